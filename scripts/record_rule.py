"""The challenge's record rule: which finished runs may be compared, and the test that compares them.

A record must beat the best by at least 0.005 nats of val_loss, shown by a one-sided Welch t-test at p < 0.01 over
independent seeds. val_loss is nats per validation token, so two runs compare only when they scored the same
validation tokens: the same text, the same tokenizer, the whole validation set. train.py's final line says what a
run scored (`tokens`, and `bytes`, the UTF-8 bytes those tokens decode to), and both must agree on every run of
both sides. Used by scripts/reproduce.py and scripts/export_record.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from quant.size import CAP_BYTES
from scripts.runlog import RunLogData, parse_log
from scripts.stats import mean_std, welch_one_sided

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
