"""GPT with mHC residual streams (n_streams >= 2) or a plain pre-norm residual stream (n_streams = 1).

Forward with mHC, per token (GUIDE §4): the n streams start as copies of the embedding; each
sublayer F (attention, MLP) reads u = Σ_i H_pre[i]·x_i and writes x'_i = Σ_j H_res[i,j]·x_j +
H_post[i]·F(u); the head reads a learned combination of the streams. The apply of sublayer l and
the pre-mix of sublayer l+1 are one call (`post_pre`), the point where the kernels fuse.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.config import ModelConfig
from model.layers import MLP, Attention, RMSNorm, Sublayer
from model.mhc import MHCParams, mhc_ops


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        C, n = cfg.d_model, cfg.n_streams
        self.embed = nn.Embedding(cfg.vocab_size, C)
        self.sublayers = nn.ModuleList()
        for _ in range(cfg.n_layers):
            self.sublayers.append(Sublayer(Attention(cfg), C))
            self.sublayers.append(Sublayer(MLP(cfg), C))
        if n > 1:
            self.mhc = nn.ModuleList(MHCParams(n, C, cfg.mhc_alpha_init) for _ in self.sublayers)
            self.readout = nn.Parameter(torch.full((n,), 1.0 / n))  # head reads Σ_i w_i x_i; starts as the mean
            self.ops = mhc_ops(cfg.mhc_kernels)
        self.final_norm = RMSNorm(C)
        self.reset_parameters()

    # -- init ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Orthogonal init for input-side matrices, zero for output projections (so every sublayer
        starts as the identity map of the residual stream), small normal for the tied embedding."""
        nn.init.normal_(self.embed.weight, std=self.cfg.embed_init_std)
        for sub in self.sublayers:
            body = sub.body
            if isinstance(body, Attention):
                nn.init.orthogonal_(body.qkv.weight)
                nn.init.zeros_(body.proj.weight)
            else:
                nn.init.orthogonal_(body.up.weight)
                nn.init.zeros_(body.down.weight)

    def param_groups(self) -> dict[str, list[nn.Parameter]]:
        """Optimizer groups: Muon for block matrices, AdamW for the embedding and everything small."""
        matrices = [m.weight for m in self.sublayers.modules() if isinstance(m, nn.Linear)]
        ids = {id(p) for p in matrices} | {id(self.embed.weight)}
        scalars = [p for p in self.parameters() if id(p) not in ids]
        return {"matrix": matrices, "embed": [self.embed.weight], "scalar": scalars}

    # -- forward ------------------------------------------------------------------------------------
    def hidden(self, idx: torch.Tensor) -> torch.Tensor:
        """Final hidden state [B, T, C] before the final norm."""
        x = self.embed(idx)
        if self.cfg.n_streams == 1:
            for sub in self.sublayers:
                x = x + sub(x)
            return x
        return self._hidden_mhc(x)

    def _hidden_mhc(self, x: torch.Tensor) -> torch.Tensor:
        n, it = self.cfg.n_streams, self.cfg.sinkhorn_iters
        dev = x.device.type
        # The stream state lives in the compute dtype (bf16 under autocast): it is the memory traffic.
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        streams = x.to(dtype).unsqueeze(-2).expand(*x.shape[:-1], n, x.shape[-1]).contiguous()
        p0 = self.mhc[0]
        u, h_post, h_res = self.ops.pre(streams, p0.phi, p0.alpha, p0.bias, it)
        last = len(self.sublayers) - 1
        for l, sub in enumerate(self.sublayers):
            y = sub(u).to(dtype)
            if l < last:
                p = self.mhc[l + 1]
                streams, u, h_post, h_res = self.ops.post_pre(streams, h_res, h_post, y, p.phi, p.alpha, p.bias, it)
            else:
                streams = self.ops.post(streams, h_res, h_post, y)
        return torch.einsum("...nc,n->...c", streams.float(), self.readout.float())

    def logits(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.final_norm(self.hidden(idx))
        logits = F.linear(h, self.embed.weight.to(h.dtype)).float()
        cap = self.cfg.logit_softcap
        return cap * torch.tanh(logits / cap) if cap > 0 else logits

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Mean cross-entropy (nats) when targets are given, else logits [B, T, V] (fp32)."""
        logits = self.logits(idx)
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def token_nll(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Per-token negative log-likelihood in nats [B, T] (fp32), for evaluation."""
        logits = self.logits(idx)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view_as(targets)
