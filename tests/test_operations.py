"""Operations: divergence guard keeps the last good checkpoint, progress bar, optional wandb."""
import math
import sys

import pytest
import torch

from conftest import FakeWandb
from model.gpt import GPT
from training.checkpoint import Checkpointer, complete_checkpoints
from training.config import ConfigError, load_config
from training.distributed import DistInfo
from training.optim import build_optimizers
from training.run_log import RunLog, maybe_wandb
from training import trainer
from training.trainer import DivergenceError, ProgressBar, run_training


class RandomLoader:
    def __init__(self):
        self.g = torch.Generator().manual_seed(0)
        self.i = 0

    def next_batch(self):
        self.i += 1
        ids = torch.randint(0, 64, (4, 17), generator=self.g)
        return ids[:, :-1], ids[:, 1:]

    def state_dict(self):
        return {"i": self.i}


class NaNAfter:
    """The model's loss, turned into NaN from call `n` on (as a diverging run would)."""

    def __init__(self, model, n):
        self.model, self.n, self.calls = model, n, 0

    def __call__(self, x, y):
        self.calls += 1
        loss = self.model(x, y)
        return loss * math.nan if self.calls >= self.n else loss


def test_divergence_stops_naming_the_step_and_keeps_the_last_good_checkpoint(tmp_path):
    cfg = load_config(None, ["model.n_layers=1", "model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1",
                             "model.vocab_size=64", "data.seq_len=16", "train.batch_tokens=64",
                             "train.micro_batch_seqs=4", "train.max_steps=20", "train.log_every=100"])
    torch.manual_seed(0)
    model = GPT(cfg.model)
    opts = build_optimizers(model.param_groups(), cfg.optim)
    ckpt = Checkpointer(tmp_path, every_steps=2, keep=5, rank=0, world_size=1)
    log = RunLog(tmp_path / "log.txt", enabled=False)
    with pytest.raises(DivergenceError, match=r"at step 6 \(hint: lower optim.matrix_lr or optim.grad_clip and start "
                                              r"again under a new train.run_id; a resume keeps this run's settings"):
        run_training(cfg, model, NaNAfter(model, 5), RandomLoader(), opts, None,
                     DistInfo(0, 0, 1, torch.device("cpu")), log, checkpointer=ckpt)
    # Step 5's NaN is caught when step 6 would be checkpointed: the step-4 checkpoint stays the newest.
    kept = complete_checkpoints(tmp_path)
    assert [p.name for p in kept] == ["step_00000002", "step_00000004"]
    state = torch.load(kept[-1] / "rank0.pt", weights_only=True)
    assert all(torch.isfinite(t).all() for t in state["model"].values())


def tiny_cfg(*extra):
    return load_config(None, ["model.n_layers=1", "model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1",
                              "model.vocab_size=64", "data.seq_len=16", "train.batch_tokens=64",
                              "train.micro_batch_seqs=4", "train.max_steps=20", "train.log_every=100", *extra])


def test_an_inf_gradient_under_a_finite_loss_never_reaches_a_checkpoint(tmp_path, monkeypatch):
    """The check before a save looked at the loss only, which is computed before the step's update: an inf gradient
    with a finite loss made NaN weights (clipping scales by 0 x inf), the checkpoint held them, and the older good
    ones were pruned. The weights and EMA are checked too now."""
    cfg = tiny_cfg("optim.ema_decay=0.9")
    torch.manual_seed(0)
    model = GPT(cfg.model)
    opts = build_optimizers(model.param_groups(), cfg.optim)
    real_step, steps = trainer.optimizer_step, []

    def inf_grad_at_step_4(optimizers, clip):
        steps.append(1)
        if len(steps) == 4:  # a checkpoint step: its loss, computed before the update, is finite
            model.embed.weight.grad[0, 0] = math.inf
        return real_step(optimizers, clip)
    monkeypatch.setattr(trainer, "optimizer_step", inf_grad_at_step_4)
    from training.ema import maybe_ema
    ckpt = Checkpointer(tmp_path, every_steps=2, keep=1, rank=0, world_size=1)
    with pytest.raises(DivergenceError, match="embed.weight holds NaN or Inf after step 4, under a finite loss"):
        run_training(cfg, model, model, RandomLoader(), opts, maybe_ema(model, cfg.optim),
                     DistInfo(0, 0, 1, torch.device("cpu")), RunLog(tmp_path / "log.txt", enabled=False),
                     checkpointer=ckpt)
    kept = complete_checkpoints(tmp_path)
    assert [p.name for p in kept] == ["step_00000002"]  # with keep=1 it used to be replaced by a NaN step 4
    state = torch.load(kept[-1] / "rank0.pt", weights_only=True)
    assert all(torch.isfinite(t).all() for part in ("model", "ema") for t in
               (state[part] if part == "model" else state[part]["shadow"]).values())


class TickingClock:
    """time.perf_counter for the training loop that advances 0.1 s a reading: the budget ends a run after the same
    steps on any machine (on a loaded one a first step past half the budget ended the run before the NaN came)."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 0.1
        return self.now


def test_a_run_stopped_between_log_steps_logs_and_checks_its_last_step(tmp_path, monkeypatch):
    """The last steps before a stop between log steps were neither logged nor checked: a loss gone NaN there reached
    the pre-quantization eval and the quantizer, which named no step."""
    cfg = tiny_cfg("train.max_steps=7", "train.log_every=5")
    torch.manual_seed(0)
    model = GPT(cfg.model)
    lines = []

    class Log(RunLog):
        def record(self, kind, **fields):
            lines.append((kind, fields))
    run_training(cfg, model, model, RandomLoader(), build_optimizers(model.param_groups(), cfg.optim), None,
                 DistInfo(0, 0, 1, torch.device("cpu")), Log(tmp_path / "l.txt", enabled=False))
    assert [f["step"] for kind, f in lines if kind == "step"] == [1, 5, 7]  # 7 = max_steps, logged before too
    cfg = tiny_cfg("train.max_steps=1000000", "train.log_every=100000", "train.time_budget_s=1.5")
    monkeypatch.setattr(trainer, "time", TickingClock())
    with pytest.raises(DivergenceError, match=r"loss is nan at step \d+ ") as stop:  # it used to return normally
        run_training(cfg, model, NaNAfter(model, 2), RandomLoader(), build_optimizers(model.param_groups(), cfg.optim),
                     None, DistInfo(0, 0, 1, torch.device("cpu")), Log(tmp_path / "l.txt", enabled=False))
    assert 1 < int(str(stop.value).split()[5]) < 100000  # the step the budget stopped at, between log steps


def test_progress_bar_draws_on_a_terminal_only(capsys):
    fields = dict(step=10, loss=2.5, tok_s=1234, done_pct=50.0, eta_s=12.0, mfu_pct=30.1)
    ProgressBar(enabled=True).show(fields)
    out = capsys.readouterr().out
    assert out.startswith("\r[##########..........]") and "50.0%" in out and "1,234 tok/s" in out
    assert "mfu 30.1%" in out and "eta 12s" in out
    ProgressBar(enabled=False).show(fields)
    assert capsys.readouterr().out == ""


def test_wandb_is_optional_and_receives_step_metrics(tmp_path, monkeypatch):
    assert maybe_wandb(False, "p", "r", {}) is None
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "wandb", None)  # not installed
        with pytest.raises(ConfigError, match="pip install wandb"):
            maybe_wandb(True, "p", "r", {})

    class Offline(FakeWandb):  # online mode without a network: wandb.init raises (wandb's CommError, a timeout)
        def init(self, **kwargs):
            raise TimeoutError("api.wandb.ai timed out")
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "wandb", Offline())
        with pytest.raises(ConfigError, match=r"wandb.init failed \(TimeoutError: api.wandb.ai timed out\) \(hint: "
                                              r"WANDB_MODE=offline"):
            maybe_wandb(True, "p", "r", {})

    run = FakeWandb().init(project="p", name="r")
    log = RunLog(tmp_path / "log.txt", enabled=True, wandb_run=run)
    log.record("step", step=3, loss=1.5, tok_s=100)
    log.record("phase", seconds=2.0)  # not a metric wandb gets
    log.final({"val_bpb": 1.2, "run_id": "x"})
    assert run.logged == [(3, {"step/step": 3, "step/loss": 1.5, "step/tok_s": 100})]
    assert run.summary == {"val_bpb": 1.2, "run_id": "x"} and run.finished


def test_a_step_that_would_end_past_the_time_budget_is_not_started(tmp_path, monkeypatch):
    """The budget was checked before each step only: a run whose steps take 0.3 s stopped at 1.2 s of a 1.0 s
    budget (the demo ran 9 s past its own on a loaded machine). At the mean step time so far, a step that would
    end past the budget is not started. The clock here is fake: each step takes exactly 0.3 s."""
    from training import trainer
    cfg = load_config(None, ["model.n_layers=1", "model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1",
                             "model.vocab_size=64", "data.seq_len=16", "train.batch_tokens=64",
                             "train.micro_batch_seqs=4", "train.max_steps=50", "train.log_every=100",
                             "train.time_budget_s=1.0", "train.schedule=time"])
    torch.manual_seed(0)
    model = GPT(cfg.model)
    clock = [100.0]

    class FakeTime:
        @staticmethod
        def perf_counter():
            return clock[0]

    def three_tenths(*args, **kwargs):
        clock[0] += 0.3
        return torch.tensor(1.0)
    monkeypatch.setattr(trainer, "time", FakeTime)
    monkeypatch.setattr(trainer, "train_step", three_tenths)
    result = run_training(cfg, model, model, RandomLoader(), build_optimizers(model.param_groups(), cfg.optim),
                          None, DistInfo(0, 0, 1, torch.device("cpu")), RunLog(tmp_path / "l.txt", enabled=False))
    assert result.stopped_by == "time_budget" and result.steps == 3
    assert result.train_time_s == pytest.approx(0.9) and result.train_time_s <= 1.0


@pytest.mark.parametrize("cores, load, threads", [(2, 0.05, 2), (2, 1.1, 1), (2, 3.0, 1), (16, 3.4, 13), (1, 0, 1)])
def test_a_cpu_run_takes_the_cores_other_processes_leave_free(monkeypatch, cores, load, threads):
    """The demo on a shared 2-core machine with two threads took 5 min 40 s where its README said ~2 min; with one
    thread on a quiet one it ran a third fewer steps. run_demo.sh now sets OMP_NUM_THREADS from the free cores."""
    import os

    from training import distributed
    assert 0.0 <= distributed.busy_cores(0.05) <= (os.cpu_count() or 1) + 0.01  # a reading of this machine
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    monkeypatch.setattr(distributed, "busy_cores", lambda: load)
    assert distributed.free_cpu_threads() == threads
    from conftest import REPO
    script = (REPO / "scripts/run_demo.sh").read_text()
    assert 'if [ -z "${OMP_NUM_THREADS:-}" ]' in script and "free_cpu_threads()" in script
