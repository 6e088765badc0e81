"""What the scoring commands (scripts.evaluate, scripts.bench_scoring) read before they score an artifact: --device,
--val's shards and the tokenizer, and the validation tokens checked against the artifact. Not imported by train.py,
so not part of the code a record ships."""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from data.loader import load_tokens
from data.shards import ShardError, list_shards, require_token_ids, require_tokenizer
from data.tokenizer import TokenizerError, build_byte_lut, file_sha256, load_sp, require_round_trip
from quant.container import ArtifactError, CodecUnavailable
from training.config import ConfigError, parse_setting
from training.eval_config import EVAL_RECORDED
from training.evaluate import ByteAuditError, require_byte_audit
from training.score import require_same_tokenizer


# Bad input (a path, an artifact, shards, a tokenizer, a missing codec module): the message names the file and
# gives a hint, so it is printed alone.
# The eval settings given as eval.KEY=VALUE: test-time training's (the window settings have their flags), and
# eval.compile, which the artifact does not record (it changes how fast a machine scores, not what is scored).
SETTINGS = tuple(key for key in EVAL_RECORDED if key.startswith("ttt")) + ("compile",)
INPUT_ERRORS = (ArtifactError, ShardError, TokenizerError, ByteAuditError, CodecUnavailable, FileNotFoundError)


def add_scoring_arguments(p: argparse.ArgumentParser, settings: tuple[str, ...], settings_default: str) -> None:
    """What every scoring command reads: --artifact, --val, --tokenizer, --device, and eval.KEY=VALUE for the keys
    of `settings` (parsed by parse_scoring_arguments)."""
    p.add_argument("--artifact", required=True, help="the .mhcg file a run wrote (train.py: runs/<run_id>.mhcg)")
    p.add_argument("--val", required=True, help="glob of validation shards, or a directory holding fineweb_val_*.bin")
    p.add_argument("--tokenizer", required=True, help="SentencePiece model the artifact was trained with")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu, cuda or cuda:N (default: cuda where a GPU is visible)")
    p.add_argument("settings", nargs="*", metavar="eval.KEY=VALUE",
                   help=f"KEY one of {', '.join(settings)} ({settings_default})")


def parse_scoring_arguments(p: argparse.ArgumentParser, argv, settings: tuple[str, ...]) -> argparse.Namespace:
    """The command line, with its eval.KEY=VALUE settings as a dict (a.eval) and --device as a torch.device."""
    a = p.parse_args(argv)
    try:
        a.eval = dict(parse_setting(item, "eval", settings) for item in a.settings)
    except ConfigError as e:
        p.error(str(e))
    a.device = parse_device(p, a.device)
    return a


def parse_device(p: argparse.ArgumentParser, text: str) -> torch.device:
    """--device as a torch.device: cpu, or a CUDA device this machine has (else the parser's error, exit code 2)."""
    try:
        device = torch.device(text)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        p.error(f"--device {text!r}: expected cpu, cuda or cuda:N")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        p.error(f"--device {text}: {torch.cuda.device_count()} CUDA device(s) visible (hint: --device cpu)")
    return device


def open_validation(val: str, tokenizer: str) -> tuple[str, list[str], object]:
    """--val's shard pattern (a glob, or a directory's fineweb_val_*.bin), its shards and the SentencePiece model."""
    pattern = str(Path(val) / "fineweb_val_*.bin") if Path(val).is_dir() else val
    shards, sp = list_shards(pattern), load_sp(tokenizer)
    training = [s for s in shards if Path(s).name.startswith("fineweb_train_")]
    if training:  # 'DIR/*.bin' matched the training shards too, and they sort first
        raise ShardError(f"--val {val} matches training shards ({Path(training[0]).name} and {len(training) - 1} "
                         "more): a score on them is no validation score (hint: --val DIR, or "
                         "'DIR/fineweb_val_*.bin')")
    return pattern, shards, sp


def checked_tokens(artifact: Path, meta: dict, vocab_size: int, pattern: str, shards: list[str], sp, tokenizer: str,
                   max_tokens: int):
    """The first max_tokens validation tokens (0: all), their byte table and the tokenizer's sha256, once the
    tokenizer is the artifact's and the shards', every id is in both vocabularies, and the byte counts (BPB's
    denominator) audit as train.py checks them."""
    sha = file_sha256(tokenizer)
    require_same_tokenizer(artifact, meta, sha)
    vouched = require_tokenizer(shards, sha, tokenizer)
    tokens = load_tokens(shards, max_tokens)
    lut = build_byte_lut(sp)
    require_token_ids(tokens, min(len(lut.base_bytes), vocab_size), pattern,
                      f"the tokenizer's ({tokenizer}) and the artifact model's")
    if not vouched:  # no manifest says which tokenizer made the shards: do the ids round-trip through this one?
        require_round_trip(tokens, sp, pattern, tokenizer)
    require_byte_audit(tokens, sp, lut, pattern, tokenizer)
    return tokens, lut, sha
