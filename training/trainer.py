"""The training loop: gradient accumulation, wall-clock budget, schedule, EMA, periodic evaluation.

Reads top to bottom like nanoGPT's loop. Host syncs happen only on logging steps (`.item()` there),
never inside the step itself.
"""
from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import torch

from training.config import Config
from training.distributed import DistInfo, optimizer_step
from training.optim import set_lr_and_momentum
from training.schedule import lr_multiplier


class DivergenceError(RuntimeError):
    pass


@dataclass
class TrainResult:
    steps: int
    train_time_s: float
    tokens: int
    stopped_by: str            # "max_steps" | "time_budget"


def grad_accum_steps(cfg: Config, world_size: int) -> int:
    """Micro-steps per optimizer step so that the global batch is exactly train.batch_tokens."""
    per_micro = world_size * cfg.train.micro_batch_seqs * cfg.data.seq_len
    if cfg.train.batch_tokens % per_micro:
        raise ValueError(
            f"train.batch_tokens={cfg.train.batch_tokens} is not a multiple of world_size({world_size}) x "
            f"train.micro_batch_seqs({cfg.train.micro_batch_seqs}) x data.seq_len({cfg.data.seq_len}) = {per_micro}"
            " (hint: change micro_batch_seqs so it divides)")
    return cfg.train.batch_tokens // per_micro


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
) -> TrainResult:
    """Train until train.max_steps or the wall-clock budget (time spent evaluating is not counted)."""
    t = cfg.train
    accum = grad_accum_steps(cfg, dist.world_size)
    budget = t.time_budget_s if time_budget_s is None else time_budget_s
    tokens_per_step = t.batch_tokens
    log(f"training: {accum} micro-steps of {t.micro_batch_seqs}x{cfg.data.seq_len} tokens on "
        f"{dist.world_size} rank(s) = {tokens_per_step:,} tokens/step; budget {budget or 'none'} s, "
        f"max {t.max_steps} steps")
    cuda = torch.device(dist.device).type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    step, stopped_by, paused = 0, "max_steps", 0.0
    last_log_time, last_log_step = 0.0, 0
    sync()
    t_start = time.perf_counter()
    clock = lambda: time.perf_counter() - t_start - paused  # noqa: E731  (training wall clock)
    for step in range(t.max_steps):
        # No sync here: the CPU runs at most a few steps ahead of the GPU (bounded launch queue),
        # and every log step below syncs, so the budget is met to within a step or two.
        train_time = clock()
        if budget and train_time >= budget:
            stopped_by = "time_budget"
            break
        progress = min(train_time / budget, 1.0) if t.schedule == "time" else step / t.max_steps
        lr_mult = lr_multiplier(progress, step, cfg.optim)
        set_lr_and_momentum(optimizers, lr_mult, step, cfg.optim)
        loss = train_step(step_model, loader, optimizers, cfg, accum, dist.device)
        if ema is not None:
            ema.update(model, step)
        if (step + 1) % t.log_every == 0 or step == 0 or step + 1 == t.max_steps:
            loss_val = loss.item()  # the only host sync of a logging step
            train_time = clock()
            if not math.isfinite(loss_val):
                raise DivergenceError(f"loss is {loss_val} at step {step + 1} (hint: lower optim.matrix_lr "
                                      "or optim.grad_clip; the last checkpoint is untouched)")
            tok_s = (step + 1 - last_log_step) * tokens_per_step / max(train_time - last_log_time, 1e-9)
            done = min(train_time / budget, 1.0) if budget else 0.0
            done = max(done, (step + 1) / t.max_steps)
            eta = train_time / done - train_time
            log.record("step", step=step + 1, loss=round(loss_val, 5), lr_mult=round(lr_mult, 5),
                       tok_s=round(tok_s), train_time_s=round(train_time, 2), done_pct=round(100 * done, 1),
                       eta_s=round(eta, 1))
            last_log_time, last_log_step = train_time, step + 1
        if evaluate is not None and cfg.eval.every_steps and (step + 1) % cfg.eval.every_steps == 0:
            sync()
            e0 = time.perf_counter()
            result = evaluate()
            paused += time.perf_counter() - e0
            log.record("eval", step=step + 1, train_time_s=round(clock(), 2), **result)
    else:
        step = t.max_steps
    sync()
    return TrainResult(steps=step, train_time_s=clock(), tokens=step * tokens_per_step, stopped_by=stopped_by)
