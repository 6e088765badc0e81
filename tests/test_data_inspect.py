"""`python -m data.inspect`: one JSON line per shard; a clear non-zero exit on a damaged shard."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from data.shards import BOS_ID, write_shard

ROOT = Path(__file__).resolve().parents[1]


def run_inspect(*args):
    return subprocess.run([sys.executable, "-m", "data.inspect", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True)


def test_prints_one_json_line_per_shard(tmp_path):
    write_shard(tmp_path / "a.bin", [BOS_ID, 5, 9, BOS_ID, 300])
    write_shard(tmp_path / "b.bin", np.array([BOS_ID, 2], dtype=np.uint16))
    out = run_inspect(tmp_path / "a.bin", tmp_path / "b.bin", "--vocab-size", 301)
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert lines == [{"path": str(tmp_path / "a.bin"), "tokens": 5, "docs": 2, "max_id": 300},
                     {"path": str(tmp_path / "b.bin"), "tokens": 2, "docs": 1, "max_id": 2}]


def test_damaged_shards_exit_nonzero_naming_the_file(tmp_path):
    write_shard(tmp_path / "good.bin", [BOS_ID, 5])
    data = (tmp_path / "good.bin").read_bytes()
    (tmp_path / "truncated.bin").write_bytes(data[:-1])
    (tmp_path / "oversized.bin").write_bytes(data + b"\x00\x00")
    (tmp_path / "corrupt.bin").write_bytes(b"\xff" * len(data))
    for name, what in [("truncated", "truncated"), ("oversized", "oversized"), ("corrupt", "magic")]:
        out = run_inspect(tmp_path / "good.bin", tmp_path / f"{name}.bin")
        assert out.returncode == 1
        assert f"{name}.bin" in out.stderr and what in out.stderr and "Traceback" not in out.stderr
        assert json.loads(out.stdout.splitlines()[0])["tokens"] == 2  # the good shard was still reported
    out = run_inspect(tmp_path / "good.bin", "--vocab-size", 5)
    assert out.returncode == 1 and "not below vocab_size 5" in out.stderr
    out = run_inspect(tmp_path)  # a folder: a traceback (IsADirectoryError) before
    assert out.returncode == 1 and "Is a directory (hint: give shard files" in out.stderr and "Traceback" not in out.stderr


def test_a_quoted_glob_is_expanded_like_the_configs_patterns(tmp_path):
    write_shard(tmp_path / "fineweb_train_000000.bin", [BOS_ID, 5])
    write_shard(tmp_path / "fineweb_train_000001.bin", [BOS_ID, 6, 7])
    out = run_inspect(f"{tmp_path}/fineweb_train_*.bin")
    assert out.returncode == 0, out.stderr
    assert [json.loads(line)["tokens"] for line in out.stdout.splitlines()] == [2, 3]
    out = run_inspect(f"{tmp_path}/fineweb_val_*.bin")
    assert out.returncode == 1 and "no shard files match" in out.stderr
