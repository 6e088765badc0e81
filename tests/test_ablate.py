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
                        "--variant", "plain=model.n_streams=1",
                        "--variant", "mhc2=model.n_streams=2 model.mhc_granularity=block",
                        "--variant", f"tiny-cap=model.n_streams=1 {small_cap}", "--", *common])
    assert code == 1  # the capped variant cannot ship
    printed = capsys.readouterr().out
    assert "[plain] " in printed and "[mhc2] " in printed and "| variant | status |" in printed
    summary = json.loads(out.read_text())
    rows = {r["variant"]: r for r in summary["runs"]}
    assert [r["variant"] for r in summary["runs"]] == ["plain", "mhc2", "tiny-cap"]
    for name in ("plain", "mhc2"):
        r = rows[name]
        assert r["status"] == "ok" and r["run_id"] == f"t-{name}" and r["steps"] == 4
        assert r["tokens_per_s"] > 0 and r["ms_per_step"] > 0 and 0 < r["val_bpb"] < 20
        assert (tmp_path / "logs" / f"t-{name}.txt").exists()
    assert rows["tiny-cap"]["status"] == "exit 1" and rows["tiny-cap"]["stdout_tail"]
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
