"""Backward Triton kernels for per-token mHC (math: kernels/mhc_reference.py).

Three passes, because every stream gradient needs dH_pre, a reduction over all n*C channels:
  coef_bwd (token-major): dH_pre[i] = sum_c du * x'_i, then the gradient of the coefficient logits
    (sigmoid gates; Sinkhorn by recomputing its rounds from the stored raw projections), folded
    into G = inv_rms * d(raw) [T, N] and the rms factor [T]; per-program partial sums for
    d(alpha) and d(bias), reduced afterwards (deterministic, no atomics).
  stream_bwd (token-major): one program owns BT tokens and walks their channels:
      dx'_i = dx'_out_i + H_pre[i] du + (G phi^T)_i + rms * x'_i        (coefficient path)
      dx_j = sum_i H_res[i, j] dx'_i,  dy = sum_i H_post[i] dx'_i          (apply path)
    x' is recomputed from x and y (one read less than loading it); the per-token sums over
    channels (dH_res, dH_post) finish in the program's registers.
  dphi: d(phi) = x'^T G, a skinny product over all tokens, as per-program partials summed afterwards.
    It reads x' once more; folding it into stream_bwd (an [n*C, N] accumulator per program) spilled
    registers and ran that kernel at 28% of peak DRAM throughput (H100, ncu).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._triton_util import (apply_stream, channel_block, load_mixing, load_streams, num_coefficients,
                                  padded_columns, phi_operand, program_slots, require_contiguous, sigmoid,
                                  sinkhorn_bwd, store_streams)


@triton.jit
def premix_grad_kernel(xs_ptr, du_ptr, dhpre_ptr, T, C, n: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """dH_pre[t, j] = sum_c du[t, c] * x'[t, j, c]: the one gradient that needs all channels."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    tmask = t < T
    t64 = t.to(tl.int64)
    row = t64 * (n * C)
    dh_pre = ()
    for j in tl.static_range(n):
        dh_pre = dh_pre + (tl.zeros([BT], tl.float32),)
    for c0 in range(0, C, BC):
        c = c0 + tl.arange(0, BC)
        m2 = tmask[:, None] & (c < C)[None, :]
        du = tl.load(du_ptr + t64[:, None] * C + c[None, :], mask=m2, other=0.0).to(tl.float32)
        xs = load_streams(xs_ptr, row, c, m2, C, n)
        summed = ()
        for j in tl.static_range(n):
            summed = summed + (dh_pre[j] + tl.sum(xs[j] * du, axis=1),)
        dh_pre = summed
    for j in tl.static_range(n):
        tl.store(dhpre_ptr + t64 * n + j, dh_pre[j], mask=tmask)


@triton.jit
def _gate_grads(dh_ptr, raw_row, t64, tmask, alpha, bias_ptr, aux_row, part, g_dot_raw, rinv,
                START: tl.constexpr, SCALE: tl.constexpr, N: tl.constexpr, n: tl.constexpr):
    """Sigmoid gates h = SCALE * sigmoid(alpha * raw + bias) of columns [START, START+n): stores G and
    the d(bias) partials; returns (g_dot_raw + sum d(raw) * raw, this program's d(alpha))."""
    dalpha = 0.0
    for j in tl.static_range(n):
        raw_j = tl.load(raw_row + START + j, mask=tmask, other=0.0)
        s_j = sigmoid(alpha * raw_j + tl.load(bias_ptr + START + j))
        dl_j = tl.load(dh_ptr + t64 * n + j, mask=tmask, other=0.0) * SCALE * s_j * (1.0 - s_j)
        g_dot_raw += alpha * dl_j * raw_j
        tl.store(aux_row + START + j, rinv * alpha * dl_j, mask=tmask)
        if START == 0:  # H_pre itself, for the stream pass
            tl.store(aux_row + N + 1 + j, s_j, mask=tmask)
        tl.store(part + START + j, tl.sum(dl_j, axis=0))
        dalpha += tl.sum(dl_j * raw_j, axis=0)
    return g_dot_raw, dalpha


@triton.jit
def coef_bwd_kernel(
    dhpre_ptr, dhpost_ptr, dhres_ptr, raw_ptr, rinv_ptr, alpha_ptr, bias_ptr, aux_ptr, part_ptr, T, K,
    n: tl.constexpr, N: tl.constexpr, NP: tl.constexpr, ITERS: tl.constexpr, SEG: tl.constexpr,
    BT: tl.constexpr,
):
    """Per token (one per thread): gradients of the coefficient logits, folded into
    aux[t] = (G = inv_rms * d(raw) in columns [0, N), rms factor in column N, H_pre in columns
    [N+1, N+1+n), zeros after: G phi^T ignores every column past N, phi having only N).

    raw = (x'.phi) * inv_rms, inv_rms = (sum x'^2 / K + eps)^-1/2, logit = alpha * raw + bias, so
    dx' = G phi^T + x' * rms_factor with rms_factor = -inv_rms^2 / K * sum(d(raw) * raw).
    Each program also writes its share of d(bias) [N] and d(alpha) [3] (summed afterwards).
    """
    pid = tl.program_id(0)
    t = pid * BT + tl.arange(0, BT)
    tmask = t < T          # masked tokens load zero gradients, so all their terms are zero
    t64 = t.to(tl.int64)
    rinv = tl.load(rinv_ptr + t64, mask=tmask, other=0.0)
    raw_row = raw_ptr + t64 * N
    aux_row = aux_ptr + t64 * NP
    part = part_ptr + pid * (N + 3)
    g_dot_raw = tl.zeros([BT], tl.float32)
    g_dot_raw, dalpha_pre = _gate_grads(dhpre_ptr, raw_row, t64, tmask, tl.load(alpha_ptr), bias_ptr, aux_row,
                                        part, g_dot_raw, rinv, 0, 1.0, N, n)
    g_dot_raw, dalpha_post = _gate_grads(dhpost_ptr, raw_row, t64, tmask, tl.load(alpha_ptr + 1), bias_ptr,
                                         aux_row, part, g_dot_raw, rinv, n, 2.0, N, n)
    a_res = tl.load(alpha_ptr + 2)
    raw_res = ()
    logits = ()
    dh_res = ()
    for ij in tl.static_range(n * n):
        raw_ij = tl.load(raw_row + 2 * n + ij, mask=tmask, other=0.0)
        raw_res = raw_res + (raw_ij,)
        logits = logits + (a_res * raw_ij + tl.load(bias_ptr + 2 * n + ij),)
        dh_res = dh_res + (tl.load(dhres_ptr + t64 * (n * n) + ij, mask=tmask, other=0.0),)
    dl_res = sinkhorn_bwd(logits, dh_res, ITERS, SEG, n)
    dalpha_res = 0.0
    for ij in tl.static_range(n * n):
        g_dot_raw += a_res * dl_res[ij] * raw_res[ij]
        tl.store(aux_row + 2 * n + ij, rinv * a_res * dl_res[ij], mask=tmask)
        tl.store(part + 2 * n + ij, tl.sum(dl_res[ij], axis=0))
        dalpha_res += tl.sum(dl_res[ij] * raw_res[ij], axis=0)
    tl.store(aux_row + N, -(rinv * rinv / K) * g_dot_raw, mask=tmask)
    for q in tl.static_range(N + 1 + n, NP):
        tl.store(aux_row + q, tl.zeros([BT], tl.float32), mask=tmask)
    tl.store(part + N, dalpha_pre)
    tl.store(part + N + 1, dalpha_post)
    tl.store(part + N + 2, dalpha_res)


@triton.jit
def _g_phi(g, phit_ptr, col, k, kmask, N: tl.constexpr, K):
    """(G phi^T) over the projection rows k: [BT, NP] x [NP, len(k)] on the tensor cores."""
    phi_t = tl.load(phit_ptr + col[:, None] * K + k[None, :], mask=(col < N)[:, None] & kmask[None, :], other=0.0)
    return tl.dot(g, phi_t.to(g.dtype), input_precision="ieee")  # fp32 operands (not LOWP): no TF32 rounding


@triton.jit
def stream_bwd_kernel(
    x_ptr, y_ptr, hres_ptr, hpost_ptr, dxo_ptr,               # apply inputs, grad of the new streams
    du_ptr, aux_ptr, phit_ptr,                                 # coefficient path; phit = phi^T [N, n*C]
    dx_ptr, dy_ptr, dhres_ptr, dhpost_ptr,
    T, C,
    n: tl.constexpr, N: tl.constexpr, NP: tl.constexpr,
    APPLY: tl.constexpr, COEF: tl.constexpr, LOWP: tl.constexpr, GP_SCRATCH: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr,
):
    """One program owns BT tokens and walks their channels in tiles of BC, so the per-token sums over
    channels (dH_res, dH_post) finish in registers and are stored once. No d(phi) here (dphi_kernel):
    its [n*C, N] accumulator is what spilled the channel-major version of this kernel.
    LOWP (bf16 streams): G phi^T takes operands in the stream dtype (fp32 accumulate).
    GP_SCRATCH: G phi^T goes through the program's own dx tile (stored in the stream dtype, reloaded,
    overwritten by dx below). Without it Triton computes the whole coefficient-path sum in the dot's
    layout and holds the x tiles and per-token coefficients in two layouts (n=4: 255 registers, 60
    layout conversions); the reload keeps the loop in the loads' layout (n=4: 159-172 registers at
    4 elements per thread, sm_90, no spill). The scratch rounds G phi^T to the stream dtype on its own,
    a rounding the reference does not have (it rounds the summed fp32 gradient once, on its way back
    through .float()); the bf16 GPU tests bound the difference."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    tmask = t < T
    t64 = t.to(tl.int64)
    K = n * C
    row = t64 * K
    if APPLY:
        h_res, h_post = load_mixing(hres_ptr, hpost_ptr, t64, tmask, n)
        dh_res = ()
        for ij in tl.static_range(n * n):
            dh_res = dh_res + (tl.zeros([BT], tl.float32),)
        dh_post = ()
        for i in tl.static_range(n):
            dh_post = dh_post + (tl.zeros([BT], tl.float32),)
    if COEF:
        col = tl.arange(0, NP)
        g = tl.load(aux_ptr + t64[:, None] * NP + col[None, :], mask=tmask[:, None] & (col < N)[None, :], other=0.0)
        if LOWP:
            g = g.to(phit_ptr.dtype.element_ty)
        rms_factor = tl.load(aux_ptr + t64 * NP + N, mask=tmask, other=0.0)
        h_pre = ()
        for i in tl.static_range(n):
            h_pre = h_pre + (tl.load(aux_ptr + t64 * NP + N + 1 + i, mask=tmask, other=0.0),)

    for c0 in range(0, C, BC):
        c = c0 + tl.arange(0, BC)
        cmask = c < C
        m2 = tmask[:, None] & cmask[None, :]
        xs = load_streams(x_ptr, row, c, m2, C, n, KEEP_DTYPE=True)
        if APPLY:
            y = tl.load(y_ptr + t64[:, None] * C + c[None, :], mask=m2, other=0.0).to(tl.float32)
            dxt = load_streams(dxo_ptr, row, c, m2, C, n)
        else:
            dxt = ()
            for i in tl.static_range(n):
                dxt = dxt + (tl.zeros([BT, BC], tl.float32),)
        if COEF:
            du = tl.load(du_ptr + t64[:, None] * C + c[None, :], mask=m2, other=0.0).to(tl.float32)
            if GP_SCRATCH:
                gps = ()
                for i in tl.static_range(n):
                    gps = gps + (_g_phi(g, phit_ptr, col, i * C + c, cmask, N, K),)
                store_streams(dx_ptr, row, c, m2, gps, C, n)
                tl.debug_barrier()  # written by other threads of this program (if the layouts differ)
                gps = load_streams(dx_ptr, row, c, m2, C, n)
                tl.debug_barrier()  # every thread has its G phi^T before any thread stores dx there
            grads = ()
            for i in tl.static_range(n):
                if APPLY:  # x'_i recomputed (one read less than loading it), rounded as stored
                    xi = apply_stream(xs, y, h_res, h_post, i, n).to(x_ptr.dtype.element_ty).to(tl.float32)
                else:
                    xi = xs[i].to(tl.float32)
                if GP_SCRATCH:
                    gp = gps[i]
                else:
                    gp = _g_phi(g, phit_ptr, col, i * C + c, cmask, N, K)
                grads = grads + (dxt[i] + h_pre[i][:, None] * du + rms_factor[:, None] * xi + gp,)
            dxt = grads
        if APPLY:
            dy = h_post[0][:, None] * dxt[0]
            for i in tl.static_range(1, n):
                dy += h_post[i][:, None] * dxt[i]
            tl.store(dy_ptr + t64[:, None] * C + c[None, :], dy.to(dy_ptr.dtype.element_ty), mask=m2)
            post_sums = ()
            res_sums = ()
            for i in tl.static_range(n):
                post_sums = post_sums + (dh_post[i] + tl.sum(dxt[i] * y, axis=1),)
                for j in tl.static_range(n):
                    res_sums = res_sums + (dh_res[i * n + j] + tl.sum(dxt[i] * xs[j].to(tl.float32), axis=1),)
            dh_post = post_sums
            dh_res = res_sums
            dx = ()
            for j in tl.static_range(n):
                acc = h_res[j][:, None] * dxt[0]
                for i in tl.static_range(1, n):
                    acc += h_res[i * n + j][:, None] * dxt[i]
                dx = dx + (acc,)
            store_streams(dx_ptr, row, c, m2, dx, C, n)
        else:
            store_streams(dx_ptr, row, c, m2, dxt, C, n)

    if APPLY:
        for ij in tl.static_range(n * n):
            tl.store(dhres_ptr + t64 * (n * n) + ij, dh_res[ij], mask=tmask)
        for i in tl.static_range(n):
            tl.store(dhpost_ptr + t64 * n + i, dh_post[i], mask=tmask)


@triton.jit
def dphi_kernel(xs_ptr, aux_ptr, part_ptr, T, K,
                N: tl.constexpr, NP: tl.constexpr, LOWP: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr):
    """d(phi)[k, :] = sum_t x'[t, k] G[t, :], x' viewed as [T, K = n*C]: one program owns BK rows of
    d(phi) and a strided subset of token blocks; the per-program partials are summed afterwards
    (deterministic, no atomics). Every x' element is read by exactly one program."""
    pid_s = tl.program_id(1)
    k = tl.program_id(0) * BK + tl.arange(0, BK)
    kmask = k < K
    col = tl.arange(0, NP)
    acc = tl.zeros([BK, NP], tl.float32)
    for tb in range(pid_s, tl.cdiv(T, BT), tl.num_programs(1)):
        t = tb * BT + tl.arange(0, BT)
        tmask = t < T
        t64 = t.to(tl.int64)
        xt = tl.load(xs_ptr + t64[:, None] * K + k[None, :], mask=tmask[:, None] & kmask[None, :], other=0.0)
        g = tl.load(aux_ptr + t64[:, None] * NP + col[None, :], mask=tmask[:, None] & (col < N)[None, :], other=0.0)
        if LOWP:
            acc += tl.dot(tl.trans(xt), g.to(xs_ptr.dtype.element_ty))
        else:
            acc += tl.dot(tl.trans(xt.to(tl.float32)), g, input_precision="ieee")
    tl.store(part_ptr + pid_s.to(tl.int64) * K * NP + k[:, None] * NP + col[None, :], acc, mask=kmask[:, None])


# ---------------------------------------------------------------- launchers (make_fx traceable)

TOKENS_PER_THREAD_BLOCK = 128  # coef_bwd on a GPU: 4 warps, one token per thread
SINKHORN_SEGMENT = 5           # Sinkhorn checkpoint spacing, ~sqrt(20 rounds); n=8 keeps none (registers)


# Block sizes: the fastest of scripts/bench_kernels.py mhc --sweep on an H100.
def coef_bwd_config(device: torch.device) -> dict:
    """premix_grad block sizes, and TOKENS per coef_bwd program (one token per thread on a GPU)."""
    if device.type == "cuda":
        return dict(BT=32, BC=128, num_warps=8, TOKENS=TOKENS_PER_THREAD_BLOCK)
    return dict(BT=16, BC=32, num_warps=4, TOKENS=16)


# stream_bwd: the fastest of scripts/bench_kernels.py mhc --sweep on an H200: 0.79 ms at 98,304
# tokens with 32 tokens x 16 channels per program on 2 warps, against 1.23 ms for 16 x 64 on 4
# warps. Both sit at 255 registers with a little spill (scripts/kernel_resources.py); the narrow tile
# needs fewer shuffles and layout barriers per token, and two-warp programs let more of them share an SM.
# At n=2 (H100) the kernel needs 149 registers, not 255, and the wide tile wins: 16 x 64 on 4 warps
# took 0.363 ms (83% of copy bandwidth on its bytes) against 0.674 ms for the n=4 default. With GP_SCRATCH
# (H100) the wide n=2 tile took 0.340 ms (89%) against 0.406 without it in the same run, and the
# n=2 training step went from 107.4 to 100.4 ms (915k to 979k tokens/s). At n=4 GP_SCRATCH was slower on
# every block tried (best 1.076 ms against 1.025), so n=4 keeps the plain kernel. n=8 is not measured; it
# keeps the n=4 block.
# dphi: 32-token blocks, 0.114 ms against 0.135 for 64.
def stream_bwd_config(device: torch.device, n: int) -> dict:
    if device.type != "cuda":
        return dict(BT=16, BC=32, num_warps=4)
    return dict(BT=16, BC=64, num_warps=4, GP_SCRATCH=True) if n <= 2 else dict(BT=32, BC=16, num_warps=2)


def dphi_config(device: torch.device) -> dict:
    return dict(BT=32, BK=128, num_warps=4) if device.type == "cuda" else dict(BT=16, BK=32, num_warps=4)


def launch_coef_bwd(launch, xs, du, dh_post, dh_res, raw, rinv, alpha, bias, iters: int, cfg: dict | None = None):
    """Returns (aux [T, NP]: G in columns [0, N) and the rms factor in column N, d(alpha) [3], d(bias) [N])."""
    T, n, C = xs.shape
    require_contiguous("launch_coef_bwd", xs=xs, du=du, dh_post=dh_post, dh_res=dh_res, raw=raw, rinv=rinv)
    alpha, bias = alpha.contiguous(), bias.contiguous()
    N, NP = num_coefficients(n), padded_columns(n)
    cfg = dict(coef_bwd_config(xs.device) if cfg is None else cfg)
    BT, BC = cfg.pop("BT"), channel_block(C, cfg.pop("BC"), n)
    token_block = cfg.pop("TOKENS", coef_bwd_config(xs.device)["TOKENS"])
    dh_pre = torch.empty((T, n), device=xs.device, dtype=torch.float32)
    launch(premix_grad_kernel)[(triton.cdiv(T, BT),)](xs, du, dh_pre, T, C, n=n, BT=BT, BC=BC, **cfg)
    programs = triton.cdiv(T, token_block)
    aux = torch.empty((T, NP), device=xs.device, dtype=torch.float32)
    part = torch.empty((programs, N + 3), device=xs.device, dtype=torch.float32)
    launch(coef_bwd_kernel)[(programs,)](
        dh_pre, dh_post, dh_res, raw, rinv, alpha, bias, aux, part, T, n * C,
        n=n, N=N, NP=NP, ITERS=iters, SEG=SINKHORN_SEGMENT if n <= 4 else iters, BT=token_block, num_warps=4)
    return aux, part[:, N:].sum(dim=0), part[:, :N].sum(dim=0)  # two sums: outputs must not alias


def launch_stream_bwd(launch, x, y, h_res, h_post, dx_new, du, aux, phi, cfg: dict | None = None):
    """Stream gradients. With y: x' = apply(x, ...) and dx_new is its incoming gradient; with du:
    the coefficient path of pre(x') (phi [n*C, N]). Returns (dx, dy, dh_res, dh_post), None where absent."""
    T, n, C = x.shape
    require_contiguous("launch_stream_bwd", x=x, y=y, h_res=h_res, h_post=h_post, dx_new=dx_new, du=du, aux=aux)
    N, NP = num_coefficients(n), padded_columns(n)
    apply, coef = y is not None, du is not None
    cfg = dict(stream_bwd_config(x.device, n) if cfg is None else cfg)
    BT, BC = cfg.pop("BT"), channel_block(C, cfg.pop("BC"), n)
    lowp = cfg.pop("LOWP", x.dtype == torch.bfloat16)
    gp_scratch = cfg.pop("GP_SCRATCH", False)
    f32 = dict(device=x.device, dtype=torch.float32)
    dx = torch.empty_like(x)
    dy = torch.empty_like(y) if apply else None
    dh_res = torch.empty((T, n, n), **f32) if apply else None
    dh_post = torch.empty((T, n), **f32) if apply else None
    phit = phi_operand(phi, x.dtype, lowp) if coef else None
    dummy = dx
    launch(stream_bwd_kernel)[(triton.cdiv(T, BT),)](
        x, y if apply else dummy, h_res if apply else dummy, h_post if apply else dummy,
        dx_new if apply else dummy, du if coef else dummy, aux if coef else dummy, phit if coef else dummy,
        dx, dy if apply else dummy, dh_res if apply else dummy, dh_post if apply else dummy, T, C,
        n=n, N=N, NP=NP, APPLY=apply, COEF=coef, LOWP=lowp, GP_SCRATCH=gp_scratch, BT=BT, BC=BC, **cfg)
    return dx, dy, dh_res, dh_post


def launch_dphi(launch, xs, aux, cfg: dict | None = None):
    """d(phi) [n*C, N] of the coefficient projection, from the streams it read (x' [T, n, C]) and G in aux."""
    T, n, C = xs.shape
    if not xs.is_contiguous():
        raise ValueError(f"launch_dphi: x' must be contiguous [T, n, C] (the kernel reads it as [T, n*C]), got "
                         f"strides {xs.stride()}; hint: pass x.contiguous()")
    N, NP, K = num_coefficients(n), padded_columns(n), n * C
    cfg = dict(dphi_config(xs.device) if cfg is None else cfg)
    BT, BK = cfg.pop("BT"), cfg.pop("BK")
    chunks = triton.cdiv(K, BK)
    # Not capped by T's token blocks: a split with none writes zeros, and under torch.compile(dynamic=True) a cap
    # guarded on T and recompiled as T changed.
    splits = cfg.pop("splits", None) or max(1, program_slots(xs.device) // chunks)
    part = torch.empty((splits, K, NP), device=xs.device, dtype=torch.float32)
    launch(dphi_kernel)[(chunks, splits)](
        xs, aux, part, T, K, N=N, NP=NP, LOWP=cfg.pop("LOWP", xs.dtype == torch.bfloat16), BT=BT, BK=BK, **cfg)
    return part[:, :, :N].sum(dim=0)
