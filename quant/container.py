"""The artifact file: a versioned, hashed, pickle-free container of quantized weights.

Layout (all integers little-endian):
    magic        8 bytes  b"MHCGOLF\\x00"
    version      u32      FORMAT_VERSION
    header_len   u32      bytes of the compressed header
    payload_len  u64      bytes of the payload
    header       JSON (UTF-8): {"codec", "meta", "tensors": [entry, ...]}, xz-compressed (lzma: the
                 standard library reads it whatever the payload codec; 8,277 -> 1,204 bytes for a
                 demo model's 55 tensors, and the header grows with the tensor count)
    payload      one chunk per tensor, in table order, back to back; a chunk is the tensor's raw bytes cut
                 into pieces of PIECE_BYTES (the last shorter), each compressed on its own, back to back
    sha256       32 bytes over everything above
Entry: name, shape, offset/nbytes (the chunk in the payload), pieces (each piece's compressed bytes),
raw_nbytes (decompressed) and either
kind "quant" (bits, layout, scale_offset: codes first, then byte-shuffled fp16 scales) or kind
"array" (dtype; stored as-is: the exporter picks fp16/fp32).

Per-tensor chunks instead of one compressed stream: measured on brotli-11 the total differs by bytes
(brotli's window is a few MB anyway), and it makes the artifact size exactly additive, so the bit
allocator can price every (tensor, width) once and build candidate artifacts from cached chunks.
Pieces of 1 MiB: Brotli-11 compresses about 1 MB/s on one core, so the 4.2 MB embedding of a vocab-8192
model was the export's critical path; in 1 MiB pieces it compresses on four cores, for 0.015% more bytes
(measured on Gaussian codes: 1,982,527 against 1,982,231 B).

Loading never executes code: only struct, json, numpy.frombuffer and the decompressor touch the bytes,
and the hash is checked before anything is parsed. The sha256 detects corruption and truncation, not a
deliberate forgery (anyone can recompute it); structure checks still bound what a forged file can do.
"""
from __future__ import annotations

import hashlib
import json
import lzma
import math
import os
import struct
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from data.files import write_atomic
from quant.pack import LAYOUTS, WIDTHS, QuantizedTensor, check_grid, decode_codes, decode_scales, encode_codes, \
    encode_scales, encoded_codes_size

MAGIC = b"MHCGOLF\x00"
FORMAT_VERSION = 3  # 2: compressed header; 3: chunks in pieces
PIECE_BYTES = 1 << 20
CODECS = ("brotli", "lzma")
ARRAY_DTYPES = ("float16", "float32", "int32", "int64", "bool")
_PREFIX = struct.Struct("<8sIIQ")
_HASH_LEN = 32
MAX_HEADER_BYTES = 16 << 20  # a decompressed header larger than this is refused (a forged file cannot balloon)
MAX_RAW_BYTES = 256 << 20    # nor can the tensors: 16 MB of artifact holds about 25 MB of quantized weights
MAX_DIMS = 8                 # dimensions of a stored tensor (the model's have at most 2)


class ArtifactError(ValueError):
    """An artifact file is malformed, truncated, corrupted or of an unknown version."""


class CodecUnavailable(RuntimeError):
    """The module a codec needs is not installed."""


# -- codecs -------------------------------------------------------------------------------------------

def _brotli():
    try:
        import brotli
    except ImportError as exc:  # the GPU machines may lack it: say what to do instead
        raise CodecUnavailable("the brotli module is not installed; hint: `pip install brotli` (it writes and "
                               "reads the artifacts)") from exc
    if not hasattr(brotli.Decompressor(), "can_accept_more_data"):  # 1.2 bounds the output
        raise CodecUnavailable(f"brotli {getattr(brotli, '__version__', '?')} cannot bound its output; hint: "
                               "`pip install -U 'brotli>=1.2'` (reading an artifact stops at each tensor's size)")
    return brotli


def require_codec(codec: str) -> None:
    """Fail now if `codec` cannot compress here: a run checks at setup what its export will need, instead of
    losing the artifact of a whole training run to a missing module."""
    compress(b"", codec)


def compress(data: bytes, codec: str) -> bytes:
    if codec == "brotli":
        return _brotli().compress(data, quality=11)
    if codec == "lzma":
        return lzma.compress(data, preset=9 | lzma.PRESET_EXTREME)
    raise ValueError(f"unknown codec {codec!r}; expected one of {CODECS}")


def decompress(data: bytes, codec: str, size: int) -> bytes:
    """`data` decompressed, which must be exactly `size` bytes: the output stops growing soon past `size`, so a
    forged chunk cannot balloon in memory (a 1.6 KB brotli chunk can hold 1 GiB of zeros). ValueError otherwise."""
    if codec == "brotli":
        brotli = _brotli()
        decoder = brotli.Decompressor()
        try:
            raw = decoder.process(data, output_buffer_limit=size + 1)
        except brotli.error as exc:
            raise ValueError(f"not a brotli stream ({exc})") from None
        done = decoder.is_finished()
    elif codec == "lzma":
        decoder = lzma.LZMADecompressor()
        try:
            raw = decoder.decompress(data, max_length=size + 1)
        except lzma.LZMAError as exc:
            raise ValueError(f"not an xz/lzma stream ({exc})") from None
        done = decoder.eof and not decoder.unused_data
    else:
        raise ValueError(f"unknown codec {codec!r}; expected one of {CODECS}")
    if len(raw) > size:
        raise ValueError(f"decompresses to more than the {size} bytes declared")
    if not done or len(raw) != size:
        raise ValueError(f"decompressed to {len(raw)} bytes, expected {size} (cut short or followed by stray bytes)")
    return raw


# -- writing ------------------------------------------------------------------------------------------

def encode_tensor(name: str, value, layout: str) -> tuple[dict, bytes]:
    """Table entry (without offsets) and the uncompressed bytes of one tensor."""
    if isinstance(value, QuantizedTensor):
        codes = encode_codes(value.codes, value.bits, layout)
        raw = codes + encode_scales(value.scales)
        entry = {"name": name, "kind": "quant", "shape": list(value.shape), "bits": value.bits,
                 "layout": layout, "scale_offset": len(codes),
                 **({"family": value.family, "step": value.step} if value.family else {})}
    elif isinstance(value, np.ndarray):
        if value.dtype.name not in ARRAY_DTYPES:
            raise TypeError(f"tensor {name!r}: dtype {value.dtype} cannot be stored; expected one of {ARRAY_DTYPES} "
                            "(hint: convert floats to float16/float32 first)")
        raw = np.ascontiguousarray(value).astype(value.dtype.newbyteorder("<"), copy=False).tobytes()
        entry = {"name": name, "kind": "array", "shape": list(value.shape), "dtype": value.dtype.name}
    else:
        raise TypeError(f"tensor {name!r}: expected QuantizedTensor or numpy array, got {type(value).__name__}")
    entry["raw_nbytes"] = len(raw)
    return entry, raw


class ChunkCache:
    """Compressed chunks keyed by (tensor object, codec, layout); holds a reference to each value so
    its id cannot be reused while cached. Lets the allocator build many candidate artifacts cheaply."""

    def __init__(self):
        self._chunks: dict[tuple, tuple[object, dict, bytes]] = {}

    def get(self, items: list[tuple[str, object]], codec: str, layout: str, threads: int) -> list[tuple[dict, bytes]]:
        missing = {id(v): (n, v) for n, v in items if (id(v), codec, layout) not in self._chunks}
        if missing:  # brotli and lzma release the GIL: threads compress the pieces in parallel
            encoded = {key: encode_tensor(name, value, layout) for key, (name, value) in missing.items()}
            jobs = [(key, raw[i:i + PIECE_BYTES]) for key, (_, raw) in encoded.items()
                    for i in range(0, max(len(raw), 1), PIECE_BYTES)]
            with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
                compressed = list(pool.map(lambda job: compress(job[1], codec), jobs))
            pieces: dict[int, list[bytes]] = {}
            for (key, _), piece in zip(jobs, compressed):
                pieces.setdefault(key, []).append(piece)
            for key, (_, value) in missing.items():
                entry = {**encoded[key][0], "pieces": [len(p) for p in pieces[key]]}
                self._chunks[(key, codec, layout)] = (value, entry, b"".join(pieces[key]))
        out = []
        for name, value in items:
            _, entry, chunk = self._chunks[(id(value), codec, layout)]
            out.append(({**entry, "name": name}, chunk))
        return out


def check_meta(meta: dict) -> None:
    if not isinstance(meta, dict):
        raise TypeError(f"artifact meta must be a dict, got {type(meta).__name__}")
    if not isinstance(meta.get("model_config"), dict):
        raise ValueError("artifact meta needs 'model_config': the model config dict (dataclasses.asdict(cfg))")
    sha = meta.get("tokenizer_sha256")
    if not (isinstance(sha, str) and len(sha) == 64 and all(c in "0123456789abcdef" for c in sha)):
        raise ValueError(f"artifact meta needs 'tokenizer_sha256': 64 lowercase hex digits, got {sha!r}")


def build_artifact(meta: dict, quantized: dict, codec: str = "brotli", layout: str = "byte",
                   cache: ChunkCache | None = None, threads: int = 0) -> bytes:
    """The complete artifact file as bytes. threads 0 = one per CPU."""
    check_meta(meta)
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}; expected one of {CODECS}")
    if layout not in LAYOUTS:
        raise ValueError(f"unknown code layout {layout!r}; expected one of {LAYOUTS}")
    cache = cache if cache is not None else ChunkCache()
    chunks = cache.get(list(quantized.items()), codec, layout, threads or os.cpu_count() or 1)
    entries, offset = [], 0
    for entry, chunk in chunks:
        entries.append({**entry, "offset": offset, "nbytes": len(chunk)})
        offset += len(chunk)
    try:
        header = lzma.compress(json.dumps({"codec": codec, "meta": meta, "tensors": entries},
                                          separators=(",", ":"), allow_nan=False).encode(),
                               preset=9 | lzma.PRESET_EXTREME)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"artifact meta is not plain JSON (dicts, lists, str, finite numbers): {exc}") from exc
    body = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(header), offset) + header + b"".join(c for _, c in chunks)
    return body + hashlib.sha256(body).digest()


def save_artifact(path: str | os.PathLike, meta: dict, quantized: dict, codec: str = "brotli",
                  layout: str = "byte", cache: ChunkCache | None = None) -> int:
    """Write the artifact atomically; returns the bytes written (the file's size)."""
    data = build_artifact(meta, quantized, codec, layout, cache)
    write_atomic(path, data)
    return len(data)


# -- reading ------------------------------------------------------------------------------------------

def load_artifact(path: str | os.PathLike, stored: bool = False, expect=None) -> tuple[dict, dict]:
    """(meta, tensors): float tensors dequantized to fp32, ready for model.load_state_dict; or with
    stored=True the values as stored (QuantizedTensor codes + scales, numpy arrays), for tools that
    study the payload itself (scripts/bench_compress.py --artifact). expect(meta, entries), when given, runs
    on the verified header before any tensor is decompressed (scripts/evaluate.py matches it to the model)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such artifact (hint: train.py writes <train.out_dir>/<run_id>.mhcg)")
    size = os.path.getsize(path)
    if size > MAX_RAW_BYTES:  # read before any check: a multi-GB file would be held in memory whole
        raise ArtifactError(f"{path}: {size:,} bytes, more than the {MAX_RAW_BYTES:,} any artifact's tensors may "
                            "declare (hint: is this an artifact? train.py writes <train.out_dir>/<run_id>.mhcg)")
    with open(path, "rb") as f:
        data = f.read()
    return parse_artifact(data, os.fspath(path), stored, expect)


def parse_artifact(data: bytes, path: str, stored: bool = False, expect=None) -> tuple[dict, dict]:
    """load_artifact on the file's bytes (`path` names them in errors): to check an artifact before it is
    written over an older one."""
    header, payload = _verified_parts(path, data)
    if expect is not None:
        expect(header["meta"], header["tensors"])
    tensors = {}
    for entry in header["tensors"]:
        chunk = payload[entry["offset"]:entry["offset"] + entry["nbytes"]]
        try:
            raw, start = [], 0
            for i, nbytes in enumerate(entry["pieces"]):
                size = min(PIECE_BYTES, entry["raw_nbytes"] - i * PIECE_BYTES)
                raw.append(decompress(chunk[start:start + nbytes], header["codec"], size))
                start += nbytes
            tensors[entry["name"]] = _decode_entry(entry, b"".join(raw), stored)
        except ValueError as exc:
            raise ArtifactError(f"{path}: tensor {entry['name']!r} is invalid: {exc}") from exc
    return header["meta"], tensors


def _verified_parts(path: str, data: bytes) -> tuple[dict, bytes]:
    if len(data) < _PREFIX.size + _HASH_LEN:
        raise ArtifactError(f"{path}: truncated: {len(data)} bytes, an artifact has at least {_PREFIX.size + _HASH_LEN}")
    magic, version, header_len, payload_len = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise ArtifactError(f"{path}: not an mhcgolf artifact (magic {magic!r}, expected {MAGIC!r})")
    if version != FORMAT_VERSION:
        raise ArtifactError(f"{path}: unsupported artifact format version {version}; this code reads version "
                            f"{FORMAT_VERSION} (hint: load it with the code that wrote it)")
    expected = _PREFIX.size + header_len + payload_len + _HASH_LEN
    if len(data) != expected:
        raise ArtifactError(f"{path}: truncated or padded: {len(data)} bytes, the prefix says {expected}")
    body, digest = data[:-_HASH_LEN], data[-_HASH_LEN:]
    actual = hashlib.sha256(body).digest()
    if actual != digest:
        raise ArtifactError(f"{path}: integrity check failed: sha256 of header+payload is {actual.hex()}, "
                            f"the file records {digest.hex()} (corrupted file)")
    text = _decompress_header(path, body[_PREFIX.size:_PREFIX.size + header_len])  # its own ArtifactError
    try:
        header = json.loads(text.decode())
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # RecursionError: [[[[...; ValueError:
        # JSONDecodeError, and an integer of more than 4,300 digits
        raise ArtifactError(f"{path}: header is not valid JSON: {exc}") from None
    payload = body[_PREFIX.size + header_len:]
    _check_header(path, header, len(payload))
    return header, payload


def _decompress_header(path: str, raw: bytes) -> bytes:
    decompressor = lzma.LZMADecompressor(format=lzma.FORMAT_XZ)
    try:
        text = decompressor.decompress(raw, max_length=MAX_HEADER_BYTES)
    except lzma.LZMAError as exc:
        raise ArtifactError(f"{path}: the header does not decompress (xz): {exc}") from exc
    if not decompressor.eof or decompressor.unused_data:
        raise ArtifactError(f"{path}: the header is cut short, followed by stray bytes, or decompresses to more "
                            f"than {MAX_HEADER_BYTES} bytes")
    return text


def _check_header(path: str, header, payload_len: int) -> None:
    def bad(msg: str):
        raise ArtifactError(f"{path}: malformed header: {msg}")
    if not isinstance(header, dict) or header.get("codec") not in CODECS or not isinstance(header.get("tensors"), list):
        bad(f"expected an object with codec in {CODECS} and a tensors list")
    if not isinstance(header.get("meta"), dict):
        bad("expected a meta object")
    offset, names = 0, set()
    for entry in header["tensors"]:
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or entry["name"] in names:
            bad(f"tensor entry {entry!r} lacks a unique string name")
        names.add(entry["name"])
        ints = ("offset", "nbytes", "raw_nbytes")
        shape = entry.get("shape")
        if not all(type(entry.get(k)) is int and entry[k] >= 0 for k in ints) or not isinstance(shape, list) \
                or not all(type(s) is int and s >= 0 for s in shape):
            bad(f"tensor {entry['name']!r} needs non-negative integer {ints} and shape")
        # Bounded before any arithmetic on them: the product of thousands of 4,000-digit dimensions took minutes,
        # and no stored tensor has more than MAX_RAW_BYTES of anything.
        if len(shape) > MAX_DIMS or any(v > MAX_RAW_BYTES for v in [*shape, *(entry[k] for k in ints)]):
            bad(f"tensor {entry['name']!r} declares {len(shape)} dimensions or a size past {MAX_RAW_BYTES:,} "
                f"(at most {MAX_DIMS} dimensions, each size at most that)")
        if entry["offset"] != offset:
            bad(f"tensor {entry['name']!r} starts at {entry['offset']}, expected {offset} (chunks are contiguous)")
        offset += entry["nbytes"]
        if entry.get("raw_nbytes") != _expected_raw_nbytes(entry):
            bad(f"tensor {entry['name']!r}: raw_nbytes or its kind/bits/layout/dtype/scale_offset are inconsistent")
        try:  # a step is a description, but a forged one must not reach the tools that read it
            check_grid(entry.get("family", ""), entry.get("step", 0.0))
        except ValueError as exc:
            bad(f"tensor {entry['name']!r}: {exc}")
    if offset != payload_len:
        bad(f"chunks cover {offset} bytes but the payload has {payload_len}")
    declared = sum(entry["raw_nbytes"] for entry in header["tensors"])
    if declared > MAX_RAW_BYTES:
        bad(f"its tensors declare {declared:,} bytes, more than the {MAX_RAW_BYTES:,} any artifact under the cap "
            "expands to (quantized weights compress about 1.5x)")
    for entry in header["tensors"]:
        pieces = entry.get("pieces")
        if not isinstance(pieces, list) or len(pieces) != max(1, -(-entry["raw_nbytes"] // PIECE_BYTES)) or \
                not all(type(p) is int and p >= 0 for p in pieces) or sum(pieces) != entry["nbytes"]:
            bad(f"tensor {entry['name']!r}: pieces must list the compressed size of each {PIECE_BYTES:,}-byte piece "
                "of its raw bytes, summing to nbytes")


def _expected_raw_nbytes(entry: dict) -> int | None:
    shape = entry["shape"]
    count = math.prod(shape)  # Python integers: np.prod wraps around at 2**63 (a [2**62, 4] shape made 0)
    if entry.get("kind") == "quant":
        if len(shape) != 2 or type(entry.get("bits")) is not int or entry["bits"] not in WIDTHS \
                or entry.get("layout") not in LAYOUTS or type(entry.get("scale_offset")) is not int:
            return None
        codes = encoded_codes_size(count, entry["bits"], entry["layout"])
        return codes + 2 * shape[0] if entry["scale_offset"] == codes else None
    if entry.get("kind") == "array" and entry.get("dtype") in ARRAY_DTYPES:
        return count * np.dtype(entry["dtype"]).itemsize
    return None


def _decode_entry(entry: dict, raw: bytes, stored: bool = False):
    shape = entry["shape"]
    if entry["kind"] == "quant":
        split = entry["scale_offset"]
        codes = decode_codes(raw[:split], entry["bits"], entry["layout"], shape[0] * shape[1])
        scales = decode_scales(raw[split:], shape[0])
        if not np.isfinite(scales).all():  # the exporter never writes one: a forged or damaged file
            raise ValueError("its scales hold NaN or Inf")
        qt = QuantizedTensor(codes.reshape(shape), scales, entry["bits"], entry.get("family", ""),
                             entry.get("step", 0.0))
        return qt if stored else qt.dequantize()
    array = np.frombuffer(raw, dtype=np.dtype(entry["dtype"]).newbyteorder("<")).reshape(shape)
    array = array.astype(array.dtype.newbyteorder("="))
    if array.dtype.kind == "f" and not np.isfinite(array).all():
        raise ValueError("it holds NaN or Inf")
    if stored:
        return array
    tensor = torch.from_numpy(array)
    return tensor.float() if tensor.is_floating_point() else tensor


def dequantize_state(quantized: dict) -> dict[str, torch.Tensor]:
    """What load_artifact returns for `quantized`, computed in memory (same decoding rules)."""
    out = {}
    for name, value in quantized.items():
        if isinstance(value, QuantizedTensor):
            out[name] = value.dequantize()
        else:
            tensor = torch.from_numpy(np.array(value))
            out[name] = tensor.float() if tensor.is_floating_point() else tensor
    return out
