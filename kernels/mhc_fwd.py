"""Forward Triton kernels for per-token mHC (math: kernels/mhc_reference.py).

Streams are [T, n, C] (T tokens, contiguous); coefficients are fp32. Two kernels:
  coef_premix: optional apply of sublayer l (x' = H_res x + H_post y, written once), then for the
    streams x' the projection x'.phi fused with the sum of squares, the gates, Sinkhorn, and the
    pre-mix u = sum_i H_pre[i] x'_i. One program owns BT tokens and all n*C of their channels:
    pass 1 streams the channels once (feeding the apply, the dot and the sum of squares); pass 2
    re-reads x' for the pre-mix. With APPLY_PASS (off in every default, see fwd_config) the apply is a
    pass 0 of its own and pass 1 reads x' back. ZIGZAG (on by default) turns the elementwise passes
    around so that each reread starts where the pass before ended, on the tiles most likely still in L2.
  apply: x' = H_res x + H_post y alone (the last sublayer, which has no next coefficients).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._triton_util import (apply_streams, channel_block, check_streams, load_mixing, load_streams,
                                  num_coefficients, padded_columns, phi_operand, pre_gates, require_contiguous,
                                  sigmoid, sinkhorn_fwd, store_streams)
from kernels.mhc_reference import RMS_EPS


@triton.jit
def _tile_start(k, tiles, REVERSE: tl.constexpr):
    """The k-th channel tile of a pass, counted from the last tile when REVERSE."""
    if REVERSE:
        return tiles - 1 - k
    return k


@triton.jit
def coef_premix_kernel(
    x_ptr, y_ptr, hres_ptr, hpost_ptr,          # apply inputs (y/hres/hpost unused without APPLY)
    phit_ptr, alpha_ptr, bias_ptr,             # phit = phi^T [N, n*C] in the projection's operand dtype
    xnew_ptr, u_ptr, hpost_out_ptr, hres_out_ptr, raw_ptr, rinv_ptr,
    T, C,
    n: tl.constexpr, N: tl.constexpr, NP: tl.constexpr, ITERS: tl.constexpr, EPS: tl.constexpr,
    APPLY: tl.constexpr, APPLY_PASS: tl.constexpr, LOWP: tl.constexpr, ZIGZAG: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr,
):
    """LOWP (bf16 streams): the projection x'.phi takes bf16 operands (the stored x' and phi^T, on the tensor
    cores) with fp32 accumulation and an fp32 result; the reference is fp32 throughout. Without LOWP the operands
    are fp32 and the product IEEE fp32 (Triton's default for fp32 operands is TF32, 1e-4 off). APPLY_PASS: the
    apply runs as a pass of its own over all channels before the projection, so that neither loop holds a
    barrier (pass 1 otherwise stores, syncs and reloads each channel tile, which keeps its loads from
    overlapping iterations).
    ZIGZAG: the passes over the channels alternate direction (pass 0 backwards, pass 1 forwards, pass 2
    backwards), so each pass first rereads the tiles the pass before touched last, while they are most likely
    still in L2. Only the elementwise passes turn around: the projection's sum keeps its order."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    tmask = t < T
    t64 = t.to(tl.int64)
    col = tl.arange(0, NP)
    K = n * C
    row = t64 * K                                   # offset of token t's first stream
    if APPLY:
        h_res_in, h_post_in = load_mixing(hres_ptr, hpost_ptr, t64, tmask, n)
        src_ptr = xnew_ptr
    else:
        src_ptr = x_ptr

    tiles = tl.cdiv(C, BC)
    if APPLY and APPLY_PASS:  # pass 0: x' for all of this program's channels, then one barrier
        for k in range(0, tiles):
            c = _tile_start(k, tiles, ZIGZAG) * BC + tl.arange(0, BC)
            m2 = tmask[:, None] & (c < C)[None, :]
            y = tl.load(y_ptr + t64[:, None] * C + c[None, :], mask=m2, other=0.0).to(tl.float32)
            xs = apply_streams(load_streams(x_ptr, row, c, m2, C, n), y, h_res_in, h_post_in, n)
            store_streams(xnew_ptr, row, c, m2, xs, C, n)
        tl.debug_barrier()

    # Pass 1: one read of the streams feeds the projection and the sum of squares.
    acc = tl.zeros([BT, NP], tl.float32)
    ss = tl.zeros([BT], tl.float32)
    for c0 in range(0, C, BC):
        c = c0 + tl.arange(0, BC)
        cmask = c < C
        m2 = tmask[:, None] & cmask[None, :]
        if APPLY and not APPLY_PASS:  # the apply, tile by tile
            xs = load_streams(x_ptr, row, c, m2, C, n, KEEP_DTYPE=LOWP)
            y = tl.load(y_ptr + t64[:, None] * C + c[None, :], mask=m2, other=0.0).to(tl.float32)
            store_streams(xnew_ptr, row, c, m2, apply_streams(xs, y, h_res_in, h_post_in, n), C, n)
            # The projection reads x' back as stored (the reference rounds it too). Reading it from
            # memory, not registers, also stops Triton from recomputing the apply in the dot-operand
            # layout (replicated across warps), which doubled the registers and spilled.
            tl.debug_barrier()
            xs = load_streams(xnew_ptr, row, c, m2, C, n, KEEP_DTYPE=LOWP)
        else:  # x' as pass 0 wrote it, or the input streams when there is no apply
            xs = load_streams(src_ptr, row, c, m2, C, n, KEEP_DTYPE=LOWP)
        for i in tl.static_range(n):
            xf = xs[i].to(tl.float32)
            ss += tl.sum(xf * xf, axis=1)
            ph = tl.load(phit_ptr + col[None, :] * K + (i * C + c)[:, None],
                         mask=cmask[:, None] & (col < N)[None, :], other=0.0)
            acc += tl.dot(xs[i], ph, input_precision="ieee")  # fp32 operands (not LOWP): no TF32 rounding

    # Coefficients, per token in registers. raw goes through global memory (the backward needs it)
    # and comes back as one [BT] vector per column, the form the gates and Sinkhorn work on.
    rinv = tl.rsqrt(ss / K + EPS)
    tl.store(raw_ptr + t64[:, None] * N + col[None, :], acc * rinv[:, None], mask=tmask[:, None] & (col < N)[None, :])
    tl.store(rinv_ptr + t64, rinv, mask=tmask)
    tl.debug_barrier()  # raw (and x') written by other threads of this program are read below
    raw_row = raw_ptr + t64 * N
    a_post = tl.load(alpha_ptr + 1)
    for i in tl.static_range(n):
        raw_i = tl.load(raw_row + n + i, mask=tmask, other=0.0)
        tl.store(hpost_out_ptr + t64 * n + i, 2.0 * sigmoid(a_post * raw_i + tl.load(bias_ptr + n + i)), mask=tmask)
    a_res = tl.load(alpha_ptr + 2)
    logits = ()
    for ij in tl.static_range(n * n):
        raw_ij = tl.load(raw_row + 2 * n + ij, mask=tmask, other=0.0)
        logits = logits + (a_res * raw_ij + tl.load(bias_ptr + 2 * n + ij),)
    h_res = sinkhorn_fwd(logits, ITERS, n)
    for ij in tl.static_range(n * n):
        tl.store(hres_out_ptr + t64 * (n * n) + ij, h_res[ij], mask=tmask)
    h_pre = pre_gates(raw_ptr, alpha_ptr, bias_ptr, t64, tmask, N, n)

    # Pass 2: the pre-mix re-reads this program's streams (x' as written in pass 0 or 1, from L2).
    for k in range(0, tiles):
        c = _tile_start(k, tiles, ZIGZAG) * BC + tl.arange(0, BC)
        m2 = tmask[:, None] & (c < C)[None, :]
        xs = load_streams(src_ptr, row, c, m2, C, n)
        u = h_pre[0][:, None] * xs[0]
        for j in tl.static_range(1, n):
            u += h_pre[j][:, None] * xs[j]
        tl.store(u_ptr + t64[:, None] * C + c[None, :], u.to(u_ptr.dtype.element_ty), mask=m2)


@triton.jit
def apply_kernel(x_ptr, y_ptr, hres_ptr, hpost_ptr, xnew_ptr, T, C,
                 n: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    tmask = t < T
    t64 = t.to(tl.int64)
    m2 = tmask[:, None] & (c < C)[None, :]
    row = t64 * (n * C)
    h_res, h_post = load_mixing(hres_ptr, hpost_ptr, t64, tmask, n)
    y = tl.load(y_ptr + t64[:, None] * C + c[None, :], mask=m2, other=0.0).to(tl.float32)
    xs = apply_streams(load_streams(x_ptr, row, c, m2, C, n), y, h_res, h_post, n)
    store_streams(xnew_ptr, row, c, m2, xs, C, n)


# ---------------------------------------------------------------- launchers (make_fx traceable)

def fwd_config(device: torch.device, n: int, apply: bool = True) -> dict:
    """Block sizes of coef_premix: tokens per program and channels per step, for the launch with the apply
    (mhc_post_pre, every sublayer but the first) or without it (mhc_pre). The fastest on an H100 (every pass
    ZIGZAG; `scripts/bench_kernels.py mhc --sweep coef_premix,coef_premix_pre`, docs/kernels.md):
      with the apply, n=4: 32 tokens x 128 channels, 0.671-0.673 ms against 0.751-0.756 for the
        APPLY_PASS block; n=2: 16 x 128, 0.289-0.291 ms against 0.317 for 16 x 64.
      without it, 64 tokens x 64 channels at both n: n=4 0.337 ms against 0.421 for 32 x 64 and 0.544 for
        32 x 128 (whose 128 KB of shared memory leave one program per SM); n=2 0.194 against 0.307 for 16 x 64.
    APPLY_PASS was slower at n=2 on every block, and no faster at n=4 once the passes zigzag. n=8 is not
    measured: with the apply it takes n=2's block, without it 16-token programs (channel_block caps its
    tile at 16 channels, and 64-token programs would need 128 KB of shared memory: scripts/kernel_resources.py --n 8)."""
    if device.type != "cuda":
        return dict(BT=16, BC=32, num_warps=4)
    if not apply:  # n=8 keeps the 16-token programs it had (its channel tile is 16 wide)
        return dict(BT=64 if n <= 4 else 16, BC=64, num_warps=4)
    return dict(BT=32 if n == 4 else 16, BC=128, num_warps=4)


def launch_coef_premix(launch, x, y, h_res, h_post, phi, alpha, bias, iters: int, cfg: dict | None = None):
    """x [T, n, C]; with y given, first x' = apply(x, h_res, h_post, y). Returns
    (x' or None, u [T, C], h_post' [T, n], h_res' [T, n, n], raw [T, N], inv_rms [T])."""
    T, n, C = x.shape
    check_streams(n, C, "mhc coefficients")
    require_contiguous("launch_coef_premix", x=x, y=y, h_res=h_res, h_post=h_post)
    alpha, bias = alpha.contiguous(), bias.contiguous()  # read as dense vectors (a strided bias gave wrong gates)
    apply = y is not None
    cfg = dict(fwd_config(x.device, n, apply) if cfg is None else cfg)
    N = num_coefficients(n)
    f32 = dict(device=x.device, dtype=torch.float32)
    x_new = torch.empty_like(x) if apply else None
    u = torch.empty((T, C), device=x.device, dtype=x.dtype)
    h_post_out = torch.empty((T, n), **f32)
    h_res_out = torch.empty((T, n, n), **f32)
    raw = torch.empty((T, N), **f32)
    rinv = torch.empty((T,), **f32)
    BT, BC = cfg.pop("BT"), channel_block(C, cfg.pop("BC"), n)
    lowp = cfg.pop("LOWP", x.dtype == torch.bfloat16)
    apply_pass = cfg.pop("APPLY_PASS", False) and apply  # without an apply the two paths are one
    zigzag = cfg.pop("ZIGZAG", True)
    phit = phi_operand(phi, x.dtype, lowp)
    grid = (triton.cdiv(T, BT),)
    launch(coef_premix_kernel)[grid](
        x, y if apply else x, h_res if apply else raw, h_post if apply else raw,
        phit, alpha, bias, x_new if apply else x, u, h_post_out, h_res_out, raw, rinv,
        T, C, n=n, N=N, NP=padded_columns(n), ITERS=iters, EPS=RMS_EPS, APPLY=apply, APPLY_PASS=apply_pass,
        LOWP=lowp, ZIGZAG=zigzag, BT=BT, BC=BC, **cfg)
    return x_new, u, h_post_out, h_res_out, raw, rinv


def launch_apply(launch, x, y, h_res, h_post):
    T, n, C = x.shape
    check_streams(n, C, "mhc apply")
    require_contiguous("launch_apply", x=x, y=y, h_res=h_res, h_post=h_post)
    x_new = torch.empty_like(x)
    BT, BC, warps = (32, channel_block(C, 128, n), 8) if x.is_cuda else (16, channel_block(C, 32, n), 4)
    grid = (triton.cdiv(T, BT), triton.cdiv(C, BC))
    launch(apply_kernel)[grid](x, y, h_res, h_post, x_new, T, C, n=n, BT=BT, BC=BC, num_warps=warps)
    return x_new
