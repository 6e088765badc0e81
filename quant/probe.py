"""Measured loss increases: the model's mean loss on the calibration batches with some weights replaced.

The rate–distortion allocation predicts each tensor's loss increase from Fisher-weighted output errors
(quant/rd.py). That prediction is a second-order model whose scale differs by kind of tensor: on a trained demo
model, Linear weights lost about what it predicts, the tied embedding 2-3 times more, and the mHC projections phi
almost nothing where it predicted as much as a Linear's. So each kind's predictions are scaled by one measurement:
every tensor of the kind replaced by a quantized version at once, the loss increase on the calibration batches
(training tokens, never validation) divided by the predicted sum.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn


@torch.no_grad()
def mean_loss(model: nn.Module, batches: Iterable[torch.Tensor], autocast_dtype: torch.dtype | None = None) -> float:
    """The mean next-token loss (nats) over the batches, every token counted once."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for ids in batches:
            ids = ids.to(device)
            with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                loss = model(ids[:, :-1], ids[:, 1:].long())
            n = ids[:, 1:].numel()
            total += float(loss) * n
            count += n
    finally:
        model.train(was_training)
    return total / max(count, 1)


@torch.no_grad()
def loss_with(model: nn.Module, batches: list[torch.Tensor], values: dict[str, torch.Tensor],
              autocast_dtype: torch.dtype | None = None) -> float:
    """mean_loss with the state_dict entries `values` put in place; the model's own weights are back afterwards."""
    state = model.state_dict()
    saved = {name: state[name].clone() for name in values}
    try:
        for name, value in values.items():
            state[name].copy_(value.to(state[name].device, state[name].dtype))
        return mean_loss(model, batches, autocast_dtype)
    finally:
        for name, value in saved.items():
            state[name].copy_(value)
