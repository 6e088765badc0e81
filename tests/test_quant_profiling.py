"""quant/profiling.py: the export's parts as profile ranges, and a profiler that records them alone."""
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from quant.profiling import export_part, parts_only


def _ops(prof) -> list[str]:
    return [e.name for e in prof.events()]


def test_parts_only_records_the_parts_and_resumes_after_the_block():
    a = torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with parts_only(prof):
            torch.sub(a, a)  # outside any part: not recorded
            with export_part("export: part one"):
                torch.mm(a, a)
            torch.sub(a, a)
        torch.mul(a, a)  # after the block: recorded again
    ops = _ops(prof)
    assert "export: part one" in ops and "aten::mm" in ops and "aten::mul" in ops
    assert "aten::sub" not in ops


def test_a_part_without_parts_only_is_a_range_in_a_plain_profile():
    a = torch.randn(8, 8)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.sub(a, a)
        with export_part("export: part two"):
            torch.mm(a, a)
    assert {"export: part two", "aten::mm", "aten::sub"} <= set(_ops(prof))
    with export_part("export: no profiler"):  # and nothing at all without one
        torch.mm(a, a)


def test_parts_only_refuses_to_nest():
    with profile(activities=[ProfilerActivity.CPU]) as prof, parts_only(prof):
        with pytest.raises(RuntimeError, match="parts_only: a profiler already records"):
            with parts_only(prof):
                pass
