"""mHC phi quantized like a Linear: the model reports phi's input, GPTQ runs on that input's Hessian,
and the artifact ships phi at the chosen width."""
import pytest
import torch

from kernels.mhc_reference import mhc_projection_input
from model.config import ModelConfig
from model.gpt import GPT
from quant.calibrate import calibrate
from quant.container import load_artifact
from quant.export import export_artifact
from quant.pack import QuantizedTensor

META = {"model_config": {"d": 32}, "tokenizer_sha256": "0" * 64}


def mhc_model(granularity: str = "sublayer", blocks: int = 0) -> GPT:
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=64, n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, n_streams=4,
                            mhc_granularity=granularity, mhc_blocks=blocks))
    with torch.no_grad():  # a trained-looking model: sublayers that write, coefficients that vary per token
        for p in model.parameters():
            if p.ndim == 2 and p.abs().max() == 0:
                p.normal_(0, 0.05)
        for unit in model.mhc:
            unit.alpha.fill_(0.5)
        model.embed.weight.normal_(0, 1)  # streams far above the rms epsilon
    return model


def batches(n: int = 3):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 64, (2, 16), generator=g) for _ in range(n)]


def phi_names(model) -> list[str]:
    return [name for name in model.state_dict() if name.endswith(".phi")]


@pytest.mark.parametrize("granularity,blocks,units", [("sublayer", 0, 4), ("block", 0, 2), ("sublayer", 1, 2)])
def test_model_reports_each_phi_input_and_the_head_input_once_per_forward(granularity, blocks, units):
    model = mhc_model(granularity, blocks)
    seen = []
    model.quant_observer = lambda name, x: seen.append((name, tuple(x.shape)))
    model(batches(1)[0])
    model.quant_observer = None
    assert [name for name, _ in seen] == phi_names(model) + ["embed.weight"] and len(seen) == units + 1
    assert all(shape == (2, 16, 4 * 32) for _, shape in seen[:-1])
    assert seen[-1][1] == (2, 16, 32)  # the tied head's input: the final norm's output
    assert all(model.state_dict()[name].shape == (24, 128) for name in phi_names(model))  # [out, in] like a Linear


def test_phi_hessian_is_that_of_the_unit_rms_projection_input():
    model = mhc_model()
    observed = {name: model.state_dict()[name] for name in phi_names(model)}
    result = calibrate(model, {}, batches(), observed=observed)
    hessians, tokens = result.hessians, result.tokens
    assert model.quant_observer is None and tokens == 3 * 2 * 16
    for name in observed:
        h = hessians[name]
        assert torch.allclose(h, h.T) and torch.linalg.eigvalsh(h.double()).min() > -1e-6
        # x / rms(x) has mean square 1 per token, so tr(H)/in is 1 whatever the streams hold
        assert torch.trace(h).item() / h.shape[0] == pytest.approx(1.0, rel=1e-4)
    # unit 0 sees n copies of the input embedding
    ids = torch.cat(batches())
    emb = model.embed_tokens(ids).detach()
    x = mhc_projection_input(emb.unsqueeze(-2).expand(*emb.shape[:-1], 4, 32)).reshape(-1, 128)
    assert torch.allclose(hessians["mhc.0.phi"], x.T @ x / x.shape[0], atol=1e-5)


@pytest.mark.parametrize("bits", [4, 5, 6, 8])
def test_artifact_ships_phi_at_the_chosen_width(tmp_path, bits):
    model = mhc_model()
    lines = []
    report = export_artifact(model, batches(), str(tmp_path / "a.mhcg"), META, 10**7, log=lines.append,
                             observed_patterns=("mhc.*.phi",), observed_bits=bits, scheme="rank")
    assert [row["name"] for row in report["observed"]] == phi_names(model)
    assert {row["bits"] for row in report["observed"]} == {bits}
    assert sum(f"fixed int{bits} mhc." in line for line in lines) == 4
    _, stored = load_artifact(str(tmp_path / "a.mhcg"), stored=True)
    for name in phi_names(model):
        assert isinstance(stored[name], QuantizedTensor) and stored[name].bits == bits
        assert stored[name].shape == (24, 128) and stored[name].scales.shape == (24,)


def test_gptq_beats_round_to_nearest_on_phi(tmp_path):
    model = mhc_model()
    errors = {}
    for method in ("gptq", "rtn"):
        report = export_artifact(model, batches(), str(tmp_path / f"{method}.mhcg"), META, 10**7,
                                 log=lambda _: None, method=method, observed_patterns=("mhc.*.phi",), observed_bits=4,
                                 scheme="rank")
        errors[method] = sum(row["err"] for row in report["observed"])
    assert errors["gptq"] < 0.9 * errors["rtn"], errors


def test_observed_matrices_need_an_observer_and_a_known_width(tmp_path):
    from test_quant_export import TinyGPT  # no quant_observer attribute
    tiny = TinyGPT()
    with pytest.raises(TypeError, match="no quant_observer attribute"):
        export_artifact(tiny, batches(), str(tmp_path / "t.mhcg"), META, 10**7, log=lambda _: None,
                        observed_patterns=("mix",))
    hooked = [name for name, m in tiny.named_modules() if m._forward_hooks]
    assert hooked == [], f"the refusal left Hessian hooks on {hooked}"
    with pytest.raises(ValueError, match="observed_bits=7"):
        export_artifact(mhc_model(), batches(), str(tmp_path / "m.mhcg"), META, 10**7, log=lambda _: None,
                        observed_patterns=("mhc.*.phi",), observed_bits=7)
    assert not (tmp_path / "t.mhcg").exists() and not (tmp_path / "m.mhcg").exists()

