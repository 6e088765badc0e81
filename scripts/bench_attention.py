"""Kernels for causal attention within documents (model.doc_attention), timed at a config's shapes on a CUDA GPU:

    python -m scripts.bench_attention --config configs/h100_sp8192_recur.toml [--tokens train | --doc-tokens 640]
        [--impls sdpa-causal,flex,varlen,varlen-cudnn] [--rep-ms 200] [--check-rows 4] [section.key=value ...]

One attention call of the model: train.micro_batch_seqs rows of data.seq_len tokens, model.n_heads query heads reading
model.n_kv_heads key/value heads of d_model / n_heads, bf16; forward, and forward with backward. The documents are those
of the first batch the training loader gives (--tokens train, from data.train_files) or random ones of mean length N
(--doc-tokens N). Every implementation but sdpa-causal is first checked against the dense reference (SDPA with the
dense mask, in fp32) on the first --check-rows rows: the largest error of the output and of each input's gradient,
as a fraction of that tensor's largest reference entry.

    sdpa-causal   SDPA, causal over the whole row: what model.doc_attention=false runs without FlashAttention 3
                  installed, every causal pair (another mask, so not checked)
    flex          FlexAttention on the block mask, compiled, through model.doc_attention (its copies included): what
                  model.doc_attention=true runs in a compiled model
    varlen        torch.nn.attention.varlen.varlen_attn on the rows' documents as one packed stream: the
                  variable-length form of FlashAttention (torch ships FlashAttention 2's kernels; the parameter-golf
                  records call FlashAttention 3's)
    varlen-cudnn  the same op routed to cuDNN's ragged kernels (torch's own choice is FlashAttention's)

The inputs are laid out as the model makes them, [B, T, heads, D] seen as [B, heads, T, D], so packing the rows into
one stream costs no copy. Where this torch's varlen_attn takes no GQA (or on the cuDNN route, which refuses it) the
key/value heads are repeated for the query heads, a cost a model would pay too; the table marks those rows.

The layout line says how much of the causal work the documents leave: the 128×128 tiles the block mask visits, and
the pairs of one document.
"""
from __future__ import annotations

import argparse
import inspect
import sys
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F

from model.doc_attention import (BLOCK, DocumentMask, dense_doc_mask, doc_block_mask, doc_causal_attention,
                                  doc_causal_reference, document_ids)
from model.features import BOS_ID
from training.bench_batches import RandomTokens, TrainTokens
from training.bench_timing import bench_ms
from training.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[1]
IMPLS = ("sdpa-causal", "flex", "varlen", "varlen-cudnn")


def layout_stats(docs: torch.Tensor) -> dict:
    """Of the causal work on rows with document ids `docs` [B, T]: the tiles the block mask visits (partial ones
    masked per pair) and the pairs within one document."""
    B, T = docs.shape
    mask = doc_block_mask(docs)
    partial, full = int(mask.kv_num_blocks.sum()), int(mask.full_kv_num_blocks.sum())
    n = -(-T // BLOCK)
    pairs = sum(int(dense_doc_mask(docs[b:b + 1]).sum()) for b in range(B))  # a row at a time: T×T bools
    return {"rows": B, "docs_per_row": float((docs.diff(dim=1) != 0).sum(dim=1).float().mean() + 1),
            "tiles": partial + full, "partial_tiles": partial, "causal_tiles": B * n * (n + 1) // 2,
            "pair_frac": pairs / (B * T * (T + 1) / 2)}


def packed_documents(docs: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The rows as one stream of sequences for a variable-length kernel: int32 offsets [N + 1] where each document
    (or a row's part of one) starts, ending at B*T, and the longest one's length."""
    B, T = docs.shape
    starts = torch.ones_like(docs, dtype=torch.bool)
    starts[:, 1:] = docs[:, 1:] != docs[:, :-1]
    offsets = torch.cat([starts.flatten().nonzero().flatten(), torch.tensor([B * T], device=docs.device)])
    return offsets.to(torch.int32), int(offsets.diff().max())


def varlen_caller(fn, heads: int, kv_heads: int, cudnn: bool = False):
    """(call(q, k, v, offsets, max_len) on packed q [N, H, D], k/v [N, H_kv, D], causal within each sequence; whether
    it repeats the key/value heads). varlen_attn's signature changed between torch releases: causality is
    `window_size=(-1, 0)` where it has that argument, `is_causal=True` before, and GQA needs `enable_gqa`. The cuDNN
    route (cudnn=True: fn is the private op, positional up to is_causal in every release that has it) takes causality
    as is_causal only and no GQA."""
    params = {} if cudnn else inspect.signature(fn).parameters
    repeat = kv_heads != heads and (cudnn or "enable_gqa" not in params)
    kwargs = {} if cudnn else {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if kv_heads != heads and not repeat:
        kwargs["enable_gqa"] = True
    group = heads // kv_heads

    def call(q, k, v, offsets, max_len):
        if repeat:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        if cudnn:
            return fn(q, k, v, offsets, offsets, max_len, max_len, True)[0]  # (output, log-sum-exp, rng state)
        return fn(q, k, v, offsets, offsets, max_len, max_len, **kwargs)
    return call, repeat


def make_impl(name: str, docs: torch.Tensor, heads: int, kv_heads: int):
    """(attention(q, k, v) for q [B, H, T, D], k/v [B, H_kv, T, D] -> [B, H, T, D], causal within the documents
    `docs` [B, T] (sdpa-causal: within the row); whether it repeats the key/value heads)."""
    if name == "sdpa-causal":
        def sdpa(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
        return sdpa, False
    if name == "flex":
        # dynamic=False: the checked rows and the timed ones are two shapes, each its own kernel as in training
        flex, mask = torch.compile(doc_causal_attention, dynamic=False), DocumentMask(doc_block_mask(docs), None)
        return (lambda q, k, v: flex(q, k, v, mask)), False
    try:
        import torch.nn.attention.varlen as varlen
    except ImportError as e:
        raise RuntimeError(f"{name}: this torch ({torch.__version__}) has no torch.nn.attention.varlen (from 2.10)") from e
    cudnn = name == "varlen-cudnn"
    call, repeat = varlen_caller(varlen._varlen_attn if cudnn else varlen.varlen_attn, heads, kv_heads, cudnn)
    offsets, max_len = packed_documents(docs)
    B, T = docs.shape

    def attention(q, k, v):
        pack = lambda t: t.transpose(1, 2).reshape(B * T, t.shape[1], t.shape[3])  # noqa: E731 (a view of [B, T, h, D])
        out = call(pack(q), pack(k), pack(v), offsets, max_len)
        return out.reshape(B, T, q.shape[1], q.shape[3]).transpose(1, 2)
    return attention, repeat


@contextmanager
def route(name: str):
    """varlen-cudnn: varlen_attn's choice of backend answers cuDNN while inside (its forward and its backward both
    ask it, and the two must agree); torch's own answer is FlashAttention. Other implementations: nothing changes."""
    if name != "varlen-cudnn":
        yield
        return
    import torch.nn.attention.varlen as varlen
    if not hasattr(varlen, "_should_use_cudnn"):
        raise RuntimeError(f"{name}: this torch ({torch.__version__}) has no cuDNN route in varlen_attn")
    chosen = varlen._should_use_cudnn
    varlen._should_use_cudnn = lambda device_index: True
    try:
        yield
    finally:
        varlen._should_use_cudnn = chosen


def random_qkv(B, H, H_kv, T, D, device, dtype=torch.bfloat16, seed=0) -> list[torch.Tensor]:
    """q, k, v as the model lays them out: leaves [B, T, heads, D], each read as [B, heads, T, D] (see heads())."""
    g = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(B, T, h, D, device=device, dtype=dtype, generator=g).requires_grad_() for h in (H, H_kv, H_kv)]


def heads(leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.transpose(1, 2) for t in leaves]


def check(attention, docs: torch.Tensor, qkv: list[torch.Tensor]) -> float:
    """The largest error of the output and of the three gradients against the dense fp32 reference, each as a fraction
    of the reference's largest entry."""
    ref_in = [t.detach().float().requires_grad_() for t in qkv]
    ref = doc_causal_reference(*heads(ref_in), dense_doc_mask(docs))
    grad = torch.randn_like(ref)
    ref.backward(grad)
    got = attention(*heads(qkv))
    got.backward(grad.to(got.dtype))
    pairs = [(got, ref)] + [(t.grad, r.grad) for t, r in zip(qkv, ref_in)]
    return max(float((a.float() - b).abs().max() / b.abs().max().clamp_min(1e-12)) for a, b in pairs)


def time_impl(attention, qkv: list[torch.Tensor], rep_ms: int) -> tuple[float, float]:
    """(forward ms, forward+backward ms) of one call, median."""
    grad = torch.randn_like(qkv[0]).transpose(1, 2)

    def both():
        for t in qkv:
            t.grad = None
        attention(*heads(qkv)).backward(grad)
    both()  # a compiled implementation compiles here, not inside the timing's own estimate
    torch.cuda.synchronize()
    with torch.no_grad():
        forward = bench_ms(lambda: attention(*heads(qkv)), rep_ms)
    return forward, bench_ms(both, rep_ms)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(REPO / "configs/h100_sp8192_recur.toml"))
    p.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated, from {list(IMPLS)}")
    p.add_argument("--tokens", choices=("random", "train"), default="random",
                   help="train: the documents of the first batch the training loader gives from data.train_files; "
                        "random: documents of mean length --doc-tokens")
    p.add_argument("--doc-tokens", type=int, default=640, metavar="N",
                   help="mean document length of the random rows (a BOS at each position with probability 1/N)")
    p.add_argument("--rep-ms", type=int, default=200, help="milliseconds of repetitions per timing")
    p.add_argument("--check-rows", type=int, default=4, help="rows checked against the dense fp32 reference")
    p.add_argument("overrides", nargs="*", help="section.key=value applied to the config")
    a = p.parse_args(argv)
    names = a.impls.split(",")
    if unknown := [n for n in names if n not in IMPLS]:
        p.error(f"--impls: unknown {unknown}; choose from {list(IMPLS)}")
    if a.doc_tokens < 2 or a.rep_ms < 1 or a.check_rows < 1:
        p.error(f"need --doc-tokens >= 2, --rep-ms >= 1 and --check-rows >= 1, got {a.doc_tokens}, {a.rep_ms} "
                f"and {a.check_rows}")
    try:
        cfg = load_config(a.config, a.overrides)
    except ConfigError as e:
        p.error(str(e))
    m = cfg.model  # the config's own checks hold the heads' shapes (d_model / n_heads, n_heads / n_kv_heads)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU: the kernels compared here run only there (the dense reference is what a CPU runs)")
    try:
        idx = (TrainTokens(cfg, torch.device("cpu")).x if a.tokens == "train" else
               RandomTokens(cfg.train.micro_batch_seqs, cfg.data.seq_len, m.vocab_size, torch.device("cpu"),
                            doc_tokens=a.doc_tokens).x[:, :-1])
    except (OSError, ValueError) as e:
        p.error(f"--tokens train: data.train_files: {e}")
    docs = document_ids(idx, BOS_ID).cuda()
    s = layout_stats(docs)
    print(f"layout: {s['rows']} rows of {docs.shape[1]} tokens, {s['docs_per_row']:.2f} documents a row; the block "
          f"mask visits {s['tiles']:,} of {s['causal_tiles']:,} causal {BLOCK}x{BLOCK} tiles "
          f"({s['tiles'] / s['causal_tiles']:.1%}, {s['partial_tiles']:,} partial); {s['pair_frac']:.1%} of the causal "
          f"pairs lie within one document")
    dims = (m.n_heads, m.n_kv_heads, docs.shape[1], m.d_model // m.n_heads)
    rows = []
    print("| implementation | forward ms | forward+backward ms | against sdpa-causal | largest error |")
    print("|---|---|---|---|---|")
    for name in names:
        try:
            with route(name):
                err = None
                if name != "sdpa-causal":
                    few = docs[:a.check_rows]
                    attention, _ = make_impl(name, few, m.n_heads, m.n_kv_heads)
                    err = check(attention, few, random_qkv(len(few), *dims, "cuda"))
                attention, repeat = make_impl(name, docs, m.n_heads, m.n_kv_heads)
                fwd, both = time_impl(attention, random_qkv(len(docs), *dims, "cuda"), a.rep_ms)
        except Exception as e:  # one implementation's failure (absent in this torch, refused by a kernel) is a row
            first = (str(e).splitlines() or [""])[0][:160]
            print(f"| {name} | failed: {type(e).__name__}: {first} | | | |", flush=True)
            rows.append({"impl": name, "error": f"{type(e).__name__}: {e}"})
            continue
        rows.append({"impl": name, "forward_ms": fwd, "both_ms": both, "max_error": err, "kv_repeated": repeat})
        base = next((r["both_ms"] for r in rows if r["impl"] == "sdpa-causal" and "both_ms" in r), None)
        ratio = f"{both / base:.2f}x" if base else "—"
        label = f"{name} (key/value heads repeated)" if repeat else name
        print(f"| {label} | {fwd:.3f} | {both:.3f} | {ratio} | {'—' if err is None else f'{err:.2e}'} |", flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(0 if any("both_ms" in r for r in main()) else 1)
