"""Triton GEMMs with the LeakyReLU(0.5)^2 epilogues used by `kernels/mlp.py`.

One matrix product `acc = A[M, K] · B[K, N]` (fp32 accumulator), two epilogues:
  ACTIVATION (forward, A = x, B = W_upᵀ):   act_grad = pre > 0 ? 2·pre : 0.5·pre,
                                            post = 0.5·act_grad·pre  (= leaky_relu(pre, 0.5)²);
                                            stores post -> out, act_grad -> aux; pre never leaves registers.
  GRAD (backward, A = dy, B = W_down):      dpre = acc ⊙ act_grad; reads act_grad from aux, stores dpre -> out.

Two kernels: `mlp_gemm_kernel` (pointer loads and stores, one program per output tile; runs on any GPU)
and `mlp_gemm_tma_kernel` (tensor descriptors, i.e. TMA bulk copies on Hopper, for loads and for the
epilogue's stores; one program per SM looping over tiles). Measured on an H100 (scripts/bench_mlp.py,
98,304 x 512 -> 1792, compiled forward+backward): 1.94 ms with the descriptor kernel, 2.19 ms tiled,
2.16 ms with a pointer-based persistent variant, which was therefore dropped.

`@triton.jit` decides at decoration time whether it builds a compiled or an interpreted kernel
(TRITON_INTERPRET=1), so this module holds only kernels: tests reload it with the variable set, and the
ops in `kernels/mlp.py` look the kernels up here at call time. For that reload to work after triton was
imported without the variable, the kernels call only `tl` builtins (which the interpreter patches), not
`@jit` helpers of triton's standard library such as `tl.cdiv` or `tl.zeros` (those stay compiled-only).
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

# Epilogue selectors: plain ints for the launching code, constexpr twins for use inside the kernels.
EPILOGUE_ACTIVATION = 0
EPILOGUE_GRAD = 1
_ACTIVATION = tl.constexpr(EPILOGUE_ACTIVATION)


def _gpu_configs() -> list[triton.Config]:
    """A handful of Hopper-friendly tiles; configs that do not fit a smaller GPU are skipped by the
    autotuner (OutOfResources), so the same list gives a correct path elsewhere."""
    def cfg(bm: int, bn: int, bk: int, stages: int, warps: int) -> triton.Config:
        return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8},
                             num_stages=stages, num_warps=warps)
    return [  # the four fastest of seven measured on an H100 (scripts/bench_mlp.py autotuner table)
        cfg(128, 256, 64, 3, 8),
        cfg(128, 128, 64, 3, 8),
        cfg(256, 128, 64, 3, 8),
        cfg(64, 256, 64, 4, 4),
    ]


def _interpreter_configs() -> list[triton.Config]:
    # Small tiles so that tiny test shapes still span several tiles, partial tiles and K steps.
    return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16, "GROUP_M": 2})]


def _configs() -> list[triton.Config]:
    return _interpreter_configs() if triton.knobs.runtime.interpret else _gpu_configs()


def _tma_configs() -> list[triton.Config]:
    """Tiles for the tensor-descriptor kernel; EPILOGUE_SPLIT column chunks bound the shared memory
    that staging the two output tiles for the TMA stores needs."""
    if triton.knobs.runtime.interpret:
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16, "GROUP_M": 2, "EPILOGUE_SPLIT": 2})]

    def cfg(bm: int, bn: int, bk: int, stages: int, warps: int, split: int) -> triton.Config:
        return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "EPILOGUE_SPLIT": split},
                             num_stages=stages, num_warps=warps)
    return [
        cfg(128, 256, 64, 3, 8, 2),
        cfg(128, 128, 64, 4, 8, 1),
        cfg(256, 128, 64, 3, 8, 2),
        cfg(128, 256, 64, 3, 8, 4),
    ]


# Tuned per problem shape, epilogue and (implicitly) dtype; results persist in Triton's cache dir. The row count
# enters as its power-of-two bucket, M_BUCKET (an argument the kernels only pass to the autotuner): a pass that meets
# many row counts, as document-LoRA test-time training does with each chunk's rows and window, would otherwise time
# every config again at each new one. (Under torch.compile inductor's autotuner launches them and ignores the key.)
_AUTOTUNE_KEY = ["M_BUCKET", "N", "K", "EPILOGUE"]


def row_bucket(rows: int) -> int:
    """The autotuner's key for a GEMM of `rows` rows: the power of two at or above it."""
    return 1 << max(rows - 1, 0).bit_length()


@triton.jit
def _tile_coords(tile_id, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Grouped ordering: GROUP_M row-blocks share each column sweep, so A rows stay in L2."""
    num_pid_m = (M + BLOCK_M - 1) // BLOCK_M
    num_pid_n = (N + BLOCK_N - 1) // BLOCK_N
    tiles_per_group = GROUP_M * num_pid_n
    first_pid_m = (tile_id // tiles_per_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (tile_id % tiles_per_group) % group_rows
    pid_n = (tile_id % tiles_per_group) // group_rows
    return pid_m, pid_n


@triton.jit
def _tile_product(a_ptr, b_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, pid_m, pid_n,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  IEEE_FP32: tl.constexpr):
    # Rows/columns past the edge wrap around (valid addresses, results discarded by the store mask),
    # so only the K tail needs a load mask.
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :].to(tl.int64) * stride_bn
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k in range(0, (K + BLOCK_K - 1) // BLOCK_K):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        if IEEE_FP32:
            acc = tl.dot(a, b, acc, input_precision="ieee")  # fp32 inputs: no silent TF32 rounding
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc


@triton.jit
def _epilogue(acc, out_ptr, aux_ptr, M, N, stride_cm, pid_m, pid_n,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EPILOGUE: tl.constexpr):
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs = rows[:, None].to(tl.int64) * stride_cm + cols[None, :]
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    if EPILOGUE == _ACTIVATION:
        act_grad = tl.where(acc > 0, 2.0 * acc, 0.5 * acc)
        post = 0.5 * act_grad * acc
        tl.store(out_ptr + offs, post.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(aux_ptr + offs, act_grad.to(aux_ptr.dtype.element_ty), mask=mask)
    else:
        act_grad = tl.load(aux_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs, (acc * act_grad).to(out_ptr.dtype.element_ty), mask=mask)


@triton.autotune(configs=_configs(), key=_AUTOTUNE_KEY, cache_results=True)
@triton.jit
def mlp_gemm_kernel(a_ptr, b_ptr, out_ptr, aux_ptr, M, N, K,
                    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, M_BUCKET,
                    EPILOGUE: tl.constexpr, IEEE_FP32: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP_M: tl.constexpr):
    pid_m, pid_n = _tile_coords(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc = _tile_product(a_ptr, b_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                        pid_m, pid_n, BLOCK_M, BLOCK_N, BLOCK_K, IEEE_FP32)
    _epilogue(acc, out_ptr, aux_ptr, M, N, stride_cm, pid_m, pid_n, BLOCK_M, BLOCK_N, EPILOGUE)


@triton.jit
def _tma_epilogue(acc, out_desc, aux_desc, off_m, off_n, EPILOGUE: tl.constexpr, OUT_DTYPE: tl.constexpr):
    if EPILOGUE == _ACTIVATION:
        act_grad = tl.where(acc > 0, 2.0 * acc, 0.5 * acc)
        out_desc.store([off_m, off_n], (0.5 * act_grad * acc).to(OUT_DTYPE))
        aux_desc.store([off_m, off_n], act_grad.to(OUT_DTYPE))
    else:
        act_grad = aux_desc.load([off_m, off_n]).to(tl.float32)
        out_desc.store([off_m, off_n], (acc * act_grad).to(OUT_DTYPE))


@triton.autotune(configs=_tma_configs(), key=_AUTOTUNE_KEY, cache_results=True)
@triton.jit
def mlp_gemm_tma_kernel(a_ptr, b_ptr, out_ptr, aux_ptr, M, N, K, stride_am, stride_b, stride_cm, NUM_PROGRAMS, M_BUCKET,
                        EPILOGUE: tl.constexpr, B_K_MAJOR: tl.constexpr, IEEE_FP32: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        GROUP_M: tl.constexpr, EPILOGUE_SPLIT: tl.constexpr):
    """Persistent schedule with tensor descriptors (TMA on Hopper): tile loads and the epilogue's
    stores are bulk copies, bounds handled by the descriptors (zero fill on load, clipped stores).
    B_K_MAJOR: b_ptr holds B transposed, [N, K] row-major (W_up); else B itself, [K, N] row-major."""
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[stride_am, 1], block_shape=[BLOCK_M, BLOCK_K])
    if B_K_MAJOR:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[stride_b, 1],
                                           block_shape=[BLOCK_N, BLOCK_K])
    else:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[K, N], strides=[stride_b, 1],
                                           block_shape=[BLOCK_K, BLOCK_N])
    SUB_N: tl.constexpr = BLOCK_N // EPILOGUE_SPLIT
    out_desc = tl.make_tensor_descriptor(out_ptr, shape=[M, N], strides=[stride_cm, 1], block_shape=[BLOCK_M, SUB_N])
    aux_desc = tl.make_tensor_descriptor(aux_ptr, shape=[M, N], strides=[stride_cm, 1], block_shape=[BLOCK_M, SUB_N])
    out_dtype: tl.constexpr = out_ptr.dtype.element_ty
    num_tiles = ((M + BLOCK_M - 1) // BLOCK_M) * ((N + BLOCK_N - 1) // BLOCK_N)
    # A second tile counter for the epilogue keeps the flattened loop's prologue and epilogue independent
    # (the pattern of Triton's persistent-matmul tutorial).
    epilogue_tile = tl.program_id(0) - NUM_PROGRAMS
    for tile_id in tl.range(tl.program_id(0), num_tiles, NUM_PROGRAMS, flatten=True):
        pid_m, pid_n = _tile_coords(tile_id, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
        for k in range(0, (K + BLOCK_K - 1) // BLOCK_K):
            a = a_desc.load([pid_m * BLOCK_M, k * BLOCK_K])
            if B_K_MAJOR:
                b = b_desc.load([pid_n * BLOCK_N, k * BLOCK_K]).T
            else:
                b = b_desc.load([k * BLOCK_K, pid_n * BLOCK_N])
            if IEEE_FP32:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        epilogue_tile += NUM_PROGRAMS
        pid_m, pid_n = _tile_coords(epilogue_tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        if EPILOGUE_SPLIT == 1:
            _tma_epilogue(acc, out_desc, aux_desc, off_m, off_n, EPILOGUE, out_dtype)
        elif EPILOGUE_SPLIT == 2:
            acc0, acc1 = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, SUB_N)), (0, 2, 1)))
            _tma_epilogue(acc0, out_desc, aux_desc, off_m, off_n, EPILOGUE, out_dtype)
            _tma_epilogue(acc1, out_desc, aux_desc, off_m, off_n + SUB_N, EPILOGUE, out_dtype)
        else:
            tl.static_assert(EPILOGUE_SPLIT == 4, "EPILOGUE_SPLIT must be 1, 2 or 4")
            halves = tl.permute(tl.reshape(acc, (BLOCK_M, 2, 2, SUB_N)), (0, 3, 2, 1))
            left, right = tl.split(halves)  # columns [0, BLOCK_N/2) and [BLOCK_N/2, BLOCK_N)
            acc0, acc1 = tl.split(left)
            acc2, acc3 = tl.split(right)
            _tma_epilogue(acc0, out_desc, aux_desc, off_m, off_n, EPILOGUE, out_dtype)
            _tma_epilogue(acc1, out_desc, aux_desc, off_m, off_n + SUB_N, EPILOGUE, out_dtype)
            _tma_epilogue(acc2, out_desc, aux_desc, off_m, off_n + 2 * SUB_N, EPILOGUE, out_dtype)
            _tma_epilogue(acc3, out_desc, aux_desc, off_m, off_n + 3 * SUB_N, EPILOGUE, out_dtype)


def kernels_interpreted() -> bool:
    """True when this module was imported with TRITON_INTERPRET=1 (kernels run on CPU tensors)."""
    return not isinstance(mlp_gemm_kernel.fn, JITFunction)
