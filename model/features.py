"""Record-architecture pieces outside attention and the MLP (https://github.com/openai/parameter-golf records): SmearGate and BigramHash on
the input embedding, the U-Net skip wiring with its learned weights, and the scalars of the parallel residual lanes.

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
    """Encoder/decoder pairing of the virtual layers, and one learned per-channel weight vector per skip.

    Over a forward of `depth` virtual layers (n_layers, or more with depth recurrence: model.recur_*), positions
    [0, n_enc) with n_enc = depth // 2 are the encoder, the rest the decoder. Decoder position n_enc + j reads what
    encoder position n_enc - 1 - j saved (for j < n_enc: the mirror image), scaled by weight[j] (init 1).
    Per-channel rather than scalar: it costs n_enc * C numbers (2,560 at the record size, < 0.01% of the model)
    and lets each channel choose how much early, more lexical, signal it takes back, which a scalar cannot.

    Why virtual positions, as the 2026-04-09 record counts them
    (https://github.com/openai/parameter-golf/tree/main/records/track_10min_16mb): a skip joins equal depths of
    the computation the model runs, so a looped block gets a skip (and a weight) of its own at each visit, and
    the U stays symmetric in depth. There are weights for the longer forward (n_weights); the shorter one, before
    recurrence switches on, uses the first of them, whose pairing then moves to the mirror of the new depth.
    """

    def __init__(self, n_weights: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n_weights, dim))

    @staticmethod
    def is_encoder(pos: int, depth: int) -> bool:
        return pos < depth // 2

    @staticmethod
    def skip_index(pos: int, depth: int) -> int | None:
        """j for decoder position n_enc + j that receives a skip, else None."""
        j = pos - depth // 2
        return j if 0 <= j < depth // 2 else None

    def skip(self, pos: int, depth: int, saved: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor | None:
        """weight[j] * (the mirror encoder position's saved tensor) for a decoder position with a skip, else None."""
        j = self.skip_index(pos, depth)
        if j is None:
            return None
        return self.weight[j].to(dtype) * saved[depth // 2 - 1 - j].to(dtype)

    def add(self, x: torch.Tensor, pos: int, depth: int, saved: list[torch.Tensor]) -> torch.Tensor:
        """x + its skip (see skip), for a decoder position with one; x otherwise."""
        s = self.skip(pos, depth, saved, x.dtype)
        return x if s is None else x + s


LANE_CARRY_INIT = 1.1  # each lane's carry at init, as the 2026-03-31 record's sqrt(1.1) before each of two sublayers


class ParallelLanes(nn.Module):
    """Learned scalars of the two residual lanes a (attention) and m (MLP) over the last blocks (model.lane_start).

    Both lanes start as copies of the residual stream entering the first lane block. In lane block i, attention
    reads norm(a) and the MLP reads norm(m), both from the state before the block (parallel, as GPT-J's block),
    and each lane is carried and written by a free 2x2 write:
        a' = carry[i,0] * a + write[i,0,0] * A + write[i,0,1] * M
        m' = carry[i,1] * m + write[i,1,0] * A + write[i,1,1] * M
    carry starts at LANE_CARRY_INIT and write at 1, so the lanes stay equal until a U-Net skip (which enters lane
    a) or training sets them apart, and an equal pair is GPT-J's parallel block x' = 1.1 x + A(x) + M(x). The
    readout is (a + m) / 2. Formulation after the 2026-03-31 record (2x2 write, readout), the 2026-04-04 and
    2026-04-08 records (skips into the attention lane) and the 2026-04-09 record (parallel reads), at
    https://github.com/openai/parameter-golf/tree/main/records/track_10min_16mb. The records' blocks also mix
    the embedding x0 into each sublayer's input (resid_mix); no block here does, so the lanes do not either.
    """

    def __init__(self, n_blocks: int):
        super().__init__()
        self.carry = nn.Parameter(torch.full((n_blocks, 2), LANE_CARRY_INIT))
        self.write = nn.Parameter(torch.ones(n_blocks, 2, 2))

    def forward(self, i: int, a: torch.Tensor, m: torch.Tensor, attn: torch.Tensor,
                mlp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The lanes after lane block i, from the lanes before it and its attention and MLP outputs."""
        c, w = self.carry[i], self.write[i]
        return c[0] * a + w[0, 0] * attn + w[0, 1] * mlp, c[1] * m + w[1, 0] * attn + w[1, 1] * mlp
