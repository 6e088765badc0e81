"""Fused per-token mHC in Triton: drop-in for the three calls of kernels/mhc_reference.py.

    mhc_pre(x, phi, alpha, bias, sinkhorn_iters=20) -> (u, h_post, h_res)
    mhc_post(x, h_res, h_post, y) -> x_new
    mhc_post_pre(x, h_res, h_post, y, phi, alpha, bias, sinkhorn_iters=20) -> (x_new, u, h_post, h_res)

Same shapes, dtypes and values as the reference (streams [..., n, C] in fp32, fp16 or bf16 on a GPU, the
coefficients fp32), differentiable w.r.t. x, y, h_res, h_post, phi, alpha and bias. Each call is a
`torch.library.triton_op` with `register_autograd`, so torch.compile(fullgraph=True) traces the
Triton kernels (forward and backward) with no graph break and no host sync.
Stricter than the reference: coefficients must have their exact shapes (no broadcasting), y the streams'
dtype, sinkhorn_iters >= 1; and there is no double backward (a second-order gradient raises).

Where the kernels cannot run (CPU tensors without TRITON_INTERPRET=1, bf16 CPU tensors, which the
interpreter computes wrongly, fp64 ones, which it computes at fp32's precision, or no triton installed) the calls
fall back to the PyTorch reference, so a model with `mhc_kernels = true` runs anywhere.
"""
from __future__ import annotations

import torch

from kernels import mhc_reference as reference

try:
    from torch.library import triton_op, wrap_triton

    from kernels._triton_util import INTERPRET
    from kernels.mhc_bwd import launch_coef_bwd, launch_dphi, launch_stream_bwd
    from kernels.mhc_fwd import launch_apply, launch_coef_premix
    HAVE_TRITON = True
except ImportError:  # no triton on this platform: the reference serves every call
    HAVE_TRITON = False
    INTERPRET = False

Tensor = torch.Tensor


# The interpreter has no bfloat16: its bf16 tl.dot gave projections ~1e11 off and its stores truncate instead of
# rounding, so bf16 CPU tensors take the reference.
_INTERPRETER_DTYPES = (torch.float32, torch.float16)  # fp64 too would run, at fp32's precision: the reference


def kernels_run_on(x: Tensor) -> bool:
    """True where the Triton kernels execute: CUDA tensors, or fp16/fp32 CPU tensors under the
    interpreter in eager mode (torch.compile cannot trace interpreted kernels, so compiled CPU code
    takes the reference)."""
    if not HAVE_TRITON:
        return False
    return x.is_cuda or (INTERPRET and x.device.type == "cpu" and x.dtype in _INTERPRETER_DTYPES
                         and not torch.compiler.is_compiling())


def _check(x: Tensor, y: Tensor | None = None, h_res: Tensor | None = None, h_post: Tensor | None = None,
           phi: Tensor | None = None, alpha: Tensor | None = None, bias: Tensor | None = None,
           sinkhorn_iters: int | None = None) -> None:
    if sinkhorn_iters is not None and sinkhorn_iters < 1:  # the backward recomputes at least one round
        raise ValueError(f"mhc: sinkhorn_iters={sinkhorn_iters} must be >= 1 (hint: model.sinkhorn_iters, 20 by "
                         "default)")
    if x.dim() < 2:
        raise ValueError(f"mhc: streams x must be [..., n, C], got shape {tuple(x.shape)}")
    *lead, n, C = x.shape
    expect = {
        "y": (y, (*lead, C)), "h_res": (h_res, (*lead, n, n)), "h_post": (h_post, (*lead, n)),
        "phi": (phi, (n * C, reference.mhc_num_coefficients(n))), "alpha": (alpha, (3,)),
        "bias": (bias, (reference.mhc_num_coefficients(n),)),
    }
    for name, (t, shape) in expect.items():
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"mhc: {name} has shape {tuple(t.shape)}, expected {shape} for streams x of shape "
                             f"{tuple(x.shape)}; hint: phi is [n*C, n*n+2n], alpha [3], bias [n*n+2n]")
    if y is not None and y.dtype != x.dtype:
        raise ValueError(f"mhc: y has dtype {y.dtype} but the streams x are {x.dtype}; hint: cast the "
                         "sublayer output to the stream dtype (y.to(x.dtype))")


def _zeros_if_none(grad: Tensor | None, shape: tuple, like: Tensor) -> Tensor:
    """Autograd passes None for an output nobody used; the kernels read a dense gradient."""
    return like.new_zeros(shape) if grad is None else grad.contiguous()


if HAVE_TRITON:
    # ------------------------------------------------------------ mhc_pre
    @triton_op("mhcgolf::mhc_pre_fwd", mutates_args=())
    def _pre_fwd(x: Tensor, phi: Tensor, alpha: Tensor, bias: Tensor, iters: int
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        _, u, h_post, h_res, raw, rinv = launch_coef_premix(
            wrap_triton, x.contiguous(), None, None, None, phi, alpha, bias, iters)
        return u, h_post, h_res, raw, rinv

    @triton_op("mhcgolf::mhc_pre_bwd", mutates_args=())
    def _pre_bwd(x: Tensor, phi: Tensor, alpha: Tensor, bias: Tensor, raw: Tensor, rinv: Tensor,
                 du: Tensor, dh_post: Tensor, dh_res: Tensor, iters: int
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        x = x.contiguous()
        aux, dalpha, dbias = launch_coef_bwd(wrap_triton, x, du, dh_post, dh_res, raw, rinv, alpha, bias, iters)
        dx, _, _, _ = launch_stream_bwd(wrap_triton, x, None, None, None, None, du, aux, phi)
        dphi = launch_dphi(wrap_triton, x, aux)
        return dx, dphi.to(phi.dtype), dalpha.to(alpha.dtype), dbias.to(bias.dtype)

    def _pre_setup(ctx, inputs, output):
        x, phi, alpha, bias, ctx.iters = inputs
        _, _, _, raw, rinv = output
        ctx.mark_non_differentiable(raw, rinv)  # saved for the backward, not outputs to differentiate
        ctx.save_for_backward(x, phi, alpha, bias, raw, rinv)

    def _pre_backward(ctx, du, dh_post, dh_res, _draw, _drinv):
        x, phi, alpha, bias, raw, rinv = ctx.saved_tensors
        T, n, C = x.shape
        grads = torch.ops.mhcgolf.mhc_pre_bwd(
            x, phi, alpha, bias, raw, rinv, _zeros_if_none(du, (T, C), x),
            _zeros_if_none(dh_post, (T, n), raw), _zeros_if_none(dh_res, (T, n, n), raw), ctx.iters)
        return (*grads, None)

    _pre_fwd.register_autograd(_pre_backward, setup_context=_pre_setup)

    # ------------------------------------------------------------ mhc_post
    @triton_op("mhcgolf::mhc_post_fwd", mutates_args=())
    def _post_fwd(x: Tensor, h_res: Tensor, h_post: Tensor, y: Tensor) -> Tensor:
        return launch_apply(wrap_triton, x.contiguous(), y.contiguous(), h_res.contiguous(), h_post.contiguous())

    @triton_op("mhcgolf::mhc_post_bwd", mutates_args=())
    def _post_bwd(x: Tensor, h_res: Tensor, h_post: Tensor, y: Tensor, dx_new: Tensor
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        dx, dy, dh_res, dh_post = launch_stream_bwd(
            wrap_triton, x.contiguous(), y.contiguous(), h_res.contiguous(), h_post.contiguous(), dx_new,
            None, None, None)
        return dx, dh_res.to(h_res.dtype), dh_post.to(h_post.dtype), dy

    def _post_setup(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def _post_backward(ctx, dx_new):
        x, h_res, h_post, y = ctx.saved_tensors
        return torch.ops.mhcgolf.mhc_post_bwd(x, h_res, h_post, y, _zeros_if_none(dx_new, x.shape, x))

    _post_fwd.register_autograd(_post_backward, setup_context=_post_setup)

    # ------------------------------------------------------------ mhc_post_pre
    @triton_op("mhcgolf::mhc_post_pre_fwd", mutates_args=())
    def _post_pre_fwd(x: Tensor, h_res: Tensor, h_post: Tensor, y: Tensor, phi: Tensor, alpha: Tensor,
                      bias: Tensor, iters: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        return launch_coef_premix(wrap_triton, x.contiguous(), y.contiguous(), h_res.contiguous(),
                                  h_post.contiguous(), phi, alpha, bias, iters)

    @triton_op("mhcgolf::mhc_post_pre_bwd", mutates_args=())
    def _post_pre_bwd(x: Tensor, h_res: Tensor, h_post: Tensor, y: Tensor, phi: Tensor, alpha: Tensor,
                      bias: Tensor, x_new: Tensor, raw: Tensor, rinv: Tensor, dx_new: Tensor, du: Tensor,
                      dh_post: Tensor, dh_res: Tensor, iters: int
                      ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        x, y = x.contiguous(), y.contiguous()
        h_res, h_post = h_res.contiguous(), h_post.contiguous()
        aux, dalpha, dbias = launch_coef_bwd(wrap_triton, x_new, du, dh_post, dh_res, raw, rinv, alpha, bias, iters)
        dx, dy, dh_res_in, dh_post_in = launch_stream_bwd(wrap_triton, x, y, h_res, h_post, dx_new, du, aux, phi)
        dphi = launch_dphi(wrap_triton, x_new, aux)
        return (dx, dh_res_in.to(h_res.dtype), dh_post_in.to(h_post.dtype), dy, dphi.to(phi.dtype),
                dalpha.to(alpha.dtype), dbias.to(bias.dtype))

    def _post_pre_setup(ctx, inputs, output):
        *tensors, ctx.iters = inputs
        x_new, _, _, _, raw, rinv = output
        ctx.mark_non_differentiable(raw, rinv)  # saved for the backward, not outputs to differentiate
        ctx.save_for_backward(*tensors, x_new, raw, rinv)

    def _post_pre_backward(ctx, dx_new, du, dh_post, dh_res, _draw, _drinv):
        x, h_res, h_post, y, phi, alpha, bias, x_new, raw, rinv = ctx.saved_tensors
        grads = torch.ops.mhcgolf.mhc_post_pre_bwd(
            x, h_res, h_post, y, phi, alpha, bias, x_new, raw, rinv, _zeros_if_none(dx_new, x.shape, x),
            _zeros_if_none(du, y.shape, y), _zeros_if_none(dh_post, h_post.shape, raw),
            _zeros_if_none(dh_res, h_res.shape, raw), ctx.iters)
        return (*grads, None)

    _post_pre_fwd.register_autograd(_post_pre_backward, setup_context=_post_pre_setup)


# ---------------------------------------------------------------- public API (reference signatures)

def mhc_pre(x, phi, alpha, bias, sinkhorn_iters: int = 20):
    """Coefficients + pre-mix for one sublayer: returns (u [..., C], h_post [..., n], h_res [..., n, n])."""
    if not kernels_run_on(x):
        return reference.mhc_pre(x, phi, alpha, bias, sinkhorn_iters)
    _check(x, phi=phi, alpha=alpha, bias=bias, sinkhorn_iters=sinkhorn_iters)
    *lead, n, C = x.shape
    u, h_post, h_res, _, _ = torch.ops.mhcgolf.mhc_pre_fwd(x.reshape(-1, n, C), phi, alpha, bias, sinkhorn_iters)
    return u.view(*lead, C), h_post.view(*lead, n), h_res.view(*lead, n, n)


def mhc_post(x, h_res, h_post, y):
    """Apply for the last sublayer: returns the new streams [..., n, C]."""
    if not kernels_run_on(x):
        return reference.mhc_post(x, h_res, h_post, y)
    _check(x, y=y, h_res=h_res, h_post=h_post)
    *lead, n, C = x.shape
    x_new = torch.ops.mhcgolf.mhc_post_fwd(x.reshape(-1, n, C), h_res.reshape(-1, n, n),
                                           h_post.reshape(-1, n), y.reshape(-1, C))
    return x_new.view(*lead, n, C)


def mhc_post_pre(x, h_res, h_post, y, phi, alpha, bias, sinkhorn_iters: int = 20):
    """Apply of sublayer l fused with coefficients + pre-mix of sublayer l+1:
    returns (x' [..., n, C], u_next [..., C], h_post_next [..., n], h_res_next [..., n, n])."""
    if not kernels_run_on(x):
        return reference.mhc_post_pre(x, h_res, h_post, y, phi, alpha, bias, sinkhorn_iters)
    _check(x, y=y, h_res=h_res, h_post=h_post, phi=phi, alpha=alpha, bias=bias, sinkhorn_iters=sinkhorn_iters)
    *lead, n, C = x.shape
    x_new, u, h_post_next, h_res_next, _, _ = torch.ops.mhcgolf.mhc_post_pre_fwd(
        x.reshape(-1, n, C), h_res.reshape(-1, n, n), h_post.reshape(-1, n), y.reshape(-1, C),
        phi, alpha, bias, sinkhorn_iters)
    return x_new.view(*lead, n, C), u.view(*lead, C), h_post_next.view(*lead, n), h_res_next.view(*lead, n, n)
