"""Kernel benchmarks on a CUDA GPU, one subcommand per kernel family:

    python scripts/bench_kernels.py mhc [--tokens 32768 98304] [--n 4] [--C 512] [--rep-ms 200]
                                        [--sweep [stream_bwd,coef_premix,coef_premix_pre,...]]
                                        [--impls eager,compiled,triton[,triton-graph]] [--profile-once]
    python scripts/bench_kernels.py mlp ...   (scripts/bench_mlp.py: its own flags)

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
        --launch-skip 5 --launch-count 5 python scripts/bench_kernels.py mhc --tokens 98304 --profile-once
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from kernels import mhc_reference as R
from scripts.mhc_bytes import design_bound, floor_bytes_per_token, stream_rows

COPY_BYTES = 1 << 30
SWEEP = {  # kernel -> block configurations tried by --sweep (the first is the default)
    # Measured and dropped (docs/benchmarks.md): 8 warps, LOWP=False, num_stages=1 (session 5), and the
    # narrow tiles that helped stream_bwd (BC=16 on 1-4 warps: 1.03-1.04 ms against 0.74 on an H100, session 6);
    # for stream_bwd BT=16/BC=16 on 1 or 2 warps, BT=32/BC=32 on 4 warps and num_stages=2 (within 4%, session 6);
    # register caps (maxnreg) so that more programs share an SM: stream_bwd at 192/168/128 registers took
    # 1.34/2.17/3.13 ms against 1.03 uncapped (the spills cost more than the occupancy gains), coef_premix at
    # 96 the same as at its own 128 (session 7); stream_bwd loading each channel tile an iteration ahead (a
    # loop-carried tile): 1.42 ms against 1.04 at n=4, and at n=2 slower than the wide tile without it (session 7).
    # The first row is the n=4 default; kernels/mhc_fwd.py and kernels/mhc_bwd.py pick coef_premix's and
    # stream_bwd's defaults per n (coef_premix's also by whether the launch applies a sublayer first).
    # APPLY_PASS (kernels/mhc_fwd.py): the apply in a loop of its own, then a projection loop with no barrier.
    # Dropped on an H100 (session 8, n=4 / n=2 ms): BT=16/BC=128 (0.941 / 0.371), 8 warps (1.200 / 0.629),
    # num_stages=4 (0.821 / 0.387) and BT=32/BC=32 (0.848 / 0.470), against 0.716 / 0.326 for session 8's defaults.
    # ZIGZAG=False (every pass in channel order): on an H100 (session 11) 0.780 / 0.772 ms at n=4 for session 8's
    # two default rows (APPLY_PASS 32/64, plain 16/64) against 0.751 / 0.730 with it (ncu: L2 hit rate 38% ->
    # 50%, DRAM bytes 1.78 -> 1.48 GB); no change at n=2 (16/64: 0.315 without, 0.317 with).
    # Session 11, n=4 (ms, two runs): 32/128/4 warps 0.671-0.673 (the default now), 32/64 APPLY_PASS 0.751-0.756
    # (session 8's default), 16/64 0.727-0.730, 16/128 0.731-0.734; 64/128 on 4 warps 1.351, 32/128 on 8 warps
    # 0.785, 32/128 APPLY_PASS 0.941, 64/128 on 8 warps 0.776 (dropped). n=2: 16/128 0.289-0.291 (the default),
    # 16/256 0.285 (channel_block caps n=4 at 128), 32/128 0.295, 16/64 0.317, 16/128 on 8 warps 0.343 (dropped).
    "coef_premix": [dict(BT=32, BC=128, num_warps=4), dict(BT=16, BC=128, num_warps=4),
                    dict(BT=32, BC=64, num_warps=4, APPLY_PASS=True), dict(BT=16, BC=64, num_warps=4),
                    dict(BT=32, BC=64, num_warps=4), dict(BT=16, BC=32, num_warps=2),
                    dict(BT=16, BC=64, num_warps=4, APPLY_PASS=True), dict(BT=16, BC=64, num_warps=2),
                    dict(BT=32, BC=64, num_warps=4, APPLY_PASS=True, ZIGZAG=False),
                    dict(BT=16, BC=256, num_warps=4)],
    # Dropped on an H100 (session 13, as in session 6): one token row per thread, like stream_bwd's fastest
    # block. Compiled for sm_90 on the CPU it needs 128 registers and no spills at n=4 with the apply (32 x 128:
    # 255 and 280 B of spills), yet 32 x 16 on 2 warps took 1.030 / 0.523 ms (n=4 / n=2) and 64 x 16 on 4 warps
    # 1.040 / 0.624, against 0.674 / 0.291 for the defaults; without the apply, 64 x 16 took 0.561 / 0.285
    # against 0.338 / 0.193.
    # coef_premix without the apply (mhc_pre, the first sublayer: x in, u out); the first row is the default at
    # every n. Session 11 (H100, ms, n=4 / n=2): 64/64 0.337 / 0.194, 32/64 0.415-0.421 / 0.202, 16/64
    # 0.596-0.599 / 0.306-0.307, 32/128 0.544 (128 KB of shared memory: one program per SM) / 0.211, 16/128
    # 0.743-0.746 / 0.314-0.315, 32/64 on 8 warps 0.685 / 0.308. Session 12 (H100): 64/64 0.339 / 0.195 again;
    # the two rows around it 64/64 on 8 warps 0.358 / 0.184 (n=2 6% faster in one run: 11 us per step, as
    # mhc_pre runs once) and 64/32 0.473 / 0.264. 128 tokens would need ~180 KB of shared memory.
    "coef_premix_pre": [dict(BT=64, BC=64, num_warps=4), dict(BT=32, BC=64, num_warps=4),
                        dict(BT=16, BC=64, num_warps=4), dict(BT=32, BC=128, num_warps=4),
                        dict(BT=16, BC=128, num_warps=4), dict(BT=32, BC=64, num_warps=8),
                        dict(BT=64, BC=64, num_warps=8), dict(BT=64, BC=32, num_warps=4)],
    "coef_bwd": [dict(BT=32, BC=128, num_warps=8), dict(BT=64, BC=128, num_warps=8), dict(BT=32, BC=256, num_warps=8),
                 dict(BT=16, BC=128, num_warps=4), dict(BT=64, BC=64, num_warps=4)],
    # GP_SCRATCH (G phi^T through the dx tile, kernels/mhc_bwd.py) takes n=4 from 255 registers to 159-172 at
    # 4 elements per thread (scripts/kernel_resources.py). On an H100 (session 8) it was slower at n=4 on every
    # block (1.076-1.483 ms against 1.025) and faster at n=2 (16/64/4 warps: 0.340 ms against 0.406), n=2's
    # default. Dropped: BT=16/BC=32/4 warps, BT=32/BC=16/4 warps and BT=16/BC=16/2 warps (n=4: 1.13-1.28 ms,
    # n=2: 0.43-0.55 ms). G phi^T as rank-one updates on the CUDA cores in the loads' layout (GP_FMA, session 9:
    # 225-250 registers and no spill at n=4, sm_90) lost on every block: n=4 1.770-2.715 ms against 1.025, n=2
    # 0.359-0.824 against 0.340 (H100); removed.
    # A fused backward (premix_grad + coef_bwd + stream_bwd as one kernel: pass A over the channels for dH_pre with
    # x' recomputed, the gate and Sinkhorn gradients in registers, then stream_bwd's loop backwards over the tiles so
    # that it rereads pass A's last tiles first) lost at its fastest block on an H100 (session 14, commit f62d499):
    # n=4 1.449 ms (32/16 on 2 warps; 8 blocks 1.449-2.724) against 0.284 + 1.027 for the three kernels, n=2 0.541
    # (16/64/4 warps GP_SCRATCH) against 0.160 + 0.341. Likely (not profiled): pass A runs at the occupancy that the
    # heaviest part sets (stream_bwd's registers), where premix_grad alone streams near copy bandwidth, and what
    # pass B gains from L2 does not make up for it. Removed (docs/benchmarks.md, session 14).
    # Whole-row channel tiles past channel_block's cap (session 20, a probe; n=4): 16/512 on 4/8/16 warps 1.334-2.039
    # ms with the apply against 0.680, 16/256 0.753; without the apply they need 262-525 KB of shared memory.
    # Tensor-descriptor (TMA) loads of the inputs (session 20, commit f0f2daf, removed after): on an H100 at n=4
    # every TMA row lost. stream_bwd 1.470-2.643 ms on 9 blocks (32/16/2 warps 1.819) against 1.026; coef_premix
    # 0.831-1.022 on 6 blocks against 0.670; coef_premix_pre 0.364-0.489 on 4 against 0.338.
    "stream_bwd": [dict(BT=32, BC=16, num_warps=2), dict(BT=16, BC=64, num_warps=4), dict(BT=64, BC=16, num_warps=4),
                   dict(BT=32, BC=16, num_warps=2, GP_SCRATCH=True), dict(BT=16, BC=64, num_warps=8, GP_SCRATCH=True),
                   dict(BT=16, BC=64, num_warps=4, GP_SCRATCH=True)],
    "dphi": [dict(BT=32, BK=128, num_warps=4), dict(BT=64, BK=128, num_warps=4), dict(BT=64, BK=256, num_warps=8),
             dict(BT=128, BK=64, num_warps=4), dict(BT=32, BK=128, num_warps=4, splits=66)],
}


# ---------------------------------------------------------------- timing

def bench_ms(fn, rep_ms: int) -> float:
    from triton.testing import do_bench
    return do_bench(fn, warmup=max(25, rep_ms // 4), rep=rep_ms, return_mode="median")


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


def default_configs(n: int) -> dict[str, dict]:
    """Each swept kernel's default launch configuration on a GPU at this n, as its launcher picks it."""
    from kernels.mhc_bwd import coef_bwd_config, dphi_config, stream_bwd_config
    from kernels.mhc_fwd import fwd_config
    gpu = torch.device("cuda")
    return {"coef_premix": fwd_config(gpu, n), "coef_premix_pre": fwd_config(gpu, n, apply=False),
            "coef_bwd": coef_bwd_config(gpu),
            "stream_bwd": stream_bwd_config(gpu, n), "dphi": dphi_config(gpu)}


def default_blocks(n: int) -> dict[str, dict]:
    """default_configs without coef_bwd's TOKENS (its second kernel's program size, which SWEEP does not vary)."""
    return {name: {k: v for k, v in cfg.items() if k != "TOKENS"} for name, cfg in default_configs(n).items()}


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

SUBCOMMANDS = ("mhc", "mlp")


def main(argv: list[str] | None = None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        raise SystemExit(0)
    if not argv or argv[0] not in SUBCOMMANDS:
        raise SystemExit(f"usage: bench_kernels.py {{{','.join(SUBCOMMANDS)}}} [options]; got {argv[:1] or 'nothing'}"
                         "\nhint: `bench_kernels.py mhc --help` lists the mHC options")
    if argv[0] == "mlp":
        try:
            from scripts import bench_mlp
        except ImportError as e:
            raise SystemExit(f"bench_kernels.py mlp: scripts/bench_mlp.py could not be imported ({e})") from e
        return bench_mlp.main(argv[1:], prog="bench_kernels.py mlp")
    return mhc_main(argv[1:])


if __name__ == "__main__":
    main()
