"""scripts.ablate: variants checked before any run, scheduled over GPU slots, real tiny CPU runs compared."""
import json
import os

import pytest

from conftest import REPO, tiny_run_overrides
from scripts import ablate

CONFIG = str(REPO / "configs/demo.toml")


def test_real_variants_run_side_by_side_and_a_failure_is_reported(demo_dir, tmp_path, capsys):
    from training.shipped_code import code_bytes
    common = [o for o in tiny_run_overrides(demo_dir, tmp_path) if not o.startswith("eval.every_steps")]
    small_cap = f"quant.cap_bytes={code_bytes() + 21000}"  # 1 kB beside the code and the margin
    out = tmp_path / "ablate.json"
    code = ablate.main(["--config", CONFIG, "--gpus", "none", "--parallel", "2", "--prefix", "t", "--out", str(out),
                        "--variant", "mhc2=model.n_streams=2 model.mhc_granularity=block",
                        "--variant", f"tiny-cap=model.n_streams=1 {small_cap}", "--", *common])
    assert code == 1  # the capped variant cannot ship
    printed = capsys.readouterr().out
    assert "[mhc2] " in printed and "[tiny-cap] " in printed and "| variant | status |" in printed
    summary = json.loads(out.read_text())
    rows = {r["variant"]: r for r in summary["runs"]}
    assert [r["variant"] for r in summary["runs"]] == ["mhc2", "tiny-cap"]
    r = rows["mhc2"]
    assert r["status"] == "ok" and r["run_id"] == "t-mhc2" and r["steps"] == 4
    assert r["overrides"] == ["model.n_streams=2", "model.mhc_granularity=block"]
    assert r["tokens_per_s"] > 0 and r["ms_per_step"] > 0 and 0 < r["val_bpb"] < 20
    assert (tmp_path / "logs" / "t-mhc2.txt").exists()
    assert rows["tiny-cap"]["status"] == "exit 1" and rows["tiny-cap"]["stdout_tail"]
    assert (tmp_path / "logs" / "t-tiny-cap.txt").exists()  # it trained side by side before its export failed
    assert summary["common"] == common


def test_variants_are_checked_before_anything_runs(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(ablate, "run_all", lambda *a: pytest.fail("nothing may run"))
    with pytest.raises(SystemExit, match="variant b: .*model.n_streams"):
        ablate.main(["--config", CONFIG, "--variant", "a=model.n_streams=1", "--variant", "b=model.n_streams=0",
                     "--", f"train.log_dir={tmp_path}"])  # no earlier run's log in the way
    with pytest.raises(SystemExit, match="must be unique"):
        ablate.main(["--config", CONFIG, "--variant", "a=", "--variant", "a=model.n_streams=1"])
    with pytest.raises(SystemExit, match="expected NAME="):
        ablate.main(["--config", CONFIG, "--variant", "bad name=model.n_streams=1"])
    with pytest.raises(SystemExit):
        ablate.main(["--config", CONFIG, "--variant", "a=", "--parallel", "0", "--gpus", "none"])
    assert "error: --parallel 0: expected >= 1" in capsys.readouterr().err


def test_gpus_overrides_and_out_are_checked_before_anything_runs(tmp_path, monkeypatch, capsys):
    """--gpus 0,1 on a machine without them (or --gpus a, which hides every GPU) silently ran on
    the CPU; an unclosed quote in a variant was a traceback; an --out that cannot be written failed after every
    variant had trained."""
    monkeypatch.setattr(ablate, "run_all", lambda *a: pytest.fail("nothing may run"))
    monkeypatch.setattr("torch.cuda.device_count", lambda: 2)
    for gpus in ("0,2", "a", "0,0"):
        with pytest.raises(SystemExit):
            ablate.main(["--config", CONFIG, "--variant", "a=", "--gpus", gpus])
        assert f"error: --gpus {gpus}: expected distinct GPU indices below 2" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="the overrides do not split as a shell would"):
        ablate.main(["--config", CONFIG, "--variant", "a=model.n_streams=1 \"unclosed", "--gpus", "none"])
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit):
        ablate.main(["--config", CONFIG, "--variant", "a=", "--gpus", "none", "--out", str(tmp_path / "file" / "x")])
    assert f"error: --out {tmp_path / 'file' / 'x'}: {tmp_path / 'file'} is a file" in capsys.readouterr().err
    args, _ = ablate.parse_args(["--config", CONFIG, "--variant", "a="])
    assert args.gpus == "0,1"  # every visible GPU by default


def test_output_paths_are_checked_by_trying_them(tmp_path):
    from training.log_reader import output_problem
    (tmp_path / "file").write_text("")
    assert output_problem(tmp_path / "new" / "deeper" / "x.json", folder=False) is None
    assert output_problem(tmp_path / "file", folder=True) == f"{tmp_path / 'file'} exists and is a file"
    assert output_problem(tmp_path, folder=False) == f"{tmp_path} exists and is a folder"
    inside_a_file = tmp_path / "file" / "x"
    assert output_problem(inside_a_file, folder=True).endswith(f"is a file, so {inside_a_file} cannot be made")
    if os.path.isdir("/proc/self"):  # root passes permission checks, but nothing can be made in /proc
        assert "does not take new files" in output_problem("/proc/nodir/a.json", folder=False)
    assert not list(tmp_path.glob(".write-check-*"))


def test_a_variant_whose_log_exists_is_refused_before_anything_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(ablate, "run_all", lambda *a: pytest.fail("nothing may run"))
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "t-b.txt").write_text("run t-b ...\n")
    with pytest.raises(SystemExit, match=r"variant b: .*t-b\.txt already exists .*hint: --prefix"):
        ablate.main(["--config", CONFIG, "--prefix", "t", "--variant", "a=", "--variant", "b=model.n_streams=1",
                     "--", f"train.log_dir={tmp_path / 'logs'}"])
    assert (tmp_path / "logs" / "t-b.txt").read_text() == "run t-b ...\n"
    ran = []
    monkeypatch.setattr(ablate, "run_all", lambda config, common, variants, *a: ran.extend(v.name for v in variants))
    ablate.main(["--config", CONFIG, "--prefix", "t", "--variant", "a=", "--variant", "b=train.resume=latest",
                 "--", f"train.log_dir={tmp_path / 'logs'}"])  # b continues its own log
    assert ran == ["a", "b"]


def test_each_gpu_slot_runs_one_variant_at_a_time(monkeypatch):
    seen, lock = [], __import__("threading").Lock()

    def fake_run(v, command, env, print_lock):
        with lock:
            seen.append((v.name, env.get("CUDA_VISIBLE_DEVICES"), command[-1]))
        v.returncode, v.final = 0, {"fits_cap": True, "steps": 10, "train_time_s": 2.0, "tokens_seen": 1000,
                                    "val_bpb": 1.5, "val_loss": 2.5, "pre_quant_val_bpb": 1.4, "total_bytes": 123}
    monkeypatch.setattr(ablate, "run_variant", fake_run)
    variants = [ablate.Variant(*ablate.parse_variant(f"v{i}=model.n_layers={i + 1}")) for i in range(5)]
    ablate.run_all(CONFIG, [], variants, ["0", "3"], "p")
    assert sorted(name for name, _, _ in seen) == [f"v{i}" for i in range(5)]
    assert {gpu for _, gpu, _ in seen} <= {"0", "3"} and all(cmd.startswith("train.run_id=p-v") for *_, cmd in seen)
    row = ablate.summary_rows(variants)[0]
    assert (row["tokens_per_s"], row["ms_per_step"], row["status"]) == (500.0, 200.0, "ok")
    assert "| v0 | ok | 10 | 500 | 200.0 | 1.4000 | 1.5000 | 123 |" in ablate.format_table([row])


@pytest.mark.parametrize("final, status", [
    ({"val_bpb": float("nan"), "val_loss": float("nan"), "fits_cap": True}, "val_loss is nan, not a finite number"),
    ({"val_bpb": 1.5, "val_loss": 2.5, "fits_cap": True, "total_bytes": 16_500_000}, "over the 16,000,000-byte cap"),
    ({"export_error": "all-int5 is over the budget", "fits_cap": False}, "no artifact: all-int5 is over the budget"),
    ({"val_bpb": 1.5, "val_loss": 2.5, "fits_cap": True, "total_bytes": 100}, None)])
def test_a_variant_is_judged_as_the_record_rule_judges_a_run(final, status):
    """A NaN score, or a total over the challenge's cap under a raised quant.cap_bytes, showed as ok, and an export
    that found no artifact as "over the byte cap"."""
    v = ablate.Variant("v", [])
    v.returncode, v.final = 0, final
    assert v.problem() == status or (status and status in v.problem())


def fake_finals(scores: dict[str, list[float]], failed: tuple[str, ...] = ()):
    """A run_variant that gives run NAME-sSEED the next of scores[NAME] as its val_bpb (exit 1 for the labels in
    `failed`), and records the order the runs were started in."""
    started, lock = [], __import__("threading").Lock()

    def fake_run(v, command, env, print_lock):
        with lock:
            started.append((v.label, command[-2:]))
            index = sum(label.startswith(f"{v.name}-s") for label, _ in started) - 1
        if v.label in failed:
            v.returncode = 1
            return
        bpb = scores[v.name][index]
        v.returncode, v.final = 0, {"fits_cap": True, "steps": 100, "train_time_s": 10.0, "tokens_seen": 1000,
                                    "val_bpb": bpb, "val_loss": bpb * 2.5, "pre_quant_val_bpb": bpb - 0.003,
                                    "total_bytes": 123}
    return fake_run, started


def test_seeds_run_every_variant_per_seed_and_test_each_against_the_baseline(monkeypatch, tmp_path, capsys):
    from training.records import welch_one_sided
    scores = {"base": [1.300, 1.302, 1.301], "better": [1.295, 1.296, 1.294], "same": [1.301, 1.300, 1.303]}
    fake_run, started = fake_finals(scores)
    monkeypatch.setattr(ablate, "run_variant", fake_run)
    out = tmp_path / "a.json"
    assert ablate.main(["--config", CONFIG, "--gpus", "none", "--parallel", "1", "--prefix", "p", "--seeds", "1,2,3",
                        "--baseline", "base", "--out", str(out), "--variant", "base=", "--variant",
                        "better=model.n_layers=3", "--variant", "same=model.n_layers=4", "--",
                        f"train.log_dir={tmp_path}"]) == 0
    # seed by seed, the variants' order rotated each seed, each run with its seed last and its own run id
    assert [label for label, _ in started] == ["base-s1", "better-s1", "same-s1", "better-s2", "same-s2", "base-s2",
                                               "same-s3", "base-s3", "better-s3"]
    assert all(cmd == [f"train.seed={label[-1]}", f"train.run_id=p-{label}"] for label, cmd in started)
    result = json.loads(out.read_text())
    assert result["seeds"] == [1, 2, 3] and [r["run_id"] for r in result["runs"]][:2] == ["p-base-s1", "p-better-s1"]
    summary = {s["variant"]: s for s in result["variants"]}
    assert "baseline" not in summary["base"] and summary["base"]["seeds_ok"] == 3
    assert summary["better"]["val_bpb_mean"] == pytest.approx(1.295)
    assert summary["better"]["delta_vs_baseline"] == pytest.approx(-0.006)
    assert summary["better"]["welch_p"] == welch_one_sided(scores["base"], scores["better"])["p_value"] < 0.01
    assert summary["same"]["welch_p"] > 0.3
    printed = capsys.readouterr().out
    assert "| better s2 | ok |" in printed
    assert f"| better | 3/3 | 100 | 100.0 | 1.29200 | 1.29500 ± 0.00100 | -0.00600 | " \
           f"{summary['better']['welch_p']:.4g} |" in printed


def test_a_failed_seed_leaves_its_variant_untested(monkeypatch, tmp_path):
    fake_run, _ = fake_finals({"base": [1.30, 1.31], "other": [1.29, 1.28]}, failed=("other-s2",))
    monkeypatch.setattr(ablate, "run_variant", fake_run)
    out = tmp_path / "a.json"
    assert ablate.main(["--config", CONFIG, "--gpus", "none", "--seeds", "1,2", "--baseline", "base", "--out", str(out),
                        "--variant", "base=", "--variant", "other=model.n_layers=3", "--",
                        f"train.log_dir={tmp_path}"]) == 1
    other = json.loads(out.read_text())["variants"][1]
    assert other["seeds_ok"] == 1 and other["test"] == "not compared: a seed of other failed" and "welch_p" not in other


def test_seed_arguments_are_checked_before_anything_runs(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(ablate, "run_all", lambda *a: pytest.fail("nothing may run"))
    base = ["--config", CONFIG, "--gpus", "none", "--variant", "a=", "--variant", "b=model.n_layers=3"]
    for extra, message in ((["--seeds", "1,1"], "each seed once"), (["--seeds", "1,x"], "expected comma-separated"),
                           (["--baseline", "a"], "--baseline a: a test needs --seeds with at least 2 seeds"),
                           (["--seeds", "1", "--baseline", "a"], "a test needs --seeds with at least 2 seeds"),
                           (["--seeds", "1,2", "--baseline", "c"], "--baseline c: no --variant of that name")):
        with pytest.raises(SystemExit):
            ablate.main([*base, *extra])
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit, match="variant b: train.seed is set by --seeds"):
        ablate.main(["--config", CONFIG, "--gpus", "none", "--seeds", "1,2", "--variant", "a=",
                     "--variant", "b=train.seed=5", "--", f"train.log_dir={tmp_path}"])
    with pytest.raises(SystemExit, match="the common overrides: train.seed is set by --seeds"):
        ablate.main([*base, "--seeds", "1,2", "--", "train.seed=5", f"train.log_dir={tmp_path}"])
    (tmp_path / "ablate-b-s2.txt").write_text("run ablate-b-s2 ...\n")
    with pytest.raises(SystemExit, match=r"variant b: .*ablate-b-s2\.txt already exists"):
        ablate.main([*base, "--seeds", "1,2", "--", f"train.log_dir={tmp_path}"])
