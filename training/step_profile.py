"""Where a training step's device time goes: kernels grouped by what they do (bench_step.py --profile).

On a GPU the unit is a kernel (its device time); on the CPU, where nothing launches kernels, it is an
operator's self CPU time, so the same tables come out of a CPU test run. Categories are found from the
kernel name alone, first match wins; "GEMM" includes Muon's Newton-Schulz products, which are cuBLAS
calls like the model's own. Device time is the sum over kernels: kernels that overlap on several
streams (NCCL under torchrun) are each counted, so it can exceed the wall clock.

A kernel name does not say which matrices a GEMM multiplied, so a third table lists the matrix
products (aten::mm, addmm, bmm, ...) by operator and input shapes, with the device time the profiler
gives each operator: a cuBLAS GEMV in the top kernels is found by its shapes there. That time ranks
the products; it is not the kernels' own (on an H100 it read 1.5x the kernel time of a lone matmul).
"""
from __future__ import annotations

import re
from collections import defaultdict
from typing import Callable

import torch

CATEGORIES = (  # (label, pattern searched in the kernel name); on the CPU the custom ops mhcgolf::*
    ("mHC Triton kernels", r"\b(coef_premix|stream_bwd|coef_bwd|premix_grad|dphi|apply)_kernel\b|mhcgolf(::|_)mhc_"),
    ("MLP Triton GEMM", r"mlp_gemm|mhcgolf(::|_)mlp_"),
    # FlexAttention's kernels are Inductor templates (triton_tem_*), which would otherwise count as GEMMs
    ("attention", r"^triton_tem_.*flex_attention"),
    ("GEMM (cuBLAS/CUTLASS, inductor templates)", r"^triton_tem_|gemm|xmma|cutlass|nvjet|cublas|^aten::(mm|addmm|bmm|matmul)$"),
    ("inductor fused (triton_*)", r"^triton_"),
    ("attention", r"flash|fmha|attention|sdpa|cudnn"),
    ("NCCL", r"nccl"),
    ("copy / fill", r"(?i)memcpy|memset|copy|fill"),
)
OTHER = "other"
GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::mv", "aten::addmv", "aten::dot",
            "aten::_scaled_mm")  # the leaf operators that launch matrix-product kernels


def category(name: str) -> str:
    for label, pattern in CATEGORIES:
        if re.search(pattern, name):
            return label
    return OTHER


def is_annotation(event) -> bool:
    """A record_function range on the device timeline (torch.compile names each graph call so)."""
    return bool(getattr(event, "is_user_annotation", False)) or event.name.startswith("## ")


def device_times(prof, on_gpu: bool) -> list[tuple[str, float, int]]:
    """(name, microseconds, calls): every kernel the profiler saw (GPU), or each operator's summed self
    time (CPU; the custom ops mhcgolf::* stand for the kernels the interpreter runs inside them)."""
    if on_gpu:  # user annotations ("## Call CompiledFxGraph ... ##") span kernels; they are not kernels
        return [(e.name, e.time_range.elapsed_us(), 1) for e in prof.events()
                if e.device_type == torch.autograd.DeviceType.CUDA and not is_annotation(e)]
    return [(e.key, e.self_cpu_time_total, e.count) for e in prof.key_averages() if e.self_cpu_time_total > 0]


def gemm_shapes(prof, on_gpu: bool, steps: int, top: int = 12) -> list[tuple[str, str, float, float]]:
    """(operator, input shapes, calls/step, ms/step) of the matrix products, largest first: the device
    time the profiler gives each operator (GPU; see the module note), or its self CPU time (CPU)."""
    rows = []
    for e in prof.key_averages(group_by_input_shape=True):
        if e.key not in GEMM_OPS:
            continue
        us = e.device_time_total if on_gpu else e.self_cpu_time_total
        shapes = " × ".join(str(list(s)) for s in e.input_shapes if s)
        rows.append((e.key, shapes, e.count / steps, us / steps / 1e3))
    return sorted(rows, key=lambda r: -r[3])[:top]


def summarize(times: list[tuple[str, float, int]], steps: int, top: int = 30) -> tuple[list[tuple], list[tuple]]:
    """Per step: (category, ms, share) rows and the `top` kernels as (name, calls, ms, share, category),
    both largest first. Shares are of the summed device time, not of the wall-clock step. 30 kernels:
    on an H100 the top 15 ended at 1.1 ms per step and named under a third of the inductor time."""
    if steps < 1:
        raise ValueError(f"profile steps must be >= 1, got {steps}; hint: pass --profile K with K >= 1 (0 skips profiling)")
    total = sum(us for _, us, _ in times) or 1.0
    by_name: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for name, us, calls in times:
        by_name[name][0] += calls
        by_name[name][1] += us
    names = sorted(((n, calls / steps, us / steps / 1e3, us / total, category(n)) for n, (calls, us) in by_name.items()),
                   key=lambda r: -r[2])
    by_cat: dict[str, list] = defaultdict(lambda: [0.0, 0.0])
    for _, _, ms, share, cat in names:
        by_cat[cat][0] += ms
        by_cat[cat][1] += share
    cats = sorted(((c, ms, share) for c, (ms, share) in by_cat.items()), key=lambda r: -r[1])
    return cats, names[:top]


def profile_steps(step: Callable[[], object], steps: int, device: torch.device
                  ) -> tuple[list[tuple], list[tuple], list[tuple]]:
    """Run `step` `steps` times under torch.profiler (after the caller's warm-up): (categories, top
    kernels, matrix products by shape)."""
    from torch.profiler import ProfilerActivity, profile

    on_gpu = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities, record_shapes=True) as prof:
        for _ in range(steps):
            step()
        if on_gpu:
            torch.cuda.synchronize()
    return (*summarize(device_times(prof, on_gpu), steps), gemm_shapes(prof, on_gpu, steps))


def format_tables(variant: str, wall_ms: float, cats: list[tuple], kernels: list[tuple],
                  gemms: list[tuple] = ()) -> str:
    busy = sum(ms for _, ms, _ in cats)
    lines = [f"\n### {variant}: {busy:.1f} ms of device time per step in {wall_ms:.1f} ms of wall clock", "",
             "| category | ms/step | share |", "|---|---|---|"]
    lines += [f"| {c} | {ms:.2f} | {100 * s:.1f}% |" for c, ms, s in cats]
    lines += ["", "| kernel | calls/step | ms/step | share | category |", "|---|---|---|---|---|"]
    lines += [f"| `{n[:90]}` | {calls:g} | {ms:.2f} | {100 * s:.1f}% | {c} |" for n, calls, ms, s, c in kernels]
    if gemms:
        lines += ["", "| matrix product | input shapes | calls/step | operator ms/step |", "|---|---|---|---|"]
        lines += [f"| {op} | {shapes} | {calls:g} | {ms:.2f} |" for op, shapes, calls, ms in gemms]
    return "\n".join(lines)
