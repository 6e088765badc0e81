"""scripts/kernel_resources.py: the mHC kernels' registers and spills for sm_90, compiled on the CPU."""
import importlib.util

import pytest
import torch

from scripts import kernel_resources as KR

has_nvidia_backend = importlib.util.find_spec("triton") is not None and \
    importlib.util.find_spec("triton.backends.nvidia") is not None


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


@pytest.mark.skipif(not has_nvidia_backend, reason="needs Triton with its NVIDIA backend")
def test_specialization_matches_the_launcher():
    from kernels.mhc_bwd import dphi_kernel
    xs, aux = torch.empty(48, 128, dtype=torch.bfloat16, device="meta"), torch.empty(48, 32, device="meta")
    part = torch.empty(2, 128, 32, device="meta")
    sig, const, attrs, options = KR.specialization(
        dphi_kernel, (xs, aux, part, 48, 100), dict(N=24, NP=32, LOWP=True, BT=16, BK=32, num_warps=4))
    assert sig == {"xs_ptr": "*bf16", "aux_ptr": "*fp32", "part_ptr": "*fp32", "T": "i32", "K": "i32",
                   "N": "constexpr", "NP": "constexpr", "LOWP": "constexpr", "BT": "constexpr", "BK": "constexpr"}
    assert const == {(5,): 24, (6,): 32, (7,): True, (8,): 16, (9,): 32} and options == {"num_warps": 4}
    # pointers are 16-byte aligned, T=48 divides by 16, K=100 does not
    assert sorted(attrs) == [(0,), (1,), (2,), (3,)]
    with pytest.raises(ValueError, match="neither a tensor nor an int"):
        KR.specialization(dphi_kernel, (xs, aux, part, 48, 1.5), dict(N=24, NP=32, LOWP=True, BT=16, BK=32))


@pytest.mark.skipif(not has_nvidia_backend, reason="needs Triton with its NVIDIA backend")
def test_every_kernel_of_a_unit_compiles_for_sm90_and_reports_its_resources(capsys):
    table = KR.main(["--n", "2", "--C", "64", "--tokens", "256"])
    names = [r["kernel"] for r in table]
    assert names == ["coef_premix_kernel"] * 2 + ["premix_grad_kernel", "coef_bwd_kernel"] + \
        ["stream_bwd_kernel"] * 3 + ["dphi_kernel"]
    for r in table:
        assert 16 <= r["registers"] <= 255 and r["spill_stores"] >= 0 and r["shared"] >= 0, r
    assert "stream_bwd_kernel" in capsys.readouterr().out


def test_bad_arguments_are_refused():
    for bad in (["--n", "3"], ["--C", "40"], ["--tokens", "0"]):
        with pytest.raises(SystemExit):
            KR.main(bad)
