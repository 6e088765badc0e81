"""The step arithmetic of mHC's memory traffic: for each stream count, the floor bytes a token, the time they take
at a given bandwidth over every sublayer, and the step that would follow (kernels/mhc_traffic.py).

    python -m scripts.mhc_bytes --n 4 --gbps 2997 --rest-ms 82.1 --plain-ms 89.1
"""
from __future__ import annotations

import argparse

from kernels.mhc_traffic import step_table
from model.config import KERNEL_STREAMS


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="What the mHC bytes allow: the floor and this kernel design's own bytes "
                                "per token, in milliseconds per unit and per training step at a copy bandwidth. "
                                "Arithmetic, not a measurement (scripts/bench_kernels.py mhc measures).")
    p.add_argument("--n", type=int, nargs="+", default=[4, 2], choices=KERNEL_STREAMS,
                   help="streams: the n the kernels take (default: 4 2)")
    p.add_argument("--C", type=int, default=512, help="stream width, the model's d_model (default 512)")
    p.add_argument("--tokens", type=int, default=98_304, help="tokens per GPU per step (default 98,304)")
    p.add_argument("--sublayers", type=int, default=22, help="mHC units per step: 2 per block (default 22)")
    p.add_argument("--gbps", type=float, default=3_000.0,
                   help="copy bandwidth in GB/s, as bench_kernels measures it (default 3,000: an H100)")
    p.add_argument("--rest-ms", type=float, nargs="+",
                   help="for each --n, the step's time outside its mHC kernels in ms (a profile's figure)")
    p.add_argument("--plain-ms", type=float, help="the n=1 step in ms, to print the step at the floor against it")
    args = p.parse_args(argv)
    values = dict(n=args.n, C=[args.C], tokens=[args.tokens], sublayers=[args.sublayers], gbps=[args.gbps],
                  rest_ms=args.rest_ms or [], plain_ms=[args.plain_ms] if args.plain_ms is not None else [])
    bad = [name for name, given in values.items() if any(v <= 0 for v in given)]
    if bad:
        p.error(f"--{bad[0].replace('_', '-')} must be positive")
    if args.rest_ms is not None and len(args.rest_ms) != len(args.n):
        p.error(f"--rest-ms takes one value per --n ({len(args.n)}), got {len(args.rest_ms)}")
    if args.plain_ms is not None and args.rest_ms is None:
        p.error("--plain-ms needs --rest-ms (the step without its mHC kernels)")
    print(step_table(args.n, args.C, args.tokens, args.sublayers, args.gbps, args.rest_ms, args.plain_ms))


if __name__ == "__main__":
    main()
