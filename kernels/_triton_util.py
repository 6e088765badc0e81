"""Shared pieces of the mHC Triton kernels: per-token coefficient math and launch sizing.

The per-token coefficient math works on register tensors of BT tokens: [BT, n] for the pre/post
gates and [BT, n, n] for the residual mixing matrix. n (streams) is a power of two so it can be a
`tl.arange` extent.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Set before triton is imported; under it the kernels run on CPU tensors through the interpreter.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def sigmoid(z):
    return 1.0 / (1.0 + tl.exp(-z))


@triton.jit
def sinkhorn_fwd(logits, ITERS: tl.constexpr):
    """exp(logits) made doubly stochastic: ITERS rounds of row then column normalization.

    logits [BT, n, n] fp32. Subtracting the per-token max first keeps exp() finite; it cancels.
    """
    mx = tl.max(tl.max(logits, axis=2), axis=1)
    m = tl.exp(logits - mx[:, None, None])
    for _ in tl.static_range(ITERS):
        m = m / tl.sum(m, axis=2)[:, :, None]
        m = m / tl.sum(m, axis=1)[:, None, :]
    return m


@triton.jit
def sinkhorn_bwd(logits, grad, ITERS: tl.constexpr):
    """Gradient w.r.t. logits of sinkhorn_fwd(logits), given the gradient of its output.

    Nothing is stored from the forward: before back-propagating through round k, its input is
    recomputed from exp(logits) (O(ITERS^2) tiny rounds per token, O(n^2) registers). The max shift
    needs no gradient: the output is invariant to scaling exp(logits), so sum(dm0 * m0) = 0.
    """
    mx = tl.max(tl.max(logits, axis=2), axis=1)
    m0 = tl.exp(logits - mx[:, None, None])
    g = grad
    for k in range(ITERS):
        m = m0
        for _ in range(ITERS - 1 - k):  # input of round ITERS-1-k
            m = m / tl.sum(m, axis=2)[:, :, None]
            m = m / tl.sum(m, axis=1)[:, None, :]
        rho = tl.sum(m, axis=2)[:, :, None]
        rows = m / rho
        cols = tl.sum(rows, axis=1)[:, None, :]
        out = rows / cols
        d_rows = (g - tl.sum(g * out, axis=1)[:, None, :]) / cols
        g = (d_rows - tl.sum(d_rows * rows, axis=2)[:, :, None]) / rho
    return g * m0


@triton.jit
def load_apply(x_ptr, y_ptr, hres_ptr, hpost, t64, tmask, i, c, cmask, C,
                n: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """x'[BT, n, BC] = sum_j H_res[:, :, j] x_j + H_post y over channel tile c, in fp32."""
    m2 = tmask[:, None] & cmask[None, :]
    yv = tl.load(y_ptr + t64[:, None] * C + c[None, :], mask=m2, other=0.0).to(tl.float32)
    xs = tl.zeros([BT, n, BC], tl.float32)
    for j in tl.static_range(n):
        xj = tl.load(x_ptr + t64[:, None] * (n * C) + j * C + c[None, :], mask=m2, other=0.0).to(tl.float32)
        hj = tl.load(hres_ptr + t64[:, None] * (n * n) + i[None, :] * n + j, mask=tmask[:, None], other=0.0)
        xs += hj[:, :, None] * xj[:, None, :]
    return xs + hpost[:, :, None] * yv[:, None, :]


# ---------------------------------------------------------------- launch sizing (host side)

def num_coefficients(n: int) -> int:
    return n * n + 2 * n


def padded_columns(n: int) -> int:
    """Width of the [tokens, columns] coefficient tiles: room for N = n^2+2n columns plus one spare
    (the backward keeps the rms-gradient factor there), a power of two and >= 16 for tl.dot."""
    return max(16, triton.next_power_of_2(num_coefficients(n) + 1))


def check_streams(n: int, C: int, where: str) -> None:
    if n < 2 or n & (n - 1):
        raise ValueError(f"{where}: the Triton mHC kernels need n_streams a power of two >= 2, got n={n}; "
                         "hint: use n in {2, 4, 8} or set mhc_kernels=false to run the PyTorch reference")
    if C % 16:
        raise ValueError(f"{where}: the Triton mHC kernels need the stream width C to be a multiple of 16, "
                         f"got C={C}; hint: pick d_model a multiple of 16 or set mhc_kernels=false")


def channel_block(C: int, want: int) -> int:
    """Largest power-of-two channel tile <= want that does not overrun C by more than it needs."""
    return max(16, min(want, triton.next_power_of_2(C)))


def program_slots(device: torch.device) -> int:
    """How many programs keep the device busy: a few per SM on a GPU, a handful in the interpreter."""
    if device.type != "cuda":
        return 4
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count
