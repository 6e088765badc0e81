"""Transformer sublayers: RMSNorm, (partial) rotary embedding, GQA attention with optional XSA, value
embeddings and output gate, LeakyReLU(0.5)^2 MLP.

Each sublayer takes the (pre-norm) residual input u [B, T, C] and returns F(u) [B, T, C]; the
residual wiring (plain or mHC) lives in model/gpt.py.
"""
from __future__ import annotations

import importlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels.mlp_reference import leaky_relu_sq
from model.config import ModelConfig
from model.doc_attention import doc_causal_attention


class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype))


def rotary_cos_sin(seq_len: int, dim: int, base: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [T, dim/2] in fp32."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


ROPE_TABLE_POSITIONS = 4096  # precomputed positions: every config's seq_len and eval context fit


class RotaryTables(nn.Module):
    """The rotary cos/sin tables, computed once and shared by every attention layer.

    Computed per call, the tables cost little in eager mode, but torch.compile inlines their
    pow/sin/cos into each layer's rotation kernel, once per element of q and k. On an H100 that kernel
    was the largest inductor kernel of the step (2.2 ms per step). As buffers they are graph inputs, and
    the rotation only loads them. They are non-persistent, so they stay out of the state dict and the
    artifact. Sequences longer than the table compute theirs per call.
    """

    def __init__(self, dim: int, base: float, positions: int = ROPE_TABLE_POSITIONS):
        super().__init__()
        self.dim, self.base = dim, base
        cos, sin = rotary_cos_sin(positions, dim, base, torch.device("cpu"))
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        if seq_len > self.cos.shape[0]:
            return rotary_cos_sin(seq_len, self.dim, self.base, self.cos.device)
        # .float(): a no-op for the fp32 buffers. A model cast to bf16 casts these too, and .float() then gives
        # fp32 tables of bf16 precision (nothing in the repository casts the model)
        return self.cos[:seq_len].float(), self.sin[:seq_len].float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (first half, second half) of the head dim. x: [B, H, T, D]."""
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return out.to(x.dtype)


def apply_partial_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dims: int) -> torch.Tensor:
    """Rotate the first `dims` dims of each head (cos/sin built for `dims`); the rest pass through.

    The unrotated dims let attention match on content independently of position (partial RoPE).
    """
    if dims == x.shape[-1]:
        return apply_rotary(x, cos, sin)
    return torch.cat([apply_rotary(x[..., :dims], cos, sin), x[..., dims:]], dim=-1)


def remove_self_value(y: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """XSA: y_h <- y_h - (y_h . v̂) v̂, v̂ the token's own normalized value in the KV head that query
    head h reads (GQA: head h reads KV head h // (H / H_kv), as in SDPA's enable_gqa).

    y [B, H, T, D], v [B, H_kv, T, D]. Attention output is a convex mix of values that always
    includes the token's own; removing that direction leaves the heads only what the *context* adds.
    Computed in fp32 so the result is orthogonal to v̂ to fp32 precision before the cast back.
    """
    B, H, T, D = y.shape
    h_kv = v.shape[1]
    yg = y.float().reshape(B, h_kv, H // h_kv, T, D)
    v_hat = F.normalize(v.float(), dim=-1).unsqueeze(2)
    yg = yg - (yg * v_hat).sum(dim=-1, keepdim=True) * v_hat
    return yg.reshape(B, H, T, D).to(y.dtype)


def load_fa3(backend: str):
    """FlashAttention 3's `flash_attn_func` (module flash_attn_interface, built from the hopper/ folder of
    the flash-attention repository) for backends that may use it, else None. Resolved when the layer is
    built: torch.compile cannot trace an import inside forward."""
    if backend == "sdpa":
        return None
    try:
        return importlib.import_module("flash_attn_interface").flash_attn_func
    except ImportError:
        if backend == "fa3":
            raise RuntimeError("model.attention='fa3' but flash_attn_interface is not importable (hint: install "
                               "FlashAttention 3 from the hopper/ folder of flash-attention, or use 'auto' / "
                               "'sdpa')") from None
        return None


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fa3=None) -> torch.Tensor:
    """Causal GQA attention, q [B, H, T, D], k/v [B, H_kv, T, D] -> [B, H, T, D]: FlashAttention 3's
    `fa3` (which takes [B, T, H, D] and handles GQA itself) when given, else torch's SDPA (flash /
    cuDNN / efficient kernels as torch picks)."""
    if fa3 is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
    out = fa3(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
    out = out[0] if isinstance(out, tuple) else out  # some FA3 versions also return the log-sum-exp
    return out.transpose(1, 2)


class Attention(nn.Module):
    """Causal GQA attention with QK-RMSNorm (learned per-head gain on q) and (partial) RoPE, via SDPA or
    FlashAttention 3 (model.attention; see causal_attention).

    `layer` (the block index) decides the per-layer options: XSA on the last cfg.xsa_layers blocks,
    and on the last cfg.value_embed_layers blocks a zero-initialized projection `value_proj` of the
    shared value embedding, added to V.

    With cfg.doc_attention the forward's document mask (model/doc_attention.py) replaces the causal kernel: each token
    attends within its own document.

    With cfg.attn_gate every head's output (after XSA) is scaled per token by sigmoid(W_h · u[:width]), u the
    sublayer's normed input: a head can switch itself off where it has nothing to add (Gated Attention,
    https://arxiv.org/abs/2505.06708; the parameter-golf records from 2026-04-16 on). W [n_heads, width] starts at
    zero, so every gate starts at sigmoid(0) = 0.5. It is a plain parameter, not a Linear: AdamW's scalar group
    trains it, as the records do, and the artifact stores it as floats.
    """

    def __init__(self, cfg: ModelConfig, layer: int = 0, rope: RotaryTables | None = None):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.rotary_dims = cfg.rotary_dims
        self.rope = rope if rope is not None else RotaryTables(cfg.rotary_dims, cfg.rope_base)
        # "auto" uses FA3 for bf16/fp16 CUDA tensors when it is installed; "fa3" always; "sdpa" never.
        self.fa3, self.force_fa3 = load_fa3(cfg.attention), cfg.attention == "fa3"
        self.xsa = layer >= cfg.n_layers - cfg.xsa_layers
        kv_dim = cfg.kv_dim
        self.qkv = nn.Linear(cfg.d_model, cfg.d_model + 2 * kv_dim, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.q_gain = nn.Parameter(torch.full((cfg.n_heads,), cfg.qk_gain_init))
        has_ve = layer >= cfg.n_layers - cfg.value_embed_layers
        self.value_proj = nn.Linear(cfg.value_embed_dim, kv_dim, bias=False) if has_ve else None
        self.gate_width = cfg.attn_gate_width or cfg.d_model
        self.head_gate = nn.Parameter(torch.zeros(cfg.n_heads, self.gate_width)) if cfg.attn_gate else None

    def forward(self, u: torch.Tensor, value_embed: torch.Tensor | None = None, doc_mask=None) -> torch.Tensor:
        """doc_mask: attend within documents (model/doc_attention.py's DocumentMask of this forward's ids)."""
        B, T, C = u.shape
        kv_dim = self.n_kv_heads * self.head_dim
        q, k, v = self.qkv(u).split([C, kv_dim, kv_dim], dim=-1)
        if self.value_proj is not None:
            if value_embed is None:
                raise ValueError("this attention layer has value embeddings: pass value_embed [B, T, value_embed_dim]")
            v = v + self.value_proj(value_embed).to(v.dtype)
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q = F.rms_norm(q, (self.head_dim,)) * self.q_gain.to(q.dtype).view(1, -1, 1, 1)
        k = F.rms_norm(k, (self.head_dim,))
        cos, sin = self.rope(T)
        q = apply_partial_rotary(q, cos, sin, self.rotary_dims)
        k = apply_partial_rotary(k, cos, sin, self.rotary_dims)
        if doc_mask is not None:
            y = doc_causal_attention(q, k, v, doc_mask)
        else:
            half = q.dtype in (torch.bfloat16, torch.float16)
            use_fa3 = self.fa3 is not None and (self.force_fa3 or (q.is_cuda and half))
            y = causal_attention(q, k, v, self.fa3 if use_fa3 else None)
        if self.xsa:
            y = remove_self_value(y, v)
        if self.head_gate is not None:
            y = y * self.head_gates(u).to(y.dtype)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))

    def head_gates(self, u: torch.Tensor) -> torch.Tensor:
        """The output gate of every head and token, [B, H, T, 1], from the sublayer's normed input u [B, T, C]."""
        g = torch.sigmoid(F.linear(u[..., :self.gate_width], self.head_gate.to(u.dtype)))
        return g.transpose(1, 2).unsqueeze(-1)


class MLP(nn.Module):
    """y = W_down · leaky_relu(W_up · u, 0.5)^2 — the reference, or the fused Triton kernel."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.up = nn.Linear(cfg.d_model, cfg.mlp_hidden, bias=False)
        self.down = nn.Linear(cfg.mlp_hidden, cfg.d_model, bias=False)
        self.use_kernel = cfg.mlp_kernel

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        if self.use_kernel:
            from kernels.mlp import fused_mlp  # imported lazily: triton is optional on CPU
            dtype = torch.get_autocast_dtype(u.device.type) if torch.is_autocast_enabled(u.device.type) else u.dtype
            return fused_mlp(u.to(dtype), self.up.weight.to(dtype), self.down.weight.to(dtype))
        # Calling the nn.Linear modules (not F.linear on their weights) keeps forward hooks working:
        # GPTQ calibration collects its Hessians from them.
        return self.down(leaky_relu_sq(self.up(u)))


class Sublayer(nn.Module):
    """Pre-norm wrapper: F(u) = body(norm_scale * RMSNorm(u)).

    norm_scale is a constant: 1, or 1/sqrt(layer+1) with model.layer_norm_scale, which shrinks what
    deep blocks write early in training (their output projections then grow under the optimizer).
    Extra inputs (the value embedding) are passed through to the body.
    """

    def __init__(self, body: nn.Module, dim: int, norm_scale: float = 1.0):
        super().__init__()
        self.norm = RMSNorm(dim)
        self.body = body
        self.norm_scale = norm_scale

    def forward(self, u: torch.Tensor, *extra: torch.Tensor) -> torch.Tensor:
        h = self.norm(u)
        if self.norm_scale != 1.0:
            h = h * self.norm_scale
        return self.body(h, *extra)
