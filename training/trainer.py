"""The training loop: gradient accumulation, wall-clock budget, schedule, EMA, periodic evaluation.

Reads top to bottom like nanoGPT's loop. Host syncs happen only on logging steps (`.item()` there),
never inside the step itself.
"""
from __future__ import annotations

import math
import sys
import time
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import torch

from data.loader import TokenLoader
from training.checkpoint import Checkpointer, Resumed
from training.config import Config, grad_accum_steps
from training.distributed import DistInfo, RankAgreement, all_reduce_mean, optimizer_step
from training.optim import set_lr_and_momentum
from training.schedule import lr_multiplier


class DivergenceError(RuntimeError):
    pass


@dataclass
class TrainResult:
    steps: int
    train_time_s: float
    tokens: int
    stopped_by: str            # "max_steps" | "time_budget" | "signal"


def training_loader(cfg: Config, files: list[str], rank: int = 0, world_size: int = 1,
                    device: str | torch.device = "cpu", prefetch: int | None = None) -> TokenLoader:
    """The loader a run trains on: this rank's share of `files` in train.seed's order (prefetch: data.prefetch
    unless given; 0 loads in the caller's thread)."""
    return TokenLoader(files, cfg.data.seq_len, cfg.train.micro_batch_seqs, rank=rank, world_size=world_size,
                       seed=cfg.train.seed, shards_per_batch=cfg.data.shards_per_batch,
                       prefetch=cfg.data.prefetch if prefetch is None else prefetch, device=device,
                       vocab_size=cfg.model.vocab_size)


def autocast_for(device: torch.device):
    """bf16 autocast on GPU; fp32 on CPU (CPU bf16 autocast is slow and not what ships)."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()


def train_step(step_model, loader, optimizers, cfg: Config, accum: int, device) -> torch.Tensor:
    """One optimizer step; returns the mean micro-batch loss as a device tensor (no host sync)."""
    total = torch.zeros((), device=device)
    for _ in range(accum):
        x, y = loader.next_batch()
        with autocast_for(device):
            loss = step_model(x, y)
        (loss / accum).backward()
        total += loss.detach()
    optimizer_step(optimizers, cfg.optim.grad_clip)  # grad averaging, clip, sharded Muon + AdamW
    return total / accum


def run_training(
    cfg: Config,
    model: torch.nn.Module,
    step_model: Callable,
    loader,
    optimizers: list,
    ema,
    dist: DistInfo,
    log,
    evaluate: Callable[[], dict] | None = None,
    time_budget_s: float | None = None,
    start: Resumed = Resumed(step=0, train_time_s=0.0),
    checkpointer: Checkpointer | None = None,
) -> TrainResult:
    """Train until train.max_steps, the wall-clock budget, or a stop signal (after a checkpoint).
    Time spent evaluating or checkpointing is not counted as training time."""
    t = cfg.train
    accum = grad_accum_steps(cfg, dist.world_size)
    budget = t.time_budget_s if time_budget_s is None else time_budget_s
    tokens_per_step = t.batch_tokens
    # per phase of depth recurrence, which runs some blocks again (MFU counts what the step computes)
    flops_per_step = {on: training_flops_per_token(model, cfg, on) * tokens_per_step for on in (False, True)}
    peak = peak_flops(dist.device) * dist.world_size
    log(f"training: {accum} micro-steps of {t.micro_batch_seqs}x{cfg.data.seq_len} tokens on "
        f"{dist.world_size} rank(s) = {tokens_per_step:,} tokens/step; budget {f'{budget} s' if budget else 'none'}, "
        f"max {t.max_steps} steps" + (f"; resuming at step {start.step}" if start.step else ""))
    cuda = torch.device(dist.device).type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    bar = ProgressBar(enabled=log.enabled and sys.stdout.isatty())
    completed, stopped_by, paused = start.step, "max_steps", 0.0
    last_log_time, last_log_step = start.train_time_s, start.step
    agree = RankAgreement(dist.world_size)
    sync()
    t_start = time.perf_counter() - start.train_time_s
    clock = lambda: time.perf_counter() - t_start - paused  # noqa: E731  (training wall clock)
    now, _ = agree(clock(), False)
    # the phase of the progress reached (a resume lands in its phase), also where no step is left to run
    switch_recurrence(model, training_progress(now, start.step, budget, t), start.step, log)

    def record_step(loss: torch.Tensor, lr_mult: float) -> None:
        nonlocal last_log_time, last_log_step
        loss_val = check_finite(global_loss(loss), completed)  # the only host sync of a logging step
        train_time = clock()
        tok_s = (completed - last_log_step) * tokens_per_step / max(train_time - last_log_time, 1e-9)
        done = max(min(train_time / budget, 1.0) if budget else 0.0, completed / t.max_steps)
        fields = dict(step=completed, loss=round(loss_val, 5), lr_mult=round(lr_mult, 5), tok_s=round(tok_s),
                      train_time_s=round(train_time, 2), done_pct=round(100 * done, 1),
                      eta_s=round(train_time / done - train_time, 1))
        if peak:
            fields["mfu_pct"] = round(100 * flops_per_step[model.recurrence_on] * tok_s / tokens_per_step / peak, 1)
        bar.clear()
        log.record("step", **fields)
        bar.show(fields)
        last_log_time, last_log_step = train_time, completed

    for step in range(start.step, t.max_steps):
        # No sync here: the CPU runs at most a few steps ahead of the GPU (bounded launch queue),
        # and every log step below syncs, so the budget is met to within a step or two. `now` is
        # the clock all ranks agreed on at the end of the previous step. A step that would end past the budget, at
        # the mean step time so far, is not started: a slow step on a loaded machine took the demo 9 s past it.
        mean_step = (now - start.train_time_s) / (step - start.step) if step > start.step else 0.0
        if budget and now + mean_step > budget:
            stopped_by = "time_budget"
            break
        progress = training_progress(now, step, budget, t)
        lr_mult = lr_multiplier(progress, step, cfg.optim)
        switch_recurrence(model, progress, step, log)  # from agreed values: every rank flips on the same step
        set_lr_and_momentum(optimizers, lr_mult, step, cfg.optim)
        loss = train_step(step_model, loader, optimizers, cfg, accum, dist.device)
        if ema is not None:
            ema.update(model, step)
        completed = step + 1
        if completed % t.log_every == 0 or step == start.step or completed == t.max_steps:
            record_step(loss, lr_mult)
        if evaluate is not None and cfg.eval.every_steps and completed % cfg.eval.every_steps == 0:
            sync()
            e0 = time.perf_counter()
            result = evaluate()
            paused += time.perf_counter() - e0
            bar.clear()
            log.record("eval", step=completed, train_time_s=round(clock(), 2), **result)
        # Every decision below comes from agreed values only: a signal that reaches one rank now
        # (even during the save) is acted on by all ranks after the next agreement.
        now, stop = agree(clock(), checkpointer is not None and checkpointer.stop_requested)
        if checkpointer is not None and (stop or checkpointer.is_periodic(completed)):
            # never replace a good checkpoint with a diverged one
            check_state_finite(global_loss(loss), model, ema, completed)
            sync()
            c0 = time.perf_counter()
            path = checkpointer.save(completed, clock(), model, optimizers, ema, loader)
            paused += time.perf_counter() - c0
            log(f"checkpoint {path} (step {completed}, {time.perf_counter() - c0:.1f} s)")
            if stop:  # a signal that reached any rank stops them all at this step
                stopped_by = "signal"
                break
    if stopped_by in ("time_budget", "max_steps") and completed < cfg.optim.warmup_steps \
            and (completed > start.step or start.step == 0):  # (a resumed finished run said it the first time)
        hint = ("a longer train.time_budget_s; on a shared CPU, OMP_NUM_THREADS=1 may run more steps"
                if stopped_by == "time_budget" else "a larger train.max_steps, or a shorter optim.warmup_steps")
        log(f"WARNING {'the time budget' if stopped_by == 'time_budget' else 'train.max_steps'} ended the run at step "
            f"{completed}, inside the {cfg.optim.warmup_steps}-step learning-rate warmup: the score says little about "
            f"the recipe (hint: {hint})")
    if stopped_by == "time_budget" and t.schedule == "steps" and cfg.optim.warmdown_frac > 0 \
            and completed < t.max_steps * (1.0 - cfg.optim.lr_floor * cfg.optim.warmdown_frac):
        log(f"WARNING the time budget ended the run at step {completed} of train.max_steps={t.max_steps} with "
            f"train.schedule=steps, whose warmdown runs on steps: the learning rate was at "
            f"{lr_multiplier(completed / t.max_steps, completed, cfg.optim):.3g} of its peak, "
            "not annealed (hint: train.schedule=time warms down on the clock)")
    if completed > last_log_step:  # stopped between log steps (the budget, a signal): the last step is logged too,
        record_step(loss, lr_mult)  # and a loss gone NaN since the last log step stops the run here, named
    sync()
    train_time = clock()
    if checkpointer is not None and checkpointer.every > 0 and completed > start.step \
            and stopped_by != "signal" and not checkpointer.is_periodic(completed):
        # A run that checkpoints also leaves its final state (what it ships), whatever stopped it:
        # scripts/bench_quant.py re-quantizes it, and resume=latest continues from it.
        check_state_finite(global_loss(loss), model, ema, completed)
        log(f"checkpoint {checkpointer.save(completed, train_time, model, optimizers, ema, loader)} "
            f"(step {completed}, final)")
    bar.clear()
    return TrainResult(steps=completed, train_time_s=train_time, tokens=completed * tokens_per_step,
                       stopped_by=stopped_by)


def training_progress(now: float, step: int, budget: float, t) -> float:
    """The schedule's progress (0..1) at the start of `step`, from the ranks' agreed clock `now`. schedule=time: the
    clock, or the steps where max_steps comes first (it stops the run too: a run it ended at full learning rate
    shipped an EMA of un-annealed weights); schedule=steps: the steps alone."""
    return max(min(now / budget, 1.0), step / t.max_steps) if t.schedule == "time" else step / t.max_steps


def switch_recurrence(model, progress: float, step: int, log) -> None:
    """Depth recurrence is on from the step whose progress reaches model.recur_at (GPT.recurrence_due)."""
    on = model.recurrence_due(progress)
    if on != model.recurrence_on:
        model.recurrence_on = on
        log(f"depth recurrence {'on' if on else 'off'} from step {step} (progress {progress:.3f}): "
            f"{len(model.block_order())} virtual layers")


def global_loss(loss: torch.Tensor) -> torch.Tensor:
    """The step's loss over the whole global batch (the mean of the ranks' losses). Each rank's own loss covers
    its share only: logged, it was 1/world_size of the batch, and a NaN on one rank's share stopped that rank
    alone, leaving the others to fail in their next collective without saying why."""
    return all_reduce_mean(loss.detach().float().clone())


# A resume repeats the run's steps exactly and refuses changed optim settings (they define the run), so the way out
# of a divergence is a new run (the hint said to resume with a lower learning rate).
DIVERGENCE_HINT = ("hint: lower optim.matrix_lr or optim.grad_clip and start again under a new train.run_id; a resume "
                   "keeps this run's settings and would repeat the same steps")


def check_finite(loss: torch.Tensor, step: int) -> float:
    value = loss.item()
    if not math.isfinite(value):
        raise DivergenceError(f"loss is {value} at step {step} ({DIVERGENCE_HINT})")
    return value


def check_state_finite(loss: torch.Tensor, model: torch.nn.Module, ema, step: int) -> None:
    """Before a checkpoint: the loss, every weight and every EMA shadow finite. The loss is computed before the
    step's update, so an inf gradient under a finite loss passed (clipping scales it by 0, and 0 x inf = NaN)."""
    check_finite(loss, step)
    named = list(model.named_parameters()) + ([(f"the EMA of {n}", t) for n, t in zip(ema.names, ema.shadow)]
                                             if ema is not None else [])
    if not torch.stack([torch.isfinite(t).all() for _, t in named]).all():  # one host sync
        bad = next(name for name, t in named if not torch.isfinite(t).all())
        raise DivergenceError(f"{bad} holds NaN or Inf after step {step}, under a finite loss ({DIVERGENCE_HINT}; "
                              "the last checkpoint was not replaced)")


def training_flops_per_token(model: torch.nn.Module, cfg: Config, recurrence: bool = False) -> float:
    """6 x (matrix + tied-head parameters) + causal attention (6 x layers x seq_len x d_model), counting each block's
    matrices and attention once per virtual layer it runs as (depth recurrence on: recur_times for the loop)."""
    groups = model.param_groups()
    matmul_params = sum(p.numel() for p in groups["matrix"]) + model.embed.weight.numel()
    order = cfg.model.block_order(recurrence)
    for block, runs in Counter(order).items():  # a block's matrices again for each extra run
        linears = [m for l in (2 * block, 2 * block + 1) for m in model.sublayers[l].modules()
                   if isinstance(m, torch.nn.Linear)]
        matmul_params += (runs - 1) * sum(m.weight.numel() for m in linears)
    return 6.0 * matmul_params + 6.0 * len(order) * cfg.data.seq_len * cfg.model.d_model


PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense, per GPU


def peak_flops(device) -> float:
    """Dense bf16 peak of known GPUs (0 when unknown: no MFU is reported)."""
    if torch.device(device).type != "cuda":
        return 0.0
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), 0.0)


class ProgressBar:
    """A one-line live bar on a terminal (rank 0); plain step lines go to the log either way."""

    def __init__(self, enabled: bool):
        self.enabled = enabled

    def show(self, f: dict) -> None:
        if not self.enabled:
            return
        filled = int(f["done_pct"] / 5)
        mfu = f" mfu {f['mfu_pct']}%" if "mfu_pct" in f else ""
        sys.stdout.write(f"\r[{'#' * filled}{'.' * (20 - filled)}] {f['done_pct']:5.1f}% step {f['step']} "
                         f"loss {f['loss']:.4f} {f['tok_s']:,} tok/s{mfu} eta {f['eta_s']:.0f}s ")
        sys.stdout.flush()

    def clear(self) -> None:
        if self.enabled:
            sys.stdout.write("\r\033[K")
            sys.stdout.flush()
