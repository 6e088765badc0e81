"""scripts/bench_step.py runs every variant end to end (tiny model on CPU; timings are not asserted)."""
import math
import os
import subprocess
import sys

import pytest
import torch

from scripts import bench_step
from training import bench_batches

TINY = ["model.n_layers=1", "model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1", "data.seq_len=16",
        "train.batch_tokens=64", "train.micro_batch_seqs=4", "train.compile=false"]


@pytest.mark.slow  # the kernel variants run their Triton kernels in the interpreter: one timed step each, no warm-up
def test_every_variant_runs_and_reports(capsys):
    rows = bench_step.main(["--config", str(bench_step.REPO / "configs/demo.toml"), "--steps", "1", "--warmup", "0",
                            "--variants", "all", *TINY])
    assert [r["variant"] for r in rows] == list(bench_step.VARIANTS)
    assert all(r["tok_s"] > 0 and math.isfinite(r["loss"]) for r in rows)
    params = {r["variant"]: r["params"] for r in rows}
    assert params["config-kernels"] == params["n4-kernels"]  # demo.toml: 4 streams on every sublayer
    assert params["n4-kernels"] > params["n4-block-kernels"] > params["n2-block-kernels"] > params["n1-kernels"]
    out = capsys.readouterr().out
    assert sum(out.count(f"\n| {name} |") for name in bench_step.VARIANTS) == len(bench_step.VARIANTS)
    assert all(r["ranks"] == 1 for r in rows)


def test_torchrun_times_the_distributed_step_and_reports_once():
    """2 gloo ranks, each a micro-batch of the global batch (as train.py splits it); rank 0 prints."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "scripts.bench_step", "--config", str(bench_step.REPO / "configs/demo.toml"),
           "--steps", "2", "--warmup", "1", "--variants", "n1-ref", *TINY, "train.batch_tokens=128"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=bench_step.REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| n1-ref |")]
    assert len(rows) == 1, done.stdout  # printed by rank 0 only
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert cells[1] == "2" and float(cells[4].replace(",", "")) > 0  # ranks, tokens/s


def test_default_variants_are_the_shipped_config_and_the_kernels_on_off_grid():
    """By default: the shipped layout with every kernel, then 4 streams and the plain network, each with
    the Triton kernels and with the PyTorch reference (what each one builds, on the recipe config)."""
    from training.config import load_config
    short = str(bench_step.REPO / "configs/h100_short.toml")
    built = {}
    for name in bench_step.DEFAULT_VARIANTS:
        m = load_config(short, bench_step.variant_overrides(name, [])).model
        built[name] = (m.n_streams, m.mhc_blocks, m.mlp_kernel, m.mhc_kernels if m.n_streams > 1 else None)
    assert built == {"config-kernels": (2, 3, True, True), "n4-kernels": (4, 0, True, True),
                     "n4-ref": (4, 0, False, False), "n1-kernels": (1, 0, True, None), "n1-ref": (1, 0, False, None)}


def test_named_variants_fix_the_mhc_layout_and_overrides_win():
    """A named variant means the same on every config: on the recipe configs (2 streams, mHC on 3 blocks)
    n4-kernels is still mHC on every sublayer of every block, and the n1 variants are valid there; the
    command line's overrides come after the variant's, so model.mhc_blocks=5 applies to n2-kernels."""
    from training.config import load_config
    short = str(bench_step.REPO / "configs/h100_short.toml")
    shipped = load_config(short, bench_step.VARIANTS["config-kernels"]).model
    assert (shipped.n_streams, shipped.mhc_blocks, shipped.mhc_kernels) == (2, 3, True)
    n4 = load_config(short, bench_step.VARIANTS["n4-kernels"]).model
    assert (n4.n_streams, n4.mhc_blocks, n4.mhc_granularity) == (4, 0, "sublayer")
    assert load_config(short, bench_step.VARIANTS["n1-ref"]).model.n_streams == 1
    n2k5 = load_config(short, bench_step.variant_overrides("n2-kernels", ["model.mhc_blocks=5"])).model
    assert (n2k5.n_streams, n2k5.mhc_blocks) == (2, 5)


def test_main_benchmarks_each_variant_with_the_overrides_last(monkeypatch, capsys):
    seen = []

    def fake_bench(cfg, steps, warmup, dist, profile, recurrence, doc_tokens, tokens):
        seen.append((cfg.model.n_streams, cfg.model.mhc_blocks, cfg.model.mhc_kernels, cfg.train.device))
        return dict(ranks=1, params=1, ms_step=1.0, tok_s=1.0, mfu=0.0, peak_gib=0.0, warmup_s=0.0, loss=0.0,
                    profile=None)
    monkeypatch.setattr(bench_step, "bench_variant", fake_bench)
    demo = str(bench_step.REPO / "configs/demo.toml")
    bench_step.main(["--config", demo, "--variants", "n2-kernels,config-kernels", "model.mhc_blocks=1",
                     "train.device=cpu"])
    # each variant's own settings, then the command line's: n2-kernels sets mhc_blocks=0 and the command line's 1
    # wins; config-kernels keeps the demo config's layout, with the command line's mhc_blocks
    assert seen == [(2, 1, True, "cpu"), (4, 1, True, "cpu")]  # config-kernels keeps the demo's 4 streams
    assert "| n2-kernels |" in capsys.readouterr().out


def test_a_variant_the_overrides_do_not_suit_is_refused_before_any_runs(monkeypatch, capsys):
    """n2 on 5 blocks is fine, n1 with mhc_blocks=5 is not: refused up front, not after n2 has compiled."""
    monkeypatch.setattr(bench_step, "bench_variant", lambda *a, **k: pytest.fail("a variant ran"))
    with pytest.raises(SystemExit):
        bench_step.main(["--variants", "n2-kernels,n1-kernels", "model.mhc_blocks=5"])
    assert "model.mhc_blocks=5 needs n_streams >= 2" in capsys.readouterr().err


def test_unknown_variant_is_refused(capsys):
    with pytest.raises(SystemExit):
        bench_step.main(["--variants", "n3-fast"])
    assert "error: unknown variants ['n3-fast']; choose from ['config-kernels'," in capsys.readouterr().err


def test_counts_and_a_missing_gpu_are_one_line_each(monkeypatch, capsys):
    """--steps 0 divided by zero and --steps -1 failed on an unbound name; train.device=cuda without a GPU was a
    traceback from the process-group setup."""
    monkeypatch.setattr(bench_step, "bench_variant", lambda *a, **k: pytest.fail("a variant ran"))
    for flags in (["--steps", "0"], ["--steps", "-1"], ["--warmup", "-1"]):
        with pytest.raises(SystemExit):
            bench_step.main([*flags, "--variants", "n1-ref"])
        assert "need --steps >= 1, --warmup >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_step.main(["--warmup", "0", "--variants", "n1-ref"])  # the default config compiles
    assert "--warmup 0 with train.compile=true times torch.compile's first step" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same on a GPU machine
    with pytest.raises(SystemExit):
        bench_step.main(["--variants", "n1-ref", "train.device=cuda"])
    assert "error: train.device='cuda' but no CUDA device is visible (hint:" in capsys.readouterr().err


def test_recurrence_on_times_the_second_phase(monkeypatch, capsys):
    """--recurrence on: every step (warm-up, timed, profiled) runs with the repeated blocks on, and MFU's FLOPs count
    them; the default times the first phase."""
    phases = []
    real_step = bench_step.train_step

    def recording_step(step_model, *args):
        phases.append(step_model.recurrence_on)
        return real_step(step_model, *args)
    monkeypatch.setattr(bench_step, "train_step", recording_step)
    recur = [*TINY, "model.n_layers=3", "model.recur_start=1", "model.recur_end=1", "model.recur_times=2"]
    demo = str(bench_step.REPO / "configs/demo.toml")
    on = bench_step.main(["--config", demo, "--steps", "2", "--warmup", "1", "--variants", "n1-ref", "--recurrence",
                          "on", *recur])
    assert phases == [True] * 3 and on[0]["recurrence"] == "on" and math.isfinite(on[0]["loss"])
    assert "| n1-ref (recurrence on) |" in capsys.readouterr().out
    phases.clear()
    off = bench_step.main(["--config", demo, "--steps", "2", "--warmup", "1", "--variants", "n1-ref", *recur])
    assert phases == [False] * 3 and off[0]["recurrence"] == "off"


def test_recurrence_on_without_recurrence_is_refused(monkeypatch, capsys):
    monkeypatch.setattr(bench_step, "bench_variant", lambda *a, **k: pytest.fail("a variant ran"))
    with pytest.raises(SystemExit):
        bench_step.main(["--config", str(bench_step.REPO / "configs/demo.toml"), "--variants", "n1-ref",
                         "--recurrence", "on", *TINY])
    assert "--recurrence on: variants ['n1-ref'] have no depth recurrence" in capsys.readouterr().err


def test_random_tokens_hold_documents_of_the_mean_length_asked_for():
    """--doc-tokens N: a BOS at each position with probability 1/N, none elsewhere (uniform ids would give one BOS
    per vocab_size tokens, documents far longer than a row)."""
    from model.features import BOS_ID
    tokens = bench_batches.RandomTokens(32, 2048, 8192, torch.device("cpu"), doc_tokens=100).x
    share = (tokens == BOS_ID).float().mean().item()
    assert 0.008 < share < 0.012 and tokens.min() >= BOS_ID
    uniform = bench_batches.RandomTokens(32, 2048, 8192, torch.device("cpu")).x
    assert (uniform == BOS_ID).float().mean().item() < 0.001


def test_doc_tokens_reach_every_variant_and_bad_lengths_are_refused(monkeypatch, capsys):
    seen = []

    def fake_bench(cfg, steps, warmup, dist, profile, recurrence, doc_tokens, tokens):
        seen.append(doc_tokens)
        return dict(ranks=1, params=1, ms_step=1.0, tok_s=1.0, mfu=0.0, peak_gib=0.0, warmup_s=0.0, loss=0.0,
                    profile=None)
    monkeypatch.setattr(bench_step, "bench_variant", fake_bench)
    demo = str(bench_step.REPO / "configs/demo.toml")
    bench_step.main(["--config", demo, "--variants", "n1-ref,n2-kernels", "--doc-tokens", "640", "train.device=cpu"])
    assert seen == [640, 640]
    for bad in ("1", "-5"):
        with pytest.raises(SystemExit):
            bench_step.main(["--config", demo, "--variants", "n1-ref", "--doc-tokens", bad])
        assert f"--doc-tokens {bad}: the mean document length must be 0" in capsys.readouterr().err


def test_train_tokens_are_the_training_loaders_first_batch_at_every_step(demo_dir, monkeypatch, capsys):
    """--tokens train: every step (warm-up, timed) gets the batch the training loader gives first from
    data.train_files, so the documents are the corpus's own."""
    from data.loader import TokenLoader
    from data.shards import list_shards
    data = [f"data.train_files={demo_dir}/fineweb_train_*.bin", f"data.tokenizer={demo_dir}/tokenizer.model"]
    demo = str(bench_step.REPO / "configs/demo.toml")
    cfg = bench_step.load_config(demo, [*TINY, *data, "train.device=cpu"])
    with TokenLoader(list_shards(cfg.data.train_files), cfg.data.seq_len, cfg.train.micro_batch_seqs,
                     seed=cfg.train.seed, shards_per_batch=cfg.data.shards_per_batch, prefetch=1,
                     vocab_size=cfg.model.vocab_size) as loader:
        first, _ = loader.next_batch()
        second, _ = loader.next_batch()
    assert not torch.equal(first, second)  # so a loader that moved on would show
    batches = []
    real_step = bench_step.train_step

    def recording_step(step_model, loader, *args):
        batches.append(loader.next_batch()[0].clone())
        return real_step(step_model, loader, *args)
    monkeypatch.setattr(bench_step, "train_step", recording_step)
    rows = bench_step.main(["--config", demo, "--steps", "2", "--warmup", "1", "--variants", "n1-ref", "--tokens",
                            "train", *TINY, *data, "train.device=cpu"])
    assert len(batches) == 3 and all(torch.equal(b, first) for b in batches)
    assert math.isfinite(rows[0]["loss"])
    # under torchrun each rank steps on its own share, as the training loader gives it
    with TokenLoader(list_shards(cfg.data.train_files), cfg.data.seq_len, cfg.train.micro_batch_seqs, rank=1,
                     world_size=2, seed=cfg.train.seed, shards_per_batch=cfg.data.shards_per_batch, prefetch=1,
                     vocab_size=cfg.model.vocab_size) as loader:
        rank1, _ = loader.next_batch()
    x1 = bench_batches.TrainTokens(cfg, torch.device("cpu"), rank=1, world_size=2).x
    assert torch.equal(x1, rank1) and not torch.equal(x1, bench_batches.TrainTokens(cfg, torch.device("cpu")).x)


def test_train_tokens_refuse_doc_tokens_and_missing_or_short_shards(demo_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench_step, "bench_variant", lambda *a, **k: pytest.fail("a variant ran"))
    demo = str(bench_step.REPO / "configs/demo.toml")
    with pytest.raises(SystemExit):
        bench_step.main(["--config", demo, "--variants", "n1-ref", "--tokens", "train", "--doc-tokens", "640"])
    assert "--doc-tokens shapes random tokens; with --tokens train" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_step.main(["--config", demo, "--variants", "n1-ref", "--tokens", "train",
                         f"data.train_files={tmp_path}/none_*.bin"])
    err = capsys.readouterr().err
    assert "--tokens train: data.train_files: no shard files match" in err and "none_*.bin" in err
    with pytest.raises(SystemExit):  # shards too short for one sequence
        bench_step.main(["--config", demo, "--variants", "n1-ref", "--tokens", "train",
                         f"data.train_files={demo_dir}/fineweb_train_*.bin", "data.seq_len=10000000",
                         "train.batch_tokens=10000000", "train.micro_batch_seqs=1"])
    assert "--tokens train: data.train_files: TokenLoader:" in capsys.readouterr().err
    # under torchrun (before its process group exists) the check loads this rank's share among all the ranks
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "100000")
    with pytest.raises(SystemExit):
        bench_step.main(["--config", demo, "--variants", "n1-ref", "--tokens", "train", *TINY,
                         f"data.train_files={demo_dir}/fineweb_train_*.bin"])
    assert "fewer than world_size 100000" in capsys.readouterr().err
