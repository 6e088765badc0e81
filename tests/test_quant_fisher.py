"""Fisher-weighted quantization errors: per output row, the loss gradient² times GPTQ's output error."""
import pytest
import torch

from quant.calibrate import calibrate, collect_fisher
from quant.export import export_artifact
from test_quant_observed import META, batches, mhc_model


def test_output_fisher_weights_every_linear_and_leaves_no_gradients():
    from quant.export import plan_tensors
    from quant.rd import ErrorModel, evaluate_candidates
    from quant.steps import step_candidates
    model = mhc_model()
    plan = plan_tensors(model)
    fisher = collect_fisher(model, plan.linears, batches()).rows
    assert set(fisher) == set(plan.linears) and model.training
    for name, f in fisher.items():
        assert f.shape == (plan.linears[name].weight.shape[0],) and (f >= 0).all() and f.sum() > 0, name
    assert all(p.grad is None for p in model.parameters())
    # unit weights give back the plain output error; real ones change the errors the allocation compares
    hessians = calibrate(model, plan.linears, batches()).hessians
    changed = []
    for name, lin in plan.linears.items():
        w = lin.weight.detach()
        cands = step_candidates(w, steps=(0.3,))[:1]
        plain, unit, weighted = (evaluate_candidates(w, ErrorModel(hessians[name], rows), "gptq", cands)[0].error
                                 for rows in (None, torch.ones_like(fisher[name]), fisher[name]))
        assert unit == pytest.approx(plain, rel=1e-5)
        changed.append(weighted != pytest.approx(plain, rel=1e-2))
    assert any(changed)


def test_fisher_weights_that_are_not_finite_are_named():
    from quant.export import plan_tensors
    model = mhc_model()
    plan = plan_tensors(model)
    next(iter(plan.linears.values())).register_forward_hook(lambda m, i, out: out * float("inf"))  # an overflow
    with pytest.raises(ValueError, match=r"Fisher weights of \[.*\] hold NaN or Inf .*hint: error_weight='output'"):
        collect_fisher(model, plan.linears, batches())


def test_fisher_weights_need_a_model_that_returns_its_loss(tmp_path):
    from test_quant_export import TinyGPT

    class LogitsOnly(TinyGPT):
        def forward(self, ids):
            return super().forward(ids)
    with pytest.raises(TypeError, match="must return the scalar mean loss"):
        export_artifact(LogitsOnly(), batches(), str(tmp_path / "t.mhcg"), META, 10**7, log=lambda _: None,
                        error_weight="fisher")
    with pytest.raises(ValueError, match="error_weight='loss': expected one of"):
        export_artifact(mhc_model(), batches(), str(tmp_path / "t.mhcg"), META, 10**7, log=lambda _: None,
                        error_weight="loss")
