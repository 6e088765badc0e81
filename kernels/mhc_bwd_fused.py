"""The backward of one coefficient pass in one kernel: premix_grad, coef_bwd and stream_bwd fused.

kernels/mhc_bwd.py runs them as three launches, because every stream gradient needs dH_pre, a sum over
all n*C channels of a token, and the coefficient gradients in between. Here one program owns BT tokens
and does all three for them:
  pass A (channels forwards): dH_pre[j] = sum_c du * x'_j, without forming x' (see premix_sums);
  then the gate and Sinkhorn gradients of its tokens (mhc_bwd.coef_grads), G written to aux for dphi;
  pass B (channels backwards, so it first rereads the tiles pass A read last, while they are likely
    still in L2): mhc_bwd.stream_grads with G back from aux.
dH_pre never goes through memory, premix_grad's read of x' goes, and so do a launch and coef_bwd's
latency-bound run. dphi stays a kernel of its own (its [n*C, N] accumulator, see mhc_bwd.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._triton_util import channel_block, load_mixing, load_streams, num_coefficients, padded_columns, phi_operand
from kernels.mhc_bwd import (SINKHORN_SEGMENT, coef_grads, launch_coef_bwd, launch_dphi, launch_stream_bwd,
                             stream_bwd_config, stream_grads)


@triton.jit
def premix_sums(x_ptr, y_ptr, du_ptr, h_res, h_post, t64, tmask, C,
                n: tl.constexpr, APPLY: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """dH_pre[j] = sum_c du x'_j of tokens t64, as n [BT] vectors. With the apply x' = H_res x + H_post y
    is linear, so dH_pre[j] = sum_k H_res[j, k] (sum_c du x_k) + H_post[j] (sum_c du y): n + 1 sums over
    the channels and none of the n^2 products per element that recomputing x' takes. (premix_grad reads
    x' as stored, rounded to the stream dtype; this is the gradient of the exact apply.)"""
    row = t64 * (n * C)
    sums = ()
    for k in tl.static_range(n):
        sums = sums + (tl.zeros([BT], tl.float32),)
    sum_y = tl.zeros([BT], tl.float32)
    for c0 in range(0, C, BC):
        c = c0 + tl.arange(0, BC)
        m2 = tmask[:, None] & (c < C)[None, :]
        du = tl.load(du_ptr + t64[:, None] * C + c[None, :], mask=m2, other=0.0).to(tl.float32)
        xs = load_streams(x_ptr, row, c, m2, C, n)
        summed = ()
        for k in tl.static_range(n):
            summed = summed + (sums[k] + tl.sum(xs[k] * du, axis=1),)
        sums = summed
        if APPLY:
            y = tl.load(y_ptr + t64[:, None] * C + c[None, :], mask=m2, other=0.0).to(tl.float32)
            sum_y += tl.sum(y * du, axis=1)
    if APPLY:
        dh_pre = ()
        for j in tl.static_range(n):
            acc = h_post[j] * sum_y
            for k in tl.static_range(n):
                acc += h_res[j * n + k] * sums[k]
            dh_pre = dh_pre + (acc,)
    else:
        dh_pre = sums
    return dh_pre


@triton.jit
def fused_bwd_kernel(
    x_ptr, y_ptr, hres_ptr, hpost_ptr, dxo_ptr, du_ptr,     # streams, apply inputs, incoming stream gradients
    dhpost_ptr, dhres_ptr, raw_ptr, rinv_ptr, alpha_ptr, bias_ptr, phit_ptr,  # the coefficient pass
    aux_ptr, part_ptr, dx_ptr, dy_ptr, dhres_in_ptr, dhpost_in_ptr,         # outputs
    T, C,
    n: tl.constexpr, N: tl.constexpr, NP: tl.constexpr, ITERS: tl.constexpr, SEG: tl.constexpr,
    APPLY: tl.constexpr, LOWP: tl.constexpr, GP_SCRATCH: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
):
    """Without APPLY the coefficients were computed from x itself (mhc_pre); with it from x' = apply(x, y)
    (mhc_post_pre), and dx_out is x''s incoming gradient. Partial sums of d(bias), d(alpha) per program."""
    pid = tl.program_id(0)
    t = pid * BT + tl.arange(0, BT)
    tmask = t < T
    t64 = t.to(tl.int64)
    if APPLY:
        h_res, h_post = load_mixing(hres_ptr, hpost_ptr, t64, tmask, n)
    else:
        h_res, h_post = 0.0, 0.0
    dh_pre = premix_sums(x_ptr, y_ptr, du_ptr, h_res, h_post, t64, tmask, C, n, APPLY, BT, BC)
    coef_grads(dh_pre, dhpost_ptr, dhres_ptr, raw_ptr, rinv_ptr, alpha_ptr, bias_ptr, aux_ptr,
               part_ptr + pid * (N + 3), t64, tmask, n * C, n, N, NP, ITERS, SEG)
    tl.debug_barrier()  # aux rows written by other threads of this program are read below
    stream_grads(x_ptr, y_ptr, h_res, h_post, dxo_ptr, du_ptr, aux_ptr, phit_ptr, dx_ptr, dy_ptr, dhres_in_ptr,
                 dhpost_in_ptr, t64, tmask, C, n, N, NP, APPLY, True, LOWP, GP_SCRATCH, True, BT, BC)


# ---------------------------------------------------------------- launcher (make_fx traceable)

def fused_bwd_config(device: torch.device, n: int) -> dict:
    """Block sizes: stream_bwd's (pass B is its loop), see kernels/mhc_bwd.py."""
    return stream_bwd_config(device, n)


def fuses_backward(device: torch.device, n: int) -> bool:
    """Whether launch_backward takes the fused kernel by default."""
    return True


def launch_fused_bwd(launch, x, y, h_res, h_post, dx_new, du, dh_post, dh_res, raw, rinv, alpha, bias, phi,
                     iters: int, cfg: dict | None = None):
    """The gradients of one coefficient pass and, with y, of the apply before it. x [T, n, C]: the streams the
    pass read (without y), or the apply's input (with y: x' = apply(x, h_res, h_post, y), dx_new its incoming
    gradient). du, dh_post, dh_res: gradients of the pass's outputs; raw, rinv: what its forward saved.
    Returns (aux [T, NP] for launch_dphi, d(alpha) [3], d(bias) [N], dx, dy, dH_res, dH_post), the last
    three None without y."""
    T, n, C = x.shape
    N, NP = num_coefficients(n), padded_columns(n)
    apply = y is not None
    cfg = dict(fused_bwd_config(x.device, n) if cfg is None else cfg)
    BT, BC = cfg.pop("BT"), channel_block(C, cfg.pop("BC"), n)
    lowp = cfg.pop("LOWP", x.dtype == torch.bfloat16)
    gp_scratch = cfg.pop("GP_SCRATCH", False)
    f32 = dict(device=x.device, dtype=torch.float32)
    programs = triton.cdiv(T, BT)
    aux = torch.empty((T, NP), **f32)
    part = torch.empty((programs, N + 3), **f32)
    dx = torch.empty_like(x)
    dy = torch.empty_like(y) if apply else None
    dh_res_in = torch.empty((T, n, n), **f32) if apply else None
    dh_post_in = torch.empty((T, n), **f32) if apply else None
    dummy = dx
    launch(fused_bwd_kernel)[(programs,)](
        x, y if apply else dummy, h_res if apply else dummy, h_post if apply else dummy,
        dx_new if apply else dummy, du, dh_post, dh_res, raw, rinv, alpha, bias, phi_operand(phi, x.dtype, lowp),
        aux, part, dx, dy if apply else dummy, dh_res_in if apply else dummy, dh_post_in if apply else dummy,
        T, C, n=n, N=N, NP=NP, ITERS=iters, SEG=SINKHORN_SEGMENT if n <= 4 else iters, APPLY=apply, LOWP=lowp,
        GP_SCRATCH=gp_scratch, BT=BT, BC=BC, **cfg)
    return aux, part[:, N:].sum(dim=0), part[:, :N].sum(dim=0), dx, dy, dh_res_in, dh_post_in


def launch_backward(launch, x, y, h_res, h_post, dx_new, x_new, du, dh_post, dh_res, raw, rinv, alpha, bias, phi,
                    iters: int, fused: bool | None = None):
    """Every gradient of one coefficient pass and, with y, of the apply before it (x_new: the streams the pass
    read, x itself without y): (dx, dy, dH_res, dH_post, d(phi), d(alpha), d(bias)), dy and the dH None
    without y. fused: the one-kernel backward above, or premix_grad + coef_bwd + stream_bwd (mhc_bwd.py);
    None takes fuses_backward's choice for this device and n."""
    if fused is None:
        fused = fuses_backward(x.device, x.shape[1])
    if fused:
        aux, dalpha, dbias, dx, dy, dh_res_in, dh_post_in = launch_fused_bwd(
            launch, x, y, h_res, h_post, dx_new, du, dh_post, dh_res, raw, rinv, alpha, bias, phi, iters)
    else:
        aux, dalpha, dbias = launch_coef_bwd(launch, x_new, du, dh_post, dh_res, raw, rinv, alpha, bias, iters)
        dx, dy, dh_res_in, dh_post_in = launch_stream_bwd(launch, x, y, h_res, h_post, dx_new, du, aux, phi)
    return dx, dy, dh_res_in, dh_post_in, launch_dphi(launch, x_new, aux), dalpha, dbias
