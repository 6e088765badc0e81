"""Score a shipped artifact in bits per byte, from a fresh process.

    python -m scripts.evaluate --artifact runs/<run>.mhcg --val 'DIR/fineweb_val_*.bin' --tokenizer T.model

Prints one JSON line: val_loss, val_bpb, tokens, bytes, score_time_s (the plain pass's wall clock), context, stride,
artifact_bytes, code_bytes, total_bytes; with test-time training, also val_loss_ttt, val_bpb_ttt and ttt_time_s
(and with eval.ttt=doc_lora ttt_phase_time_s, its phases' part of it).
train.py's final line comes from training.score.evaluate_artifact: the same code path. Unless --context / --stride /
--max-tokens / --batch-seqs and eval.ttt* settings say otherwise, it scores as the run did (its eval settings,
recorded in the artifact), so the numbers are train.py's; eval.compile=true runs the passes' model calls through
torch.compile (not recorded: a GPU's speed-up, the same scores to rounding). Score-first test-time training beside
the plain score (docs/operations.md):

    python -m scripts.evaluate --artifact A.mhcg --val DIR --tokenizer T.model eval.ttt=chunk_sgd [eval.ttt_lr=...]
The counted code is what a record made from this checkout ships (training.shipped_code), as train.py counts it; for
an artifact that ships with other code, a record's, name that code: --code RECORD/train_gpt.py RECORD/config.toml.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from quant.container import ArtifactError
from training.score import load_model, recorded_eval, score_model
from training.scoring_inputs import (INPUT_ERRORS, SETTINGS, add_scoring_arguments, checked_tokens, open_validation,
                                     parse_scoring_arguments)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_scoring_arguments(p, SETTINGS, "default: the run's; compile: false")
    p.add_argument("--context", type=int, help="window length in tokens (default: the run's eval.context)")
    p.add_argument("--stride", type=int, help="0 = non-overlapping windows (default: the run's eval.stride)")
    p.add_argument("--batch-seqs", type=int, help="windows per forward pass (default: the run's eval.batch_seqs)")
    p.add_argument("--max-tokens", type=int,
                   help="score only the first N validation tokens, 0 = all (default: the run's eval.max_tokens)")
    p.add_argument("--code", nargs="+", metavar="FILE",
                   help="the code that ships with the artifact, counted in its total in place of this repository's "
                        "(a record's train_gpt.py and config.toml)")
    a = parse_scoring_arguments(p, argv, SETTINGS)
    try:
        score(a, p, a.device)
    except INPUT_ERRORS as e:
        sys.exit(f"scripts.evaluate: {e}")


def score(a: argparse.Namespace, p: argparse.ArgumentParser, device: torch.device) -> None:
    """The command line's scoring; the cheap inputs (shards, tokenizer, code) are checked before the model is built."""
    shipped_code = None if a.code is None else [Path(f) for f in a.code]
    for f in shipped_code or []:
        if not f.is_file():
            p.error(f"--code {f}: no such file (hint: the files that ship with the artifact, e.g. a record folder's "
                    "train_gpt.py and config.toml)")
    pattern, shards, sp = open_validation(a.val, a.tokenizer)
    model, meta = load_model(Path(a.artifact), device)
    eval_cfg = recorded_eval(meta, a.artifact, context=a.context, stride=a.stride, max_tokens=a.max_tokens,
                             batch_seqs=a.batch_seqs, **a.eval)
    try:
        eval_cfg.validate()
    except ValueError as e:
        p.error(f"{e} (hint: from --context/--stride/--max-tokens/--batch-seqs or eval.KEY=VALUE, else recorded in "
                f"{a.artifact})")
    tokens, lut, sha = checked_tokens(Path(a.artifact), meta, model.cfg.vocab_size, pattern, shards, sp, a.tokenizer,
                                      eval_cfg.max_tokens)
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
