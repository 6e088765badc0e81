"""Fused LeakyReLU(0.5)^2 MLP: `fused_mlp(x, w_up, w_down)` == `mlp_reference(x, w_up, w_down)`.

Forward:  one Triton GEMM x·W_upᵀ whose epilogue stores post = leaky_relu(pre, 0.5)² and
          act_grad = d post / d pre (never pre), then y = post·W_downᵀ through torch.mm (cuBLAS).
Backward: one Triton GEMM dpre = (dy·W_down) ⊙ act_grad (multiply in the epilogue), then
          dW_down = dyᵀ·post, dW_up = dpreᵀ·x, dx = dpre·W_up through torch.mm.

Both GEMMs are `torch.library.triton_op`s launched through `wrap_triton`, so torch.compile traces into
them (the matrix products and everything around the MLP stay visible to Inductor) with no graph break;
triton_op registers the op body itself as the fake (meta) implementation. Autograd is attached with
`register_autograd` on the forward op.

Where the kernels run: CUDA tensors always; CPU fp32/fp16 tensors when `kernels/mlp_triton.py` was
imported with TRITON_INTERPRET=1 (the Triton interpreter). Anything else (plain CPU, bf16 on the
interpreter, no Triton installed) computes the same function with PyTorch ops.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.library import triton_op, wrap_triton

from kernels.mlp_reference import leaky_relu_sq, leaky_relu_sq_grad

try:
    import triton

    from kernels import mlp_triton
except ImportError:  # triton is a Linux-only dependency (pyproject.toml); other hosts use PyTorch ops
    triton = None
    mlp_triton = None

_INTERPRETER_DTYPES = (torch.float32, torch.float16)  # the interpreter has no bfloat16


def kernels_used_for(t: torch.Tensor) -> bool:
    """Whether the Triton kernels (compiled or interpreted) compute the MLP for tensors like `t`."""
    if mlp_triton is None:
        return False
    if t.device.type == "cuda":
        return True
    return t.device.type == "cpu" and mlp_triton.kernels_interpreted() and t.dtype in _INTERPRETER_DTYPES


def persistent_schedule_for(device: torch.device) -> bool:
    """Persistent (one program per SM) schedule on Hopper, tiled elsewhere."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def launch_gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, aux: torch.Tensor, epilogue: int,
                persistent_programs: int | None) -> None:
    """out (and aux) [M, N] from a [M, K] · b [K, N] with the given `mlp_triton.EPILOGUE_*`.

    `persistent_programs`: None for one program per tile, else the number of looping programs.
    out and aux must be contiguous; a and b may have any strides (b is usually a transposed view).
    """
    M, K = a.shape
    N = b.shape[1]
    if M == 0 or N == 0:
        return
    args = (a, b, out, aux, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0))
    ieee_fp32 = a.dtype == torch.float32
    if persistent_programs is None:
        def grid(meta):
            return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

        wrap_triton(mlp_triton.mlp_gemm_kernel)[grid](*args, EPILOGUE=epilogue, IEEE_FP32=ieee_fp32)
    else:
        wrap_triton(mlp_triton.mlp_gemm_persistent_kernel)[(persistent_programs,)](
            *args, persistent_programs, EPILOGUE=epilogue, IEEE_FP32=ieee_fp32)


def _default_programs(device: torch.device) -> int | None:
    if not persistent_schedule_for(device):
        return None
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@triton_op("mhcgolf::mlp_forward", mutates_args=())
def mlp_forward(x2d: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, post, act_grad) for x2d [T, D]; post and act_grad are outputs only so autograd can save them."""
    if kernels_used_for(x2d):
        hidden = w_up.shape[0]
        post = x2d.new_empty((x2d.shape[0], hidden))
        act_grad = x2d.new_empty((x2d.shape[0], hidden))
        launch_gemm(x2d, w_up.t(), post, act_grad, mlp_triton.EPILOGUE_ACTIVATION, _default_programs(x2d.device))
    else:
        pre = F.linear(x2d, w_up)
        post, act_grad = leaky_relu_sq(pre), leaky_relu_sq_grad(pre)
    return torch.mm(post, w_down.t()), post, act_grad


@triton_op("mhcgolf::mlp_dpre", mutates_args=())
def mlp_dpre(dy: torch.Tensor, w_down: torch.Tensor, act_grad: torch.Tensor) -> torch.Tensor:
    """dpre = (dy · W_down) ⊙ act_grad for dy [T, D], W_down [D, H], act_grad [T, H]."""
    if not kernels_used_for(dy):
        return torch.mm(dy, w_down) * act_grad
    act_grad = act_grad.contiguous()  # the epilogue indexes act_grad and dpre with one row stride
    dpre = torch.empty_like(act_grad)
    launch_gemm(dy, w_down, dpre, act_grad, mlp_triton.EPILOGUE_GRAD, _default_programs(dy.device))
    return dpre


def _setup_context(ctx, inputs, output) -> None:
    x2d, w_up, w_down = inputs
    _, post, act_grad = output
    ctx.save_for_backward(x2d, w_up, w_down, post, act_grad)
    ctx.mark_non_differentiable(post, act_grad)
    # post/act_grad never receive gradients; without this eager autograd would fill two [T, H] zero tensors.
    ctx.set_materialize_grads(False)


def _backward(ctx, dy, _grad_post, _grad_act_grad):
    if dy is None:
        return None, None, None
    x2d, w_up, w_down, post, act_grad = ctx.saved_tensors
    need_x, need_w_up, need_w_down = ctx.needs_input_grad
    dx = dw_up = dw_down = None
    if need_w_down:
        dw_down = dy.t().mm(post)
    if need_x or need_w_up:
        dpre = mlp_dpre(dy, w_down, act_grad)
        if need_x:
            dx = dpre.mm(w_up)
        if need_w_up:
            dw_up = dpre.t().mm(x2d)
    return dx, dw_up, dw_down


mlp_forward.register_autograd(_backward, setup_context=_setup_context)


def _check_inputs(x: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> None:
    if x.dim() < 1 or w_up.dim() != 2 or w_down.dim() != 2:
        raise ValueError(f"fused_mlp: expected x [..., D], w_up [H, D], w_down [D_out, H]; got shapes "
                         f"{tuple(x.shape)}, {tuple(w_up.shape)}, {tuple(w_down.shape)}")
    if x.shape[-1] != w_up.shape[1] or w_down.shape[1] != w_up.shape[0]:
        raise ValueError(f"fused_mlp: shape mismatch x {tuple(x.shape)}, w_up {tuple(w_up.shape)}, "
                         f"w_down {tuple(w_down.shape)}; hint: weights use the nn.Linear layout "
                         f"[out_features, in_features]")
    if not (x.dtype == w_up.dtype == w_down.dtype) or not (x.device == w_up.device == w_down.device):
        raise ValueError(f"fused_mlp: x, w_up, w_down must share dtype and device; got "
                         f"{x.dtype}/{x.device}, {w_up.dtype}/{w_up.device}, {w_down.dtype}/{w_down.device}; "
                         f"hint: cast the weights (autocast does not reach this custom op)")


def fused_mlp(x: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """leaky_relu(x·W_upᵀ, 0.5)²·W_downᵀ for x [..., D], w_up [H, D], w_down [D_out, H]; differentiable."""
    _check_inputs(x, w_up, w_down)
    y, _, _ = mlp_forward(x.reshape(-1, x.shape[-1]), w_up, w_down)
    return y.reshape(*x.shape[:-1], w_down.shape[0])
