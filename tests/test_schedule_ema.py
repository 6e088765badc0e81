"""LR schedule (warmup, plateau, warmdown, floor) and the warmed-up weight EMA."""
import pytest
import torch
import torch.nn as nn

from training.config import OptimConfig
from training.ema import EMA, maybe_ema
from training.schedule import lr_multiplier


def test_warmup_ramps_by_step_from_one_over_warmup_steps():
    cfg = OptimConfig(warmup_steps=20)
    assert lr_multiplier(0.0, 0, cfg) == pytest.approx(1 / 20)
    assert lr_multiplier(0.01, 9, cfg) == pytest.approx(0.5)
    assert lr_multiplier(0.02, 19, cfg) == 1.0
    assert lr_multiplier(0.0, 0, OptimConfig(warmup_steps=0)) == 1.0


def test_plateau_then_linear_warmdown_to_the_floor():
    cfg = OptimConfig(warmup_steps=5, warmdown_frac=0.4, lr_floor=0.05)
    assert lr_multiplier(0.3, 100, cfg) == 1.0
    assert lr_multiplier(0.6, 100, cfg) == 1.0          # warmdown starts at progress 1 - 0.4
    assert lr_multiplier(0.8, 100, cfg) == pytest.approx(0.5)
    assert lr_multiplier(0.9, 100, cfg) == pytest.approx(0.25)
    assert lr_multiplier(1.0, 100, cfg) == 0.05         # exactly the floor at the end
    assert lr_multiplier(0.99, 100, cfg) == 0.05        # (1 - 0.99) / 0.4 = 0.025 is below the floor
    assert lr_multiplier(1.3, 100, cfg) == 0.05         # an overshot time budget counts as progress 1
    assert lr_multiplier(0.99, 100, OptimConfig(warmdown_frac=0.0)) == 1.0
    assert lr_multiplier(1.0, 100, OptimConfig(lr_floor=0.0)) == 0.0


@pytest.mark.parametrize("source", ["steps", "time"])
def test_floor_is_never_crossed_for_either_progress_source(source):
    cfg = OptimConfig(warmup_steps=20, warmdown_frac=0.5, lr_floor=0.05)
    max_steps, budget_s, step_s = 200, 60.0, 0.29  # time: ~207 steps of 0.29 s fit in 60 s
    mults = []
    for step in range(10_000):
        progress = step / max_steps if source == "steps" else step * step_s / budget_s
        if progress > 1.0:
            break
        mults.append(lr_multiplier(progress, step, cfg))
    assert min(mults[cfg.warmup_steps:]) == 0.05 and mults[-1] == 0.05
    assert max(mults) == 1.0
    assert all(a <= b for a, b in zip(mults[:20], mults[1:20]))  # warmup rises
    assert all(a >= b for a, b in zip(mults[20:], mults[21:]))   # then never rises again


def test_short_run_takes_the_smaller_of_warmup_and_warmdown():
    cfg = OptimConfig(warmup_steps=20, warmdown_frac=0.5, lr_floor=0.05)
    assert lr_multiplier(0.8, 3, cfg) == pytest.approx(min(4 / 20, 0.4))
    assert lr_multiplier(0.95, 15, cfg) == pytest.approx(0.1)


@pytest.mark.parametrize("field,value", [("warmdown_frac", 1.5), ("lr_floor", -0.1), ("warmup_steps", -1)])
def test_schedule_rejects_bad_config(field, value):
    with pytest.raises(ValueError, match=f"optim.{field}"):
        lr_multiplier(0.5, 1, OptimConfig(**{field: value}))
    with pytest.raises(ValueError, match="progress"):
        lr_multiplier(-0.1, 1, OptimConfig())


class Net(nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.lin = nn.Linear(4, 3).to(dtype)
        self.register_buffer("running", torch.zeros(3, dtype=dtype))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        self.register_buffer("table", torch.ones(2, dtype=dtype), persistent=False)  # derived, like the rotary tables


def test_decay_warmup_formula():
    ema = EMA(Net(), decay=0.997, warmup_steps=10)
    assert ema.decay_at(0) == pytest.approx(1 / 10)
    assert ema.decay_at(1) == pytest.approx(2 / 11)
    assert ema.decay_at(10) == pytest.approx(11 / 20)
    assert ema.decay_at(1000) == pytest.approx(1001 / 1010)
    assert ema.decay_at(10**6) == 0.997
    # the integer buffer is not averaged; the non-persistent one is not either: no checkpoint holds it
    assert ema.names == ["lin.weight", "lin.bias", "running"]


def test_ema_names_are_what_a_checkpoint_holds():
    """bench_quant and resume put EMA shadows into state dicts by name, so each name must be in one."""
    from model.gpt import GPT
    from model.config import ModelConfig
    model = GPT(ModelConfig(vocab_size=64, n_layers=2, d_model=32, n_heads=2, n_kv_heads=1))
    ema = EMA(model, decay=0.9, warmup_steps=1)
    assert set(ema.names) <= set(model.state_dict())
    assert not any("rope" in n for n in ema.names)
    ema.update(model, 0)  # the live tensors still match the names


def initial_share_after(cfg: OptimConfig, steps: int) -> float:
    """Fraction of the EMA still made of the initial weights after `steps` updates at new weights."""
    torch.manual_seed(0)
    net = Net()
    w0 = net.lin.weight.detach().clone()
    ema = maybe_ema(net, cfg)
    with torch.no_grad():
        net.lin.weight.add_(1.0)  # training moved every weight by +1
    for step in range(steps):
        ema.update(net, step)
    return (1.0 - (ema.shadow[0] - w0).mean()).item()


def test_short_run_ema_is_not_dominated_by_initial_weights():
    warm = initial_share_after(OptimConfig(ema_decay=0.997, ema_warmup_steps=10), steps=20)
    fixed = initial_share_after(OptimConfig(ema_decay=0.997, ema_warmup_steps=1), steps=20)
    assert fixed == pytest.approx(0.997**20, abs=1e-5)   # ~0.94: a fixed decay keeps the init weights
    assert warm == pytest.approx(1 / 10015005, abs=1e-6)  # prod (1+t)/(10+t), t < 20 = 1/C(29, 9)
    assert warm < 1e-3


def test_update_tracks_buffers_and_bf16_models_in_fp32():
    net = Net(torch.bfloat16)
    ema = EMA(net, decay=0.5, warmup_steps=10)
    assert all(s.dtype == torch.float32 for s in ema.shadow)
    with torch.no_grad():
        net.running.fill_(2.0)
    ema.update(net, step=100)  # decay_at = min(0.5, 101 / 110) = 0.5
    torch.testing.assert_close(ema.shadow[2], torch.full((3,), 1.0))


def test_swapped_into_restores_live_weights_exactly():
    torch.manual_seed(0)
    net = Net()
    ema = EMA(net, decay=0.9, warmup_steps=1)
    with torch.no_grad():
        for p in net.parameters():
            p.mul_(3.0).add_(0.123)
    live = {k: v.clone() for k, v in net.state_dict().items()}
    ema.update(net, 5)
    with ema.swapped_into(net) as m:
        assert m is net
        torch.testing.assert_close(net.lin.weight, ema.shadow[0], rtol=0, atol=0)
        assert not torch.equal(net.lin.weight, live["lin.weight"])
    for k, v in net.state_dict().items():
        assert torch.equal(v, live[k]), k
    with pytest.raises(RuntimeError, match="boom"):
        with ema.swapped_into(net):
            raise RuntimeError("boom")
    assert torch.equal(net.lin.weight, live["lin.weight"])


def test_copy_to_and_state_dict_round_trip():
    torch.manual_seed(0)
    a, b = Net(), Net()
    ema_a = EMA(a, decay=0.99, warmup_steps=10)
    with torch.no_grad():
        a.lin.weight.add_(1.0)
    ema_a.update(a, 3)
    ema_b = EMA(b, decay=0.5, warmup_steps=2)
    ema_b.load_state_dict(ema_a.state_dict())
    assert (ema_b.decay, ema_b.warmup_steps) == (0.99, 10)
    ema_b.copy_to(b)
    torch.testing.assert_close(b.lin.weight, ema_a.shadow[0], rtol=0, atol=0)
    bad = ema_a.state_dict()
    bad["shadow"] = {**bad["shadow"], "running": torch.zeros(5)}
    with pytest.raises(ValueError, match="'running' has shape"):
        ema_b.load_state_dict(bad)
    with pytest.raises(ValueError, match="names differ"):
        ema_b.load_state_dict({"shadow": {"x": torch.zeros(1)}, "decay": 0.9, "warmup_steps": 1})


def test_maybe_ema_and_bad_decay():
    assert maybe_ema(Net(), OptimConfig(ema_decay=0.0)) is None
    assert isinstance(maybe_ema(Net(), OptimConfig()), EMA)
    with pytest.raises(ValueError, match="ema_decay"):
        maybe_ema(Net(), OptimConfig(ema_decay=1.0))
    with pytest.raises(ValueError, match="ema_warmup_steps"):
        maybe_ema(Net(), OptimConfig(ema_warmup_steps=0))
