"""The rank scheme (quant.scheme = "rank"): int6 for the matrices that need it most, int5 for the rest, under a byte
budget.

Sensitivity (the ranking key) is the measured cost of downgrading a matrix, per parameter:
    s = (E5 - E6) / numel,   E_b = tr(ΔW_b H ΔW_bᵀ), ΔW_b = GPTQ_b(W) - W, H = XᵀX/n.
E_b is the mean squared error GPTQ leaves on the layer's output over the calibration tokens, so it is
in the same units for every matrix whatever its fan-in (trace(H) alone grows with input width and
ignores both the weights and how well they fit the grid). Dividing by numel makes it the error saved
per parameter upgraded: extra bytes for int6 are ~proportional to numel, so ranking by s is the
greedy solution of "most error removed per byte", and the int6 set is a prefix of that ranking (then the bytes
the prefix leaves are filled in the same order, below).
Limitation: output error is not loss; a matrix whose outputs the network amplifies is not weighted
more (that would need gradients).

The budget is checked on real bytes: `size_of(bits_by_name)` builds the complete artifact (cached
per-tensor chunks make this cheap) and returns its length. The search finds the largest prefix k that
fits by bisection; every returned assignment has been measured, never estimated (the fill below estimates which
steps to try from chunk sizes, and keeps only measured ones).

int4 fallback (quant.min_bits = 4): when even all-int5 is over the budget, the matrices whose int5 -> int4
step costs least error per parameter, d = (E4 - E5) / numel, are demoted to int4, the fewest that make
the artifact fit (again a measured bisection). int5/int6 stays the recipe; int4 is only ever used to
ship instead of failing, and the log says how many matrices it took.

Either search stops at a prefix of its order: the next matrix does not fit, but smaller ones after it may. Given
each matrix's own chunk size, the bytes left under the budget are filled in the same order (int4 matrices back to
int5, costliest demotion first; else int5 matrices to int6, most sensitive first), each step measured.

"""
from __future__ import annotations

from collections.abc import Callable

LOW_BITS, HIGH_BITS = 5, 6
FALLBACK_BITS = 4
FILL_PROBES = 8  # artifacts built at most while filling what an allocation leaves under the budget (full builds)


class BudgetError(ValueError):
    """Even the all-int5 artifact does not fit the byte budget."""


def rank_by_sensitivity(sensitivity: dict[str, float]) -> list[str]:
    """Names, most sensitive first (ties broken by name, so the order is deterministic)."""
    return sorted(sensitivity, key=lambda name: (-sensitivity[name], name))


def assignment(order: list[str], k: int, bits: int = HIGH_BITS) -> dict[str, int]:
    """The first k names of `order` get `bits`, the rest LOW_BITS."""
    return {name: bits if i < k else LOW_BITS for i, name in enumerate(order)}


def allocate_bits(sensitivity: dict[str, float], size_of: Callable[[dict[str, int]], int],
                  budget_bytes: int, demotion_cost: dict[str, float] | None = None,
                  chunk_size: Callable[[str, int], int] | None = None) -> tuple[dict[str, int], int, list[dict]]:
    """Returns (bits per matrix, artifact bytes of that choice, the search log).

    `demotion_cost` (per matrix, (E4 - E5) / numel) enables the int4 fallback; without it an
    all-int5 artifact over the budget raises BudgetError.
    Assumes size grows with k (int6 chunks are larger than int5 ones); if a glitch broke that, the
    result would still fit (only measured sizes are accepted) but might not be the largest k.
    With `chunk_size(name, bits)` (a matrix's own compressed chunk), the bytes the prefix leaves under the budget
    are then filled (`fill_in_order`): the prefix stops at the first matrix that does not fit, but smaller ones
    after it may.
    """
    size_of = KnownSizes(size_of)
    bits, size, probes = _allocate_prefix(sensitivity, size_of, budget_bytes, demotion_cost)
    if chunk_size is None:
        return bits, size, probes
    # Only steps that lower the error (a matrix GPTQ fits no better at int6 has sensitivity <= 0)
    if any(b == FALLBACK_BITS for b in bits.values()):  # back to int5, the costliest demotions first
        order = sorted(demotion_cost, key=lambda name: (-demotion_cost[name], name))
        order = [name for name in order if bits[name] == FALLBACK_BITS and demotion_cost[name] > 0]
        up = LOW_BITS
    else:  # on to int6, the most sensitive first
        order = [name for name in rank_by_sensitivity(sensitivity) if bits[name] == LOW_BITS and sensitivity[name] > 0]
        up = HIGH_BITS
    size = fill_in_order(bits, size, order, up, chunk_size, size_of, budget_bytes, probes)
    return bits, size, probes


class KnownSizes:
    """size_of with a memory: an allocator that comes back to an assignment it has measured (a repair retracing a
    step, a fill's first candidate that the bisection measured already) does not build that artifact again."""

    def __init__(self, size_of: Callable[[dict[str, int]], int]):
        self.size_of, self.known = size_of, {}

    def __call__(self, bits: dict[str, int]) -> int:
        key = tuple(sorted(bits.items()))
        if key not in self.known:
            self.known[key] = int(self.size_of(bits))
        return self.known[key]

    def knows(self, bits: dict[str, int]) -> bool:
        return tuple(sorted(bits.items())) in self.known


def probe(size_of: KnownSizes, bits: dict[str, int], budget_bytes: int, probes: list[dict], **fields) -> int:
    """Measures `bits` and logs it in `probes` (its fields, the size, whether it fits, and `cached` where the size
    was known already, so that the log can count the artifacts really built)."""
    cached = size_of.knows(bits)
    size = size_of(bits)
    probes.append({**fields, "artifact_bytes": size, "fits": size <= budget_bytes,
                   **({"cached": True} if cached else {})})
    return size


def fill_in_order(bits: dict[str, int], size: int, order: list[str], up: int, chunk_size: Callable[[str, int], int],
                  size_of: KnownSizes, budget_bytes: int, probes: list[dict]) -> int:
    """Moves matrices of `order` to `up` bits, in that order, where their chunks' growth fits in what the budget has
    left; each is measured and undone if the artifact is over (no step as large is tried after that). At most
    FILL_PROBES new artifacts are built. Changes `bits` in place; returns the final size."""
    limit, built = budget_bytes, 0
    for name in order:
        if built == FILL_PROBES:
            break
        old = bits[name]
        cost = chunk_size(name, up) - chunk_size(name, old)
        if size + cost > limit:
            continue
        bits[name] = up
        measured = probe(size_of, bits, budget_bytes, probes, n_int6=sum(b == HIGH_BITS for b in bits.values()),
                         n_int4=sum(b == FALLBACK_BITS for b in bits.values()), fill=True)
        built += not probes[-1].get("cached")
        if measured <= budget_bytes:
            size = measured
        else:
            bits[name] = old
            limit = min(limit, size + cost - 1)
    return size


def _allocate_prefix(sensitivity: dict[str, float], size_of: KnownSizes, budget_bytes: int,
                     demotion_cost: dict[str, float] | None) -> tuple[dict[str, int], int, list[dict]]:
    """int6 for the largest prefix of the sensitivity ranking that fits, else int4 for the fewest cheapest."""
    if not sensitivity:
        raise ValueError("no matrices to allocate bits to")
    order = rank_by_sensitivity(sensitivity)
    probes: list[dict] = []

    def measure(k: int) -> int:
        return probe(size_of, assignment(order, k), budget_bytes, probes, n_int6=k, n_int4=0)

    size_lo = measure(0)
    if size_lo > budget_bytes:
        if demotion_cost is None:
            raise BudgetError(f"even all-int{LOW_BITS} ({len(order)} matrices) makes a {size_lo}-byte artifact, "
                              f"over the budget of {budget_bytes} bytes by {size_lo - budget_bytes} bytes; "
                              "hint: shrink the model, or allow the int4 fallback with quant.min_bits=4")
        return _demote_to_fit(demotion_cost, size_of, budget_bytes, probes)
    # int6 only where it lowers the error: the prefix ends before the first matrix of sensitivity <= 0.
    # Invariant: k = lo fits; no k > hi is tried.
    lo, hi, best_size = 0, sum(sensitivity[name] > 0 for name in order), size_lo
    size_hi = measure(hi)
    if size_hi <= budget_bytes:
        return assignment(order, hi), size_hi, probes
    hi -= 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        size = measure(mid)
        if size <= budget_bytes:
            lo, best_size = mid, size
        else:
            hi = mid - 1
    return assignment(order, lo), best_size, probes


def _demote_to_fit(demotion_cost: dict[str, float], size_of: KnownSizes,
                   budget_bytes: int, probes: list[dict]) -> tuple[dict[str, int], int, list[dict]]:
    """All-int5 is over the budget: demote the cheapest matrices to int4, as few as fit (bisection)."""
    order = sorted(demotion_cost, key=lambda name: (demotion_cost[name], name))  # cheapest first

    def measure(k: int) -> int:
        return probe(size_of, assignment(order, k, FALLBACK_BITS), budget_bytes, probes, n_int6=0, n_int4=k)

    size_all = measure(len(order))
    if size_all > budget_bytes:
        raise BudgetError(f"even all-int{FALLBACK_BITS} ({len(order)} matrices) makes a {size_all}-byte artifact, "
                          f"over the budget of {budget_bytes} bytes by {size_all - budget_bytes} bytes; "
                          "hint: shrink the model (fewer layers, a narrower MLP) or store fewer tensors as tables")
    lo, hi, best_size = 0, len(order), size_all  # invariant: k = hi fits; k <= lo is known not to fit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        size = measure(mid)
        if size <= budget_bytes:
            hi, best_size = mid, size
        else:
            lo = mid
    return assignment(order, hi, FALLBACK_BITS), best_size, probes


def allocation_log(order_sensitivity: dict[str, float], bits: dict[str, int], details: dict[str, dict]) -> list[dict]:
    """One dict per matrix, most sensitive first: rank, name, bits, sensitivity and the caller's details."""
    order = rank_by_sensitivity(order_sensitivity)
    return [{"rank": i, "name": name, "bits": bits[name], "sensitivity": order_sensitivity[name], **details.get(name, {})}
            for i, name in enumerate(order)]
