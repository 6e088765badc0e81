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

from kernels.mhc_reference import SINKHORN_FLOOR as _FLOOR
from kernels.mhc_reference import mhc_num_coefficients as num_coefficients  # noqa: F401 (the launchers' name)
from model.config import KERNEL_STREAMS, KERNEL_WIDTH_MULTIPLE  # one source: configs are checked against them

# Set before triton is imported; under it the kernels run on CPU tensors through the interpreter.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def sigmoid(z):
    return 1.0 / (1.0 + tl.exp(-z))


SINKHORN_FLOOR = tl.constexpr(_FLOOR)  # read inside the kernels

# Sinkhorn works on tuples of n*n [BT] vectors (entry (i, j) at index i*n + j): every thread holds
# whole matrices of its tokens, so the row and column sums are register adds, not cross-thread
# reductions of a [BT, n, n] tensor.

@triton.jit
def _row_sums(m, n: tl.constexpr):
    sums = ()
    for i in tl.static_range(n):
        s = m[i * n]
        for j in tl.static_range(1, n):
            s += m[i * n + j]
        sums = sums + (s,)
    return sums


@triton.jit
def _col_sums(m, n: tl.constexpr):
    sums = ()
    for j in tl.static_range(n):
        s = m[j]
        for i in tl.static_range(1, n):
            s += m[i * n + j]
        sums = sums + (s,)
    return sums


# Scaling multiplies by n reciprocals instead of dividing n*n times: an IEEE division is a long
# instruction sequence, and with divisions coef_bwd needed 255 registers and spilled; with reciprocals
# 184 and no spills (sm_90, scripts/kernel_resources.py). Results differ from division by an ulp or two.

@triton.jit
def _scale_rows(m, s, n: tl.constexpr):
    """m[i, j] / s[i]."""
    inv = ()
    for i in tl.static_range(n):
        inv = inv + (1.0 / s[i],)
    out = ()
    for ij in tl.static_range(n * n):
        out = out + (m[ij] * inv[ij // n],)
    return out


@triton.jit
def _scale_cols(m, s, n: tl.constexpr):
    """m[i, j] / s[j]."""
    inv = ()
    for j in tl.static_range(n):
        inv = inv + (1.0 / s[j],)
    out = ()
    for ij in tl.static_range(n * n):
        out = out + (m[ij] * inv[ij % n],)
    return out


@triton.jit
def sinkhorn_round(m, n: tl.constexpr):
    """One round: normalize rows, then columns (the reference's order)."""
    rows = _scale_rows(m, _row_sums(m, n), n)
    return _scale_cols(rows, _col_sums(rows, n), n)


@triton.jit
def sinkhorn_offsets(logits, n: tl.constexpr):
    """logits - max: the max cancels in the normalization and keeps exp() finite."""
    mx = logits[0]
    for ij in tl.static_range(1, n * n):
        mx = tl.maximum(mx, logits[ij])
    out = ()
    for ij in tl.static_range(n * n):
        out = out + (logits[ij] - mx,)
    return out


@triton.jit
def sinkhorn_start(logits, n: tl.constexpr):
    """exp(logits - max), the exponent floored at SINKHORN_FLOOR (kernels/mhc_reference.py) so that no row or
    column underflows to zeros. A where, not tl.maximum: maximum drops a NaN, which must reach the output."""
    offsets = sinkhorn_offsets(logits, n)
    out = ()
    for ij in tl.static_range(n * n):
        out = out + (tl.exp(tl.where(offsets[ij] < SINKHORN_FLOOR, SINKHORN_FLOOR, offsets[ij])),)
    return out


@triton.jit
def sinkhorn_fwd(logits, ITERS: tl.constexpr, n: tl.constexpr):
    # A runtime loop, not tl.static_range: unrolling ITERS rounds of n*n divisions made Triton's
    # coalescing pass the bulk of the compile (coef_premix at n=4 for sm_90: 16.7 s unrolled, 3.4 s
    # as a loop; at n=8 over 600 s vs 40 s), for a loop that is a small part of a streaming kernel.
    m = sinkhorn_start(logits, n)
    for _ in range(ITERS):
        m = sinkhorn_round(m, n)
    return m


@triton.jit
def _sinkhorn_round_bwd(m, g, n: tl.constexpr):
    """Gradient w.r.t. the input m of one round, given the gradient g of its output."""
    rho = _row_sums(m, n)
    rows = _scale_rows(m, rho, n)
    cols = _col_sums(rows, n)
    out = _scale_cols(rows, cols, n)
    g_out = ()
    for ij in tl.static_range(n * n):
        g_out = g_out + (g[ij] * out[ij],)
    d_rows = _scale_cols(g, cols, n)
    col_dot = _scale_cols(g_out, cols, n)
    col_dot = _col_sums(col_dot, n)  # sum_i g[i, j] out[i, j] / cols[j]
    dr = ()
    for ij in tl.static_range(n * n):
        dr = dr + (d_rows[ij] - col_dot[ij % n],)
    dr_rows = ()
    for ij in tl.static_range(n * n):
        dr_rows = dr_rows + (dr[ij] * rows[ij],)
    row_dot = _row_sums(dr_rows, n)
    d_in = ()
    for ij in tl.static_range(n * n):
        d_in = d_in + ((dr[ij] - row_dot[ij // n]) / rho[ij // n],)
    return d_in


@triton.jit
def sinkhorn_bwd(logits, grad, ITERS: tl.constexpr, SEG: tl.constexpr, n: tl.constexpr):
    """Gradient w.r.t. logits of sinkhorn_fwd(logits), given the gradient of its output.

    Nothing is stored from the forward. The iterates are recomputed from sinkhorn_start(logits): checkpoints
    every SEG rounds (in registers), and each round's input rebuilt from the checkpoint before it,
    ~ITERS*(SEG+1)/2 extra rounds instead of ITERS^2/2. The max shift needs no gradient: the output
    is invariant to scaling exp(logits), so sum(dm0 * m0) = 0 -- unless an entry sits at the floor (below).
    """
    m0 = sinkhorn_start(logits, n)
    NSEG: tl.constexpr = (ITERS + SEG - 1) // SEG
    checkpoints = ()
    m = m0
    for s in tl.static_range(NSEG):
        checkpoints = checkpoints + (m,)
        if s < NSEG - 1:
            for _r in range(SEG):  # a loop, not unrolled: keeps the code (and compile time) small
                m = sinkhorn_round(m, n)
    g = grad
    for s in tl.static_range(NSEG - 1, -1, -1):
        # rounds in segment s: SEG, the last one the remainder; round s*SEG + k, last first
        for k in range((SEG if s < NSEG - 1 else ITERS - s * SEG) - 1, -1, -1):
            m = checkpoints[s]
            for _step in range(k):  # (distinct names: Triton types loop variables per name)
                m = sinkhorn_round(m, n)
            g = _sinkhorn_round_bwd(m, g, n)
    # d logits = g * m0 where an entry is above the floor (one held there takes none, as clamp_min's), and the
    # max's share: the shift moves every entry above the floor, so the max (split evenly among ties, as amax's
    # gradient) takes minus their sum. Without a floored entry that sum is zero (the output ignores the scale of
    # m0); with one it is not (found comparing the reference's autograd at res logits spread by ~100).
    # An entry exactly at the floor keeps its gradient, as clamp_min's does (the offsets, not the floored values).
    offsets = sinkhorn_offsets(logits, n)
    free = ()
    shift_grad = tl.zeros_like(m0[0])
    ties = tl.zeros_like(m0[0])
    for ij in tl.static_range(n * n):
        d = tl.where(offsets[ij] < SINKHORN_FLOOR, 0.0, g[ij] * m0[ij])
        free = free + (d,)
        shift_grad += d
        ties += tl.where(offsets[ij] == 0.0, 1.0, 0.0)
    out = ()
    for ij in tl.static_range(n * n):
        out = out + (free[ij] - tl.where(offsets[ij] == 0.0, shift_grad / ties, 0.0),)
    return out


# Stream tiles travel as tuples of n two-dimensional [BT, BC] fp32 tiles (stream j of BT tokens over
# the channel tile c), not as one [BT, n, BC] tensor: Triton re-materializes broadcasts across a
# 3-D layout once per consumer, which tripled the registers of the apply and spilled.

@triton.jit
def load_streams(ptr, row, c, mask, C, n: tl.constexpr, KEEP_DTYPE: tl.constexpr = False):
    """(x_0, ..., x_{n-1}): tiles ptr[row + j*C + c] of a [T, n, C] tensor, row = token * n*C; fp32,
    or in the storage dtype with KEEP_DTYPE (half the registers for bf16, converted where used)."""
    tiles = ()
    for j in tl.static_range(n):
        tile = tl.load(ptr + row[:, None] + j * C + c[None, :], mask=mask, other=0.0)
        tiles = tiles + (tile if KEEP_DTYPE else tile.to(tl.float32),)
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
    acc = h_res[i * n][:, None] * xs[0].to(tl.float32)
    for j in tl.static_range(1, n):
        acc += h_res[i * n + j][:, None] * xs[j].to(tl.float32)
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

def padded_columns(n: int) -> int:
    """Width of the [tokens, columns] coefficient tiles: N = n^2+2n columns plus the backward's
    extras (the rms-gradient factor and H_pre, see mhc_bwd.py), a power of two >= 16 for tl.dot."""
    return max(16, triton.next_power_of_2(num_coefficients(n) + 1 + n))


def phi_operand(phi: torch.Tensor, stream_dtype: torch.dtype, lowp: bool) -> torch.Tensor:
    """phi^T [N, n*C] as the kernels' dot operand: the model's storage layout (phi [n*C, N] arrives as
    its transposed view, so no transpose copy), in the stream dtype when LOWP else fp32."""
    return phi.t().to(stream_dtype if lowp else torch.float32).contiguous()


def require_contiguous(where: str, **tensors) -> None:
    """The launchers index their tensors as dense row-major arrays ([T, n, C] streams, [T, ...] coefficients): a
    view with other strides would be read wrong with no error. The public calls (kernels/mhc.py) pass contiguous
    tensors; this guards direct callers (tests, benchmarks)."""
    for name, t in tensors.items():
        if t is not None and not t.is_contiguous():
            raise ValueError(f"{where}: {name} must be contiguous, got shape {tuple(t.shape)} with strides "
                             f"{t.stride()}; hint: pass {name}.contiguous()")


def check_streams(n: int, C: int, where: str) -> None:
    if n not in KERNEL_STREAMS:
        raise ValueError(f"{where}: the Triton mHC kernels take n_streams in {KERNEL_STREAMS}, got n={n}; "
                         "hint: use one of those or set mhc_kernels=false to run the PyTorch reference")
    if C % KERNEL_WIDTH_MULTIPLE:
        m = KERNEL_WIDTH_MULTIPLE
        raise ValueError(f"{where}: the Triton mHC kernels need the stream width C to be a multiple of {m}, "
                         f"got C={C}; hint: pick d_model a multiple of {m} or set mhc_kernels=false")


def channel_block(C: int, want: int, n: int) -> int:
    """Power-of-two channel tile: at most `want`, no wider than C needs, and small enough that the
    [n*BC, NP] tile of phi that coef_premix and stream_bwd take per step stays at <= 16K values."""
    cap = max(16, 16384 // (n * padded_columns(n)))
    return max(16, min(want, cap, triton.next_power_of_2(C)))


def program_slots(device: torch.device) -> int:
    """How many programs keep the device busy: a few per SM on a GPU, a handful in the interpreter."""
    if device.type != "cuda":
        return 4
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count
