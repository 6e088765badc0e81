"""Lagrangian bit allocation: hull paths, optimality for the bytes it uses, real sizes, end to end."""
import itertools
import random

import pytest
import torch

from quant.allocate import BudgetError, allocate_lagrangian, hull_path
from quant.container import load_artifact
from test_quant_export import run_export


def test_hull_path_drops_dominated_and_non_convex_widths():
    assert hull_path({4: (10.0, 100), 5: (4.0, 150), 6: (1.0, 200)}) == [6, 5, 4]
    assert hull_path({4: (10.0, 100), 5: (8.0, 150), 6: (1.0, 200)}) == [6, 4]     # 5 above the 4-6 chord
    assert hull_path({4: (10.0, 100), 5: (4.0, 150), 6: (5.0, 200)}) == [5, 4]     # 6: more bytes, more error
    assert hull_path({4: (10.0, 100), 5: (4.0, 100), 6: (1.0, 200)}) == [6, 5]     # 4: same bytes as 5, worse
    assert hull_path({5: (4.0, 150)}) == [5]


def random_options(rng: random.Random, n: int) -> dict:
    out = {}
    for i in range(n):
        numel, sens = rng.randint(50, 400), 10 ** rng.uniform(-3, 1)
        out[f"m{i}"] = {b: (sens * numel * 4.0 ** -b * rng.uniform(0.7, 1.3), int(numel * (b - rng.uniform(1.0, 1.8))))
                        for b in (4, 5, 6)}
    return out


@pytest.mark.parametrize("seed", range(6))
def test_solution_has_the_least_error_of_all_that_use_no_more_bytes(seed):
    """Brute force over every assignment of 6 matrices (3^6): nothing within the bytes where the walk stopped (its
    first fitting artifact) has less error, the slack filled after it only lowers the error, and the allocator
    never goes over its budget."""
    rng = random.Random(seed)
    options = random_options(rng, 6)
    header = 37

    def size_of(bits):
        return header + sum(options[n][b][1] for n, b in bits.items())

    names = sorted(options)
    everything = [dict(zip(names, combo)) for combo in itertools.product((4, 5, 6), repeat=len(names))]
    low, high = min(map(size_of, everything)), max(map(size_of, everything))
    for budget in (low, (low + high) // 2, low + (high - low) // 5, high):
        bits, size, probes = allocate_lagrangian(options, size_of, budget)
        error = sum(options[n][b][0] for n, b in bits.items())
        assert size == size_of(bits) <= budget
        walk_stop = next(p["artifact_bytes"] for p in probes if p["fits"])
        best = min(sum(options[n][b][0] for n, b in a.items()) for a in everything if size_of(a) <= walk_stop)
        assert error <= best * (1 + 1e-12)


def test_the_bytes_a_large_step_frees_are_filled():
    """Found by a review: the walk took A's 50-byte step for a 5-byte overshoot and stopped at 70 bytes, error 5;
    undoing it and taking B's 5-byte step instead fits the 115-byte budget at error 1."""
    options = {"A": {5: (5.0, 50), 6: (0.0, 100)}, "B": {5: (1.0, 15), 6: (0.0, 20)}}

    def size_of(bits):
        return sum(options[n][b][1] for n, b in bits.items())

    bits, size, probes = allocate_lagrangian(options, size_of, 115)
    assert bits == {"A": 6, "B": 5} and size == 115
    assert [p["artifact_bytes"] for p in probes if p["error_per_byte"] == -1.0]  # the fill measured what it kept


def test_a_fill_step_the_real_artifact_misses_is_undone():
    """The estimate says B's step back fits; the measured artifact (10 bytes of header once B is int6) does not:
    it is undone, and the final size is the last measured one that fits."""
    options = {"A": {5: (5.0, 50), 6: (0.0, 100)}, "B": {5: (1.0, 15), 6: (0.0, 20)}}

    def size_of(bits):
        return sum(options[n][b][1] for n, b in bits.items()) + (10 if bits["B"] == 6 and bits["A"] == 5 else 0)

    bits, size, probes = allocate_lagrangian(options, size_of, 72)
    assert bits == {"A": 5, "B": 5} and size == size_of(bits) == 65 and not probes[-1]["fits"]


def test_walk_goes_on_while_the_measured_size_is_over():
    """Chunk bytes promise a fit that the real artifact (here 5 bytes of header per int6) misses."""
    options = {f"m{i}": {5: (2.0 + i, 100), 6: (1.0, 150)} for i in range(3)}

    def size_of(bits):
        return sum(options[n][b][1] + (5 if b == 6 else 0) for n, b in bits.items())

    bits, size, probes = allocate_lagrangian(options, size_of, 400)
    assert size <= 400 and sum(b == 6 for b in bits.values()) == 1 and bits["m2"] == 6
    assert [p["fits"] for p in probes][-1] and not probes[0]["fits"]


def test_budget_error_when_even_the_narrowest_is_over():
    options = {"a": {4: (3.0, 100), 5: (1.0, 120)}}
    with pytest.raises(BudgetError, match=r"narrowest widths \(int4\) .*over the budget of 50 bytes by 50.*hint: "
                                          r"shrink the model, or store fewer tensors as tables"):
        allocate_lagrangian(options, lambda bits: sum(options[n][b][1] for n, b in bits.items()), 50)
    options = {"a": {5: (1.0, 120), 6: (0.5, 150)}}  # int4 not among the widths: the hint offers it
    with pytest.raises(BudgetError, match=r"\(int5\) .*hint: shrink the model, or allow int4 with quant.min_bits=4"):
        allocate_lagrangian(options, lambda bits: sum(options[n][b][1] for n, b in bits.items()), 50)
    with pytest.raises(ValueError, match="no matrices"):
        allocate_lagrangian({}, lambda bits: 0, 10)


def test_export_with_the_lagrangian_allocator_fits_and_beats_the_ranking(tmp_path):
    """A budget where the ranking must leave everything int5 with a few int4: the Lagrangian walk
    spends the same bytes for less total error."""
    from test_quant_export import TinyGPT
    torch.manual_seed(0)
    model = TinyGPT(d=48)
    loose, _ = run_export(model, tmp_path / "loose.art", 10**7, min_bits=4)
    sizes = {p["n_int6"]: p["artifact_bytes"] for p in loose["probes"]}
    reports = {}
    for allocator in ("rank", "lagrangian"):
        budget = sizes[0] - 150  # all-int5 is just over: the ranking falls back to int4
        reports[allocator], lines = run_export(model, tmp_path / f"{allocator}.art", budget, min_bits=4,
                                               allocator=allocator)
        assert reports[allocator]["artifact_bytes"] <= budget and reports[allocator]["allocator"] == allocator
        load_artifact(str(tmp_path / f"{allocator}.art"))

    def total_error(report):
        return sum(row[f"err{row['bits']}"] for row in report["matrices"])
    assert total_error(reports["lagrangian"]) < total_error(reports["rank"])
    with pytest.raises(ValueError, match="allocator='greedy': expected one of"):
        run_export(model, tmp_path / "x.art", 10**7, allocator="greedy")
