"""Optimizers: Muon (sharded across ranks) for block matrices, AdamW for the embedding and scalars.

Muon = Nesterov momentum, then the update is replaced by its nearest semi-orthogonal matrix
(approximated by a quintic Newton-Schulz iteration), scaled by sqrt(max(1, rows/cols)). With row_norm
(MuonEq-R, the parameter-golf records from 2026-04-03 on, https://github.com/openai/parameter-golf) each row of
the momentum update is first scaled to unit L2 norm, so every output unit enters the orthogonalization with the
same weight. With row splits (optim.muon_split_qkv: the attention's fused q, k, v projection) the row blocks of
one matrix are orthogonalized and scaled apart, as the separate matrices they act as.

Sharding (world size W > 1): the gradients of Muon's parameters are averaged by Muon itself with a
reduce-scatter, so each rank receives only the matrices it owns (parameter i of a same-shape bucket is
owned by rank i % W), orthogonalizes those, and an all-gather hands the updated matrices to everyone.
Nothing else may all-reduce Muon's gradients. The call order the trainer must follow is in
`training.distributed.optimizer_step`.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor

from training.config import OptimConfig

GROUP_NAMES = ("matrix", "embed", "scalar")

# torch >= 2.13 renamed the tensor collectives; older releases (2.11 on the GPU machine) lack the new names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def zeropower_via_newtonschulz5(G: Tensor, steps: int = 5) -> Tensor:
    """Approximate U V^T for G = U S V^T (every singular value pushed into ~[0.68, 1.13]).

    Works on [..., m, n]. bf16 on CUDA (the tensor cores; the iteration tolerates it), fp32 elsewhere
    (CPU bf16 matmuls are slow). Returns G's dtype.
    """
    if G.ndim < 2:
        raise ValueError(f"Newton-Schulz needs a matrix or a batch of matrices, got shape {tuple(G.shape)}")
    a, b, c = 3.4445, -4.7750, 2.0315
    X = G.bfloat16() if G.is_cuda else G.float()
    tall = G.size(-2) > G.size(-1)
    if tall:  # iterate on the wide side: X X^T is then the smaller Gram matrix
        X = X.mT
    # Frobenius norm >= spectral norm, so every singular value starts in [0, 1] where the quintic converges.
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        A = X @ X.mT
        B = b * A + c * (A @ A)
        X = a * X + B @ X
    if tall:
        X = X.mT
    return X.to(G.dtype)


ROW_NORM_EPS = 1e-7  # rows below this norm (all-zero gradients) are divided by it instead: they stay ~0


def normalize_rows_(G: Tensor) -> Tensor:
    """MuonEq-R: each row of G [..., rows, cols] divided by its L2 norm (computed in fp32), in place. Rows,
    not columns, whatever the shape: a row is one output unit of a weight [out, in]."""
    norms = G.float().norm(dim=-1, keepdim=True).clamp_min(ROW_NORM_EPS)
    return G.div_(norms.to(G.dtype))


def orthogonalize_row_blocks(G: Tensor, splits: tuple[int, ...], steps: int) -> Tensor:
    """Newton-Schulz on each row block of G [..., rows, cols] apart, each times its own sqrt(max(1, rows/cols))."""
    cols = G.size(-1)
    return torch.cat([zeropower_via_newtonschulz5(block, steps) * max(1.0, block.size(-2) / cols) ** 0.5
                      for block in G.split(list(splits), dim=-2)], dim=-2)


class _Bucket:
    """Same-shape Muon parameters of one param group, laid out for one reduce-scatter / all-gather.

    Slot layout of the stacked [W * n_chunks, ...] tensor: rank r's share is the contiguous block
    r * n_chunks ... (r + 1) * n_chunks - 1, holding parameters r, r + W, r + 2W, ... (zeros past the end).
    """

    def __init__(self, group_index: int, params: list[nn.Parameter], world: int, rank: int,
                 splits: tuple[int, ...] | None = None):
        # An index, not the dict: load_state_dict replaces the param-group dicts.
        self.group_index, self.params, self.world, self.rank = group_index, params, world, rank
        self.splits = splits  # row blocks orthogonalized apart (Muon's row_splits), or None: the whole matrix
        self.n_chunks = math.ceil(len(params) / world)
        self.own = params[rank::world]  # chunk order c = 0, 1, ... : parameter c * W + rank
        self.pad = torch.zeros_like(params[0])
        self.grad: Tensor | None = None  # averaged gradients of own share, [n_chunks, ...]
        self.grad_work = None
        self.gathered: Tensor | None = None
        self.gather_work = None

    def slot_order(self, tensors: list[Tensor]) -> list[Tensor]:
        """tensors[i] belongs to parameter i; returns them in slot order, zero-padded."""
        out = []
        for r in range(self.world):
            for c in range(self.n_chunks):
                i = c * self.world + r
                out.append(tensors[i] if i < len(tensors) else self.pad)
        return out

    def slot_of(self, i: int) -> int:
        return (i % self.world) * self.n_chunks + i // self.world


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


class Muon(torch.optim.Optimizer):
    """Muon with decoupled weight decay (p *= 1 - lr * wd), sharded when torch.distributed runs W > 1.

    `step()` = `sync_grads_async()` (if not already called) + `launch_step()` + `finish_step()`.
    Optimizer state (momentum) exists only for the parameters this rank owns.
    """

    def __init__(self, params, lr: float = 0.02, momentum: float = 0.95, weight_decay: float = 0.0,
                 ns_steps: int = 5, row_norm: bool = False,
                 row_splits: dict[nn.Parameter, tuple[int, ...]] | None = None):
        """row_splits: {matrix: row block sizes} for the matrices whose row blocks are orthogonalized apart (each block
        as a matrix of its own, with its own shape's scale); the others are orthogonalized whole."""
        if lr < 0 or not 0 <= momentum < 1 or weight_decay < 0 or ns_steps < 1:
            raise ValueError(f"Muon: expected lr >= 0, 0 <= momentum < 1, weight_decay >= 0, ns_steps >= 1; "
                             f"got lr={lr}, momentum={momentum}, weight_decay={weight_decay}, ns_steps={ns_steps}")
        self._buckets: list[_Bucket] | None = None
        self._layout_world: tuple[int, int] | None = None
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, ns_steps=ns_steps,
                                      row_norm=row_norm))
        self._row_splits = self._check_row_splits(row_splits or {})

    def _check_row_splits(self, row_splits: dict[nn.Parameter, tuple[int, ...]]) -> dict[int, tuple[int, ...]]:
        """{id(matrix): sizes}, each matrix one of this optimizer's and its sizes positive and summing to its rows."""
        mine = {id(p) for g in self.param_groups for p in g["params"]}
        for p, sizes in row_splits.items():
            if id(p) not in mine:
                raise ValueError(f"Muon: row_splits names a tensor of shape {tuple(p.shape)} that is not one of its "
                                 "parameters")
            if not sizes or min(sizes) < 1 or sum(sizes) != p.size(-2):
                raise ValueError(f"Muon: row_splits {tuple(sizes)} for a matrix of shape {tuple(p.shape)}: expected "
                                 f"positive block sizes summing to its {p.size(-2)} rows")
        return {id(p): tuple(sizes) for p, sizes in row_splits.items()}

    def __setstate__(self, state: dict) -> None:
        # load_state_dict replaces the param groups with the saved ones: a checkpoint from before row_norm existed
        # trained without it (and a resume with it on is then refused by the settings check)
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("row_norm", False)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        for p in self.param_groups[-1]["params"]:
            if p.ndim < 2:
                raise ValueError(f"Muon: parameter of shape {tuple(p.shape)} is not a matrix "
                                 "(hint: give 0-D/1-D parameters to AdamW, group 'scalar')")
        self._buckets = None  # layout is rebuilt lazily

    @property
    def is_sharded(self) -> bool:
        return _world()[0] > 1

    def _layout(self) -> list[_Bucket]:
        world, rank = _world()
        if self._buckets is None or self._layout_world != (world, rank):
            self._layout_world = (world, rank)
            self._buckets = []
            for index, group in enumerate(self.param_groups):
                by_shape: dict[tuple, list[nn.Parameter]] = {}
                for p in group["params"]:
                    splits = self._row_splits.get(id(p))
                    by_shape.setdefault((tuple(p.shape), p.dtype, p.device, splits), []).append(p)
                self._buckets += [_Bucket(index, ps, world, rank, key[-1]) for key, ps in by_shape.items()]
        return self._buckets

    @torch.no_grad()
    def sync_grads_async(self) -> None:
        """Start averaging the gradients across ranks (reduce-scatter: each rank gets its own share)."""
        for b in self._layout():
            missing = [tuple(p.shape) for p in b.params if p.grad is None]
            if missing:
                raise RuntimeError(f"Muon: a parameter of shape {missing[0]} has no gradient "
                                   "(was backward run? is every matrix used in the forward pass?)")
            stacked = torch.stack(b.slot_order([p.grad for p in b.params]))
            if b.world == 1:
                b.grad, b.grad_work = stacked, None
            else:
                b.grad = torch.empty_like(stacked[: b.n_chunks])
                b.grad_work = _reduce_scatter(b.grad, stacked, op=dist.ReduceOp.AVG, async_op=True)

    def synced_grads(self) -> list[Tensor]:
        """The averaged gradients this rank owns, one [n_chunks, ...] tensor per bucket (padding rows are
        zero). Clipping scales these in place; the parameters' own .grad is not used after the sync."""
        buckets = self._layout()
        if any(b.grad is None for b in buckets):
            raise RuntimeError("Muon.synced_grads() before sync_grads_async() (see distributed.optimizer_step)")
        for b in buckets:
            if b.grad_work is not None:
                b.grad_work.wait()
                b.grad_work = None
        return [b.grad for b in buckets]

    @torch.no_grad()
    def launch_step(self) -> None:
        """Update the owned matrices in place and start the all-gather of every rank's share."""
        if any(b.grad is None for b in self._layout()):
            self.sync_grads_async()
        self.synced_grads()
        for b in self._layout():
            self._update_own(b)
            b.grad = None
            if b.world > 1:
                send = torch.stack(b.own + [b.pad] * (b.n_chunks - len(b.own)))
                b.gathered = send.new_empty((b.world * b.n_chunks, *send.shape[1:]))
                b.gather_work = _all_gather(b.gathered, send, async_op=True)

    def _update_own(self, b: _Bucket) -> None:
        k = len(b.own)
        if k == 0:  # fewer matrices of this shape than ranks
            return
        g = self.param_groups[b.group_index]
        lr, beta, wd = g["lr"], g["momentum"], g["weight_decay"]
        rows = list(b.grad[:k].unbind(0))
        bufs = []
        for p in b.own:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)
            bufs.append(state["momentum_buffer"])
        torch._foreach_lerp_(bufs, rows, 1 - beta)  # buf = beta * buf + (1 - beta) * g
        torch._foreach_lerp_(rows, bufs, beta)      # Nesterov: g + beta * (buf - g), in b.grad's rows
        if g["row_norm"]:
            normalize_rows_(b.grad[:k])
        if b.splits is None:
            update = zeropower_via_newtonschulz5(b.grad[:k], g["ns_steps"])
            scale = max(1.0, b.own[0].size(-2) / b.own[0].size(-1)) ** 0.5
        else:
            update, scale = orthogonalize_row_blocks(b.grad[:k], b.splits, g["ns_steps"]), 1.0
        if wd:
            torch._foreach_mul_(b.own, 1 - lr * wd)
        torch._foreach_add_(b.own, list(update.unbind(0)), alpha=-lr * scale)

    @torch.no_grad()
    def finish_step(self) -> None:
        """Wait for the all-gather and write every rank's updated matrices into the parameters."""
        for b in self._layout():
            if b.gather_work is None:
                continue
            b.gather_work.wait()
            rows = b.gathered.unbind(0)
            torch._foreach_copy_(b.params, [rows[b.slot_of(i)] for i in range(len(b.params))])
            b.gathered, b.gather_work = None, None

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("Muon.step does not take a closure")
        self.launch_step()
        self.finish_step()


def check_param_groups(model: nn.Module, groups: dict[str, list[nn.Parameter]]) -> None:
    """Every model parameter in exactly one group; 'matrix' holds only 2-D tensors. Errors name the parameter."""
    if set(groups) != set(GROUP_NAMES):
        raise ValueError(f"param groups: expected keys {list(GROUP_NAMES)}, got {sorted(groups)}")
    names = {id(p): n for n, p in model.named_parameters()}
    seen: dict[int, str] = {}
    for group in GROUP_NAMES:
        for p in groups[group]:
            if id(p) not in names:
                raise ValueError(f"param group '{group}' holds a tensor of shape {tuple(p.shape)} "
                                 "that is not a parameter of the model")
            name = names[id(p)]
            if id(p) in seen:
                raise ValueError(f"parameter '{name}' is listed twice: in '{seen[id(p)]}' and in '{group}'")
            seen[id(p)] = group
            if group == "matrix" and p.ndim != 2:
                raise ValueError(f"parameter '{name}' in group 'matrix' has shape {tuple(p.shape)}; "
                                 "Muon takes 2-D matrices (hint: move it to 'scalar')")
    missing = [n for i, n in names.items() if i not in seen]
    if missing:
        raise ValueError(f"parameter '{missing[0]}' is in no optimizer group "
                         f"({len(missing)} missing; hint: fix model.param_groups())")


def build_optimizers(param_groups: dict[str, list[nn.Parameter]], cfg: OptimConfig,
                     qkv_splits: dict[nn.Parameter, tuple[int, ...]] | None = None) -> list[torch.optim.Optimizer]:
    """[Muon for 'matrix', AdamW for 'embed' + 'scalar'] (empty groups are left out).

    Every param group carries 'name' and 'initial_lr' (the peak lr that the schedule scales). qkv_splits ({fused qkv
    weight: (q, k, v) row counts}, GPT.qkv_splits) is what optim.muon_split_qkv orthogonalizes apart; unused when off.
    """
    if set(param_groups) != set(GROUP_NAMES):
        raise ValueError(f"param groups: expected keys {list(GROUP_NAMES)}, got {sorted(param_groups)}")
    if cfg.muon_split_qkv and qkv_splits is None:
        raise ValueError("optim.muon_split_qkv=true needs the model's q, k, v row blocks (hint: "
                         "build_optimizers(model.param_groups(), cfg, model.qkv_splits()))")
    optimizers: list[torch.optim.Optimizer] = []
    if param_groups["matrix"]:
        optimizers.append(Muon([dict(params=list(param_groups["matrix"]), name="matrix", initial_lr=cfg.matrix_lr)],
                               lr=cfg.matrix_lr, momentum=cfg.muon_momentum, weight_decay=cfg.weight_decay,
                               ns_steps=cfg.ns_steps, row_norm=cfg.muon_row_norm,
                               row_splits=qkv_splits if cfg.muon_split_qkv else None))
    embed_wd = cfg.weight_decay if cfg.embed_weight_decay == -1 else cfg.embed_weight_decay
    adam_groups = [dict(params=list(param_groups[name]), name=name, lr=lr, initial_lr=lr, weight_decay=wd)
                   for name, lr, wd in (("embed", cfg.embed_lr, embed_wd),
                                        ("scalar", cfg.scalar_lr, cfg.scalar_weight_decay))
                   if param_groups[name]]
    if adam_groups:
        on_cuda = all(p.is_cuda for g in adam_groups for p in g["params"])
        optimizers.append(torch.optim.AdamW(adam_groups, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                            fused=on_cuda or None))
    return optimizers


def muon_momentum_at(step: int, cfg: OptimConfig) -> float:
    """Linear warm-up from muon_momentum_start to muon_momentum over muon_momentum_warmup_steps."""
    if cfg.muon_momentum_warmup_steps <= 0:
        return cfg.muon_momentum
    frac = min(1.0, step / cfg.muon_momentum_warmup_steps)
    return cfg.muon_momentum_start + frac * (cfg.muon_momentum - cfg.muon_momentum_start)


def set_lr_and_momentum(optimizers: list[torch.optim.Optimizer], lr_mult: float, step: int, cfg: OptimConfig) -> None:
    momentum = muon_momentum_at(step, cfg)
    for opt in optimizers:
        for group in opt.param_groups:
            if "initial_lr" not in group:
                raise KeyError("param group without 'initial_lr' (hint: create optimizers with build_optimizers)")
            group["lr"] = group["initial_lr"] * lr_mult
            if isinstance(opt, Muon):
                group["momentum"] = momentum


def clip_grad_norm_(optimizers: list[torch.optim.Optimizer], max_norm: float) -> Tensor | None:
    """Scale all gradients so their global L2 norm is at most max_norm; returns the pre-clip norm
    (a device tensor: no host sync). max_norm = 0 disables clipping and returns None.

    Takes the optimizers, not the parameters: with sharded Muon the averaged matrix gradients live in
    Muon (each rank holds its share), so call this after all_reduce_grads(...).wait() and
    Muon.sync_grads_async(), before any step().
    """
    if max_norm < 0:
        raise ValueError(f"optim.grad_clip={max_norm}: expected >= 0 (0 disables clipping)")
    if max_norm == 0:
        return None
    muons = [o for o in optimizers if isinstance(o, Muon)]
    replicated = [p.grad for o in optimizers if not isinstance(o, Muon)
                  for g in o.param_groups for p in g["params"] if p.grad is not None]
    sharded = [t for m in muons for t in m.synced_grads()]
    if not replicated and not sharded:
        raise RuntimeError("clip_grad_norm_: no gradients (was backward run?)")
    device = (replicated or sharded)[0].device

    def sum_sq(ts: list[Tensor]) -> Tensor:
        if not ts:
            return torch.zeros((), device=device)
        return torch.stack([n.float() for n in torch._foreach_norm(ts)]).square().sum()

    sharded_sq = sum_sq(sharded)
    if any(m.is_sharded for m in muons):  # every rank holds a different share of the matrices
        dist.all_reduce(sharded_sq)
    total = (sum_sq(replicated) + sharded_sq).sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    torch._foreach_mul_(replicated + sharded, coef)
    return total
