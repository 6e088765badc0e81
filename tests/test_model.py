"""Model properties: causality, doubly stochastic H_res, plain-residual start, n_streams=1 path."""
import re

import pytest
import torch
import torch.nn.functional as F

from kernels.mhc_reference import mhc_coefficients, mhc_init_bias, sinkhorn_knopp
from model.config import ModelConfig
from model.gpt import GPT
from model.layers import MLP
from model.mhc import MHCParams
from training.config import OptimConfig


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=64, n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, n_streams=4)
    base.update(kw)
    return ModelConfig(**base)


def randomize_(model: GPT, scale: float = 0.3) -> GPT:
    """Give every parameter a non-trivial value (the zero-init output projections hide bugs)."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") and "mhc" in name:
                continue  # keep the structural mHC bias, perturbed below via alpha/phi
            # phi is stored at unit scale and used times phi_scale: perturb what the model computes with.
            unit = model.mhc[0].phi_scale if name.endswith(".phi") else 1.0
            # phi's noise is drawn [in, out], the layout phi had when the pinned fingerprints were taken
            noise = torch.randn(p.shape[::-1], generator=g).t() if name.endswith(".phi") else torch.randn(p.shape, generator=g)
            p.add_(noise * scale / unit)
    return model


@pytest.mark.parametrize("n_streams,granularity,blocks,kernels", [
    (1, "sublayer", 0, False), (4, "sublayer", 0, False), (4, "block", 0, False), (2, "block", 0, False),
    (2, "sublayer", 1, False),
    (4, "sublayer", 0, True), (2, "sublayer", 1, True)])  # the Triton mHC and MLP kernels (interpreted on a CPU)
def test_causal_including_across_document_boundary(n_streams, granularity, blocks, kernels):
    if kernels:
        pytest.importorskip("triton")
    torch.manual_seed(0)
    model = randomize_(GPT(tiny(n_streams=n_streams, mhc_granularity=granularity, mhc_blocks=blocks,
                                mhc_kernels=kernels, mlp_kernel=kernels))).eval()
    idx = torch.randint(4, 64, (1, 24))
    idx[0, 10] = 1  # BOS: a document boundary inside the sequence
    base = model(idx)
    for t in (5, 10, 15):
        changed = idx.clone()
        changed[0, t + 1:] = torch.randint(4, 64, (24 - t - 1,))
        out = model(changed)
        assert torch.equal(out[0, : t + 1], base[0, : t + 1]), f"logits at <= {t} changed"
        assert not torch.allclose(out[0, t + 1:], base[0, t + 1:]), "later positions should change"


def test_h_res_is_doubly_stochastic():
    torch.manual_seed(0)
    n, C = 4, 16
    x = torch.randn(3, 7, n, C) * 5
    # Trained-model magnitudes: phi ~ N(0, 1/(nC)) makes raw logits unit-scale; alpha and the bias
    # then spread them by about a unit (20 rounds converge for spreads of that order).
    phi = torch.randn(n * C, n * n + 2 * n) / (n * C) ** 0.5
    alpha = torch.tensor([0.5, 0.5, 0.3])
    bias = mhc_init_bias(n) + 0.5 * torch.randn(n * n + 2 * n)
    h_pre, h_post, h_res = mhc_coefficients(x, phi, alpha, bias, sinkhorn_iters=20)
    assert (h_res >= 0).all()
    assert torch.allclose(h_res.sum(-1), torch.ones(3, 7, n), atol=1e-5)
    assert torch.allclose(h_res.sum(-2), torch.ones(3, 7, n), atol=1e-5)
    assert ((h_pre > 0) & (h_pre < 1)).all() and ((h_post > 0) & (h_post < 2)).all()


def test_reference_coefficients_are_fp32_under_autocast():
    """The reference's projection ran under the model's bf16 autocast and rounded raw to bf16 (0.014 off at unit
    scale), though its docstring said fp32; the Triton kernel keeps it in fp32."""
    torch.manual_seed(0)
    n, C = 4, 16
    x = torch.randn(3, 7, n, C)
    phi = torch.randn(n * C, n * n + 2 * n) / (n * C) ** 0.5
    args = (phi, torch.tensor([1.0, 1.0, 1.0]), mhc_init_bias(n))
    exact = mhc_coefficients(x, *args)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under_autocast = mhc_coefficients(x, *args)
    assert all(torch.equal(a, b) and b.dtype == torch.float32 for a, b in zip(exact, under_autocast))


def test_reference_apply_is_fp32_under_autocast():
    """The apply's matmul ran in bf16 under autocast (H_res rounded, its rows summing to 1 only within 2e-3),
    though its docstring said fp32."""
    from kernels.mhc_reference import mhc_apply
    torch.manual_seed(0)
    n, C = 4, 16
    x, y = torch.randn(3, 7, n, C), torch.randn(3, 7, C)
    h_res = torch.softmax(torch.randn(3, 7, n, n), -1)
    h_post = torch.rand(3, 7, n) * 2
    exact = mhc_apply(x, h_res, h_post, y)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under_autocast = mhc_apply(x, h_res, h_post, y)
    assert torch.equal(exact, under_autocast) and under_autocast.dtype == torch.float32
    assert mhc_apply(x.half(), h_res.half(), h_post, y.half()).dtype == torch.float16  # fp16 H_res: no dtype error


def test_sinkhorn_of_large_logits_stays_finite():
    m = sinkhorn_knopp(torch.tensor([[[200.0, 0.0], [0.0, 200.0]]]), 20)
    assert torch.isfinite(m).all() and torch.allclose(m, torch.eye(2).unsqueeze(0), atol=1e-6)
    # a row (or column) entirely ~90 below the max underflowed to zeros: 0/0 in the first round
    m = sinkhorn_knopp(torch.tensor([[[120.0, 0.0], [0.0, -10.0]]]), 20)
    assert torch.isfinite(m).all() and torch.allclose(m.sum(-2), torch.ones(1, 2))  # 20 rounds do not reach I
    logits = (torch.randn(2000, 4, 4, generator=torch.Generator().manual_seed(0)) * 40).requires_grad_()
    m = sinkhorn_knopp(logits, 20)
    m.square().sum().backward()
    assert torch.isfinite(m).all() and torch.isfinite(logits.grad).all()
    assert torch.allclose(m.sum(-2), torch.ones(2000, 4), atol=1e-5)  # the columns, normalized last


def test_init_bias_starts_as_plain_residual_coefficients():
    n = 4
    x = torch.randn(5, 1, 8).expand(5, n, 8)
    h_pre, h_post, h_res = mhc_coefficients(x, torch.zeros(n * 8, 24), torch.zeros(3), mhc_init_bias(n))
    assert torch.allclose(h_pre.sum(-1), torch.ones(5))        # u = x
    assert torch.allclose(h_post, torch.ones(5, n))            # every stream gets + F(u)
    assert (torch.diagonal(h_res, dim1=-2, dim2=-1) > 0.7).all()  # diagonal-dominant


def copy_plain_weights(src: GPT, dst: GPT) -> None:
    """Copy every parameter the plain network has into the mHC network."""
    dst_params = dict(dst.named_parameters())
    with torch.no_grad():
        for name, p in src.named_parameters():
            dst_params[name].copy_(p)


@pytest.mark.parametrize("granularity,blocks", [("sublayer", 0), ("block", 0), ("sublayer", 1)])
@pytest.mark.parametrize("alpha,tol", [(0.0, 1e-5), (0.01, 5e-2)])
def test_mhc_network_starts_as_plain_prenorm_residual_network(alpha, tol, granularity, blocks):
    torch.manual_seed(0)
    plain = randomize_(GPT(tiny(n_streams=1))).eval()
    mhc = GPT(tiny(n_streams=4, mhc_alpha_init=alpha, mhc_granularity=granularity, mhc_blocks=blocks)).eval()
    copy_plain_weights(plain, mhc)
    idx = torch.randint(0, 64, (2, 16))
    ref, out = plain(idx), mhc(idx)
    err = (out - ref).abs().max().item()
    assert err < tol * ref.abs().max().item(), f"max |Δlogits| = {err}"
    if alpha > 0:
        assert err > 0, "alpha > 0 must give per-token modulation"


def test_block_granularity_wraps_whole_blocks():
    """One set of mHC parameters per block, and the block inside is a plain pre-norm residual block:
    with identical streams kept identical (alpha 0, H_post = 1), every stream holds the plain network's
    residual stream after each block, so logits match it while the sublayer granularity (whose streams
    mix differently once the sublayers are non-trivial) is a different model."""
    torch.manual_seed(0)
    block = GPT(tiny(n_streams=4, mhc_granularity="block"))
    sub = GPT(tiny(n_streams=4))
    assert len(block.mhc) == block.cfg.n_layers and len(sub.mhc) == 2 * sub.cfg.n_layers
    with pytest.raises(ValueError, match="mhc_granularity='layer'"):
        GPT(tiny(mhc_granularity="layer"))
    plain = randomize_(GPT(tiny(n_streams=1))).eval()
    copy_plain_weights(plain, block.eval())
    with torch.no_grad():
        for p in block.mhc:
            p.alpha.zero_()
    idx = torch.randint(0, 64, (2, 16))
    torch.testing.assert_close(block(idx), plain(idx), atol=1e-5, rtol=1e-5)
    randomize_(block)
    sub.load_state_dict({k: v for k, v in block.state_dict().items() if not k.startswith("mhc.")}, strict=False)
    assert not torch.allclose(block(idx), sub.eval()(idx), atol=1e-4)


@pytest.mark.parametrize("granularity,units", [("sublayer", 4), ("block", 2)])
def test_mhc_blocks_wraps_the_first_blocks_and_leaves_the_rest_plain(granularity, units):
    """mhc_blocks=2 of 3: mHC parameters for the first two blocks only, then the streams are read out
    once and block 2 is a plain pre-norm residual block on that single stream."""
    torch.manual_seed(0)
    model = randomize_(GPT(tiny(n_layers=3, n_streams=2, mhc_blocks=2, mhc_granularity=granularity))).eval()
    assert len(model.mhc) == units
    idx = torch.randint(0, 64, (2, 16))
    seen = {}
    last = model.sublayers[4]
    hook = last.register_forward_pre_hook(lambda m, args: seen.setdefault("x", args[0].detach().clone()))
    out = model(idx)
    hook.remove()
    x = seen["x"]  # block 2's input: the readout of the streams after block 1
    for sub in model.sublayers[4:]:
        x = x + sub(x)
    logits = 30 * torch.tanh(F.linear(model.final_norm(x), model.embed.weight) / 30)
    torch.testing.assert_close(out, logits, atol=1e-5, rtol=1e-5)
    model.train()
    model(idx, idx).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    for bad, match in ((dict(mhc_blocks=3), "must be in"), (dict(mhc_blocks=-1), "must be in"),
                       (dict(n_streams=1, mhc_blocks=1), "needs n_streams >= 2")):
        with pytest.raises(ValueError, match=f"model.mhc_blocks=.* {match}"):
            GPT(tiny(**bad))
    with pytest.raises(ValueError, match="model.n_streams=0 must be >= 1"):  # the model checks it, not only the config
        GPT(tiny(n_streams=0, mhc_blocks=1))


# the second layout runs both mHC blocks twice (depth recurrence): every unit's kernels run twice in one forward,
# and their gradients must add up to the reference's
@pytest.mark.parametrize("layout", [dict(n_streams=2, mhc_blocks=1),
                                    dict(n_streams=2, n_layers=3, mhc_blocks=2, recur_end=1, recur_times=2),
                                    dict(n_streams=2, n_layers=3, mhc_start=1, mhc_blocks=1)])
def test_mhc_blocks_with_the_triton_kernels_matches_the_reference(layout):
    """The partial network through the kernels (the interpreter on CPU, fp32): the last mHC unit is an
    apply alone (post), then the readout and the plain block; logits and every gradient as the reference."""
    from kernels import mhc as K
    if not (K.HAVE_TRITON and K.INTERPRET):
        pytest.skip("needs the Triton interpreter (TRITON_INTERPRET=1, no CUDA; tests/conftest.py sets it)")
    torch.manual_seed(0)
    ref = randomize_(GPT(tiny(**layout)))
    ker = GPT(tiny(**layout, mhc_kernels=True))
    ker.load_state_dict(ref.state_dict())
    ref.recurrence_on = ker.recurrence_on = True  # a no-op without recur_times > 1
    idx = torch.randint(0, 64, (2, 16))
    ref(idx, idx).backward()
    ker(idx, idx).backward()
    torch.testing.assert_close(ker.logits(idx), ref.logits(idx), atol=1e-4, rtol=1e-4)
    for (name, a), b in zip(ker.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-4, rtol=1e-3, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the compiled kernels in bf16)")
@pytest.mark.parametrize("layout", [dict(n_streams=4), dict(n_streams=2, mhc_blocks=1)])
def test_gpu_model_with_the_triton_kernels_is_as_close_to_fp32_as_the_bf16_reference(layout):
    """The whole network on a GPU under bf16 autocast, the compiled mHC kernels and the PyTorch reference, each
    against the reference in fp32: the kernels' loss and every gradient at most twice as far off as the bf16
    reference's (plus a little). Compared with each other directly, sums that cancel (d alpha) differ by ~50% in bf16
    on both sides (the interpreter test above compares the kernels with the reference exactly, in fp32)."""
    torch.manual_seed(0)
    cfg = dict(vocab_size=64, n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, **layout)
    ref = randomize_(GPT(ModelConfig(**cfg))).cuda()
    idx = torch.randint(0, 64, (4, 64), device="cuda")
    runs = {}
    for name, kernels, bf16 in (("fp32", False, False), ("reference", False, True), ("kernels", True, True)):
        model = GPT(ModelConfig(**cfg, mhc_kernels=kernels)).cuda()
        model.load_state_dict(ref.state_dict())
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            loss = model(idx, idx)
        loss.backward()
        runs[name] = (loss.item(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None})
    (exact, grads), (ref_loss, ref_grads), (ker_loss, ker_grads) = runs["fp32"], runs["reference"], runs["kernels"]
    assert abs(ker_loss - exact) <= 2 * abs(ref_loss - exact) + 5e-3
    assert ker_grads.keys() == grads.keys()
    for name, g in grads.items():
        def off(other):
            return ((other[name] - g).norm() / g.norm().clamp_min(1e-12)).item()
        assert off(ker_grads) <= 2 * off(ref_grads) + 0.02, (name, off(ker_grads), off(ref_grads))


def test_single_stream_is_exactly_plain_residual_and_has_no_mhc_parameters():
    torch.manual_seed(0)
    model = randomize_(GPT(tiny(n_streams=1))).eval()
    assert not any("mhc" in n or "readout" in n for n, _ in model.named_parameters())
    idx = torch.randint(0, 64, (2, 16))
    x = model.embed(idx)
    for sub in model.sublayers:
        x = x + sub.body(sub.norm(x))
    h = model.final_norm(x)
    logits = 30 * torch.tanh((h @ model.embed.weight.T) / 30)
    assert torch.allclose(model(idx), logits, atol=1e-6)


def test_param_groups_cover_every_parameter_once():
    model = GPT(tiny())
    groups = model.param_groups()
    seen = [id(p) for ps in groups.values() for p in ps]
    assert len(seen) == len(set(seen)) == len(list(model.parameters()))
    assert all(p.ndim == 2 for p in groups["matrix"])
    assert len(groups["matrix"]) == 4 * model.cfg.n_layers


def test_softcap_bounds_logits_and_zero_disables():
    torch.manual_seed(0)
    model = randomize_(GPT(tiny(n_streams=1, logit_softcap=2.0)), scale=3.0)
    idx = torch.randint(0, 64, (1, 8))
    assert model(idx).abs().max() <= 2.0
    uncapped = GPT(tiny(n_streams=1, logit_softcap=0.0))
    uncapped.load_state_dict(model.state_dict())
    assert uncapped(idx).abs().max() > 2.0


def _first_adam_step_logit_change(params: MHCParams, lr: float) -> float:
    """Largest change of the projected logits x̃·projection/rms(x̃) over 64 tokens after one AdamW step
    on phi (Adam's first step moves every element by ~lr, whatever the gradient's size)."""
    torch.manual_seed(3)
    n_coef, n_c = params.phi.shape
    x = torch.randn(64, n_c)
    target = torch.randn(64, n_coef)

    def raw():
        return (x @ params.projection()) * torch.rsqrt(x.square().mean(dim=-1, keepdim=True))

    before = raw().detach()
    opt = torch.optim.AdamW([params.phi], lr=lr, weight_decay=0.0)
    (raw() * target).sum().backward()
    opt.step()
    return float((raw().detach() - before).abs().max())


def test_phi_is_stored_at_unit_scale_so_adam_steps_stay_small():
    """Regression: phi stored at its natural scale 1/sqrt(n*C) moved by more than its own size per
    AdamW step at the scalar lr, and the mHC logits exploded (NaN at step 250 on an H100)."""
    lr = OptimConfig().scalar_lr
    params = MHCParams(4, 512, alpha_init=0.01)
    assert params.phi.std().item() == pytest.approx(1.0, rel=0.05)
    assert _first_adam_step_logit_change(params, lr) < 1.0
    with torch.no_grad():  # the old parametrization: the same projection stored as the parameter itself
        params.phi.mul_(params.phi_scale)
    params.phi_scale = 1.0
    assert _first_adam_step_logit_change(params, lr) > 3.0


def test_stream_readout_is_no_matrix_product():
    """The head's Σ_i w_i x_i over n streams: an einsum made it a matrix product with K = n (forward) and
    K = 1 (backward) over all B*T*C elements, which cuBLAS ran as GEMVs (3.1 ms of an n=4 H100 step)."""
    from training.step_profile import GEMM_OPS
    model = randomize_(GPT(tiny(n_streams=4)))
    idx = torch.randint(0, model.cfg.vocab_size, (2, 16))
    with torch.profiler.profile(record_shapes=True) as prof:
        model(idx, idx).backward()
    flat = 2 * 16 * model.cfg.d_model  # every stream element of one stream
    products = [e.input_shapes for e in prof.events() if e.name in GEMM_OPS]
    assert products, "the profile saw no matrix products at all (the test would pass vacuously)"
    assert not [s for s in products if any(flat in dims for dims in s)], products
    assert model.readout.grad is not None and model.readout.grad.abs().sum() > 0


@pytest.mark.parametrize("on", [True, False])
def test_model_mlp_kernel_routes_every_mlp_through_the_fused_op(on, monkeypatch):
    """model.mlp_kernel=true sends each block's MLP through kernels.mlp.fused_mlp (Triton where it runs), false
    through the nn.Linear modules; the two compute the same function."""
    import kernels.mlp as fused
    calls = []
    real = fused.fused_mlp

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)
    monkeypatch.setattr(fused, "fused_mlp", counted)
    torch.manual_seed(0)
    model = randomize_(GPT(tiny(n_streams=1, mlp_kernel=on)))
    idx = torch.randint(0, 64, (2, 8))
    logits = model.logits(idx)
    assert len(calls) == (model.cfg.n_layers if on else 0)
    mlps = [m for m in model.modules() if isinstance(m, MLP)]
    assert len(mlps) == model.cfg.n_layers and all(m.use_kernel == on for m in mlps)
    for m in mlps:
        m.use_kernel = not on
    assert torch.allclose(model.logits(idx), logits, atol=1e-5)


@pytest.mark.parametrize("field,value,says", [
    ("embed_init_std", 0.0, "model.embed_init_std=0.0 must be > 0"),  # every gradient was 0: it never trained
    ("mhc_alpha_init", float("nan"), "model.mhc_alpha_init=nan must be a finite number"),
    ("qk_gain_init", float("inf"), "model.qk_gain_init=inf must be a finite number"),
])
def test_initial_values_that_cannot_train_are_refused(field, value, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        GPT(tiny(**{field: value}))


def test_a_float64_model_with_mhc_on_some_blocks_runs():
    """The readout summed the streams in fp32 whatever the model's dtype: a float64 model with plain blocks after
    the mHC ones failed in their first product (expected m1 and m2 to have the same dtype)."""
    torch.manual_seed(0)
    model = GPT(tiny(n_streams=2, mhc_blocks=1)).double()
    idx = torch.randint(0, 64, (2, 8))
    assert torch.isfinite(model(idx)).all()


def test_initial_weights_do_not_depend_on_the_cpu_thread_count():
    """The orthogonal init's QR rounds differently on one thread and on several: it runs on one, so a seed starts from
    the same weights on any machine (and a busy host does not stall the QR); the caller's thread count is kept."""
    threads = torch.get_num_threads()
    weights = []
    try:  # the suite's later tests keep their thread count whatever happens here
        for n in (1, 2):
            torch.set_num_threads(n)
            torch.manual_seed(0)
            weights.append(GPT(tiny(vocab_size=256, d_model=128, n_heads=4, n_kv_heads=4, n_streams=1)).state_dict())
            assert torch.get_num_threads() == n
    finally:
        torch.set_num_threads(threads)
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
