"""scripts/kernel_resources.py: the mHC kernels' registers and spills for sm_90, compiled on the CPU.

The compile runs in a subprocess without TRITON_INTERPRET: this test session builds its kernels
interpreted (tests/conftest.py), and interpreted kernels do not compile."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from scripts import kernel_resources as KR

REPO = Path(__file__).resolve().parents[1]


def fake_kernel(*params: tuple[str, bool]):
    """Stands in for a JITFunction: its parameters (name, is_constexpr)."""
    return SimpleNamespace(__name__="fake_kernel",
                           params=[SimpleNamespace(name=n, is_constexpr=c) for n, c in params])


def test_ptxas_report_is_parsed_and_garbage_is_refused():
    report = ("ptxas info    : Function properties for k\n    8 bytes stack frame, 12 bytes spill stores, "
              "4 bytes spill loads\nptxas info    : Used 255 registers, used 1 barriers\n")
    assert KR.parse_ptxas(report) == {"registers": 255, "spill_stores": 12, "spill_loads": 4}
    with pytest.raises(ValueError, match="no register/spill lines"):
        KR.parse_ptxas("ptxas fatal: something else")


def test_recorder_captures_launches_instead_of_running_them():
    rec = KR.Recorder()
    rec("kernel")[(4, 2)](1, 2, BT=16, num_warps=4)
    assert rec.launches == [("kernel", (1, 2), {"BT": 16, "num_warps": 4})]


def test_specialization_types_pointers_ints_and_constexprs_like_the_launcher():
    kernel = fake_kernel(("xs_ptr", False), ("aux_ptr", False), ("T", False), ("K", False), ("BIG", False),
                         ("BT", True), ("LOWP", True))
    xs, aux = torch.empty(48, 128, dtype=torch.bfloat16, device="meta"), torch.empty(48, 32, device="meta")
    sig, const, attrs, options = KR.specialization(kernel, (xs, aux, 48, 100, 2**40),
                                                   dict(BT=16, LOWP=True, num_warps=4, num_stages=2))
    assert sig == {"xs_ptr": "*bf16", "aux_ptr": "*fp32", "T": "i32", "K": "i32", "BIG": "i64",
                   "BT": "constexpr", "LOWP": "constexpr"}
    assert const == {(5,): 16, (6,): True} and options == {"num_warps": 4, "num_stages": 2}
    assert sorted(attrs) == [(0,), (1,), (2,), (4,)]  # aligned pointers, 48 and 2**40 divide by 16; 100 does not
    with pytest.raises(ValueError, match="neither a tensor nor an int"):
        KR.specialization(kernel, (xs, aux, 48, 1.5, 0), dict(BT=16, LOWP=True))
    with pytest.raises(ValueError, match="dtype torch.bool"):
        KR.specialization(kernel, (xs.bool(), aux, 48, 100, 0), dict(BT=16, LOWP=True))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
@pytest.mark.parametrize("arch", [None, 80])  # the default (sm_90, ptxas's sm_90a), and --arch for an A100
def test_every_kernel_of_a_unit_compiles_and_reports_its_resources(arch):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "scripts.kernel_resources", "--n", "2", "--C", "64",
                           "--tokens", "256", *(["--arch", str(arch)] if arch else [])],
                          capture_output=True, text=True, env=env, timeout=600, cwd=REPO)
    if "needs Triton with its NVIDIA backend" in done.stderr:
        pytest.skip("this Triton has no NVIDIA backend")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith(f"mHC kernels for sm_{arch or 90}, n=2 C=64")
    rows = [line.split() for line in done.stdout.splitlines()[2:]]
    assert [r[0] for r in rows] == ["coef_premix_kernel"] * 2 + ["premix_grad_kernel", "coef_bwd_kernel"] + \
        ["stream_bwd_kernel"] * 3 + ["dphi_kernel"]
    for r in rows:
        registers, spills, shared = int(r[-3]), r[-2].split("/"), int(r[-1])
        assert 16 <= registers <= 255 and all(int(b) >= 0 for b in spills) and shared >= 0, r


@pytest.mark.parametrize("n", [4, 2])
def test_sweep_plans_launch_each_row_as_the_benchmark_does(n):
    """Each SWEEP row replaces its kernel's default whole: the n=2 stream_bwd default (GP_SCRATCH) must not
    switch that path on in rows that leave it off. coef_premix's launch without the apply takes its own
    default and rows (coef_premix_pre)."""
    from kernels.mhc_blocks import SWEEP
    plans = KR.launch_plans(n, sweep=True)
    assert plans[0] == KR.default_configs(n)
    for name, configs in SWEEP.items():
        launched = [plan[name] for plan in plans[1:] if plan[name] is not plans[0][name]]
        tokens = {"TOKENS": plans[0][name]["TOKENS"]} if "TOKENS" in plans[0][name] else {}
        assert launched == [tokens | cfg for cfg in configs], name


def test_the_launch_without_the_apply_takes_its_own_block():
    """A unit's two coef_premix launches compile with their own defaults (mhc_post_pre's and mhc_pre's)."""
    from kernels.mhc_fwd import fwd_config
    gpu = torch.device("cuda")
    for n in (4, 2):
        launches = KR.unit_launches(256, n, 512, KR.launch_plans(n, sweep=False)[0])
        premix = [kw for kernel, _, kw in launches if KR.kernel_name(kernel) == "coef_premix_kernel"]
        expect = [(apply, fwd_config(gpu, n, apply)) for apply in (True, False)]
        assert [(kw["APPLY"], kw["BT"], kw["BC"]) for kw in premix] == \
            [(apply, cfg["BT"], cfg["BC"]) for apply, cfg in expect], n


def test_interpreted_kernels_and_bad_arguments_are_refused(monkeypatch, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(SystemExit, match="TRITON_INTERPRET=1"):
        KR.main([])
    # Each bad argument is refused by its own check, ahead of the interpreter's refusal (16 streams once passed,
    # then crashed): argparse exits with status 2 and names the argument.
    for bad, says in ((["--n", "3"], "argument --n: invalid choice: 3"),
                      (["--n", "16"], "argument --n: invalid choice: 16"),
                      (["--C", "40"], "--C must be a positive multiple of 16"),
                      (["--tokens", "0"], "--tokens positive; got C=512 tokens=0")):
        with pytest.raises(SystemExit) as exit_:
            KR.main(bad)
        assert exit_.value.code == 2 and says in capsys.readouterr().err, bad


def test_an_architecture_it_cannot_compile_for_is_refused_by_argparse():
    """--arch 10 used to abort inside LLVM (exit 134, no Python message)."""
    done = subprocess.run([sys.executable, "-m", "scripts.kernel_resources", "--arch", "10"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 2 and "argument --arch: invalid choice: 10 (choose from 80, 86, 89, 90)" in done.stderr
