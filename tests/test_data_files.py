"""data/files.py (write_atomic, used by every layer that writes a file) and training.checkpoint.replace_folder."""
import os

import numpy as np
import pytest

from data.files import current_umask, write_atomic
from training.checkpoint import replace_folder


def plain_mode() -> int:
    return 0o666 & ~current_umask()  # the process's umask is the same now as when data.files was imported


def test_write_atomic_makes_the_folder_and_leaves_no_temp_file(tmp_path):
    """A summary written after hours of runs (ablate/bench_quant --out, submission.json) must not be lost to a
    folder nobody created; the file gets a plain open()'s mode, and a failed write leaves the old file and no
    temp file behind."""
    target = tmp_path / "new" / "deeper" / "summary.json"
    write_atomic(target, b"{}")
    assert target.read_bytes() == b"{}" and os.listdir(target.parent) == ["summary.json"]
    assert target.stat().st_mode & 0o777 == plain_mode()
    with pytest.raises(TypeError):
        write_atomic(target, b"[", "not bytes")
    assert target.read_bytes() == b"{}" and os.listdir(target.parent) == ["summary.json"]


def test_write_atomic_writes_its_chunks_in_order(tmp_path):
    """A shard is its header then its tokens, written from the array without a joined copy."""
    target = tmp_path / "s.bin"
    tokens = np.arange(5, dtype="<u2")
    write_atomic(target, b"head", memoryview(b"-"), tokens)
    assert target.read_bytes() == b"head-" + tokens.tobytes()
    write_atomic(target)  # no chunks: an empty file
    assert target.read_bytes() == b""


def test_umask_is_read_without_being_changed():
    before = os.umask(0o027)
    try:
        assert current_umask() == 0o027 and current_umask() == 0o027
    finally:
        os.umask(before)


def test_shards_tokenizer_artifacts_and_summaries_are_written_through_it():
    """One routine, not five: the modules that had their own (shards, tokenizer, manifest, artifact, summaries)
    and the record's files use data.files.write_atomic. (Checkpoints are torch.save'd into a folder that
    training.checkpoint.replace_folder puts in place; the run log is appended line by line.)"""
    import data.prepare
    import data.shards
    import data.tokenizer
    import quant.container
    import quant.export
    import scripts.export_record
    import training.records
    for module in (data.prepare, data.shards, data.tokenizer, quant.container, quant.export, scripts.export_record,
                   training.records):
        assert module.write_atomic is write_atomic, module.__name__


def make_folder(path, text):
    path.mkdir()
    (path / "file.txt").write_text(text)


def test_replace_folder_puts_the_new_folder_in_place_of_the_old(tmp_path):
    final, aside = tmp_path / "record", tmp_path / ".record.replaced"
    make_folder(tmp_path / "new1", "one")
    replace_folder(tmp_path / "new1", final, aside)  # nothing there yet
    make_folder(tmp_path / "new2", "two")
    replace_folder(tmp_path / "new2", final, aside)  # a non-empty folder there: it goes aside, then away
    assert (final / "file.txt").read_text() == "two"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["record"]


def test_replace_folder_clears_an_aside_left_by_a_killed_run(tmp_path):
    final, aside = tmp_path / "step_00000010", tmp_path / "step_00000010.replaced"
    make_folder(final, "current")
    make_folder(aside, "stale")  # a run killed after its first rename, whose caller recovered `final` otherwise
    make_folder(tmp_path / "new", "newest")
    replace_folder(tmp_path / "new", final, aside)
    assert (final / "file.txt").read_text() == "newest" and not aside.exists()


def test_a_failed_replace_keeps_the_old_folder_aside_for_recovery(tmp_path, fail_at_call):
    """Killed between the two renames (simulated: the second fails), the old folder is at `aside`, whole."""
    final, aside = tmp_path / "record", tmp_path / ".record.replaced"
    make_folder(final, "old")
    make_folder(tmp_path / "new", "new")
    fail_at_call(os, "replace", 2, OSError("simulated crash"))
    with pytest.raises(OSError, match="simulated crash"):
        replace_folder(tmp_path / "new", final, aside)
    assert (aside / "file.txt").read_text() == "old" and not final.exists()
