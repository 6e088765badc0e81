"""model/doc_attention.py: attention within documents, its FlexAttention tiles against the dense reference, and the
model under model.doc_attention scoring each document without the ones before it."""
import shutil

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

from model.config import ModelConfig
from model import doc_attention
from model.doc_attention import (BLOCK, dense_doc_mask, doc_block_mask, doc_causal_attention, doc_causal_reference,
                                 document_ids, document_mask)
from model.features import BOS_ID
from model.gpt import GPT
from tests.test_model import randomize_


def ids_with_documents(rows: int, T: int, vocab: int = 64, seed: int = 0, docs_per_row: int = 4) -> torch.Tensor:
    """Token ids [rows, T] with BOS at random places (and at 0 in every other row), never a BOS elsewhere."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(BOS_ID + 1, vocab, (rows, T), generator=g)
    for r in range(rows):
        starts = torch.randperm(T, generator=g)[:docs_per_row]
        idx[r, starts] = BOS_ID
        if r % 2 == 0:
            idx[r, 0] = BOS_ID
    return idx


def qkv(B: int, T: int, H: int = 4, H_kv: int = 2, D: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, T, D, generator=g), torch.randn(B, H_kv, T, D, generator=g),
            torch.randn(B, H_kv, T, D, generator=g))


def test_document_ids_count_the_bos_tokens_so_far():
    idx = torch.tensor([[5, 1, 7, 7, 1, 1, 9], [1, 3, 3, 3, 3, 1, 2]])
    assert document_ids(idx).tolist() == [[0, 1, 1, 1, 2, 3, 3], [1, 1, 1, 1, 1, 2, 2]]


def test_the_reference_is_causal_attention_run_on_each_document_alone():
    idx = ids_with_documents(2, 50)
    q, k, v = qkv(2, 50)
    out = doc_causal_reference(q, k, v, dense_doc_mask(document_ids(idx)))
    for b in range(2):
        cuts = [0, *(t for t in range(1, 50) if idx[b, t] == BOS_ID), 50]
        for lo, hi in zip(cuts, cuts[1:]):
            alone = F.scaled_dot_product_attention(q[b:b + 1, :, lo:hi], k[b:b + 1, :, lo:hi], v[b:b + 1, :, lo:hi],
                                                   is_causal=True, enable_gqa=True)
            torch.testing.assert_close(out[b:b + 1, :, lo:hi], alone, atol=1e-5, rtol=1e-5)


def _tiles(counts: torch.Tensor, indices: torch.Tensor) -> set[tuple[int, int, int]]:
    """(row, query tile, key tile) of every tile a BlockMask lists."""
    return {(b, i, int(indices[b, 0, i, j])) for b in range(counts.shape[0]) for i in range(counts.shape[2])
            for j in range(int(counts[b, 0, i]))}


@pytest.mark.parametrize("T,block,docs", [(300, 128, 3), (512, 128, 2), (77, 16, 5), (64, 16, 1), (40, 16, 0)])
def test_the_tiles_hold_every_allowed_pair_and_full_tiles_only_allowed_ones(T, block, docs):
    idx = ids_with_documents(3, T, docs_per_row=docs, seed=T)
    ids = document_ids(idx)
    mask = doc_block_mask(ids, block)
    partial = _tiles(mask.kv_num_blocks, mask.kv_indices)
    full = _tiles(mask.full_kv_num_blocks, mask.full_kv_indices)
    assert not partial & full
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for b in range(3):
        allowed = (ids[b, :, None] == ids[b, None, :]) & causal
        for i in range(-(-T // block)):
            for j in range(-(-T // block)):
                tile = allowed[i * block:(i + 1) * block, j * block:(j + 1) * block]
                if (b, i, j) in full:
                    assert tile.all(), (b, i, j)
                elif (b, i, j) not in partial:
                    assert not tile.any(), (b, i, j)  # a skipped tile has no pair of one document
    n = -(-T // block)
    # the tiles skip work wherever a row holds more than one document; a row of one document needs no per-pair mask
    # left of the diagonal
    assert docs < 2 or len(partial) + len(full) < 3 * sum(range(1, n + 1))
    assert docs > 0 or len(full) == 3 * n * (n - 1) // 2


@pytest.mark.skipif(not any(map(shutil.which, ("g++", "c++", "clang++"))),
                    reason="Inductor compiles FlexAttention for a CPU with a C++ compiler; none is on the PATH")
@pytest.mark.parametrize("T,block", [(300, 128), (77, 16)])
def test_compiled_flex_attention_on_the_tiles_equals_the_reference(T, block):
    """FlexAttention compiled (on a CPU, forward only), which skips the tiles the mask leaves out and applies no
    per-pair mask inside full ones, computes the dense reference: a wrong tile list changes the output. (Uncompiled,
    FlexAttention applies the per-pair mask everywhere and would not notice.)"""
    idx = ids_with_documents(2, T, seed=3)
    q, k, v = qkv(2, T, seed=4)
    ids = document_ids(idx)
    flex = torch.compile(flex_attention, fullgraph=True)
    with torch.no_grad():
        out = flex(q, k, v, block_mask=doc_block_mask(ids, block), enable_gqa=True)
    torch.testing.assert_close(out, doc_causal_reference(q, k, v, dense_doc_mask(ids)), atol=1e-5, rtol=1e-5)


def doc_model(doc_attention: bool, **kw) -> GPT:
    options = dict(vocab_size=64, n_layers=4, d_model=64, n_heads=4, n_kv_heads=2, n_streams=2, mhc_blocks=2,
                   xsa_layers=2, unet_skips=True, smear_gate=True, bigram_buckets=32, bigram_dim=8,
                   value_embed_layers=2, value_embed_dim=8, rope_dims=4, doc_attention=doc_attention)
    cfg = ModelConfig(**{**options, **kw})
    torch.manual_seed(0)
    return randomize_(GPT(cfg)).eval()


@pytest.mark.parametrize("kw", [{}, {"recur_start": 2, "recur_end": 3, "recur_times": 2},
                                {"n_streams": 1, "mhc_blocks": 0}])
def test_a_document_is_scored_without_the_documents_before_it(kw):
    """Under model.doc_attention the logits of a document do not change when the documents before it in the row
    do; with attention across documents they do. Every token-mixing path takes part: attention, SmearGate,
    BigramHash, value embeddings, U-Net skips, mHC streams and depth recurrence."""
    idx = ids_with_documents(1, 48, docs_per_row=0)
    idx[0, 0], idx[0, 20] = BOS_ID, BOS_ID
    other = idx.clone()
    other[0, 1:20] = torch.randint(BOS_ID + 1, 64, (19,), generator=torch.Generator().manual_seed(9))
    for within in (True, False):
        model = doc_model(within, **kw)
        model.recurrence_on = "recur_times" in kw
        with torch.no_grad():
            a, b = model(idx), model(other)
        moved = (a[0, 20:] - b[0, 20:]).abs().max().item()
        assert (moved < 1e-5) if within else (moved > 1e-3), (within, moved)
        assert (a[0, 1:20] - b[0, 1:20]).abs().max().item() > 1e-3  # the changed document's own logits do move


def test_training_through_the_reference_has_gradients():
    model = doc_model(True).train()
    idx = ids_with_documents(2, 33, seed=5)
    loss = model(idx[:, :-1], idx[:, 1:])
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_doc_attention_refuses_another_attention_backend():
    with pytest.raises(ValueError, match="model.doc_attention=true attends through a document mask"):
        ModelConfig(vocab_size=64, n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, doc_attention=True,
                    attention="sdpa").validate()


def test_doc_attention_refuses_heads_narrower_than_flex_attention_takes():
    with pytest.raises(ValueError, match="needs head_dim >= 16 .* got 8"):
        ModelConfig(vocab_size=64, n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, doc_attention=True).validate()
    ModelConfig(vocab_size=64, n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, doc_attention=True).validate()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_compiled_flex_attention_matches_the_reference_forward_and_backward():
    """Compiled on a GPU (as training's step is) the mask is FlexAttention's tiles and its fused kernel runs, bf16,
    forward and backward, near the training shape (a length that leaves the last tile short); uncompiled the
    reference runs."""
    idx = ids_with_documents(2, 2047, vocab=8192, docs_per_row=3, seed=6).cuda()  # a last tile of 127 tokens
    q, k, v = (t.cuda().to(torch.bfloat16).requires_grad_() for t in qkv(2, 2047, H=8, H_kv=4, D=64, seed=7))
    assert document_mask(idx).blocks is None  # eager: the reference

    def attend(q, k, v, idx):
        mask = document_mask(idx)
        assert mask.blocks is not None and mask.blocks.BLOCK_SIZE == (BLOCK, BLOCK)
        return doc_causal_attention(q, k, v, mask)
    out = torch.compile(attend, fullgraph=True)(q, k, v, idx)
    ref_inputs = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref = doc_causal_reference(*ref_inputs, dense_doc_mask(document_ids(idx)))
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    g = torch.randn_like(ref)
    out.backward(g.to(out.dtype))
    ref.backward(g)
    for got, want in zip((q, k, v), ref_inputs):
        torch.testing.assert_close(got.grad.float(), want.grad, atol=5e-2, rtol=5e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_compiled_model_with_doc_attention_matches_the_uncompiled_one(monkeypatch):
    """The training step's path: the whole model compiled (FlexAttention on the tiles, which the trace must reach)
    gives the loss and gradients of the uncompiled model (the reference), with recurrence on, mHC streams, rows of 3
    tiles with the last one short, and one row a single document (so full tiles too). In fp32 they agree closely, so a
    tile the kernel skips or masks wrongly shows. Under bf16 autocast (training's precision, where q and k leave their
    norm in fp32) the gradients' error against the fp32 reference is at most what the uncompiled model's own bf16
    rounding gives them (3x, plus 1%): all of them together, and each of at least 1,024 elements. A smaller one's
    rounding error is a sum of few terms that can cancel by chance, so against it a sound kernel fails at random;
    the fp32 check covers those."""
    traced = []

    def counting_flex(*args, **kwargs):
        traced.append(kwargs["block_mask"])
        return flex_attention(*args, **kwargs)
    monkeypatch.setattr(doc_attention, "flex_attention", counting_flex)
    model = doc_model(True, recur_start=2, recur_end=3, recur_times=2).cuda().train()
    model.recurrence_on = True
    idx = ids_with_documents(4, 301, docs_per_row=3, seed=8)
    assert idx[0, 0] == BOS_ID  # row 0 becomes one document, from its BOS at 0 to the end
    idx[0, 1:] = torch.randint(BOS_ID + 1, 64, (300,), generator=torch.Generator().manual_seed(9))
    idx = idx.cuda()

    def loss_and_grads(run, autocast):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = run(idx[:, :-1], idx[:, 1:])
        loss.backward()
        return loss.detach().float(), [p.grad.detach().float().clone() for p in model.parameters()]
    names = [name for name, _ in model.named_parameters()]
    ref_loss, ref_grads = loss_and_grads(model, False)
    eager_loss, eager_grads = loss_and_grads(model, True)
    assert not traced  # uncompiled: the reference
    compiled = torch.compile(model)
    loss, grads = loss_and_grads(compiled, False)
    assert traced  # compiled: FlexAttention
    torch.testing.assert_close(loss, ref_loss, atol=1e-4, rtol=1e-4)
    far = [n for n, got, want in zip(names, grads, ref_grads)
           if (got - want).abs().max() > 1e-3 * want.abs().max().clamp_min(1e-6)]
    assert not far, f"fp32: compiled gradients off the reference: {far}"
    loss, grads = loss_and_grads(compiled, True)
    assert (loss - ref_loss).abs() <= 3 * (eager_loss - ref_loss).abs() + 1e-3 * ref_loss.abs()

    def beyond_rounding(got, eager, want):  # the error, as a multiple of what bf16 rounding allows
        return ((got - want).norm() / (3 * (eager - want).norm() + 0.01 * want.norm())).item()
    flat = [torch.cat([t.flatten() for t in ts]) for ts in (grads, eager_grads, ref_grads)]
    assert beyond_rounding(*flat) <= 1, f"bf16: all gradients together {beyond_rounding(*flat):.2f}x the bound"
    far = {n: round(beyond_rounding(got, eager, want), 2) for n, got, eager, want
           in zip(names, grads, eager_grads, ref_grads) if want.numel() >= 1024}
    far = {n: r for n, r in far.items() if r > 1}
    assert not far, f"bf16: compiled gradients further off the fp32 reference than bf16 rounding (x bound): {far}"
