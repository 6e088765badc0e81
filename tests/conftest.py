"""Fixtures shared by several test files, and the session's Triton mode."""
import json
import os
import socket
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # One Triton mode for the whole session, set before any test module imports triton: Triton makes
    # each @triton.jit function (its own standard library's included) interpreted or compiled when it
    # is decorated, so a module that imported triton first would leave the interpreter half built.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from data.demo import make_demo


@contextmanager
def started(commands: list[list[str]]):
    """Processes run side by side (a tiny run is mostly one core's Python), their stderr piped; yields them. Any
    still running when the block ends, a failed assertion's included, is stopped: none is left behind."""
    procs = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for cmd in commands]
    try:
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


@pytest.fixture
def free_port() -> int:
    """A TCP port free on this machine now: MASTER_PORT for the multi-process (gloo) tests."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def fail_at_call(monkeypatch):
    """fail_at_call(owner, name, n, error): `owner.name` raises `error` at its n-th call and runs the real function at
    the others, to stop a routine midway (a crash between two renames, a kill between two shards). Returns the list
    of the calls' first arguments; clearing it counts the calls from zero again."""
    def install(owner, name: str, n: int, error: BaseException) -> list:
        real, calls = getattr(owner, name), []

        def fails_at_nth(*args, **kwargs):
            calls.append(args[0] if args else None)
            if len(calls) == n:
                raise error
            return real(*args, **kwargs)
        monkeypatch.setattr(owner, name, fails_at_nth)
        return calls
    return install


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory) -> Path:
    """A small demo corpus (train/val shards, tokenizer, manifest), built once per test session."""
    out = tmp_path_factory.mktemp("demo")
    make_demo(out, seed=0, train_docs=1500, val_docs=40)
    return out


REPO = Path(__file__).resolve().parents[1]
TINY_SEEDS = (7, 8)


@pytest.fixture(scope="session")
def tiny_checkpoint(demo_dir, tmp_path_factory) -> tuple[Path, list[str]]:
    """A 6-step tiny run's final checkpoint and the overrides it trained with, for the tools that read a trained
    model's weights (scripts.bench_quant, scripts.bench_lowrank); trained once per test session, never written to."""
    import train
    from test_train import tiny_overrides
    tmp = tmp_path_factory.mktemp("ckpt")
    overrides = [*tiny_overrides(demo_dir, tmp), "train.max_steps=6", "train.checkpoint_every=6"]
    train.main(["--config", str(REPO / "configs/demo.toml"), *overrides])
    return tmp / "runs" / "checkpoints" / "tiny" / "step_00000006", overrides


TINY_BUDGET = 30_000  # bytes for the tiny model's artifact: the finest grids take ~35.4k, so the allocation coarsens


def tiny_run_overrides(data: Path, tmp: Path) -> list[str]:
    """test_train's tiny CPU run, shortened further (4 steps, evals every 2), without its fixed run id, scored on
    every validation token as a record must be (the small demo's ~9k), under a cap that binds as a real run's does:
    the allocator then fills a budget that depends on the counted code, which a record must pin."""
    from test_train import tiny_overrides
    from training.shipped_code import code_bytes
    cap = code_bytes() + 20_000 + TINY_BUDGET  # the code, the default margin, the budget
    return [o for o in tiny_overrides(data, tmp) if not o.startswith("train.run_id=")] + [
        "train.max_steps=4", "train.log_every=2", "eval.every_steps=2", "eval.max_tokens=0",
        "optim.warmup_steps=2", f"quant.cap_bytes={cap}"]


@dataclass
class TinyRuns:
    exit_code: int
    root: Path                 # logs/ and runs/ of the runs, and sub/submission.json
    logs: list[Path]
    submission: dict


@pytest.fixture(scope="session")
def tiny_seed_runs(demo_dir, tmp_path_factory) -> TinyRuns:
    """Two real seeds of the tiny config run through scripts.reproduce (about 25 s on 2 cores)."""
    from scripts import reproduce
    root = tmp_path_factory.mktemp("seeds")
    code = reproduce.main(["--config", str(REPO / "configs/demo.toml"), "--seeds", ",".join(map(str, TINY_SEEDS)),
                           "--name", "tiny run", "--github-id", "tester", "--out", str(root / "sub"),
                           "--", *tiny_run_overrides(demo_dir, root)])
    submission = root / "sub" / "submission.json"
    return TinyRuns(code, root, [root / "logs" / f"tiny-run-s{s}.txt" for s in TINY_SEEDS],
                    json.loads(submission.read_text()) if submission.exists() else {})


class FakeWandb:
    """Stands in for the wandb module and its run: records init's arguments, the logged metrics, the summary
    and whether the run finished."""

    def __init__(self):
        self.inits, self.logged, self.summary, self.finished = [], [], {}, False

    def init(self, **kwargs):
        self.inits.append(kwargs)
        return self

    def log(self, data, step=None):
        self.logged.append((step, data))

    def finish(self):
        self.finished = True
