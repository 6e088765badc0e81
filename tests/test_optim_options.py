"""Optional optimizer settings: MuonEq-R (optim.muon_row_norm) and the weight decay of the AdamW groups
(optim.embed_weight_decay, optim.scalar_weight_decay)."""
import copy
import re

import pytest
import torch
import torch.nn as nn

from test_optim import Tiny
from training.checkpoint import optimizer_settings
from training.config import ConfigError, OptimConfig, load_config
from training.optim import Muon, build_optimizers, normalize_rows_, zeropower_via_newtonschulz5

SHAPES = [(12, 8), (8, 12), (12, 8)]  # tall and wide: the rows are a weight's rows whatever its shape


def muon_steps(grads: list[list[torch.Tensor]], row_norm: bool, momentum: float = 0.8) -> list[torch.Tensor]:
    """The parameters (seeded) after one Muon step per list of gradients."""
    g = torch.Generator().manual_seed(4)
    params = [nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]
    opt = Muon(params, lr=0.03, momentum=momentum, weight_decay=0.1, ns_steps=4, row_norm=row_norm)
    for step in grads:
        for p, grad in zip(params, step):
            p.grad = grad.clone()
        opt.step()
    return [p.detach() for p in params]


def random_grads(steps: int, seed: int = 5) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=g) for s in SHAPES] for _ in range(steps)]


def test_muon_row_norm_scales_each_row_of_the_momentum_update_to_unit_norm_before_newton_schulz():
    """Against the update written out per matrix: Nesterov momentum, rows / their L2 norm, Newton-Schulz."""
    grads = random_grads(2)
    lr, beta, wd = 0.03, 0.8, 0.1
    g = torch.Generator().manual_seed(4)
    ref = [torch.randn(s, generator=g) for s in SHAPES]
    bufs = [torch.zeros(s) for s in SHAPES]
    for step in grads:
        for i, grad in enumerate(step):
            bufs[i] = beta * bufs[i] + (1 - beta) * grad
            nesterov = grad + beta * (bufs[i] - grad)
            rows = torch.stack([r / r.norm() for r in nesterov])  # one row at a time
            update = zeropower_via_newtonschulz5(rows, steps=4)
            scale = max(1.0, SHAPES[i][0] / SHAPES[i][1]) ** 0.5
            ref[i] = ref[i] * (1 - lr * wd) - lr * scale * update
    for got, want in zip(muon_steps(grads, row_norm=True), ref):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    off = muon_steps(grads, row_norm=False)
    assert all((a - b).abs().max() > 1e-4 for a, b in zip(off, ref))  # the option changes the update


# Position-weighted sum of the parameters after muon_steps(random_grads(3), row_norm=False), measured with the Muon
# of commit e0a2f5a, before the option existed (its parameters were bit-identical to these on the machine it was
# measured on; rel 1e-6 leaves room for another BLAS).
PLAIN_MUON_FINGERPRINT = -20.897598026957994


def test_muon_row_norm_off_is_the_update_before_the_option():
    params = muon_steps(random_grads(3), row_norm=False)
    flat = torch.cat([p.flatten() for p in params]).double()
    fingerprint = float((flat * torch.cos(torch.arange(flat.numel(), dtype=torch.float64))).sum())
    assert fingerprint == pytest.approx(PLAIN_MUON_FINGERPRINT, rel=1e-6)
    assert Muon([nn.Parameter(torch.zeros(2, 2))]).param_groups[0]["row_norm"] is False  # off unless asked for


def test_muon_row_norm_makes_the_step_blind_to_the_scale_of_each_gradient_row():
    """What the normalization is for: a row with a 100x larger gradient no longer dominates the orthogonalization."""
    (grads,) = random_grads(1)
    scaled = [grad * torch.logspace(-1, 1, grad.shape[0]).unsqueeze(1) for grad in grads]
    for row_norm, same in ((True, True), (False, False)):
        a, b = muon_steps([grads], row_norm, momentum=0.0), muon_steps([scaled], row_norm, momentum=0.0)
        assert all(torch.allclose(x, y, atol=1e-5) for x, y in zip(a, b)) == same


def test_normalize_rows_keeps_a_zero_row_at_zero_and_works_on_a_stack():
    G = torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(6))
    G[1, 2] = 0
    out = normalize_rows_(G.clone())
    norms = out.norm(dim=-1)
    assert norms[1, 2] == 0 and torch.isfinite(out).all()
    norms[1, 2] = 1
    torch.testing.assert_close(norms, torch.ones(3, 5))
    half = normalize_rows_(G.clone().bfloat16())  # norms in fp32, the result in G's dtype
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), out, rtol=1e-2, atol=1e-2)


def test_a_checkpoint_from_before_row_norm_loads_as_row_norm_off():
    """load_state_dict replaces the param groups with the saved ones; a group saved without the key trained
    without the normalization (and the checkpoint's settings check then refuses a resume that turns it on)."""
    p = nn.Parameter(torch.randn(6, 4))
    p.grad = torch.randn(6, 4)
    old = Muon([p])
    old.step()
    state = copy.deepcopy(old.state_dict())
    del state["param_groups"][0]["row_norm"]
    new = Muon([p], row_norm=True)
    configured = optimizer_settings([new])
    new.load_state_dict(state)
    assert new.param_groups[0]["row_norm"] is False
    assert configured[("?", "row_norm")] is True and optimizer_settings([new])[("?", "row_norm")] is False
    p.grad = torch.randn(6, 4)
    new.step()


def test_build_optimizers_passes_row_norm_and_the_groups_weight_decays():
    model = Tiny()
    default, = [g["weight_decay"] for g in build_optimizers(model.param_groups(), OptimConfig())[1].param_groups
                if g["name"] == "embed"]
    assert default == OptimConfig().weight_decay  # -1: the embedding decays as the matrices do
    cfg = OptimConfig(weight_decay=0.09, embed_weight_decay=0.2, scalar_weight_decay=0.01, muon_row_norm=True)
    muon, adam = build_optimizers(model.param_groups(), cfg)
    assert (muon.param_groups[0]["weight_decay"], muon.param_groups[0]["row_norm"]) == (0.09, True)
    assert {g["name"]: g["weight_decay"] for g in adam.param_groups} == {"embed": 0.2, "scalar": 0.01}
    zero = build_optimizers(model.param_groups(), OptimConfig(embed_weight_decay=0.0))[1]
    assert [g["weight_decay"] for g in zero.param_groups] == [0.0, 0.0]


def test_each_group_decays_by_its_own_weight_decay():
    """With zero gradients AdamW's and Muon's steps are their decoupled decay alone: p <- p * (1 - lr * wd)."""
    model = Tiny()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    cfg = OptimConfig(weight_decay=0.1, embed_weight_decay=0.3, scalar_weight_decay=0.05)
    opts = build_optimizers(model.param_groups(), cfg)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    for opt in opts:
        opt.step()
    decay = {"embed": cfg.embed_lr * 0.3, "blocks": cfg.matrix_lr * 0.1, "gain": cfg.scalar_lr * 0.05,
             "bias": cfg.scalar_lr * 0.05}
    for name, p in model.named_parameters():
        rate = next(v for k, v in decay.items() if name.startswith(k))
        torch.testing.assert_close(p.detach(), before[name] * (1 - rate), rtol=1e-6, atol=0)


@pytest.mark.parametrize("override,message", [
    ("optim.embed_weight_decay=-0.5", "optim.embed_weight_decay=-0.5 must be >= 0, or -1 for optim.weight_decay"),
    ("optim.embed_weight_decay=-2", "optim.embed_weight_decay=-2.0 must be >= 0, or -1"),
    ("optim.scalar_weight_decay=-0.01", "optim.scalar_weight_decay=-0.01 must be >= 0"),
    ("optim.muon_row_norm=maybe", "optim.muon_row_norm: expected true/false"),
])
def test_bad_optimizer_options_name_the_field(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, [override])


def test_the_records_optimizer_values_load():
    """The April-2026 records' settings are all expressible: momentum 0.97 warmed from 0.92 over 1500 steps, EMA
    0.9965, warmdown over the last 72%, LR floor 0.10, Muon/embedding/scalar weight decay 0.095/0.085/0.02."""
    cfg = load_config(None, ["optim.muon_momentum=0.97", "optim.muon_momentum_start=0.92",
                             "optim.muon_momentum_warmup_steps=1500", "optim.ema_decay=0.9965",
                             "optim.warmdown_frac=0.72", "optim.lr_floor=0.10", "optim.weight_decay=0.095",
                             "optim.embed_weight_decay=0.085", "optim.scalar_weight_decay=0.02",
                             "optim.muon_row_norm=true", "model.qk_gain_init=5.25", "model.mlp_mult=4"])
    assert (cfg.optim.muon_row_norm, cfg.optim.embed_weight_decay, cfg.model.qk_gain_init) == (True, 0.085, 5.25)
    assert load_config(None, ["optim.embed_weight_decay=-1"]).optim.embed_weight_decay == -1
