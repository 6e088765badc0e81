"""The mHC kernels' launch configurations under the Triton interpreter: the GPU's block shapes, GP_SCRATCH, APPLY_PASS
and the ZIGZAG tile order compute what the plain blocks do. The kernels against the reference:
tests/test_mhc_kernels.py (imported first: it selects the interpreter on a machine without CUDA)."""
import pytest
import torch

from test_mhc_kernels import K, interpreted, make_inputs, rel, stream_bwd_args

if K.HAVE_TRITON:  # a kernel that writes the order in which a ZIGZAG pass visits its tiles
    import triton
    import triton.language as tl

    from kernels.mhc_fwd import _tile_start

    @triton.jit
    def tile_order_kernel(out_ptr, tiles, REVERSE: tl.constexpr):
        for k in range(0, tiles):
            tl.store(out_ptr + k, _tile_start(k, tiles, REVERSE))


@interpreted
@pytest.mark.parametrize("n", [4, 2])
def test_gpu_block_sizes_compute_what_the_cpu_ones_do(n):
    """The GPU defaults (block shapes the interpreter tests do not otherwise use: stream_bwd's 32 tokens x
    16 channels at n=4 and 16 x 64 through the GP_SCRATCH path at n=2, coef_premix's 128-channel tiles with
    the apply and 64-channel ones without it, coef_bwd's 128-token programs) give the CPU defaults' results,
    tokens and channels partial (C=48 is less than one tile)."""
    from kernels.mhc_bwd import (coef_bwd_config, dphi_config, launch_coef_bwd, launch_dphi, launch_stream_bwd,
                                 stream_bwd_config)
    from kernels.mhc_fwd import fwd_config, launch_coef_premix
    inp = make_inputs(n, 48, (45,))
    x, y, h_res, h_post, phi, alpha, bias = (inp[k] for k in ("x", "y", "h_res", "h_post", "phi", "alpha", "bias"))
    g = torch.Generator().manual_seed(3)
    dxo, du = torch.randn(x.shape, generator=g), torch.randn(y.shape, generator=g)
    dhp, dhr = torch.randn(h_post.shape, generator=g), torch.randn(h_res.shape, generator=g)
    direct = lambda kernel: kernel  # noqa: E731

    def unit(device):
        fwd = launch_coef_premix(direct, x, y, h_res, h_post, phi, alpha, bias, 20, fwd_config(device, n))
        x_new, _, _, _, raw, rinv = fwd
        aux, dalpha, dbias = launch_coef_bwd(direct, x_new, du, dhp, dhr, raw, rinv, alpha, bias, 20,
                                             coef_bwd_config(device))
        streams = launch_stream_bwd(direct, x, y, h_res, h_post, dxo, du, aux, phi, stream_bwd_config(device, n))
        pre = launch_coef_premix(direct, x, None, None, None, phi, alpha, bias, 20, fwd_config(device, n, apply=False))
        return [*fwd, aux, dalpha, dbias, *streams, launch_dphi(direct, x_new, aux, dphi_config(device)), *pre[1:]]

    gpu, cpu = unit(torch.device("cuda")), unit(torch.device("cpu"))
    for i, (a, b) in enumerate(zip(gpu, cpu)):
        assert a.shape == b.shape and rel(a, b) < 1e-5, f"result {i}: rel err {rel(a, b):.2e}"


@interpreted
@pytest.mark.parametrize("n", [4, 2])
def test_coef_premix_narrow_blocks_compute_what_the_plain_block_does(n):
    """Blocks with more tokens per program than the interpreter's default and a channel tile half as wide
    (the one-row-per-thread blocks, timed and dropped on an H100) give the 16 x 32
    block's results up to the projection's summation order, with a partial token block (45 tokens) and three
    16-channel tiles, walked both ways by the zigzag passes, where the plain block has one and a half."""
    from kernels.mhc_fwd import launch_coef_premix
    inp = make_inputs(n, 48, (45,))
    x, y, h_res, h_post, phi, alpha, bias = (inp[k] for k in ("x", "y", "h_res", "h_post", "phi", "alpha", "bias"))
    direct = lambda kernel: kernel  # noqa: E731
    rows = [dict(BT=32, BC=16, num_warps=2), dict(BT=64, BC=16, num_warps=4)]
    for name, ys in (("coef_premix", (y, h_res, h_post)), ("coef_premix_pre", (None, None, None))):
        plain = launch_coef_premix(direct, x, *ys, phi, alpha, bias, 20, dict(BT=16, BC=32, num_warps=4))
        for cfg in rows:
            for i, (a, b) in enumerate(zip(launch_coef_premix(direct, x, *ys, phi, alpha, bias, 20, dict(cfg)), plain)):
                assert (a is None) == (b is None) and (a is None or rel(a, b) < 1e-6), f"{name} {cfg}, output {i}"


@interpreted
def test_coef_premix_default_block_follows_the_apply(monkeypatch):
    """Without a config, launch_coef_premix asks fwd_config for the block of its own launch: with the apply
    (mhc_post_pre) or without it (mhc_pre), whose fastest GPU blocks differ."""
    from kernels import mhc_fwd
    for n in (4, 2):
        assert mhc_fwd.fwd_config(torch.device("cuda"), n) != mhc_fwd.fwd_config(torch.device("cuda"), n, apply=False)
    asked, real = [], mhc_fwd.fwd_config
    monkeypatch.setattr(mhc_fwd, "fwd_config", lambda device, n, apply=True: asked.append(apply) or real(device, n, apply))
    inp = make_inputs(4, 48, (5,))
    x, y, h_res, h_post, phi, alpha, bias = (inp[k] for k in ("x", "y", "h_res", "h_post", "phi", "alpha", "bias"))
    direct = lambda kernel: kernel  # noqa: E731
    mhc_fwd.launch_coef_premix(direct, x, y, h_res, h_post, phi, alpha, bias, 20)
    mhc_fwd.launch_coef_premix(direct, x, None, None, None, phi, alpha, bias, 20)
    assert asked == [True, False]


@interpreted
def test_zigzag_tile_order_runs_backwards_when_asked():
    """coef_premix's ZIGZAG passes take their tiles from _tile_start; its outputs cannot show the order (the
    turned passes are elementwise), so the order itself is checked: every tile once, backwards when asked."""
    for tiles in (1, 2, 5):
        for reverse, expect in ((False, list(range(tiles))), (True, list(range(tiles))[::-1])):
            out = torch.full((tiles,), -1, dtype=torch.int32)
            tile_order_kernel[(1,)](out, tiles, REVERSE=reverse)
            assert out.tolist() == expect, (tiles, reverse)


@interpreted
@pytest.mark.parametrize("n", [4, 2])
def test_stream_bwd_gp_scratch_gives_the_same_gradients(n):
    """GP_SCRATCH routes G phi^T through the program's own dx tile (stored, reloaded, then overwritten by
    dx): in fp32 that is exact, so every path gives the plain kernel's results bit for bit, with a partial
    last channel tile (C=48 in 32-channel tiles) and a partial token block (37 tokens in 16-token programs)."""
    from kernels.mhc_bwd import launch_stream_bwd
    x, y, h_res, h_post, dxo, du, aux, phi = stream_bwd_args(n, 48, (37,))
    direct = lambda kernel: kernel  # noqa: E731
    paths = {"apply+coefficients": (x, y, h_res, h_post, dxo, du, aux, phi),
             "coefficients": (x, None, None, None, None, du, aux, phi)}
    for name, args in paths.items():
        plain = launch_stream_bwd(direct, *args, dict(BT=16, BC=32, num_warps=4))
        scratch = launch_stream_bwd(direct, *args, dict(BT=16, BC=32, num_warps=4, GP_SCRATCH=True))
        for a, b in zip(scratch, plain):
            assert (a is None) == (b is None), name
            if a is not None:
                assert torch.equal(a, b), f"{name}: GP_SCRATCH changed a result"


@interpreted
@pytest.mark.parametrize("n", [4, 2])
def test_coef_premix_apply_pass_and_zigzag_give_the_same_results(n):
    """APPLY_PASS writes x' for all channels before the projection pass reads it back; the plain kernel
    writes and rereads it tile by tile. Both project the stored x', so in fp32 every output is the same bit
    for bit, with a partial channel tile (C=48 in 32-channel tiles) and a partial token block (37 in 16).
    ZIGZAG (the default) turns only the elementwise passes around, so it changes no bit either."""
    from kernels.mhc_fwd import launch_coef_premix
    inp = make_inputs(n, 48, (37,))
    x, y, h_res, h_post, phi, alpha, bias = (inp[k] for k in ("x", "y", "h_res", "h_post", "phi", "alpha", "bias"))
    direct = lambda kernel: kernel  # noqa: E731
    variants = [dict(APPLY_PASS=True), dict(ZIGZAG=False), dict(APPLY_PASS=True, ZIGZAG=False)]
    for ys in ((y, h_res, h_post), (None, None, None)):
        plain = launch_coef_premix(direct, x, *ys, phi, alpha, bias, 20, dict(BT=16, BC=32, num_warps=4))
        for variant in variants:
            other = launch_coef_premix(direct, x, *ys, phi, alpha, bias, 20, dict(BT=16, BC=32, num_warps=4, **variant))
            for i, (a, b) in enumerate(zip(other, plain)):
                assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), \
                    f"{variant}, output {i}, apply={ys[0] is not None}"
