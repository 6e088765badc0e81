"""Full training-step benchmark: tokens/s, ms/step, MFU and peak memory of the recipe's step.

    python -m scripts.bench_step [--config configs/h100_short.toml] [--steps 30] [--warmup 5]
                                 [--variants config-kernels,n4-kernels,n4-ref,n1-kernels,n1-ref | all]
                                 [--profile 3] [--recurrence on] [--doc-tokens 640 | --tokens train]
                                 [override ...]
    torchrun --standalone --nproc_per_node=2 -m scripts.bench_step ... train.batch_tokens=196608

Each variant builds the config's model with a named mHC layout (config-kernels: the config's own; n4, n2:
streams on every sublayer; n4-block, n2-block: around whole blocks; n1: none) and the Triton kernels on
or off, compiles the step like train.py (train.compile), and times `--steps` optimizer steps on
one batch held on the device (random tokens, or with --tokens train the training loader's first) after `--warmup`
steps (compilation happens there). Prints a markdown table.
With --profile K, K more steps of each variant run under torch.profiler and the device time is
broken down by kernel category and by kernel (training/step_profile.py), printed after the table.
With depth recurrence (model.recur_times > 1) a run steps in two phases; --recurrence on times the second, the
repeated blocks on (MFU then counts their extra passes), where the default times the first. Attention within
documents (model.doc_attention) costs what the documents' lengths make it: --doc-tokens N gives the random tokens
documents of mean length N, and --tokens train steps on the first batch the training loader gives from
data.train_files, so on the corpus's own documents (real lengths are skewed: most tokens sit in documents longer than
the mean).

Under torchrun every rank runs the same step as train.py does: gradient averaging and sharded Muon.
tokens/s is the global rate. train.batch_tokens is the global batch, so pass N x 98,304 to keep each
GPU's share of the one-GPU step; the ratio to the one-GPU row is then the scaling factor.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

from model.gpt import GPT
from training.bench_batches import RandomTokens, TrainTokens
from training.step_profile import format_tables, profile_steps
from training.config import Config, ConfigError, load_config
from training.distributed import DistInfo, destroy, init_distributed, print0, torchrun_rank_world
from training.optim import build_optimizers
from training.trainer import grad_accum_steps, peak_flops, train_step, training_flops_per_token

# Each named variant fixes the whole mHC layout (streams, granularity, mHC blocks), so it means the same on
# any config; "config-kernels" keeps the config's own layout (the recipe as shipped) with every kernel on.
SUBLAYER_ALL = ["model.mhc_granularity=sublayer", "model.mhc_blocks=0"]
BLOCK_ALL = ["model.mhc_granularity=block", "model.mhc_blocks=0"]
KERNELS = ["model.mhc_kernels=true", "model.mlp_kernel=true"]
VARIANTS = {
    "config-kernels": KERNELS,
    "n4-kernels": ["model.n_streams=4", *SUBLAYER_ALL, *KERNELS],
    "n4-ref": ["model.n_streams=4", *SUBLAYER_ALL, "model.mhc_kernels=false", "model.mlp_kernel=false"],
    "n1-kernels": ["model.n_streams=1", "model.mhc_blocks=0", "model.mlp_kernel=true"],
    "n1-ref": ["model.n_streams=1", "model.mhc_blocks=0", "model.mlp_kernel=false"],
    # Cheaper mHC: mHC around whole blocks (half the stream traffic), and 2 streams.
    "n4-block-kernels": ["model.n_streams=4", *BLOCK_ALL, *KERNELS],
    "n2-block-kernels": ["model.n_streams=2", *BLOCK_ALL, *KERNELS],
    "n2-kernels": ["model.n_streams=2", *SUBLAYER_ALL, *KERNELS],
}


def variant_overrides(name: str, overrides: list[str]) -> list[str]:
    """The variant's own settings, then the command line's, so the command line wins."""
    return VARIANTS[name] + list(overrides)


DEFAULT_VARIANTS = ("config-kernels", "n4-kernels", "n4-ref", "n1-kernels", "n1-ref")


def step_tokens(cfg: Config, device: torch.device, dist: DistInfo, tokens: str, doc_tokens: int):
    if tokens == "train":
        return TrainTokens(cfg, device, dist.rank, dist.world_size)
    return RandomTokens(cfg.train.micro_batch_seqs, cfg.data.seq_len, cfg.model.vocab_size, device, dist.rank,
                        doc_tokens)


def bench_variant(cfg: Config, steps: int, warmup: int, dist: DistInfo, profile: int = 0,
                  recurrence: bool = False, doc_tokens: int = 0, tokens: str = "random") -> dict:
    """recurrence: time the step of depth recurrence's second phase (the repeated blocks on), which a run of a
    config with model.recur_times > 1 takes from model.recur_at on, instead of the first."""
    device = dist.device
    torch.manual_seed(0)
    model = GPT(cfg.model).to(device)
    model.recurrence_on = recurrence
    opts = build_optimizers(model.param_groups(), cfg.optim, model.qkv_splits())
    step_model = torch.compile(model) if cfg.train.compile else model
    loader = step_tokens(cfg, device, dist, tokens, doc_tokens)
    accum = grad_accum_steps(cfg, dist.world_size)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step():
        return train_step(step_model, loader, opts, cfg, accum, device)

    t0 = time.perf_counter()
    for _ in range(warmup):
        step()
    sync()
    warmup_s = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    sync()
    seconds = (time.perf_counter() - t0) / steps
    tok_s = cfg.train.batch_tokens / seconds
    peak = peak_flops(device) * dist.world_size
    breakdown = profile_steps(step, profile, device) if profile else None
    return {"ranks": dist.world_size, "profile": breakdown,
        "params": sum(p.numel() for p in model.parameters()), "ms_step": 1000 * seconds, "tok_s": tok_s,
        "mfu": 100 * training_flops_per_token(model, cfg, recurrence) * tok_s / peak if peak else float("nan"),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan"),
        "warmup_s": warmup_s, "loss": float(loss),
    }


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(REPO / "configs/h100_short.toml"))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help=f"comma-separated, or 'all': {list(VARIANTS)}")
    p.add_argument("--profile", type=int, default=0, metavar="K",
                   help="profile K more steps per variant and print where the device time goes")
    p.add_argument("--recurrence", choices=("off", "on"), default="off",
                   help="on: time the step with depth recurrence on (a config with model.recur_times > 1 runs it "
                        "from model.recur_at on); off: the step before it switches on")
    p.add_argument("--doc-tokens", type=int, default=0, metavar="N",
                   help="random documents of mean length N tokens (a BOS at each position with probability 1/N; the "
                        "shared sp8192 train mix averages ~640), for model.doc_attention; 0: uniform ids")
    p.add_argument("--tokens", choices=("random", "train"), default="random",
                   help="train: step on the first batch the training loader gives from data.train_files (the "
                        "corpus's own documents); random: random ids (see --doc-tokens)")
    p.add_argument("overrides", nargs="*",
                   help="section.key=value applied to every variant, after the variant's own (so they win)")
    a = p.parse_args(argv)
    names = list(VARIANTS) if a.variants == "all" else a.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    if a.doc_tokens < 0 or a.doc_tokens == 1:
        p.error(f"--doc-tokens {a.doc_tokens}: the mean document length must be 0 (uniform ids) or at least 2")
    if a.tokens == "train" and a.doc_tokens:
        p.error("--doc-tokens shapes random tokens; with --tokens train the documents are the corpus's own (hint: "
                "leave one of them out)")
    if a.profile < 0 or a.steps < 1 or a.warmup < 0:
        p.error(f"need --steps >= 1, --warmup >= 0 and --profile >= 0, got {a.steps}, {a.warmup} and {a.profile}")
    try:  # every variant's config before the first one compiles (an override may not suit them all)
        configs = [load_config(a.config, variant_overrides(name, a.overrides)) for name in names]
    except ConfigError as e:
        p.error(str(e))
    if a.recurrence == "on" and (flat := [n for n, cfg in zip(names, configs) if cfg.model.recur_times == 1]):
        p.error(f"--recurrence on: variants {flat} have no depth recurrence (model.recur_times=1; hint: a config with "
                "recurrence, such as configs/h100_sp8192_recur.toml, or model.recur_start/recur_end/recur_times)")
    if a.tokens == "train":  # missing, broken or too short shards fail here, before any variant compiles
        try:  # this rank's own batch, as bench_variant will load it: too few sequences for the ranks fail here too
            for cfg in configs:
                TrainTokens(cfg, torch.device("cpu"), *torchrun_rank_world())
        except (OSError, ValueError) as e:
            p.error(f"--tokens train: data.train_files: {e}")
    if a.warmup == 0 and any(cfg.train.compile for cfg in configs):  # compilation would land in the timed steps
        p.error("--warmup 0 with train.compile=true times torch.compile's first step as a training step "
                "(hint: --warmup 1 or more, or train.compile=false)")
    try:  # before any process group exists: every refusal above leaves none open under torchrun
        dist = init_distributed(configs[0].train.device)  # train.device=cuda without a GPU is a ConfigError
    except ConfigError as e:
        p.error(str(e))
    if dist.device.type != "cuda":  # the Triton variants would time the PyTorch fallback under their names
        print0("bench_step: no GPU: the *-kernels variants run the PyTorch reference here, and the default config is "
               "the record-size model (hint: --config configs/demo.toml for a CPU check)", file=sys.stderr)
    rows = []
    print0("| variant | ranks | params | ms/step | tokens/s | MFU % | peak GiB (rank 0) | warm-up s | last loss |")
    print0("|---|---|---|---|---|---|---|---|---|")
    try:
        for name, cfg in zip(names, configs):
            r = bench_variant(cfg, a.steps, a.warmup, dist, a.profile, a.recurrence == "on", a.doc_tokens, a.tokens)
            rows.append({"variant": name, "recurrence": a.recurrence, **r})
            label = f"{name} (recurrence on)" if a.recurrence == "on" else name
            print0(f"| {label} | {r['ranks']} | {r['params']:,} | {r['ms_step']:.1f} | {r['tok_s']:,.0f} | "
                   f"{r['mfu']:.1f} | {r['peak_gib']:.1f} | {r['warmup_s']:.1f} | {r['loss']:.3f} |", flush=True)
    finally:
        destroy()
    for r in rows:  # after the table, so it stays one block (rank 0's profile under torchrun)
        if r["profile"]:
            print0(format_tables(r["variant"], r["ms_step"], *r["profile"]))
    return rows


if __name__ == "__main__":
    main()
