"""Benchmark the fused LeakyReLU(0.5)^2 MLP against torch.compile of the reference and eager PyTorch.

    python -m scripts.bench_mlp [--tokens 98304 --d-model 512 --hidden 1792 --rep-ms 200]

Times forward (training forward, inputs require grad), backward (torch.autograd.grad, timed alone after
an untimed forward) and forward+backward in bf16 with CUDA events (medians), and reports TFLOP/s against
the bf16 matrix-product peak measured in the same run (a large torch.mm on random data). Also times the
two Triton GEMMs alone in every schedule beside cuBLAS for the same product (compiled and autotuned into an empty
Triton cache, so the autotuner's table and the first launch are this run's), and lists the GPU kernels of one
forward+backward of the compiled versions (torch.profiler).
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from unittest import mock


import torch

from kernels import mlp
from kernels.mlp_reference import mlp_reference
from training.bench_timing import bench_ms

PEAK_SIZE = 8192


def parse_args(argv: list[str] | None, prog: str | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=98_304, help="rows of x (tokens in one micro-batch)")
    p.add_argument("--d-model", type=int, default=512, help="model width D")
    p.add_argument("--hidden", type=int, default=1792, help="MLP hidden width H")
    p.add_argument("--rep-ms", type=int, default=200, help="milliseconds of timed repeats per measurement")
    args = p.parse_args(argv)
    for name in ("tokens", "d_model", "hidden", "rep_ms"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    return args


def matmul_peak_tflops(rep_ms: int) -> float:
    a = torch.randn(PEAK_SIZE, PEAK_SIZE, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(PEAK_SIZE, PEAK_SIZE, device="cuda", dtype=torch.bfloat16)
    return 2 * PEAK_SIZE**3 / bench_ms(lambda: torch.mm(a, b), rep_ms) / 1e9


def backward_ms(fn, leaves, dy, reps: int, warmup: int = 3) -> float:
    """Median CUDA-event time of the backward alone; each repeat runs its own (untimed) forward,
    because compiled backwards free their saved buffers (no retain_graph)."""
    pairs = []
    for i in range(warmup + reps):
        y = fn(*leaves)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.autograd.grad(y, leaves, dy)
        end.record()
        if i >= warmup:
            pairs.append((start, end))
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in pairs)[len(pairs) // 2]


def pass_timings(fn, x, w_up, w_down, rep_ms: int) -> dict[str, float]:
    """Milliseconds of forward, backward and forward+backward of y = fn(x, w_up, w_down)."""
    leaves = [t.detach().clone().requires_grad_() for t in (x, w_up, w_down)]
    dy = torch.randn(*x.shape[:-1], w_down.shape[0], device=x.device, dtype=x.dtype)

    def forward():
        return fn(*leaves)

    def forward_backward():
        torch.autograd.grad(fn(*leaves), leaves, dy)

    both = bench_ms(forward_backward, rep_ms)
    return {
        "forward": bench_ms(forward, rep_ms),
        "backward": backward_ms(fn, leaves, dy, reps=max(10, int(rep_ms / both))),
        "forward+backward": both,
    }


def first_call_seconds(fn, x, w_up, w_down) -> float:
    """Wall time of the first forward+backward: Triton autotuning/compilation or torch.compile."""
    leaves = [t.detach().clone().requires_grad_() for t in (x, w_up, w_down)]
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn(*leaves).sum().backward()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def env_var(name: str, value: str):
    """Sets an environment variable for a `with` block and restores what was there (the standard library's)."""
    return mock.patch.dict(os.environ, {name: value})


def config_label(config) -> str:
    kw = config.kwargs
    split = f" split{kw['EPILOGUE_SPLIT']}" if "EPILOGUE_SPLIT" in kw else ""
    return f"{kw['BLOCK_M']}x{kw['BLOCK_N']}x{kw['BLOCK_K']} s{config.num_stages} w{config.num_warps}{split}"


def gemm_rows(x, w_up, w_down, rep_ms: int) -> tuple[list[list], list[list[str]]]:
    """Rows (name, ms, flop, chosen config, first-launch seconds) for each fused GEMM in every schedule
    beside cuBLAS computing the same product, and the autotuner's timing of every config. Run first in
    a process, so that each first launch includes compiling and autotuning its kernel. A schedule that
    fails to compile is reported in its row, not raised."""
    from kernels import mlp_triton
    kernels = {"tiled": mlp_triton.mlp_gemm_kernel, "tma": mlp_triton.mlp_gemm_tma_kernel}
    tokens, hidden = x.shape[0], w_up.shape[0]
    flop = 2 * tokens * x.shape[1] * hidden
    out, aux = (torch.empty(tokens, hidden, device="cuda", dtype=x.dtype) for _ in range(2))
    dy = torch.randn(tokens, w_down.shape[0], device="cuda", dtype=x.dtype)
    rows = [["cuBLAS x·W_upᵀ (no epilogue)", bench_ms(lambda: torch.mm(x, w_up.t()), rep_ms), flop, "-", 0.0]]
    tuning = []
    for schedule, kernel in kernels.items():
        for what, a, b, epilogue in (("up GEMM + activation", x, w_up.t(), mlp_triton.EPILOGUE_ACTIVATION),
                                     ("dpre GEMM ⊙ act_grad", dy, w_down, mlp_triton.EPILOGUE_GRAD)):
            def launch():
                mlp.launch_gemm(a, b, out, aux, epilogue, schedule)
            name = f"Triton {what}, {schedule}"
            torch.cuda.synchronize()
            start = time.perf_counter()
            try:
                launch()  # compile + autotune outside the timed region
                torch.cuda.synchronize()
            except Exception as err:  # noqa: BLE001 - report the failing schedule and keep benchmarking
                rows.append([name, float("nan"), flop, f"failed: {type(err).__name__}: {str(err)[:80]}", 0.0])
                continue
            first_s = time.perf_counter() - start
            rows.append([name, bench_ms(launch, rep_ms), flop, config_label(kernel.best_config), first_s])
            for config, ms in getattr(kernel, "configs_timings", {}).items():
                median = ms[0] if isinstance(ms, (list, tuple)) else ms
                tuning.append([name, config_label(config), f"{median:.3f}"])
    return rows, tuning


def kernel_breakdown(fn, x, w_up, w_down, iters: int = 5) -> list[list[str]]:
    """GPU time per forward+backward of each kernel (torch.profiler), largest first, and their sum."""
    from torch.profiler import ProfilerActivity, profile
    leaves = [t.detach().clone().requires_grad_() for t in (x, w_up, w_down)]
    dy = torch.randn(*x.shape[:-1], w_down.shape[0], device=x.device, dtype=x.dtype)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            torch.autograd.grad(fn(*leaves), leaves, dy)
        torch.cuda.synchronize()
    per_kernel = [(e.key, getattr(e, "device_time_total", 0.0) / iters / 1000, e.count / iters)
                  for e in prof.key_averages()]
    per_kernel = sorted((k for k in per_kernel if k[1] > 0), key=lambda k: -k[1])
    rows = [[name[:70], f"{count:g}", f"{ms:.3f}"] for name, ms, count in per_kernel]
    rows.append(["(sum of kernel time)", "", f"{sum(k[1] for k in per_kernel):.3f}"])
    return rows


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]
    print(f"\n{title}")
    print(" | ".join(h.ljust(w) for h, w in zip(header, widths)))
    print("-+-".join("-" * w for w in widths))
    for r in rows:
        print(" | ".join(c.ljust(w) for c, w in zip(r, widths)))


def make_impls() -> dict:
    """Implementations timed end to end. Each fused schedule is compiled on its own (the schedule is a
    constant argument of the custom op, so each traces its own graph); "auto" picks tma on Hopper."""
    impls = {"fused, auto schedule (eager)": mlp.fused_mlp}
    for schedule in mlp.SCHEDULES:
        def fused(x, w_up, w_down, schedule=schedule):
            return mlp.fused_mlp(x, w_up, w_down, schedule=schedule)
        impls[f"fused, {schedule} (torch.compile)"] = torch.compile(fused, fullgraph=True)
    impls["reference (torch.compile)"] = torch.compile(mlp_reference, fullgraph=True)
    impls["reference (eager)"] = mlp_reference
    return impls


def time_impls(impls: dict, x, w_up, w_down, rep_ms: int) -> dict[str, dict[str, float]]:
    """Pass timings of every implementation that runs; a failure is printed and skipped."""
    times = {}
    for name, fn in impls.items():
        try:
            first_s = first_call_seconds(fn, x, w_up, w_down)
            times[name] = pass_timings(fn, x, w_up, w_down, rep_ms)
        except Exception as err:  # noqa: BLE001 - report the failing implementation, time the others
            print(f"{name}: FAILED {type(err).__name__}: {str(err)[:300]}")
            continue
        print(f"{name}: first forward+backward {first_s:.1f} s; " +
              ", ".join(f"{k} {v:.3f} ms" for k, v in times[name].items()))
    return times


def main(argv: list[str] | None = None, prog: str | None = None) -> dict[str, dict[str, float]]:
    """prog: the program name its usage shows (bench_kernels.py mlp runs this one)."""
    args = parse_args(argv, prog)
    if not torch.cuda.is_available():
        raise SystemExit("bench_mlp: needs a CUDA GPU (torch.cuda.is_available() is False)")
    torch.manual_seed(0)
    t, d, h = args.tokens, args.d_model, args.hidden
    x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    w_up = (torch.randn(h, d, device="cuda") / d**0.5).to(torch.bfloat16)
    w_down = (torch.randn(d, h, device="cuda") / h**0.5).to(torch.bfloat16)
    peak = matmul_peak_tflops(args.rep_ms)
    print(f"device: {torch.cuda.get_device_name(0)}; torch {torch.__version__}; "
          f"triton {__import__('triton').__version__}")
    print(f"shape: {t} x {d} -> {h} -> {d}, bf16; matmul peak (torch.mm {PEAK_SIZE}^3 bf16): {peak:.0f} TFLOP/s")

    # The kernels autotune with cache_results: on a warm Triton cache the first launch would load an earlier run's
    # choice and print its timings as this run's. An empty cache makes them this run's (compiling everything anew).
    with tempfile.TemporaryDirectory(prefix="bench_mlp_triton_") as cache, env_var("TRITON_CACHE_DIR", cache):
        gemms, tuning = gemm_rows(x, w_up, w_down, args.rep_ms)
    print_table("Autotuner timings (median ms per config)", ["GEMM", "config", "ms"], tuning)
    print_table("Single GEMMs (same product)", ["GEMM", "ms", "TFLOP/s", "% peak", "config", "first launch s"],
                [[n, f"{ms:.3f}", f"{f / ms / 1e9:.0f}", f"{100 * f / ms / 1e9 / peak:.0f}%", c, f"{s:.1f}"]
                 for n, ms, f, c, s in gemms])

    impls = make_impls()
    times = time_impls(impls, x, w_up, w_down, args.rep_ms)
    for name in ("fused, tma (torch.compile)", "reference (torch.compile)"):
        if name in times:
            print_table(f"Kernels per forward+backward: {name} (torch.profiler)", ["kernel", "calls", "ms"],
                        kernel_breakdown(impls[name], x, w_up, w_down))

    flop = {"forward": 4 * t * d * h, "backward": 8 * t * d * h, "forward+backward": 12 * t * d * h}
    baseline = times.get("reference (torch.compile)")
    rows = []
    for name, passes in times.items():
        for pass_name, ms in passes.items():
            tflops = flop[pass_name] / ms / 1e9
            vs = f"{baseline[pass_name] / ms:.2f}x" if baseline else "-"
            rows.append([name, pass_name, f"{ms:.3f}", f"{tflops:.0f}", f"{100 * tflops / peak:.0f}%", vs])
    print_table("MLP passes", ["implementation", "pass", "ms", "TFLOP/s", "% peak", "speed vs compile"], rows)
    if baseline:
        for name, passes in times.items():
            if name.startswith("fused"):
                print(f"forward+backward, {name} vs reference (torch.compile): "
                      f"{baseline['forward+backward'] / passes['forward+backward']:.2f}x (goal >= 1.10x)")
    return times


if __name__ == "__main__":
    main()
