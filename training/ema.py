"""Exponential moving average of the weights (what gets exported), with a warmed-up decay.

A fixed decay of 0.997 averages over ~330 steps; on a short run that average is dominated by the
initial weights, so the decay at step t is min(ema_decay, (1 + t) / (ema_warmup_steps + t)).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn as nn
from torch import Tensor

from training.config import OptimConfig


def _tracked(model: nn.Module, skip: frozenset[str] = frozenset()) -> dict[str, Tensor]:
    """Parameters and floating-point buffers, by name (tied tensors once), less the names in `skip`."""
    tensors = {n: p for n, p in model.named_parameters()}
    tensors.update({n: b for n, b in model.named_buffers() if b.is_floating_point() and n not in skip})
    return tensors


def _derived_buffers(model: nn.Module) -> frozenset[str]:
    """Non-persistent buffers (e.g. the rotary tables): constants the model rebuilds, which checkpoints
    do not hold, so averaging them would only put names in the EMA that no state dict has."""
    saved = model.state_dict(keep_vars=True)
    return frozenset(n for n, _ in model.named_buffers() if n not in saved)


class EMA:
    def __init__(self, model: nn.Module, decay: float, warmup_steps: int):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"optim.ema_decay={decay}: expected 0 < decay < 1 (0 disables: use maybe_ema)")
        if warmup_steps < 1:
            raise ValueError(f"optim.ema_warmup_steps={warmup_steps}: expected >= 1")
        self.decay, self.warmup_steps = decay, warmup_steps
        self.skip = _derived_buffers(model)
        tracked = _tracked(model, self.skip)
        self.names = list(tracked)
        # fp32 shadows: a bf16 shadow would lose updates smaller than its 8-bit mantissa.
        self.shadow = [t.detach().float().clone() for t in tracked.values()]

    def decay_at(self, step: int) -> float:
        return min(self.decay, (1 + step) / (self.warmup_steps + step))

    def _live(self, model: nn.Module) -> list[Tensor]:
        tensors = _tracked(model, self.skip)
        if list(tensors) != self.names:
            raise ValueError("EMA: the model's parameters/buffers differ from the ones the EMA was built from")
        return list(tensors.values())

    @torch.no_grad()
    def update(self, model: nn.Module, step: int) -> None:
        """shadow = decay_t * shadow + (1 - decay_t) * live; foreach ops, no host sync."""
        live = [t.detach().float() for t in self._live(model)]  # .float() is a no-op for fp32
        torch._foreach_lerp_(self.shadow, live, 1.0 - self.decay_at(step))

    @torch.no_grad()
    def copy_to(self, model: nn.Module) -> None:
        torch._foreach_copy_(self._live(model), self.shadow)

    @contextmanager
    def swapped_into(self, model: nn.Module) -> Iterator[nn.Module]:
        """Run with the EMA weights in the model (e.g. for evaluation); the live ones come back after."""
        with torch.no_grad():
            saved = [t.detach().clone() for t in self._live(model)]
            self.copy_to(model)
        try:
            yield model
        finally:
            with torch.no_grad():
                torch._foreach_copy_(self._live(model), saved)

    def state_dict(self) -> dict:
        return {"decay": self.decay, "warmup_steps": self.warmup_steps,
                "shadow": dict(zip(self.names, self.shadow))}

    def load_state_dict(self, state: dict) -> None:
        shadow = state.get("shadow")
        if not isinstance(shadow, dict) or list(shadow) != self.names:
            raise ValueError("EMA.load_state_dict: tensor names differ from this model's "
                             "(hint: the checkpoint is from another model config)")
        for name, mine in zip(self.names, self.shadow):
            if shadow[name].shape != mine.shape:
                raise ValueError(f"EMA.load_state_dict: '{name}' has shape {tuple(shadow[name].shape)}, "
                                 f"expected {tuple(mine.shape)}")
        self.decay, self.warmup_steps = state["decay"], state["warmup_steps"]
        with torch.no_grad():
            torch._foreach_copy_(self.shadow, [shadow[n].float() for n in self.names])


def maybe_ema(model: nn.Module, cfg: OptimConfig) -> EMA | None:
    """An EMA per cfg, or None when optim.ema_decay = 0."""
    if cfg.ema_decay == 0:
        return None
    return EMA(model, cfg.ema_decay, cfg.ema_warmup_steps)
