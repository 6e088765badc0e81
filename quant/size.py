"""Size accounting: total = artifact bytes + the bytes of the code that ships with it, under the cap.

Which code counts is training.shipped_code's to say: a record's train_gpt.py and its config.toml.
"""
from __future__ import annotations

CAP_BYTES = 16_000_000  # decimal, not MiB


def check_total(artifact_bytes: int, code_bytes: int, cap: int = CAP_BYTES) -> dict:
    """{artifact_bytes, code_bytes, total_bytes, cap, fits, over_by} (over_by is 0 when it fits)."""
    if artifact_bytes < 0 or code_bytes < 0:
        raise ValueError(f"byte counts must be >= 0, got artifact {artifact_bytes} and code {code_bytes}")
    total = artifact_bytes + code_bytes
    return {"artifact_bytes": artifact_bytes, "code_bytes": code_bytes, "total_bytes": total, "cap": cap,
            "fits": total <= cap, "over_by": max(0, total - cap)}

