"""scripts/bench_quant.py: one checkpoint re-quantized under several [quant] settings, each artifact scored."""
import json

import pytest

from conftest import REPO
from quant.container import load_artifact
from scripts import bench_quant


def test_variants_share_the_weights_and_differ_in_what_they_ship(tiny_checkpoint, tmp_path, capsys):
    ckpt, overrides = tiny_checkpoint
    out = tmp_path / "bq.json"
    code = bench_quant.main(["--config", str(REPO / "configs/demo.toml"), "--checkpoint", str(ckpt),
                             "--variant", "phi8=quant.scheme=rank quant.phi_bits=8 quant.table_bits=6 "
                                          "quant.error_weight=output",
                             "--variant", "rd=quant.method=rtn",
                             "--keep", str(tmp_path), "--out", str(out), "--", *overrides])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["weights"] == "ema"
    rows = {r["variant"]: r for r in result["rows"]}
    # the export's own report: a config key that did not reach export_artifact would show its default here
    assert [rows["phi8"][k] for k in ("method", "scheme", "error_weight")] == ["gptq", "rank", "output"]
    assert [rows["rd"][k] for k in ("method", "scheme", "error_weight")] == ["rtn", "rd", "fisher"]
    assert "kinds" not in rows["phi8"] and set(rows["rd"]["kinds"]) == {"linear", "phi", "table"}
    for r in rows.values():
        assert (tmp_path / f"{r['variant']}.mhcg").stat().st_size == r["artifact_bytes"]
        assert r["gap"] == pytest.approx(r["val_bpb"] - result["float_val_bpb"])
    _, stored = load_artifact(tmp_path / "phi8.mhcg", stored=True)
    assert stored["embed.weight"].bits == 6 and stored["mhc.0.phi"].bits == 8  # config keys reach the artifact
    _, stored = load_artifact(tmp_path / "rd.mhcg", stored=True)
    assert {stored[n].family for n in stored if n.endswith(".phi")} <= {"std", "weighted"}
    table = capsys.readouterr().out
    assert "| phi8 | gptq, rank, output |" in table and "| rd | rtn, rd, fisher |" in table
    assert "| rd | table | 1 | " in table


def test_equal_bytes_gives_every_variant_the_reference_artifacts_size(tiny_checkpoint, tmp_path, capsys):
    ckpt, overrides = tiny_checkpoint
    out = tmp_path / "eq.json"
    args = ["--config", str(REPO / "configs/demo.toml"), "--checkpoint", str(ckpt),
            "--variant", "rd=quant.scheme=rd", "--variant", "rec=quant.scheme=sdclip"]
    assert bench_quant.main([*args, "--equal-bytes", "rec", "--out", str(out), "--", *overrides]) == 0
    rec, rd = json.loads(out.read_text())["rows"]  # the reference first, whatever the order given
    assert rec["variant"] == "rec" and rd["budget_bytes"] == rec["artifact_bytes"] >= rd["artifact_bytes"]
    assert rec["n_int6"] == rec["n_int5"] + rec["n_int6"] + rec["n_int4"] + rec["n_int8"]  # the records: all int6
    with pytest.raises(SystemExit, match=r"--equal-bytes nope: no such variant \(the variants: \['rd', 'rec'\]\)"):
        bench_quant.main([*args, "--equal-bytes", "nope", "--", *overrides])


def test_only_quant_keys_may_vary_and_the_checkpoint_must_exist(tiny_checkpoint, tmp_path, capsys):
    ckpt, overrides = tiny_checkpoint
    args = ["--config", str(REPO / "configs/demo.toml"), "--checkpoint", str(ckpt)]
    with pytest.raises(SystemExit, match=r"variant wide: changes \[model\]"):
        bench_quant.main([*args, "--variant", "wide=model.d_model=64", "--", *overrides])
    with pytest.raises(SystemExit, match="quant.phi_bits=3"):
        bench_quant.main([*args, "--variant", "bad=quant.scheme=rank quant.phi_bits=3", "--", *overrides])
    with pytest.raises(SystemExit) as exit_:  # refused first: the validation shards here do not even exist
        bench_quant.main(["--config", str(REPO / "configs/demo.toml"), "--checkpoint", str(tmp_path),
                          "--variant", "a=quant.scheme=rank", "--", *overrides, "data.val_files=/nowhere/*.bin"])
    assert exit_.value.code == 2 and f"{tmp_path}: no rank0.pt and not an artifact (hint: pass a step_NNNNNNNN" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit, match="do not fit the model"):
        bench_quant.main([*args, "--variant", "a=quant.scheme=rank", "--", *overrides, "model.d_model=64"])


def test_calibration_never_reads_a_validation_shard(tiny_checkpoint, demo_dir, tmp_path):
    """bench_quant calibrates and scores outside train.py, and skipped its checks: with data.train_files matching
    the validation shard too, calibration read validation text. It refuses now, before loading."""
    ckpt, overrides = tiny_checkpoint
    with pytest.raises(SystemExit, match=r"bench_quant: .*fineweb_val_000000.bin is the validation shard"):
        bench_quant.main(["--config", str(REPO / "configs/demo.toml"), "--checkpoint", str(ckpt),
                          "--variant", "a=quant.scheme=rank", "--", *overrides, f"data.train_files={demo_dir}/*.bin"])


def test_an_artifact_serves_as_the_weights(tiny_checkpoint, tmp_path):
    """Re-quantizing a shipped artifact: its dequantized weights score what the artifact scored."""
    ckpt, overrides = tiny_checkpoint
    args = ["--config", str(REPO / "configs/demo.toml")]
    assert bench_quant.main([*args, "--checkpoint", str(ckpt), "--variant", "rd=quant.scheme=rd", "--keep", str(tmp_path),
                             "--out", str(tmp_path / "a.json"), "--", *overrides]) == 0
    shipped = json.loads((tmp_path / "a.json").read_text())["rows"][0]
    again = tmp_path / "again"
    again.mkdir()
    assert bench_quant.main([*args, "--checkpoint", str(tmp_path / "rd.mhcg"), "--variant", "rd=quant.scheme=rd",
                             "--out", str(again / "b.json"), "--", *overrides]) == 0
    result = json.loads((again / "b.json").read_text())
    assert result["weights"] == "artifact" and result["float_val_bpb"] == pytest.approx(shipped["val_bpb"], abs=1e-9)
    (tmp_path / "cut.mhcg").write_bytes((tmp_path / "rd.mhcg").read_bytes()[:-1])
    with pytest.raises(SystemExit, match="cut.mhcg: truncated or padded"):
        bench_quant.main([*args, "--checkpoint", str(tmp_path / "cut.mhcg"), "--variant", "rd=quant.scheme=rd",
                          "--", *overrides])


def test_profile_writes_a_trace_of_each_export_with_its_parts_labelled(tiny_checkpoint, tmp_path, capsys):
    """--profile: one Chrome trace per variant, whose ranges name calibration's parts and every loss-probe pass (the
    unchanged model's first), and the top operators printed; a file where the folder should be is refused first."""
    ckpt, overrides = tiny_checkpoint
    args = ["--config", str(REPO / "configs/demo.toml"), "--checkpoint", str(ckpt),
            "--variant", "rd=quant.scheme=rd", "--variant", "again=quant.scheme=rd"]
    assert bench_quant.main([*args, "--profile", str(tmp_path / "prof"), "--", *overrides]) == 0
    out = capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "prof").iterdir()) == ["again.trace.json", "rd.trace.json"]
    events = json.loads((tmp_path / "prof" / "rd.trace.json").read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    passes = sorted(n for n in names if n and n.startswith("export: probe pass "))
    assert {"export: hessians", "export: fisher"} <= names and passes[0] == "export: probe pass 0" and len(passes) >= 2
    # the parts alone: every recorded operator ran inside one of them (GPTQ and the allocation were not recorded)
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name", "").startswith("export: ")]
    ops = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    assert ops and all(any(lo <= e["ts"] <= hi for lo, hi in spans) for e in ops)
    assert f"rd: profile {tmp_path / 'prof' / 'rd.trace.json'}" in out and "Self CPU" in out
    (tmp_path / "taken").write_text("a file")
    with pytest.raises(SystemExit) as exit_:
        bench_quant.main([*args, "--profile", str(tmp_path / "taken"), "--", *overrides])
    assert exit_.value.code == 2 and "--profile" in capsys.readouterr().err
