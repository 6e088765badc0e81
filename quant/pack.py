"""Quantized tensors and their byte layouts (vectorized numpy, bit-exact round trips).

A QuantizedTensor is integer codes in [-qmax, qmax] (qmax = 2^(bits-1) - 1: int4 -> 7, int5 -> 15,
int6 -> 31, int8 -> 127) with one fp16 scale per row; its value is codes * scale, computed in fp32 by
`dequantize` (the one definition both the exporter and the loader use, so they agree bit for bit).

Codes are first zigzag-mapped to unsigned (0, -1, 1, -2, ... -> 0, 1, 2, 3, ...) and then laid out as:
  "byte"     one byte per code;
  "dense"    `bits` bits per code, packed little-endian (8 codes -> `bits` bytes);
  "bitplane" one packed 1-bit plane per bit, most significant plane first.
Measured with brotli-11 (scripts/bench_compress.py) "byte" compresses smallest: brotli's entropy
coder sees whole symbols, while dense packing splits symbols across byte boundaries and hides their
skewed distribution. The container defaults to "byte"; the others stay readable and benchmarkable.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

LAYOUTS = ("byte", "dense", "bitplane")
WIDTHS = (4, 5, 6, 8)


GRID_FAMILIES = ("", "std", "weighted")
MAX_STEP = 64.0  # a step of 64 row units leaves every code of a row at 0 or ±1: no grid is coarser


def check_grid(family, step) -> None:
    """A grid's description as the artifact records it; ValueError naming what is wrong."""
    if family not in GRID_FAMILIES:
        raise ValueError(f"grid family {family!r}: expected one of {GRID_FAMILIES}")
    if type(step) not in (int, float) or not 0 <= step <= MAX_STEP:  # NaN fails the comparison
        raise ValueError(f"grid step {step!r}: expected a number in [0, {MAX_STEP:g}]")


def qmax_for(bits: int) -> int:
    if bits not in WIDTHS:
        raise ValueError(f"bit width {bits} is not supported; expected one of {WIDTHS}")
    return (1 << (bits - 1)) - 1


@dataclass
class QuantizedTensor:
    codes: np.ndarray   # int8 [rows, cols], values in [-qmax, qmax]
    scales: np.ndarray  # float16 [rows]
    bits: int
    family: str = ""    # how the scales were chosen (quant/steps.py), recorded in the artifact for inspection
    step: float = 0.0   # the step of that family (scale / row base); 0 for the rank scheme's clip search

    def __post_init__(self) -> None:
        qmax = qmax_for(self.bits)
        if self.codes.dtype != np.int8 or self.codes.ndim != 2:
            raise ValueError(f"codes must be a 2-D int8 array, got {self.codes.dtype} {self.codes.shape}")
        if self.scales.dtype != np.float16 or self.scales.shape != (self.codes.shape[0],):
            raise ValueError(f"scales must be float16 [{self.codes.shape[0]}], got {self.scales.dtype} {self.scales.shape}")
        if self.codes.size and int(np.abs(self.codes.astype(np.int16)).max()) > qmax:
            raise ValueError(f"codes exceed the int{self.bits} range [-{qmax}, {qmax}]")
        check_grid(self.family, self.step)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self) -> torch.Tensor:
        """fp32 weights codes * scale (numpy fp32 multiply: deterministic on every machine)."""
        values = self.codes.astype(np.float32) * self.scales.astype(np.float32)[:, None]
        return torch.from_numpy(values)


# -- bit packing --------------------------------------------------------------------------------------

def pack_bits(values: np.ndarray, width: int) -> bytes:
    """Pack unsigned values < 2^width (width 1..8) densely: ceil(n * width / 8) bytes."""
    if not 1 <= width <= 8:
        raise ValueError(f"pack width must be 1..8, got {width}")
    flat = np.ascontiguousarray(values, dtype=np.uint8).ravel()
    if flat.size and int(flat.max()) >> width:
        raise ValueError(f"value {int(flat.max())} does not fit in {width} bits")
    n = flat.size
    if width == 8:
        return flat.tobytes()
    # 8 values of `width` bits make exactly `width` bytes: build each group as one uint64, keep its low bytes.
    groups = np.zeros(-(-n // 8) * 8, dtype=np.uint64)
    groups[:n] = flat
    groups = groups.reshape(-1, 8)
    shifts = np.arange(8, dtype=np.uint64) * np.uint64(width)
    words = np.bitwise_or.reduce(groups << shifts, axis=1)
    packed = words.view(np.uint8).reshape(-1, 8)[:, :width].ravel()  # little-endian byte order
    return packed[: (n * width + 7) // 8].tobytes()


def unpack_bits(data: bytes, width: int, count: int) -> np.ndarray:
    """Inverse of pack_bits: `count` uint8 values from `data` (which must be exactly the packed size)."""
    if not 1 <= width <= 8:
        raise ValueError(f"pack width must be 1..8, got {width}")
    expected = (count * width + 7) // 8
    if len(data) != expected:
        raise ValueError(f"packed data holds {len(data)} bytes, expected {expected} for {count} values of {width} bits")
    raw = np.frombuffer(data, dtype=np.uint8)
    if width == 8:
        return raw.copy()
    n_groups = -(-count // 8)
    group_bytes = np.zeros(n_groups * width, dtype=np.uint8)
    group_bytes[: raw.size] = raw
    padded = np.zeros((n_groups, 8), dtype=np.uint8)
    padded[:, :width] = group_bytes.reshape(n_groups, width)
    words = padded.view("<u8").ravel()
    shifts = np.arange(8, dtype=np.uint64) * np.uint64(width)
    values = (words[:, None] >> shifts) & np.uint64((1 << width) - 1)
    return values.astype(np.uint8).ravel()[:count]


# -- code layouts ---------------------------------------------------------------------------------------

def zigzag(codes: np.ndarray) -> np.ndarray:
    c = codes.astype(np.int16)
    return np.where(c >= 0, 2 * c, -2 * c - 1).astype(np.uint8)


def unzigzag(values: np.ndarray) -> np.ndarray:
    v = values.astype(np.int16)
    return np.where(v % 2 == 0, v // 2, -(v + 1) // 2).astype(np.int8)


def encoded_codes_size(count: int, bits: int, layout: str) -> int:
    """Bytes that encode_codes produces for `count` codes (used to validate artifacts)."""
    if layout == "byte":
        return count
    if layout == "dense":
        return (count * bits + 7) // 8
    if layout == "bitplane":
        return bits * ((count + 7) // 8)
    raise ValueError(f"unknown code layout {layout!r}; expected one of {LAYOUTS}")


def encode_codes(codes: np.ndarray, bits: int, layout: str) -> bytes:
    qmax_for(bits)
    u = zigzag(codes.ravel())
    if layout == "byte":
        return u.tobytes()
    if layout == "dense":
        return pack_bits(u, bits)
    if layout == "bitplane":
        return b"".join(np.packbits((u >> b) & 1).tobytes() for b in reversed(range(bits)))
    raise ValueError(f"unknown code layout {layout!r}; expected one of {LAYOUTS}")


def decode_codes(data: bytes, bits: int, layout: str, count: int) -> np.ndarray:
    """int8 codes (flat) from encode_codes output; raises ValueError on a size or range mismatch."""
    qmax = qmax_for(bits)
    expected = encoded_codes_size(count, bits, layout)
    if len(data) != expected:
        raise ValueError(f"{layout} codes hold {len(data)} bytes, expected {expected} for {count} int{bits} codes")
    if layout == "byte":
        u = np.frombuffer(data, dtype=np.uint8)
    elif layout == "dense":
        u = unpack_bits(data, bits, count)
    else:
        plane_bytes = (count + 7) // 8
        raw = np.frombuffer(data, dtype=np.uint8).reshape(bits, plane_bytes)
        planes = np.unpackbits(raw, axis=1)[:, :count]
        u = np.zeros(count, dtype=np.uint8)
        for plane, b in zip(planes, reversed(range(bits))):
            u |= plane << np.uint8(b)
    if u.size and int(u.max()) > 2 * qmax:
        raise ValueError(f"decoded code {int(u.max())} (zigzag) is outside the int{bits} range [-{qmax}, {qmax}]")
    return unzigzag(u)


# -- scales -------------------------------------------------------------------------------------------

def encode_scales(scales: np.ndarray) -> bytes:
    """fp16 scales byte-shuffled (all low bytes, then all high bytes): the high bytes (sign and
    exponent) of neighbouring rows are near-identical, which brotli exploits (~5% smaller)."""
    raw = np.ascontiguousarray(scales, dtype="<f2").view(np.uint8).reshape(-1, 2)
    return raw.T.tobytes()


def decode_scales(data: bytes, count: int) -> np.ndarray:
    if len(data) != 2 * count:
        raise ValueError(f"scales hold {len(data)} bytes, expected {2 * count} for {count} fp16 scales")
    raw = np.frombuffer(data, dtype=np.uint8).reshape(2, count)
    return np.ascontiguousarray(raw.T).view("<f2").ravel().astype(np.float16)
