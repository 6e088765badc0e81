"""Record-architecture options (model/config.py): each one off = the plain model, on = its behaviour,
and all of them together with mHC (n_streams=4) and the plain path (n_streams=1)."""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from model.features import BOS_ID, SMEAR_GATE_INIT, SmearGate, bigram_bucket
from model.gpt import GPT
from model.layers import MLP, Attention, RotaryTables, apply_partial_rotary, rotary_cos_sin
from test_model import copy_plain_weights, randomize_, tiny  # shared tiny config and non-trivial weights

ALL_ON = dict(xsa_layers=2, rope_dims=4, layer_norm_scale=True, unet_skips=True, smear_gate=True,
              bigram_buckets=96, bigram_dim=16, value_embed_layers=1, value_embed_dim=8, attn_gate=True)


def tokens(shape=(2, 16), seed=2, low=0) -> torch.Tensor:
    return torch.randint(low, 64, shape, generator=torch.Generator().manual_seed(seed))


def fingerprint(t: torch.Tensor) -> float:
    """Position-weighted sum: changes with any element's value or place."""
    flat = t.detach().double().flatten()
    return float((flat * torch.cos(torch.arange(flat.numel(), dtype=torch.float64))).sum())


# Measured with the model before these options existed (commit 4ee2acb), seed 0, tiny(): number of
# parameters, fingerprint of the initial parameters, fingerprint of randomize_(model)(tokens()).
# mHC phi has since been stored at unit scale (used times phi_scale): the fingerprint is taken over the
# projection the model computes with, which is unchanged.
# n=4 re-measured once phi drew from a generator of its own, so the other weights (and randomize_ after
# them) draw what n=1's do; before, (29, -6.684738389490956, 23.970796178406445).
PRE_FEATURE_MODEL = {1: (16, -5.3265196567213335, 23.2206164659311),
                     4: (29, 14.714022953292275, -36.766300130113606)}


@pytest.mark.parametrize("layout", [dict(n_streams=4), dict(n_streams=2, mhc_blocks=2),
                                    dict(n_streams=4, mhc_granularity="block")])
def test_a_seed_gives_every_mhc_layout_the_plain_networks_weights(layout):
    """Phi drew from the global RNG between the sublayers and the embedding, so the same seed gave
    the plain network and each mHC layout different weights, and a same-seed comparison of layouts was not paired."""
    torch.manual_seed(0)
    plain = dict(GPT(tiny(n_streams=1, n_layers=3, **{k: v for k, v in ALL_ON.items() if k != "xsa_layers"}))
                 .named_parameters())
    torch.manual_seed(0)
    mhc = GPT(tiny(n_layers=3, **layout, **{k: v for k, v in ALL_ON.items() if k != "xsa_layers"}))
    shared = [name for name, _ in mhc.named_parameters() if name in plain]
    assert len(shared) > 20
    for name, tensor in mhc.named_parameters():
        if name in plain:
            assert torch.equal(tensor, plain[name]), name
    # phi is a draw of its own (drawn under a fork of the global RNG, its numbers came again at once,
    # and the first mHC unit's phi was a scaled copy of the embedding's first rows)
    torch.manual_seed(0)
    bare = GPT(tiny(n_layers=3, **layout))  # no options: the embedding draws right after the sublayers
    for model in (mhc, bare):
        phi = model.mhc[0].phi.detach().t().flatten()
        for name, tensor in model.named_parameters():
            other = tensor.detach().flatten()[:phi.numel()]
            if not name.endswith(".phi") and other.numel() == phi.numel() and other.std() > 0:
                assert abs(torch.corrcoef(torch.stack([phi, other]))[0, 1]) < 0.1, name
    torch.manual_seed(1)  # another seed, another phi
    assert not torch.equal(GPT(tiny(n_layers=3, **layout)).mhc[0].phi, mhc.mhc[0].phi)


@pytest.mark.parametrize("n_streams", [1, 4])
def test_all_options_off_reproduce_the_pre_feature_model(n_streams):
    torch.manual_seed(0)
    model = GPT(tiny(n_streams=n_streams))
    n_params, init_fp, logits_fp = PRE_FEATURE_MODEL[n_streams]
    assert len(list(model.parameters())) == n_params
    # rel 1e-5 leaves room for another BLAS's orthogonal_ (QR); a changed draw order moves these by O(1).
    used = [(p * model.mhc[0].phi_scale).t() if name.endswith(".phi") else p for name, p in model.named_parameters()]
    assert fingerprint(torch.cat([p.flatten() for p in used])) == pytest.approx(init_fp, rel=1e-5)
    assert fingerprint(randomize_(model).eval()(tokens())) == pytest.approx(logits_fp, rel=1e-5)


@pytest.mark.parametrize("option,value", [(k, v) for k, v in ALL_ON.items() if k not in ("bigram_dim", "value_embed_dim")])
@pytest.mark.parametrize("n_streams", [1, 4])
def test_each_option_changes_the_model(option, value, n_streams):
    cfg_kw = dict(n_streams=n_streams, n_layers=4, **{option: value})
    torch.manual_seed(0)
    off = randomize_(GPT(tiny(n_streams=n_streams, n_layers=4))).eval()
    on = randomize_(GPT(tiny(**cfg_kw))).eval()
    shared = dict(off.named_parameters())
    with torch.no_grad():
        for name, p in on.named_parameters():
            if name in shared:
                p.copy_(shared[name])
    idx = tokens()
    assert not torch.allclose(on(idx), off(idx), atol=1e-4), f"{option}={value} has no effect"


# --- XSA ----------------------------------------------------------------------------------------------

def test_xsa_removes_each_heads_component_along_its_own_value():
    cfg = tiny(n_heads=4, n_kv_heads=2, xsa_layers=1)
    C, H, D, kv = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.kv_dim
    torch.manual_seed(0)
    xsa, plain = Attention(cfg, layer=1), Attention(tiny(n_heads=4, n_kv_heads=2), layer=1)
    assert xsa.xsa and not plain.xsa
    with torch.no_grad():
        xsa.proj.weight.copy_(torch.eye(C))  # identity output projection: we see the heads' outputs
    plain.load_state_dict(xsa.state_dict())
    u = torch.randn(2, 9, C)
    y, y0 = xsa(u).view(2, 9, H, D), plain(u).view(2, 9, H, D)
    v = xsa.qkv(u)[..., C + kv:].view(2, 9, cfg.n_kv_heads, D)
    v_hat = F.normalize(v, dim=-1).repeat_interleave(H // cfg.n_kv_heads, dim=2)  # query head h reads KV head h//2
    assert (y * v_hat).sum(-1).abs().max() < 1e-5
    along = (y0 * v_hat).sum(-1, keepdim=True)
    assert along.abs().max() > 1e-2, "plain attention output has an own-value component to remove"
    assert torch.allclose(y, y0 - along * v_hat, atol=1e-5)


def test_xsa_is_on_the_last_k_layers():
    for k, expected in ((0, [False] * 3), (2, [False, True, True]), (3, [True] * 3)):
        model = GPT(tiny(n_layers=3, xsa_layers=k))
        assert [s.body.xsa for s in model.sublayers[::2]] == expected


# --- partial RoPE -------------------------------------------------------------------------------------

def test_partial_rope_leaves_other_dims_and_keeps_relative_positions():
    D, r, T = 16, 6, 12
    cos, sin = rotary_cos_sin(T, r, 10000.0, torch.device("cpu"))
    torch.manual_seed(0)
    x = torch.randn(1, 2, T, D)
    out = apply_partial_rotary(x, cos, sin, r)
    assert torch.equal(out[..., r:], x[..., r:])
    assert not torch.allclose(out[..., 1:, :r], x[..., 1:, :r])
    # The same q and k at every position: the rotated dims' scores depend only on the offset m - n.
    q, k = torch.randn(D).expand(1, 1, T, D), torch.randn(D).expand(1, 1, T, D)
    rq, rk = apply_partial_rotary(q, cos, sin, r)[0, 0, :, :r], apply_partial_rotary(k, cos, sin, r)[0, 0, :, :r]
    scores = rq @ rk.T
    assert torch.allclose(scores[1:, 1:], scores[:-1, :-1], atol=1e-5)
    assert scores[0].std() > 1e-2, "scores must vary with the offset"


def test_rotary_tables_are_the_per_call_tables_shared_and_not_shipped():
    tables = RotaryTables(8, 10000.0, positions=16)
    for T in (5, 16, 40):  # inside the table, its full length, and past it (computed per call)
        want = rotary_cos_sin(T, 8, 10000.0, torch.device("cpu"))
        assert all(torch.equal(a, b) for a, b in zip(tables(T), want))
    model = GPT(tiny(n_layers=3))
    attn = [s.body for s in model.sublayers[::2]]
    assert all(a.rope is attn[0].rope for a in attn)  # one copy for the model
    assert not any("rope" in k for k in model.state_dict()), "the tables must stay out of checkpoints and artifacts"
    assert len([n for n, _ in model.named_buffers() if "rope" in n]) == 2  # cos and sin, once


def test_rope_dims_zero_rotates_the_whole_head():
    torch.manual_seed(0)
    full = Attention(tiny(rope_dims=0))
    nn.init.normal_(full.proj.weight, std=0.1)
    same, part = Attention(tiny(rope_dims=8)), Attention(tiny(rope_dims=4))
    same.load_state_dict(full.state_dict())
    part.load_state_dict(full.state_dict())
    u = torch.randn(2, 9, 32)
    assert torch.equal(same(u), full(u))
    assert not torch.allclose(part(u), full(u))


@pytest.mark.parametrize("kw,field", [(dict(rope_dims=3), "rope_dims"), (dict(rope_dims=10), "rope_dims"),
                                      (dict(rope_dims=-2), "rope_dims"), (dict(xsa_layers=3), "xsa_layers"),
                                      (dict(value_embed_layers=-1), "value_embed_layers"),
                                      (dict(bigram_buckets=-1), "bigram_buckets"),
                                      (dict(bigram_buckets=8, vocab_size=50000), "vocab_size"),
                                      (dict(unet_skips=True, n_layers=1), "unet_skips")])
def test_bad_options_are_refused_with_the_field_name(kw, field):
    with pytest.raises(ValueError, match=field):
        GPT(tiny(**kw))


# --- per-layer norm scale -----------------------------------------------------------------------------

def test_layer_norm_scale_is_one_over_sqrt_block_index_plus_one():
    assert all(s.norm_scale == 1.0 for s in GPT(tiny(n_layers=3)).sublayers)
    model = randomize_(GPT(tiny(n_layers=3, layer_norm_scale=True)))
    assert [s.norm_scale for s in model.sublayers] == [1.0, 1.0] + [2 ** -0.5] * 2 + [3 ** -0.5] * 2
    sub, u = model.sublayers[5], torch.randn(2, 5, 32)
    assert torch.allclose(sub(u), sub.body(sub.norm(u) / math.sqrt(3)), atol=1e-6)


# --- U-Net skips --------------------------------------------------------------------------------------

def attention_inputs(model: GPT, idx: torch.Tensor) -> list[torch.Tensor]:
    """The input u (x for n_streams=1) of every block's attention sublayer, captured by pre-hooks."""
    seen = []
    hooks = [s.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().clone()))
             for s in model.sublayers[::2]]
    model(idx)
    for h in hooks:
        h.remove()
    return seen


@pytest.mark.parametrize("n_streams,blocks,granularity", [(1, 0, "sublayer"), (4, 0, "sublayer"), (4, 3, "sublayer"),
                                                          (4, 1, "sublayer"), (4, 3, "block")])
def test_unet_decoder_block_receives_its_mirror_encoder_block(n_streams, blocks, granularity):
    """5 blocks: encoder 0-1, decoder 2-4; block 2 <- encoder 1, block 3 <- encoder 0, block 4 none.
    The skip is the state after encoder block i, which is block i+1's input: the residual x on the plain
    path, the pre-mix u of the next unit (or the readout after the last mHC block) with mHC. (mHC used to
    carry block i's own input u instead, so it did not start as the plain network with skips.) With mhc_blocks=3 the encoder and block 2 have mHC and block 3 is plain; with mhc_blocks=1 the
    split is inside the encoder: block 0's state is the readout that plain block 1 reads."""
    torch.manual_seed(0)
    model = randomize_(GPT(tiny(n_layers=5, n_streams=n_streams, unet_skips=True, mhc_blocks=blocks,
                                mhc_granularity=granularity))).eval()
    assert model.unet.weight.shape == (2, 32) and [model.unet.skip_index(b, 5) for b in range(5)] == [None, None, 0, 1, None]
    assert torch.equal(GPT(tiny(n_layers=5, unet_skips=True)).unet.weight, torch.ones(2, 32))
    idx = tokens()
    for j, enc in ((0, 1), (1, 0)):
        shift = 1  # the state after encoder block enc: the input of block enc + 1, on either path
        with torch.no_grad():
            model.unet.weight.zero_()
            no_skip = attention_inputs(model, idx)
            model.unet.weight[j] = torch.randn(32)
            with_skip = attention_inputs(model, idx)
            expected = no_skip[2 + j] + model.unet.weight[j] * no_skip[enc + shift]
        assert all(torch.equal(a, b) for a, b in zip(no_skip[:2 + j], with_skip[:2 + j]))
        assert torch.allclose(with_skip[2 + j], expected, atol=1e-6)


@pytest.mark.parametrize("n_streams", [1, 4])
def test_unet_skip_weights_get_gradients(n_streams):
    torch.manual_seed(0)
    model = randomize_(GPT(tiny(n_layers=4, n_streams=n_streams, unet_skips=True)))
    idx = tokens()
    model(idx, tokens(seed=3)).backward()
    grad = model.unet.weight.grad
    assert grad is not None and (grad.abs().sum(-1) > 0).all()


# --- SmearGate and BigramHash -------------------------------------------------------------------------

@pytest.mark.parametrize("kw", [dict(smear_gate=True), dict(bigram_buckets=96, bigram_dim=16),
                                dict(smear_gate=True, bigram_buckets=96, bigram_dim=16)])
def test_input_embedding_never_crosses_a_bos(kw):
    torch.manual_seed(0)
    model = randomize_(GPT(tiny(**kw)))
    idx = tokens((2, 20), low=2)
    idx[:, 8] = BOS_ID
    idx[1, 15] = BOS_ID
    base = model.embed_tokens(idx)
    changed = idx.clone()
    changed[:, :8] = tokens((2, 8), seed=5, low=2)
    changed[1, 8 + 1:15] = tokens((1, 6), seed=6, low=2)
    out = model.embed_tokens(changed)
    assert torch.equal(out[:, 8:9], base[:, 8:9]) and torch.equal(out[0, 8:], base[0, 8:])
    assert torch.equal(out[1, 15:], base[1, 15:])
    # Inside a document the previous token does reach position t (so the checks above can fail).
    inside = idx.clone()
    inside[0, 3] = 2 if idx[0, 3] != 2 else 3
    assert not torch.allclose(model.embed_tokens(inside)[0, 4], base[0, 4])


def test_smear_gate_blends_with_the_previous_token_except_at_start_and_bos():
    smear = SmearGate(8)
    assert torch.equal(smear.gate, torch.full((8,), SMEAR_GATE_INIT))
    with torch.no_grad():
        smear.gate.copy_(torch.linspace(-2, 2, 8))
    x, idx = torch.randn(1, 6, 8), torch.tensor([[5, 7, BOS_ID, 9, 4, BOS_ID]])
    s = torch.sigmoid(smear.gate)
    out = smear(x, idx)
    for t in range(6):
        expected = x[0, t] if t in (0, 2, 5) else (1 - s) * x[0, t] + s * x[0, t - 1]
        assert torch.allclose(out[0, t], expected, atol=1e-6), t


def test_bigram_buckets_are_uniform_and_use_a_sentinel_for_missing_predecessors():
    V, nb = 1024, 3072
    prev, cur = torch.arange(V + 1).repeat_interleave(V), torch.arange(V).repeat(V + 1)  # V = the sentinel
    pairs = torch.stack([prev, cur], dim=1)[cur != BOS_ID]  # (anything, BOS) pairs collapse by design
    buckets = bigram_bucket(pairs, nb, V)[:, 1]
    counts = torch.bincount(buckets, minlength=nb).float()
    assert buckets.dtype == torch.int64 and 0 <= buckets.min() and buckets.max() < nb
    assert counts.min() > 0.97 * counts.mean() and counts.max() < 1.03 * counts.mean()  # measured 336..344 of 341.3
    seq = torch.tensor([[7, 9, BOS_ID, 9], [8, 9, BOS_ID, 9]])
    b = bigram_bucket(seq, nb, V)
    sentinel = bigram_bucket(torch.tensor([[V, 7, V, BOS_ID]]), nb, V)  # buckets of (V, 7) and (V, BOS) pairs
    assert b[0, 0] == sentinel[0, 1] and b[0, 2] == b[1, 2] == sentinel[0, 3]
    assert b[0, 1] != b[1, 1] and b[0, 3] == b[1, 3]  # (7, 9) vs (8, 9); (BOS, 9) in both rows


def test_bigram_starts_at_zero_and_is_a_quantizer_table():
    model = GPT(tiny(bigram_buckets=96, bigram_dim=16))
    assert isinstance(model.bigram.table, nn.Embedding) and model.bigram.table.weight.shape == (96, 16)
    assert torch.equal(model.bigram(tokens()), torch.zeros(2, 16, 32))
    w = model.bigram.proj.weight  # orthogonal, so the zero table still gets a gradient
    assert torch.allclose(w.T @ w, torch.eye(16), atol=1e-5)


# --- value embeddings ---------------------------------------------------------------------------------

@pytest.mark.parametrize("n_streams", [1, 4])
def test_value_embeddings_reach_v_only_in_the_last_k_layers(n_streams):
    torch.manual_seed(0)
    model = randomize_(GPT(tiny(n_layers=4, n_streams=n_streams, value_embed_layers=2, value_embed_dim=8))).eval()
    attns = [s.body for s in model.sublayers[::2]]
    assert [a.value_proj is not None for a in attns] == [False, False, True, True]
    fresh = GPT(tiny(value_embed_layers=2, value_embed_dim=8))
    assert all(torch.equal(s.body.value_proj.weight, torch.zeros(16, 8)) for s in fresh.sublayers[::2])
    calls = []
    for i, a in enumerate(attns[2:], start=2):
        a.value_proj.register_forward_hook(lambda m, inp, out, i=i: calls.append(i))
    outputs = []
    for a in attns:
        a.register_forward_hook(lambda m, inp, out: outputs.append(out.detach().clone()))
    idx = tokens()
    model(idx)
    with torch.no_grad():
        model.value_embed.weight.add_(torch.randn(64, 8))
    model(idx)
    assert calls == [2, 3, 2, 3]
    before, after = outputs[:4], outputs[4:]
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
    assert not torch.allclose(before[2], after[2]) and not torch.allclose(before[3], after[3])


# --- everything on ------------------------------------------------------------------------------------

@pytest.mark.parametrize("n_streams", [1, 4])
def test_all_options_causal_including_across_document_boundary(n_streams):
    torch.manual_seed(0)
    model = randomize_(GPT(tiny(n_streams=n_streams, **ALL_ON))).eval()
    idx = tokens((1, 24), low=4)
    idx[0, 10] = BOS_ID
    base = model(idx)
    for t in (0, 5, 10, 15):
        changed = idx.clone()
        changed[0, t + 1:] = tokens((1, 24 - t - 1), seed=t, low=4)
        out = model(changed)
        assert torch.equal(out[0, : t + 1], base[0, : t + 1]), f"logits at <= {t} changed"
        assert not torch.allclose(out[0, t + 1:], base[0, t + 1:])


@pytest.mark.parametrize("n_streams", [1, 4])
def test_all_options_param_groups_cover_every_parameter_once(n_streams):
    model = GPT(tiny(n_streams=n_streams, **ALL_ON))
    groups = model.param_groups()
    seen = [id(p) for ps in groups.values() for p in ps]
    assert len(seen) == len(set(seen)) == len(list(model.parameters()))
    linears = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    assert {id(p) for p in groups["matrix"]} == linears and all(p.ndim == 2 for p in groups["matrix"])
    tables = {id(model.embed.weight), id(model.bigram.table.weight), id(model.value_embed.weight)}
    assert {id(p) for p in groups["embed"]} == tables
    assert len(groups["matrix"]) == 4 * model.cfg.n_layers + 1 + model.cfg.value_embed_layers


@pytest.mark.parametrize("n_streams", [1, 4])
def test_all_options_state_dict_round_trip_and_every_linear_is_called(n_streams):
    torch.manual_seed(0)
    model = randomize_(GPT(tiny(n_streams=n_streams, **ALL_ON))).eval()
    torch.manual_seed(1)
    fresh = GPT(tiny(n_streams=n_streams, **ALL_ON)).eval()
    fresh.load_state_dict(model.state_dict(), strict=True)
    called = set()
    for name, m in fresh.named_modules():
        if isinstance(m, nn.Linear):  # GPTQ calibration hooks them: they must be called, not bypassed
            m.register_forward_hook(lambda mod, inp, out, name=name: called.add(name))
    idx = tokens()
    assert torch.equal(fresh(idx), model(idx))
    assert called == {n for n, m in fresh.named_modules() if isinstance(m, nn.Linear)}


@pytest.mark.parametrize("n_streams,blocks", [(1, 0), (4, 0), (4, 1)])
def test_all_options_trace_as_one_graph(n_streams, blocks):
    """torch.compile(fullgraph=True) needs no graph breaks (no .item(), no branching on tensor values);
    the eager backend checks the trace without paying for code generation on CPU."""
    torch.manual_seed(0)
    model = randomize_(GPT(tiny(n_streams=n_streams, mhc_blocks=blocks, **ALL_ON))).eval()
    idx = tokens()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    assert torch.allclose(compiled(idx), model(idx), atol=1e-6)


@pytest.mark.parametrize("granularity, blocks", [("sublayer", 0), ("sublayer", 1), ("sublayer", 3), ("block", 0),
                                                 ("block", 3)])
def test_mhc_with_options_starts_as_the_plain_network_with_the_same_options(granularity, blocks):
    """Every option, U-Net skips included, so mHC at alpha = 0 starts as the plain network with the same options.
    The skips used to carry other tensors under mHC (a block's input, added to the next sublayer's input only), and
    the shipped layout (n=2, mhc_blocks=3, skips on) started up to 1.4 logits away from the plain one."""
    torch.manual_seed(0)
    plain = randomize_(GPT(tiny(n_layers=5, n_streams=1, **ALL_ON))).eval()  # encoder 0-1, decoder 2-4
    mhc = GPT(tiny(n_layers=5, n_streams=4, mhc_alpha_init=0.0, mhc_granularity=granularity, mhc_blocks=blocks,
                   **ALL_ON)).eval()
    copy_plain_weights(plain, mhc)
    idx = tokens()
    ref = plain(idx)
    assert (mhc(idx) - ref).abs().max() < 1e-5 * ref.abs().max()


def test_width_and_init_options_reach_the_layers():
    """model.mlp_mult, rope_base, qk_gain_init and embed_init_std each set what they name in the built model."""
    torch.manual_seed(0)
    cfg = tiny(n_streams=1, vocab_size=512, d_model=64, mlp_mult=2.25, rope_base=500.0, qk_gain_init=0.75,
               embed_init_std=0.02)
    model = GPT(cfg)
    mlps = [s.body for s in model.sublayers if isinstance(s.body, MLP)]
    attentions = [s.body for s in model.sublayers if isinstance(s.body, Attention)]
    assert len(mlps) == len(attentions) == cfg.n_layers
    assert all(m.up.weight.shape == (144, 64) and m.down.weight.shape == (64, 144) for m in mlps)  # round(2.25 * 64)
    assert all(torch.equal(a.q_gain.detach(), torch.full((cfg.n_heads,), 0.75)) for a in attentions)
    # 32,768 draws: the sample std is within 1% of 0.02 (the default, 0.005, is far outside)
    assert model.embed.weight.std().item() == pytest.approx(0.02, rel=0.03)
    cos, sin = attentions[0].rope(4)  # position 1's angles are the inverse frequencies base^(-2i/dim)
    dim = cfg.rotary_dims
    assert torch.allclose(torch.atan2(sin[1], cos[1]), 500.0 ** -(torch.arange(0, dim, 2) / dim))


def test_sinkhorn_iters_reaches_every_mhc_call(monkeypatch):
    """model.sinkhorn_iters is the number of Sinkhorn rounds of every mHC coefficient call, and it changes the logits."""
    from kernels import mhc_reference
    seen = []
    real = mhc_reference.sinkhorn_knopp

    def counting(logits, iters):
        seen.append(iters)
        return real(logits, iters)
    monkeypatch.setattr(mhc_reference, "sinkhorn_knopp", counting)
    logits = {}
    for iters in (2, 20):
        torch.manual_seed(0)
        model = randomize_(GPT(tiny(n_streams=4, sinkhorn_iters=iters))).eval()
        seen.clear()
        logits[iters] = model(tokens())
        assert len(seen) == 2 * model.cfg.n_layers and set(seen) == {iters}, seen
    assert not torch.allclose(logits[2], logits[20], atol=1e-5)
