"""Screen a trained checkpoint's matrices for low-rank error correction (LQER) against the allocator's next grid.

    python -m scripts.bench_lowrank --config configs/h100_sp8192.toml --checkpoint runs/checkpoints/RUN/step_N \\
        [--bits 3.3] [--rank 4] [--factor-bits 4] [--top 12] [-- overrides]

Calibrates the checkpoint's shipped weights as train.py's export does (training tokens, input Hessians, Fisher row
weights with quant.error_weight=fisher) and, for every matrix and mHC phi, quantizes it on the grid nearest --bits a
parameter and compares two ways of spending more bytes on it (quant/lowrank.py): the next finer grid of the
rate–distortion allocation, and the best rank-r correction of the quantization error in the allocator's own error
norm. The correction's gain is a bound (an unquantized rank-r factor pair) and its bytes are counted at
--factor-bits a value, so a ratio well below 1 means it would not pay there, and one near 1 is too close to call.
Prints the --top matrices by that ratio, how many are above 1, and what share of all the screened error their
corrections would remove. Embedding tables are left out: their error has a per-entry term.
"""
from __future__ import annotations

import argparse
import sys

import torch

from data.shards import ShardError, list_shards, require_disjoint
from model.gpt import GPT
from quant.calibrate import calibrate, collect_fisher
from quant.export import plan_tensors
from quant.lowrank import Screen, screen_matrix
from quant.schemes import error_models
from training.config import ConfigError, load_config
from training.distributed import init_distributed
from training.export import calibration_batches, observed_patterns, reference_mlps
from training.trained_weights import add_weights_arguments, load_weights, require_weights
from training.variants import split_common


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    argv, common = split_common(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_weights_arguments(p)
    p.add_argument("--bits", type=float, default=3.3, help="bits a parameter of the reference grid (default 3.3)")
    p.add_argument("--rank", type=int, default=4, help="rank of the correction (default 4)")
    p.add_argument("--factor-bits", type=int, default=4, help="bits a value of its factors (default 4)")
    p.add_argument("--top", type=int, default=12, help="matrices to list, highest ratio first (default 12)")
    args = p.parse_args(argv)
    for flag, value, low in (("--bits", args.bits, 0.5), ("--rank", args.rank, 1), ("--factor-bits", args.factor_bits, 2),
                             ("--top", args.top, 1)):
        if not value >= low:
            p.error(f"{flag} {value}: expected a number >= {low}")
    if args.bits > 8:
        p.error(f"--bits {args.bits}: expected at most 8 (the widest grid)")
    require_weights(p, args.checkpoint)
    return args, common


def screen_model(model: torch.nn.Module, batches: list[torch.Tensor], method: str, error_weight: str,
                 amp, bits: float, rank: int, factor_bits: int) -> list[Screen]:
    """Every matrix's screen (quant.lowrank.screen_matrix), on the Hessians and Fisher rows of `batches`."""
    plan = plan_tensors(model, (), observed_patterns(model))
    calib = calibrate(model, plan.linears, batches, amp, plan.observed)
    fisher = collect_fisher(model, plan.linears, batches, amp, list(plan.observed)) if error_weight == "fisher" else None
    weights = {**{n: m.weight for n, m in plan.linears.items()}, **plan.observed}
    kinds = {**dict.fromkeys(plan.linears, "linear"), **dict.fromkeys(plan.observed, "phi")}
    models = error_models(weights, kinds, calib, fisher)
    screens = (screen_matrix(n, w, models[n], method, bits, rank, factor_bits) for n, w in weights.items())
    return [s for s in screens if s is not None]


def format_table(screens: list[Screen], top: int, rank: int) -> str:
    lines = ["| matrix | shape | bits/param | error | next grid: gain / bytes | "
             f"rank {rank}: gain / bytes | share of the error | ratio |", "|---|---|---|---|---|---|---|---|"]
    for s in sorted(screens, key=lambda s: s.ratio, reverse=True)[:top]:
        lines.append(f"| {s.name} | {s.shape[0]}×{s.shape[1]} | {s.bits_per_param:.2f} | {s.error:.3e} | "
                     f"{s.grid_gain:.3e} / {s.grid_bytes:,.0f} | {s.lowrank_gain:.3e} / {s.lowrank_bytes:,.0f} | "
                     f"{s.top_share:.1%} | {s.ratio:.2f} |")
    above = [s for s in screens if s.ratio > 1]
    lines.append(f"\n{len(above)} of {len(screens)} matrices: a rank-{rank} correction would remove more error per "
                 "byte than the next grid (ratio > 1)")
    # what the verdict rests on: a ratio above 1 on a matrix holding little of the error moves the score by little
    total, gain = sum(s.error for s in screens), sum(s.lowrank_gain for s in above)
    lines.append(f"their corrections would remove {gain:.3e} of the screened matrices' {total:.3e} weighted error "
                 f"({gain / total if total > 0 else 0.0:.2%}) for {sum(s.lowrank_bytes for s in above):,.0f} bytes")
    return "\n".join(lines)


def main(argv=None) -> None:
    args, common = parse_args(sys.argv[1:] if argv is None else list(argv))
    try:
        cfg = load_config(args.config, common)
        train_files = list_shards(cfg.data.train_files)
        require_disjoint(train_files, list_shards(cfg.data.val_files))
    except (ConfigError, ShardError, FileNotFoundError) as e:
        raise SystemExit(f"bench_lowrank: {e}") from None
    device = init_distributed(cfg.train.device).device
    model = GPT(cfg.model)
    source, _ = load_weights(args.checkpoint, model)
    model.to(device)
    amp = torch.bfloat16 if device.type == "cuda" else None
    with reference_mlps(model):
        batches = calibration_batches(cfg, model, train_files, device)
        screens = screen_model(model, batches, cfg.quant.method, cfg.quant.error_weight, amp, args.bits, args.rank,
                               args.factor_bits)
    print(f"{args.checkpoint} ({source} weights), {sum(len(b) for b in batches)} calibration sequences, "
          f"reference grids near {args.bits} bits a parameter, factors at {args.factor_bits} bits\n")
    print(format_table(screens, args.top, args.rank))


if __name__ == "__main__":
    main()
