"""quant/lowrank.py and scripts/bench_lowrank.py: the low-rank correction screen against the allocator's next grid."""
import re

import pytest
import torch

from conftest import REPO
from model.gpt import GPT
from quant.export import plan_tensors
from quant import lowrank
from quant.rd import ErrorModel, tensor_options
from scripts import bench_lowrank
from training.config import load_config
from training.export import observed_patterns


def hessian(cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2048, cols, generator=g) @ (torch.eye(cols) + 0.3 * torch.randn(cols, cols, generator=g))
    return x.T @ x / len(x)


def test_the_singular_values_hold_the_allocators_error_and_the_best_rank_r_correction_removes_their_top():
    """Σσ² is the weighted error Σ_r w_r Δ_r H Δ_rᵀ that quant/rd.py prices; the correction built from the top r
    singular directions (A·B = D^-½ U_r S_r V_rᵀ R^-1) leaves exactly the rest."""
    g = torch.Generator().manual_seed(1)
    delta, h, rw = torch.randn(24, 32, generator=g), hessian(32, 2), torch.rand(24, generator=g) + 0.5
    sv = lowrank.weighted_singular_values(delta, h, rw)
    error = float((rw.double() * ((delta.double() @ h.double()) * delta.double()).sum(dim=1)).sum())
    assert float((sv ** 2).sum()) == pytest.approx(error, rel=1e-9)
    evals, evecs = torch.linalg.eigh(h.double())
    root = evecs * evals.sqrt()
    u, s, vt = torch.linalg.svd(rw.double().sqrt()[:, None] * (delta.double() @ root))
    r = 3
    correction = (u[:, :r] * s[:r] @ vt[:r]) @ torch.linalg.inv(root) / rw.double().sqrt()[:, None]
    rest = lowrank.weighted_singular_values(delta.double() - correction, h, rw)
    assert float((rest ** 2).sum()) == pytest.approx(float((sv[r:] ** 2).sum()), rel=1e-6)
    assert float((sv[:r] ** 2).sum()) > r / 24 * error  # the top directions hold more than an even share


def test_a_low_rank_error_favours_the_correction_and_a_plain_matrix_the_next_grid():
    """A weight whose rounding error is mostly one direction (rows that are multiples of one vector, rounded on one
    grid) against a random one: the screen's share and ratio tell them apart."""
    g = torch.Generator().manual_seed(3)
    h = hessian(64, 4)
    plain = torch.randn(64, 64, generator=g) * 0.02
    shared = torch.randn(1, 64, generator=g) * 0.02 * torch.ones(64, 1)  # every row the same: one rounding error
    low = lowrank.screen_matrix("shared", shared, ErrorModel(h), "rtn", 3.0, 1, 4)
    high = lowrank.screen_matrix("plain", plain, ErrorModel(h), "rtn", 3.0, 1, 4)
    assert low.top_share > 0.99 and high.top_share < 0.2
    assert low.ratio > high.ratio
    assert low.lowrank_bytes == lowrank.factor_bytes(64, 64, 1, 4) == 1 * 128 * 4 / 8 + 2 * 65


def test_the_reference_is_the_grid_nearest_the_bits_that_has_a_finer_one():
    w, h = torch.randn(32, 48) * 0.02, hessian(48, 5)
    options = tensor_options(w, ErrorModel(h), "gptq")
    screen = lowrank.screen_matrix("w", w, ErrorModel(h), "gptq", 3.0, 4, 4)
    bits = sorted(8 * o.est_bytes / w.numel() for o in options)
    assert screen.bits_per_param == min(bits[:-1], key=lambda b: abs(b - 3.0))
    finest = lowrank.screen_matrix("w", w, ErrorModel(h), "gptq", 8.0, 4, 4)
    assert finest.bits_per_param == bits[-2]  # the finest grid has none finer to compare with
    assert finest.grid_gain > 0 and finest.grid_bytes > 0
    # tables (a lookup term) and tensors without a Hessian are not screened
    assert lowrank.screen_matrix("t", w, ErrorModel(h, lookup=torch.ones(32, 1)), "gptq", 3.0, 4, 4) is None
    assert lowrank.screen_matrix("t", w, ErrorModel(), "rtn", 3.0, 4, 4) is None
    assert lowrank.reference_option(options[:1], w.numel(), 3.0) is None


def test_the_tool_screens_every_matrix_of_a_checkpoint(tiny_checkpoint, capsys):
    ckpt, overrides = tiny_checkpoint
    bench_lowrank.main(["--config", str(REPO / "configs/demo.toml"), "--checkpoint", str(ckpt), "--rank", "2",
                        "--top", "3", "--", *overrides])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| matrix")]
    assert len(rows) == 3
    ratios = [float(row.strip("|").split("|")[-1]) for row in rows]
    assert ratios == sorted(ratios, reverse=True)
    found = re.search(r"(\d+) of (\d+) matrices: a rank-2 correction", out)
    model = GPT(load_config(str(REPO / "configs/demo.toml"), overrides).model)
    plan = plan_tensors(model, (), observed_patterns(model))  # every Linear and mHC phi: no table
    assert found and int(found.group(2)) == len(plan.linears) + len(plan.observed) > 0
    assert int(found.group(1)) <= int(found.group(2)) and plan.observed
    assert "(ema weights)" in out or "(model weights)" in out


@pytest.mark.parametrize("flags, message", [(["--rank", "0"], "--rank 0: expected a number >= 1"),
                                            (["--bits", "9"], "--bits 9.0: expected at most 8"),
                                            (["--factor-bits", "1"], "--factor-bits 1: expected a number >= 2")])
def test_bad_flags_are_named(tiny_checkpoint, flags, message, capsys):
    ckpt, _ = tiny_checkpoint
    with pytest.raises(SystemExit):
        bench_lowrank.main(["--config", str(REPO / "configs/demo.toml"), "--checkpoint", str(ckpt), *flags])
    assert message in capsys.readouterr().err


def test_a_missing_checkpoint_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench_lowrank.main(["--config", str(REPO / "configs/demo.toml"), "--checkpoint", str(tmp_path)])
    assert "no rank0.pt and not an artifact" in capsys.readouterr().err


def test_the_summary_counts_the_error_the_paying_corrections_would_remove():
    """The verdict's weight: the gain of the corrections with a ratio above 1, against all screened error."""
    def screen(name, error, lowrank_gain, lowrank_bytes):
        return lowrank.Screen(name, (8, 8), 3.0, error, 1e-3, 1000.0, lowrank_gain, lowrank_bytes,
                              lowrank_gain / error)
    screens = [screen("pays", 0.01, 2e-3, 1000.0),      # 2e-6 a byte against the grid's 1e-6: ratio 2
               screen("pays too", 0.03, 3e-3, 2000.0),  # ratio 1.5
               screen("does not", 0.16, 5e-4, 1000.0)]  # ratio 0.5: its gain is not counted
    assert [round(s.ratio, 6) for s in screens] == [2.0, 1.5, 0.5]
    out = bench_lowrank.format_table(screens, top=1, rank=4)
    assert "2 of 3 matrices: a rank-4 correction" in out
    assert "would remove 5.000e-03 of the screened matrices' 2.000e-01 weighted error (2.50%) for 3,000 bytes" in out
