"""Would a low-rank correction of a quantized matrix's error buy more than the allocator's own next grid?

LQER (low-rank quantization error reconstruction) ships W ≈ Q + A·B with A [out, r] and B [r, in]; the 2026-04-27
record corrects its three worst tensors at rank 4 with int4 factors
(https://github.com/openai/parameter-golf/pull/1797). Under the rate–distortion allocation (quant/rd.py) the same
bytes could instead buy finer grids, so the question is which buys more error per byte.

The error the allocation minimizes for a matrix is Σ_r w_r Δ_r H Δ_rᵀ = ‖D^½ Δ R‖²_F, with Δ = Q − W, D the row
weights (Fisher, or 1), H = R Rᵀ the input Hessian. The best rank-r correction in that norm removes the r largest
squared singular values of D^½ Δ R (Eckart–Young), so their sum bounds what any rank-r correction removes, before
its own factors are quantized. Its bytes are counted at `factor_bits` a value plus fp16 scales; an entropy coder
would take somewhat less for factors whose values bunch near zero, while the grids' bytes are entropy estimates. The
gain is the generous side: a tensor where the correction buys well under what the next grid buys would not gain
from it, and a ratio near 1 is too close to call without building it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from quant.rd import ErrorModel, Option, tensor_options


def weighted_singular_values(delta: torch.Tensor, hessian: torch.Tensor,
                             row_weight: torch.Tensor | None = None) -> torch.Tensor:
    """Singular values of D^½ Δ R, H = R Rᵀ (from H's eigendecomposition, negative rounding clipped): their squares
    sum to the weighted error Σ_r w_r Δ_r H Δ_rᵀ."""
    evals, evecs = torch.linalg.eigh(hessian.double())
    m = delta.double() @ (evecs * evals.clamp_min(0).sqrt())
    if row_weight is not None:
        m = m * row_weight.double().clamp_min(0).sqrt()[:, None]
    return torch.linalg.svdvals(m)


def factor_bytes(rows: int, cols: int, rank: int, bits: int) -> float:
    """A [rows, rank] and B [rank, cols] at `bits` a value, with an fp16 scale for each row of A and of B."""
    return rank * (rows + cols) * bits / 8 + 2 * (rows + rank)


@dataclass
class Screen:
    name: str
    shape: tuple[int, int]
    bits_per_param: float   # the reference grid's estimated bytes, per parameter
    error: float            # its weighted error
    grid_gain: float        # error the next finer grid removes ...
    grid_bytes: float       # ... for these extra bytes
    lowrank_gain: float     # error the best rank-r correction removes (a bound) ...
    lowrank_bytes: float    # ... for these bytes
    top_share: float        # lowrank_gain / error

    @property
    def ratio(self) -> float:
        """The correction's error per byte over the next grid's: above 1, the correction buys more."""
        per_byte = self.grid_gain / self.grid_bytes if self.grid_bytes > 0 else 0.0
        mine = self.lowrank_gain / self.lowrank_bytes
        return mine / per_byte if per_byte > 0 else float("inf")


def reference_option(options: list[Option], params: int, bits: float) -> int | None:
    """Of the Pareto options (any order), the index of the one nearest `bits` a parameter that has a finer one
    (the next grid to compare with); None with fewer than two."""
    order = sorted(range(len(options)), key=lambda i: options[i].est_bytes)
    if len(order) < 2:
        return None
    return min(order[:-1], key=lambda i: abs(8 * options[i].est_bytes / params - bits))


def screen_matrix(name: str, weight: torch.Tensor, model: ErrorModel, method: str, bits: float, rank: int,
                  factor_bits: int) -> Screen | None:
    """The screen of one matrix at the grid nearest `bits` a parameter; None for a tensor without a Hessian or with
    a lookup term (a table: its error is not of the form above) or with one grid alone."""
    if model.hessian is None or model.lookup is not None:
        return None
    w = weight.detach().float().to(model.hessian.device)
    options = tensor_options(w, model, method)
    i = reference_option(options, w.numel(), bits)
    if i is None:
        return None
    finer = min((o for o in options if o.est_bytes > options[i].est_bytes), key=lambda o: o.est_bytes)
    ref = options[i]
    sv = weighted_singular_values(ref.rounded.dequantize() - w, model.hessian, model.row_weight)
    error = float((sv ** 2).sum())
    gain = float((sv[:rank] ** 2).sum())
    rows, cols = w.shape
    return Screen(name, (rows, cols), 8 * ref.est_bytes / w.numel(), error, ref.error - finer.error,
                  finer.est_bytes - ref.est_bytes, gain, factor_bytes(rows, cols, rank, factor_bits),
                  gain / error if error > 0 else 0.0)
