"""Benchmark the fused LeakyReLU(0.5)^2 MLP against torch.compile of the reference and eager PyTorch.

    python scripts/bench_mlp.py [--tokens 98304 --d-model 512 --hidden 1792 --rep-ms 200]

Times forward (training forward, inputs require grad), backward (torch.autograd.grad on a retained
graph) and forward+backward in bf16 with CUDA events (median of triton.testing.do_bench), and reports
TFLOP/s against the bf16 matrix-product peak measured in the same run (a large torch.mm on random data).
Also times the two Triton GEMMs alone, in both schedules, beside cuBLAS for the same product.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from kernels import mlp
from kernels.mlp_reference import mlp_reference

PEAK_SIZE = 8192


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=98_304, help="rows of x (tokens in one micro-batch)")
    p.add_argument("--d-model", type=int, default=512, help="model width D")
    p.add_argument("--hidden", type=int, default=1792, help="MLP hidden width H")
    p.add_argument("--rep-ms", type=int, default=200, help="milliseconds of timed repeats per measurement")
    args = p.parse_args(argv)
    for name in ("tokens", "d_model", "hidden", "rep_ms"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    return args


def bench_ms(fn, rep_ms: int) -> float:
    from triton.testing import do_bench
    return do_bench(fn, warmup=max(25, rep_ms // 4), rep=rep_ms, return_mode="median")


def matmul_peak_tflops(rep_ms: int) -> float:
    a = torch.randn(PEAK_SIZE, PEAK_SIZE, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(PEAK_SIZE, PEAK_SIZE, device="cuda", dtype=torch.bfloat16)
    return 2 * PEAK_SIZE**3 / bench_ms(lambda: torch.mm(a, b), rep_ms) / 1e9


def pass_timings(fn, x, w_up, w_down, rep_ms: int) -> dict[str, float]:
    """Milliseconds of forward, backward and forward+backward of y = fn(x, w_up, w_down)."""
    leaves = [t.detach().clone().requires_grad_() for t in (x, w_up, w_down)]
    dy = torch.randn(*x.shape[:-1], w_down.shape[0], device=x.device, dtype=x.dtype)

    def forward():
        return fn(*leaves)

    def forward_backward():
        torch.autograd.grad(fn(*leaves), leaves, dy)

    y = forward()
    return {
        "forward": bench_ms(forward, rep_ms),
        "backward": bench_ms(lambda: torch.autograd.grad(y, leaves, dy, retain_graph=True), rep_ms),
        "forward+backward": bench_ms(forward_backward, rep_ms),
    }


def first_call_seconds(fn, x, w_up, w_down) -> float:
    """Wall time of the first forward+backward: Triton autotuning/compilation or torch.compile."""
    leaves = [t.detach().clone().requires_grad_() for t in (x, w_up, w_down)]
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn(*leaves).sum().backward()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def gemm_rows(x, w_up, w_down, rep_ms: int) -> list[tuple[str, float, float]]:
    """(name, ms, flop) for each fused GEMM in both schedules and cuBLAS computing the same product."""
    from kernels import mlp_triton
    tokens, hidden = x.shape[0], w_up.shape[0]
    flop = 2 * tokens * x.shape[1] * hidden
    out, aux = (torch.empty(tokens, hidden, device="cuda", dtype=x.dtype) for _ in range(2))
    dy = torch.randn(tokens, w_down.shape[0], device="cuda", dtype=x.dtype)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = [("cuBLAS x·W_upᵀ (no epilogue)", bench_ms(lambda: torch.mm(x, w_up.t()), rep_ms), flop)]
    for label, programs in (("tiled", None), ("persistent", sms)):
        up = lambda: mlp.launch_gemm(x, w_up.t(), out, aux, mlp_triton.EPILOGUE_ACTIVATION, programs)  # noqa: E731
        down = lambda: mlp.launch_gemm(dy, w_down, out, aux, mlp_triton.EPILOGUE_GRAD, programs)  # noqa: E731
        up()  # autotune outside the timed region
        down()
        rows.append((f"Triton up GEMM + activation, {label}", bench_ms(up, rep_ms), flop))
        rows.append((f"Triton dpre GEMM ⊙ act_grad, {label}", bench_ms(down, rep_ms), flop))
    return rows


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print(f"\n{title}")
    print(" | ".join(h.ljust(w) for h, w in zip(header, widths)))
    print("-+-".join("-" * w for w in widths))
    for r in rows:
        print(" | ".join(c.ljust(w) for c, w in zip(r, widths)))


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_mlp: needs a CUDA GPU (torch.cuda.is_available() is False)")
    torch.manual_seed(0)
    t, d, h = args.tokens, args.d_model, args.hidden
    x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    w_up = (torch.randn(h, d, device="cuda") / d**0.5).to(torch.bfloat16)
    w_down = (torch.randn(d, h, device="cuda") / h**0.5).to(torch.bfloat16)
    peak = matmul_peak_tflops(args.rep_ms)
    impls = {
        "fused kernel (eager)": mlp.fused_mlp,
        "fused kernel (torch.compile)": torch.compile(mlp.fused_mlp, fullgraph=True),
        "reference (torch.compile)": torch.compile(mlp_reference, fullgraph=True),
        "reference (eager)": mlp_reference,
    }
    first_s = {name: first_call_seconds(fn, x, w_up, w_down) for name, fn in impls.items()}
    times = {name: pass_timings(fn, x, w_up, w_down, args.rep_ms) for name, fn in impls.items()}
    flop = {"forward": 4 * t * d * h, "backward": 8 * t * d * h, "forward+backward": 12 * t * d * h}
    baseline = times["reference (torch.compile)"]

    print(f"device: {torch.cuda.get_device_name(0)}; torch {torch.__version__}; "
          f"triton {__import__('triton').__version__}")
    print(f"shape: {t} x {d} -> {h} -> {d}, bf16; matmul peak (torch.mm {PEAK_SIZE}^3 bf16): {peak:.0f} TFLOP/s")
    rows = []
    for name, passes in times.items():
        for pass_name, ms in passes.items():
            tflops = flop[pass_name] / ms / 1e9
            rows.append([name, pass_name, f"{ms:.3f}", f"{tflops:.0f}", f"{100 * tflops / peak:.0f}%",
                         f"{baseline[pass_name] / ms:.2f}x"])
    print_table("MLP passes", ["implementation", "pass", "ms", "TFLOP/s", "% peak", "speed vs compile"], rows)
    gemms = gemm_rows(x, w_up, w_down, args.rep_ms)
    print_table("Single GEMMs (same product)", ["GEMM", "ms", "TFLOP/s", "% peak"],
                [[n, f"{ms:.3f}", f"{f / ms / 1e9:.0f}", f"{100 * f / ms / 1e9 / peak:.0f}%"] for n, ms, f in gemms])
    print_table("First call (autotune / compile), s", ["implementation", "seconds"],
                [[n, f"{s:.1f}"] for n, s in first_s.items()])
    speedup = baseline["forward+backward"] / times["fused kernel (torch.compile)"]["forward+backward"]
    print(f"\nforward+backward, fused (torch.compile) vs reference (torch.compile): {speedup:.2f}x (goal >= 1.10x)")
    return times


if __name__ == "__main__":
    main()
