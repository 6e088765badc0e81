"""Depth recurrence (model.recur_*) and parallel residual lanes (model.lane_start): off = the plain model bit for bit;
recurrence on = the model unrolled over its virtual layers (plain and mHC, with U-Net skips); lanes = their 2x2
write; the trainer's switch, its resume, the compile's two graphs, the artifact's phase, and config errors."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from model.config import ModelConfig
from model.features import LANE_CARRY_INIT
from model.gpt import GPT
from test_model import randomize_, tiny
from test_model_features import tokens

LOOP = dict(recur_start=1, recur_end=2, recur_times=3)  # 5 blocks: 0,1,2,1,2,1,2,3,4 (9 virtual layers)


def test_the_virtual_order_repeats_the_range_in_a_row():
    cfg = ModelConfig(recur_start=3, recur_end=5, recur_times=3)
    assert cfg.block_order(True) == (0, 1, 2, 3, 4, 5, 3, 4, 5, 3, 4, 5, 6, 7, 8, 9, 10)
    assert cfg.block_order(False) == tuple(range(11)) == ModelConfig().block_order(True)
    model = GPT(tiny(n_layers=5, n_streams=1, **LOOP))
    assert model.block_order() == (0, 1, 2, 3, 4)
    model.recurrence_on = True
    assert model.block_order() == (0, 1, 2, 1, 2, 1, 2, 3, 4)


@pytest.mark.parametrize("n_streams,extra", [(1, {}), (2, dict(mhc_blocks=3)), (1, dict(lane_start=3))])
def test_configured_but_off_is_the_plain_model_bit_for_bit(n_streams, extra):
    """The same seed gives the same parameters, and before the switch the same outputs, exactly."""
    torch.manual_seed(0)
    plain = randomize_(GPT(tiny(n_layers=5, n_streams=n_streams, **extra)))
    torch.manual_seed(0)
    looped = randomize_(GPT(tiny(n_layers=5, n_streams=n_streams, **extra, **LOOP)))
    assert [(n, p.shape) for n, p in plain.named_parameters()] == [(n, p.shape) for n, p in looped.named_parameters()]
    assert all(torch.equal(p, q) for p, q in zip(plain.parameters(), looped.parameters()))
    idx = tokens()
    assert torch.equal(plain(idx), looped(idx))


def unrolled(model: GPT) -> GPT:
    """A model without recurrence whose blocks (and mHC units) are copies of `model`'s in its virtual order."""
    cfg, order = model.cfg, model.block_order()
    mhc_layers = sum(b < model.n_mhc_blocks for b in order)
    flat = GPT(dataclasses.replace(cfg, n_layers=len(order), recur_times=1,
                                   mhc_blocks=mhc_layers if cfg.n_streams > 1 else 0))
    per = 1 if cfg.mhc_granularity == "block" else 2
    state, mine = {}, model.state_dict()
    for name in flat.state_dict():
        part, _, rest = name.partition(".")
        index, _, tail = rest.partition(".")
        if part == "sublayers":
            p, k = divmod(int(index), 2)
            name_in = f"sublayers.{2 * order[p] + k}.{tail}"
        elif part == "mhc":
            p, k = divmod(int(index), per)
            name_in = f"mhc.{per * order[p] + k}.{tail}"
        else:
            name_in = name
        state[name] = mine[name_in]
    flat.load_state_dict(state)
    return flat


@pytest.mark.parametrize("n_streams,extra", [(1, {}), (1, dict(unet_skips=True)),
                                             (2, dict(unet_skips=True)),  # the loop inside the mHC blocks
                                             (2, dict(mhc_blocks=1, unet_skips=True)),  # the loop after them
                                             (2, dict(mhc_granularity="block", unet_skips=True))])
def test_recurrence_on_is_the_model_unrolled_over_its_virtual_layers(n_streams, extra):
    """mHC streams flow through the loop (post_pre hands them to the next unit run), the repeated blocks reuse their
    parameters, and U-Net skips pair the virtual layers: 9 of them, 4 skip weights."""
    torch.manual_seed(0)
    model = randomize_(GPT(tiny(n_layers=5, n_streams=n_streams, **LOOP, **extra)))
    model.recurrence_on = True
    if model.unet is not None:
        assert model.unet.weight.shape == (4, 32)
    flat = unrolled(model)
    idx = tokens()
    with torch.no_grad():
        assert torch.allclose(model(idx), flat(idx), atol=1e-5, rtol=0)
        model.recurrence_on = False  # and off, the 5 blocks once
        assert not torch.allclose(model(idx), flat(idx), atol=1e-3)


@pytest.mark.parametrize("n_streams", [1, 2])
def test_every_visit_of_a_repeated_block_trains_it(n_streams):
    torch.manual_seed(0)
    model = randomize_(GPT(tiny(n_layers=5, n_streams=n_streams, **LOOP)))
    grads = {}
    for on in (False, True):
        model.recurrence_on = on
        model.zero_grad()
        model(tokens(), tokens(seed=3)).backward()
        grads[on] = {n: p.grad.clone() for n, p in model.named_parameters()}
        assert all(g.abs().sum() > 0 for n, g in grads[on].items() if n.startswith("sublayers.")), on
    for name, g in grads[True].items():  # blocks 1 and 2 run three times: their gradients change
        if name.startswith(("sublayers.2.", "sublayers.5.")):
            assert not torch.allclose(g, grads[False][name])


def test_recurrence_is_switched_by_the_progress_of_training():
    model = GPT(tiny(n_streams=1, n_layers=3, recur_start=0, recur_end=1, recur_times=2, recur_at=0.35))
    assert [model.recurrence_due(p) for p in (0.0, 0.3499, 0.35, 1.0)] == [False, False, True, True]
    assert not GPT(tiny(n_streams=1, recur_at=0.0)).recurrence_due(1.0)  # recur_times=1: never


def lanes_reference(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    """The hidden state written out: plain blocks, then lanes a and m from the stream entering lane_start, each block
    reading both from before it; a' = c0 a + w00 A + w01 M, m' = c1 m + w10 A + w11 M; readout (a + m) / 2."""
    x = model.embed(idx)
    for block in range(model.cfg.lane_start):
        x = x + model.sublayers[2 * block](x)
        x = x + model.sublayers[2 * block + 1](x)
    a, m = x, x
    for i, block in enumerate(range(model.cfg.lane_start, model.cfg.n_layers)):
        attn, mlp = model.sublayers[2 * block](a), model.sublayers[2 * block + 1](m)
        c, w = model.lanes.carry[i], model.lanes.write[i]
        a, m = c[0] * a + w[0, 0] * attn + w[0, 1] * mlp, c[1] * m + w[1, 0] * attn + w[1, 1] * mlp
    return (a + m) / 2


def test_lanes_read_before_the_block_and_write_through_their_2x2_scalars():
    torch.manual_seed(0)
    model = randomize_(GPT(tiny(n_layers=4, n_streams=1, lane_start=2)))  # random carry and write too
    idx = tokens()
    with torch.no_grad():
        assert torch.allclose(model.hidden(idx), lanes_reference(model, idx), atol=1e-5, rtol=0)


def test_lanes_start_as_gpt_j_parallel_blocks_with_carry_1_1():
    """carry 1.1, write 1: the lanes stay equal, and each lane block is x' = 1.1 x + A(x) + M(x)."""
    torch.manual_seed(0)
    model = GPT(tiny(n_layers=4, n_streams=1, lane_start=2))
    assert torch.equal(model.lanes.carry, torch.full((2, 2), LANE_CARRY_INIT))
    assert torch.equal(model.lanes.write, torch.ones(2, 2, 2))
    fresh = {k: v.clone() for k, v in model.lanes.state_dict().items()}
    randomize_(model)
    model.lanes.load_state_dict(fresh)
    idx = tokens()
    with torch.no_grad():
        x = model.embed(idx)
        for block in range(4):
            attn, mlp = model.sublayers[2 * block], model.sublayers[2 * block + 1]
            x = x + attn(x) + mlp(x + attn(x)) if block < 2 else 1.1 * x + attn(x) + mlp(x)
        assert torch.allclose(model.hidden(idx), x, atol=1e-5, rtol=0)
    scalars = {id(p) for p in model.param_groups()["scalar"]}
    assert id(model.lanes.carry) in scalars and id(model.lanes.write) in scalars


def test_unet_skips_enter_the_attention_lane():
    """5 blocks, lanes from block 3: decoder block 3 gets encoder block 0's skip in lane a only."""
    torch.manual_seed(0)
    model = randomize_(GPT(tiny(n_layers=5, n_streams=1, lane_start=3, unet_skips=True)))
    seen = {}
    hooks = [model.sublayers[l].register_forward_pre_hook(lambda _, args, l=l: seen.__setitem__(l, args[0]))
             for l in (6, 7)]
    idx = tokens()
    with torch.no_grad():
        model.hidden(idx)
        attn_in, mlp_in = seen[6], seen[7]
        model.unet.weight[1].zero_()  # block 3 is decoder j = 1 of depth 5
        model.hidden(idx)
    for h in hooks:
        h.remove()
    assert torch.equal(seen[7], mlp_in) and not torch.allclose(seen[6], attn_in)


def run_recorded(cfg, model, monkeypatch, tmp_path, start=None):
    """run_training with a step that records the phase it ran in, on a fake clock of 1 s per step."""
    from training import trainer
    from training.checkpoint import Resumed
    from training.distributed import DistInfo
    from training.optim import build_optimizers
    from training.run_log import RunLog
    clock, phases = [0.0], []

    class FakeTime:
        @staticmethod
        def perf_counter():
            return clock[0]

    def one_second_step(*args, **kwargs):
        phases.append(model.recurrence_on)
        clock[0] += 1.0
        return torch.tensor(1.0)
    monkeypatch.setattr(trainer, "time", FakeTime)
    monkeypatch.setattr(trainer, "train_step", one_second_step)
    trainer.run_training(cfg, model, model, None, build_optimizers(model.param_groups(), cfg.optim), None,
                         DistInfo(0, 0, 1, torch.device("cpu")), RunLog(tmp_path / "log.txt", enabled=False),
                         start=start or Resumed(step=0, train_time_s=0.0))
    return phases


def loop_cfg(*extra):
    from training.config import load_config
    return load_config(None, ["model.n_layers=3", "model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1",
                              "model.n_streams=1", "model.vocab_size=64", "model.recur_start=1", "model.recur_end=1",
                              "model.recur_times=2", "data.seq_len=16", "train.batch_tokens=64",
                              "train.micro_batch_seqs=4", "train.log_every=100", *extra])


@pytest.mark.parametrize("schedule", [["train.schedule=steps", "train.max_steps=10"],
                                      ["train.schedule=time", "train.time_budget_s=10", "train.max_steps=1000"]])
def test_the_trainer_switches_on_the_step_whose_progress_crosses_recur_at(monkeypatch, tmp_path, schedule):
    """Steps of 1 s, 10 s or 10 steps: progress at the start of step s is s / 10, so 0.35 switches at step 4.
    The progress is the LR schedule's, from the ranks' agreed clock: every rank flips on the same step."""
    cfg = loop_cfg("model.recur_at=0.35", *schedule)
    torch.manual_seed(0)
    phases = run_recorded(cfg, GPT(cfg.model), monkeypatch, tmp_path)
    assert phases == [False] * 4 + [True] * 6


def test_a_resumed_run_lands_in_the_phase_of_its_progress(monkeypatch, tmp_path):
    from training.checkpoint import Resumed
    cfg = loop_cfg("model.recur_at=0.5", "train.max_steps=10")
    torch.manual_seed(0)
    assert run_recorded(cfg, GPT(cfg.model), monkeypatch, tmp_path, Resumed(step=3, train_time_s=3.0)) == \
        [False, False] + [True] * 5
    model = GPT(cfg.model)  # resumed past the switch: on from its first step
    assert run_recorded(cfg, model, monkeypatch, tmp_path, Resumed(step=7, train_time_s=7.0)) == [True] * 3
    model = GPT(cfg.model)  # a finished training resumed to be scored: no step runs, the phase is still set
    assert run_recorded(cfg, model, monkeypatch, tmp_path, Resumed(step=10, train_time_s=10.0)) == []
    assert model.recurrence_on


def test_flops_per_token_count_the_virtual_layers():
    from training.trainer import training_flops_per_token
    cfg = loop_cfg("model.recur_times=3")  # block 1 three times: 5 virtual layers of 3
    model = GPT(cfg.model)
    block = sum(p.numel() for n, p in model.named_parameters() if n.startswith(("sublayers.2.", "sublayers.3."))
                and n.endswith("weight") and p.ndim == 2)
    off, on = training_flops_per_token(model, cfg, False), training_flops_per_token(model, cfg, True)
    assert on - off == 6.0 * 2 * block + 6.0 * 2 * cfg.data.seq_len * cfg.model.d_model


def test_compiled_model_keeps_one_graph_per_phase():
    """Dynamo guards on recurrence_on: the flip compiles once, and flipping back and forth reuses both graphs."""
    from torch._dynamo.testing import CompileCounter
    torch._dynamo.reset()
    model = GPT(tiny(n_layers=3, n_streams=1, recur_start=1, recur_end=1, recur_times=2))
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter)
    idx = tokens()
    for on in (False, True, False, True, False):
        model.recurrence_on = on
        compiled(idx)
    assert counter.frame_count == 2
    torch._dynamo.reset()


CALIB = [torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))]  # one calibration batch


def export_and_load(cfg, model: GPT, path, monkeypatch):
    """export_model of `model` to `path` on one fixed calibration batch, then the scored model load_model gives."""
    from training import export
    from training.score import load_model
    monkeypatch.setattr(export, "calibration_batches", lambda *a: CALIB)
    report = export.export_model(cfg, model, train_files=[], rank=0, world_size=1, log=lambda _: None,
                                 artifact_path=path, tokenizer_sha256="0" * 64, device=torch.device("cpu"),
                                 train_time_s=0.0)
    assert "export_error" not in report
    return load_model(path, torch.device("cpu"))


def test_the_artifact_is_scored_in_the_phase_training_ended_in(tmp_path, monkeypatch):
    """export_model records the phase in the meta; load_model turns the loops on from it. The lane scalars ship
    as fp32 as they are, and the scored model computes the trained model's function on the dequantized weights."""
    from quant.container import load_artifact
    from quant.export import export_artifact
    from training.config import load_config
    from training.score import load_model
    cfg = load_config(None, ["model.n_layers=4", "model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1",
                             "model.n_streams=2", "model.mhc_blocks=1", "model.vocab_size=64", "model.unet_skips=true",
                             "model.recur_start=1", "model.recur_end=2", "model.recur_times=2", "model.lane_start=3",
                             "quant.budget_bytes=10000000"])
    torch.manual_seed(0)
    model = randomize_(GPT(cfg.model))
    model.recurrence_on = True
    path = tmp_path / "a.mhcg"
    loaded, meta = export_and_load(cfg, model, path, monkeypatch)
    assert meta["recurrence_on"] is True and loaded.recurrence_on
    assert torch.equal(loaded.lanes.carry, model.lanes.carry) and torch.equal(loaded.lanes.write, model.lanes.write)
    model.load_state_dict(load_artifact(path)[1])  # the trained model on the shipped weights
    idx = tokens()
    with torch.no_grad():
        assert torch.equal(loaded(idx), model(idx))
    model.recurrence_on = False  # an artifact of a run that ended before recur_at is scored without the loops
    export_artifact(model, CALIB, str(path), {"model_config": dataclasses.asdict(cfg.model), "tokenizer_sha256":
                                              "0" * 64, "recurrence_on": False}, 10 ** 7, log=lambda _: None,
                    observed_patterns=("mhc.*.phi",))
    assert not load_model(path, torch.device("cpu"))[0].recurrence_on


@pytest.mark.parametrize("kw,message", [
    (dict(recur_times=0), r"model.recur_times=0 must be >= 1"),
    (dict(recur_start=3, recur_end=2, recur_times=2), r"recur_start=3, model.recur_end=2: expected 0 <= recur_start"),
    (dict(recur_start=1, recur_end=5), r"recur_end=5: expected .* < n_layers=5"),
    (dict(recur_at=1.5, recur_times=2), r"model.recur_at=1.5 must be in \[0, 1\]"),
    (dict(recur_at=float("nan")), r"model.recur_at=nan must be in \[0, 1\]"),
    (dict(n_streams=2, mhc_blocks=2, recur_start=1, recur_end=3, recur_times=2), r"spans the last mHC block \(1"),
    (dict(lane_start=5), r"model.lane_start=5 must be in \[0, n_layers=5\)"),
    (dict(lane_start=-1), r"model.lane_start=-1 must be in"),
    (dict(n_streams=2, lane_start=3), r"lane_start=3 with n_streams=2: .* blocks 0..4 have mHC"),
    (dict(n_streams=2, mhc_blocks=4, lane_start=3), r"blocks 0..3 have mHC .* lane_start >= 4"),
    (dict(lane_start=3, recur_start=2, recur_end=3, recur_times=2), r"recur_end=3 with model.lane_start=3: .*before"),
])
def test_bad_recurrence_and_lane_options_are_refused_naming_the_field(kw, message):
    with pytest.raises(ValueError, match=message):
        GPT(tiny(**{"n_layers": 5, "n_streams": 1, **kw}))


def test_a_loop_before_the_lanes_runs_in_the_plain_part():
    """The records' layout in small: loop blocks 1-2, lanes from block 3, mHC on block 0."""
    torch.manual_seed(0)
    model = randomize_(GPT(tiny(n_layers=5, n_streams=2, mhc_blocks=1, lane_start=3, unet_skips=True, **LOOP)))
    model.recurrence_on = True
    idx, targets = tokens(), tokens(seed=3)
    loss = F.cross_entropy(model(idx).flatten(0, 1), targets.flatten())
    loss.backward()
    assert torch.isfinite(loss) and model.lanes.write.grad.abs().sum() > 0


def test_a_checkpoint_re_exported_by_bench_quant_keeps_its_phase(tmp_path):
    """scripts/bench_quant.py re-quantizes a checkpoint's weights: in the phase they were trained in last."""
    from training.trained_weights import load_weights
    from training.checkpoint import Checkpointer
    from training.optim import build_optimizers
    cfg = loop_cfg("train.max_steps=10")
    model = GPT(cfg.model)
    model.recurrence_on = True

    class Loader:
        def state_dict(self):
            return {}
    path = Checkpointer(tmp_path, every_steps=0, keep=1, rank=0, world_size=1).save(
        5, 5.0, model, build_optimizers(model.param_groups(), cfg.optim), None, Loader())
    fresh = GPT(cfg.model)
    assert load_weights(path, fresh) == ("model", 5.0) and fresh.recurrence_on
