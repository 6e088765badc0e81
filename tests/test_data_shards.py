"""Shard format: round trip, and every kind of damage rejected with a message naming the file."""
import numpy as np
import pytest

from data.shards import (BOS_ID, HEADER_BYTES, MAGIC, ShardError, count_documents, list_shards, read_header,
                         read_shard, write_shard)


def test_round_trip_memmap_and_in_memory(tmp_path):
    tokens = np.array([BOS_ID, 5, 65535, 0, BOS_ID, 7], dtype=np.int64)
    path = tmp_path / "s.bin"
    write_shard(path, tokens)
    assert path.stat().st_size == HEADER_BYTES + 2 * len(tokens)
    header = np.fromfile(path, dtype="<i4", count=3)
    assert header.tolist() == [MAGIC, 1, len(tokens)]
    raw = np.fromfile(path, dtype="<u2", offset=HEADER_BYTES)
    assert raw.tolist() == tokens.tolist()  # little-endian uint16 on disk
    mapped = read_shard(path)
    assert isinstance(mapped, np.memmap) and mapped.dtype == np.uint16
    assert mapped.tolist() == tokens.tolist()
    loaded = read_shard(path, vocab_size=65536, mmap=False)
    assert not isinstance(loaded, np.memmap) and loaded.tolist() == tokens.tolist()
    assert count_documents(loaded) == 2 and count_documents(loaded, chunk=2) == 2
    assert not list(tmp_path.glob(".*tmp*")), "temporary file left behind"


def test_empty_shard_round_trips(tmp_path):
    write_shard(tmp_path / "e.bin", np.zeros(0, dtype=np.uint16))
    assert read_shard(tmp_path / "e.bin", vocab_size=2).size == 0


@pytest.mark.parametrize("bad, match", [(np.array([-1]), "uint16"), (np.array([70000]), "uint16"),
                                        (np.array([[1, 2]]), "1-D"), (np.array([1.5]), "integer")])
def test_write_rejects_bad_tokens(tmp_path, bad, match):
    with pytest.raises(ShardError, match=match):
        write_shard(tmp_path / "x.bin", bad)
    assert not (tmp_path / "x.bin").exists()


def test_failed_write_leaves_no_valid_looking_file(tmp_path, monkeypatch):
    path = tmp_path / "s.bin"

    def crash(*args):
        raise OSError("disk full")
    monkeypatch.setattr("data.shards.os.replace", crash)
    with pytest.raises(OSError, match="disk full"):
        write_shard(path, np.arange(100))
    assert list(tmp_path.iterdir()) == []


def good_shard(tmp_path, n=10):
    path = tmp_path / "good.bin"
    write_shard(path, np.arange(n))
    return path


def corrupt(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


@pytest.mark.parametrize("offset, header, dtype, says", [
    (0, [1234], "<i4", rf"magic is 1234, expected {MAGIC}"),
    (0, [MAGIC, 1, 10], ">i4", "magic"),  # a big-endian header is not a shard
    (4, [2], "<i4", "version is 2, expected 1"),
    (8, [-5], "<i4", "negative"),
], ids=["bad_magic", "big_endian", "bad_version", "negative_count"])
def test_a_bad_header_field_is_named(tmp_path, offset, header, dtype, says):
    path = good_shard(tmp_path)
    corrupt(path, offset, np.array(header, dtype=dtype).tobytes())
    with pytest.raises(ShardError, match=rf"{path}.*{says}"):
        read_shard(path)


def test_truncated_body(tmp_path):
    path = good_shard(tmp_path)
    with open(path, "r+b") as f:
        f.truncate(HEADER_BYTES + 2 * 10 - 1)
    with pytest.raises(ShardError, match=f"{path}: truncated: header declares 10 tokens.*{HEADER_BYTES + 20} bytes"):
        read_shard(path)


def test_truncated_header(tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(b"\x00" * 100)
    with pytest.raises(ShardError, match=f"{path}: 100 bytes is shorter than the {HEADER_BYTES}-byte header"):
        read_header(path)


def test_oversized(tmp_path):
    path = good_shard(tmp_path)
    with open(path, "ab") as f:
        f.write(b"\x00\x00")
    with pytest.raises(ShardError, match=f"{path}: oversized"):
        read_shard(path)


def test_missing_file(tmp_path):
    with pytest.raises(ShardError, match="nope.bin: no such shard"):
        read_shard(tmp_path / "nope.bin")


def test_ids_must_be_below_vocab(tmp_path):
    path = good_shard(tmp_path, n=10)  # ids 0..9
    assert read_shard(path, vocab_size=10).size == 10
    with pytest.raises(ShardError, match=f"{path}: token id 9 .*position 9.*vocab_size 9"):
        read_shard(path, vocab_size=9)


def test_list_shards_sorted_and_clear_when_empty(tmp_path):
    for name in ["b_000001.bin", "b_000000.bin", "a.txt"]:
        (tmp_path / name).write_bytes(b"")
    assert [p.split("/")[-1] for p in list_shards(str(tmp_path / "b_*.bin"))] == ["b_000000.bin", "b_000001.bin"]
    pattern = str(tmp_path / "missing_*.bin")
    with pytest.raises(FileNotFoundError, match="missing_\\*.bin"):
        list_shards(pattern)
