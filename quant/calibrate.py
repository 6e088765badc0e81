"""Calibration: per-layer input Hessians H = XᵀX/n, and calibration text the model writes itself.

The challenge forbids calibrating on validation data; the caller feeds batches of TRAINING tokens, or
tokens from `generate_calibration_tokens` (sampled from the model, so no data is touched at all).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.nn as nn


class HessianCollector:
    """XᵀX in fp32 on the model's device for the inputs of every given nn.Linear (forward hooks) and of
    every `observed` 2-D parameter [out, in] that is not a Linear weight (the model reports those
    inputs itself through its `quant_observer` attribute; see model/gpt.py). `optional` names are observed
    when the model reports them and skipped otherwise (an embedding table that is also the output head);
    `lookups` (nn.Embedding modules) get the count of every row's uses.

    Memory: one [in, in] fp32 matrix per matrix (66 modules of in ≤ 1792 is at most 66 × 12.8 MB;
    22 mHC phi of in = 2048 add 22 × 16.8 MB).
    """

    def __init__(self, modules: dict[str, nn.Linear], observed: dict[str, torch.Tensor] | None = None,
                 optional: dict[str, torch.Tensor] | None = None, lookups: dict[str, nn.Embedding] | None = None):
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, int] = {}
        self.optional = set(optional or ())
        self.uses: dict[str, torch.Tensor] = {}
        self._handles = []
        for name, module in modules.items():
            if not isinstance(module, nn.Linear):
                raise TypeError(f"{name}: Hessian collection hooks nn.Linear modules, got {type(module).__name__}")
            self._track(name, module.weight)
            self._handles.append(module.register_forward_hook(self._hook(name)))
        for name, weight in {**(observed or {}), **(optional or {})}.items():
            if weight.ndim != 2:
                raise ValueError(f"{name}: an observed matrix must be 2-D [out, in], got shape {tuple(weight.shape)}")
            self._track(name, weight)
        for name, module in (lookups or {}).items():
            self.uses[name] = torch.zeros(module.weight.shape[0], dtype=torch.float64, device=module.weight.device)
            self._handles.append(module.register_forward_hook(self._count(name)))

    def _track(self, name: str, weight: torch.Tensor) -> None:
        self.sums[name] = torch.zeros(weight.shape[1], weight.shape[1], dtype=torch.float32, device=weight.device)
        self.counts[name] = 0

    def _hook(self, name: str):
        def hook(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
            self.observe(name, inputs[0])
        return hook

    def _count(self, name: str):
        def hook(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
            rows = inputs[0].detach().reshape(-1).long()
            self.uses[name] += torch.bincount(rows, minlength=self.uses[name].numel()).double()
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
        """H = XᵀX / n per matrix seen; a matrix never seen is an error (it would get no calibration) unless optional."""
        missing = [name for name, n in self.counts.items() if n == 0 and name not in self.optional]
        if missing:
            raise RuntimeError(f"calibration never saw the inputs of these matrices: {missing[:5]}"
                               f"{' ...' if len(missing) > 5 else ''}; hint: is the model calling them "
                               "(and reporting observed ones through quant_observer)?")
        return {name: s / self.counts[name] for name, s in self.sums.items() if self.counts[name]}


@dataclass
class Calibration:
    """What one pass over the calibration batches measured."""
    hessians: dict[str, torch.Tensor]      # H = XᵀX/n per matrix (and per optional table the model reported)
    tokens: int
    uses: dict[str, torch.Tensor] = field(default_factory=dict)  # per lookup table, each row's share of the lookups


@torch.no_grad()
def calibrate(model: nn.Module, modules: dict[str, nn.Linear], calib_batches: Iterable[torch.Tensor],
              autocast_dtype: torch.dtype | None = None, observed: dict[str, torch.Tensor] | None = None,
              optional: dict[str, torch.Tensor] | None = None, lookups: dict[str, nn.Embedding] | None = None,
              ) -> Calibration:
    """Run `model(ids)` over every batch with hooks on `modules` (and `lookups`); see HessianCollector.

    observed: 2-D parameters (by state_dict name) whose inputs the model reports by calling
    `model.quant_observer(name, x)`; they get Hessians like the Linears.

    autocast_dtype: run the forward under autocast, as training and evaluation do on a GPU (bf16), so
    the Hessians see the activations the shipped model computes; it also reuses the kernels compiled
    for that dtype (an fp32 calibration of the mHC model spent 34 s compiling fp32 Triton variants).
    """
    device = next(model.parameters()).device
    if (observed or optional) and not hasattr(model, "quant_observer"):  # before the collector hooks the modules
        raise TypeError(f"{type(model).__name__} has no quant_observer attribute, so the inputs of "
                        f"{list(observed or optional)[:3]} cannot be observed; hint: quantize them as int8 tables "
                        "instead")
    collector = HessianCollector(modules, observed, optional, lookups)
    was_training, tokens = model.training, 0
    model.eval()
    reporting = bool(observed or optional)
    if reporting:
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
        if reporting:
            model.quant_observer = None
        model.train(was_training)
    if tokens == 0:
        raise ValueError("calibration got no batches; hint: pass a non-empty iterable of [B, T] token ids")
    uses = {name: (u / u.sum().clamp_min(1)).float() for name, u in collector.uses.items()}
    return Calibration(collector.hessians(), tokens, uses)


@dataclass
class Fisher:
    """Mean over calibration tokens of the squared loss gradient: per output row of every matrix (`rows`), and per
    entry of every lookup table (`lookups`, [rows, width]: a token's gradient at the lookup's output counts for the
    row it read)."""
    rows: dict[str, torch.Tensor]
    lookups: dict[str, torch.Tensor] = field(default_factory=dict)


def collect_fisher(model: nn.Module, modules: dict[str, nn.Linear], calib_batches: Iterable[torch.Tensor],
                   autocast_dtype: torch.dtype | None = None, observed: Iterable[str] = (),
                   lookups: dict[str, nn.Embedding] | None = None) -> Fisher:
    """Per output unit of every module (and of every `observed` matrix whose output the model reports through
    `model.quant_grad_observer(name, y)`), the mean over tokens of (d loss / d output)², the loss summed
    over next-token predictions (so the scale does not depend on the batch size); per entry of every lookup table,
    the same at the lookup's output, added to the row each token read.

    Why: a matrix's quantization error as GPTQ measures it is the mean squared error of its outputs;
    weighting each output row by how much the loss reacts to it (the diagonal of the empirical Fisher
    of the outputs) turns that into an estimate of the loss increase, comparable across matrices; a table's
    entries the same way. The weights' .grad is left as it was found (None).
    """
    device = next(model.parameters()).device
    observed, lookups = list(observed), lookups or {}
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    tables = {name: torch.zeros_like(m.weight, dtype=torch.float32) for name, m in lookups.items()}

    def add(name: str, g: torch.Tensor) -> None:
        g = g.detach().reshape(-1, g.shape[-1]).float()
        sums[name] = sums.get(name, 0) + g.square().sum(dim=0)
        counts[name] = counts.get(name, 0) + g.shape[0]

    def on_output(name: str, y: torch.Tensor) -> torch.Tensor:
        if name in observed and y.requires_grad:
            y.register_hook(lambda g: add(name, g))
        return y

    def module_hook(name):
        return lambda module, grad_input, grad_output: add(name, grad_output[0])

    def lookup_hook(name):
        def forward(module, inputs, output):
            rows = inputs[0].detach().reshape(-1)

            def backward(g: torch.Tensor) -> None:
                tables[name].index_add_(0, rows, g.detach().reshape(rows.numel(), -1).float().square())
            output.register_hook(backward)
        return forward

    hint = (f"{type(model).__name__}(ids, targets) must return the scalar mean loss for Fisher weights; "
            "hint: use error_weight='output' with this model")
    if observed and not hasattr(model, "quant_grad_observer"):
        raise TypeError(f"{type(model).__name__} has no quant_grad_observer attribute, so the outputs of "
                        f"{observed[:3]} cannot be observed; hint: use error_weight='output'")
    handles = [m.register_full_backward_hook(module_hook(name)) for name, m in modules.items()]
    handles += [m.register_forward_hook(lookup_hook(name)) for name, m in lookups.items()]
    was_training, tokens = model.training, 0
    model.eval()
    if observed:
        model.quant_grad_observer = on_output
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
            tokens += ids[:, :-1].numel()
    finally:
        for h in handles:
            h.remove()
        if observed:
            model.quant_grad_observer = None
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    missing = [name for name in [*modules, *observed] if not counts.get(name)]
    if missing:
        raise RuntimeError(f"no gradient reached the outputs of {missing[:5]}; hint: are they on the loss path?")
    rows = {name: sums[name] / counts[name] for name in [*modules, *observed]}
    lookup = {name: t / max(tokens, 1) for name, t in tables.items()}
    # A NaN weight would make that matrix's error NaN, and the allocators' orderings undefined
    broken = [name for name, f in [*rows.items(), *lookup.items()] if not torch.isfinite(f).all()]
    if broken:
        raise ValueError(f"Fisher weights of {broken[:5]} hold NaN or Inf (the loss gradient overflowed on the "
                         "calibration batches); hint: error_weight='output' needs no backward pass")
    return Fisher(rows, lookup)


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
