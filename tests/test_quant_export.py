"""export_artifact end to end on a tiny model: treatment of every tensor, budget, report, log."""
import numpy as np
import pytest
import torch
import torch.nn as nn

from quant.allocate import BudgetError
from quant.container import load_artifact
from quant.export import FP32_MAX_NUMEL, export_artifact, plan_tensors

META = {"model_config": {"d": 32}, "tokenizer_sha256": "0123456789abcdef" * 4}


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.Parameter(torch.ones(d))
        self.up = nn.Linear(d, 3 * d, bias=False)
        self.down = nn.Linear(3 * d, d, bias=True)

    def forward(self, x):
        h = torch.nn.functional.rms_norm(x, (x.shape[-1],), self.norm)
        return x + self.down(torch.relu(self.up(h)) ** 2)


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 32, layers: int = 3):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.mix = nn.Parameter(torch.randn(d, 8) * 0.1)  # a non-Linear 2-D parameter
        self.scale = nn.Parameter(torch.tensor(0.8125))

    def forward(self, ids, targets=None):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        x = x + (x @ self.mix).sum(-1, keepdim=True) * self.scale
        logits = x @ self.embed.weight.T
        if targets is None:
            return logits
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = TinyGPT()
    with torch.no_grad():
        for block in m.blocks:
            block.norm.uniform_(0.5, 1.5)
    return m


def calib(n_batches: int = 3):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 64, (2, 16), generator=g) for _ in range(n_batches)]


def run_export(model, path, budget, **kw):
    """The rank scheme on output errors unless told otherwise (tests/test_quant_rd.py covers the rd scheme)."""
    lines = []
    kw = {"scheme": "rank", "error_weight": "output", **kw}
    report = export_artifact(model, calib(), str(path), META, budget, log=lines.append, **kw)
    return report, lines


def test_plan_assigns_every_tensor_once(model):
    plan = plan_tensors(model, ["mix"])
    assert sorted(plan.linears) == sorted(f"blocks.{i}.{n}.weight" for i in range(3) for n in ("up", "down"))
    assert sorted(plan.tables) == ["embed.weight", "mix"]
    assert set(plan.others) == {"scale"} | {f"blocks.{i}.norm" for i in range(3)} | {f"blocks.{i}.down.bias" for i in range(3)}
    assert plan_tensors(model).tables == ["embed.weight"] and "mix" in plan_tensors(model).others
    with pytest.raises(ValueError, match=r"\['nope\*'\] match no non-Linear tensor"):
        plan_tensors(model, ["nope*"])
    with pytest.raises(ValueError, match="quantized matrices must be 2-D"):
        plan_tensors(model, ["scale"])
    observed = plan_tensors(model, observed_patterns=["mix"])
    assert list(observed.observed) == ["mix"] and "mix" not in observed.tables + observed.others
    with pytest.raises(ValueError, match="both a table and an observed pattern"):
        plan_tensors(model, ["mix"], ["m*"])


@pytest.mark.parametrize("method", ["gptq", "rtn"])
def test_export_fits_budget_loads_back_and_logs_every_matrix(tmp_path, model, method):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    loose, _ = run_export(model, tmp_path / "loose.art", 10**7, method=method, table_patterns=["mix"])
    assert loose["n_int6"] == 6 and loose["n_int5"] == 0
    all5 = loose["probes"][0]["artifact_bytes"]
    budget = (all5 + loose["artifact_bytes"]) // 2
    report, lines = run_export(model, tmp_path / "m.art", budget, method=method, table_patterns=["mix"])
    path = tmp_path / "m.art"
    assert report["artifact_bytes"] == path.stat().st_size <= budget
    assert 0 < report["n_int6"] < 6 and report["n_int5"] == 6 - report["n_int6"]
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # model untouched

    meta, tensors = load_artifact(path)
    assert meta["model_config"] == META["model_config"]
    assert meta["quant"] == {"method": method, "scheme": "rank", "calib_tokens": 96}
    # int6 goes to the most sensitive matrices, and the log names every matrix with its bits.
    rows = report["matrices"]
    assert [r["rank"] for r in rows] == list(range(6))
    assert [r["bits"] for r in rows] == sorted((r["bits"] for r in rows), reverse=True)
    assert all(r["err6"] < r["err5"] for r in rows)
    for r in rows:
        assert any(r["name"] in line and f"int{r['bits']}" in line for line in lines)
    assert f"artifact {report['artifact_bytes']} bytes" in lines[-1]
    for key in ("calib_s", "quant_alloc_s", "save_verify_s"):
        assert report[key] >= 0

    # Treatment: tables int8 (per-row dequantized values), small tensors fp32/fp16 as documented.
    assert sorted(report["tables"]) == ["embed.weight", "mix"] and report["table_bits"] == 8
    assert report["others"]["scale"] == "float32" and report["others"]["blocks.0.norm"] == "float32"
    assert FP32_MAX_NUMEL >= 32 and tensors["scale"].item() == 0.8125
    emb = model.embed.weight.detach()
    assert torch.linalg.norm(tensors["embed.weight"] - emb) < 0.01 * torch.linalg.norm(emb)  # int8: < 1% error
    reloaded = TinyGPT()
    reloaded.load_state_dict(tensors)
    with torch.no_grad():
        ids = calib(1)[0]
        assert (reloaded(ids) - model(ids)).abs().max() < 0.1 * model(ids).abs().max()


def test_export_large_small_tensor_goes_fp16(tmp_path):
    torch.manual_seed(1)
    m = TinyGPT(d=80, layers=1)
    report, _ = run_export(m, tmp_path / "a.art", 10**7, codec="lzma", layout="dense")
    assert report["others"]["blocks.0.norm"] == "float16" and report["others"]["scale"] == "float32"
    assert report["codec"] == "lzma" and report["layout"] == "dense"
    _, tensors = load_artifact(tmp_path / "a.art")
    assert torch.equal(tensors["blocks.0.norm"], m.blocks[0].norm.detach().half().float())


def test_export_refuses_impossible_budget_and_bad_arguments(tmp_path, model):
    with pytest.raises(BudgetError, match=r"over the budget of 1000 bytes by \d+ bytes"):
        run_export(model, tmp_path / "x.art", 1000)
    assert not (tmp_path / "x.art").exists()
    with pytest.raises(ValueError, match="quantization option method="):
        run_export(model, tmp_path / "x.art", 10**7, method="awq")
    with pytest.raises(ValueError, match="tokenizer_sha256"):
        export_artifact(model, calib(), str(tmp_path / "x.art"), {"model_config": {}}, 10**7)


def test_an_artifact_that_fails_its_check_never_replaces_the_old_one(tmp_path, model, monkeypatch):
    """The round-trip check runs on the built bytes before the write: the artifact a run exported before (same
    run_id, a resumed run) stays whole when the new one does not load back to what was quantized."""
    import quant.export as export
    path = tmp_path / "run.mhcg"
    run_export(model, path, 10**7)
    before = path.read_bytes()
    real_parse = export.parse_artifact

    def parse_one_tensor_short(data, where, stored=False):
        meta, tensors = real_parse(data, where, stored)
        tensors.pop(sorted(tensors)[0])
        return meta, tensors
    monkeypatch.setattr(export, "parse_artifact", parse_one_tensor_short)
    with pytest.raises(RuntimeError, match="does not load back.*nothing was written"):
        run_export(model, path, 10**7, method="rtn")
    assert path.read_bytes() == before and [f.name for f in tmp_path.iterdir()] == ["run.mhcg"]


@pytest.mark.parametrize("name", ["blocks.1.up.weight", "blocks.1.norm", "scale", "embed.weight"])
def test_a_non_finite_tensor_is_named_before_anything_is_quantized(tmp_path, name):
    """NaN in a norm gain was reported as an overflowing Hessian, in a scalar as a failed read-back check; none
    named the tensor."""
    torch.manual_seed(0)
    m = TinyGPT()
    with torch.no_grad():
        m.get_parameter(name).view(-1)[0] = float("nan")
    with pytest.raises(ValueError, match=f"^{name} holds NaN or Inf.*hint: the run diverged"):
        run_export(m, tmp_path / "x.art", 10**7)
    assert not (tmp_path / "x.art").exists()


@pytest.mark.parametrize("scheme", ["rank", "rd"])
def test_a_quantizer_error_names_its_matrix(model, scheme):
    from quant.calibrate import Calibration
    from quant.rd import ErrorModel
    from quant.schemes import quantize_rank, quantize_rd
    plan = plan_tensors(model)
    hessians = {name: torch.eye(lin.in_features) for name, lin in plan.linears.items()}
    weights = {name: lin.weight for name, lin in plan.linears.items()}

    def quantize():
        if scheme == "rank":
            quantize_rank(weights, {}, {}, Calibration(hessians, 96), None, "gptq", 5, 6, 8, None, 10**7, None)
        else:
            quantize_rd(weights, dict.fromkeys(weights, "linear"), {n: ErrorModel(h) for n, h in hessians.items()},
                        "gptq", None, 10**7, print)
    hessians["blocks.2.down.weight"] = torch.full_like(hessians["blocks.2.down.weight"], float("inf"))
    with pytest.raises(ValueError, match="^blocks.2.down.weight: Hessian holds NaN or Inf"):
        quantize()
    indefinite = torch.eye(32)
    indefinite[0, 1] = indefinite[1, 0] = 1000.0
    hessians["blocks.2.down.weight"] = torch.eye(96)
    hessians["blocks.0.up.weight"] = indefinite
    with pytest.raises(RuntimeError, match="^blocks.0.up.weight: GPTQ: Hessian .32x32. is not positive definite"):
        quantize()


def test_export_refuses_tied_weights(tmp_path):
    m = TinyGPT()
    m.head = nn.Linear(32, 64, bias=False)
    m.head.weight = m.embed.weight
    with pytest.raises(ValueError, match="share storage"):
        plan_tensors(m)


def test_small_tensor_rule_is_by_size():
    from quant.export import small_tensor
    assert small_tensor(torch.ones(FP32_MAX_NUMEL)).dtype == np.float32
    assert small_tensor(torch.ones(FP32_MAX_NUMEL + 1)).dtype == np.float16
    assert small_tensor(torch.arange(3)).dtype == np.int64
    big = small_tensor(torch.full((FP32_MAX_NUMEL + 1,), 7e4))  # past fp16's range: kept in fp32, not made Inf
    assert big.dtype == np.float32 and np.isfinite(big).all()


def test_export_int4_fallback_ships_what_int5_cannot(tmp_path, model):
    """A budget between the all-int4 and all-int5 sizes: min_bits=5 refuses, min_bits=4 ships some int4
    matrices, logs the warning, and the artifact loads to exactly those codes' values."""
    all5 = run_export(model, tmp_path / "b.art", 10**7)[0]
    n5 = len(all5["matrices"])
    low = min(p["artifact_bytes"] for p in all5["probes"])  # all-int5
    with pytest.raises(BudgetError, match="quant.min_bits=4"):
        run_export(model, tmp_path / "a.art", low - 200)
    report, lines = run_export(model, tmp_path / "c.art", low - 200, min_bits=4)
    assert 0 < report["n_int4"] <= n5 and report["n_int6"] == 0 and report["artifact_bytes"] <= low - 200
    assert any("fell back to int4" in line for line in lines)
    assert all("err4" in row for row in report["matrices"])
    assert {row["bits"] for row in report["matrices"]} <= {4, 5}
    _, tensors = load_artifact(tmp_path / "c.art")
    int4 = [row["name"] for row in report["matrices"] if row["bits"] == 4]
    w = tensors[int4[0]]
    assert len(torch.unique(w[0])) <= 15  # int4: at most 15 levels per row
    with pytest.raises(ValueError, match="min_bits=3"):
        run_export(model, tmp_path / "d.art", 10**7, min_bits=3)


def test_table_width_is_a_choice(tmp_path, model):
    """int6 tables: smaller, every table at 6 bits, and still close; other widths are refused."""
    int8, _ = run_export(model, tmp_path / "t8.art", 10**7)
    int6, lines = run_export(model, tmp_path / "t6.art", 10**7, table_bits=6)
    assert int6["artifact_bytes"] < int8["artifact_bytes"] and "int6 tables" in lines[-1]
    _, stored = load_artifact(tmp_path / "t6.art", stored=True)
    assert stored["embed.weight"].bits == 6
    _, tensors = load_artifact(tmp_path / "t6.art")
    emb = model.embed.weight.detach()
    assert torch.linalg.norm(tensors["embed.weight"] - emb) < 0.05 * torch.linalg.norm(emb)
    with pytest.raises(ValueError, match="table_bits=4"):
        run_export(model, tmp_path / "t4.art", 10**7, table_bits=4)
