"""scripts/bench_quant.py: one checkpoint re-quantized under several [quant] settings, each artifact scored."""
import json

import pytest

from conftest import REPO
from quant.container import load_artifact
from scripts import bench_quant
from test_train import tiny_overrides


@pytest.fixture(scope="module")
def checkpoint(demo_dir, tmp_path_factory):
    import train
    tmp = tmp_path_factory.mktemp("bq")
    overrides = [*tiny_overrides(demo_dir, tmp), "train.max_steps=6", "train.checkpoint_every=6"]
    train.main(["--config", str(REPO / "configs/demo.toml"), *overrides])
    return tmp / "runs" / "checkpoints" / "tiny" / "step_00000006", overrides


def test_variants_share_the_weights_and_differ_in_what_they_ship(checkpoint, tmp_path, capsys):
    ckpt, overrides = checkpoint
    out = tmp_path / "bq.json"
    code = bench_quant.main(["--config", str(REPO / "configs/demo.toml"), "--checkpoint", str(ckpt),
                             "--variant", "phi8=quant.phi_bits=8 quant.table_bits=6", "--variant", "phi4=quant.phi_bits=4 quant.method=rtn quant.allocator=lagrangian quant.error_weight=fisher",
                             "--keep", str(tmp_path), "--out", str(out), "--", *overrides])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["weights"] == "ema"
    rows = {r["variant"]: r for r in result["rows"]}
    assert rows["phi8"]["phi_bits"] == 8 and rows["phi4"]["phi_bits"] == 4
    # the export's own report: a config key that did not reach export_artifact would show its default here
    assert [rows["phi8"][k] for k in ("method", "allocator", "error_weight")] == ["gptq", "rank", "output"]
    assert [rows["phi4"][k] for k in ("method", "allocator", "error_weight")] == ["rtn", "lagrangian", "fisher"]
    assert rows["phi4"]["artifact_bytes"] < rows["phi8"]["artifact_bytes"]
    for r in rows.values():
        assert (tmp_path / f"{r['variant']}.mhcg").stat().st_size == r["artifact_bytes"]
        assert r["gap"] == pytest.approx(r["val_bpb"] - result["float_val_bpb"])
    _, stored = load_artifact(tmp_path / "phi8.mhcg", stored=True)
    assert stored["embed.weight"].bits == 6 and stored["mhc.0.phi"].bits == 8  # config keys reach the artifact
    table = capsys.readouterr().out
    assert "| phi8 | gptq, rank, output |" in table and "| phi4 | rtn, lagrangian, fisher |" in table


def test_only_quant_keys_may_vary_and_the_checkpoint_must_exist(checkpoint, tmp_path, capsys):
    ckpt, overrides = checkpoint
    args = ["--config", str(REPO / "configs/demo.toml"), "--checkpoint", str(ckpt)]
    with pytest.raises(SystemExit, match=r"variant wide: changes \[model\]"):
        bench_quant.main([*args, "--variant", "wide=model.d_model=64", "--", *overrides])
    with pytest.raises(SystemExit, match="quant.phi_bits=3"):
        bench_quant.main([*args, "--variant", "bad=quant.phi_bits=3", "--", *overrides])
    with pytest.raises(SystemExit) as exit_:  # refused first: the validation shards here do not even exist
        bench_quant.main(["--config", str(REPO / "configs/demo.toml"), "--checkpoint", str(tmp_path),
                          "--variant", "a=quant.phi_bits=8", "--", *overrides, "data.val_files=/nowhere/*.bin"])
    assert exit_.value.code == 2 and f"{tmp_path}: no rank0.pt (hint: pass a step_NNNNNNNN" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="do not fit the model"):
        bench_quant.main([*args, "--variant", "a=quant.phi_bits=8", "--", *overrides, "model.d_model=64"])


def test_calibration_never_reads_a_validation_shard(checkpoint, demo_dir, tmp_path):
    """bench_quant calibrates and scores outside train.py, and skipped its checks: with data.train_files matching
    the validation shard too, calibration read validation text (found by a review). It refuses now, before loading."""
    ckpt, overrides = checkpoint
    with pytest.raises(SystemExit, match=r"bench_quant: .*fineweb_val_000000.bin is the validation shard"):
        bench_quant.main(["--config", str(REPO / "configs/demo.toml"), "--checkpoint", str(ckpt),
                          "--variant", "a=quant.phi_bits=8", "--", *overrides, f"data.train_files={demo_dir}/*.bin"])
