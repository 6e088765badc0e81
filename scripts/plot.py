"""Plot training loss and validation BPB of one or more runs, overlaid, from their logs.

    python -m scripts.plot logs/a.txt logs/b.txt --out plots/

Writes loss_vs_step.png, loss_vs_time.png, bpb_vs_step.png and bpb_vs_time.png (time is the
training wall clock, evaluation excluded, as the run logged it), and loss_vs_tokens.png /
bpb_vs_tokens.png when every log's config has train.batch_tokens (runs of different batch sizes or
GPU counts compared per training token). Validation BPB comes from the
periodic `eval` lines (eval.every_steps); the score of the shipped artifact is drawn as a marker
at the run's last step, so a run without periodic evaluations still shows its final point.
"""
from __future__ import annotations

import argparse
import io
import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt
from matplotlib.figure import Figure

REPO = Path(__file__).resolve().parents[1]

from data.files import write_atomic
from training.log_reader import LogFormatError, RunLogData, output_problem, parse_log

AXES = {"step": ("step", "step"), "time": ("train_time_s", "training time (s)"),
        "tokens": ("step", "training tokens (millions)")}  # tokens: step x train.batch_tokens


def axis_scale(log: RunLogData, axis: str) -> float:
    """Factor from the record's AXES key to the plotted value (tokens per step, in millions)."""
    return log.config_value("train.batch_tokens") / 1e6 if axis == "tokens" else 1


def has_batch_tokens(log: RunLogData) -> bool:
    return isinstance(log.config.get("train", {}).get("batch_tokens"), int)


def run_labels(logs: list[RunLogData]) -> list[str]:
    """Run ids; a run id seen twice (same name, different folders) gets its file path added."""
    ids = [log.label for log in logs]
    return [f"{rid} ({log.source})" if ids.count(rid) > 1 else rid for rid, log in zip(ids, logs)]


def final_point(log: RunLogData) -> dict | None:
    """{step, train_time_s, val_bpb} of the shipped artifact, or None for an unfinished run."""
    scored = log.final or log.stage_evals.get("artifact")
    if scored is None or not finite(scored.get("val_bpb")):  # unfinished, or diverged (NaN)
        return None
    last = log.steps[-1] if log.steps else {}
    return {"step": scored.get("steps", last.get("step")),
            "train_time_s": scored.get("train_time_s", last.get("train_time_s")),
            "val_bpb": scored["val_bpb"]}


def with_axis(source: str, records: list[dict], key: str, kind: str, axis: str) -> list[dict]:
    """The records that have the x-axis field (train.py writes it on each). The others are left out of this axis's
    plots and named on stderr: a KeyError stopped every plot before."""
    kept = [r for r in records if key in r]
    if len(kept) < len(records):
        missing = [r["step"] for r in records if key not in r]
        print(f"plot: {source}: {len(missing)} `{kind}` record(s) without {key!r} (step {missing[0]}"
              f"{', ...' if len(missing) > 1 else ''}) left out of the plots against {axis}", file=sys.stderr)
    return kept


def finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def loss_figure(logs: list[RunLogData], labels: list[str], axis: str) -> Figure:
    """NaN/inf losses (a diverged run) are left out; a run with none finite is named on stderr."""
    key, xlabel = AXES[axis]
    fig, ax = plt.subplots(figsize=(8, 5))
    for log, label in zip(logs, labels):
        steps, scale = with_axis(log.source, log.require_steps(), key, "step", axis), axis_scale(log, axis)
        points = [(s[key] * scale, s["loss"]) for s in steps if finite(s["loss"])]
        if not points:
            print(f"plot: {log.source}: no finite training loss to draw", file=sys.stderr)
            continue
        # a single point is invisible as a line
        ax.plot(*zip(*points), label=label, linewidth=1.2, marker="." if len(points) == 1 else None)
    ax.set(xlabel=xlabel, ylabel="train loss (nats/token)", title=f"training loss vs {xlabel}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def bpb_figure(logs: list[RunLogData], labels: list[str], axis: str) -> Figure | None:
    """None when no run has any BPB to show (no periodic evals and no final score)."""
    key, xlabel = AXES[axis]
    fig, ax = plt.subplots(figsize=(8, 5))
    drawn = False
    for log, label in zip(logs, labels):
        scale = axis_scale(log, axis)
        curve = [(e[key] * scale, e["val_bpb"]) for e in with_axis(log.source, log.evals, key, "eval", axis)
                 if finite(e["val_bpb"])]
        final = final_point(log)
        color = None
        if curve:
            (line,) = ax.plot(*zip(*curve), label=label, linewidth=1.2, marker=".")
            color = line.get_color()
        if final is not None and final[key] is not None:
            ax.plot([final[key] * scale], [final["val_bpb"]], linestyle="none", marker="*", markersize=11, color=color,
                    label=f"{label} (artifact)" if curve else label)
        drawn = drawn or bool(curve) or final is not None
    if not drawn:
        plt.close(fig)
        return None
    ax.set(xlabel=xlabel, ylabel="validation bits per byte",
           title=f"validation BPB vs {xlabel} (star: quantized artifact)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def build_figures(logs: list[RunLogData]) -> dict[str, Figure]:
    """{file stem: figure}; a missing bpb figure means no run had a BPB to plot."""
    labels = run_labels(logs)
    axes = [axis for axis in AXES if axis != "tokens" or all(map(has_batch_tokens, logs))]
    if "tokens" not in axes:
        missing = next(log.source for log in logs if not has_batch_tokens(log))
        print(f"plot: no tokens plots: {missing} has no train.batch_tokens in its config line", file=sys.stderr)
    figures = {f"loss_vs_{axis}": loss_figure(logs, labels, axis) for axis in axes}
    for axis in axes:
        fig = bpb_figure(logs, labels, axis)
        if fig is not None:
            figures[f"bpb_vs_{axis}"] = fig
    return figures


def save_png_atomic(fig: Figure, path: Path) -> None:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=120)
    write_atomic(path, buffer.getvalue())


def plot_logs(paths: list[str | Path], out: str | Path) -> list[Path]:
    """Parse every log first (a bad one fails before anything is written), then write the PNGs."""
    logs = [parse_log(p) for p in paths]
    for log in logs:
        log.require_steps()
    figures = build_figures(logs)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for stem, fig in figures.items():
        path = out / f"{stem}.png"
        save_png_atomic(fig, path)
        plt.close(fig)
        written.append(path)
    for kind in ("loss", "bpb"):  # an earlier call's plot that this one has no data for would pass as this one's
        for axis in AXES:
            stale = out / f"{kind}_vs_{axis}.png"
            if stale not in written:
                stale.unlink(missing_ok=True)
    return written


def main(argv=None) -> list[Path]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("logs", nargs="+", help="train.py logs (logs/<run_id>.txt)")
    p.add_argument("--out", default="plots", help="folder for the PNG files (default: plots)")
    a = p.parse_args(argv)
    if problem := output_problem(a.out, folder=True):
        p.error(f"--out {a.out}: {problem}")
    try:
        written = plot_logs(a.logs, a.out)
    except (LogFormatError, FileNotFoundError) as e:
        raise SystemExit(f"plot: {e}") from None
    for path in written:
        print(path)
    if not any(path.stem.startswith("bpb_") for path in written):
        print("no validation BPB in any log (no eval lines and no final line): only loss plots written",
              file=sys.stderr)
    return written


if __name__ == "__main__":
    main()
