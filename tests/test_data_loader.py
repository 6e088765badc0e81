"""Training loader order (coverage, rank disjointness, seeding, resume) and the validation iterators."""
import json
import os

import numpy as np
import pytest
import torch

from data import loader as loader_module
from data.loader import TokenLoader, load_tokens
from data.shards import ShardError, write_shard

SHARD_BASE = 10_000  # token value = shard * SHARD_BASE + position: every row's first token names its block


@pytest.fixture
def shards(tmp_path):
    sizes = [9000, 4001, 7777, 650, 9999]
    files = []
    for s, n in enumerate(sizes):
        path = tmp_path / f"train_{s:06d}.bin"
        write_shard(path, s * SHARD_BASE + np.arange(n))
        files.append(str(path))
    return files, sizes


def take(loader, n_batches):
    return [loader.next_batch() for _ in range(n_batches)]


def rows_of_pass(loader, p=0):
    """The first blocks_in_pass(p) rows the loader hands out, as first-input-token values."""
    need = loader.blocks_in_pass(p)
    firsts = []
    while len(firsts) < need:
        x, y = loader.next_batch()
        assert torch.equal(x[:, 1:], y[:, :-1])  # targets are inputs shifted by one
        firsts.extend(x[:, 0].tolist())
    return firsts[:need]


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_one_pass_tiles_every_shard_once_and_ranks_are_disjoint(shards, world_size):
    files, sizes = shards
    seq_len = 64
    per_rank = []
    for rank in range(world_size):
        with TokenLoader(files, seq_len, batch_seqs=7, rank=rank, world_size=world_size, seed=3,
                         shards_per_batch=2, prefetch=2) as loader:
            per_rank.append(rows_of_pass(loader))
    everything = [v for rows in per_rank for v in rows]
    assert len(everything) == len(set(everything)), "a block was served twice in one pass"
    assert len({len(rows) for rows in per_rank}) == 1, "ranks got different counts, so they drift into other passes"
    tiles = 0
    for s, n in enumerate(sizes):
        starts = sorted(v - s * SHARD_BASE for v in everything if v // SHARD_BASE == s)
        offset = starts[0] % seq_len  # the pass's phase offset, in [0, seq_len)
        # blocks of the tiling from the phase offset to the last full block
        assert all((v - offset) % seq_len == 0 and v + seq_len + 1 <= n for v in starts)
        tiles += (n - 1 - offset) // seq_len
    assert 0 <= tiles - len(everything) < world_size  # every block once, but for the remainder of an equal split
    if world_size == 1:
        assert tiles == len(everything)


def test_ranks_get_equal_shares_and_stay_in_the_same_pass(shards):
    """Spare blocks of every shard went to the lowest ranks first: with 5 shards and 8 ranks the counts of pass 0
    were 32, 32, 31, 31, 31, 30, 28, 27, so ranks drifted into different passes and read the same tokens in one
    step. Each rank now gets the same count, pass after pass."""
    files, _ = shards
    for p in range(4):
        counts = []
        for rank in range(8):
            with TokenLoader(files, 64, batch_seqs=4, rank=rank, world_size=8, seed=5, prefetch=0) as loader:
                counts.append(loader.blocks_in_pass(p))
        assert len(set(counts)) == 1, (p, counts)


def test_a_loader_failure_is_named_and_every_later_call_fails_too(shards, tmp_path, monkeypatch):
    """After the prefetch thread failed, a second next_batch() waited forever on an empty queue.
    A shard's own problem (an id outside the vocabulary, a file cut short while training, which under a memory map
    killed the process with SIGBUS) is named as a ShardError; other failures come wrapped, with their cause."""
    import threading

    def twice(loader, error, says):
        outcomes = []

        def call_twice():
            for _ in range(2):
                try:
                    loader.next_batch()
                except Exception as e:
                    outcomes.append(e)
        worker = threading.Thread(target=call_twice, daemon=True)
        worker.start()
        worker.join(timeout=20)
        assert not worker.is_alive(), "next_batch() blocked after the loader failed"
        assert len(outcomes) == 2 and all(isinstance(e, error) and says in str(e) for e in outcomes), outcomes
    files, _ = shards
    with TokenLoader(files, 16, 2, prefetch=2, vocab_size=1000) as loader:  # ids reach 4 * SHARD_BASE
        twice(loader, ShardError, "is outside the model's vocabulary of 1000 (hint: shards made with another")
    cut = tmp_path / "cut.bin"
    write_shard(cut, np.arange(5000))
    with TokenLoader([str(cut)], 16, 2, prefetch=0) as loader:
        loader.next_batch()
        os.truncate(cut, 3000)  # as `cp` over it would leave it for a moment
        with pytest.raises(ShardError, match="cut.bin: shorter than when training started: overwritten in place"):
            loader.next_batch()

    def broken(self, state):
        raise ValueError("boom")
    monkeypatch.setattr(TokenLoader, "_plan_batch", broken)
    with TokenLoader(files, 16, 2, prefetch=2) as loader:
        twice(loader, RuntimeError, "TokenLoader: the prefetch thread failed")


def test_a_shard_too_short_for_one_sequence_is_left_out(shards, tmp_path):
    """data.prepare writes what is left into its last shard, which can be a few tokens: the loader refused the whole
    set. That shard is left out now and listed in `skipped`; train.py logs it."""
    files, _ = shards
    stub = tmp_path / "train_999999.bin"
    write_shard(stub, np.arange(3))
    with TokenLoader([*files, str(stub)], 64, 4, prefetch=0) as loader, \
            TokenLoader(files, 64, 4, prefetch=0) as without:
        assert loader.skipped == [(str(stub), 3)] and loader.files == files
        assert all(torch.equal(a, b) for a, b in zip(loader.next_batch(), without.next_batch()))


def test_batches_mix_several_shards(shards):
    files, _ = shards
    with TokenLoader(files, 32, batch_seqs=8, seed=0, shards_per_batch=4, prefetch=0) as loader:
        counts = [len(set((x[:, 0] // SHARD_BASE).tolist())) for x, _ in take(loader, 20)]
    assert max(counts) == 4 and min(counts) >= 2
    with TokenLoader(files, 32, batch_seqs=8, seed=0, shards_per_batch=1, prefetch=0) as loader:
        counts = [len(set((x[:, 0] // SHARD_BASE).tolist())) for x, _ in take(loader, 20)]
    assert max(counts) <= 2  # one shard per draw; a second only when the first runs dry


def test_same_seed_same_order_different_seed_different_order(shards):
    files, _ = shards

    def firsts(seed, prefetch):
        with TokenLoader(files, 48, batch_seqs=5, seed=seed, prefetch=prefetch) as loader:
            return [x[:, 0].tolist() for x, _ in take(loader, 30)]
    assert firsts(1, 0) == firsts(1, 4) == firsts(1, 1)
    assert firsts(1, 0) != firsts(2, 0)


def test_each_pass_is_a_new_order_of_a_full_tiling(shards):
    files, _ = shards
    with TokenLoader(files, 50, batch_seqs=1, seed=5, prefetch=2) as loader:
        first = rows_of_pass(loader, 0)
        assert loader.epoch == 1
        second = rows_of_pass(loader, 1)
        assert loader.epoch == 2
    assert len(set(second)) == len(second) and second != first
    # a new phase offset per pass: the tiling itself moves, not only the order
    assert set(second) != set(first)


@pytest.mark.parametrize("prefetch", [0, 4])
def test_resume_reproduces_batches_even_with_prefetch_ahead(shards, prefetch):
    files, _ = shards
    kwargs = dict(seq_len=40, batch_seqs=6, seed=11, shards_per_batch=3, prefetch=prefetch)
    with TokenLoader(files, **kwargs) as a:
        take(a, 13)
        state = json.loads(json.dumps(a.state_dict()))  # must survive JSON
        expected = take(a, 200)  # runs past a pass boundary
        assert a.epoch >= 1
    with TokenLoader(files, **kwargs) as b:
        b.load_state_dict(state)
        got = take(b, 200)
    for (xe, ye), (xg, yg) in zip(expected, got):
        assert torch.equal(xe, xg) and torch.equal(ye, yg)


def test_rewind_in_place(shards):
    files, _ = shards
    with TokenLoader(files, 40, batch_seqs=6, seed=2, prefetch=4) as loader:
        state = loader.state_dict()
        first = take(loader, 5)
        loader.load_state_dict(state)
        again = take(loader, 5)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(first, again))


def test_state_from_another_setup_is_refused(shards):
    files, _ = shards
    with TokenLoader(files, 40, batch_seqs=6, seed=2, prefetch=0) as a:
        state = a.state_dict()
    with TokenLoader(files, 40, batch_seqs=6, seed=3, prefetch=0) as b:
        with pytest.raises(ValueError, match="seed=2 but this loader has 3"):
            b.load_state_dict(state)


def test_a_state_of_other_shards_under_the_same_names_is_refused(shards, tmp_path):
    """The state named its shards only, so shards rebuilt under the same names (another
    --shard-tokens, another corpus) resumed silently, cursors past a shard's new end skipping the rest of the pass."""
    files, _ = shards
    with TokenLoader(files, 16, batch_seqs=8, seed=2, prefetch=0) as a:
        take(a, 30)
        state = a.state_dict()
    write_shard(files[0], np.arange(1000))  # the same name, other data
    with TokenLoader(files, 16, batch_seqs=8, seed=2, prefetch=0) as b:
        with pytest.raises(ValueError, match=r"state has shard_tokens=\[9000, .* but this loader has \[1000, "
                                             r".*shards rebuilt under the same names are other data"):
            b.load_state_dict(state)
        old = {k: v for k, v in state.items() if k not in ("shard_tokens", "shard_samples")}  # an older state
        with pytest.raises(ValueError, match=r"cursors \[.*\] do not fit this rank's blocks per shard in pass 0"):
            b.load_state_dict({**old, "cursors": [10_000] + old["cursors"][1:]})
        b.load_state_dict({**old, "cursors": [0] * len(files)})  # names alone and cursors that fit: accepted
        take(b, 2)
    # other tokens, the same names and counts (every full shard of a set holds shard_tokens): the samples differ
    write_shard(files[0], np.arange(9000) + 7)
    with TokenLoader(files, 16, batch_seqs=8, seed=2, prefetch=0) as c:
        with pytest.raises(ValueError, match=r"state has shard_samples=.* but this loader has"):
            c.load_state_dict({**state, "shard_tokens": c.state_dict()["shard_tokens"]})


def test_an_old_state_on_several_ranks_and_a_closed_loader_are_refused(shards):
    files, _ = shards
    with TokenLoader(files, 16, batch_seqs=4, seed=2, prefetch=2, rank=1, world_size=2) as a:
        state = a.state_dict()
        with pytest.raises(ValueError, match="written by an older loader.*cannot resume on several ranks"):
            a.load_state_dict({**state, "format": 1})
        take(a, 1)
    with pytest.raises(RuntimeError, match=r"next_batch\(\) after close\(\)"):  # used to wait forever
        a.next_batch()
    a.load_state_dict(state)  # restarts it
    assert a.next_batch()[0].shape == (4, 16)
    a.close()


def test_outputs_are_int64_on_device(shards):
    files, _ = shards
    with TokenLoader(files, 16, batch_seqs=3, prefetch=1, device="cpu") as loader:
        x, y = loader.next_batch()
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (3, 16) and x.device.type == "cpu"


def test_bad_arguments_are_explained(shards, tmp_path):
    files, _ = shards
    with pytest.raises(ValueError, match="rank 2 must be in"):
        TokenLoader(files, 16, 2, rank=2, world_size=2)
    with pytest.raises(ValueError, match="shards_per_batch >= 1"):
        TokenLoader(files, 16, 2, shards_per_batch=0)
    tiny = tmp_path / "tiny.bin"
    write_shard(tiny, np.arange(10))
    with pytest.raises(ValueError, match="tiny.bin has 10 tokens"):
        TokenLoader([str(tiny)], 16, 2)
    # 3-4 blocks of 16 by the pass's phase offset: too few for 8 ranks. A rank used to fail only in the pass that
    # left it none, hours into a run; it is refused before any pass now.
    write_shard(tiny, np.arange(65))
    with pytest.raises(ValueError, match=r"1 usable shard\(s\) of 1 hold 3 sequences of seq_len \+ 1 = 17 tokens in "
                                         "a pass, fewer than world_size 8"):
        TokenLoader([str(tiny)], 16, 2, rank=7, world_size=8)


def test_load_tokens_concatenates_in_order(shards):
    files, sizes = shards
    tokens = load_tokens(files[:2])
    assert tokens.dtype == np.uint16 and len(tokens) == sizes[0] + sizes[1]
    assert tokens[sizes[0]] == SHARD_BASE


def test_load_tokens_max_tokens_takes_a_prefix_and_skips_later_shards(shards, monkeypatch):
    files, sizes = shards
    whole = load_tokens(files[:3])
    cut = sizes[0] + 5  # ends inside the second shard
    read = []
    real_read_shard = loader_module.read_shard
    monkeypatch.setattr(loader_module, "read_shard", lambda f, **kw: read.append(f) or real_read_shard(f, **kw))
    prefix = load_tokens(files[:3], max_tokens=cut)
    assert np.array_equal(prefix, whole[:cut])
    assert read == files[:2]  # the third shard is past the cap: never read
    read.clear()
    assert np.array_equal(load_tokens(files[:3], max_tokens=sizes[0]), whole[:sizes[0]])
    assert read == files[:1]  # a cap at a shard's end reads no further
    assert np.array_equal(load_tokens(files[:3], max_tokens=10 * len(whole)), whole)  # a cap past the end: all
    with pytest.raises(ValueError, match="max_tokens=-1"):
        load_tokens(files[:3], max_tokens=-1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("prefetch", [1, 3])  # prefetch=1 once deadlocked on CUDA (two batches in hand)
def test_cuda_path_matches_cpu_path(shards, prefetch):
    files, _ = shards
    kwargs = dict(seq_len=64, batch_seqs=8, seed=4, prefetch=prefetch)
    with TokenLoader(files, device="cpu", **kwargs) as cpu, TokenLoader(files, device="cuda", **kwargs) as gpu:
        for _ in range(50):
            (xc, yc), (xg, yg) = cpu.next_batch(), gpu.next_batch()
            assert xg.is_cuda and torch.equal(xc, xg.cpu()) and torch.equal(yc, yg.cpu())
        state = gpu.state_dict()
        expect = [gpu.next_batch()[0].cpu() for _ in range(5)]
        gpu.load_state_dict(state)
        assert all(torch.equal(e, gpu.next_batch()[0].cpu()) for e in expect)


def test_a_shard_renamed_over_or_moved_keeps_training_from_its_map(tmp_path):
    """The size check named a shard that was replaced by a rename (what the hint recommends) or moved away, though
    the memory map still held the intact file; an old single-rank state loads."""
    path = tmp_path / "s.bin"
    write_shard(path, np.arange(5000))
    with TokenLoader([str(path)], 16, 2, prefetch=0) as reference:  # the same seed on a file left alone
        expect = [reference.next_batch()[0] for _ in range(4)]
    write_shard(tmp_path / "copy.bin", np.arange(5000))
    os.replace(tmp_path / "copy.bin", path)
    with TokenLoader([str(path)], 16, 2, prefetch=0) as loader:
        got = [loader.next_batch()[0]]
        write_shard(path, np.full(3000, 7))  # a new, shorter file renamed into place
        got.append(loader.next_batch()[0])
        os.remove(path)
        got.append(loader.next_batch()[0])
        state = {**loader.state_dict(), "format": 1}
        loader.load_state_dict(state)  # format 1 = format 2 for one rank
        got.append(loader.next_batch()[0])
    # the batches come from the map of the file opened (the new file holds only 7s), and the old state resumes
    # where it was
    assert all(torch.equal(a, b) for a, b in zip(got, expect))
