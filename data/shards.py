"""The published token-shard format (compatible with the parameter-golf FineWeb exports).

A shard is a 256 x int32 little-endian header -- [0] magic 20240520, [1] version 1, [2] token count --
followed by exactly that many little-endian uint16 tokens. Every document is BOS (id 1) followed by its
tokens; there is no EOS. A document may continue into the next shard.
"""
from __future__ import annotations

import fnmatch
import glob
import hashlib
import json
import os
from pathlib import Path

import numpy as np

from data.files import write_atomic

MAGIC = 20240520
VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
BOS_ID = 1
SWAP_MARKER = ".prepare-swap-in-progress"  # data.prepare's, while a folder holds parts of two shard sets
DOWNLOAD_MARKER = ".download-incomplete"   # data.download's, until every file it was asked for is in place
TOKEN_DTYPE = np.dtype("<u2")


class ShardError(ValueError):
    """A shard file that does not follow the format; the message names the file and the expectation."""


def write_shard(path: str | os.PathLike, tokens: np.ndarray) -> None:
    """Write `tokens` (integers in [0, 65535]) as a shard, atomically: a temporary file in the same
    directory is renamed over `path` only once it is complete, so a crash never leaves a valid-looking
    half shard."""
    path = Path(path)
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise ShardError(f"{path}: tokens must be a 1-D integer array, got shape {tokens.shape} dtype {tokens.dtype}")
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) > 0xFFFF):
        raise ShardError(f"{path}: token ids must fit in uint16 [0, 65535], got range "
                         f"[{int(tokens.min())}, {int(tokens.max())}]")
    if tokens.size >= 2**31:
        raise ShardError(f"{path}: {tokens.size} tokens do not fit the int32 count in the header")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0], header[1], header[2] = MAGIC, VERSION, tokens.size
    write_atomic(path, header.tobytes(), np.ascontiguousarray(tokens, dtype=TOKEN_DTYPE))


def read_header(path: str | os.PathLike) -> int:
    """Validate the header and the exact file size of a shard; returns its token count."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise ShardError(f"{path}: no such shard file") from None
    if size < HEADER_BYTES:
        raise ShardError(f"{path}: {size} bytes is shorter than the {HEADER_BYTES}-byte header "
                         "(truncated, or not a token shard)")
    header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    magic, version, count = int(header[0]), int(header[1]), int(header[2])
    if magic != MAGIC:
        raise ShardError(f"{path}: header magic is {magic}, expected {MAGIC} (not a token shard, or "
                         "written with another byte order)")
    if version != VERSION:
        raise ShardError(f"{path}: header version is {version}, expected {VERSION}")
    if count < 0:
        raise ShardError(f"{path}: header declares a negative token count {count}")
    expected = HEADER_BYTES + 2 * count
    if size != expected:
        kind = "truncated" if size < expected else "oversized"
        raise ShardError(f"{path}: {kind}: header declares {count} tokens, so the file should be {expected} "
                         f"bytes, but it is {size} (hint: an interrupted copy or download; fetch it again)")
    return count


def read_shard(path: str | os.PathLike, vocab_size: int | None = None, mmap: bool = True) -> np.ndarray:
    """Tokens of a validated shard as uint16: a read-only memory map (nothing read yet) or, with
    mmap=False, an array in memory. With `vocab_size`, every id must be below it (this reads the shard)."""
    count = read_header(path)
    if mmap:
        tokens = np.memmap(path, dtype=TOKEN_DTYPE, mode="r", offset=HEADER_BYTES, shape=(count,))
    else:
        tokens = np.fromfile(path, dtype=TOKEN_DTYPE, count=count, offset=HEADER_BYTES)
    if vocab_size is not None and count:
        top = int(tokens.max())
        if top >= vocab_size:
            where = int(np.argmax(tokens >= vocab_size))
            raise ShardError(f"{path}: token id {top} (first out-of-range id at position {where}) is not below "
                             f"vocab_size {vocab_size} (hint: shards and tokenizer do not match)")
    return tokens


def list_shards(pattern: str) -> list[str]:
    """Sorted files matching a glob pattern; an error naming the pattern when nothing matches."""
    files = sorted(glob.glob(os.path.expanduser(pattern)))
    if not files:
        raise FileNotFoundError(f"no shard files match {pattern!r} (hint: run `python -m data.download` for "
                                "FineWeb or `python -m data.demo --out DIR` for the demo corpus, and check the "
                                "path is relative to the directory you run from)")
    for folder in sorted({os.path.dirname(f) for f in files}):
        if os.path.exists(os.path.join(folder, SWAP_MARKER)):
            raise ShardError(f"{folder or '.'}: data.prepare was interrupted while replacing its shards, so it holds "
                             "parts of two sets (hint: run the data.prepare command again with --overwrite)")
        marker = os.path.join(folder, DOWNLOAD_MARKER)
        if os.path.exists(marker):
            require_downloaded(marker, folder, os.path.basename(pattern))
    return files


def require_downloaded(marker: str, folder: str, name_pattern: str) -> None:
    """data.download's marker lists the shards it is fetching into `folder`: refuse a pattern that matches one still
    missing, since the glob would train (or score) on the part that arrived. Other patterns in the folder (the
    validation shards once complete, a prefix of the training shards) pass."""
    try:
        with open(marker, encoding="utf-8") as f:
            fields = json.load(f)
        command, expected = str(fields["command"]), [str(name) for name in fields["files"]]
    except (OSError, ValueError, KeyError, TypeError):  # unreadable: the whole folder is in doubt
        command, expected = "python -m data.download ...", None
    missing = [name for name in expected or [] if fnmatch.fnmatch(name, name_pattern)
               and not os.path.exists(os.path.join(folder, name))]
    if expected is None or missing:
        some = f" ({len(missing)} of the shards {name_pattern!r} matches, e.g. {missing[0]})" if missing else ""
        raise ShardError(f"{folder or '.'}: data.download has not finished fetching this folder{some}: the pattern "
                         f"would read part of the set (hint: run `{command}` again: it resumes)")


def require_tokenizer(files: list[str], tokenizer_sha256: str, tokenizer: str) -> bool:
    """Shards whose folder holds a manifest.json (data.prepare's, data.demo's) naming another tokenizer are refused:
    their ids would be decoded, and their bytes counted, by the wrong one, and the byte audit cannot see it.
    Returns whether a manifest names this tokenizer for every folder (where not, data.tokenizer.require_round_trip
    checks the ids against the tokenizer instead)."""
    vouched = True
    for folder in sorted({os.path.dirname(f) for f in files}):
        try:
            with open(os.path.join(folder, "manifest.json"), encoding="utf-8") as f:
                recorded = json.load(f).get("tokenizer_sha256")
        except (OSError, ValueError, AttributeError):  # none, or not a manifest of ours
            vouched = False
            continue
        vouched = vouched and recorded == tokenizer_sha256
        if recorded and recorded != tokenizer_sha256:
            raise ShardError(f"{folder or '.'}: its manifest.json says these shards were made with another tokenizer "
                             f"(sha256 {str(recorded)[:12]}…) than {tokenizer} ({tokenizer_sha256[:12]}…) (hint: "
                             "the tokenizer the folder was prepared with, usually the one inside it)")
    return vouched


SAMPLE_BYTES = 1 << 16


def file_sample(path: str, sample_bytes: int = SAMPLE_BYTES) -> str:
    """A digest of one shard's size and its first and last `sample_bytes` (128 KB read, not the shard)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        h.update(size.to_bytes(8, "little") + fh.read(sample_bytes))
        fh.seek(max(size - sample_bytes, 0))
        h.update(fh.read(sample_bytes))
    return h.hexdigest()[:16]


def sample_digest(samples: list[str]) -> str:
    """One digest of a set of shards from their `file_sample`s, in any order (paths and their order may differ
    between machines). It differs between sets of equal count and sizes (FineWeb's shards 0-79 and 80-159 hold
    100M tokens each); the seed tools compare it where the paths differ."""
    return hashlib.sha256("".join(sorted(samples)).encode()).hexdigest()[:16]


def require_token_ids(tokens: np.ndarray, vocab_size: int, shards: str, vocabulary: str) -> None:
    """ShardError when a token id is past the vocabulary: the model's embedding would be indexed out of range, or
    the byte table read past its end. `vocabulary` says whose it is (the model's, the tokenizer's)."""
    if len(tokens) and int(tokens.max()) >= vocab_size:
        raise ShardError(f"{shards}: token id {int(tokens.max())} is outside {vocabulary} vocabulary of {vocab_size} "
                         "ids (hint: shards made with another tokenizer)")


def require_disjoint(train_files: list[str], val_files: list[str]) -> None:
    """ShardError when a training shard is a validation shard: the same file under any name (a symlink or hard
    link included), or an identical copy. A score on text the model trained on is no validation score, and GPTQ
    calibration reads the training shards as well. Only files of equal size are hashed."""
    def same(kind: str, train: str, val: str):
        raise ShardError(f"{train} is the validation shard {val} ({kind}; hint: data.train_files and data.val_files "
                         "must match different data, e.g. fineweb_train_*.bin and fineweb_val_*.bin)")
    inodes = {(st.st_dev, st.st_ino): f for f in val_files for st in [os.stat(f)]}
    for f in train_files:
        st = os.stat(f)
        if (st.st_dev, st.st_ino) in inodes:
            same("the same file", f, inodes[st.st_dev, st.st_ino])
    digests: dict[str, bytes] = {}

    def digest(path: str) -> bytes:
        if path not in digests:
            with open(path, "rb") as fh:
                digests[path] = hashlib.file_digest(fh, "sha256").digest()
        return digests[path]
    sizes = {}
    for f in val_files:
        sizes.setdefault(os.path.getsize(f), []).append(f)
    for f in train_files:
        for v in sizes.get(os.path.getsize(f), ()):
            if digest(f) == digest(v):
                same("an identical copy", f, v)


def count_documents(tokens: np.ndarray, chunk: int = 1 << 24) -> int:
    """Documents that start in `tokens` (one BOS each), counted in chunks so a memory-mapped shard is
    never materialized whole."""
    return sum(int(np.count_nonzero(tokens[i:i + chunk] == BOS_ID)) for i in range(0, len(tokens), chunk))
