"""Size accounting: total = artifact bytes + raw bytes of the code needed to load and evaluate it.

The counted code is the raw (uncompressed) source of the files matched by CODE_FILES, relative to
the repository root: everything `python -m scripts.evaluate` imports to rebuild the model from the
artifact and score it (tests/test_quant_size.py checks that list against the evaluator's import
closure, lazy imports included, so a new dependency cannot slip out of the count). The Triton kernels
count too: an artifact whose config asks for them runs them (not the traffic arithmetic and block tables beside
them, which only the benchmarks read). Raw bytes, not a compressed bundle: that
is what ships. Every pattern must match at least one file: a renamed module must fail loudly, never
be dropped from the count.
"""
from __future__ import annotations

from pathlib import Path

CAP_BYTES = 16_000_000  # decimal, not MiB

CODE_FILES = (
    "model/*.py",
    "kernels/__init__.py",
    "kernels/_triton_util.py",
    "kernels/mhc.py",
    "kernels/mhc_bwd.py",
    "kernels/mhc_fwd.py",
    "kernels/mhc_reference.py",
    "kernels/mlp.py",
    "kernels/mlp_reference.py",
    "kernels/mlp_triton.py",
    "quant/__init__.py",
    "quant/container.py",
    "quant/options.py",
    "quant/pack.py",
    "quant/size.py",
    "data/__init__.py",
    "data/files.py",
    "data/shards.py",
    "data/loader.py",
    "data/tokenizer.py",
    "training/__init__.py",
    "training/config.py",
    "training/eval_config.py",
    "training/evaluate.py",
    "training/score.py",
    "training/ttt.py",
    "training/ttt_lora.py",
    "scripts/__init__.py",
    "scripts/evaluate.py",
)


class SizeCapError(RuntimeError):
    """Artifact + code is over the byte cap."""


def code_files(repo_root: str | Path, patterns: tuple[str, ...] = CODE_FILES) -> list[Path]:
    """The counted files, sorted and without duplicates."""
    root = Path(repo_root)
    if not root.is_dir():
        raise FileNotFoundError(f"repository root {root} is not a directory")
    files: set[Path] = set()
    for pattern in patterns:
        matched = [p for p in root.glob(pattern) if p.is_file()]
        if not matched:
            raise FileNotFoundError(f"code pattern {pattern!r} matches no file under {root}; "
                                    "hint: update quant.size.CODE_FILES if the module moved")
        files.update(matched)
    return sorted(files)


def code_bytes(repo_root: str | Path, patterns: tuple[str, ...] = CODE_FILES) -> int:
    return sum(p.stat().st_size for p in code_files(repo_root, patterns))


def check_total(artifact_bytes: int, code_bytes: int, cap: int = CAP_BYTES) -> dict:
    """{artifact_bytes, code_bytes, total_bytes, cap, fits, over_by} (over_by is 0 when it fits)."""
    if artifact_bytes < 0 or code_bytes < 0:
        raise ValueError(f"byte counts must be >= 0, got artifact {artifact_bytes} and code {code_bytes}")
    total = artifact_bytes + code_bytes
    return {"artifact_bytes": artifact_bytes, "code_bytes": code_bytes, "total_bytes": total, "cap": cap,
            "fits": total <= cap, "over_by": max(0, total - cap)}


def require_fits(total: dict) -> dict:
    """Raise SizeCapError unless the check_total result fits; returns it unchanged otherwise."""
    if not total["fits"]:
        raise SizeCapError(f"artifact {total['artifact_bytes']} + code {total['code_bytes']} = "
                           f"{total['total_bytes']} bytes is over the cap of {total['cap']} bytes "
                           f"by {total['over_by']} bytes")
    return total
