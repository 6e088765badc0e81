"""Fused LeakyReLU(0.5)^2 MLP: `fused_mlp(x, w_up, w_down)` == `mlp_reference(x, w_up, w_down)`.

Forward:  one Triton GEMM x·W_upᵀ whose epilogue stores post = leaky_relu(pre, 0.5)² and
          act_grad = d post / d pre (never pre), then y = post·W_downᵀ through torch.mm (cuBLAS).
Backward: one Triton GEMM dpre = (dy·W_down) ⊙ act_grad (multiply in the epilogue), then
          dW_down = dyᵀ·post, dW_up = dpreᵀ·x, dx = dpre·W_up through torch.mm.

The two Triton GEMMs are launched through `wrap_triton` inside the `torch.library.triton_op`s
mhcgolf::mlp_forward and mhcgolf::mlp_dpre, so torch.compile traces into them (the cuBLAS products and
everything around the MLP stay visible to Inductor) with no graph break; triton_op registers each op
body as its fake (meta) implementation. Autograd is attached with `register_autograd` on mlp_forward.

Schedules (`SCHEDULES`, argument `schedule` of `fused_mlp`): "tiled" pointer kernel on any GPU, "tma"
tensor-descriptor persistent kernel on Hopper; "auto" takes tma where it applies (measured faster on an
H100, see kernels/mlp_triton.py).

A second-order gradient (backward with create_graph=True) takes a PyTorch-ops backward from a recomputed
pre-activation; the first-order backward of a training step, eager or compiled, takes the kernels.

Where the kernels run: CUDA bf16/fp16/fp32 tensors; CPU fp32/fp16 tensors when `kernels/mlp_triton.py` was
imported with TRITON_INTERPRET=1 (the Triton interpreter), outside torch.compile tracing. Anything else
(plain CPU, bf16 on the interpreter, fp64, no Triton installed) computes the same function with PyTorch ops.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.library import triton_op, wrap_triton

from kernels.mlp_reference import leaky_relu_sq, leaky_relu_sq_grad

try:
    import triton

    from kernels import mlp_triton
except ImportError:  # triton is a Linux-only dependency (pyproject.toml); other hosts use PyTorch ops
    triton = None
    mlp_triton = None

_INTERPRETER_DTYPES = (torch.float32, torch.float16)  # the interpreter has no bfloat16
_GPU_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what the kernels compile for
_INTERPRETER_PROGRAMS = 3  # the tma schedule on CPU: few programs, so each loops over several tiles


def kernels_used_for(t: torch.Tensor) -> bool:
    """Whether the Triton kernels (compiled or interpreted) compute the MLP for tensors like `t`."""
    if mlp_triton is None:
        return False
    if t.device.type == "cuda":
        return t.dtype in _GPU_DTYPES  # float64, say, compiles to nothing: PyTorch ops compute it
    # The interpreter needs real data, so while torch.compile traces (fake tensors) CPU uses PyTorch ops.
    return (t.device.type == "cpu" and mlp_triton.kernels_interpreted() and t.dtype in _INTERPRETER_DTYPES
            and _has_data(t))


def _has_data(t: torch.Tensor) -> bool:
    """False for the stand-ins torch.compile traces with, which have no memory behind them."""
    if isinstance(t, (FakeTensor, FunctionalTensor)):
        return False
    try:
        t.data_ptr()
    except RuntimeError:  # other tensor subclasses without storage
        return False
    return True


SCHEDULES = ("tiled", "tma")
_HOPPER_DEFAULT = "tma"  # measured fastest on an H100 (scripts/bench_mlp.py)


def _byte_address(t: torch.Tensor) -> int:
    if _has_data(t):
        return t.data_ptr()
    # Tracing: no address yet. PyTorch's allocators align storages to at least 16 bytes, so the storage
    # offset decides.
    return t.storage_offset() * t.element_size()


def _descriptor_ok(t: torch.Tensor, unit: int) -> bool:
    """A 16-byte aligned base, stride 1 along dimension `unit`, and along the other a 16-byte aligned stride that
    steps past a whole line (not 0, as in a broadcast, nor overlapping)."""
    other = t.stride(1 - unit)
    return (t.stride(unit) == 1 and other >= max(t.shape[unit], 1) and not _byte_address(t) % 16
            and not (other * t.element_size()) % 16)


def tma_compatible(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, aux: torch.Tensor) -> bool:
    """Whether the tensor-descriptor kernel can take these operands. It reads a, and writes out and aux, as
    row-major [M, K] / [M, N]; b may be row-major [K, N] or a transposed view of a row-major [N, K] (B_K_MAJOR).
    A column-major a (x.transpose(...) reshaped without a copy, a transposed dy) was accepted and read as
    row-major: wrong outputs and gradients with no error."""
    return (all(_descriptor_ok(t, 1) for t in (a, out, aux))
            and (_descriptor_ok(b, 1) or _descriptor_ok(b, 0)))


def _check_schedule(schedule: str) -> None:
    if schedule not in ("auto", *SCHEDULES):
        raise ValueError(f"fused_mlp: schedule must be 'auto' or one of {SCHEDULES}, got {schedule!r}")


def resolve_schedule(schedule: str, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, aux: torch.Tensor) -> str:
    """The schedule a launch uses. "auto": the tensor-descriptor kernel on Hopper and newer, tiled elsewhere.
    "tma" (asked for or chosen) falls back to "tiled" where descriptors cannot be used: layouts that are not
    `tma_compatible` (a broadcast dy, say), a CUDA GPU older than Hopper, or fp32 on a GPU (every tensor-descriptor
    tile configuration needs more shared memory in fp32 than an H100 has)."""
    _check_schedule(schedule)
    cuda = a.device.type == "cuda"
    hopper = cuda and torch.cuda.get_device_capability(a.device) >= (9, 0)
    if schedule == "auto":
        schedule = _HOPPER_DEFAULT if hopper else "tiled"
    if schedule == "tma" and (not tma_compatible(a, b, out, aux) or (cuda and (not hopper or a.dtype == torch.float32))):
        return "tiled"
    return schedule


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _tma_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    return torch.empty(size, device="cuda", dtype=torch.int8)


def launch_gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, aux: torch.Tensor, epilogue: int,
                schedule: str, programs: int | None = None) -> None:
    """out (and aux) [M, N] from a [M, K] · b [K, N] with the given `mlp_triton.EPILOGUE_*`.

    schedule: "tiled" (one program per tile) or "tma" (`programs` looping programs, default one per
    SM; 3 in the interpreter). out and aux must be contiguous; for "tiled" a and b may have any strides
    (b is usually a transposed view); "tma" needs `tma_compatible` layouts.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"launch_gemm: schedule must be one of {SCHEDULES}, got {schedule!r}")
    M, K = a.shape
    N = b.shape[1]
    if out.shape != (M, N) or aux.shape != (M, N) or out.stride() != aux.stride() or out.stride(1) != 1:
        raise ValueError(f"launch_gemm: out and aux must be row-major [M, N] = [{M}, {N}] with one row stride (the "
                         f"epilogue indexes both with out's); got {tuple(out.shape)} {out.stride()} and "
                         f"{tuple(aux.shape)} {aux.stride()}; hint: pass .contiguous() tensors")
    if M == 0 or N == 0:
        return
    ieee_fp32 = a.dtype == torch.float32
    # traced by torch.compile the row count may be a symbol; the key is then unused, as inductor's own autotuner
    # launches the kernels and times the configs once, at the compiled kernel's first launch
    bucket = mlp_triton.row_bucket(M) if isinstance(M, int) else M
    if schedule == "tiled":
        def grid(meta):
            return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

        wrap_triton(mlp_triton.mlp_gemm_kernel)[grid](
            a, b, out, aux, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), bucket,
            EPILOGUE=epilogue, IEEE_FP32=ieee_fp32)
        return
    if not tma_compatible(a, b, out, aux):
        raise ValueError("launch_gemm: the tma schedule needs 16-byte aligned, unit-last-stride tensors; "
                         "hint: resolve_schedule() falls back to the tiled kernel")
    if programs is None and a.device.type == "cuda":
        programs = _sm_count(a.device.index if a.device.index is not None else torch.cuda.current_device())
    elif programs is None:
        programs = _INTERPRETER_PROGRAMS
    if a.device.type == "cuda":
        # Device-side descriptors live in a small global scratch buffer that Triton requests through an
        # allocator held in a ContextVar, i.e. per thread: set it at every launch, because autograd runs
        # the backward on its own device thread.
        triton.set_allocator(_tma_scratch)
    b_k_major = b.stride(0) == 1 and b.stride(1) != 1  # b is a transposed view of a row-major [N, K]
    wrap_triton(mlp_triton.mlp_gemm_tma_kernel)[(programs,)](
        a, b, out, aux, M, N, K, a.stride(0), b.stride(1) if b_k_major else b.stride(0), out.stride(0),
        programs, bucket, EPILOGUE=epilogue, B_K_MAJOR=b_k_major, IEEE_FP32=ieee_fp32)


@triton_op("mhcgolf::mlp_forward", mutates_args=())
def mlp_forward(x2d: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, schedule: str
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, post, act_grad) for x2d [T, D]; post and act_grad are outputs only so autograd can save them."""
    if kernels_used_for(x2d):
        hidden = w_up.shape[0]
        post = x2d.new_empty((x2d.shape[0], hidden))
        act_grad = x2d.new_empty((x2d.shape[0], hidden))
        b = w_up.t()
        launch_gemm(x2d, b, post, act_grad, mlp_triton.EPILOGUE_ACTIVATION,
                    resolve_schedule(schedule, x2d, b, post, act_grad))
    else:
        pre = F.linear(x2d, w_up)
        post, act_grad = leaky_relu_sq(pre), leaky_relu_sq_grad(pre)
    return torch.mm(post, w_down.t()), post, act_grad


@triton_op("mhcgolf::mlp_dpre", mutates_args=())
def mlp_dpre(dy: torch.Tensor, w_down: torch.Tensor, act_grad: torch.Tensor, schedule: str) -> torch.Tensor:
    """dpre = (dy · W_down) ⊙ act_grad for dy [T, D], W_down [D, H], act_grad [T, H]."""
    if not kernels_used_for(dy):
        return torch.mm(dy, w_down) * act_grad
    act_grad = act_grad.contiguous()  # the epilogue indexes act_grad and dpre with one row stride
    dpre = torch.empty_like(act_grad)
    launch_gemm(dy, w_down, dpre, act_grad, mlp_triton.EPILOGUE_GRAD,
                resolve_schedule(schedule, dy, w_down, dpre, act_grad))
    return dpre


def _setup_context(ctx, inputs, output) -> None:
    x2d, w_up, w_down, ctx.schedule = inputs
    _, post, act_grad = output
    ctx.save_for_backward(x2d, w_up, w_down, post, act_grad)
    ctx.mark_non_differentiable(post, act_grad)
    # post/act_grad never receive gradients; without this eager autograd would fill two [T, H] zero tensors.
    ctx.set_materialize_grads(False)


def _backward(ctx, dy, _grad_post, _grad_act_grad):
    if dy is None:
        return None, None, None, None
    x2d, w_up, w_down, post, act_grad = ctx.saved_tensors
    need_x, need_w_up, need_w_down, _ = ctx.needs_input_grad
    if torch.is_grad_enabled():  # create_graph=True (a training step's backward, compiled or not, runs without)
        return (*_differentiable_backward(dy, x2d, w_up, w_down, need_x, need_w_up, need_w_down), None)
    dx = dw_up = dw_down = None
    if need_w_down:
        dw_down = dy.t().mm(post)
    if need_x or need_w_up:
        dpre = mlp_dpre(dy, w_down, act_grad, ctx.schedule)
        if need_x:
            dx = dpre.mm(w_up)
        if need_w_up:
            dw_up = dpre.t().mm(x2d)
    return dx, dw_up, dw_down, None


def _differentiable_backward(dy, x2d, w_up, w_down, need_x: bool, need_w_up: bool, need_w_down: bool):
    """The backward in PyTorch ops from a recomputed pre-activation, for a second-order gradient: the saved post and
    act_grad are cut from the graph, so dW_down = dyᵀ·post lost its path to x and W_up (a review found the second
    order gradient of x off by a third, silently), and mlp_dpre has no autograd formula of its own."""
    pre = x2d.mm(w_up.t())
    dpre = dy.mm(w_down) * leaky_relu_sq_grad(pre)
    return (dpre.mm(w_up) if need_x else None, dpre.t().mm(x2d) if need_w_up else None,
            dy.t().mm(leaky_relu_sq(pre)) if need_w_down else None)


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
                         f"hint: cast them to one dtype (under autocast fused_mlp casts them to its dtype)")


def fused_mlp(x: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, schedule: str = "auto") -> torch.Tensor:
    """leaky_relu(x·W_upᵀ, 0.5)²·W_downᵀ for x [..., D], w_up [H, D], w_down [D_out, H]; differentiable.

    schedule: "auto" (the measured best for the GPU) or one of SCHEDULES, for benchmarks and tests;
    see `resolve_schedule`. Ignored where PyTorch ops compute the MLP (`kernels_used_for`).

    Under autocast the inputs are cast to its dtype, as nn.Linear's would be, and the op runs with autocast off:
    autocast reached the op's own torch.mm, which returned bf16 from fp32 inputs, and the backward then mixed
    dtypes and failed."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        x, w_up, w_down = x.to(dtype), w_up.to(dtype), w_down.to(dtype)
    _check_inputs(x, w_up, w_down)
    _check_schedule(schedule)
    with torch.autocast(device, enabled=False):
        y, _, _ = mlp_forward(x.reshape(-1, x.shape[-1]), w_up, w_down, schedule)
    return y.reshape(*x.shape[:-1], w_down.shape[0])
