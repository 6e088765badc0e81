"""scripts.reproduce: the commands, real tiny CPU runs (two seeds, one failing run), and seeds read back from their
logs (--reuse). The kept GPU run logs: tests/test_run_logs.py; training.records' statistics: tests/test_records.py."""
import json
import shlex
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, TINY_SEEDS, tiny_run_overrides
from scripts import export_record, reproduce
from scripts.reproduce import SeedRun
from test_records import final, write_final_log
from training.log_reader import parse_log
from training.records import read_baseline, significance


def test_seed_run_problems():
    ok = SeedRun(1, "r", [], returncode=0, final=final(1, 1.9, 15_000_000))
    assert ok.problem() is None
    # quant.cap_bytes can be raised in a config; the challenge's cap cannot.
    assert "over the 16,000,000-byte cap" in SeedRun(1, "r", [], 0, final(1, 1.9, 15_950_000, code=60_000)).problem()
    assert SeedRun(1, "r", [], returncode=1).problem() == "train.py exited with status 1"
    assert SeedRun(1, "r", [], returncode=0).problem() == "no final JSON line with val_bpb on stdout"
    no_artifact = {"export_error": "even all-int5 is over the budget", "fits_cap": False, "code_bytes": 1}
    assert SeedRun(1, "r", [], 1, no_artifact).problem() == "no artifact: even all-int5 is over the budget"
    diverged = final(1, float("nan"), 15_000_000)  # train.py writes NaN into its JSON line; it used to count as ok
    assert SeedRun(1, "r", [], 0, diverged).problem() == "val_loss is nan, not a finite number"


def test_config_differences_name_changed_keys_and_leave_out_run_only_and_ignored_ones():
    logged = {"model": {"n_layers": 9}, "quant": {"budget_bytes": 0}, "train": {"run_id": "a", "seed": 1}}
    expected = {"model": {"n_layers": 11}, "quant": {"budget_bytes": 15_000_000}, "train": {"run_id": "b", "seed": 1}}
    assert reproduce.config_differences(logged, expected) == [
        "model.n_layers: log 9, this command 11", "quant.budget_bytes: log 0, this command 15000000"]
    assert reproduce.config_differences(logged, expected, ignore=("quant.budget_bytes",)) == [
        "model.n_layers: log 9, this command 11"]


# ----- commands -----

def test_dry_run_prints_one_command_per_seed(capsys):
    assert reproduce.main(["--config", "configs/demo.toml", "--seeds", "1337,42", "--name", "my run", "--dry-run",
                           "--", "train.max_steps=5"]) == 0
    commands = [shlex.split(line) for line in capsys.readouterr().out.splitlines()]
    assert commands == [[sys.executable, str(REPO / "train.py"), "--config", "configs/demo.toml", f"train.seed={s}",
                         f"train.run_id=my-run-s{s}", "train.max_steps=5"] for s in (1337, 42)]
    assert reproduce.main(["--config", "c.toml", "--seeds", "3", "--nproc-per-node", "8", "--dry-run"]) == 0
    command = shlex.split(capsys.readouterr().out)
    assert command[:5] == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=8"]
    assert command[5:] == [str(REPO / "train.py"), "--config", "c.toml", "train.seed=3", "train.run_id=c-s3"]


@pytest.mark.parametrize("argv, message", [
    (["--seeds", "1,x"], "expected comma-separated integers"),
    (["--seeds", "1,-2"], "expected comma-separated integers >= 0"),
    (["--seeds", "1,1"], "each seed once"),
    (["--seeds", "1,2", "--", "train.seed=5"], "set per seed by this script"),
    (["--seeds", "1", "--baseline", "README.md", "pyproject.toml"], "at least 2 runs on each side"),
    (["--seeds", "1,2", "--baseline", "logs/baseline_*.txt"], "--baseline logs/baseline_*.txt: no such log file"),
    (["--seeds", "1,2", "model.n_streams=2"], "hint: config overrides go after --, e.g. -- model.n_streams=2"),
    (["--seeds", "1,2", "--baseline", "logs/nope*.txt", "logs/x.txt"], "--baseline logs/nope*.txt: no such log file"),
    (["--seeds", "1,2", "--nproc-per-node", "-2"], "--nproc-per-node -2: expected >= 1"),
    (["--seeds", "1,2", "--out", f"{REPO}/README.md"], f"--out {REPO}/README.md: {REPO}/README.md exists and is a file"),
    (["--seeds", "1,2", "--baseline", "README.md", "README.md", "model.n_streams=2"],
     "--baseline model.n_streams=2: no such log file (hint: config overrides go after --"),
])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        reproduce.main(["--config", "configs/demo.toml", *argv])
    assert message in capsys.readouterr().err


def test_usage_examples_keep_their_line_continuations():
    """The --help of these scripts prints its docstring: a plain (not raw) one joined each example's lines at the
    trailing backslash into one line full of spaces."""
    import scripts.ablate
    import scripts.bench_quant
    import scripts.export_record
    for module in (reproduce, scripts.ablate, scripts.bench_quant, scripts.export_record):
        assert " \\\n" in module.__doc__, module.__name__


def test_config_typo_fails_before_any_run(tmp_path):
    with pytest.raises(SystemExit, match="unknown key 'train.max_stepz'"):
        reproduce.main(["--config", str(REPO / "configs/demo.toml"), "--seeds", "1,2", "--out", str(tmp_path),
                        "--", "train.max_stepz=3"])
    assert not list(tmp_path.iterdir())


# ----- real tiny runs -----

def test_two_tiny_seeds_give_a_submission(tiny_seed_runs):
    assert tiny_seed_runs.exit_code == 0
    sub = tiny_seed_runs.submission
    finals = [parse_log(p).require_final() for p in tiny_seed_runs.logs]
    assert sub["seeds"] == list(TINY_SEEDS) and sub["name"] == "tiny run" and sub["github_id"] == "tester"
    assert [sub["seed_results"][str(s)]["val_bpb"] for s in TINY_SEEDS] == [f["val_bpb"] for f in finals]
    assert finals[0]["val_bpb"] != finals[1]["val_bpb"], "different seeds must give different runs"
    assert sub["val_bpb"] == pytest.approx(sum(f["val_bpb"] for f in finals) / 2, rel=1e-12)
    assert sub["bytes_total"] == max(f["total_bytes"] for f in finals) and sub["bytes_code"] == finals[0]["code_bytes"]
    assert sub["hardware"].startswith("cpu") and sub["versions"]["torch"] == parse_log(tiny_seed_runs.logs[0]).versions["torch"]
    assert "significance" not in sub


@pytest.mark.parametrize("failure, message", [
    ("data.train_files={tmp}/missing_*.bin", "train.py exited with status 1"),
    ("quant.cap_bytes={code_and_1k}", "no artifact: "),  # 1 kB beside the code: train.py ships nothing
])
def test_a_failing_seed_is_reported_and_exits_nonzero(demo_dir, tmp_path, capsys, failure, message):
    from training.shipped_code import code_bytes
    overrides = [*tiny_run_overrides(demo_dir, tmp_path), "train.max_steps=2", "quant.margin_bytes=0",
                 failure.format(tmp=tmp_path, code_and_1k=code_bytes() + 1000)]
    code = reproduce.main(["--config", str(REPO / "configs/demo.toml"), "--seeds", "5", "--out", str(tmp_path / "sub"),
                           "--", *overrides])
    captured = capsys.readouterr()
    assert code == 1
    assert message in captured.out and "1 of 1 seed(s) failed; no submission.json written" in captured.err
    assert not (tmp_path / "sub").exists()


def test_baseline_comparison_from_real_logs(tiny_seed_runs, tmp_path, capsys):
    """The candidate side uses the real runs' numbers; the baseline is 1 nat worse: a record (the two seeds of a
    4-step run differ by under 0.1 nat, asserted, well inside what the t-test tolerates at 2 runs)."""
    losses = [parse_log(p).require_final()["val_loss"] for p in tiny_seed_runs.logs]
    assert abs(losses[0] - losses[1]) < 0.1
    finals = [parse_log(p).require_final() for p in tiny_seed_runs.logs]
    base = [write_final_log(tmp_path / f"b{i}.txt", f"b{i}", v + 1.0, tokens=finals[0]["tokens"],
                            bytes=finals[0]["bytes"]) for i, v in enumerate(losses)]
    runs = [SeedRun(s, f"tiny-run-s{s}", [], 0, f) for s, f in zip(TINY_SEEDS, finals)]
    sig = significance([r.scored() for r in runs], read_baseline([str(p) for p in base]))
    assert sig["improvement_nats"] == pytest.approx(1.0, abs=1e-9) and sig["is_record"]
    reproduce.print_summary(runs, sig)
    out = capsys.readouterr().out
    assert "RECORD" in out and "val_bpb: mean" in out and "tiny-run-s7" in out
    gain = sig["any_improvement"]
    assert f"without the margin (any improvement): t {gain['t']:.3f}, p {gain['p_value']:.4g}" in out



# ----- seeds run before, or elsewhere (--reuse) -----

def tiny_argv(tiny_seed_runs, demo_dir, seeds, out, *extra, overrides=()):
    """The fixture's reproduce command (same name, config and overrides, so the same run ids and log folder)."""
    return ["--config", str(REPO / "configs/demo.toml"), "--seeds", ",".join(map(str, seeds)), "--name", "tiny run",
            "--github-id", "tester", "--out", str(out), *extra,
            "--", *tiny_run_overrides(demo_dir, tiny_seed_runs.root), *overrides]


def copied_logs(tiny_seed_runs, folder: Path, edit=lambda seed, text: text) -> list[str]:
    """The fixture's two logs copied into `folder` (edited per seed); the override that points a command there."""
    folder.mkdir()
    for seed, log in zip(TINY_SEEDS, tiny_seed_runs.logs):
        text = edit(seed, log.read_text())
        if text is not None:
            (folder / log.name).write_text(text)
    return [f"train.log_dir={folder}"]


def no_run(monkeypatch):
    monkeypatch.setattr(reproduce, "run_seed", lambda run, signals=None: pytest.fail(f"seed {run.seed} ran"))


def test_an_existing_log_is_refused_without_reuse(tiny_seed_runs, demo_dir, tmp_path, monkeypatch):
    no_run(monkeypatch)
    with pytest.raises(SystemExit, match=r"tiny-run-s7.txt already exists .*hint: --reuse counts that run"):
        reproduce.main(tiny_argv(tiny_seed_runs, demo_dir, TINY_SEEDS, tmp_path / "sub"))
    assert not (tmp_path / "sub").exists()


def test_reuse_reads_finished_seeds_back_and_runs_only_the_others(tiny_seed_runs, demo_dir, tmp_path, monkeypatch, capsys):
    no_run(monkeypatch)
    assert reproduce.main(tiny_argv(tiny_seed_runs, demo_dir, TINY_SEEDS, tmp_path / "same", "--reuse")) == 0
    assert json.loads((tmp_path / "same" / "submission.json").read_text()) == tiny_seed_runs.submission
    assert capsys.readouterr().out.count("ok (from its log)") == 2

    ran = []
    log8 = parse_log(tiny_seed_runs.logs[1])

    def fake_run(run, signals=None):  # a third seed, run now: stands in for train.py
        ran.append(run.seed)
        run.returncode, run.final = 0, dict(log8.final, run_id=run.run_id, val_bpb=log8.final["val_bpb"] + 0.01)
        run.versions, run.world_size, run.code = log8.versions, 1, log8.code
        return run
    monkeypatch.setattr(reproduce, "run_seed", fake_run)
    # the logs copied to another folder (another machine's): folders differ, the config does not
    moved = copied_logs(tiny_seed_runs, tmp_path / "moved")
    assert reproduce.main(tiny_argv(tiny_seed_runs, demo_dir, (*TINY_SEEDS, 9), tmp_path / "three", "--reuse",
                                    overrides=moved)) == 0
    sub = json.loads((tmp_path / "three" / "submission.json").read_text())
    assert ran == [9] and sub["seeds"] == [*TINY_SEEDS, 9]
    assert [sub["seed_results"][str(s)]["val_bpb"] for s in TINY_SEEDS] == \
        [tiny_seed_runs.submission["seed_results"][str(s)]["val_bpb"] for s in TINY_SEEDS]


def test_a_comparison_that_cannot_be_made_writes_no_submission(tiny_seed_runs, demo_dir, tmp_path, monkeypatch,
                                                               capsys):
    """A baseline scored on other validation data is found once the seeds have run: no verdict and no
    submission.json, and the hint says how to compare the same seeds again without running them. A validation
    subset, and a seed that failed, give no verdict either (the test used to run on the seeds that survived)."""
    no_run(monkeypatch)
    finals = [parse_log(p).require_final() for p in tiny_seed_runs.logs]
    base = [str(write_final_log(tmp_path / f"b{i}.txt", f"b{i}", f["val_loss"] + 1, seed=100 + i,
                                tokens=f["tokens"] - 1, bytes=f["bytes"])) for i, f in enumerate(finals)]
    assert reproduce.main(tiny_argv(tiny_seed_runs, demo_dir, TINY_SEEDS, tmp_path / "sub", "--reuse",
                                    "--baseline", *base)) == 1
    err = capsys.readouterr().err
    assert "not compared with the baseline: the candidate and the baseline scored different validation data" in err
    assert "--reuse with another --baseline compares them without running them again" in err
    assert not (tmp_path / "sub").exists()
    with pytest.raises(SystemExit, match="eval.max_tokens=1000 scores the first tokens of the validation set only"):
        reproduce.main(tiny_argv(tiny_seed_runs, demo_dir, TINY_SEEDS, tmp_path / "sub", "--reuse",
                                 overrides=["eval.max_tokens=1000"]))

    def failed(run, signals=None):
        run.returncode = 1
        return run
    monkeypatch.setattr(reproduce, "run_seed", failed)
    good = [str(write_final_log(tmp_path / f"g{i}.txt", f"g{i}", f["val_loss"] + 1, seed=200 + i, tokens=f["tokens"],
                                bytes=f["bytes"])) for i, f in enumerate(finals)]
    assert reproduce.main(tiny_argv(tiny_seed_runs, demo_dir, (*TINY_SEEDS, 9), tmp_path / "sub", "--reuse",
                                    "--baseline", *good)) == 1
    captured = capsys.readouterr()
    assert "not compared with the baseline: 1 of 3 seed(s) failed" in captured.err and "RECORD" not in captured.out


def test_reuse_refuses_the_log_of_another_config(tiny_seed_runs, demo_dir, tmp_path, monkeypatch):
    no_run(monkeypatch)
    with pytest.raises(SystemExit, match=r"(?s)is a run of another config.*train\.max_steps: log 4, this command 3"):
        reproduce.main(tiny_argv(tiny_seed_runs, demo_dir, TINY_SEEDS, tmp_path / "sub", "--reuse",
                                 overrides=["train.max_steps=3"]))


def test_reuse_compares_the_artifact_budget_the_runs_had(tiny_seed_runs, demo_dir, tmp_path, monkeypatch):
    """The logs' runs derived their budget (quant.budget_bytes=0): a command pinning that number counts them, one
    pinning another does not, and a derived budget that moved (another count of the code) does not either, unless
    --allow-other-code counts other code with the budget it derived (a pinned one is still compared)."""
    no_run(monkeypatch)
    had = parse_log(tiny_seed_runs.logs[0]).require_final()["budget_bytes"]
    assert had > 0 and all(parse_log(p).config["quant"]["budget_bytes"] == 0 for p in tiny_seed_runs.logs)
    assert reproduce.main(tiny_argv(tiny_seed_runs, demo_dir, TINY_SEEDS, tmp_path / "pinned", "--reuse",
                                    overrides=[f"quant.budget_bytes={had}"])) == 0
    with pytest.raises(SystemExit, match=rf"quant\.budget_bytes: the run's artifact budget was {had:,} bytes, this "
                                         rf"command's is {had - 1:,} \(pinned\); hint: quant\.budget_bytes={had} after"):
        reproduce.main(tiny_argv(tiny_seed_runs, demo_dir, TINY_SEEDS, tmp_path / "other", "--reuse",
                                 overrides=[f"quant.budget_bytes={had - 1}"]))
    moved = copied_logs(tiny_seed_runs, tmp_path / "moved",
                        lambda seed, text: text.replace(f'"budget_bytes": {had},', f'"budget_bytes": {had + 5},'))
    with pytest.raises(SystemExit, match=rf"the run's artifact budget was {had + 5:,} bytes, this command's is "
                                         rf"{had:,} \(quant\.cap_bytes less this checkout's counted code"):
        reproduce.main(tiny_argv(tiny_seed_runs, demo_dir, TINY_SEEDS, tmp_path / "derived", "--reuse",
                                 overrides=moved))
    with pytest.raises(SystemExit, match=rf"the run's artifact budget was {had:,} bytes, this command's is {had - 1:,} "):
        reproduce.main(tiny_argv(tiny_seed_runs, demo_dir, TINY_SEEDS, tmp_path / "other", "--reuse",
                                 "--allow-other-code", overrides=[f"quant.budget_bytes={had - 1}"]))
    assert not any((tmp_path / name).exists() for name in ("other", "derived"))
    assert reproduce.main(tiny_argv(tiny_seed_runs, demo_dir, TINY_SEEDS, tmp_path / "derived", "--reuse",
                                    "--allow-other-code", overrides=moved)) == 0


def test_reuse_counts_a_log_run_under_another_name(tiny_seed_runs, demo_dir, tmp_path, monkeypatch):
    """A seed run by scripts.ablate (run id <layout>-s<seed>) counts once its log has this command's name."""
    no_run(monkeypatch)
    renamed = copied_logs(tiny_seed_runs, tmp_path / "renamed", lambda seed, text: text.replace(
        f"tiny-run-s{seed}", f"ablation-s{seed}"))
    assert all("tiny-run" not in p.read_text() for p in (tmp_path / "renamed").iterdir())
    assert reproduce.main(tiny_argv(tiny_seed_runs, demo_dir, TINY_SEEDS, tmp_path / "sub", "--reuse",
                                    overrides=renamed)) == 0


def test_reuse_takes_an_option_newer_than_the_log_only_at_its_default(tiny_seed_runs, demo_dir, tmp_path, monkeypatch):
    """A log written before model.smear_gate existed ran without it: equal to the default, not to smear_gate=true."""
    def drop_option(seed, text):
        lines = text.splitlines(keepends=True)
        i = next(i for i, line in enumerate(lines) if line.startswith("config "))
        config = json.loads(lines[i][len("config "):])
        del config["model"]["smear_gate"]
        lines[i] = "config " + json.dumps(config, sort_keys=True) + "\n"
        return "".join(lines)
    older = copied_logs(tiny_seed_runs, tmp_path / "older", drop_option)
    no_run(monkeypatch)
    assert reproduce.main(tiny_argv(tiny_seed_runs, demo_dir, TINY_SEEDS, tmp_path / "sub", "--reuse",
                                    overrides=older)) == 0
    with pytest.raises(SystemExit, match=r"model\.smear_gate: log '<absent>', this command True"):
        reproduce.main(tiny_argv(tiny_seed_runs, demo_dir, TINY_SEEDS, tmp_path / "sub2", "--reuse",
                                 overrides=[*older, "model.smear_gate=true"]))


def test_reuse_refuses_a_failed_run_and_another_process_count(tiny_seed_runs, demo_dir, tmp_path, monkeypatch):
    def fail_seed_8(seed, text):
        if seed != 8:
            return text
        head, _, final = text.rpartition("final ")
        result = json.loads(final)
        result.update(fits_cap=False, export_error="over the budget")
        return head + "final " + json.dumps(result) + "\n"
    failed = copied_logs(tiny_seed_runs, tmp_path / "failed", fail_seed_8)
    no_run(monkeypatch)
    with pytest.raises(SystemExit, match=r"tiny-run-s8.txt is a failed run of seed 8 \(no artifact: over the budget\)"):
        reproduce.main(tiny_argv(tiny_seed_runs, demo_dir, TINY_SEEDS, tmp_path / "sub", "--reuse", overrides=failed))
    with pytest.raises(SystemExit, match=r"ran on 1 process\(es\), this command runs 2 \(--nproc-per-node\)"):
        reproduce.main(tiny_argv(tiny_seed_runs, demo_dir, TINY_SEEDS, tmp_path / "sub", "--reuse",
                                 "--nproc-per-node", "2"))
    assert not (tmp_path / "sub").exists()


def test_an_unfinished_log_is_refused_unless_the_run_resumes(tiny_seed_runs, demo_dir, tmp_path, monkeypatch):
    """Seed 7 interrupted (no final line), seed 8 finished with another run appended to it that did not finish:
    both are unfinished. They are not counted, not appended to and not deleted; train.resume continues them."""
    def interrupt(seed, text):
        lines = text.splitlines(keepends=True)
        if seed == 7:
            return "".join(line for line in lines if not line.startswith("final "))
        return text + "".join(line for line in lines[:3])  # a second run's header, versions and config lines
    logs = copied_logs(tiny_seed_runs, tmp_path / "logs", interrupt)
    before = {p.name: p.read_text() for p in (tmp_path / "logs").iterdir()}
    no_run(monkeypatch)
    for seeds in ((7,), (8,)):
        with pytest.raises(SystemExit, match=rf"tiny-run-s{seeds[0]}.txt holds an unfinished run .*train.resume=latest"):
            reproduce.main(tiny_argv(tiny_seed_runs, demo_dir, seeds, tmp_path / "sub", "--reuse", overrides=logs))
    assert {p.name: p.read_text() for p in (tmp_path / "logs").iterdir()} == before

    ran = []
    log7 = parse_log(tiny_seed_runs.logs[0])

    def fake_resume(run, signals=None):
        ran.append((run.seed, "train.resume=latest" in run.command))
        run.returncode, run.final, run.versions, run.code = 0, dict(log7.final, run_id=run.run_id), log7.versions, log7.code
        return run
    monkeypatch.setattr(reproduce, "run_seed", fake_resume)
    assert reproduce.main(tiny_argv(tiny_seed_runs, demo_dir, TINY_SEEDS, tmp_path / "sub", "--reuse",
                                    overrides=[*logs, "train.resume=latest"])) == 0
    assert ran == [(7, True), (8, True)]


def test_reuse_refuses_a_log_of_other_code_unless_allowed(tiny_seed_runs, demo_dir, tmp_path, monkeypatch, capsys):
    """--reuse counted logs of any code: three seeds run at two commits (one of them +dirty) made one submission.
    A log's code digest must be the checkout's, unless --allow-other-code, and submission.json
    lists the digests."""
    no_run(monkeypatch)

    def other_code(seed, text):
        return text.replace(f"code {parse_log(tiny_seed_runs.logs[0]).code}", "code 0000000000000000", 1) \
            if seed == TINY_SEEDS[0] else text
    logs = copied_logs(tiny_seed_runs, tmp_path / "logs", other_code)
    with pytest.raises(SystemExit, match=rf"tiny-run-s{TINY_SEEDS[0]}.txt ran code 0000000000000000, this checkout's "
                                         r"training code is [0-9a-f]{16}.*--allow-other-code"):
        reproduce.main(tiny_argv(tiny_seed_runs, demo_dir, TINY_SEEDS, tmp_path / "sub", "--reuse", overrides=logs))
    assert reproduce.main(tiny_argv(tiny_seed_runs, demo_dir, TINY_SEEDS, tmp_path / "sub", "--reuse",
                                    "--allow-other-code", overrides=logs)) == 0
    sub = json.loads((tmp_path / "sub" / "submission.json").read_text())
    assert sub["code_digests"] == sorted({"0000000000000000", parse_log(tiny_seed_runs.logs[1]).code})


def test_seeds_scored_on_other_validation_text_make_no_submission(tiny_seed_runs, demo_dir, tmp_path, monkeypatch,
                                                                  capsys):
    """Without --baseline the seeds' own scoring was never compared: a seed scored on another machine's shard
    was averaged in."""
    no_run(monkeypatch)

    def other_text(seed, text):
        if seed != TINY_SEEDS[1]:
            return text
        *lines, last = text.splitlines()
        final = json.loads(last.removeprefix("final "))
        final["bytes"] += 7
        return "\n".join([*lines, "final " + json.dumps(final)]) + "\n"
    logs = copied_logs(tiny_seed_runs, tmp_path / "logs", other_text)
    assert reproduce.main(tiny_argv(tiny_seed_runs, demo_dir, TINY_SEEDS, tmp_path / "sub", "--reuse",
                                    overrides=logs)) == 1
    err = capsys.readouterr().err
    assert "the seeds scored different validation data" in err
    assert "(hint: run every seed on the same shards and tokenizer)" in err and "--baseline" not in err
    assert not (tmp_path / "sub" / "submission.json").exists()


def test_reuse_counts_seeds_whose_data_sat_at_other_paths(tiny_seed_runs, demo_dir, tmp_path, monkeypatch):
    """Seeds run on another machine, where the same shards sit at another path, were refused
    as runs of another config, against the README's several-machines recipe. What they scored is compared instead."""
    no_run(monkeypatch)

    def elsewhere(seed, text):
        return text.replace(str(demo_dir), "/mnt/other/machine/demo") if seed == TINY_SEEDS[0] else text
    logs = copied_logs(tiny_seed_runs, tmp_path / "logs", elsewhere)
    assert "/mnt/other/machine/demo" in (tmp_path / "logs" / tiny_seed_runs.logs[0].name).read_text()
    assert reproduce.main(tiny_argv(tiny_seed_runs, demo_dir, TINY_SEEDS, tmp_path / "sub", "--reuse",
                                    overrides=logs)) == 0
    export_record.main(["--runs", *(str(tmp_path / "logs" / p.name) for p in tiny_seed_runs.logs),
                        "--out", str(tmp_path / "rec")])


def test_seeds_trained_on_other_shards_make_no_submission_nor_record(tiny_seed_runs, demo_dir, tmp_path, monkeypatch,
                                                                     capsys):
    """With data paths free to differ between machines, a seed trained on 10 shards and one on 80
    counted as one submission. Each run's final line says how many shards of how many bytes it trained on."""
    no_run(monkeypatch)
    assert json.loads(tiny_seed_runs.logs[0].read_text().splitlines()[-1][6:])["train_shards"] >= 1

    def fewer(seed, text):
        if seed != TINY_SEEDS[1]:
            return text
        *lines, last = text.splitlines()
        final = json.loads(last.removeprefix("final "))
        final["train_shards"] -= 1
        final["train_shard_bytes"] -= 1000
        return "\n".join([*lines, "final " + json.dumps(final)]) + "\n"
    logs = copied_logs(tiny_seed_runs, tmp_path / "logs", fewer)
    assert reproduce.main(tiny_argv(tiny_seed_runs, demo_dir, TINY_SEEDS, tmp_path / "sub", "--reuse",
                                    overrides=logs)) == 1
    assert "the seeds trained on different data: " in capsys.readouterr().err
    with pytest.raises(SystemExit, match="the record's runs trained on different data"):
        export_record.main(["--runs", *(str(tmp_path / "logs" / p.name) for p in tiny_seed_runs.logs),
                            "--out", str(tmp_path / "rec")])


def test_seeds_trained_on_other_shards_of_the_same_sizes_are_told_apart(tiny_seed_runs, tmp_path):
    """Shard count and bytes cannot tell FineWeb's shards 0-79 from 80-159 (100M tokens each): runs also log a
    digest sampled from each shard's head and tail, and the seed tools compare it."""
    from data.shards import file_sample, sample_digest, write_shard
    from training.records import ComparisonError, check_trained_alike
    finals = [json.loads(log.read_text().splitlines()[-1][6:]) for log in tiny_seed_runs.logs]
    assert len({f["train_data_digest"] for f in finals}) == 1 and len(finals[0]["train_data_digest"]) == 16
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    write_shard(a, np.arange(50_000) % 1000)
    write_shard(b, (np.arange(50_000) + 1) % 1000)  # the same size, other tokens
    assert a.stat().st_size == b.stat().st_size and file_sample(str(a)) != file_sample(str(b))
    assert sample_digest([file_sample(str(a)), file_sample(str(b))]) == sample_digest([file_sample(str(b)),
                                                                                        file_sample(str(a))])
    other = {**finals[1], "train_data_digest": sample_digest([file_sample(str(b))])}
    with pytest.raises(ComparisonError, match=r"read shards of the same count and sizes but other contents"):
        check_trained_alike([finals[0], other], ["s1.txt", "s2.txt"], "the seeds")
    check_trained_alike([finals[0], {k: v for k, v in other.items() if k != "train_data_digest"}], ["s1", "s2"],
                        "the seeds")  # a log from before the digest: unchecked, as before
