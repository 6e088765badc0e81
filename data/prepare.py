"""Tokenize text into train/val shards with a manifest.

    python -m data.prepare --input FILE... --tokenizer MODEL --out DIR
                           [--val-docs N | --val-input FILE...] [--shard-tokens N] [--workers N] [--overwrite]

Documents become BOS + tokens and fill `fineweb_train_XXXXXX.bin` / `fineweb_val_XXXXXX.bin` of exactly
--shard-tokens tokens each (the last one shorter); a document may continue into the next shard, as
in the published export. Tokenization runs on all cores in fixed-size chunks whose results are
written in input order, so the output is byte-identical for any number of workers.

Decoding a document's tokens gives back its text after the tokenizer's nmt_nfkc normalization
(NFKC; tabs and newlines become spaces; leading, trailing and repeated spaces are dropped), i.e.
`sp.normalize(text)` with "▁" read as a space; text that normalization leaves unchanged comes back
exactly. manifest.json counts, per split: docs, tokens (BOS included), `bytes` -- UTF-8 bytes of the
decoded text, the denominator of bits per byte -- and `input_bytes` of the raw text.
"""
from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np

from data.files import write_atomic
from data.shards import BOS_ID, SWAP_MARKER, write_shard
from data.tokenizer import build_byte_lut, count_target_bytes, file_sha256, iter_texts, load_sp

CHUNK_DOCS = 256          # documents per worker task
CHUNKS_IN_FLIGHT = 8      # tasks per worker queued at once: bounds memory on corpora of any size
SPLITS = ("train", "val")

_worker = {}


def _init_worker(model_path: str) -> None:
    sp = load_sp(model_path)
    _worker.update(sp=sp, lut=build_byte_lut(sp))


class Encoded(NamedTuple):
    """A chunk of documents, tokenized: BOS + the ids of each document, concatenated, and per document its token
    count (BOS included), decoded bytes, input bytes, and a digest of its ids (the held-out check's key)."""
    tokens: np.ndarray
    lengths: np.ndarray
    decoded: np.ndarray
    raw: np.ndarray
    digests: list[bytes]

    def without(self, drop: np.ndarray) -> "Encoded":
        """The chunk less the documents where `drop` is True."""
        keep = ~drop
        return Encoded(self.tokens[np.repeat(keep, self.lengths)], self.lengths[keep], self.decoded[keep],
                       self.raw[keep], [d for d, k in zip(self.digests, keep) if k])


def encode_chunk(texts: list[str]) -> Encoded:
    sp, lut = _worker["sp"], _worker["lut"]
    docs = sp.encode(texts)
    tokens = np.fromiter(itertools.chain.from_iterable([BOS_ID, *ids] for ids in docs), dtype=np.uint16)
    lengths = np.array([len(ids) + 1 for ids in docs], dtype=np.int64)
    # bytes of token j+1 given token j, and 0 for the token after the last: a document's share is its own tokens'
    # bytes (the next document's BOS adds none)
    per_token = np.append(count_target_bytes(tokens[:-1], tokens[1:], lut), 0) if len(tokens) else np.zeros(0)
    starts = np.cumsum(lengths) - lengths
    decoded = np.add.reduceat(per_token, starts) if len(docs) else np.zeros(0, dtype=np.int64)
    raw = np.array([len(t.encode("utf-8")) for t in texts], dtype=np.int64)
    digests = [hashlib.blake2b(np.asarray(ids, dtype=np.uint16).tobytes(), digest_size=16).digest() for ids in docs]
    return Encoded(tokens, lengths, decoded.astype(np.int64), raw, digests)


class ShardWriter:
    """Cuts a token stream into shards of exactly `shard_tokens` tokens (the last one may be shorter)."""

    def __init__(self, out_dir: Path, split: str, shard_tokens: int):
        self.out_dir, self.split, self.shard_tokens = out_dir, split, shard_tokens
        self.pending: list[np.ndarray] = []
        self.pending_tokens = 0
        self.shards: list[str] = []

    def add(self, tokens: np.ndarray) -> None:
        self.pending.append(tokens)
        self.pending_tokens += len(tokens)
        if self.pending_tokens >= self.shard_tokens:
            stream = np.concatenate(self.pending)
            full = len(stream) // self.shard_tokens * self.shard_tokens
            for start in range(0, full, self.shard_tokens):
                self._write(stream[start:start + self.shard_tokens])
            self.pending, self.pending_tokens = [stream[full:]], len(stream) - full

    def finish(self) -> list[str]:
        if self.pending_tokens:
            self._write(np.concatenate(self.pending))
        self.pending, self.pending_tokens = [], 0
        return self.shards

    def _write(self, tokens: np.ndarray) -> None:
        name = f"fineweb_{self.split}_{len(self.shards):06d}.bin"
        write_shard(self.out_dir / name, tokens)
        self.shards.append(name)


def _chunks(texts: Iterable[str]) -> Iterator[list[str]]:
    it = iter(texts)
    while chunk := list(itertools.islice(it, CHUNK_DOCS)):
        yield chunk


def _old_outputs(out_dir: Path, overwrite: bool, tokenizer: str) -> list[Path]:
    """The shards and manifest already in out_dir: refused up front without overwrite, else replaced only
    once the new set is complete (so a bad input or an interruption keeps the old set). A tokenizer.model/.vocab
    that the old set's manifest says its run shipped into out_dir (`tokenizer_shipped`) goes with them, unless it
    is the tokenizer this run reads: left beside shards of another tokenizer, it is the one a user would reach for.
    A tokenizer the old manifest does not name as shipped (one the user put there) stays."""
    manifest = out_dir / "manifest.json"
    old = sorted(out_dir.glob("fineweb_*.bin")) + ([manifest] if manifest.exists() else [])
    if old and not overwrite:
        raise FileExistsError(f"{out_dir} already holds {len(old)} shard/manifest files (e.g. {old[0].name}); "
                              "mixing runs would corrupt the split (hint: pass --overwrite or choose an empty --out)")
    try:  # only the manifest's own word: a "tokenizer" path inside out_dir may be the user's file, read in place
        shipped = manifest.exists() and json.loads(manifest.read_text()).get("tokenizer_shipped") is True
    except (ValueError, AttributeError, OSError):  # not a manifest of ours: nothing is known to be shipped
        shipped = False
    reading = {Path(tokenizer).resolve(), Path(tokenizer).with_suffix(".vocab").resolve()}
    ours = [out_dir / f"tokenizer{suffix}" for suffix in (".model", ".vocab")] if shipped else []
    return old + [f for f in ours if f.exists() and f.resolve() not in reading]


def _swap_in(staging: Path, out_dir: Path, old: list[Path]) -> None:
    """Replace the old outputs with the staged ones by renames on one filesystem. A marker file stands in the folder
    from before the first old file goes until the manifest is in: the loaders (data.shards.list_shards) refuse a
    folder caught between the two, which holds part of each set."""
    write_atomic(out_dir / SWAP_MARKER, b"data.prepare is replacing the shards of this folder\n")
    for path in sorted(old, key=lambda q: q.name != "manifest.json"):
        path.unlink(missing_ok=True)
    for path in sorted(staging.glob("fineweb_*.bin")) + sorted(staging.glob("tokenizer.*")):
        os.replace(path, out_dir / path.name)
    os.replace(staging / "manifest.json", out_dir / "manifest.json")
    (out_dir / SWAP_MARKER).unlink()


class HeldOut:
    """Keeps training documents out of the validation split: remembers the ids of every validation document (a
    digest, computed in the workers) and drops training documents that encode to the same ids (counted in the
    manifest). Ids, not raw text: a copy that differs in runs of spaces, tabs, leading or trailing whitespace or
    compatibility characters, which the tokenizer's normalization removes, is the same validation text to the
    model (raw text let such copies into training)."""

    def __init__(self):
        self.digests: set[bytes] = set()
        self.dropped = 0

    def remember(self, chunk: Encoded) -> Encoded:
        self.digests.update(chunk.digests)
        return chunk

    def drop_seen(self, chunk: Encoded) -> Encoded:
        drop = np.array([d in self.digests for d in chunk.digests], dtype=bool)
        if not drop.any():
            return chunk
        self.dropped += int(drop.sum())
        return chunk.without(drop)


def prepare_splits(splits: dict[str, Iterable[str]], tokenizer: str, out_dir: str | os.PathLike, *,
                   shard_tokens: int = 100_000_000, workers: int | None = None, overwrite: bool = False,
                   extra_manifest: dict | None = None, ship_tokenizer: bool = False) -> dict:
    """Tokenize each split's documents into shards under `out_dir`, with manifest.json (its presence means the
    shards are complete). All are staged in a hidden folder inside out_dir and moved in, manifest last, once
    written: a failed or interrupted run leaves out_dir as it was. Training documents whose text is a validation
    document's are left out (`held_out_duplicates` in the manifest). ship_tokenizer: the tokenizer (and its .vocab
    beside it) moves into out_dir as tokenizer.model/.vocab together with the shards, so that the two never
    disagree. Returns the manifest.

    Tokenization runs in worker processes started by a forkserver, which imports the calling script's main module:
    a script that calls this must do so under `if __name__ == "__main__":`, or each worker runs the script again."""
    if not 1 <= shard_tokens < 2**31:  # write_shard's int32 count; refused before the tokenization, not after
        raise ValueError(f"shard_tokens must be in [1, 2**31), got {shard_tokens}")
    unknown = set(splits) - set(SPLITS)
    if unknown:
        raise ValueError(f"unknown split names {sorted(unknown)}; expected {SPLITS}")
    sp = load_sp(tokenizer)
    if sp.get_piece_size() > 65536:
        raise ValueError(f"{tokenizer}: vocab size {sp.get_piece_size()} does not fit uint16 shards")
    build_byte_lut(tokenizer)  # its checks (BOS at id 1, a space piece) before any worker starts
    held_out = HeldOut()
    splits = dict(sorted(splits.items(), key=lambda kv: kv[0] != "val"))  # val first: its ids are held out
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    old = _old_outputs(out, overwrite, tokenizer)
    for leftover in out.glob(".staging-*"):  # what a killed run (SIGKILL: no finally) staged, maybe gigabytes
        shutil.rmtree(leftover, ignore_errors=True)
    workers = workers or os.cpu_count() or 1
    manifest = {"tokenizer": str(out / "tokenizer.model" if ship_tokenizer else tokenizer),
                "tokenizer_shipped": ship_tokenizer,
                "tokenizer_sha256": file_sha256(tokenizer),
                "vocab_size": sp.get_piece_size(), "shard_tokens": shard_tokens, "bos_id": BOS_ID,
                "bytes_definition": "UTF-8 bytes of the decoded (nmt_nfkc-normalized) text; BOS adds none",
                "splits": {}}
    # forkserver: workers fork from a clean single-threaded server, never from this (maybe threaded) process
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
    # Shards are written to a staging folder inside out_dir and moved in once all splits and the manifest are
    # done; whatever fails before (a missing input, a bad line, Ctrl-C) leaves out_dir as it was.
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=out))
    try:
        with context.Pool(workers, initializer=_init_worker, initargs=(str(tokenizer),)) as pool:
            for split, texts in splits.items():
                writer = ShardWriter(staging, split, shard_tokens)
                check = held_out.remember if split == "val" else held_out.drop_seen
                manifest["splits"][split] = _tokenize_split(pool, workers, texts, writer, check)
        if "train" in splits and not manifest["splits"]["train"]["docs"]:
            raise ValueError("no training documents: the inputs hold none, or only copies of validation "
                             "documents; nothing was written (hint: check --input)")
        manifest["held_out_duplicates"] = held_out.dropped
        manifest.update(extra_manifest or {})
        if ship_tokenizer:
            for suffix in (".model", ".vocab"):
                source = Path(tokenizer).with_suffix(suffix)
                if source.exists():
                    shutil.copyfile(source, staging / f"tokenizer{suffix}")
        write_atomic(staging / "manifest.json", (json.dumps(manifest, indent=2) + "\n").encode())
        _swap_in(staging, out, old)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return manifest


def _tokenize_split(pool, workers: int, texts: Iterable[str], writer: ShardWriter,
                    check: Callable[[Encoded], Encoded]) -> dict:
    totals = {"docs": 0, "tokens": 0, "bytes": 0, "input_bytes": 0}
    chunks = _chunks(texts)
    while window := list(itertools.islice(chunks, workers * CHUNKS_IN_FLIGHT)):
        for encoded in pool.map(encode_chunk, window, chunksize=1):
            encoded = check(encoded)
            writer.add(encoded.tokens)
            totals["docs"] += len(encoded.lengths)
            totals["tokens"] += len(encoded.tokens)
            totals["bytes"] += int(encoded.decoded.sum())
            totals["input_bytes"] += int(encoded.raw.sum())
    totals["shards"] = writer.finish()
    return totals


def prepare(inputs: list[str], tokenizer: str, out_dir: str | os.PathLike, *, val_docs: int = 0,
            val_inputs: list[str] | None = None, **kwargs) -> dict:
    """Files to shards. The validation split is either the first `val_docs` documents of `inputs` or all
    documents of `val_inputs`; with neither there is no validation split."""
    if val_docs and val_inputs:
        raise ValueError("give either val_docs or val_inputs, not both")
    if val_docs < 0:
        raise ValueError(f"val_docs must be >= 0, got {val_docs}")
    if val_inputs:
        shared = [(v, t) for v in val_inputs for t in inputs if Path(v).exists() and Path(t).exists()
                  and os.path.samefile(v, t)]
        if shared:
            raise ValueError(f"--val-input {shared[0][0]} is also a training --input ({shared[0][1]}): the model "
                             "would train on its validation text (hint: give each file to one split)")
        return prepare_splits({"val": iter_texts(val_inputs), "train": iter_texts(inputs)}, tokenizer, out_dir,
                              **kwargs)
    docs = iter_texts(inputs)
    val = list(itertools.islice(docs, val_docs))
    first_train = next(docs, None)  # at least one document must be left to train on
    if first_train is None and not val:
        raise ValueError(f"the inputs ({', '.join(map(str, inputs))}) hold no documents (hint: empty and "
                         "whitespace-only lines or texts are skipped; check --input)")
    if first_train is None and val_docs:
        raise ValueError(f"--val-docs {val_docs} but the inputs hold only {len(val)} documents, none left to train "
                         "(hint: a smaller --val-docs, or separate validation text with --val-input FILE)")
    docs = itertools.chain([first_train], docs)
    splits = {"val": val, "train": docs} if val_docs else {"train": docs}
    return prepare_splits(splits, tokenizer, out_dir, **kwargs)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True,
                   help="training text: .txt (one document per non-empty line), .jsonl, .jsonl.gz, .jsonl.xz (one "
                        "JSON object per line, the document in \"text\")")
    p.add_argument("--tokenizer", required=True, help="SentencePiece .model")
    p.add_argument("--out", required=True, help="output directory")
    val = p.add_mutually_exclusive_group()
    val.add_argument("--val-docs", type=int, default=0, help="the first N input documents form the val split")
    val.add_argument("--val-input", nargs="+", help="separate validation text files")
    p.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per shard (default 100M)")
    p.add_argument("--workers", type=int, default=None, help="tokenizer processes (default: all cores)")
    p.add_argument("--overwrite", action="store_true", help="replace shards and manifest already in --out")
    a = p.parse_args(argv)
    try:
        manifest = prepare(a.input, a.tokenizer, a.out, val_docs=a.val_docs, val_inputs=a.val_input,
                           shard_tokens=a.shard_tokens, workers=a.workers, overwrite=a.overwrite)
    except (ValueError, FileNotFoundError, FileExistsError) as exc:
        sys.exit(f"data.prepare: {exc}")
    for split, s in manifest["splits"].items():
        print(f"{split}: {s['docs']:,} docs, {s['tokens']:,} tokens, {s['bytes']:,} bytes, {len(s['shards'])} shards")


if __name__ == "__main__":
    main()
