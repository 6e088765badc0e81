"""Ranks whose clocks disagree, or where a signal reaches one rank only (before or after the step's
agreement), still stop and checkpoint at the same step, train with the same learning rates and hold
identical weights (2 gloo processes, the real loop)."""
import json
import os
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from model.gpt import GPT
from training import trainer
from training.checkpoint import Checkpointer, complete_checkpoints
from training.config import load_config
from training.distributed import RankAgreement, destroy, init_distributed, require_same_on_every_rank
from training.optim import build_optimizers
from training.run_log import RunLog

SKEW = 1.6  # rank 1's clock runs 60% fast: alone, it would stop after ~1/1.6 of rank 0's steps
TICK = 0.1  # seconds of training clock a read of it adds on rank 0


class TickingTime:
    """Stands in for the `time` module inside training.trainer: a clock that advances rate × TICK at each read rather
    than with the wall clock, so that the number of steps a budget holds is the same however loaded the machine is
    (on the wall clock, a slow first step alone can fill the budget)."""

    def __init__(self, rate: float):
        self.rate, self.reads = rate, 0

    def perf_counter(self) -> float:
        self.reads += 1
        return self.rate * TICK * self.reads


class RankLoader:
    def __init__(self, rank: int):
        self.g = torch.Generator().manual_seed(rank)

    def next_batch(self):
        ids = torch.randint(0, 64, (2, 17), generator=self.g)
        return ids[:, :-1], ids[:, 1:]

    def state_dict(self):
        return {}


class Recorder:
    """The step function, recording the learning rate each optimizer step used; on `signal_rank`
    it raises the checkpointer's stop request at call `signal_at` (as SIGTERM's handler would)."""

    def __init__(self, model, optimizers, checkpointer=None, signal_at=None):
        self.model, self.optimizers, self.checkpointer, self.signal_at = model, optimizers, checkpointer, signal_at
        self.lrs, self.calls = [], 0

    def __call__(self, x, y):
        self.calls += 1
        self.lrs.append(self.optimizers[0].param_groups[0]["lr"])
        if self.calls == self.signal_at:
            self.checkpointer.stop_requested = True
        return self.model(x, y)


class LateSignal(RankAgreement):
    """A signal that lands right after the ranks agreed (on call `at`): this step's decisions must
    ignore it on this rank too, and all ranks act on it at the next step."""

    def __init__(self, world: int, checkpointer: Checkpointer, at: int):
        super().__init__(world)
        self.checkpointer, self.at, self.calls = checkpointer, at, 0

    def __call__(self, now: float, stop: bool) -> tuple[float, bool]:
        agreed = super().__call__(now, stop)
        self.calls += 1
        if self.calls == self.at:
            self.checkpointer.stop_requested = True
        return agreed


# The same failure paths over NCCL where two GPUs are visible (the default is gloo on CPU).
TWO_GPUS = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]


def join_env(rank: int, world: int, port: int) -> None:
    """The environment torchrun gives a worker."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


HUNG_S = 900  # ranks that both still run this long after the spawn wait for each other (no test's pair runs so long)


def join_or_fail(ranks, seconds: float, message: str) -> None:
    """Wait for spawned ranks; where one waits in a collective the other left, fail the test instead of hanging.
    `seconds` counts from the first rank's exit, not from the spawn: a rank still running that long after its peer
    left is waiting for it, while on a loaded machine ranks that are merely slow take longer than any fixed time from
    the spawn."""
    start, first_exit = time.time(), None
    while not ranks.join(timeout=1):
        now = time.time()
        if first_exit is None and any(proc.exitcode is not None for proc in ranks.processes):
            first_exit = now
        if now - start > HUNG_S or (first_exit is not None and now - first_exit > seconds):
            for proc in ranks.processes:
                proc.kill()
            pytest.fail(message)


def write_outcome(path: Path, run) -> None:
    """What `run` returned, or the exception it raised as 'Type: message', into `path`; the group is left either way."""
    try:
        outcome = run()
    except Exception as e:
        outcome = f"{type(e).__name__}: {e}"
    finally:
        destroy()
    path.write_text(outcome)


def tiny(extra: list[str]):
    cfg = load_config(None, ["model.n_layers=1", "model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1",
                             "model.vocab_size=64", "data.seq_len=16", "train.batch_tokens=64",
                             "train.micro_batch_seqs=2", "train.log_every=1000", *extra])
    torch.manual_seed(0)
    model = GPT(cfg.model)
    return cfg, model, build_optimizers(model.param_groups(), cfg.optim)


def worker(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    join_env(rank, world, port)
    info = init_distributed("cpu")
    log = RunLog(os.path.join(out_dir, f"log{rank}.txt"), enabled=False)
    out = {}
    try:
        trainer.time = TickingTime(SKEW if rank == 1 else 1.0)
        # 1. A wall-clock budget with a time-driven schedule.
        # A checkpointer whose period is never reached: only the final checkpoint is written.
        cfg, model, opts = tiny(["train.max_steps=100000", "train.schedule=time", "train.time_budget_s=3",
                                 "optim.warmup_steps=0"])  # the LR then follows the clock alone
        step = Recorder(model, opts)
        ckpt = Checkpointer(Path(out_dir) / "final", every_steps=10**6, keep=2, rank=rank, world_size=world)
        result = trainer.run_training(cfg, model, step, RankLoader(rank), opts, None, info, log, checkpointer=ckpt)
        out["budget"] = dict(steps=result.steps, stopped_by=result.stopped_by, lrs=step.lrs,
                             weights=[p.detach().double().sum().item() for p in model.parameters()])
        # 2. A stop request that reaches rank 1 only, at its 4th step.
        cfg, model, opts = tiny(["train.max_steps=40", "train.schedule=steps"])
        ckpt = Checkpointer(Path(out_dir) / "ckpt", every_steps=0, keep=2, rank=rank, world_size=world)
        step = Recorder(model, opts, ckpt, signal_at=4 if rank == 1 else None)
        result = trainer.run_training(cfg, model, step, RankLoader(rank), opts, None, info, log, checkpointer=ckpt)
        out["signal"] = dict(steps=result.steps, stopped_by=result.stopped_by)
        # 3. A stop request that reaches rank 1 right after the 4th agreement (the end of step 3).
        cfg, model, opts = tiny(["train.max_steps=40", "train.schedule=steps"])
        ckpt = Checkpointer(Path(out_dir) / "late", every_steps=0, keep=2, rank=rank, world_size=world)
        if rank == 1:
            trainer.RankAgreement = lambda world: LateSignal(world, ckpt, at=4)
        result = trainer.run_training(cfg, model, Recorder(model, opts), RankLoader(rank), opts, None, info, log,
                                      checkpointer=ckpt)
        out["late_signal"] = dict(steps=result.steps, stopped_by=result.stopped_by)
    finally:
        trainer.time = time
        trainer.RankAgreement = RankAgreement
        destroy()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)



def test_ranks_agree_on_the_clock_and_on_stop_requests(tmp_path, free_port):
    ranks = mp.spawn(worker, args=(2, free_port, str(tmp_path)), nprocs=2, join=False)
    join_or_fail(ranks, 150, "the ranks hung: they disagreed on when to stop (a rank waits in a collective alone)")
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    budget0, budget1 = r0["budget"], r1["budget"]
    assert budget0["stopped_by"] == budget1["stopped_by"] == "time_budget"
    assert budget0["steps"] == budget1["steps"] >= 3
    assert budget0["lrs"] == budget1["lrs"]                      # the same schedule, step by step
    assert budget0["lrs"][-1] < budget0["lrs"][0]                # and it decayed with the (agreed) clock
    assert budget0["weights"] == budget1["weights"]              # replicated weights stayed identical
    final = complete_checkpoints(tmp_path / "final")
    assert [c.name for c in final] == [f"step_{budget0['steps']:08d}"]  # the run's end, saved by both ranks
    assert sorted(p.name for p in final[0].glob("rank*.pt")) == ["rank0.pt", "rank1.pt"]
    assert r0["signal"] == r1["signal"] == {"steps": 4, "stopped_by": "signal"}
    assert r0["late_signal"] == r1["late_signal"] == {"steps": 4, "stopped_by": "signal"}
    assert [c.name for c in complete_checkpoints(tmp_path / "late")] == ["step_00000004"]
    saved = complete_checkpoints(tmp_path / "ckpt")
    assert [c.name for c in saved] == ["step_00000004"]
    assert sorted(p.name for p in saved[0].glob("rank*.pt")) == ["rank0.pt", "rank1.pt"]


class WandbWithoutNetwork:
    """The wandb module as it behaves online with no route to its server: init raises."""

    def init(self, **kwargs):
        raise ConnectionError("could not reach api.wandb.ai")


def demo_argv(data: str, out_dir: str, run_id: str, device: str = "cpu") -> list[str]:
    """train.py's arguments for the demo config (gloo on cpu, NCCL on cuda), on the corpus in `data`, writing under
    `out_dir`."""
    repo = Path(__file__).resolve().parents[1]
    return ["--config", str(repo / "configs/demo.toml"), f"train.device={device}", "train.micro_batch_seqs=16",
            f"data.train_files={data}/fineweb_train_*.bin", f"data.val_files={data}/fineweb_val_*.bin",
            f"data.tokenizer={data}/tokenizer.model", f"train.log_dir={out_dir}/logs", f"train.out_dir={out_dir}/runs",
            f"train.run_id={run_id}"]


TINY_STEPS = ["train.max_steps=4", "train.time_budget_s=0", "train.schedule=steps", "model.n_layers=1",
              "model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1"]


def setup_worker(rank: int, world: int, port: int, data: str, out_dir: str, fault: str, device: str = "cpu") -> None:
    """train.main on one of two ranks, with a step that rank 0 alone runs made to fail: the validation byte audit
    (fault="audit") or wandb.init (fault="wandb")."""
    torch.set_num_threads(1)
    join_env(rank, world, port)
    import sys

    import train
    import training.evaluate
    argv = demo_argv(data, out_dir, "setup", device)
    if fault == "audit":
        training.evaluate.audit_bytes = lambda tokens, sp, lut: (1, 2)
    elif fault == "wandb":
        sys.modules["wandb"] = WandbWithoutNetwork()
        argv.append("train.wandb=true")
    elif fault == "load":  # rank 1's part of the checkpoint it resumes from is damaged
        from training.checkpoint import CheckpointError, Resumed

        def load(path, *args):
            if rank == 1:
                raise CheckpointError(f"{path}/rank1.pt: damaged")
            return Resumed(step=4, train_time_s=1.0)
        train.load_checkpoint = load
        argv += ["train.resume=latest"]
    else:  # "nan": rank 1's share of the batch gives a NaN loss from step 2 on
        import training.trainer
        real_step = training.trainer.train_step

        def step(*args, **kwargs):
            loss = real_step(*args, **kwargs)  # the real step: the ranks' collectives stay matched
            step.calls += 1
            return loss * float("nan") if rank == 1 and step.calls >= 2 else loss
        step.calls = 0
        training.trainer.train_step = step
        argv += [*TINY_STEPS, "train.log_every=2"]
    write_outcome(Path(out_dir, f"setup{rank}.txt"), lambda: train.main(argv) and "trained")


@pytest.mark.parametrize("fault, rank0_says, step", [
    ("audit", "ByteAuditError: byte accounting mismatch on ", "its setup checks"),
    ("wandb", "ConfigError: train.wandb=true but wandb.init failed (ConnectionError: could not reach api.wandb.ai) "
              "(hint: WANDB_MODE=offline", "wandb.init"),
], ids=["audit", "wandb"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=TWO_GPUS)])
def test_a_rank_that_fails_at_setup_stops_every_rank(demo_dir, tmp_path, free_port, fault, rank0_says, step, device):
    """Rank 0's byte audit (or its wandb.init) fails. Rank 1 used to go on to its first collective and fail there
    once rank 0's process had gone (gloo: "Connection closed by peer ... typically caused by a remote worker
    crashing"), with a run log opened. Both now stop at setup, each with a message, and no run log is left."""
    ranks = mp.spawn(setup_worker, args=(2, free_port, str(demo_dir), str(tmp_path), fault, device), nprocs=2,
                     join=False)
    join_or_fail(ranks, 120, f"rank 1 did not stop when rank 0 failed {step}")
    assert (tmp_path / "setup0.txt").read_text().startswith(rank0_says)
    assert (tmp_path / "setup1.txt").read_text() == \
        f"RankFailed: stopped: another rank failed {step} (its own message says why)"
    assert not list(tmp_path.glob("logs/*"))  # the setup check may have made the folder, but no run log is in it


def test_a_checkpoint_part_that_fails_to_load_on_one_rank_stops_every_rank(demo_dir, tmp_path, free_port):
    """Rank 0 went on to the trainer's first collective and waited there for the rank that had failed (gloo's connect
    timeout is 30 minutes; torchrun killed it after its grace period, without a message)."""
    (tmp_path / "runs" / "checkpoints" / "setup" / "step_00000004").mkdir(parents=True)
    ranks = mp.spawn(setup_worker, args=(2, free_port, str(demo_dir), str(tmp_path), "load"), nprocs=2, join=False)
    join_or_fail(ranks, 120, "rank 0 did not stop when rank 1 failed to load its checkpoint part")
    where = tmp_path / "runs" / "checkpoints" / "setup" / "step_00000004"
    assert (tmp_path / "setup1.txt").read_text() == f"CheckpointError: {where}/rank1.pt: damaged"
    assert (tmp_path / "setup0.txt").read_text() == \
        f"RankFailed: stopped: another rank failed to load its part of {where} (its own message says why)"


def test_a_nan_loss_on_one_ranks_share_stops_every_rank_named(demo_dir, tmp_path, free_port):
    """Each rank checked its own share's loss: the rank whose share went NaN stopped alone, and the others failed in
    their next collective with a transport error. The checked (and logged) loss is now the global batch's."""
    ranks = mp.spawn(setup_worker, args=(2, free_port, str(demo_dir), str(tmp_path), "nan"), nprocs=2, join=False)
    join_or_fail(ranks, 240, "a rank did not stop when another's loss went NaN")
    for rank in range(2):
        assert (tmp_path / f"setup{rank}.txt").read_text().startswith("DivergenceError: loss is nan at step 2 ")


def scoring_stop_worker(rank: int, world: int, port: int, data: str, out_dir: str, resume: bool,
                        device: str = "cpu") -> None:
    """train.main on one of two ranks; unless resuming, rank 1 alone gets SIGTERM as its pre-quant evaluation ends."""
    torch.set_num_threads(1)
    join_env(rank, world, port)
    import os
    import signal

    import train
    argv = [*demo_argv(data, out_dir, "cut", device), *TINY_STEPS, "eval.max_tokens=2000", "quant.method=rtn",
            "quant.calib_seqs=2", *(["train.resume=latest"] if resume else [])]
    real = train.evaluate_bpb

    def evaluate_then_signal(*args, **kwargs):
        out = real(*args, **kwargs)
        if rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return out
    if not resume:
        train.evaluate_bpb = evaluate_then_signal
    try:
        outcome = f"final steps {train.main(argv)['steps']}"
    except SystemExit as e:
        outcome = f"exit {e.code}"
    finally:
        destroy()
    Path(out_dir, f"{'resume' if resume else 'cut'}{rank}.txt").write_text(outcome)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=TWO_GPUS)])
def test_a_signal_on_one_rank_while_the_run_is_scored_stops_both_and_resume_scores_it(demo_dir, tmp_path, free_port,
                                                                                      device):
    """Several ranks: the trained state is checkpointed (both parts) before scoring, a signal that reaches one rank
    stops both at the next phase (they agree), and train.resume=latest on both scores it without a step."""
    ranks = mp.spawn(scoring_stop_worker, args=(2, free_port, str(demo_dir), str(tmp_path), False, device), nprocs=2,
                     join=False)
    join_or_fail(ranks, 240, "a rank did not stop when the other got a signal while the run was scored")
    assert [(tmp_path / f"cut{r}.txt").read_text() for r in range(2)] == ["exit 143", "exit 143"]
    log = (tmp_path / "logs" / "cut.txt").read_text()
    assert "stopped by a signal before the export: the trained state is checkpoint " in log
    kept = tmp_path / "runs" / "checkpoints" / "cut" / "step_00000004"
    assert sorted(p.name for p in kept.iterdir()) == ["rank0.pt", "rank1.pt"]
    import socket
    with socket.socket() as sock:  # a port of its own for the second group
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ranks = mp.spawn(scoring_stop_worker, args=(2, port, str(demo_dir), str(tmp_path), True, device), nprocs=2,
                     join=False)
    join_or_fail(ranks, 240, "the resumed ranks did not score the checkpoint")
    assert [(tmp_path / f"resume{r}.txt").read_text() for r in range(2)] == ["final steps 4"] * 2
    assert "the checkpoint's training is finished (step 4" in (tmp_path / "logs" / "cut.txt").read_text()


def export_worker(rank: int, world: int, port: int, data: str, out_dir: str) -> None:
    """training.export.export_model on two ranks, with rank 0's export failing unexpectedly (a full disk, say)."""
    torch.set_num_threads(1)
    join_env(rank, world, port)
    from training import export

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")
    export.export_artifact = disk_full
    init_distributed("cpu")
    cfg, model, _ = tiny(["model.vocab_size=512", "quant.calib_seqs=2"])
    train_files = sorted(map(str, Path(data).glob("fineweb_train_*.bin")))

    def run() -> str:
        report = export.export_model(cfg, model, train_files=train_files, rank=rank, world_size=world,
                                     log=RunLog(None, enabled=False), artifact_path=Path(out_dir) / "a.mhcg",
                                     tokenizer_sha256="x", device=torch.device("cpu"), train_time_s=0.0)
        return f"report: {report['export_error']}"
    write_outcome(Path(out_dir, f"export{rank}.txt"), run)


def test_an_unexpected_export_failure_on_rank_0_reaches_every_rank(demo_dir, tmp_path, free_port):
    """Rank 0 alone exports while the others wait for its report: an error there other than BudgetError used to
    leave them in that broadcast, which failed once rank 0's process had gone (gloo: "Connection closed by peer").
    They now get the error as the export_error, and rank 0 raises it."""
    ranks = mp.spawn(export_worker, args=(2, free_port, str(demo_dir), str(tmp_path)), nprocs=2, join=False)
    join_or_fail(ranks, 120, "rank 1 kept waiting for the artifact after rank 0's export failed")
    assert (tmp_path / "export0.txt").read_text() == "OSError: [Errno 28] No space left on device"
    assert (tmp_path / "export1.txt").read_text() == "report: OSError: [Errno 28] No space left on device"


def shard_list_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    join_env(rank, world, port)
    init_distributed("cpu")
    files = ["a.bin", "b.bin"][:2 - rank]  # rank 1's node lacks b.bin
    write_outcome(Path(out_dir, f"files{rank}.txt"),
                  lambda: require_same_on_every_rank(files, "training shards", "the same data everywhere") or "same")


def test_ranks_that_see_different_shards_all_stop(tmp_path, free_port):
    """A node with only some of the shards used to train on other data than the rest, silently."""
    ranks = mp.spawn(shard_list_worker, args=(2, free_port, str(tmp_path)), nprocs=2, join=False)
    join_or_fail(ranks, 60, "the ranks hung comparing their shard lists")
    for rank in range(2):
        assert (tmp_path / f"files{rank}.txt").read_text() == \
            "ConfigError: rank 1 sees other training shards than rank 0 (hint: the same data everywhere)"


def checkpoint_worker(rank: int, world: int, port: int, out_dir: str, fault: str = "write") -> None:
    """Checkpointer.save on two ranks, where rank 1's disk is full (fault="write") or rank 0 cannot rename the
    finished folder into place (fault="publish")."""
    torch.set_num_threads(1)
    join_env(rank, world, port)
    init_distributed("cpu")
    if rank == 1 and fault == "write":
        def disk_full(*args, **kwargs):
            raise OSError(28, "No space left on device")
        torch.save = disk_full
    if rank == 0 and fault == "publish":
        def not_allowed(tmp, final):
            raise PermissionError(f"cannot rename {tmp.name}")
        Checkpointer._publish = staticmethod(not_allowed)
    model = torch.nn.Linear(2, 2)
    loader = type("Loader", (), {"state_dict": lambda self: {"position": 0}})()
    ckpt = Checkpointer(Path(out_dir) / "ckpt", every_steps=1, keep=2, rank=rank, world_size=world)
    write_outcome(Path(out_dir, f"ckpt{rank}.txt"), lambda: str(ckpt.save(3, 1.0, model, [], None, loader)))


def test_a_checkpoint_part_that_fails_on_one_rank_stops_every_rank(tmp_path, free_port):
    """The ranks used to meet in a barrier after writing their parts: one rank failing alone left the others there.
    Now every rank stops at once, with the failing rank's own error and RankFailed elsewhere, and the half-written
    folder is gone."""
    ranks = mp.spawn(checkpoint_worker, args=(2, free_port, str(tmp_path)), nprocs=2, join=False)
    join_or_fail(ranks, 120, "rank 0 did not stop when rank 1 failed to write its checkpoint part")
    assert (tmp_path / "ckpt1.txt").read_text() == "OSError: [Errno 28] No space left on device"
    assert (tmp_path / "ckpt0.txt").read_text() == ("RankFailed: stopped: another rank failed to write its part of "
                                                    "checkpoint step_00000003 (its own message says why)")
    assert list((tmp_path / "ckpt").iterdir()) == []


def test_a_checkpoint_that_rank_0_cannot_publish_stops_every_rank_and_leaves_no_parts(tmp_path, free_port):
    """Rank 0 renames the finished folder into place while the others wait: a failure there left them in a barrier,
    and (once it stopped every rank) left every rank's part behind in step_*.tmp."""
    ranks = mp.spawn(checkpoint_worker, args=(2, free_port, str(tmp_path), "publish"), nprocs=2, join=False)
    join_or_fail(ranks, 120, "rank 1 did not stop when rank 0 failed to publish the checkpoint")
    assert (tmp_path / "ckpt0.txt").read_text() == "PermissionError: cannot rename step_00000003.tmp"
    assert (tmp_path / "ckpt1.txt").read_text() == ("RankFailed: stopped: another rank failed to publish checkpoint "
                                                    "step_00000003 (its own message says why)")
    assert list((tmp_path / "ckpt").iterdir()) == []
