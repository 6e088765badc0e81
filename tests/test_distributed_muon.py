"""Sharded Muon + bucketed all-reduce on 2 and 3 gloo processes == one process stepping on the averaged grads."""
import dataclasses
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

from training.config import OptimConfig
from training.distributed import (all_reduce_mean, barrier, destroy, init_distributed, is_main, optimizer_step,
                                  print0, world_size)
from training.optim import Muon, build_optimizers, check_param_groups, set_lr_and_momentum
from training.schedule import lr_multiplier

VOCAB, STEPS, MICRO = 11, 3, 2
# Small clip so the global-norm clip is active: it must be computed from the averaged gradients.
CFG = OptimConfig(grad_clip=0.05, weight_decay=0.1, muon_momentum_warmup_steps=2, warmup_steps=2)


class Chain(nn.Module):
    """Embedding -> a chain of matrices (several same-shape buckets) -> tied head."""

    def __init__(self, shapes: list[tuple[int, int]]):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, shapes[0][1])
        self.mats = nn.ParameterList([nn.Parameter(torch.randn(s) / s[1] ** 0.5) for s in shapes])
        self.gain = nn.Parameter(torch.ones(shapes[-1][0]))

    def param_groups(self):
        return {"matrix": list(self.mats), "embed": [self.embed.weight], "scalar": [self.gain]}

    def qkv_splits(self):
        """Row blocks for optim.muon_split_qkv: the 16-row matrices at odd places, so a same-shape bucket can hold
        split and whole matrices."""
        return {W: (8, 4, 4) for i, W in enumerate(self.mats) if W.shape[0] == 16 and i % 2}

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)
        for W in self.mats:
            h = torch.tanh(h @ W.T)
        logits = (h * self.gain) @ self.embed.weight.T
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), idx[:, 1:].reshape(-1))


def batch(step: int, rank: int, micro: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (3, 6), generator=torch.Generator().manual_seed(1000 * step + 10 * rank + micro))


def accumulate(model: Chain, step: int, rank: int) -> None:
    for micro in range(MICRO):
        (model(batch(step, rank, micro)) / MICRO).backward()


def join_group(rank: int, world: int, port: int):
    """This spawned process as rank `rank` of a gloo group, as torchrun's environment would set it up."""
    torch.set_num_threads(1)  # up to 3 processes share 2 cores: oversubscribed OpenMP threads only slow them
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return init_distributed("cpu")


def worker(rank: int, world: int, port: int, out_dir: str, shapes, cfg: OptimConfig) -> None:
    info = join_group(rank, world, port)
    try:
        assert (info.rank, info.world_size, world_size(), is_main()) == (rank, world, world, rank == 0)
        model = Chain(shapes)
        check_param_groups(model, model.param_groups())
        opts = build_optimizers(model.param_groups(), cfg, model.qkv_splits())
        norms = []
        for step in range(STEPS):
            set_lr_and_momentum(opts, lr_multiplier(step / STEPS, step, cfg), step, cfg)
            accumulate(model, step, rank)
            norms.append(optimizer_step(opts, cfg.grad_clip))
        mean_rank = all_reduce_mean(torch.tensor(float(rank)))
        barrier()
        print0(f"world {world} done")
        muon = next(o for o in opts if isinstance(o, Muon))
        torch.save({"params": [p.detach() for p in model.parameters()], "norms": torch.stack(norms),
                    "mean_rank": mean_rank, "muon_state": len(muon.state)}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        destroy()


def single_process_reference(shapes, world: int, cfg: OptimConfig):
    """Same steps in one process, each step on the average of every rank's accumulated gradients."""
    model = Chain(shapes)
    opts = build_optimizers(model.param_groups(), cfg, model.qkv_splits())
    norms = []
    for step in range(STEPS):
        per_rank = []
        for rank in range(world):
            model.zero_grad(set_to_none=True)
            accumulate(model, step, rank)
            per_rank.append([p.grad.clone() for p in model.parameters()])
        assert not torch.equal(per_rank[0][0], per_rank[1][0])  # ranks really see different data
        for p, grads in zip(model.parameters(), zip(*per_rank)):
            p.grad = torch.stack(grads).mean(0)
        set_lr_and_momentum(opts, lr_multiplier(step / STEPS, step, cfg), step, cfg)
        norms.append(optimizer_step(opts, cfg.grad_clip))
    return [p.detach() for p in model.parameters()], torch.stack(norms)



@pytest.mark.parametrize("world,shapes,row_norm,split_qkv", [
    # 6 matrices: 3 x (8, 8) -> one padded chunk; (16, 8), (16, 16), (8, 16) alone -> rank 1 idle there.
    (2, [(8, 8), (16, 8), (16, 16), (8, 16), (8, 8), (8, 8)], False, False),
    # 7 matrices on 3 ranks: 5 x (8, 8) -> two chunks, one padded; (12, 8), (8, 12) alone.
    (3, [(8, 8), (12, 8), (8, 12), (8, 8), (8, 8), (8, 8), (8, 8)], False, False),
    # MuonEq-R on each rank's own share (the zero padding rows stay out of it)
    (2, [(8, 8), (16, 8), (8, 16), (8, 8), (8, 8)], True, False),
    # optim.muon_split_qkv: (16, 8) split; the (16, 16) pair one split (its own bucket), one whole
    (2, [(8, 8), (16, 8), (16, 16), (16, 16), (8, 16), (8, 8)], False, True),
])
def test_sharded_step_equals_single_process_on_averaged_grads(tmp_path, capfd, world, shapes, row_norm, split_qkv,
                                                              free_port):
    cfg = dataclasses.replace(CFG, muon_row_norm=row_norm, muon_split_qkv=split_qkv)
    mp.spawn(worker, args=(world, free_port, str(tmp_path), shapes, cfg), nprocs=world, join=True)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    ref_params, ref_norms = single_process_reference(shapes, world, cfg)
    assert (ref_norms > CFG.grad_clip).all()  # the clip was active on every step
    if row_norm or split_qkv:  # the option reached the sharded update
        plain = single_process_reference(shapes, world, CFG)[0]
        assert not any(torch.allclose(a, b, atol=1e-4) for a, b in zip(results[0]["params"][1:], plain[1:]))
    for res in results:
        torch.testing.assert_close(res["norms"], ref_norms, rtol=1e-6, atol=0)
        assert res["mean_rank"].item() == pytest.approx((world - 1) / 2)
        for got, want in zip(res["params"], ref_params):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        for got, want in zip(res["params"], results[0]["params"]):
            assert torch.equal(got, want)  # ranks hold bit-identical weights
    # Momentum state is sharded: each matrix has its buffer on exactly one rank.
    assert sum(res["muon_state"] for res in results) == len(shapes)
    assert capfd.readouterr().out.count(f"world {world} done") == 1  # print0 prints on rank 0 only


def live_thread_names() -> list[str]:
    tasks = "/proc/self/task"
    return [open(f"{tasks}/{t}/comm").read().strip() for t in os.listdir(tasks)]


def teardown_worker(rank: int, world: int, port: int, out_dir: str, made_by: str) -> None:
    """A sharded step (async reduce-scatter and all-gather), destroy(), then the threads still alive."""
    if made_by == "init_distributed":
        join_group(rank, world, port)
    else:  # a group made without init_distributed, in a process that imported training.distributed
        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    model = Chain([(8, 8), (8, 8), (8, 8)])
    opts = build_optimizers(model.param_groups(), CFG)  # constructing an optimizer imports torch._dynamo
    accumulate(model, 0, rank)
    optimizer_step(opts, CFG.grad_clip)
    destroy()
    with open(os.path.join(out_dir, f"threads{rank}.txt"), "w") as f:
        f.write("\n".join(live_thread_names()))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="lists threads through Linux's /proc")
@pytest.mark.parametrize("made_by", ["init_distributed", "init_process_group"])
def test_destroy_ends_the_gloo_and_store_threads(tmp_path, free_port, made_by):
    """A gloo or TCP-store thread alive at interpreter shutdown can free a collective's tensor there and abort
    the process after its work is done (torchrun then reports a failed rank): destroy() must end them, also
    for a group made directly (a test's spawned ranks), which the optimizers' lazy imports meet after it exists."""
    mp.spawn(teardown_worker, args=(2, free_port, str(tmp_path), made_by), nprocs=2, join=True)
    for rank in range(2):
        names = (tmp_path / f"threads{rank}.txt").read_text().split("\n")
        left = [n for n in names if "gloo" in n or "tcpstore" in n]
        assert not left, f"rank {rank} threads after destroy(): {names}"
