"""Typed run configuration: dataclasses loaded from configs/*.toml plus `section.key=value` overrides.

Every field is used somewhere and exercised by a test; unknown keys are errors (a typo must never
silently fall back to a default).
"""
from __future__ import annotations

import ast
import dataclasses
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

from model.config import ModelConfig
from quant.options import CALIB_SOURCES, ERROR_WEIGHTS, METHODS, MIN_BITS, OBSERVED_BITS, SCHEMES, TABLE_BITS, \
    one_of
from quant.size import CAP_BYTES
from training.eval_config import EvalConfig


@dataclass
class DataConfig:
    # Where `python -m data.download` puts FineWeb sp1024: the data the default model (vocab_size 1024) is for.
    train_files: str = "data/datasets/fineweb10B_sp1024/fineweb_train_*.bin"   # glob of training shards
    val_files: str = "data/datasets/fineweb10B_sp1024/fineweb_val_*.bin"       # glob of validation shards
    tokenizer: str = "data/tokenizers/fineweb_1024_bpe.model"                  # SentencePiece model (byte accounting)
    seq_len: int = 256                 # training sequence length (tokens)
    shards_per_batch: int = 4          # shards mixed into every batch
    prefetch: int = 4                  # batches queued ahead by the loader thread


@dataclass
class OptimConfig:
    matrix_lr: float = 0.025           # Muon, 2-D block matrices
    embed_lr: float = 0.035            # AdamW, token embedding (tied head)
    scalar_lr: float = 0.025           # AdamW, gains, biases, mHC phi/alpha/bias, skip weights
    muon_momentum: float = 0.99
    muon_momentum_start: float = 0.92  # momentum warms linearly from this ...
    muon_momentum_warmup_steps: int = 1500  # ... over this many steps
    ns_steps: int = 5                  # Newton-Schulz iterations
    muon_row_norm: bool = False        # MuonEq-R: each row of the update scaled to unit L2 norm before Newton-Schulz
    muon_split_qkv: bool = False       # Newton-Schulz on the q, k and v row blocks of each attention qkv apart
    weight_decay: float = 0.04         # decoupled, Muon and AdamW matrices/embeddings
    embed_weight_decay: float = -1.0   # AdamW 'embed' group (the embedding tables); -1: optim.weight_decay
    scalar_weight_decay: float = 0.0   # AdamW 'scalar' group (gains, gates, mixing parameters)
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    grad_clip: float = 0.3             # global grad-norm clip; 0 disables
    warmup_steps: int = 20             # linear LR warmup
    warmdown_frac: float = 0.5         # final fraction of the budget with linear warmdown
    lr_floor: float = 0.05             # LR multiplier never drops below this
    ema_decay: float = 0.997           # EMA of weights (what gets exported); 0 disables
    ema_warmup_steps: int = 10         # decay at step t = min(ema_decay, (1 + t) / (ema_warmup_steps + t))


@dataclass
class QuantConfig:
    method: str = "gptq"               # gptq | rtn (round-to-nearest baseline)
    calib_source: str = "train"        # train (training tokens) | generated (text the model samples itself)
    calib_seqs: int = 64               # calibration sequences of data.seq_len tokens
    calib_reserve_s: float = 0.0       # seconds of train.time_budget_s kept for calibration
    cap_bytes: int = 16_000_000        # artifact + code must fit (decimal bytes)
    margin_bytes: int = 20_000         # safety margin under the cap for the int5/int6 allocation
    budget_bytes: int = 0              # the artifact's budget; 0: cap_bytes - counted code - margin_bytes. A record's
                                       # config pins its runs' budget (its train_gpt.py counts less code than they did)
    scheme: str = "rd"                 # rd: every tensor's step size by rate–distortion under the budget | rank: int5/int6
                                       # by sensitivity rank | sdclip: the April-2026 records' fixed int6/int8 scheme
    error_weight: str = "fisher"       # what the allocation compares: fisher (× loss gradient²) | output (output MSE)
    min_bits: int = 5                  # scheme rank: 4 demotes the least sensitive matrices to int4 if all-int5 is over
    table_bits: int = 8                # scheme rank: embedding tables round-to-nearest per row at 5, 6 or 8 bits
    phi_bits: int = 4                  # scheme rank: mHC phi's GPTQ width (4, 5, 6, 8)


@dataclass
class TrainConfig:
    run_id: str = ""                   # default: <config name>-<timestamp>-s<seed>
    seed: int = 1337
    device: str = "auto"               # auto | cpu | cuda
    batch_tokens: int = 8192           # global tokens per optimizer step
    micro_batch_seqs: int = 8          # sequences per rank per forward/backward
    max_steps: int = 200               # stop after this many steps ...
    time_budget_s: float = 0.0         # ... or when training wall clock reaches this (0: no limit)
    schedule: str = "steps"            # steps | time : what drives warmdown progress
    compile: bool = False              # torch.compile the model (GPU)
    log_every: int = 10
    checkpoint_every: int = 0          # steps between checkpoints, and one at the end (0: only on SIGTERM/SIGINT)
    checkpoint_keep: int = 2           # newest checkpoints kept in <out_dir>/checkpoints/<run_id>/
    resume: str = ""                   # '' | latest | <checkpoint dir>; 'latest' needs a fixed train.run_id
    log_dir: str = "logs"
    out_dir: str = "runs"
    wandb: bool = False
    wandb_project: str = "mhcgolf"


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


class ConfigError(ValueError):
    pass


def _coerce(value: Any, typ: type, where: str) -> Any:
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
            return value.lower() in ("true", "1")
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        try:
            return int(str(value).replace("_", ""))
        except ValueError:
            raise ConfigError(f"{where}: expected an integer, got {value!r}") from None
    if typ is float:
        if isinstance(value, bool):  # float(True) is 1.0: `matrix_lr = true` trained at an lr of 1
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected a number, got {value!r}") from None
        if not math.isfinite(number):  # inf passed the range checks (time_budget_s=inf made a schedule never end)
            raise ConfigError(f"{where}: expected a finite number, got {value!r}")
        return number
    if typ is str:
        if not isinstance(value, str):  # a list or number here would surface later as a puzzling path
            raise ConfigError(f"{where}: expected a string, got {value!r} (hint: quote it; data paths take one "
                              "glob pattern, e.g. \"data/x/fineweb_train_*.bin\")")
        return value
    if getattr(typ, "__origin__", None) is tuple:
        if isinstance(value, str):
            value = ast.literal_eval(value)
        return tuple(int(v) for v in value)
    raise ConfigError(f"{where}: unsupported field type {typ}")


def _apply(section_obj: Any, section: str, values: dict[str, Any], source: str) -> None:
    hints = get_type_hints(type(section_obj))
    for key, value in values.items():
        if key not in hints:
            known = ", ".join(sorted(hints))
            raise ConfigError(f"{source}: unknown key '{section}.{key}'. Known keys in [{section}]: {known}")
        setattr(section_obj, key, _coerce(value, hints[key], f"{source}: {section}.{key}"))


def parse_setting(item: str, section: str, keys: tuple[str, ...]) -> tuple[str, Any]:
    """A command-line `section.key=value` with key in `keys`, as (key, value of the field's type)."""
    name, sep, value = item.partition("=")
    key = name.removeprefix(f"{section}.")
    if not sep or key == name or key not in keys:
        raise ConfigError(f"{item!r}: expected {section}.KEY=VALUE with KEY one of {', '.join(keys)}")
    field_type = get_type_hints(type(getattr(Config(), section)))[key]
    return key, _coerce(value, field_type, f"command line: {section}.{key}")


def _read_toml(path: Path) -> dict:
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found (hint: see configs/ for the shipped ones)") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None
    except OSError as e:  # a folder, a file it cannot read
        raise ConfigError(f"config file {path}: {e.strerror} (hint: --config takes a .toml file, see configs/)") \
            from None


def _apply_file(path: Path, sections: dict, seen: tuple[Path, ...]) -> None:
    """A config file's sections onto `sections`; first those of the file it names in a top-level
    `extends = "base.toml"` (relative to its own folder), so that a config states only what differs from its base."""
    data = _read_toml(path)
    base = data.pop("extends", None)
    if base is not None:
        if not isinstance(base, str):
            raise ConfigError(f"{path}: extends = {base!r}: expected the path of another config file, as a string")
        base_path = path.parent / base
        if base_path.resolve() in seen or base_path.resolve() == path.resolve():
            raise ConfigError(f"{path}: extends {base}, which extends it in turn (a cycle)")
        _apply_file(base_path, sections, (*seen, path.resolve()))
    for section, values in data.items():
        if section not in sections or not isinstance(values, dict):
            raise ConfigError(f"{path}: unknown section [{section}]; expected one of {sorted(sections)} "
                              "(or a top-level extends = \"base.toml\")")
        _apply(sections[section], section, values, str(path))


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Defaults <- TOML file (after the file it extends, if any) <- `section.key=value` overrides, in that order."""
    cfg = Config()
    sections = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    if path is not None:
        path = Path(path)
        _apply_file(path, sections, ())
    for item in overrides:
        key, sep, value = item.partition("=")
        section, dot, name = key.partition(".")
        if not sep or not dot or section not in sections:
            raise ConfigError(f"override {item!r}: expected section.key=value with section in {sorted(sections)}")
        _apply(sections[section], section, {name: value}, "command line")
    try:
        validate(cfg)
    except ConfigError as e:  # a conflict may come from the file, the overrides, or both: name what was read
        sources = [str(path)] if path is not None else ["the defaults"]
        if overrides:
            sources.append("the overrides")
        raise ConfigError(f"{' + '.join(sources)}: {e}") from None
    return cfg


# Numbers a run cannot use, refused when the config loads (naming the key) rather than deep inside the loader,
# the optimizer or the first step: (key, the least allowed value).
AT_LEAST = (
    ("data.seq_len", 1), ("data.shards_per_batch", 1), ("data.prefetch", 0),
    ("optim.matrix_lr", 0), ("optim.embed_lr", 0), ("optim.scalar_lr", 0), ("optim.weight_decay", 0),
    ("optim.scalar_weight_decay", 0),
    ("optim.grad_clip", 0), ("optim.ns_steps", 1), ("optim.warmup_steps", 0), ("optim.muon_momentum_warmup_steps", 0),
    ("optim.ema_warmup_steps", 1), ("quant.calib_seqs", 1), ("quant.calib_reserve_s", 0), ("quant.cap_bytes", 1),
    ("quant.margin_bytes", 0), ("quant.budget_bytes", 0), ("train.batch_tokens", 1), ("train.micro_batch_seqs", 1),
    ("train.max_steps", 1),
    ("train.time_budget_s", 0), ("train.log_every", 1), ("train.checkpoint_every", 0), ("train.seed", 0))
# Fractions: (key, whether 1 itself is allowed). A decay or momentum of 1 never forgets (and Adam's bias
# correction divides by 1 - beta2^t).
FRACTIONS = (
    ("optim.muon_momentum", False), ("optim.muon_momentum_start", False), ("optim.adam_beta1", False),
    ("optim.adam_beta2", False), ("optim.ema_decay", False), ("optim.warmdown_frac", True), ("optim.lr_floor", True))


def flat_config(config: dict) -> dict[str, object]:
    """{"train": {"seed": 1}} -> {"train.seed": 1}, as to_dict (and a run log's `config` line) nests it."""
    flat = {}
    for section, values in config.items():
        if isinstance(values, dict):
            flat.update({f"{section}.{key}": value for key, value in values.items()})
        else:  # not a section: compared as one value (and so reported, not crashed on)
            flat[section] = values
    return flat


def _value(cfg: Config, key: str):
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def grad_accum_steps(cfg: Config, world_size: int) -> int:
    """Micro-steps per optimizer step so that the global batch is exactly train.batch_tokens."""
    per_micro = world_size * cfg.train.micro_batch_seqs * cfg.data.seq_len
    if cfg.train.batch_tokens % per_micro:
        ranks = f"world_size({world_size}) x " if world_size > 1 else ""
        per_seq = world_size * cfg.data.seq_len
        if cfg.train.batch_tokens % per_seq:  # no micro_batch_seqs can help
            hint = (f"train.batch_tokens must be a multiple of {ranks}data.seq_len = {per_seq}, e.g. "
                    f"{max(1, round(cfg.train.batch_tokens / per_seq)) * per_seq}")
        else:
            seqs = cfg.train.batch_tokens // per_seq
            fits = [d for d in range(1, min(seqs, cfg.train.micro_batch_seqs) + 1) if seqs % d == 0]
            hint = f"a train.micro_batch_seqs that divides {seqs} sequences per rank, e.g. {fits[-1]}"
        raise ConfigError(
            f"train.batch_tokens={cfg.train.batch_tokens} is not a multiple of {ranks}train.micro_batch_seqs("
            f"{cfg.train.micro_batch_seqs}) x data.seq_len({cfg.data.seq_len}) = {per_micro} (hint: {hint})")
    return cfg.train.batch_tokens // per_micro


def validate(cfg: Config) -> None:
    m, t = cfg.model, cfg.train
    try:
        m.validate()
        cfg.eval.validate()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    defaults = Config()
    for key, low in AT_LEAST:
        if not _value(cfg, key) >= low:  # NaN included
            raise ConfigError(f"{key}={_value(cfg, key)} must be >= {low} (hint: the default is "
                              f"{_value(defaults, key)})")
    for key, one_allowed in FRACTIONS:
        value = _value(cfg, key)
        if not (0 <= value <= 1 if one_allowed else 0 <= value < 1):
            raise ConfigError(f"{key}={value} must be in [0, 1{']' if one_allowed else ')'} (hint: the default is "
                              f"{_value(defaults, key)})")
    if not (cfg.optim.embed_weight_decay >= 0 or cfg.optim.embed_weight_decay == -1):
        raise ConfigError(f"optim.embed_weight_decay={cfg.optim.embed_weight_decay} must be >= 0, or -1 for "
                          f"optim.weight_decay's value (now {cfg.optim.weight_decay})")
    grad_accum_steps(cfg, 1)  # and for the world size, where train.py knows it
    if t.schedule not in ("steps", "time"):
        raise ConfigError(f"train.schedule={t.schedule!r}: expected 'steps' or 'time'")
    if t.schedule == "time" and t.time_budget_s <= 0:
        raise ConfigError("train.schedule='time' needs train.time_budget_s > 0 (hint: or train.schedule=steps, "
                          "which decays the learning rate over train.max_steps)")
    q = cfg.quant
    for key, value, allowed, what in (
            ("method", q.method, METHODS, ""),
            ("min_bits", q.min_bits, MIN_BITS, " (5: int5/int6 only; 4: int4 fallback when all-int5 is over the cap)"),
            ("scheme", q.scheme, SCHEMES, ""),
            ("error_weight", q.error_weight, ERROR_WEIGHTS, ""),
            ("table_bits", q.table_bits, TABLE_BITS, " (the width of the embedding tables)"),
            ("phi_bits", q.phi_bits, OBSERVED_BITS, " (the width of the mHC phi projections)"),
            ("calib_source", q.calib_source, CALIB_SOURCES, "")):
        if value not in allowed:
            raise ConfigError(f"quant.{key}={value!r}: expected {one_of(allowed)}{what}")
    rank_only = [f"quant.{key}={getattr(q, key)}" for key in ("min_bits", "table_bits", "phi_bits")
                 if getattr(q, key) != getattr(defaults.quant, key)]
    if q.scheme != "rank" and rank_only:  # the other schemes choose every width themselves: the setting would do nothing
        raise ConfigError(f"{', '.join(rank_only)} applies to quant.scheme=rank only, and the scheme is {q.scheme!r} "
                          "(hint: drop it, or set quant.scheme=rank)")
    if q.cap_bytes > CAP_BYTES:  # the run is held to the challenge's cap whatever this says
        raise ConfigError(f"quant.cap_bytes={q.cap_bytes:,} is above the challenge's {CAP_BYTES:,}-byte cap (hint: "
                          "it can only be lowered, to export a smaller artifact)")
    if t.time_budget_s and cfg.quant.calib_reserve_s >= t.time_budget_s:
        raise ConfigError(f"quant.calib_reserve_s={cfg.quant.calib_reserve_s} must be < train.time_budget_s="
                          f"{t.time_budget_s} (hint: it is the part of the budget kept for GPTQ calibration; a few "
                          "seconds suffice)")
    if t.run_id and (Path(t.run_id).name != t.run_id or t.run_id in (".", "..")):  # it names files and a folder
        raise ConfigError(f"train.run_id={t.run_id!r}: expected a name, not a path (hint: letters, digits, '-', '_'; "
                          "the run writes <log_dir>/<run_id>.txt, <out_dir>/<run_id>.mhcg and a checkpoint folder)")
    if t.seed >= 2**63:  # torch.manual_seed takes a signed 64-bit value
        raise ConfigError(f"train.seed={t.seed} must be < 2**63 (hint: any smaller non-negative integer)")
    if t.resume == "latest" and not t.run_id:
        raise ConfigError("train.resume=latest needs train.run_id=NAME (the default run id is new every run)")
    if t.checkpoint_keep < 1:
        raise ConfigError(f"train.checkpoint_keep={t.checkpoint_keep} must be >= 1 (hint: it counts the newest "
                          "checkpoints kept on disk; train.checkpoint_every=0 writes none)")
    if t.device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"train.device={t.device!r}: expected auto, cpu or cuda (hint: auto takes cuda where "
                          "a GPU is visible)")


def to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)
