"""Triton mHC kernels (kernels/mhc.py) against the PyTorch reference (kernels/mhc_reference.py).

On a machine without CUDA the kernels run on CPU through the Triton interpreter (fp32): the
variable must be set before triton or the kernel modules are imported. On a GPU machine the
`gpu` tests run the compiled kernels in bf16.
"""
import os
import re

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from kernels import mhc as K  # noqa: E402
from kernels import mhc_reference as R  # noqa: E402

interpreted = pytest.mark.skipif(not (K.HAVE_TRITON and K.INTERPRET),
                                 reason="needs the Triton interpreter (TRITON_INTERPRET=1, no CUDA)")

# (n, C, leading token dims): token counts not divisible by the blocks, C not a power of two.
SHAPES = [(4, 48, (37,)), (2, 96, (2, 11)), (8, 48, (17,))]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def make_inputs(n, C, lead, device="cpu", dtype=torch.float32, seed=0):
    """Random streams and parameters large enough that every coefficient path matters."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    N = R.mhc_num_coefficients(n)

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    inputs = dict(
        x=rnd(*lead, n, C), h_res=torch.softmax(rnd(*lead, n, n), -1), h_post=2 * torch.rand(*lead, n, generator=g),
        y=rnd(*lead, C), phi=rnd(n * C, N, scale=(n * C) ** -0.5), alpha=0.5 + torch.rand(3, generator=g),
        bias=R.mhc_init_bias(n) + rnd(N, scale=0.3))
    cast = {"x": dtype, "y": dtype}
    return {k: v.to(device=device, dtype=cast.get(k, torch.float32)) for k, v in inputs.items()}


def call(ops, name, inp, iters=20):
    if name == "pre":
        return ops.mhc_pre(inp["x"], inp["phi"], inp["alpha"], inp["bias"], iters)
    if name == "post":
        return (ops.mhc_post(inp["x"], inp["h_res"], inp["h_post"], inp["y"]),)
    return ops.mhc_post_pre(inp["x"], inp["h_res"], inp["h_post"], inp["y"], inp["phi"], inp["alpha"],
                            inp["bias"], iters)


def outputs_and_grads(ops, name, inp, grads_seed=1, iters=20):
    """Outputs of one call and the gradients of every input under random output gradients."""
    leaves = {k: v.detach().clone().requires_grad_() for k, v in inp.items()}
    outs = call(ops, name, leaves, iters)
    g = torch.Generator(device="cpu").manual_seed(grads_seed)
    cotangents = [torch.randn(o.shape, generator=g).to(o) for o in outs]
    torch.autograd.backward(outs, cotangents)
    used = {k: v.grad for k, v in leaves.items() if v.grad is not None}
    return [o.detach() for o in outs], used


def assert_close_to_reference(name, inp, out_tol, grad_tol, iters=20):
    outs, grads = outputs_and_grads(K, name, inp, iters=iters)
    ref_outs, ref_grads = outputs_and_grads(R, name, inp, iters=iters)
    assert len(outs) == len(ref_outs) and grads.keys() == ref_grads.keys()
    for i, (o, r) in enumerate(zip(outs, ref_outs)):
        assert o.shape == r.shape and o.dtype == r.dtype
        assert rel(o, r) < out_tol, f"{name} output {i}: rel err {rel(o, r):.2e}"
    for k in grads:
        assert grads[k].dtype == inp[k].dtype
        assert rel(grads[k], ref_grads[k]) < grad_tol, f"{name} grad {k}: rel err {rel(grads[k], ref_grads[k]):.2e}"


# ---------------------------------------------------------------- CPU, Triton interpreter, fp32

@interpreted
@pytest.mark.parametrize("name", ["pre", "post", "post_pre"])
@pytest.mark.parametrize("n,C,lead", SHAPES)
def test_forward_and_backward_match_reference(name, n, C, lead):
    assert_close_to_reference(name, make_inputs(n, C, lead), out_tol=1e-5, grad_tol=1e-5)


@interpreted
@pytest.mark.parametrize("name", ["pre", "post_pre"])
def test_extreme_mixing_logits_stay_finite_and_match_the_reference(name):
    """Res logits spread by over a thousand (alpha_res = 300): rows that underflowed to zeros made NaN in the reference
    and the kernels alike; both start such entries at exp(-80) now, and their gradients still agree. Also: logits
    exactly 80 apart (the floor's edge keeps its gradient), tied maxima, and a NaN, which must come out as NaN."""
    inp = make_inputs(4, 48, (23,), seed=7)
    inp["alpha"] = torch.tensor([0.5, 0.5, 300.0])
    assert_close_to_reference(name, inp, out_tol=1e-5, grad_tol=1e-4)
    inp["alpha"] = torch.tensor([0.5, 0.5, 0.0])  # the res logits are the bias alone
    for res_bias in (torch.tensor([80.0] + [0.0] * 15), torch.tensor([5.0, 5.0] + [-100.0] * 14), torch.zeros(16)):
        inp["bias"] = torch.cat([inp["bias"][:8], res_bias])
        assert_close_to_reference(name, inp, out_tol=1e-5, grad_tol=1e-4)
    inp["alpha"] = torch.tensor([0.5, 0.5, float("nan")])
    for ops in (K, R):
        assert torch.isnan(call(ops, name, inp)[-1]).all()  # h_res: a floor must not hide a NaN


@interpreted
def test_sinkhorn_iterations_are_a_parameter():
    assert_close_to_reference("post_pre", make_inputs(4, 48, (21,), seed=3), out_tol=1e-5, grad_tol=1e-5, iters=3)


@interpreted
def test_chain_of_sublayers_matches_reference():
    """pre -> linear -> post_pre -> linear -> post, as the model runs it, values and gradients."""
    inp = make_inputs(4, 48, (2, 13), seed=5)
    w = torch.randn(48, 48) / 48 ** 0.5

    def chain(ops, x, phi, alpha, bias):
        u, h_post, h_res = ops.mhc_pre(x, phi, alpha, bias)
        x, u, h_post, h_res = ops.mhc_post_pre(x, h_res, h_post, u @ w, phi, alpha, bias)
        x = ops.mhc_post(x, h_res, h_post, torch.tanh(u @ w))
        return (x.square() * torch.linspace(0, 1, 48)).sum()

    results = []
    for ops in (K, R):
        leaves = [inp[k].clone().requires_grad_() for k in ("x", "phi", "alpha", "bias")]
        loss = chain(ops, *leaves)
        loss.backward()
        results.append([loss.detach()] + [t.grad for t in leaves])
    for mine, ref in zip(*results):
        assert rel(mine, ref) < 1e-5


@interpreted
def test_phi_as_the_models_transposed_view_gives_the_same_values_and_gradient():
    """The model stores phi as [N, n*C] and passes phi.t() (the kernels' operand layout, no copy)."""
    inp = make_inputs(4, 48, (23,), seed=7)
    stored = inp["phi"].t().contiguous().requires_grad_()
    as_view = dict(inp, phi=stored.t())
    outs, grads = outputs_and_grads(K, "post_pre", as_view)
    ref_outs, ref_grads = outputs_and_grads(R, "post_pre", inp)
    for o, r in zip(outs, ref_outs):
        assert rel(o, r) < 1e-5
    assert rel(grads["phi"], ref_grads["phi"]) < 1e-5


@interpreted
@pytest.mark.parametrize("n,C,T,cfg", [(2, 48, 37, dict(BT=16, BK=64, num_warps=4)),  # K=96: a partial d(phi) tile
                                       (4, 48, 70, dict(BT=16, BK=32, num_warps=4, splits=9))])  # splits > blocks
def test_dphi_kernel_is_xT_G_for_any_shape(n, C, T, cfg):
    from kernels._triton_util import padded_columns
    from kernels.mhc_bwd import launch_dphi
    g = torch.Generator().manual_seed(n)
    N, NP = R.mhc_num_coefficients(n), padded_columns(n)
    xs, aux = torch.randn(T, n, C, generator=g), torch.randn(T, NP, generator=g)
    dphi = launch_dphi(lambda kernel: kernel, xs, aux, dict(cfg))
    assert dphi.shape == (n * C, N)
    assert rel(dphi, xs.reshape(T, n * C).T.double() @ aux[:, :N].double()) < 1e-5
    with pytest.raises(ValueError, match="must be contiguous"):
        launch_dphi(lambda kernel: kernel, xs.transpose(0, 1), aux, dict(cfg))


def stream_bwd_args(n, C, lead, device="cpu", dtype=torch.float32):
    """launch_stream_bwd's inputs for the apply + coefficient path: streams, coefficients and incoming
    gradients, with aux from the real forward and coefficient backward."""
    from kernels.mhc_bwd import launch_coef_bwd
    from kernels.mhc_fwd import launch_coef_premix
    inp = make_inputs(n, C, lead, device, dtype)
    x, y, h_res, h_post, phi, alpha, bias = (inp[k] for k in ("x", "y", "h_res", "h_post", "phi", "alpha", "bias"))
    g = torch.Generator().manual_seed(5)
    dxo, du = (torch.randn(t.shape, generator=g).to(device=device, dtype=dtype) for t in (x, y))
    direct = lambda kernel: kernel  # noqa: E731
    x_new, _, hp, hr, raw, rinv = launch_coef_premix(direct, x, y, h_res, h_post, phi, alpha, bias, 20)
    aux, _, _ = launch_coef_bwd(direct, x_new, du, torch.randn_like(hp), torch.randn_like(hr), raw, rinv, alpha,
                                bias, 20)
    return x, y, h_res, h_post, dxo, du, aux, phi


@interpreted
def test_unused_outputs_get_zero_gradients():
    """Autograd passes None for unused outputs; the backward must treat them as zeros."""
    inp = make_inputs(4, 48, (19,))
    grads = []
    for ops in (K, R):
        leaves = {k: v.clone().requires_grad_() for k, v in inp.items()}
        x_new, u, h_post, h_res = call(ops, "post_pre", leaves)
        u.sum().backward()  # x_new, h_post, h_res unused
        grads.append(leaves)
    for k in ("x", "phi", "alpha", "bias", "y", "h_res", "h_post"):
        assert rel(grads[0][k].grad, grads[1][k].grad) < 1e-5


def test_falls_back_to_reference_where_kernels_cannot_run(monkeypatch):
    monkeypatch.setattr(K, "INTERPRET", False)
    inp = make_inputs(3, 40, (5,))  # n=3, C=40 are not kernel shapes: the reference must take them
    assert not K.kernels_run_on(inp["x"])
    for name in ("pre", "post", "post_pre"):
        for mine, ref in zip(call(K, name, inp), call(R, name, inp)):
            assert torch.equal(mine, ref)


@interpreted
def test_bf16_cpu_streams_take_the_reference_not_the_interpreter():
    """The interpreter has no bfloat16 (its bf16 projection came out ~1e11 off, its stores truncate): bf16 CPU
    streams take the reference, fp32/fp16 ones the interpreted kernels."""
    inp = make_inputs(4, 48, (5,), dtype=torch.bfloat16)
    assert not K.kernels_run_on(inp["x"])
    assert K.kernels_run_on(inp["x"].float()) and K.kernels_run_on(inp["x"].half())
    assert not K.kernels_run_on(inp["x"].double())  # it would run, at fp32's precision
    for name in ("pre", "post", "post_pre"):
        for mine, ref in zip(call(K, name, inp), call(R, name, inp)):
            assert torch.equal(mine, ref), name


@interpreted
def test_the_ops_saved_projections_are_not_differentiable():
    """raw and inv_rms leave the forward ops for the backward only; a gradient sent into them was dropped, so
    autograd must not offer one: (raw**2).sum().backward() left x.grad at zero."""
    inp = make_inputs(4, 48, (5,))
    x = inp["x"].clone().requires_grad_()
    *_, raw, rinv = torch.ops.mhcgolf.mhc_pre_fwd(x, inp["phi"], inp["alpha"], inp["bias"], 20)
    assert not raw.requires_grad and not rinv.requires_grad
    outs = torch.ops.mhcgolf.mhc_post_pre_fwd(x, inp["h_res"], inp["h_post"], inp["y"], inp["phi"], inp["alpha"],
                                              inp["bias"], 20)
    assert outs[0].requires_grad and not outs[4].requires_grad and not outs[5].requires_grad


@interpreted
@pytest.mark.parametrize("bad,match", [
    (dict(x=torch.randn(5, 3, 48)), re.escape("n_streams in (2, 4, 8), got n=3")),
    (dict(x=torch.randn(5, 4, 40), phi=torch.randn(160, 24), y=torch.randn(5, 40)), "multiple of 16"),
    (dict(phi=torch.randn(10, 24)), "phi has shape"),
    (dict(y=torch.randn(5, 48, dtype=torch.float64)), "y has dtype"),
    (dict(h_res=torch.randn(5, 4, 3)), "h_res has shape"),
])
def test_bad_inputs_raise_clear_errors(bad, match):
    inp = make_inputs(4, 48, (5,))
    if "x" in bad and "phi" not in bad:  # n=3: give phi/bias/coefficients the matching shapes
        inp = make_inputs(3, 48, (5,))
    inp.update(bad)
    with pytest.raises(ValueError, match=match):
        call(K, "post_pre", inp)


@interpreted
def test_strided_alpha_and_bias_are_read_as_their_values():
    """The kernels read alpha and bias as dense vectors: a strided view gave wrong gates (u 0.52 off) with no error."""
    inp = make_inputs(4, 48, (5,))
    strided = dict(inp, alpha=torch.stack([inp["alpha"], torch.zeros(3)], 1)[:, 0],
                   bias=torch.stack([inp["bias"], torch.zeros_like(inp["bias"])], 1)[:, 0])
    assert strided["alpha"].stride() == (2,) and strided["bias"].stride() == (2,)
    for name in ("pre", "post_pre"):
        mine, _ = outputs_and_grads(K, name, strided)
        ref, _ = outputs_and_grads(R, name, inp)
        assert all(rel(a, b) < 1e-5 for a, b in zip(mine, ref)), name


@interpreted
def test_launchers_refuse_layouts_they_would_misread():
    """The public calls pass contiguous tensors; a direct caller's column-major x was read as row-major (1.4 off)."""
    from kernels.mhc_fwd import launch_apply, launch_coef_premix
    inp = make_inputs(4, 48, (6,))
    x_cm = inp["x"].permute(2, 1, 0).contiguous().permute(2, 1, 0)
    with pytest.raises(ValueError, match=r"launch_apply: x must be contiguous.*hint: pass x.contiguous\(\)"):
        launch_apply(lambda kernel: kernel, x_cm, inp["y"], inp["h_res"], inp["h_post"])
    with pytest.raises(ValueError, match="launch_coef_premix: x must be contiguous"):
        launch_coef_premix(lambda kernel: kernel, x_cm, None, None, None, inp["phi"], inp["alpha"], inp["bias"], 20)


@interpreted
def test_zero_sinkhorn_rounds_are_refused():
    """Its backward assumes at least one round: with 0 the gradients were silently wrong (d alpha 2.1 off)."""
    inp = make_inputs(4, 48, (5,))
    for name in ("pre", "post_pre"):
        with pytest.raises(ValueError, match="sinkhorn_iters=0 must be >= 1"):
            call(K, name, inp, iters=0)


def test_compiles_fullgraph_on_cpu():
    """The public calls trace with no graph break (here through the reference fallback)."""
    inp = make_inputs(4, 48, (2, 7))
    w = torch.randn(48, 48) / 48 ** 0.5

    def chain(x, phi, alpha, bias):
        u, h_post, h_res = K.mhc_pre(x, phi, alpha, bias)
        x, u, h_post, h_res = K.mhc_post_pre(x, h_res, h_post, u @ w, phi, alpha, bias)
        return K.mhc_post(x, h_res, h_post, u @ w)

    args = [inp[k] for k in ("x", "phi", "alpha", "bias")]
    compiled = torch.compile(chain, fullgraph=True, backend="aot_eager")  # fullgraph: a break raises
    assert rel(compiled(*args), chain(*args)) < 1e-5


# ---------------------------------------------------------------- GPU, compiled kernels, bf16

# n=8 only through post_pre, which runs every kernel (its register-heavy variants compile slowly).
# n=8 is marked slow: its backward kernels take ~2 minutes each to compile for sm_90 (measured by
# cross-compiling with triton 3.9 on a CPU), so `-m "gpu and not slow"` is the quick GPU pass.
GPU_CASES = [(name, 4, 512, (3, 1000)) for name in ("pre", "post", "post_pre")] + [
    (name, 2, 320, (777,)) for name in ("pre", "post", "post_pre")] + [
    pytest.param("post_pre", 8, 96, (4, 129), marks=pytest.mark.slow)]


@pytest.mark.parametrize("name,n,C,lead", GPU_CASES)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_bf16_matches_reference(name, n, C, lead):
    """Against the reference on the same bf16 inputs: both round x' to bf16 at the same point (an
    fp32 reference does not, and d(alpha), a sum over tokens that largely cancels, then differs
    by more than the bf16 rounding of its terms)."""
    inp = make_inputs(n, C, lead, device="cuda", dtype=torch.bfloat16)
    assert_close_to_reference(name, inp, out_tol=1e-2, grad_tol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["pre", "post_pre"])
@pytest.mark.parametrize("n", [2, 4])
def test_gpu_fp32_streams_are_computed_in_fp32(name, n):
    """tl.dot on fp32 operands defaults to TF32: fp32 streams were 1.5e-4 off (gradients up to 1.2e-3), not ~1e-7."""
    # the reference in fp32 too, set and restored by hand: cuBLASModule serves allow_tf32 through __getattr__, so it
    # is not in the instance __dict__, and pytest 9.2's monkeypatch undoes such an attribute by deleting it
    matmul = torch.backends.cuda.matmul
    saved = matmul.allow_tf32
    matmul.allow_tf32 = False
    try:
        assert_close_to_reference(name, make_inputs(n, 256, (300,), device="cuda"), out_tol=1e-5, grad_tol=1e-5)
    finally:
        matmul.allow_tf32 = saved


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_backward_is_deterministic():
    inp = make_inputs(4, 512, (4096,), device="cuda", dtype=torch.bfloat16)
    first = outputs_and_grads(K, "post_pre", inp)[1]
    second = outputs_and_grads(K, "post_pre", inp)[1]
    for k in first:
        assert torch.equal(first[k], second[k]), k


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_compile_fullgraph_matches_eager():
    inp = make_inputs(4, 256, (2, 300), device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(256, 256, device="cuda") / 16).bfloat16()

    def chain(x, phi, alpha, bias):
        u, h_post, h_res = K.mhc_pre(x, phi, alpha, bias)
        x, u, h_post, h_res = K.mhc_post_pre(x, h_res, h_post, u @ w, phi, alpha, bias)
        x = K.mhc_post(x, h_res, h_post, u @ w)
        return x.float().square().mean()

    results = []
    for fn in (chain, torch.compile(chain, fullgraph=True)):
        leaves = [inp[k].clone().requires_grad_() for k in ("x", "phi", "alpha", "bias")]
        loss = fn(*leaves)
        loss.backward()
        results.append([loss.detach()] + [t.grad for t in leaves])
    for eager, compiled in zip(*results):
        assert rel(compiled, eager) < 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_opcheck():
    inp = make_inputs(4, 64, (70,), device="cuda", dtype=torch.bfloat16)
    ops = torch.ops.mhcgolf
    for op, args in [
        (ops.mhc_pre_fwd, (inp["x"], inp["phi"], inp["alpha"], inp["bias"], 20)),
        (ops.mhc_post_fwd, (inp["x"], inp["h_res"], inp["h_post"], inp["y"])),
        (ops.mhc_post_pre_fwd, (inp["x"], inp["h_res"], inp["h_post"], inp["y"], inp["phi"], inp["alpha"],
                                inp["bias"], 20)),
    ]:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("n", [4, 2])
def test_gpu_stream_bwd_gp_scratch_matches_the_plain_kernel(n):
    """On the GPU the scratch round trip depends on the barriers (threads may reload what others stored):
    every GP_SCRATCH block of SWEEP gives the plain kernel's gradients up to G phi^T's bf16 rounding."""
    from kernels.mhc_bwd import launch_stream_bwd, stream_bwd_config
    from kernels.mhc_blocks import SWEEP
    args = stream_bwd_args(n, 512, (3001,), device="cuda", dtype=torch.bfloat16)
    direct = lambda kernel: kernel  # noqa: E731
    plain = launch_stream_bwd(direct, *args, dict(stream_bwd_config(args[0].device, n), GP_SCRATCH=False))
    configs = [cfg for cfg in SWEEP["stream_bwd"] if cfg.get("GP_SCRATCH")]
    assert configs
    for cfg in configs:
        for a, b in zip(launch_stream_bwd(direct, *args, dict(cfg)), plain):
            assert rel(a, b) < 1e-2, f"{cfg}: rel err {rel(a, b):.2e}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("n", [4, 2])
def test_gpu_coef_premix_blocks_match_the_plain_kernel(n):
    """Every coef_premix block of SWEEP (the defaults among them) gives the plain 16 x 64 kernel's forward
    outputs on the GPU, with the apply and without it: APPLY_PASS's pass 1 depends on the barrier after pass 0
    (threads read back x' that other threads wrote), and the wide defaults run near 255 registers."""
    from kernels.mhc_fwd import launch_coef_premix
    from kernels.mhc_blocks import SWEEP
    inp = make_inputs(n, 512, (3001,), "cuda", torch.bfloat16)
    x, y, h_res, h_post, phi, alpha, bias = (inp[k] for k in ("x", "y", "h_res", "h_post", "phi", "alpha", "bias"))
    direct = lambda kernel: kernel  # noqa: E731
    for rows, ys in ((SWEEP["coef_premix"], (y, h_res, h_post)), (SWEEP["coef_premix_pre"], (None, None, None))):
        plain = launch_coef_premix(direct, x, *ys, phi, alpha, bias, 20, dict(BT=16, BC=64, num_warps=4))
        for cfg in rows:
            for i, (a, b) in enumerate(zip(launch_coef_premix(direct, x, *ys, phi, alpha, bias, 20, dict(cfg)), plain)):
                assert (a is None) == (b is None) and (a is None or rel(a, b) < 1e-3), \
                    f"{cfg}, apply={ys[0] is not None}, output {i}: rel err {rel(a, b):.2e}"


@interpreted
def test_dphi_splits_with_no_token_blocks_add_nothing():
    """d(phi)'s split count no longer depends on T (a guard on T recompiled dynamic-shape graphs): splits past the
    last token block must contribute exact zeros."""
    from kernels.mhc_bwd import launch_dphi
    torch.manual_seed(0)
    xs, aux = torch.randn(5, 4, 48), torch.randn(5, R.mhc_num_coefficients(4) + 8)
    aux = torch.cat([aux, torch.zeros(5, 32 - aux.shape[1])], 1)  # [T, NP], NP = 32 at n=4
    one = launch_dphi(lambda kernel: kernel, xs, aux, dict(BT=16, BK=32, splits=1))
    many = launch_dphi(lambda kernel: kernel, xs, aux, dict(BT=16, BK=32, splits=6))  # 1 token block, 6 splits
    assert torch.equal(one, many)
