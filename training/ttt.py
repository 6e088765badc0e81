"""Score-first test-time training (eval.ttt=chunk_sgd): the model keeps learning from validation text it has scored.

The targets 1..n-1 are cut into chunks of eval.ttt_chunk_tokens: chunk c holds targets c*C+1 .. (c+1)*C. For each
chunk in order, every sliding window whose first scored target lies in it is scored with the current weights (the
windows of training.evaluate.plan_windows, so each target has the context it has in the plain sliding score); then,
unless it is the last chunk, the model trains on that chunk's targets, split into sequences of eval.context tokens,
for eval.ttt_epochs epochs of SGD with momentum over every parameter. Once chunk c's windows are scored, every
target up to (c+1)*C is scored (a target is scored by the window of the latest first target at or before it), so
no weight that scores a target was trained on it or on anything after it: one left-to-right pass, each target scored
once (docs/legality.md; tests/test_ttt.py changes later tokens and checks earlier scores stay exactly the same).

The procedure is the April-2026 records' "legal TTT", e.g.
https://github.com/openai/parameter-golf/tree/main/records/track_10min_16mb/2026-04-09_SP8192_3LayerRecur_ParResid_QK525_LegalTTT:
SGD (lr 0.005, momentum 0.9) for 3 epochs per 32K-token chunk, the learning rate cosine-decayed across chunks,
gradients clipped to norm 1. Here a step's batch of eval.ttt_batch_seqs sequences is split over the ranks and its
mean gradient assembled exactly, so the weights do not depend on the number of ranks.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist

from data.tokenizer import ByteLUT
from training.eval_config import EvalConfig
from training.evaluate import PROGRESS_EVERY_S, Window, batch_windows, bpb_totals, compiled, device_tokens, \
    plan_windows, score_batch

GRAD_CLIP = 1.0  # the records' global gradient-norm clip for TTT steps
# What a TTT pass adds to a score's result, beside the plain sliding score's val_loss and val_bpb.
TTT_KEYS = ("val_loss_ttt", "val_bpb_ttt", "ttt_time_s")


def chunk_windows(windows: list[Window], n_targets: int, chunk_tokens: int) -> list[list[Window]]:
    """The windows of each chunk, by their first scored target; a chunk may have none (chunk_tokens < stride)."""
    chunks: list[list[Window]] = [[] for _ in range(math.ceil(n_targets / chunk_tokens))]
    for w in windows:
        chunks[(w.start + w.score_from) // chunk_tokens].append(w)  # first target w.start + w.score_from + 1
    return chunks


def training_starts(chunk: int, n_targets: int, chunk_tokens: int, seq_len: int) -> list[int]:
    """First input token of each training sequence of `chunk`: sequence s has inputs s..s+seq_len-1 and targets
    s+1..s+seq_len, all within the chunk's targets. The last seq_len - 1 or fewer targets that do not fill a
    sequence are left out."""
    first, last = chunk * chunk_tokens + 1, min((chunk + 1) * chunk_tokens, n_targets)
    return list(range(first - 1, last - seq_len + 1, seq_len))


def cosine_lr(lr: float, chunk: int, n_chunks: int) -> float:
    """The learning rate of chunk `chunk`: lr at the first, decaying to 0 at the last (which is never trained on)."""
    return lr * 0.5 * (1 + math.cos(math.pi * chunk / max(n_chunks - 1, 1)))


def sum_gradients(params: list[torch.nn.Parameter], world_size: int) -> None:
    """Sum the gradients over the ranks, in one flat all-reduce (training.distributed's helpers would add the
    optimizer module to the code an artifact's score counts)."""
    if world_size == 1:
        return
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    torch._foreach_copy_(grads, [part.view_as(g) for part, g in zip(flat.split([g.numel() for g in grads]), grads)])


def train_on_chunk(model: torch.nn.Module, optimizer: torch.optim.Optimizer, all_tokens: torch.Tensor,
                   starts: list[int], *, seq_len: int, epochs: int, batch_seqs: int, amp,
                   rank: int, world_size: int, before_batch: Callable[[], None] | None, compile: bool) -> None:
    """`epochs` epochs over the sequences of seq_len tokens at `starts`, batch_seqs of them per step. Each rank takes
    its share of a step's sequences and the gradients are summed, so every rank steps to the same weights. all_tokens
    (int64 [n]) is on the model's device, where each step's sequences are gathered.
    compile (eval.compile): the loss through torch.compile, with static shapes: a rank's share of a full step and of
    a chunk's last, smaller one are the only row counts, so one or two graphs."""
    loss_fn = compiled(model, compile, dynamic=False)
    params = [p for p in model.parameters() if p.requires_grad]
    offsets = torch.arange(seq_len + 1, device=all_tokens.device)
    model.train()
    for _ in range(epochs):
        for i in range(0, len(starts), batch_seqs):
            if before_batch is not None:
                before_batch()
            step = starts[i:i + batch_seqs]
            mine = step[rank * len(step) // world_size:(rank + 1) * len(step) // world_size]
            optimizer.zero_grad(set_to_none=True)
            if mine:
                seqs = all_tokens[torch.tensor(mine, device=all_tokens.device)[:, None] + offsets]
                with amp:
                    loss = loss_fn(seqs[:, :-1], seqs[:, 1:])
                # this rank's mean over its sequences, weighted so that the ranks' sum is the step's mean
                (loss * (len(mine) / len(step))).backward()
            for p in params:  # a rank without a sequence (or a parameter without a gradient) adds zeros
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            sum_gradients(params, world_size)
            torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP)
            optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    model.eval()


def ttt_scores(model: torch.nn.Module, tokens: np.ndarray, lut: ByteLUT, cfg: EvalConfig, *, device: torch.device,
               autocast_dtype: torch.dtype | None = None, rank: int = 0, world_size: int = 1,
               progress: Callable[[str], None] | None = None, before_batch: Callable[[], None] | None = None
               ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The pass, as the (target index, NLL in nats, bytes) of each batch of windows this rank scores, in order;
    trains `model` in place between chunks. The caller sums them (and all-reduces the sums)."""
    n_targets = len(tokens) - 1
    chunks = chunk_windows(plan_windows(len(tokens), cfg.context, cfg.stride), n_targets, cfg.ttt_chunk_tokens)
    all_tokens, all_bytes = device_tokens(tokens, lut, device)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=cfg.ttt_lr,
                                momentum=cfg.ttt_momentum)
    amp = torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype else nullcontext()
    token_nll = compiled(model.token_nll, cfg.compile, dynamic=False)  # the plain score's graph (evaluate_bpb)
    shape = (cfg.batch_seqs, cfg.context) if cfg.compile else None
    scored_through = 0  # every target up to this one is scored (by some rank)
    t0 = last_said = time.perf_counter()
    model.eval()
    for c, chunk in enumerate(chunks):
        if progress is not None and time.perf_counter() - last_said >= PROGRESS_EVERY_S and c:
            last_said, elapsed = time.perf_counter(), time.perf_counter() - t0
            progress(f"test-time training: {c:,} of {len(chunks):,} chunks in {elapsed:.0f} s, about "
                     f"{elapsed * (len(chunks) - c) / c:.0f} s left")
        mine = chunk[rank * len(chunk) // world_size:(rank + 1) * len(chunk) // world_size]
        scored = []
        with torch.no_grad():
            for batch in batch_windows(mine, cfg.batch_seqs):
                if before_batch is not None:
                    before_batch()
                with amp:
                    scored.append(score_batch(token_nll, batch, all_tokens, all_bytes, shape))
        yield from scored
        scored_through = max([scored_through] + [w.start + w.length for w in chunk])
        if c == len(chunks) - 1:
            break
        starts = training_starts(c, n_targets, cfg.ttt_chunk_tokens, cfg.context)
        if starts and starts[-1] + cfg.context > scored_through:  # the construction above makes this impossible
            raise RuntimeError(f"test-time training would train on target {starts[-1] + cfg.context}, scored only "
                               f"through {scored_through}")
        for group in optimizer.param_groups:
            group["lr"] = cosine_lr(cfg.ttt_lr, c, len(chunks))
        train_on_chunk(model, optimizer, all_tokens, starts, seq_len=cfg.context, epochs=cfg.ttt_epochs,
                       batch_seqs=cfg.ttt_batch_seqs, amp=amp, rank=rank, world_size=world_size,
                       before_batch=before_batch, compile=cfg.compile)


def evaluate_bpb_ttt(model: torch.nn.Module, tokens: np.ndarray, lut: ByteLUT, cfg: EvalConfig, *,
                     device: torch.device, autocast_dtype: torch.dtype | None = None, rank: int = 0,
                     world_size: int = 1, progress: Callable[[str], None] | None = None,
                     before_batch: Callable[[], None] | None = None) -> dict:
    """val_loss, val_bpb, tokens, bytes of the score-first TTT pass (see ttt_scores), as evaluate_bpb reports them.
    Trains `model` in place: score it plainly first."""
    nll_sum = torch.zeros((), dtype=torch.float64, device=device)
    n_scored = torch.zeros((), dtype=torch.int64, device=device)
    n_bytes = torch.zeros((), dtype=torch.int64, device=device)
    for _, nll, byte_counts in ttt_scores(model, tokens, lut, cfg, device=device, autocast_dtype=autocast_dtype,
                                          rank=rank, world_size=world_size, progress=progress,
                                          before_batch=before_batch):
        nll_sum += nll.sum()
        n_scored += nll.numel()
        n_bytes += byte_counts.sum()
    return bpb_totals(nll_sum, n_scored, n_bytes, len(tokens), world_size)
