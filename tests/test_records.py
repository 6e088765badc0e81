"""training.records: Welch's test and its Student-t tail (against closed forms and scipy), the record rule on
synthetic baseline logs, what a baseline may not be, submission.json's fields, and the H100 logs kept in
docs/run_logs compared as the journal quotes them."""
import json
import math
import random
import sys
from pathlib import Path

import pytest

from conftest import REPO
from training.log_reader import parse_log
from training.records import (ComparisonError, Scored, SeedResult, betainc_regularized, build_submission,
                              read_baseline, significance, student_t_sf, welch_one_sided)

# ----- statistics -----

@pytest.mark.parametrize("t", [-30.0, -2.5, -0.3, 0.0, 0.7, 1.9, 12.0])
def test_student_t_tail_matches_closed_forms(t):
    assert student_t_sf(t, 1) == pytest.approx(0.5 - math.atan(t) / math.pi, rel=1e-12, abs=1e-15)  # Cauchy
    assert student_t_sf(t, 2) == pytest.approx(0.5 - t / (2 * math.sqrt(2 + t * t)), rel=1e-12, abs=1e-15)


def test_incomplete_beta_identities():
    assert betainc_regularized(1.0, 1.0, 0.3) == pytest.approx(0.3, rel=1e-14)        # uniform CDF
    assert betainc_regularized(2.5, 1.0, 0.4) == pytest.approx(0.4 ** 2.5, rel=1e-13)  # I_x(a, 1) = x^a
    assert betainc_regularized(3.0, 4.5, 0.2) == pytest.approx(1 - betainc_regularized(4.5, 3.0, 0.8), rel=1e-13)
    with pytest.raises(ValueError, match="0 <= x <= 1"):
        betainc_regularized(1.0, 1.0, 1.5)


def test_builtin_statistics_match_scipy(monkeypatch):
    stats = pytest.importorskip("scipy.stats")
    special = pytest.importorskip("scipy.special")
    rng = random.Random(0)
    for _ in range(300):
        a, b, x = rng.uniform(0.05, 50), rng.uniform(0.05, 50), rng.random()
        assert betainc_regularized(a, b, x) == pytest.approx(special.betainc(a, b, x), rel=1e-10, abs=1e-13)
    for t in (-8.0, -1.0, 0.2, 1.5, 4.0, 25.0):
        for df in (0.8, 2.7, 4.0, 30.0, 1000.0):
            assert student_t_sf(t, df) == pytest.approx(stats.t.sf(t, df), rel=1e-9, abs=1e-300)
    for _ in range(20):
        base = [rng.gauss(2.0, 0.01) for _ in range(rng.randint(2, 6))]
        cand = [rng.gauss(1.99, 0.02) for _ in range(rng.randint(2, 6))]
        with_scipy = welch_one_sided(base, cand, 0.005)
        monkeypatch.setitem(sys.modules, "scipy", None)  # import fails: the built-in path
        builtin = welch_one_sided(base, cand, 0.005)
        monkeypatch.delitem(sys.modules, "scipy")
        assert (with_scipy["method"], builtin["method"]) == ("scipy", "builtin")
        assert builtin["t"] == pytest.approx(with_scipy["t"], rel=1e-12)
        assert builtin["p_value"] == pytest.approx(with_scipy["p_value"], rel=1e-8, abs=1e-15)


@pytest.mark.filterwarnings("ignore:Precision loss occurred")  # scipy, on the side without spread
def test_welch_edge_cases():
    with pytest.raises(ValueError, match="at least 2 runs per side"):
        welch_one_sided([1.0], [0.9, 0.8])
    # No spread on either side: t and p are undefined. This used to give p 0 or 1 by the sign of a difference
    # within rounding of the margin (1 - 0.995 passed it, 2 - 1.995 did not): identical runs say the seed was lost.
    for base, cand in (([1.0, 1.0], [0.995, 0.995]), ([2.0, 2.0], [1.995, 1.995]), ([2.0, 2.0], [2.0, 2.0])):
        with pytest.raises(ValueError, match="needs spread on each side: every baseline and every candidate run"):
            welch_one_sided(base, cand, 0.005)
    # Nor on one side: three copies of one candidate run, against a baseline with spread, passed
    # the record rule at p 0.002 on the baseline's spread alone. Identical runs are one sample.
    with pytest.raises(ValueError, match="every candidate run has the same value"):
        welch_one_sided([2.23, 2.225, 2.227], [2.2, 2.2, 2.2], 0.005)
    with pytest.raises(ValueError, match="every baseline run has the same value"):
        welch_one_sided([2.0, 2.0], [1.0, 1.1], 0.005)
    with pytest.raises(ValueError, match="needs finite values"):  # used to fail inside the incomplete beta
        welch_one_sided([2.0, float("nan")], [1.0, 1.1])


def write_final_log(path: Path, run_id: str, val_loss: float, seed: int | None = None, tokens: int = 9_000,
                    **final_fields) -> Path:
    """A finished run's log as train.py writes it: the config line (with the seed, when given) and the final line,
    scored on `tokens` validation tokens."""
    final = {"run_id": run_id, "val_loss": val_loss, "val_bpb": val_loss / 1.7, "steps": 10, "tokens": tokens,
             "bytes": 2 * tokens, **final_fields}
    config = f"config {json.dumps({'train': {'seed': seed}})}\n" if seed is not None else ""
    path.write_text(f"run {run_id}  commit abc  world_size 8  device cuda:0\n{config}final {json.dumps(final)}\n")
    return path


def scored(losses: list[float], tokens: int = 9_000, name: str = "cand") -> list[Scored]:
    return [Scored(f"{name}-{i}", i, v, tokens, 2 * tokens, f"{name}{i}.txt") for i, v in enumerate(losses)]


@pytest.mark.parametrize("candidate, is_record", [
    ([1.900, 1.901, 1.899], True),     # 0.02 nats better, tight: a record
    ([1.916, 1.9161, 1.9159], False),  # 0.004 nats better, however tight: under the 0.005 margin
    ([1.880, 1.950, 1.900], False),    # better on average, far too noisy for p < 0.01
])
def test_record_rule_on_synthetic_baseline_logs(tmp_path, candidate, is_record):
    logs = [write_final_log(tmp_path / f"b{i}.txt", f"base-{i}", v) for i, v in enumerate([1.920, 1.9201, 1.9199])]
    sig = significance(scored(candidate), read_baseline([str(p) for p in logs]))
    assert sig["baseline_runs"] == ["base-0", "base-1", "base-2"]
    assert sig["improvement_nats"] == pytest.approx(1.920 - sum(candidate) / 3, abs=1e-12)
    assert sig["is_record"] is is_record
    assert (sig["p_value"] < 0.01) is is_record
    # without the margin each candidate is better on average, so its p is the smaller of the two
    assert sig["any_improvement"]["t"] > sig["t"] and sig["any_improvement"]["p_value"] < sig["p_value"]


def test_a_baseline_that_would_fake_or_spoil_the_test_is_refused(tmp_path):
    """The baseline used to be read for its val_loss alone: a log given three times made a zero-spread baseline and a
    tiny p; a failed run raised KeyError (no val_loss) or counted (over the cap, NaN); a run of another tokenizer or
    of a validation subset compared nats per token across different tokens."""
    def log(name, loss=1.92, seed=None, **fields):
        return str(write_final_log(tmp_path / f"{name}.txt", name, loss, seed, **fields))
    a, b = log("a", 1.92, seed=1), log("b", 1.93, seed=2)
    cases = [
        ([a, a], "a.txt and .*a.txt: the same log. A repeated run is not an independent sample"),
        ([a, log("a2", seed=1)], "a2.txt and .*a.txt: the same seed 1"),
        ([a, log("a3")], None),  # distinct run, no seed logged: accepted
        ([a, log("x", export_error="even all-int5 is over")], r"x.txt: a failed run \(no artifact: even all-int5"),
        ([a, log("y", total_bytes=16_000_001)], r"y.txt: a failed run \(over the 16,000,000-byte cap"),
        ([a, log("z", fits_cap=False)], r"z.txt: a failed run \(over its config's quant.cap_bytes"),
        ([a, log("slow", calib_within_budget=False, train_time_s=598.0, calib_total_s=7.5)],
         r"slow.txt: a failed run \(training \(598.0 s\) and calibration on training tokens \(7.5 s\) took longer"),
        ([a, log("nan", float("nan"))], r"nan.txt: a failed run \(val_loss is nan, not a finite number"),
        ([a, log("fewer", tokens=8_000)], "the baseline's runs scored different validation data: .*a.txt 9,000 tokens "
                                          "/ 18,000 bytes, .*fewer.txt 8,000 / 16,000"),
    ]
    for paths, refusal in cases:
        if refusal is None:
            assert len(read_baseline(paths)) == 2
            continue
        with pytest.raises(ComparisonError, match=refusal):
            read_baseline(paths)
    unscored = tmp_path / "old.txt"  # a final line without what it scored
    unscored.write_text(f"final {json.dumps({'run_id': 'old', 'val_loss': 1.9, 'val_bpb': 1.1})}\n")
    with pytest.raises(ComparisonError, match="old.txt: its final line has no validation `tokens`/`bytes`"):
        read_baseline([a, str(unscored)])
    missing = tmp_path / "missing.txt"
    missing.write_text(f"final {json.dumps({'run_id': 'm', 'val_bpb': 1.1})}\n")
    with pytest.raises(ComparisonError, match=r"missing.txt: a failed run \(no val_loss in its final line"):
        read_baseline([a, str(missing)])
    # what the log's config says: another tokenizer (refused before any seed runs), a validation subset
    other = tmp_path / "sp8192.txt"
    other.write_text(f"config {json.dumps({'model': {'vocab_size': 8192}, 'train': {'seed': 5}})}\n"
                     + Path(b).read_text().splitlines()[-1] + "\n")
    with pytest.raises(ComparisonError, match="sp8192.txt: model.vocab_size=8192, this command's is 1024"):
        read_baseline([a, str(other)], vocab_size=1024)
    subset = tmp_path / "subset.txt"
    subset.write_text(f"config {json.dumps({'eval': {'max_tokens': 1000}, 'train': {'seed': 6}})}\n"
                      + Path(b).read_text().splitlines()[-1] + "\n")
    with pytest.raises(ComparisonError, match="subset.txt: scored on the first eval.max_tokens=1000 validation"):
        read_baseline([a, str(subset)])


def test_significance_refuses_runs_scored_on_other_tokens_or_on_both_sides(tmp_path):
    base = scored([1.92, 1.93], name="base")
    with pytest.raises(ComparisonError, match="the candidate and the baseline scored different validation data"):
        significance(scored([1.90, 1.91], tokens=8_000), base)
    with pytest.raises(ComparisonError, match="run base-1 is on both sides of the comparison"):
        significance([*scored([1.90]), base[1]], base)
    assert significance(scored([1.90, 1.91]), base)["validation_tokens"] == 9_000


# ----- submission.json -----

def final(seed: int, val_loss: float, artifact: int, code: int = 60_000) -> dict:
    return {"run_id": f"r-s{seed}", "val_loss": val_loss, "val_bpb": val_loss / 1.7, "pre_quant_val_bpb": 1.0,
            "steps": 100, "train_time_s": 599.5, "artifact_bytes": artifact, "code_bytes": code,
            "total_bytes": artifact + code}


def test_submission_fields():
    gpu = {"python": "3.11.7", "torch": "2.11.0", "triton": "3.6.0", "cuda": "12.8", "gpu": "NVIDIA H100 80GB HBM3"}
    results = [SeedResult(1, final(1, 1.90, 15_000_000), gpu, 8), SeedResult(2, final(2, 1.92, 15_100_000), gpu, 8)]
    sub = build_submission("mhc", "me", results, significance_block={"is_record": False})
    assert sub["name"] == "mhc" and sub["github_id"] == "me" and sub["seeds"] == [1, 2]
    assert sub["val_loss"] == pytest.approx(1.91) and sub["val_bpb"] == pytest.approx(1.91 / 1.7)
    assert sub["val_loss_std"] == pytest.approx(math.sqrt(2 * 0.01 ** 2))
    assert sub["bytes_total"] == 15_160_000 and sub["bytes_code"] == 60_000
    assert sub["seed_results"]["2"]["bytes_total"] == 15_160_000 and sub["seed_results"]["1"]["run_id"] == "r-s1"
    assert sub["hardware"] == "8x NVIDIA H100 80GB HBM3"
    assert sub["versions"] == {"torch": "2.11.0", "triton": "3.6.0", "python": "3.11.7", "cuda": "12.8"}
    assert sub["significance"] == {"is_record": False}
    shipped = build_submission("mhc", "me", results, code_bytes=250_000)  # a record's generated script
    assert shipped["bytes_code"] == 250_000 and shipped["bytes_total"] == 15_350_000
    with pytest.raises(ValueError, match="different hardware or software"):
        build_submission("mhc", "me", [results[0], SeedResult(3, final(3, 1.9, 1), {**gpu, "torch": "2.12"}, 8)])
    assert sub["code_digests"] == ["unknown"]  # SeedResults without a digest (logs from before it)
    digests = [SeedResult(r.seed, r.final, gpu, 8, code) for r, code in zip(results, ("b" * 16, "a" * 16))]
    assert build_submission("mhc", "me", digests)["code_digests"] == ["a" * 16, "b" * 16]
    # Every seed fit under its own count, but with the largest code counted one does not (seeds
    # reused from other code, 15,993,686 and 15,908,547 bytes, made a 16,003,547-byte submission).
    near = [SeedResult(1, final(1, 1.9, 15_993_686 - 60_000), gpu, 8),
            SeedResult(2, {**final(2, 1.9, 15_908_547 - 150_000), "code_bytes": 150_000}, gpu, 8)]
    with pytest.raises(ValueError, match=r"seed 1: artifact 15,933,686 \+ code 150,000 bytes = 16,083,686, over the "
                                         r"16,000,000-byte cap"):
        build_submission("mhc", "me", near)


# docs/run_logs/README.md: (n_streams, mhc_blocks), val_bpb per seed, and the mean docs/journal.md quotes.
KEPT_GPU_LOGS = {
    "n1": ((1, 0), {1337: 1.3139540611233271, 42: 1.3106258461496454, 2025: 1.3121527697526691}, 1.31224),
    "n2k3": ((2, 3), {1337: 1.3113889330099047, 42: 1.314503399280887, 2025: 1.311754911793264}, 1.31255),
    "unet17": ((2, 3), {1337: 1.3115338494851583, 42: 1.3148200896244573, 2025: 1.3132908139004342}, 1.31321),
}


def kept_gpu_log_paths(name: str) -> list[Path]:
    return [REPO / "docs" / "run_logs" / f"{name}-s{seed}.txt" for seed in KEPT_GPU_LOGS[name][1]]


@pytest.mark.parametrize("name", sorted(KEPT_GPU_LOGS))
def test_the_kept_h100_logs_make_one_submission(name):
    """The GPU logs kept in docs/run_logs (train.py's own output on an H100, read by a later
    comparison as --baseline or through --reuse) still parse as finished single-GPU runs of one software
    stack and layout, and give the val_bpb that docs/journal.md quotes."""
    (n_streams, mhc_blocks), per_seed, mean_bpb = KEPT_GPU_LOGS[name]
    results = []
    for (seed, val_bpb), path in zip(per_seed.items(), kept_gpu_log_paths(name)):
        log = parse_log(path)
        assert log.final is not None and log.final["run_id"] == f"{name}-s{seed}" and log.final["fits_cap"]
        assert log.final["val_bpb"] == val_bpb and log.config["train"]["seed"] == seed
        assert (log.config["model"]["n_streams"], log.config["model"]["mhc_blocks"]) == (n_streams, mhc_blocks)
        results.append(SeedResult(seed, log.final, log.versions, log.world_size))
    sub = build_submission(name, "me", results)
    assert sub["hardware"] == "1x NVIDIA H100 80GB HBM3" and sub["versions"]["torch"].startswith("2.11")
    assert sub["seeds"] == [1337, 42, 2025] and sub["val_bpb"] == pytest.approx(mean_bpb, abs=1e-5)


def test_the_kept_layouts_compare_as_reproduce_reported():
    """h100_short's layout against the plain residual, as `reproduce --baseline` printed on the H100: 0.00052
    nats worse in mean val_loss, far from the record rule's 0.005 (Welch t -2.364, p 0.961)."""
    baseline = read_baseline([str(p) for p in kept_gpu_log_paths("n1")], vocab_size=1024)
    candidate = read_baseline([str(p) for p in kept_gpu_log_paths("n2k3")])
    sig = significance(candidate, baseline)
    assert sig["baseline_runs"] == ["n1-s1337", "n1-s42", "n1-s2025"] and not sig["is_record"]
    assert (sig["validation_tokens"], sig["validation_bytes"]) == (392_053, 959_913)  # dev_val, both sides
    assert sig["improvement_nats"] == pytest.approx(-0.000517, abs=1e-6)
    assert sig["t"] == pytest.approx(-2.364, abs=1e-3) and sig["p_value"] == pytest.approx(0.961, abs=1e-3)
    # and no gain at all: the README's t -0.22 (p 0.58) for "any improvement"
    gain = sig["any_improvement"]
    assert gain["t"] == pytest.approx(-0.2217, abs=1e-4) and gain["p_value"] == pytest.approx(0.5823, abs=1e-4)
    # the runs of h100_short's layout with the U-Net skips rewired, as reproduce printed them on the H100
    rewired = significance(read_baseline([str(p) for p in kept_gpu_log_paths("unet17")]), baseline)
    assert rewired["improvement_nats"] == pytest.approx(-0.00165, abs=1e-5) and not rewired["is_record"]
    assert rewired["t"] == pytest.approx(-2.898, abs=1e-3) and rewired["p_value"] == pytest.approx(0.9779, abs=1e-4)
    assert rewired["any_improvement"]["t"] == pytest.approx(-0.718, abs=1e-3)
