"""scripts/bench_attention: the documents' layout, the packed stream a variable-length kernel reads, the adapter to
varlen_attn's two signatures, the cuDNN route's patch, the refusals; on a GPU the whole table."""
import re
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from conftest import REPO
from model.doc_attention import BLOCK, dense_doc_mask, doc_causal_reference
from scripts import bench_attention as B


def test_packed_documents_start_at_each_row_and_each_document():
    docs = torch.tensor([[0, 0, 1, 1, 1], [1, 2, 2, 2, 3]])  # row 1 starts inside a document cut at the row's start
    offsets, longest = B.packed_documents(docs)
    assert offsets.dtype == torch.int32
    assert offsets.tolist() == [0, 2, 5, 6, 9, 10]
    assert longest == 3


def test_layout_counts_the_tiles_and_pairs_of_one_and_of_two_documents():
    T = 2 * BLOCK
    one = B.layout_stats(torch.zeros(1, T, dtype=torch.int32))
    assert (one["tiles"], one["causal_tiles"], one["pair_frac"], one["docs_per_row"]) == (3, 3, 1.0, 1.0)
    halves = torch.cat([torch.zeros(1, BLOCK, dtype=torch.int32), torch.ones(1, BLOCK, dtype=torch.int32)], dim=1)
    two = B.layout_stats(halves)  # each document fills one tile: the tile below the diagonal holds no pair
    assert (two["tiles"], two["partial_tiles"], two["docs_per_row"]) == (2, 2, 2.0)
    assert two["pair_frac"] == pytest.approx(2 * BLOCK * (BLOCK + 1) / (T * (T + 1)))


def fake_varlen(window_size: bool):
    """A CPU stand-in for varlen_attn with one of its two signatures: causal SDPA on each packed sequence."""
    calls = []

    def run(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs):
        calls.append(kwargs)
        assert torch.equal(cu_q, cu_k) and max_q == max_k == int(cu_q.diff().max())
        out = torch.empty_like(q)
        for s, e in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):  # [L, H, D] -> [H, L, D]
            out[s:e] = F.scaled_dot_product_attention(q[s:e].transpose(0, 1), k[s:e].transpose(0, 1),
                                                      v[s:e].transpose(0, 1), is_causal=True).transpose(0, 1)
        return out
    if window_size:
        def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size=(-1, -1), enable_gqa=False):
            assert window_size == (-1, 0) and enable_gqa == (k.shape[1] != q.shape[1])
            if enable_gqa:
                group = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            return run(q, k, v, cu_q, cu_k, max_q, max_k, window_size=window_size, enable_gqa=enable_gqa)
    else:
        def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False):
            assert is_causal and k.shape[1] == q.shape[1]  # no GQA in this signature: the heads come repeated
            return run(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=is_causal)
    return varlen_attn, calls


@pytest.mark.parametrize("window_size", [True, False], ids=["window_size", "is_causal"])
def test_the_packed_varlen_path_equals_the_dense_reference(window_size, monkeypatch):
    """The rows packed into one stream, the kernel called through either signature, unpacked again: the dense
    reference's output, so the offsets, the heads' layout and the GQA grouping are right."""
    fn, calls = fake_varlen(window_size)
    varlen = pytest.importorskip("torch.nn.attention.varlen")
    monkeypatch.setattr(varlen, "varlen_attn", fn)
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(2, 50, (3, 40), generator=g)
    idx[torch.rand(idx.shape, generator=g) < 0.1] = 1  # BOS
    docs = B.document_ids(idx)
    q, k, v = (torch.randn(3, h, 40, 8, generator=g) for h in (4, 2, 2))
    attention, repeated = B.make_impl("varlen", docs, 4, 2)
    got = attention(q, k, v)
    torch.testing.assert_close(got, doc_causal_reference(q, k, v, dense_doc_mask(docs)), atol=1e-5, rtol=1e-5)
    assert len(calls) == 1 and repeated == (not window_size)  # the older signature has no GQA


def test_the_cudnn_route_calls_the_private_op_causal_with_the_heads_repeated(monkeypatch):
    """cuDNN's route refuses windows and GQA: the op is called positionally with is_causal and as many key/value heads
    as query heads, and its first output is the attention."""
    fn, _ = fake_varlen(window_size=False)
    varlen = pytest.importorskip("torch.nn.attention.varlen")
    seen = []

    def private_op(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False):
        seen.append((k.shape[1], is_causal))
        return fn(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=is_causal), "lse", "rng"
    monkeypatch.setattr(varlen, "_varlen_attn", private_op)
    docs = torch.tensor([[0] * 5 + [1] * 7])
    q, k, v = (torch.randn(1, h, 12, 8) for h in (4, 2, 2))
    attention, repeated = B.make_impl("varlen-cudnn", docs, 4, 2)
    torch.testing.assert_close(attention(q, k, v), doc_causal_reference(q, k, v, dense_doc_mask(docs)))
    assert repeated and seen == [(4, True)]


def test_the_cudnn_route_answers_cudnn_only_inside(monkeypatch):
    fake = types.SimpleNamespace(_should_use_cudnn=lambda device_index: False)
    monkeypatch.setitem(sys.modules, "torch.nn.attention.varlen", fake)
    monkeypatch.setattr(torch.nn.attention, "varlen", fake, raising=False)
    with B.route("varlen"):
        assert fake._should_use_cudnn(0) is False
    with B.route("varlen-cudnn"):
        assert fake._should_use_cudnn(0) is True
    assert fake._should_use_cudnn(0) is False
    with pytest.raises(ZeroDivisionError), B.route("varlen-cudnn"):
        1 / 0  # noqa: B018 -- restored on the way out of an error too
    assert fake._should_use_cudnn(0) is False
    monkeypatch.delattr(fake, "_should_use_cudnn")
    with pytest.raises(RuntimeError, match="no cuDNN route"), B.route("varlen-cudnn"):
        pass


@pytest.mark.parametrize("args, message", [
    (["--impls", "sdpa,flex"], r"unknown \['sdpa'\]"),
    (["--doc-tokens", "1"], "--doc-tokens >= 2"),
    (["--check-rows", "0"], "--check-rows >= 1"),
    (["model.n_heads=3"], "must be divisible by model.n_heads=3"),  # the config's check
])
def test_bad_arguments_are_refused(args, message, capsys):
    with pytest.raises(SystemExit):
        B.main(["--config", str(REPO / "configs/demo.toml"), *args])
    assert re.search(message, capsys.readouterr().err)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal without a GPU")
def test_without_a_gpu_it_says_so(capsys):
    with pytest.raises(SystemExit):
        B.main(["--config", str(REPO / "configs/demo.toml")])
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_every_document_kernel_matches_the_reference(capsys):
    """Small shapes (4 rows of 512 tokens, 4 heads over 2 of 32): FlexAttention and FlashAttention's variable-length
    kernel agree with the dense fp32 reference within bf16's error; each is timed; cuDNN's route may be refused by the
    GPU's cuDNN, which the table then says."""
    rows = B.main(["--config", str(REPO / "configs/demo.toml"), "--doc-tokens", "96", "--rep-ms", "5",
                   "--check-rows", "2", "data.seq_len=512", "train.micro_batch_seqs=4"])
    out = capsys.readouterr().out
    assert "layout: 4 rows of 512 tokens" in out
    by = {r["impl"]: r for r in rows}
    assert set(by) == set(B.IMPLS)
    for name in ("sdpa-causal", "flex", "varlen"):
        assert "error" not in by[name], by[name]
        assert 0 < by[name]["forward_ms"] < by[name]["both_ms"]  # the backward costs more than nothing
    for name in ("flex", "varlen"):
        assert by[name]["max_error"] < 0.05, by[name]
    if "error" in by["varlen-cudnn"]:  # this GPU's cuDNN may refuse ragged inputs, but not for what the call controls
        assert not re.search(r"window|GQA", by["varlen-cudnn"]["error"]), by["varlen-cudnn"]
    else:
        assert by["varlen-cudnn"]["max_error"] < 0.05


def test_missing_training_shards_are_refused_with_the_loaders_reason(monkeypatch, tmp_path, capsys):
    """--tokens train reads data.train_files; where they are missing the refusal names them (the GPU check passed)."""
    monkeypatch.setattr(B.torch.cuda, "is_available", lambda: True)
    with pytest.raises(SystemExit):
        B.main(["--config", str(REPO / "configs/demo.toml"), "--tokens", "train",
                f"data.train_files={tmp_path}/none_*.bin"])
    err = capsys.readouterr().err
    assert "--tokens train: data.train_files:" in err and "none_" in err, err
