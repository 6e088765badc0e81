"""Bit allocation under a byte budget measured on real artifacts."""
import numpy as np
import pytest
import torch

from quant.allocate import BudgetError, allocate_bits, allocation_log, assignment, rank_by_sensitivity
from quant.container import ChunkCache, build_artifact
from quant.gptq import rtn_quantize

META = {"model_config": {"tiny": 1}, "tokenizer_sha256": "ab" * 32}


@pytest.fixture(scope="module")
def matrices():
    """Eight matrices of different sizes, quantized to int5 and int6 once."""
    g = torch.Generator().manual_seed(0)
    shapes = [(16, 32), (32, 32), (48, 16), (8, 64), (24, 24), (40, 8), (16, 16), (32, 48)]
    out = {}
    for i, shape in enumerate(shapes):
        w = torch.randn(*shape, generator=g)
        out[f"m{i}.weight"] = {b: rtn_quantize(w, b)[0] for b in (5, 6)}
    return out


def real_size_of(matrices, cache):
    extra = {"norm.weight": np.ones(8, np.float16)}

    def size_of(bits):
        # in a fixed order, as the exporter composes them: the compressed header depends on the order
        quantized = {name: matrices[name][bits[name]] for name in matrices} | extra
        return len(build_artifact(META, quantized, "lzma", "byte", cache, threads=1))
    return size_of


def test_never_exceeds_budget_and_takes_the_largest_prefix(matrices):
    cache = ChunkCache()
    size_of = real_size_of(matrices, cache)
    rng = np.random.default_rng(1)
    low = size_of(dict.fromkeys(matrices, 5))
    high = size_of(dict.fromkeys(matrices, 6))
    assert high > low
    for trial in range(12):
        sens = {name: float(rng.exponential()) for name in matrices}
        budget = int(rng.integers(low, high + 50)) if trial else low  # trial 0: exactly the all-int5 size
        bits, size, probes = allocate_bits(sens, size_of, budget)
        assert size <= budget and size == size_of(bits)
        assert all(p["fits"] == (p["artifact_bytes"] <= budget) for p in probes)
        order = rank_by_sensitivity(sens)
        k = sum(b == 6 for b in bits.values())
        assert bits == assignment(order, k)  # int6 goes to a prefix of the sensitivity ranking
        if k < len(order):  # one more int6 matrix would not fit
            assert size_of(assignment(order, k + 1)) > budget


def test_prefers_int6_for_the_most_sensitive():
    sizes = {f"m{i}": 100 for i in range(6)}
    size_of = lambda bits: sum(sizes[n] + (20 if b == 6 else 0) for n, b in bits.items())  # noqa: E731
    sens = {"m0": 0.1, "m1": 5.0, "m2": 0.3, "m3": 9.0, "m4": 0.2, "m5": 1.0}
    bits, size, _ = allocate_bits(sens, size_of, budget_bytes=600 + 3 * 20 + 5)
    assert {n for n, b in bits.items() if b == 6} == {"m3", "m1", "m5"}
    assert size == 660
    bits, size, probes = allocate_bits(sens, size_of, budget_bytes=10_000)
    assert set(bits.values()) == {6} and len(probes) == 2  # all-int6 fits: two measurements only


def test_budget_error_says_by_how_much():
    size_of = lambda bits: 1000 + 10 * sum(b == 6 for b in bits.values())  # noqa: E731
    with pytest.raises(BudgetError, match=r"1000-byte artifact, over the budget of 900 bytes by 100 bytes"):
        allocate_bits({"a": 1.0, "b": 2.0}, size_of, 900)
    with pytest.raises(ValueError, match="no matrices"):
        allocate_bits({}, size_of, 900)


def test_allocation_log_lists_every_matrix_in_rank_order():
    sens = {"x": 1.0, "y": 3.0, "z": 2.0}
    rows = allocation_log(sens, {"x": 5, "y": 6, "z": 5}, {"y": {"err5": 0.5}})
    assert [r["name"] for r in rows] == ["y", "z", "x"]
    assert [r["rank"] for r in rows] == [0, 1, 2]
    assert rows[0] == {"rank": 0, "name": "y", "bits": 6, "sensitivity": 3.0, "err5": 0.5}


def test_int4_fallback_demotes_the_cheapest_fewest_matrices():
    """All-int5 is over the budget: the matrices whose int4 step costs least go to int4, as few as fit."""
    sizes = {f"m{i}": 100 for i in range(6)}
    step = {4: -30, 5: 0, 6: 20}
    size_of = lambda bits: sum(sizes[n] + step[b] for n, b in bits.items())  # noqa: E731
    sens = {f"m{i}": 1.0 for i in range(6)}
    demotion = {"m0": 3.0, "m1": 0.5, "m2": 9.0, "m3": 0.1, "m4": 2.0, "m5": 7.0}
    for budget, expect in [(600 - 60, {"m3", "m1"}), (600 - 61, {"m3", "m1", "m4"}), (600 - 180, set(sizes))]:
        bits, size, probes = allocate_bits(sens, size_of, budget, demotion)
        assert {n for n, b in bits.items() if b == 4} == expect
        assert set(bits.values()) <= {4, 5} and size == size_of(bits) <= budget
        assert probes[0] == {"n_int6": 0, "n_int4": 0, "artifact_bytes": 600, "fits": False}
        assert all(p["fits"] == (p["artifact_bytes"] <= budget) for p in probes)
    with pytest.raises(BudgetError, match=r"all-int4 \(6 matrices\) makes a 420-byte artifact.*by 1 bytes"):
        allocate_bits(sens, size_of, 419, demotion)
    # When all-int5 fits, the fallback table changes nothing: int5/int6 as without it.
    assert allocate_bits(sens, size_of, 700, demotion) == allocate_bits(sens, size_of, 700)


def test_the_bytes_a_prefix_leaves_are_filled_in_its_order():
    """The prefix stops at the first matrix that does not fit, but a smaller one after it may (the 72 KB a 60 s
    H100 run left unused with 11 matrices at int4): given chunk sizes, they are filled in the ranking's order."""
    numel = {"big": 100, "mid": 60, "small": 10, "tiny": 5}
    step = {4: -0.3, 5: 0.0, 6: 0.2}
    chunk = lambda name, bits: int(numel[name] * (1 + step[bits]))  # noqa: E731
    size_of = lambda bits: sum(chunk(n, b) for n, b in bits.items())  # noqa: E731
    sens = {"big": 9.0, "mid": 5.0, "small": 3.0, "tiny": 1.0}
    base = size_of(dict.fromkeys(numel, 5))  # 175
    bits, size, probes = allocate_bits(sens, size_of, base + 14)  # big (+20) and mid (+12 after it) ...
    assert bits == assignment(rank_by_sensitivity(sens), 0)  # ... the prefix alone: nothing, 14 bytes unused
    bits, size, probes = allocate_bits(sens, size_of, base + 14, chunk_size=chunk)
    assert bits == {"big": 5, "mid": 6, "small": 6, "tiny": 5} and size == base + 14 == size_of(bits)
    assert [p["fill"] for p in probes if "fill" in p] == [True, True]  # mid, then small; tiny no longer fits
    # int4 fallback: the cheapest demotions go first (tiny, small, then big to fit); the 4 bytes big's step left
    # take back the costliest demotion that fits (small, 3 bytes), not tiny (2 more would be over)
    demotion = {"tiny": 0.5, "small": 0.6, "big": 1.0, "mid": 2.0}
    bits, size, _ = allocate_bits(sens, size_of, base - 31, demotion)
    assert bits == {"big": 4, "mid": 5, "small": 4, "tiny": 4} and size == base - 35
    bits, size, _ = allocate_bits(sens, size_of, base - 31, demotion, chunk)
    assert bits == {"big": 4, "mid": 5, "small": 5, "tiny": 4} and size == base - 32 == size_of(bits)


def test_the_fill_takes_no_step_that_adds_error_and_rebuilds_nothing_it_measured():
    """A matrix GPTQ fits no better at int6 (sensitivity <= 0) went to int6 when bytes were left;
    and the fill rebuilt assignments the search had measured already."""
    numel = {"a": 100, "b": 10}
    chunk = lambda name, bits: numel[name] + (numel[name] // 5 if bits == 6 else 0)  # noqa: E731
    builds = []

    def size_of(bits):
        builds.append(dict(bits))
        return sum(chunk(n, b) for n, b in bits.items())
    bits, size, _ = allocate_bits({"a": 1.0, "b": -0.5}, size_of, 115, chunk_size=chunk)
    assert bits == {"a": 5, "b": 5} and size == 110  # b's int6 (2 bytes) would fit, and add error
    assert len(builds) == len({tuple(sorted(b.items())) for b in builds})  # no artifact built twice
    bits, size, probes = allocate_bits({"a": 1.0, "b": -0.5}, size_of, 200)  # all-int6 fits: b still stays int5
    assert bits == {"a": 6, "b": 5} and size == 130
    assert [p.get("cached", False) for p in probes] == [False, False]


def test_a_fill_step_over_the_budget_is_undone():
    numel = {"a": 100, "b": 10}
    chunk = lambda name, bits: numel[name] + (2 if bits == 6 else 0)  # noqa: E731  (estimates: +2 for int6)
    size_of = lambda bits: sum(numel[n] + (9 if b == 6 else 0) for n, b in bits.items())  # real: +9
    # the fill's step is the assignment the bisection measured over the budget already: not built again (cached)
    bits, size, probes = allocate_bits({"a": 2.0, "b": 1.0}, size_of, 115, chunk_size=chunk)
    assert bits == {"a": 5, "b": 5} and size == 110 and probes[-1] == {
        "n_int6": 1, "n_int4": 0, "artifact_bytes": 119, "fits": False, "fill": True, "cached": True}


def test_budget_error_without_fallback_names_the_option():
    size_of = lambda bits: 1000  # noqa: E731
    with pytest.raises(BudgetError, match="quant.min_bits=4"):
        allocate_bits({"a": 1.0}, size_of, 900)
