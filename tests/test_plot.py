"""scripts.plot and training.log_reader on logs written by the real RunLog (same format as train.py's)."""
from pathlib import Path

import pytest

from scripts import plot
from training.log_reader import LogFormatError, parse_lines, parse_log
from training.run_log import RunLog

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_log(path: Path, run_id: str, losses: list[float], evals: dict[int, float] | None = None,
              final_bpb: float | None = None, seconds_per_step: float = 0.5, batch_tokens: int | None = None) -> Path:
    log = RunLog(path, enabled=True)
    log(f"run {run_id}  commit abc1234  world_size 1  device cpu")
    log('versions {"python": "3.11.7", "torch": "2.13.0+cpu", "triton": "3.9.0"}')
    log('config {"train": {"seed": 1}}' if batch_tokens is None else
        f'config {{"train": {{"seed": 1, "batch_tokens": {batch_tokens}}}}}')
    log("phase setup 1.0 s")
    for i, loss in enumerate(losses, start=1):
        log.record("step", step=i, loss=loss, lr_mult=1.0, tok_s=100, train_time_s=i * seconds_per_step,
                   done_pct=100 * i / len(losses), eta_s=0.0)
        if evals and i in evals:
            log.record("eval", step=i, train_time_s=i * seconds_per_step, val_bpb=evals[i], val_loss=2 * evals[i])
    if final_bpb is not None:
        log.record("eval", stage="artifact", val_bpb=final_bpb, val_loss=2 * final_bpb)
        log.final({"run_id": run_id, "steps": len(losses), "train_time_s": len(losses) * seconds_per_step,
                   "val_bpb": final_bpb, "val_loss": 2 * final_bpb})
    else:
        log._file.close()
    return path


def line_data(fig):
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in fig.axes[0].get_lines()}


def test_parse_log_reads_header_records_and_final(tmp_path, capsys):
    path = write_log(tmp_path / "a.txt", "run-a", [3.0, 2.5, 2.0], evals={2: 1.5}, final_bpb=1.4)
    capsys.readouterr()
    log = parse_log(path)
    assert (log.run_id, log.commit, log.world_size, log.device) == ("run-a", "abc1234", 1, "cpu")
    assert log.versions["torch"] == "2.13.0+cpu" and log.config == {"train": {"seed": 1}}
    assert [s["loss"] for s in log.steps] == [3.0, 2.5, 2.0]
    assert log.evals == [{"step": 2, "train_time_s": 1.0, "val_bpb": 1.5, "val_loss": 3.0}]
    assert log.stage_evals["artifact"]["val_bpb"] == 1.4 and log.final["steps"] == 3
    assert log.config_value("train.seed") == 1
    with pytest.raises(LogFormatError, match="train.nope"):
        log.config_value("train.nope")


def test_resumed_log_keeps_one_trajectory():
    lines = ['step {"step": 1, "loss": 5.0}', 'step {"step": 2, "loss": 4.0}', 'step {"step": 3, "loss": 3.9}',
             "run r  commit x  world_size 2  device cuda:0",  # the resumed process, from step 2's checkpoint
             'step {"step": 3, "loss": 3.5}', 'step {"step": 4, "loss": 3.0}']
    log = parse_lines(lines, "resumed.txt")
    assert [(s["step"], s["loss"]) for s in log.steps] == [(1, 5.0), (2, 4.0), (3, 3.5), (4, 3.0)]
    assert log.world_size == 2


def test_a_run_appended_after_a_finished_one_has_no_final_yet():
    """train.py appends to its log: the earlier run's final line is not the result of the run after it."""
    finished = ['config {"train": {"seed": 1}}', 'step {"step": 1, "loss": 5.0}', 'final {"val_bpb": 1.5}']
    assert parse_lines(finished, "a.txt").final == {"val_bpb": 1.5}
    appended = parse_lines([*finished, "run r  commit x  world_size 1  device cpu", 'config {"train": {"seed": 2}}'],
                           "a.txt")
    assert appended.final is None and appended.config == {"train": {"seed": 2}}


def test_a_run_id_used_again_starts_afresh_and_a_resume_continues():
    """A re-run appended to a log (a run_id used again, train.resume empty) used to keep the earlier run's evals:
    a crashed re-run was plotted with the earlier run's artifact score. A resumed run keeps the
    trajectory and drops only the end-of-run evals of the process it continues."""
    first = ['config {"train": {"seed": 1, "resume": ""}}', 'step {"step": 50, "loss": 3.0}',
             'eval {"step": 50, "val_bpb": 1.9}', 'eval {"stage": "artifact", "val_bpb": 1.5}', 'final {"val_bpb": 1.5}']
    again = parse_lines([*first, 'config {"train": {"seed": 1, "resume": ""}}', 'step {"step": 25, "loss": 4.0}'],
                        "a.txt")
    assert ([s["step"] for s in again.steps], again.evals, again.stage_evals, again.final) == ([25], [], {}, None)
    assert again.fresh_runs == 2
    resumed = parse_lines([*first[:3], 'config {"train": {"seed": 1, "resume": "latest"}}',
                           'step {"step": 60, "loss": 2.9}'], "b.txt")
    assert [s["step"] for s in resumed.steps] == [50, 60] and resumed.evals == [{"step": 50, "val_bpb": 1.9}]
    assert resumed.fresh_runs == 1


def test_a_file_that_is_no_text_log_is_named(tmp_path):
    (tmp_path / "a.mhcg").write_bytes(b"MHCGOLF\x00\xe4\xff\x00")
    with pytest.raises(LogFormatError, match=r"a.mhcg: not a text log"):  # a UnicodeDecodeError traceback before
        parse_log(tmp_path / "a.mhcg")
    with pytest.raises(LogFormatError, match=r": a folder, not a run log"):
        parse_log(tmp_path)


def test_bad_json_names_file_and_line():
    with pytest.raises(LogFormatError, match=r"broken.txt:2: `step` line is not valid JSON"):
        parse_lines(['step {"step": 1, "loss": 5.0}', 'step {"step": 2, "loss"'], "broken.txt")


def test_a_record_without_a_field_the_plots_read_is_named(tmp_path, capsys):
    """A step line without its loss, an eval without its val_bpb, or a record without the training time the time
    axis needs ended in a bare KeyError that named neither file nor line."""
    with pytest.raises(LogFormatError, match=r"cut.txt:2: `step` record has no 'loss' field"):
        parse_lines(['step {"step": 1, "loss": 5.0}', 'step {"step": 2, "lr_mult": 1.0}'], "cut.txt")
    with pytest.raises(LogFormatError, match=r"cut.txt:1: `eval` record has no 'val_bpb' field"):
        parse_lines(['eval {"step": 1, "val_loss": 2.0}'], "cut.txt")
    log = tmp_path / "untimed.txt"
    log.write_text('step {"step": 1, "loss": 5.0, "train_time_s": 0.5}\nstep {"step": 2, "loss": 4.0}\n'
                   'eval {"step": 2, "val_bpb": 1.9}\n')
    written = plot.main([str(log), "--out", str(tmp_path / "plots")])  # a KeyError before
    assert sorted(p.name for p in written) == ["bpb_vs_step.png", "loss_vs_step.png", "loss_vs_time.png"]
    err = capsys.readouterr().err
    assert "untimed.txt: 1 `step` record(s) without 'train_time_s' (step 2) left out of the plots against time" in err
    assert "untimed.txt: 1 `eval` record(s) without 'train_time_s' (step 2) left out of the plots against time" in err


def test_figures_overlay_runs_with_run_id_legend(tmp_path, capsys):
    a = parse_log(write_log(tmp_path / "a.txt", "run-a", [3.0, 2.0, 1.5], evals={2: 1.8, 3: 1.6}, final_bpb=1.65))
    b = parse_log(write_log(tmp_path / "b.txt", "run-b", [3.1, 2.9], final_bpb=2.2, seconds_per_step=2.0))
    capsys.readouterr()
    figs = plot.build_figures([a, b])
    assert set(figs) == {"loss_vs_step", "loss_vs_time", "bpb_vs_step", "bpb_vs_time"}
    assert line_data(figs["loss_vs_step"]) == {"run-a": ([1, 2, 3], [3.0, 2.0, 1.5]), "run-b": ([1, 2], [3.1, 2.9])}
    assert line_data(figs["loss_vs_time"])["run-b"] == ([2.0, 4.0], [3.1, 2.9])
    bpb = line_data(figs["bpb_vs_step"])
    assert bpb["run-a"] == ([2, 3], [1.8, 1.6])
    assert bpb["run-a (artifact)"] == ([3], [1.65])
    assert bpb["run-b"] == ([2], [2.2]), "a run with only the final score still shows its final point"
    assert line_data(figs["bpb_vs_time"])["run-b"] == ([4.0], [2.2])
    assert [t.get_text() for t in figs["loss_vs_step"].axes[0].get_legend().get_texts()] == ["run-a", "run-b"]


def test_tokens_axis_when_every_log_has_its_batch_size(tmp_path, capsys):
    """Runs of different batch sizes (or GPU counts) compare per token: step x train.batch_tokens."""
    a = write_log(tmp_path / "a.txt", "one-gpu", [3.0, 2.0, 1.5, 1.2], final_bpb=1.5, batch_tokens=1000)
    b = write_log(tmp_path / "b.txt", "two-gpu", [3.1, 2.0], final_bpb=1.4, batch_tokens=2000)
    logs = [parse_log(a), parse_log(b)]
    capsys.readouterr()
    figs = plot.build_figures(logs)
    assert line_data(figs["loss_vs_tokens"]) == {"one-gpu": ([0.001, 0.002, 0.003, 0.004], [3.0, 2.0, 1.5, 1.2]),
                                                 "two-gpu": ([0.002, 0.004], [3.1, 2.0])}
    assert line_data(figs["bpb_vs_tokens"])["two-gpu"] == ([0.004], [1.4])
    c = parse_log(write_log(tmp_path / "c.txt", "no-batch", [3.0, 2.0]))  # an old log: no tokens plots
    capsys.readouterr()
    assert "loss_vs_tokens" not in plot.build_figures([*logs, c])
    assert "c.txt has no train.batch_tokens" in capsys.readouterr().err


def test_same_run_id_in_two_folders_gets_distinct_labels(tmp_path, capsys):
    (tmp_path / "x").mkdir(), (tmp_path / "y").mkdir()
    logs = [parse_log(write_log(tmp_path / d / "t.txt", "tiny", [3.0, 2.0])) for d in ("x", "y")]
    capsys.readouterr()
    labels = plot.run_labels(logs)
    assert len(set(labels)) == 2 and all(label.startswith("tiny (") for label in labels)


def test_cli_writes_pngs_atomically(tmp_path, capsys):
    a = write_log(tmp_path / "a.txt", "run-a", [3.0, 2.0, 1.5], evals={3: 1.6}, final_bpb=1.65)
    b = write_log(tmp_path / "b.txt", "run-b", [3.1, 2.9, 2.5])  # unfinished: no final, no evals
    out = tmp_path / "plots"
    capsys.readouterr()
    written = plot.main([str(a), str(b), "--out", str(out)])
    assert sorted(p.name for p in written) == ["bpb_vs_step.png", "bpb_vs_time.png", "loss_vs_step.png",
                                                "loss_vs_time.png"]
    for path in written:
        data = path.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in written), "no temp files left behind"
    assert capsys.readouterr().out.split() == [str(p) for p in written]


def test_cli_without_any_bpb_writes_only_loss_plots(tmp_path, capsys):
    """...and removes an earlier call's BPB plots from the folder, which would otherwise pass as this call's."""
    scored = write_log(tmp_path / "s.txt", "run-s", [3.0, 2.0], evals={1: 1.8}, final_bpb=1.6)
    plot.main([str(scored), "--out", str(tmp_path / "plots")])
    assert (tmp_path / "plots" / "bpb_vs_step.png").exists()
    a = write_log(tmp_path / "a.txt", "run-a", [3.0, 2.0])
    written = plot.main([str(a), "--out", str(tmp_path / "plots")])
    assert sorted(p.name for p in written) == ["loss_vs_step.png", "loss_vs_time.png"]
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["loss_vs_step.png", "loss_vs_time.png"]
    assert "no validation BPB" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # an --out that is a file: one line, not a FileExistsError traceback
        plot.main([str(a), "--out", str(a)])
    assert f"--out {a}: {a} exists and is a file" in capsys.readouterr().err


def test_log_without_steps_is_an_error_naming_the_file(tmp_path, capsys):
    good = write_log(tmp_path / "good.txt", "run-a", [3.0, 2.0])
    empty = tmp_path / "empty.txt"
    empty.write_text("run x  commit y  world_size 1  device cpu\nphase setup 1.0 s\n")
    out = tmp_path / "plots"
    with pytest.raises(SystemExit, match=r"empty\.txt: no `step \{json\}` lines"):
        plot.main([str(good), str(empty), "--out", str(out)])
    assert not out.exists(), "nothing is written when any log is bad"
    with pytest.raises(SystemExit, match="missing.txt does not exist"):
        plot.main([str(tmp_path / "missing.txt"), "--out", str(out)])


def test_plots_of_real_train_py_logs(tiny_seed_runs, tmp_path, capsys):
    written = plot.main([*map(str, tiny_seed_runs.logs), "--out", str(tmp_path)])
    assert len(written) == 6  # step, time and tokens axes (train.py logs carry train.batch_tokens)
    logs = [parse_log(p) for p in tiny_seed_runs.logs]
    figs = plot.build_figures(logs)
    bpb = line_data(figs["bpb_vs_step"])
    for log in logs:  # periodic evals as a curve, the artifact's score as the final marker
        assert bpb[log.run_id] == ([e["step"] for e in log.evals], [e["val_bpb"] for e in log.evals])
        assert bpb[f"{log.run_id} (artifact)"] == ([log.final["steps"]], [log.final["val_bpb"]])


def test_one_point_shows_and_nan_points_are_left_out(tmp_path, capsys):
    """A log with one step drew an invisible line (no marker), and a diverged run's NaN scores
    made empty BPB plots without a word. NaN points are left out; a run with nothing finite is named."""
    one = parse_log(write_log(tmp_path / "one.txt", "one", [3.0], final_bpb=2.0))
    nan = float("nan")
    diverged = parse_log(write_log(tmp_path / "nan.txt", "diverged", [3.0, nan, nan], evals={1: 2.5, 2: nan},
                                   final_bpb=nan))
    lost = parse_log(write_log(tmp_path / "lost.txt", "lost", [nan, nan]))
    capsys.readouterr()
    figs = plot.build_figures([one, diverged, lost])
    lines = {line.get_label(): line for line in figs["loss_vs_step"].axes[0].get_lines()}
    assert lines["one"].get_marker() == "." and list(lines["one"].get_ydata()) == [3.0]
    assert list(lines["diverged"].get_ydata()) == [3.0] and "lost" not in lines
    assert "lost.txt: no finite training loss to draw" in capsys.readouterr().err
    bpb = line_data(figs["bpb_vs_step"])
    assert bpb["diverged"] == ([1], [2.5]) and "diverged (artifact)" not in bpb  # the NaN score has no star


def test_the_code_digest_is_that_of_every_process_of_the_kept_run():
    """Only the last `run` header's digest was kept, so a run trained under one code and resumed
    (or only scored) under another passed as the other's."""
    a, b = "a" * 16, "b" * 16

    def header(code):
        return f"run r  commit abc  code {code}  world_size 1  device cpu" if code else \
            "run r  commit abc  world_size 1  device cpu"
    fresh, resumed = 'config {"train": {"resume": ""}}', 'config {"train": {"resume": "latest"}}'
    final = 'final {"val_bpb": 1.0}'
    assert parse_lines([header(a), fresh, final], "x").code == a
    mixed = parse_lines([header(a), fresh, 'step {"step": 1, "loss": 2.0}', header(b), resumed, final], "x")
    assert mixed.code is None and mixed.codes == [a, b] and "digests aaaa" in mixed.describe_code()
    again = parse_lines([header(a), fresh, final, header(b), fresh, final], "x")  # a run_id used again: the last run
    assert again.code == b and again.codes == [b]
    old = parse_lines([header(None), fresh, final], "x")
    assert old.code is None and "unknown digest" in old.describe_code()


@pytest.mark.parametrize("sent", ["SIGTERM", "SIGHUP"])  # SIGHUP (a closed terminal) goes on as SIGTERM
def test_a_stop_signal_reaches_the_command_once_and_its_output_is_read_to_the_end(tmp_path, sent):
    """Ctrl-C killed scripts.reproduce's reader, and train.py then died in its next log line on
    the closed pipe, losing the seed; SIGTERM to the reader alone left train.py training with nobody reading. The
    reader now passes the signal on (the command runs in a session of its own, so a terminal's Ctrl-C reaches it
    once) and reads its output until it exits."""
    import os
    import signal
    import sys
    import threading

    from training.log_reader import stream_run
    child = tmp_path / "child.py"
    child.write_text(
        "import os, signal, sys, time\n"
        "def stop(signum, frame):\n"
        "    print('checkpoint written', flush=True)\n"
        "    sys.exit(143)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        f"print('session differs', os.getsid(0) != {os.getsid(0)}, flush=True)\n"
        "time.sleep(60)\n")
    received: list[int] = []
    threading.Timer(1.0, lambda: os.kill(os.getpid(), getattr(signal, sent))).start()
    code, lines, final = stream_run([sys.executable, str(child)], "c", signals=received)
    assert code == 143 and received == [getattr(signal, sent)] and final is None
    assert [line.strip() for line in lines] == ["session differs True", "checkpoint written"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # given back


def test_a_log_line_survives_a_reader_that_has_gone(tmp_path, monkeypatch):
    """train.py died with BrokenPipeError in a log line when the reader of its stdout had gone; the line reaches the
    file first, and printing stops quietly."""
    import sys

    class Gone:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            raise BrokenPipeError(32, "Broken pipe")
    monkeypatch.setattr(sys, "stdout", Gone())
    log = RunLog(tmp_path / "r.txt", enabled=True)
    log("step one")
    log("step two")
    log.final({"val_bpb": 1.0})
    assert (tmp_path / "r.txt").read_text() == 'step one\nstep two\nfinal {"val_bpb": 1.0}\n'
