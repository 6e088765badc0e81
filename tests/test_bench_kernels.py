"""scripts/bench_kernels.py and scripts/mhc_bytes.py: the byte counts against the launches, argument parsing, the
sweep summary, dispatch; on a GPU (`gpu`), the benchmark itself, short."""
import pytest
import torch

from kernels import mhc as K
from kernels import mhc_reference as R


def test_bench_floor_bytes_are_the_stated_count():
    from kernels.mhc_traffic import floor_bytes_per_token
    # n=4, C=512: fwd 10*C bf16 + 2*80 B coefficients + 100 B raw/inv_rms; bwd 15*C bf16 + 3*80 + 100
    assert floor_bytes_per_token(4, 512) == {"fwd": 10_500, "bwd": 15_700, "fwd+bwd": 26_200}


def test_bench_kernel_bytes_count_what_each_launch_of_the_unit_passes():
    """kernel_bytes_per_token against the launches themselves: the per-token tensors that the five kernels of
    mhc_post_pre's forward and backward receive (recorded on meta tensors, as mhc.py launches them); and
    stream_rows, on which the block sweep rates each kernel, against their bf16 stream tensors (mhc_pre's
    launch too, the sweep's coef_premix_pre)."""
    pytest.importorskip("triton")
    from kernels.mhc_bwd import launch_coef_bwd, launch_dphi, launch_stream_bwd
    from kernels.mhc_fwd import launch_coef_premix
    from scripts.kernel_resources import Recorder, kernel_name
    from kernels.mhc_traffic import design_bound, floor_bytes_per_token, kernel_bytes_per_token, stream_rows

    T, C = 1000, 64
    for n in (2, 4):
        N = R.mhc_num_coefficients(n)
        new = lambda *shape, dtype=torch.float32: torch.empty(*shape, dtype=dtype, device="meta")  # noqa: E731
        x, y, dx_new, du = new(T, n, C, dtype=torch.bfloat16), new(T, C, dtype=torch.bfloat16), \
            new(T, n, C, dtype=torch.bfloat16), new(T, C, dtype=torch.bfloat16)
        h_res, h_post, dh_res, dh_post = new(T, n, n), new(T, n), new(T, n, n), new(T, n)
        phi, alpha, bias = new(N, n * C).t(), new(3), new(N)
        rec = Recorder()
        x_new, _, _, _, raw, rinv = launch_coef_premix(rec, x, y, h_res, h_post, phi, alpha, bias, 20)
        aux, _, _ = launch_coef_bwd(rec, x_new, du, dh_post, dh_res, raw, rinv, alpha, bias, 20)
        launch_stream_bwd(rec, x, y, h_res, h_post, dx_new, du, aux, phi)
        launch_dphi(rec, x_new, aux)
        launch_coef_premix(rec, x, None, None, None, phi, alpha, bias, 20)  # mhc_pre: the sweep's coef_premix_pre
        counted, streams = {}, {}
        for (kernel, args, kwargs), name in zip(rec.launches, [*kernel_bytes_per_token(n, C), "coef_premix_pre"]):
            assert kernel_name(kernel).removesuffix("_kernel") == name.removesuffix("_pre")
            per_token = {id(a): a for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor) and a.shape[0] == T}
            counted[name] = sum(a.numel() * a.element_size() for a in per_token.values()) // T
            stream = {id(a): a for a in per_token.values() if a.dtype == torch.bfloat16}
            streams[name] = sum(a.numel() for a in stream.values()) // (T * C)
        assert {k: v for k, v in counted.items() if k != "coef_premix_pre"} == kernel_bytes_per_token(n, C)
        assert {k: v for k, v in streams.items() if k != "coef_bwd"} == stream_rows(n)
    # n=4, C=512: 35,832 bytes, 1.37x the floor's 26,200 (docs/kernels.md)
    assert sum(kernel_bytes_per_token(4, 512).values()) == 35_832
    assert floor_bytes_per_token(4, 512)["fwd"] == kernel_bytes_per_token(4, 512)["coef_premix"]
    assert design_bound(4, 512).endswith("sum 35832 = 1.37x the floor, so at copy bandwidth this design reaches "
                                         "73.1% of the floor at most")


def test_bench_mhc_flags_parse_and_reject_bad_values(capsys):
    from kernels.mhc_blocks import SWEEP
    from scripts.bench_kernels import parse_mhc_args
    args = parse_mhc_args([])
    assert (args.tokens, args.n, args.C, args.rep_ms, args.sweep) == ([32_768, 98_304], 4, 512, 200, [])
    args = parse_mhc_args(["--tokens", "100", "200", "--n", "8", "--C", "96", "--rep-ms", "5", "--sweep"])
    assert (args.tokens, args.n, args.C, args.rep_ms, args.sweep) == ([100, 200], 8, 96, 5, list(SWEEP))
    assert parse_mhc_args(["--sweep", "stream_bwd, dphi"]).sweep == ["stream_bwd", "dphi"]
    assert (args.impls, args.profile_once) == (["eager", "compiled", "triton"], False)
    args = parse_mhc_args(["--impls", "triton, eager", "--profile-once"])
    assert (args.impls, args.profile_once) == (["triton", "eager"], True)
    assert parse_mhc_args(["--impls", "triton-graph"]).impls == ["triton-graph"]  # asked for, never by default
    for bad, says in ((["--n", "3"], "--n must be a power of two >= 2 and --C a positive multiple of 16, got n=3"),
                      (["--C", "40"], "got n=4 C=40"), (["--tokens", "0"], "--tokens and --rep-ms must be positive"),
                      (["--rep-ms", "-1"], "got [32768, 98304] and -1"),
                      (["--impls", "cuda"], "--impls must name some of eager,compiled,triton,triton-graph, got "
                                            "['cuda']"),
                      (["--impls", ","], "--impls must name some of eager,compiled,triton,triton-graph, got nothing"),
                      (["--sweep", "stream_fwd"], "--sweep takes 'all' or kernels among coef_premix,")):
        with pytest.raises(SystemExit):
            parse_mhc_args(bad)
        assert says in capsys.readouterr().err, bad


@pytest.mark.parametrize("n", [4, 2])
def test_bench_sweep_summary_compares_the_fastest_block_with_this_ns_default(n):
    from kernels.mhc_blocks import SWEEP, default_blocks
    from scripts.bench_kernels import sweep_summary
    defaults = default_blocks(n)
    for name, configs in SWEEP.items():  # every default is a SWEEP row, so every sweep can compare with it
        assert defaults[name] in configs, name
        assert configs[0] == default_blocks(4)[name], f"{name}: SWEEP's first row is the n=4 default"
    text = lambda cfg: ",".join(f"{k}={v}" for k, v in cfg.items())  # noqa: E731
    rows = [("stream_bwd", text(cfg), 1.0 + i, 50.0) for i, cfg in enumerate(SWEEP["stream_bwd"])]
    default_ms = 1.0 + SWEEP["stream_bwd"].index(defaults["stream_bwd"])
    assert sweep_summary(rows, defaults) == [
        f"stream_bwd: fastest {rows[0][1]} 1.000 ms, {default_ms:.2f}x the default {text(defaults['stream_bwd'])} "
        f"({default_ms:.3f} ms)"]
    missing = sweep_summary(rows[1:2], {"stream_bwd": dict(BT=8)})
    assert missing == [f"stream_bwd: fastest {rows[1][1]} 2.000 ms; the default BT=8 is not a SWEEP row "
                       "(hint: add it to SWEEP to compare)"]


def test_bench_dispatches_subcommands(capsys, monkeypatch):
    from scripts.bench_kernels import main
    with pytest.raises(SystemExit, match="usage: bench_kernels.py"):
        main([])
    with pytest.raises(SystemExit) as exit_info:  # the top-level help names both subcommands
        main(["--help"])
    assert exit_info.value.code == 0 and "scripts.bench_kernels mhc" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="the fused MLP's benchmark is python -m scripts.bench_mlp"):  # a tool of its own
        main(["mlp", "--help"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same on a GPU machine
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        main(["mhc", "--tokens", "64"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_bench_mhc_runs_with_sweep():
    from scripts.bench_kernels import main
    rows = main(["mhc", "--tokens", "3000", "--C", "512", "--rep-ms", "10", "--sweep"])
    assert len(rows) == 9 and all(r["ms"] > 0 and r["pct"] > 0 for r in rows)
    rows = main(["mhc", "--tokens", "3000", "--rep-ms", "10", "--impls", "triton"])
    assert [r["impl"] for r in rows] == ["triton kernels"] * 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_cuda_graph_replays_the_passes_it_times():
    """Each pass captured by cuda_graph recomputes what it computes eagerly (replayed into the graph's own
    outputs), and bench_kernels times all three passes that way. The backward is captured as the
    benchmark does it: on the outputs of a captured forward (autograd runs it on the forward's stream)."""
    from scripts.bench_kernels import cuda_graph, main, make_inputs
    inputs = make_inputs(3000, 4, 512)
    # Separate leaves for the eager reference: autograd syncs with the stream a leaf was first used on, and a
    # leaf used eagerly on the default stream makes the captured backward wait on that stream (a capture error).
    eager_leaves, leaves = ([t.detach().clone().requires_grad_() for t in inputs] for _ in range(2))
    eager_outs = K.mhc_post_pre(*eager_leaves)
    fwd_replay, outs = cuda_graph(lambda: K.mhc_post_pre(*leaves))
    cotangents = [torch.randn_like(o) for o in outs]
    eager = torch.autograd.grad(eager_outs, eager_leaves, cotangents, retain_graph=True)
    bwd_replay, grads = cuda_graph(lambda: torch.autograd.grad(outs, leaves, cotangents, retain_graph=True))
    with torch.no_grad():
        for t in [*outs, *grads]:
            t.zero_()
    fwd_replay()
    bwd_replay()
    torch.cuda.synchronize()
    for i, (a, b) in enumerate(zip(outs, eager_outs)):
        assert torch.equal(a, b), f"output {i} differs after replay"
    for i, (a, b) in enumerate(zip(grads, eager)):
        assert torch.equal(a, b), f"gradient {i} differs after replay"
    rows = main(["mhc", "--tokens", "3000", "--rep-ms", "10", "--impls", "triton-graph"])
    assert [(r["impl"], r["pass_name"]) for r in rows] == [("triton, CUDA graph", p) for p in ("fwd", "bwd", "fwd+bwd")]
    assert all(r["ms"] > 0 for r in rows)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_bench_mhc_profile_once_runs_the_unit_and_times_nothing(capsys):
    from scripts.bench_kernels import main
    assert main(["mhc", "--tokens", "3000", "--profile-once"]) == []
    assert "ran mhc_post_pre forward+backward twice at T=3000" in capsys.readouterr().out


def test_mhc_bytes_prints_what_the_floor_allows_per_step(capsys):
    """`python scripts/mhc_bytes.py`: README's arithmetic (n=4: 22 x 0.859 ms at the floor, a step of no less than
    ~101 ms beside the 82.1 ms outside the mHC kernels, 1.13x the plain 89.1 ms; n=2 on its own profile) as a
    command; bad values are refused by name."""
    from scripts import mhc_bytes
    mhc_bytes.main(["--n", "4", "--gbps", "2997", "--rest-ms", "82.1", "--plain-ms", "89.1"])
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines()[2:]]
    assert rows == [["| 4", "26,200", "35,832", "0.859", "1.175", "18.9", "25.9", "101.0", "1.13x |"]]
    mhc_bytes.main(["--rest-ms", "80.8", "81.5", "--plain-ms", "88.6"])
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines()[2:]]
    assert rows[0][:8] == ["| 4", "26,200", "35,832", "0.859", "1.174", "18.9", "25.8", "99.7"]
    assert rows[1][0] == "| 2" and rows[1][7:] == ["92.7", "1.05x |"]
    mhc_bytes.main(["--n", "4", "--sublayers", "11"])  # mHC around half the sublayers: half the step's ms
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines()[2:]]
    assert rows == [["| 4", "26,200", "35,832", "0.859", "1.174", "9.4", "12.9 |"]]
    for argv, says in ((["--n", "0"], "argument --n: invalid choice: 0"), (["--n", "1"], "invalid choice: 1"),
                       (["--n", "3"], "invalid choice: 3"), (["--gbps", "-1"], "--gbps must be positive"),
                       (["--rest-ms", "3"], "--rest-ms takes one value per --n (2), got 1"),
                       (["--plain-ms", "3"], "--plain-ms needs --rest-ms")):
        with pytest.raises(SystemExit):
            mhc_bytes.main(argv)
        assert says in capsys.readouterr().err
