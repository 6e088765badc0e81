"""SentencePiece tokenizers with the published sp1024 settings, text readers, and exact byte accounting.

    python -m data.tokenizer --input FILE... --vocab-size N --out PREFIX

Text files: `.txt` holds one document per non-empty line (lines end at "\n"; a "\r" before it is dropped, one
elsewhere stays in the text); `.jsonl`, `.jsonl.gz` and `.jsonl.xz` hold one JSON object per line with the
document in its "text" field. Documents that are empty or only whitespace are skipped in both.
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import lzma
import os
import sys
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import sentencepiece as spm

from data.files import write_atomic
from data.shards import BOS_ID

# The settings of the official parameter-golf tokenizers (read from their model protos).
PUBLISHED_SETTINGS = dict(
    model_type="bpe", byte_fallback=True, split_digits=True, normalization_rule_name="nmt_nfkc",
    add_dummy_prefix=False, pad_id=0, bos_id=1, eos_id=2, unk_id=3, character_coverage=0.999,
    hard_vocab_limit=False,
)
TEXT_SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".jsonl.xz")
SPACE = "▁"  # SentencePiece's whitespace symbol


class TokenizerError(ValueError):
    """A tokenizer file that SentencePiece cannot load, or a training that cannot give what was asked."""


def _open_text(path: Path) -> io.TextIOBase:
    """Lines end at "\n" only: universal newlines would also cut a document at a lone "\r"."""
    name = path.name
    if name.endswith(".xz"):
        return lzma.open(path, "rt", encoding="utf-8", newline="\n")
    if name.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8", newline="\n")
    return open(path, encoding="utf-8", newline="\n")


def iter_texts(paths: list[str | os.PathLike]) -> Iterator[str]:
    """Documents from text files, in file order then line order (see the module docstring)."""
    for path in map(Path, paths):
        if not path.name.endswith(TEXT_SUFFIXES):
            raise ValueError(f"{path}: unsupported file kind; expected one of {', '.join(TEXT_SUFFIXES)}")
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such text file")
        try:
            yield from _documents(path)
        except (EOFError, lzma.LZMAError, gzip.BadGzipFile, zlib.error, UnicodeDecodeError) as exc:  # truncated, corrupt, binary
            raise ValueError(f"{path}: cannot be read as {path.name.split('.', 1)[-1]} text "
                             f"({type(exc).__name__}: {exc})") from None


def _documents(path: Path) -> Iterator[str]:
    is_jsonl = not path.name.endswith(".txt")
    with _open_text(path) as f:
        for line_no, line in enumerate(f, 1):
            line = line.removesuffix("\n").removesuffix("\r")
            if not line.strip():
                continue
            if not is_jsonl:
                yield line
                continue
            try:
                text = json.loads(line)["text"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{line_no}: expected a JSON object with a \"text\" string field "
                                 f"({type(exc).__name__}: {exc})") from None
            if not isinstance(text, str):
                raise ValueError(f"{path}:{line_no}: \"text\" must be a string, got {type(text).__name__}")
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:  # valid JSON ("\ud800"), yet no text: SentencePiece fails naming nothing
                raise ValueError(f"{path}:{line_no}: \"text\" holds a lone surrogate, not Unicode text ({exc})") from None
            if text.strip():
                yield text


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def training_pieces(texts: Iterator[str], max_bytes: int) -> Iterator[str]:
    """Documents for the tokenizer trainer, those over `max_bytes` UTF-8 bytes cut into pieces that fit: at a line
    break, else at a space, in the second half of the allowed length, else at a character boundary. SentencePiece
    skips longer sentences without a word: on the shared training mix, 51% of the bytes (docs/journal.md)."""
    for text in texts:
        data = text.encode("utf-8")
        while len(data) > max_bytes:
            cut = max_bytes
            while data[cut] & 0xC0 == 0x80:  # data[cut] continues a character: cut before that character
                cut -= 1
            for separator in (b"\n", b" "):
                at = data.rfind(separator, cut // 2, cut)
                if at > 0:
                    cut = at + 1
                    break
            if data[:cut].strip():
                yield data[:cut].decode("utf-8")
            data = data[cut:]
        if data.strip():
            yield data.decode("utf-8")


def train_tokenizer(inputs: list[str], vocab_size: int, out_prefix: str, *, num_threads: int | None = None,
                    max_sentence_length: int = 4192) -> str:
    """Train a BPE tokenizer with the published settings on the documents of `inputs`.

    Writes PREFIX.model and PREFIX.vocab (each renamed into place once complete) and returns the
    .model path. Documents longer than `max_sentence_length` bytes (SentencePiece's limit) are cut into
    pieces that fit (training_pieces). The model file records its trainer options, `num_threads`
    (default: all cores) among them: fix it to get byte-identical models on different machines.
    """
    if max_sentence_length < 16:
        raise ValueError(f"max_sentence_length must be >= 16 bytes, got {max_sentence_length}")
    if vocab_size < 256 + 4 + 1:
        raise ValueError(f"vocab_size {vocab_size} is too small: byte fallback alone needs 256 byte pieces "
                         "plus 4 control ids, and at least one merged piece")
    out_prefix = str(out_prefix)  # write_atomic makes its folder once there is something to write
    proto, failed = io.BytesIO(), []

    def texts() -> Iterator[str]:  # SentencePiece turns an error raised here into its own, naming no line
        try:
            empty = True
            for piece in training_pieces(iter_texts(inputs), max_sentence_length):
                empty = False
                yield piece
            if empty:  # SentencePiece's own words for it: "[!sentences_.empty()]"
                raise TokenizerError(f"the inputs ({', '.join(map(str, inputs))}) hold no documents; nothing was "
                                     "written (hint: empty and whitespace-only lines or texts are skipped)")
        except Exception as e:
            failed.append(e)
            raise
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=texts(), model_writer=proto,
            vocab_size=vocab_size, num_threads=num_threads or os.cpu_count() or 1,
            max_sentence_length=max_sentence_length, minloglevel=2, **PUBLISHED_SETTINGS)
    except RuntimeError:
        if failed:
            raise failed[0] from None
        raise
    sp = spm.SentencePieceProcessor(model_proto=proto.getvalue())
    if sp.piece_to_id(SPACE) == sp.unk_id():
        raise TokenizerError(f"the inputs hold no spaces, so the tokenizer has no {SPACE!r} piece and would count "
                             "each space as 3 bytes; nothing was written (hint: train on ordinary text)")
    if sp.get_piece_size() != vocab_size:  # too little text: SentencePiece stops early without saying so
        raise TokenizerError(f"the inputs give {sp.get_piece_size()} pieces, not the vocab_size={vocab_size} asked "
                             f"for; nothing was written (hint: train on more text, or ask for at most "
                             f"{sp.get_piece_size()})")
    vocab = "".join(f"{sp.id_to_piece(i)}\t{sp.get_score(i):g}\n" for i in range(sp.get_piece_size()))
    write_atomic(out_prefix + ".vocab", vocab.encode("utf-8"))
    write_atomic(out_prefix + ".model", proto.getvalue())
    return out_prefix + ".model"


ROUND_TRIP_DOCS = 64   # validation documents the tokenizer check decodes and encodes again
ROUND_TRIP_SHARE = 0.5  # the share of them that must come back as the same ids


def require_round_trip(tokens: np.ndarray, sp: spm.SentencePieceProcessor, shards: str, tokenizer: str,
                       bos_id: int = 1) -> None:
    """TokenizerError unless most documents of `tokens` are what `sp` makes of their own decoded text.

    Shards written by a tokenizer hold its canonical segmentation of each document, so decoding and encoding again
    gives the same ids back (every one of 64 FineWeb documents, with each official tokenizer). Decoded with
    another tokenizer of the same vocabulary size the ids make other text, and its own encoding of that text
    differs (7 of 64 demo documents came back): the byte audit cannot see it, since the same wrong tokenizer both
    decodes and counts, and the score would be in the wrong bytes. This is the check where no manifest records
    which tokenizer made the shards."""
    starts = np.flatnonzero(tokens == bos_id)
    docs = [d[1:].tolist() for d in np.split(tokens, starts)[1:ROUND_TRIP_DOCS + 1] if len(d) > 1]
    if not docs:
        return
    same = sum(sp.encode(sp.decode(ids)) == ids for ids in docs)
    if same < ROUND_TRIP_SHARE * len(docs):
        raise TokenizerError(f"{shards}: decoded with {tokenizer} and encoded again, {len(docs) - same} of the first "
                             f"{len(docs)} documents come back as other ids: these shards were made with another "
                             "tokenizer (hint: the tokenizer the shards were prepared with; data.prepare records "
                             "it in the folder's manifest.json)")


def load_sp(model_path_or_sp) -> spm.SentencePieceProcessor:
    if isinstance(model_path_or_sp, spm.SentencePieceProcessor):
        return model_path_or_sp
    path = Path(model_path_or_sp)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such tokenizer model (hint: data.tokenizer in the config, or "
                                "`python -m data.download` / `python -m data.demo`)")
    try:
        return spm.SentencePieceProcessor(model_file=str(path))
    except (RuntimeError, OSError) as e:  # SentencePiece's "could not parse ModelProto" names no file
        raise TokenizerError(f"{path}: not a SentencePiece model ({str(e).strip()}; hint: pass the .model file, "
                             "not the .vocab)") from None


@dataclass
class ByteLUT:
    """Per-id byte accounting (docs/legality.md, bits per byte); arrays of length vocab_size."""
    base_bytes: np.ndarray          # int16: UTF-8 bytes of the piece without its leading "▁"
    has_leading_space: np.ndarray   # bool: piece starts with "▁" (one more byte unless after a boundary)
    is_boundary: np.ndarray         # bool: control / unknown / unused ids (BOS among them)


def build_byte_lut(model_path_or_sp) -> ByteLUT:
    """Bytes each token decodes to. Control, unknown and unused ids: 0 bytes and boundaries. Byte-fallback
    pieces <0xNN>: 1 byte. Others: UTF-8 length of the piece with a leading "▁" removed (any other "▁"
    decodes to a 1-byte space), plus one for the leading "▁" unless the previous token is a boundary --
    SentencePiece drops that space at the start of a decoded document."""
    sp = load_sp(model_path_or_sp)
    if sp.piece_to_id(SPACE) == sp.unk_id():  # a space would decode as "▁", 3 bytes
        raise TokenizerError(f"{model_path_or_sp}: no standalone {SPACE!r} piece, so byte fallback spells each space "
                             "as the 3 bytes of U+2581 and bits per byte would be counted against the wrong text "
                             "(hint: use a tokenizer trained on text with spaces)")
    if sp.bos_id() != BOS_ID or not sp.is_control(BOS_ID):  # every document starts with it, a 0-byte boundary
        raise TokenizerError(f"{model_path_or_sp}: bos_id is {sp.bos_id()} and id {BOS_ID} is "
                             f"{sp.id_to_piece(BOS_ID)!r}; shards need the BOS control token at id {BOS_ID} (hint: train "
                             "it with python -m data.tokenizer, which uses the published settings)")
    vocab = sp.get_piece_size()
    base = np.zeros(vocab, dtype=np.int16)
    space = np.zeros(vocab, dtype=bool)
    boundary = np.zeros(vocab, dtype=bool)
    for i in range(vocab):
        if sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i):
            boundary[i] = True
        elif sp.is_byte(i):
            base[i] = 1
        else:
            piece = sp.id_to_piece(i)
            if piece.startswith("▁"):
                space[i] = True
                piece = piece[1:]
            base[i] = len(piece.replace("▁", " ").encode("utf-8"))
    return ByteLUT(base_bytes=base, has_leading_space=space, is_boundary=boundary)


def count_target_bytes(prev_ids: np.ndarray, target_ids: np.ndarray, lut: ByteLUT) -> np.ndarray:
    """UTF-8 bytes of each target token given the token before it (int64, same shape as target_ids)."""
    prev_ids, target_ids = np.asarray(prev_ids), np.asarray(target_ids)
    if prev_ids.shape != target_ids.shape:
        raise ValueError(f"prev_ids {prev_ids.shape} and target_ids {target_ids.shape} must have the same shape")
    extra = lut.has_leading_space[target_ids] & ~lut.is_boundary[prev_ids]
    return lut.base_bytes[target_ids].astype(np.int64) + extra


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Train a SentencePiece BPE tokenizer with the published sp1024 "
                                "settings (byte fallback, split digits, nmt_nfkc, no dummy prefix).")
    p.add_argument("--input", nargs="+", required=True, help="text files: .txt, .jsonl, .jsonl.gz, .jsonl.xz")
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--out", required=True, help="output prefix: writes PREFIX.model and PREFIX.vocab")
    p.add_argument("--num-threads", type=int, default=None,
                   help="trainer threads (default: all cores); the model file records it, so fix it for "
                        "byte-identical models across machines")
    p.add_argument("--max-sentence-length", type=int, default=4192,
                   help="longest training piece in UTF-8 bytes; longer documents are cut to fit (default 4192)")
    args = p.parse_args(argv)
    if args.num_threads is not None and args.num_threads < 1:
        p.error(f"--num-threads must be >= 1, got {args.num_threads}")
    try:
        model = train_tokenizer(args.input, args.vocab_size, args.out, num_threads=args.num_threads,
                                max_sentence_length=args.max_sentence_length)
    except (ValueError, OSError) as exc:  # TokenizerError and a bad input line included
        sys.exit(f"data.tokenizer: {exc}")
    except RuntimeError as exc:  # SentencePiece's own checks, e.g. more distinct characters than vocab
        sys.exit(f"data.tokenizer: SentencePiece training failed: {str(exc).splitlines()[-1]}")
    print(json.dumps({"model": model, "vocab_size": args.vocab_size, "sha256": file_sha256(model)}))


if __name__ == "__main__":
    main()
