"""GPTQ and round-to-nearest (RTN) quantization of one weight matrix to per-row fp16 scales.

GPTQ (Frantar et al. 2022) quantizes the columns of W one at a time and pushes each column's rounding
error onto the columns not yet quantized, weighted by the inverse Hessian H = XᵀX/n of the layer's
inputs, so the layer's output on the calibration inputs stays close to the float one. Here:
  * damping: 1% of the mean of diag(H) is added to the diagonal before inversion;
  * dead columns (diag(H) = 0: that input was always 0) get diag 1; since their row and column of H
    are zero, nothing propagates to or from them and they are simply rounded (kept, not zeroed, so
    inputs unseen in calibration still meet a sensible weight);
  * act-order: columns are processed in decreasing diag(H) (largest-energy inputs first);
  * blocks of 128 columns with lazy batch updates of the remaining columns;
  * the upper Cholesky factor of H⁻¹ supplies the update rows (numerically stable form).
Clip search: the per-row scale is p-quantile(|w_row|) / qmax for every p in CLIP_PERCENTILES; all
candidates (and all requested bit widths) run through one GPTQ pass stacked along the rows (rows are
independent in GPTQ), and each row keeps the candidate with the smallest H-weighted error
e_r = Δw_r H Δw_rᵀ (undamped H). That error is the row's contribution to the mean squared output error
on the calibration inputs, the quantity GPTQ itself minimizes, so it chooses the clip by what matters
(plain |Δw|² would favour never clipping). RTN uses the same clip search, H-weighted when H is given,
plain squared error otherwise (embedding tables).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from quant.pack import QuantizedTensor, qmax_for

CLIP_PERCENTILES = (0.999, 0.9995, 0.9999, 0.99999, 1.0)
BLOCK_SIZE = 128
DAMP_FRAC = 0.01
FP16_MAX = 65504.0
MAX_STACK = 1 << 28  # values of the candidate stack GPTQ sweeps at once (1 GiB in fp32)


def candidate_scales(weight: torch.Tensor, bits: int, percentiles=CLIP_PERCENTILES) -> torch.Tensor:
    """[P, rows] fp32 scales (already rounded to fp16) for every clip percentile."""
    qmax = qmax_for(bits)
    q = torch.tensor(percentiles, dtype=torch.float32, device=weight.device)
    clips = torch.quantile(weight.abs().float(), q, dim=1)  # [P, rows]
    if clips[-1].max() / qmax > FP16_MAX:  # a clamped scale would clip the row silently
        raise ValueError(f"a weight of magnitude {clips[-1].max():.4g} is past what an fp16 row scale can hold at "
                         f"int{bits} ({FP16_MAX:g} x {qmax}); hint: the run diverged, or the matrix is not a weight")
    scales = (clips / qmax).half().float()
    # An all-zero row (or one whose scale underflows fp16) quantizes to codes 0 with any scale.
    return torch.where(scales > 0, scales, torch.ones_like(scales))


def row_errors(delta: torch.Tensor, hessian: torch.Tensor | None) -> torch.Tensor:
    """Per-row error: Δw H Δwᵀ (H-weighted) or |Δw|² (plain) for delta [rows, cols]."""
    if hessian is None:
        return (delta * delta).sum(dim=1)
    return ((delta @ hessian) * delta).sum(dim=1)


@dataclass(frozen=True)
class ScaleSet:
    """One candidate grid for a matrix: `scales` [P, rows] (fp32 values that fp16 holds exactly, all > 0) and the
    width `bits` (codes clamp to ±qmax). With P > 1 each row keeps the option of least H-weighted error (a
    clip search); P = 1 is one fixed scale per row (a step-size candidate)."""
    scales: torch.Tensor
    bits: int


@dataclass
class Rounded:
    """A matrix quantized on one grid, still on the device it was computed on: int8 codes [rows, cols], fp16 scales
    [rows], the width, and each row's error. `tensor()` is the QuantizedTensor that ships (on the host)."""
    codes: torch.Tensor
    scales: torch.Tensor
    bits: int
    row_errors: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """codes × scale in fp32 on the device (the same products QuantizedTensor.dequantize computes)."""
        return self.codes.float() * self.scales.float()[:, None]

    def tensor(self, family: str = "", step: float = 0.0) -> QuantizedTensor:
        return QuantizedTensor(self.codes.cpu().numpy(), self.scales.cpu().numpy(), self.bits, family, step)


def _pick_rows(codes: torch.Tensor, scales: torch.Tensor, errors: torch.Tensor, bits: int) -> Rounded:
    """Choose per row the option with the lowest error. codes [P, rows, cols], scales/errors [P, rows]."""
    best = errors.argmin(dim=0)  # [rows]
    rows = torch.arange(codes.shape[1], device=codes.device)
    return Rounded(codes[best, rows].to(torch.int8), scales[best, rows].half(), bits, errors[best, rows])


def rtn_scale_sets(weight: torch.Tensor, sets: list[ScaleSet], hessian: torch.Tensor | None = None,
                   ) -> list[Rounded]:
    """Round-to-nearest on every candidate grid, the per-row error H-weighted when `hessian` is given, plain
    squared otherwise."""
    w = _check_weight(weight)
    h = None if hessian is None else _check_hessian(hessian, w).to(w.device)
    out = []
    for s in sets:
        qmax, scales = qmax_for(s.bits), s.scales.to(w.device)
        codes = torch.clamp(torch.round(w.unsqueeze(0) / scales.unsqueeze(-1)), -qmax, qmax)
        errors = torch.stack([row_errors(c * sc[:, None] - w, h) for c, sc in zip(codes, scales)])
        out.append(_pick_rows(codes, scales, errors, s.bits))
    return out


def rtn_quantize(weight: torch.Tensor, bits: int, hessian: torch.Tensor | None = None,
                 percentiles=CLIP_PERCENTILES) -> tuple[QuantizedTensor, float]:
    """Round-to-nearest with per-row clip search. Returns the tensor and its total error
    (H-weighted if `hessian` is given, plain squared error otherwise)."""
    w = _check_weight(weight)
    r = rtn_scale_sets(w, [ScaleSet(candidate_scales(w, bits, percentiles), bits)], hessian)[0]
    return r.tensor(), float(r.row_errors.sum())


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, bits_list=(5, 6),
                  percentiles=CLIP_PERCENTILES, block_size: int = BLOCK_SIZE,
                  damp_frac: float = DAMP_FRAC, act_order: bool = True) -> dict[int, tuple[QuantizedTensor, float]]:
    """GPTQ of `weight` [rows, cols] for every width in `bits_list` in one pass, each with its clip search.

    Returns {bits: (QuantizedTensor, H-weighted error Σ_r Δw_r H Δw_rᵀ)}; the computation runs on the
    device of `hessian`.
    """
    w = _check_weight(weight)
    sets = [ScaleSet(candidate_scales(w, bits, percentiles), bits) for bits in bits_list]
    results = gptq_scale_sets(w, hessian, sets, block_size, damp_frac, act_order)
    return {s.bits: (r.tensor(), float(r.row_errors.sum())) for s, r in zip(sets, results)}


def gptq_scale_sets(weight: torch.Tensor, hessian: torch.Tensor, sets: list[ScaleSet], block_size: int = BLOCK_SIZE,
                    damp_frac: float = DAMP_FRAC, act_order: bool = True, max_elements: int = MAX_STACK,
                    ) -> list[Rounded]:
    """GPTQ of `weight` [rows, cols] on every candidate grid (per-row errors H-weighted), in order.

    GPTQ treats rows independently, so every (grid, option) runs in one column sweep stacked along the rows, in
    groups of at most `max_elements` values (the stack of 59 grids of a 8192-row table is 2 GB in fp32).
    The computation runs on the device of `hessian`.
    """
    h_true = _check_hessian(hessian, weight)
    w = _check_weight(weight).to(h_true.device)
    rows, cols = w.shape
    perm = torch.argsort(torch.diagonal(h_true), descending=True) if act_order else torch.arange(cols, device=w.device)
    upper = _inverse_hessian_factor(h_true[perm][:, perm], damp_frac)
    inverse = torch.argsort(perm)
    results, group, stacked = [], [], 0
    for i, s in enumerate(sets):
        group.append(s)
        stacked += s.scales.shape[0] * rows * cols
        if i + 1 == len(sets) or stacked + sets[i + 1].scales.shape[0] * rows * cols > max_elements:
            scales = torch.cat([g.scales.to(w.device).reshape(-1) for g in group])
            qmax = torch.cat([torch.full((g.scales.numel(),), float(qmax_for(g.bits)), device=w.device)
                              for g in group])
            codes = _gptq_columns(w[:, perm].repeat(scales.numel() // rows, 1), upper, scales, qmax, block_size)
            codes, start = codes[:, inverse], 0
            for g in group:
                n = g.scales.shape[0]
                c = codes[start * rows:(start + n) * rows].view(n, rows, cols).float()
                sc = g.scales.to(w.device)
                errors = torch.stack([row_errors(cc * ss[:, None] - w, h_true) for cc, ss in zip(c, sc)])
                results.append(_pick_rows(c, sc, errors, g.bits))
                start += n
            group, stacked = [], 0
    return results


def _gptq_columns(work: torch.Tensor, upper: torch.Tensor, scales: torch.Tensor, qmax: torch.Tensor,
                  block_size: int) -> torch.Tensor:
    """The GPTQ sweep over columns (in place on `work`); returns float codes [rows, cols]."""
    rows, cols = work.shape
    codes = torch.zeros(work.shape, dtype=torch.int8, device=work.device)  # |codes| <= 127
    for i1 in range(0, cols, block_size):
        i2 = min(i1 + block_size, cols)
        block = work[:, i1:i2].clone()
        errs = torch.zeros_like(block)
        u_block = upper[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = block[:, i]
            q = torch.clamp(torch.round(col / scales), -qmax, qmax)
            codes[:, i1 + i] = q
            err = (col - q * scales) / u_block[i, i]
            block[:, i + 1:] -= err.unsqueeze(1) * u_block[i, i + 1:].unsqueeze(0)
            errs[:, i] = err
        # Lazy batch update: the whole block's errors reach the later columns in one matmul.
        work[:, i2:] -= errs @ upper[i1:i2, i2:]
    return codes


def _inverse_hessian_factor(hessian: torch.Tensor, damp_frac: float) -> torch.Tensor:
    """Upper Cholesky factor U of (H + damping)⁻¹. H is first divided by its mean live diagonal: GPTQ's codes do
    not change with H's scale, and at scale 1 neither factorization meets under- or overflow (H ~ 1e-42 failed
    the second one). Dead columns (zero diagonal) then get diag 1, the live mean, so they neither dominate
    nor vanish from the damping."""
    h = hessian.clone()
    diag = torch.diagonal(h)
    dead = diag == 0
    if not dead.all():
        h /= diag[~dead].mean()
    diag[dead] = 1.0
    damp = damp_frac * float(diag.mean())
    eye = torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    for attempt in range(4):  # numerically indefinite H (tiny calibration sets): retry with 10x damping
        chol, info = torch.linalg.cholesky_ex(h + damp * eye)
        if int(info) == 0:
            upper, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(chol), upper=True)
            if int(info) == 0:
                return upper
        damp *= 10.0
    raise RuntimeError(f"GPTQ: Hessian [{h.shape[0]}x{h.shape[0]}] is not positive definite even with damping "
                       f"{damp / 10:.3g} x its mean diagonal; hint: calibrate on more tokens")


def _check_weight(weight: torch.Tensor) -> torch.Tensor:
    if weight.ndim != 2:
        raise ValueError(f"expected a 2-D weight matrix, got shape {tuple(weight.shape)}")
    w = weight.detach().float()
    if not torch.isfinite(w).all():
        raise ValueError("weight matrix holds NaN or Inf; refusing to quantize it")
    return w


def _check_hessian(hessian: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    cols = weight.shape[-1]
    if hessian.shape != (cols, cols):
        raise ValueError(f"Hessian shape {tuple(hessian.shape)} does not match the weight's {cols} input columns")
    h = hessian.detach().float()
    if not torch.isfinite(h).all():
        raise ValueError("Hessian holds NaN or Inf (calibration activations overflowed?)")
    return h


def h_weighted_error(weight: torch.Tensor, qt: QuantizedTensor, hessian: torch.Tensor) -> float:
    """tr(ΔW H ΔWᵀ) for a quantized tensor against the float weight (for tests and logs)."""
    delta = qt.dequantize().to(hessian.device) - weight.detach().float().to(hessian.device)
    return float(row_errors(delta, hessian.float()).sum())

