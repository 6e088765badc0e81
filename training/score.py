"""Scoring a shipped artifact: rebuild the model from the artifact alone (no pickle; its config and tensors
checked against each other before anything is decompressed), and score it in bits per byte on validation tokens
with the size that ships. train.py's final line and `python -m scripts.evaluate` both come from here."""
from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from data.tokenizer import ByteLUT
from model.config import ModelConfig
from model.gpt import GPT
from quant.container import ArtifactError, check_meta, load_artifact
from quant.size import check_total
from training.eval_config import EVAL_RECORDED, EvalConfig
from training.evaluate import evaluate_bpb
from training.shipped_code import code_bytes
from training.ttt import evaluate_bpb_ttt
from training.ttt_lora import evaluate_bpb_doc_lora

TTT_PASSES = {"chunk_sgd": evaluate_bpb_ttt, "doc_lora": evaluate_bpb_doc_lora}  # by eval.ttt


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
    model.recurrence_on = recorded_recurrence(artifact, meta)
    return model.to(device), meta


def recorded_recurrence(artifact: Path, meta: dict) -> bool:
    """Whether depth recurrence was on when training ended (the meta's recurrence_on, written where the model
    config has model.recur_times > 1): the artifact is scored as the model was trained and calibrated last."""
    on = meta.get("recurrence_on", False)
    if type(on) is not bool:
        raise ArtifactError(f"{artifact}: its meta records recurrence_on={on!r}, not true or false (hint: a damaged "
                            "artifact, or one written by another code version)")
    return on


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


KIND_NAMES = {int: "an integer", float: "a number", str: "a string"}  # of the recorded eval settings, in errors


def recorded_eval(meta: dict, source: str | Path = "the artifact", **given) -> EvalConfig:
    """How the run scored itself (the meta's eval_<key> for each key of EVAL_RECORDED), under any value `given`
    that is not None. Artifacts written before a key was recorded get EvalConfig's default for it. The recorded
    ttt_* settings that the method scored with does not read (all of them with ttt="none") are left out, so that
    another method can be given. `source` names the artifact in errors."""
    default = EvalConfig()
    recorded = {key: meta.get(f"eval_{key}", getattr(default, key)) for key in EVAL_RECORDED}
    for key, value in recorded.items():
        want = type(getattr(default, key))
        if not (type(value) is want or (want is float and type(value) is int)):
            raise ArtifactError(f"{source}: its meta records eval_{key}={value!r}, not {KIND_NAMES[want]} (hint: a "
                                "damaged artifact; --context/--stride/--max-tokens/--batch-seqs and eval.KEY=VALUE "
                                "set them)")
    settings = {**recorded, **{key: value for key, value in given.items() if value is not None}}
    read = EvalConfig(**settings).ttt_keys()
    settings.update({key: getattr(default, key) for key in EVAL_RECORDED
                     if key.startswith("ttt_") and key not in read and given.get(key) is None})
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
    """BPB of the model loaded from `artifact`, the plain pass's wall clock (score_time_s), and the shipped size
    (artifact + counted code: training.shipped_code's, or the files of `shipped_code`). With eval_cfg.ttt, the
    score-first test-time training pass's too (val_loss_ttt, val_bpb_ttt, and its wall-clock ttt_time_s; doc_lora's
    phases' part of it, ttt_phase_time_s), after the plain score: chunk_sgd trains `model` in place, doc_lora gives it
    its weights back.
    progress and before_batch: see training.evaluate.evaluate_bpb."""
    if tokenizer_sha256:
        require_same_tokenizer(artifact, meta, tokenizer_sha256)
    autocast_dtype = torch.bfloat16 if device.type == "cuda" else None
    t0 = time.perf_counter()  # each pass ends in a host read of its totals: the device has finished by then
    result = evaluate_bpb(model, val_tokens, lut, context=eval_cfg.context, stride=eval_cfg.stride,
                          batch_seqs=eval_cfg.batch_seqs, device=device, autocast_dtype=autocast_dtype,
                          rank=rank, world_size=world_size, progress=progress, before_batch=before_batch,
                          compile=eval_cfg.compile)
    result["score_time_s"] = round(time.perf_counter() - t0, 3)
    if eval_cfg.ttt != "none":
        t0 = time.perf_counter()
        ttt = TTT_PASSES[eval_cfg.ttt](model, val_tokens, lut, eval_cfg, device=device, autocast_dtype=autocast_dtype,
                                       rank=rank, world_size=world_size, progress=progress, before_batch=before_batch)
        result.update(val_loss_ttt=ttt["val_loss"], val_bpb_ttt=ttt["val_bpb"],
                      ttt_time_s=round(time.perf_counter() - t0, 3))
        if "phase_time_s" in ttt:  # doc_lora: the part of ttt_time_s its phases of global SGD took
            result["ttt_phase_time_s"] = ttt["phase_time_s"]
    code = code_bytes() if shipped_code is None else sum(f.stat().st_size for f in shipped_code)
    sizes = check_total(artifact.stat().st_size, code)
    result.update(context=eval_cfg.context, stride=eval_cfg.stride, max_tokens=eval_cfg.max_tokens, ttt=eval_cfg.ttt,
                  artifact_bytes=sizes["artifact_bytes"], code_bytes=sizes["code_bytes"],
                  total_bytes=sizes["total_bytes"], fits_cap=sizes["fits"])
    return result
