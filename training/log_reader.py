"""Run logs read back, for the tools: parse_log (a log train.py wrote, training.run_log), stream_run (runs train.py
and reads its stdout the same way, its last line, the bare final JSON, apart), and output_problem (where a tool's
output can go). None of it runs in training, so a record does not ship it.

A resumed run appends to the same file, so step numbers can go back: the records from the resumed
step on replace the ones the interrupted process had written, leaving one trajectory. A start that train.py
refused before it trained (a resume with other settings, a rerun over kept checkpoints) ends its lines with
`refused {json}`: everything from its `run …` header on is dropped, as if it had written nothing. A run that is not
a resume (train.resume empty) but reuses a run_id also appends: its `config` line starts the data afresh,
so nothing of the earlier run is read as its own, and `fresh_runs` counts such runs.
"""
from __future__ import annotations

import copy
import json
import os
import re
import signal
import subprocess
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

HEADER = re.compile(r"^run (?P<run_id>\S+)\s+commit (?P<commit>\S+)(?:\s+code (?P<code>[0-9a-f]+))?"
                    r"\s+world_size (?P<world_size>\d+)\s+device (?P<device>\S+)")  # `code`: absent from older logs
JSON_KINDS = ("step", "eval", "final", "config", "versions", "refused")


class LogFormatError(ValueError):
    """A log line that claims a record kind but does not hold one, or a log missing a needed part."""


@dataclass
class RunLogData:
    source: str                                  # file name (or "stdout of …") for error messages
    run_id: str | None = None
    commit: str | None = None
    codes: list = field(default_factory=list)    # code digest of each process that wrote the kept run (None: unlogged)
    world_size: int | None = None
    device: str | None = None
    versions: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)
    steps: list[dict] = field(default_factory=list)        # `step` records, in step order
    evals: list[dict] = field(default_factory=list)        # periodic evals (they carry "step")
    stage_evals: dict[str, dict] = field(default_factory=dict)  # end-of-run evals by stage
    final: dict | None = None
    fresh_runs: int = 0                          # `config` lines of runs that did not resume (see the module doc)
    refusals: list[str] = field(default_factory=list)  # the reasons of the refused starts the log holds

    @property
    def code(self) -> str | None:
        """The digest of the code that made the kept run (training.sources.code_digest), or None where its processes
        logged none or differing ones (a run resumed, or only scored, under other code)."""
        digests = set(self.codes)
        return digests.pop() if len(digests) == 1 else None

    def describe_code(self) -> str:
        """The code that made the kept run, in words, for a refusal."""
        known = sorted({c for c in self.codes if c})
        if len(set(self.codes)) > 1:
            return (f"code of digests {', '.join(known)}{' and an unlogged one' if None in self.codes else ''} (its "
                    "processes differ: resumed or scored under other code)")
        return f"code {known[0]}" if known else "code of unknown digest (a log from before digests were logged)"

    @property
    def label(self) -> str:
        return self.run_id or (self.final or {}).get("run_id") or Path(self.source).stem

    def require_steps(self) -> list[dict]:
        if not self.steps:
            raise LogFormatError(f"{self.source}: no `step {{json}}` lines (hint: is this a train.py log? "
                                 "A run logs its first step and every train.log_every steps)")
        return self.steps

    def require_final(self) -> dict:
        if self.final is None:
            raise LogFormatError(f"{self.source}: no `final {{json}}` line (hint: the run did not finish; "
                                 "a log is complete only after export and evaluation)")
        return self.final

    def config_value(self, dotted: str):
        """config_value('train.seed') -> the value from the `config` line, with a clear error."""
        section, _, key = dotted.partition(".")
        try:
            return self.config[section][key]
        except KeyError:
            raise LogFormatError(f"{self.source}: the `config` line has no {dotted} "
                                 "(hint: a log from an older train.py, or no config line at all)") from None


def _decode(payload: str, kind: str, where: str) -> dict:
    try:
        value = json.loads(payload)
    except json.JSONDecodeError as e:
        raise LogFormatError(f"{where}: `{kind}` line is not valid JSON ({e}) "
                             "(hint: a file truncated mid-line, or edited by hand?)") from None
    if not isinstance(value, dict):
        raise LogFormatError(f"{where}: `{kind}` line holds {type(value).__name__}, expected a JSON object")
    return value


# Fields every record of a kind carries in train.py's logs and the tools read, periodic and stage evals alike ("step"
# is checked where records are ordered; plot leaves out of a time plot the records without the training time).
REQUIRED_FIELDS = {"step": ("loss",), "eval": ("val_bpb",)}


def _append_in_order(records: list[dict], record: dict, where: str) -> None:
    """Keep one record per step; a step number going back means the run resumed from there."""
    step = record.get("step")
    if not isinstance(step, int):
        raise LogFormatError(f"{where}: record has no integer 'step' field: {record}")
    while records and records[-1]["step"] >= step:
        records.pop()
    records.append(record)


def _apply_line(log: RunLogData, line: str, where: str) -> None:
    header = HEADER.match(line)
    if header:
        log.run_id, log.commit, log.device = header["run_id"], header["commit"], header["device"]
        log.codes.append(header["code"])
        log.world_size = int(header["world_size"])
        return
    kind, _, payload = line.partition(" ")
    if kind not in JSON_KINDS or not payload.startswith("{"):
        return  # free text for people (phase timings, quantization report, ...)
    record = _decode(payload, kind, where)
    if missing := [key for key in REQUIRED_FIELDS.get(kind, ()) if key not in record]:  # plot and ablate read them; say so here, not KeyError
        raise LogFormatError(f"{where}: `{kind}` record has no {', '.join(repr(k) for k in missing)} field: {record} "
                             "(hint: a train.py log line cut or edited by hand?)")
    if kind == "step":
        _append_in_order(log.steps, record, where)
    elif kind == "eval" and "stage" in record:
        log.stage_evals[record["stage"]] = record
    elif kind == "eval":
        _append_in_order(log.evals, record, where)
    elif kind == "final":
        log.final = record
    elif kind == "config":  # a run's first record: what an earlier process wrote ends here
        resumed = isinstance(record.get("train"), dict) and bool(record["train"].get("resume"))
        if not resumed:  # a run_id used again: the earlier run's steps and evals are not this run's
            log.steps, log.evals, log.fresh_runs = [], [], log.fresh_runs + 1
            log.codes = log.codes[-1:]  # this run's own header
        log.config, log.final, log.stage_evals = record, None, {}
    else:
        log.versions = record


def parse_lines(lines, source: str) -> RunLogData:
    log = RunLogData(source=source)
    before = copy.deepcopy(log)  # the data as it was before the segment being read (from its `run …` header on)
    for number, line in enumerate(lines, start=1):
        line = line.rstrip("\n")
        if not line:
            continue
        where = f"{source}:{number}"
        if HEADER.match(line):
            before = copy.deepcopy(log)
        elif line.startswith("refused {"):  # a refused start: its segment is dropped
            reason = _decode(line.partition(" ")[2], "refused", where).get("reason")
            log, log.refusals = copy.deepcopy(before), before.refusals + [str(reason)]
            continue
        _apply_line(log, line, where)
    return log


def parse_log(path: str | Path) -> RunLogData:
    path = Path(path)
    if path.is_dir():
        raise LogFormatError(f"{path}: a folder, not a run log (hint: train.py writes logs/<run_id>.txt)")
    if not path.is_file():
        raise FileNotFoundError(f"run log {path} does not exist (hint: train.py writes logs/<run_id>.txt)")
    try:
        with open(path, encoding="utf-8") as f:
            return parse_lines(f, str(path))
    except UnicodeDecodeError:
        raise LogFormatError(f"{path}: not a text log (hint: train.py's log is logs/<run_id>.txt; an artifact or "
                             "a checkpoint is binary)") from None


def output_problem(path: str | Path, folder: bool) -> str | None:
    """Why `path` cannot receive a script's output (a file, or with folder=True a folder to fill), or None. Checked
    before anything runs, so that the output of hours of runs is not lost at the end: the path must not be of the
    other kind, and its nearest existing folder must take a new file (tried, not inferred from permissions, which
    root passes even where nothing can be written)."""
    path = Path(path)
    if path.exists() and path.is_dir() != folder:
        return f"{path} exists and is {'a file' if folder else 'a folder'}"
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        return f"{existing} is a file, so {path} cannot be made"
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".write-check-"):
            pass
    except OSError as e:
        return f"{existing} does not take new files ({e.strerror})"
    return None


def stream_run(command: list[str], label: str, env: dict | None = None, print_lock: threading.Lock | None = None,
               signals: list[int] | None = None) -> tuple[int, list[str], dict | None]:
    """Run a train.py command, echoing its stdout prefixed with [label] (stderr passes straight
    through); returns (exit status, stdout lines, the final JSON object of its last line or None).

    signals: called from the main thread with a list, SIGINT/SIGTERM that reach this process while the command
    runs are passed on to it and appended there, and the command's output is read until it exits (it checkpoints
    and stops). The command runs in a session of its own, so a terminal's Ctrl-C reaches it once, through here (a
    second one aborts it, as train.py documents); before, Ctrl-C killed this reader, and train.py died in its next
    log line on the closed pipe, and SIGTERM to this process alone left train.py running without a reader."""
    lines: list[str] = []
    lock = print_lock or threading.Lock()
    forward = signals is not None and threading.current_thread() is threading.main_thread() and os.name == "posix"
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True, bufsize=1, env=env,
                          start_new_session=forward) as proc:
        previous = {}
        if forward:  # SIGHUP (a closed terminal, an ssh drop) goes on as SIGTERM: train.py checkpoints on that
            def pass_on(signum, frame):
                signals.append(signum)
                proc.send_signal(signal.SIGTERM if signum == signal.SIGHUP else signum)
            previous = {sig: signal.signal(sig, pass_on) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        try:
            for line in proc.stdout:
                with lock:
                    print(f"[{label}] {line}", end="", flush=True)
                lines.append(line)
            proc.wait()
        except BaseException:  # this reader fails (its own stdout gone, say): the run checkpoints and stops, not orphaned
            if forward and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            raise
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    try:
        last = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        last = None
    return proc.returncode, lines, last if isinstance(last, dict) else None

