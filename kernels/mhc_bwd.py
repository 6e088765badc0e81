"""Backward Triton kernels for per-token mHC (math: kernels/mhc_reference.py).

Two passes, because every stream gradient needs dH_pre, a reduction over all n*C channels:
  coef_bwd (token-major): dH_pre[i] = sum_c du * x'_i, then the gradient of the coefficient logits
    (sigmoid gates; Sinkhorn by recomputing its rounds from the stored raw projections), folded
    into G = inv_rms * d(raw) [T, N] and the rms factor [T]; per-program partial sums for
    d(alpha) and d(bias), reduced afterwards (deterministic, no atomics).
  stream_bwd (channel-major): one program owns a channel tile of all n streams and walks a
    strided subset of token blocks, so it can keep d(phi) rows for its channels in registers:
      dx'_i = dx'_out_i + H_pre[i] du + (G phi^T)_i + rms * x'_i        (coefficient path)
      dx_j = sum_i H_res[i, j] dx'_i,  dy = sum_i H_post[i] dx'_i          (apply path)
    x' is recomputed from x and y (one read less than loading it). Per-token reductions over the
    channel tiles (dH_res, dH_post) and the per-program d(phi) rows are partial sums reduced by
    torch.sum afterwards.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._triton_util import (channel_block, load_apply, num_coefficients, padded_columns,
                                  program_slots, sigmoid, sinkhorn_bwd)


@triton.jit
def coef_bwd_kernel(
    xs_ptr, du_ptr, dhpost_ptr, dhres_ptr, raw_ptr, rinv_ptr, alpha_ptr, bias_ptr,
    aux_ptr, part_ptr, T, C,
    n: tl.constexpr, N: tl.constexpr, NP: tl.constexpr, ITERS: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr,
):
    pid = tl.program_id(0)
    t = pid * BT + tl.arange(0, BT)
    tmask = t < T
    t64 = t.to(tl.int64)
    i = tl.arange(0, n)
    K = n * C
    stream_off = t64[:, None, None] * K + i[None, :, None] * C

    dh_pre = tl.zeros([BT, n], tl.float32)
    for c0 in range(0, C, BC):
        c = c0 + tl.arange(0, BC)
        cmask = c < C
        xs = tl.load(xs_ptr + stream_off + c[None, None, :], mask=tmask[:, None, None] & cmask[None, None, :],
                     other=0.0).to(tl.float32)
        du = tl.load(du_ptr + t64[:, None] * C + c[None, :], mask=tmask[:, None] & cmask[None, :],
                     other=0.0).to(tl.float32)
        dh_pre += tl.sum(xs * du[:, None, :], axis=2)

    # Masked tokens load zero gradients, so every d(logit) below is zero for them.
    m2 = tmask[:, None]
    m3 = tmask[:, None, None]
    ij = i[:, None] * n + i[None, :]                                    # [n, n] row-major
    raw_pre = tl.load(raw_ptr + t64[:, None] * N + i[None, :], mask=m2, other=0.0)
    raw_post = tl.load(raw_ptr + t64[:, None] * N + n + i[None, :], mask=m2, other=0.0)
    raw_res = tl.load(raw_ptr + t64[:, None, None] * N + 2 * n + ij[None, :, :], mask=m3, other=0.0)
    rinv = tl.load(rinv_ptr + t64, mask=tmask, other=0.0)
    a_pre = tl.load(alpha_ptr)
    a_post = tl.load(alpha_ptr + 1)
    a_res = tl.load(alpha_ptr + 2)
    s_pre = sigmoid(a_pre * raw_pre + tl.load(bias_ptr + i)[None, :])
    s_post = sigmoid(a_post * raw_post + tl.load(bias_ptr + n + i)[None, :])
    dl_pre = dh_pre * s_pre * (1.0 - s_pre)
    dh_post = tl.load(dhpost_ptr + t64[:, None] * n + i[None, :], mask=m2, other=0.0)
    dl_post = dh_post * 2.0 * s_post * (1.0 - s_post)
    res_logits = a_res * raw_res + tl.load(bias_ptr + 2 * n + ij)[None, :, :]
    dh_res = tl.load(dhres_ptr + t64[:, None, None] * (n * n) + ij[None, :, :], mask=m3, other=0.0)
    dl_res = sinkhorn_bwd(res_logits, dh_res, ITERS)

    # raw = (x'.phi) * inv_rms, inv_rms = (sum x'^2 / K + eps)^-1/2:
    #   d(x'.phi) = inv_rms * d(raw) = G;  dx' += G phi^T - x' * inv_rms^2 / K * sum(d(raw) * raw)
    g_pre = a_pre * dl_pre
    g_post = a_post * dl_post
    g_res = a_res * dl_res
    g_dot_raw = (tl.sum(g_pre * raw_pre, axis=1) + tl.sum(g_post * raw_post, axis=1)
                 + tl.sum(tl.sum(g_res * raw_res, axis=2), axis=1))
    rms_factor = -(rinv * rinv / K) * g_dot_raw
    row = aux_ptr + t64 * NP
    tl.store(row[:, None] + i[None, :], rinv[:, None] * g_pre, mask=m2)
    tl.store(row[:, None] + n + i[None, :], rinv[:, None] * g_post, mask=m2)
    tl.store(row[:, None, None] + 2 * n + ij[None, :, :], rinv[:, None, None] * g_res, mask=m3)
    col = tl.arange(0, NP)
    tail = tl.where(col[None, :] == N, rms_factor[:, None], 0.0)
    tl.store(row[:, None] + col[None, :], tail, mask=m2 & (col >= N)[None, :])

    # This program's share of d(bias) [N] and d(alpha) [3]: one partial row, summed on the host side.
    part = part_ptr + pid * (N + 3)
    tl.store(part + i, tl.sum(dl_pre, axis=0))
    tl.store(part + n + i, tl.sum(dl_post, axis=0))
    tl.store(part + 2 * n + ij, tl.sum(dl_res, axis=0))
    tl.store(part + N, tl.sum(tl.sum(dl_pre * raw_pre, axis=1), axis=0))
    tl.store(part + N + 1, tl.sum(tl.sum(dl_post * raw_post, axis=1), axis=0))
    tl.store(part + N + 2, tl.sum(tl.sum(tl.sum(dl_res * raw_res, axis=2), axis=1), axis=0))


@triton.jit
def stream_bwd_kernel(
    x_ptr, y_ptr, hres_ptr, hpost_ptr, dxo_ptr,               # apply inputs, grad of the new streams
    du_ptr, aux_ptr, raw_ptr, alpha_ptr, bias_ptr, phi_ptr,    # coefficient path
    dx_ptr, dy_ptr, dhres_part_ptr, dhpost_part_ptr, dphi_part_ptr,
    T, C,
    n: tl.constexpr, N: tl.constexpr, NP: tl.constexpr,
    APPLY: tl.constexpr, COEF: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
):
    pid_c = tl.program_id(0)
    pid_s = tl.program_id(1)
    splits = tl.num_programs(1)
    c = pid_c * BC + tl.arange(0, BC)
    cmask = c < C
    i = tl.arange(0, n)
    col = tl.arange(0, NP)
    K = n * C
    phi_row = i[:, None] * C + c[None, :]                                # [n, BC]
    if COEF:
        ph = tl.load(phi_ptr + phi_row[:, :, None] * N + col[None, None, :],
                     mask=cmask[None, :, None] & (col < N)[None, None, :], other=0.0).to(tl.float32)
        phi_t = tl.trans(tl.reshape(ph, [n * BC, NP]))                  # [NP, n*BC]
        a_pre = tl.load(alpha_ptr)
        b_pre = tl.load(bias_ptr + i)
        dphi = tl.zeros([n * BC, NP], tl.float32)

    for tb in range(pid_s, tl.cdiv(T, BT), splits):
        t = tb * BT + tl.arange(0, BT)
        tmask = t < T
        t64 = t.to(tl.int64)
        m2 = tmask[:, None] & cmask[None, :]
        m3 = tmask[:, None, None] & cmask[None, None, :]
        stream_off = t64[:, None, None] * K + i[None, :, None] * C + c[None, None, :]
        if APPLY:
            hpost = tl.load(hpost_ptr + t64[:, None] * n + i[None, :], mask=tmask[:, None], other=0.0)
            xs = load_apply(x_ptr, y_ptr, hres_ptr, hpost, t64, tmask, i, c, cmask, C, n, BT, BC)
            dxt = tl.load(dxo_ptr + stream_off, mask=m3, other=0.0).to(tl.float32)
        else:
            xs = tl.load(x_ptr + stream_off, mask=m3, other=0.0).to(tl.float32)
            dxt = tl.zeros([BT, n, BC], tl.float32)
        if COEF:
            if APPLY:
                xs = xs.to(x_ptr.dtype.element_ty).to(tl.float32)     # x' as the forward stored it
            du = tl.load(du_ptr + t64[:, None] * C + c[None, :], mask=m2, other=0.0).to(tl.float32)
            raw_pre = tl.load(raw_ptr + t64[:, None] * N + i[None, :], mask=tmask[:, None], other=0.0)
            h_pre = sigmoid(a_pre * raw_pre + b_pre[None, :])
            g = tl.load(aux_ptr + t64[:, None] * NP + col[None, :], mask=tmask[:, None], other=0.0)
            rms_factor = tl.load(aux_ptr + t64 * NP + N, mask=tmask, other=0.0)
            dxt += (h_pre[:, :, None] * du[:, None, :] + rms_factor[:, None, None] * xs
                    + tl.reshape(tl.dot(g, phi_t), [BT, n, BC]))
            dphi += tl.dot(tl.trans(tl.reshape(xs, [BT, n * BC])), g)
        if APPLY:
            yv = tl.load(y_ptr + t64[:, None] * C + c[None, :], mask=m2, other=0.0).to(tl.float32)
            dy = tl.sum(hpost[:, :, None] * dxt, axis=1)
            tl.store(dy_ptr + t64[:, None] * C + c[None, :], dy.to(dy_ptr.dtype.element_ty), mask=m2)
            part_row = pid_c * T + t64
            tl.store(dhpost_part_ptr + part_row[:, None] * n + i[None, :], tl.sum(dxt * yv[:, None, :], axis=2),
                     mask=tmask[:, None])
            for j in tl.static_range(n):
                xj = tl.load(x_ptr + t64[:, None] * K + j * C + c[None, :], mask=m2, other=0.0).to(tl.float32)
                hj = tl.load(hres_ptr + t64[:, None] * (n * n) + i[None, :] * n + j, mask=tmask[:, None], other=0.0)
                dxj = tl.sum(hj[:, :, None] * dxt, axis=1)
                tl.store(dx_ptr + t64[:, None] * K + j * C + c[None, :], dxj.to(dx_ptr.dtype.element_ty), mask=m2)
                tl.store(dhres_part_ptr + part_row[:, None] * (n * n) + i[None, :] * n + j,
                         tl.sum(dxt * xj[:, None, :], axis=2), mask=tmask[:, None])
        else:
            tl.store(dx_ptr + stream_off, dxt.to(dx_ptr.dtype.element_ty), mask=m3)

    if COEF:
        out = dphi_part_ptr + pid_s.to(tl.int64) * K * NP + phi_row[:, :, None] * NP + col[None, None, :]
        tl.store(out, tl.reshape(dphi, [n, BC, NP]), mask=cmask[None, :, None])


# ---------------------------------------------------------------- launchers (make_fx traceable)

def coef_bwd_config(device: torch.device) -> dict:
    return dict(BT=32, BC=64, num_warps=4) if device.type == "cuda" else dict(BT=16, BC=32, num_warps=4)


def stream_bwd_config(device: torch.device) -> dict:
    return dict(BT=32, BC=64, num_warps=8) if device.type == "cuda" else dict(BT=16, BC=32, num_warps=4)


def launch_coef_bwd(launch, xs, du, dh_post, dh_res, raw, rinv, alpha, bias, iters: int, cfg: dict | None = None):
    """Returns (aux [T, NP]: G in columns [0, N) and the rms factor in column N, d(alpha) [3], d(bias) [N])."""
    T, n, C = xs.shape
    N, NP = num_coefficients(n), padded_columns(n)
    cfg = dict(coef_bwd_config(xs.device) if cfg is None else cfg)
    BT, BC = cfg.pop("BT"), channel_block(C, cfg.pop("BC"))
    programs = triton.cdiv(T, BT)
    aux = torch.empty((T, NP), device=xs.device, dtype=torch.float32)
    part = torch.empty((programs, N + 3), device=xs.device, dtype=torch.float32)
    launch(coef_bwd_kernel)[(programs,)](
        xs, du, dh_post, dh_res, raw, rinv, alpha, bias, aux, part, T, C,
        n=n, N=N, NP=NP, ITERS=iters, BT=BT, BC=BC, **cfg)
    return aux, part[:, N:].sum(dim=0), part[:, :N].sum(dim=0)  # two sums: outputs must not alias


def launch_stream_bwd(launch, x, y, h_res, h_post, dx_new, du, aux, raw, alpha, bias, phi,
                      cfg: dict | None = None):
    """Stream gradients. With y: x' = apply(x, ...) and dx_new is its incoming gradient; with du:
    the coefficient path of pre(x'). Returns (dx, dy, dh_res, dh_post, dphi), None where absent."""
    T, n, C = x.shape
    N, NP = num_coefficients(n), padded_columns(n)
    apply, coef = y is not None, du is not None
    cfg = dict(stream_bwd_config(x.device) if cfg is None else cfg)
    BT, BC = cfg.pop("BT"), channel_block(C, cfg.pop("BC"))
    chunks = triton.cdiv(C, BC)
    splits = max(1, program_slots(x.device) // chunks)
    f32 = dict(device=x.device, dtype=torch.float32)
    dx = torch.empty_like(x)
    dy = torch.empty_like(y) if apply else None
    dhres_part = torch.empty((chunks, T, n, n), **f32) if apply else None
    dhpost_part = torch.empty((chunks, T, n), **f32) if apply else None
    dphi_part = torch.empty((splits, n * C, NP), **f32) if coef else None
    dummy = dx
    launch(stream_bwd_kernel)[(chunks, splits)](
        x, y if apply else dummy, h_res if apply else dummy, h_post if apply else dummy,
        dx_new if apply else dummy, du if coef else dummy, aux if coef else dummy,
        raw if coef else dummy, alpha, bias, phi, dx, dy if apply else dummy,
        dhres_part if apply else dummy, dhpost_part if apply else dummy,
        dphi_part if coef else dummy, T, C,
        n=n, N=N, NP=NP, APPLY=apply, COEF=coef, BT=BT, BC=BC, **cfg)
    dh_res = dhres_part.sum(dim=0) if apply else None
    dh_post = dhpost_part.sum(dim=0) if apply else None
    dphi = dphi_part[:, :, :N].sum(dim=0) if coef else None
    return dx, dy, dh_res, dh_post, dphi
