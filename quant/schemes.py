"""The three ways to turn calibrated tensors into the artifact's quantized values (quant.scheme):

  * "rd"     every matrix, mHC phi and table on the step-size grid that the rate–distortion allocation picks
             under the byte budget (quant/rd.py): the default;
  * "rank"   matrices at int5 or int6 by percentile clip search, int6 for the most sensitive that fit (int4 as a
             fallback with min_bits=4); phi at a fixed width; tables round-to-nearest at a fixed width
             (quant/allocate.py);
  * "sdclip" the April-2026 records' fixed scheme: every matrix and phi GPTQ'd at int6 on scales 12.85·std(row)/31,
             every table int8 at 20·std(row)/127 (the tied embedding GPTQ'd on the output layer's Hessian); no
             allocation, so an artifact over the budget is a BudgetError. A baseline to compare with.

Each returns a Quantized: the values of the quantized tensors, the artifact's bytes as measured, the probes, and one
row per tensor for the report.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from quant.allocate import FALLBACK_BITS, HIGH_BITS, BudgetError, allocate_bits, allocation_log
from quant.calibrate import Calibration, Fisher
from quant.gptq import gptq_quantize, row_errors, rtn_quantize
from quant.pack import QuantizedTensor
from quant.rd import ErrorModel, Option, allocate, evaluate_candidates, scale_errors, tensor_options
from quant.steps import sdclip_candidate


@dataclass
class Quantized:
    values: dict[str, QuantizedTensor]
    size: int
    probes: list[dict]
    rows: list[dict] = field(default_factory=list)  # per quantized tensor: name, kind, bits, grid, error, bytes
    matrices: list[dict] = field(default_factory=list)  # the rank scheme's allocation log of the Linears
    observed: list[dict] = field(default_factory=list)  # the rank scheme's fixed-width phi
    scaled: dict[str, dict] = field(default_factory=dict)  # the rd scheme's loss probes, per group


@contextlib.contextmanager
def naming(name: str):
    """Prefix a quantizer's error (a NaN Hessian, a shape, a Hessian GPTQ cannot factorize) with the tensor it was
    quantizing, keeping its type."""
    try:
        yield
    except (ValueError, RuntimeError) as e:
        raise type(e)(f"{name}: {e}") from e


def error_models(weights: dict[str, torch.Tensor], kinds: dict[str, str], calib: Calibration,
                 fisher: Fisher | None) -> dict[str, ErrorModel]:
    """What each tensor's error is measured against (quant/rd.py): matrices and phi on their input Hessian (rows
    Fisher-weighted with a Fisher pass); tables on their lookups (the tied one on the head's Hessian too); a table
    the model never looks up through an nn.Embedding on its plain squared error."""
    out = {}
    for name, weight in weights.items():
        h = calib.hessians.get(name)
        rows = fisher.rows.get(name) if fisher is not None else None
        lookup = None
        if kinds[name] == "table":
            if fisher is not None and name in fisher.lookups:
                lookup = fisher.lookups[name]
            elif name in calib.uses:
                lookup = calib.uses[name].unsqueeze(1)
            elif h is None:
                lookup = torch.ones(weight.shape[0], 1, device=weight.device)
        out[name] = ErrorModel(h, rows if h is not None else None, lookup)
    return out


def report_rows(options: dict[str, Option], kinds: dict[str, str], chunk_bytes: dict[str, int]) -> list[dict]:
    rows = []
    for name, o in options.items():
        qt = o.value
        rows.append({"name": name, "kind": kinds[name], "bits": qt.bits, "grid": o.label, "params": qt.codes.size,
                     "error": o.error, "bytes": chunk_bytes[name], "bits_per_param": 8 * chunk_bytes[name] / qt.codes.size})
    return rows


def probe_groups(kinds: dict[str, str]) -> dict[str, str]:
    """The loss probe's groups: all Linears, all phi, each table alone."""
    return {name: name if kind == "table" else kind for name, kind in kinds.items()}


def quantize_rd(weights: dict[str, torch.Tensor], kinds: dict[str, str], models: dict[str, ErrorModel], method: str,
                measure: Callable, budget_bytes: int, log: Callable[[str], None],
                probe: Callable | None = None) -> Quantized:
    """probe(values) -> the loss increase with those values in place; None keeps the predicted errors unscaled."""
    t = time.perf_counter()
    options = {}
    for name, weight in weights.items():
        with naming(name):
            options[name] = tensor_options(weight, models[name], method)
    log(f"quant: {sum(map(len, options.values()))} candidates of {len(options)} tensors priced in "
        f"{time.perf_counter() - t:.1f}s")
    scaled = scale_errors(options, probe_groups(kinds), probe) if probe is not None else {}
    for group, m in scaled.items():
        log(f"quant: probe {group}: {m['tensors']} tensors, loss +{m['loss_increase']:.4e} against "
            f"{m['predicted']:.4e} predicted: errors x {m['factor']:.3g}")
    choice, size, probes = allocate(options, measure, budget_bytes, log)
    picked = {name: options[name][i] for name, i in choice.items()}
    _, chunks = measure({name: o.value for name, o in picked.items()})
    return Quantized({n: o.value for n, o in picked.items()}, size, probes, report_rows(picked, kinds, chunks),
                     scaled=scaled)


def quantize_sdclip(weights: dict[str, torch.Tensor], kinds: dict[str, str], models: dict[str, ErrorModel],
                    method: str, measure: Callable, budget_bytes: int) -> Quantized:
    picked = {}
    for name, weight in weights.items():
        with naming(name):
            w = weight.detach().float()
            cand = sdclip_candidate(w, table=kinds[name] == "table")
            picked[name] = evaluate_candidates(w, models[name], method, [cand])[0]
    size, chunks = measure({name: o.value for name, o in picked.items()})
    probes = [{"artifact_bytes": size, "fits": size <= budget_bytes}]
    if size > budget_bytes:
        raise BudgetError(f"the records' scheme (sdclip) makes a {size:,}-byte artifact, over the budget of "
                          f"{budget_bytes:,} bytes by {size - budget_bytes:,} bytes; hint: quant.scheme=rd fits any "
                          "budget its coarsest grids fit")
    return Quantized({n: o.value for n, o in picked.items()}, size, probes, report_rows(picked, kinds, chunks))


def quantize_rank(linears: dict[str, torch.Tensor], observed: dict[str, torch.Tensor], tables: dict[str, torch.Tensor],
                  calib: Calibration, fisher: Fisher | None, method: str, min_bits: int, observed_bits: int,
                  table_bits: int, measure: Callable, budget_bytes: int, chunk_size: Callable) -> Quantized:
    """Linears at int5/int6 (int4 as the fallback) by sensitivity rank; phi at observed_bits; tables by RTN."""
    widths = tuple(range(min_bits, HIGH_BITS + 1))
    candidates, details = {}, {}
    for name, weight in linears.items():
        h = calib.hessians[name]
        w = weight.detach().to(h.device)
        with naming(name):
            results = gptq_quantize(w, h, widths) if method == "gptq" else {b: rtn_quantize(w, b, h) for b in widths}
        candidates[name] = {b: qt for b, (qt, _) in results.items()}
        errors = {b: err for b, (_, err) in results.items()}
        if fisher is not None:
            f = fisher.rows[name].to(h.device)
            errors = {b: float((row_errors(qt.dequantize().to(h.device) - w.float(), h) * f).sum())
                      for b, qt in candidates[name].items()}
        details[name] = {"shape": list(w.shape), "trace_h_per_in": float(torch.trace(h)) / h.shape[0],
                         **{f"err{b}": errors[b] for b in widths}}
    fixed, observed_log = {}, []
    for name, weight in observed.items():
        h = calib.hessians[name]
        w = weight.detach().to(h.device)
        with naming(name):
            qt, err = gptq_quantize(w, h, (observed_bits,))[observed_bits] if method == "gptq" else \
                rtn_quantize(w, observed_bits, h)
        fixed[name] = qt
        observed_log.append({"name": name, "bits": observed_bits, "shape": list(w.shape), "err": err,
                             "trace_h_per_in": float(torch.trace(h)) / h.shape[0]})
    for name, weight in tables.items():
        with naming(name):
            fixed[name] = rtn_quantize(weight, table_bits)[0]

    def compose(bits: dict[str, int]) -> dict[str, QuantizedTensor]:
        return {**{n: candidates[n][b] for n, b in bits.items()}, **fixed}

    numel = {n: d["shape"][0] * d["shape"][1] for n, d in details.items()}
    sensitivity = {n: (d["err5"] - d["err6"]) / numel[n] for n, d in details.items()}
    demotion = ({n: (d["err4"] - d["err5"]) / numel[n] for n, d in details.items()}
                if min_bits == FALLBACK_BITS else None)
    bits, size, probes = allocate_bits(sensitivity, lambda b: measure(compose(b))[0], budget_bytes, demotion,
                                       lambda name, b: chunk_size(name, candidates[name][b]))
    return Quantized(compose(bits), size, probes, matrices=allocation_log(sensitivity, bits, details),
                     observed=observed_log)

