"""mHC parameters of one sublayer, and the switch between the PyTorch reference and Triton kernels."""
from __future__ import annotations

import math
from types import SimpleNamespace

import torch
import torch.nn as nn

from kernels import mhc_reference
from kernels.mhc_reference import mhc_init_bias, mhc_num_coefficients, res_diag_logit


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

    def __init__(self, n_streams: int, dim: int, alpha_init: float, generator: torch.Generator | None = None,
                 res_diag: float = 0.0):
        super().__init__()
        k = n_streams * dim
        # Drawn [in, out] and transposed: the same values as the earlier [n*C, N] layout had, so runs
        # measured before the change stay comparable seed for seed.
        self.phi = nn.Parameter(torch.randn(k, mhc_num_coefficients(n_streams), generator=generator).t().contiguous())
        self.phi_scale = 1.0 / math.sqrt(k)
        self.alpha = nn.Parameter(torch.full((3,), float(alpha_init)))
        # res_diag (model.mhc_res_diag): H_res's diagonal at init instead of the default logit's; 0 keeps the default
        self.bias = nn.Parameter(mhc_init_bias(n_streams, res_diag_logit(n_streams, res_diag)) if res_diag
                                 else mhc_init_bias(n_streams))

    def projection(self) -> torch.Tensor:
        """The [n*C, n^2+2n] projection the mHC calls take (phi times its fixed scale, transposed)."""
        return (self.phi * self.phi_scale).t()


# How far the lanes init leans into its choices: sigmoid(4) = 0.982. A larger logit comes closer to a one-hot read
# and an identity carry, but the gradient that lets training move them is sigmoid' = 0.018 here and falls as
# exp(-logit) (4.5e-5 at 10).
LANE_READ_LOGIT = 4.0
LANE_RES_LOGIT = 4.0


def lanes_init_bias(reads: int, write: float) -> torch.Tensor:
    """Bias of an n=2 mHC unit that starts as one sublayer of the parallel residual lanes (model.mhc_init='lanes'):
    streams (a, m), the unit reading stream `reads` (0 = a for attention, 1 = m for the MLP) and writing `write`.

    At alpha = 0, with r = sigmoid(LANE_READ_LOGIT) and d = sigmoid(LANE_RES_LOGIT), both 0.982:
      - H_pre = (r, 1 - r) on the read stream first: u = 0.982 * read + 0.018 * other (a one-hot read needs r = 1,
        out of sigmoid's reach);
      - H_res = [[d, 1 - d], [1 - d, d]]: exp of the logits [[4, 0], [0, 4]] already has equal row and column sums,
        so Sinkhorn returns it as it is: each stream keeps 0.982 of itself and takes 0.018 of the other. Rows of a
        doubly stochastic matrix sum to 1, so the lanes' carry 1.1 is out of reach here; GPT sets `write` so that
        the streams are the lanes scaled down instead (see GPT._init_mhc_as_lanes);
      - H_post = 2 * sigmoid(log(write / (2 - write))) = write on both streams, as the lanes write each output into
        both lanes.
    """
    if not 0.0 < write < 2.0:
        raise ValueError(f"lanes_init_bias: write={write} must be in (0, 2) (H_post = 2 * sigmoid)")
    pre = torch.tensor([LANE_READ_LOGIT, -LANE_READ_LOGIT])
    if reads == 1:
        pre = pre.flip(0)
    post = torch.full((2,), math.log(write / (2.0 - write)))
    res = torch.eye(2) * LANE_RES_LOGIT
    return torch.cat([pre, post, res.flatten()])


def mhc_ops(use_kernels: bool) -> SimpleNamespace:
    """The three calls the model makes: pre, post, post_pre (same signatures in both modules)."""
    if use_kernels:
        from kernels import mhc as impl  # imported lazily: triton is optional on CPU
    else:
        impl = mhc_reference
    return SimpleNamespace(pre=impl.mhc_pre, post=impl.mhc_post, post_pre=impl.mhc_post_pre)
