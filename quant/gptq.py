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

import torch

from quant.pack import QuantizedTensor, qmax_for

CLIP_PERCENTILES = (0.999, 0.9995, 0.9999, 0.99999, 1.0)
BLOCK_SIZE = 128
DAMP_FRAC = 0.01
FP16_MAX = 65504.0


def candidate_scales(weight: torch.Tensor, bits: int, percentiles=CLIP_PERCENTILES) -> torch.Tensor:
    """[P, rows] fp32 scales (already rounded to fp16) for every clip percentile."""
    qmax = qmax_for(bits)
    q = torch.tensor(percentiles, dtype=torch.float32, device=weight.device)
    clips = torch.quantile(weight.abs().float(), q, dim=1)  # [P, rows]
    if clips[-1].max() / qmax > FP16_MAX:  # a clamped scale would clip the row silently (found by a review)
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


def _pick_rows(codes: torch.Tensor, scales: torch.Tensor, errors: torch.Tensor, bits: int):
    """Choose per row the clip candidate with the lowest error. codes [P, rows, cols], scales/errors [P, rows]."""
    best = errors.argmin(dim=0)  # [rows]
    rows = torch.arange(codes.shape[1], device=codes.device)
    chosen_codes = codes[best, rows]
    chosen_scales = scales[best, rows]
    qt = QuantizedTensor(
        codes=chosen_codes.to(torch.int8).cpu().numpy(),
        scales=chosen_scales.half().cpu().numpy(),
        bits=bits,
    )
    return qt, float(errors[best, rows].sum())


def rtn_quantize(weight: torch.Tensor, bits: int, hessian: torch.Tensor | None = None,
                 percentiles=CLIP_PERCENTILES) -> tuple[QuantizedTensor, float]:
    """Round-to-nearest with per-row clip search. Returns the tensor and its total error
    (H-weighted if `hessian` is given, plain squared error otherwise)."""
    w = _check_weight(weight)
    qmax = qmax_for(bits)
    scales = candidate_scales(w, bits, percentiles)  # [P, rows]
    codes = torch.clamp(torch.round(w.unsqueeze(0) / scales.unsqueeze(-1)), -qmax, qmax)
    h = None if hessian is None else _check_hessian(hessian, w).to(w.device)
    errors = torch.stack([row_errors(c * s[:, None] - w, h) for c, s in zip(codes, scales)])
    return _pick_rows(codes, scales, errors, bits)


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, bits_list=(5, 6),
                  percentiles=CLIP_PERCENTILES, block_size: int = BLOCK_SIZE,
                  damp_frac: float = DAMP_FRAC, act_order: bool = True) -> dict[int, tuple[QuantizedTensor, float]]:
    """GPTQ of `weight` [rows, cols] for every width in `bits_list` in one pass.

    Returns {bits: (QuantizedTensor, H-weighted error Σ_r Δw_r H Δw_rᵀ)}; the computation runs on the
    device of `hessian`.
    """
    h_true = _check_hessian(hessian, weight)
    w = _check_weight(weight).to(h_true.device)
    rows, cols = w.shape
    perm = torch.argsort(torch.diagonal(h_true), descending=True) if act_order else torch.arange(cols, device=w.device)
    upper = _inverse_hessian_factor(h_true[perm][:, perm], damp_frac)

    # Stack (width, clip) candidates along rows: [sum over widths of P * rows, cols].
    scale_list, qmax_list = [], []
    for bits in bits_list:
        s = candidate_scales(w, bits, percentiles)
        scale_list.append(s.reshape(-1))
        qmax_list.append(torch.full_like(s.reshape(-1), float(qmax_for(bits))))
    scales, qmax = torch.cat(scale_list), torch.cat(qmax_list)
    n_cand = scales.numel() // rows
    work = w[:, perm].repeat(n_cand, 1)
    codes = _gptq_columns(work, upper, scales, qmax, block_size)[:, torch.argsort(perm)]

    results, n_p = {}, len(percentiles)
    for i, bits in enumerate(bits_list):
        c = codes[i * n_p * rows:(i + 1) * n_p * rows].view(n_p, rows, cols)
        s = scales[i * n_p * rows:(i + 1) * n_p * rows].view(n_p, rows)
        errors = torch.stack([row_errors(cc * ss[:, None] - w, h_true) for cc, ss in zip(c, s)])
        results[bits] = _pick_rows(c, s, errors, bits)
    return results


def _gptq_columns(work: torch.Tensor, upper: torch.Tensor, scales: torch.Tensor, qmax: torch.Tensor,
                  block_size: int) -> torch.Tensor:
    """The GPTQ sweep over columns (in place on `work`); returns float codes [rows, cols]."""
    rows, cols = work.shape
    codes = torch.zeros_like(work)
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

