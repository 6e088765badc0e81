"""Kernel benchmarks on a CUDA GPU, one subcommand per kernel family:

    python -m scripts.bench_kernels mhc [--tokens 32768 98304] [--n 4] [--C 512] [--rep-ms 200]
                                        [--sweep [stream_bwd,coef_premix,coef_premix_pre,...]]
                                        [--impls eager,compiled,triton[,triton-graph]] [--profile-once]
(the fused MLP has its own tool: python -m scripts.bench_mlp)

`mhc` times one steady-state mHC unit, mhc_post_pre (apply of sublayer l + coefficients and pre-mix
of sublayer l+1, with the sublayer output y given), in bf16: forward, backward and forward+backward
of the eager PyTorch reference, torch.compile of the reference, and the Triton kernels. Each time is
compared with the floor set by the bytes that must move (printed per token) at the device-to-device
copy bandwidth measured in the same run. `triton-graph` (not in the default set) replays each pass of
the Triton unit from a CUDA graph: device time only, without the gaps a slow host leaves between eager
launches (short units, as at n=2, can be host-bound). `--sweep` also times each Triton kernel alone
under several block configurations. `--profile-once` times nothing: it runs the Triton unit's forward and backward
twice (the first compiles) for a profiler to read; the five mHC kernels of the second run are
    ncu --clock-control none --kernel-name regex:"coef_premix|premix_grad|coef_bwd|stream_bwd|dphi"
        --launch-skip 5 --launch-count 5 python -m scripts.bench_kernels mhc --tokens 98304 --profile-once
"""
from __future__ import annotations

import argparse
import sys

import torch

from kernels import mhc_reference as R
from kernels.mhc_blocks import SWEEP, default_blocks
from kernels.mhc_traffic import design_bound, floor_bytes_per_token, stream_rows
from training.bench_timing import bench_ms

COPY_BYTES = 1 << 30


# ---------------------------------------------------------------- timing

def copy_bandwidth(rep_ms: int) -> float:
    """Bytes/s of a large device-to-device copy (bytes read + bytes written)."""
    src = torch.randn(COPY_BYTES // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return 2 * COPY_BYTES / (bench_ms(lambda: dst.copy_(src), rep_ms) * 1e-3)


def make_inputs(T: int, n: int, C: int) -> list[torch.Tensor]:
    """x, h_res, h_post, y, phi, alpha, bias of one sublayer pair, random (never zeros), bf16 streams."""
    dev = "cuda"
    x = torch.randn(T, n, C, device=dev).bfloat16()
    h_res = R.sinkhorn_knopp(torch.randn(T, n, n, device=dev), 20)
    h_post = 2 * torch.sigmoid(torch.randn(T, n, device=dev))
    y = torch.randn(T, C, device=dev).bfloat16()
    phi = torch.randn(n * C, R.mhc_num_coefficients(n), device=dev) / (n * C) ** 0.5
    alpha = torch.full((3,), 0.5, device=dev)
    bias = R.mhc_init_bias(n).to(dev)
    return [x, h_res, h_post, y, phi, alpha, bias]


def cuda_graph(run):
    """`run` captured once into a CUDA graph: (its replay, what the captured call returned, which each
    replay overwrites). Warmed up on a side stream first, as capture requires (compilation, allocator
    pools). Captures run on torch.cuda.graph's default capture stream."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = run()
    return graph.replay, result


def pass_timings(fn, inputs: list[torch.Tensor], rep_ms: int, graphed: bool = False) -> dict[str, float]:
    """Milliseconds of forward (training mode), backward (retained graph) and forward+backward; with
    `graphed`, each pass is replayed from a CUDA graph."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]

    def forward():
        return fn(*leaves)

    # Autograd runs each backward node on its forward's stream: for the backward to be captured, its
    # forward must have run on the capture stream, i.e. inside a capture itself.
    timed_forward, outs = cuda_graph(forward) if graphed else (forward, forward())
    cotangents = [torch.randn_like(o) for o in outs]

    def backward():
        return torch.autograd.grad(outs, leaves, cotangents, retain_graph=True)

    def forward_backward():
        return torch.autograd.grad(forward(), leaves, cotangents)

    timed = (lambda run: cuda_graph(run)[0]) if graphed else (lambda run: run)
    return {"fwd": bench_ms(timed_forward, rep_ms), "bwd": bench_ms(timed(backward), rep_ms),
            "fwd+bwd": bench_ms(timed(forward_backward), rep_ms)}


def sweep_rows(inputs: list[torch.Tensor], rep_ms: int, copy_bps: float, kernels: list[str]) -> list[tuple]:
    """Each of `kernels` alone under its SWEEP block configurations: (kernel, config, ms, % of copy bw)."""
    from kernels.mhc_bwd import launch_coef_bwd, launch_dphi, launch_stream_bwd
    from kernels.mhc_fwd import launch_coef_premix

    x, h_res, h_post, y, phi, alpha, bias = inputs
    T, n, C = x.shape
    direct = lambda kernel: kernel  # noqa: E731  (launch without the torch.compile wrapper)
    x_new, u, hp, hr, raw, rinv = launch_coef_premix(direct, x, y, h_res, h_post, phi, alpha, bias, 20)
    du, dhp, dhr = torch.randn_like(u), torch.randn_like(hp), torch.randn_like(hr)
    aux, _, _ = launch_coef_bwd(direct, x_new, du, dhp, dhr, raw, rinv, alpha, bias, 20)
    dxo = torch.randn_like(x)
    # Each row is rated on the stream bytes of what it launches (the coef_bwd row runs premix_grad first).
    rows_of = stream_rows(n)
    runs = {
        "coef_premix": (lambda cfg: launch_coef_premix(direct, x, y, h_res, h_post, phi, alpha, bias, 20, cfg),
                        rows_of["coef_premix"]),
        "coef_premix_pre": (lambda cfg: launch_coef_premix(direct, x, None, None, None, phi, alpha, bias, 20, cfg),
                            rows_of["coef_premix_pre"]),
        "coef_bwd": (lambda cfg: launch_coef_bwd(direct, x_new, du, dhp, dhr, raw, rinv, alpha, bias, 20, cfg),
                     rows_of["premix_grad"]),
        "stream_bwd": (lambda cfg: launch_stream_bwd(direct, x, y, h_res, h_post, dxo, du, aux, phi, cfg),
                       rows_of["stream_bwd"]),
        "dphi": (lambda cfg: launch_dphi(direct, x_new, aux, cfg), rows_of["dphi"]),
    }
    rows = []
    for name in kernels:
        run, rows_per_token = runs[name]
        for cfg in SWEEP[name]:
            ms = bench_ms(lambda: run(cfg), rep_ms)
            pct = 100 * rows_per_token * C * x.element_size() * T / copy_bps / (ms * 1e-3)
            rows.append((name, block_text(cfg), ms, pct))
            # printed as timed (each row may compile first): a sweep cut short still shows its rows
            print(f"{name:<16} {block_text(cfg):<40} {ms:8.3f} {pct:6.1f}%", flush=True)
    return rows


def block_text(cfg: dict) -> str:
    """A block configuration as the sweep table prints it: BT=32,BC=16,num_warps=2."""
    return ",".join(f"{k}={v}" for k, v in cfg.items())


def sweep_summary(rows: list[tuple], defaults: dict[str, dict]) -> list[str]:
    """A line per swept kernel: its fastest block and how that compares with the default at this n, the
    number to read before changing a default (a few % is within run-to-run noise)."""
    lines = []
    for name in dict.fromkeys(row[0] for row in rows):
        timed = {cfg: ms for kernel, cfg, ms, _ in rows if kernel == name}
        fastest = min(timed, key=timed.get)
        default = block_text(defaults[name])
        if default in timed:
            lines.append(f"{name}: fastest {fastest} {timed[fastest]:.3f} ms, {timed[default] / timed[fastest]:.2f}x "
                         f"the default {default} ({timed[default]:.3f} ms)")
        else:
            lines.append(f"{name}: fastest {fastest} {timed[fastest]:.3f} ms; the default {default} is not a SWEEP "
                         "row (hint: add it to SWEEP to compare)")
    return lines


# ---------------------------------------------------------------- mhc subcommand

IMPLS = ("eager", "compiled", "triton")  # the default set
ALL_IMPLS = IMPLS + ("triton-graph",)
IMPL_LABELS = {"eager": "eager reference", "compiled": "compiled reference", "triton": "triton kernels",
               "triton-graph": "triton, CUDA graph"}


def profile_once(T: int, n: int, C: int) -> None:
    """Forward + backward of the Triton unit, twice: the first run compiles, the second is the one to
    profile (5 kernel launches in the forward+backward of mhc_post_pre: coef_premix, premix_grad,
    coef_bwd, stream_bwd, dphi)."""
    from kernels import mhc as K
    leaves = [t.detach().clone().requires_grad_() for t in make_inputs(T, n, C)]
    for _ in range(2):
        outs = K.mhc_post_pre(*leaves)
        torch.autograd.grad(outs, leaves, [torch.ones_like(o) for o in outs])
    torch.cuda.synchronize()
    print(f"profile-once: ran mhc_post_pre forward+backward twice at T={T}, n={n}, C={C}")

def parse_mhc_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_kernels.py mhc", description="mHC fused-kernel benchmark (bf16)")
    p.add_argument("--tokens", type=int, nargs="+", default=[32_768, 98_304], help="token counts to time")
    p.add_argument("--n", type=int, default=4, help="number of residual streams (a power of two)")
    p.add_argument("--C", type=int, default=512, help="stream width (a multiple of 16)")
    p.add_argument("--rep-ms", type=int, default=200, help="milliseconds of timed repeats per measurement")
    p.add_argument("--sweep", nargs="?", const="all", default="", metavar="KERNELS",
                   help=f"also time Triton kernels under several block configs: all, or some of {','.join(SWEEP)}")
    p.add_argument("--impls", default=",".join(IMPLS),
                   help=f"comma-separated subset of {','.join(ALL_IMPLS)}")
    p.add_argument("--profile-once", action="store_true",
                   help="no timing: run the Triton unit's forward+backward twice at the first --tokens, for a profiler")
    args = p.parse_args(argv)
    args.impls = [name.strip() for name in args.impls.split(",") if name.strip()]
    unknown = sorted(set(args.impls) - set(ALL_IMPLS))
    if unknown or not args.impls:
        p.error(f"--impls must name some of {','.join(ALL_IMPLS)}, got {unknown or 'nothing'}")
    if min(args.tokens) <= 0 or args.rep_ms <= 0:
        p.error(f"--tokens and --rep-ms must be positive, got {args.tokens} and {args.rep_ms}")
    args.sweep = list(SWEEP) if args.sweep == "all" else [k.strip() for k in args.sweep.split(",") if k.strip()]
    if set(args.sweep) - set(SWEEP):
        p.error(f"--sweep takes 'all' or kernels among {','.join(SWEEP)}, got {','.join(args.sweep)}")
    if args.n < 2 or args.n & (args.n - 1) or args.C <= 0 or args.C % 16:
        p.error(f"--n must be a power of two >= 2 and --C a positive multiple of 16, got n={args.n} C={args.C}")
    return args


def mhc_main(argv: list[str]) -> list[dict]:
    args = parse_mhc_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels.py mhc: needs a CUDA GPU (the timings use CUDA events)")
    from kernels import mhc as K

    torch.manual_seed(0)
    n, C = args.n, args.C
    if args.profile_once:
        profile_once(args.tokens[0], n, C)
        return []
    per_token = floor_bytes_per_token(n, C)
    copy_bps = copy_bandwidth(args.rep_ms)
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  n={n} C={C} bf16 streams")
    print(f"copy bandwidth (1 GiB D2D, read+write): {copy_bps / 1e9:.0f} GB/s", flush=True)
    print(f"floor bytes/token: fwd {per_token['fwd']}, bwd {per_token['bwd']}, fwd+bwd {per_token['fwd+bwd']} "
          f"(= {(5 * n + 5)} * C bf16 stream elements + fp32 coefficients)")
    print(design_bound(n, C))
    make = {"eager": lambda: R.mhc_post_pre, "compiled": lambda: torch.compile(R.mhc_post_pre, dynamic=False),
            "triton": lambda: K.mhc_post_pre, "triton-graph": lambda: K.mhc_post_pre}
    impls = {name: make[name]() for name in args.impls}
    print("\nmhc_post_pre, one sublayer pair: time, floor bytes / time, and floor time / time")
    print(f"{'tokens':>7} {'implementation':<20} {'pass':<8} {'ms':>8} {'GB/s':>7} {'% floor':>8}")
    rows = []  # each printed as timed, like the sweep's
    for T in args.tokens:
        inputs = make_inputs(T, n, C)
        for name, fn in impls.items():
            impl = IMPL_LABELS[name]
            for pass_name, ms in pass_timings(fn, inputs, args.rep_ms, graphed=name == "triton-graph").items():
                gbps = per_token[pass_name] * T / (ms * 1e-3) / 1e9
                pct = 100 * (per_token[pass_name] * T / copy_bps * 1e3) / ms  # floor time / time
                rows.append(dict(tokens=T, impl=impl, pass_name=pass_name, ms=ms, gbps=gbps, pct=pct))
                print(f"{T:>7} {impl:<20} {pass_name:<8} {ms:8.3f} {gbps:7.0f} {pct:7.1f}%", flush=True)
        del inputs
    if args.sweep:
        print(f"\nper-kernel block sweep at {max(args.tokens)} tokens (% of copy bandwidth on the kernel's own "
              "stream bytes)")
        print(f"{'kernel':<16} {'config':<40} {'ms':>8} {'% copy':>7}")
        swept = sweep_rows(make_inputs(max(args.tokens), n, C), args.rep_ms, copy_bps, args.sweep)
        print("\n".join(sweep_summary(swept, default_blocks(n))))
    return rows


# ---------------------------------------------------------------- dispatch

SUBCOMMANDS = ("mhc",)


def main(argv: list[str] | None = None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        raise SystemExit(0)
    if not argv or argv[0] not in SUBCOMMANDS:
        raise SystemExit(f"usage: bench_kernels.py {{{','.join(SUBCOMMANDS)}}} [options]; got {argv[:1] or 'nothing'}"
                         "\nhint: `bench_kernels.py mhc --help` lists the mHC options; the fused MLP's benchmark is "
                         "python -m scripts.bench_mlp")
    return mhc_main(argv[1:])


if __name__ == "__main__":
    main()
