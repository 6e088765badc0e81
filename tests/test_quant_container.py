"""Artifact container: bit-exact round trip, integrity checks, atomic writes, no pickle."""
import ast
import hashlib
import json
import lzma
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

from quant.container import (FORMAT_VERSION, MAGIC, ArtifactError, build_artifact, dequantize_state, load_artifact,
                             save_artifact)
from quant.gptq import rtn_quantize
from quant.pack import QuantizedTensor

META = {"model_config": {"vocab": 40, "d": 16}, "tokenizer_sha256": "4f" * 32, "note": "ünïcode ok"}


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(40, 16)
        self.norm = nn.Parameter(torch.ones(16))
        self.gain = nn.Parameter(torch.tensor([0.7312, 1.25]))
        self.up = nn.Linear(16, 33, bias=True)
        self.down = nn.Linear(33, 16, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        x = torch.nn.functional.rms_norm(x, (16,), self.norm) * self.gain[0]
        x = x + self.down(torch.relu(self.up(x))) * self.gain[1]
        return x @ self.embed.weight.T


def quantize_tiny(model: TinyLM) -> dict:
    sd = model.state_dict()
    return {"embed.weight": rtn_quantize(sd["embed.weight"], 8)[0],
            "norm": sd["norm"].numpy().astype(np.float16),
            "gain": sd["gain"].numpy().astype(np.float32),
            "up.weight": rtn_quantize(sd["up.weight"], 6)[0],
            "up.bias": sd["up.bias"].numpy().astype(np.float16),
            "down.weight": rtn_quantize(sd["down.weight"], 5)[0],
            "step": np.array([12345], np.int64)}


@pytest.fixture
def tiny():
    torch.manual_seed(0)
    model = TinyLM()
    with torch.no_grad():
        model.norm.uniform_(0.5, 1.5)
    return model, quantize_tiny(model)


@pytest.mark.parametrize("codec", ["brotli", "lzma"])
@pytest.mark.parametrize("layout", ["byte", "dense", "bitplane"])
def test_round_trip_is_bit_exact_and_logits_identical(tmp_path, tiny, codec, layout):
    model, quantized = tiny
    path = tmp_path / "model.art"
    written = save_artifact(path, META, quantized, codec=codec, layout=layout)
    assert written == path.stat().st_size
    assert written == len(build_artifact(META, quantized, codec, layout))
    meta, loaded = load_artifact(path)
    assert meta == META
    expected = dequantize_state(quantized)
    assert list(loaded) == list(expected)
    for name in expected:
        assert loaded[name].dtype == expected[name].dtype
        assert torch.equal(loaded[name], expected[name]), name
    assert loaded["step"].dtype == torch.int64 and int(loaded["step"]) == 12345
    assert loaded["gain"].tolist() == pytest.approx([0.7312, 1.25], abs=1e-7)  # fp32 kept exactly

    in_memory, from_disk = TinyLM(), TinyLM()
    in_memory.load_state_dict({k: v for k, v in expected.items() if k != "step"})
    from_disk.load_state_dict({k: v for k, v in loaded.items() if k != "step"})
    ids = torch.randint(0, 40, (3, 11))
    with torch.no_grad():
        assert torch.equal(in_memory(ids), from_disk(ids))


def test_artifact_is_deterministic(tmp_path, tiny):
    _, quantized = tiny
    a = build_artifact(META, quantized)
    assert a == build_artifact(META, quantized)
    assert a.startswith(MAGIC) and struct.unpack_from("<I", a, 8)[0] == FORMAT_VERSION
    assert hashlib.sha256(a[:-32]).digest() == a[-32:]


def flip(data: bytes, pos: int) -> bytes:
    return data[:pos] + bytes([data[pos] ^ 0x40]) + data[pos + 1:]


def test_corruption_anywhere_is_refused(tmp_path, tiny):
    _, quantized = tiny
    good = build_artifact(META, quantized)
    header_len = struct.unpack_from("<I", good, 12)[0]
    positions = {"header": 24 + 5, "header end": 24 + header_len - 1, "payload": 24 + header_len + 3,
                 "payload end": len(good) - 33, "hash": len(good) - 1, "hash start": len(good) - 32}
    for where, pos in positions.items():
        path = tmp_path / f"flip_{where.replace(' ', '_')}.art"
        path.write_bytes(flip(good, pos))
        with pytest.raises(ArtifactError, match=rf"{path.name}.*integrity check failed.*corrupted"):
            load_artifact(path)
    # Length fields: the file no longer has the size they describe.
    for pos in (13, 17):
        path = tmp_path / f"flip_len{pos}.art"
        path.write_bytes(flip(good, pos))
        with pytest.raises(ArtifactError, match="truncated or padded"):
            load_artifact(path)


def test_truncated_bad_magic_and_unknown_version_are_refused(tmp_path, tiny):
    _, quantized = tiny
    good = build_artifact(META, quantized)
    cases = {
        "cut.art": (good[:-100], r"truncated or padded: \d+ bytes, the prefix says \d+"),
        "cut_hash.art": (good[:-1], "truncated or padded"),
        "tiny.art": (good[:20], "truncated: 20 bytes"),
        "empty.art": (b"", "truncated: 0 bytes"),
        "magic.art": (b"PK\x03\x04" + good[4:], r"not an mhcgolf artifact \(magic"),
        "version.art": (good[:8] + struct.pack("<I", 99) + good[12:], "unsupported artifact format version 99"),
    }
    for name, (data, message) in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ArtifactError, match=message):
            load_artifact(tmp_path / name)


def rehash(body: bytes) -> bytes:
    return body + hashlib.sha256(body).digest()


def test_consistently_tampered_header_is_refused(tmp_path, tiny):
    """A forger can recompute the sha256; the structure checks still refuse inconsistent files."""
    _, quantized = tiny
    good = build_artifact(META, quantized)
    header_len, payload_len = struct.unpack_from("<IQ", good, 12)
    header = good[24:24 + header_len]
    payload = good[24 + header_len:-32]

    header = lzma.decompress(header)

    def forged(new_header: bytes, new_payload: bytes = payload, pack=lzma.compress) -> bytes:
        new_header = pack(new_header)
        return rehash(good[:8] + struct.pack("<IIQ", FORMAT_VERSION, len(new_header), len(new_payload))
                      + new_header + new_payload)

    cases = {
        "shape.art": (forged(header.replace(b'"shape":[33,16]', b'"shape":[34,16]')), "inconsistent"),
        "json.art": (forged(header[:-1] + b"?"), "header is not valid JSON"),
        "raw.art": (forged(header, pack=lambda h: h), r"header does not decompress \(xz\)"),
        "cut.art": (forged(header, pack=lambda h: lzma.compress(h)[:-20]), "header is cut short"),
        "huge.art": (forged(b" " * (17 << 20) + header), "decompresses to more than"),
        "extra.art": (forged(header, payload + b"\x00"), r"chunks cover \d+ bytes but the payload has"),
        "codec.art": (forged(header.replace(b'"codec":"brotli"', b'"codec":"pickle"')), "codec in"),
        "chunk.art": (forged(header, flip(payload, 10)), "tensor 'embed.weight'"),
    }
    for name, (data, message) in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ArtifactError, match=message) as refused:
            load_artifact(tmp_path / name)
        assert str(refused.value).count(name) == 1, refused.value  # named once: not wrapped in a second error


def artifact_of(tensors: list[tuple[dict, bytes]], codec: str = "brotli", header_text: bytes | None = None) -> bytes:
    """An artifact assembled by hand from (entry, chunk) pairs, with a valid sha256: what a forger can write."""
    entries, payload = [], b""
    for entry, chunk in tensors:
        entries.append({"pieces": [len(chunk)], **entry, "offset": len(payload), "nbytes": len(chunk)})
        payload += chunk
    header = lzma.compress(header_text if header_text is not None else
                           json.dumps({"codec": codec, "meta": META, "tensors": entries}).encode())
    return rehash(struct.pack("<8sIIQ", MAGIC, FORMAT_VERSION, len(header), len(payload)) + header + payload)


def test_a_forged_file_cannot_balloon_or_slip_through(tmp_path):
    """A small chunk that decompresses to 64 MiB for a tensor declared
    at 128 bytes (decompressed whole before the size was compared); tensors declared at gigabytes; a shape whose
    element count wraps around in int64 (np.prod gave 0), or whose product of huge dimensions took minutes; a header
    nested 200,000 deep (RecursionError traceback);
    bits 6.0 where an integer belongs (accepted, then failed as "does not decompress")."""
    import brotli
    gain = {"name": "gain", "kind": "array", "shape": [32], "dtype": "float32", "raw_nbytes": 128}
    zeros = b"\0" * (64 << 20)
    quant = {"name": "w", "kind": "quant", "shape": [4, 8], "bits": 6.0, "layout": "byte", "scale_offset": 32,
             "raw_nbytes": 40}
    cases = {
        "bomb_brotli": (artifact_of([(gain, brotli.compress(zeros, quality=1))]),
                        "tensor 'gain' is invalid: decompresses to more than the 128 bytes declared"),
        "bomb_lzma": (artifact_of([(gain, lzma.compress(zeros, preset=0))], codec="lzma"),
                      "tensor 'gain' is invalid: decompresses to more than the 128 bytes declared"),
        "cut": (artifact_of([(gain, brotli.compress(b"\1" * 128)[:-2])]), "decompressed to 0 bytes, expected 128"),
        "stray": (artifact_of([(gain, lzma.compress(b"\1" * 128) + b"\0")], codec="lzma"),
                  "decompressed to 128 bytes, expected 128 \\(cut short or followed by stray bytes\\)"),
        "huge": (artifact_of([({**gain, "shape": [20000, 20000], "raw_nbytes": 1_600_000_000}, b"")]),
                 "tensor 'gain' declares 2 dimensions or a size past 268,435,456"),
        "huge_together": (artifact_of([({**gain, "name": f"g{i}", "shape": [10000, 5000], "raw_nbytes": 200_000_000},
                                        b"") for i in range(2)]),
                          "its tensors declare 400,000,000 bytes, more than the 268,435,456"),
        "wrap": (artifact_of([({**gain, "shape": [2 ** 62, 4], "raw_nbytes": 0}, b"")]),
                 "tensor 'gain' declares 2 dimensions or a size past 268,435,456"),
        # thousands of 1,000-digit dimensions: their product took minutes before the sizes were compared
        "slow_product": (artifact_of([({**gain, "shape": [10 ** 1000] * 800, "raw_nbytes": 0}, b"")]),
                         "tensor 'gain' declares 800 dimensions or a size past"),
        "far_offset": (artifact_of([({**gain, "raw_nbytes": 10 ** 1000}, b"")]), "a size past 268,435,456"),
        "nested": (artifact_of([], header_text=b"[" * 200_000), "header is not valid JSON"),
        "float_bits": (artifact_of([(quant, brotli.compress(b"\0" * 40))]), "tensor 'w': raw_nbytes or its kind/bits"),
    }
    for name, (data, message) in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ArtifactError, match=message):
            load_artifact(tmp_path / name)
    ok = artifact_of([(gain, brotli.compress(np.arange(32, dtype="<f4").tobytes()))])
    (tmp_path / "ok").write_bytes(ok)
    assert load_artifact(tmp_path / "ok")[1]["gain"].tolist() == list(range(32))  # the hand-made file is sound


def test_meta_and_tensor_validation(tiny):
    _, quantized = tiny
    with pytest.raises(ValueError, match="model_config"):
        build_artifact({"tokenizer_sha256": "0" * 64}, quantized)
    with pytest.raises(ValueError, match="tokenizer_sha256"):
        build_artifact({"model_config": {}, "tokenizer_sha256": "xyz"}, quantized)
    with pytest.raises(ValueError, match="not plain JSON"):
        build_artifact({**META, "bad": float("nan")}, quantized)
    with pytest.raises(TypeError, match="'obj'.*QuantizedTensor or numpy"):
        build_artifact(META, {"obj": object()})
    with pytest.raises(TypeError, match="dtype complex64 cannot be stored"):
        build_artifact(META, {"c": np.zeros(2, np.complex64)})
    with pytest.raises(ValueError, match="unknown codec"):
        build_artifact(META, quantized, codec="zip")
    with pytest.raises(ValueError, match="unknown code layout"):
        build_artifact(META, quantized, layout="nibble")


def test_atomic_write_leaves_no_temp_and_keeps_old_file_on_failure(tmp_path, tiny):
    """Also: the artifact gets a plain file's mode (it was written 0600, mkstemp's, so unreadable to others)."""
    from data.files import current_umask
    _, quantized = tiny
    path = tmp_path / "a.art"
    save_artifact(path, META, quantized)
    assert path.stat().st_mode & 0o777 == 0o666 & ~current_umask()
    before = path.read_bytes()
    with pytest.raises(ValueError):
        save_artifact(path, {**META, "bad": float("inf")}, quantized)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.art"]


def test_a_missing_brotli_module_is_not_reported_as_a_corrupt_artifact(tmp_path, tiny, monkeypatch):
    """parse_artifact's catch-all used to turn the missing module into "tensor ... does not decompress": a message
    about the file, for a lack of this machine."""
    from quant.container import CodecUnavailable
    _, quantized = tiny
    save_artifact(tmp_path / "a.art", META, quantized)
    monkeypatch.setitem(sys.modules, "brotli", None)
    with pytest.raises(CodecUnavailable, match=r"the brotli module is not installed; hint: `pip install brotli`"):
        load_artifact(tmp_path / "a.art")


def test_loading_code_has_no_unpickling_path():
    """container.py and pack.py (the shipped loader) import nothing that can deserialize code."""
    root = Path(__file__).resolve().parents[1] / "quant"
    for name in ("container.py", "pack.py"):
        tree = ast.parse((root / name).read_text())
        imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                    for alias in node.names} | {node.module.split(".")[0] for node in ast.walk(tree)
                                                 if isinstance(node, ast.ImportFrom) and node.module}
        assert not imported & {"pickle", "marshal", "shelve", "dill", "joblib"}, name
        calls = {ast.unparse(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
        assert not calls & {"torch.load", "np.load", "eval", "exec", "pickle.loads"}, name


def test_a_large_tensor_is_stored_in_pieces_that_load_back_and_a_forged_piece_list_is_refused(tmp_path):
    """Chunks are compressed in 1 MiB pieces (in parallel): a tensor past one piece spans several."""
    from quant.container import PIECE_BYTES, parse_artifact
    rng = np.random.default_rng(0)
    codes = rng.integers(-31, 32, size=(1100, 1024)).astype(np.int8)
    big = QuantizedTensor(codes, np.full(1100, 0.01, np.float16), 6)
    data = build_artifact(META, {"big": big, "small": np.ones(3, np.float32)})
    _, stored = parse_artifact(data, "a", stored=True)
    assert np.array_equal(stored["big"].codes, codes) and stored["small"].tolist() == [1, 1, 1]
    header = json.loads(lzma.decompress(data[24:24 + struct.unpack_from("<I", data, 12)[0]]))
    pieces = {e["name"]: e["pieces"] for e in header["tensors"]}
    assert len(pieces["big"]) == 2 == -(-(codes.size + 2 * 1100) // PIECE_BYTES) and len(pieces["small"]) == 1
    import brotli
    gain = {"name": "gain", "kind": "array", "shape": [32], "dtype": "float32", "raw_nbytes": 128}
    chunk = brotli.compress(b"\0" * 128)
    for forged in ([len(chunk), 0], [len(chunk) + 1], [-1], "all"):
        (tmp_path / "f").write_bytes(artifact_of([({**gain, "pieces": forged}, chunk)]))
        with pytest.raises(ArtifactError, match="tensor 'gain': pieces must list the compressed size of each"):
            load_artifact(tmp_path / "f")
