"""The training token stream over memory-mapped shards, and the validation split's tokens (load_tokens).

Training order. A pass splits every shard into blocks of seq_len + 1 tokens (inputs and their
shifted targets; consecutive blocks share one token, so every target token after the phase offset is
used once). For each (pass, shard) a generator seeded with (seed, pass, shard) -- identical on every
rank -- draws a phase (a token offset in [0, seq_len) and a starting block) and a stride coprime to the
block count; visiting blocks (start + k * stride) mod n_blocks for k = 0..n_blocks-1 reaches every
block exactly once. The blocks of all shards are numbered one after another, and rank r takes the numbers
r, r + W, r + 2W, ... below the largest multiple of W: ranks are disjoint, each gets the same count (so all
stay in the same pass, step for step), and together they cover the pass but for fewer than W blocks. Shards
shorter than seq_len + 1 tokens are left out (`skipped`). Each batch mixes up to `shards_per_batch` shards, chosen with probability proportional to
their blocks left in the pass so all shards drain together. The whole order is a pure function of
(seed, rank, world_size, seq_len, batch_seqs, shard sizes) and of the small resumable state
(pass, draws, per-shard cursors).

Delivery. A daemon thread builds batches into pinned CPU memory and queues up to `prefetch` of them;
on CUDA the host-to-device copy of batch i+1 is issued on a side stream when batch i is handed out.
`state_dict()` describes the batches handed out by `next_batch()`, never those merely prefetched.
"""
from __future__ import annotations

import math
import os
import queue
import threading
from pathlib import Path

import numpy as np
import torch

from data.shards import HEADER_BYTES, ShardError, file_sample, read_shard

STATE_FORMAT = 2  # 2: ranks take equal shares of all shards' blocks (format 1's split differs when world_size > 1)
_PHASE_TAG = 0x5EED  # separates the per-shard phase stream from the per-batch shard-choice stream


class _Pass:
    """The block order of one shard in one pass (shared by all ranks)."""

    def __init__(self, n_tokens: int, seq_len: int, rng: np.random.Generator):
        max_offset = min(seq_len - 1, n_tokens - 1 - seq_len)
        self.offset = int(rng.integers(0, max_offset + 1))
        self.n_blocks = (n_tokens - 1 - self.offset) // seq_len
        self.start = int(rng.integers(0, self.n_blocks))
        stride = int(rng.integers(1, max(self.n_blocks, 2)))
        while math.gcd(stride, self.n_blocks) != 1:
            stride = int(rng.integers(1, max(self.n_blocks, 2)))
        self.stride = stride

    def token_start(self, k: int, seq_len: int) -> int:
        return self.offset + ((self.start + k * self.stride) % self.n_blocks) * seq_len

    def assign(self, numbered_before: int, numbered_total: int, rank: int, world_size: int) -> None:
        """This rank's blocks of the shard: k = first, first + W, ... for the blocks numbered (numbered_before + k)
        that are r mod W and below the last multiple of W of the pass's total."""
        used = numbered_total // world_size * world_size
        self.first = (rank - numbered_before) % world_size
        limit = min(self.n_blocks, used - numbered_before)
        self.count = max(0, (limit - self.first + world_size - 1) // world_size)


def fewest_blocks(n_tokens: int, seq_len: int) -> int:
    """A shard's blocks in its worst pass: the one whose phase offset is largest."""
    return (n_tokens - 1 - min(seq_len - 1, n_tokens - 1 - seq_len)) // seq_len


class TokenLoader:
    """Batches of (inputs, targets), int64 [batch_seqs, seq_len] on `device`; see the module docstring."""

    def __init__(self, files: list[str], seq_len: int, batch_seqs: int, rank: int = 0, world_size: int = 1,
                 seed: int = 0, shards_per_batch: int = 4, prefetch: int = 4,
                 device: str | torch.device = "cpu", vocab_size: int | None = None):
        if not files:
            raise ValueError("TokenLoader: no shard files given (hint: check data.train_files)")
        if seq_len < 1 or batch_seqs < 1:
            raise ValueError(f"TokenLoader: seq_len ({seq_len}) and batch_seqs ({batch_seqs}) must be >= 1")
        if not 0 <= rank < world_size:
            raise ValueError(f"TokenLoader: rank {rank} must be in [0, world_size={world_size})")
        if seed < 0 or shards_per_batch < 1 or prefetch < 0:
            raise ValueError(f"TokenLoader: need seed >= 0 (got {seed}), shards_per_batch >= 1 (got "
                             f"{shards_per_batch}) and prefetch >= 0 (got {prefetch})")
        shards = [(str(f), read_shard(f)) for f in files]  # memory maps: pages load on demand
        # A last shard of a few tokens (data.prepare writes whatever is left) holds no sequence: left out, said.
        self.skipped = [(f, len(t)) for f, t in shards if len(t) < seq_len + 1]
        self.files = [f for f, t in shards if len(t) >= seq_len + 1]
        self.tokens = [t for _, t in shards if len(t) >= seq_len + 1]
        if not self.files:
            f, n = self.skipped[0]
            raise ValueError(f"TokenLoader: {f} has {n} tokens, fewer than seq_len + 1 = {seq_len + 1}, and so has "
                             f"every shard given ({len(shards)}; hint: a shorter data.seq_len, or check the shards)")
        worst = sum(fewest_blocks(len(t), seq_len) for t in self.tokens)
        if worst < world_size:  # each rank needs a block in every pass, whatever its phase offsets
            raise ValueError(f"TokenLoader: {len(self.files)} usable shard(s) of {len(shards)} hold {worst} sequences "
                             f"of seq_len + 1 = {seq_len + 1} tokens in a pass, fewer than world_size {world_size} "
                             "(hint: more data, a shorter data.seq_len, or fewer ranks)")
        self._inodes = [(st.st_dev, st.st_ino) for st in map(os.stat, self.files)]  # a file renamed over it: not ours
        self.samples = [file_sample(f) for f in self.files]  # what a resume and the seed tools compare
        self.vocab_size = vocab_size
        self.seq_len, self.batch_seqs = seq_len, batch_seqs
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.shards_per_batch, self.prefetch = shards_per_batch, prefetch
        self.device = torch.device(device)
        self._pin = self.device.type == "cuda"
        if self._pin and self.device.index is None:  # the producer thread needs an explicit index
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._copy_stream = torch.cuda.Stream(self.device) if self._pin else None
        self._passes: dict[int, list[_Pass]] = {}
        self._consumed = self._initial_state()
        self._ready = None      # (x, y, event, state) of the batch already copied to the device
        self._thread = None
        self._closed = False
        self._start_producer(self._consumed)

    # ----- the order: a pure function of the state -----

    def _initial_state(self) -> dict:
        return {"pass": 0, "draws": 0, "cursors": [0] * len(self.files)}

    def _pass(self, p: int) -> list[_Pass]:
        passes = self._passes.get(p)  # read once: the producer thread may swap the cache concurrently
        if passes is None:
            passes = [_Pass(len(t), self.seq_len, np.random.default_rng([self.seed, p, s, _PHASE_TAG]))
                      for s, t in enumerate(self.tokens)]
            total, before = sum(sp.n_blocks for sp in passes), 0
            for sp in passes:
                sp.assign(before, total, self.rank, self.world_size)
                before += sp.n_blocks
            self._passes = {p: passes}
        return passes

    def blocks_in_pass(self, p: int) -> int:
        """How many blocks (sequences) this rank receives in pass `p`: the same on every rank."""
        return sum(sp.count for sp in self._pass(p))

    def _plan_batch(self, state: dict) -> tuple[list[tuple[int, int]], dict]:
        """(shard, token start) of each row of the next batch, and the state after it."""
        p, draws, cursors = state["pass"], state["draws"], list(state["cursors"])
        rows: list[tuple[int, int]] = []
        while len(rows) < self.batch_seqs:
            passes = self._pass(p)
            left = np.array([sp.count - c for sp, c in zip(passes, cursors)], dtype=np.float64)
            if left.sum() == 0:  # never at a pass's start: the constructor made sure every rank has a block
                p, draws, cursors = p + 1, 0, [0] * len(cursors)
                continue
            rng = np.random.default_rng([self.seed, self.rank, p, draws])
            draws += 1
            active = np.flatnonzero(left)
            k = min(self.shards_per_batch, len(active))
            chosen = rng.choice(active, size=k, replace=False, p=left[active] / left[active].sum())
            need = self.batch_seqs - len(rows)
            for i, s in enumerate(chosen.tolist()):
                take = min(need // k + (i < need % k), int(left[s]))
                for c in range(cursors[s], cursors[s] + take):
                    kk = passes[s].first + c * self.world_size
                    rows.append((s, passes[s].token_start(kk, self.seq_len)))
                cursors[s] += take
        if all(sp.count == c for sp, c in zip(self._pass(p), cursors)):
            p, draws, cursors = p + 1, 0, [0] * len(cursors)  # canonical: a finished pass is the next one
        return rows, {"pass": p, "draws": draws, "cursors": cursors}

    def _gather(self, rows: list[tuple[int, int]]) -> torch.Tensor:
        """Token rows [batch_seqs, seq_len + 1] as int32, pinned when bound for a GPU."""
        for s in {s for s, _ in rows}:  # a shard cut short under its memory map would kill the process (SIGBUS)
            try:
                st = os.stat(self.files[s])
            except FileNotFoundError:
                continue  # moved or deleted: the map still holds the file
            if (st.st_dev, st.st_ino) == self._inodes[s] and st.st_size < HEADER_BYTES + 2 * len(self.tokens[s]):
                raise ShardError(f"{self.files[s]}: shorter than when training started: overwritten in place? "
                                 "(hint: replace shards by renaming a finished file into place, as data.prepare "
                                 "and data.download do)")
        out = torch.empty((len(rows), self.seq_len + 1), dtype=torch.int32, pin_memory=self._pin)
        buf = out.numpy()
        for i, (s, start) in enumerate(rows):
            buf[i] = self.tokens[s][start:start + self.seq_len + 1]
        if self.vocab_size is not None and buf.max() >= self.vocab_size:  # else an index error inside the model
            i = int(np.argmax(buf.max(axis=1)))
            raise ShardError(f"{self.files[rows[i][0]]}: token id {int(buf[i].max())} near token {rows[i][1]} is "
                             f"outside the model's vocabulary of {self.vocab_size} (hint: shards made with another "
                             "tokenizer than data.tokenizer)")
        return out

    # ----- the producer thread -----

    def _produce_one(self, state: dict):
        """(pinned int32 rows for a GPU, or the final (x, y) on CPU, state after this batch)."""
        plan, after = self._plan_batch(state)
        rows = self._gather(plan)
        if self._pin:
            return rows, after
        return (rows[:, :-1].long(), rows[:, 1:].long()), after

    def _start_producer(self, state: dict) -> None:
        self._producer_state = state
        self._taken = 0
        if self.prefetch == 0:
            return
        # A slot frees only when next_batch() returns, not when it takes a batch from the queue: the
        # producer then does its (GIL-holding) work during the caller's step instead of competing with
        # next_batch()'s own device calls for the GIL.
        self._queue: queue.Queue = queue.Queue()
        self._slots = threading.Semaphore(self.prefetch)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce_forever, name="TokenLoader", daemon=True,
                                        args=(self._queue, self._slots, self._stop, state))
        self._thread.start()

    def _produce_forever(self, q: queue.Queue, slots: threading.Semaphore, stop: threading.Event,
                         state: dict) -> None:
        try:
            if self._pin:  # else pinning from this thread would open a CUDA context on GPU 0 in every rank
                torch.cuda.set_device(self.device)
            while True:
                while not slots.acquire(timeout=0.05):
                    if stop.is_set():
                        return
                if stop.is_set():
                    return
                item = self._produce_one(state)
                state = item[1]
                q.put(item)
        except BaseException as exc:  # handed to the consumer, who re-raises it
            q.put(exc)

    def _stop_producer(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def _next_cpu(self):
        if self._closed:  # the queue may still hold prefetched batches, then nothing: a get() would wait forever
            raise RuntimeError("TokenLoader: next_batch() after close() (hint: load_state_dict() restarts it)")
        if self.prefetch == 0:
            item = self._produce_one(self._producer_state)
            self._producer_state = item[1]
            return item
        item = self._queue.get()
        if isinstance(item, BaseException):
            self._queue.put(item)  # the thread has stopped: every later call fails the same way, none waits forever
            if isinstance(item, ShardError):  # names the shard: what to fix
                raise item
            raise RuntimeError("TokenLoader: the prefetch thread failed") from item
        self._taken += 1
        return item

    def _free_slots(self) -> None:
        if self._thread is not None:
            for _ in range(self._taken):
                self._slots.release()
        self._taken = 0

    # ----- delivery -----

    def _to_device(self, rows, state: dict):
        if self._copy_stream is None:  # CPU: the producer already built (x, y)
            return *rows, None, state
        with torch.cuda.stream(self._copy_stream):
            dev = rows.to(self.device, non_blocking=True)
            x, y = dev[:, :-1].long(), dev[:, 1:].long()
            event = torch.cuda.Event()
            event.record(self._copy_stream)
        return x, y, event, state

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._ready is None:
            self._ready = self._to_device(*self._next_cpu())
        x, y, event, state = self._ready
        # Free the slots of batches already taken before waiting for the next one: with prefetch=1
        # the producer would otherwise wait for a slot while we wait for its batch (a deadlock).
        self._free_slots()
        # Start the next copy now so it overlaps the caller's compute on this batch.
        self._ready = self._to_device(*self._next_cpu()) if self._copy_stream is not None else None
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            x.record_stream(current)  # the allocator must not reuse these while the step still reads them
            y.record_stream(current)
        self._consumed = state
        self._free_slots()
        return x, y

    @property
    def epoch(self) -> int:
        """The pass (0-based) the next handed-out block comes from."""
        return self._consumed["pass"]

    def state_dict(self) -> dict:
        return {"format": STATE_FORMAT, "seed": self.seed, "rank": self.rank, "world_size": self.world_size,
                "seq_len": self.seq_len, "files": [Path(f).name for f in self.files],
                "shard_tokens": [len(t) for t in self.tokens], "shard_samples": list(self.samples),
                "pass": self._consumed["pass"], "draws": self._consumed["draws"],
                "cursors": list(self._consumed["cursors"])}

    def load_state_dict(self, d: dict) -> None:
        mine = self.state_dict()
        if d.get("format") == 1 and self.world_size == 1:  # one rank's order is the same in both formats
            d = {**d, "format": STATE_FORMAT}
        if d.get("format") == 1:
            raise ValueError("TokenLoader.load_state_dict: the state was written by an older loader, whose split of "
                             "the blocks among ranks differs, so it cannot resume on several ranks (hint: resume it on "
                             "one rank, or start a new run)")
        for key in ("shard_tokens", "shard_samples"):  # a state from before they were saved: not checked
            if key not in d:
                mine.pop(key)
        for key in ("format", "seed", "rank", "world_size", "seq_len", "files", "shard_tokens", "shard_samples"):
            if key in mine and d.get(key) != mine[key]:
                raise ValueError(f"TokenLoader.load_state_dict: state has {key}={_short(d.get(key))} but this loader "
                                 f"has {_short(mine[key])} (hint: resume with the same data, seed, seq_len and world "
                                 "size; shards rebuilt under the same names are other data)")
        consumed = {"pass": int(d["pass"]), "draws": int(d["draws"]), "cursors": [int(c) for c in d["cursors"]]}
        counts = [sp.count for sp in self._pass(consumed["pass"])]
        if len(consumed["cursors"]) != len(counts) or not all(0 <= c <= n for c, n in zip(consumed["cursors"], counts)):
            raise ValueError(f"TokenLoader.load_state_dict: cursors {_short(consumed['cursors'])} do not fit this "
                             f"rank's blocks per shard in pass {consumed['pass']} ({_short(counts)}) (hint: the state "
                             "is of other shards)")
        self._stop_producer()
        self._ready = None
        self._closed = False
        self._consumed = consumed
        self._start_producer(self._consumed)

    def close(self) -> None:
        """Stops the prefetch thread; next_batch() then refuses (load_state_dict starts the loader again)."""
        self._stop_producer()
        self._ready = None
        self._closed = True

    def __enter__(self) -> "TokenLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _short(value, most: int = 8) -> str:
    """A state field for a message: lists of hundreds of shards cut to their first entries."""
    if isinstance(value, list) and len(value) > most:
        return repr(value[:most])[:-1] + f", ... ({len(value)} in all)]"
    return repr(value)


def load_tokens(files: list[str], max_tokens: int = 0) -> np.ndarray:
    """The tokens of `files` concatenated in order (uint16, in memory): the validation split. With
    max_tokens > 0 only its first max_tokens tokens (eval.max_tokens), and shards past them are not read."""
    if not files:
        raise ValueError("load_tokens: no shard files given (hint: check data.val_files)")
    if max_tokens < 0:
        raise ValueError(f"load_tokens: max_tokens={max_tokens}, expected >= 0 (0 = every token)")
    parts, count = [], 0
    for f in files:
        parts.append(read_shard(f, mmap=False))
        count += len(parts[-1])
        if max_tokens and count >= max_tokens:
            break
    tokens = np.concatenate(parts)
    return tokens[:max_tokens] if max_tokens else tokens
