"""The challenge's record rule: which finished runs may be compared, and the test that compares them.

A record must beat the best by at least 0.005 nats of val_loss, shown by a one-sided Welch t-test at p < 0.01 over
independent seeds. val_loss is nats per validation token, so two runs compare only when they scored the same
validation tokens: the same text, the same tokenizer, the whole validation set. train.py's final line says what a
run scored (`tokens`, and `bytes`, the UTF-8 bytes those tokens decode to), and both must agree on every run of
both sides. Used by scripts/reproduce.py and scripts/export_record.py.

Also here: the statistics (mean and sample standard deviation; Welch's one-sided t-test with its Student-t tail
computed here, agreeing with scipy.stats where that is importable, so nothing needs scipy) and submission.json.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from data.files import write_atomic
from quant.size import CAP_BYTES
from training.log_reader import RunLogData, parse_log


# -- statistics ---------------------------------------------------------------------------------------


def mean_std(values: list[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (None for a single value)."""
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, None
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def _beta_continued_fraction(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function, modified Lentz evaluation."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    result = d
    for m in range(1, 1000):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            result *= c * d
        if abs(c * d - 1.0) < 1e-15:
            return result
    raise ArithmeticError(f"incomplete beta did not converge for a={a}, b={b}, x={x}")


def betainc_regularized(a: float, b: float, x: float) -> float:
    """I_x(a, b), the regularized incomplete beta function, for a, b > 0 and 0 <= x <= 1."""
    if not (a > 0 and b > 0 and 0.0 <= x <= 1.0):
        raise ValueError(f"betainc_regularized needs a, b > 0 and 0 <= x <= 1, got a={a}, b={b}, x={x}")
    if x in (0.0, 1.0):
        return x
    log_front = (math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):  # the fraction converges fast on this side; use symmetry otherwise
        return math.exp(log_front) * _beta_continued_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_continued_fraction(b, a, 1.0 - x) / b


def student_t_sf(t: float, df: float) -> float:
    """P(T > t) for Student's t with df (possibly fractional) degrees of freedom."""
    if math.isinf(t):
        return 0.0 if t > 0 else 1.0
    tail = 0.5 * betainc_regularized(df / 2.0, 0.5, df / (df + t * t))
    return tail if t >= 0 else 1.0 - tail


def welch_one_sided(baseline: list[float], candidate: list[float], margin: float = 0.0) -> dict:
    """Test H1: mean(baseline) - mean(candidate) > margin, variances not assumed equal.

    scipy.stats is used when importable; the built-in Student-t tail otherwise (same numbers, tested)."""
    if len(baseline) < 2 or len(candidate) < 2:
        raise ValueError(f"Welch's t-test needs at least 2 runs per side, got {len(baseline)} baseline and "
                         f"{len(candidate)} candidate (hint: run more seeds)")
    if not all(math.isfinite(v) for v in [*baseline, *candidate]):
        raise ValueError(f"Welch's t-test needs finite values, got baseline {baseline} and candidate {candidate} "
                         "(hint: a diverged run has no score to compare)")
    mb, sb = mean_std(baseline)
    mc, sc = mean_std(candidate)
    vb, vc = sb * sb / len(baseline), sc * sc / len(candidate)
    flat = [side for side, v in (("baseline", vb), ("candidate", vc)) if v == 0.0]
    if flat:  # identical runs mean the seed changed nothing: one sample, not certainty (and t borrows the other side's
        # spread alone, which made three copies of one run a significant record)
        raise ValueError(f"Welch's t-test needs spread on each side: every {' and every '.join(flat)} run has the same "
                         f"value (baseline mean {mb!r}, candidate mean {mc!r}); hint: check that train.seed reaches the "
                         "runs (identical runs are not independent samples)")
    t = (mb - mc - margin) / math.sqrt(vb + vc)
    df = (vb + vc) ** 2 / (vb ** 2 / (len(baseline) - 1) + vc ** 2 / (len(candidate) - 1))
    try:
        from scipy import stats
    except ImportError:
        return {"t": t, "df": df, "p_value": student_t_sf(t, df), "method": "builtin"}
    result = stats.ttest_ind([v - margin for v in baseline], candidate, equal_var=False, alternative="greater")
    return {"t": float(result.statistic), "df": df, "p_value": float(result.pvalue), "method": "scipy"}


# -- which runs compare, and the rule ------------------------------------------------------------------

RECORD_MARGIN_NATS = 0.005   # a new record must beat the best by this much in val_loss ...
RECORD_ALPHA = 0.01          # ... at this one-sided significance level


class ComparisonError(ValueError):
    """Runs that the record rule cannot compare: failed, repeated, or scored on other validation tokens."""


def final_problem(final: dict) -> str | None:
    """Why a run's final JSON line cannot count as a scored run within the cap, or None."""
    if "export_error" in final:  # train.py found no artifact that fits
        return f"no artifact: {final['export_error']}"
    if final.get("total_bytes", 0) > CAP_BYTES:
        return (f"over the {CAP_BYTES:,}-byte cap: {final['total_bytes']:,} bytes "
                f"(artifact {final.get('artifact_bytes', 0):,} + code {final.get('code_bytes', 0):,})")
    if final.get("fits_cap") is False:
        return "over its config's quant.cap_bytes"
    if final.get("calib_within_budget") is False:  # the rules put calibration on training data in the budget
        return (f"training ({final.get('train_time_s', '?')} s) and calibration on training tokens "
                f"({final.get('calib_total_s', '?')} s) took longer than train.time_budget_s (hint: raise "
                "quant.calib_reserve_s or calibrate on generated text, quant.calib_source=generated)")
    missing = [key for key in ("val_loss", "val_bpb") if key not in final]
    if missing:
        return f"no {missing[0]} in its final line"
    bad = [key for key in ("val_loss", "val_bpb") if not isinstance(final[key], (int, float)) or not
           math.isfinite(final[key])]
    if bad:  # a diverged run: json writes NaN, which no test can use
        return f"{bad[0]} is {final[bad[0]]!r}, not a finite number"
    return None


@dataclass(frozen=True)
class Scored:
    """One finished run as the test sees it."""
    run_id: str
    seed: int | None
    val_loss: float
    tokens: int | None     # validation tokens scored, and the bytes they decode to (None: an older log)
    bytes: int | None
    source: str            # the log it came from, for messages

    @classmethod
    def from_final(cls, final: dict, seed: int | None, source: str) -> Scored:
        return cls(final.get("run_id", "?"), seed, final["val_loss"], final.get("tokens"), final.get("bytes"), source)


def read_baseline(paths: list[str], vocab_size: int | None = None) -> list[Scored]:
    """The baseline's runs from their logs: each finished, scored and within the cap, each an independent run
    (a log given twice, or two runs of one seed, would fake a sample and shrink the spread), all scored alike.
    With vocab_size (the candidate's model.vocab_size), a baseline of another tokenizer is refused now, before
    the candidate's runs, which the final check (check_scored_alike) would refuse after them."""
    runs, seen = [], {}
    for path in paths:
        log = parse_log(path)
        final = log.require_final()
        problem = final_problem(final)
        if problem:
            raise ComparisonError(f"--baseline {path}: a failed run ({problem}); hint: a baseline is finished runs")
        model = log.config.get("model") if isinstance(log.config.get("model"), dict) else {}
        if vocab_size is not None and model.get("vocab_size", vocab_size) != vocab_size:
            raise ComparisonError(f"--baseline {path}: model.vocab_size={model['vocab_size']}, this command's is "
                                  f"{vocab_size}: val_loss is nats per token, so another tokenizer's does not "
                                  "compare (hint: a baseline of the same tokenizer)")
        run = Scored.from_final(final, _logged_seed(log), str(path))
        for key, what in ((("log", str(Path(path).resolve())), "the same log"), (("run_id", run.run_id),
                          "the same run_id"), (("seed", run.seed) if run.seed is not None else None,
                                               f"the same seed {run.seed}")):
            if key is not None and key in seen:
                raise ComparisonError(f"--baseline {path} and {seen[key]}: {what}. A repeated run is not an "
                                      "independent sample (hint: one log per seed)")
            seen[key] = path
        _require_full_validation(log, f"--baseline {path}")
        runs.append(run)
    check_scored_alike(runs, "the baseline's runs")
    return runs


def _logged_seed(log: RunLogData) -> int | None:
    return log.config.get("train", {}).get("seed") if isinstance(log.config.get("train"), dict) else None


def _require_full_validation(log: RunLogData, what: str) -> None:
    limit = log.config.get("eval", {}).get("max_tokens") if isinstance(log.config.get("eval"), dict) else None
    if limit:
        raise ComparisonError(f"{what}: scored on the first eval.max_tokens={limit} validation tokens only; the record "
                              "rule compares whole validation sets (hint: runs with eval.max_tokens=0)")


def check_scored_alike(runs: list[Scored], what: str) -> None:
    """Every run scored the same number of validation tokens decoding to the same bytes: the same text under the
    same tokenizer. A run without the counts (a log from before they were written) is refused: unchecked, it could
    be scored on anything."""
    unknown = [r for r in runs if r.tokens is None or r.bytes is None]
    if unknown:
        raise ComparisonError(f"{unknown[0].source}: its final line has no validation `tokens`/`bytes`, so what it "
                              "scored cannot be checked (hint: a log written by this repository's train.py)")
    kinds = {(r.tokens, r.bytes) for r in runs}
    if len(kinds) > 1:
        first = runs[0]
        other = next(r for r in runs if (r.tokens, r.bytes) != (first.tokens, first.bytes))
        raise ComparisonError(
            f"{what} scored different validation data: {first.source} {first.tokens:,} tokens / {first.bytes:,} bytes, "
            f"{other.source} {other.tokens:,} / {other.bytes:,}. val_loss is nats per token, so it compares only on "
            "the same tokens (hint: the same data.val_files, tokenizer and eval.max_tokens on both sides)")


def check_trained_alike(finals: list[dict], sources: list[str], what: str) -> None:
    """Every run trained on as many shards of as many bytes, with the same sampled contents (`train_data_digest`,
    data.shards.sample_digest: sets of equal count and sizes, FineWeb's shards 0-79 and 80-159, differ there). Final
    lines from before these were logged: unchecked. The seed tools let data paths differ between machines; this is
    what stands in for them."""
    known = [(f.get("train_shards"), f.get("train_shard_bytes"), source) for f, source in zip(finals, sources)
             if f.get("train_shards") is not None]
    kinds = {(shards, size) for shards, size, _ in known}
    hint = "(hint: the same training shards on every machine, e.g. the same data.download --train-shards)"
    if len(kinds) > 1:
        first = known[0]
        other = next(k for k in known if k[:2] != first[:2])
        raise ComparisonError(f"{what} trained on different data: {first[2]} {first[0]} shards of {first[1]:,} bytes, "
                              f"{other[2]} {other[0]} of {other[1]:,} {hint}")
    sampled = [(f["train_data_digest"], source) for f, source in zip(finals, sources) if f.get("train_data_digest")]
    if len({digest for digest, _ in sampled}) > 1:
        (first, source), (other, other_source) = sampled[0], next(s for s in sampled if s[0] != sampled[0][0])
        raise ComparisonError(f"{what} trained on different data: {source} and {other_source} read shards of the "
                              f"same count and sizes but other contents (sampled digests {first}, {other}) {hint}")


def check_seeds_alike(finals: list[dict], seeds: list[int | None], sources: list[str], what: str) -> None:
    """The runs whose mean a record or a reproduction reports: scored on the same validation text and trained on
    the same data (check_scored_alike, check_trained_alike)."""
    check_scored_alike([Scored.from_final(f, seed, source) for f, seed, source in zip(finals, seeds, sources)], what)
    check_trained_alike(finals, sources, what)


def significance(candidate: list[Scored], baseline: list[Scored]) -> dict:
    """The record rule's test, and beside it the same test without the margin ("any_improvement"): whether the
    candidate is better at all, which is what comparing two layouts of one's own asks. Refuses runs that cannot be
    compared: a baseline run that is one of the candidate's, or either side scored on other validation data."""
    own = {r.run_id for r in candidate} & {r.run_id for r in baseline}
    if own:
        raise ComparisonError(f"run {sorted(own)[0]} is on both sides of the comparison (hint: --baseline takes the "
                              "logs of the runs to beat, not this command's)")
    check_scored_alike(baseline + candidate, "the candidate and the baseline")
    base_losses, cand_losses = [r.val_loss for r in baseline], [r.val_loss for r in candidate]
    test = welch_one_sided(base_losses, cand_losses, RECORD_MARGIN_NATS)
    any_gain = welch_one_sided(base_losses, cand_losses, 0.0)
    improvement = mean_std(base_losses)[0] - mean_std(cand_losses)[0]
    return {"baseline_runs": [r.run_id for r in baseline], "baseline_val_loss": mean_std(base_losses)[0],
            "improvement_nats": improvement, "required_nats": RECORD_MARGIN_NATS, "alpha": RECORD_ALPHA,
            "validation_tokens": candidate[0].tokens, "validation_bytes": candidate[0].bytes,
            "test": "Welch t, one-sided, H1: improvement > required_nats", **test,
            "is_record": improvement >= RECORD_MARGIN_NATS and test["p_value"] < RECORD_ALPHA,
            "any_improvement": {"test": "Welch t, one-sided, H1: improvement > 0", "t": any_gain["t"],
                                "p_value": any_gain["p_value"]}}


# -- submission.json -----------------------------------------------------------------------------------

@dataclass
class SeedResult:
    seed: int
    final: dict
    versions: dict = field(default_factory=dict)
    world_size: int = 1
    code: str | None = None  # the digest of the code that ran (training.sources.code_digest); None in older logs


def hardware(versions: dict, world_size: int) -> str:
    gpu = versions.get("gpu")
    return f"{world_size}x {gpu}" if gpu else f"cpu ({world_size} process{'es' if world_size > 1 else ''})"


def check_one_stack(results: list) -> None:
    """Runs that are compared, or summed into one submission, must share hardware and software versions
    (SeedResult or SeedRun: seed, versions, world_size)."""
    stacks = {json.dumps([hardware(r.versions, r.world_size), r.versions], sort_keys=True) for r in results}
    if len(stacks) > 1:
        raise ValueError("runs come from different hardware or software versions: "
                         + "; ".join(f"seed {r.seed}: {hardware(r.versions, r.world_size)} {r.versions}" for r in results))


def build_submission(name: str, github_id: str, results: list[SeedResult], *, code_bytes: int | None = None,
                     significance_block: dict | None = None) -> dict:
    """The challenge's submission.json. code_bytes replaces the runs' own count when the shipped code
    differs from what the runs measured (a record folder ships one generated train_gpt.py). A seed over the cap,
    counted with that code, is refused: the runs fitting under their own count is not enough."""
    check_one_stack(results)
    code = code_bytes if code_bytes is not None else max(r.final["code_bytes"] for r in results)
    over = [r for r in results if r.final["artifact_bytes"] + code > CAP_BYTES]
    if over:
        raise ValueError(f"seed {over[0].seed}: artifact {over[0].final['artifact_bytes']:,} + code {code:,} bytes = "
                         f"{over[0].final['artifact_bytes'] + code:,}, over the {CAP_BYTES:,}-byte cap (hint: the code "
                         "counted is what ships, a record's train_gpt.py and config.toml, else the largest of the "
                         "seeds' own counts: run the seeds on one checkout, under a quant.budget_bytes that leaves "
                         "room for it)")
    per_seed = {str(r.seed): {"run_id": r.final["run_id"], "val_bpb": r.final["val_bpb"],
                              "val_loss": r.final["val_loss"], "pre_quant_val_bpb": r.final.get("pre_quant_val_bpb"),
                              "steps": r.final["steps"], "train_time_s": r.final["train_time_s"],
                              "artifact_bytes": r.final["artifact_bytes"],
                              "bytes_total": r.final["artifact_bytes"] + code} for r in results}
    bpb_mean, bpb_std = mean_std([r.final["val_bpb"] for r in results])
    loss_mean, loss_std = mean_std([r.final["val_loss"] for r in results])
    submission = {"name": name, "github_id": github_id, "val_bpb": bpb_mean, "val_loss": loss_mean,
                  "val_bpb_std": bpb_std, "val_loss_std": loss_std,
                  "bytes_total": max(s["bytes_total"] for s in per_seed.values()), "bytes_code": code,
                  "seeds": [r.seed for r in results], "seed_results": per_seed,
                  "code_digests": sorted({r.code or "unknown" for r in results}),
                  "hardware": hardware(results[0].versions, results[0].world_size),
                  "versions": {k: results[0].versions[k] for k in ("torch", "triton", "python", "cuda")
                               if k in results[0].versions}}
    if significance_block is not None:
        submission["significance"] = significance_block
    return submission


def write_json_atomic(path: Path, value: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, (json.dumps(value, indent=2) + "\n").encode())
