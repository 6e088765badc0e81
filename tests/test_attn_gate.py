"""The attention output gate (model.attn_gate, model.attn_gate_width): each head's output times
sigmoid(W_h · u[:width]), W zero at init; trained by AdamW's scalar group; shipped in the artifact."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from model.config import ModelConfig
from model.gpt import GPT
from model.layers import Attention
from quant.export import export_artifact, plan_tensors
from test_model import randomize_, tiny
from training.score import load_model


def tokens(seed: int = 2) -> torch.Tensor:
    return torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(seed))


def attentions(model: GPT) -> list[Attention]:
    return [s.body for s in model.sublayers if isinstance(s.body, Attention)]


@pytest.mark.parametrize("n_streams", [1, 4])
@pytest.mark.parametrize("width", [0, 12])
def test_a_zero_gate_is_the_ungated_model_with_half_its_output_projection(n_streams, width):
    """sigmoid(0) = 0.5: at init every head is halved, which is the ungated model with proj / 2 (XSA on, as the gate
    comes after it). The default proj starts at zero, so the gated model starts as the same function."""
    torch.manual_seed(0)
    off = randomize_(GPT(tiny(n_streams=n_streams, xsa_layers=1))).eval()
    on = GPT(tiny(n_streams=n_streams, xsa_layers=1, attn_gate=True, attn_gate_width=width)).eval()
    gates = [a.head_gate for a in attentions(on)]
    assert all(g is not None and not g.any() for g in gates)
    assert gates[0].shape == (on.cfg.n_heads, width or on.cfg.d_model)
    on.load_state_dict({**off.state_dict(), **{k: v for k, v in on.state_dict().items() if k.endswith("head_gate")}})
    with torch.no_grad():
        for a in attentions(off):
            a.proj.weight.mul_(0.5)
    idx = tokens()
    torch.testing.assert_close(on(idx), off(idx), rtol=1e-6, atol=1e-6)


def test_the_gate_is_sigmoid_of_the_first_width_channels_of_the_normed_input_per_head():
    attn = Attention(tiny(attn_gate=True, attn_gate_width=12))
    with torch.no_grad():
        attn.head_gate.normal_(generator=torch.Generator().manual_seed(3))
    u = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(4))
    g = attn.head_gates(u)  # [B, H, T, 1]
    want = torch.sigmoid(torch.einsum("btc,hc->bht", u[..., :12], attn.head_gate.detach()))
    torch.testing.assert_close(g.squeeze(-1), want)
    later = u.clone()
    later[..., 12:] += 5.0  # channels past the width do not reach the gate
    assert torch.equal(attn.head_gates(later), g)


@pytest.mark.parametrize("n_streams", [1, 4])
def test_the_gate_gets_gradients_from_zero_and_is_in_the_scalar_group(n_streams):
    torch.manual_seed(0)
    model = GPT(tiny(n_streams=n_streams, attn_gate=True))
    with torch.no_grad():  # a zero proj would hide the gate from the loss
        for a in attentions(model):
            a.proj.weight.normal_(std=0.1)
    idx = tokens()
    model(idx[:, :-1], idx[:, 1:]).backward()
    gates = [a.head_gate for a in attentions(model)]
    assert all(g.grad is not None and g.grad.abs().min(dim=1).values.gt(0).all() for g in gates)  # every head
    scalar_ids = {id(p) for p in model.param_groups()["scalar"]}
    assert all(id(g) in scalar_ids for g in gates)


def test_the_gated_model_traces_as_one_graph():
    torch.manual_seed(0)
    model = randomize_(GPT(tiny(n_streams=1, attn_gate=True, attn_gate_width=12, xsa_layers=1))).eval()
    idx = tokens()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(idx), model(idx))


def test_the_scored_artifact_reproduces_the_gate(tmp_path):
    """The gate ships as a float tensor (not quantized: a sigmoid's input, and n_heads x width values a layer), the
    artifact's config rebuilds the gated model, and the gate changes its logits beyond the quantization error."""
    torch.manual_seed(0)
    cfg = tiny(n_streams=1, attn_gate=True)
    model = randomize_(GPT(cfg)).eval()
    plan = plan_tensors(model)
    assert {f"sublayers.{2 * i}.body.head_gate" for i in range(cfg.n_layers)} <= set(plan.others)
    meta = {"model_config": dataclasses.asdict(cfg), "tokenizer_sha256": "0" * 64}
    path = tmp_path / "gated.mhcg"
    export_artifact(model, [tokens(5)], str(path), meta, 10**7, log=lambda _: None)
    loaded, _ = load_model(path, torch.device("cpu"))
    assert loaded.cfg.attn_gate and loaded.cfg.attn_gate_width == 0
    for a, b in zip(attentions(loaded), attentions(model)):
        torch.testing.assert_close(a.head_gate, b.head_gate.detach().half().float(), rtol=0, atol=0)
    idx = tokens()
    with torch.no_grad():
        quant_error = (loaded(idx) - model(idx)).abs().mean()
        for a in attentions(loaded):
            a.head_gate.zero_()
        gate_effect = (loaded(idx) - model(idx)).abs().mean()
    assert gate_effect > 5 * quant_error, (gate_effect, quant_error)  # measured: ~10x


@pytest.mark.parametrize("kw,message", [
    (dict(attn_gate=True, attn_gate_width=33), "model.attn_gate_width=33 must be in [0, d_model=32]"),
    (dict(attn_gate=True, attn_gate_width=-1), "model.attn_gate_width=-1 must be in [0, d_model=32]"),
    (dict(attn_gate_width=12), "model.attn_gate_width=12 applies to model.attn_gate=true only"),
])
def test_bad_gate_options_are_refused_with_the_field_name(kw, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        ModelConfig(**{**dataclasses.asdict(tiny()), **kw}).validate()


def test_the_gate_is_off_by_default():
    assert not any(a.head_gate is not None for a in attentions(GPT(tiny())))
    assert "head_gate" not in " ".join(GPT(tiny()).state_dict())
    assert F.sigmoid(torch.zeros(())) == 0.5  # the documented start of every gate
