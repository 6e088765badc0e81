"""The [eval] section: how a run scores its artifact, and its score-first test-time training (training/ttt.py,
training/ttt_lora.py). training.config loads it with the other sections."""
from __future__ import annotations

from dataclasses import dataclass


# The eval settings an artifact's meta records (as eval_<key>): scripts.evaluate scores with them by default.
EVAL_RECORDED = ("context", "stride", "max_tokens", "batch_seqs", "ttt", "ttt_chunk_tokens", "ttt_lr", "ttt_momentum",
                 "ttt_epochs", "ttt_batch_seqs", "ttt_lora_rank", "ttt_lora_lr", "ttt_lora_chunk", "ttt_lora_docs",
                 "ttt_lora_wd", "ttt_phases", "ttt_phase_docs", "ttt_phase_lr", "ttt_phase_epochs")
TTT_METHODS = ("none", "chunk_sgd", "doc_lora")
# The ttt_* settings each method reads (EvalConfig.ttt_keys): SGD of the model's weights on scored chunks (chunk_sgd,
# and doc_lora's phases), doc_lora's adapters, and its phases.
SGD_KEYS = ("ttt_chunk_tokens", "ttt_momentum", "ttt_batch_seqs")
LORA_KEYS = ("ttt_lora_rank", "ttt_lora_lr", "ttt_lora_chunk", "ttt_lora_docs", "ttt_lora_wd", "ttt_phases")
PHASE_KEYS = ("ttt_phase_docs", "ttt_phase_lr", "ttt_phase_epochs")
# The least value of each numeric ttt_* setting, and whether the least itself is allowed.
TTT_LEAST = {"ttt_lr": (0, False), "ttt_epochs": (1, True), "ttt_batch_seqs": (1, True), "ttt_lora_rank": (1, True),
             "ttt_lora_lr": (0, False), "ttt_lora_chunk": (1, True), "ttt_lora_docs": (1, True),
             "ttt_lora_wd": (0, True), "ttt_phases": (0, True), "ttt_phase_lr": (0, False),
             "ttt_phase_epochs": (1, True)}


@dataclass
class EvalConfig:
    every_steps: int = 0               # periodic validation during training (0: only at the end)
    max_tokens: int = 0                # cap on validation tokens (0: all)
    context: int = 2048                # sliding-window context
    stride: int = 64                   # sliding-window stride; 0 = non-overlapping windows of `context`
    batch_seqs: int = 16               # windows per forward pass
    pre_quant: bool = True             # also score the unquantized (EMA) model, to report the quantization gap
    compile: bool = False              # torch.compile the scoring and TTT passes' model calls (scores move by rounding)
    # Score-first test-time training of the shipped artifact, scored beside the plain score (training/ttt.py)
    ttt: str = "none"                  # none | chunk_sgd: SGD on each chunk once scored | doc_lora (ttt_lora.py)
    ttt_chunk_tokens: int = 32768      # targets per chunk; a multiple of eval.context trains on all of them
    ttt_lr: float = 0.005              # SGD learning rate at the first chunk, cosine-decayed to 0 at the last
    ttt_momentum: float = 0.9          # SGD momentum, carried across chunks
    ttt_epochs: int = 3                # passes over each scored chunk
    ttt_batch_seqs: int = 32           # sequences of eval.context tokens per SGD step, over all ranks
    # eval.ttt=doc_lora; each default is the setting named of the phased-TTT record [1] (2026-04-14) or [2]
    # (2026-04-27), which training/ttt_lora.py cites by URL
    ttt_lora_rank: int = 80            # rank of each document's adapters (TTT_LORA_RANK [2])
    ttt_lora_lr: float = 1e-4          # AdamW learning rate of the adapters (TTT_LORA_LR [1])
    ttt_lora_chunk: int = 48           # targets scored, then trained on, per adapter step (TTT_CHUNK_SIZE [1])
    ttt_lora_docs: int = 64            # documents adapted side by side in a batch, on each rank (TTT_BATCH_SIZE [1])
    ttt_lora_wd: float = 0.5           # AdamW decoupled weight decay of the adapters (TTT_WEIGHT_DECAY [1])
    ttt_phases: int = 3                # phases of global SGD on scored documents; 0: none (PHASED_TTT_NUM_PHASES [1])
    ttt_phase_docs: int = 2000         # documents in ttt_phases parts, then the rest (PHASED_TTT_PREFIX_DOCS [1])
    ttt_phase_lr: float = 0.001        # SGD learning rate of a phase's first chunk, cosine-decayed (GLOBAL_TTT_LR [1])
    ttt_phase_epochs: int = 1          # passes of each phase over the scored text (GLOBAL_TTT_EPOCHS [1])

    def validate(self) -> None:
        """Raise ValueError naming the field: checked when the config loads, not after training."""
        if self.context < 1:
            raise ValueError(f"eval.context={self.context} must be >= 1 (tokens per scoring window)")
        if not 0 <= self.stride <= self.context:
            raise ValueError(f"eval.stride={self.stride} must be in [0, eval.context={self.context}] "
                             "(0 = non-overlapping windows)")
        for name, what in (("every_steps", "0 = only at the end"), ("max_tokens", "0 = every token")):
            if getattr(self, name) < 0:
                raise ValueError(f"eval.{name}={getattr(self, name)} must be >= 0 ({what})")
        if self.batch_seqs < 1:
            raise ValueError(f"eval.batch_seqs={self.batch_seqs} must be >= 1 (windows per forward pass)")
        if self.max_tokens == 1:  # one token leaves nothing to predict (BPB would divide by zero bytes)
            raise ValueError("eval.max_tokens=1 scores no token: 0 (every token) or >= 2")
        self.validate_ttt()

    def ttt_keys(self) -> tuple[str, ...]:
        """The ttt_* settings eval.ttt's method reads; a changed one it does not read is refused (it does nothing)."""
        if self.ttt == "chunk_sgd":
            return SGD_KEYS + ("ttt_lr", "ttt_epochs")
        if self.ttt == "doc_lora":
            return LORA_KEYS + (PHASE_KEYS + SGD_KEYS if self.ttt_phases else ())
        return ()

    def validate_ttt(self) -> None:
        if self.ttt not in TTT_METHODS:
            raise ValueError(f"eval.ttt={self.ttt!r}: expected one of {', '.join(TTT_METHODS)}")
        default, used = EvalConfig(), self.ttt_keys()
        changed = [f"eval.{key}={getattr(self, key)}" for key in EVAL_RECORDED
                   if key.startswith("ttt_") and key not in used and getattr(self, key) != getattr(default, key)]
        if changed and self.ttt == "none":
            raise ValueError(f"{', '.join(changed)} applies to test-time training, and eval.ttt is 'none' "
                             "(hint: set eval.ttt=chunk_sgd or doc_lora, or drop it)")
        if changed:
            raise ValueError(f"{', '.join(changed)} does not apply to eval.ttt={self.ttt}"
                             + (" with eval.ttt_phases=0" if self.ttt == "doc_lora" else "")
                             + " (hint: drop it; docs/configuration.md says which method reads which key)")
        for key in used:
            value, (least, allowed) = getattr(self, key), TTT_LEAST.get(key, (None, True))
            if least is not None and not (value >= least if allowed else value > least):
                raise ValueError(f"eval.{key}={value} must be {'>=' if allowed else '>'} {least}")
        if "ttt_chunk_tokens" in used and self.ttt_chunk_tokens < self.context:  # no whole sequence would fit
            raise ValueError(f"eval.ttt_chunk_tokens={self.ttt_chunk_tokens} must be >= eval.context={self.context} "
                             "(it trains on sequences of eval.context tokens within each chunk)")
        if "ttt_momentum" in used and not 0 <= self.ttt_momentum < 1:
            raise ValueError(f"eval.ttt_momentum={self.ttt_momentum} must be in [0, 1)")
        if "ttt_lora_chunk" in used and self.ttt_lora_chunk > self.context:
            raise ValueError(f"eval.ttt_lora_chunk={self.ttt_lora_chunk} must be <= eval.context={self.context} (a "
                             "chunk's targets are scored in one window of at most eval.context tokens)")
        if "ttt_phase_docs" in used and self.ttt_phase_docs < self.ttt_phases:
            raise ValueError(f"eval.ttt_phase_docs={self.ttt_phase_docs} must be >= eval.ttt_phases={self.ttt_phases} "
                             "(each phase follows at least one scored document)")
