"""Model hyper-parameters (a typed dataclass; configs/*.toml fill it under [model])."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ModelConfig:
    vocab_size: int = 1024
    n_layers: int = 11
    d_model: int = 512
    n_heads: int = 8                   # query heads
    n_kv_heads: int = 4                # key/value heads (GQA)
    mlp_mult: float = 3.5              # MLP hidden width = round(mlp_mult * d_model)
    n_streams: int = 4                 # mHC residual streams; 1 = plain residual network, no mHC cost
    sinkhorn_iters: int = 20           # Sinkhorn-Knopp rounds for H_res
    mhc_alpha_init: float = 0.01       # initial alpha_pre/post/res
    rope_base: float = 10000.0
    logit_softcap: float = 30.0        # tanh softcap on logits; 0 disables
    qk_gain_init: float = 1.5          # learned per-head gain after QK-RMSNorm
    embed_init_std: float = 0.005      # tied embedding init
    mhc_kernels: bool = False          # Triton mHC kernels instead of the PyTorch reference
    mlp_kernel: bool = False           # Triton fused LeakyReLU^2 MLP instead of the PyTorch reference

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def mlp_hidden(self) -> int:
        return int(round(self.mlp_mult * self.d_model))
