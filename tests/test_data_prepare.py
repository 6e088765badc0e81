"""Text -> shards: exact round trip, deterministic for any worker count, atomic, every flag exercised."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm

from data.demo_source import Sampler, build_source
from data.loader import load_tokens
from data.prepare import main as prepare_main
from data.prepare import prepare
from data.shards import BOS_ID, list_shards, read_shard
from data.tokenizer import iter_texts, train_tokenizer

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
OFFICIAL = SHARED / "tokenizers" / "fineweb_1024_bpe.model"
DEV_VAL = SHARED / "corpus" / "dev_val_fineweb.jsonl.xz"


def documents(tokens, sp):
    starts = np.flatnonzero(tokens == BOS_ID).tolist() + [len(tokens)]
    assert starts[0] == 0, "a split must start with BOS"
    return [sp.decode(tokens[a + 1:b].tolist()) for a, b in zip(starts[:-1], starts[1:])]


@pytest.fixture(scope="module")
def demo_text(tmp_path_factory):
    """Demo-source documents (normalization is the identity on them) and a small tokenizer."""
    d = tmp_path_factory.mktemp("text")
    docs = Sampler(build_source(1)).documents(700, np.random.default_rng(0))
    (d / "docs.txt").write_text("\n".join(docs) + "\n")
    (d / "val.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs[:30]))
    model = train_tokenizer([str(d / "docs.txt")], 300, str(d / "tok"), num_threads=2)
    return d, docs, model


def test_round_trip_is_exact_on_identity_normalized_text(demo_text, tmp_path):
    d, docs, model = demo_text
    m = prepare([str(d / "docs.txt")], model, tmp_path, val_docs=50, shard_tokens=5_000, workers=2)
    sp = spm.SentencePieceProcessor(model_file=model)
    val = load_tokens(list_shards(str(tmp_path / "fineweb_val_*.bin")))
    train = load_tokens(list_shards(str(tmp_path / "fineweb_train_*.bin")))
    assert documents(val, sp) == docs[:50] and documents(train, sp) == docs[50:]
    assert m["splits"]["val"]["docs"] == 50 and m["splits"]["train"]["docs"] == 650
    assert m["splits"]["train"]["tokens"] == len(train) and m["splits"]["val"]["tokens"] == len(val)
    assert m["splits"]["train"]["bytes"] == m["splits"]["train"]["input_bytes"] == sum(map(len, docs[50:]))
    shards = list_shards(str(tmp_path / "fineweb_train_*.bin"))
    assert len(shards) > 2 and all(len(read_shard(s)) == 5_000 for s in shards[:-1])  # exact shard size
    assert 0 < len(read_shard(shards[-1])) <= 5_000
    assert m["vocab_size"] == 300 and len(m["tokenizer_sha256"]) == 64
    assert json.loads((tmp_path / "manifest.json").read_text()) == m


def test_output_is_identical_for_any_worker_count(demo_text, tmp_path):
    d, _, model = demo_text
    prepare([str(d / "docs.txt")], model, tmp_path / "one", val_docs=10, shard_tokens=7_000, workers=1)
    prepare([str(d / "docs.txt")], model, tmp_path / "two", val_docs=10, shard_tokens=7_000, workers=2)
    names = sorted(p.name for p in (tmp_path / "one").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "two").iterdir())
    for name in names:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name


def test_separate_val_input_and_overwrite(demo_text, tmp_path):
    d, docs, model = demo_text
    prepare([str(d / "docs.txt")], model, tmp_path, val_inputs=[str(d / "val.jsonl")], workers=1)
    with pytest.raises(FileExistsError, match="--overwrite"):
        prepare([str(d / "docs.txt")], model, tmp_path, workers=1)
    m = prepare([str(d / "docs.txt")], model, tmp_path, workers=1, overwrite=True)
    assert "val" not in m["splits"] and not list(tmp_path.glob("fineweb_val_*"))  # old val shards removed
    # A tokenizer the user put beside the shards stays (a review: an earlier version deleted it), also when a run
    # read it in place (the manifest then names it, though no run shipped it)
    own = tmp_path / "tokenizer.model"
    own.write_bytes(b"the user's")
    prepare([str(d / "docs.txt")], model, tmp_path, workers=1, overwrite=True)
    assert own.read_bytes() == b"the user's"
    own.write_bytes(Path(model).read_bytes())
    prepare([str(d / "docs.txt")], str(own), tmp_path, workers=1, overwrite=True)
    prepare([str(d / "docs.txt")], model, tmp_path, workers=1, overwrite=True)
    assert own.read_bytes() == Path(model).read_bytes()
    # A tokenizer an earlier run shipped into the folder goes with its shards (left beside shards of another
    # tokenizer it was the one a user reached for), unless it is the tokenizer this run reads
    from data.prepare import prepare_splits
    prepare_splits({"train": docs}, model, tmp_path, workers=1, overwrite=True, ship_tokenizer=True)
    assert own.read_bytes() == Path(model).read_bytes()
    prepare([str(d / "docs.txt")], model, tmp_path, workers=1, overwrite=True)
    assert not own.exists() and not (tmp_path / "tokenizer.vocab").exists()
    prepare_splits({"train": docs}, model, tmp_path, workers=1, overwrite=True, ship_tokenizer=True)
    m = prepare([str(d / "docs.txt")], str(own), tmp_path, workers=1, overwrite=True)
    assert own.read_bytes() == Path(model).read_bytes() and m["splits"]["train"]["docs"] == 700
    with pytest.raises(ValueError, match="not both"):
        prepare([str(d / "docs.txt")], model, tmp_path / "x", val_docs=3, val_inputs=[str(d / "val.jsonl")])
    with pytest.raises(ValueError, match="only 700 documents"):
        prepare([str(d / "docs.txt")], model, tmp_path / "y", val_docs=10_000)
    with pytest.raises(ValueError, match="--val-docs 700 but the inputs hold only 700 documents, none left to train"):
        prepare([str(d / "docs.txt")], model, tmp_path / "z", val_docs=700)  # it exited 0 with no training shard


def test_an_interrupted_run_leaves_the_folder_as_it_was(demo_text, tmp_path, fail_at_call):
    """Shards are staged and moved in only when every split and the manifest are done: killed midway, a
    first run leaves an empty folder, and an --overwrite run leaves the old set whole (nothing staged left)."""
    d, _, model = demo_text
    import data.prepare as prep
    calls = fail_at_call(prep, "write_shard", 3, KeyboardInterrupt("killed"))
    with pytest.raises(KeyboardInterrupt):
        prepare([str(d / "docs.txt")], model, tmp_path / "first", shard_tokens=3_000, workers=1)
    assert list((tmp_path / "first").iterdir()) == []

    old = prepare([str(d / "docs.txt")], model, tmp_path / "kept", shard_tokens=20_000, workers=1)
    before = {f.name: f.read_bytes() for f in (tmp_path / "kept").iterdir()}
    calls.clear()
    with pytest.raises(KeyboardInterrupt):
        prepare([str(d / "docs.txt")], model, tmp_path / "kept", shard_tokens=3_000, workers=1, overwrite=True)
    assert {f.name: f.read_bytes() for f in (tmp_path / "kept").iterdir()} == before  # no staging folder either
    assert json.loads(before["manifest.json"]) == old
    with pytest.raises(FileNotFoundError, match="no such text file"):  # a bad input: the same
        prepare([str(d / "missing.txt")], model, tmp_path / "kept", workers=1, overwrite=True)
    assert {f.name: f.read_bytes() for f in (tmp_path / "kept").iterdir()} == before
    (tmp_path / "kept" / ".staging-killed").mkdir()  # SIGKILL skips the cleanup: the next run does it
    (tmp_path / "kept" / ".staging-killed" / "fineweb_train_000000.bin").write_bytes(b"partial")
    prepare([str(d / "docs.txt")], model, tmp_path / "kept", shard_tokens=20_000, workers=1, overwrite=True)
    assert {f.name: f.read_bytes() for f in (tmp_path / "kept").iterdir()} == before


def test_prepare_cli_flags(demo_text, tmp_path):
    d, docs, model = demo_text
    out = subprocess.run([sys.executable, "-m", "data.prepare", "--input", str(d / "docs.txt"), "--tokenizer", model,
                          "--out", str(tmp_path), "--val-docs", "25", "--shard-tokens", "20000", "--workers", "2"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "val: 25 docs" in out and "train: 675 docs" in out
    m = json.loads((tmp_path / "manifest.json").read_text())
    assert m["shard_tokens"] == 20_000 and len(m["splits"]["train"]["shards"]) > 1
    prepare_main(["--input", str(d / "docs.txt"), "--tokenizer", model, "--out", str(tmp_path),
                  "--val-input", str(d / "val.jsonl"), "--overwrite", "--workers", "1"])
    assert json.loads((tmp_path / "manifest.json").read_text())["splits"]["val"]["docs"] == 30
    with pytest.raises(SystemExit, match="already holds"):
        prepare_main(["--input", str(d / "docs.txt"), "--tokenizer", model, "--out", str(tmp_path)])


def test_real_text_round_trips_to_its_normalized_form(tmp_path):
    """FineWeb documents with the official tokenizer: decoding gives back sp.normalize(text) (nmt_nfkc:
    newlines and tabs become spaces, runs of spaces collapse), which is what bits per byte counts."""
    if not (OFFICIAL.is_file() and DEV_VAL.is_file()):
        pytest.skip(f"shared data absent at {SHARED}")
    m = prepare([str(DEV_VAL)], str(OFFICIAL), tmp_path, val_docs=40, shard_tokens=60_000, workers=2)
    sp = spm.SentencePieceProcessor(model_file=str(OFFICIAL))
    texts = list(iter_texts([DEV_VAL]))
    normalized = [sp.normalize(t).replace("▁", " ") for t in texts]
    decoded = documents(load_tokens(list_shards(str(tmp_path / "fineweb_val_*.bin"))), sp)
    decoded += documents(load_tokens(list_shards(str(tmp_path / "fineweb_train_*.bin"))), sp)
    assert decoded == normalized
    total = m["splits"]["val"]["bytes"] + m["splits"]["train"]["bytes"]
    assert total == sum(len(t.encode("utf-8")) for t in normalized)
    assert m["tokenizer_sha256"].startswith("4f5e8adb")


def test_validation_text_never_reaches_the_training_split(demo_text, tmp_path):
    """--val-input documents that also sat in the training inputs were trained on, and nothing noticed; the same file
    given to both splits is refused, and copies of validation documents among the training ones are left out."""
    d, docs, model = demo_text
    with pytest.raises(ValueError, match=r"--val-input .*docs.txt is also a training --input"):
        prepare([str(d / "docs.txt")], model, tmp_path / "same", val_inputs=[str(d / "docs.txt")], workers=1)
    m = prepare([str(d / "docs.txt")], model, tmp_path / "overlap", val_inputs=[str(d / "val.jsonl")], workers=1)
    assert m["held_out_duplicates"] == 30 and m["splits"]["train"]["docs"] == 670  # val.jsonl is docs[:30]
    sp = spm.SentencePieceProcessor(model_file=model)
    train = documents(load_tokens(list_shards(str(tmp_path / "overlap" / "fineweb_train_*.bin"))), sp)
    assert train == docs[30:]
    # Copies that differ in whitespace encode to the validation document's ids: copies too
    variants = ["  " + t + "\t" for t in docs[:10]] + [t.replace(" ", "  ") for t in docs[10:20]] + docs[30:]
    (d / "variants.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in variants))
    m = prepare([str(d / "variants.jsonl")], model, tmp_path / "variants", val_inputs=[str(d / "val.jsonl")], workers=1)
    assert m["held_out_duplicates"] == 20 and m["splits"]["train"]["docs"] == 670
    with pytest.raises(ValueError, match="no training documents: the inputs hold none, or only copies of validation"):
        prepare([str(d / "val.jsonl")], model, tmp_path / "only_val", val_inputs=[str(d / "docs.txt")], workers=1)
    assert not list((tmp_path / "only_val").glob("fineweb_*"))
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match=r"^the inputs \(.*empty.txt\) hold no documents \(hint"):
        prepare([str(tmp_path / "empty.txt")], model, tmp_path / "none", workers=1)
    # with a validation split asked for, the message was "a smaller --val-docs": the inputs are what is wrong
    with pytest.raises(ValueError, match=r"^the inputs \(.*empty.txt\) hold no documents \(hint: empty and"):
        prepare([str(tmp_path / "empty.txt")], model, tmp_path / "none", val_docs=1, workers=1)


def test_a_swap_interrupted_between_two_renames_is_refused_by_the_loaders(demo_text, tmp_path, monkeypatch):
    """The swap deletes the old files and renames the new ones in: killed between, the folder held part of each set,
    and the loaders read it as one. A marker now stands there until the manifest is in."""
    d, _, model = demo_text
    import data.prepare as prep
    from data.shards import SWAP_MARKER, ShardError
    prepare([str(d / "docs.txt")], model, tmp_path, shard_tokens=5_000, workers=1)
    real_replace, moved = prep.os.replace, []

    def killed_after_one_shard_moved_in(src, dst):
        if ".staging-" in str(src) and Path(dst).parent == tmp_path:  # the swap's renames, not the staging writes
            moved.append(dst)
            if len(moved) == 2:
                raise KeyboardInterrupt("killed")
        real_replace(src, dst)
    monkeypatch.setattr(prep.os, "replace", killed_after_one_shard_moved_in)
    with pytest.raises(KeyboardInterrupt):
        prepare([str(d / "docs.txt")], model, tmp_path, shard_tokens=7_000, workers=1, overwrite=True)
    assert (tmp_path / SWAP_MARKER).exists()
    with pytest.raises(ShardError, match="data.prepare was interrupted while replacing its shards"):
        list_shards(str(tmp_path / "fineweb_train_*.bin"))


def test_the_swap_marker_goes_once_the_manifest_is_in(demo_text, tmp_path):
    from data.shards import SWAP_MARKER
    d, _, model = demo_text
    (tmp_path / SWAP_MARKER).write_text("left by a killed run\n")
    (tmp_path / "fineweb_train_000000.bin").write_bytes(b"half of an old set")
    m = prepare([str(d / "docs.txt")], model, tmp_path, shard_tokens=50_000, workers=1, overwrite=True)
    assert not (tmp_path / SWAP_MARKER).exists()
    assert [Path(f).name for f in list_shards(str(tmp_path / "fineweb_train_*.bin"))] == m["splits"]["train"]["shards"]
    assert read_shard(tmp_path / "fineweb_train_000000.bin")[0] == BOS_ID


def test_a_tokenizer_without_bos_at_id_1_and_a_shard_size_past_int32_are_refused_up_front(demo_text, tmp_path):
    d, _, model = demo_text
    spm.SentencePieceTrainer.train(input=str(d / "docs.txt"), model_prefix=str(tmp_path / "nobos"), vocab_size=300,
                                   model_type="bpe", bos_id=-1, byte_fallback=True, num_threads=1, minloglevel=2)
    with pytest.raises(ValueError, match=r"nobos.model: bos_id is -1 .* need the BOS control token at id 1"):
        prepare([str(d / "docs.txt")], str(tmp_path / "nobos.model"), tmp_path / "out", workers=1)
    with pytest.raises(ValueError, match=r"shard_tokens must be in \[1, 2\*\*31\)"):
        prepare([str(d / "docs.txt")], model, tmp_path / "out", shard_tokens=2**31, workers=1)
