"""The validation text a run scores: its tokens (none of them in the training shards), the tokenizer's byte table,
the byte accounting audited against the decoded text, and the demo corpus's source entropy."""
from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import numpy as np

from data.loader import load_tokens
from data.shards import list_shards, require_disjoint, require_token_ids, require_tokenizer
from data.tokenizer import ByteLUT, build_byte_lut, file_sha256, load_sp, require_round_trip
from training.config import Config, ConfigError
from training.evaluate import require_byte_audit


class Validation(NamedTuple):
    tokens: np.ndarray
    lut: ByteLUT
    tokenizer_sha256: str          # hashed once: the sha256 that was checked is the one the artifact records
    source_entropy: float | None  # bits per byte of the text's source, where its manifest states it (the demo)
    audited_bytes: int | None     # BPB's denominator, audited against the decoded text (rank 0; None elsewhere)


def load_validation(cfg: Config, train_files: list[str], rank: int) -> Validation:
    """The validation tokens (none of them in `train_files`) and the tokenizer's byte table, with the byte
    accounting audited on rank 0, and the source entropy of the demo corpus."""
    val_files = list_shards(cfg.data.val_files)
    require_disjoint(train_files, val_files)
    val_tokens = load_tokens(val_files, cfg.eval.max_tokens)
    lut = build_byte_lut(cfg.data.tokenizer)  # a missing or unusable tokenizer is named here
    if len(lut.base_bytes) != cfg.model.vocab_size:  # before the ids: the fix is the vocab size, not the shards
        raise ConfigError(f"{cfg.data.tokenizer} has {len(lut.base_bytes)} ids but model.vocab_size="
                          f"{cfg.model.vocab_size} (hint: set model.vocab_size={len(lut.base_bytes)})")
    require_token_ids(val_tokens, cfg.model.vocab_size, cfg.data.val_files, "the model's")
    tokenizer_sha256 = file_sha256(cfg.data.tokenizer)
    if not require_tokenizer(train_files + val_files, tokenizer_sha256, cfg.data.tokenizer):
        require_round_trip(val_tokens, load_sp(cfg.data.tokenizer), cfg.data.val_files, cfg.data.tokenizer)
    audited = None
    if rank == 0:  # BPB's denominator must be the decoded text's UTF-8 length, exactly
        audited = require_byte_audit(val_tokens, load_sp(cfg.data.tokenizer), lut, cfg.data.val_files,
                                     cfg.data.tokenizer)
    return Validation(val_tokens, lut, tokenizer_sha256, source_entropy(cfg, tokenizer_sha256), audited)


def source_entropy(cfg: Config, tokenizer_sha256: str) -> float | None:
    """The demo corpus states its true entropy rate in the manifest beside its tokenizer; real data has none."""
    manifest = Path(cfg.data.tokenizer).parent / "manifest.json"
    if not manifest.exists():
        return None
    try:
        fields = json.loads(manifest.read_text())
        value = fields.get("source_entropy_bits_per_byte")
    except (json.JSONDecodeError, AttributeError) as e:
        raise ConfigError(f"{manifest}: not a data manifest ({e}); hint: it is read for the demo's source entropy, "
                          "so regenerate it (python -m data.prepare or data.demo) or move it away") from None
    if value is not None and not isinstance(value, (int, float)):
        raise ConfigError(f"{manifest}: source_entropy_bits_per_byte must be a number, got {value!r}")
    recorded = fields.get("tokenizer_sha256")
    if value is not None and recorded is not None and recorded != tokenizer_sha256:
        raise ConfigError(f"{manifest}: describes another tokenizer than {cfg.data.tokenizer} (its sha256 differs), "
                          "so its shards and source entropy are not this tokenizer's (hint: regenerate the folder: "
                          "python -m data.demo --out DIR)")
    return value
