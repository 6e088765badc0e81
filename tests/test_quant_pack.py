"""Bit packing and code layouts: bit-exact round trips at every width and length."""
import numpy as np
import pytest
import torch

from quant.pack import (LAYOUTS, QuantizedTensor, decode_codes, decode_scales, encode_codes, encode_scales,
                        encoded_codes_size, pack_bits, qmax_for, unpack_bits, unzigzag, zigzag)

LENGTHS = [0, 1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 63, 64, 65, 127, 1000, 1001, 4099]


@pytest.mark.parametrize("width", [4, 5, 6, 8])
@pytest.mark.parametrize("n", LENGTHS)
def test_pack_bits_round_trip_random(width, n):
    rng = np.random.default_rng(width * 10007 + n)
    values = rng.integers(0, 1 << width, n).astype(np.uint8)
    packed = pack_bits(values, width)
    assert len(packed) == (n * width + 7) // 8  # dense: no padding beyond the last partial byte
    np.testing.assert_array_equal(unpack_bits(packed, width, n), values)


@pytest.mark.parametrize("width", [4, 5, 6, 8])
def test_pack_bits_extremes_and_known_bytes(width):
    top = (1 << width) - 1
    for values in (np.full(13, top, np.uint8), np.zeros(13, np.uint8), np.array([top, 0] * 7, np.uint8)):
        np.testing.assert_array_equal(unpack_bits(pack_bits(values, width), width, values.size), values)
    # All ones packs to all-ones bytes except the unused high bits of the last byte.
    packed = pack_bits(np.full(3, top, np.uint8), width)
    assert packed[:-1] == b"\xff" * (len(packed) - 1)
    assert packed[-1] == (1 << ((3 * width - 1) % 8 + 1)) - 1


def test_pack_bits_little_endian_layout():
    # Two 5-bit values 0b00001, 0b00011 -> bits 1000011000 (LSB first) -> bytes 0x61, 0x00.
    assert pack_bits(np.array([1, 3], np.uint8), 5) == bytes([0b01100001, 0b00])


def test_pack_bits_rejects_bad_input():
    with pytest.raises(ValueError, match="does not fit in 5 bits"):
        pack_bits(np.array([32], np.uint8), 5)
    with pytest.raises(ValueError, match="1..8"):
        pack_bits(np.array([1], np.uint8), 9)
    with pytest.raises(ValueError, match="expected 4"):
        unpack_bits(b"\x00" * 3, 6, 5)


@pytest.mark.parametrize("bits", [4, 5, 6, 8])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_code_layouts_round_trip(bits, layout):
    qmax = qmax_for(bits)
    rng = np.random.default_rng(bits)
    for n in LENGTHS:
        codes = rng.integers(-qmax, qmax + 1, n).astype(np.int8)
        if n >= 2:  # both extremes present
            codes[0], codes[1] = -qmax, qmax
        data = encode_codes(codes, bits, layout)
        assert len(data) == encoded_codes_size(n, bits, layout)
        np.testing.assert_array_equal(decode_codes(data, bits, layout, n), codes)


def test_zigzag_is_a_bijection_on_int8_codes():
    codes = np.arange(-127, 128, dtype=np.int8)
    u = zigzag(codes)
    assert sorted(u.tolist()) == list(range(255))
    np.testing.assert_array_equal(unzigzag(u), codes)


def test_decode_codes_rejects_out_of_range_and_bad_sizes():
    with pytest.raises(ValueError, match="outside the int5 range"):
        decode_codes(bytes([31]), 5, "byte", 1)  # zigzag 31 = -16
    with pytest.raises(ValueError, match="expected 6"):
        decode_codes(b"\x00" * 5, 6, "bitplane", 8)
    with pytest.raises(ValueError, match="unknown code layout"):
        encode_codes(np.zeros(3, np.int8), 5, "nibble")


def test_scales_round_trip_bit_exact():
    scales = np.array([1e-4, 0.5, 65504.0, 6e-8, 0.0, 0.0123], dtype=np.float16)
    out = decode_scales(encode_scales(scales), scales.size)
    assert out.dtype == np.float16
    assert out.tobytes() == scales.tobytes()


def test_quantized_tensor_validation_and_dequantize():
    qt = QuantizedTensor(np.array([[-15, 15], [1, 0]], np.int8), np.array([0.5, 2.0], np.float16), 5)
    assert torch.equal(qt.dequantize(), torch.tensor([[-7.5, 7.5], [2.0, 0.0]]))
    with pytest.raises(ValueError, match="exceed the int5 range"):
        QuantizedTensor(np.array([[16]], np.int8), np.array([1.0], np.float16), 5)
    with pytest.raises(ValueError, match="scales must be float16"):
        QuantizedTensor(np.zeros((2, 2), np.int8), np.ones(2, np.float32), 6)
    assert [qmax_for(b) for b in (4, 5, 6, 8)] == [7, 15, 31, 127]
    with pytest.raises(ValueError, match="bit width 3"):
        qmax_for(3)
