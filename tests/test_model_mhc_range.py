"""mHC on a range of blocks that need not start at block 0 (model.mhc_start, model.mhc_blocks), and the n=2 init
that starts such a range as the parallel residual lanes (model.mhc_init='lanes')."""
import dataclasses
import math

import pytest
import torch

from kernels.mhc_reference import mhc_apply, mhc_coefficients, mhc_premix
from model import mhc as mhc_module
from model.features import LANE_CARRY_INIT
from model.gpt import GPT
from test_model import copy_plain_weights, randomize_, tiny
from test_model_features import ALL_ON, tokens
from test_model_recurrence import export_and_load


def plain_block(model: GPT, block: int, x: torch.Tensor) -> torch.Tensor:
    x = x + model.sublayers[2 * block](x)
    return x + model.sublayers[2 * block + 1](x)


def mhc_unit(model: GPT, unit: int, streams: torch.Tensor, body) -> torch.Tensor:
    """One mHC unit through the reference: coefficients, pre-mix, body, apply."""
    p = model.mhc[unit]
    h_pre, h_post, h_res = mhc_coefficients(streams, p.projection(), p.alpha, p.bias, model.cfg.sinkhorn_iters)
    return mhc_apply(streams, h_res, h_post, body(mhc_premix(streams, h_pre)))


def composed_hidden(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    """The hidden state written out: plain blocks, the stream expanded into n copies, mHC units numbered from the
    range's first block, the readout, plain blocks."""
    cfg = model.cfg
    x, streams = model.embed(idx), None
    for block in range(cfg.n_layers):
        if cfg.mhc_start <= block < cfg.mhc_end:
            if streams is None:
                streams = x.unsqueeze(-2).expand(*x.shape[:-1], cfg.n_streams, x.shape[-1])
            i = block - cfg.mhc_start
            attn, mlp = model.sublayers[2 * block], model.sublayers[2 * block + 1]
            if cfg.mhc_granularity == "block":
                streams = mhc_unit(model, i, streams, lambda u: plain_block(model, block, u) - u)
            else:
                streams = mhc_unit(model, 2 * i, streams, attn)
                streams = mhc_unit(model, 2 * i + 1, streams, mlp)
            continue
        if streams is not None:
            x, streams = (streams * model.readout[:, None]).sum(-2), None
        x = plain_block(model, block, x)
    return x if streams is None else (streams * model.readout[:, None]).sum(-2)


@pytest.mark.parametrize("start,blocks,granularity", [(2, 3, "sublayer"), (2, 2, "sublayer"), (1, 1, "sublayer"),
                                                      (2, 2, "block"), (0, 2, "sublayer")])
def test_an_mhc_range_is_plain_blocks_copies_mhc_readout_plain_blocks(start, blocks, granularity):
    torch.manual_seed(0)
    model = randomize_(GPT(tiny(n_layers=5, n_streams=2, mhc_start=start, mhc_blocks=blocks,
                                mhc_granularity=granularity))).eval()
    assert len(model.mhc) == blocks * (1 if granularity == "block" else 2)
    idx = tokens()
    with torch.no_grad():
        ref = composed_hidden(model, idx)  # entries up to ~70: a bound relative to the largest
        assert (model.hidden(idx) - ref).abs().max() < 1e-6 * ref.abs().max()


@pytest.mark.parametrize("start,blocks", [(2, 3), (1, 2)])
def test_an_mhc_range_with_every_option_starts_as_the_plain_network_and_trains_every_parameter(start, blocks):
    """U-Net skips cross into and out of the range (encoder 0-1, decoder 2-4), value embeddings and XSA sit on the
    last blocks: at alpha = 0 the model is the plain one with the same options; every parameter gets a gradient."""
    torch.manual_seed(0)
    plain = randomize_(GPT(tiny(n_layers=5, n_streams=1, **ALL_ON))).eval()
    mhc = GPT(tiny(n_layers=5, n_streams=2, mhc_alpha_init=0.0, mhc_start=start, mhc_blocks=blocks, **ALL_ON)).eval()
    copy_plain_weights(plain, mhc)
    idx = tokens()
    ref = plain(idx)
    assert (mhc(idx) - ref).abs().max() < 1e-5 * ref.abs().max()
    randomize_(mhc).train()
    mhc(idx, tokens(seed=3)).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in mhc.parameters())


def test_the_quantizer_sees_the_units_by_their_own_numbers():
    model = randomize_(GPT(tiny(n_layers=4, n_streams=2, mhc_start=2, mhc_blocks=2)))
    seen = []
    model.quant_observer = lambda name, x: seen.append(name)
    model(tokens())
    assert seen == [f"mhc.{u}.phi" for u in range(4)] + ["embed.weight"]
    assert [n for n in model.state_dict() if n.endswith(".phi")] == seen[:-1]


def unrolled(model: GPT) -> GPT:
    """A model without recurrence whose blocks and mHC units are copies of `model`'s in its virtual order."""
    cfg, order = model.cfg, model.block_order()
    first = sum(b < cfg.mhc_start for b in order)
    count = sum(cfg.mhc_start <= b < cfg.mhc_end for b in order)
    flat = GPT(dataclasses.replace(cfg, n_layers=len(order), recur_times=1, mhc_start=first, mhc_blocks=count))
    mine, state = model.state_dict(), {}
    for name in flat.state_dict():
        part, _, rest = name.partition(".")
        index, _, tail = rest.partition(".")
        if part == "sublayers":
            p, k = divmod(int(index), 2)
            state[name] = mine[f"sublayers.{2 * order[p] + k}.{tail}"]
        elif part == "mhc":
            q, k = divmod(int(index), 2)
            state[name] = mine[f"mhc.{2 * (order[first + q] - cfg.mhc_start) + k}.{tail}"]
        else:
            state[name] = mine[name]
    flat.load_state_dict(state)
    return flat


@pytest.mark.parametrize("start,blocks,loop", [(1, 2, (1, 2)),   # the loop is the mHC range
                                               (2, 3, (2, 3)),   # inside it, the range at the end
                                               (3, 2, (1, 2)),   # before it
                                               (1, 2, (3, 4))])  # after it
def test_recurrence_inside_or_outside_an_mhc_range_is_the_model_unrolled(start, blocks, loop):
    torch.manual_seed(0)
    model = randomize_(GPT(tiny(n_layers=5, n_streams=2, mhc_start=start, mhc_blocks=blocks, unet_skips=True,
                                recur_start=loop[0], recur_end=loop[1], recur_times=2)))
    model.recurrence_on = True
    flat = unrolled(model)
    idx = tokens()
    with torch.no_grad():
        assert torch.allclose(model(idx), flat(idx), atol=1e-5, rtol=0)


@pytest.mark.parametrize("kw,message", [
    (dict(mhc_start=5, mhc_blocks=1), r"model.mhc_start=5 must be in \[0, n_layers=5\)"),
    (dict(mhc_start=-1, mhc_blocks=1), r"model.mhc_start=-1 must be in"),
    (dict(mhc_start=2), r"model.mhc_start=2 needs n_streams >= 2 and model.mhc_blocks >= 1"),
    (dict(mhc_start=2, n_streams=1), r"model.mhc_start=2 needs n_streams >= 2 .* got n_streams=1"),
    (dict(mhc_start=3, mhc_blocks=3), r"model.mhc_start=3 \+ model.mhc_blocks=3 must be <= n_layers=5"),
    (dict(mhc_start=1, mhc_blocks=2, recur_start=0, recur_end=1, recur_times=2), r"spans the first mHC block \(1"),
    (dict(mhc_start=1, mhc_blocks=2, recur_start=2, recur_end=3, recur_times=2), r"spans the last mHC block \(2"),
    (dict(mhc_start=1, mhc_blocks=2, lane_start=2), r"lane_start=2 .* blocks 1..2 have mHC .* lane_start >= 3"),
    (dict(mhc_init="lane"), r"model.mhc_init='lane': expected 'plain'"),
    (dict(mhc_init="lanes", n_streams=4), r"model.mhc_init='lanes' needs n_streams=2 and mhc_granularity"),
    (dict(mhc_init="lanes", mhc_granularity="block"), r"model.mhc_init='lanes' needs n_streams=2"),
    (dict(mhc_init="lanes", mhc_start=2, mhc_blocks=3, recur_start=3, recur_end=3, recur_times=2),
     r"model.mhc_init='lanes' with model.recur_start=3..recur_end=3 inside the mHC blocks 2..4"),
])
def test_bad_mhc_range_options_are_refused_naming_the_field(kw, message):
    with pytest.raises(ValueError, match=message):
        GPT(tiny(**{"n_layers": 5, "n_streams": 2, **kw}))


def test_an_mhc_range_round_trips_through_the_artifact(tmp_path, monkeypatch):
    """export_model quantizes the units' phi (observed as mhc.{unit}.phi), and the scored model loaded from the
    artifact computes the trained model's function on the shipped weights."""
    from quant.container import load_artifact
    from training.config import load_config
    cfg = load_config(None, ["model.n_layers=5", "model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1",
                             "model.n_streams=2", "model.mhc_start=2", "model.mhc_blocks=3", "model.mhc_init=lanes",
                             "model.vocab_size=64", "model.unet_skips=true", "quant.budget_bytes=10000000"])
    torch.manual_seed(0)
    model = randomize_(GPT(cfg.model))
    path = tmp_path / "a.mhcg"
    loaded, meta = export_and_load(cfg, model, path, monkeypatch)
    assert (loaded.cfg.mhc_start, loaded.cfg.mhc_blocks, loaded.cfg.mhc_init) == (2, 3, "lanes")
    shipped = load_artifact(path)[1]
    assert not torch.equal(shipped["mhc.5.phi"], model.mhc[5].phi)  # quantized, not stored as it was
    model.load_state_dict(shipped)
    idx = tokens()
    with torch.no_grad():
        assert torch.equal(loaded(idx), model(idx))


# --- mhc_init = "lanes" ---------------------------------------------------------------------------------------

def sigmoid(z: float) -> float:
    return 1.0 / (1.0 + math.exp(-z))


def test_the_lanes_init_reads_one_stream_per_sublayer_and_writes_the_lanes_scaled():
    """At alpha = 0: attention reads stream a and the MLP stream m at 0.982 / 0.018, H_res keeps 0.982 of each
    stream (Sinkhorn leaves the symmetric 2x2 as it is), lane block i writes 1.1^-(i+1) into both streams, and the
    readout is 1.1^k / 2 per stream."""
    model = GPT(tiny(n_layers=5, n_streams=2, mhc_start=2, mhc_blocks=3, mhc_init="lanes", mhc_alpha_init=0.0))
    x = torch.randn(3, 2, 32)
    r, d = sigmoid(mhc_module.LANE_READ_LOGIT), sigmoid(mhc_module.LANE_RES_LOGIT)
    assert r == pytest.approx(0.982, abs=5e-4)
    for unit, p in enumerate(model.mhc):
        h_pre, h_post, h_res = mhc_coefficients(x, p.projection(), p.alpha, p.bias, model.cfg.sinkhorn_iters)
        read = [r, 1 - r] if unit % 2 == 0 else [1 - r, r]
        assert torch.allclose(h_pre, torch.tensor(read).expand(3, 2), atol=1e-6)
        write = LANE_CARRY_INIT ** -(unit // 2 + 1)
        assert torch.allclose(h_post, torch.full((3, 2), write), atol=1e-6)
        assert torch.allclose(h_res, torch.tensor([[d, 1 - d], [1 - d, d]]).expand(3, 2, 2), atol=1e-6)
    assert torch.allclose(model.readout.detach(), torch.full((2,), LANE_CARRY_INIT ** 3 / 2))


def lanes_pair(monkeypatch):
    """A lanes model (lane_start=2 of 4, carry 1.1 and write 1 as at init) with random sublayers, and the mHC-lanes
    model on the same sublayers with one-hot reads and an identity carry (the logits at 30: sigmoid(30) = 1 in fp32)."""
    monkeypatch.setattr(mhc_module, "LANE_READ_LOGIT", 30.0)
    monkeypatch.setattr(mhc_module, "LANE_RES_LOGIT", 30.0)
    torch.manual_seed(0)
    lanes = randomize_(GPT(tiny(n_layers=4, n_streams=1, lane_start=2))).eval()
    with torch.no_grad():
        lanes.lanes.carry.fill_(LANE_CARRY_INIT)
        lanes.lanes.write.fill_(1.0)
    mhc = GPT(tiny(n_layers=4, n_streams=2, mhc_start=2, mhc_blocks=2, mhc_init="lanes", mhc_alpha_init=0.0)).eval()
    params = dict(mhc.named_parameters())
    with torch.no_grad():
        for name, p in lanes.named_parameters():
            if name in params:
                params[name].copy_(p)
    return lanes, mhc


def test_the_lanes_init_in_the_limit_is_the_lanes_with_the_mlp_reading_after_attention(monkeypatch):
    """With one-hot reads and an identity carry the mHC range is the lanes (carry 1.1, write 1, readout (a + m) / 2,
    at the lanes' own scale), except that the MLP reads lane m after attention's write: 1.1·m + A(a)."""
    lanes, mhc = lanes_pair(monkeypatch)
    idx = tokens()
    c = LANE_CARRY_INIT
    with torch.no_grad():
        x = lanes.embed(idx)
        for block in range(2):
            x = plain_block(lanes, block, x)
        a = m = x
        for block in (2, 3):
            attn = lanes.sublayers[2 * block](a)
            mid = c * m + attn
            mlp = lanes.sublayers[2 * block + 1](mid)
            a, m = c * a + attn + mlp, mid + mlp
        expected = (a + m) / 2
        assert torch.allclose(mhc.hidden(idx), expected, atol=1e-5 * expected.abs().max().item(), rtol=0)
        assert not torch.allclose(lanes.hidden(idx), expected, atol=1e-3)  # the MLP's read is the difference


def test_the_lanes_init_in_the_limit_is_the_lanes_model_while_attention_writes_nothing(monkeypatch):
    """Attention's output projections at zero (as at init): the MLP reads 1.1·m, the same as m through its norm, and
    the mHC range computes what the lanes model does."""
    lanes, mhc = lanes_pair(monkeypatch)
    with torch.no_grad():
        for model in (lanes, mhc):
            for sub in model.sublayers[::2]:
                sub.body.proj.weight.zero_()
        idx = tokens()
        ref = lanes.hidden(idx)
        assert torch.allclose(mhc.hidden(idx), ref, atol=1e-5 * ref.abs().max().item(), rtol=0)


def test_an_mhc_range_with_every_option_traces_as_one_graph():
    torch.manual_seed(0)
    model = randomize_(GPT(tiny(n_layers=5, n_streams=2, mhc_start=2, mhc_blocks=2, **ALL_ON))).eval()
    idx = tokens()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    assert torch.allclose(compiled(idx), model(idx), atol=1e-6)
