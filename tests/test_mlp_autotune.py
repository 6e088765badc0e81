"""The MLP GEMMs' autotuner keys on the power-of-two bucket of the row count, not the row count itself: a pass that
meets many row counts (document-LoRA test-time training's chunks) times the configs once per bucket."""
import pytest
import torch

from kernels import mlp, mlp_triton
from test_mlp_kernels import epilogue_case, kernels_built_with, needs_cuda, rel_err, torch_epilogue_reference


@pytest.fixture
def interpreter():
    yield from kernels_built_with(interpret=True)


def test_a_row_count_keys_by_the_power_of_two_at_or_above_it():
    assert [mlp_triton.row_bucket(m) for m in (1, 2, 3, 4, 5, 64, 65, 98304, 131072)] == \
        [1, 2, 4, 4, 8, 64, 128, 131072, 131072]
    for kernel in (mlp_triton.mlp_gemm_kernel, mlp_triton.mlp_gemm_tma_kernel):
        assert kernel.keys == ["M_BUCKET", "N", "K", "EPILOGUE"]


@pytest.mark.parametrize("schedule", mlp.SCHEDULES)
def test_each_launch_passes_its_row_counts_bucket(interpreter, schedule, monkeypatch):
    seen, bucket = [], mlp_triton.row_bucket
    monkeypatch.setattr(mlp_triton, "row_bucket", lambda rows: seen.append(rows) or bucket(rows))
    a, b, out, aux = epilogue_case(37, 40, 48, mlp_triton.EPILOGUE_ACTIVATION)
    mlp.launch_gemm(a, b, out, aux, mlp_triton.EPILOGUE_ACTIVATION, schedule, programs=3)
    assert seen == [37]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("schedule", mlp.SCHEDULES)
def test_gpu_row_counts_of_one_bucket_share_one_tuning(schedule):
    """Two row counts of one bucket add one entry to the autotuner's cache, a row count of the next bucket another
    (1,000 and 1,020 rows: bucket 1,024; 1,030: 2,048); every launch still computes what the reference does."""
    kernel = {"tiled": mlp_triton.mlp_gemm_kernel, "tma": mlp_triton.mlp_gemm_tma_kernel}[schedule]
    before = set(kernel.cache)
    for rows in (1000, 1020, 1030):
        a, b, out, aux = epilogue_case(rows, 512, 1024, mlp_triton.EPILOGUE_ACTIVATION, device="cuda",
                                       dtype=torch.bfloat16)
        want_out, want_aux = torch_epilogue_reference(a, b, aux, mlp_triton.EPILOGUE_ACTIVATION)
        mlp.launch_gemm(a, b, out, aux, mlp_triton.EPILOGUE_ACTIVATION, schedule)
        assert rel_err(out, want_out) < 1e-2 and rel_err(aux, want_aux) < 1e-2
    assert len(set(kernel.cache) - before) == 2
