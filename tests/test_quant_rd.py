"""The rate–distortion scheme: step-size grids, the exact knapsack, the measured budget loop, tables by GPTQ."""
import itertools
import re
import json
import lzma
import time

import numpy as np
import pytest
import torch

from quant.container import build_artifact, load_artifact, parse_artifact, ArtifactError
from quant.export import export_artifact
from quant.knapsack import Infeasible, fill, solve, total
from quant.gptq import Rounded
from quant.pack import QuantizedTensor, qmax_for
from quant.rd import ErrorModel, Option, RDBudgetError, allocate, estimated_bytes, evaluate_candidates, scale_errors, \
    tensor_options
from quant.steps import row_bases, sdclip_candidate, step_candidates, step_grid
from test_quant_observed import META, batches, mhc_model


def weights(rows=24, cols=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g)


def test_every_grid_family_round_trips_bit_for_bit(tmp_path):
    w = weights()
    h = torch.eye(64) + 0.1
    cands = step_candidates(w, torch.rand(24), steps=(0.05, 0.4, 1.5))
    assert {c.family for c in cands} == {"std", "weighted"} and len(cands) == 6
    options = evaluate_candidates(w, ErrorModel(h), "gptq", cands)
    values = {f"t{i}": o.value for i, o in enumerate(options)}
    for o in options:  # the device-side values are what ships
        assert torch.equal(o.rounded.dequantize(), o.value.dequantize())
    data = build_artifact(META, values)
    _, stored = parse_artifact(data, "a", stored=True)
    _, loaded = parse_artifact(data, "a")
    for name, qt in values.items():
        s = stored[name]
        assert np.array_equal(s.codes, qt.codes) and np.array_equal(s.scales.view(np.uint16), qt.scales.view(np.uint16))
        assert (s.family, s.step, s.bits) == (qt.family, qt.step, qt.bits)
        assert torch.equal(loaded[name], qt.dequantize())


def test_a_grid_takes_the_narrowest_width_that_reaches_its_largest_weight():
    w = weights()
    base = row_bases(w, "std")
    for step in (0.04, 0.1, 0.4, 1.0):
        grid = step_grid(w, base, step)
        reach = float((w.abs().amax(1) / grid.scales[0]).max())
        assert qmax_for(grid.bits) >= reach or grid.bits == 8
        narrower = [b for b in (4, 5, 6, 8) if b < grid.bits]
        assert all(qmax_for(b) < reach for b in narrower)
    w[3, 5] = 8 * base[3]  # an outlier 200 steps of 0.04 out
    fine = step_grid(w, row_bases(w, "std"), 0.04)
    assert fine.bits == 8 and (w.abs().amax(1) / fine.scales[0]).max() > 127  # int8 clips what it cannot reach
    rec = sdclip_candidate(w, table=False)
    assert rec.grid.bits == 6 and torch.equal(rec.grid.scales[0], (12.85 / 31 * row_bases(w, "std")).half().float())
    assert sdclip_candidate(w, table=True).grid.bits == 8
    with pytest.raises(ValueError, match="a step must be a positive finite number"):
        step_grid(w, base, float("nan"))


def test_weighted_rows_get_finer_steps_and_unseen_rows_a_bounded_one():
    w = weights()
    rw = torch.ones(24)
    rw[0], rw[1] = 16.0, 0.0
    base = row_bases(w, "weighted", rw)
    sigma = float(w.std(unbiased=False))
    others = base[2:]
    assert torch.allclose(others, others[0].expand_as(others))
    assert base[0] < others[0] < base[1] <= 4 * sigma + 1e-6 and base[0] >= sigma / 4 - 1e-6
    assert torch.allclose(row_bases(w, "weighted"), torch.full((24,), sigma))  # no weights: one step for all
    with pytest.raises(ValueError, match="unknown step family 'max'"):
        row_bases(w, "max")


def brute_force(options, capacity):
    names = sorted(options)
    best = None
    for combo in itertools.product(*(range(len(options[n])) for n in names)):
        e = sum(options[n][i][0] for n, i in zip(names, combo))
        b = sum(options[n][i][1] for n, i in zip(names, combo))
        if b <= capacity and (best is None or e < best):
            best = e
    return best


@pytest.mark.parametrize("seed", range(40))
def test_the_knapsack_is_optimal_on_small_problems(seed):
    rng = np.random.default_rng(seed)
    options = {f"m{i}": [(float(rng.uniform(0, 10)), int(rng.integers(1, 60))) for _ in range(rng.integers(1, 6))]
               for i in range(rng.integers(1, 6))}
    smallest = sum(min(b for _, b in o) for o in options.values())
    largest = sum(max(b for _, b in o) for o in options.values())
    capacity = int(rng.integers(smallest, largest + 1))
    picked = solve(options, capacity)
    error, nbytes = total(options, picked)
    assert nbytes <= capacity and error == pytest.approx(brute_force(options, capacity))
    with pytest.raises(Infeasible, match="over the capacity"):
        solve(options, smallest - 1)


def test_coarse_units_still_fit_and_fill_spends_what_rounding_left():
    rng = np.random.default_rng(3)
    options = {f"m{i}": sorted([(float(e), float(b)) for e, b in zip(rng.uniform(0, 1, 8), rng.uniform(1e3, 1e5, 8))])
               for i in range(30)}
    capacity = 1.2e6
    coarse = solve(options, capacity, buckets=64)  # units of 18,750 bytes
    filled = fill(options, coarse, capacity)
    assert total(options, coarse)[1] <= capacity and total(options, filled)[1] <= capacity
    assert total(options, filled)[0] <= total(options, coarse)[0]
    fine = solve(options, capacity, buckets=1 << 16)
    assert total(options, fine)[0] <= total(options, coarse)[0]


def fake_options(n=6, seed=0):
    """Options whose real chunk is 10% larger than estimated: the loop must learn that and still fit."""
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(n):
        opts = []
        for b in (2.0, 3.0, 4.0, 5.0):
            r = Rounded(torch.zeros(4, 4, dtype=torch.int8), torch.ones(4, dtype=torch.float16), 5, torch.zeros(4))
            opts.append(Option(f"b{b}", r, "std", b, float(rng.uniform(1, 2) * 2 ** (-2 * b)), 1000 * b))
        out[f"t{i}"] = opts
    return out


def test_the_budget_is_met_by_measurement_and_only_built_sizes_are_returned():
    options = fake_options()
    real = {id(o.value): 1.1 * o.est_bytes for opts in options.values() for o in opts}
    built = []

    def measure(values):
        chunks = {n: int(real[id(v)]) for n, v in values.items()}
        size = 500 + sum(chunks.values())  # a header the estimates do not know
        built.append(size)
        return size, chunks
    budget = 25_000
    choice, size, probes = allocate(options, measure, budget)
    assert size <= budget and size in built and [p["artifact_bytes"] for p in probes] == built
    assert probes[0]["fits"] is False and any(p["fits"] for p in probes)  # the first guess was over: corrected
    with pytest.raises(RDBudgetError, match="even the coarsest grid of every tensor is over the budget of 10,000"):
        allocate(options, measure, 10_000)


def test_each_groups_errors_are_scaled_to_the_measured_loss():
    options = fake_options()
    groups = {n: ("a" if i < 3 else "b") for i, n in enumerate(sorted(options))}
    before = {n: [o.error for o in opts] for n, opts in options.items()}
    measured = scale_errors(options, groups, lambda values: 0.5 if "t0" in values else -1e-3)
    assert measured["a"]["factor"] == pytest.approx(0.5 / measured["a"]["predicted"])
    assert measured["b"]["factor"] == pytest.approx(0.01 * measured["a"]["factor"])  # a loss that fell: the floor
    for n, opts in options.items():
        f = measured[groups[n]]["factor"]
        assert [o.error for o in opts] == pytest.approx([e * f for e in before[n]])


def test_rd_export_ships_every_tensor_on_a_grid_within_a_tight_budget(tmp_path):
    model = mhc_model()
    loose = export_artifact(model, batches(), str(tmp_path / "loose.mhcg"), META, 10**7, log=lambda _: None,
                            observed_patterns=("mhc.*.phi",))
    budget = int(loose["artifact_bytes"] * 0.55)
    lines = []
    report = export_artifact(model, batches(), str(tmp_path / "t.mhcg"), META, budget, log=lines.append,
                             observed_patterns=("mhc.*.phi",))
    path = tmp_path / "t.mhcg"
    assert report["artifact_bytes"] == path.stat().st_size <= budget
    assert report["artifact_bytes"] in [p["artifact_bytes"] for p in report["probes"]]
    kinds = {row["kind"] for row in report["tensors"]}
    assert kinds == {"linear", "phi", "table"} and set(report["loss_probes"]) == {"linear", "phi", "embed.weight"}
    _, stored = load_artifact(path, stored=True)
    for row in report["tensors"]:
        qt = stored[row["name"]]
        assert qt.bits == row["bits"] and row["grid"].removeprefix("rtn:") == f"{qt.family}@{qt.step:g}"
    assert sum(row["bytes"] for row in report["tensors"]) < report["artifact_bytes"]
    assert any("quant: probe embed.weight" in line for line in lines) and "artifact" in lines[-1]
    # the probes' time, counted as calibration, in its parts: decoding the values (host only) and one pass over the
    # batches for the unchanged model and for each group probed; calibration's time in the Hessians' and Fisher's
    passes = report["probe_pass_s"]
    assert len(passes) == 1 + len(report["loss_probes"]) and min(passes) > 0
    assert 0 < report["probe_dequantize_s"] < report["probe_s"]
    assert report["probe_s"] == pytest.approx(report["probe_dequantize_s"] + sum(passes))
    assert 0 < report["hessian_s"] < report["calib_s"]
    assert any(f"(Hessians {report['hessian_s']:.1f}s, Fisher {report['fisher_s']:.1f}s) (+ loss probes "
               f"{report['probe_s']:.1f}s: passes {'/'.join(f'{s:.1f}' for s in passes)}s, "
               f"{report['probe_dequantize_s']:.1f}s decoding)" in line for line in lines)
    bits = [row["bits_per_param"] for row in report["tensors"]]
    assert max(bits) - min(bits) > 0.5  # the budget is shared out unevenly: by predicted loss, not by width


def test_rd_export_times_the_hessians_and_the_fisher_pass_apart(tmp_path, monkeypatch):
    """A slower Fisher pass shows in fisher_s, not in hessian_s; the two make up calib_s."""
    import quant.export
    fisher = quant.export.collect_fisher

    def slow_fisher(*args, **kwargs):
        time.sleep(0.3)
        return fisher(*args, **kwargs)
    monkeypatch.setattr(quant.export, "collect_fisher", slow_fisher)
    report = export_artifact(mhc_model(), batches(), str(tmp_path / "f.mhcg"), META, 10**7, log=lambda _: None,
                             observed_patterns=("mhc.*.phi",))
    assert report["fisher_s"] >= 0.3
    assert report["hessian_s"] + report["fisher_s"] == pytest.approx(report["calib_s"])


def test_rd_export_with_output_errors_times_no_fisher_pass_and_no_probes(tmp_path):
    """error_weight=output runs neither the Fisher pass nor the loss probes: calibration is the Hessians alone, and
    neither the report nor the log line names the other two."""
    lines = []
    report = export_artifact(mhc_model(), batches(), str(tmp_path / "o.mhcg"), META, 10**7, log=lines.append,
                             observed_patterns=("mhc.*.phi",), error_weight="output")
    assert "fisher_s" not in report and "probe_s" not in report and not report["loss_probes"]
    assert 0 < report["hessian_s"] <= report["calib_s"]
    line = next(line for line in lines if "calibration" in line and "tokens in" in line)
    assert "Fisher" not in line and "loss probes" not in line


def markov_batches(transitions: torch.Tensor, n: int, length: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.zeros(n, length, dtype=torch.long)
    x[:, 0] = torch.randint(0, transitions.shape[0], (n,), generator=g)
    for t in range(1, length):
        x[:, t] = torch.multinomial(transitions[x[:, t - 1]], 1, generator=g).squeeze(1)
    return x


@pytest.fixture(scope="module")
def toy():
    """A one-block GPT trained (Adam, 150 steps) on a random Markov chain: a table that was learned."""
    from model.config import ModelConfig
    from model.gpt import GPT
    torch.manual_seed(0)
    transitions = torch.softmax(torch.randn(64, 64, generator=torch.Generator().manual_seed(0)) * 2.5, dim=1)
    data = markov_batches(transitions, 512, 33, 1)
    model = GPT(ModelConfig(vocab_size=64, n_layers=1, d_model=32, n_heads=2, n_kv_heads=1, n_streams=1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(150):
        b = data[torch.randint(0, 512, (32,))]
        loss = model(b[:, :-1], b[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    calib = [markov_batches(transitions, 8, 33, s) for s in (2, 3)]
    held_out = [markov_batches(transitions, 32, 33, 9)]
    return model, calib, held_out


def test_a_tied_table_is_gptqd_on_the_heads_hessian_and_ships_what_loses_least(toy):
    """GPTQ on the Hessian of the head's input lowers the logits' error; it raises each entry's own error, which the
    lookups read. The table's error counts both, and the choice between GPTQ and round-to-nearest on a grid, made by
    that error, scores no worse on held-out text than round-to-nearest does."""
    from quant.calibrate import calibrate, collect_fisher
    from quant.probe import loss_with, mean_loss
    model, calib, held_out = toy
    stats = calibrate(model, {}, calib, optional={"embed.weight": model.embed.weight})
    fisher = collect_fisher(model, {}, calib, None, ["embed.weight"], {"embed.weight": model.embed})
    h, w = stats.hessians["embed.weight"], model.embed.weight.detach()
    both = ErrorModel(h, fisher.rows["embed.weight"], fisher.lookups["embed.weight"])
    base = mean_loss(model, held_out)
    for cand in step_candidates(w, steps=(0.4, 0.8)):
        head = {m: evaluate_candidates(w, ErrorModel(h), m, [cand])[0] for m in ("gptq", "rtn")}
        assert head["gptq"].error < 0.7 * head["rtn"].error  # the head's own output error
        priced = {m: evaluate_candidates(w, both, m, [cand])[0] for m in ("gptq", "rtn")}
        loss = {m: loss_with(model, held_out, {"embed.weight": o.value.dequantize()}) - base for m, o in priced.items()}
        chosen = min(priced, key=lambda m: priced[m].error)
        assert loss[chosen] <= loss["rtn"] + 1e-6, (cand.label, loss, {m: o.error for m, o in priced.items()})
    lookup = fisher.lookups["embed.weight"]
    for scale, rtn_only in ((1e6, True), (1e-9, False)):  # the lookups' error dominating, or negligible
        labels = [o.label for o in tensor_options(w, ErrorModel(h, None, lookup * scale), "gptq", steps=(0.2, 0.4))]
        assert all(label.startswith("rtn:") for label in labels) == rtn_only, (scale, labels)
    # a matrix that is not looked up gets GPTQ alone
    assert not any(o.label.startswith("rtn:") for o in tensor_options(w, ErrorModel(h), "gptq", steps=(0.2, 0.4)))


def test_entropy_estimates_land_near_brotli():
    import brotli
    from quant.pack import encode_codes, encode_scales
    w = weights(256, 512, seed=4)
    for cand in step_candidates(w, steps=(0.1, 0.4, 1.2)):
        o = evaluate_candidates(w, ErrorModel(), "rtn", [cand])[0]
        qt = o.value
        real = len(brotli.compress(encode_codes(qt.codes, qt.bits, "byte") + encode_scales(qt.scales), quality=11))
        assert o.est_bytes == estimated_bytes(o.rounded.codes, o.rounded.scales)
        assert abs(o.est_bytes / real - 1) < 0.06, (cand.label, o.est_bytes, real)


@pytest.mark.parametrize("step,message", [(1e300, "grid step 1e+300"), (-0.5, "grid step -0.5"),
                                          ("0.4", "grid step '0.4'"), (None, "grid step None")])
def test_a_forged_step_is_refused_before_any_tensor_is_read(tmp_path, step, message):
    qt = QuantizedTensor(np.zeros((4, 4), np.int8), np.ones(4, np.float16), 6, "std", 0.4)
    data = bytearray(build_artifact(META, {"w": qt}))
    prefix = 8 + 4 + 4 + 8
    header_len = int.from_bytes(data[12:16], "little")
    header = json.loads(lzma.decompress(bytes(data[prefix:prefix + header_len])))
    header["tensors"][0]["step"] = step
    forged = lzma.compress(json.dumps(header).encode(), format=lzma.FORMAT_XZ)
    body = bytes(data[:12]) + len(forged).to_bytes(4, "little") + bytes(data[16:prefix]) + forged + \
        bytes(data[prefix + header_len:-32])
    import hashlib
    path = tmp_path / "forged.mhcg"
    path.write_bytes(body + hashlib.sha256(body).digest())
    with pytest.raises(ArtifactError, match=re.escape(f"malformed header: tensor 'w': {message}: expected a number")):
        load_artifact(path)
