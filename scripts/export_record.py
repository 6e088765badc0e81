r"""Package finished runs as a record folder of the challenge, with a generated single-file train_gpt.py.

    python -m scripts.export_record --runs logs/a-s1337.txt logs/a-s42.txt logs/a-s2025.txt \
        --out records/2026-11-22_mhc11L --name "mHC 11L" --github-id me [--baseline LOG ...] [--force]

Writes README.md (per-seed table, how to run), submission.json (scripts.reproduce's builder), one log
per seed (train_seed<S>.log), requirements.txt, config.toml (the runs' configuration, read back
from their logs) and train_gpt.py (training.packing): the repository's train.py and every local module it imports,
minified and packed, served by an import hook, so the folder runs with no repository around it. The code bytes
counted for the record are train_gpt.py's size plus config.toml's, which it trains with; the runs counted the same
train_gpt.py and a bound on config.toml (training.shipped_code), and a record that would ship more code than its runs
counted is refused. Nothing is written outside --out.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys
import tempfile
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from data.files import current_umask, write_atomic
from quant.size import CAP_BYTES
from training.records import Scored, check_seeds_alike, final_problem, read_baseline, significance
from training.records import SeedResult, build_submission
from training.log_reader import LogFormatError, RunLogData, output_problem, parse_log
from training.checkpoint import replace_folder
from training.config import ConfigError, flat_config, load_config
from training.packing import made_script, shipped_modules
from training.run_log import git_commit
from training.sources import code_digest, imported_names

# May differ between the runs of one record: the seed, and where each machine kept its data (the record's config
# takes the first run's paths, and its README says to pass your own).
PER_RUN_KEYS = ("train.seed", "train.run_id", "train.resume", "data.train_files", "data.val_files", "data.tokenizer")
RECORD_PATHS = {"train.run_id": "", "train.resume": "", "train.log_dir": "logs", "train.out_dir": "runs"}


# ----- which modules ship -----

def third_party_imports(modules: dict[str, tuple[Path, bool]]) -> set[str]:
    names = set()
    for path, _ in modules.values():
        names.update(n.split(".")[0] for n in imported_names(path.read_text(), str(path)))
    local = {name.split(".")[0] for name in modules}
    return {n for n in names if n not in local and n not in sys.stdlib_module_names and n != "__future__"}


# ----- generated files -----

def toml_value(value, where: str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # JSON string escapes are valid TOML basic-string escapes
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v, where) for v in value) + "]"
    raise ValueError(f"{where}: a {type(value).__name__} cannot be written to TOML")


def config_toml(config: dict, comment: str) -> str:
    lines = [f"# {line}" for line in comment.splitlines()]
    for section, values in config.items():
        lines += ["", f"[{section}]"] + [f"{key} = {toml_value(v, f'{section}.{key}')}" for key, v in values.items()]
    text = "\n".join(lines) + "\n"
    if tomllib.loads(text) != config:
        raise AssertionError("config.toml does not read back as the logged config")
    return text


def record_config(logs: list[RunLogData]) -> dict:
    """The runs' common config (per-run keys aside), with paths made relative to the record folder."""
    flat = [flat_config(log.config) for log in logs]
    if not flat[0]:
        raise LogFormatError(f"{logs[0].source}: no `config {{json}}` line")
    for log, other in zip(logs[1:], flat[1:]):
        for key in sorted(set(flat[0]) | set(other)):
            if key not in PER_RUN_KEYS and flat[0].get(key) != other.get(key):
                raise ValueError(f"{log.source}: {key} = {other.get(key)!r}, but {logs[0].source} has "
                                 f"{flat[0].get(key)!r} (hint: a record's runs differ only in train.seed)")
    config = json.loads(json.dumps(logs[0].config))
    for key, value in RECORD_PATHS.items():
        section, _, name = key.partition(".")
        config[section][name] = value
    return config


def requirements(modules: dict[str, tuple[Path, bool]]) -> str:
    """The repository's requirement lines for the packages the shipped code imports."""
    imported = third_party_imports(modules)
    lines, pinned = [], set()
    for line in (REPO / "requirements.txt").read_text().splitlines():
        match = re.match(r"\s*([A-Za-z0-9_.-]+)", line)
        name = match and match[1].lower().replace("-", "_")
        if name and not line.lstrip().startswith("#") and name in imported:
            lines.append(line.strip())
            pinned.add(name)
    if imported - pinned:
        lines.append(f"# imported only by optional code paths: {', '.join(sorted(imported - pinned))}")
    return "\n".join(lines) + "\n"


def readme(sub: dict, logs: list[RunLogData], script_name: str, n_modules: int, commit: str, digest: str) -> str:
    rows = []
    for seed in sub["seeds"]:
        r = sub["seed_results"][str(seed)]
        pre = r["pre_quant_val_bpb"]
        rows.append(f"| {seed} | {r['run_id']} | {r['steps']} | {r['train_time_s']:.1f} | {r['val_loss']:.5f} | "
                    f"{r['val_bpb']:.5f} | {'' if pre is None else f'{pre:.5f}'} | {r['artifact_bytes']:,} | "
                    f"{r['bytes_total']:,} |")
    std = "" if sub["val_bpb_std"] is None else f" ± {sub['val_bpb_std']:.5f}"
    world = logs[0].world_size or 1
    launch = (f"torchrun --standalone --nproc_per_node={world} {script_name}" if world > 1
              else f"python {script_name}")
    commits = ", ".join(sorted({log.commit or "unknown" for log in logs}))
    sig = sub.get("significance")
    verdict = "" if sig is None else (
        f"\nAgainst {len(sig['baseline_runs'])} baseline runs (val_loss {sig['baseline_val_loss']:.5f}): "
        f"{sig['improvement_nats']:+.5f} nats, one-sided Welch p = {sig['p_value']:.3g} — "
        f"{'a record' if sig['is_record'] else 'not a record'} (needs ≥ {sig['required_nats']} nats at p < {sig['alpha']}).\n")
    return f"""# {sub['name']}

**val_bpb {sub['val_bpb']:.5f}{std}** (mean of {len(rows)} seed{'s' if len(rows) > 1 else ''}), val_loss {sub['val_loss']:.5f};
at most {sub['bytes_total']:,} bytes = artifact + {sub['bytes_code']:,} bytes of code ({script_name} and config.toml),
cap {CAP_BYTES:,}. Hardware: {sub['hardware']}; {', '.join(f'{k} {v}' for k, v in sub['versions'].items())}.
{verdict}
| seed | run id | steps | train time (s) | val_loss | val_bpb | pre-quant val_bpb | artifact bytes | total bytes |
|---|---|---|---|---|---|---|---|---|
{chr(10).join(rows)}

## How to run

```bash
pip install -r requirements.txt
{launch} train.seed={sub['seeds'][0]} \\
    data.train_files='<shards>/fineweb_train_*.bin' data.val_files='<shards>/fineweb_val_*.bin' \\
    data.tokenizer=<tokenizer>.model
```

Without `--config` the script reads `config.toml` beside it: the configuration of these runs as their
logs recorded it (the data paths are those of the machine that trained; pass your own as above).
Each run writes `logs/<run_id>.txt`, its artifact to `runs/`, and prints its final JSON line.

## Files

- `{script_name}`: generated by `scripts/export_record.py` (repository commit {commit}) from `train.py`
  and the {n_modules} local modules it imports, minified (no docstrings, comments or annotations of undecorated
  functions, one space per indentation level: their line numbers are not the repository's; `python {script_name}
  --unpack src/` writes them out as files): the training code of digest {digest} (`training.sources.code_digest`). Runs were made at commit(s) {commits}, with code of digest(s) {', '.join(sub['code_digests'])}.
- `config.toml`, `requirements.txt`, `submission.json`, and one log per seed: {', '.join(f'`train_seed{s}.log`' for s in sub['seeds'])}.
"""


# ----- writing the folder -----

def check_runs(logs: list[RunLogData], code: str | None) -> list[SeedResult]:
    """The runs a record may ship: finished, within the cap, scored on all the same validation tokens, each seed
    once, each of the code being packaged (`code`, its digest; None: --allow-other-code)."""
    results = []
    for log in logs:
        final = log.require_final()
        if log.fresh_runs > 1:  # a run_id used again appends; the folder would ship every run's lines
            raise ValueError(f"{log.source}: holds {log.fresh_runs} runs appended under one run_id (hint: copy the "
                             "last run's lines, from its last `run ...` line, into a log of its own)")
        problem = final_problem(final)
        if problem:
            raise ValueError(f"{log.source}: not a scored run within the cap ({problem})")
        if log.config_value("eval.max_tokens"):
            raise ValueError(f"{log.source}: scored on the first eval.max_tokens={log.config_value('eval.max_tokens')} "
                             "validation tokens only; a record is scored on all of them (hint: eval.max_tokens=0)")
        if code is not None and log.code != code:
            ran = log.describe_code()
            raise ValueError(f"{log.source}: ran {ran}, and the train_gpt.py this would write carries code {code}: "
                             "the record would claim these scores for code that did not make them (hint: rerun the "
                             "seeds on this checkout, or --allow-other-code; the README then lists every digest)")
        results.append(SeedResult(log.config_value("train.seed"), final, log.versions, log.world_size or 1, log.code))
    seeds = [r.seed for r in results]
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"runs share a seed ({seeds}): a record's runs are independent seeds")
    check_seeds_alike([r.final for r in results], seeds, [str(log.source) for log in logs], "the record's runs")
    return results


def pinned_budget(logs: list[RunLogData]) -> int:
    """The artifact budget the runs quantized to, which the record's config pins: train_gpt.py counts config.toml as
    it is, not the bound a checkout counts for it, and left to derive its budget it would build a larger artifact
    than the runs did."""
    budgets = {log.final.get("budget_bytes") for log in logs}
    if None in budgets or len(budgets) > 1:
        raise ValueError(f"the runs' final lines give artifact budgets {sorted(map(str, budgets))}: a record pins one "
                         "(hint: seeds of one config on one checkout share it; logs from before budget_bytes was "
                         "logged cannot be packaged)")
    return budgets.pop()


def check_code_counted(logs: list[RunLogData], script: bytes, config_file: bytes) -> None:
    """A record ships no more code than each of its runs counted beside its artifact (training.shipped_code)."""
    shipped = len(script) + len(config_file)
    for log in logs:
        counted = log.final.get("code_bytes")
        if not isinstance(counted, int) or shipped > counted:
            raise ValueError(f"{log.source}: counted {counted if counted is None else f'{counted:,}'} bytes of code, "
                             f"and the record would ship {shipped:,} (train_gpt.py {len(script):,} + config.toml "
                             f"{len(config_file):,}): its artifact was budgeted beside less code than ships (hint: "
                             "export from a checkout whose train_gpt.py is the runs' (same sources, Python and brotli "
                             "versions), or rerun the seeds on this one)")


def write_record(out: Path, files: dict[str, bytes], force: bool) -> None:
    """Write `files` into a staging folder beside `out`, check the config there, then put the folder in place
    by renames. With --force the old record's other files (not its seed logs) move into the new one, and the
    old record is removed only once the new one is in place: any failure leaves `out` as it was."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise FileExistsError(f"{out} exists and is not empty (hint: --force replaces the record's files)")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.staging-", dir=out.parent))
    os.chmod(staging, 0o777 & ~current_umask())  # a plain mkdir's mode: mkdtemp's 0700 would make it private
    try:
        for name, data in files.items():
            write_atomic(staging / name, data)
        if "config.toml" in files:
            load_config(staging / "config.toml")  # the shipped code must accept the shipped config
        if out.exists():
            for kept in out.iterdir():  # the user's own additions; an earlier export's seed logs are replaced
                if kept.name in files or (kept.name.startswith("train_seed") and kept.suffix == ".log"):
                    continue
                if kept.is_dir():
                    shutil.copytree(kept, staging / kept.name, symlinks=True)
                else:
                    shutil.copy2(kept, staging / kept.name)
        replace_folder(staging, out, out.with_name(f".{out.name}.replaced"))
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def main(argv=None) -> Path:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", nargs="+", required=True, metavar="LOG", help="one finished train.py log per seed")
    p.add_argument("--out", required=True, help="the record folder, e.g. records/2026-11-22_mhc11L")
    p.add_argument("--name", help="submission name (default: the folder's name)")
    p.add_argument("--github-id", default="", help="submission.json github_id")
    p.add_argument("--baseline", nargs="+", default=[], metavar="LOG", help="logs to test the record rule against")
    p.add_argument("--force", action="store_true", help="replace the files of an existing record folder")
    p.add_argument("--allow-other-code", action="store_true",
                   help="package runs whose training code differs from this checkout's (or is unknown); the "
                        "record's README and submission.json list every digest")
    a = p.parse_args(argv)
    out = Path(a.out)
    if problem := output_problem(out, folder=True):
        p.error(f"--out {out}: {problem}")
    name = a.name or out.name
    try:
        logs = [parse_log(path) for path in a.runs]
        modules = shipped_modules(REPO)
        digest = code_digest(REPO)
        results = check_runs(logs, None if a.allow_other_code else digest)
        config = record_config(logs)
        config["quant"]["budget_bytes"] = pinned_budget(logs)
        commit = git_commit(REPO)
        script = made_script(REPO).encode()
        sig = None
        if a.baseline:
            candidate = [Scored.from_final(r.final, r.seed, str(log.source)) for r, log in zip(results, logs)]
            sig = significance(candidate, read_baseline(a.baseline, logs[0].config_value("model.vocab_size")))
        config_file = config_toml(config, f"Configuration of the runs of {name!r}, read from their logs; train.seed "
                                          "is given per run").encode()
        # The code that ships: train_gpt.py and the config.toml it trains with (as train_gpt.py counts itself);
        # build_submission refuses a seed whose artifact does not fit beside it.
        check_code_counted(logs, script, config_file)
        sub = build_submission(name, a.github_id, results, code_bytes=len(script) + len(config_file),
                               significance_block=sig)
        files = {"config.toml": config_file, "requirements.txt": requirements(modules).encode(), "train_gpt.py": script}
        files.update({f"train_seed{r.seed}.log": Path(path).read_bytes() for r, path in zip(results, a.runs)})
        files["README.md"] = readme(sub, logs, "train_gpt.py", len(modules) - 1, commit, digest).encode()
        files["submission.json"] = (json.dumps(sub, indent=2) + "\n").encode()
        write_record(out, files, a.force)
    except (LogFormatError, ConfigError, ValueError, FileNotFoundError, FileExistsError) as e:
        raise SystemExit(f"export_record: {e}") from None
    print(f"wrote {out}: {', '.join(files)} (train_gpt.py {len(script):,} bytes, {len(modules)} modules; "
          f"val_bpb {sub['val_bpb']:.5f}, {sub['bytes_total']:,} bytes)")
    return out


if __name__ == "__main__":
    main()
