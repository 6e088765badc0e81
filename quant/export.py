"""The one entry point the trainer calls: calibrate, quantize, write and verify the artifact.

Which tensor gets which treatment (by state_dict name):
  * the weight of every nn.Linear                   -> a matrix, quantized by the scheme (quant/schemes.py);
  * 2-D tensors matching `observed_patterns`        -> a matrix too, on the Hessian of the inputs the model
    (parameters [out, in] whose inputs the model       reports (mHC phi; see quant/calibrate.py);
    reports)
  * nn.Embedding weights, and 2-D tensors matching  -> a table: by the scheme, on its lookups' statistics (the tied
    one of `table_patterns`                            embedding also on the output layer's input Hessian);
  * everything else (norm gains, scalars,
    biases, other small tensors)            -> float16, or float32 when it has <= FP32_MAX_NUMEL
    elements: those are scalars/gates/mixing biases where fp16's 3-digit precision could shift
    behaviour, and keeping them exact costs a few hundred bytes at most. Integer tensors are kept as is.
"""
from __future__ import annotations

import fnmatch
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn as nn

from data.files import write_atomic
from quant.allocate import FALLBACK_BITS, HIGH_BITS, LOW_BITS
from quant.calibrate import calibrate, collect_fisher
from quant.container import ChunkCache, build_artifact, check_meta, dequantize_state, parse_artifact
from quant.gptq import FP16_MAX
from quant.options import ERROR_WEIGHTS, METHODS, MIN_BITS, OBSERVED_BITS, SCHEMES, TABLE_BITS
from quant.pack import QuantizedTensor
from quant.probe import loss_with, mean_loss
from quant.profiling import export_part
from quant.schemes import error_models, quantize_rank, quantize_rd, quantize_sdclip

assert MIN_BITS == (FALLBACK_BITS, LOW_BITS), "quant.options.MIN_BITS must name the allocator's widths"
FP32_MAX_NUMEL = 64


@dataclass
class TensorPlan:
    linears: dict[str, nn.Linear] = field(default_factory=dict)  # weight name -> module
    observed: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [out, in] weight
    tables: list[str] = field(default_factory=list)
    others: list[str] = field(default_factory=list)
    embeddings: dict[str, nn.Embedding] = field(default_factory=dict)  # the tables looked up by nn.Embedding


def plan_tensors(model: nn.Module, table_patterns: Iterable[str] = (),
                 observed_patterns: Iterable[str] = ()) -> TensorPlan:
    state = model.state_dict()
    _refuse_aliases(state)
    _refuse_non_finite(state)
    plan = TensorPlan()
    for mod_name, module in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        if isinstance(module, nn.Linear):
            plan.linears[prefix + "weight"] = module
        elif isinstance(module, nn.Embedding):
            plan.embeddings[prefix + "weight"] = module
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
            (plan.tables if name in plan.embeddings or hits else plan.others).append(name)
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


def export_artifact(model: nn.Module, calib_batches: Iterable[torch.Tensor], path: str, meta: dict,
                    budget_bytes: int, method: str = "gptq", log: Callable[[str], None] = print,
                    table_patterns: Iterable[str] = (), codec: str = "brotli", layout: str = "byte",
                    min_bits: int = LOW_BITS, autocast_dtype: torch.dtype | None = None,
                    observed_patterns: Iterable[str] = (), observed_bits: int = HIGH_BITS,
                    scheme: str = "rd", error_weight: str = "fisher", table_bits: int = 8) -> dict:
    """Quantize `model` into the artifact at `path` (at most `budget_bytes`); returns the report.

    scheme: "rd" (every tensor's step size by rate–distortion under the budget), "rank" (int5/int6 matrices by
    sensitivity rank; min_bits, observed_bits and table_bits apply to it alone) or "sdclip" (the records' fixed
    scheme); see quant/schemes.py.
    error_weight: "fisher" (errors times the loss gradient² at each output: an estimate of the loss increase,
    comparable across tensors; one extra forward and backward over the calibration batches) or "output" (plain
    output MSE; a table's error by its rows' share of the lookups).
    autocast_dtype: the calibration forward's autocast (bf16 on a GPU, as in training and evaluation).

    The model is not modified. After writing, the artifact is read back and checked bit for bit
    against the in-memory quantized tensors, so the reported size is the size of what loads.
    """
    check_meta(meta)
    for name, value, allowed in (("method", method, METHODS), ("min_bits", min_bits, MIN_BITS),
                                 ("table_bits", table_bits, TABLE_BITS), ("error_weight", error_weight, ERROR_WEIGHTS),
                                 ("scheme", scheme, SCHEMES), ("observed_bits", observed_bits, OBSERVED_BITS)):
        if value not in allowed:
            raise ValueError(f"quantization option {name}={value!r}: expected one of {allowed}")
    plan = plan_tensors(model, table_patterns, observed_patterns)
    if not plan.linears:
        raise ValueError("the model has no nn.Linear modules to quantize")
    state = model.state_dict()
    device = next(model.parameters()).device
    tables = {name: state[name] for name in plan.tables}
    by_rd = scheme != "rank"
    timings = {}
    t = time.perf_counter()
    calib_batches = list(calib_batches)  # read twice with Fisher weights
    heads = tables if by_rd and hasattr(model, "quant_observer") else None  # the tied table, reported as the head
    lookups = plan.embeddings if by_rd else None
    with export_part("export: hessians"):  # calibration's parts, named in a profile (quant/profiling.py)
        calib = calibrate(model, plan.linears, calib_batches, autocast_dtype, plan.observed, heads, lookups)
    timings["hessian_s"] = seconds_since(t, device)
    fisher = None
    if error_weight == "fisher":
        outputs = [*plan.observed, *(n for n in tables if n in calib.hessians)] if by_rd else []
        with export_part("export: fisher"):
            fisher = collect_fisher(model, plan.linears, calib_batches, autocast_dtype, outputs, lookups)
    timings["calib_s"] = seconds_since(t, device)
    if fisher is not None:
        timings["fisher_s"] = timings["calib_s"] - timings["hessian_s"]

    t = time.perf_counter()
    meta = {**meta, "quant": {"method": method, "scheme": scheme, "calib_tokens": calib.tokens}}
    fixed = {name: small_tensor(state[name]) for name in plan.others}
    cache = ChunkCache()

    def measure(values: dict) -> tuple[int, dict[str, int]]:
        """Bytes of the artifact of `values` with the fixed tensors, and of each of those values' chunks."""
        quantized = {name: values[name] if name in values else fixed[name] for name in state}
        size = len(build_artifact(meta, quantized, codec, layout, cache))
        chunks = cache.get(list(values.items()), codec, layout, 1)
        return size, {name: len(chunk) for name, (_, chunk) in zip(values, chunks)}

    if by_rd:
        weights = {**{n: m.weight for n, m in plan.linears.items()}, **plan.observed, **tables}
        kinds = {**dict.fromkeys(plan.linears, "linear"), **dict.fromkeys(plan.observed, "phi"),
                 **dict.fromkeys(tables, "table")}
        models = error_models(weights, kinds, calib, fisher)
        del calib
        if scheme == "rd":
            # Fisher errors are scaled to measured loss (quant/probe.py)
            probe_loss = loss_probe(model, calib_batches, autocast_dtype, timings) if error_weight == "fisher" else None
            result = quantize_rd(weights, kinds, models, method, measure, budget_bytes, log, probe_loss)
        else:
            result = quantize_sdclip(weights, kinds, models, method, measure, budget_bytes)
    else:
        def chunk_size(name: str, value: QuantizedTensor) -> int:
            return len(cache.get([(name, value)], codec, layout, 1)[0][1])
        result = quantize_rank({n: m.weight for n, m in plan.linears.items()}, plan.observed, tables, calib, fisher,
                               method, min_bits, observed_bits, table_bits, measure, budget_bytes, chunk_size)
    timings["quant_alloc_s"] = time.perf_counter() - t
    if "probe_pass_s" in timings:  # the probes' time, counted as calibration: decoding and every pass
        timings["probe_s"] = timings["probe_dequantize_s"] + sum(timings["probe_pass_s"])

    t = time.perf_counter()
    quantized = {name: result.values[name] if name in result.values else fixed[name] for name in state}
    data = build_artifact(meta, quantized, codec, layout, cache)
    _verify_round_trip(path, data, quantized, result.size)  # before the write: a bad artifact never replaces a good one
    write_atomic(path, data)
    timings["save_verify_s"] = time.perf_counter() - t

    bits = {name: result.values[name].bits for name in plan.linears}
    report = {"method": method, "scheme": scheme, "error_weight": error_weight, "codec": codec, "layout": layout,
              "calib_tokens": meta["quant"]["calib_tokens"], "artifact_bytes": len(data), "budget_bytes": budget_bytes,
              **{f"n_int{b}": sum(v == b for v in bits.values()) for b in (8, 6, 5, 4)},
              "tables": list(plan.tables), "table_bits": table_bits,
              "others": {n: str(fixed[n].dtype) for n in plan.others},
              "tensors": result.rows, "observed": result.observed, "matrices": result.matrices,
              "probes": result.probes, "loss_probes": result.scaled, **timings}
    _log_report(report, log)
    return report


def seconds_since(t: float, device: torch.device) -> float:
    """perf_counter seconds since t once the device has run what was queued: a CUDA kernel runs after the call that
    queued it, so without the wait its time would count in whatever waits for it next."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t


def loss_probe(model: nn.Module, batches: list[torch.Tensor], autocast_dtype, timings: dict) -> Callable:
    """probe(values) -> the loss increase on the calibration batches with `values` in place; its time goes to
    timings in parts: decoding `values` with numpy (reading no tokens) to timings["probe_dequantize_s"], and each
    pass over the batches (the unchanged model's first; each later one with the copies in and out of the model) to
    timings["probe_pass_s"]. Their sum is the probes' time (probe_s, counted as calibration: the probes read training
    tokens); it varies from run to run, and the parts say whether the host's decoding, one pass or every pass does."""
    t = time.perf_counter()
    with export_part("export: probe pass 0"):
        base = mean_loss(model, batches, autocast_dtype)
    first = time.perf_counter() - t
    timings.update(probe_dequantize_s=0.0, probe_pass_s=[first])

    def probe(values: dict[str, QuantizedTensor]) -> float:
        t = time.perf_counter()
        dense = {name: v.dequantize() for name, v in values.items()}
        decoded = time.perf_counter()
        with export_part(f"export: probe pass {len(timings['probe_pass_s'])}"):
            loss = loss_with(model, batches, dense, autocast_dtype)
        timings["probe_dequantize_s"] += decoded - t
        timings["probe_pass_s"].append(time.perf_counter() - decoded)
        return loss - base
    return probe


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


def kind_summary(rows: list[dict]) -> dict[str, dict]:
    """Per tensor kind (linear, phi, table): tensors, parameters, bytes, bits per parameter, summed error."""
    out: dict[str, dict] = {}
    for row in rows:
        k = out.setdefault(row["kind"], {"tensors": 0, "params": 0, "bytes": 0, "error": 0.0})
        k["tensors"] += 1
        k["params"] += row["params"]
        k["bytes"] += row["bytes"]
        k["error"] += row["error"]
    for k in out.values():
        k["bits_per_param"] = 8 * k["bytes"] / max(k["params"], 1)
    return out


def _log_report(report: dict, log: Callable[[str], None]) -> None:
    passes = "/".join(f"{s:.1f}" for s in report.get("probe_pass_s", ()))
    log(f"quant: {report['method']} ({report['scheme']}, {report['error_weight']} errors) calibration "
        f"{report['calib_tokens']} tokens in {report['calib_s']:.1f}s"
        + (f" (Hessians {report['hessian_s']:.1f}s, Fisher {report['fisher_s']:.1f}s)" if "fisher_s" in report else "")
        + (f" (+ loss probes {report['probe_s']:.1f}s: passes {passes}s, {report['probe_dequantize_s']:.1f}s decoding)"
           if "probe_s" in report else "") + ", quantization and allocation "
        f"{report['quant_alloc_s']:.1f}s ({sum(not p.get('cached') for p in report['probes'])} artifacts built), "
        f"save+verify {report['save_verify_s']:.1f}s")
    for row in report["matrices"]:
        log(f"quant: rank {row['rank']:>3} int{row['bits']} {row['name']:<44} sens {row['sensitivity']:.3e} "
            + (f"err4 {row['err4']:.3e} " if "err4" in row else "")
            + f"err5 {row['err5']:.3e} err6 {row['err6']:.3e} tr(H)/in {row['trace_h_per_in']:.3e}")
    for row in report["observed"]:
        log(f"quant: fixed int{row['bits']} {row['name']:<44} err {row['err']:.3e} "
            f"tr(H)/in {row['trace_h_per_in']:.3e}")
    for row in report["tensors"]:
        log(f"quant: {row['kind']:<6} {row['name']:<40} {row['grid']:<16} int{row['bits']} {row['bytes']:>9,} B "
            f"{row['bits_per_param']:.3f} bits/param, error {row['error']:.3e}")
    for kind, k in kind_summary(report["tensors"]).items():
        log(f"quant: {kind}: {k['tensors']} tensors, {k['params']:,} parameters in {k['bytes']:,} B "
            f"({k['bits_per_param']:.3f} bits/param), error {k['error']:.4e}")
    if report["n_int4"] and report["scheme"] == "rank":
        log(f"quant: WARNING all-int5 was over the budget: {report['n_int4']} matrices fell back to int4 "
            "(quant.min_bits=4); the quantization gap will be larger than the int5/int6 recipe's")
    widths = " + ".join(f"{report[f'n_int{b}']} int{b}" for b in (8, 6, 5, 4) if report[f"n_int{b}"])
    tables = (f"int{report['table_bits']} tables" if report["scheme"] == "rank" else "tables")
    log(f"quant: {widths} matrices, {len(report['observed'])} fixed-width observed matrices, "
        f"{len(report['tables'])} {tables}, {len(report['others'])} other tensors; artifact {report['artifact_bytes']} "
        f"bytes (budget {report['budget_bytes']}, {report['codec']}, layout {report['layout']})")
