"""Checkpoints that let a run continue exactly: model, optimizers, EMA, loader cursor, RNG, step, clock.

Layout: <dir>/step_<N>/rank<r>.pt, one file per rank (Muon's momentum is sharded: each rank owns
part of it), written as `step_<N>.tmp/` and renamed by rank 0 once every rank has written, so a
killed run never leaves a directory that looks complete (and a new Checkpointer removes such leftovers).
The one just written is kept with the newest `keep` - 1 others.

Checkpoints are not artifacts: they hold optimizer state for resuming, and are loaded with
`torch.load(weights_only=True)`, which refuses anything but tensors and plain containers.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from data.files import write_atomic
from training.config import flat_config
from training.distributed import RankAgreement, fail_together

STEP_DIR = re.compile(r"^step_(\d{8})$")


class CheckpointError(ValueError):
    """A checkpoint this run cannot continue from: another world size or optimizer settings, a missing part."""


@dataclass
class Resumed:
    step: int
    train_time_s: float


def complete_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Finished checkpoint directories, oldest first (a `.tmp` one is an interrupted write)."""
    if not ckpt_dir.is_dir():
        return []
    found = [p for p in ckpt_dir.iterdir() if p.is_dir() and STEP_DIR.match(p.name)]
    return sorted(found, key=checkpoint_step)


def replace_folder(new: Path, final: Path, aside: Path) -> None:
    """Put the finished folder `new` at `final` by renames on one filesystem (checkpoints, record folders). A
    rename cannot replace a non-empty folder, so one already at `final` moves to `aside` first and is removed
    once `new` is in place; a run killed between the two renames leaves it at `aside` for the caller to
    recover, and an `aside` such a run left is cleared first."""
    if final.exists():
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
    os.replace(new, final)
    shutil.rmtree(aside, ignore_errors=True)


def checkpoint_step(path: Path) -> int:
    return int(STEP_DIR.match(path.name).group(1))


def refuse_later_checkpoints(ckpt_dir: Path, start_step: int) -> None:
    """A run starting at `start_step` (0, or the step it resumes from) must not share its folder with
    checkpoints past that step: they are another trajectory of this run_id, which train.resume=latest would
    pick up and which pruning would mix with this run's."""
    later = [p for p in complete_checkpoints(ckpt_dir) if checkpoint_step(p) > start_step]
    if later:
        raise FileExistsError(f"{ckpt_dir} holds {len(later)} checkpoint(s) past step {start_step} from another run "
                              f"with this run_id (e.g. {later[-1].name}); hint: train.resume=latest continues the "
                              "newest, a new train.run_id starts afresh, or move them away")


FINISHED = "finished.json"  # in a run's checkpoint folder once its artifact is scored


def mark_finished(ckpt_dir: Path, final: dict, artifact: Path) -> None:
    """Records that the run of this folder finished: train.resume=latest then says so instead of training again from
    a checkpoint it kept (the one a stop signal wrote before the run was resumed and finished, say)."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    done = {"steps": final.get("steps"), "val_bpb": final.get("val_bpb"), "artifact": str(artifact)}
    write_atomic(ckpt_dir / FINISHED, (json.dumps(done) + "\n").encode())


def clear_finished(ckpt_dir: Path) -> None:
    """A run that trains again under this run_id (a fresh start, or a resume from a named checkpoint) is no longer
    finished."""
    (ckpt_dir / FINISHED).unlink(missing_ok=True)


def resolve_resume(resume: str, ckpt_dir: Path) -> Path | None:
    """train.resume: '' (fresh run), 'latest' (newest complete checkpoint of this run, if any) or a path. 'latest'
    on a run that finished is refused: there is nothing to resume, and its kept checkpoints would train again."""
    if not resume:
        return None
    if resume == "latest" and (ckpt_dir / FINISHED).is_file():
        try:
            done = json.loads((ckpt_dir / FINISHED).read_text())
            summary = f"step {done['steps']}, val_bpb {done['val_bpb']:.4f}, artifact {done['artifact']}"
        except (OSError, ValueError, KeyError, TypeError):
            summary, done = "its record unreadable", {"artifact": f"<train.out_dir>/{ckpt_dir.name}.mhcg"}
        raise CheckpointError(f"train.resume=latest: run {ckpt_dir.name} has finished ({summary}); nothing to resume "
                              f"(hint: score it again with python -m scripts.evaluate --artifact {done['artifact']} "
                              f"--val VAL_SHARDS --tokenizer TOKENIZER; to train again: a new train.run_id, or move {ckpt_dir} "
                              "away first)")
    if resume == "latest":
        done = complete_checkpoints(ckpt_dir)
        return done[-1] if done else None
    path = Path(resume)
    if not path.is_dir() or not STEP_DIR.match(path.name):
        raise FileNotFoundError(f"train.resume={resume!r}: expected 'latest' or a checkpoint directory "
                                f"named step_NNNNNNNN (hint: ls {ckpt_dir})")
    return path


# What a run's trajectory depends on, beside the optimizer settings that load_checkpoint compares anyway: resumed
# with another value, a checkpoint would continue another run (the implementation switches model.attention,
# model.mhc_kernels and model.mlp_kernel compute the same function and may change).
TRAJECTORY = ("model.", "optim.", "data.seq_len", "data.shards_per_batch", "train.seed", "train.batch_tokens",
              "train.max_steps", "train.time_budget_s", "train.schedule", "quant.calib_reserve_s", "quant.calib_source")
SWITCHES = ("model.attention", "model.mhc_kernels", "model.mlp_kernel")


def trajectory_differences(saved: dict, mine: dict) -> list[str]:
    """`key: checkpoint X, this run Y` for the trajectory keys where two resolved configs (to_dict form) differ."""
    a, b = flat_config(saved), flat_config(mine)
    # keys on one side only are left out: a field added since the checkpoint was written (its default keeps the old
    # behaviour) must not make every older checkpoint unresumable
    return [f"{key}: checkpoint {a[key]!r}, this run {b[key]!r}" for key in sorted(set(a) & set(b))
            if key.startswith(TRAJECTORY) and key not in SWITCHES and a[key] != b[key]]


class Checkpointer:
    """Saves every `every_steps` steps and when SIGTERM/SIGINT arrives (at the next step boundary). run_config (the
    resolved config, to_dict form) goes into each checkpoint, for load_checkpoint to compare."""

    def __init__(self, ckpt_dir: Path, every_steps: int, keep: int, rank: int, world_size: int,
                 run_config: dict | None = None):
        self.dir, self.every, self.keep, self.run_config = ckpt_dir, every_steps, keep, run_config
        self.rank, self.world = rank, world_size
        self.stop_requested = False
        self._previous_handlers = {}
        if rank == 0 and ckpt_dir.is_dir():
            self._recover(ckpt_dir)

    @staticmethod
    def _recover(ckpt_dir: Path) -> None:
        """Undo what a killed run left: half-written folders go; a checkpoint set aside by _publish comes back
        if the run died before its replacement was in place, else goes."""
        for stale in ckpt_dir.glob("step_*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        for aside in ckpt_dir.glob("step_*.replaced"):
            final = aside.with_name(aside.name.removesuffix(".replaced"))
            if final.exists():
                shutil.rmtree(aside, ignore_errors=True)
            else:
                os.replace(aside, final)

    def install_signal_handlers(self) -> None:
        """The first SIGTERM/SIGINT asks for a stop at the next safe point (a step boundary, a scoring phase); a
        second one is not deferred: the previous handlers come back and get it (Ctrl-C twice interrupts at once)."""
        def request_stop(signum, frame):
            if not self.stop_requested:
                self.stop_requested = True
                if self.rank == 0:  # os.write: no buffered stream to re-enter from a handler
                    try:
                        os.write(2, b"stop requested: the run checkpoints at its next step (or between scoring "
                                    b"phases) and exits; a second signal stops it at once, without a checkpoint\n")
                    except OSError:  # stderr's reader has gone (Ctrl-C on `... | tee`): the stop still happens
                        pass
                return
            self.restore_signal_handlers()
            signal.raise_signal(signum)
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous_handlers[sig] = signal.signal(sig, request_stop)

    def restore_signal_handlers(self) -> None:
        for sig, handler in self._previous_handlers.items():
            signal.signal(sig, handler)
        self._previous_handlers = {}

    def folder(self, step: int) -> Path:
        """Where the checkpoint of `step` is (complete once the folder exists)."""
        return self.dir / f"step_{step:08d}"

    def has(self, step: int) -> bool:
        """A complete checkpoint of `step` is in the folder."""
        return self.folder(step).is_dir()

    def is_periodic(self, step: int) -> bool:
        """A checkpoint step by the schedule alone. A stop request is a separate decision: the ranks
        agree on it first (training.distributed.RankAgreement), since it reaches each at its own time."""
        return self.every > 0 and step % self.every == 0

    def save(self, step: int, train_time_s: float, model, optimizers, ema, loader) -> Path:
        final = self.folder(step)
        tmp = final.with_name(final.name + ".tmp")
        failure = None
        if self.rank == 0:
            try:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
            except Exception as e:  # the others would wait for the folder in a barrier, without a word
                failure = e
        fail_together(failure, f"to create the folder of checkpoint {final.name}")  # a barrier too
        state = {
            "step": step, "train_time_s": train_time_s, "world_size": self.world,
            "optimizers": [o.state_dict() for o in optimizers],
            "loader": loader.state_dict(),
            "rng_cpu": torch.get_rng_state(),
        }
        if torch.cuda.is_available():
            state["rng_cuda"] = torch.cuda.get_rng_state()
        if self.rank == 0:  # replicated state: once is enough
            state["model"] = model.state_dict()
            # the phase of depth recurrence the weights were trained in last, for tools that re-export them
            # (scripts/bench_quant.py); a resume takes its phase from its progress instead
            state["recurrence_on"] = getattr(model, "recurrence_on", False)
            if self.run_config is not None:
                state["config"] = self.run_config
            if ema is not None:
                state["ema"] = ema.state_dict()
        part = tmp / f"rank{self.rank}.pt"
        try:
            failure = None
            try:
                torch.save(state, str(part) + ".part")
                os.replace(str(part) + ".part", part)
            except Exception as e:  # disk full, say, maybe under one rank only: every rank stops
                failure = e
            fail_together(failure, f"to write its part of checkpoint {final.name}")  # and waits for the others
        except BaseException:  # no half-written folder of possibly gigabytes stays behind
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        failure = None
        if self.rank == 0:
            try:
                self._publish(tmp, final)
                # the checkpoint just written always stays, with the newest keep - 1 others
                others = [p for p in complete_checkpoints(self.dir) if p != final]
                for old in others[:max(0, len(others) - (self.keep - 1))]:
                    shutil.rmtree(old, ignore_errors=True)
            except Exception as e:
                failure = e
                shutil.rmtree(tmp, ignore_errors=True)  # every rank's part, maybe gigabytes; an old one is kept
        fail_together(failure, f"to publish checkpoint {final.name}")  # a barrier too
        return final

    @staticmethod
    def _publish(tmp: Path, final: Path) -> None:
        """Rename the finished folder into place; a folder of that step already there goes aside to
        step_*.replaced, which _recover finds. train.py never replaces one (it refuses to start beside later
        checkpoints and saves only after its start step); other users of Checkpointer may."""
        replace_folder(tmp, final, final.with_name(final.name + ".replaced"))


def optimizer_settings(optimizers) -> dict[tuple[str, str], object]:
    """{(group, key): value} of every fixed optimizer setting: all of a param group but its tensors and what the
    schedule sets at each step (lr, and Muon's momentum during its warmup), and the implementation flags that follow
    the device (AdamW's fused is True on CUDA, None on CPU: a CPU checkpoint resumes on a GPU)."""
    return {(group.get("name", "?"), key): value for opt in optimizers for group in opt.param_groups
            for key, value in group.items()
            if key not in ("params", "lr", "momentum", "fused", "foreach", "capturable", "differentiable")}


def _read_part(file: Path) -> dict:
    """One rank's part, or a CheckpointError naming the file (a truncated part was an OSError with no path)."""
    try:
        part = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # torch.load raises OSError, RuntimeError, pickle errors... for a damaged file
        raise CheckpointError(f"{file}: unreadable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}) "
                              "(hint: train.resume=<an older step_NNNNNNNN folder>, or move this one away and "
                              "resume=latest takes the one before)") from None
    if not isinstance(part, dict) or "world_size" not in part:
        raise CheckpointError(f"{file}: not a checkpoint part written by train.py (no world_size) (hint: "
                              "train.resume=<an older step_NNNNNNNN folder>)")
    return part


def load_checkpoint(path: Path, model, optimizers, ema, loader, rank: int, world_size: int,
                    run_config: dict | None = None) -> Resumed:
    """Restore everything `Checkpointer.save` wrote; the world size must match (Muon's shards), and with run_config
    the settings the run's trajectory depends on (TRAJECTORY; checkpoints from before they were saved skip this)."""
    if not (path / f"rank{rank}.pt").exists():  # more ranks now than wrote it: say so, not "no such file"
        written = len(list(path.glob("rank*.pt")))
        raise CheckpointError(f"{path}: written by {written} rank(s), resuming on {world_size}: it has no rank{rank}.pt "
                         "(hint: resume with the same --nproc_per_node)")
    own = _read_part(path / f"rank{rank}.pt")
    if own["world_size"] != world_size:
        raise CheckpointError(f"{path}: written by {own['world_size']} rank(s), resuming on {world_size} "
                         "(hint: resume with the same --nproc_per_node)")
    shared = own if rank == 0 else _read_part(path / "rank0.pt")
    if run_config is not None and isinstance(shared.get("config"), dict):
        differences = trajectory_differences(shared["config"], run_config)
        if differences:
            raise CheckpointError(f"{path}: written by a run of other settings ({'; '.join(differences[:3])}"
                                  f"{'; …' if len(differences) > 3 else ''}) (hint: resume with the run's own command "
                                  "and overrides plus train.resume=latest; a checkpoint continues the run it belongs to)")
    try:
        model.load_state_dict(shared["model"])
    except RuntimeError as e:  # a checkpoint from before configs were saved, of another model
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        raise CheckpointError(f"{path}: its weights do not fit this run's model ({lines[min(1, len(lines) - 1)]}) "
                              "(hint: resume with the run's own model.* settings)") from None

    def settings() -> dict[tuple[str, str], object]:
        ema_setting = {("ema", "decay, warmup_steps"): (ema.decay, ema.warmup_steps)} if ema is not None else {}
        return {**optimizer_settings(optimizers), **ema_setting}
    configured = settings()
    for opt, state in zip(optimizers, own["optimizers"], strict=True):
        opt.load_state_dict(state)
    if ema is not None:
        if "ema" not in shared:
            raise CheckpointError(f"{path}: has no EMA state but optim.ema_decay > 0")
        ema.load_state_dict(shared["ema"])
    # Loading restores the settings the checkpoint trained with (peak LRs, weight decay, betas, Newton-Schulz steps,
    # the EMA's), while the run log records this run's config: a different optim.* would train on unlogged values.
    for (group, key), theirs in settings().items():
        mine = configured.get((group, key), theirs)  # a key of another torch version's defaults: not compared
        if mine != theirs:
            raise CheckpointError(f"{path}: trained with {key}={theirs} in group {group!r}, this run's config gives "
                             f"{mine} (hint: resume with the run's optim.* settings; a checkpoint continues the "
                             "run it belongs to)")
    try:
        loader.load_state_dict(own["loader"])
    except ValueError as e:  # the data moved under the run (other shards, or the same names over other data)
        raise CheckpointError(f"{path}: {e}") from None
    torch.set_rng_state(own["rng_cpu"])
    if "rng_cuda" in own and torch.cuda.is_available():
        torch.cuda.set_rng_state(own["rng_cuda"])
    return Resumed(step=int(own["step"]), train_time_s=float(own["train_time_s"]))


def keep_trained_state(checkpointer: Checkpointer, step: int, train_time_s: float, model, optimizers, ema, loader,
                       world_size: int, log) -> tuple[Path, bool]:
    """Before scoring: the trained state (live weights, EMA, optimizers, loader) as a checkpoint, so that a stop
    signal while the run is scored or exported loses no training; train.resume=latest then scores it with no step.
    Written before, not on the signal: under torchrun (or Slurm) SIGKILL follows SIGTERM within 30 s, and several
    ranks can only stop between phases that take minutes. Returns (its folder, whether it was written now: not when
    train.checkpoint_every > 0 wrote it, or the run resumed from it)."""
    path = checkpointer.folder(step)
    if not RankAgreement(world_size)(0.0, not checkpointer.has(step))[1]:  # the ranks agree, as save() needs them to
        return path, False
    t0 = time.perf_counter()
    checkpointer.save(step, train_time_s, model, optimizers, ema, loader)
    log(f"checkpoint {path} (step {step}, {time.perf_counter() - t0:.1f} s): the trained state, kept while the run "
        "is scored")
    return path, True
