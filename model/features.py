"""Record-architecture pieces outside attention and the MLP (https://github.com/openai/parameter-golf records): SmearGate and BigramHash on
the input embedding, and the U-Net skip wiring with its learned weights.

Document boundaries: every shard document starts with BOS (id 1). Position t has an in-document
predecessor only when t > 0 and token t is not a BOS; SmearGate and BigramHash read the previous
token only there, so nothing of one document leaks into the next through them.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

BOS_ID = 1
SMEAR_GATE_INIT = -3.0      # sigmoid(-3) = 0.047: a 5% blend at init, with a non-vanishing gradient
BIGRAM_OUT_SCALE = 0.05     # BigramHash output scale, as in the records
FIB_MULT = 2654435761       # floor(2**32 / golden ratio): Knuth's multiplicative (Fibonacci) hash
MASK32 = 0xFFFFFFFF


def has_predecessor(idx: torch.Tensor, bos_id: int = BOS_ID) -> torch.Tensor:
    """bool [B, T]: True where token t has an in-document previous token (t > 0 and idx[t] != BOS)."""
    valid = idx != bos_id
    valid[..., 0] = False
    return valid


class SmearGate(nn.Module):
    """x_t <- (1 - s) * x_t + s * x_{t-1}, s = sigmoid(g) per channel; s = 0 where t has no predecessor.

    Gives every position a cheap look at the previous token's embedding before any attention.
    g starts at SMEAR_GATE_INIT: near the identity (a large blend would blur token identity from
    step 0), yet sigmoid'(g) = 0.045 still lets the optimizer open the gate.
    """

    def __init__(self, dim: int):
        super().__init__()
        self.gate = nn.Parameter(torch.full((dim,), SMEAR_GATE_INIT))

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        prev = F.pad(x[:, :-1], (0, 0, 1, 0))  # x_{t-1}; zeros at t = 0 (masked anyway)
        mask = has_predecessor(idx).unsqueeze(-1).to(x.dtype)
        s = torch.sigmoid(self.gate.float()).to(x.dtype) * mask
        return x + s * (prev - x)


def bigram_bucket(idx: torch.Tensor, n_buckets: int, vocab_size: int, bos_id: int = BOS_ID) -> torch.Tensor:
    """Bucket of (previous token, current token) for every position, int64 [B, T].

    The previous token is the sentinel `vocab_size` where t has no in-document predecessor (t = 0,
    or a BOS). key = prev * (vocab_size + 1) + cur is unique per pair; Fibonacci hashing spreads it:
    the top 32 bits of frac(key * 2^32 / phi) scaled to [0, n_buckets) (multiply-shift range
    reduction). All products stay below 2**63 (key < 2**31, checked in ModelConfig.validate), so the
    int64 arithmetic is exact and identical on every device.
    """
    prev = F.pad(idx[..., :-1], (1, 0), value=vocab_size)
    prev = torch.where(has_predecessor(idx, bos_id), prev, torch.full_like(prev, vocab_size))
    key = prev.long() * (vocab_size + 1) + idx.long()
    mixed = (key * FIB_MULT) & MASK32
    return (mixed * n_buckets) >> 32


class BigramHash(nn.Module):
    """Hashed (previous, current) token embedding: table [n_buckets, dim] -> nn.Linear(dim, d_model),
    times BIGRAM_OUT_SCALE, added to the token embedding.

    The table is an nn.Embedding so the quantizer stores it as an int8 table and the optimizer puts
    it in the "embed" group; it starts at zero (GPT.reset_parameters), so the model starts as
    without it. The projection then must NOT also start at zero: with both zero neither gets a
    gradient, ever.
    """

    def __init__(self, n_buckets: int, dim: int, d_model: int, vocab_size: int):
        super().__init__()
        self.n_buckets, self.vocab_size = n_buckets, vocab_size
        self.table = nn.Embedding(n_buckets, dim)
        self.proj = nn.Linear(dim, d_model, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        rows = self.table(bigram_bucket(idx, self.n_buckets, self.vocab_size))
        return self.proj(rows) * BIGRAM_OUT_SCALE


class UNetSkips(nn.Module):
    """Encoder/decoder pairing of blocks, and one learned per-channel weight vector per skip.

    Blocks [0, n_enc) with n_enc = n_layers // 2 are the encoder, the rest the decoder. Decoder block
    n_enc + j reads what encoder block n_enc - 1 - j saved (for j < n_enc: the mirror image), scaled
    by weight[j] (init 1). Per-channel rather than scalar: it costs n_enc * C numbers (2,560 at the
    record size, < 0.01% of the model) and lets each channel choose how much early, more lexical,
    signal it takes back, which a scalar cannot.
    """

    def __init__(self, n_layers: int, dim: int):
        super().__init__()
        self.n_enc = n_layers // 2
        self.weight = nn.Parameter(torch.ones(self.n_enc, dim))

    def is_encoder(self, block: int) -> bool:
        return block < self.n_enc

    def skip_index(self, block: int) -> int | None:
        """j for decoder block n_enc + j that receives a skip, else None."""
        j = block - self.n_enc
        return j if 0 <= j < self.n_enc else None

    def skip(self, block: int, saved: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor | None:
        """weight[j] * (the mirror encoder block's saved tensor) for a decoder block with a skip, else None."""
        j = self.skip_index(block)
        if j is None:
            return None
        return self.weight[j].to(dtype) * saved[self.n_enc - 1 - j].to(dtype)

    def add(self, x: torch.Tensor, block: int, saved: list[torch.Tensor]) -> torch.Tensor:
        """x + its skip (see skip), for a decoder block with one; x otherwise."""
        s = self.skip(block, saved, x.dtype)
        return x if s is None else x + s
