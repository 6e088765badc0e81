r"""Run named variants of one config side by side, one per GPU, same seed (or each over several), and compare them.

    python -m scripts.ablate --config configs/h100_short.toml --gpus 0,1 --out logs/ablate.json \
        --variant plain="model.n_streams=1 model.mhc_blocks=0" --variant n2-all="model.mhc_blocks=0" \
        -- data.train_files='runs/mix/fineweb_train_*.bin' ...

With --seeds 1337,42,2025 every variant runs once per seed (run ids PREFIX-NAME-sSEED), the runs queued seed by
seed with the variants' order rotated each seed (so that no variant keeps the first, or the same, GPU), and a second
table gives each variant's mean and spread over the seeds; with
--baseline NAME, also each other variant's difference from NAME and the one-sided Welch p-value that it is lower
(what scripts.reproduce tests for a submission, without the record rule's margin).

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
from training.records import final_problem, mean_std, welch_one_sided
from training.run_log import log_path
from training.log_reader import output_problem, stream_run
from training.variants import NAME, parse_seeds, parse_variant, split_common

REPO = Path(__file__).resolve().parents[1]

@dataclass
class Variant:
    name: str
    overrides: list[str]
    seed: int | None = None  # with --seeds: the seed this run of the variant has (train.seed among its overrides)
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

    @property
    def label(self) -> str:
        return self.name if self.seed is None else f"{self.name}-s{self.seed}"


def run_id(prefix: str, label: str) -> str:
    return f"{prefix}-{label}"


def with_seeds(variants: list[Variant], seeds: list[int] | None, common: list[str]) -> list[Variant]:
    """Each variant once per seed, queued seed by seed (with as many slots as variants a seed's runs start together,
    and a stopped ablation leaves whole seeds); the order rotates by one each seed, so that the variants take turns
    on the slots rather than each keeping one GPU, whose speed would otherwise count in its score."""
    if not seeds:
        return variants
    for where, overrides in [("the common overrides", common), *((f"variant {v.name}", v.overrides) for v in variants)]:
        if any(o.startswith("train.seed=") for o in overrides):
            raise SystemExit(f"{where}: train.seed is set by --seeds (hint: drop it there, or drop --seeds)")
    k = len(variants)
    return [Variant(v.name, [*v.overrides, f"train.seed={s}"], s)
            for i, s in enumerate(seeds) for v in variants[i % k:] + variants[:i % k]]


def check_configs(config: str, common: list[str], variants: list[Variant], prefix: str) -> None:
    """Fail before any run starts: a typo in the last variant must not cost the first one's GPU time, and
    a variant's log must not exist yet unless the variant resumes (train.py appends to its log: two runs
    would share one file)."""
    names = [v.label for v in variants]
    if len(set(names)) != len(names):
        raise SystemExit(f"variant names must be unique, got {names}")
    for v in variants:
        rid = run_id(prefix, v.label)
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
    v.returncode, lines, v.final = stream_run(command, v.label, env, print_lock)
    v.tail = lines[-5:]


def run_all(config: str, common: list[str], variants: list[Variant], slots: list[str | None], prefix: str) -> None:
    """One worker per slot (a GPU index, or None for a CPU slot); each takes the next waiting variant."""
    todo: queue.Queue[Variant] = queue.Queue()
    for v in variants:
        v.run_id = run_id(prefix, v.label)
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
        row = {"variant": v.name, "seed": v.seed, "run_id": v.run_id, "status": v.problem() or "ok",
               "overrides": v.overrides,
               "steps": steps, "train_time_s": seconds,
               "tokens_per_s": f["tokens_seen"] / seconds if seconds and "tokens_seen" in f else None,
               "ms_per_step": 1000 * seconds / steps if seconds and steps else None,
               "pre_quant_val_bpb": f.get("pre_quant_val_bpb"), "val_bpb": f.get("val_bpb"),
               "total_bytes": f.get("total_bytes")}
        if row["status"] != "ok":
            row["stdout_tail"] = [line.rstrip("\n") for line in v.tail]
        rows.append(row)
    return rows


def num(value, spec: str) -> str:
    """A table cell: the value formatted, or a dash for a run that has none."""
    return "—" if value is None else format(value, spec)


def format_table(rows: list[dict]) -> str:
    out = ["| variant | status | steps | tokens/s | ms/step | val_bpb pre-quant | val_bpb artifact | total bytes |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        name = r["variant"] if r.get("seed") is None else f"{r['variant']} s{r['seed']}"
        out.append(f"| {name} | {r['status']} | {num(r['steps'], ',')} | {num(r['tokens_per_s'], ',.0f')} | "
                   f"{num(r['ms_per_step'], '.1f')} | {num(r['pre_quant_val_bpb'], '.4f')} | "
                   f"{num(r['val_bpb'], '.4f')} | {num(r['total_bytes'], ',')} |")
    return "\n".join(out)


def seed_summary(rows: list[dict], baseline: str | None) -> list[dict]:
    """Per variant over its seeds: how many ran ok, the mean (and sample sd) of val_bpb before and after
    quantization, of steps and ms/step; against `baseline`, the difference of the means after quantization and the
    one-sided Welch p-value for 'lower than the baseline'. Where a seed failed the variant gets no test: a verdict on
    the seeds that survived would hide the others."""
    names = list(dict.fromkeys(r["variant"] for r in rows))
    ok = {n: [r for r in rows if r["variant"] == n and r["status"] == "ok"] for n in names}
    total = {n: sum(r["variant"] == n for r in rows) for n in names}
    out = []
    for n in names:
        s = {"variant": n, "seeds": total[n], "seeds_ok": len(ok[n])}
        for key in ("pre_quant_val_bpb", "val_bpb", "steps", "ms_per_step"):
            values = [r[key] for r in ok[n] if r[key] is not None]
            s[f"{key}_mean"], s[f"{key}_std"] = mean_std(values) if values else (None, None)
        if baseline and n != baseline:
            s["baseline"] = baseline
            base, mine = [r["val_bpb"] for r in ok[baseline]], [r["val_bpb"] for r in ok[n]]
            if len(ok[n]) < total[n] or len(ok[baseline]) < total[baseline]:
                s["test"] = f"not compared: a seed of {n if len(ok[n]) < total[n] else baseline} failed"
            else:
                try:
                    s["delta_vs_baseline"] = mean_std(mine)[0] - mean_std(base)[0]
                    s["welch_p"] = welch_one_sided(base, mine)["p_value"]
                except ValueError as e:  # fewer than 2 seeds, or no spread on one side
                    s["test"] = f"not compared: {e}"
        out.append(s)
    return out


def format_seed_table(summary: list[dict]) -> str:
    out = ["| variant | seeds ok | steps | ms/step | val_bpb pre-quant | val_bpb artifact (mean ± sd) | vs baseline | "
           "one-sided p |", "|---|---|---|---|---|---|---|---|"]
    for s in summary:
        vs = "—" if "baseline" not in s else s.get("test") or f"{s['delta_vs_baseline']:+.5f}"
        out.append(f"| {s['variant']} | {s['seeds_ok']}/{s['seeds']} | {num(s['steps_mean'], ',.0f')} | "
                   f"{num(s['ms_per_step_mean'], '.1f')} | {num(s['pre_quant_val_bpb_mean'], '.5f')} | "
                   f"{num(s['val_bpb_mean'], '.5f')} ± {num(s['val_bpb_std'], '.5f')} | {vs} | "
                   f"{num(s.get('welch_p'), '.4g')} |")
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
    p.add_argument("--prefix", default="ablate", help="run ids are PREFIX-NAME (PREFIX-NAME-sSEED with --seeds)")
    p.add_argument("--out", default=None, help="write the summary as JSON here (atomically)")
    p.add_argument("--seeds", type=parse_seeds, default=None,
                   help="comma-separated seeds: every variant runs once per seed, with a table over the seeds")
    p.add_argument("--baseline", default=None, metavar="NAME",
                   help="with --seeds: the variant the others are tested against (one-sided Welch on val_bpb)")
    args = p.parse_args(argv)
    if args.baseline is not None and len(args.seeds or ()) < 2:
        p.error(f"--baseline {args.baseline}: a test needs --seeds with at least 2 seeds")
    if args.baseline is not None and args.baseline not in [parse_variant(t).name for t in args.variant]:
        p.error(f"--baseline {args.baseline}: no --variant of that name")
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
    variants = with_seeds([Variant(*parse_variant(text)) for text in args.variant], args.seeds, common)
    check_configs(args.config, common, variants, args.prefix)
    slots = [None] * args.parallel if args.gpus == "none" else [g.strip() for g in args.gpus.split(",")]
    run_all(args.config, common, variants, slots, args.prefix)
    rows = summary_rows(variants)
    print("\n" + format_table(rows))
    result = {"config": args.config, "common": common, "runs": rows}
    if args.seeds:
        result["seeds"], result["variants"] = args.seeds, seed_summary(rows, args.baseline)
        print("\n" + format_seed_table(result["variants"]))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        write_atomic(args.out, (json.dumps(result, indent=1) + "\n").encode())
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
