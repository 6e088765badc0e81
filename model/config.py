"""Model hyper-parameters (a typed dataclass; configs/*.toml fill it under [model]).

The record-architecture options (the parameter-golf records' stack, https://github.com/openai/parameter-golf:
XSA, partial RoPE, per-layer norm scale, U-Net skips, SmearGate, BigramHash, value embeddings,
attention output gate) all default to OFF, which is the plain model bit for bit.
"""
from __future__ import annotations

import math

from dataclasses import dataclass

# BigramHash keys are prev * (vocab_size + 1) + cur, hashed in int64 without overflow while keys stay
# below 2**31 (see model/features.py::bigram_bucket).
MAX_BIGRAM_VOCAB = 46339
ATTENTION_BACKENDS = ("auto", "sdpa", "fa3")
MHC_GRANULARITIES = ("sublayer", "block")
MHC_INITS = ("plain", "lanes")
# What the Triton mHC kernels are built and tested for (kernels/_triton_util.py::check_streams reads these too):
# stream counts, and the stream width's multiple (tl.dot tiles are 16 wide).
KERNEL_STREAMS = (2, 4, 8)
KERNEL_WIDTH_MULTIPLE = 16


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
    mhc_granularity: str = "sublayer"  # sublayer: around attention and MLP; block: around each block (half the traffic)
    mhc_blocks: int = 0                # mHC on k blocks from mhc_start only, plain residual around them; 0 = all blocks
    mhc_start: int = 0                 # the first mHC block (plain blocks before it feed the streams copies of x)
    mhc_init: str = "plain"            # plain: mHC starts as the plain residual; lanes: n=2 starts as the lanes
    mhc_res_diag: float = 0.0          # initial diagonal of H_res, in (1/n_streams, 1); 0 = diag logit 2
    mhc_stream_fp32: bool = False      # mHC streams in fp32 under autocast (else the autocast dtype, bf16)
    rope_base: float = 10000.0
    rope_dims: int = 0                 # partial RoPE: rotate the first rope_dims dims of each head; 0 = all
    logit_softcap: float = 30.0        # tanh softcap on logits; 0 disables
    qk_gain_init: float = 1.5          # learned per-head gain after QK-RMSNorm
    embed_init_std: float = 0.005      # tied embedding init
    xsa_layers: int = 0                # XSA (remove own-value component from head outputs) on the last k layers
    layer_norm_scale: bool = False     # scale block l's sublayer norms by 1/sqrt(l+1)
    unet_skips: bool = False           # encoder/decoder skips with learned per-channel weights
    smear_gate: bool = False           # x_t <- x_t + sigmoid(g) * (x_{t-1} - x_t), never across a BOS
    bigram_buckets: int = 0            # BigramHash table rows; 0 disables
    bigram_dim: int = 112              # BigramHash table width (projected to d_model)
    value_embed_layers: int = 0        # value embeddings added to V on the last k layers; 0 disables
    value_embed_dim: int = 128         # shared value-embedding table width (projected to the KV width)
    attn_gate: bool = False            # per-head attention output gate sigmoid(W u[:width]), W zero-init (0.5 at init)
    attn_gate_width: int = 0           # the gate reads the first k channels of the normed input u; 0 = all d_model
    recur_start: int = 0               # depth recurrence: first block of the repeated range
    recur_end: int = 0                 # depth recurrence: last block of the repeated range (inclusive)
    recur_times: int = 1               # passes over the range once recurrence is on; 1 = off
    recur_at: float = 0.35             # training progress (of the budget, or of max_steps) that switches it on
    lane_start: int = 0                # parallel residual lanes on blocks lane_start..n_layers-1; 0 = off
    attention: str = "auto"            # auto (FlashAttention 3 when installed, on CUDA) | sdpa | fa3
    doc_attention: bool = False        # attend within documents only (BOS starts one): FlexAttention, no fa3
    mhc_kernels: bool = False          # Triton mHC kernels instead of the PyTorch reference
    mlp_kernel: bool = False           # Triton fused LeakyReLU^2 MLP instead of the PyTorch reference

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def rotary_dims(self) -> int:
        """Head dims that RoPE rotates (rope_dims, or the whole head when 0)."""
        return self.rope_dims or self.head_dim

    @property
    def mlp_hidden(self) -> int:
        return int(round(self.mlp_mult * self.d_model))

    @property
    def n_mhc_blocks(self) -> int:
        """Blocks with mHC (all of them for mhc_blocks = 0); none in the plain network."""
        return (self.mhc_blocks or self.n_layers) if self.n_streams > 1 else 0

    @property
    def mhc_end(self) -> int:
        """One past the last mHC block: mHC covers blocks mhc_start..mhc_end-1."""
        return self.mhc_start + self.n_mhc_blocks

    def block_order(self, recurrence: bool) -> tuple[int, ...]:
        """The physical block of each virtual layer, in the order the forward runs them: every block once, or with
        recurrence on blocks recur_start..recur_end recur_times times in a row (3-5 three times of 11 blocks:
        0,1,2,3,4,5,3,4,5,3,4,5,6,...,10, 17 virtual layers)."""
        blocks = tuple(range(self.n_layers))
        if not recurrence or self.recur_times == 1:
            return blocks
        loop = blocks[self.recur_start:self.recur_end + 1]
        return blocks[:self.recur_start] + loop * self.recur_times + blocks[self.recur_end + 1:]

    def kernel_problem(self) -> str | None:
        """Why the Triton mHC kernels cannot take this model, or None. Checked by train.py on a GPU, where they run:
        elsewhere (CPU without the interpreter) mhc_kernels falls back to the reference, which takes any shape."""
        if not self.mhc_kernels or self.n_streams == 1:
            return None
        if self.n_streams not in KERNEL_STREAMS:
            return (f"model.n_streams={self.n_streams} with model.mhc_kernels=true: the Triton kernels take "
                    f"{', '.join(map(str, KERNEL_STREAMS))} streams (hint: pick one of those, or set "
                    "model.mhc_kernels=false to run the PyTorch reference)")
        if self.d_model % KERNEL_WIDTH_MULTIPLE:
            return (f"model.d_model={self.d_model} with model.mhc_kernels=true: the Triton kernels need a multiple "
                    f"of {KERNEL_WIDTH_MULTIPLE} (hint: round d_model, or set model.mhc_kernels=false)")
        return None

    def validate(self) -> None:
        """Raise ValueError naming the field for options the model cannot build."""
        for name, low in (("vocab_size", 2), ("n_layers", 1), ("d_model", 1), ("n_heads", 1), ("n_kv_heads", 1),
                          ("sinkhorn_iters", 1), ("logit_softcap", 0)):
            if not getattr(self, name) >= low:  # NaN included
                raise ValueError(f"model.{name}={getattr(self, name)} must be >= {low} (hint: the default is "
                                 f"{getattr(ModelConfig, name)})")
        # embed_init_std=0 gave a model with every gradient exactly 0 (the tied head reads the zero table through
        # output projections that also start at zero), so it never trained
        for name in ("mlp_mult", "rope_base", "embed_init_std"):
            if not getattr(self, name) > 0:
                raise ValueError(f"model.{name}={getattr(self, name)} must be > 0 (hint: the default is "
                                 f"{getattr(ModelConfig, name)})")
        for name in ("mhc_alpha_init", "qk_gain_init"):  # any finite value builds; NaN and inf did too
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"model.{name}={getattr(self, name)} must be a finite number (hint: the default is "
                                 f"{getattr(ModelConfig, name)})")
        if self.mlp_hidden < 1:
            raise ValueError(f"model.mlp_mult={self.mlp_mult} gives an MLP of {self.mlp_hidden} channels at "
                             f"d_model={self.d_model} (hint: mlp_mult * d_model must round to >= 1)")
        if self.n_streams < 1:
            raise ValueError(f"model.n_streams={self.n_streams} must be >= 1 (1 = plain residual network)")
        if self.d_model % self.n_heads:
            raise ValueError(f"model.d_model={self.d_model} must be divisible by model.n_heads={self.n_heads} (hint: "
                             "a head is d_model / n_heads channels wide)")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"model.n_heads={self.n_heads} must be a multiple of model.n_kv_heads={self.n_kv_heads} "
                             "(hint: each key/value head serves n_heads / n_kv_heads query heads)")
        hd = self.head_dim
        if not self.rope_dims and hd % 2:
            raise ValueError(f"model.d_model={self.d_model} / n_heads={self.n_heads} gives heads of {hd} channels, and "
                             "RoPE on the whole head (rope_dims=0) rotates pairs (hint: an even head width, or an "
                             "even model.rope_dims below it)")
        if self.rope_dims < 0 or self.rope_dims > hd or self.rope_dims % 2:
            raise ValueError(f"model.rope_dims={self.rope_dims} must be even and in [0, head_dim={hd}] "
                             "(RoPE rotates pairs of dims; 0 rotates the whole head, the record uses 16)")
        for name in ("xsa_layers", "value_embed_layers"):
            k = getattr(self, name)
            if not 0 <= k <= self.n_layers:
                raise ValueError(f"model.{name}={k} must be in [0, n_layers={self.n_layers}] "
                                 "(it counts the last layers that use the feature; 0 disables it)")
        if self.bigram_buckets < 0 or self.bigram_dim < 1 or self.value_embed_dim < 1:
            raise ValueError(f"model.bigram_buckets={self.bigram_buckets} must be >= 0, model.bigram_dim="
                             f"{self.bigram_dim} and model.value_embed_dim={self.value_embed_dim} >= 1")
        if self.bigram_buckets and self.vocab_size > MAX_BIGRAM_VOCAB:
            raise ValueError(f"model.bigram_buckets>0 supports vocab_size <= {MAX_BIGRAM_VOCAB}, got "
                             f"{self.vocab_size} (hint: the bigram key must fit the int64 hash)")
        if self.attention not in ATTENTION_BACKENDS:
            raise ValueError(f"model.attention={self.attention!r}: expected 'auto' (FlashAttention 3 when "
                             "importable on CUDA, else SDPA), 'sdpa' or 'fa3'")
        if self.doc_attention and self.attention != "auto":
            raise ValueError(f"model.doc_attention=true attends through a document mask (FlexAttention compiled, "
                             f"SDPA uncompiled), so model.attention={self.attention!r} would not be used (hint: leave "
                             "model.attention at 'auto')")
        if self.doc_attention and self.head_dim < 16:
            raise ValueError(f"model.doc_attention=true needs head_dim >= 16 (d_model / n_heads), got {self.head_dim}: "
                             "FlexAttention's GPU kernel takes no narrower heads (hint: fewer heads or a wider "
                             "d_model)")
        if self.mhc_granularity not in MHC_GRANULARITIES:
            raise ValueError(f"model.mhc_granularity={self.mhc_granularity!r}: expected 'sublayer' (mHC around "
                             "every attention and MLP) or 'block' (around each block, half the stream traffic)")
        if not 0 <= self.mhc_blocks <= self.n_layers:
            raise ValueError(f"model.mhc_blocks={self.mhc_blocks} must be in [0, n_layers={self.n_layers}] "
                             "(hint: it counts the leading blocks with mHC; 0 = all of them)")
        if self.mhc_blocks and self.n_streams == 1:
            raise ValueError(f"model.mhc_blocks={self.mhc_blocks} needs n_streams >= 2, got n_streams="
                             f"{self.n_streams} (hint: a single stream has no mHC; set "
                             "model.mhc_blocks=0 as well)")
        self._validate_mhc_range()
        if not 0 <= self.attn_gate_width <= self.d_model:
            raise ValueError(f"model.attn_gate_width={self.attn_gate_width} must be in [0, d_model={self.d_model}] "
                             "(the gate reads the first k channels of the attention input; 0 = all of them)")
        if self.attn_gate_width and not self.attn_gate:
            raise ValueError(f"model.attn_gate_width={self.attn_gate_width} applies to model.attn_gate=true only "
                             "(hint: set model.attn_gate=true, or drop the width)")
        if self.unet_skips and self.n_layers < 2:
            raise ValueError(f"model.unet_skips needs n_layers >= 2 (got {self.n_layers}): "
                             "one encoder and one decoder block")
        self._validate_recurrence_and_lanes()

    def _validate_mhc_range(self) -> None:
        """mhc_start and mhc_init: a range of existing blocks, and an init that the layout can start from."""
        start, n = self.mhc_start, self.n_layers
        if not 0 <= start < n:
            raise ValueError(f"model.mhc_start={start} must be in [0, n_layers={n}) (the first block with mHC)")
        if start and (self.n_streams == 1 or not self.mhc_blocks):
            raise ValueError(f"model.mhc_start={start} needs n_streams >= 2 and model.mhc_blocks >= 1, got n_streams="
                             f"{self.n_streams}, mhc_blocks={self.mhc_blocks} (hint: mhc_blocks=0 means every block, "
                             "from block 0; set the number of mHC blocks)")
        if start + self.mhc_blocks > n:
            raise ValueError(f"model.mhc_start={start} + model.mhc_blocks={self.mhc_blocks} must be <= n_layers={n} "
                             f"(mHC covers blocks mhc_start..mhc_start+mhc_blocks-1)")
        if self.mhc_init not in MHC_INITS:
            raise ValueError(f"model.mhc_init={self.mhc_init!r}: expected 'plain' (mHC starts as the plain residual) "
                             "or 'lanes' (n_streams=2 starts as the parallel residual lanes)")
        if self.mhc_init == "lanes" and (self.n_streams != 2 or self.mhc_granularity != "sublayer"):
            raise ValueError(f"model.mhc_init='lanes' needs n_streams=2 and mhc_granularity='sublayer' (stream a "
                             "feeds attention, stream m the MLP), got n_streams="
                             f"{self.n_streams}, mhc_granularity={self.mhc_granularity!r}")
        self._validate_mhc_init_and_dtype()
        if self.mhc_init == "lanes" and self.recur_times > 1 and self.recur_start < self.mhc_end \
                and self.recur_end >= start:
            raise ValueError(f"model.mhc_init='lanes' with model.recur_start={self.recur_start}..recur_end="
                             f"{self.recur_end} inside the mHC blocks {start}..{self.mhc_end - 1}: the init writes each "
                             "mHC block as one lane block of a single pass (hint: loop blocks outside the mHC range)")

    def _validate_mhc_init_and_dtype(self) -> None:
        """mhc_res_diag and mhc_stream_fp32: options of an mHC model (n_streams >= 2), the diagonal one that H_res has."""
        d, n = self.mhc_res_diag, self.n_streams
        if self.mhc_stream_fp32 and n == 1:
            raise ValueError("model.mhc_stream_fp32=true needs n_streams >= 2, got n_streams=1 (a single stream has "
                             "no mHC streams) (hint: model.mhc_stream_fp32=false)")
        if d == 0:
            return
        if n == 1 or self.mhc_init == "lanes":
            raise ValueError(f"model.mhc_res_diag={d} sets the plain init's H_res, and needs n_streams >= 2 with "
                             f"model.mhc_init='plain', got n_streams={n}, mhc_init={self.mhc_init!r} (the lanes init "
                             "sets its own H_res) (hint: model.mhc_res_diag=0)")
        if not 1.0 / n < d < 1.0:  # NaN included
            raise ValueError(f"model.mhc_res_diag={d} must be in (1/n_streams, 1) = ({1.0 / n:.4g}, 1) (a doubly "
                             "stochastic H_res with equal off-diagonals; 1/n is the uniform mix, 1 the identity), "
                             "or 0 for the default init")

    def _validate_recurrence_and_lanes(self) -> None:
        n, s, k = self.n_layers, self.mhc_start, self.mhc_end
        if self.recur_times < 1:
            raise ValueError(f"model.recur_times={self.recur_times} must be >= 1 (1 = no depth recurrence; the records "
                             "ran blocks 3-5 three times)")
        if not 0 <= self.recur_start <= self.recur_end < n:
            raise ValueError(f"model.recur_start={self.recur_start}, model.recur_end={self.recur_end}: expected "
                             f"0 <= recur_start <= recur_end < n_layers={n} (recur_end is the last repeated block, "
                             "inclusive)")
        if not 0.0 <= self.recur_at <= 1.0:  # NaN included
            raise ValueError(f"model.recur_at={self.recur_at} must be in [0, 1] (the fraction of training after which "
                             "recurrence is on; 0 = from the start)")
        recurs = self.recur_times > 1
        if recurs and self.recur_start < k <= self.recur_end:
            raise ValueError(f"model.recur_start={self.recur_start}..recur_end={self.recur_end} spans the last mHC "
                             f"block ({k - 1}, model.mhc_blocks={self.mhc_blocks}) and the plain blocks after it: the "
                             "streams are read out after the last mHC block, so a loop cannot go back into mHC (hint: "
                             f"a range inside blocks {s}..{k - 1} or {k}..{n - 1})")
        if recurs and self.recur_start < s <= self.recur_end:
            raise ValueError(f"model.recur_start={self.recur_start}..recur_end={self.recur_end} spans the first mHC "
                             f"block ({s}, model.mhc_start={s}) and the plain blocks before it: the stream enters the "
                             "mHC streams once, so a loop cannot go back out of mHC (hint: a range inside blocks "
                             f"0..{s - 1} or {s}..{k - 1})")
        if not 0 <= self.lane_start < n:
            raise ValueError(f"model.lane_start={self.lane_start} must be in [0, n_layers={n}) (the first block of "
                             "the two residual lanes; 0 = no lanes)")
        if self.lane_start and self.lane_start < k:
            raise ValueError(f"model.lane_start={self.lane_start} with n_streams={self.n_streams}: the lanes run on "
                             f"plain blocks only, and blocks {s}..{k - 1} have mHC (model.mhc_blocks={self.mhc_blocks}) "
                             f"(hint: lane_start >= {k}, or a smaller model.mhc_blocks)")
        if self.lane_start and recurs and self.recur_end >= self.lane_start:
            raise ValueError(f"model.recur_end={self.recur_end} with model.lane_start={self.lane_start}: the repeated "
                             "blocks must come before the lanes (the records looped blocks 3-5 and ran lanes from "
                             f"block 7) (hint: recur_end < {self.lane_start})")
