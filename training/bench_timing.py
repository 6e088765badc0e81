"""The kernel benchmarks' one timer (scripts.bench_kernels, bench_mlp, bench_attention)."""
from __future__ import annotations


def bench_ms(fn, rep_ms: int) -> float:
    """Median milliseconds of fn on the GPU over about rep_ms of repetitions, after a quarter of that (at least 25 ms)
    of warm-up (triton.testing.do_bench, which clears the L2 cache before each call)."""
    from triton.testing import do_bench
    return do_bench(fn, warmup=max(25, rep_ms // 4), rep=rep_ms, return_mode="median")
