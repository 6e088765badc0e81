"""Pure-PyTorch reference for mHC (manifold-constrained hyper-connections).

This is the ground truth the Triton kernels in `kernels/mhc.py` must match, and what the model
runs when `model.mhc_kernels = false`.

Everything is **per token** and therefore causal: the coefficients of token t are computed from
token t's own streams only (never from a sequence mean).

Shapes (any number of leading token dimensions, written `...`):
  streams  x      [..., n, C]   n residual streams of width C
  phi             [n*C, N]      N = n*n + 2*n projection columns
  alpha           [3]           (alpha_pre, alpha_post, alpha_res)
  bias            [N]
Column layout of phi / bias: [0, n) pre | [n, 2n) post | [2n, 2n + n*n) res, row-major (i, j).

One sublayer F (attention or MLP) wrapped by mHC:
  h_pre, h_post, h_res = mhc_coefficients(x, ...)
  u  = mhc_premix(x, h_pre)                 # the sublayer's input, [..., C]
  x' = mhc_apply(x, h_res, h_post, F(u))    # new streams, [..., n, C]
"""
from __future__ import annotations

import math

import torch

RMS_EPS = 1e-6


def mhc_num_coefficients(n: int) -> int:
    return n * n + 2 * n


# Entries more than this far below their matrix's max start at exp(-80) ~ 1.8e-35 instead of underflowing to 0:
# a row or column of zeros was 0/0 in the first round, and the NaN reached every later token through attention
# (at res logits spread by ~90). Above it nothing changes.
SINKHORN_FLOOR = -80.0


def sinkhorn_knopp(logits: torch.Tensor, iters: int) -> torch.Tensor:
    """exp(logits) made doubly stochastic by `iters` rounds of row then column normalization.

    logits: [..., n, n] (fp32). The per-matrix max is subtracted first: it cancels in the
    normalization and keeps exp() finite; what lies SINKHORN_FLOOR below it starts at exp(SINKHORN_FLOOR).
    """
    m = torch.exp((logits - logits.amax(dim=(-2, -1), keepdim=True)).clamp_min(SINKHORN_FLOOR))
    for _ in range(iters):
        m = m / m.sum(dim=-1, keepdim=True)
        m = m / m.sum(dim=-2, keepdim=True)
    return m


def mhc_projection_input(x: torch.Tensor) -> torch.Tensor:
    """x̃ / rms(x̃) in fp32 [..., n*C]: what phi projects (x̃ is the flattened stream state)."""
    flat = x.flatten(-2).float()
    return flat * torch.rsqrt(flat.square().mean(dim=-1, keepdim=True) + RMS_EPS)


def mhc_coefficients(
    x: torch.Tensor,
    phi: torch.Tensor,
    alpha: torch.Tensor,
    bias: torch.Tensor,
    sinkhorn_iters: int = 20,
    raw_hook=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token mixing coefficients, computed in fp32 (autocast off: under the model's bf16 autocast the
    projection's output was rounded to bf16, 0.014 off at unit scale). raw_hook(raw) -> raw, when given, sees the
    projection's output (the quantizer's Fisher pass hooks its gradient).

    Returns h_pre [..., n] = sigmoid, h_post [..., n] = 2*sigmoid, h_res [..., n, n] doubly stochastic.
    """
    n = x.shape[-2]
    with torch.autocast(x.device.type, enabled=False):
        raw = mhc_projection_input(x) @ phi.float()                # [..., N]
    if raw_hook is not None:
        raw = raw_hook(raw)
    alpha = alpha.float()
    bias = bias.float()
    h_pre = torch.sigmoid(alpha[0] * raw[..., :n] + bias[:n])
    h_post = 2.0 * torch.sigmoid(alpha[1] * raw[..., n:2 * n] + bias[n:2 * n])
    res_logits = alpha[2] * raw[..., 2 * n:] + bias[2 * n:]
    h_res = sinkhorn_knopp(res_logits.unflatten(-1, (n, n)), sinkhorn_iters)
    return h_pre, h_post, h_res


def mhc_premix(x: torch.Tensor, h_pre: torch.Tensor) -> torch.Tensor:
    """u = sum_i h_pre[i] * x_i, accumulated in fp32, returned in x's dtype. [..., C]"""
    return (h_pre.unsqueeze(-1) * x.float()).sum(dim=-2).to(x.dtype)


def mhc_apply(x: torch.Tensor, h_res: torch.Tensor, h_post: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x'_i = sum_j h_res[i, j] * x_j + h_post[i] * y, accumulated in fp32. [..., n, C]
    With autocast off: it would run the matmul in bf16 (H_res rounded, rows summing to 1 only within 2e-3)."""
    with torch.autocast(x.device.type, enabled=False):
        mixed = torch.matmul(h_res.float(), x.float())
        return (mixed + h_post.float().unsqueeze(-1) * y.float().unsqueeze(-2)).to(x.dtype)


def res_diag_logit(n: int, diag: float) -> float:
    """The H_res diagonal logit g (off-diagonal logits 0) whose Sinkhorn result has diagonal `diag`, in (1/n, 1).

    exp of g·I has every row and column sum 1 + (n-1)·exp(-g) (after the max is subtracted), so the first row
    normalization already makes it doubly stochastic and every further round leaves it as it is: the diagonal is
    1 / (1 + (n-1)·exp(-g)), for any number of rounds. Solved for g: log(diag·(n-1) / (1-diag)).
    """
    if not 1.0 / n < diag < 1.0:
        raise ValueError(f"res_diag_logit: diag={diag} must be in (1/n, 1) = ({1.0 / n:.4g}, 1) for n={n}")
    return math.log(diag * (n - 1) / (1.0 - diag))


def mhc_init_bias(n: int, res_diag_logit: float = 2.0) -> torch.Tensor:
    """Bias that makes an mHC network start as a plain pre-norm residual network.

    With all streams equal to x (they start as copies of the embedding):
      - h_pre = 1/n on every stream            -> u = x                  (bias = -log(n-1))
      - h_post = 2*sigmoid(0) = 1              -> every stream gets x + F(u)
      - any doubly stochastic h_res keeps equal streams equal (rows sum to 1).
    So at alpha = 0 the streams stay identical copies of the plain residual stream whatever h_res is. With
    the default alpha_init (0.01) the gates move by about alpha * |raw| per token, so the streams part from
    step 0 by that much (a tiny model's logits differed from the plain one's by ~0.5%).
    h_res starts diagonal-dominant (diag logit 2: diag 0.88 at n=2, 0.71 at n=4; res_diag_logit() gives the logit of
    another diagonal). A logit of 4 (diag 0.95) would be
    closer to I, but Sinkhorn converges slowly near the identity: with 20 rounds its row sums were
    off by 1e-4 already at init and 1e-2 under perturbation, against < 3e-5 for logit 2 (measured
    in tests/test_model.py::test_h_res_is_doubly_stochastic).
    """
    if n < 2:
        raise ValueError(f"mHC needs n >= 2 streams, got n={n}; n_streams=1 is the plain residual path")
    pre = torch.full((n,), -math.log(n - 1))
    post = torch.zeros(n)
    res = torch.eye(n) * res_diag_logit
    return torch.cat([pre, post, res.flatten()])


# --- The three calls the model makes; kernels/mhc.py provides fused versions with these signatures.

def mhc_pre(x, phi, alpha, bias, sinkhorn_iters: int = 20, raw_hook=None):
    """Coefficients + pre-mix for one sublayer: returns (u [..., C], h_post [..., n], h_res [..., n, n])."""
    h_pre, h_post, h_res = mhc_coefficients(x, phi, alpha, bias, sinkhorn_iters, raw_hook)
    return mhc_premix(x, h_pre), h_post, h_res


def mhc_post(x, h_res, h_post, y):
    """Apply for the last sublayer: returns the new streams [..., n, C]."""
    return mhc_apply(x, h_res, h_post, y)


def mhc_post_pre(x, h_res, h_post, y, phi, alpha, bias, sinkhorn_iters: int = 20, raw_hook=None):
    """Apply of sublayer l followed by coefficients + pre-mix of sublayer l+1 (the fusion point):
    returns (x' [..., n, C], u_next [..., C], h_post_next [..., n], h_res_next [..., n, n])."""
    x_new = mhc_apply(x, h_res, h_post, y)
    u, h_post_next, h_res_next = mhc_pre(x_new, phi, alpha, bias, sinkhorn_iters, raw_hook)
    return x_new, u, h_post_next, h_res_next
