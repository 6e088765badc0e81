"""Newton-Schulz, Muon, optimizer construction, lr/momentum setting and gradient clipping (1 process)."""
import copy

import pytest
import torch
import torch.nn as nn

from training.config import OptimConfig
from training.distributed import optimizer_step
from training.optim import (Muon, build_optimizers, check_param_groups, clip_grad_norm_, muon_momentum_at,
                            set_lr_and_momentum, zeropower_via_newtonschulz5)


@pytest.mark.parametrize("shape", [(32, 64), (128, 48), (3, 16, 40), (2, 2, 50, 20), (256, 96)])
def test_newton_schulz_singular_values_near_one(shape):
    G = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    X = zeropower_via_newtonschulz5(G, steps=5)
    assert X.shape == G.shape and X.dtype == G.dtype
    s = torch.linalg.svdvals(X)
    assert s.min() > 0.5 and s.max() < 1.5, (s.min(), s.max())  # the quintic settles in ~[0.68, 1.13]
    assert 0.75 < s.mean() < 1.1
    # Same singular vectors as the exact polar factor U V^T: high cosine similarity with it.
    U, _, Vh = torch.linalg.svd(G, full_matrices=False)
    polar = U @ Vh
    cos = (X * polar).sum(dim=(-2, -1)) / (X.norm(dim=(-2, -1)) * polar.norm(dim=(-2, -1)))
    assert cos.min() > 0.95


def test_newton_schulz_square_and_tall_wide_symmetry():
    G = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    s = torch.linalg.svdvals(zeropower_via_newtonschulz5(G))
    # Square Gaussian matrices have a few singular values near 0 that 5 steps cannot lift (a known limit
    # of NS5); the bulk is still in range and none overshoots.
    assert s.max() < 1.5 and ((s > 0.5) & (s < 1.5)).float().mean() > 0.95
    T = torch.randn(80, 24, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(zeropower_via_newtonschulz5(T), zeropower_via_newtonschulz5(T.T).T)
    with pytest.raises(ValueError, match="matrix"):
        zeropower_via_newtonschulz5(torch.randn(5))


def test_ns_steps_changes_the_result():
    G = torch.randn(16, 32, generator=torch.Generator().manual_seed(3))
    s1 = torch.linalg.svdvals(zeropower_via_newtonschulz5(G, steps=1))
    s5 = torch.linalg.svdvals(zeropower_via_newtonschulz5(G, steps=5))
    assert (s5 - 1).abs().max() < (s1 - 1).abs().max()


def test_muon_reduces_a_quadratic_loss():
    g = torch.Generator().manual_seed(0)
    # Muon moves every singular direction by ~lr per step, so the target's spectrum must be reachable.
    target = 0.2 * torch.randn(24, 16, generator=g)
    W = nn.Parameter(torch.zeros(24, 16))
    opt = Muon([W], lr=0.05, momentum=0.9)
    losses = []
    for _ in range(60):
        loss = ((W - target) ** 2).sum()
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert losses[-1] < 0.01 * losses[0], (losses[0], losses[-1])


def test_muon_weight_decay_is_decoupled():
    W = nn.Parameter(torch.randn(8, 4))
    before = W.detach().clone()
    opt = Muon([W], lr=0.1, momentum=0.0, weight_decay=0.5)
    W.grad = torch.zeros_like(W)
    opt.step()
    torch.testing.assert_close(W.detach(), before * (1 - 0.1 * 0.5), rtol=0, atol=1e-7)


def test_muon_step_matches_the_per_matrix_formula():
    """Two steps on matrices of mixed shapes (several buckets) against the textbook update, per matrix."""
    g = torch.Generator().manual_seed(4)
    shapes = [(12, 8), (8, 12), (12, 8), (6, 6), (12, 8)]
    params = [nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    ref = [p.detach().clone() for p in params]
    bufs = [torch.zeros_like(p) for p in ref]
    lr, beta, wd = 0.03, 0.8, 0.1
    opt = Muon([{"params": params[:3]}, {"params": params[3:], "lr": 2 * lr}], lr=lr, momentum=beta,
               weight_decay=wd, ns_steps=4)
    for _ in range(2):
        grads = [torch.randn(s, generator=g) for s in shapes]
        for p, gr in zip(params, grads):
            p.grad = gr.clone()
        opt.step()
        for i, gr in enumerate(grads):
            lr_i = lr if i < 3 else 2 * lr
            bufs[i] = beta * bufs[i] + (1 - beta) * gr
            update = zeropower_via_newtonschulz5(gr + beta * (bufs[i] - gr), steps=4)
            scale = max(1.0, shapes[i][0] / shapes[i][1]) ** 0.5
            ref[i] = ref[i] * (1 - lr_i * wd) - lr_i * scale * update
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.detach(), r, rtol=1e-5, atol=1e-6)


def test_muon_state_dict_round_trip_keeps_lr_control():
    """After load_state_dict (which replaces the group dicts) the schedule must still reach the update."""
    g = torch.Generator().manual_seed(5)
    a, b = nn.Parameter(torch.randn(6, 4, generator=g)), nn.Parameter(torch.zeros(6, 4))
    with torch.no_grad():
        b.copy_(a)
    opt_a, opt_b = Muon([a], lr=0.1, momentum=0.9), Muon([b], lr=0.7, momentum=0.5)
    for p, opt in ((a, opt_a), (b, opt_b)):  # both have stepped (built their layouts) before the load
        p.grad = torch.randn(6, 4, generator=g)
        opt.step()
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))  # as from disk: no shared buffers
    with torch.no_grad():
        b.copy_(a)
    grad = torch.randn(6, 4, generator=g)
    for opt, p in ((opt_a, a), (opt_b, b)):
        opt.param_groups[0]["lr"] = 0.02
        p.grad = grad.clone()
        opt.step()
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_muon_rejects_vectors_and_missing_grads():
    with pytest.raises(ValueError, match="not a matrix"):
        Muon([nn.Parameter(torch.zeros(5))])
    opt = Muon([nn.Parameter(torch.zeros(3, 3))])
    with pytest.raises(RuntimeError, match="no gradient"):
        opt.step()


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8, bias=False), nn.Linear(8, 16, bias=False)])
        self.gain = nn.Parameter(torch.ones(16))
        self.bias = nn.Parameter(torch.zeros(16))

    def param_groups(self):
        return {"matrix": [b.weight for b in self.blocks], "embed": [self.embed.weight],
                "scalar": [self.gain, self.bias]}

    def forward(self, idx):
        x = self.embed(idx)
        x = torch.relu(self.blocks[0](x))
        return (self.blocks[1](x) * self.gain + self.bias).square().mean()


def custom_cfg() -> OptimConfig:
    return OptimConfig(matrix_lr=0.011, embed_lr=0.022, scalar_lr=0.033, muon_momentum=0.97, ns_steps=3,
                       weight_decay=0.07, adam_beta1=0.8, adam_beta2=0.9)


def test_build_optimizers_groups_and_hyperparameters():
    model, cfg = Tiny(), custom_cfg()
    groups = model.param_groups()
    check_param_groups(model, groups)
    muon, adam = build_optimizers(groups, cfg)
    assert isinstance(muon, Muon) and isinstance(adam, torch.optim.AdamW)
    (mg,) = muon.param_groups
    assert [id(p) for p in mg["params"]] == [id(b.weight) for b in model.blocks]
    assert (mg["lr"], mg["initial_lr"], mg["momentum"], mg["weight_decay"], mg["ns_steps"]) == (
        0.011, 0.011, 0.97, 0.07, 3)
    by_name = {g["name"]: g for g in adam.param_groups}
    assert by_name["embed"]["params"] == [model.embed.weight]
    assert (by_name["embed"]["lr"], by_name["embed"]["initial_lr"], by_name["embed"]["weight_decay"]) == (
        0.022, 0.022, 0.07)
    assert [id(p) for p in by_name["scalar"]["params"]] == [id(model.gain), id(model.bias)]
    assert (by_name["scalar"]["lr"], by_name["scalar"]["weight_decay"]) == (0.033, 0.0)
    assert adam.defaults["betas"] == (0.8, 0.9)


def test_build_optimizers_skips_empty_groups():
    model = Tiny()
    opts = build_optimizers({"matrix": [], "embed": [model.embed.weight], "scalar": []}, custom_cfg())
    assert len(opts) == 1 and [g["name"] for g in opts[0].param_groups] == ["embed"]
    with pytest.raises(ValueError, match="expected keys"):
        build_optimizers({"matrix": []}, custom_cfg())


def test_check_param_groups_names_the_offending_parameter():
    model = Tiny()
    groups = model.param_groups()
    with pytest.raises(ValueError, match="'bias' is in no optimizer group"):
        check_param_groups(model, {**groups, "scalar": [model.gain]})
    with pytest.raises(ValueError, match="'gain' is listed twice"):
        check_param_groups(model, {**groups, "embed": [model.embed.weight, model.gain]})
    with pytest.raises(ValueError, match="'gain' in group 'matrix'"):
        check_param_groups(model, {**groups, "matrix": groups["matrix"] + [model.gain], "scalar": [model.bias]})
    with pytest.raises(ValueError, match="not a parameter of the model"):
        check_param_groups(model, {**groups, "scalar": groups["scalar"] + [nn.Parameter(torch.zeros(2))]})
    with pytest.raises(ValueError, match="expected keys"):
        check_param_groups(model, {"matrix": [], "embed": []})


def test_set_lr_and_momentum_scales_lr_and_warms_momentum():
    cfg = OptimConfig(muon_momentum_start=0.85, muon_momentum=0.95, muon_momentum_warmup_steps=100)
    opts = build_optimizers(Tiny().param_groups(), cfg)
    set_lr_and_momentum(opts, 0.5, step=50, cfg=cfg)
    for opt in opts:
        for g in opt.param_groups:
            assert g["lr"] == pytest.approx(0.5 * g["initial_lr"])
    assert opts[0].param_groups[0]["momentum"] == pytest.approx(0.90)
    assert muon_momentum_at(0, cfg) == pytest.approx(0.85)
    assert muon_momentum_at(100, cfg) == muon_momentum_at(5000, cfg) == pytest.approx(0.95)
    assert muon_momentum_at(7, OptimConfig(muon_momentum_warmup_steps=0)) == OptimConfig().muon_momentum
    with pytest.raises(KeyError, match="initial_lr"):
        set_lr_and_momentum([torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)], 1.0, 0, cfg)


def fill_grads(model: nn.Module, seed: int) -> None:
    model.zero_grad(set_to_none=True)
    model(torch.randint(0, 10, (4, 5), generator=torch.Generator().manual_seed(seed))).backward()


def test_clip_grad_norm_uses_all_groups_and_respects_grad_clip():
    cfg = OptimConfig()  # grad_clip = 0.3
    model = Tiny()
    with torch.no_grad():
        model.gain.mul_(30)  # large gradients: the clip must bite
    opts = build_optimizers(model.param_groups(), cfg)
    fill_grads(model, 0)
    expected = torch.sqrt(sum(p.grad.square().sum() for p in model.parameters()))
    opts[0].sync_grads_async()
    norm = clip_grad_norm_(opts, cfg.grad_clip)
    torch.testing.assert_close(norm, expected)
    assert norm > cfg.grad_clip
    after = torch.sqrt(sum(t.square().sum() for t in opts[0].synced_grads())
                       + sum(p.grad.square().sum() for g in opts[1].param_groups for p in g["params"]))
    torch.testing.assert_close(after, torch.tensor(cfg.grad_clip), rtol=1e-4, atol=0)
    assert clip_grad_norm_(opts, 0.0) is None
    with pytest.raises(ValueError, match="grad_clip"):
        clip_grad_norm_(opts, -1.0)


def test_optimizer_step_single_process_trains_and_clears_grads():
    torch.manual_seed(0)
    model = Tiny()
    cfg = OptimConfig()
    opts = build_optimizers(model.param_groups(), cfg)
    losses = []
    for step in range(30):
        fill_grads(model, seed=0)  # the same batch: loss must fall
        losses.append(model(torch.randint(0, 10, (4, 5), generator=torch.Generator().manual_seed(0))).item())
        set_lr_and_momentum(opts, 1.0, step, cfg)
        norm = optimizer_step(opts, cfg.grad_clip)
        assert norm is not None and torch.isfinite(norm)
        assert all(p.grad is None for p in model.parameters())
    assert losses[-1] < 0.5 * losses[0], (losses[0], losses[-1])
