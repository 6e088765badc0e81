"""Score a shipped artifact in bits per byte, from a fresh process.

    python -m scripts.evaluate --artifact runs/<run>.mhcg --val 'DIR/fineweb_val_*.bin' --tokenizer T.model

Prints one JSON line: val_loss, val_bpb, tokens, bytes, context, stride, artifact_bytes, code_bytes,
total_bytes. train.py's final line comes from `evaluate_artifact` below: the same code path. Unless
--context / --stride / --max-tokens / --batch-seqs say otherwise, it scores as the run did (its eval.context,
eval.stride, eval.max_tokens and eval.batch_seqs, recorded in the artifact), so the number is train.py's.
The counted code is this repository's (quant.size.CODE_FILES), as train.py counts it; for an artifact that ships
with other code, a record's, name that code: --code RECORD/train_gpt.py RECORD/config.toml.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python scripts/evaluate.py` as well as `python -m scripts.evaluate`
    sys.path.insert(0, str(REPO))

from data.loader import load_tokens  # noqa: E402
from data.shards import ShardError, list_shards, require_token_ids, require_tokenizer  # noqa: E402
from data.tokenizer import ByteLUT, TokenizerError, build_byte_lut, file_sha256, load_sp, require_round_trip  # noqa: E402
from model.config import ModelConfig  # noqa: E402
from model.gpt import GPT  # noqa: E402
from quant.container import ArtifactError, CodecUnavailable, check_meta, load_artifact  # noqa: E402
from quant.size import check_total, code_bytes  # noqa: E402
from training.config import EVAL_RECORDED, EvalConfig  # noqa: E402
from training.evaluate import ByteAuditError, evaluate_bpb, require_byte_audit  # noqa: E402


def load_model(artifact: Path, device: torch.device) -> tuple[GPT, dict]:
    """Rebuild the model from the artifact's own config and dequantized weights (no pickle). The config is
    checked, and the model's tensors matched by name, shape and kind to the header, before anything is
    decompressed or allocated: a damaged or forged file fails with one line naming what is wrong."""
    configs = []

    def match_model(meta: dict, entries: list[dict]) -> None:
        configs.append(model_config(artifact, meta))
        config, stored = configs[0], {e["name"]: e for e in entries}
        # Cheap facts first: a forged width or depth would make even the shapes-only build below allocate gigabytes
        # (the rotary tables are real tensors) or run for minutes.
        embed = stored.get("embed.weight", {}).get("shape")
        if embed != [config.vocab_size, config.d_model] or len(entries) < config.n_layers:
            raise ArtifactError(f"{artifact}: its model config (vocab_size {config.vocab_size}, d_model "
                                f"{config.d_model}, n_layers {config.n_layers}) does not match its {len(entries)} "
                                f"tensors (embed.weight {embed}) (hint: a damaged artifact, or one written by "
                                "another code version)")
        try:
            with torch.device("meta"):  # shapes only, no memory
                expected = GPT(config).state_dict()
        except (ArithmeticError, TypeError, ValueError, RuntimeError) as e:  # e.g. a hidden width past int64
            raise ArtifactError(f"{artifact}: its model config cannot build a model: {e}") from None
        missing, unexpected = sorted(set(expected) - set(stored)), sorted(set(stored) - set(expected))
        if missing or unexpected:
            raise ArtifactError(f"{artifact}: tensors do not match the model config: missing {missing[:5]}, "
                                f"unexpected {unexpected[:5]} (hint: artifact written by another code version?)")
        for name, tensor in expected.items():
            entry, floating = stored[name], tensor.is_floating_point()
            kind = "float" if entry["kind"] == "quant" or entry.get("dtype", "").startswith("float") else entry["dtype"]
            if list(tensor.shape) != entry["shape"] or (kind == "float") != floating \
                    or not (floating or kind == str(tensor.dtype).removeprefix("torch.")):
                raise ArtifactError(f"{artifact}: tensor {name!r} is stored as {kind} {entry['shape']}, the model "
                                    f"config makes it {str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)}")

    meta, state = load_artifact(artifact, expect=match_model)
    if device.type == "cuda" and configs[0].kernel_problem():  # a shape the Triton kernels cannot take: the
        configs[0].mhc_kernels = False                          # reference computes the same function
    model = GPT(configs[0])
    model.load_state_dict(state)
    return model.to(device), meta


def model_config(artifact: Path, meta: dict) -> ModelConfig:
    """The artifact's model config, checked: known keys, each of its field's type, values the model can build.
    The attention backend computes the same function either way: "auto" lets an artifact trained with
    FlashAttention 3 be scored where it is not installed."""
    try:
        check_meta(meta)
        given = {**meta["model_config"], "attention": "auto"}
        default = ModelConfig()
        for key, value in given.items():
            if not hasattr(default, key):
                raise ValueError(f"unknown key {key!r}")
            want = type(getattr(default, key))
            if not (type(value) is want or (want is float and type(value) is int)):
                raise ValueError(f"{key}={value!r} is not of type {want.__name__}")
            if want is float and not math.isfinite(value):
                raise ValueError(f"{key}={value!r} is not a finite number")
        config = ModelConfig(**given)
        config.validate()
        return config
    except (ArithmeticError, TypeError, ValueError) as e:
        raise ArtifactError(f"{artifact}: its model config cannot build a model: {e} (hint: a damaged artifact, "
                            "or one written by another code version)") from None


def require_same_tokenizer(artifact: Path, meta: dict, tokenizer_sha256: str) -> None:
    if meta.get("tokenizer_sha256") not in (None, tokenizer_sha256):
        raise ArtifactError(f"{artifact}: trained with tokenizer sha256 {str(meta['tokenizer_sha256'])[:12]}…, "
                            f"evaluating with {tokenizer_sha256[:12]}… (hint: pass the run's tokenizer)")


def recorded_eval(meta: dict, source: str | Path = "the artifact", **given: int | None) -> EvalConfig:
    """How the run scored itself (the meta's eval_context, eval_stride, eval_max_tokens, eval_batch_seqs), under
    any value `given` that is not None. Artifacts written before these were recorded get EvalConfig's defaults.
    `source` names the artifact in errors."""
    default = EvalConfig()
    recorded = {key: meta.get(f"eval_{key}", getattr(default, key)) for key in EVAL_RECORDED}
    wrong = [key for key, value in recorded.items() if type(value) is not int]
    if wrong:
        raise ArtifactError(f"{source}: its meta records eval_{wrong[0]}={recorded[wrong[0]]!r}, not an integer "
                            "(hint: a damaged artifact; --context/--stride/--max-tokens/--batch-seqs set them)")
    settings = {**recorded, **{key: value for key, value in given.items() if value is not None}}
    return EvalConfig(**settings)


def evaluate_artifact(artifact: str | Path, val_tokens, lut: ByteLUT, eval_cfg: EvalConfig, *,
                      device: torch.device, rank: int = 0, world_size: int = 1,
                      tokenizer_sha256: str | None = None, progress=None, before_batch=None) -> dict:
    artifact = Path(artifact)
    model, meta = load_model(artifact, device)
    return score_model(artifact, model, meta, val_tokens, lut, eval_cfg, device=device, rank=rank,
                       world_size=world_size, tokenizer_sha256=tokenizer_sha256, progress=progress,
                       before_batch=before_batch)


def score_model(artifact: Path, model: GPT, meta: dict, val_tokens, lut: ByteLUT, eval_cfg: EvalConfig, *,
                device: torch.device, rank: int = 0, world_size: int = 1,
                tokenizer_sha256: str | None = None, progress=None, before_batch=None,
                shipped_code: list[Path] | None = None) -> dict:
    """BPB of the model loaded from `artifact`, and the shipped size (artifact + counted code: the repository's,
    or the files of `shipped_code`). progress and before_batch: see training.evaluate.evaluate_bpb."""
    if tokenizer_sha256:
        require_same_tokenizer(artifact, meta, tokenizer_sha256)
    result = evaluate_bpb(model, val_tokens, lut, context=eval_cfg.context, stride=eval_cfg.stride,
                          batch_seqs=eval_cfg.batch_seqs, device=device,
                          autocast_dtype=torch.bfloat16 if device.type == "cuda" else None,
                          rank=rank, world_size=world_size, progress=progress, before_batch=before_batch)
    code = code_bytes(REPO) if shipped_code is None else sum(f.stat().st_size for f in shipped_code)
    sizes = check_total(artifact.stat().st_size, code)
    result.update(context=eval_cfg.context, stride=eval_cfg.stride, max_tokens=eval_cfg.max_tokens,
                  artifact_bytes=sizes["artifact_bytes"], code_bytes=sizes["code_bytes"],
                  total_bytes=sizes["total_bytes"], fits_cap=sizes["fits"])
    return result


# Bad input (a path, an artifact, shards, a tokenizer, a missing codec module): the message names the file and
# gives a hint, so it is printed alone.
INPUT_ERRORS = (ArtifactError, ShardError, TokenizerError, ByteAuditError, CodecUnavailable, FileNotFoundError)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifact", required=True, help="the .mhcg file a run wrote (train.py: runs/<run_id>.mhcg)")
    p.add_argument("--val", required=True, help="glob of validation shards, or a directory holding fineweb_val_*.bin")
    p.add_argument("--tokenizer", required=True, help="SentencePiece model the artifact was trained with")
    p.add_argument("--context", type=int, help="window length in tokens (default: the run's eval.context)")
    p.add_argument("--stride", type=int, help="0 = non-overlapping windows (default: the run's eval.stride)")
    p.add_argument("--batch-seqs", type=int, help="windows per forward pass (default: the run's eval.batch_seqs)")
    p.add_argument("--max-tokens", type=int,
                   help="score only the first N validation tokens, 0 = all (default: the run's eval.max_tokens)")
    p.add_argument("--code", nargs="+", metavar="FILE",
                   help="the code that ships with the artifact, counted in its total in place of this repository's "
                        "(a record's train_gpt.py and config.toml)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu, cuda or cuda:N (default: cuda where a GPU is visible)")
    a = p.parse_args(argv)
    try:
        device = torch.device(a.device)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        p.error(f"--device {a.device!r}: expected cpu, cuda or cuda:N")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        p.error(f"--device {a.device}: {torch.cuda.device_count()} CUDA device(s) visible (hint: --device cpu)")
    try:
        score(a, p, device)
    except INPUT_ERRORS as e:
        sys.exit(f"scripts.evaluate: {e}")


def score(a: argparse.Namespace, p: argparse.ArgumentParser, device: torch.device) -> None:
    """The command line's scoring; the cheap inputs (shards, tokenizer, code) are checked before the model is built."""
    shipped_code = None if a.code is None else [Path(f) for f in a.code]
    for f in shipped_code or []:
        if not f.is_file():
            p.error(f"--code {f}: no such file (hint: the files that ship with the artifact, e.g. a record folder's "
                    "train_gpt.py and config.toml)")
    pattern = str(Path(a.val) / "fineweb_val_*.bin") if Path(a.val).is_dir() else a.val
    shards, sp = list_shards(pattern), load_sp(a.tokenizer)
    training = [s for s in shards if Path(s).name.startswith("fineweb_train_")]
    if training:  # 'DIR/*.bin' matched the training shards too, and they sort first
        raise ShardError(f"--val {a.val} matches training shards ({Path(training[0]).name} and {len(training) - 1} more): "
                         "a score on them is no validation score (hint: --val DIR, or 'DIR/fineweb_val_*.bin')")
    model, meta = load_model(Path(a.artifact), device)
    eval_cfg = recorded_eval(meta, a.artifact, context=a.context, stride=a.stride, max_tokens=a.max_tokens,
                             batch_seqs=a.batch_seqs)
    try:
        eval_cfg.validate()
    except ValueError as e:
        p.error(f"{e} (hint: from --context/--stride/--max-tokens/--batch-seqs, else recorded in {a.artifact})")
    sha = file_sha256(a.tokenizer)
    require_same_tokenizer(Path(a.artifact), meta, sha)
    vouched = require_tokenizer(shards, sha, a.tokenizer)
    tokens = load_tokens(shards, eval_cfg.max_tokens)
    lut = build_byte_lut(sp)
    require_token_ids(tokens, min(len(lut.base_bytes), model.cfg.vocab_size), pattern,
                      f"the tokenizer's ({a.tokenizer}) and the artifact model's")
    if not vouched:  # no manifest says which tokenizer made the shards: do the ids round-trip through this one?
        require_round_trip(tokens, sp, pattern, a.tokenizer)
    require_byte_audit(tokens, sp, lut, pattern, a.tokenizer)  # BPB's denominator, as train.py checks it
    result = score_model(Path(a.artifact), model, meta, tokens, lut, eval_cfg, device=device,
                         tokenizer_sha256=sha, progress=lambda line: print(line, file=sys.stderr),
                         shipped_code=shipped_code)
    if not math.isfinite(result["val_loss"]):
        raise ArtifactError(f"{a.artifact}: scores val_loss {result['val_loss']} (its weights give NaN or Inf "
                            "log-probabilities: a damaged artifact)")
    print(json.dumps(result, sort_keys=True))
    if not result["fits_cap"]:
        sys.exit(f"total {result['total_bytes']:,} bytes is over the 16,000,000-byte cap by "
                 f"{result['total_bytes'] - 16_000_000:,}")


if __name__ == "__main__":
    main()
