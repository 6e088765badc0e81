"""The one entry point the trainer calls: calibrate, quantize, allocate bits, write and verify the artifact.

Which tensor gets which treatment (by state_dict name):
  * the weight of every nn.Linear           -> GPTQ (or RTN) int5/int6, per allocate.allocate_bits
                                               (int4 for a few when min_bits=4 and all-int5 is over budget),
                                               or per allocate.allocate_lagrangian (allocator="lagrangian");
                                               errors are output MSE, or Fisher-weighted (error_weight="fisher");
  * 2-D tensors matching `observed_patterns` -> GPTQ (or RTN) at the fixed `observed_bits`, on the Hessian
    (parameters [out, in] whose inputs the       of the inputs the model reports (mHC phi); they stay out of
    model reports, see quant/calibrate.py)       the allocation, whose sensitivities are Linear output errors;
  * nn.Embedding weights, and 2-D tensors
    matching one of `table_patterns`        -> int8 per-row scale, round-to-nearest;
  * everything else (norm gains, scalars,
    biases, other small tensors)            -> float16, or float32 when it has <= FP32_MAX_NUMEL
    elements: those are scalars/gates/mixing biases where fp16's 3-digit precision could shift
    behaviour, and keeping them exact costs a few hundred bytes at most. Integer tensors are kept as is.
"""
from __future__ import annotations

import contextlib
import fnmatch
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn as nn

from data.files import write_atomic
from quant.allocate import FALLBACK_BITS, HIGH_BITS, LOW_BITS, allocate_bits, allocate_lagrangian, allocation_log
from quant.calibrate import collect_hessians, collect_output_fisher
from quant.container import ChunkCache, build_artifact, check_meta, dequantize_state, parse_artifact
from quant.gptq import FP16_MAX, gptq_quantize, row_errors, rtn_quantize
from quant.options import ALLOCATORS, ERROR_WEIGHTS, METHODS, MIN_BITS, OBSERVED_BITS, TABLE_BITS
from quant.pack import QuantizedTensor

assert MIN_BITS == (FALLBACK_BITS, LOW_BITS), "quant.options.MIN_BITS must name the allocator's widths"
FP32_MAX_NUMEL = 64


@dataclass
class TensorPlan:
    linears: dict[str, nn.Linear] = field(default_factory=dict)  # weight name -> module
    observed: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [out, in] weight
    tables: list[str] = field(default_factory=list)
    others: list[str] = field(default_factory=list)


def plan_tensors(model: nn.Module, table_patterns: Iterable[str] = (),
                 observed_patterns: Iterable[str] = ()) -> TensorPlan:
    state = model.state_dict()
    _refuse_aliases(state)
    _refuse_non_finite(state)
    plan = TensorPlan()
    embeddings = set()
    for mod_name, module in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        if isinstance(module, nn.Linear):
            plan.linears[prefix + "weight"] = module
        elif isinstance(module, nn.Embedding):
            embeddings.add(prefix + "weight")
    kinds = {**{p: "table" for p in table_patterns}, **{p: "observed" for p in observed_patterns}}
    used = {p: False for p in kinds}
    for name, tensor in state.items():
        if name in plan.linears:
            continue
        hits = [p for p in kinds if fnmatch.fnmatchcase(name, p)]
        for p in hits:
            used[p] = True
            if tensor.ndim != 2:
                raise ValueError(f"{kinds[p]} pattern {p!r} matches {name!r} of shape {tuple(tensor.shape)}; "
                                 "quantized matrices must be 2-D")
        if len({kinds[p] for p in hits}) > 1:
            raise ValueError(f"{name!r} matches both a table and an observed pattern ({hits}); pick one")
        if hits and kinds[hits[0]] == "observed":
            plan.observed[name] = tensor
        else:
            (plan.tables if name in embeddings or hits else plan.others).append(name)
    unused = [p for p, hit in used.items() if not hit]
    if unused:
        raise ValueError(f"patterns {unused} match no non-Linear tensor; names look like "
                         f"{list(state)[:3]} (hint: fnmatch syntax, e.g. 'mhc.*.phi')")
    return plan


def _refuse_aliases(state: dict[str, torch.Tensor]) -> None:
    seen: dict[tuple, str] = {}
    for name, tensor in state.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if tensor.numel() and key in seen:
            raise ValueError(f"state_dict entries {seen[key]!r} and {name!r} share storage (tied weights); "
                             "the artifact stores each tensor once: untie them or drop one from the state_dict")
        seen[key] = name


def _refuse_non_finite(state: dict[str, torch.Tensor]) -> None:
    """A NaN weight would surface later as a Hessian error or a failed read-back check, naming neither the
    tensor nor the cause."""
    for name, tensor in state.items():
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise ValueError(f"{name} holds NaN or Inf, so the model cannot be quantized (hint: the run diverged; "
                             "lower the learning rate, or resume from an earlier checkpoint)")


def small_tensor(tensor: torch.Tensor) -> np.ndarray:
    """A tensor stored as is: fp32 when small (or past fp16's range, which would make it Inf), else fp16."""
    t = tensor.detach().cpu()
    if t.is_floating_point():
        wide = t.numel() <= FP32_MAX_NUMEL or bool(t.abs().max() > FP16_MAX)
        return t.float().numpy().astype(np.float32 if wide else np.float16)
    return t.numpy().copy()


def _table(name: str, weight: torch.Tensor, bits: int):
    """An embedding table, round-to-nearest per row; an error names the table."""
    with _naming(name):
        return rtn_quantize(weight, bits)[0]


@contextlib.contextmanager
def _naming(name: str):
    """Prefix a quantizer's error (a NaN Hessian, a shape, a Hessian GPTQ cannot factorize) with the matrix it was
    quantizing, keeping its type."""
    try:
        yield
    except (ValueError, RuntimeError) as e:
        raise type(e)(f"{name}: {e}") from e


def quantize_matrices(plan: TensorPlan, hessians: dict[str, torch.Tensor], method: str, min_bits: int = LOW_BITS,
                      row_weights: dict[str, torch.Tensor] | None = None,
                      ) -> tuple[dict[str, dict[int, QuantizedTensor]], dict[str, dict]]:
    """Candidates per matrix for every width from min_bits to int6, and their errors (errB keys):
    Σ_rows Δw H Δwᵀ, each row times its weight when `row_weights` (per output unit) are given."""
    if method not in METHODS:
        raise ValueError(f"unknown quantization method {method!r}; expected one of {METHODS}")
    widths = tuple(range(min_bits, HIGH_BITS + 1))
    candidates, details = {}, {}
    for name, module in plan.linears.items():
        h = hessians[name]
        weight = module.weight.detach().to(h.device)
        with _naming(name):
            results = gptq_quantize(weight, h, widths) if method == "gptq" else {
                b: rtn_quantize(weight, b, h) for b in widths}
        candidates[name] = {b: qt for b, (qt, _) in results.items()}
        errors = {b: err for b, (_, err) in results.items()}
        if row_weights is not None:
            f = row_weights[name].to(h.device)
            errors = {b: float((row_errors(qt.dequantize().to(h.device) - weight.float(), h) * f).sum())
                      for b, qt in candidates[name].items()}
        details[name] = {"shape": list(weight.shape), "trace_h_per_in": float(torch.trace(h)) / h.shape[0],
                         **{f"err{b}": errors[b] for b in widths}}
    return candidates, details


def quantize_observed(plan: TensorPlan, hessians: dict[str, torch.Tensor], method: str, bits: int,
                      ) -> tuple[dict[str, QuantizedTensor], list[dict]]:
    """The observed matrices at `bits` (GPTQ or RTN, H-weighted clip search), and a log row for each."""
    quantized, rows = {}, []
    for name, weight in plan.observed.items():
        h = hessians[name]
        w = weight.detach().to(h.device)
        with _naming(name):
            qt, err = gptq_quantize(w, h, (bits,))[bits] if method == "gptq" else rtn_quantize(w, bits, h)
        quantized[name] = qt
        rows.append({"name": name, "bits": bits, "shape": list(w.shape), "err": err,
                     "trace_h_per_in": float(torch.trace(h)) / h.shape[0]})
    return quantized, rows


def export_artifact(model: nn.Module, calib_batches: Iterable[torch.Tensor], path: str, meta: dict,
                    budget_bytes: int, method: str = "gptq", log: Callable[[str], None] = print,
                    table_patterns: Iterable[str] = (), codec: str = "brotli", layout: str = "byte",
                    min_bits: int = LOW_BITS, autocast_dtype: torch.dtype | None = None,
                    observed_patterns: Iterable[str] = (), observed_bits: int = HIGH_BITS,
                    allocator: str = "rank", error_weight: str = "output", table_bits: int = 8) -> dict:
    """Quantize `model` into the artifact at `path` (at most `budget_bytes`); returns the report.

    min_bits=4 lets the allocator demote the least sensitive matrices to int4 when even all-int5 is
    over the budget (see quant/allocate.py); with 5 that case raises BudgetError.
    table_bits: width of the embedding tables (and `table_patterns` matches), round-to-nearest per row.
    observed_patterns / observed_bits: non-Linear matrices quantized like Linears at a fixed width,
    on Hessians from `model.quant_observer` (the mHC phi projections; see model/gpt.py).
    allocator: "rank" (int6 for a sensitivity-ranked prefix, int4 only as the min_bits=4 fallback, then the
    bytes left filled in the same order) or
    "lagrangian" (every width from min_bits to int6 priced by its own bytes; see quant/allocate.py).
    error_weight: "output" (the allocators compare output MSE) or "fisher" (each output row's error
    times the mean squared loss gradient of that output: an estimate of the loss increase; one extra
    forward and backward over the calibration batches).
    autocast_dtype: the calibration forward's autocast (bf16 on a GPU, as in training and evaluation).

    The model is not modified. After writing, the artifact is read back and checked bit for bit
    against the in-memory quantized tensors, so the reported size is the size of what loads.
    """
    check_meta(meta)
    for name, value, allowed in (("method", method, METHODS), ("min_bits", min_bits, MIN_BITS),
                                 ("table_bits", table_bits, TABLE_BITS), ("error_weight", error_weight, ERROR_WEIGHTS),
                                 ("allocator", allocator, ALLOCATORS), ("observed_bits", observed_bits, OBSERVED_BITS)):
        if value not in allowed:
            raise ValueError(f"quantization option {name}={value!r}: expected one of {allowed}")
    plan = plan_tensors(model, table_patterns, observed_patterns)
    if not plan.linears:
        raise ValueError("the model has no nn.Linear modules to quantize")
    timings = {}
    t = time.perf_counter()
    calib_batches = list(calib_batches)  # read twice with Fisher weights
    hessians, n_tokens = collect_hessians(model, plan.linears, calib_batches, autocast_dtype, plan.observed)
    fisher = (collect_output_fisher(model, plan.linears, calib_batches, autocast_dtype)
              if error_weight == "fisher" else None)
    timings["calib_s"] = time.perf_counter() - t

    t = time.perf_counter()
    candidates, details = quantize_matrices(plan, hessians, method, min_bits, fisher)
    state = model.state_dict()
    fixed, observed_log = quantize_observed(plan, hessians, method, observed_bits)
    fixed.update({name: _table(name, state[name], table_bits) for name in plan.tables})
    fixed.update({name: small_tensor(state[name]) for name in plan.others})
    timings["quant_s"] = time.perf_counter() - t
    del hessians

    meta = {**meta, "quant": {"method": method, "calib_tokens": n_tokens}}
    cache = ChunkCache()

    def compose(bits: dict[str, int]) -> dict:
        return {name: candidates[name][bits[name]] if name in candidates else fixed[name] for name in state}

    t = time.perf_counter()
    numel = {n: d["shape"][0] * d["shape"][1] for n, d in details.items()}
    sensitivity = {n: (d["err5"] - d["err6"]) / numel[n] for n, d in details.items()}
    demotion = ({n: (d["err4"] - d["err5"]) / numel[n] for n, d in details.items()}
                if min_bits == FALLBACK_BITS else None)

    def size_of(bits: dict[str, int]) -> int:
        return len(build_artifact(meta, compose(bits), codec, layout, cache))

    if allocator == "lagrangian":
        nbytes = chunk_bytes(candidates, cache, codec, layout)
        options = {n: {b: (details[n][f"err{b}"], nbytes[n][b]) for b in candidates[n]} for n in candidates}
        bits, size, probes = allocate_lagrangian(options, size_of, budget_bytes)
    else:
        def chunk_size(name: str, bits: int) -> int:  # one matrix's compressed chunk (cached, as the probes built it)
            return len(cache.get([(name, candidates[name][bits])], codec, layout, 1)[0][1])
        bits, size, probes = allocate_bits(sensitivity, size_of, budget_bytes, demotion, chunk_size)
    timings["alloc_s"] = time.perf_counter() - t

    t = time.perf_counter()
    quantized = compose(bits)
    data = build_artifact(meta, quantized, codec, layout, cache)
    _verify_round_trip(path, data, quantized, size)  # before the write: a bad artifact never replaces a good one
    write_atomic(path, data)
    written = len(data)
    timings["save_verify_s"] = time.perf_counter() - t

    matrices = allocation_log(sensitivity, bits, details)
    report = {"method": method, "allocator": allocator, "error_weight": error_weight, "codec": codec, "layout": layout, "calib_tokens": n_tokens,
              "artifact_bytes": written, "budget_bytes": budget_bytes,
              "n_int6": sum(b == HIGH_BITS for b in bits.values()), "n_int5": sum(b == LOW_BITS for b in bits.values()),
              "n_int4": sum(b == FALLBACK_BITS for b in bits.values()),
              "tables": list(plan.tables), "table_bits": table_bits, "others": {n: str(fixed[n].dtype) for n in plan.others},
              "observed": observed_log,
              "matrices": matrices, "probes": probes, **timings}
    _log_report(report, log)
    return report


def chunk_bytes(candidates: dict[str, dict[int, QuantizedTensor]], cache: ChunkCache, codec: str, layout: str,
                ) -> dict[str, dict[int, int]]:
    """Compressed bytes of every candidate's own chunk (all compressed at once, in parallel, and cached
    for the artifacts the allocator then builds)."""
    items = [(name, qt) for name, by_bits in candidates.items() for qt in by_bits.values()]
    chunks = cache.get(items, codec, layout, os.cpu_count() or 1)
    out: dict[str, dict[int, int]] = {}
    for (name, qt), (_, chunk) in zip(items, chunks):
        out.setdefault(name, {})[qt.bits] = len(chunk)
    return out


def _verify_round_trip(path: str, data: bytes, quantized: dict, measured: int) -> None:
    """The artifact's bytes are the size the allocator measured and load back to exactly the quantized tensors."""
    if len(data) != measured:
        raise RuntimeError(f"{path}: built {len(data)} bytes but the allocator measured {measured} for the same choice")
    _, loaded = parse_artifact(data, path)
    expected = dequantize_state(quantized)
    bad = [n for n in expected if n not in loaded or not torch.equal(loaded[n], expected[n])]
    if bad or set(loaded) != set(expected):
        raise RuntimeError(f"{path}: the artifact does not load back to the quantized tensors (first mismatch: "
                           f"{(bad or sorted(set(loaded) ^ set(expected)))[0]!r}); nothing was written")


def _log_report(report: dict, log: Callable[[str], None]) -> None:
    log(f"quant: {report['method']} calibration {report['calib_tokens']} tokens in {report['calib_s']:.1f}s, "
        f"quantization {report['quant_s']:.1f}s, allocation {report['alloc_s']:.1f}s "
        f"({report['allocator']}, {sum(not p.get('cached') for p in report['probes'])} artifacts built), "
        f"save+verify {report['save_verify_s']:.1f}s")
    for row in report["matrices"]:
        log(f"quant: rank {row['rank']:>3} int{row['bits']} {row['name']:<44} sens {row['sensitivity']:.3e} "
            + (f"err4 {row['err4']:.3e} " if "err4" in row else "")
            + f"err5 {row['err5']:.3e} err6 {row['err6']:.3e} tr(H)/in {row['trace_h_per_in']:.3e}")
    for row in report["observed"]:
        log(f"quant: fixed int{row['bits']} {row['name']:<44} err {row['err']:.3e} "
            f"tr(H)/in {row['trace_h_per_in']:.3e}")
    if report["n_int4"] and report["allocator"] == "rank":
        log(f"quant: WARNING all-int5 was over the budget: {report['n_int4']} matrices fell back to int4 "
            "(quant.min_bits=4); the quantization gap will be larger than the int5/int6 recipe's")
    log(f"quant: {report['n_int6']} int6 + {report['n_int5']} int5 + {report['n_int4']} int4 matrices, "
        f"{len(report['observed'])} observed matrices, {len(report['tables'])} int{report['table_bits']} tables, "
        f"{len(report['others'])} other tensors; artifact {report['artifact_bytes']} bytes "
        f"(budget {report['budget_bytes']}, {report['codec']}, layout {report['layout']})")
