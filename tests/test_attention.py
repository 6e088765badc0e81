"""The attention layer: grouped-query heads, and the SDPA and FlashAttention-3 backends giving one answer."""
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from model.config import ModelConfig
from model.gpt import GPT
from model.layers import Attention
from test_model import tiny


def gqa_layer_and_input() -> tuple[ModelConfig, Attention, torch.Tensor]:
    """A 4-query / 2-KV-head attention layer with a non-zero output projection, and an input for it."""
    cfg = tiny(n_heads=4, n_kv_heads=2)
    torch.manual_seed(0)
    attn = Attention(cfg)
    nn.init.normal_(attn.proj.weight, std=0.1)
    return cfg, attn, torch.randn(2, 9, cfg.d_model)


def test_gqa_attention_matches_repeated_kv_heads():
    cfg, attn, u = gqa_layer_and_input()
    out = attn(u)
    # Same attention with each KV head duplicated into a 4-KV-head layer.
    full = Attention(tiny(n_heads=4, n_kv_heads=4))
    hd, C = cfg.head_dim, cfg.d_model
    with torch.no_grad():
        wq, wk, wv = attn.qkv.weight.split([C, 2 * hd, 2 * hd])
        rep = lambda w: w.view(2, hd, C).repeat_interleave(2, dim=0).reshape(4 * hd, C)
        full.qkv.weight.copy_(torch.cat([wq, rep(wk), rep(wv)]))
        full.proj.weight.copy_(attn.proj.weight)
        full.q_gain.copy_(attn.q_gain)
    assert torch.allclose(full(u), out, atol=1e-5)


class FakeFA3:
    """Stands in for flash_attn_interface: FA3's [B, T, H, D] layout, GQA by head groups, and (like some
    FA3 versions) a (out, lse) tuple; records its calls."""

    def __init__(self):
        self.calls = []

    def flash_attn_func(self, q, k, v, causal=False):
        self.calls.append((tuple(q.shape), tuple(k.shape), causal))
        groups = q.shape[2] // k.shape[2]
        k, v = (t.repeat_interleave(groups, dim=2).transpose(1, 2) for t in (k, v))
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=causal).transpose(1, 2)
        return out, torch.zeros(q.shape[:3])


def test_attention_backends_agree_and_fa3_is_used_when_asked(monkeypatch):
    cfg, attn, u = gqa_layer_and_input()
    sdpa = attn(u)
    monkeypatch.setitem(sys.modules, "flash_attn_interface", None)  # import fails
    with pytest.raises(RuntimeError, match="flash_attn_interface is not importable"):
        Attention(tiny(n_heads=4, n_kv_heads=2, attention="fa3"))
    assert Attention(tiny(attention="auto")).fa3 is None  # auto without FA3: SDPA
    fake = FakeFA3()
    monkeypatch.setitem(sys.modules, "flash_attn_interface", fake)
    for backend, uses_fa3 in [("auto", False), ("sdpa", False), ("fa3", True)]:  # auto: CPU fp32 stays on SDPA
        layer = Attention(tiny(n_heads=4, n_kv_heads=2, attention=backend))
        layer.load_state_dict(attn.state_dict())
        torch.testing.assert_close(layer(u), sdpa, atol=1e-5, rtol=1e-5)
        assert bool(fake.calls) == uses_fa3
    assert fake.calls == [((2, 9, 4, cfg.head_dim), (2, 9, 2, cfg.head_dim), True)]
    with pytest.raises(ValueError, match="model.attention='fa2'"):
        GPT(tiny(attention="fa2"))
