"""Demo corpus: the stated entropy rate matches an independent estimate; the shards round-trip exactly."""
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm

from data.demo import make_demo
from data.demo_source import Sampler, build_source, code_length_bits, entropy_rate
from data.loader import load_tokens
from data.shards import BOS_ID, list_shards
from data.tokenizer import build_byte_lut, count_target_bytes

ROOT = Path(__file__).resolve().parents[1]


def test_source_rows_are_distributions():
    src = build_source(0)
    assert np.allclose(src.next_word.sum(axis=1), 1) and np.isclose(src.start.sum(), 1)
    assert len(set(src.words)) == src.n_words and all(w.islower() and w.isalpha() for w in src.words)


def test_entropy_rate_matches_empirical_code_length():
    """The exact rate (absorbing-chain algebra) vs the code length of 3,000 sampled documents parsed back
    from their text. Tolerance: 4 standard errors of the ratio estimator (the SE itself must be small)."""
    src = build_source(0)
    exact = entropy_rate(src)
    docs = Sampler(src).documents(3000, np.random.default_rng(7))
    index = {w: i for i, w in enumerate(src.words)}
    bits = np.array([code_length_bits(src, d, index) for d in docs])
    nbytes = np.array([len(d.encode("utf-8")) for d in docs], dtype=float)
    estimate = bits.sum() / nbytes.sum()
    resid = bits - estimate * nbytes
    se = math.sqrt((resid ** 2).sum() / (len(docs) * (len(docs) - 1))) / nbytes.mean()
    assert se < 0.005
    assert abs(estimate - exact["bits_per_byte"]) < 4 * se, (estimate, exact, se)
    assert abs(nbytes.mean() - exact["bytes_per_doc"]) < 0.05 * exact["bytes_per_doc"]
    assert 1.0 < exact["bits_per_byte"] < 2.5


def test_code_length_rejects_foreign_text():
    src = build_source(0)
    with pytest.raises(ValueError, match="not from this source"):
        code_length_bits(src, "Hello world.")
    doc = Sampler(src).documents(1, np.random.default_rng(0))[0]
    with pytest.raises(ValueError, match="must end with"):
        code_length_bits(src, doc[:-1])


def decoded_documents(tokens: np.ndarray, sp) -> list[str]:
    starts = np.flatnonzero(tokens == BOS_ID).tolist() + [len(tokens)]
    return [sp.decode(tokens[a + 1:b].tolist()) for a, b in zip(starts[:-1], starts[1:])]


@pytest.fixture(scope="module")
def small_demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    return out, make_demo(out, seed=3, train_docs=400, val_docs=60)


def test_make_demo_writes_a_complete_consistent_corpus(small_demo):
    out, manifest = small_demo
    assert json.loads((out / "manifest.json").read_text()) == manifest
    sp = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    assert manifest["vocab_size"] == sp.get_piece_size() == 512
    src = build_source(3)
    for split, rng_tag, n_docs in (("val", 2, 60), ("train", 1, 400)):
        tokens = load_tokens(list_shards(str(out / f"fineweb_{split}_*.bin")))
        stats = manifest["splits"][split]
        assert stats["tokens"] == len(tokens) and stats["docs"] == n_docs == np.count_nonzero(tokens == BOS_ID)
        # decoding gives back exactly the generated text (normalization is the identity on it)
        expected = Sampler(src).documents(n_docs, np.random.default_rng([3, rng_tag]))
        assert decoded_documents(tokens, sp) == expected
        lut = build_byte_lut(sp)
        assert int(count_target_bytes(tokens[:-1], tokens[1:], lut).sum()) == stats["bytes"] == sum(map(len, expected))
    assert manifest["source_entropy_bits_per_byte"] == pytest.approx(entropy_rate(src)["bits_per_byte"])
    assert manifest["source_entropy_bits_per_byte"] < manifest["val_unigram_bits_per_byte"] - 1.0


def test_val_code_length_is_scored_like_evaluation(small_demo):
    """val_source_bits_per_byte = sum over scored targets of the source's code length / scored bytes:
    every document's end is a scored BOS except the last one's."""
    out, manifest = small_demo
    src = build_source(3)
    docs = Sampler(src).documents(60, np.random.default_rng([3, 2]))
    index = {w: i for i, w in enumerate(src.words)}
    bits = sum(code_length_bits(src, d, index) for d in docs) + math.log2(src.doc_end_prob)
    assert manifest["val_source_bits_per_byte"] == pytest.approx(bits / manifest["splits"]["val"]["bytes"])


def test_demo_cli_is_deterministic_per_seed(tmp_path, small_demo):
    args = [sys.executable, "-m", "data.demo", "--seed", "3", "--train-docs", "400", "--val-docs", "60"]
    out = subprocess.run(args + ["--out", str(tmp_path / "a")], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    assert "source_entropy_bits_per_byte 1." in out and "train: 400 docs" in out and "val: 60 docs" in out
    ref_dir, _ = small_demo
    for name in ["fineweb_train_000000.bin", "fineweb_val_000000.bin", "tokenizer.model"]:
        assert (tmp_path / "a" / name).read_bytes() == (ref_dir / name).read_bytes(), name
    make_demo(tmp_path / "b", seed=4, train_docs=400, val_docs=60)
    assert (tmp_path / "b" / "fineweb_val_000000.bin").read_bytes() != (ref_dir / "fineweb_val_000000.bin").read_bytes()
    assert "replaced" not in out
    # over an earlier demo: replaced, and said (runs on the two are not comparable)
    again = subprocess.run(args + ["--out", str(tmp_path / "b")], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout
    assert f"replaced the demo of seed 4 that {tmp_path / 'b'} held" in again
    assert (tmp_path / "b" / "fineweb_val_000000.bin").read_bytes() == (ref_dir / "fineweb_val_000000.bin").read_bytes()


def test_make_demo_refuses_a_folder_with_another_corpus(tmp_path):
    """Only an earlier demo is replaced: shards without a manifest, or with another corpus's manifest, stay."""
    from data.demo import make_demo
    for name, manifest in (("bare", None), ("prepared", '{"splits": {}}'), ("broken", "{not json")):
        out = tmp_path / name
        out.mkdir()
        (out / "fineweb_train_000000.bin").write_bytes(b"real data")
        if manifest is not None:
            (out / "manifest.json").write_text(manifest)
        with pytest.raises(FileExistsError, match="another corpus"):
            make_demo(out, train_docs=5, val_docs=2)
        assert (out / "fineweb_train_000000.bin").read_bytes() == b"real data"
        assert not (out / "tokenizer.model").exists()


def test_an_interrupted_demo_keeps_its_tokenizer_with_its_shards(tmp_path, fail_at_call):
    """The new tokenizer replaced the old one before the shards were written: interrupted, the folder held the old
    shards and manifest beside a tokenizer they were not made with (the byte audit still passed)."""
    import data.prepare as prep
    make_demo(tmp_path, seed=0, train_docs=60, val_docs=10)
    before = {f.name: f.read_bytes() for f in tmp_path.iterdir()}
    fail_at_call(prep, "write_shard", 1, KeyboardInterrupt("killed"))
    with pytest.raises(KeyboardInterrupt):
        make_demo(tmp_path, seed=1, train_docs=60, val_docs=10)
    assert {f.name: f.read_bytes() for f in tmp_path.iterdir()} == before  # nothing staged is left either


def test_train_refuses_a_manifest_of_another_tokenizer(small_demo, tmp_path):
    """The demo's manifest gives the source entropy train.py reports; read beside another tokenizer it is stale."""
    from data.tokenizer import file_sha256
    from training.validation import source_entropy
    from training.config import ConfigError, load_config
    out, _ = small_demo
    (tmp_path / "manifest.json").write_bytes((out / "manifest.json").read_bytes())
    other = tmp_path / "tokenizer.model"
    other.write_bytes((out / "tokenizer.model").read_bytes() + b"\0")
    cfg = load_config(None, [f"data.tokenizer={other}"])
    with pytest.raises(ConfigError, match="describes another tokenizer"):
        source_entropy(cfg, file_sha256(other))
    own = out / "tokenizer.model"
    assert source_entropy(load_config(None, [f"data.tokenizer={own}"]), file_sha256(own)) > 0
