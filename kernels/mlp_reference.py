"""Pure-PyTorch reference for the LeakyReLU(0.5)^2 MLP: y = W_down · leaky_relu(W_up · x, 0.5)^2.

The Triton kernels in `kernels/mlp.py` must match this. Shapes: x [..., D], w_up [H, D],
w_down [D, H] (nn.Linear layout: out_features x in_features).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

NEGATIVE_SLOPE = 0.5


def leaky_relu_sq(pre: torch.Tensor) -> torch.Tensor:
    return F.leaky_relu(pre, NEGATIVE_SLOPE).square()


def leaky_relu_sq_grad(pre: torch.Tensor) -> torch.Tensor:
    """d/dpre of leaky_relu(pre, 0.5)^2: 2*pre where pre > 0, else 2*0.25*pre = 0.5*pre."""
    return torch.where(pre > 0, 2.0 * pre, 0.5 * pre)


def mlp_reference(x: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    return F.linear(leaky_relu_sq(F.linear(x, w_up)), w_down)
