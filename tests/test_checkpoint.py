"""Resume continues exactly: straight runs and killed-then-resumed runs give identical losses. What a resume refuses
of a checkpoint itself: tests/test_checkpoint_refusals.py."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import started
from data.demo import make_demo
from training.checkpoint import complete_checkpoints, resolve_resume

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ckpt_demo")
    make_demo(out, seed=1, train_docs=600, val_docs=20)
    return out


def args(data: Path, tmp: Path, run_id: str, *extra: str) -> list[str]:
    return [sys.executable, str(REPO / "train.py"), "--config", str(REPO / "configs/demo.toml"),
            f"data.train_files={data}/fineweb_train_*.bin", f"data.val_files={data}/fineweb_val_*.bin",
            f"data.tokenizer={data}/tokenizer.model", "data.seq_len=32", "model.n_layers=2", "model.d_model=32",
            "model.n_heads=2", "model.n_kv_heads=1", "train.batch_tokens=256", "train.micro_batch_seqs=8",
            "train.max_steps=14", "train.time_budget_s=0", "train.schedule=steps", "train.log_every=1",
            "eval.context=32", "eval.stride=0", "eval.max_tokens=1000", "eval.pre_quant=false",
            "quant.calib_seqs=2", "quant.calib_reserve_s=0", "quant.method=rtn",
            f"train.log_dir={tmp}/logs", f"train.out_dir={tmp}/runs", f"train.run_id={run_id}", *extra]


def step_losses(log: Path) -> dict[int, float]:
    out = {}
    for line in log.read_text().splitlines():
        if line.startswith("step "):
            rec = json.loads(line[5:])
            out[rec["step"]] = rec["loss"]
    return out


def final(log: Path) -> dict:
    return json.loads([x for x in log.read_text().splitlines() if x.startswith("final ")][-1][6:])


def run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def succeeded(proc: subprocess.Popen) -> None:
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]


def wait_for_step(log: Path, proc: subprocess.Popen, step: int) -> None:
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if log.exists() and step in step_losses(log):
            return
        time.sleep(0.01)
    raise AssertionError(f"run never reached step {step} (exit code {proc.poll()})")


@pytest.mark.slow
def test_kill_9_between_checkpoints_then_resume_matches_straight_run(corpus, tmp_path):
    # the straight run trains beside the one under test
    with started([args(corpus, tmp_path, "straight", "train.checkpoint_every=5"),
                  args(corpus, tmp_path, "killed", "train.checkpoint_every=5")]) as [reference, proc]:
        wait_for_step(tmp_path / "logs/killed.txt", proc, 7)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        ckpts = complete_checkpoints(tmp_path / "runs/checkpoints/killed")
        assert ckpts, "a checkpoint was written at step 5 before the kill"
        resumed_at = int(ckpts[-1].name.split("_")[1])
        run(args(corpus, tmp_path, "killed", "train.checkpoint_every=5", "train.resume=latest"))
        succeeded(reference)
    straight = tmp_path / "logs/straight.txt"
    ref = step_losses(straight)
    after = {s: v for s, v in step_losses(tmp_path / "logs/killed.txt").items() if s > resumed_at}
    assert after and all(after[s] == ref[s] for s in after), (resumed_at, after, ref)
    assert max(after) == 14
    assert final(tmp_path / "logs/killed.txt")["val_bpb"] == final(straight)["val_bpb"]
    assert not [key for key in final(straight) if key.startswith("pre_quant")], "eval.pre_quant=false scores no float model"
    # 14 is no multiple of 5: the run still leaves its final state (what bench_quant re-quantizes)
    assert [c.name for c in complete_checkpoints(tmp_path / "runs/checkpoints/killed")] == \
        ["step_00000010", "step_00000014"]
    # and the state it ends in is the straight run's, bit for bit: weights, EMA, optimizer moments, loader, RNG
    import torch
    ends = [torch.load(tmp_path / f"runs/checkpoints/{run_id}/step_00000014/rank0.pt", weights_only=True)
            for run_id in ("straight", "killed")]
    for state in ends:
        state.pop("train_time_s")  # wall-clock time differs,
        assert state.pop("config")["train"]["run_id"] in ("straight", "killed")  # and the config names its run
    assert_same(*ends)


def assert_same(a, b, where="state"):
    """Nested dicts/lists/tuples of tensors and plain values, equal bit for bit."""
    import torch
    assert type(a) is type(b), where
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    else:
        assert a == b, where


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_exits_then_resume_continues(corpus, tmp_path):
    # the straight run trains beside the one under test
    with started([args(corpus, tmp_path, "straight"), args(corpus, tmp_path, "term")]) as [reference, proc]:
        wait_for_step(tmp_path / "logs/term.txt", proc, 3)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 143, proc.stderr.read()[-2000:]
        ckpts = complete_checkpoints(tmp_path / "runs/checkpoints/term")
        assert len(ckpts) == 1
        stopped_at = int(ckpts[0].name.split("_")[1])
        run(args(corpus, tmp_path, "term", "train.resume=latest"))
        succeeded(reference)
    ref = step_losses(tmp_path / "logs/straight.txt")
    after = {s: v for s, v in step_losses(tmp_path / "logs/term.txt").items() if s > stopped_at}
    assert after and all(after[s] == ref[s] for s in after)


def test_checkpoints_keep_only_the_newest_and_ignore_unfinished(tmp_path):
    import torch
    from training.checkpoint import Checkpointer

    class Dummy:
        def state_dict(self):
            return {"w": torch.ones(2)}

    ck = Checkpointer(tmp_path, every_steps=2, keep=2, rank=0, world_size=1)
    for step in (2, 4, 6):
        ck.save(step, float(step), Dummy(), [], None, type("L", (), {"state_dict": lambda self: {"pos": step}})())
    (tmp_path / "step_00000008.tmp").mkdir()  # an interrupted write
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_00000004", "step_00000006"]
    assert resolve_resume("latest", tmp_path).name == "step_00000006"
    assert resolve_resume("", tmp_path) is None
    with pytest.raises(FileNotFoundError, match="train.resume"):
        resolve_resume(str(tmp_path / "nope"), tmp_path)


def test_a_step_written_again_replaces_its_folder_and_stays_and_stale_writes_go(tmp_path):
    """Checkpointer used directly (train.py refuses these states before training): a step written again
    replaces its folder (a rename cannot replace a non-empty one), the checkpoint just written survives pruning
    even where later-numbered ones sort after it, and a new Checkpointer cleans up after a killed run:
    half-written folders go, and a folder set aside mid-replacement comes back if its replacement never
    arrived."""
    import torch
    from training.checkpoint import Checkpointer, checkpoint_step, refuse_later_checkpoints

    class Dummy:
        def __init__(self, value):
            self.value = value

        def state_dict(self):
            return {"w": torch.full((2,), float(self.value))}

    loader = type("L", (), {"state_dict": lambda self: {"pos": 0}})()
    ck = Checkpointer(tmp_path, every_steps=2, keep=2, rank=0, world_size=1)
    for step in (2, 4, 6):
        ck.save(step, float(step), Dummy(step), [], None, loader)
    ck.save(6, 6.0, Dummy(60), [], None, loader)  # the same step again, other weights
    assert torch.load(tmp_path / "step_00000006" / "rank0.pt", weights_only=True)["model"]["w"][0] == 60
    ck.save(2, 2.0, Dummy(20), [], None, loader)  # an older step: it stays, the oldest other one goes
    assert [checkpoint_step(p) for p in complete_checkpoints(tmp_path)] == [2, 6]
    (tmp_path / "step_00000008.tmp").mkdir()  # a killed write
    os.replace(tmp_path / "step_00000006", tmp_path / "step_00000006.replaced")  # killed between the renames
    (tmp_path / "step_00000002.replaced").mkdir()  # killed after them: the old copy is garbage
    Checkpointer(tmp_path, every_steps=0, keep=2, rank=0, world_size=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000002", "step_00000006"]
    assert torch.load(tmp_path / "step_00000006" / "rank0.pt", weights_only=True)["model"]["w"][0] == 60
    refuse_later_checkpoints(tmp_path, 6)
    with pytest.raises(FileExistsError, match=r"2 checkpoint\(s\) past step 0 .*train.resume=latest"):
        refuse_later_checkpoints(tmp_path, 0)


def test_a_fresh_run_refuses_a_folder_with_checkpoints_of_its_run_id(corpus, tmp_path):
    """train.py with a run_id whose folder holds checkpoints: started afresh, it would share them (and
    train.resume=latest would later continue the old trajectory), so it stops before training. (The first run,
    with train.resume=latest and nothing to resume, says it starts at step 0: a misspelt run_id shows.)"""
    run(args(corpus, tmp_path, "again", "train.max_steps=4", "train.checkpoint_every=2", "train.resume=latest"))
    assert "train.resume=latest: no checkpoint in " in (tmp_path / "logs/again.txt").read_text()
    done = subprocess.run(args(corpus, tmp_path, "again", "train.max_steps=4", "train.checkpoint_every=2"),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 1 and "checkpoint(s) past step 0" in done.stderr, done.stderr[-2000:]


def in_process(corpus, tmp_path, run_id, *extra) -> list[str]:
    """train.py's arguments for train.main in this process (its signal handlers then see os.kill of this pid)."""
    return args(corpus, tmp_path, run_id, "eval.pre_quant=true", *extra)[2:]


@pytest.fixture(scope="module")
def straight_record(corpus, tmp_path_factory) -> dict:
    """The record of a run that no signal stopped (checkpoint_every does not change it). With checkpoint_every=0
    the trained state is checkpointed while the run is scored, and removed once it is; the run's folder then holds
    only the record that it finished."""
    import train
    root = tmp_path_factory.mktemp("straight")
    record = train.main(in_process(corpus, root, "straight"))
    assert "the trained state, kept while the run is scored" in (root / "logs/straight.txt").read_text()
    assert [p.name for p in (root / "runs/checkpoints/straight").iterdir()] == ["finished.json"]
    return record


@pytest.mark.slow
@pytest.mark.parametrize("when, every", [("during", 0), ("before_export", 0), ("before_export", 5)])
def test_a_signal_after_training_keeps_the_trained_state_and_resume_scores_it(corpus, straight_record, tmp_path,
                                                                               monkeypatch, when, every):
    """A signal after the last step, while the run scored or exported, ended the process and lost the training
    with train.checkpoint_every=0. Now the trained state is checkpointed (or found,
    when checkpoint_every > 0 wrote it already) before the run is scored, and train.resume=latest scores it with no
    step: the same record, bit for bit, as a run never stopped. On one rank the signal stops a scoring pass at its
    next batch; otherwise at the next phase."""
    import train
    from training import evaluate as evaluation
    real = evaluation.evaluate_bpb

    def signalled(*a, **k):
        if when == "during":
            os.kill(os.getpid(), signal.SIGTERM)
            return real(*a, **k)
        out = real(*a, **k)
        os.kill(os.getpid(), signal.SIGTERM)
        return out
    monkeypatch.setattr(train, "evaluate_bpb", signalled)
    with pytest.raises(SystemExit) as stopped:
        train.main(in_process(corpus, tmp_path, "cut", f"train.checkpoint_every={every}"))
    assert stopped.value.code == 143
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handlers are given back
    phase = "during scoring" if when == "during" else "before the export"
    text = (tmp_path / "logs/cut.txt").read_text()
    assert f"stopped by a signal {phase}: the trained state is checkpoint " in text, text[-1500:]
    assert "train.resume=latest train.run_id=cut scores it without training further" in text
    assert not (tmp_path / "runs/cut.mhcg").exists() or when == "during"
    kept = [c.name for c in complete_checkpoints(tmp_path / "runs/checkpoints/cut")]
    assert kept == (["step_00000005", "step_00000010", "step_00000014"][-2:] if every else ["step_00000014"])
    # the live weights, not the EMA ones that were swapped in for scoring
    import torch
    saved = torch.load(tmp_path / f"runs/checkpoints/cut/{kept[-1]}/rank0.pt", weights_only=True)
    assert any(not torch.equal(saved["model"][name].float(), shadow) for name, shadow in saved["ema"]["shadow"].items())
    monkeypatch.setattr(train, "evaluate_bpb", real)
    resumed = train.main(in_process(corpus, tmp_path, "cut", f"train.checkpoint_every={every}",
                                    "train.resume=latest"))
    text = (tmp_path / "logs/cut.txt").read_text()
    assert "the checkpoint's training is finished (step 14" in text
    assert max(step_losses(tmp_path / "logs/cut.txt")) == 14  # no step after the resume
    for key in ("steps", "tokens_seen", "pre_quant_val_bpb", "val_bpb", "n_int6"):  # (the run_id is in the artifact)
        assert resumed[key] == straight_record[key], key


def test_a_second_signal_is_not_deferred(tmp_path, capfd):
    """The first SIGINT asks for a stop at the next safe point; a second one reaches the previous handler at once
    (Ctrl-C twice interrupts a long scoring pass), and the handlers are given back."""
    from training.checkpoint import Checkpointer
    ck = Checkpointer(tmp_path, every_steps=0, keep=1, rank=0, world_size=1)
    # The previous handler is Python's own, whatever this process inherited: a shell's background job (`cmd &`)
    # starts with SIGINT ignored, and Python then leaves it ignored.
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    ck.install_signal_handlers()
    try:
        signal.raise_signal(signal.SIGINT)  # to this thread: its handler has run when the call returns
        assert ck.stop_requested
        assert "stop requested: the run checkpoints at its next step" in capfd.readouterr().err  # said at once
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        ck.restore_signal_handlers()
        signal.signal(signal.SIGINT, inherited)


def test_a_resume_with_settings_of_another_trajectory_is_refused_in_one_line(corpus, tmp_path):
    """Resuming with another model gave a 40-line load_state_dict traceback, and with another
    schedule or budget it went on silently under the new one. The checkpoint now holds the run's config; the keys
    its trajectory depends on must agree, while implementation switches (model.mhc_kernels ...) may change."""
    import train
    from training.checkpoint import CheckpointError
    base = in_process(corpus, tmp_path, "traj", "train.checkpoint_every=5", "eval.pre_quant=false")
    train.main(base)
    # its step-14 checkpoint as a run stopped while it was scored leaves it (a finished run refuses any resume)
    (tmp_path / "runs/checkpoints/traj/finished.json").unlink()
    for override, says in (("model.n_layers=3", "model.n_layers: checkpoint 2, this run 3"),
                           ("train.schedule=time", "train.schedule: checkpoint 'steps', this run 'time'"),
                           ("train.seed=5", "train.seed: checkpoint 1337, this run 5")):
        extra = [override, "train.time_budget_s=60"] if "schedule" in override else [override]
        with pytest.raises(CheckpointError, match=rf"step_00000014: written by a run of other settings \({says}.*"
                                                  r"\(hint: resume with the run's own command"):
            train.main([*base, *extra, "train.resume=latest"])
    # a switch: same run. The kernels run in Triton's interpreter here, so the resumed run is scored and quantized
    # briefly (neither setting is part of the trajectory)
    quick = ["model.mhc_kernels=true", "quant.error_weight=output", "eval.max_tokens=256", "train.resume=latest"]
    assert train.main([*base, *quick])["steps"] == 14


def test_the_first_signal_with_stderr_gone_still_stops_the_run(tmp_path):
    """The acknowledgement's os.write raised BrokenPipeError inside the handler when stderr's reader
    had gone (Ctrl-C on `train.py 2>&1 | tee`), and the run died before it could checkpoint."""
    script = tmp_path / "child.py"
    script.write_text(
        "import os, signal, sys, time\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "from training.checkpoint import Checkpointer\n"
        f"ck = Checkpointer(__import__('pathlib').Path({str(tmp_path)!r}), 0, 1, 0, 1)\n"
        "ck.install_signal_handlers()\n"
        "print('ready', flush=True)\n"
        "while not ck.stop_requested:\n"
        "    time.sleep(0.01)\n"
        "print('stopping cleanly', flush=True)\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    proc.stderr.close()  # the reader of stderr has gone
    proc.send_signal(signal.SIGINT)
    assert proc.stdout.readline().strip() == "stopping cleanly"
    assert proc.wait(timeout=30) == 0


def test_refused_starts_leave_the_log_whole_and_a_finished_run_says_it_finished(corpus, tmp_path, monkeypatch):
    """A run stopped at step 3, two starts refused under its run_id (a resume with another optim.matrix_lr, a
    rerun without resume over its checkpoint), then its resume to the end: each refused start had appended a `run`
    header and config, and the log read back only the steps after the resume (or none). And the resume command
    repeated after the run finished trained again from the step-3 checkpoint and rewrote the artifact."""
    import train
    from scripts import plot
    from training.log_reader import parse_log
    from training import trainer
    from training.checkpoint import CheckpointError
    real, calls = trainer.train_step, []

    def stop_after_three(*a, **k):
        loss = real(*a, **k)
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return loss
    monkeypatch.setattr(trainer, "train_step", stop_after_three)
    with pytest.raises(SystemExit) as stopped:
        train.main(in_process(corpus, tmp_path, "cut"))
    assert stopped.value.code == 143
    monkeypatch.setattr(trainer, "train_step", real)
    with pytest.raises(CheckpointError, match="optim.matrix_lr: checkpoint 0.025, this run 0.1"):
        train.main(in_process(corpus, tmp_path, "cut", "train.resume=latest", "optim.matrix_lr=0.1"))
    with pytest.raises(FileExistsError, match="checkpoint.s. past step 0"):
        train.main(in_process(corpus, tmp_path, "cut"))
    record = train.main(in_process(corpus, tmp_path, "cut", "train.resume=latest"))
    log_file = tmp_path / "logs/cut.txt"
    log = parse_log(log_file)
    assert [s["step"] for s in log.steps] == list(range(1, 15)) and log.final == record
    assert len(log.refusals) == 2 and log.fresh_runs == 1 and "optim" in log.refusals[0]
    artifact = tmp_path / f"runs/{record['run_id']}.mhcg"
    written = artifact.stat().st_mtime_ns
    with pytest.raises(CheckpointError, match=r"run cut has finished \(step 14, val_bpb .*; nothing to resume "
                                              r"\(hint: score it again with python -m scripts.evaluate --artifact"):
        train.main(in_process(corpus, tmp_path, "cut", "train.resume=latest"))
    again = parse_log(log_file)
    assert again.final == record and len(again.refusals) == 3 and artifact.stat().st_mtime_ns == written
    assert plot.main([str(log_file), "--out", str(tmp_path / "plots")])  # the whole trajectory plots
