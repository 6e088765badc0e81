"""Forward Triton kernels for per-token mHC (math: kernels/mhc_reference.py).

Streams are [T, n, C] (T tokens, contiguous); coefficients are fp32. Two kernels:
  coef_premix: optional apply of sublayer l (x' = H_res x + H_post y, written once), then for the
    streams x' the projection x'.phi fused with the sum of squares, the gates, Sinkhorn, and the
    pre-mix u = sum_i H_pre[i] x'_i. One program owns BT tokens and all n*C of their channels:
    pass 1 streams the channels once (feeding the apply, the dot and the sum of squares); pass 2
    re-reads x' for the pre-mix while it is still in L2.
  apply: x' = H_res x + H_post y alone (the last sublayer, which has no next coefficients).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._triton_util import (channel_block, check_streams, load_apply, num_coefficients,
                                  padded_columns, sigmoid, sinkhorn_fwd)
from kernels.mhc_reference import RMS_EPS


@triton.jit
def _take_columns(tile, START: tl.constexpr, WIDTH: tl.constexpr, NP: tl.constexpr):
    """Columns [START, START+WIDTH) of a [BT, NP] register tile, as a [BT, WIDTH] tile."""
    col = tl.arange(0, NP)
    want = START + tl.arange(0, WIDTH)
    hit = col[None, None, :] == want[None, :, None]
    return tl.sum(tl.where(hit, tile[:, None, :], 0.0), axis=2)


@triton.jit
def coef_premix_kernel(
    x_ptr, y_ptr, hres_ptr, hpost_ptr,          # apply inputs (y/hres/hpost unused without APPLY)
    phi_ptr, alpha_ptr, bias_ptr,
    xnew_ptr, u_ptr, hpost_out_ptr, hres_out_ptr, raw_ptr, rinv_ptr,
    T, C,
    n: tl.constexpr, N: tl.constexpr, NP: tl.constexpr, ITERS: tl.constexpr, EPS: tl.constexpr,
    APPLY: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    tmask = t < T
    t64 = t.to(tl.int64)
    i = tl.arange(0, n)
    col = tl.arange(0, NP)
    K = n * C
    stream_off = t64[:, None, None] * K + i[None, :, None] * C          # [BT, n, 1]
    if APPLY:
        hpost = tl.load(hpost_ptr + t64[:, None] * n + i[None, :], mask=tmask[:, None], other=0.0)
        src_ptr = xnew_ptr
    else:
        src_ptr = x_ptr

    # Pass 1: one read of the streams feeds the projection and the sum of squares.
    acc = tl.zeros([BT, NP], tl.float32)
    ss = tl.zeros([BT], tl.float32)
    for c0 in range(0, C, BC):
        c = c0 + tl.arange(0, BC)
        cmask = c < C
        m3 = tmask[:, None, None] & cmask[None, None, :]
        if APPLY:
            xs = load_apply(x_ptr, y_ptr, hres_ptr, hpost, t64, tmask, i, c, cmask, C, n, BT, BC)
            xq = xs.to(xnew_ptr.dtype.element_ty)
            tl.store(xnew_ptr + stream_off + c[None, None, :], xq, mask=m3)
            xs = xq.to(tl.float32)  # the coefficients see x' as stored, like the reference
        else:
            xs = tl.load(x_ptr + stream_off + c[None, None, :], mask=m3, other=0.0).to(tl.float32)
        ss += tl.sum(tl.sum(xs * xs, axis=2), axis=1)
        phi_row = i[:, None] * C + c[None, :]                             # [n, BC]
        ph = tl.load(phi_ptr + phi_row[:, :, None] * N + col[None, None, :],
                     mask=cmask[None, :, None] & (col < N)[None, None, :], other=0.0).to(tl.float32)
        acc += tl.dot(tl.reshape(xs, [BT, n * BC]), tl.reshape(ph, [n * BC, NP]))

    # Coefficients, all per token in registers.
    rinv = tl.rsqrt(ss / K + EPS)
    raw = acc * rinv[:, None]
    tl.store(raw_ptr + t64[:, None] * N + col[None, :], raw, mask=tmask[:, None] & (col < N)[None, :])
    tl.store(rinv_ptr + t64, rinv, mask=tmask)
    nn = tl.arange(0, n * n)
    h_pre = sigmoid(tl.load(alpha_ptr) * _take_columns(raw, 0, n, NP) + tl.load(bias_ptr + i)[None, :])
    h_post = 2.0 * sigmoid(tl.load(alpha_ptr + 1) * _take_columns(raw, n, n, NP)
                           + tl.load(bias_ptr + n + i)[None, :])
    res_logits = (tl.load(alpha_ptr + 2) * _take_columns(raw, 2 * n, n * n, NP)
                  + tl.load(bias_ptr + 2 * n + nn)[None, :])
    h_res = sinkhorn_fwd(tl.reshape(res_logits, [BT, n, n]), ITERS)
    tl.store(hpost_out_ptr + t64[:, None] * n + i[None, :], h_post, mask=tmask[:, None])
    tl.store(hres_out_ptr + t64[:, None] * (n * n) + nn[None, :], tl.reshape(h_res, [BT, n * n]),
             mask=tmask[:, None])

    # Pass 2: the pre-mix re-reads this program's streams (x' was written by other threads of it).
    if APPLY:
        tl.debug_barrier()
    for c0 in range(0, C, BC):
        c = c0 + tl.arange(0, BC)
        cmask = c < C
        m3 = tmask[:, None, None] & cmask[None, None, :]
        xs = tl.load(src_ptr + stream_off + c[None, None, :], mask=m3, other=0.0).to(tl.float32)
        u = tl.sum(xs * h_pre[:, :, None], axis=1)
        tl.store(u_ptr + t64[:, None] * C + c[None, :], u.to(u_ptr.dtype.element_ty),
                 mask=tmask[:, None] & cmask[None, :])


@triton.jit
def apply_kernel(x_ptr, y_ptr, hres_ptr, hpost_ptr, xnew_ptr, T, C,
                 n: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    tmask = t < T
    cmask = c < C
    t64 = t.to(tl.int64)
    i = tl.arange(0, n)
    hpost = tl.load(hpost_ptr + t64[:, None] * n + i[None, :], mask=tmask[:, None], other=0.0)
    xs = load_apply(x_ptr, y_ptr, hres_ptr, hpost, t64, tmask, i, c, cmask, C, n, BT, BC)
    off = t64[:, None, None] * (n * C) + i[None, :, None] * C + c[None, None, :]
    tl.store(xnew_ptr + off, xs.to(xnew_ptr.dtype.element_ty), mask=tmask[:, None, None] & cmask[None, None, :])


# ---------------------------------------------------------------- launchers (make_fx traceable)

def fwd_config(device: torch.device) -> dict:
    """Block sizes of coef_premix: tokens per program and channels per pass-1 step."""
    if device.type == "cuda":
        return dict(BT=32, BC=64, num_warps=8)
    return dict(BT=16, BC=32, num_warps=4)


def launch_coef_premix(launch, x, y, h_res, h_post, phi, alpha, bias, iters: int, cfg: dict | None = None):
    """x [T, n, C]; with y given, first x' = apply(x, h_res, h_post, y). Returns
    (x' or None, u [T, C], h_post' [T, n], h_res' [T, n, n], raw [T, N], inv_rms [T])."""
    T, n, C = x.shape
    check_streams(n, C, "mhc coefficients")
    cfg = dict(fwd_config(x.device) if cfg is None else cfg)
    N = num_coefficients(n)
    apply = y is not None
    f32 = dict(device=x.device, dtype=torch.float32)
    x_new = torch.empty_like(x) if apply else None
    u = torch.empty((T, C), device=x.device, dtype=x.dtype)
    h_post_out = torch.empty((T, n), **f32)
    h_res_out = torch.empty((T, n, n), **f32)
    raw = torch.empty((T, N), **f32)
    rinv = torch.empty((T,), **f32)
    BT, BC = cfg.pop("BT"), channel_block(C, cfg.pop("BC"))
    grid = (triton.cdiv(T, BT),)
    launch(coef_premix_kernel)[grid](
        x, y if apply else x, h_res if apply else raw, h_post if apply else raw,
        phi, alpha, bias, x_new if apply else x, u, h_post_out, h_res_out, raw, rinv,
        T, C, n=n, N=N, NP=padded_columns(n), ITERS=iters, EPS=RMS_EPS, APPLY=apply,
        BT=BT, BC=BC, **cfg)
    return x_new, u, h_post_out, h_res_out, raw, rinv


def launch_apply(launch, x, y, h_res, h_post):
    T, n, C = x.shape
    check_streams(n, C, "mhc apply")
    x_new = torch.empty_like(x)
    BT, BC = (32, channel_block(C, 128)) if x.is_cuda else (16, channel_block(C, 32))
    grid = (triton.cdiv(T, BT), triton.cdiv(C, BC))
    launch(apply_kernel)[grid](x, y, h_res, h_post, x_new, T, C, n=n, BT=BT, BC=BC,
                               num_warps=4)
    return x_new
