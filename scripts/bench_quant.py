"""Re-quantize one trained checkpoint under several [quant] settings and score every artifact.

    python -m scripts.bench_quant --config configs/demo.toml --checkpoint runs/checkpoints/RUN/step_00000500 \\
        --equal-bytes rec --variant rec="quant.scheme=sdclip" --variant rd="quant.scheme=rd" -- [overrides for all]

Training is the expensive part; quantization choices are cheap to compare on the same weights. The
script loads the checkpoint's weights (its EMA shadow when it has one: what train.py ships) into the
model of --config, scores the float model once, and then for each variant exports the artifact
exactly as train.py does (calibration on training tokens, GPTQ, allocation, Brotli, verified write),
scores it from disk, and prints one table: artifact and total bytes, matrices per width, val_bpb
after quantization and the gap to the float model; and, for the schemes that report them, bits per
parameter and predicted error per kind of tensor. --equal-bytes NAME gives every variant the byte
budget that NAME's artifact took. A variant may change only [quant] keys: the weights are fixed. --profile DIR
writes a torch.profiler trace of calibration in each variant's export (its parts and each loss-probe pass labelled,
the rest of the export not recorded); a variant repeated under another name shows what a second export in the same
process no longer pays.
Write a checkpoint at the end of a run with train.checkpoint_every=<max_steps>, or stop a run with
SIGTERM; an artifact (.mhcg) also serves, by its dequantized weights.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

REPO = Path(__file__).resolve().parents[1]

from data.files import write_atomic
from data.loader import load_tokens
from data.shards import ShardError, list_shards, require_disjoint
from data.tokenizer import TokenizerError, build_byte_lut, file_sha256, load_sp
from model.gpt import GPT
from quant.profiling import parts_only
from training.variants import parse_variant, split_common
from training.log_reader import output_problem
from training.score import evaluate_artifact
from training.config import ConfigError, load_config, to_dict
from training.distributed import init_distributed
from training.evaluate import ByteAuditError, evaluate_bpb, require_byte_audit
from training.export import export_model
from training.trained_weights import add_weights_arguments, load_weights, require_weights


def check_variants(config: str, common: list[str], variants) -> dict:
    """Every variant's config, checked before the first export; only [quant] may differ from the base."""
    base = to_dict(load_config(config, common))
    names = [v.name for v in variants]
    if len(set(names)) != len(names):
        raise SystemExit(f"variant names must be unique, got {names}")
    configs = {}
    for v in variants:
        try:
            cfg = load_config(config, [*common, *v.overrides])
        except ConfigError as e:
            raise SystemExit(f"variant {v.name}: {e}") from None
        changed = [k for k, value in to_dict(cfg).items() if k != "quant" and value != base[k]]
        if changed:
            raise SystemExit(f"variant {v.name}: changes [{', '.join(changed)}]; only [quant] keys can vary on "
                             "fixed weights (hint: put other overrides after --, for every variant)")
        configs[v.name] = cfg
    return configs


def format_table(rows: list[dict]) -> str:
    out = ["| variant | method, scheme, error weight | artifact bytes | total bytes | Linears int8/6/5/4 "
           "| val_bpb | gap | export s |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['variant']} | {r['method']}, {r['scheme']}, {r['error_weight']} | "
                   f"{r['artifact_bytes']:,} | {r['total_bytes']:,} | "
                   f"{r['n_int8']} / {r['n_int6']} / {r['n_int5']} / {r['n_int4']} | {r['val_bpb']:.6f} | "
                   f"{r['gap']:+.6f} | {r['export_seconds']:.1f} |")
    return "\n".join(out)


def format_kinds(rows: list[dict]) -> str:
    """Bits per parameter and summed error per tensor kind and variant (the schemes that report tensors)."""
    out = ["| variant | kind | tensors | parameters | bytes | bits/param | error |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        for kind, k in r.get("kinds", {}).items():
            out.append(f"| {r['variant']} | {kind} | {k['tensors']} | {k['params']:,} | {k['bytes']:,} | "
                       f"{k['bits_per_param']:.3f} | {k['error']:.4e} |")
    return "\n".join(out)


@contextmanager
def profiled(folder: Path | None, name: str, device: torch.device):
    """Profile calibration's parts in the block (quant/profiling.py) into folder/<name>.trace.json and print their
    top operators by self time (nothing without a folder). Why: calibration counts against the training budget and
    its time varies from run to run; the trace shows what a slow pass waits for."""
    if folder is None:
        yield
        return
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof, parts_only(prof):
        yield
    path = folder / f"{name}.trace.json"
    with tempfile.TemporaryDirectory() as tmp:  # the profiler writes to a path; write_atomic makes the trace whole
        prof.export_chrome_trace(f"{tmp}/trace.json")
        write_atomic(path, Path(tmp, "trace.json").read_bytes())
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(f"{name}: profile {path}\n{prof.key_averages().table(sort_by=sort, row_limit=15)}", flush=True)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    argv, common = split_common(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_weights_arguments(p)
    p.add_argument("--variant", action="append", required=True, metavar='NAME="OVERRIDES"',
                   help="a named set of quant.key=value overrides (repeat for each variant)")
    p.add_argument("--equal-bytes", metavar="NAME", default=None,
                   help="export variant NAME first, then every other variant at its artifact's size "
                        "(quant.budget_bytes): a comparison at equal bytes")
    p.add_argument("--verbose", action="store_true", help="print each export's log (every tensor's grid, the probes)")
    p.add_argument("--keep", type=Path, default=None, help="keep the artifacts here as NAME.mhcg (default: discard)")
    p.add_argument("--out", default=None, help="write the table as JSON here (atomically)")
    p.add_argument("--profile", type=Path, default=None,
                   help="profile calibration in each variant's export with torch.profiler: NAME.trace.json here "
                        "(Chrome trace of the 'export: …' ranges, calibration's parts and each loss-probe pass, alone) "
                        "and their top operators")
    args = p.parse_args(argv)
    for flag, path, folder in (("--out", args.out, False), ("--keep", args.keep, True),
                               ("--profile", args.profile, True)):
        if path and (problem := output_problem(path, folder)):
            p.error(f"{flag} {path}: {problem}")
    require_weights(p, args.checkpoint)  # before the shards, the byte audit and the device are set up
    return args, common


def main(argv=None) -> int:
    args, common = parse_args(sys.argv[1:] if argv is None else list(argv))
    variants = [parse_variant(text) for text in args.variant]
    configs = check_variants(args.config, common, variants)
    if args.equal_bytes is not None:
        if args.equal_bytes not in configs:
            raise SystemExit(f"--equal-bytes {args.equal_bytes}: no such variant (the variants: {list(configs)})")
        variants.sort(key=lambda v: v.name != args.equal_bytes)  # the reference first
    cfg = load_config(args.config, common)
    try:  # as train.py checks them: calibration reads no validation shard, BPB counts the decoded bytes
        train_files, val_files = list_shards(cfg.data.train_files), list_shards(cfg.data.val_files)
        require_disjoint(train_files, val_files)
        val_tokens = load_tokens(val_files, cfg.eval.max_tokens)
        lut = build_byte_lut(cfg.data.tokenizer)
        require_byte_audit(val_tokens, load_sp(cfg.data.tokenizer), lut, cfg.data.val_files, cfg.data.tokenizer)
    except (ShardError, FileNotFoundError, TokenizerError, ByteAuditError) as e:
        raise SystemExit(f"bench_quant: {e}") from None
    device = init_distributed(cfg.train.device).device  # one process; train.device=cuda without a GPU is an error
    model = GPT(cfg.model)
    source, train_time_s = load_weights(args.checkpoint, model)
    model.to(device)
    amp = torch.bfloat16 if device.type == "cuda" else None
    pre = evaluate_bpb(model, val_tokens, lut, context=cfg.eval.context, stride=cfg.eval.stride,
                       batch_seqs=cfg.eval.batch_seqs, device=device, autocast_dtype=amp)
    print(f"{args.checkpoint} ({source} weights): float val_bpb {pre['val_bpb']:.6f} on {pre['tokens']:,} tokens")
    sha = file_sha256(cfg.data.tokenizer)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = args.keep or Path(tmp)
        for v in variants:
            vcfg = configs[v.name]
            if args.equal_bytes is not None and v.name != args.equal_bytes:
                vcfg.quant.budget_bytes = rows[0]["artifact_bytes"]
            artifact = out_dir / f"{v.name}.mhcg"
            t0 = time.perf_counter()
            with profiled(args.profile, v.name, device):
                report = export_model(vcfg, model, train_files=train_files, rank=0, world_size=1,
                                      log=print if args.verbose else (lambda line: None), artifact_path=artifact,
                                      tokenizer_sha256=sha, device=device, train_time_s=train_time_s)
            seconds = time.perf_counter() - t0
            if "export_error" in report:
                raise SystemExit(f"variant {v.name}: {report['export_error']}")
            scored = evaluate_artifact(artifact, val_tokens, lut, vcfg.eval, device=device, tokenizer_sha256=sha)
            rows.append({"variant": v.name, "overrides": v.overrides,
                         # what the export did (its report), not what the variant asked for
                         **{k: report[k] for k in ("method", "scheme", "error_weight", "n_int8", "n_int6", "n_int5",
                                                   "n_int4", "budget_bytes")},
                         **({"kinds": report["kinds"]} if "kinds" in report else {}),
                         **{k: scored[k] for k in ("artifact_bytes", "total_bytes", "fits_cap", "val_bpb", "val_loss")},
                         "gap": scored["val_bpb"] - pre["val_bpb"], "export_seconds": seconds})
            print(f"{v.name}: {rows[-1]['total_bytes']:,} B, val_bpb {rows[-1]['val_bpb']:.6f}", flush=True)
    print("\n" + format_table(rows))
    if any("kinds" in r for r in rows):
        print("\n" + format_kinds(rows))
    if args.out:
        write_atomic(args.out, (json.dumps({"config": args.config, "checkpoint": str(args.checkpoint),
                                            "weights": source, "common": common, "float_val_bpb": pre["val_bpb"],
                                            "rows": rows}, indent=1) + "\n").encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
