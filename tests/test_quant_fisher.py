"""Fisher-weighted quantization errors: per output row, the loss gradient² times GPTQ's output error."""
import pytest
import torch

from quant.calibrate import collect_hessians
from quant.export import export_artifact
from test_quant_observed import META, batches, mhc_model


def test_output_fisher_weights_every_linear_and_leaves_no_gradients():
    from quant.calibrate import collect_output_fisher
    from quant.export import plan_tensors, quantize_matrices
    model = mhc_model()
    plan = plan_tensors(model)
    fisher = collect_output_fisher(model, plan.linears, batches())
    assert set(fisher) == set(plan.linears) and model.training
    for name, f in fisher.items():
        assert f.shape == (plan.linears[name].weight.shape[0],) and (f >= 0).all() and f.sum() > 0, name
    assert all(p.grad is None for p in model.parameters())
    # unit weights give back the plain output error; real ones change the ranking's inputs
    hessians, _ = collect_hessians(model, plan.linears, batches())
    _, plain = quantize_matrices(plan, hessians, "gptq", 5)
    ones = {name: torch.ones_like(f) for name, f in fisher.items()}
    _, unit = quantize_matrices(plan, hessians, "gptq", 5, ones)
    _, weighted = quantize_matrices(plan, hessians, "gptq", 5, fisher)
    for name in plain:
        assert unit[name]["err5"] == pytest.approx(plain[name]["err5"], rel=1e-4)
    assert any(weighted[n]["err5"] != pytest.approx(plain[n]["err5"], rel=1e-2) for n in plain)


def test_fisher_weights_that_are_not_finite_are_named():
    from quant.calibrate import collect_output_fisher
    from quant.export import plan_tensors
    model = mhc_model()
    plan = plan_tensors(model)
    next(iter(plan.linears.values())).register_forward_hook(lambda m, i, out: out * float("inf"))  # an overflow
    with pytest.raises(ValueError, match=r"Fisher weights of \[.*\] hold NaN or Inf .*hint: error_weight='output'"):
        collect_output_fisher(model, plan.linears, batches())


def test_fisher_weights_need_a_model_that_returns_its_loss(tmp_path):
    from test_quant_export import TinyGPT  # forward(ids) returns logits only
    with pytest.raises(TypeError, match="must return the scalar mean loss"):
        export_artifact(TinyGPT(), batches(), str(tmp_path / "t.mhcg"), META, 10**7, log=lambda _: None,
                        error_weight="fisher")
    with pytest.raises(ValueError, match="error_weight='loss': expected one of"):
        export_artifact(mhc_model(), batches(), str(tmp_path / "t.mhcg"), META, 10**7, log=lambda _: None,
                        error_weight="loss")
