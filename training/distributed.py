"""Process-group setup (torchrun env), small helpers, and the optimizer-step sequence.

No DDP: every rank accumulates its own gradients over its micro-batches, then `optimizer_step`
averages them — the small (AdamW) parameters with one bucketed all-reduce, the matrices inside
Muon with a reduce-scatter — clips with the averaged gradients, and steps.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
# Before any process group exists: torch.distributed.nn.functional binds `group=group.WORLD` as the default argument
# of its collectives when it is imported (torch 2.13). Imported while a group exists (torch.optim and torch.compile
# import it lazily, through torch._dynamo), its ten functions keep that group, which destroy_process_group then cannot
# free, and the group's gloo threads and the TCP store's thread live on into interpreter shutdown. One of them
# releasing a finished collective's tensor there takes the GIL during finalization, and the process aborts
# ("terminate called without an active exception", SIGABRT) after its work is done. Imported with the module that
# makes the groups, before any exists, it holds none, and destroy() ends them.
import torch.distributed.nn  # noqa: F401
from torch import Tensor

from training.config import ConfigError
from training.optim import Muon, clip_grad_norm_


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device


def _env_int(name: str) -> int:
    value = os.environ[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r}: expected an integer (set by torchrun)") from None


def torchrun_rank_world() -> tuple[int, int]:
    """This process's rank and the world size as torchrun sets them (the variables init_distributed reads), for checks
    made before the process group exists; 0 and 1 without torchrun or where they are malformed (init_distributed then
    names the variable)."""
    try:
        return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    except ValueError:
        return 0, 1


def init_distributed(device: str = "auto") -> DistInfo:
    """Join the process group described by torchrun's RANK / LOCAL_RANK / WORLD_SIZE (+ MASTER_ADDR/PORT),
    or run as a single process when none is set. device: auto | cpu | cuda (train.device).
    NCCL on CUDA, gloo on CPU."""
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"train.device={device!r}: expected auto, cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device='cuda' but no CUDA device is visible (hint: train.device=cpu or auto)")
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
    present = [k for k in keys if k in os.environ]
    if not present:
        return DistInfo(0, 0, 1, torch.device("cuda" if use_cuda else "cpu"))
    if len(present) != len(keys):
        raise RuntimeError(f"distributed env is incomplete: have {present}, need all of {list(keys)} "
                           "(hint: launch with torchrun, or unset them for a single process)")
    rank, local_rank, world = (_env_int(k) for k in keys)
    if use_cuda:
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world)
    global _CPU_GROUP
    # Created now, while every rank is alive: a group created later (at the first step) waits on a rank that died
    # in between until gloo's 30-minute connect timeout, where an existing one reports the closed connection.
    _CPU_GROUP = dist.new_group(backend="gloo") if world > 1 and use_cuda else None
    return DistInfo(rank, local_rank, world, dev)


_CPU_GROUP = None  # the gloo group of RankAgreement on NCCL runs (a gloo run uses its default group)


def busy_cores(window_s: float = 0.3) -> float:
    """Cores busy with other work now: /proc/stat's busy share over `window_s` seconds times the cores (Linux), else
    the 1-minute load average (which lags: a job that ended a minute ago still counts in it)."""
    def sample() -> tuple[int, int]:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        return sum(fields), fields[3] + fields[4]  # total, idle + iowait
    try:
        total0, idle0 = sample()
        time.sleep(window_s)
        total1, idle1 = sample()
        share = 1.0 - (idle1 - idle0) / max(total1 - total0, 1)
        return share * (os.cpu_count() or 1)
    except (OSError, ValueError, IndexError):
        try:
            return os.getloadavg()[0]
        except (OSError, AttributeError):  # not every platform reports a load average
            return 0.0


def free_cpu_threads() -> int:
    """Threads for a CPU run on a machine others may share: the cores this process may use, less the cores busy
    with other work now, at least 1. Two threads on two cores where another job holds one ran the demo several
    times slower than one thread; on a quiet machine, one thread instead of two cost it a third of its steps.
    scripts/run_demo.sh sets OMP_NUM_THREADS from this unless it is set."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, round(cores - busy_cores())))


def cpu_group():
    """The process group for small host-side collectives: no GPU synchronization."""
    return _CPU_GROUP


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


def is_main() -> bool:
    return not is_initialized() or dist.get_rank() == 0


def print0(*args, **kwargs) -> None:
    if is_main():
        print(*args, **kwargs)


def barrier() -> None:
    if is_initialized():
        dist.barrier()


def destroy() -> None:
    """Leave the process group. The groups, and gloo's worker threads, end here unless the caller still
    holds a handle to one (a subgroup kept in an object that outlives this call, say)."""
    global _CPU_GROUP
    _CPU_GROUP = None  # no handle outlives the groups (see init_distributed)
    if is_initialized():
        dist.destroy_process_group()


def all_reduce_mean(tensor: Tensor) -> Tensor:
    """Average `tensor` across ranks in place (synchronous w.r.t. the stream); returns it."""
    if world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.AVG)
    return tensor


class RankFailed(RuntimeError):
    """Raised by fail_together on the ranks that did not fail (the one that did raises its own error)."""


def fail_together(error: BaseException | None, what: str) -> None:
    """Raise `error` where it happened and RankFailed on every other rank. A rank that stops alone (rank 0 alone
    audits the validation bytes; a disk fills up under one rank's checkpoint part) leaves the others to run on
    into their next collective, which then fails with a transport error that does not say why, or waits until
    its timeout. Every rank must call it: one MAX all-reduce of a flag, on the device NCCL needs."""
    if world_size() > 1:
        on_gpu = dist.get_backend() == "nccl"
        failed = torch.tensor([int(error is not None)], device=torch.cuda.current_device() if on_gpu else "cpu")
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if failed.item() and error is None:
            raise RankFailed(f"stopped: another rank failed {what} (its own message says why)")
    if error is not None:
        raise error


def require_same_on_every_rank(value, what: str, hint: str) -> None:
    """Raise the same ConfigError on every rank where the ranks' `value`s (picklable) differ."""
    if world_size() > 1:
        values = [None] * world_size()
        dist.all_gather_object(values, value)
        differ = [rank for rank, v in enumerate(values) if v != values[0]]
        if differ:
            raise ConfigError(f"rank {differ[0]} sees other {what} than rank 0 (hint: {hint})")


class RankAgreement:
    """The training clock and the stop request, made identical on every rank once per step.

    Each rank reads its own wall clock, and a signal reaches ranks at different steps. Decisions taken
    from them must still be alike on all ranks: a rank that stops while another starts the next step
    waits forever in that step's all-reduce, and the time-driven learning rate must be the same for
    replicated parameters. So every step the ranks take the latest clock and any stop request
    (a MAX all-reduce of two numbers) over a CPU (gloo) group: no GPU synchronization in the step.
    A single process returns its own values. The group is made by init_distributed, at setup."""

    def __init__(self, world: int):
        self.world = world

    def __call__(self, now: float, stop: bool) -> tuple[float, bool]:
        if self.world == 1:
            return now, stop
        values = torch.tensor([now, float(stop)], dtype=torch.float64)
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=cpu_group())
        return values[0].item(), values[1].item() > 0


class GradSync:
    """Handle of an in-flight gradient all-reduce; wait() writes the averages back into the .grad tensors."""

    def __init__(self, buckets: list[tuple[list[Tensor], Tensor, object]]):
        self._buckets = buckets

    def wait(self) -> None:
        for grads, flat, work in self._buckets:
            work.wait()
            torch._foreach_copy_(grads, [t.view_as(g) for t, g in zip(flat.split([g.numel() for g in grads]), grads)])
        self._buckets = []


def all_reduce_grads(params: list[torch.nn.Parameter]) -> GradSync:
    """Start averaging the gradients of the (non-Muon) params across ranks: one flat bucket per
    (device, dtype), async. Call .wait() on the result before reading the gradients."""
    grads = []
    for i, p in enumerate(params):
        if p.grad is None:
            raise RuntimeError(f"all_reduce_grads: parameter #{i} of shape {tuple(p.shape)} has no gradient "
                               "(every trained parameter must be used in the forward pass)")
        grads.append(p.grad)
    if world_size() == 1:
        return GradSync([])
    by_kind: dict[tuple, list[Tensor]] = {}
    for g in grads:
        by_kind.setdefault((g.device, g.dtype), []).append(g)
    buckets = []
    for group in by_kind.values():
        flat = torch.cat([g.reshape(-1) for g in group])
        buckets.append((group, flat, dist.all_reduce(flat, op=dist.ReduceOp.AVG, async_op=True)))
    return GradSync(buckets)


def optimizer_step(optimizers: list[torch.optim.Optimizer], grad_clip: float) -> Tensor | None:
    """One optimizer step after the micro-batch backward passes; returns the pre-clip grad norm
    (None when grad_clip = 0). The sequence:

      1. all_reduce_grads(AdamW params)  -- async, one bucket
      2. Muon.sync_grads_async()         -- async reduce-scatter of the matrices' grads (both in flight)
      3. wait for 1; clip_grad_norm_      -- waits for 2; global norm from the averaged grads
      4. Muon.launch_step()               -- orthogonalize own share, start the all-gather
      5. AdamW.step()                     -- overlaps with the all-gather
      6. Muon.finish_step()               -- every rank now holds identical parameters
      7. zero_grad(set_to_none=True) on all optimizers

    The trainer calls set_lr_and_momentum(...) before this, and EMA.update(...) after it.
    """
    muons = [o for o in optimizers if isinstance(o, Muon)]
    others = [o for o in optimizers if not isinstance(o, Muon)]
    small = [p for o in others for g in o.param_groups for p in g["params"]]
    sync = all_reduce_grads(small)
    for m in muons:
        m.sync_grads_async()
    sync.wait()
    norm = clip_grad_norm_(optimizers, grad_clip)
    for m in muons:
        m.launch_step()
    for o in others:
        o.step()
    for m in muons:
        m.finish_step()
    for o in optimizers:
        o.zero_grad(set_to_none=True)
    return norm
