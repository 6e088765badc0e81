"""Train a GPT with mHC residual streams, export a size-capped artifact, score it in bits per byte.

    python train.py --config configs/demo.toml [section.key=value ...]
    torchrun --standalone --nproc_per_node=8 train.py --config configs/record_8xh100.toml

Phases (each timed in the log): setup, compile warm-up (not counted), training (the wall-clock
budget, GPTQ calibration included), quantization + export, evaluation of the shipped artifact.
The last line on stdout is one JSON object.
"""
from __future__ import annotations

import argparse
import copy
import faulthandler
import json
import shutil
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed

from data.loader import TokenLoader
from data.shards import ShardError, list_shards, sample_digest
from data.tokenizer import TokenizerError
from model.gpt import GPT
from quant.container import ArtifactError, CodecUnavailable, require_codec
from training.score import evaluate_artifact
from training.checkpoint import (CheckpointError, Checkpointer, Resumed, checkpoint_step, clear_finished,
                                 keep_trained_state, load_checkpoint, mark_finished, refuse_later_checkpoints,
                                 resolve_resume)
from training.config import Config, ConfigError, load_config, to_dict
from training.distributed import (RankAgreement, RankFailed, destroy, fail_together, init_distributed,
                                  require_same_on_every_rank)
from training.ema import maybe_ema
from training.evaluate import ByteAuditError, evaluate_bpb
from training.export import ARTIFACT_CODEC, artifact_budget, export_model
from training.optim import build_optimizers
from training.run_log import RunLog, check_writable_dir, git_commit, log_path, maybe_wandb, require_wandb, versions
from training.shipped_code import code_digest
from training.trainer import grad_accum_steps, run_training, train_step, training_loader
from training.ttt import TTT_KEYS
from training.validation import Validation, load_validation

REPO = Path(__file__).resolve().parent


def parse_args(argv=None, default_config: str | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=default_config is None, default=default_config,
                   help=f"a TOML file (default: {default_config})" if default_config else "a TOML file in configs/")
    p.add_argument("overrides", nargs="*", help="section.key=value, e.g. model.n_layers=4")
    return p.parse_args(argv)


def warm_up_compile(step_model, model, loader, optimizers, cfg: Config, accum: int, device, log) -> None:
    """Run two real steps so torch.compile builds its graphs, then restore weights, optimizer, loader and RNG
    exactly: the timed run starts from the same state as an uncompiled one (or as the checkpoint it resumes).
    With depth recurrence (model.recur_times > 1) one more step with it on builds that phase's graph too: dynamo
    keeps both, so the switch during training costs no compile time."""
    t0 = time.perf_counter()
    weights = copy.deepcopy(model.state_dict())
    opt_states = [copy.deepcopy(o.state_dict()) for o in optimizers]
    loader_state = loader.state_dict()
    rng = torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    phase = model.recurrence_on
    for on in [False, False] + ([True] if cfg.model.recur_times > 1 else []):
        model.recurrence_on = on
        train_step(step_model, loader, optimizers, cfg, accum, device)
    model.recurrence_on = phase
    model.load_state_dict(weights)
    for opt, state in zip(optimizers, opt_states):
        opt.load_state_dict(state)
    loader.load_state_dict(loader_state)
    torch.set_rng_state(rng[0])
    if rng[1] is not None:
        torch.cuda.set_rng_state(rng[1], device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    log(f"phase compile_warmup {time.perf_counter() - t0:.1f} s (not counted in the training budget)")


def main(argv=None, default_config: str | None = None) -> dict:
    args = parse_args(argv, default_config)
    cfg = load_config(args.config, args.overrides)
    dist = init_distributed(cfg.train.device)
    device = dist.device
    t_setup = time.perf_counter()
    # The inputs are checked before a run log or a model exists: a run that cannot start leaves no log behind.
    failure = None
    try:
        require_codec(ARTIFACT_CODEC)  # the export needs it after training
        grad_accum_steps(cfg, dist.world_size)  # the batch divides over this world size
        artifact_budget(cfg)  # the artifact and the code fit under the cap together
        if device.type == "cuda" and (problem := cfg.model.kernel_problem()):  # not in the first forward
            raise ConfigError(problem)
        train_files = list_shards(cfg.data.train_files)
        val = load_validation(cfg, train_files, dist.rank)  # before the loader's thread starts: bad paths fail fast
        check_writable_dir("train.out_dir", cfg.train.out_dir)  # every rank writes its checkpoint part there
        if dist.rank == 0:  # what rank 0 alone opens
            if cfg.train.wandb:
                require_wandb()
            check_writable_dir("train.log_dir", cfg.train.log_dir)
    except Exception as e:
        failure = e
    fail_together(failure, "its setup checks")  # every rank stops, not only the one that failed
    # A node with only some of the shards would train (or score) on other data than the rest, silently.
    require_same_on_every_rank((train_files, len(val.tokens)), "training shards or validation tokens",
                               "every node needs the same data.train_files and data.val_files")
    run_id = cfg.train.run_id or f"{Path(args.config).stem}-{time.strftime('%Y%m%d-%H%M%S')}-s{cfg.train.seed}"
    if dist.world_size > 1:  # rank 0's timestamp names the run everywhere
        holder = [run_id]
        torch.distributed.broadcast_object_list(holder, src=0)
        run_id = holder[0]
    cfg.train.run_id = run_id
    wandb_run, failure = None, None
    try:  # rank 0's wandb.init can fail in online mode (network, login): every rank stops, as at setup
        wandb_run = maybe_wandb(cfg.train.wandb and dist.rank == 0, cfg.train.wandb_project, run_id, to_dict(cfg))
    except ConfigError as e:
        failure = e
    fail_together(failure, "wandb.init")
    log, failure, path = None, None, log_path(cfg.train.log_dir, run_id)
    reused = not cfg.train.resume and path.exists()
    try:  # rank 0 alone opens the log file
        log = RunLog(path, dist.rank == 0, wandb_run)
    except Exception as e:
        failure = e
    fail_together(failure, "to open the run log")
    try:
        return start_run(cfg, dist, log, val, train_files, reused, path, t_setup)
    except INPUT_ERRORS as e:  # refused before training: the log says so, and its readers drop these lines
        log.refused(e)
        raise


def start_run(cfg: Config, dist, log, val: Validation, train_files: list[str], reused: bool, path: Path,
              t_setup: float) -> dict:
    """The run's header in its log, the model, optimizers and loader; then training and shipping."""
    device, run_id = dist.device, cfg.train.run_id
    if reused:  # said at the top of the new run's lines, and on the terminal
        log(f"WARNING {path} already holds a run of train.run_id={run_id}: this run is "
            "appended to it and replaces its artifact (training.log_reader reads the newest run; export_record refuses "
            "such a log); hint: a new train.run_id keeps runs apart")
    digest = code_digest()  # None: scripts.reproduce --reuse and export_record will call the code unknown
    log(f"run {run_id}  commit {git_commit(REPO)}{f'  code {digest}' if digest else ''}  world_size {dist.world_size}  "
        f"device {device}")
    log("versions " + json.dumps(versions()))
    log("config " + json.dumps(to_dict(cfg), sort_keys=True))
    if val.audited_bytes is not None:
        log(f"byte audit: {val.audited_bytes:,} bytes counted = UTF-8 length of the decoded validation text")

    torch.manual_seed(cfg.train.seed)  # identical initial weights on every rank
    model = GPT(cfg.model).to(device)
    optimizers = build_optimizers(model.param_groups(), cfg.optim, model.qkv_splits())
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model {n_params:,} parameters")
    try:  # the same on every rank: a refusal (too little data for the ranks) stops them all
        loader = training_loader(cfg, train_files, dist.rank, dist.world_size, device)
    except ValueError as e:
        raise ConfigError(f"data.train_files: {e}") from None
    for shard, n in loader.skipped:
        log(f"data: {shard} left out: its {n} tokens are fewer than data.seq_len + 1 = {cfg.data.seq_len + 1}")
    # Closed however the run ends: a prefetch thread still running when an exception reaches the top aborts
    # the interpreter's exit (SIGABRT, "terminate called without an active exception") instead of exiting 1.
    with loader:
        step_model = torch.compile(model) if cfg.train.compile else model
        log(f"phase setup {time.perf_counter() - t_setup:.1f} s")
        return train_and_ship(cfg, dist, model, step_model, optimizers, loader, val, n_params, log)


def find_checkpoint(cfg: Config, dist, ckpt_dir: Path) -> tuple[Checkpointer, Path | None]:
    """The checkpointer, and the checkpoint to resume from. Rank 0 repairs what a killed run left in the folder and
    chooses; every rank gets its choice, so ranks that see the folder differently (other nodes) cannot resume
    from different steps, and a failure there stops every rank."""
    checkpointer, chosen, failure = None, None, None
    try:
        checkpointer = Checkpointer(ckpt_dir, cfg.train.checkpoint_every, cfg.train.checkpoint_keep, dist.rank,
                                    dist.world_size, to_dict(cfg))  # rank 0 repairs the folder
        if dist.rank == 0:
            chosen = resolve_resume(cfg.train.resume, ckpt_dir)
            refuse_later_checkpoints(ckpt_dir, checkpoint_step(chosen) if chosen is not None else 0)
            clear_finished(ckpt_dir)  # this run trains (or scores) again
    except Exception as e:
        failure = e
    fail_together(failure, f"to find the checkpoint to resume from in {ckpt_dir}")
    if dist.world_size > 1:
        holder = [None if chosen is None else str(chosen)]
        torch.distributed.broadcast_object_list(holder, src=0)
        chosen = None if holder[0] is None else Path(holder[0])
    return checkpointer, chosen


def train_and_ship(cfg: Config, dist, model, step_model, optimizers, loader, val: Validation, n_params: int,
                   log) -> dict:
    """Train within the budget (resuming if asked), export the capped artifact, score it: the final record."""
    device, run_id = dist.device, cfg.train.run_id
    ckpt_dir = REPO / cfg.train.out_dir / "checkpoints" / run_id
    # before the compile warm-up (minutes on a GPU): periodic or not, a signal writes a checkpoint
    checkpointer, resume_from = find_checkpoint(cfg, dist, ckpt_dir)
    if cfg.train.resume == "latest" and resume_from is None:  # said, so that a misspelt run_id is noticed
        log(f"train.resume=latest: no checkpoint in {ckpt_dir}, so the run starts at step 0")
    ema = maybe_ema(model, cfg.optim)
    start = resume(resume_from, model, optimizers, ema, loader, dist, log, to_dict(cfg))
    # the reserve is for calibration on training tokens, which the rules count in the budget; generated text is not
    reserve = cfg.quant.calib_reserve_s if cfg.quant.calib_source == "train" else 0.0
    budget = cfg.train.time_budget_s - reserve if cfg.train.time_budget_s else 0.0
    # from the ranks' agreed clock: each rank saved its own, and ranks that disagreed here would not meet in the
    # collectives of the warm-up step
    clock = RankAgreement(dist.world_size)(start.train_time_s, False)[0]
    trained = start.step >= cfg.train.max_steps or (budget and clock >= budget)
    log.started = True
    if trained:  # a checkpoint of a finished training (a stop signal came while it was scored): no step to run
        log(f"the checkpoint's training is finished (step {start.step}, {start.train_time_s:.1f} s): scoring it")
    elif cfg.train.compile:
        warm_up_compile(step_model, model, loader, optimizers, cfg, grad_accum_steps(cfg, dist.world_size), device, log)

    # eval.compile compiles model.token_nll, not step_model (its graphs are the training loss with gradients); the EMA
    # swap copies weights in place, and compiled graphs take the parameters as inputs, so they score the EMA weights
    def evaluate(m=model, before_batch=None) -> dict:
        return evaluate_bpb(m, val.tokens, val.lut, context=cfg.eval.context, stride=cfg.eval.stride,
                            batch_seqs=cfg.eval.batch_seqs, device=device,
                            autocast_dtype=torch.bfloat16 if device.type == "cuda" else None,
                            rank=dist.rank, world_size=dist.world_size, progress=log, before_batch=before_batch,
                            compile=cfg.eval.compile)

    checkpointer.install_signal_handlers()  # until the artifact is scored: a signal after training keeps its state
    try:
        result = run_training(cfg, model, step_model, loader, optimizers, ema, dist, log, evaluate, budget,
                              start=start, checkpointer=checkpointer)
        loader.close()
        if result.stopped_by == "signal":
            log(f"stopped by a signal at step {result.steps}; continue with train.resume=latest train.run_id={run_id}")
            destroy()
            raise SystemExit(143)
        log(f"phase training {result.train_time_s:.1f} s, {result.steps} steps, stopped by {result.stopped_by}")
        kept, made = keep_trained_state(checkpointer, result.steps, result.train_time_s, model, optimizers, ema,
                                        loader, dist.world_size, log)
        try:
            final = ship(cfg, dist, model, ema, loader, result, val, n_params, evaluate, checkpointer, log)
        except StopRequested as stop:
            log(f"stopped by a signal {stop.phase}: the trained state is checkpoint {kept} (step {result.steps}); "
                f"train.resume=latest train.run_id={run_id} scores it without training further")
            destroy()
            raise SystemExit(143) from None
        if dist.rank == 0:  # train.resume=latest now says the run finished, instead of training again
            mark_finished(ckpt_dir, final, REPO / cfg.train.out_dir / f"{run_id}.mhcg")
        if made and dist.rank == 0:  # kept only while the run was scored (train.checkpoint_every=0)
            shutil.rmtree(kept, ignore_errors=True)
        return final
    finally:
        checkpointer.restore_signal_handlers()


class StopRequested(Exception):
    """A stop signal acted on after training: between the scoring phases (the ranks agree on it), or inside a
    scoring pass on a single rank. The trained state is in a checkpoint by then (keep_trained_state)."""

    def __init__(self, phase: str):
        super().__init__(phase)
        self.phase = phase


def resume(resume_from: Path | None, model, optimizers, ema, loader, dist, log, run_config: dict) -> Resumed:
    """Load the checkpoint chosen by find_checkpoint (the same on every rank), or start at step 0."""
    if resume_from is None:
        return Resumed(step=0, train_time_s=0.0)
    start, failure = None, None
    try:
        start = load_checkpoint(resume_from, model, optimizers, ema, loader, dist.rank, dist.world_size, run_config)
    except Exception as e:  # a damaged part of one rank, say
        failure = e
    fail_together(failure, f"to load its part of {resume_from}")
    require_same_on_every_rank(start.step, "a resumed step", "every node must see the same checkpoint folder")
    log(f"resumed from {resume_from}: step {start.step}, {start.train_time_s:.1f} s of training done")
    return start


def ship(cfg: Config, dist, model, ema, loader: TokenLoader, result, val: Validation, n_params: int, evaluate,
         checkpointer: Checkpointer, log) -> dict:
    """Score the trained weights (eval.pre_quant), export the capped artifact, score it: the final record.
    A stop signal raises StopRequested before each phase (all ranks agree on it) or, on a single rank, inside a
    scoring pass."""
    device, run_id, train_files = dist.device, cfg.train.run_id, loader.files
    agree = RankAgreement(dist.world_size)

    def check_stop(phase: str) -> None:
        if agree(0.0, checkpointer.stop_requested)[1]:
            raise StopRequested(f"before {phase}")

    def stop_now() -> None:  # one rank alone can leave a pass: ranks score different windows, with no agreement
        if checkpointer.stop_requested:
            raise StopRequested("during scoring")
    poll = stop_now if dist.world_size == 1 else None

    final = {"run_id": run_id, "steps": result.steps, "train_time_s": round(result.train_time_s, 2),
             "tokens_seen": result.tokens, "params": n_params, "world_size": dist.world_size,
             # what it trained on, for the seed tools (the paths may differ between machines)
             "train_shards": len(train_files), "train_shard_bytes": sum(Path(f).stat().st_size for f in train_files),
             "train_data_digest": sample_digest(loader.samples)}  # sampled when the loader opened the shards
    artifact = REPO / cfg.train.out_dir / f"{run_id}.mhcg"
    with ema.swapped_into(model) if ema is not None else nullcontext():  # the EMA weights are what ships
        if cfg.eval.pre_quant:
            check_stop("the pre-quant evaluation")
            t0 = time.perf_counter()
            pre = evaluate(before_batch=poll)
            log.record("eval", stage="pre_quant", seconds=round(time.perf_counter() - t0, 1), **pre)
            final.update(pre_quant_val_loss=pre["val_loss"], pre_quant_val_bpb=pre["val_bpb"])
        check_stop("the export")
        export = export_model(cfg, model, train_files=train_files, rank=dist.rank,
                              world_size=dist.world_size, log=log, artifact_path=artifact,
                              tokenizer_sha256=val.tokenizer_sha256, device=device,
                              train_time_s=result.train_time_s)
    final.update(export)
    if "export_error" in export:
        final.update(fits_cap=False)
        log.final(final)
        destroy()
        raise SystemExit(f"no artifact: {export['export_error']}")
    check_stop("scoring the artifact")
    t0 = time.perf_counter()
    scored = evaluate_artifact(artifact, val.tokens, val.lut, cfg.eval, device=device, rank=dist.rank,
                               world_size=dist.world_size, tokenizer_sha256=val.tokenizer_sha256,
                               progress=log, before_batch=poll)
    log.record("eval", stage="artifact", seconds=round(time.perf_counter() - t0, 1), **scored)
    final.update({k: scored[k] for k in ("val_loss", "val_bpb", "tokens", "bytes", "artifact_bytes",
                                         "code_bytes", "total_bytes", "fits_cap", *TTT_KEYS) if k in scored})
    final["source_entropy_bits_per_byte"] = entropy = val.source_entropy
    log(f"summary val_bpb {final['val_bpb']:.4f}" + (f" (source entropy {entropy:.4f} bits/byte)" if entropy else "")
        + (f", with test-time training {final['val_bpb_ttt']:.4f} in {final['ttt_time_s']:.1f} s"
           if "val_bpb_ttt" in final else "")
        + f", artifact {final['artifact_bytes']:,} B + code {final['code_bytes']:,} B = {final['total_bytes']:,} B"
        + f" of {cfg.quant.cap_bytes:,}")
    log.final(final)
    destroy()
    if not final["fits_cap"]:  # never report success above the cap
        raise SystemExit(f"total {final['total_bytes']:,} bytes is over the {cfg.quant.cap_bytes:,}-byte cap by "
                         f"{final['total_bytes'] - cfg.quant.cap_bytes:,} (hint: lower quant.margin_bytes is not "
                         "the fix; shrink the model or use more int5)")
    return final


# Bad input (a config key, a path, a shard, an artifact, a checkpoint of other settings, a folder in use, a missing
# codec module), or another rank's: the message names the file, field or module and gives a hint, so it is printed
# alone; any other error keeps its traceback.
INPUT_ERRORS = (ConfigError, ShardError, TokenizerError, ByteAuditError, ArtifactError, CodecUnavailable,
                CheckpointError, FileNotFoundError, FileExistsError, RankFailed)


def cli(argv=None, default_config: str | None = None) -> None:
    """The command line of train.py and of a record's train_gpt.py."""
    faulthandler.enable()  # a fatal signal (SIGBUS from a shard cut short under its memory map) prints a traceback
    try:
        main(argv, default_config)
    except INPUT_ERRORS as e:
        raise SystemExit(f"{Path(sys.argv[0]).name}: {e}") from None
    finally:
        destroy()  # the process group, however the run ended (a no-op once main has left it)


if __name__ == "__main__":
    cli()
