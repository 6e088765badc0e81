"""Calibration: per-layer input Hessians H = XᵀX/n, and calibration text the model writes itself.

The challenge forbids calibrating on validation data; the caller feeds batches of TRAINING tokens, or
tokens from `generate_calibration_tokens` (sampled from the model, so no data is touched at all).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn


class HessianCollector:
    """Forward hooks on the given nn.Linear modules accumulating XᵀX in fp32 on the model's device.

    Memory: one [in, in] fp32 matrix per module (66 modules of in ≤ 1792 is at most 66 × 12.8 MB).
    """

    def __init__(self, modules: dict[str, nn.Linear]):
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, int] = {}
        self._handles = []
        for name, module in modules.items():
            if not isinstance(module, nn.Linear):
                raise TypeError(f"{name}: Hessian collection hooks nn.Linear modules, got {type(module).__name__}")
            w = module.weight
            self.sums[name] = torch.zeros(w.shape[1], w.shape[1], dtype=torch.float32, device=w.device)
            self.counts[name] = 0
            self._handles.append(module.register_forward_hook(self._hook(name)))

    def _hook(self, name: str):
        def hook(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
            x = inputs[0].detach()
            x = x.reshape(-1, x.shape[-1]).float()
            self.sums[name].addmm_(x.t(), x)
            self.counts[name] += x.shape[0]
        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def hessians(self) -> dict[str, torch.Tensor]:
        """H = XᵀX / n per module; a module never called is an error (it would get no calibration)."""
        missing = [name for name, n in self.counts.items() if n == 0]
        if missing:
            raise RuntimeError(f"calibration never ran these nn.Linear modules: {missing[:5]}"
                               f"{' ...' if len(missing) > 5 else ''}; hint: is the model calling them "
                               "(custom kernels must be switched off for calibration)?")
        return {name: s / self.counts[name] for name, s in self.sums.items()}


@torch.no_grad()
def collect_hessians(model: nn.Module, modules: dict[str, nn.Linear], calib_batches: Iterable[torch.Tensor],
                     autocast_dtype: torch.dtype | None = None) -> tuple[dict[str, torch.Tensor], int]:
    """Run `model(ids)` over every batch with hooks on `modules`; returns (Hessians, tokens seen).

    autocast_dtype: run the forward under autocast, as training and evaluation do on a GPU (bf16), so
    the Hessians see the activations the shipped model computes; it also reuses the kernels compiled
    for that dtype (an fp32 calibration of the mHC model spent 34 s compiling fp32 Triton variants).
    """
    device = next(model.parameters()).device
    collector = HessianCollector(modules)
    was_training, tokens = model.training, 0
    model.eval()
    try:
        for ids in calib_batches:
            if ids.ndim != 2 or ids.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"calibration batches must be integer token ids [B, T], got {ids.dtype} {tuple(ids.shape)}")
            with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                model(ids.to(device))
            tokens += ids.numel()
    finally:
        collector.remove()
        model.train(was_training)
    if tokens == 0:
        raise ValueError("calibration got no batches; hint: pass a non-empty iterable of [B, T] token ids")
    return collector.hessians(), tokens


@torch.no_grad()
def generate_calibration_tokens(model: nn.Module, n_seqs: int, seq_len: int, bos_id: int = 1,
                                temperature: float = 0.8, seed: int = 0, batch_size: int = 0) -> torch.Tensor:
    """Sample `n_seqs` sequences of `seq_len` tokens (first = BOS) autoregressively from the model.

    model(ids) must return logits [B, T, V]. No KV cache: each step re-runs the prefix, which costs
    O(seq_len²) but needs nothing from the model beyond its forward. Returns int64 [n_seqs, seq_len]
    on the model's device. batch_size 0 means all sequences at once.
    """
    if n_seqs < 1 or seq_len < 1:
        raise ValueError(f"n_seqs and seq_len must be >= 1, got {n_seqs} and {seq_len}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}; hint: 0.8 is the usual choice")
    device = next(model.parameters()).device
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    batch_size = batch_size or n_seqs
    was_training = model.training
    model.eval()
    try:
        out = [_sample_batch(model, min(batch_size, n_seqs - start), seq_len, bos_id, temperature, gen, device)
               for start in range(0, n_seqs, batch_size)]
    finally:
        model.train(was_training)
    return torch.cat(out)


def _sample_batch(model, n, seq_len, bos_id, temperature, gen, device) -> torch.Tensor:
    ids = torch.full((n, 1), bos_id, dtype=torch.long, device=device)
    while ids.shape[1] < seq_len:
        logits = model(ids)[:, -1, :].float()
        probs = torch.softmax(logits / temperature, dim=-1)
        nxt = torch.multinomial(probs, 1, generator=gen)
        ids = torch.cat([ids, nxt], dim=1)
    return ids
