"""Fused LeakyReLU(0.5)^2 MLP kernels (`kernels/mlp.py`) against `kernels/mlp_reference.py`.

CPU: the real Triton kernels run in the interpreter (fp32/fp16; it has no bf16). `@triton.jit` picks
interpreted or compiled kernels when it decorates, so the `interpreter` fixture sets TRITON_INTERPRET=1
and reloads `kernels.mlp_triton`, then restores the previous build (another test module may set the
variable for the whole process; `no_interpreter` gives compiled-mode kernels for CPU fallback tests).
GPU (marked gpu): bf16 kernels, both schedules, torch.compile(fullgraph=True) and a training step.
"""
from __future__ import annotations

import importlib
import os

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from kernels import mlp, mlp_triton
from kernels.mlp_reference import leaky_relu_sq, leaky_relu_sq_grad, mlp_reference

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def kernels_built_with(interpret: bool):
    """Reload kernels.mlp_triton with TRITON_INTERPRET set or unset (another test module may have set it
    for the whole process), then restore the variable and the kernels as they were."""
    saved = os.environ.get("TRITON_INTERPRET")
    if interpret:
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)
    try:
        importlib.reload(mlp_triton)
        assert mlp_triton.kernels_interpreted() == interpret, "TRITON_INTERPRET did not take effect"
        yield
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved
        importlib.reload(mlp_triton)


@pytest.fixture
def interpreter():
    yield from kernels_built_with(interpret=True)


@pytest.fixture
def no_interpreter():
    yield from kernels_built_with(interpret=False)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "NaN in output"
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def make_inputs(lead: tuple[int, ...], d: int, h: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(*lead, d, generator=g, device=device).to(dtype)
    w_up = (torch.randn(h, d, generator=g, device=device) / d**0.5).to(dtype)
    w_down = (torch.randn(d, h, generator=g, device=device) / h**0.5).to(dtype)
    return x, w_up, w_down


def forward_backward(fn, x, w_up, w_down, dy):
    leaves = [t.detach().clone().requires_grad_() for t in (x, w_up, w_down)]
    y = fn(*leaves)
    y.backward(dy)
    return [y.detach()] + [t.grad for t in leaves]


def reference_fp64(x, w_up, w_down, dy):
    return forward_backward(mlp_reference, x.double(), w_up.double(), w_down.double(), dy.double())


def assert_matches_reference(x, w_up, w_down, tol: float, seed: int = 1, schedule: str = "auto"):
    y_shape = (*x.shape[:-1], w_down.shape[0])
    dy = torch.randn(y_shape, generator=torch.Generator(device=x.device).manual_seed(seed), device=x.device)
    dy = dy.to(x.dtype)
    got = forward_backward(lambda *a: mlp.fused_mlp(*a, schedule=schedule), x, w_up, w_down, dy)
    want = reference_fp64(x, w_up, w_down, dy)
    for name, a, b in zip(("y", "dx", "dw_up", "dw_down"), got, want):
        assert a.shape == b.shape and a.dtype == x.dtype, name
        assert rel_err(a, b) < tol, f"{name}: rel err {rel_err(a, b):.2e} >= {tol}"


# Token counts, H and D chosen off the interpreter's 16x32x16 tiles: partial row/column tiles, a K tail.
@pytest.mark.parametrize("lead,d,h", [((37,), 40, 72), ((2, 19), 48, 96), ((5,), 16, 32)])
def test_interpreter_matches_reference_fp32(interpreter, lead, d, h):
    x, w_up, w_down = make_inputs(lead, d, h, torch.float32)
    assert mlp.kernels_used_for(x)
    assert_matches_reference(x, w_up, w_down, tol=1e-5)


@pytest.mark.parametrize("schedule", mlp.SCHEDULES)
def test_interpreter_every_schedule_through_fused_mlp(interpreter, schedule):
    x, w_up, w_down = make_inputs((2, 23), 40, 72, torch.float32)  # 160- and 288-byte rows: TMA-compatible
    assert_matches_reference(x, w_up, w_down, tol=1e-5, schedule=schedule)


def test_interpreter_matches_reference_fp16(interpreter):
    x, w_up, w_down = make_inputs((33,), 32, 80, torch.float16)
    assert mlp.kernels_used_for(x)
    assert_matches_reference(x, w_up, w_down, tol=5e-3)


def torch_epilogue_reference(a, b, aux, epilogue):
    acc = a.double() @ b.double()
    if epilogue == mlp_triton.EPILOGUE_ACTIVATION:
        return leaky_relu_sq(acc), leaky_relu_sq_grad(acc)
    return acc * aux.double(), aux.double()


def epilogue_case(m: int, k: int, n: int, epilogue: int, device: str = "cpu", dtype=torch.float32):
    """a, b (a transposed view, as W_upᵀ in the forward), NaN-poisoned out and aux (aux holds act_grad
    for the GRAD epilogue)."""
    a = torch.randn(m, k, device=device).to(dtype)
    b = (torch.randn(n, k, device=device) / k**0.5).to(dtype).t()
    out = torch.full((m, n), float("nan"), device=device, dtype=dtype)
    aux = (torch.randn(m, n, device=device).to(dtype) if epilogue == mlp_triton.EPILOGUE_GRAD
           else torch.full_like(out, float("nan")))
    return a, b, out, aux


EPILOGUES = pytest.mark.parametrize("epilogue", [mlp_triton.EPILOGUE_ACTIVATION, mlp_triton.EPILOGUE_GRAD],
                                    ids=["activation", "grad"])


@pytest.mark.parametrize("schedule", mlp.SCHEDULES)
@EPILOGUES
def test_interpreter_every_schedule_writes_every_element(interpreter, schedule, epilogue):
    a, b, out, aux = epilogue_case(45, 24, 68, epilogue)  # row strides of 96 and 272 bytes: TMA-compatible
    want_out, want_aux = torch_epilogue_reference(a, b, aux, epilogue)
    mlp.launch_gemm(a, b, out, aux, epilogue, schedule, programs=3)
    assert rel_err(out, want_out) < 1e-5
    assert rel_err(aux, want_aux) < 1e-5


@pytest.mark.parametrize("split", [1, 2, 4])
@EPILOGUES
def test_interpreter_tma_epilogue_splits(interpreter, split, epilogue):
    """Every EPILOGUE_SPLIT the GPU configs use, and a row-major b (as W_down in the backward)."""
    a, b, out, aux = epilogue_case(37, 40, 136, epilogue)
    b = b.contiguous()
    want_out, want_aux = torch_epilogue_reference(a, b, aux, epilogue)
    m, k = a.shape
    n = b.shape[1]
    mlp_triton.mlp_gemm_tma_kernel.fn[(3,)](
        a, b, out, aux, m, n, k, a.stride(0), b.stride(0), out.stride(0), 3, mlp_triton.row_bucket(m),
        EPILOGUE=epilogue, B_K_MAJOR=False, IEEE_FP32=True, BLOCK_M=16, BLOCK_N=64, BLOCK_K=16, GROUP_M=2,
        EPILOGUE_SPLIT=split)
    assert rel_err(out, want_out) < 1e-5
    assert rel_err(aux, want_aux) < 1e-5


def test_schedule_selection_and_errors():
    a, b, out, aux = epilogue_case(8, 16, 32, mlp_triton.EPILOGUE_ACTIVATION)
    assert mlp.tma_compatible(a, b, out, aux)
    assert mlp.resolve_schedule("auto", a, b, out, aux) == "tiled"  # CPU: the descriptor kernel is for Hopper
    assert mlp.resolve_schedule("tma", a, b, out, aux) == "tma"  # the interpreter runs it when asked
    broadcast = torch.randn(1, 16).expand(8, 16)  # rows of stride 0
    assert not mlp.tma_compatible(broadcast, b, out, aux)
    assert not mlp.tma_compatible(torch.randn(8, 5), torch.randn(5, 32), out, aux)  # 20-byte rows
    assert mlp.resolve_schedule("tma", broadcast, b, out, aux) == "tiled"
    column_major = torch.randn(16, 8).t()  # a [8, 16] view with strides (1, 8): the kernel reads a row-major
    assert not mlp.tma_compatible(column_major, b, out, aux)
    assert mlp.tma_compatible(a, b.t().contiguous().t(), out, aux)  # b as a transposed row-major [N, K]: fine
    with FakeTensorMode():  # tracing: no data pointer, the storage offset decides
        fake = torch.empty(8, 16)
        fake_b, fake_out = torch.empty(16, 32), torch.empty(8, 32)
        assert mlp.tma_compatible(fake, fake_b, fake_out, fake_out)
        assert not mlp.tma_compatible(fake[:, 1:], fake_b[1:], fake_out, fake_out)
    with pytest.raises(ValueError, match="schedule must be"):
        mlp.fused_mlp(torch.randn(4, 16), torch.randn(32, 16), torch.randn(16, 32), schedule="fastest")
    with pytest.raises(ValueError, match="schedule must be one of"):
        mlp.launch_gemm(a, b, out, aux, mlp_triton.EPILOGUE_ACTIVATION, "fastest")
    with pytest.raises(ValueError, match="tma schedule needs"):
        mlp.launch_gemm(torch.randn(8, 5), torch.randn(5, 32), out, aux, mlp_triton.EPILOGUE_ACTIVATION, "tma")
    with pytest.raises(ValueError, match="out and aux must be row-major"):  # the epilogue would index aux wrong
        mlp.launch_gemm(a, b, out, aux.t().contiguous().t(), mlp_triton.EPILOGUE_ACTIVATION, "tiled")


@pytest.mark.parametrize("schedule", mlp.SCHEDULES)
def test_interpreter_column_major_x_and_dy(interpreter, schedule):
    """x from a transpose (batch 1 reshapes it without a copy) and a transposed dy: the tma schedule read them as
    row-major and gave wrong outputs and gradients with no error; it now falls back to tiled for them."""
    x, w_up, w_down = make_inputs((1,), 40, 72, torch.float32)
    x = torch.randn(1, 40, 37).transpose(1, 2)  # [1, 37, 40] whose reshape to [37, 40] has strides (1, 37)
    assert x.reshape(-1, 40).stride() == (1, 37)
    dy = torch.randn(1, 40, 37).transpose(1, 2)
    got = forward_backward(lambda *a: mlp.fused_mlp(*a, schedule=schedule), x, w_up, w_down, dy)
    want = reference_fp64(x, w_up, w_down, dy)
    for name, mine, ref in zip(("y", "dx", "dw_up", "dw_down"), got, want):
        assert rel_err(mine, ref) < 1e-5, name


def test_fused_mlp_under_autocast_takes_fp32_tensors(interpreter):
    """Autocast reached the op's own torch.mm (bf16 from fp32 inputs) and the backward failed on mixed dtypes."""
    x, w_up, w_down = make_inputs((2, 9), 16, 32, torch.float32)
    leaves = [t.clone().requires_grad_() for t in (x, w_up, w_down)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = mlp.fused_mlp(*leaves)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    ref = [t.clone().requires_grad_() for t in (x, w_up, w_down)]
    mlp_reference(*ref).sum().backward()
    for mine, want in zip(leaves, ref):
        assert mine.grad.dtype == torch.float32 and rel_err(mine.grad, want.grad) < 2e-2


@pytest.mark.parametrize("schedule", ["auto", "tma"])
def test_interpreter_broadcast_grad_and_partial_requires_grad(interpreter, schedule):
    """y.sum() gives a stride-0 dy (the tma schedule falls back to tiled for it); frozen weights must get
    no gradient and cost no work."""
    x, w_up, w_down = make_inputs((29,), 32, 48, torch.float32)
    x_leaf = x.clone().requires_grad_()
    mlp.fused_mlp(x_leaf, w_up, w_down, schedule=schedule).sum().backward()
    x_ref = x.double().requires_grad_()
    mlp_reference(x_ref, w_up.double(), w_down.double()).sum().backward()
    assert rel_err(x_leaf.grad, x_ref.grad) < 1e-5
    assert w_up.grad is None and w_down.grad is None


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-9), (torch.float32, 1e-4)])
def test_second_order_gradients_match_the_reference(interpreter, dtype, tol):
    """backward(create_graph=True) through the fused op: dW_down = dyᵀ·post came from the saved, non-differentiable
    post, so a gradient penalty's second-order term lost its path to x and W_up without an error. fp32 runs the
    interpreted kernel forward (fp64 the PyTorch ops); the backward of both is the differentiable one."""
    x, w_up, w_down = make_inputs((11,), 16, 32, torch.float32)
    assert mlp.kernels_used_for(x.to(dtype)) == (dtype == torch.float32)
    grads = []
    for fn in (mlp.fused_mlp, mlp_reference):
        leaves = [t.to(dtype).requires_grad_() for t in (x, w_up, w_down)]
        y = fn(*leaves)
        g_x, g_up, g_down = torch.autograd.grad(y.square().sum(), leaves, create_graph=True)
        (y.sum() + g_x.square().sum() + g_up.square().sum() + 1e-3 * g_down.square().sum()).backward()
        grads.append([t.grad for t in leaves])
    for name, mine, ref in zip(("x", "w_up", "w_down"), *grads):
        assert rel_err(mine, ref) < tol, name


def test_cpu_without_interpreter_uses_pytorch_ops(no_interpreter):
    x, w_up, w_down = make_inputs((3, 7), 16, 40, torch.float32)
    assert not mlp_triton.kernels_interpreted() and not mlp.kernels_used_for(x)
    assert_matches_reference(x, w_up, w_down, tol=1e-5)


def test_bfloat16_on_interpreter_falls_back_to_pytorch(interpreter):
    x, w_up, w_down = make_inputs((9,), 16, 32, torch.bfloat16)
    assert not mlp.kernels_used_for(x)
    assert_matches_reference(x, w_up, w_down, tol=1e-2)


@pytest.mark.parametrize("shapes,match", [
    (((4, 16), (32, 8), (16, 32)), "shape mismatch"),
    (((4, 16), (32, 16), (16, 30)), "shape mismatch"),
    (((4, 16), (32, 16, 1), (16, 32)), "expected x"),
])
def test_bad_shapes_raise_clear_errors(shapes, match):
    x, w_up, w_down = (torch.randn(s) for s in shapes)
    with pytest.raises(ValueError, match=match):
        mlp.fused_mlp(x, w_up, w_down)


def test_mixed_dtypes_raise_clear_error():
    x, w_up, w_down = make_inputs((4,), 16, 32, torch.float32)
    with pytest.raises(ValueError, match="share dtype"):
        mlp.fused_mlp(x, w_up.half(), w_down)


def block_with_mlp(mlp_fn, x, w_up, w_down):
    """Work around the MLP so the compiler has something to fuse across it."""
    return (x + mlp_fn(F.rms_norm(x, (x.shape[-1],)), w_up, w_down) * 0.5).square().mean()


@pytest.fixture(params=[False, True], ids=["plain", "interpreter"])
def either_kernel_build(request):
    yield from kernels_built_with(interpret=request.param)


def test_compile_fullgraph_cpu_fallback(either_kernel_build):
    """On CPU the compiled graph computes the MLP with PyTorch ops, also when the interpreter is on."""
    torch._dynamo.reset()
    x, w_up, w_down = make_inputs((2, 11), 32, 64, torch.float32)
    compiled = torch.compile(lambda *a: block_with_mlp(mlp.fused_mlp, *a), fullgraph=True, backend="aot_eager")
    got = forward_backward(compiled, x, w_up, w_down, torch.tensor(1.0))
    want = forward_backward(lambda *a: block_with_mlp(mlp_reference, *a), x, w_up, w_down, torch.tensor(1.0))
    for a, b in zip(got, want):
        assert rel_err(a, b) < 1e-5


# ---------------------------------------------------------------- GPU (bf16, real kernels)

@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("schedule", mlp.SCHEDULES)
@pytest.mark.parametrize("lead,d,h", [((4, 1037), 512, 1792), ((3001,), 384, 1000)])
def test_gpu_bf16_matches_reference(lead, d, h, schedule):
    x, w_up, w_down = make_inputs(lead, d, h, torch.bfloat16, device="cuda")
    assert mlp.kernels_used_for(x)
    assert_matches_reference(x, w_up, w_down, tol=1e-2, schedule=schedule)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("schedule", ["auto", *mlp.SCHEDULES])
def test_gpu_fp32_fp16_and_column_major_inputs(schedule):
    """fp32 on Hopper crashed in the default schedule (no tensor-descriptor tile fits its shared memory in fp32); a
    column-major x was read as row-major by it. fp64 compiled to nothing: PyTorch ops compute it."""
    for dtype, tol in ((torch.float32, 1e-4), (torch.float16, 1e-2)):
        x, w_up, w_down = make_inputs((515,), 256, 512, dtype, device="cuda")
        assert_matches_reference(x, w_up, w_down, tol=tol, schedule=schedule)
    x, w_up, w_down = make_inputs((1,), 256, 512, torch.bfloat16, device="cuda")
    x = torch.randn(1, 256, 1000, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    assert_matches_reference(x, w_up, w_down, tol=1e-2, schedule=schedule)
    x64, w_up64, w_down64 = make_inputs((33,), 64, 96, torch.float64, device="cuda")
    assert not mlp.kernels_used_for(x64)
    assert_matches_reference(x64, w_up64, w_down64, tol=1e-10, schedule=schedule)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("schedule", mlp.SCHEDULES)
def test_gpu_every_schedule_writes_every_element(schedule):
    for epilogue in (mlp_triton.EPILOGUE_ACTIVATION, mlp_triton.EPILOGUE_GRAD):
        a, b, out, aux = epilogue_case(2051, 512, 1000, epilogue, device="cuda", dtype=torch.bfloat16)
        for b_layout in (b, b.contiguous()):  # W_upᵀ view (forward) and row-major (W_down, backward)
            out.fill_(float("nan"))
            want_out, want_aux = torch_epilogue_reference(a, b_layout, aux, epilogue)
            mlp.launch_gemm(a, b_layout, out, aux, epilogue, schedule)
            assert rel_err(out, want_out) < 1e-2 and rel_err(aux, want_aux) < 1e-2


@pytest.mark.gpu
@needs_cuda
def test_gpu_compile_fullgraph_uses_kernels():
    from torch._inductor.utils import run_and_get_code
    torch._dynamo.reset()
    x, w_up, w_down = make_inputs((2, 1000), 512, 1792, torch.bfloat16, device="cuda")
    compiled = torch.compile(lambda *a: block_with_mlp(mlp.fused_mlp, *a), fullgraph=True)
    leaves = [t.clone().requires_grad_() for t in (x, w_up, w_down)]
    loss, codes = run_and_get_code(compiled, *leaves)
    assert any("mlp_gemm" in code for code in codes), "compiled graph does not launch the Triton GEMM"
    loss.backward()
    want = forward_backward(lambda *a: block_with_mlp(mlp.fused_mlp, *a), x, w_up, w_down,
                            torch.tensor(1.0, device="cuda"))
    for a, b in zip([loss.detach()] + [t.grad for t in leaves], want):
        assert rel_err(a, b) < 1e-2


def train_losses(mlp_fn, steps: int = 5, lr: float = 0.05) -> list[float]:
    """Losses of a 2-layer residual MLP stack (bf16 weights) trained with plain SGD on fixed data."""
    g = torch.Generator(device="cuda").manual_seed(3)
    d, h, tokens = 256, 768, 4096
    weights = []
    for _ in range(2):
        weights += [torch.randn(h, d, generator=g, device="cuda") / d**0.5,
                    torch.randn(d, h, generator=g, device="cuda") / h**0.5]
    weights = [w.to(torch.bfloat16).requires_grad_() for w in weights]
    x = torch.randn(tokens, d, generator=g, device="cuda").to(torch.bfloat16)
    target = torch.randn(tokens, d, generator=g, device="cuda").to(torch.bfloat16)
    losses = []
    for _ in range(steps):
        h_ = x
        for w_up, w_down in zip(weights[0::2], weights[1::2]):
            h_ = h_ + mlp_fn(F.rms_norm(h_, (d,)), w_up, w_down)
        loss = (h_.float() - target.float()).square().mean()
        loss.backward()
        with torch.no_grad():
            for w in weights:
                w -= lr * w.grad
                w.grad = None
        losses.append(loss.item())
    return losses


@pytest.mark.gpu
@needs_cuda
def test_gpu_training_steps_match_reference():
    got, want = train_losses(mlp.fused_mlp), train_losses(mlp_reference)
    assert want[-1] < want[0], f"reference did not train: {want}"
    for a, b in zip(got, want):
        assert abs(a - b) <= 1e-2 * abs(b), f"kernel losses {got} vs reference {want}"


# ---------------------------------------------------------------- benchmark script

@pytest.mark.parametrize("flag", ["--tokens", "--d-model", "--hidden", "--rep-ms"])
def test_bench_rejects_nonpositive_sizes(flag, capsys):
    from scripts import bench_mlp
    with pytest.raises(SystemExit):
        bench_mlp.parse_args([flag, "0"])
    assert f"{flag} must be positive" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without a GPU")
def test_bench_without_gpu_exits_with_message():
    from scripts import bench_mlp
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bench_mlp.main(["--tokens", "64"])


def test_bench_env_var_sets_and_restores(monkeypatch):
    """bench_mlp autotunes into an empty Triton cache (a warm one printed an earlier run's timings as its own) and
    gives the variable back as it was, set or not."""
    from scripts.bench_mlp import env_var
    monkeypatch.setenv("TRITON_CACHE_DIR", "/before")
    with env_var("TRITON_CACHE_DIR", "/during"):
        assert os.environ["TRITON_CACHE_DIR"] == "/during"
    assert os.environ["TRITON_CACHE_DIR"] == "/before"
    monkeypatch.delenv("TRITON_CACHE_DIR")
    with pytest.raises(RuntimeError), env_var("TRITON_CACHE_DIR", "/during"):
        raise RuntimeError
    assert "TRITON_CACHE_DIR" not in os.environ


@pytest.mark.gpu
@needs_cuda
def test_bench_runs_small_shape(capsys, monkeypatch):
    from scripts import bench_mlp
    seen, real_rows = [], bench_mlp.gemm_rows

    def gemm_rows(*args):
        seen.append(os.environ["TRITON_CACHE_DIR"])
        return real_rows(*args)
    monkeypatch.setattr(bench_mlp, "gemm_rows", gemm_rows)
    times = bench_mlp.main(["--tokens", "2048", "--d-model", "256", "--hidden", "512", "--rep-ms", "20"])
    assert "bench_mlp_triton_" in seen[0] and os.environ.get("TRITON_CACHE_DIR") != seen[0]
    assert set(times) == {"fused, auto schedule (eager)", "fused, tiled (torch.compile)",
                          "fused, tma (torch.compile)", "reference (torch.compile)", "reference (eager)"}
    assert all(ms > 0 for passes in times.values() for ms in passes.values())
    assert "speed vs compile" in capsys.readouterr().out
