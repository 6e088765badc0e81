"""Benchmark data.loader.TokenLoader: sustained throughput, and time lost waiting for data in a training loop.

    python -m scripts.bench_loader [--files GLOB] [--device cpu|cuda] [--seq-len 2048] [--batch-seqs 48]
                                   [--steps N] [--step-ms 100] [--synthetic-tokens N]

1. throughput: next_batch() in a tight loop (on CUDA the host-to-device copy included, synchronized at
   the end): the most tokens/s the loader can deliver.
2. training loop: every step takes a batch, then simulates a step of --step-ms: a sleep on CPU, on CUDA a
   matmul loop that reads the batch, calibrated to --step-ms and synchronized at the end of each step
   (as a loss.item() would). `wait` is the time spent inside next_batch(); `overhead` compares the loop's
   wall time with as many simulated steps on a fixed, already-resident batch, in 5 alternating rounds (the
   median and the range: a difference of two timings is as noisy as the steps it times); each loader block
   first runs untimed steps on the batches the loader queued during the resident block.
Without --files it writes 4 temporary shards of --synthetic-tokens random tokens (default 20M each).
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from data.loader import TokenLoader
from data.shards import list_shards, write_shard


def synthetic_shards(directory: Path, n_shards: int, tokens: int) -> list[str]:
    rng = np.random.default_rng(0)
    files = []
    for i in range(n_shards):
        path = directory / f"synthetic_{i:06d}.bin"
        write_shard(path, rng.integers(0, 1024, size=tokens, dtype=np.uint16))
        files.append(str(path))
    return files


class SimulatedStep:
    """A step of about `ms` milliseconds that depends on the batch."""

    def __init__(self, ms: float, device: torch.device):
        self.ms, self.device = ms, device
        if device.type == "cuda":
            self.a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
            self.reps = self._calibrate()

    def _matmuls(self, x: torch.Tensor, reps: int) -> torch.Tensor:
        acc = self.a + x[0, 0].to(self.a.dtype)  # the step reads the batch: it must wait for the copy
        for _ in range(reps):
            acc = acc @ self.a
            acc = acc / acc.abs().amax()
        return acc

    def _calibrate(self) -> int:
        x = torch.zeros(1, 1, device=self.device, dtype=torch.int64)
        self._matmuls(x, 5)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        self._matmuls(x, 50)
        torch.cuda.synchronize()
        per_rep_ms = (time.perf_counter() - t0) * 1000 / 50
        return max(1, round(self.ms / per_rep_ms))

    def __call__(self, x: torch.Tensor) -> None:
        if self.device.type == "cuda":
            self._matmuls(x, self.reps)
            torch.cuda.synchronize()
        else:
            time.sleep(self.ms / 1000)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def throughput(loader: TokenLoader, steps: int, device: torch.device) -> float:
    loader.next_batch()  # thread start-up and first copy are not the steady state
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        x, _ = loader.next_batch()
    sync(device)
    return steps * x.numel() / (time.perf_counter() - t0)


ROUNDS = 5  # the overhead is a difference of two timings: measured in alternating rounds, its spread is shown
PREFETCH = 4  # batches the loader queues ahead (the config's data.prefetch default)


def training_loop(loader, steps: int, step: SimulatedStep, device: torch.device, prefetched: int = PREFETCH) -> dict:
    """`steps` loader steps in ROUNDS blocks, each after a block as long on a fixed, already-resident batch; the
    overhead is each round's (loader - resident) / loader, reported as the median and the range over rounds.
    The loader's thread fills its queue during a resident block: each loader block first runs `prefetched` steps
    untimed, which use up those batches at the step's pace (they came free, and a loader slower than the step
    looked almost free); taking them without steps instead stalled a fast loader once a round."""
    x, _ = loader.next_batch()
    step(x)
    waits, overheads, total = [], [], 0.0
    for r in range(ROUNDS):
        block = steps // ROUNDS + (r < steps % ROUNDS)
        t0 = time.perf_counter()
        for _ in range(block):
            step(x)
        resident = time.perf_counter() - t0
        for _ in range(prefetched):
            x, _ = loader.next_batch()
            step(x)
        t0 = time.perf_counter()
        for _ in range(block):
            t = time.perf_counter()
            x, _ = loader.next_batch()
            waits.append(time.perf_counter() - t)
            step(x)
        fed = time.perf_counter() - t0
        overheads.append((fed - resident) / fed)
        total += fed
    waits_ms = np.array(waits) * 1000
    return {"step_ms": total * 1000 / steps, "wait_ms": float(waits_ms.mean()),
            "wait_p99_ms": float(np.percentile(waits_ms, 99)), "wait_share": float(waits_ms.sum() / 1000 / total),
            "overhead": float(np.median(overheads)), "overhead_min": min(overheads), "overhead_max": max(overheads)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--files", help="glob of shards (default: temporary synthetic shards)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-seqs", type=int, default=48)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--step-ms", type=float, default=100.0)
    p.add_argument("--synthetic-tokens", type=int, default=20_000_000, help="tokens per synthetic shard")
    a = p.parse_args(argv)
    for flag, value, least in (("--seq-len", a.seq_len, 1), ("--batch-seqs", a.batch_seqs, 1),
                               ("--steps", a.steps, ROUNDS), ("--step-ms", a.step_ms, 0),
                               ("--synthetic-tokens", a.synthetic_tokens, 1)):
        if value < least:
            p.error(f"{flag} must be >= {least}, got {value}" + (f" ({ROUNDS} rounds of the training loop)"
                                                                 if flag == "--steps" else ""))
    device = torch.device(a.device)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            files = list_shards(a.files) if a.files else synthetic_shards(Path(tmp), 4, a.synthetic_tokens)
            loader = TokenLoader(files, a.seq_len, a.batch_seqs, seed=0, prefetch=PREFETCH, device=device)
        except (FileNotFoundError, ValueError) as e:  # no shard matches; a bad shard (ShardError)
            raise SystemExit(f"bench_loader: {e}") from None
        with loader:
            tok_s = throughput(loader, a.steps, device)
            loop = training_loop(loader, a.steps, SimulatedStep(a.step_ms, device), device)
    row = {"device": str(device), "seq_len": a.seq_len, "batch_seqs": a.batch_seqs, "shards": len(files),
           "tokens_per_s": tok_s, **loop}
    print("| device | seq_len x batch | shards | loader tokens/s | step ms | wait ms/step (p99) | wait share | "
          f"overhead vs resident batch, median (range of {ROUNDS} rounds) |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| {row['device']} | {a.seq_len} x {a.batch_seqs} | {len(files)} | {tok_s / 1e6:.1f}M | {loop['step_ms']:.1f} "
          f"| {loop['wait_ms']:.3f} ({loop['wait_p99_ms']:.3f}) | {100 * loop['wait_share']:.2f}% "
          f"| {100 * loop['overhead']:.2f}% ({100 * loop['overhead_min']:.2f} to {100 * loop['overhead_max']:.2f}%) |")
    return row


if __name__ == "__main__":
    main()
