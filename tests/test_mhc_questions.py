"""Options that exist to measure open questions, each off by default: Newton-Schulz on q, k and v apart
(optim.muon_split_qkv), H_res's initial diagonal (model.mhc_res_diag) and fp32 mHC streams (model.mhc_stream_fp32)."""
import math
import re
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from kernels.mhc_reference import mhc_init_bias, res_diag_logit, sinkhorn_knopp
from model.gpt import GPT
from model.layers import Attention
from test_model import tiny
from test_model_features import tokens
from training.config import ConfigError, OptimConfig, load_config
from training.optim import Muon, build_optimizers, normalize_rows_, zeropower_via_newtonschulz5

# A fused [q; k; v] matrix of 8 + 4 + 4 rows, a same-shape matrix orthogonalized whole, and another shape.
SHAPES = [(16, 8), (16, 8), (8, 12)]
SPLITS = (8, 4, 4)
LR, BETA, WD, NS = 0.03, 0.8, 0.1, 4


def seeded_params() -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(4)
    return [nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def grads(steps: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [[torch.randn(s, generator=g) for s in SHAPES] for _ in range(steps)]


def muon_run(steps, split: bool, row_norm: bool = False) -> list[torch.Tensor]:
    params = seeded_params()
    opt = Muon(params, lr=LR, momentum=BETA, weight_decay=WD, ns_steps=NS, row_norm=row_norm,
               row_splits={params[0]: SPLITS} if split else None)
    for step in steps:
        for p, grad in zip(params, step):
            p.grad = grad.clone()
        opt.step()
    return [p.detach() for p in params]


def scale(rows: int, cols: int) -> float:
    return max(1.0, rows / cols) ** 0.5


@pytest.mark.parametrize("row_norm", [False, True])
def test_split_muon_orthogonalizes_each_row_block_apart_with_its_own_scale(row_norm):
    """Against the update written out: Nesterov momentum (rows normalized with MuonEq-R), then Newton-Schulz on each
    block of rows of the split matrix as a matrix of its own, and on the other matrices whole."""
    steps = grads(2)
    ref = [p.detach().clone() for p in seeded_params()]
    bufs = [torch.zeros(s) for s in SHAPES]
    for step in steps:
        for i, grad in enumerate(step):
            bufs[i] = BETA * bufs[i] + (1 - BETA) * grad
            nesterov = grad + BETA * (bufs[i] - grad)
            if row_norm:
                nesterov = normalize_rows_(nesterov.clone())
            blocks = nesterov.split(list(SPLITS)) if i == 0 else [nesterov]
            update = torch.cat([zeropower_via_newtonschulz5(b, NS) * scale(*b.shape) for b in blocks])
            ref[i] = ref[i] * (1 - LR * WD) - LR * update
    got = muon_run(steps, split=True, row_norm=row_norm)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    whole = muon_run(steps, split=False, row_norm=row_norm)
    assert (got[0] - whole[0]).abs().max() > 1e-3  # the split changes the split matrix ...
    assert torch.equal(got[1], whole[1]) and torch.equal(got[2], whole[2])  # ... and only that one


def test_muon_refuses_row_splits_that_do_not_fit():
    params = seeded_params()
    with pytest.raises(ValueError, match=re.escape("expected positive block sizes summing to its 16 rows")):
        Muon(params, row_splits={params[0]: (8, 4)})
    with pytest.raises(ValueError, match="not one of its parameters"):
        Muon(params[1:], row_splits={params[0]: SPLITS})


def test_gpt_qkv_splits_name_every_attention_qkv_with_its_q_k_v_rows():
    model = GPT(tiny(n_kv_heads=1))  # d_model 32, kv_dim 8
    splits = model.qkv_splits()
    qkvs = [m.qkv.weight for m in model.modules() if isinstance(m, Attention)]
    assert [id(p) for p in splits] == [id(p) for p in qkvs] and len(qkvs) == model.cfg.n_layers
    assert set(splits.values()) == {(32, 8, 8)}
    matrices = {id(p) for p in model.param_groups()["matrix"]}
    assert all(id(p) in matrices for p in splits)


def model_after_step(cfg: OptimConfig, splits: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(tiny(n_streams=1))
    opts = build_optimizers(model.param_groups(), cfg, model.qkv_splits() if splits else None)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()))
    for opt in opts:
        opt.step()
    return [p.detach() for p in model.parameters()]


def test_build_optimizers_splits_qkv_only_when_the_option_is_on():
    off_without, off_with = model_after_step(OptimConfig(), False), model_after_step(OptimConfig(), True)
    assert all(torch.equal(a, b) for a, b in zip(off_without, off_with))  # off: the model's splits are not used
    on = model_after_step(OptimConfig(muon_split_qkv=True), True)
    changed = [not torch.equal(a, b) for a, b in zip(on, off_without)]
    assert 0 < sum(changed) < len(changed)  # the qkv weights moved differently, the rest did not
    with pytest.raises(ValueError, match=re.escape("optim.muon_split_qkv=true needs the model's q, k, v row blocks")):
        build_optimizers(GPT(tiny()).param_groups(), OptimConfig(muon_split_qkv=True))


def test_muon_split_qkv_loads_and_bad_values_name_the_field():
    assert OptimConfig().muon_split_qkv is False
    assert load_config(None, ["optim.muon_split_qkv=true"]).optim.muon_split_qkv is True
    with pytest.raises(ConfigError, match=re.escape("optim.muon_split_qkv: expected true/false")):
        load_config(None, ["optim.muon_split_qkv=maybe"])


# -- H_res's initial diagonal


def init_h_res(model: GPT) -> list[torch.Tensor]:
    n = model.cfg.n_streams
    return [sinkhorn_knopp(p.bias.detach()[2 * n:].view(n, n), model.cfg.sinkhorn_iters) for p in model.mhc]


@pytest.mark.parametrize("n,diag", [(2, 0.6), (2, 0.97), (4, 0.3), (4, 0.9)])
def test_mhc_res_diag_is_the_diagonal_of_h_res_after_sinkhorn(n, diag):
    model = GPT(tiny(n_streams=n, mhc_res_diag=diag))
    off = (1 - diag) / (n - 1)
    want = torch.full((n, n), off) + torch.eye(n) * (diag - off)
    for h_res in init_h_res(model):
        torch.testing.assert_close(h_res, want, rtol=0, atol=1e-4)
    assert res_diag_logit(n, diag) > 0


@pytest.mark.parametrize("n", [2, 4])
def test_default_mhc_res_diag_keeps_the_diag_logit_2_init(n):
    model = GPT(tiny(n_streams=n))
    assert all(torch.equal(p.bias.detach(), mhc_init_bias(n)) for p in model.mhc)
    diag = 1 / (1 + (n - 1) * math.exp(-2.0))  # 0.88 at n=2, 0.71 at n=4
    for h_res in init_h_res(model):
        torch.testing.assert_close(h_res.diagonal(), torch.full((n,), diag), rtol=0, atol=1e-6)
    torch.testing.assert_close(mhc_init_bias(n, res_diag_logit(n, diag)), mhc_init_bias(n))


@pytest.mark.parametrize("kw,message", [
    (dict(n_streams=4, mhc_res_diag=0.25), "model.mhc_res_diag=0.25 must be in (1/n_streams, 1) = (0.25, 1)"),
    (dict(n_streams=2, mhc_res_diag=1.0), "model.mhc_res_diag=1.0 must be in (1/n_streams, 1)"),
    (dict(n_streams=2, mhc_res_diag=-0.5), "model.mhc_res_diag=-0.5 must be in (1/n_streams, 1)"),
    (dict(n_streams=2, mhc_res_diag=float("nan")), "model.mhc_res_diag=nan must be in (1/n_streams, 1)"),
    (dict(n_streams=1, mhc_res_diag=0.9), "model.mhc_res_diag=0.9 sets the plain init's H_res"),
    (dict(n_streams=2, mhc_init="lanes", mhc_res_diag=0.9), "the lanes init sets its own H_res"),
    (dict(n_streams=1, mhc_stream_fp32=True), "model.mhc_stream_fp32=true needs n_streams >= 2"),
])
def test_bad_mhc_measurement_options_name_the_field(kw, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        tiny(**kw).validate()


# -- fp32 streams


def stream_dtypes(model: GPT) -> list[torch.dtype]:
    """Wrap the model's mHC calls to record the dtype of the streams each one receives."""
    seen, ops = [], model.ops

    def record(fn):
        def call(x, *args, **kw):
            seen.append(x.dtype)
            return fn(x, *args, **kw)
        return call
    model.ops = SimpleNamespace(pre=record(ops.pre), post=record(ops.post), post_pre=record(ops.post_pre))
    return seen


@pytest.mark.parametrize("fp32,want", [(False, torch.bfloat16), (True, torch.float32)])
def test_mhc_stream_fp32_keeps_the_streams_fp32_under_autocast(fp32, want):
    torch.manual_seed(0)
    model = GPT(tiny(n_streams=2, mhc_stream_fp32=fp32))
    seen = stream_dtypes(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(tokens(), tokens(seed=3))
    assert seen and set(seen) == {want}
    assert torch.isfinite(loss)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_mhc_stream_fp32_changes_nothing_without_autocast():
    logits = []
    for fp32 in (False, True):
        torch.manual_seed(0)
        logits.append(GPT(tiny(n_streams=2, mhc_stream_fp32=fp32))(tokens()))
    assert torch.equal(*logits)
