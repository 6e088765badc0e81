"""GPT with mHC residual streams (n_streams >= 2) or a plain pre-norm residual stream (n_streams = 1).

Forward with mHC (https://arxiv.org/abs/2512.24880), per token: the n streams start as copies of the embedding; each
sublayer F (attention, MLP) reads u = Σ_i H_pre[i]·x_i and writes x'_i = Σ_j H_res[i,j]·x_j +
H_post[i]·F(u); the head reads a learned combination of the streams. The apply of sublayer l and
the pre-mix of sublayer l+1 are one call (`post_pre`), the point where the kernels fuse.

Record options (model/config.py; all off by default): the input embedding may add BigramHash and
pass through SmearGate; attention may use XSA, partial RoPE and value embeddings (one shared table,
a projection per layer); sublayer norms may be scaled per block; U-Net skips link encoder and
decoder blocks. A skip carries the state after encoder block i and is added, times its learned weight, to
the residual before the mirror decoder block, so that mHC starts as the plain network with skips too:
  * n_streams = 1: the residual stream x after the block; it is added to x, and so stays in the stream.
  * mHC: the state after the block is what the next block reads, its pre-mix u (or, after the last mHC
    block, the readout). The skip s enters the decoder block's input u, and its output y as y + s, which
    the apply adds to every stream i times H_post[i] (1 at init): the plain x + s + F(x + s). Both are C
    values per token between the kernel calls; adding s to the n streams themselves would cost n*C reads
    and writes per token and a change to the fused calls.
With mhc_blocks = k > 0 only blocks mhc_start..mhc_start+k-1 have mHC: the plain residual stream x before them
enters as n copies (as the embedding does when mHC starts at block 0), after them the learned readout collapses
the streams into one residual stream, and the other blocks are plain, so the stream traffic (the cost of mHC)
scales with k. A skip then carries u (or the readout) from an mHC encoder block and x from a plain one, and is
added by the decoder block as its wiring takes it. mhc_init = "lanes" starts an n=2 range as the parallel residual
lanes instead of the plain residual (GPT._init_mhc_as_lanes).

Depth recurrence (model.recur_*) runs a range of blocks several times in a row once training reaches
model.recur_at: the forward follows a virtual layer sequence of block indices (block_order), mHC streams flow
through the loops (the repeated blocks reuse their mHC units), and U-Net skips pair virtual layers (UNetSkips).
Value embeddings, XSA and the norm scale stay per physical block. Parallel residual lanes (model.lane_start)
run the last plain blocks as two residual lanes (ParallelLanes).
"""
from __future__ import annotations

import functools
from contextlib import contextmanager
from types import SimpleNamespace
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels import mhc_reference
from kernels.mhc_reference import mhc_projection_input
from model.config import ModelConfig
from model.doc_attention import DocumentMask, document_mask
from model.features import LANE_CARRY_INIT, BigramHash, ParallelLanes, SmearGate, UNetSkips
from model.layers import MLP, Attention, RMSNorm, RotaryTables, Sublayer
from model.mhc import MHCParams, lanes_init_bias, mhc_ops


HEAD = "embed.weight"  # the tied table, by state_dict name: the token embedding and the output layer
PHI_SEED_OFFSET = 0x6D6863  # phi's generator: the run's seed plus this ("mhc"), apart from the global stream


class ForwardContext(NamedTuple):
    """What one forward computes once from the token ids for every attention layer."""
    value_embed: torch.Tensor | None  # [B, T, value_embed_dim] with value embeddings
    doc_mask: DocumentMask | None     # under model.doc_attention (model/doc_attention.py)


@contextmanager
def one_cpu_thread():
    """Torch's CPU ops on one thread inside the block. For the orthogonal init: the rounding of its QR depends on the
    thread count, so a seed's initial weights would differ between machines with other core counts; and a QR on
    several threads slows down by an order of magnitude where other processes keep the cores busy (runs side by
    side on one host), where on one thread it takes milliseconds a matrix."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        C, n = cfg.d_model, cfg.n_streams
        self.embed = nn.Embedding(cfg.vocab_size, C)
        self.sublayers = nn.ModuleList()
        rope = RotaryTables(cfg.rotary_dims, cfg.rope_base)  # one copy, shared by every attention layer
        for layer in range(cfg.n_layers):
            scale = (layer + 1) ** -0.5 if cfg.layer_norm_scale else 1.0
            self.sublayers.append(Sublayer(Attention(cfg, layer, rope), C, scale))
            self.sublayers.append(Sublayer(MLP(cfg), C, scale))
        # Blocks with mHC (cfg.mhc_blocks = 0 means all of them); none in the plain network.
        self.n_mhc_blocks = cfg.n_mhc_blocks
        if n > 1:
            units = self.n_mhc_blocks * (1 if cfg.mhc_granularity == "block" else 2)
            # phi draws from a generator of its own, seeded from the run's seed: every other weight then draws what
            # the plain network (and any other mHC layout) draws under the same seed, so a same-seed comparison of
            # layouts is a paired one. (A fork of the global RNG did that too, but its draws came again right after:
            # phi was a scaled copy of the first embedding rows.)
            phi_rng = torch.Generator().manual_seed((torch.initial_seed() + PHI_SEED_OFFSET) % 2 ** 63)
            # unit u belongs to block mhc_start + u (block granularity) or mhc_start + u // 2 (u even: attention)
            self.mhc = nn.ModuleList(MHCParams(n, C, cfg.mhc_alpha_init, phi_rng, cfg.mhc_res_diag) for _ in range(units))
            # Σ_i w_i x_i after the last mHC block (for the head, or the plain blocks after the mHC range);
            # the mean at init
            self.readout = nn.Parameter(torch.full((n,), 1.0 / n))
            self.ops = mhc_ops(cfg.mhc_kernels)
            if cfg.mhc_init == "lanes":
                self._init_mhc_as_lanes()
        self.final_norm = RMSNorm(C)
        # Optional modules are only created when on, so the default model is the plain one, parameter
        # for parameter and random draw for random draw.
        self.bigram = (BigramHash(cfg.bigram_buckets, cfg.bigram_dim, C, cfg.vocab_size)
                       if cfg.bigram_buckets else None)
        self.smear = SmearGate(C) if cfg.smear_gate else None
        self.value_embed = nn.Embedding(cfg.vocab_size, cfg.value_embed_dim) if cfg.value_embed_layers else None
        # weights for the longer forward: the one with depth recurrence on, where it is configured (see UNetSkips)
        self.unet = UNetSkips(len(cfg.block_order(True)) // 2, C) if cfg.unet_skips else None
        self.lanes = ParallelLanes(cfg.n_layers - cfg.lane_start) if cfg.lane_start else None
        # Depth recurrence (model.recur_*): the trainer switches it on once training reaches model.recur_at, and
        # the artifact records the phase training ended in. A plain attribute, not a buffer: torch.compile guards on
        # it, so each phase has a graph of its own and a flip costs one recompile, done in the compile warm-up.
        self.recurrence_on = False
        self._orders = {False: cfg.block_order(False), True: cfg.block_order(True)}
        # Set only during quantization calibration: called as observer(name, x) with the input that the
        # 2-D parameter `name` (out x in) multiplies, for the parameters that are not nn.Linear weights
        # (mHC phi), so GPTQ gets their Hessians as it does a Linear's from a forward hook.
        self.quant_observer = None
        # Set only during the quantizer's Fisher pass: called as y = observer(name, y) with the output of the 2-D
        # parameter `name` that is not an nn.Linear weight (mHC phi's projection, the tied head's logits), to hook
        # the loss gradient there. mHC then runs the PyTorch reference, where the projection is one tensor.
        self.quant_grad_observer = None
        self.reset_parameters()

    # -- init ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def _init_mhc_as_lanes(self) -> None:
        """Biases and readout that start the n=2 mHC range as ParallelLanes (model.mhc_init='lanes').

        Lane block i of k (mHC block mhc_start + i), carry c = LANE_CARRY_INIT, write 1, is x' = c·x + A + M per lane.
        Every sublayer reads its input through an RMSNorm, which a positive scale does not change, so the lanes
        divided by c^i before lane block i follow y' = y + (A + M) / c^(i+1): carry 1, write c^-(i+1), which H_res
        and H_post can express (model/mhc.py::lanes_init_bias). The readout c^k / 2 per stream then gives the lanes'
        (a + m) / 2 at the lanes' own scale. What stays apart from the lanes at alpha = 0:
          - the reads and carries lean 0.982 / 0.018 instead of 1 / 0 (LANE_READ_LOGIT, LANE_RES_LOGIT);
          - mHC runs attention and MLP one after the other, so the MLP reads lane m after attention's write,
            c·m + A (scaled), where the lanes' MLP reads m from before the block;
          - U-Net skips enter the mHC units as on any mHC range (module doc), not lane a alone.
        """
        k = self.cfg.n_mhc_blocks
        for i in range(k):
            write = LANE_CARRY_INIT ** -(i + 1)
            self.mhc[2 * i].bias.copy_(lanes_init_bias(0, write))      # attention reads stream a
            self.mhc[2 * i + 1].bias.copy_(lanes_init_bias(1, write))  # the MLP reads stream m
        self.readout.fill_(LANE_CARRY_INIT ** k / 2)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Orthogonal init for input-side matrices, zero for the matrices that write into the residual
        stream or into V (so every sublayer starts as the identity map of the residual stream and the
        value embeddings start without effect), small normal for the tied embedding.

        Value-embedding table: N(0, 1), so its projection (trained by Muon like every block matrix)
        sees inputs of unit RMS like the RMS-normed inputs of the other matrices. BigramHash: the
        table starts at zero and the projection orthogonal (both zero would never get a gradient).
        """
        nn.init.normal_(self.embed.weight, std=self.cfg.embed_init_std)
        with one_cpu_thread():
            for sub in self.sublayers:
                body = sub.body
                if isinstance(body, Attention):
                    nn.init.orthogonal_(body.qkv.weight)
                    nn.init.zeros_(body.proj.weight)
                    if body.value_proj is not None:
                        nn.init.zeros_(body.value_proj.weight)
                else:
                    nn.init.orthogonal_(body.up.weight)
                    nn.init.zeros_(body.down.weight)
            if self.bigram is not None:
                nn.init.zeros_(self.bigram.table.weight)
                nn.init.orthogonal_(self.bigram.proj.weight)
        if self.value_embed is not None:
            nn.init.normal_(self.value_embed.weight, std=1.0)

    def param_groups(self) -> dict[str, list[nn.Parameter]]:
        """Optimizer groups: Muon for every nn.Linear weight (block matrices and the feature
        projections), AdamW for every nn.Embedding table (token, bigram, value) and everything small."""
        matrices = [m.weight for m in self.modules() if isinstance(m, nn.Linear)]
        embeds = [m.weight for m in self.modules() if isinstance(m, nn.Embedding)]
        ids = {id(p) for p in matrices + embeds}
        scalars = [p for p in self.parameters() if id(p) not in ids]
        return {"matrix": matrices, "embed": embeds, "scalar": scalars}

    def qkv_splits(self) -> dict[nn.Parameter, tuple[int, int, int]]:
        """{fused qkv weight: its q, k, v row counts}, for Muon to orthogonalize them apart (optim.muon_split_qkv)."""
        C, kv = self.cfg.d_model, self.cfg.kv_dim
        return {sub.body.qkv.weight: (C, kv, kv) for sub in self.sublayers if isinstance(sub.body, Attention)}

    # -- forward ------------------------------------------------------------------------------------
    def embed_tokens(self, idx: torch.Tensor) -> torch.Tensor:
        """Input embedding [B, T, C]: token embedding (+ BigramHash), then SmearGate."""
        x = self.embed(idx)
        if self.bigram is not None:
            x = x + self.bigram(idx)
        if self.smear is not None:
            x = self.smear(x, idx)
        return x

    def _extra(self, l: int, ctx: ForwardContext) -> tuple:
        """Extra inputs of sublayer l, for attention alone: the value embedding where the layer projects it, and the
        document mask under model.doc_attention."""
        body = self.sublayers[l].body
        if not isinstance(body, Attention):
            return ()
        if ctx.doc_mask is not None:
            return ctx.value_embed, ctx.doc_mask
        return (ctx.value_embed,) if body.value_proj is not None else ()

    def hidden(self, idx: torch.Tensor) -> torch.Tensor:
        """Final hidden state [B, T, C] before the final norm."""
        x = self.embed_tokens(idx)
        ctx = ForwardContext(self.value_embed(idx) if self.value_embed is not None else None,
                             document_mask(idx) if self.cfg.doc_attention else None)
        if self.cfg.n_streams == 1:
            return self._hidden_plain(x, ctx)
        # plain virtual layers, then the mHC range's, then plain ones (a loop stays inside one part, ModelConfig checks)
        order, start, end = self.block_order(), self.cfg.mhc_start, self.cfg.mhc_end
        first = sum(b < start for b in order)
        stop = first + sum(start <= b < end for b in order)
        saved: list[torch.Tensor] = []  # U-Net: the state after each encoder layer (see module doc)
        x = self._hidden_plain(x, ctx, 0, first, saved)
        x = self._hidden_mhc(x, ctx, first, stop, saved)
        return self._hidden_plain(x, ctx, stop, len(order), saved)

    def block_order(self) -> tuple[int, ...]:
        """The physical block of each virtual layer in the phase the model is in (see ModelConfig.block_order)."""
        return self._orders[self.recurrence_on]

    def recurrence_due(self, progress: float) -> bool:
        """Whether depth recurrence is on at this training progress (0..1, the schedule's)."""
        return self.cfg.recur_times > 1 and progress >= self.cfg.recur_at

    def _hidden_plain(self, x: torch.Tensor, ctx: ForwardContext, first: int = 0,
                      stop: int | None = None, saved: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Plain pre-norm residual blocks over virtual layers first..stop-1 (to the end for None), as two lanes from
        model.lane_start; saved holds the U-Net skips of earlier layers."""
        saved = [] if saved is None else saved  # U-Net: residual stream after each encoder layer
        order = self.block_order()
        for pos in range(first, len(order) if stop is None else stop):
            block = order[pos]
            if self.lanes is not None and block >= self.cfg.lane_start:
                return self._hidden_lanes(x, ctx, pos, saved)
            if self.unet is not None:
                x = self.unet.add(x, pos, len(order), saved)
            for l in (2 * block, 2 * block + 1):
                x = x + self.sublayers[l](x, *self._extra(l, ctx))
            if self.unet is not None and self.unet.is_encoder(pos, len(order)):
                saved.append(x)
        return x

    def _hidden_lanes(self, x: torch.Tensor, ctx: ForwardContext, first: int,
                      saved: list[torch.Tensor]) -> torch.Tensor:
        """Virtual layers from `first` on (blocks lane_start.., each once) as two parallel residual lanes
        (ParallelLanes): U-Net skips enter the attention lane a; the state a lane block saves as a skip, and the
        readout, is (a + m) / 2, the plain stream while the lanes are equal."""
        order = self.block_order()
        a = m = x
        for pos in range(first, len(order)):
            block = order[pos]
            if self.unet is not None:
                a = self.unet.add(a, pos, len(order), saved)
            attn = self.sublayers[2 * block](a, *self._extra(2 * block, ctx))
            mlp = self.sublayers[2 * block + 1](m)
            a, m = self.lanes(block - self.cfg.lane_start, a, m, attn, mlp)
            if self.unet is not None and self.unet.is_encoder(pos, len(order)):
                saved.append((a + m) * 0.5)
        return (a + m) * 0.5

    def _hidden_mhc(self, x: torch.Tensor, ctx: ForwardContext, first: int, stop: int,
                    saved: list[torch.Tensor]) -> torch.Tensor:
        """The mHC virtual layers first..stop-1: x expanded into n copies, the units, then the readout."""
        n, it = self.cfg.n_streams, self.cfg.sinkhorn_iters
        dev = x.device.type
        # The stream state lives in the compute dtype (bf16 under autocast): it is the memory traffic. In fp32 with
        # model.mhc_stream_fp32, to measure what that rounding costs.
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        if self.cfg.mhc_stream_fp32:
            dtype = torch.promote_types(x.dtype, torch.float32)
        streams = x.to(dtype).unsqueeze(-2).expand(*x.shape[:-1], n, x.shape[-1]).contiguous()
        order = self.block_order()
        depth = len(order)
        # The units run in virtual order, so post_pre hands the streams to the next unit run, the same unit again at
        # a loop's turn: repeated blocks reuse their units' parameters. runs: (virtual layer, sublayer or block, unit)
        per_block, start = self.cfg.mhc_granularity == "block", self.cfg.mhc_start
        runs = ([(pos, order[pos], order[pos] - start) for pos in range(first, stop)] if per_block else
                [(pos, 2 * order[pos] + k, 2 * (order[pos] - start) + k) for pos in range(first, stop) for k in (0, 1)])
        p0 = self.mhc[runs[0][2]]
        self._observe_mhc_input(runs[0][2], streams)
        u, h_post, h_res = self._mhc_ops(runs[0][2]).pre(streams, p0.projection(), p0.alpha, p0.bias, it)
        last = len(runs) - 1
        for i, (pos, l, unit) in enumerate(runs):
            block = l if per_block else l // 2
            skip = self.unet.skip(pos, depth, saved, u.dtype) if self.unet is not None and (per_block or l % 2 == 0) \
                else None
            if skip is not None:
                u = u + skip
            y = (self._block_delta(block, u, ctx) if per_block
                 else self.sublayers[l](u, *self._extra(l, ctx)))
            y = (y if skip is None else y + skip).to(dtype)  # the skip reaches the streams, as in the plain one
            if i < last:
                nxt = runs[i + 1][2]
                p = self.mhc[nxt]
                streams, u, h_post, h_res = self._mhc_ops(nxt).post_pre(streams, h_res, h_post, y, p.projection(),
                                                                        p.alpha, p.bias, it)
                self._observe_mhc_input(nxt, streams)  # post_pre returned unit nxt's input with its coefficients
                if self.unet is not None and (per_block or l % 2 == 1) and self.unet.is_encoder(pos, depth):
                    saved.append(u)  # the state after the block: what the next block reads
            else:
                streams = self._mhc_ops(unit).post(streams, h_res, h_post, y)
        # An elementwise product and a sum over the stream axis, not an einsum: einsum lowers to a matrix
        # product with K = n (forward) and K = 1 (backward) over all B*T*C elements, which cuBLAS ran
        # as GEMV kernels taking 3.1 ms (n=4) and 6.0 ms (n=2) of an H100 step; this inductor fuses.
        acc = torch.promote_types(streams.dtype, torch.float32)  # fp32 at least; a float64 model stays float64
        x = (streams.to(acc) * self.readout.to(acc)[:, None]).sum(dim=-2)
        if self.unet is not None and self.unet.is_encoder(stop - 1, depth):
            saved.append(x)  # the last mHC layer was an encoder layer: its state is the readout
        return x

    def _mhc_ops(self, unit: int) -> SimpleNamespace:
        """The mHC calls for unit `unit`: the model's own, or in the Fisher pass the reference reporting phi's output."""
        if self.quant_grad_observer is None:
            return self.ops
        hook = functools.partial(self.quant_grad_observer, f"mhc.{unit}.phi")
        return SimpleNamespace(pre=functools.partial(mhc_reference.mhc_pre, raw_hook=hook), post=mhc_reference.mhc_post,
                               post_pre=functools.partial(mhc_reference.mhc_post_pre, raw_hook=hook))

    def _observe_mhc_input(self, unit: int, streams: torch.Tensor) -> None:
        if self.quant_observer is not None:
            self.quant_observer(f"mhc.{unit}.phi", mhc_projection_input(streams.detach()))

    def _block_delta(self, block: int, u: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """What block `block` adds to its input u as a plain pre-norm residual block: A(u) + M(u + A(u))."""
        a = self.sublayers[2 * block](u, *self._extra(2 * block, ctx))
        return a + self.sublayers[2 * block + 1](u + a.to(u.dtype))

    def logits(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.final_norm(self.hidden(idx))
        if self.quant_observer is not None:  # the tied table is also the output layer: GPTQ it on the head's input
            self.quant_observer(HEAD, h)
        logits = F.linear(h, self.embed.weight.to(h.dtype))
        if self.quant_grad_observer is not None:
            logits = self.quant_grad_observer(HEAD, logits)
        logits = logits.float()
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
