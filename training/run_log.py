"""The run log as train.py writes it: RunLog (logs/<run_id>.txt on rank 0, mirrored to stdout; optional wandb; the
final JSON line), and what its header says (git_commit, versions). The tools read it back with training.log_reader.

A log is plain text; the machine-readable lines are `<kind> {json}` written by RunLog.record / .final, plus the header
lines `run …`, `versions {json}` and `config {json}`. Everything else (phase timings, quantization notes) is for
people. A start refused before it trained ends its lines with `refused {json}` (RunLog.refused).
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from training.config import ConfigError

REPO = Path(__file__).resolve().parents[1]


def check_writable_dir(key: str, value: str) -> None:
    """A folder the run writes into (train.log_dir, train.out_dir) exists (made if missing) and takes files: checked
    at setup, not when the first file goes there (for train.out_dir that was after training, and the trained
    weights were lost with the traceback)."""
    folder = REPO / value
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{key}={value}: cannot make {folder} ({e.strerror}) (hint: another {key})") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}={value}: {folder} is not writable (hint: another {key})")


def require_wandb() -> Any:
    """The wandb module, or a ConfigError saying how to get it."""
    try:
        import wandb
    except ImportError:
        raise ConfigError("train.wandb=true but wandb is not installed (hint: pip install wandb, or set "
                          "train.wandb=false)") from None
    return wandb


def log_path(log_dir: str, run_id: str) -> Path:
    """Where train.py writes run `run_id`'s log: <train.log_dir>/<run_id>.txt, a relative log_dir taken from
    the repository root (the scripts that look for a run's log ask here)."""
    return REPO / log_dir / f"{run_id}.txt"


def git_commit(repo: Path) -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=repo, capture_output=True, text=True, timeout=5)
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def versions() -> dict[str, str]:
    info = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = "absent"
    if torch.cuda.is_available():
        info["cuda"] = str(torch.version.cuda)
        info["gpu"] = torch.cuda.get_device_name()
    return info


class RunLog:
    """Everything is written by rank 0 only; other ranks get a silent instance."""

    def __init__(self, path: Path, enabled: bool, wandb_run: Any = None):
        self.path, self.enabled, self.wandb = path, enabled, wandb_run
        self.start = time.time()
        self.started = False  # set once the run is past its checks and trains (or scores a finished checkpoint)
        self._stdout_gone = False
        if enabled:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", buffering=1)

    def __call__(self, msg: str) -> None:
        if not self.enabled:
            return
        self._file.write(msg + "\n")  # the file first: the terminal or pipe may be gone
        self._echo(msg)

    def _echo(self, line: str) -> None:
        """Print to stdout unless it has gone: a reader that died (Ctrl-C on scripts.reproduce closes the pipe) must
        not kill the run in a log line, before it could checkpoint; the file keeps every line."""
        if self._stdout_gone:
            return
        try:
            print(line, flush=True)
        except (ValueError, OSError):  # BrokenPipeError; ValueError: a closed stream
            self._stdout_gone = True  # once gone, never tried again

    def record(self, kind: str, **fields: Any) -> None:
        """A machine-readable line `<kind> {json}` (the plotting and reproduce scripts parse these)."""
        self(f"{kind} " + json.dumps(fields, sort_keys=True))
        if self.wandb is not None and kind in ("step", "eval"):
            self.wandb.log({f"{kind}/{k}": v for k, v in fields.items() if isinstance(v, (int, float))},
                           step=fields.get("step"))

    def refused(self, error: BaseException) -> None:
        """A start refused before it trained (a resume with other settings, a folder in use): `refused {json}` ends
        the lines it wrote, and readers drop that segment (training.log_reader), so that a finished run's log stays whole."""
        if not self.started:
            self.record("refused", reason=str(error))

    def final(self, result: dict[str, Any]) -> None:
        """The last line on stdout: one JSON object."""
        if not self.enabled:
            return
        line = json.dumps(result, sort_keys=True)
        self._file.write("final " + line + "\n")
        self._file.close()
        if self.wandb is not None:
            self.wandb.summary.update({k: v for k, v in result.items() if isinstance(v, (int, float, str))})
            self.wandb.finish()
        self._echo(line)


def maybe_wandb(enabled: bool, project: str, run_id: str, config: dict) -> Any:
    """A wandb run when enabled (WANDB_MODE=offline/disabled honoured by wandb itself), else None.

    wandb.init talks to the server in online mode: a network or login failure there is a ConfigError that says
    how to run without it, raised before the run log opens (train.py has every rank stop on it)."""
    if not enabled:
        return None
    wandb = require_wandb()
    try:
        return wandb.init(project=os.environ.get("WANDB_PROJECT", project), name=run_id, config=config,
                          mode=os.environ.get("WANDB_MODE"))
    except Exception as e:  # wandb's CommError/UsageError, a timeout, a refused login: all stop the run the same way
        raise ConfigError(f"train.wandb=true but wandb.init failed ({type(e).__name__}: {e}) (hint: WANDB_MODE=offline "
                          "logs locally for a later `wandb sync`, or set train.wandb=false)") from e
