"""GPTQ vs round-to-nearest, clip search, dead columns, Hessian hooks, self-generated calibration."""
import pytest
import torch
import torch.nn as nn

from quant.calibrate import HessianCollector, calibrate, generate_calibration_tokens
from quant.gptq import CLIP_PERCENTILES, candidate_scales, gptq_quantize, h_weighted_error, rtn_quantize


def correlated_inputs(n: int, d_in: int, seed: int) -> torch.Tensor:
    """Inputs living mostly in a 12-dim subspace (strong correlations between input columns)."""
    g = torch.Generator().manual_seed(seed)
    mixing = torch.randn(12, d_in, generator=torch.Generator().manual_seed(0))
    return torch.randn(n, 12, generator=g) @ mixing + 0.05 * torch.randn(n, d_in, generator=g)


@pytest.fixture(scope="module")
def layer():
    torch.manual_seed(0)
    d_in, d_out = 192, 64
    x_cal, x_test = correlated_inputs(4096, d_in, 1), correlated_inputs(2048, d_in, 2)
    weight = torch.randn(d_out, d_in) / d_in ** 0.5
    return weight, x_cal.T @ x_cal / x_cal.shape[0], x_test


@pytest.mark.parametrize("act_order", [True, False])
@pytest.mark.parametrize("bits", [5, 6])
def test_gptq_beats_rtn_on_correlated_inputs(layer, bits, act_order):
    weight, hessian, x_test = layer
    gptq, gptq_err = gptq_quantize(weight, hessian, (bits,), act_order=act_order)[bits]
    rtn, rtn_err = rtn_quantize(weight, bits, hessian)
    assert gptq_err == pytest.approx(h_weighted_error(weight, gptq, hessian), rel=1e-4)
    assert rtn_err == pytest.approx(h_weighted_error(weight, rtn, hessian), rel=1e-4)
    assert gptq_err < 0.5 * rtn_err
    out_mse = lambda qt: float(((x_test @ (qt.dequantize() - weight).T) ** 2).mean())  # noqa: E731
    assert out_mse(gptq) < 0.5 * out_mse(rtn)  # held-out inputs from the same distribution


def test_gptq_multi_width_pass_equals_single_width_passes(layer):
    weight, hessian, _ = layer
    both = gptq_quantize(weight, hessian, (5, 6))
    for bits in (5, 6):
        alone = gptq_quantize(weight, hessian, (bits,))[bits]
        assert (both[bits][0].codes == alone[0].codes).all()
        assert both[bits][1] == pytest.approx(alone[1], rel=1e-5)
    assert both[6][1] < both[5][1]


def test_gptq_small_blocks_match_one_block(layer):
    """Lazy batch updates are an exact reorganisation of the column sweep."""
    weight, hessian, _ = layer
    a = gptq_quantize(weight, hessian, (6,), block_size=16)[6]
    b = gptq_quantize(weight, hessian, (6,), block_size=512)[6]
    assert (a[0].codes != b[0].codes).mean() < 0.002  # fp32 summation order may flip a rare tie
    assert a[1] == pytest.approx(b[1], rel=1e-3)


def test_clip_search_picks_the_best_candidate_per_row():
    torch.manual_seed(1)
    weight = torch.randn(32, 2048) * torch.rand(32, 1)
    weight[:4, :3] = 12.0  # rows with outliers: clipping them is a real trade-off
    qt, err = rtn_quantize(weight, 5)
    cands = candidate_scales(weight, 5)
    assert cands.shape == (len(CLIP_PERCENTILES), 32)
    per_cand = torch.stack([((torch.clamp(torch.round(weight / s[:, None]), -15, 15) * s[:, None] - weight) ** 2).sum(1)
                            for s in cands])
    chosen = ((qt.dequantize() - weight) ** 2).sum(1)
    torch.testing.assert_close(chosen, per_cand.min(0).values)
    assert err == pytest.approx(float(per_cand.min(0).values.sum()), rel=1e-5)
    scales = torch.from_numpy(qt.scales.astype("float32"))
    assert all(bool((cands[:, r] == scales[r]).any()) for r in range(32))
    assert len(set(per_cand.argmin(0).tolist())) > 1  # the search does choose differently per row


def test_dead_columns_and_zero_rows():
    torch.manual_seed(2)
    x = correlated_inputs(1024, 64, 3)
    x[:, :5] = 0.0  # inputs that never fire: diag(H) = 0
    hessian = x.T @ x / x.shape[0]
    weight = torch.randn(16, 64)
    weight[3] = 0.0
    qt, err = gptq_quantize(weight, hessian, (5,))[5]
    assert torch.isfinite(qt.dequantize()).all() and err >= 0
    assert (qt.codes[3] == 0).all()
    # Dead columns are rounded, not zeroed: they still carry the weights.
    scale = torch.from_numpy(qt.scales.astype("float32"))[:, None]
    expected = torch.clamp(torch.round(weight[:, :5] / scale), -15, 15)
    assert torch.equal(torch.from_numpy(qt.codes[:, :5]).float(), expected)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="does not match"):
        gptq_quantize(torch.randn(4, 8), torch.eye(7))
    with pytest.raises(ValueError, match="NaN or Inf"):
        rtn_quantize(torch.tensor([[float("nan"), 1.0]]), 6)
    with pytest.raises(ValueError, match="2-D"):
        rtn_quantize(torch.randn(3), 6)
    huge = torch.randn(2, 8)
    huge[1, 3] = 1e7  # its row scale would be clamped to fp16's largest, clipping the weight to 2.03e6 in silence
    with pytest.raises(ValueError, match=r"magnitude 1e\+07 is past what an fp16 row scale can hold at int6"):
        rtn_quantize(huge, 6)
    with pytest.raises(ValueError, match="past what an fp16 row scale can hold at int5"):
        gptq_quantize(huge, torch.eye(8), bits_list=(5,))
    from quant.schemes import naming  # an embedding table's refusal names the table
    with pytest.raises(ValueError, match=r"^embed.weight: a weight of magnitude 1e\+08 is past .* at int8"):
        with naming("embed.weight"):
            rtn_quantize(torch.full((4, 8), 1e8), 8)


class TwoLinears(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.a = nn.Linear(16, 24)
        self.b = nn.Linear(24, 50, bias=False)
        self.unused = nn.Linear(16, 16)

    def forward(self, ids):
        return self.b(torch.relu(self.a(self.embed(ids))))


def test_hessian_hooks_match_manual_xtx_and_are_removed():
    torch.manual_seed(3)
    model = TwoLinears()
    batches = [torch.randint(0, 50, (2, 7)), torch.randint(0, 50, (3, 5))]
    result = calibrate(model, {"a.weight": model.a, "b.weight": model.b}, batches)
    hessians, tokens = result.hessians, result.tokens
    assert tokens == 29
    x = torch.cat([model.embed(ids).reshape(-1, 16) for ids in batches]).detach()
    torch.testing.assert_close(hessians["a.weight"], x.T @ x / 29)
    h = torch.relu(model.a(x)).detach()
    torch.testing.assert_close(hessians["b.weight"], h.T @ h / 29)
    assert not model.a._forward_hooks and not model.b._forward_hooks


def test_hessians_under_autocast_see_the_autocast_activations():
    """With autocast_dtype the hooked inputs are what the autocast forward computes (bf16 here, as the
    shipped model runs on a GPU), accumulated in fp32."""
    torch.manual_seed(3)
    model = TwoLinears()
    batches = [torch.randint(0, 50, (4, 9))]
    seen = []
    model.b.register_forward_hook(lambda m, inp, out: seen.append(inp[0].dtype))
    h_bf16 = calibrate(model, {"b.weight": model.b}, batches, autocast_dtype=torch.bfloat16).hessians
    h_fp32 = calibrate(model, {"b.weight": model.b}, batches).hessians
    assert seen == [torch.bfloat16, torch.float32]
    assert h_bf16["b.weight"].dtype == torch.float32
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        h = torch.relu(model.a(model.embed(batches[0]))).reshape(-1, 24).float()
    torch.testing.assert_close(h_bf16["b.weight"], h.T @ h / 36)
    assert not torch.equal(h_bf16["b.weight"], h_fp32["b.weight"])


def test_hessians_refuse_uncalibrated_modules_and_empty_input():
    model = TwoLinears()
    with pytest.raises(RuntimeError, match="never saw the inputs.*unused.weight"):
        calibrate(model, {"unused.weight": model.unused}, [torch.zeros(1, 4, dtype=torch.long)])
    with pytest.raises(ValueError, match="no batches"):
        calibrate(model, {"a.weight": model.a}, [])
    with pytest.raises(TypeError, match="nn.Linear"):
        HessianCollector({"embed": model.embed})


def test_generate_calibration_tokens():
    torch.manual_seed(4)
    model = TwoLinears().train()
    ids = generate_calibration_tokens(model, n_seqs=5, seq_len=9, bos_id=1, temperature=0.8, seed=7, batch_size=2)
    assert ids.shape == (5, 9) and ids.dtype == torch.long
    assert (ids[:, 0] == 1).all() and int(ids.max()) < 50
    assert model.training  # mode restored
    again = generate_calibration_tokens(model, n_seqs=5, seq_len=9, bos_id=1, temperature=0.8, seed=7, batch_size=2)
    assert torch.equal(ids, again)
    other = generate_calibration_tokens(model, n_seqs=5, seq_len=9, bos_id=1, temperature=0.8, seed=8, batch_size=2)
    assert not torch.equal(ids, other)
    # Very low temperature is greedy decoding: the argmax continuation.
    greedy = generate_calibration_tokens(model, 1, 4, bos_id=2, temperature=1e-4, seed=0)
    with torch.no_grad():
        assert int(greedy[0, 1]) == int(model(greedy[:, :1])[0, -1].argmax())
    with pytest.raises(ValueError, match="temperature"):
        generate_calibration_tokens(model, 1, 4, temperature=0.0)


def test_gptq_codes_do_not_depend_on_the_hessians_scale():
    """GPTQ is invariant to H's scale; at H ~ 1e-42 the second Cholesky used to fail with a bare _LinAlgError."""
    torch.manual_seed(0)
    w = torch.randn(16, 64)
    x = torch.randn(512, 64)
    x[:, 3] = 0  # a dead column
    h = x.T @ x / 512
    base = gptq_quantize(w, h, (5,))[5][0]
    for scale in (1e-30, 1e12):
        assert (gptq_quantize(w, h * scale, (5,))[5][0].codes == base.codes).all(), scale
    tiny = gptq_quantize(w, h * 1e-42, (5,))[5][0]  # subnormal entries: codes close, and no error
    assert (tiny.codes != base.codes).mean() < 0.05
