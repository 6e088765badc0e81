r"""Run one config over several seeds, summarize, test against a baseline, write submission.json.

    python -m scripts.reproduce --config configs/record_8xh100.toml --seeds 1337,42,2025 \
        --nproc-per-node 8 --baseline logs/base-s1.txt logs/base-s2.txt logs/base-s3.txt \
        --name "mHC 11L" --github-id me --out records/draft -- train.time_budget_s=600

Each seed runs `python train.py --config C train.seed=S train.run_id=<name>-s<S> [overrides]` (through
torch.distributed.run with --nproc-per-node) and is read back from its last stdout line. The record
rule of the challenge: the mean val_loss must beat the baseline's by at least 0.005 nats, shown by a
one-sided Welch t-test at p < 0.01 (printed beside the same test without the margin: better at all?).
A failed run, or one over the 16,000,000-byte cap, makes the exit status non-zero and no submission.json
is written. So does a baseline that cannot be compared with the seeds (training/records.py: other
validation tokens, a repeated or failed baseline run); the logs stay, and --reuse compares them again.

A seed whose log (<train.log_dir>/<run_id>.txt) already exists is refused up front: train.py appends to
its log, so a second run would mix two trajectories in one file. With --reuse a finished run there is
read back instead of run again, after checking that the log's config is this command's (folders, run id and
report intervals aside; the artifact budget as the run had it), that it ran on as many processes, and that it
succeeded. An unfinished one is
continued from its checkpoint when the overrides hold train.resume=latest. So seeds run on several
machines, or before an interruption, come together: copy their logs into the log folder and run the
same command with --reuse.
"""
from __future__ import annotations

import argparse
import json
import re
import shlex
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

from training.config import Config, ConfigError, flat_config, load_config, to_dict
from training.export import artifact_budget
from training.records import (RECORD_MARGIN_NATS, ComparisonError, Scored, SeedResult, build_submission,
                              check_one_stack, check_seeds_alike, final_problem, mean_std, read_baseline,
                              significance, write_json_atomic)
from training.run_log import log_path
from training.log_reader import LogFormatError, RunLogData, output_problem, parse_lines, parse_log, stream_run
from training.sources import code_digest
from training.variants import parse_seeds

REPO = Path(__file__).resolve().parents[1]
SET_BY_SCRIPT = ("train.seed=", "train.run_id=")


# ----- running the seeds -----

@dataclass
class SeedRun:
    seed: int
    run_id: str
    command: list[str]
    returncode: int | None = None
    final: dict | None = None
    versions: dict = field(default_factory=dict)
    world_size: int = 1
    code: str | None = None  # the digest its log gives for the code that ran
    reused: bool = False  # read back from an existing log (--reuse), not run by this call

    def problem(self) -> str | None:
        """Why this run cannot count, or None."""
        f = self.final
        why = final_problem(f) if f is not None else None
        if why and ("export_error" in f or "total_bytes" in f):  # train.py's own account beats its exit status
            return why
        if self.returncode != 0:
            return f"train.py exited with status {self.returncode}"
        if f is None or "val_bpb" not in f:
            return "no final JSON line with val_bpb on stdout"
        return why

    def scored(self) -> Scored:
        return Scored.from_final(self.final, self.seed, self.run_id)


def train_command(config: str, seed: int, run_id: str, overrides: list[str], nproc: int | None) -> list[str]:
    launcher = [sys.executable]
    if nproc:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return [*launcher, str(REPO / "train.py"), "--config", config, f"train.seed={seed}", f"train.run_id={run_id}",
            *overrides]


def run_seed(run: SeedRun, signals: list[int] | None = None) -> SeedRun:
    """Stream the run's stdout (stderr passes straight through); the last line is the final JSON. A stop signal
    goes to the run (it checkpoints) and into `signals`."""
    run.returncode, lines, run.final = stream_run(run.command, f"seed {run.seed}", signals=signals)
    log = parse_lines(lines[:-1], f"stdout of seed {run.seed}")
    run.versions, run.world_size, run.code = log.versions, log.world_size or 1, log.code
    return run


# Where a run's files go and how often it reports: two runs of one config may differ here (another
# machine's folders, a resumed run) and still compute the same thing.
# Data paths too: the same shards sit at other paths on other machines (what the runs scored is compared instead:
# the validation tokens and bytes of every seed). And the run id: it names the log and the artifact, so a log run
# under another name counts once it is copied to this command's name for its seed.
RUN_ONLY_KEYS = ("train.run_id", "train.resume", "train.log_dir", "train.out_dir", "train.log_every",
                 "train.checkpoint_every", "train.checkpoint_keep", "train.wandb", "train.wandb_project", "train.device",
                 "data.train_files", "data.val_files", "data.tokenizer")


def config_differences(logged: dict, expected: dict, ignore: tuple[str, ...] = ()) -> list[str]:
    """The dotted keys where a log's config line differs from the config this command would run, leaving out
    RUN_ONLY_KEYS and `ignore` (keys the caller compares another way). An option the log does not have (newer than
    the run) counts as equal while this command leaves it at its default, which is what the run did before the
    option existed."""
    a, b, default = flat_config(logged), flat_config(expected), flat_config(to_dict(Config()))
    absent = "<absent>"
    return [f"{key}: log {a.get(key, absent)!r}, this command {b.get(key, absent)!r}"
            for key in sorted(set(a) | set(b))
            if key not in RUN_ONLY_KEYS and key not in ignore and a.get(key, absent) != b.get(key, absent)
            and not (key not in a and key in default and b.get(key) == default[key])]


def budget_difference(had: int, cfg: Config) -> list[str]:
    """quant.budget_bytes=0 derives the artifact's budget from the code a checkout counts, so the key says neither
    what a run had nor what this command would give: the budgets themselves are compared (the run's from its final
    record). A run whose budget was derived counts for a command that pins the same number, and a derived budget
    that moved with the code does not count (unless --allow-other-code, which counts the runs of other code with
    the budgets that code gave them)."""
    would = cfg.quant.budget_bytes or artifact_budget(cfg)[0]
    if had == would:
        return []
    how = "pinned" if cfg.quant.budget_bytes else "quant.cap_bytes less this checkout's counted code and the margin"
    return [f"quant.budget_bytes: the run's artifact budget was {had:,} bytes, this command's is {would:,} ({how}); "
            f"hint: quant.budget_bytes={had} after -- compares at the run's budget"]


def reuse_seed(run: SeedRun, log: RunLogData, config: str, overrides: list[str], world_size: int,
               code: str | None) -> SeedRun:
    """Count a finished run of this seed from its log, after checking that it is a run of this command's
    config on as many processes, of the code at hand (`code`, its digest; None: any code, --allow-other-code),
    and that it succeeded (a failed run is not silently counted)."""
    path = log.source
    if code is not None and log.code != code:
        ran = log.describe_code()
        raise SystemExit(f"reproduce: {path} ran {ran}, this checkout's training code is {code}: counted with the "
                         "seeds run now, it would mix two recipes under one submission. hint: move the log away to "
                         "run the seed again, or --allow-other-code to count it anyway (submission.json lists the "
                         "digests)")
    cfg = load_config(config, [*overrides, f"train.seed={run.seed}", f"train.run_id={run.run_id}"])
    # A log's final record holds the budget its artifact had: that is compared instead of the key (older logs lack
    # it, and their key is compared). With --allow-other-code, a budget both sides derive from their code moved with
    # the code the user chose to count, so it is not compared.
    had_budget = log.final.get("budget_bytes")
    ignore = ("quant.budget_bytes",) if had_budget is not None else ()
    # through JSON as train.py logged it (tuples become lists), so equal values compare equal
    differences = config_differences(log.config, json.loads(json.dumps(to_dict(cfg))), ignore)
    both_derived = cfg.quant.budget_bytes == 0 and log.config.get("quant", {}).get("budget_bytes") == 0
    if had_budget is not None and not (code is None and both_derived):
        differences += budget_difference(had_budget, cfg)
    if differences:
        raise SystemExit(f"reproduce: {path} is a run of another config, so --reuse cannot count it for seed "
                         f"{run.seed}:\n  " + "\n  ".join(differences) + "\nhint: pass the same --config and "
                         "overrides as the run had, or move the log away to run the seed again")
    if (log.world_size or 1) != world_size:
        raise SystemExit(f"reproduce: {path} ran on {log.world_size or 1} process(es), this command runs {world_size} "
                         "(--nproc-per-node): the same global batch splits differently. hint: the run's "
                         "--nproc-per-node, or move the log away to run the seed again")
    run.returncode, run.final, run.reused = 0, log.final, True
    run.versions, run.world_size, run.code = log.versions, log.world_size or 1, log.code
    failure = run.problem()
    if failure:
        raise SystemExit(f"reproduce: {path} is a failed run of seed {run.seed} ({failure}); hint: move it away to "
                         "run that seed again")
    return run


def check_existing_logs(runs: list[SeedRun], log_dir: str, *, reuse: bool, resume: bool, config: str,
                        overrides: list[str], world_size: int, code: str | None) -> None:
    """Before anything runs: each seed's log is absent; or it holds a finished run of this config, counted
    with reuse; or an unfinished one that train.resume continues (train.py appends to the log)."""
    for run in runs:
        path = log_path(log_dir, run.run_id)
        if not path.exists():
            continue
        log = parse_log(path)
        if log.final is None:  # interrupted, or another run appended after a finished one
            if resume:
                continue
            raise SystemExit(f"reproduce: {path} holds an unfinished run of seed {run.seed}; hint: "
                             "train.resume=latest continues it from its last checkpoint, or move the log away to "
                             "start the seed again")
        if not reuse:
            raise SystemExit(f"reproduce: {path} already exists (a finished run of seed {run.seed}); train.py would "
                             "append this run to it. hint: --reuse counts that run, --name gives new run ids, or "
                             "move the file away")
        reuse_seed(run, log, config, overrides, world_size, code)
    try:
        check_one_stack([r for r in runs if r.reused])
    except ValueError as e:
        raise SystemExit(f"reproduce: the reused logs: {e}") from None


def print_summary(runs: list[SeedRun], sig: dict | None) -> None:
    print(f"\n{'seed':>8} {'run_id':<28} {'val_loss':>10} {'val_bpb':>10} {'total bytes':>12}  status")
    for r in runs:
        f = r.final or {}
        print(f"{r.seed:>8} {r.run_id:<28} {f.get('val_loss', float('nan')):>10.5f} "
              f"{f.get('val_bpb', float('nan')):>10.5f} {f.get('total_bytes', 0):>12,}  "
              f"{r.problem() or 'ok'}{' (from its log)' if r.reused else ''}")
    good = [r.final for r in runs if r.problem() is None]
    for key in ("val_loss", "val_bpb") if good else ():
        mean, std = mean_std([f[key] for f in good])
        print(f"{key}: mean {mean:.5f}, std {'n/a' if std is None else f'{std:.5f}'} over {len(good)} seed(s)")
    if sig is not None:
        print(f"vs baseline {sig['baseline_val_loss']:.5f}: improvement {sig['improvement_nats']:+.5f} nats "
              f"(need >= {RECORD_MARGIN_NATS}), t {sig['t']:.3f}, p {sig['p_value']:.4g} ({sig['method']}): "
              + ("RECORD" if sig["is_record"] else "not a record"))
        gain = sig["any_improvement"]
        print(f"without the margin (any improvement): t {gain['t']:.3f}, p {gain['p_value']:.4g}")


def override_hint(arg: str, otherwise: str = "") -> str:
    """An argument that looks like a config override landed in argparse: it belongs after --."""
    return f" (hint: config overrides go after --, e.g. -- {arg})" if "=" in arg else otherwise


def parse_args(argv: list[str]) -> argparse.Namespace:
    argv, overrides = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                usage="%(prog)s --config C --seeds S1,S2,... [options] [-- section.key=value ...]")
    p.add_argument("--config", required=True, help="train.py config (TOML)")
    p.add_argument("--seeds", required=True, type=parse_seeds, help="comma-separated, e.g. 1337,42,2025")
    p.add_argument("--baseline", nargs="+", default=[], metavar="LOG", help="final logs of the runs to beat")
    p.add_argument("--out", help="folder for submission.json (default: runs/reproduce-<name>)")
    p.add_argument("--name", help="submission name; run ids are <name>-s<seed> (default: the config's stem)")
    p.add_argument("--github-id", default="", help="submission.json github_id")
    p.add_argument("--nproc-per-node", type=int, help="launch each seed with torch.distributed.run on N processes")
    p.add_argument("--reuse", action="store_true",
                   help="read back the seeds whose logs already hold a finished run of this config (run "
                        "elsewhere, or before an interruption) and run only the others")
    p.add_argument("--allow-other-code", action="store_true",
                   help="with --reuse, count logs of runs whose training code differs from this checkout's (or is "
                        "unknown), with the artifact budget that code derived; submission.json lists every digest")
    p.add_argument("--dry-run", action="store_true",
                   help="print the commands and exit (reads neither the config nor the logs, so it also lists "
                        "the seeds --reuse would read back)")
    a, unknown = p.parse_known_args(argv)
    if unknown:
        p.error(f"unrecognized arguments: {' '.join(unknown)}{override_hint(unknown[0])}")
    a.overrides = overrides
    a.name = a.name or Path(a.config).stem
    for o in overrides:
        if o.startswith(SET_BY_SCRIPT):
            p.error(f"override {o!r}: train.seed and train.run_id are set per seed by this script")
    missing = [log for log in a.baseline if not Path(log).is_file()]
    if missing:  # a shell glob that matched nothing arrives as the pattern itself (checked before counting them)
        p.error(f"--baseline {missing[0]}: no such log file"
                + override_hint(missing[0], " (hint: train.py writes <train.log_dir>/<run_id>.txt)"))
    if a.baseline and (len(a.baseline) < 2 or len(a.seeds) < 2):
        p.error(f"--baseline with {len(a.baseline)} log(s) and {len(a.seeds)} seed(s): Welch's t-test needs at "
                "least 2 runs on each side")
    if a.nproc_per_node is not None and a.nproc_per_node < 1:
        p.error(f"--nproc-per-node {a.nproc_per_node}: expected >= 1 (processes per seed)")
    if a.out and (problem := output_problem(a.out, folder=True)):  # before the seeds run, not after
        p.error(f"--out {a.out}: {problem}")
    return a


def main(argv=None) -> int:
    a = parse_args(sys.argv[1:] if argv is None else list(argv))
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", a.name).strip("-") or "run"
    runs = [SeedRun(s, f"{slug}-s{s}", train_command(a.config, s, f"{slug}-s{s}", a.overrides, a.nproc_per_node))
            for s in a.seeds]
    if a.dry_run:
        for r in runs:
            print(shlex.join(r.command))
        return 0
    try:
        # a typo fails now, not after the first seed's hours (as seed 1 will run: train.resume needs a run id)
        cfg = load_config(a.config, [*a.overrides, f"train.seed={runs[0].seed}", f"train.run_id={runs[0].run_id}"])
        if cfg.eval.max_tokens:  # a submission, and the record rule, score the whole validation set
            raise ConfigError(f"eval.max_tokens={cfg.eval.max_tokens} scores the first tokens of the validation set "
                              "only; seeds for a submission are scored on all of it (hint: eval.max_tokens=0; "
                              "scripts/ablate.py compares layouts on a subset)")
        baseline = read_baseline(a.baseline, cfg.model.vocab_size) if a.baseline else None
        code = None if a.allow_other_code else code_digest(REPO)
        check_existing_logs(runs, cfg.train.log_dir, reuse=a.reuse, resume=bool(cfg.train.resume),
                            config=a.config, overrides=a.overrides, world_size=a.nproc_per_node or 1, code=code)
    except (ConfigError, LogFormatError, FileNotFoundError, ComparisonError) as e:
        raise SystemExit(f"reproduce: {e}") from None
    signals: list[int] = []
    for r in runs:
        if not r.reused:
            run_seed(r, signals)
        if signals:  # the seed checkpointed and stopped: no next seed, and the way back in
            print(f"reproduce: stopped by a signal during seed {r.seed} (exit status {r.returncode}); hint: the same "
                  "command with --reuse, and train.resume=latest after --, continues it from its checkpoint (a second "
                  "signal stopped it without one: it then starts over) and runs the other seeds", file=sys.stderr)
            return 130 if signals[0] == signal.SIGINT else 143
    good = [r for r in runs if r.problem() is None]
    sig, not_compared = None, None
    # what to do when no submission.json is written for a reason other than a failed seed
    hint = "the seeds' logs stay; --reuse with another --baseline compares them without running them again"
    if code is not None and len({r.code for r in good}) > 1:  # the checkout changed while the seeds ran
        not_compared = "the seeds ran different code: " + ", ".join(f"seed {r.seed} {r.code}" for r in good)
        hint = "leave the checkout alone while seeds run, or count them with --reuse --allow-other-code"
    elif len(good) == len(runs) > 1:  # the mean of runs scored on different text means nothing
        try:
            check_seeds_alike([r.final for r in good], [r.seed for r in good], [r.run_id for r in good], "the seeds")
        except ComparisonError as e:
            not_compared, hint = str(e), "run every seed on the same shards and tokenizer"
    if not_compared:
        pass
    elif baseline is not None and len(good) < len(runs):  # a verdict on the seeds that survived would hide the others
        not_compared = f"not compared with the baseline: {len(runs) - len(good)} of {len(runs)} seed(s) failed"
    elif baseline is not None:
        try:
            sig = significance([r.scored() for r in runs], baseline)
        except (ComparisonError, ValueError) as e:
            not_compared = f"not compared with the baseline: {e}"
    print_summary(runs, sig)
    print("logs: " + " ".join(str(log_path(cfg.train.log_dir, r.run_id)) for r in runs))
    if not_compared:
        print(not_compared, file=sys.stderr)
    if len(good) < len(runs):
        print(f"{len(runs) - len(good)} of {len(runs)} seed(s) failed; no submission.json written", file=sys.stderr)
        return 1
    if not_compared:
        print(f"no submission.json written (hint: {hint})", file=sys.stderr)
        return 1
    try:
        submission = build_submission(a.name, a.github_id, [SeedResult(r.seed, r.final, r.versions, r.world_size,
                                                                      r.code) for r in runs], significance_block=sig)
    except ValueError as e:  # e.g. seeds reused from another machine's software than the ones run here
        print(f"reproduce: {e}; no submission.json written", file=sys.stderr)
        return 1
    out = Path(a.out or REPO / cfg.train.out_dir / f"reproduce-{slug}") / "submission.json"
    write_json_atomic(out, submission)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
