"""From trained weights to the shipped artifact: calibration batches, GPTQ export, size accounting.

Calibration uses TRAINING tokens (a fresh loader order, never validation data) or text the model
samples itself, and runs inside the training wall-clock budget (quant.calib_reserve_s).
"""
from __future__ import annotations

import dataclasses
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed

from data.loader import TokenLoader
from model.layers import MLP
from quant.calibrate import generate_calibration_tokens
from quant.allocate import BudgetError
from quant.export import export_artifact, kind_summary
from training.config import Config, ConfigError
from training.eval_config import EVAL_RECORDED
from training.shipped_code import code_bytes

CALIB_SEED_OFFSET = 7919  # calibration reads the training shards in an order of its own
ARTIFACT_CODEC = "brotli"  # Brotli-11 on every tensor chunk (quant.container); train.py checks it at setup


@contextmanager
def reference_mlps(model: torch.nn.Module):
    """GPTQ hooks nn.Linear calls; the fused MLP kernel bypasses them, so calibrate on the reference."""
    mlps = [m for m in model.modules() if isinstance(m, MLP)]
    saved = [m.use_kernel for m in mlps]
    for m in mlps:
        m.use_kernel = False
    try:
        yield
    finally:
        for m, s in zip(mlps, saved):
            m.use_kernel = s


def observed_patterns(model) -> tuple[str, ...]:
    """The mHC projections phi ([n^2+2n, n*C] each, ~1.08M values at the record size): not nn.Linear
    weights, so the model reports their inputs (GPT.quant_observer) and they are GPTQ'd like matrices."""
    return ("mhc.*.phi",) if any(name.endswith(".phi") for name, _ in model.named_parameters()) else ()


def calibration_batches(cfg: Config, model, train_files: list[str], device: torch.device) -> list[torch.Tensor]:
    q, seq_len = cfg.quant, cfg.data.seq_len
    batch = min(8, q.calib_seqs)
    if q.calib_source == "generated":
        ids = generate_calibration_tokens(model, q.calib_seqs, seq_len, seed=cfg.train.seed)
        return list(ids.to(device).split(batch))
    loader = TokenLoader(train_files, seq_len, batch, seed=cfg.train.seed + CALIB_SEED_OFFSET,
                         shards_per_batch=cfg.data.shards_per_batch, prefetch=2, device=device,
                         vocab_size=cfg.model.vocab_size)
    try:  # the last batch is cut to what is left, so exactly calib_seqs sequences are calibrated on
        batches = [loader.next_batch()[0] for _ in range(-(-q.calib_seqs // batch))]
        batches[-1] = batches[-1][:q.calib_seqs - batch * (len(batches) - 1)]
        return batches
    finally:
        loader.close()


def calibration_within_budget(cfg: Config, seconds: float, train_time_s: float, log) -> bool | None:
    """Did training and calibration on training tokens (batches + Hessians, + Fisher weights) together fit in
    train.time_budget_s? The rules put calibration inside the training budget; train.py stops training
    quant.calib_reserve_s early to leave room for it. None where no such rule applies: no time budget, or
    calibration on text the model generated itself."""
    budget = cfg.train.time_budget_s
    if not budget or cfg.quant.calib_source != "train":
        return None
    used = train_time_s + seconds
    if used <= budget:
        log(f"calibration {seconds:.1f} s after {train_time_s:.1f} s of training: {used:.1f} s, inside the "
            f"{budget:g} s budget")
        return True
    share = budget - cfg.quant.calib_reserve_s  # what training may take of the budget
    if train_time_s > share:  # training overran its share; calibration may have fit its reserve
        log(f"WARNING training took {train_time_s:.1f} s of its {share:g} s (train.time_budget_s={budget:g} minus "
            f"quant.calib_reserve_s={cfg.quant.calib_reserve_s:g}): its last step ended "
            f"{train_time_s - share:.1f} s past it, and with calibration ({seconds:.1f} s) the run used {used:.1f} s; "
            "hint: steps of uneven length (a loaded machine, evaluations inside training) overrun; a quieter "
            "machine, or a larger quant.calib_reserve_s, keeps the run inside")
    else:
        log(f"WARNING calibration on training tokens took {seconds:.1f} s after {train_time_s:.1f} s of training: "
            f"{used - budget:.1f} s beyond train.time_budget_s={budget:g}; hint: raise quant.calib_reserve_s (now "
            f"{cfg.quant.calib_reserve_s:g}) or calibrate on generated text (quant.calib_source=generated)")
    return False


def artifact_budget(cfg: Config) -> tuple[int, int]:
    """(the artifact's byte budget, the counted code): quant.budget_bytes, else cap_bytes - code - margin_bytes.
    Refused when the budget and the code do not fit under quant.cap_bytes: train.py asks at setup, before training,
    not after it."""
    code = code_bytes()
    budget = cfg.quant.budget_bytes or cfg.quant.cap_bytes - code - cfg.quant.margin_bytes
    if budget <= 0 or budget + code > cfg.quant.cap_bytes:
        given = f"quant.budget_bytes={cfg.quant.budget_bytes:,}" if cfg.quant.budget_bytes else \
            f"quant.margin_bytes={cfg.quant.margin_bytes:,}"
        raise ConfigError(f"{given} with {code:,} bytes of counted code leaves an artifact budget of {budget:,} bytes "
                          f"under quant.cap_bytes={cfg.quant.cap_bytes:,} (hint: the budget and the code must fit "
                          "under the cap together)")
    return budget, code


def export_model(cfg: Config, model, *, train_files: list[str], rank: int, world_size: int, log,
                 artifact_path: Path, tokenizer_sha256: str, device: torch.device, train_time_s: float) -> dict:
    """Rank 0 calibrates, quantizes and writes the artifact; the other ranks wait for it. An unexpected error on
    rank 0 is raised there once the others know (as an export_error), so that they stop instead of waiting.
    train_time_s: the training the budget has paid for already (calibration on training tokens must fit beside it)."""
    report: dict = {}
    failure: Exception | None = None
    if rank == 0:
        meta = {"model_config": dataclasses.asdict(cfg.model), "tokenizer_sha256": tokenizer_sha256,
                "run_id": cfg.train.run_id, "seq_len": cfg.data.seq_len,
                **{f"eval_{key}": getattr(cfg.eval, key) for key in EVAL_RECORDED},  # scripts.evaluate's defaults
                # the phase of depth recurrence training ended in: the scorer runs the model as it was calibrated
                **({"recurrence_on": model.recurrence_on} if cfg.model.recur_times > 1 else {})}
        t0, code = time.perf_counter(), None
        try:
            artifact_path.parent.mkdir(parents=True, exist_ok=True)
            budget, code = artifact_budget(cfg)
            with reference_mlps(model):
                batches = calibration_batches(cfg, model, train_files, device)
                t_calib_data = time.perf_counter() - t0
                report = export_artifact(model, batches, str(artifact_path), meta, budget,
                                         method=cfg.quant.method, log=log, min_bits=cfg.quant.min_bits,
                                         observed_patterns=observed_patterns(model),
                                         observed_bits=cfg.quant.phi_bits, scheme=cfg.quant.scheme,
                                         codec=ARTIFACT_CODEC,
                                         error_weight=cfg.quant.error_weight, table_bits=cfg.quant.table_bits,
                                         autocast_dtype=torch.bfloat16 if device.type == "cuda" else None)
        except BudgetError as e:  # reported in the final JSON; the run then exits non-zero
            log(f"export failed: {e}")
            report = {"export_error": str(e), "code_bytes": code}
        except Exception as e:  # raised below, after the other ranks have learned of it
            failure, report = e, {"export_error": f"{type(e).__name__}: {e}", "code_bytes": code}
            log(f"export failed: {report['export_error']}")
        if failure is None:  # a BudgetError too: calibration and quantization ran
            seconds = time.perf_counter() - t0
            log(f"phase quantize+export {seconds:.1f} s (calibration data {t_calib_data:.1f} s; "
                f"reserve {cfg.quant.calib_reserve_s} s)")
        if "export_error" not in report:  # a failed export has no calibration timing (its line would understate it)
            # the loss probes read training tokens too: calibration, inside the training budget
            calib_total = t_calib_data + report.get("calib_s", 0.0) + report.get("probe_s", 0.0)
            within = calibration_within_budget(cfg, calib_total, train_time_s, log)
    if rank == 0 and "export_error" not in report:
        report = {"artifact_bytes": artifact_path.stat().st_size, "code_bytes": code,
                  "export_seconds": round(seconds, 2), "quant_method": cfg.quant.method,
                  "calib_source": cfg.quant.calib_source, "calib_total_s": round(calib_total, 2),
                  **({} if within is None else {"calib_within_budget": within}),
                  **{k: v for k, v in report.items() if isinstance(v, (int, float, str))},
                  **({"kinds": kind_summary(report["tensors"])} if report["tensors"] else {})}
    if world_size > 1:  # every rank learns the outcome (and waits for the artifact file)
        holder = [report]
        torch.distributed.broadcast_object_list(holder, src=0)
        report = holder[0]
    if failure is not None:
        raise failure
    return report
