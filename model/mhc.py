"""mHC parameters of one sublayer, and the switch between the PyTorch reference and Triton kernels."""
from __future__ import annotations

import math
from types import SimpleNamespace

import torch
import torch.nn as nn

from kernels import mhc_reference
from kernels.mhc_reference import mhc_init_bias, mhc_num_coefficients


class MHCParams(nn.Module):
    """phi [n^2+2n, n*C], alpha [3], bias [n^2+2n] for one mHC unit (see kernels/mhc_reference.py).

    The projection the kernels take is [n*C, n^2+2n] = (phi / sqrt(n*C))ᵀ (`projection()`): x̃·that /
    rms(x̃) is then unit-scale, so alpha sets the size of the per-token modulation around the bias;
    the bias alone gives the plain-residual start (mhc_init_bias). phi is stored out × in, like an
    nn.Linear weight, so the artifact quantizes it like one: GPTQ with per-row scales (24 rows at
    n=4), on the Hessian of its input x̃ / rms(x̃) that the model reports to the calibration
    (GPT.quant_observer).

    Why the parameter is stored at unit scale: AdamW moves every element by about lr per step
    whatever its size. Stored at its natural scale 1/sqrt(n*C) (0.022 at n*C = 2048), phi changed by
    more than its own size every step at the scalar lr 0.025, the H_res logits grew by tens per
    step, and a 1xH100 run of configs/h100_short.toml diverged (NaN) at step 250. At unit scale the
    same lr is a 2.5% relative step, like the other scalars.
    """

    def __init__(self, n_streams: int, dim: int, alpha_init: float, generator: torch.Generator | None = None):
        super().__init__()
        k = n_streams * dim
        # Drawn [in, out] and transposed: the same values as the earlier [n*C, N] layout had, so runs
        # measured before the change stay comparable seed for seed.
        self.phi = nn.Parameter(torch.randn(k, mhc_num_coefficients(n_streams), generator=generator).t().contiguous())
        self.phi_scale = 1.0 / math.sqrt(k)
        self.alpha = nn.Parameter(torch.full((3,), float(alpha_init)))
        self.bias = nn.Parameter(mhc_init_bias(n_streams))

    def projection(self) -> torch.Tensor:
        """The [n*C, n^2+2n] projection the mHC calls take (phi times its fixed scale, transposed)."""
        return (self.phi * self.phi_scale).t()


def mhc_ops(use_kernels: bool) -> SimpleNamespace:
    """The three calls the model makes: pre, post, post_pre (same signatures in both modules)."""
    if use_kernels:
        from kernels import mhc as impl  # imported lazily: triton is optional on CPU
    else:
        impl = mhc_reference
    return SimpleNamespace(pre=impl.mhc_pre, post=impl.mhc_post, post_pre=impl.mhc_post_pre)
