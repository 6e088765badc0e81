"""scripts/bench_loader.py runs end to end on tiny inputs and reports what it claims to measure."""
import time

import numpy as np
import pytest
import torch

from data.shards import write_shard
from scripts.bench_loader import SimulatedStep, main, training_loop


def test_bench_on_synthetic_shards(capsys):
    row = main(["--device", "cpu", "--seq-len", "64", "--batch-seqs", "4", "--steps", "20", "--step-ms", "2",
                "--synthetic-tokens", "20000"])
    table = capsys.readouterr().out
    assert "| cpu | 64 x 4 | 4 |" in table
    assert row["tokens_per_s"] > 0 and row["step_ms"] >= 2 and 0 <= row["wait_share"] < 1
    assert row["overhead_min"] <= row["overhead"] <= row["overhead_max"]
    assert "overhead vs resident batch, median (range of 5 rounds)" in table


@pytest.mark.parametrize("argv,says", [(["--steps", "0"], "--steps must be >= 5, got 0 (5 rounds"),
                                       (["--seq-len", "0"], "--seq-len must be >= 1, got 0"),
                                       (["--batch-seqs", "-2"], "--batch-seqs must be >= 1, got -2"),
                                       (["--step-ms", "-1"], "--step-ms must be >= 0, got -1.0")])
def test_bad_arguments_are_refused_by_name(argv, says, capsys):
    with pytest.raises(SystemExit) as exit_:  # --steps 0 was an UnboundLocalError
        main(argv)
    assert exit_.value.code == 2 and says in capsys.readouterr().err


def test_shards_that_do_not_exist_are_named(tmp_path):
    with pytest.raises(SystemExit, match=rf"bench_loader: no shard files match '{tmp_path}/nowhere_\*\.bin'"):
        main(["--files", str(tmp_path / "nowhere_*.bin"), "--steps", "5"])


def test_bench_on_given_files(tmp_path, capsys):
    for i in range(2):
        write_shard(tmp_path / f"s_{i}.bin", np.arange(5000) % 512)
    row = main(["--files", str(tmp_path / "s_*.bin"), "--seq-len", "32", "--batch-seqs", "2", "--steps", "5",
                "--step-ms", "1"])
    assert row["shards"] == 2 and "| cpu | 32 x 2 | 2 |" in capsys.readouterr().out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bench_on_cuda(capsys):
    row = main(["--device", "cuda", "--seq-len", "256", "--batch-seqs", "8", "--steps", "20", "--step-ms", "5",
                "--synthetic-tokens", "200000"])
    assert row["device"] == "cuda" and row["tokens_per_s"] > 0


class PacedLoader:
    """A loader whose thread makes one batch every `every_s` seconds into a queue of `depth` (a fluid model)."""

    def __init__(self, every_s: float, depth: int):
        self.every, self.depth, self.level, self.clock = every_s, depth, 0.0, time.perf_counter()

    def next_batch(self):
        now = time.perf_counter()
        self.level = min(self.depth, self.level + (now - self.clock) / self.every)
        if self.level < 1:
            time.sleep((1 - self.level) * self.every)
            self.level = 1.0
        self.level -= 1
        self.clock = time.perf_counter()
        return torch.zeros(1, 4), torch.zeros(1, 4)


def test_a_loader_slower_than_the_step_shows_its_overhead():
    """Batches a loader queues while the resident blocks run do not count as free: a loader three times slower than
    the step costs about two thirds of the loop (the rounds alone measured ~1% for such a loader)."""
    loop = training_loop(PacedLoader(0.006, 4), 20, SimulatedStep(2.0, torch.device("cpu")), torch.device("cpu"))
    assert loop["overhead"] > 0.58 and loop["wait_share"] > 0.58, loop  # 0.47 when the queued batches came free
