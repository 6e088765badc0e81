"""Choose one candidate per tensor: the least total error whose bytes fit a capacity (a multiple-choice knapsack).

Exact by dynamic programming over the bytes, counted in units of `ceil(capacity / buckets)` bytes, each
candidate's bytes rounded up to whole units: so the choice always fits, and it is the optimum of the problem
at that resolution (at one-byte units, problems with capacity ≤ buckets, the exact optimum; tests check it
against brute force). At the artifact's scale (16 MB in 2^16 units of 245 bytes) rounding up wastes on average
half a unit a tensor; `fill` then spends what the exact bytes leave on the best further upgrades.

Unlike a Lagrangian walk along each tensor's convex hull, the program also reaches candidates inside the hull,
and it has no integrality gap: a large tensor's step cannot leave bytes unused that a mix of small ones would
have taken.
"""
from __future__ import annotations

import math

import numpy as np

DP_BUCKETS = 1 << 16


class Infeasible(ValueError):
    """Even the smallest candidate of every tensor is over the capacity."""


def pareto(options: list[tuple[float, float]]) -> list[int]:
    """Indices of the candidates no other beats on both error and bytes (fewest bytes first)."""
    order = sorted(range(len(options)), key=lambda i: (options[i][1], options[i][0], i))
    kept, best = [], math.inf
    for i in order:
        if options[i][0] < best:
            kept.append(i)
            best = options[i][0]
    return kept


def solve(options: dict[str, list[tuple[float, float]]], capacity: float, buckets: int = DP_BUCKETS,
          ) -> dict[str, int]:
    """{name: index into options[name]} minimizing Σ error with Σ bytes ≤ capacity; options[name] = [(error, bytes)].

    Raises Infeasible when the smallest candidates alone are over the capacity."""
    if not options:
        return {}
    smallest = sum(min(b for _, b in opts) for opts in options.values())
    if smallest > capacity:
        raise Infeasible(f"the smallest candidates take {smallest:,.0f} bytes, over the capacity of {capacity:,.0f}")
    unit = max(1, math.ceil(capacity / buckets))
    cap = int(capacity // unit)
    names = sorted(options)
    kept = {name: pareto(options[name]) for name in names}
    best = np.zeros(cap + 1)  # least error of the tensors so far within each number of units
    choices = []
    for name in names:
        new = np.full(cap + 1, np.inf)
        choice = np.full(cap + 1, -1, dtype=np.int32)
        for i in kept[name]:
            error, nbytes = options[name][i]
            w = math.ceil(nbytes / unit)
            if w > cap:
                continue
            trial = best[:cap + 1 - w] + error
            better = trial < new[w:]
            new[w:][better] = trial[better]
            choice[w:][better] = i
        best = new
        choices.append(choice)
    if not np.isfinite(best[cap]):  # the smallest fit in exact bytes but not once rounded up to units
        raise Infeasible(f"the smallest candidates take {smallest:,.0f} bytes, too close to the capacity of "
                         f"{capacity:,.0f} at a resolution of {unit} bytes")
    picked, b = {}, cap
    for name, choice in zip(reversed(names), reversed(choices)):
        i = int(choice[b])
        picked[name] = i
        b -= math.ceil(options[name][i][1] / unit)
    return picked


def fill(options: dict[str, list[tuple[float, float]]], picked: dict[str, int], capacity: float) -> dict[str, int]:
    """Spends the bytes `picked` leaves under `capacity` on single-tensor upgrades, most error saved per byte first,
    while one fits. Returns a new choice with no more error and no more than `capacity` bytes."""
    picked = dict(picked)
    used = sum(options[name][i][1] for name, i in picked.items())
    while True:
        slack, best = capacity - used, None
        for name in sorted(picked):
            error, nbytes = options[name][picked[name]]
            for j, (e, b) in enumerate(options[name]):
                if e < error and b - nbytes <= slack:
                    gain = (error - e) / max(b - nbytes, 1e-9)
                    if best is None or gain > best[0]:
                        best = (gain, name, j, b - nbytes)
        if best is None:
            return picked
        _, name, j, extra = best
        picked[name] = j
        used += extra


def total(options: dict[str, list[tuple[float, float]]], picked: dict[str, int]) -> tuple[float, float]:
    """(Σ error, Σ bytes) of a choice."""
    return (sum(options[n][i][0] for n, i in picked.items()), sum(options[n][i][1] for n, i in picked.items()))
