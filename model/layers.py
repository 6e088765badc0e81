"""Transformer sublayers: RMSNorm, rotary embedding, GQA attention, LeakyReLU(0.5)^2 MLP.

Each sublayer takes the (pre-norm) residual input u [B, T, C] and returns F(u) [B, T, C]; the
residual wiring (plain or mHC) lives in model/gpt.py.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels.mlp_reference import leaky_relu_sq
from model.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype))


def rotary_cos_sin(seq_len: int, dim: int, base: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [T, dim/2] in fp32 (computed per call: cheap, and compile-friendly)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (first half, second half) of the head dim. x: [B, H, T, D]."""
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return out.to(x.dtype)


class Attention(nn.Module):
    """Causal GQA attention with QK-RMSNorm (learned per-head gain on q) and RoPE, via SDPA."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.rope_base = cfg.rope_base
        kv_dim = cfg.n_kv_heads * cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, cfg.d_model + 2 * kv_dim, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.q_gain = nn.Parameter(torch.full((cfg.n_heads,), cfg.qk_gain_init))

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        B, T, C = u.shape
        kv_dim = self.n_kv_heads * self.head_dim
        q, k, v = self.qkv(u).split([C, kv_dim, kv_dim], dim=-1)
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q = F.rms_norm(q, (self.head_dim,)) * self.q_gain.to(q.dtype).view(1, -1, 1, 1)
        k = F.rms_norm(k, (self.head_dim,))
        cos, sin = rotary_cos_sin(T, self.head_dim, self.rope_base, u.device)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


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
    """Pre-norm wrapper: F(u) = body(RMSNorm(u))."""

    def __init__(self, body: nn.Module, dim: int):
        super().__init__()
        self.norm = RMSNorm(dim)
        self.body = body

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return self.body(self.norm(u))
