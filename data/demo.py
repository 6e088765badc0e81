"""The embedded demo corpus: English-like text from a seeded source whose entropy rate is known exactly.

    python -m data.demo --out DIR [--seed S] [--train-docs N] [--val-docs N]

Writes DIR/tokenizer.model (SentencePiece BPE, 512 ids, the published settings), fineweb_train_*.bin,
fineweb_val_*.bin and manifest.json, which adds to the usual counts:
  source_entropy_bits_per_byte  the source's exact entropy rate (data/demo_source.py): what a perfect
                                model of the source scores in expectation, as bits per byte is measured
  val_source_bits_per_byte      the code length of this particular validation split under the source,
                                scored the way evaluation scores it (the BOS after every document but
                                the last is a target): the number no model can beat on average
  val_unigram_bits_per_byte     the same split under its own token frequencies: the best a model that
                                ignores context could do, to show how much there is to learn
The text is ASCII letters, single spaces and periods, which nmt_nfkc normalization leaves unchanged:
decoding the shards gives back the generated documents exactly.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from data.demo_source import Sampler, build_source, code_length_bits, entropy_rate
from data.prepare import prepare_splits
from data.tokenizer import load_sp, train_tokenizer

DEMO_VOCAB_SIZE = 512
DEFAULT_TRAIN_DOCS = 13_500    # ~3.0M tokens
DEFAULT_VAL_DOCS = 450         # ~100k tokens
TOKENIZER_DOCS = 4_000         # training sample for the tokenizer (~2 MB)
SHARD_TOKENS = 1_000_000       # a few train shards, so the loader has shards to mix


def split_code_length(src, docs: list[str]) -> float:
    """Bits to encode `docs` as evaluation scores them: the end of the last document has no BOS after it."""
    index = {w: i for i, w in enumerate(src.words)}
    bits = sum(code_length_bits(src, d, index) for d in docs)
    return bits + math.log2(src.doc_end_prob)  # give back the unscored final end-of-document event


def unigram_bits(sp, docs: list[str]) -> float:
    """Code length of BOS + tokens of every document under the split's own token frequencies."""
    counts = np.bincount(np.concatenate([[1, *ids] for ids in sp.encode(docs)]).astype(np.int64))
    counts = counts[counts > 0]
    return float(-(counts * np.log2(counts / counts.sum())).sum())


DEMO_KIND = "demo word-level Markov chain (data/demo_source.py)"


def earlier_demo(out: Path) -> dict | None:
    """The source of the demo already in `out` (its manifest's "source": seed, words, ...), which a new demo
    replaces (its shards and tokenizer), or None for an empty folder. Shards of another corpus are refused: those
    stay unless the user moves them."""
    manifest = out / "manifest.json"
    if not manifest.exists() and not any(out.glob("fineweb_*.bin")):
        return None
    source = None
    try:
        source = json.loads(manifest.read_text()).get("source") if manifest.exists() else None
    except (json.JSONDecodeError, AttributeError):  # not a manifest of ours
        pass
    if not isinstance(source, dict) or source.get("kind") != DEMO_KIND:
        found = "its manifest.json names no demo source" if manifest.exists() else "shards, no manifest.json"
        raise FileExistsError(f"{out} holds shards of another corpus ({found}), which the demo would replace "
                              "(hint: choose an empty --out, e.g. runs/demo/data)")
    return source


def make_demo(out_dir: str | os.PathLike, seed: int = 0, train_docs: int = DEFAULT_TRAIN_DOCS,
              val_docs: int = DEFAULT_VAL_DOCS) -> dict:
    """Generate the corpus, train its tokenizer, write shards and manifest into `out_dir`; returns the
    manifest. Everything is a function of `seed` (and the document counts)."""
    if train_docs < 1 or val_docs < 1:
        raise ValueError(f"train_docs ({train_docs}) and val_docs ({val_docs}) must be >= 1")
    out = Path(out_dir)
    earlier_demo(out)  # refuses another corpus's folder
    out.mkdir(parents=True, exist_ok=True)
    src = build_source(seed)
    rate = entropy_rate(src)
    sampler = Sampler(src)
    val = sampler.documents(val_docs, np.random.default_rng([seed, 2]))
    train = sampler.documents(train_docs, np.random.default_rng([seed, 1]))
    # The tokenizer is trained beside the folder's files and moves in with the new shards (ship_tokenizer): an
    # interrupted run must not leave a new tokenizer next to the old shards and manifest.
    for leftover in out.glob(".demo-tokenizer-*"):  # a killed run's
        shutil.rmtree(leftover, ignore_errors=True)
    scratch = Path(tempfile.mkdtemp(prefix=".demo-tokenizer-", dir=out))
    try:
        sample = scratch / "sample.txt"
        sample.write_text("\n".join(train[:TOKENIZER_DOCS]) + "\n")
        # a fixed thread count: the model file records it, and the demo should be byte-identical anywhere
        model = train_tokenizer([str(sample)], DEMO_VOCAB_SIZE, str(scratch / "tokenizer"), num_threads=2)
        val_bytes = sum(len(d) for d in val)  # ASCII, and normalization is the identity on this text
        extra = {
            "source_entropy_bits_per_byte": rate["bits_per_byte"],
            "val_source_bits_per_byte": split_code_length(src, val) / val_bytes,
            "val_unigram_bits_per_byte": unigram_bits(load_sp(model), val) / val_bytes,
            "source": {"kind": DEMO_KIND, "seed": seed,
                       "words": src.n_words, "doc_end_prob": src.doc_end_prob, **rate},
        }
        manifest = prepare_splits({"val": val, "train": train}, model, out, shard_tokens=SHARD_TOKENS,
                                  overwrite=True, extra_manifest=extra, ship_tokenizer=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if manifest["splits"]["val"]["bytes"] != val_bytes:
        raise RuntimeError(f"demo val split decodes to {manifest['splits']['val']['bytes']} bytes, generated "
                           f"{val_bytes}: the tokenizer did not round-trip the text")
    return manifest


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-docs", type=int, default=DEFAULT_TRAIN_DOCS)
    p.add_argument("--val-docs", type=int, default=DEFAULT_VAL_DOCS)
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    before = earlier_demo(Path(a.out))
    m = make_demo(a.out, seed=a.seed, train_docs=a.train_docs, val_docs=a.val_docs)
    if before is not None:  # said, because runs trained on the old one are not comparable with runs on this one
        print(f"replaced the demo of seed {before.get('seed')} that {a.out} held")
    for split in ("train", "val"):
        s = m["splits"][split]
        print(f"{split}: {s['docs']:,} docs, {s['tokens']:,} tokens, {s['bytes']:,} bytes, {len(s['shards'])} shards")
    print(f"source_entropy_bits_per_byte {m['source_entropy_bits_per_byte']:.4f} (exact; a perfect model's "
          f"expected score)")
    print(f"val_source_bits_per_byte {m['val_source_bits_per_byte']:.4f} (this val split under the true source)")
    print(f"val_unigram_bits_per_byte {m['val_unigram_bits_per_byte']:.4f} (context-free token model)")
    print(f"wrote {a.out} in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
