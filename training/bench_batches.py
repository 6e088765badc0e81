"""Batches held on the device for the benchmarks (scripts.bench_step, scripts.bench_attention): the same tokens at every
step, so a timing measures the step or the kernel, not the loader."""
from __future__ import annotations

import torch

from data.shards import list_shards
from model.features import BOS_ID
from training.config import Config
from training.trainer import training_loader


class RandomTokens:
    """Random batches already on the device: measures the step, not the loader. With doc_tokens, a BOS starts a
    document at each position with probability 1/doc_tokens (documents of that mean length), where uniform ids would
    give one BOS per vocab_size tokens: attention within documents (model.doc_attention) costs what the documents'
    lengths make it."""

    def __init__(self, batch_seqs: int, seq_len: int, vocab: int, device: torch.device, rank: int = 0,
                 doc_tokens: int = 0):
        g = torch.Generator().manual_seed(rank)  # each rank its own tokens, as a sharded loader gives
        x = torch.randint(BOS_ID + 1 if doc_tokens else 0, vocab, (batch_seqs, seq_len + 1), generator=g)
        if doc_tokens:
            x[torch.rand(x.shape, generator=g) < 1.0 / doc_tokens] = BOS_ID
        self.x = x.to(device)

    def next_batch(self):
        return self.x[:, :-1], self.x[:, 1:]


class TrainTokens:
    """The first batch the training loader gives this rank from data.train_files (train.seed's order), held on the
    device and given at every step: the corpus's own documents, without timing the loader."""

    def __init__(self, cfg: Config, device: torch.device, rank: int = 0, world_size: int = 1):
        # prefetch=0: no thread, so a shard's error reaches the caller as raised
        with training_loader(cfg, list_shards(cfg.data.train_files), rank, world_size, device, prefetch=0) as loader:
            self.x, self.y = loader.next_batch()

    def next_batch(self):
        return self.x, self.y
