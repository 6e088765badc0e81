"""scripts/bench_step.py runs every variant end to end (tiny model on CPU; timings are not asserted)."""
import math

import pytest

from scripts import bench_step


def test_every_variant_runs_and_reports(capsys):
    tiny = ["model.n_layers=1", "model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1", "data.seq_len=16",
            "train.batch_tokens=64", "train.micro_batch_seqs=4", "train.compile=false"]
    rows = bench_step.main(["--config", str(bench_step.REPO / "configs/demo.toml"), "--steps", "2", "--warmup", "1",
                            "--variants", "all", *tiny])
    assert [r["variant"] for r in rows] == list(bench_step.VARIANTS)
    assert all(r["tok_s"] > 0 and math.isfinite(r["loss"]) for r in rows)
    params = {r["variant"]: r["params"] for r in rows}
    assert params["n4-kernels"] > params["n4-block-kernels"] > params["n2-block-kernels"] > params["n1-kernels"]
    assert capsys.readouterr().out.count("\n| n") == len(bench_step.VARIANTS)


def test_default_variants_are_the_kernels_on_off_grid():
    assert bench_step.DEFAULT_VARIANTS == ("n4-kernels", "n4-ref", "n1-kernels", "n1-ref")


def test_unknown_variant_is_refused():
    with pytest.raises(SystemExit):
        bench_step.main(["--variants", "n3-fast"])
