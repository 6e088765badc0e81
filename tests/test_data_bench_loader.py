"""scripts/bench_loader.py runs end to end on tiny inputs and reports what it claims to measure."""
import numpy as np
import pytest
import torch

from data.shards import write_shard
from scripts.bench_loader import main


def test_bench_on_synthetic_shards(capsys):
    row = main(["--device", "cpu", "--seq-len", "64", "--batch-seqs", "4", "--steps", "20", "--step-ms", "2",
                "--synthetic-tokens", "20000"])
    table = capsys.readouterr().out
    assert "| cpu | 64 x 4 | 4 |" in table
    assert row["tokens_per_s"] > 0 and row["step_ms"] >= 2 and 0 <= row["wait_share"] < 1


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
