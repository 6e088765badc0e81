"""Document-LoRA score-first test-time training with phases of global SGD (eval.ttt=doc_lora).

Documents. Validation is cut at its BOS tokens (text before the first BOS is a document too). Document d holds the
inputs s_d .. s_{d+1}-1 and the targets s_d+1 .. s_{d+1}: its last target is the next document's BOS, so every
target of the stream belongs to exactly one document. A document is scored on its own tokens alone.

Adapters. Each document gets low-rank adapters of its own (rank eval.ttt_lora_rank): beside the q, k and v rows of
every attention's qkv projection and beside its output projection, beside every MLP (from its input to its output)
and beside the head. They start afresh at every document (A a fixed random draw, the same for every document, and
B zero: the model as it is). The document's targets are cut into chunks of eval.ttt_lora_chunk and taken left to
right: chunk c is scored by one forward pass, with the adapters as they are, over a window of the document's tokens
that ends at the chunk's last target and holds at most eval.context of them; then, unless it is the document's last
chunk, one AdamW step on the chunk's mean loss trains the adapters. A target is scored by adapters trained only on
earlier chunks of its own document.

Phases. The documents are scored in validation order in segments: the first eval.ttt_phase_docs in eval.ttt_phases
equal parts, then all the others. After each part, the model's own weights train on everything scored so far (the
validation stream through the part's last target) as chunk_sgd trains on a chunk (training.ttt.train_on_chunk: SGD
with eval.ttt_momentum, eval.ttt_batch_seqs sequences of eval.context tokens a step, over all ranks), for
eval.ttt_phase_epochs epochs at eval.ttt_phase_lr cosine-decayed over chunks of eval.ttt_chunk_tokens, the last
chunk left out, with a fresh optimizer. The next segment is scored with those weights.

Batches. Within a segment every document sees the same base weights and nothing of the others, so the order does not
change a score: the segment's documents are sorted by length and adapted eval.ttt_lora_docs at a time, as the rows
of one batch, longest first, and the batches are dealt to the ranks in turn. Chunk c's forward pass reads the rows
whose documents still have targets from chunk c on (a prefix of the batch), never fewer than two rows where
eval.ttt_lora_docs allows two (a padding row beside a lone document), over min((c+1)·chunk, context) positions: a
document that has ended costs nothing more, so a batch's work is its documents' own and does not grow with its
longest one. The blocks run over the whole window, whose earlier positions are the chunk's context, but the head
(vocabulary-wide logits, the softcap and the loss) reads only the window's last eval.ttt_lora_chunk positions, which
hold the chunk's targets. The shapes vary in both sizes and share the compiled graphs (a row count of one would take
graphs of its own). Window tails and padding rows hold token 0, never a later token. When the pass ends the model
gets back the weights it came with: the shipped artifact and its plain score are untouched; the pass reports its own
score.

The records' procedure ("phased TTT"), whose settings are the defaults (training/config.py):
  [1] https://github.com/openai/parameter-golf/tree/main/records/track_10min_16mb/2026-04-14_MultiPhaseGlobalSGD_PhasedTTT
      TTT_LORA_LR 1e-4, TTT_CHUNK_SIZE 48, TTT_EVAL_SEQ_LEN 2048 (= eval.context), TTT_BATCH_SIZE 64 documents,
      AdamW with TTT_BETA1 0, TTT_BETA2 0.999, eps 1e-10 and TTT_WEIGHT_DECAY 0.5; PHASED_TTT_PREFIX_DOCS 2000 in
      PHASED_TTT_NUM_PHASES 3 (its run command); GLOBAL_TTT_LR 0.001, GLOBAL_TTT_MOMENTUM 0.9, GLOBAL_TTT_EPOCHS 1,
      GLOBAL_TTT_CHUNK_TOKENS 32768, GLOBAL_TTT_BATCH_SEQS 32, GLOBAL_TTT_GRAD_CLIP 1.0.
  [2] https://github.com/openai/parameter-golf/tree/main/records/track_10min_16mb/2026-04-27_SP8192_LQER_SparseGate_BOSSmearFix_9HpStack_1.0611
      TTT_LORA_RANK 80 (the 2026-04-14 record ran 96).
Where this differs from the records: documents are scored in validation order (the records take the longest first,
and their phases train on the first documents they scored); the phases train on the stream, across document
boundaries, as chunk_sgd does (the records' attention stops at them); the output adapter reads the output
projection's input (the records' reads the attention's input); a block that depth recurrence repeats keeps one
set of adapters (the records' have one per virtual layer); the phase boundaries stay where they are when the
validation set is short (see segments); a chunk's pass computes neither the rows of documents that have ended nor
the logits of positions before the chunk (the records' computes both, and keeps the chunk's); the records' later
option of scaling the adapters by alpha/rank and keeping A across documents is left out.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from data.tokenizer import ByteLUT
from model.features import BOS_ID
from model.layers import MLP, Attention
from training.eval_config import EvalConfig
from training.evaluate import PROGRESS_EVERY_S, bpb_totals, compiled, device_tokens
from training.ttt import cosine_lr, train_on_chunk, training_starts

ADAM_BETAS, ADAM_EPS = (0.0, 0.999), 1e-10  # the records' TTT_BETA1, TTT_BETA2 and eps [1]
A_SEED = 0x6C6F7261  # the adapters' A draw ("lora"): one generator of its own, the same draw for every document


def split_documents(tokens: np.ndarray, bos_id: int = BOS_ID) -> list[tuple[int, int]]:
    """(first input token, number of targets) of every document that has a target, in validation order."""
    bos = np.flatnonzero(tokens == bos_id)
    starts = np.concatenate([[0], bos[bos > 0]])
    ends = np.append(starts[1:], len(tokens) - 1)  # the last document's targets end with the stream
    return [(int(s), int(e - s)) for s, e in zip(starts, ends) if e > s]


def segments(n_docs: int, phase_docs: int, phases: int) -> list[range]:
    """The documents scored with one set of base weights, in order; a phase of global SGD follows each but the last.
    The first phase_docs documents make `phases` parts (boundaries as the records': phase_docs·(k+1)//phases), the
    rest one more. The boundaries do not depend on n_docs, which later tokens decide (the records' take
    min(phase_docs, n_docs), which would move a document's phase with the number of documents after it): where
    the validation set ends first, its last segment is cut short or missing."""
    edges = [0] + [phase_docs * (k + 1) // phases for k in range(phases)] + [n_docs]
    return [range(a, min(b, n_docs)) for a, b in zip(edges[:-1], edges[1:]) if min(b, n_docs) > a]


def phase_end(docs: list[tuple[int, int]], segment: range) -> int:
    """The last target a phase after `segment` trains on: the segment's last document's last target."""
    start, n_targets = docs[segment[-1]]
    return start + n_targets


def segment_batches(docs: list[tuple[int, int]], segment: range, per_batch: int) -> list[list[int]]:
    """The documents of `segment` in batches of per_batch, longest first (similar lengths share a batch's chunks)."""
    order = sorted(segment, key=lambda d: (-docs[d][1], d))
    return [order[i:i + per_batch] for i in range(0, len(order), per_batch)]


def pass_batches(docs: list[tuple[int, int]], cfg: EvalConfig) -> list[tuple[range, list[list[int]]]]:
    """The pass's plan over `docs` (all ranks): each segment (see segments) with its batches (see segment_batches)."""
    return [(segment, segment_batches(docs, segment, cfg.ttt_lora_docs))
            for segment in segments(len(docs), cfg.ttt_phase_docs, cfg.ttt_phases)]


def batch_rows(batch: list[tuple[int, int]], docs_per_batch: int) -> list[tuple[int, int]]:
    """The rows of a batch (start, number of targets): its documents, and a padding row with no target beside a lone
    document where a batch may hold two (a row count of one would take compiled graphs of its own)."""
    return batch + [(0, 0)] * (min(2, docs_per_batch) - len(batch))


def window_length(chunk: int, chunk_len: int, context: int) -> int:
    """Positions of chunk `chunk`'s window: every target through the chunk's end, at most `context` of them."""
    return min((chunk + 1) * chunk_len, context)


def chunk_rows(lengths: list[int], chunk: int, chunk_len: int) -> int:
    """The rows chunk `chunk`'s pass computes, of rows whose documents hold `lengths` targets, longest first: those
    with targets from the chunk on (a prefix), never fewer than two where there are two."""
    return max(sum(1 for n in lengths if n > chunk * chunk_len), min(2, len(lengths)))


def chunk_shapes(lengths: list[int], chunk_len: int, context: int) -> Iterator[tuple[int, int, int]]:
    """(chunk, rows, window length) of each chunk of a batch whose rows hold `lengths` targets, longest first: the one
    schedule the pass runs and chunk_work counts."""
    for c in range(math.ceil(lengths[0] / chunk_len)):
        yield c, chunk_rows(lengths, c, chunk_len), window_length(c, chunk_len, context)


def chunk_work(tokens: np.ndarray, cfg: EvalConfig) -> tuple[int, int]:
    """(chunk steps, window positions) of the pass over `tokens` on one rank: the steps it runs (each one adapter
    step of its batch, whose kernels are launched from the host one by one unless compiled into fewer) and the
    positions they compute (rows × window length, summed), which grow with the documents' lengths, not with their
    number of tokens alone. A pass bound by the device's work takes time in proportion to the positions; one bound
    by the host's launches, in proportion to the steps."""
    docs, steps, positions = split_documents(tokens), 0, 0
    for _, batches in pass_batches(docs, cfg):
        for batch in batches:
            lengths = [n for _, n in batch_rows([docs[d] for d in batch], cfg.ttt_lora_docs)]
            for _, rows, width in chunk_shapes(lengths, cfg.ttt_lora_chunk, cfg.context):
                steps, positions = steps + 1, positions + rows * width
    return steps, positions


def trained_targets(chunk: int, n_targets: torch.Tensor, chunk_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The document-relative targets [first, stop) that chunk `chunk`'s adapter step trains on, per document: the
    chunk's own where the document has a later chunk, none at its last chunk (scored, never trained on)."""
    first = torch.full_like(n_targets, chunk * chunk_len)
    return first, torch.where(n_targets > (chunk + 1) * chunk_len, first + chunk_len, first)


class LoRA(nn.Module):
    """Low-rank adapters of a batch of documents reading one input x [docs, T, d_in]: for document b and output
    block i, (x A_i[b]^T) B_i[b]^T, the blocks concatenated. The A_i are stacked so that one product reads x."""

    def __init__(self, d_in: int, outs: tuple[int, ...], rank: int, docs: int, gen: torch.Generator,
                 device: torch.device):
        super().__init__()
        bound = d_in ** -0.5  # the records' uniform(-1/sqrt(d_in), 1/sqrt(d_in)) init of A
        self.register_buffer("a_init", ((torch.rand(len(outs) * rank, d_in, generator=gen) * 2 - 1) * bound).to(device))
        self.a = nn.Parameter(self.a_init.expand(docs, -1, -1).clone())
        self.b = nn.ParameterList(nn.Parameter(torch.zeros(docs, d_out, rank, device=device)) for d_out in outs)
        self.rank = rank

    @torch.no_grad()
    def reset(self) -> None:
        self.a.copy_(self.a_init)
        for b in self.b:
            b.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x holds the batch's first x.shape[0] documents (the rows a chunk still scores)."""
        rows = x.shape[0]
        h = (x @ self.a[:rows].transpose(1, 2)).split(self.rank, dim=-1)
        return torch.cat([part @ b[:rows].transpose(1, 2) for part, b in zip(h, self.b)], dim=-1)


class Adapters(nn.Module):
    """The adapters of every site of `model` for a batch of `docs` documents: (module, LoRA added to its output)."""

    def __init__(self, model: nn.Module, rank: int, docs: int, device: torch.device):
        super().__init__()
        cfg, gen = model.cfg, torch.Generator().manual_seed(A_SEED)
        self.sites, loras = [], []
        for module in model.modules():
            if isinstance(module, Attention):
                pairs = [(module.qkv, (cfg.d_model, cfg.kv_dim, cfg.kv_dim)), (module.proj, (cfg.d_model,))]
            elif isinstance(module, MLP):
                pairs = [(module, (cfg.d_model,))]
            else:
                continue
            for site, outs in pairs:
                loras.append(LoRA(cfg.d_model, outs, rank, docs, gen, device))
                self.sites.append((site, loras[-1]))
        self.loras = nn.ModuleList(loras)
        self.head = LoRA(cfg.d_model, (cfg.vocab_size,), rank, docs, gen, device)

    def reset(self) -> None:
        for lora in (*self.loras, self.head):
            lora.reset()


@contextmanager
def adapted(model: nn.Module, adapters: Adapters):
    """The model with each adapter's output added to its site's (forward hooks, removed on exit)."""
    handles = [site.register_forward_hook(lambda _, args, out, lora=lora: out + lora(args[0]))
               for site, lora in adapters.sites]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def adapted_nll(model: nn.Module, head: LoRA, x: torch.Tensor, y: torch.Tensor, tail: int) -> torch.Tensor:
    """Per-token NLL in nats [docs, tail] (fp32) of the last `tail` positions: GPT.token_nll with `head`'s output
    added to the logits before the softcap (the other adapters act through their hooks). The whole window runs
    through the blocks, as its earlier positions are the tail's context; the head, whose logits are vocabulary-wide,
    reads the tail alone. One call per chunk, of one of a few shapes: the function eval.compile wraps."""
    # a gather, not a slice: a slice is a view, contiguous only when the window is the tail, and the layers below
    # branch on that (with the length symbolic, a graph each); the gathered copy is always contiguous
    last = torch.arange(x.shape[1] - tail, x.shape[1], device=x.device)
    h = model.final_norm(model.hidden(x).index_select(1, last))
    y = y.index_select(1, last)
    logits = (F.linear(h, model.embed.weight.to(h.dtype)) + head(h)).float()
    cap = model.cfg.logit_softcap
    logits = cap * torch.tanh(logits / cap) if cap > 0 else logits
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view_as(y)


def score_documents(model: nn.Module, adapters: Adapters, batch: list[tuple[int, int]], all_tokens: torch.Tensor,
                    all_bytes: torch.Tensor, cfg: EvalConfig, *, amp, before_batch: Callable[[], None] | None,
                    nll_fn: Callable) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Score the documents of `batch` (start, number of targets; longest first, at most cfg.ttt_lora_docs) chunk by
    chunk, each chunk before the adapter step that trains on it, with nll_fn (adapted_nll, or its compiled wrapper).
    Yields (target index, NLL in nats as float64, bytes, scored) [rows, T] per chunk, `scored` marking the targets
    the chunk scores. Tensors live on all_tokens' device."""
    device, chunk_len, window = all_tokens.device, cfg.ttt_lora_chunk, cfg.context
    if any(a[1] < b[1] for a, b in zip(batch, batch[1:])):
        raise ValueError("score_documents: the batch's documents must come longest first")
    rows = batch_rows(batch, cfg.ttt_lora_docs)
    lengths = [n for _, n in rows]
    starts, n_targets = torch.tensor(rows, dtype=torch.int64).T
    # One copy to the device a batch: every chunk's [docs] and [docs, T] numbers are made there (a copy from
    # pageable memory would wait for the device at every chunk); the host keeps its own for the guard.
    starts_d, n_targets_d = starts.to(device), n_targets.to(device)
    adapters.reset()
    optimizer = torch.optim.AdamW(adapters.parameters(), lr=cfg.ttt_lora_lr, betas=ADAM_BETAS, eps=ADAM_EPS,
                                  weight_decay=cfg.ttt_lora_wd, fused=device.type == "cuda")
    scored_to = torch.zeros_like(n_targets)  # targets of each document scored so far
    for c, active, width in chunk_shapes(lengths, chunk_len, window):
        if before_batch is not None:
            before_batch()
        end = n_targets_d[:active].clamp(max=(c + 1) * chunk_len)  # past the chunk's last target; <= c·chunk_len: done
        low = (end - window).clamp(min=0)  # the window's first input, document-relative
        pos = torch.arange(width, device=device)
        inputs = (starts_d[:active] + low)[:, None] + pos  # absolute index of each input; its target is the next token
        valid = pos < (end - low)[:, None]
        inputs = torch.where(valid, inputs, 0)
        x, y = torch.where(valid, all_tokens[inputs], 0), torch.where(valid, all_tokens[inputs + 1], 0)
        # the chunk's targets are the window's last chunk_len positions at most (it ends at the chunk's last target,
        # and holds at least chunk_len positions): the head scores those alone
        inputs, valid, relative = inputs[:, -chunk_len:], valid[:, -chunk_len:], (low[:, None] + pos)[:, -chunk_len:]
        scored = valid & (relative >= c * chunk_len)
        first, stop = trained_targets(c, n_targets, chunk_len)
        training = bool((stop > first).any())
        # with the gradient on at a batch's last chunk too, which trains on nothing: compiled, a chunk without it
        # takes a graph of its own, whose compilation costs more than the few activations kept for nothing
        with torch.enable_grad(), amp:
            nll = nll_fn(model, adapters.head, x, y, chunk_len)
        yield inputs + 1, nll.detach().double(), all_bytes[inputs], scored
        scored_to = torch.maximum(scored_to, n_targets.clamp(max=(c + 1) * chunk_len))
        if not training:
            continue
        late = (stop > first) & (stop > scored_to)
        if late.any():  # the construction above makes this impossible
            d = int(late.nonzero()[0])
            raise RuntimeError(f"test-time training would train the adapters on target {int(starts[d] + stop[d])} of "
                               f"the document at {int(starts[d])}, scored only through {int(starts[d] + scored_to[d])}")
        first_d, stop_d = trained_targets(c, n_targets_d[:active], chunk_len)
        trained = (relative >= first_d[:, None]) & (relative < stop_d[:, None]) & valid
        optimizer.zero_grad(set_to_none=True)
        (torch.where(trained, nll, 0).sum() / chunk_len).backward()  # the sum of the documents' chunk means
        optimizer.step()


def train_on_scored(model: nn.Module, all_tokens: torch.Tensor, through: int, scored_through: int, cfg: EvalConfig,
                    *, amp, rank: int, world_size: int, before_batch: Callable[[], None] | None) -> None:
    """One phase: the model's weights train on targets 1..through (all_tokens on the model's device), which must all
    be scored."""
    if through > scored_through:  # the construction of the phases makes this impossible
        raise RuntimeError(f"a phase of test-time training would train on target {through}, scored only through "
                           f"{scored_through}")
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=cfg.ttt_phase_lr,
                                momentum=cfg.ttt_momentum)
    n_chunks = math.ceil(through / cfg.ttt_chunk_tokens)
    for c in range(n_chunks - 1):  # the records leave the last chunk out, as chunk_sgd's last is never trained on
        for group in optimizer.param_groups:
            group["lr"] = cosine_lr(cfg.ttt_phase_lr, c, n_chunks)
        train_on_chunk(model, optimizer, all_tokens, training_starts(c, through, cfg.ttt_chunk_tokens, cfg.context),
                       seq_len=cfg.context, epochs=cfg.ttt_phase_epochs, batch_seqs=cfg.ttt_batch_seqs,
                       amp=amp, rank=rank, world_size=world_size, before_batch=before_batch, compile=cfg.compile)


def doc_lora_scores(model: nn.Module, tokens: np.ndarray, lut: ByteLUT, cfg: EvalConfig, *, device: torch.device,
                    autocast_dtype: torch.dtype | None = None, rank: int = 0, world_size: int = 1,
                    progress: Callable[[str], None] | None = None, before_batch: Callable[[], None] | None = None,
                    phase_seconds: list[float] | None = None
                    ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The pass, as score_documents' (target index, NLL, bytes, scored) of each chunk this rank scores; the phases
    train `model` in between, and it gets its own weights back at the end. The caller sums the scored entries.
    phase_seconds, where given, gets each phase's wall clock (the device's work included)."""
    docs = split_documents(tokens)
    all_tokens, all_bytes = device_tokens(tokens, lut, device)
    amp = torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype else nullcontext()
    trainable = [p for p in model.parameters() if p.requires_grad]
    saved = {name: t.detach().clone() for name, t in model.state_dict().items()}
    was_training = model.training
    model.eval()  # train_on_chunk leaves it so after each phase too
    adapters = Adapters(model, cfg.ttt_lora_rank, cfg.ttt_lora_docs, device)
    # eval.compile: the ~context/ttt_lora_chunk window lengths and the chunks' row counts share one graph, both sizes
    # symbolic, with the adapters' gradient (see score_documents)
    nll_fn = compiled(adapted_nll, cfg.compile, dynamic=True)
    plan = [(segment, batches[rank::world_size]) for segment, batches in pass_batches(docs, cfg)]
    mine, done, scored_through = sum(len(b) for _, bs in plan for b in bs), 0, 0
    t0 = last_said = time.perf_counter()
    try:
        for k, (segment, batches) in enumerate(plan):
            for p in trainable:
                p.requires_grad_(False)  # the adapters alone train within a segment
            with adapted(model, adapters):
                for batch in batches:
                    yield from score_documents(model, adapters, [docs[d] for d in batch], all_tokens, all_bytes, cfg,
                                               amp=amp, before_batch=before_batch, nll_fn=nll_fn)
                    done += len(batch)
                    if progress is not None and time.perf_counter() - last_said >= PROGRESS_EVERY_S:
                        last_said, elapsed = time.perf_counter(), time.perf_counter() - t0
                        progress(f"document-LoRA test-time training: {done:,} of {mine:,} documents in {elapsed:.0f} "
                                 f"s, about {elapsed * (mine - done) / done:.0f} s left")
            # every document of the segment is scored (each by one rank): the stream through its last one is
            scored_through = max([scored_through] + [docs[d][0] + docs[d][1] for d in segment])
            if k < len(plan) - 1:
                for p in trainable:
                    p.requires_grad_(True)
                started = device_clock(device)
                train_on_scored(model, all_tokens, phase_end(docs, segment), scored_through, cfg, amp=amp, rank=rank,
                                world_size=world_size, before_batch=before_batch)
                if phase_seconds is not None:
                    phase_seconds.append(device_clock(device) - started)
    finally:
        model.load_state_dict(saved)
        for p in trainable:
            p.requires_grad_(True)
        model.train(was_training)


def device_clock(device: torch.device) -> float:
    """The host's clock once the device has finished what it was given: a phase's time is then its own work's, not
    the scoring's queued before it. Once a phase, so the wait costs nothing that matters."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def evaluate_bpb_doc_lora(model: nn.Module, tokens: np.ndarray, lut: ByteLUT, cfg: EvalConfig, *,
                          device: torch.device, autocast_dtype: torch.dtype | None = None, rank: int = 0,
                          world_size: int = 1, progress: Callable[[str], None] | None = None,
                          before_batch: Callable[[], None] | None = None) -> dict:
    """val_loss, val_bpb, tokens, bytes of the document-LoRA pass (see doc_lora_scores), as evaluate_bpb reports
    them, and phase_time_s: the seconds of its phases of global SGD. Summed on the device, without a host read per
    chunk."""
    nll_sum = torch.zeros((), dtype=torch.float64, device=device)
    n_scored = torch.zeros((), dtype=torch.int64, device=device)
    n_bytes = torch.zeros((), dtype=torch.int64, device=device)
    phase_seconds: list[float] = []
    for _, nll, byte_counts, scored in doc_lora_scores(model, tokens, lut, cfg, device=device,
                                                       autocast_dtype=autocast_dtype, rank=rank,
                                                       world_size=world_size, progress=progress,
                                                       before_batch=before_batch, phase_seconds=phase_seconds):
        nll_sum += torch.where(scored, nll, 0).sum()
        n_scored += scored.sum()
        n_bytes += torch.where(scored, byte_counts, 0).sum()
    return {**bpb_totals(nll_sum, n_scored, n_bytes, len(tokens), world_size),
            "phase_time_s": round(sum(phase_seconds), 3)}
