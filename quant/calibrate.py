"""Calibration: per-layer input Hessians H = XᵀX/n, and calibration text the model writes itself.

The challenge forbids calibrating on validation data; the caller feeds batches of TRAINING tokens, or
tokens from `generate_calibration_tokens` (sampled from the model, so no data is touched at all).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn


class HessianCollector:
    """XᵀX in fp32 on the model's device for the inputs of every given nn.Linear (forward hooks) and of
    every `observed` 2-D parameter [out, in] that is not a Linear weight (the model reports those
    inputs itself through its `quant_observer` attribute; see model/gpt.py).

    Memory: one [in, in] fp32 matrix per matrix (66 modules of in ≤ 1792 is at most 66 × 12.8 MB;
    22 mHC phi of in = 2048 add 22 × 16.8 MB).
    """

    def __init__(self, modules: dict[str, nn.Linear], observed: dict[str, torch.Tensor] | None = None):
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, int] = {}
        self._handles = []
        for name, module in modules.items():
            if not isinstance(module, nn.Linear):
                raise TypeError(f"{name}: Hessian collection hooks nn.Linear modules, got {type(module).__name__}")
            self._track(name, module.weight)
            self._handles.append(module.register_forward_hook(self._hook(name)))
        for name, weight in (observed or {}).items():
            if weight.ndim != 2:
                raise ValueError(f"{name}: an observed matrix must be 2-D [out, in], got shape {tuple(weight.shape)}")
            self._track(name, weight)

    def _track(self, name: str, weight: torch.Tensor) -> None:
        self.sums[name] = torch.zeros(weight.shape[1], weight.shape[1], dtype=torch.float32, device=weight.device)
        self.counts[name] = 0

    def _hook(self, name: str):
        def hook(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
            self.observe(name, inputs[0])
        return hook

    def observe(self, name: str, x: torch.Tensor) -> None:
        """Add the rows of x [..., in] to the sums of `name`; names not tracked are ignored."""
        if name not in self.sums:
            return
        x = x.detach().reshape(-1, x.shape[-1]).float()
        if x.shape[1] != self.sums[name].shape[0]:
            raise ValueError(f"{name}: observed input has {x.shape[1]} features, its matrix takes "
                             f"{self.sums[name].shape[0]}")
        self.sums[name].addmm_(x.t(), x)
        self.counts[name] += x.shape[0]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def hessians(self) -> dict[str, torch.Tensor]:
        """H = XᵀX / n per matrix; one never seen is an error (it would get no calibration)."""
        missing = [name for name, n in self.counts.items() if n == 0]
        if missing:
            raise RuntimeError(f"calibration never saw the inputs of these matrices: {missing[:5]}"
                               f"{' ...' if len(missing) > 5 else ''}; hint: is the model calling them "
                               "(and reporting observed ones through quant_observer)?")
        return {name: s / self.counts[name] for name, s in self.sums.items()}


@torch.no_grad()
def collect_hessians(model: nn.Module, modules: dict[str, nn.Linear], calib_batches: Iterable[torch.Tensor],
                     autocast_dtype: torch.dtype | None = None, observed: dict[str, torch.Tensor] | None = None,
                     ) -> tuple[dict[str, torch.Tensor], int]:
    """Run `model(ids)` over every batch with hooks on `modules`; returns (Hessians, tokens seen).

    observed: 2-D parameters (by state_dict name) whose inputs the model reports by calling
    `model.quant_observer(name, x)`; they get Hessians like the Linears.

    autocast_dtype: run the forward under autocast, as training and evaluation do on a GPU (bf16), so
    the Hessians see the activations the shipped model computes; it also reuses the kernels compiled
    for that dtype (an fp32 calibration of the mHC model spent 34 s compiling fp32 Triton variants).
    """
    device = next(model.parameters()).device
    if observed and not hasattr(model, "quant_observer"):  # before the collector hooks the modules
        raise TypeError(f"{type(model).__name__} has no quant_observer attribute, so the inputs of "
                        f"{list(observed)[:3]} cannot be observed; hint: quantize them as int8 tables instead")
    collector = HessianCollector(modules, observed)
    was_training, tokens = model.training, 0
    model.eval()
    if observed:
        model.quant_observer = collector.observe
    try:
        for ids in calib_batches:
            if ids.ndim != 2 or ids.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"calibration batches must be integer token ids [B, T], got {ids.dtype} {tuple(ids.shape)}")
            with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                model(ids.to(device))
            tokens += ids.numel()
    finally:
        collector.remove()
        if observed:
            model.quant_observer = None
        model.train(was_training)
    if tokens == 0:
        raise ValueError("calibration got no batches; hint: pass a non-empty iterable of [B, T] token ids")
    return collector.hessians(), tokens


def collect_output_fisher(model: nn.Module, modules: dict[str, nn.Linear], calib_batches: Iterable[torch.Tensor],
                          autocast_dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Per output unit of every module, the mean over tokens of (d loss / d output)², the loss summed
    over next-token predictions (so the scale does not depend on the batch size).

    Why: a matrix's quantization error as GPTQ measures it is the mean squared error of its outputs;
    weighting each output row by how much the loss reacts to it (the diagonal of the empirical Fisher
    of the outputs) turns that into an estimate of the loss increase, comparable across matrices.
    The weights' .grad is left as it was found (None).
    """
    device = next(model.parameters()).device
    sums = {name: torch.zeros(m.weight.shape[0], dtype=torch.float32, device=device) for name, m in modules.items()}
    counts = dict.fromkeys(modules, 0)

    def hook(name):
        def record(module, grad_input, grad_output):
            g = grad_output[0].detach().reshape(-1, grad_output[0].shape[-1]).float()
            sums[name] += g.square().sum(dim=0)
            counts[name] += g.shape[0]
        return record

    hint = (f"{type(model).__name__}(ids, targets) must return the scalar mean loss for Fisher weights; "
            "hint: use error_weight='output' with this model")
    handles = [m.register_full_backward_hook(hook(name)) for name, m in modules.items()]
    was_training = model.training
    model.eval()
    try:
        for ids in calib_batches:
            ids = ids.to(device)
            if ids.shape[1] < 2:
                raise ValueError("Fisher weights need sequences of at least 2 tokens (a next-token loss)")
            with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                try:
                    loss = model(ids[:, :-1], ids[:, 1:].long())
                except TypeError as e:
                    raise TypeError(f"{hint} ({e})") from None
            if not (isinstance(loss, torch.Tensor) and loss.ndim == 0):
                raise TypeError(hint)
            (loss.float() * ids[:, 1:].numel()).backward()
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    missing = [name for name, n in counts.items() if n == 0]
    if missing:
        raise RuntimeError(f"no gradient reached the outputs of {missing[:5]}; hint: are they on the loss path?")
    # A NaN weight would make that matrix's error NaN, and the allocators' orderings undefined (found by a review)
    broken = [name for name in modules if not torch.isfinite(sums[name]).all()]
    if broken:
        raise ValueError(f"Fisher weights of {broken[:5]} hold NaN or Inf (the loss gradient overflowed on the "
                         "calibration batches); hint: error_weight='output' needs no backward pass")
    return {name: sums[name] / counts[name] for name in modules}


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
