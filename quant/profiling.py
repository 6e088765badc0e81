"""The export's labelled parts, and a profiler that records those parts alone.

The parts are what counts against the training budget as calibration: the Hessians, the Fisher pass and each
loss-probe pass (`export: hessians`, `export: fisher`, `export: probe pass N`). Profiled in full, an sp8192
export's GPTQ column sweeps and allocation (not calibration: they read no tokens) launch so many small operators
that the Chrome trace runs to gigabytes; `parts_only(prof)` switches collection off outside the parts, so a trace
(scripts.bench_quant --profile) holds what a slow calibration waits for and stays small.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch.profiler import profile, record_function

_RECORDING: ContextVar[profile | None] = ContextVar("export_parts_profiler", default=None)


@contextmanager
def export_part(label: str) -> Iterator[None]:
    """A range named `label` in any profile; under parts_only(prof), the only stretch prof records."""
    prof = _RECORDING.get()
    if prof is None:
        with record_function(label):
            yield
        return
    prof.toggle_collection_dynamic(True, prof.activities)
    try:
        with record_function(label):
            yield
            if torch.cuda.is_available():  # the part's kernels run while collection is still on
                torch.cuda.synchronize()
    finally:
        prof.toggle_collection_dynamic(False, prof.activities)


@contextmanager
def parts_only(prof: profile) -> Iterator[None]:
    """Inside an active `prof`: record nothing but the export's parts until the block ends."""
    if _RECORDING.get() is not None:
        raise RuntimeError("parts_only: a profiler already records the export's parts; nest none inside another")
    prof.toggle_collection_dynamic(False, prof.activities)
    token = _RECORDING.set(prof)
    try:
        yield
    finally:
        _RECORDING.reset(token)
        prof.toggle_collection_dynamic(True, prof.activities)
