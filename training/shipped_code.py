"""The code a run counts against the cap, and which code it is. In a checkout: the train_gpt.py a record made from
this tree would ship (training.packing), plus CONFIG_BYTES for the config.toml beside it; scripts.export_record
refuses a record whose two files come to more than its runs counted. A record's train_gpt.py puts its own version of
this module in place (training.record_script): there the code is that file and its config, as they are.
"""
from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# A record's config.toml holds every config key; those of configs/*.toml, written as records write them, measure
# 2,154-2,207 bytes (docs/journal.md). The rest is room for longer data paths and keys to come.
CONFIG_BYTES = 4_096


def code_bytes() -> int:
    """train_gpt.py's bytes (made once per state of the sources) + CONFIG_BYTES."""
    from training.packing import script_bytes  # a checkout's own: a record ships neither this nor the packer
    return script_bytes(REPO) + CONFIG_BYTES


def code_digest() -> str | None:
    """training.sources.code_digest of this checkout: train.py and every module it imports."""
    from training.sources import code_digest as digest
    return digest(REPO)
