"""Time an artifact's scoring passes on one device, and estimate each one's time on the whole validation split.

    python -m scripts.bench_scoring --artifact runs/<run>.mhcg --val 'DIR/fineweb_val_*.bin' --tokenizer T.model \\
        --tokens 524288 --passes none,chunk_sgd,doc_lora --compile false,true

The challenge allows 10 minutes of evaluation on 8xH100, and a record reports its test-time-training pass's time.
Scoring the whole split once per setting takes tens of minutes on one GPU, so this command times a prefix and
extrapolates. Each row, one eval.ttt method under one eval.compile setting, loads the artifact afresh (chunk TTT
trains the weights in place) and first scores the first --warmup-tokens tokens: with eval.compile on, that builds
the graphs, which the timed pass reuses (Dynamo keeps them with the function's code). It loads the artifact again and
scores the first --tokens tokens as scripts.evaluate does (training.score.score_model: the plain sliding pass, then
the TTT pass, each with its own wall clock), with the settings the run recorded (the TTT method's own settings:
their defaults where the run recorded another method) under any eval.KEY=VALUE given.

The estimate for the full split (--full-tokens, default every token of --val) is the warm-up's seconds plus each
pass's timed seconds scaled to the split: by tokens for the plain and chunk passes, whose work is linear in tokens
(windows, chunks). The document-LoRA pass runs one adapter step per chunk of each batch of documents
(training.ttt_lora.chunk_work): its time grows with the window positions those steps compute where the device's work
bounds it, and with the number of steps where launching each step's kernels from the host does (small batches,
short windows, eager mode). Both grow with the documents' lengths, not with their tokens alone, and a prefix of a
few hundred documents is not the split in small, so its estimate is a range: the TTT time scaled by the smaller and
by the larger of the two ratios. With --full-tokens the split's documents are not at hand, and the prefix's counts
per token stand for them. The warm-up also holds the scoring of its own tokens, so the estimate leans high. A TTT
row's estimate holds both passes, as scripts.evaluate and train.py run them; the plain row is the plain pass alone.
The document-LoRA pass's phases of global SGD (ttt_phase_time_s, shown beside its TTT seconds) train on the split's
first eval.ttt_phase_docs documents, so they count as timed, unscaled; a prefix holding fewer documents times fewer
phases, and the command says so. --sample-batches N times, in place of a prefix, the documents of N of the
document-LoRA pass's own batches over the split, spread over them (sampled_batches): shapes of the whole split
rather than of its first documents, which narrows the range.

One-off costs belong in the warm-up: graphs (eval.compile), and the Triton MLP kernels' autotuning, which runs once
for each power-of-two bucket of the number of rows a GEMM meets when they are called eagerly (compiled, inductor
times them once, at a graph's first launch). A warm-up shorter than the timed tokens can leave some of it in the
timed pass; --warmup-tokens equal to --tokens moves it out.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from data.loader import load_tokens
from data.shards import read_header
from training.eval_config import TTT_METHODS, EvalConfig
from training.score import load_model, recorded_eval, score_model
from training.ttt_lora import chunk_work, pass_batches, segments, split_documents
from training.scoring_inputs import (INPUT_ERRORS, SETTINGS, add_scoring_arguments, checked_tokens, open_validation,
                                     parse_scoring_arguments)


DEFAULT_TOKENS, DEFAULT_WARMUP_TOKENS = 524_288, 65_536
TUNABLE = tuple(key for key in SETTINGS if key not in ("ttt", "compile"))  # the rows set those two


@dataclass
class Row:
    ttt: str
    compile: bool
    warmup_s: float
    plain_s: float
    ttt_s: float | None   # None for the plain pass alone
    tokens: int           # timed tokens
    ttt_work: tuple[float, float] | None = None  # the split's TTT work over the timed pass's, where not the token
                                                 # ratio: the two bounds of doc_lora's (steps, positions)
    phase_s: float = 0.0  # the part of ttt_s in doc_lora's phases of global SGD: the split's own, not scaled

    def rate(self, seconds: float) -> float:
        return self.tokens / max(seconds, 1e-3)  # score_model rounds to the millisecond

    def full_split_s(self, full_tokens: int) -> tuple[float, float]:
        """The warm-up, then each pass that runs scaled to the split: by tokens, or by the smaller and the larger of
        the TTT pass's work ratios (low, high; equal for a token-scaled row); the phases of global SGD as timed (a
        prefix with all of them trains on what the split's train on)."""
        seconds = self.warmup_s + full_tokens / self.rate(self.plain_s)
        if self.ttt_s is None:
            return seconds, seconds
        ratios = self.ttt_work if self.ttt_work is not None else (full_tokens / self.tokens,) * 2
        low, high = (seconds + (self.ttt_s - self.phase_s) * r + self.phase_s for r in sorted(ratios))
        return low, high


def parse_list(p: argparse.ArgumentParser, flag: str, text: str, choices: tuple[str, ...]) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    bad = [item for item in items if item not in choices]
    if bad or not items:
        p.error(f"{flag} {text!r}: expected a comma-separated list of {', '.join(choices)}")
    return list(dict.fromkeys(items))  # in order, each once


def settings_for(method: str, given: dict) -> dict:
    """The given eval settings that `method` reads: chunk TTT's learning rate does not apply to the plain row."""
    reads = EvalConfig(ttt=method, **given).ttt_keys()
    return {key: value for key, value in given.items() if key in reads}


def time_row(artifact: Path, tokens, warmup, lut, settings: dict, device: torch.device) -> Row:
    """One method under one compile setting: a warm-up on `warmup`, then the timed pass on `tokens`, each on a model
    loaded afresh from the artifact."""
    def run(val) -> dict:
        model, meta = load_model(artifact, device)
        cfg = recorded_eval(meta, artifact, max_tokens=len(val), **settings)
        cfg.validate()
        return score_model(artifact, model, meta, val, lut, cfg, device=device)
    t0 = time.perf_counter()
    run(warmup)
    warmup_s = time.perf_counter() - t0
    result = run(tokens)
    return Row(settings["ttt"], settings["compile"], warmup_s, result["score_time_s"], result.get("ttt_time_s"),
               len(tokens), phase_s=result.get("ttt_phase_time_s", 0.0))


def lora_work_lines(cfg: EvalConfig, timed: np.ndarray, full: np.ndarray | None
                    ) -> tuple[tuple[float, float] | None, list[str]]:
    """The document-LoRA row's work ratios (the split's chunk steps and window positions over the timed tokens';
    None without the split's tokens: the token ratio) and what to say about them: the counts (steps per 1,000
    tokens, positions per token), and the split's phases the timed tokens hold too few documents for (a phase
    follows each of the first eval.ttt_phase_docs documents' parts)."""
    timed_work, lines = chunk_work(timed, cfg), []
    full_work = None if full is None else chunk_work(full, cfg)
    ratios = None if full_work is None else (full_work[0] / timed_work[0], full_work[1] / timed_work[1])

    def counts(work: tuple[int, int], tokens: np.ndarray) -> str:
        return f"{1000 * work[0] / len(tokens):.2f} and {work[1] / len(tokens):.1f}"
    split = "" if full_work is None else f", {counts(full_work, full)} in the split: the estimate spans both ratios"
    lines.append(f"doc_lora: chunk steps per 1,000 tokens and window positions per token: "
                 f"{counts(timed_work, timed)} in the timed tokens{split}")
    split_docs = 1 << 62 if full is None else len(split_documents(full))  # unknown: as many as there are phases
    timed_docs, phases = len(split_documents(timed)), len(segments(split_docs, cfg.ttt_phase_docs, cfg.ttt_phases)) - 1
    timed_phases = len(segments(timed_docs, cfg.ttt_phase_docs, cfg.ttt_phases)) - 1
    if timed_phases < phases:
        lines.append(f"doc_lora: the timed tokens hold {timed_docs:,} documents, so {timed_phases} of the split's "
                     f"{phases} phases of global SGD ran (eval.ttt_phase_docs {cfg.ttt_phase_docs} in "
                     f"{cfg.ttt_phases} parts): the estimate counts those alone; timed tokens holding more "
                     f"than {cfg.ttt_phase_docs:,} documents time them all")
    return ratios, lines


def sampled_batches(tokens: np.ndarray, cfg: EvalConfig, n: int) -> np.ndarray:
    """The documents of n of the document-LoRA pass's batches over `tokens` (one rank), the middle batch of each of n
    equal runs of its batches in their order, as a stream of their own in validation order (each document's inputs,
    then the token after the last one: the targets are the split's). A batch holds documents of near-equal length,
    so the stream's own batches have shapes from the whole split, its longest documents to its shortest, where a
    prefix holds its first few hundred documents only."""
    docs = split_documents(tokens)
    plan = [batch for _, batches in pass_batches(docs, cfg) for batch in batches]
    if not 1 <= n <= len(plan):
        raise ValueError(f"--sample-batches {n}: expected 1 to {len(plan):,}, the document-LoRA pass's batches "
                         f"over the split at eval.ttt_lora_docs {cfg.ttt_lora_docs}")
    picked = [(2 * i + 1) * len(plan) // (2 * n) for i in range(n)]  # the middle batch of each of n equal runs
    ids = sorted(d for i in picked for d in plan[i])
    last_start, last_targets = docs[ids[-1]]
    return np.concatenate([tokens[s:s + t] for s, t in (docs[d] for d in ids)]
                          + [tokens[last_start + last_targets:last_start + last_targets + 1]])


def estimate_cell(low: float, high: float) -> str:
    return f"{low:,.1f}" if low == high else f"{low:,.1f}–{high:,.1f}"


def format_table(rows: list[Row], full_tokens: int) -> str:
    lines = [f"| eval.ttt | eval.compile | warm-up s | plain s | plain tokens/s | TTT s | TTT tokens/s | "
             f"{full_tokens:,} tokens, s (estimate) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        phases = f" ({r.phase_s:.2f} in phases)" if r.phase_s else ""
        ttt = ("—", "—") if r.ttt_s is None else (f"{r.ttt_s:.2f}{phases}", f"{r.rate(r.ttt_s):,.0f}")
        estimate = estimate_cell(*r.full_split_s(full_tokens))
        lines.append(f"| {r.ttt} | {str(r.compile).lower()} | {r.warmup_s:.2f} | {r.plain_s:.2f} | "
                     f"{r.rate(r.plain_s):,.0f} | {ttt[0]} | {ttt[1]} | {estimate} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_scoring_arguments(p, TUNABLE, "default: the run's, else EvalConfig's")
    p.add_argument("--tokens", type=int, default=None,
                   help=f"validation tokens each timed pass scores, from the first (default {DEFAULT_TOKENS:,})")
    p.add_argument("--sample-batches", type=int, default=0,
                   help="instead of a prefix, time the documents of this many of the document-LoRA pass's batches, "
                        "spread evenly over the split (needs doc_lora in --passes)")
    p.add_argument("--warmup-tokens", type=int, default=None,
                   help="tokens of the warm-up pass before each timed one, from the timed tokens' first (compiles "
                        f"the graphs with eval.compile; default {DEFAULT_WARMUP_TOKENS:,}, or all of a sample's)")
    p.add_argument("--passes", default="none,chunk_sgd,doc_lora",
                   help=f"eval.ttt methods to time, comma-separated, of {', '.join(TTT_METHODS)}")
    p.add_argument("--compile", default="false,true", help="eval.compile settings to time each method with")
    p.add_argument("--full-tokens", type=int, default=0,
                   help="the token count to estimate for (default 0: every token of --val's shards)")
    a = parse_scoring_arguments(p, argv, TUNABLE)
    methods = parse_list(p, "--passes", a.passes, TTT_METHODS)
    unread = sorted(set(a.eval) - {key for method in methods for key in settings_for(method, a.eval)})
    if unread:
        p.error(f"eval.{unread[0]} is read by none of --passes {','.join(methods)}")
    compiles = [c == "true" for c in parse_list(p, "--compile", a.compile, ("false", "true"))]
    if a.sample_batches:
        check_sampling(p, a, methods)
    for flag, value in (("--tokens", a.tokens), ("--warmup-tokens", a.warmup_tokens)):
        if value is not None and value < 2:
            p.error(f"{flag} {value}: expected at least 2 (a target and its context)")
    a.tokens = DEFAULT_TOKENS if a.tokens is None else a.tokens
    if a.warmup_tokens is None and not a.sample_batches:  # a sample warms up on all of itself
        a.warmup_tokens = DEFAULT_WARMUP_TOKENS
    if a.full_tokens < 0:
        p.error(f"--full-tokens {a.full_tokens}: expected 0 (every token of --val) or a positive count")
    try:
        bench(a, methods, compiles, a.device)
    except INPUT_ERRORS as e:
        sys.exit(f"scripts.bench_scoring: {e}")
    except ValueError as e:  # an eval setting the artifact recorded that this method cannot take
        sys.exit(f"scripts.bench_scoring: {a.artifact}: {e}")


def check_sampling(p: argparse.ArgumentParser, a: argparse.Namespace, methods: list[str]) -> None:
    """--sample-batches replaces the prefix and samples the split's own documents."""
    if a.sample_batches < 0:
        p.error(f"--sample-batches {a.sample_batches}: expected 0 (a prefix) or a number of batches")
    if "doc_lora" not in methods:
        p.error("--sample-batches samples the document-LoRA pass's batches: expected doc_lora in --passes")
    if a.tokens is not None:
        p.error("--sample-batches and --tokens: give one (the sample's documents are the timed tokens)")
    if a.full_tokens:
        p.error("--sample-batches with --full-tokens: the sample is drawn from --val's own documents, which are "
                "the split estimated for")


def bench(a: argparse.Namespace, methods: list[str], compiles: list[bool], device: torch.device) -> None:
    artifact = Path(a.artifact)
    pattern, shards, sp = open_validation(a.val, a.tokenizer)
    model, meta = load_model(artifact, device)
    in_split = sum(read_header(s) for s in shards)
    if not a.sample_batches and a.tokens > in_split:
        sys.exit(f"scripts.bench_scoring: --tokens {a.tokens:,}: {pattern} holds {in_split:,} tokens "
                 f"(hint: --tokens {in_split} or fewer)")
    tokens, lut, _ = checked_tokens(artifact, meta, model.cfg.vocab_size, pattern, shards, sp, a.tokenizer,
                                    0 if a.sample_batches else a.tokens)
    del model
    if a.sample_batches:  # every token of --val, checked above: the split, and the sample drawn from it
        full, lora = tokens, {**settings_for("doc_lora", a.eval), "ttt": "doc_lora"}
        tokens = sampled_batches(full, recorded_eval(meta, artifact, **lora), a.sample_batches)
    else:
        full = load_tokens(shards) if a.full_tokens == 0 and "doc_lora" in methods else None
    warmup = tokens[:a.warmup_tokens]  # None: all of them
    full_tokens = a.full_tokens or in_split
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    sampled = f" (the documents of {a.sample_batches:,} document-LoRA batches)" if a.sample_batches else ""
    print(f"{artifact}: {len(tokens):,} timed tokens{sampled}, {len(warmup):,} warm-up tokens, on {name}; "
          f"estimates for {full_tokens:,} tokens", flush=True)
    rows, notes = [], []
    for method in methods:
        given = {**settings_for(method, a.eval), "ttt": method}
        work = None  # the token ratio; doc_lora's counted once, as eval.compile does not change its shapes
        if method == "doc_lora":
            work, notes = lora_work_lines(recorded_eval(meta, artifact, **given), tokens, full)
        for on in compiles:
            rows.append(replace(time_row(artifact, tokens, warmup, lut, {**given, "compile": on}, device),
                                ttt_work=work))
            print(f"timed eval.ttt={method} eval.compile={str(on).lower()}", file=sys.stderr, flush=True)
    print("\n" + format_table(rows, full_tokens) + "".join("\n" + line for line in notes))


if __name__ == "__main__":
    main()
