"""Text readers, tokenizer training with the published settings, and the exact byte accounting."""
import gzip
import json
import lzma
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm

from data.tokenizer import ByteLUT, build_byte_lut, count_target_bytes, file_sha256, iter_texts, train_tokenizer

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
OFFICIAL = SHARED / "tokenizers" / "fineweb_1024_bpe.model"
DEV_VAL = SHARED / "corpus" / "dev_val_fineweb.jsonl.xz"
OFFICIAL_SHA256 = "4f5e8adb109c66b4886963bc75a7befd73bda36d27fd7102df8e9e66503b0e2a"
ROOT = Path(__file__).resolve().parents[1]


def needs_shared():
    if not (OFFICIAL.is_file() and DEV_VAL.is_file()):
        pytest.skip(f"shared data absent at {SHARED}")


def write_all_kinds(tmp_path, docs):
    (tmp_path / "a.txt").write_text("\n".join(docs[:2]) + "\n\n", encoding="utf-8")
    lines = "".join(json.dumps({"text": d, "source": "x"}) + "\n" for d in docs[2:4])
    (tmp_path / "b.jsonl").write_text(lines, encoding="utf-8")
    with gzip.open(tmp_path / "c.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write(json.dumps({"text": docs[4]}) + "\n")
    with lzma.open(tmp_path / "d.jsonl.xz", "wt", encoding="utf-8") as f:
        f.write(json.dumps({"text": docs[5]}) + "\n")
    return [str(tmp_path / n) for n in ["a.txt", "b.jsonl", "c.jsonl.gz", "d.jsonl.xz"]]


def test_iter_texts_reads_every_kind_in_order(tmp_path):
    docs = ["one doc", "two é", "three\nlines", "four", "five ü", "six 六"]
    assert list(iter_texts(write_all_kinds(tmp_path, docs))) == docs


def test_iter_texts_errors_name_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: expected a JSON object with a \"text\""):
        list(iter_texts([bad]))
    with pytest.raises(ValueError, match=r"x.csv: unsupported file kind"):
        list(iter_texts([tmp_path / "x.csv"]))


def corpus_lines(n=3000, seed=0):
    rng = np.random.default_rng(seed)
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "then", "ran", "away", "from", "dog", "fast"]
    return [" ".join(rng.choice(words, size=rng.integers(5, 20))) + f" {rng.integers(0, 99999)}." for _ in range(n)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    (d / "corpus.txt").write_text("\n".join(corpus_lines()) + "\n")
    model = train_tokenizer([str(d / "corpus.txt")], 300, str(d / "tok"), num_threads=2)
    return model


def test_trained_tokenizer_has_published_settings(trained):
    sp = spm.SentencePieceProcessor(model_file=trained)
    assert sp.get_piece_size() == 300
    assert [sp.id_to_piece(i) for i in range(4)] == ["<pad>", "<s>", "</s>", "<unk>"]
    assert (sp.pad_id(), sp.bos_id(), sp.eos_id(), sp.unk_id()) == (0, 1, 2, 3)
    assert all(sp.is_byte(i) and sp.id_to_piece(i) == f"<0x{i - 4:02X}>" for i in range(4, 260))  # byte_fallback
    assert sp.encode("中", out_type=str) == ["<0xE4>", "<0xB8>", "<0xAD>"]  # unseen text falls back to bytes
    assert sp.encode("12345", out_type=str) == ["1", "2", "3", "4", "5"]  # split_digits
    assert not sp.encode("the cat", out_type=str)[0].startswith("▁")  # add_dummy_prefix=False
    assert sp.normalize("ﬁ\t x") == "fi▁x"  # nmt_nfkc: NFKC, tabs to spaces, runs of spaces collapsed
    assert Path(trained).with_suffix(".vocab").is_file()
    assert not list(Path(trained).parent.glob("*tmp*"))


def test_tokenizer_cli(tmp_path):
    docs = corpus_lines(400, seed=1)
    paths = write_all_kinds(tmp_path, docs[:6])
    (tmp_path / "more.txt").write_text("\n".join(docs) + "\n")
    out = subprocess.run([sys.executable, "-m", "data.tokenizer", "--input", *paths, str(tmp_path / "more.txt"),
                          "--vocab-size", "320", "--out", str(tmp_path / "cli")],
                         cwd=ROOT, capture_output=True, text=True, check=True)
    report = json.loads(out.stdout)
    assert report["vocab_size"] == 320 and report["sha256"] == file_sha256(tmp_path / "cli.model")
    bad = subprocess.run([sys.executable, "-m", "data.tokenizer", "--input", *paths, "--vocab-size", "100",
                          "--out", str(tmp_path / "small")], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode != 0 and "vocab_size 100 is too small" in bad.stderr
    crowded = subprocess.run([sys.executable, "-m", "data.tokenizer", "--input", *paths, "--vocab-size", "270",
                              "--out", str(tmp_path / "crowded")], cwd=ROOT, capture_output=True, text=True)
    assert crowded.returncode != 0 and "SentencePiece training failed" in crowded.stderr


def test_training_names_a_bad_input_line_and_refuses_a_vocabulary_it_cannot_fill(tmp_path):
    """A bad JSONL line used to reach the user as SentencePiece's 'training failed' naming no file; too little
    text gave fewer pieces than asked for, written and reported as the size asked for."""
    from data.tokenizer import TokenizerError
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(json.dumps({"text": t}) for t in corpus_lines(50)) + '\n{"body": "no text"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:51: expected a JSON object with a \"text\""):
        train_tokenizer([str(bad)], 300, str(tmp_path / "a"), num_threads=1)
    one = tmp_path / "one.txt"
    one.write_text("a single short line of text\n")
    with pytest.raises(TokenizerError, match=r"the inputs give \d+ pieces, not the vocab_size=1024 asked for"):
        train_tokenizer([str(one)], 1024, str(tmp_path / "b"), num_threads=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "one.txt"]  # nothing written


def test_a_truncated_or_corrupt_file_is_named(tmp_path):
    """gzip's EOFError and lzma's LZMAError used to reach SentencePiece, which reported a line of this module."""
    whole = gzip.compress(("\n".join(json.dumps({"text": t}) for t in corpus_lines(200)) + "\n").encode())
    (tmp_path / "cut.jsonl.gz").write_bytes(whole[:len(whole) // 2])
    (tmp_path / "bad.jsonl.xz").write_bytes(b"not xz at all")
    for name, kind in (("cut.jsonl.gz", "EOFError"), ("bad.jsonl.xz", "LZMAError")):
        with pytest.raises(ValueError, match=rf"{name}: cannot be read as jsonl\.\w+ text \({kind}"):
            train_tokenizer([str(tmp_path / name)], 300, str(tmp_path / "t"), num_threads=1)


def test_loading_a_file_that_is_not_a_model_names_it(tmp_path, trained):
    from data.tokenizer import TokenizerError, load_sp
    vocab = Path(trained).with_suffix(".vocab")
    with pytest.raises(TokenizerError, match=rf"{re.escape(str(vocab))}: not a SentencePiece model .*hint: pass the "
                                             r"\.model file"):
        load_sp(vocab)


def test_official_tokenizer_checksum():
    needs_shared()
    assert file_sha256(OFFICIAL) == OFFICIAL_SHA256


def test_byte_lut_rules_on_official_tokenizer():
    needs_shared()
    sp = spm.SentencePieceProcessor(model_file=str(OFFICIAL))
    lut = build_byte_lut(str(OFFICIAL))
    assert isinstance(lut, ByteLUT) and lut.base_bytes.dtype == np.int16 and len(lut.base_bytes) == 1024
    assert lut.is_boundary[:4].all() and (lut.base_bytes[:4] == 0).all() and not lut.is_boundary[4:].any()
    assert (lut.base_bytes[4:260] == 1).all() and not lut.has_leading_space[4:260].any()  # <0xNN>: 1 byte
    the = sp.piece_to_id("▁the")
    assert lut.base_bytes[the] == 3 and lut.has_leading_space[the]
    # a leading space counts after a normal token, never after BOS
    assert count_target_bytes(np.array([1, the]), np.array([the, the]), lut).tolist() == [3, 4]


def test_byte_counts_equal_decoded_utf8_on_real_documents():
    """The byte audit: BOS + tokens of a document, targets after BOS, sum == decoded bytes."""
    needs_shared()
    sp = spm.SentencePieceProcessor(model_file=str(OFFICIAL))
    lut = build_byte_lut(sp)
    total_bytes = total_tokens = 0
    for text in iter_texts([DEV_VAL]):
        ids = np.array([1] + sp.encode(text))
        counted = int(count_target_bytes(ids[:-1], ids[1:], lut).sum())
        decoded = len(sp.decode(ids[1:].tolist()).encode("utf-8"))
        assert counted == decoded, text[:80]
        total_bytes, total_tokens = total_bytes + decoded, total_tokens + len(ids) - 1
    assert 2.3 < total_bytes / total_tokens < 2.6  # FineWeb on sp1024 runs at ~2.4 bytes per token


def test_text_files_keep_lone_carriage_returns_and_skip_empty_documents(tmp_path):
    """A lone "\r" cut a .txt document in two (universal newlines); JSONL documents of only whitespace became bare BOS
    tokens, where .txt skipped them."""
    (tmp_path / "a.txt").write_bytes(b"first part\rsecond part\r\nnext\n\n")
    assert list(iter_texts([tmp_path / "a.txt"])) == ["first part\rsecond part", "next"]
    (tmp_path / "b.jsonl").write_text('{"text": "x"}\n{"text": ""}\n{"text": "  \\n "}\n{"text": "y"}\n')
    assert list(iter_texts([tmp_path / "b.jsonl"])) == ["x", "y"]


def test_unreadable_text_is_named_with_its_line(tmp_path):
    surrogate = tmp_path / "s.jsonl"
    surrogate.write_text('{"text": "ok"}\n{"text": "bad \\ud800 text"}\n')
    with pytest.raises(ValueError, match=r"s.jsonl:2: \"text\" holds a lone surrogate"):
        list(iter_texts([surrogate]))
    good = gzip.compress(b"".join(json.dumps({"text": f"doc {i} " * 50}).encode() + b"\n" for i in range(200)))
    broken = bytearray(good)
    broken[200:260] = bytes(60)  # a corrupt deflate stream: zlib.error, which was not caught
    (tmp_path / "c.jsonl.gz").write_bytes(bytes(broken))
    with pytest.raises(ValueError, match=r"c.jsonl.gz: cannot be read as jsonl.gz text \((error|BadGzipFile)"):
        list(iter_texts([tmp_path / "c.jsonl.gz"]))


def test_long_documents_are_cut_to_fit_the_trainer_not_skipped(tmp_path):
    """SentencePiece skips sentences over max_sentence_length bytes without a word: on the shared mix that was half of
    the bytes, and a corpus of long documents only failed with '!sentences_.empty()'."""
    from data.tokenizer import training_pieces
    text = ("a line of words é\n" * 40) + "x" * 300 + " 六" * 100
    pieces = list(training_pieces(iter([text, "short"]), 128))
    assert all(len(p.encode("utf-8")) <= 128 for p in pieces) and pieces[-1] == "short"
    assert "".join(pieces[:-1]) == text  # nothing lost: cut only
    assert pieces[0].endswith("\n")  # at a line break where there is one
    long_docs = [" ".join(corpus_lines(40, seed=i)) for i in range(30)]  # ~6 KB each, all over 4192 bytes
    (tmp_path / "long.txt").write_text("\n".join(long_docs) + "\n")
    model = train_tokenizer([str(tmp_path / "long.txt")], 300, str(tmp_path / "tok"), num_threads=1)
    assert spm.SentencePieceProcessor(model_file=model).get_piece_size() == 300


def test_a_tokenizer_without_a_space_piece_is_refused(tmp_path):
    """Byte fallback would spell each space as the 3 bytes of U+2581: the byte table and the audit agree with each
    other, and bits per byte is counted against the wrong text (a mistake that sank real submissions)."""
    from data.tokenizer import TokenizerError
    (tmp_path / "nospace.txt").write_text("\n".join("".join(line.split()) for line in corpus_lines(2000)) + "\n")
    with pytest.raises(TokenizerError, match="no '▁' piece"):
        train_tokenizer([str(tmp_path / "nospace.txt")], 300, str(tmp_path / "tok"), num_threads=1)
    assert not list(tmp_path.glob("tok.*"))
    spm.SentencePieceTrainer.train(input=str(tmp_path / "nospace.txt"), model_prefix=str(tmp_path / "raw"),
                                   vocab_size=300, model_type="bpe", byte_fallback=True, add_dummy_prefix=False,
                                   num_threads=1, minloglevel=2)
    with pytest.raises(TokenizerError, match="raw.model: no standalone '▁' piece"):
        build_byte_lut(str(tmp_path / "raw.model"))


def test_tokenizer_cli_threads_and_sentence_length(tmp_path, monkeypatch, capsys):
    import data.tokenizer as tok
    seen, real = {}, tok.train_tokenizer

    def record(inputs, vocab_size, out, **kw):
        seen.update(kw)
        return real(inputs, vocab_size, out, **kw)
    monkeypatch.setattr(tok, "train_tokenizer", record)
    (tmp_path / "c.txt").write_text("\n".join(corpus_lines(800)) + "\n")
    tok.main(["--input", str(tmp_path / "c.txt"), "--vocab-size", "300", "--out", str(tmp_path / "t"),
              "--num-threads", "1", "--max-sentence-length", "64"])
    assert seen == {"num_threads": 1, "max_sentence_length": 64}
    assert json.loads(capsys.readouterr().out)["vocab_size"] == 300
    with pytest.raises(SystemExit):
        tok.main(["--input", str(tmp_path / "c.txt"), "--vocab-size", "300", "--out", str(tmp_path / "u"),
                  "--num-threads", "0"])
    assert "--num-threads must be >= 1, got 0" in capsys.readouterr().err


def test_an_input_without_documents_is_named_not_sentencepieces_internal_check(tmp_path):
    """An empty (or whitespace-only) input printed SentencePiece's own `[!sentences_.empty()]`."""
    from data.tokenizer import TokenizerError
    (tmp_path / "empty.txt").write_text("\n  \n")
    with pytest.raises(TokenizerError, match=r"the inputs \(.*empty.txt\) hold no documents; nothing was written"):
        train_tokenizer([str(tmp_path / "empty.txt")], 300, str(tmp_path / "tok"), num_threads=1)
    assert not list(tmp_path.glob("tok.*"))


def test_shards_that_do_not_round_trip_through_the_tokenizer_are_refused(tmp_path):
    """Without a manifest nothing said which tokenizer made the shards: another of the same size decoded and counted
    them, and the byte audit agreed with itself. Decoding and encoding again tells them apart."""
    import numpy as np

    from data.tokenizer import TokenizerError, require_round_trip
    lines = corpus_lines(2000, seed=1)
    (tmp_path / "a.txt").write_text("\n".join(lines[:1000]) + "\n")
    (tmp_path / "b.txt").write_text("\n".join(line.upper() for line in lines[1000:]) + "\n")
    mine = spm.SentencePieceProcessor(model_file=train_tokenizer([str(tmp_path / "a.txt")], 300,
                                                                 str(tmp_path / "mine"), num_threads=1))
    other = spm.SentencePieceProcessor(model_file=train_tokenizer([str(tmp_path / "b.txt")], 300,
                                                                  str(tmp_path / "other"), num_threads=1))
    tokens = np.concatenate([np.array([1, *mine.encode(line)], dtype=np.uint16) for line in lines[:80]])
    require_round_trip(tokens, mine, "val/*.bin", "mine.model")  # its own shards pass
    with pytest.raises(TokenizerError, match=r"val/\*.bin: decoded with other.model and encoded again, \d+ of the "
                                             r"first 64 documents come back as other ids"):
        require_round_trip(tokens, other, "val/*.bin", "other.model")
