"""scripts/bench_step.py runs every variant end to end (tiny model on CPU; timings are not asserted)."""
import math
import os
import subprocess
import sys

import pytest

from scripts import bench_step

TINY = ["model.n_layers=1", "model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1", "data.seq_len=16",
        "train.batch_tokens=64", "train.micro_batch_seqs=4", "train.compile=false"]


@pytest.mark.slow  # ~70 s on 2 cores: the kernel variants run their Triton kernels in the interpreter
def test_every_variant_runs_and_reports(capsys):
    rows = bench_step.main(["--config", str(bench_step.REPO / "configs/demo.toml"), "--steps", "2", "--warmup", "1",
                            "--variants", "all", *TINY])
    assert [r["variant"] for r in rows] == list(bench_step.VARIANTS)
    assert all(r["tok_s"] > 0 and math.isfinite(r["loss"]) for r in rows)
    params = {r["variant"]: r["params"] for r in rows}
    assert params["n4-kernels"] > params["n4-block-kernels"] > params["n2-block-kernels"] > params["n1-kernels"]
    assert capsys.readouterr().out.count("\n| n") == len(bench_step.VARIANTS)
    assert all(r["ranks"] == 1 for r in rows)


def test_torchrun_times_the_distributed_step_and_reports_once():
    """2 gloo ranks, each a micro-batch of the global batch (as train.py splits it); rank 0 prints."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(bench_step.REPO / "scripts/bench_step.py"), "--config", str(bench_step.REPO / "configs/demo.toml"),
           "--steps", "2", "--warmup", "1", "--variants", "n1-ref", *TINY, "train.batch_tokens=128"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| n1-ref |")]
    assert len(rows) == 1, done.stdout  # printed by rank 0 only
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert cells[1] == "2" and float(cells[4].replace(",", "")) > 0  # ranks, tokens/s


def test_default_variants_are_the_kernels_on_off_grid():
    assert bench_step.DEFAULT_VARIANTS == ("n4-kernels", "n4-ref", "n1-kernels", "n1-ref")


def test_unknown_variant_is_refused():
    with pytest.raises(SystemExit):
        bench_step.main(["--variants", "n3-fast"])
