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


# Stream tiles travel as tuples of n two-dimensional [BT, BC] fp32 tiles (stream j of BT tokens over
# the channel tile c), not as one [BT, n, BC] tensor: Triton re-materializes broadcasts across a
# 3-D layout once per consumer, which tripled the registers of the apply and spilled.

@triton.jit
def load_streams(ptr, row, c, mask, C, n: tl.constexpr):
    """(x_0, ..., x_{n-1}): tiles ptr[row + j*C + c] of a [T, n, C] tensor, row = token * n*C."""
    tiles = ()
    for j in tl.static_range(n):
        tiles = tiles + (tl.load(ptr + row[:, None] + j * C + c[None, :], mask=mask, other=0.0).to(tl.float32),)
    return tiles


@triton.jit
def store_streams(ptr, row, c, mask, tiles, C, n: tl.constexpr):
    for j in tl.static_range(n):
        tl.store(ptr + row[:, None] + j * C + c[None, :], tiles[j].to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def load_mixing(hres_ptr, hpost_ptr, t64, tmask, n: tl.constexpr):
    """Per-token apply coefficients as [BT] vectors: (H_res[:, i, j] for i, j row-major), (H_post[:, i])."""
    h_res = ()
    for ij in tl.static_range(n * n):
        h_res = h_res + (tl.load(hres_ptr + t64 * (n * n) + ij, mask=tmask, other=0.0),)
    h_post = ()
    for i in tl.static_range(n):
        h_post = h_post + (tl.load(hpost_ptr + t64 * n + i, mask=tmask, other=0.0),)
    return h_res, h_post


@triton.jit
def apply_stream(xs, y, h_res, h_post, i: tl.constexpr, n: tl.constexpr):
    """x'_i = sum_j H_res[i, j] x_j + H_post[i] y, in fp32, for one channel tile."""
    acc = h_res[i * n][:, None] * xs[0]
    for j in tl.static_range(1, n):
        acc += h_res[i * n + j][:, None] * xs[j]
    return acc + h_post[i][:, None] * y


@triton.jit
def apply_streams(xs, y, h_res, h_post, n: tl.constexpr):
    out = ()
    for i in tl.static_range(n):
        out = out + (apply_stream(xs, y, h_res, h_post, i, n),)
    return out


@triton.jit
def pre_gates(raw_ptr, alpha_ptr, bias_ptr, t64, tmask, N: tl.constexpr, n: tl.constexpr):
    """(H_pre[:, j]) as [BT] vectors: sigmoid(alpha_pre * raw_pre + bias_pre), from the stored raw."""
    a_pre = tl.load(alpha_ptr)
    gates = ()
    for j in tl.static_range(n):
        raw = tl.load(raw_ptr + t64 * N + j, mask=tmask, other=0.0)
        gates = gates + (sigmoid(a_pre * raw + tl.load(bias_ptr + j)),)
    return gates


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


def channel_block(C: int, want: int, n: int) -> int:
    """Power-of-two channel tile: at most `want`, no wider than C needs, and small enough that the
    [n*BC, NP] projection tile (and the d(phi) accumulator) stays at <= 16K fp32 values."""
    cap = max(16, 16384 // (n * padded_columns(n)))
    return max(16, min(want, cap, triton.next_power_of_2(C)))


def program_slots(device: torch.device) -> int:
    """How many programs keep the device busy: a few per SM on a GPU, a handful in the interpreter."""
    if device.type != "cuda":
        return 4
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count
