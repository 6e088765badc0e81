"""Step-size candidates: the grids a tensor may be quantized on, and the width each needs.

Under an entropy coder the bytes of a quantized tensor follow its step size relative to the spread of its
weights, not the width of its codes: for near-Gaussian weights on a grid of step Δ·σ the codes carry about
log2(√(2πe)/Δ) = 2.05 − log2 Δ bits each, and the squared error is about (Δσ)²/12. Halving the step costs one
bit a weight and quarters the error, whatever the width, which only bounds the range. So a tensor's candidates
are step sizes on a geometric grid (STEP_GRID, a quarter bit apart), each with the narrowest width whose range
reaches the tensor's largest weight (nothing is clipped before GPTQ's error feedback moves it), and the
allocator chooses a step per tensor (quant/rd.py).

Two families place the grid per row (the scale stored for row r is step × base_r):
  * "std":      base_r = std(row r): the records' SDClip scales (k·std(row)/qmax, so step = k/qmax).
  * "weighted": base_r = σ × (w_r / mean w)^(-1/2), σ the tensor's std and w_r the row's weight in the error
                (a row's loss gradient² for a Linear, its token frequency for a table; 1 where none is known:
                one step for the whole tensor). Minimizing Σ_r w_r·err_r at a given number of bits puts every
                row at the same w_r·Δ_r², hence Δ_r ∝ w_r^(-1/2); clamped to [1/4, 4] of σ so that a row never
                seen in calibration is not dropped.
(The percentile-of-max clip search of the rank scheme, offered beside these, was never chosen for any tensor of
three 300 s checkpoints; the "weighted" family was chosen for nine tensors in ten.)

References: SDClip in the April-2026 parameter-golf records
(https://github.com/openai/parameter-golf/tree/main/records/track_10min_16mb); the high-rate rule
D(R) ∝ 2^(−2R) and the equal-slope allocation in Gersho & Gray, "Vector Quantization and Signal Compression".
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from quant.gptq import FP16_MAX, ScaleSet
from quant.pack import WIDTHS, qmax_for

STEP_GRID = tuple(round(0.04 * 2 ** (i / 4), 6) for i in range(22))  # step / base: 0.04 ... 1.52
FAMILIES = ("std", "weighted")
WEIGHT_CLAMP = 4.0   # a row's base stays within [σ / 4, 4σ]
WEIGHT_FLOOR = 0.01  # w_r below 1% of the mean counts as 1% (a token never seen still gets a finite step)
# The records' fixed scheme (SDClip): every matrix int6 at k = 12.85 (step 12.85/31 of the row's std), the
# embedding tables int8 at k = 20 (step 20/127).
SDCLIP_MATRIX = (6, 12.85)
SDCLIP_TABLE = (8, 20.0)


@dataclass(frozen=True)
class Candidate:
    """How one candidate grid was made: family ('std' or 'weighted'), step (step / base), and the grid itself."""
    family: str
    step: float
    grid: ScaleSet

    @property
    def label(self) -> str:
        return f"{self.family}@{self.step:g}"


def row_bases(weight: torch.Tensor, family: str, row_weight: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 [rows]: the per-row unit that a step multiplies (see the module doc)."""
    w = weight.detach().float()
    sigma = float(w.std(unbiased=False)) if w.numel() > 1 else 0.0
    sigma = sigma if sigma > 0 else 1.0
    if family == "std":
        std = w.std(dim=1, unbiased=False) if w.shape[1] > 1 else torch.zeros(w.shape[0], device=w.device)
        return torch.where(std > 0, std, torch.full_like(std, sigma))
    if family == "weighted":
        if row_weight is None:
            return torch.full((w.shape[0],), sigma, device=w.device)
        rw = row_weight.detach().float().to(w.device).clamp_min(0)
        mean = float(rw.mean())
        if not math.isfinite(mean) or mean <= 0:
            return torch.full((w.shape[0],), sigma, device=w.device)
        factor = (rw.clamp_min(WEIGHT_FLOOR * mean) / mean).rsqrt().clamp(1 / WEIGHT_CLAMP, WEIGHT_CLAMP)
        return sigma * factor
    raise ValueError(f"unknown step family {family!r}; expected one of {FAMILIES}")


def step_grid(weight: torch.Tensor, base: torch.Tensor, step: float, bits: int | None = None) -> ScaleSet:
    """Scales step × base_r (rounded to fp16, as stored) at width `bits`, or by default the narrowest width whose
    ±qmax × scale reaches every weight of its row (int8, clipping the excess, when no width does)."""
    if not (math.isfinite(step) and step > 0):
        raise ValueError(f"a step must be a positive finite number, got {step!r}")
    w = weight.detach().float()
    scales = (step * base).clamp(max=FP16_MAX).half().float()
    tiny = float(torch.finfo(torch.float16).tiny)
    scales = torch.where(scales >= tiny, scales, torch.full_like(scales, tiny))
    if bits is None:
        reach = float((w.abs().amax(dim=1) / scales).max()) if w.numel() else 0.0
        bits = next((b for b in WIDTHS if qmax_for(b) >= reach), WIDTHS[-1])
    return ScaleSet(scales.unsqueeze(0), bits)


def step_candidates(weight: torch.Tensor, row_weight: torch.Tensor | None = None, steps=STEP_GRID) -> list[Candidate]:
    """Every family × step of the grid."""
    out = []
    for family in FAMILIES:
        base = row_bases(weight, family, row_weight)
        out += [Candidate(family, step, step_grid(weight, base, step)) for step in steps]
    return out


def sdclip_candidate(weight: torch.Tensor, table: bool) -> Candidate:
    """The records' one grid for a matrix (int6, k = 12.85) or an embedding table (int8, k = 20)."""
    bits, k = SDCLIP_TABLE if table else SDCLIP_MATRIX
    step = k / qmax_for(bits)
    return Candidate("std", step, step_grid(weight, row_bases(weight, "std"), step, bits))
