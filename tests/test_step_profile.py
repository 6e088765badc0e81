"""training/step_profile.py: kernel names to categories, per-step tables, and bench_step --profile end to end."""
import pytest
import torch

from scripts import bench_step
from training import step_profile
from training.step_profile import OTHER, category, format_tables, summarize

# Kernel names as H100 and H200 traces of the compiled step show them (torch 2.11, triton 3.6).
NAMES = {
    "coef_premix_kernel": "mHC Triton kernels",
    "stream_bwd_kernel": "mHC Triton kernels",
    "dphi_kernel": "mHC Triton kernels",
    "mlp_gemm_tma_kernel": "MLP Triton GEMM",
    "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT": "GEMM (cuBLAS/CUTLASS, inductor templates)",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1": "GEMM (cuBLAS/CUTLASS, inductor templates)",
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x64_4x1x1": "attention",
    "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits>": "attention",
    "triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0": "inductor fused (triton_*)",
    "triton_tem_fused_mm_0": "GEMM (cuBLAS/CUTLASS, inductor templates)",  # inductor's GEMM template
    # FlexAttention's forward and backward (model.doc_attention): Inductor templates too, but attention
    "triton_tem_fused_flex_attention_15": "attention",
    "triton_tem_fused__to_copy_add_clamp_min_div_expand_flex_attention_backward_mul_transpose_u": "attention",
    "triton_per_fused__scaled_dot_product_cudnn_attention_backward__to_copy_add_clamp_min_div_e": "inductor fused (triton_*)",
    "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL": "NCCL",
    "Memcpy DtoD (Device -> Device)": "copy / fill",
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>": "copy / fill",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float>>": OTHER,
    "CUDA_tensor_apply_kernel": OTHER,  # not ours: "apply_kernel" must be a whole name part
}


@pytest.mark.parametrize("name", NAMES)
def test_kernel_names_fall_in_their_category(name):
    assert category(name) == NAMES[name]


def test_tables_are_per_step_largest_first_and_shares_sum_to_one():
    times = [("stream_bwd_kernel", 3000.0, 2), ("nvjet_tst_x", 5000.0, 4), ("triton_poi_fused_add_0", 1000.0, 2),
             ("coef_premix_kernel", 1000.0, 2)]
    cats, kernels = summarize(times, steps=2, top=3)
    assert [c for c, _, _ in cats] == ["GEMM (cuBLAS/CUTLASS, inductor templates)", "mHC Triton kernels", "inductor fused (triton_*)"]
    assert [ms for _, ms, _ in cats] == [2.5, 2.0, 0.5]  # microseconds over 2 steps, in ms
    assert sum(s for _, _, s in cats) == pytest.approx(1.0)
    assert [(n, calls) for n, calls, *_ in kernels] == [("nvjet_tst_x", 2), ("stream_bwd_kernel", 1),
                                                         ("triton_poi_fused_add_0", 1)]  # top 3 of 4
    text = format_tables("n4-kernels", 6.0, cats, kernels)
    assert "5.0 ms of device time per step in 6.0 ms" in text and "| mHC Triton kernels | 2.00 | 40.0% |" in text


def test_flex_attention_and_sdpa_kernels_add_up_in_one_attention_row():
    """Two patterns name attention (FlexAttention's templates before the GEMM rule, the fixed kernels after it):
    the category table still has one attention row, their sum."""
    times = [("triton_tem_fused_flex_attention_15", 3000.0, 2), ("pytorch_flash::flash_fwd_kernel", 1000.0, 2),
             ("triton_tem_fused_mm_0", 2000.0, 2)]
    cats, _ = summarize(times, steps=2)
    assert cats == [("attention", 2.0, pytest.approx(4 / 6)),
                    ("GEMM (cuBLAS/CUTLASS, inductor templates)", 1.0, pytest.approx(2 / 6))]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_profile_reads_kernel_times_from_the_device():
    """The GPU branch: kernels (not operators) with their device time; a bf16 matmul lands in GEMM."""
    a = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    cats, kernels, gemms = step_profile.profile_steps(lambda: a @ a, 2, torch.device("cuda"))
    assert cats[0][0] == "GEMM (cuBLAS/CUTLASS, inductor templates)" and cats[0][1] > 0
    assert all(not name.startswith("aten::") for name, *_ in kernels)
    op, shapes, calls, ms = gemms[0]  # the device time the profiler gives the operator, under its shapes
    assert (op, shapes, calls) == ("aten::mm", "[1024, 1024] × [1024, 1024]", 1.0) and ms > 0
    # (Not equal to the kernel's own time: on an H100, torch 2.11, the operator's device time was 1.5x the
    # sum of every kernel event, so the table ranks products; the kernel table gives their times.)


def test_device_annotations_are_not_counted_as_kernels():
    """torch.compile puts a "## Call CompiledFxGraph ... ##" range on the device timeline around each graph
    call: counted as a kernel, it doubled the device time of a compiled step (H100)."""
    from types import SimpleNamespace as E
    cuda = torch.autograd.DeviceType.CUDA
    span = lambda us: E(elapsed_us=lambda: us)  # noqa: E731
    events = [E(name="## Call CompiledFxGraph fsqq ##", device_type=cuda, time_range=span(900.0)),
              E(name="user_range", device_type=cuda, time_range=span(900.0), is_user_annotation=True),
              E(name="stream_bwd_kernel", device_type=cuda, time_range=span(500.0), is_user_annotation=False),
              E(name="aten::mm", device_type=torch.autograd.DeviceType.CPU, time_range=span(10.0))]
    prof = E(events=lambda: events)
    assert step_profile.device_times(prof, on_gpu=True) == [("stream_bwd_kernel", 500.0, 1)]


def test_matrix_products_are_listed_by_operator_and_shapes():
    """Two products of different shapes per step: each its own row, per step, largest first."""
    a, b, v = torch.randn(256, 128), torch.randn(128, 256), torch.randn(128)

    def step():
        return a @ b, a @ v, torch.mm(a[:8], b)
    _, _, gemms = step_profile.profile_steps(step, 2, torch.device("cpu"))
    rows = {(op, shapes): calls for op, shapes, calls, _ in gemms}
    assert rows == {("aten::mm", "[256, 128] × [128, 256]"): 1.0, ("aten::mv", "[256, 128] × [128]"): 1.0,
                    ("aten::mm", "[8, 128] × [128, 256]"): 1.0}
    assert [ms for *_, ms in gemms] == sorted((ms for *_, ms in gemms), reverse=True)
    text = format_tables("v", 1.0, [("GEMM", 1.0, 1.0)], [], gemms)
    assert "| aten::mm | [256, 128] × [128, 256] | 1 |" in text


def test_zero_profile_steps_are_refused(capsys):
    with pytest.raises(ValueError, match="profile steps must be >= 1"):
        summarize([("k", 1.0, 1)], steps=0)
    with pytest.raises(SystemExit):
        bench_step.main(["--profile", "-1"])
    assert "need --steps >= 1, --warmup >= 0 and --profile >= 0, got 30, 5 and -1" in capsys.readouterr().err


def test_bench_step_profile_attributes_time_to_the_mhc_kernels(capsys):
    """n=2 per block on a 1-layer model, kernels in the interpreter (conftest): the mHC ops show up as
    their own category, and the tables follow the timing table."""
    tiny = ["model.n_layers=1", "model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1", "data.seq_len=16",
            "train.batch_tokens=32", "train.micro_batch_seqs=2", "train.compile=false"]
    rows = bench_step.main(["--config", str(bench_step.REPO / "configs/demo.toml"), "--steps", "1", "--warmup", "1",
                            "--variants", "n2-block-kernels,n1-ref", "--profile", "1", *tiny])
    cats = {r["variant"]: {c for c, _, _ in r["profile"][0]} for r in rows}
    assert "mHC Triton kernels" in cats["n2-block-kernels"] and "mHC Triton kernels" not in cats["n1-ref"]
    out = capsys.readouterr().out
    assert out.index("| n1-ref |") < out.index("### n2-block-kernels") < out.index("### n1-ref")
