"""Attention within documents (model.doc_attention): a token attends to the earlier tokens of its own document only.

Training sequences are cut from a stream of documents, each starting with BOS (id 1), so a 2,048-token sequence
holds two or three of them; plain causal attention lets every token read the documents before its own, which share
nothing with it. Masking them out changes what the model computes (and so scoring: the artifact records the
option, and every path that runs the model, evaluation and test-time training included, applies it), and it saves
work: the attention kernel skips every 128×128 tile that holds no pair of one document. The parameter-golf
records do this with FlashAttention's variable-length kernel (https://github.com/openai/parameter-golf/pull/1530);
here it is FlexAttention (https://pytorch.org/blog/flexattention/) with a block mask built from the BOS positions.

`document_mask(idx)` builds the mask once per forward (every layer shares it); `doc_causal_attention` runs it. Inside
a compiled model on a GPU (training's step) that is FlexAttention, fused into one Triton kernel that skips the tiles.
Everywhere else it is the reference, SDPA with the dense mask: uncompiled, FlexAttention would either run unfused or
compile a kernel for each new batch shape, and calibration, which runs uncompiled inside the training budget, cannot
wait for that; on a CPU FlexAttention has no backward at all.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from model.features import BOS_ID

BLOCK = 128  # FlexAttention's tile: the unit in which cross-document work is skipped


def document_ids(idx: torch.Tensor, bos_id: int = BOS_ID) -> torch.Tensor:
    """int32 [B, T]: the index of the document each token belongs to within its row (a row's tokens before its
    first BOS are document 0, the rest of a document cut off at the row's start)."""
    return (idx == bos_id).cumsum(dim=1, dtype=torch.int32)


class DocumentMask(NamedTuple):
    blocks: BlockMask | None          # FlexAttention's tiles when compiling for a GPU, else None
    dense: torch.Tensor | None        # bool [B, 1, T, T]: the pairs the reference may attend, where it runs


def document_mask(idx: torch.Tensor, bos_id: int = BOS_ID) -> DocumentMask:
    """The mask of one forward, built once for every layer: the tiles inside a compiled model on a GPU, else the
    dense mask."""
    docs = document_ids(idx, bos_id)
    if idx.is_cuda and torch.compiler.is_compiling():
        return DocumentMask(doc_block_mask(docs), None)
    return DocumentMask(None, dense_doc_mask(docs))


def dense_doc_mask(docs: torch.Tensor) -> torch.Tensor:
    """bool [B, 1, T, T]: query t may attend key s where s <= t and both lie in one document."""
    T = docs.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=docs.device).tril()
    return (docs[:, None, :, None] == docs[:, None, None, :]) & causal


def _indices(allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(count, indices) per query tile of the key tiles where `allowed` [B, 1, Q, K] is True, lowest first."""
    count = allowed.sum(dim=-1, dtype=torch.int32)
    order = torch.argsort(allowed.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return count, order


def doc_block_mask(docs: torch.Tensor, block: int = BLOCK) -> BlockMask:
    """The FlexAttention block mask of causal attention within documents, for document ids docs [B, T].

    Document ids never decrease along a row, so a tile's documents are the range between its first and last token's.
    A key tile left of the diagonal can hold a pair of one document only if its last document is the query tile's
    first; it needs no per-pair mask if both tiles hold that one document alone. The diagonal tiles are always
    partial (causal within the tile)."""
    B, T = docs.shape
    n = -(-T // block)
    # pad to whole tiles with a document no query shares: the mask reads only in-range pairs, the tile ends stay right
    padded = torch.cat([docs, docs.new_full((B, n * block - T), -1)], dim=1) if n * block != T else docs
    first = padded[:, ::block]
    last = torch.cat([padded[:, block - 1::block][:, :n - 1], docs[:, -1:]], dim=1)  # the last tile ends at T - 1
    q_first, q_last = first[:, :, None], last[:, :, None]   # [B, n, 1]: query tile i
    k_first, k_last = first[:, None, :], last[:, None, :]   # [B, 1, n]: key tile j
    i = torch.arange(n, device=docs.device)
    below = (i[None, :] < i[:, None])[None]                 # key tile j strictly left of query tile i
    diagonal = torch.eye(n, dtype=torch.bool, device=docs.device)[None]
    shared = below & (k_last == q_first)
    full = shared & (k_first == k_last) & (q_first == q_last)
    partial = (shared & ~full) | diagonal
    kv_num, kv_idx = _indices(partial[:, None])
    full_num, full_idx = _indices(full[:, None])

    def same_document_causal(b, h, q, kv):
        return (q >= kv) & (padded[b, q] == padded[b, kv])

    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block,
                                    mask_mod=same_document_causal, seq_lengths=(T, T))


def doc_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: DocumentMask) -> torch.Tensor:
    """Causal GQA attention within documents: q [B, H, T, D], k/v [B, H_kv, T, D] -> [B, H, T, D]."""
    if mask.blocks is None:
        return doc_causal_reference(q, k, v, mask.dense)
    # FlexAttention is no autocast op (SDPA is): under autocast q and k may leave their norm in another dtype than v.
    # Contiguous inputs: q and k arrive as normed transposed views, a layout Inductor's FlexAttention lowering has
    # mishandled on a CPU (torch 2.13); a copy is cheap beside the attention.
    q, k, v = q.to(v.dtype).contiguous(), k.to(v.dtype).contiguous(), v.contiguous()
    return flex_attention(q, k, v, block_mask=mask.blocks, enable_gqa=k.shape[1] != q.shape[1])


def doc_causal_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """The same through SDPA with the dense mask `allowed` (dense_doc_mask): every pair computed, then masked. The KV
    heads are repeated for the query heads that read them (head h reads KV head h // (H / H_kv), as enable_gqa does):
    with a mask, SDPA's GQA would fall back to its unfused math kernel on a GPU."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
