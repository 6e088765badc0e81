"""Learning-rate multiplier: linear warmup (by step), plateau at 1, linear warmdown to a floor (by progress).

Progress in [0, 1] is step / max_steps or elapsed / time_budget_s; the trainer picks which
(train.schedule). Pure Python: called once per step on the host.
"""
from __future__ import annotations

from training.config import OptimConfig


def check_schedule(cfg: OptimConfig) -> None:
    if cfg.warmup_steps < 0:
        raise ValueError(f"optim.warmup_steps={cfg.warmup_steps}: expected >= 0")
    if not 0.0 <= cfg.warmdown_frac <= 1.0:
        raise ValueError(f"optim.warmdown_frac={cfg.warmdown_frac}: expected a fraction in [0, 1]")
    if not 0.0 <= cfg.lr_floor <= 1.0:
        raise ValueError(f"optim.lr_floor={cfg.lr_floor}: expected a multiplier in [0, 1]")


def lr_multiplier(progress: float, step: int, cfg: OptimConfig) -> float:
    """Multiplier of every group's initial_lr at optimizer step `step` (0-based).

    Warmup: (step + 1) / warmup_steps, so the first step already moves. Warmdown: linear from 1 at
    progress = 1 - warmdown_frac to 0 at progress = 1, clamped below at lr_floor. When both apply
    (very short runs) the smaller wins. Progress past 1 (a time budget overshot by the last step) is
    treated as 1.
    """
    check_schedule(cfg)
    if progress < 0:
        raise ValueError(f"lr_multiplier: progress={progress} must be >= 0")
    progress = min(progress, 1.0)
    warmup = min(1.0, (step + 1) / cfg.warmup_steps) if cfg.warmup_steps > 0 else 1.0
    warmdown = 1.0
    if cfg.warmdown_frac > 0 and progress > 1.0 - cfg.warmdown_frac:
        warmdown = max(cfg.lr_floor, (1.0 - progress) / cfg.warmdown_frac)
    return min(warmup, warmdown)
