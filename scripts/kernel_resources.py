"""Registers, spills and shared memory of the mHC Triton kernels on a Hopper GPU, read without one.

    python -m scripts.kernel_resources [--n 4] [--C 512] [--tokens 98304] [--sweep] [--arch 90]

Each launcher of kernels/mhc_fwd.py and kernels/mhc_bwd.py runs on `meta` tensors with a launch shim
that records the kernel, its arguments and its block configuration instead of running it. Every
recorded launch is then compiled for the target (sm_90 by default) the way Triton's launcher would
specialize it (bf16 streams, 16-byte aligned pointers, integers divisible by 16 marked so) and
assembled with the ptxas that Triton ships, whose report gives registers per thread and spill bytes;
Triton gives the shared memory. No GPU and no CUDA driver are needed, so register pressure (a
kernel at 255 registers that spills runs one program per SM) can be checked on a laptop before any
device time is spent. `--sweep` reports the block configurations that scripts/bench_kernels.py
times. The Triton version here may allocate differently from the GPU machine's: the numbers are a
lead, the GPU's timings decide.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from pathlib import Path


import torch

from model.config import KERNEL_STREAMS
from kernels.mhc_blocks import SWEEP, default_configs  # the blocks bench_kernels times, and the defaults

DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
          torch.int64: "i64"}
LAUNCH_OPTIONS = ("num_warps", "num_stages", "maxnreg")


class Recorder:
    """Stands in for `wrap_triton` in the launchers: `launch(kernel)[grid](*args, **kwargs)` is recorded."""

    def __init__(self):
        self.launches: list[tuple] = []

    def __call__(self, kernel):
        recorder = self

        class Gridded:
            def __getitem__(self, grid):
                return lambda *args, **kwargs: recorder.launches.append((kernel, args, kwargs))
        return Gridded()


def kernel_name(kernel) -> str:
    return getattr(kernel, "__name__", None) or kernel.fn.__name__


def specialization(kernel, args: tuple, kwargs: dict):
    """(signature, constexprs, attrs, options) as Triton's launcher would build them for these arguments."""
    names = [p.name for p in kernel.params]
    values = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k not in LAUNCH_OPTIONS}
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(names):
        value = values[name]
        if kernel.params[i].is_constexpr:
            signature[name], constexprs[(i,)] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            if value.dtype not in DTYPES:
                raise ValueError(f"{kernel_name(kernel)}: argument {name} has dtype {value.dtype}, not one of "
                                 f"{list(DTYPES)}")
            signature[name], attrs[(i,)] = "*" + DTYPES[value.dtype], [["tt.divisibility", 16]]
        elif isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{kernel_name(kernel)}: argument {name}={value!r} is neither a tensor nor an int "
                             "(hint: constexpr arguments must be annotated tl.constexpr in the kernel)")
        else:
            signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    options = {k: kwargs[k] for k in LAUNCH_OPTIONS if k in kwargs}
    return signature, constexprs, attrs, options


def parse_ptxas(report: str) -> dict:
    """Registers and spill bytes from `ptxas -v` output."""
    regs = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    if regs is None or spills is None:
        raise ValueError(f"ptxas -v printed no register/spill lines (hint: a ptxas version change?):\n{report[-800:]}")
    return {"registers": int(regs.group(1)), "spill_stores": int(spills.group(1)), "spill_loads": int(spills.group(2))}


def resources(kernel, args: tuple, kwargs: dict, arch: int) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    signature, constexprs, attrs, options = specialization(kernel, args, kwargs)
    compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", arch, 32), options=options)
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "kernel.ptx"
        ptx.write_text(compiled.asm["ptx"])
        gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
        done = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name={gpu}", str(ptx), "-o", str(ptx) + ".cubin"],
                              capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"ptxas failed on {kernel_name(kernel)}: {done.stderr[-800:]}")
    return parse_ptxas(done.stderr) | {"shared": compiled.metadata.shared}


def unit_launches(T: int, n: int, C: int, configs: dict) -> list[tuple]:
    """The launches of one mhc_post_pre unit, forward and backward, on meta bf16 tensors."""
    from kernels import mhc_reference as R
    from kernels.mhc_bwd import launch_coef_bwd, launch_dphi, launch_stream_bwd
    from kernels.mhc_fwd import launch_coef_premix

    meta = dict(device="meta")
    N = R.mhc_num_coefficients(n)
    x, y = torch.empty(T, n, C, dtype=torch.bfloat16, **meta), torch.empty(T, C, dtype=torch.bfloat16, **meta)
    h_res, h_post = torch.empty(T, n, n, **meta), torch.empty(T, n, **meta)
    phi, alpha, bias = torch.empty(N, n * C, **meta).t(), torch.empty(3, **meta), torch.empty(N, **meta)
    rec = Recorder()
    x_new, u, hp, hr, raw, rinv = launch_coef_premix(rec, x, y, h_res, h_post, phi, alpha, bias, 20,
                                                     configs["coef_premix"])
    launch_coef_premix(rec, x, None, None, None, phi, alpha, bias, 20, configs["coef_premix_pre"])
    aux, _, _ = launch_coef_bwd(rec, x_new, u, hp, hr, raw, rinv, alpha, bias, 20, configs["coef_bwd"])
    launch_stream_bwd(rec, x, y, h_res, h_post, x, u, aux, phi, configs["stream_bwd"])      # apply + coefficients
    launch_stream_bwd(rec, x, None, None, None, None, u, aux, phi, configs["stream_bwd"])   # coefficients (pre)
    launch_stream_bwd(rec, x, y, h_res, h_post, x, None, None, None, configs["stream_bwd"])  # apply (post)
    launch_dphi(rec, x_new, aux, configs["dphi"])
    return rec.launches


SHAPE_ARGS = ("n", "N", "NP", "ITERS", "SEG", "EPS")  # fixed by the problem, not by the block configuration


def describe(kwargs: dict) -> str:
    """The launch's configuration: every keyword argument but the problem's shape constants (so a new
    kernel switch shows up, and two launches differing only in it stay two rows)."""
    return ",".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in kwargs.items() if k not in SHAPE_ARGS)


def launch_plans(n: int, sweep: bool) -> list[dict]:
    """Block configurations per kernel for each unit to compile: the defaults, then (with sweep) the
    defaults with one kernel's configuration replaced by a SWEEP row, as bench_kernels.py launches it.
    The row replaces the default whole (a default's switch such as n=2's GP_SCRATCH must not leak into
    rows that leave it off), except coef_bwd's TOKENS: its launcher would read that default
    from the device, and here the device is `meta`."""
    default = default_configs(n)
    plans = [default]
    if sweep:  # every SWEEP row (the n=4 defaults among them: defaults depend on n; repeats are dropped later)
        for name, configs in SWEEP.items():
            if name in default:
                keep = {k: v for k, v in default[name].items() if k == "TOKENS"}
                plans += [default | {name: keep | cfg} for cfg in configs]
    return plans


def rows(T: int, n: int, C: int, arch: int, sweep: bool) -> list[dict]:
    """One row per distinct kernel launch: the defaults, then (with sweep) every SWEEP configuration."""
    seen, out = set(), []
    for plan in launch_plans(n, sweep):
        for kernel, args, kwargs in unit_launches(T, n, C, plan):
            key = (kernel_name(kernel), describe(kwargs))
            if key in seen:
                continue
            seen.add(key)
            out.append({"kernel": key[0], "config": key[1]} | resources(kernel, args, kwargs, arch))
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=4, choices=KERNEL_STREAMS, help="residual streams")
    p.add_argument("--C", type=int, default=512, help="stream width (a multiple of 16)")
    p.add_argument("--tokens", type=int, default=98_304, help="tokens (only their divisibility by 16 matters)")
    p.add_argument("--arch", type=int, default=90, choices=(80, 86, 89, 90),
                   help="compute capability x10 to compile for (90: H100/H200; the choices are limited to these "
                        "four because other values abort inside LLVM)")
    p.add_argument("--sweep", action="store_true", help="also the block configurations bench_kernels.py --sweep times")
    args = p.parse_args(argv)
    if args.C <= 0 or args.C % 16 or args.tokens <= 0:
        p.error(f"--C must be a positive multiple of 16 and --tokens positive; got C={args.C} tokens={args.tokens}")
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise SystemExit("kernel_resources.py: TRITON_INTERPRET=1 builds interpreted kernels, which do not compile; "
                         "hint: run it with the variable unset (env -u TRITON_INTERPRET ...)")
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # what the GPU machine's Triton does by default
    try:
        import triton.backends.nvidia.compiler  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"kernel_resources.py: needs Triton with its NVIDIA backend ({e}); hint: pip install triton")
    table = rows(args.tokens, args.n, args.C, args.arch, args.sweep)
    print(f"mHC kernels for sm_{args.arch}, n={args.n} C={args.C}, bf16 streams (ptxas -v; shared memory from Triton)")
    print(f"{'kernel':<20} {'config':<58} {'regs':>5} {'spill st/ld B':>14} {'smem B':>7}")
    for r in table:
        spills = f"{r['spill_stores']}/{r['spill_loads']}"
        print(f"{r['kernel']:<20} {r['config']:<58} {r['registers']:>5} {spills:>14} {r['shared']:>7}")
    return table


if __name__ == "__main__":
    main()
