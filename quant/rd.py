"""Rate–distortion allocation: every quantized tensor's grid chosen for the least predicted loss under the budget.

Each tensor (Linear weights, mHC phi, embedding tables) gets the candidates of quant/steps.py: two step-size
families on a quarter-bit grid. For each candidate:
  * its error predicts the loss increase it causes: Σ_r w_r · Δw_r H Δw_rᵀ for a matrix (H its input Hessian,
    w_r the loss gradient² at output row r with error_weight="fisher", 1 with "output"), plus for a lookup table
    Σ L ⊙ Δw², L the loss gradient² at the lookup's output summed over the tokens that read each row ("fisher"), or
    each row's share of the lookups ("output"). The tied embedding has both terms: it is looked up and it is the
    output layer, GPTQ'd on the Hessian of the final norm's output;
  * its bytes are first estimated from the entropy of its codes (`estimated_bytes`).
The exact multiple-choice knapsack (quant/knapsack.py) then picks one candidate per tensor. The budget is met by
measurement, never by estimate: the chosen artifact is built, each tensor's estimate is rescaled by what its chosen
chunk really compressed to, the header and fixed tensors by what they took, and the choice is solved again, until
a built artifact fits with little left over. Every size reported is that of an artifact that was built.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from quant.allocate import BudgetError
from quant.gptq import Rounded, gptq_scale_sets, rtn_scale_sets
from quant.knapsack import Infeasible, fill, pareto, solve
from quant.pack import QuantizedTensor
from quant.steps import STEP_GRID, Candidate, step_candidates

PROBE_BITS = 3.0         # the grid each kind's loss probe quantizes at (bits a parameter, estimated)
FACTOR_FLOOR = 0.01      # a kind's scale is at least this share of the largest (none becomes free)
ROUNDS = 6               # artifacts built at most while meeting the budget
SLACK_FRACTION = 1e-3    # a fitting artifact within this share of the budget ends the search (16 KB of 16 MB: ~40K
                         # parameters at 3.5 bits, below what a run's loss can tell) ...
AIM_FRACTION = 5e-4      # ... and after the first build the choice aims this far below the budget, so that what
                         # the rescaled estimates still miss lands inside that window rather than over it
CHUNK_OVERHEAD = 16      # bytes a compressed chunk costs beyond its entropy (estimate only; measured after)


class RDBudgetError(BudgetError):
    """Even the coarsest grid of every tensor is over the byte budget (train.py reports it as a failed export)."""


@dataclass
class ErrorModel:
    """What a tensor's error is measured against (see the module doc); any part may be absent."""
    hessian: torch.Tensor | None = None     # [in, in] input Hessian
    row_weight: torch.Tensor | None = None  # [rows] multiplying each row's H-weighted error (Fisher), else 1
    lookup: torch.Tensor | None = None      # [rows, cols] or [rows, 1]: weight of each entry's squared error

    def family_weights(self) -> torch.Tensor | None:
        """Per row, the loss weight of a unit squared error on one of its entries: the weighted family's w_r (None
        where nothing weighs the rows apart)."""
        weight = None
        if self.hessian is not None and self.row_weight is not None:
            weight = self.row_weight.float() * float(torch.diagonal(self.hessian).mean())
        if self.lookup is not None:
            lookup = self.lookup.float().mean(dim=1)
            weight = lookup if weight is None else weight + lookup.to(weight.device)
        return weight


@dataclass
class Option:
    label: str              # e.g. "std@0.4", "weighted@0.2", "pct5", "rtn:std@0.4"
    rounded: Rounded        # its codes and scales, on the device they were computed on
    family: str
    step: float
    error: float            # predicted loss increase (error-weight units)
    est_bytes: float        # entropy estimate of its compressed chunk
    _value: QuantizedTensor | None = None

    @property
    def value(self) -> QuantizedTensor:
        """The QuantizedTensor that ships (copied to the host once, when first asked for)."""
        if self._value is None:
            self._value = self.rounded.tensor(self.family, self.step)
        return self._value


def _entropy_bits(counts: torch.Tensor) -> float:
    """Σ over the rows of `counts` [..., 256] of n·H(row), in bits."""
    counts = counts.reshape(-1, counts.shape[-1]).double()
    p = counts / counts.sum(dim=1, keepdim=True).clamp_min(1)
    return float(-(counts * torch.where(p > 0, p.log2(), torch.zeros_like(p))).sum())


def estimated_bytes(codes: torch.Tensor, scales: torch.Tensor) -> float:
    """The int8 codes' order-0 entropy, halfway between that of the whole tensor and the sum of each row's (Brotli
    adapts its codes to the data as it goes: on rows of unequal spread it lands between the two), plus fp16 scales
    unless they are all equal. Within 6% of Brotli-11 on test matrices, which loses most to its prefix codes at the
    coarsest steps; the allocation then corrects each tensor by what its chunk really took. On codes' device."""
    rows = codes.shape[0]
    index = torch.arange(rows, device=codes.device).unsqueeze(1) * 256 + (codes.to(torch.int64) & 0xFF)
    per_row = torch.bincount(index.reshape(-1), minlength=rows * 256).view(rows, 256)
    bits = 0.5 * (_entropy_bits(per_row.sum(dim=0)) + _entropy_bits(per_row))
    scale_bytes = 0 if bool((scales == scales[0]).all()) else 2 * rows
    return bits / 8 + scale_bytes + CHUNK_OVERHEAD


def tensor_options(weight: torch.Tensor, model: ErrorModel, method: str, steps=STEP_GRID) -> list[Option]:
    """Every candidate grid of one tensor with its error and estimated bytes, dominated ones dropped.

    A tied table (looked up, and the output layer) gets each grid twice: GPTQ'd on the head's Hessian, which lowers
    the logits' error but raises each entry's own, and rounded to nearest, which does the opposite; its error
    counts both roles, so the allocation picks."""
    w = weight.detach().float()
    candidates = step_candidates(w, model.family_weights(), steps)
    options = evaluate_candidates(w, model, method, candidates)
    if method == "gptq" and model.hessian is not None and model.lookup is not None:
        for o in evaluate_candidates(w, model, "rtn", candidates):
            o.label = f"rtn:{o.label}"
            options.append(o)
    return [options[i] for i in pareto([(o.error, o.est_bytes) for o in options])]


def evaluate_candidates(weight: torch.Tensor, model: ErrorModel, method: str, candidates: list[Candidate],
                        ) -> list[Option]:
    """Quantize `weight` on each candidate grid (GPTQ on the Hessian where there is one and method is gptq,
    round-to-nearest otherwise) and price it: predicted error and estimated bytes."""
    device = model.hessian.device if model.hessian is not None else weight.device
    w = weight.detach().float().to(device)
    grids = [c.grid for c in candidates]
    if model.hessian is not None and method == "gptq":
        results = gptq_scale_sets(w, model.hessian, grids)
    else:
        results = rtn_scale_sets(w, grids, model.hessian)
    options = []
    for cand, r in zip(candidates, results):
        error = 0.0
        if model.hessian is not None:
            rw = model.row_weight.to(r.row_errors.device) if model.row_weight is not None else 1.0
            error += float((r.row_errors * rw).sum())
        if model.lookup is not None:
            error += float((model.lookup.to(device) * (r.dequantize() - w).square()).sum())
        options.append(Option(cand.label, r, cand.family, cand.step, error, estimated_bytes(r.codes, r.scales)))
    return options


def scale_errors(options: dict[str, list[Option]], groups: dict[str, str],
                 probe: Callable[[dict[str, QuantizedTensor]], float]) -> dict[str, dict]:
    """Scales the predicted errors of each group of tensors to measured loss: probe(values) is the loss increase
    with every tensor of a group at its option nearest PROBE_BITS; the group's errors are multiplied by that over
    their predicted sum (quant/probe.py says why). Changes `options` in place; returns each group's measurement."""
    measured = {}
    for group in sorted(set(groups.values())):
        names = [name for name in options if groups[name] == group]
        picks = {name: min(options[name], key=lambda o: abs(8 * o.est_bytes / o.rounded.codes.numel() - PROBE_BITS))
                 for name in names}
        predicted = sum(o.error for o in picks.values())
        measured[group] = {"tensors": len(names), "predicted": predicted,
                           "loss_increase": probe({name: o.value for name, o in picks.items()})}
    factors = {g: m["loss_increase"] / m["predicted"] if m["predicted"] > 0 else 0.0 for g, m in measured.items()}
    floor = FACTOR_FLOOR * max([*factors.values(), 0.0])
    for group, m in measured.items():
        m["factor"] = max(factors[group], floor) if floor > 0 else 1.0
    for name, opts in options.items():
        for o in opts:
            o.error *= measured[groups[name]]["factor"]
    return measured


def allocate(options: dict[str, list[Option]], measure: Callable[[dict[str, QuantizedTensor]], tuple[int, dict]],
             budget_bytes: int, log: Callable[[str], None] = lambda _: None) -> tuple[dict[str, int], int, list[dict]]:
    """{name: option index}, the artifact bytes of that choice, and the log of every artifact built.

    measure(values) builds the artifact of the chosen values and returns (its bytes, {name: its chunk's bytes}).
    """
    ratio = {name: 1.0 for name in options}
    overhead, capacity = 0.0, float(budget_bytes)
    best: tuple[float, dict, int] | None = None
    probes: list[dict] = []
    seen: set[tuple] = set()
    for round_ in range(ROUNDS):
        t = time.perf_counter()
        priced = {n: [(o.error, o.est_bytes * ratio[n]) for o in opts] for n, opts in options.items()}
        try:
            choice = fill(priced, solve(priced, capacity), capacity)
        except Infeasible as e:
            if best is not None:
                break
            raise RDBudgetError(f"even the coarsest grid of every tensor is over the budget of {budget_bytes:,} bytes "
                                f"({e}, beside {overhead:,.0f} bytes of header and fixed tensors); hint: shrink the "
                                "model, or raise quant.budget_bytes") from None
        key = tuple(sorted(choice.items()))
        if key in seen:  # the estimates have converged on a choice already built
            break
        seen.add(key)
        predicted = overhead + sum(priced[n][i][1] for n, i in choice.items())
        size, chunks = measure({n: options[n][i].value for n, i in choice.items()})
        error = sum(options[n][i].error for n, i in choice.items())
        probes.append({"round": round_, "capacity": round(capacity), "artifact_bytes": size,
                       "fits": size <= budget_bytes, "error": error})
        log(f"quant: rd round {round_}: {size:,} bytes (budget {budget_bytes:,}), predicted error {error:.4e}, "
            f"{time.perf_counter() - t:.1f}s")
        if size <= budget_bytes and (best is None or error < best[0]):
            best = (error, choice, size)
        if size <= budget_bytes and budget_bytes - size <= SLACK_FRACTION * budget_bytes:
            break
        overhead = size - sum(chunks.values())
        for n, i in choice.items():
            ratio[n] = chunks[n] / options[n][i].est_bytes
        # The next choice's estimates are exact for the options this one built and rescaled for the rest; aim as far
        # below the budget as the rescaled estimates missed by this time (at least AIM_FRACTION of it).
        miss = size - predicted if round_ else 0.0
        capacity = budget_bytes - overhead - max(AIM_FRACTION * budget_bytes, miss)
    if best is None:
        raise RDBudgetError(f"no artifact built in {ROUNDS} rounds fits the budget of {budget_bytes:,} bytes "
                            f"(the last: {probes[-1]['artifact_bytes']:,}); hint: raise quant.margin_bytes")
    return best[1], best[2], probes
