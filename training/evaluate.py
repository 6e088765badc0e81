"""Bits-per-byte evaluation: exact byte accounting, sliding-window or non-overlapping, sharded over ranks.

BPB = (sum of target-token NLL in nats) / ln 2 / (UTF-8 bytes those targets decode to).

Scoring is legal by construction: every target token j (predicting tokens[j] from tokens[:j]) is
scored exactly once, by one window that contains only tokens before it, with a full softmax.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from data.tokenizer import ByteLUT

PROGRESS_EVERY_S = 30.0  # evaluate_bpb's progress lines
# torch.compile's backend for eval.compile (a module constant, not a config key: tests set a CPU backend here)
COMPILE_BACKEND = "inductor"


def compiled(fn: Callable, on: bool, *, dynamic: bool) -> Callable:
    """fn through torch.compile when `on` (eval.compile), else fn itself. Dynamo keeps its graphs with fn's code and
    takes the parameters as graph inputs: every wrapper of it, and every model of the same shapes, reuses them, and
    weights changed in place (test-time training, the EMA swap) are what a graph reads."""
    if not on:
        return fn
    # Inductor's shape padding (pad_mm) widens a matmul's small dimension, e.g. a LoRA rank of 4 to 8 bf16 columns;
    # with the sequence length symbolic, the padded product's saved strides were fixed at the first length's values,
    # and the backward at the next length failed its stride check (torch 2.11 on CUDA).
    options = {"shape_padding": False} if dynamic and COMPILE_BACKEND == "inductor" else None
    graph = torch.compile(fn, backend=COMPILE_BACKEND, dynamic=dynamic, options=options)
    if not dynamic:
        return graph
    # With sizes symbolic, Dynamo also makes float constants symbolic (module attributes, and globals such as the
    # Sinkhorn floor), and where a later pass has to specialize one it restarts the whole trace: Dynamo and the
    # forward-backward trace then run twice. Taken as constants from the start, they run once.
    return torch._dynamo.config.patch(specialize_float=True)(graph)


@dataclass(frozen=True)
class Window:
    start: int        # first input token
    score_from: int   # first scored position inside the window
    length: int       # input tokens in the window (targets are the next `length` tokens)


def plan_windows(n_tokens: int, context: int, stride: int) -> list[Window]:
    """Windows that score targets 1..n_tokens-1 exactly once.

    The first window scores all its positions; every later window ends `stride` targets further and
    scores only those new targets, each with (context - stride) or more tokens of context. stride=0
    means non-overlapping windows of `context`.
    """
    if context < 1:
        raise ValueError(f"eval.context must be >= 1, got {context}")
    stride = stride or context
    if not 0 < stride <= context:
        raise ValueError(f"eval.stride={stride} must be in (0, context={context}]; 0 means non-overlapping")
    n_targets = n_tokens - 1
    windows, done = [], 0
    while done < n_targets:
        end = min(done + (context if done == 0 else stride), n_targets)
        start = max(0, end - context)
        windows.append(Window(start=start, score_from=done - start, length=end - start))
        done = end
    return windows


def target_bytes(tokens: torch.Tensor, lut: ByteLUT) -> torch.Tensor:
    """Bytes of targets tokens[1:] given their previous tokens (docs/legality.md, bits per byte), int64 [n-1]."""
    base = torch.as_tensor(lut.base_bytes, dtype=torch.int64)
    space = torch.as_tensor(lut.has_leading_space, dtype=torch.bool)
    boundary = torch.as_tensor(lut.is_boundary, dtype=torch.bool)
    prev, tgt = tokens[:-1].long(), tokens[1:].long()
    return base[tgt] + (space[tgt] & ~boundary[prev]).long()


def device_tokens(tokens: np.ndarray, lut: ByteLUT, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(all_tokens int64 [n], all_bytes int32 [n-1]: the bytes of target j at index j-1) on `device`, copied once for
    a whole pass, so that its batches are gathered there."""
    all_tokens = torch.from_numpy(tokens.astype(np.int64))
    return all_tokens.to(device), target_bytes(all_tokens, lut).to(device=device, dtype=torch.int32)


def audit_bytes(tokens: np.ndarray, sp, lut: ByteLUT, bos_id: int = 1) -> tuple[int, int]:
    """(counted bytes, UTF-8 bytes of the decoded text) over the documents in `tokens`.

    Both must match: a byte-accounting bug inflates or deflates BPB silently. When the tokens end inside a
    character spelled in byte-fallback pieces (eval.max_tokens cut there), those pieces are left out of both sides:
    decoded, they would be one U+FFFD of 3 bytes, not the 1-3 bytes counted.
    """
    counted = int(target_bytes(torch.from_numpy(tokens.astype(np.int64)), lut).sum())
    decoded = 0
    starts = np.flatnonzero(tokens == bos_id).tolist() + [len(tokens)]
    if starts[0] != 0:  # text before the first BOS is a document too
        starts.insert(0, 0)
    for a, b in zip(starts[:-1], starts[1:]):
        ids = [int(t) for t in tokens[a:b] if t != bos_id]
        if b == len(tokens) and (cut := unfinished_character(ids, sp)):
            ids, counted = ids[:-cut], counted - cut  # a byte piece counts one byte
        decoded += len(sp.decode(ids).encode("utf-8"))
    return counted, decoded


def unfinished_character(ids: list[int], sp) -> int:
    """How many byte-fallback pieces at the end of `ids` begin a UTF-8 character they do not finish (0 if none)."""
    tail: list[int] = []  # the trailing byte values, last first
    for t in reversed(ids[-4:]):
        if not sp.is_byte(t):
            break
        tail.append(int(sp.id_to_piece(t)[3:5], 16))  # "<0xC3>" -> 0xC3
    for k, byte in enumerate(tail):
        if byte & 0xC0 != 0x80:  # the last lead byte (or ASCII): how many bytes its character takes
            length = 2 if byte >> 5 == 0b110 else 3 if byte >> 4 == 0b1110 else 4 if byte >> 3 == 0b11110 else 1
            return k + 1 if k + 1 < length else 0
    return 0


class ByteAuditError(ValueError):
    """Tokens whose counted bytes differ from the UTF-8 length of their decoded text."""


def require_byte_audit(tokens: np.ndarray, sp, lut: ByteLUT, shards: str, tokenizer: str) -> int:
    """BPB's denominator for `tokens` (read from `shards`), checked against the decoded text: raises
    ByteAuditError where they differ, as with shards tokenized by another tokenizer."""
    if len(tokens) < 2:  # found now, not by a division by zero after training
        raise ByteAuditError(f"{shards}: {len(tokens)} validation token(s) leave no target to score (hint: the "
                             "validation shards are empty or cut short; eval.max_tokens, if set, must be >= 2)")
    counted, decoded = audit_bytes(tokens, sp, lut)
    if counted == 0:
        raise ByteAuditError(f"{shards}: the {len(tokens) - 1:,} validation targets decode to no bytes, so bits per "
                             "byte is undefined (hint: shards of document separators only?)")
    if counted != decoded:
        raise ByteAuditError(f"byte accounting mismatch on {shards}: counted {counted:,} bytes, the decoded text "
                             f"has {decoded:,} (hint: are these shards tokenized with {tokenizer}?)")
    return counted


def batch_windows(windows: list[Window], batch_seqs: int) -> list[list[Window]]:
    """Batches of at most `batch_seqs` windows of one length (all but the first and the last window usually share
    one length), in plan order within each length."""
    groups: dict[int, list[Window]] = {}
    for w in windows:
        groups.setdefault(w.length, []).append(w)
    return [ws[i:i + batch_seqs] for ws in groups.values() for i in range(0, len(ws), batch_seqs)]


def batch_inputs(batch: list[Window], all_tokens: torch.Tensor, shape: tuple[int, int] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, y, index, scored) [rows, T] for the windows of `batch` (of one length): inputs, targets, each input's
    position in all_tokens (int64 [n], its target is at index + 1), and the targets the windows score. Built on
    all_tokens' device: on the host these small tensor ops ran on every core for every batch, and where other
    processes kept the cores busy each batch waited on them. shape: (rows, length) to pad to, so that one compiled
    graph takes every batch: the padding rows, and the positions past a short window's end, hold token 0 (never a
    later token; the model is causal) and are not scored."""
    device = all_tokens.device
    n, length = len(batch), batch[0].length
    rows, width = shape or (n, length)
    pad = [0] * (rows - n)
    spans = torch.tensor([[w.start for w in batch] + pad, [w.score_from for w in batch] + pad])
    # from pinned memory the copy queues behind the device's work; from pageable memory it would wait for it
    starts, score_from = (spans.pin_memory() if device.type == "cuda" else spans).to(device, non_blocking=True)
    offsets = torch.arange(width, device=device)
    real = (offsets < length) & (torch.arange(rows, device=device) < n)[:, None]  # a padding row has no position
    index = (starts[:, None] + offsets).clamp(max=len(all_tokens) - 2)
    x = torch.where(real, all_tokens[index], 0)
    y = torch.where(real, all_tokens[index + 1], 0)
    return x, y, index, real & (offsets >= score_from[:, None])


def score_batch(token_nll: Callable, batch: list[Window], all_tokens: torch.Tensor, all_bytes: torch.Tensor,
                shape: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(target index, NLL in nats as float64, bytes) of every target the windows of `batch` score, token_nll(x, y)
    giving the NLL [rows, T]; all_tokens (int64 [n]) and all_bytes (the bytes of target j at index j-1) on the
    model's device. Indexing by the scored mask reads it on the host: evaluate_bpb sums without it."""
    x, y, index, scored = batch_inputs(batch, all_tokens, shape)
    return (index + 1)[scored], token_nll(x, y).double()[scored], all_bytes[index][scored]


def bpb_totals(nll_sum: torch.Tensor, n_scored: torch.Tensor, n_bytes: torch.Tensor, n_tokens: int,
               world_size: int) -> dict:
    """The ranks' sums (tensors, reduced in place) as the score: every target 1..n_tokens-1 must be in them once."""
    if world_size > 1:
        for t in (nll_sum, n_scored, n_bytes):
            dist.all_reduce(t)
    expected = n_tokens - 1
    if int(n_scored) != expected:
        raise RuntimeError(f"evaluation scored {int(n_scored)} targets, expected {expected}: window plan bug")
    return {
        "val_loss": float(nll_sum) / expected,
        "val_bpb": float(nll_sum) / math.log(2) / int(n_bytes),
        "tokens": expected,
        "bytes": int(n_bytes),
    }


@torch.no_grad()
def evaluate_bpb(
    model: torch.nn.Module,
    tokens: np.ndarray,
    lut: ByteLUT,
    *,
    context: int,
    stride: int,
    batch_seqs: int,
    device: torch.device,
    autocast_dtype: torch.dtype | None = None,
    rank: int = 0,
    world_size: int = 1,
    progress: Callable[[str], None] | None = None,
    before_batch: Callable[[], None] | None = None,
    compile: bool = False,
) -> dict:
    """Score `tokens` (uint16 1-D) with `model.token_nll`; windows are split across ranks. progress: called with a
    line every PROGRESS_EVERY_S seconds of scoring (a CPU scores the full validation set for minutes).
    before_batch: called before each batch (train.py stops a single rank's pass there on a signal).
    compile (eval.compile): token_nll through torch.compile, every batch padded to [batch_seqs, context]: one graph."""
    windows = plan_windows(len(tokens), context, stride)
    mine = windows[rank * len(windows) // world_size:(rank + 1) * len(windows) // world_size]
    all_tokens, all_bytes = device_tokens(tokens, lut, device)
    nll_sum = torch.zeros((), dtype=torch.float64, device=device)
    n_scored = torch.zeros((), dtype=torch.int64, device=device)
    n_bytes = torch.zeros((), dtype=torch.int64, device=device)
    amp = torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype else nullcontext()
    token_nll = compiled(model.token_nll, compile, dynamic=False)
    shape = (batch_seqs, context) if compile else None
    was_training = model.training
    model.eval()
    t0 = last_said = time.perf_counter()
    done = 0
    for batch in batch_windows(mine, batch_seqs):
        if before_batch is not None:
            before_batch()
        if progress is not None and time.perf_counter() - last_said >= PROGRESS_EVERY_S and done:
            last_said, elapsed = time.perf_counter(), time.perf_counter() - t0
            progress(f"scoring: {done:,} of {len(mine):,} windows in {elapsed:.0f} s, about "
                     f"{elapsed * (len(mine) - done) / done:.0f} s left")
        done += len(batch)
        x, y, index, scored = batch_inputs(batch, all_tokens, shape)
        with amp:
            nll = token_nll(x, y)
        nll_sum += torch.where(scored, nll.double(), 0).sum()  # no host read per batch: the next one queues
        n_scored += scored.sum()
        n_bytes += torch.where(scored, all_bytes[index], 0).sum()
    model.train(was_training)
    return bpb_totals(nll_sum, n_scored, n_bytes, len(tokens), world_size)
