r"""Run named variants of one config side by side, one per GPU, same seed, and compare them.

    python -m scripts.ablate --config configs/h100_short.toml --gpus 0,1 --out logs/ablate.json \
        --variant plain="model.n_streams=1 model.mhc_blocks=0" --variant n2-all="model.mhc_blocks=0" \
        -- data.train_files='runs/mix/fineweb_train_*.bin' ...

Each variant runs `python train.py --config C train.run_id=<prefix>-<name> [common overrides] [its
overrides]` with CUDA_VISIBLE_DEVICES set to one GPU of --gpus; variants beyond the number of GPUs
wait for a free one. With `--gpus none` they run on the CPU, --parallel at a time. Every variant's
config is checked before anything starts. The result is one table (steps, tokens/s, ms/step, val_bpb
before and after quantization, total bytes) printed and written as JSON to --out.

Runs started together share the host's CPU cores (loader threads, compilation); compare throughput
between runs of one invocation, and between invocations only on the same kind of machine.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from data.files import write_atomic
from training.config import ConfigError, load_config
from training.records import final_problem
from training.run_log import log_path
from training.log_reader import output_problem, stream_run
from training.variants import NAME, parse_variant, split_common

REPO = Path(__file__).resolve().parents[1]

@dataclass
class Variant:
    name: str
    overrides: list[str]
    run_id: str = ""
    returncode: int | None = None
    final: dict | None = None
    tail: list[str] = field(default_factory=list)   # last stdout lines, for a failure report

    def problem(self) -> str | None:
        if self.returncode != 0:
            return f"exit {self.returncode}"
        if self.final is None:
            return "no final JSON line"
        return final_problem(self.final)  # no artifact, over a cap, calibration past the budget, a NaN score


def run_id(prefix: str, name: str) -> str:
    return f"{prefix}-{name}"


def check_configs(config: str, common: list[str], variants: list[Variant], prefix: str) -> None:
    """Fail before any run starts: a typo in the last variant must not cost the first one's GPU time, and
    a variant's log must not exist yet unless the variant resumes (train.py appends to its log: two runs
    would share one file)."""
    names = [v.name for v in variants]
    if len(set(names)) != len(names):
        raise SystemExit(f"variant names must be unique, got {names}")
    for v in variants:
        rid = run_id(prefix, v.name)
        try:
            cfg = load_config(config, [*common, *v.overrides, f"train.run_id={rid}"])  # as it will run
        except ConfigError as e:
            raise SystemExit(f"variant {v.name}: {e}") from None
        log = log_path(cfg.train.log_dir, rid)
        if log.exists() and not cfg.train.resume:  # a resumed run continues its own log
            raise SystemExit(f"variant {v.name}: {log} already exists (an earlier run with this run id); train.py "
                             "would append this run to it. hint: --prefix gives new run ids, or move the file away")


def run_variant(v: Variant, command: list[str], env: dict, print_lock: threading.Lock) -> None:
    """Stream the run's stdout with a [name] prefix; its last line is train.py's final JSON."""
    v.returncode, lines, v.final = stream_run(command, v.name, env, print_lock)
    v.tail = lines[-5:]


def run_all(config: str, common: list[str], variants: list[Variant], slots: list[str | None], prefix: str) -> None:
    """One worker per slot (a GPU index, or None for a CPU slot); each takes the next waiting variant."""
    todo: queue.Queue[Variant] = queue.Queue()
    for v in variants:
        v.run_id = run_id(prefix, v.name)
        todo.put(v)
    lock = threading.Lock()

    def worker(slot: str | None) -> None:
        env = dict(os.environ)
        if slot is not None:  # slot is an index among the GPUs this process sees: map it to what the child sees
            granted = [g.strip() for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
            env["CUDA_VISIBLE_DEVICES"] = granted[int(slot)] if granted else slot
        while True:
            try:
                v = todo.get_nowait()
            except queue.Empty:
                return
            command = [sys.executable, str(REPO / "train.py"), "--config", config, *common, *v.overrides,
                       f"train.run_id={v.run_id}"]
            run_variant(v, command, env, lock)

    threads = [threading.Thread(target=worker, args=(slot,)) for slot in slots]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def summary_rows(variants: list[Variant]) -> list[dict]:
    rows = []
    for v in variants:
        f = v.final or {}
        steps, seconds = f.get("steps"), f.get("train_time_s")
        row = {"variant": v.name, "run_id": v.run_id, "status": v.problem() or "ok", "overrides": v.overrides,
               "steps": steps, "train_time_s": seconds,
               "tokens_per_s": f["tokens_seen"] / seconds if seconds and "tokens_seen" in f else None,
               "ms_per_step": 1000 * seconds / steps if seconds and steps else None,
               "pre_quant_val_bpb": f.get("pre_quant_val_bpb"), "val_bpb": f.get("val_bpb"),
               "total_bytes": f.get("total_bytes")}
        if row["status"] != "ok":
            row["stdout_tail"] = [line.rstrip("\n") for line in v.tail]
        rows.append(row)
    return rows


def format_table(rows: list[dict]) -> str:
    def num(value, spec):
        return "—" if value is None else format(value, spec)
    out = ["| variant | status | steps | tokens/s | ms/step | val_bpb pre-quant | val_bpb artifact | total bytes |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['variant']} | {r['status']} | {num(r['steps'], ',')} | {num(r['tokens_per_s'], ',.0f')} | "
                   f"{num(r['ms_per_step'], '.1f')} | {num(r['pre_quant_val_bpb'], '.4f')} | "
                   f"{num(r['val_bpb'], '.4f')} | {num(r['total_bytes'], ',')} |")
    return "\n".join(out)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    argv, common = split_common(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--variant", action="append", required=True, metavar='NAME="OVERRIDES"',
                   help="a named set of section.key=value overrides (repeat for each variant)")
    p.add_argument("--gpus", default=None, help="comma-separated GPU indices, one run each at a time, or 'none' "
                   "for CPU runs (default: every visible GPU, or 'none' without one)")
    p.add_argument("--parallel", type=int, default=1, help="with --gpus none: CPU runs at a time")
    p.add_argument("--prefix", default="ablate", help="run ids are PREFIX-NAME")
    p.add_argument("--out", default=None, help="write the summary as JSON here (atomically)")
    args = p.parse_args(argv)
    if args.parallel < 1:
        p.error(f"--parallel {args.parallel}: expected >= 1")
    import torch
    visible = torch.cuda.device_count()
    if args.gpus is None:
        args.gpus = ",".join(map(str, range(visible))) or "none"
    if args.gpus != "none":
        gpus = [g.strip() for g in args.gpus.split(",")]
        if not all(g.isdigit() for g in gpus) or len(set(gpus)) != len(gpus) or any(int(g) >= visible for g in gpus):
            p.error(f"--gpus {args.gpus}: expected distinct GPU indices below {visible} (the GPUs visible here), "
                    "or 'none' for CPU runs (hint: an index no GPU has hides them all, and the run goes to the CPU)")
    if args.out and (problem := output_problem(args.out, folder=False)):
        p.error(f"--out {args.out}: {problem}")
    if not NAME.match(args.prefix):
        p.error(f"--prefix {args.prefix!r}: letters, digits, '.', '_' or '-' only")
    return args, common


def main(argv=None) -> int:
    args, common = parse_args(sys.argv[1:] if argv is None else list(argv))
    variants = [Variant(*parse_variant(text)) for text in args.variant]
    check_configs(args.config, common, variants, args.prefix)
    slots = [None] * args.parallel if args.gpus == "none" else [g.strip() for g in args.gpus.split(",")]
    run_all(args.config, common, variants, slots, args.prefix)
    rows = summary_rows(variants)
    print("\n" + format_table(rows))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        write_atomic(args.out, (json.dumps({"config": args.config, "common": common, "runs": rows}, indent=1)
                                + "\n").encode())
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
