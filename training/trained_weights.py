"""The weights a tool re-quantizes or screens: a checkpoint's shipped weights (its EMA shadow when it has one, as
train.py ships), or an artifact's dequantized weights. Shared by scripts.bench_quant and scripts.bench_lowrank."""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from quant.container import ArtifactError, load_artifact
from training.score import recorded_recurrence


NO_WEIGHTS = ("{checkpoint}: no rank0.pt and not an artifact (hint: pass a step_NNNNNNNN folder written by train.py's "
              "checkpointer, e.g. runs/checkpoints/RUN/step_00000500, or a .mhcg artifact)")


def add_weights_arguments(p: argparse.ArgumentParser) -> None:
    """--config and --checkpoint, as every tool that reads a trained model's weights takes them."""
    p.add_argument("--config", required=True)
    p.add_argument("--checkpoint", required=True, type=Path,
                   help="a step_NNNNNNNN folder of train.py's checkpointer, or a .mhcg artifact (its dequantized weights)")


def require_weights(p: argparse.ArgumentParser, checkpoint: Path) -> None:
    """A usage error naming --checkpoint where it holds no weights: before any data or device is set up."""
    if checkpoint_weights(checkpoint) is None:
        p.error(NO_WEIGHTS.format(checkpoint=checkpoint))


def checkpoint_weights(checkpoint: Path) -> Path | None:
    """The file the weights come from: a checkpoint folder's rank0.pt, or an artifact (a .mhcg file)."""
    path = checkpoint if checkpoint.suffix == ".mhcg" else checkpoint / "rank0.pt"
    return path if path.is_file() else None


def fit(model: torch.nn.Module, state: dict, path: Path) -> None:
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        raise SystemExit(f"{path}: the weights do not fit the model of --config ({str(e).splitlines()[0]}); "
                         "hint: pass the run's own config and model overrides") from None


def load_weights(checkpoint: Path, model: torch.nn.Module) -> tuple[str, float]:
    """Put the checkpoint's shipped weights into `model`; returns which ones ('ema', 'model', or 'artifact': an
    artifact's dequantized weights, to re-quantize a shipped model or time the export) and the seconds of training
    the checkpoint records (the export checks calibration against the budget left after them; 0 for an artifact)."""
    path = checkpoint_weights(checkpoint)
    if path is None:
        raise SystemExit(NO_WEIGHTS.format(checkpoint=checkpoint))
    if path.suffix == ".mhcg":
        try:
            meta, state = load_artifact(path)
            fit(model, state, path)
            model.recurrence_on = recorded_recurrence(path, meta)
        except ArtifactError as e:
            raise SystemExit(str(e)) from None
        return "artifact", 0.0
    state = torch.load(path, map_location="cpu", weights_only=True)
    fit(model, state["model"], path)
    model.recurrence_on = bool(state.get("recurrence_on", False))  # depth recurrence as the weights last trained
    train_time_s = float(state.get("train_time_s", 0.0))
    if "ema" not in state:
        return "model", train_time_s
    live = model.state_dict()
    with torch.no_grad():
        for name, shadow in state["ema"]["shadow"].items():
            live[name].copy_(shadow)
    return "ema", train_time_s
