"""End to end on CPU: train.py on a tiny demo corpus; distributed steps equal single-process steps. What train.py
refuses at setup: tests/test_train_refusals.py."""
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import FakeWandb
from model.gpt import GPT
from quant.container import load_artifact
from training.log_reader import parse_log
from training.config import load_config
from training.distributed import destroy, init_distributed
from training.optim import build_optimizers
from training.trainer import grad_accum_steps, train_step

REPO = Path(__file__).resolve().parents[1]


def tiny_overrides(data: Path, tmp: Path) -> list[str]:
    return [f"data.train_files={data}/fineweb_train_*.bin", f"data.val_files={data}/fineweb_val_*.bin",
            f"data.tokenizer={data}/tokenizer.model", "data.seq_len=32", "model.n_layers=2", "model.d_model=32",
            "model.n_heads=2", "model.n_kv_heads=1", "train.batch_tokens=512", "train.micro_batch_seqs=8",
            "train.max_steps=40", "train.time_budget_s=0", "train.schedule=steps", "train.log_every=5",
            "eval.context=32", "eval.stride=16", "eval.max_tokens=3000", "quant.calib_seqs=4",
            "quant.calib_reserve_s=0", "optim.warmup_steps=5", "optim.matrix_lr=0.05",
            f"train.log_dir={tmp}/logs", f"train.out_dir={tmp}/runs", "train.run_id=tiny"]


def test_train_end_to_end_writes_log_artifact_and_final_json(demo_dir, tmp_path, capsys, monkeypatch):
    import train
    wandb = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.delenv("WANDB_PROJECT", raising=False)  # it would override train.wandb_project
    from training import trainer
    loaders, real_loader = [], trainer.TokenLoader

    def spy_loader(*args, **kw):
        loaders.append(kw)
        return real_loader(*args, **kw)
    monkeypatch.setattr(trainer, "TokenLoader", spy_loader)  # train.py's loader comes from trainer.training_loader
    final = train.main(["--config", str(REPO / "configs/demo.toml"), *tiny_overrides(demo_dir, tmp_path),
                        "quant.scheme=rank", "quant.phi_bits=5", "train.time_budget_s=600",  # steps end it
                        "quant.calib_reserve_s=30",
                        "train.checkpoint_every=10", "train.checkpoint_keep=3", "data.shards_per_batch=1",
                        "data.prefetch=3", "train.wandb=true", "train.wandb_project=golf-test"])
    # data.shards_per_batch and data.prefetch (not their defaults, 4 and 4) reach the training loader
    assert [(kw["shards_per_batch"], kw["prefetch"]) for kw in loaders] == [(1, 3)]
    # train.checkpoint_keep (3, not the default 2): of the checkpoints at steps 10, 20, 30 and 40 the newest three
    checkpoints = tmp_path / "runs" / "checkpoints" / "tiny"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["finished.json", "step_00000020", "step_00000030",
                                                              "step_00000040"]
    # train.wandb_project names the wandb project; the run gets the step metrics and the final numbers
    assert [(i["project"], i["name"]) for i in wandb.inits] == [("golf-test", "tiny")]
    assert 40 in [step for step, _ in wandb.logged] and wandb.summary["val_bpb"] == final["val_bpb"]
    assert wandb.finished
    last_line = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last_line) == json.loads(json.dumps(final, sort_keys=True))
    for key in ("val_loss", "val_bpb", "steps", "train_time_s", "artifact_bytes", "code_bytes", "total_bytes", "run_id"):
        assert key in final, key
    assert final["steps"] == 40 and final["run_id"] == "tiny"
    assert final["calib_within_budget"] is True and 0 < final["calib_total_s"] <= 30
    artifact = tmp_path / "runs" / "tiny.mhcg"
    assert final["artifact_bytes"] == artifact.stat().st_size
    _, stored = load_artifact(str(artifact), stored=True)
    phis = {name: t.bits for name, t in stored.items() if name.endswith(".phi")}
    assert len(phis) == 4 and set(phis.values()) == {5}, phis  # quant.phi_bits reached the artifact
    assert final["total_bytes"] == final["artifact_bytes"] + final["code_bytes"] <= 16_000_000
    assert final["source_entropy_bits_per_byte"] > 0
    # The quantized model is scored, and close to the unquantized one at this tiny size.
    assert abs(final["val_bpb"] - final["pre_quant_val_bpb"]) < 0.05
    log = (tmp_path / "logs" / "tiny.txt").read_text().splitlines()
    steps = [json.loads(line[5:]) for line in log if line.startswith("step ")]
    assert steps[0]["step"] == 1 and steps[-1]["step"] == 40
    assert steps[-1]["loss"] < steps[0]["loss"] - 1.0, "loss must fall within a few dozen steps"
    assert any(line.startswith("config ") for line in log) and any("commit" in line for line in log)
    # scripts.evaluate in a fresh call scores as the run did (eval.context=32, stride=16, max_tokens=3000)
    # unless told otherwise, and so reproduces train.py's number exactly.
    from scripts import evaluate
    args = ["--artifact", str(artifact), "--val", str(demo_dir), "--tokenizer", str(demo_dir / "tokenizer.model")]
    evaluate.main(args)
    again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (again["context"], again["stride"], again["max_tokens"]) == (32, 16, 3000)
    assert again["val_bpb"] == final["val_bpb"] and again["tokens"] == final["tokens"]
    assert again["code_bytes"] == final["code_bytes"]  # the code a record of this tree ships, as train.py counted it
    shipped = [tmp_path / "train_gpt.py", tmp_path / "config.toml"]  # a record's: the code that ships counts
    shipped[0].write_bytes(b"#" * 1234)
    shipped[1].write_bytes(b"#" * 56)
    evaluate.main(args + ["--stride", "0", "--code", *map(str, shipped)])
    windows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (windows["context"], windows["stride"]) == (32, 0) and windows["val_bpb"] != final["val_bpb"]
    assert windows["code_bytes"] == 1290 and windows["total_bytes"] == final["artifact_bytes"] + 1290
    # every window flag overrides what the artifact recorded; batching changes no score
    evaluate.main(args + ["--context", "24", "--stride", "8", "--max-tokens", "1000", "--batch-seqs", "3"])
    told = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (told["context"], told["stride"], told["max_tokens"], told["tokens"]) == (24, 8, 1000, 999)
    evaluate.main(args + ["--context", "24", "--stride", "8", "--max-tokens", "1000", "--batch-seqs", "64"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["val_bpb"] == pytest.approx(told["val_bpb"],
                                                                                                     rel=1e-6)
    with pytest.raises(SystemExit):
        evaluate.main(args + ["--code", str(tmp_path / "gone.py")])
    assert f"--code {tmp_path / 'gone.py'}: no such file (hint:" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="matches training shards .*hint: --val DIR"):  # 'DIR/*.bin' sorts train first
        evaluate.main(["--artifact", str(artifact), "--val", f"{demo_dir}/*.bin", "--tokenizer",
                       str(demo_dir / "tokenizer.model")])
    with pytest.raises(SystemExit):  # a negative cap would silently drop the last tokens
        evaluate.main(args + ["--max-tokens", "-5"])
    assert "eval.max_tokens=-5 must be >= 0" in capsys.readouterr().err
    # it audits BPB's denominator as train.py does (here a count made to disagree with the decoded text)
    import training.evaluate
    monkeypatch.setattr(training.evaluate, "audit_bytes", lambda tokens, sp, lut: (1, 2))
    with pytest.raises(SystemExit, match="^scripts.evaluate: byte accounting mismatch on .*fineweb_val_.*counted 1 "
                                         "bytes, the decoded text has 2 .*hint: are these shards tokenized with"):
        evaluate.main(args)
    # and train.py stops at setup, naming the validation shards
    with pytest.raises(training.evaluate.ByteAuditError, match="mismatch on .*fineweb_val_"):
        train.main(["--config", str(REPO / "configs/demo.toml"), *tiny_overrides(demo_dir, tmp_path),
                    "train.run_id=tiny-audit"])


def test_calibration_on_training_tokens_is_checked_against_the_budget():
    """Training plus calibration must fit in train.time_budget_s. The check compared calibration with
    quant.calib_reserve_s alone, so a run stopped early by train.max_steps failed it."""
    from training.export import calibration_within_budget
    demo = REPO / "configs/demo.toml"
    cfg = load_config(demo, ["train.time_budget_s=60", "quant.calib_reserve_s=5"])
    lines = []
    assert calibration_within_budget(cfg, 1.2, 55.0, lines.append) is True
    assert "56.2 s, inside the 60 s budget" in lines[-1]
    assert calibration_within_budget(cfg, 7.5, 55.0, lines.append) is False
    assert lines[-1].startswith("WARNING") and "2.5 s beyond train.time_budget_s=60" in lines[-1]
    assert "quant.calib_reserve_s (now 5)" in lines[-1]
    assert calibration_within_budget(cfg, 7.5, 20.0, lines.append) is True  # stopped early by max_steps: room left
    # Training itself past its share (60 - 5 s): the warning names training, not calibration, which fit its reserve
    assert calibration_within_budget(cfg, 0.8, 59.5, lines.append) is False
    assert lines[-1].startswith("WARNING training took 59.5 s of its 55 s") and "ended 4.5 s past it" in lines[-1]
    assert "raise quant.calib_reserve_s" not in lines[-1]
    # No rule applies without a time budget, or to text the model generated itself.
    no_budget = load_config(demo, ["train.time_budget_s=0", "train.schedule=steps"])
    assert calibration_within_budget(no_budget, 99.0, 500.0, lines.append) is None
    generated = load_config(demo, ["train.time_budget_s=60", "quant.calib_source=generated"])
    assert calibration_within_budget(generated, 99.0, 55.0, lines.append) is None


def test_a_reused_run_id_and_a_run_ending_inside_warmup_are_said(demo_dir, tmp_path, monkeypatch, capsys):
    """A second run under one run_id was appended to the first's log with no word (export_record then refused the
    log); a budget that ended the run inside the warmup gave a meaningless score, also silently. Long scoring on a
    CPU prints progress."""
    import train
    import training.evaluate
    monkeypatch.setattr(training.evaluate, "PROGRESS_EVERY_S", 0.0)
    args = ["--config", str(REPO / "configs/demo.toml"), *tiny_overrides(demo_dir, tmp_path), "train.max_steps=2"]
    train.main(args)
    out = capsys.readouterr().out
    assert "already holds a run" not in out
    assert "WARNING train.max_steps ended the run at step 2, inside the 5-step learning-rate warmup" in out  # review
    train.main(args[:-1] + ["train.max_steps=100000", "train.time_budget_s=3", "quant.calib_reserve_s=1",
                            "train.schedule=time", "optim.warmup_steps=100000"])
    out = capsys.readouterr().out
    assert "WARNING" in out and "logs/tiny.txt already holds a run of train.run_id=tiny" in out
    assert "WARNING the time budget ended the run at step" in out and "learning-rate warmup" in out
    assert "scoring: " in out and " windows in " in out


def test_the_warmdown_follows_whichever_limit_ends_the_run(demo_dir, tmp_path, capsys):
    """With train.schedule=time a run that train.max_steps ended first never warmed down (its
    EMA shipped un-annealed weights), and with schedule=steps a run the budget ended did so without a word. And
    quant.calib_reserve_s came off the training budget even when calibration reads no training tokens."""
    import train
    base = ["--config", str(REPO / "configs/demo.toml"), *tiny_overrides(demo_dir, tmp_path), "train.log_every=1",
            "optim.warmup_steps=0", "eval.max_tokens=500", "optim.lr_floor=0.1"]
    train.main(base + ["train.schedule=time", "train.time_budget_s=1000", "train.max_steps=10", "train.run_id=steps"])
    lrs = [s["lr_mult"] for s in parse_log(tmp_path / "logs/steps.txt").steps]
    assert lrs[:5] == [1.0] * 5 and lrs[5:] == sorted(lrs[5:], reverse=True) and lrs[-1] == pytest.approx(0.2)
    capsys.readouterr()
    train.main(base + ["train.schedule=steps", "train.time_budget_s=2", "train.max_steps=100000",
                       "quant.calib_reserve_s=1", "quant.calib_source=generated", "quant.calib_seqs=2",
                       "train.run_id=clock"])
    out = capsys.readouterr().out
    assert "budget 2.0 s" in out  # the whole budget trains: generated calibration needs no reserve
    assert "WARNING the time budget ended the run at step" in out and "of train.max_steps=100000 with " \
        "train.schedule=steps" in out and "not annealed (hint: train.schedule=time" in out


def test_periodic_evaluation_does_not_feed_back_into_training(demo_dir, tmp_path, capsys):
    """eval.every_steps scores the validation tokens during training; the run must train exactly as without
    it (same step losses, same weights shipped): validation data may never reach the weights."""
    import train
    finals, losses = [], []
    for every in (0, 5):
        args = ["--config", str(REPO / "configs/demo.toml"), *tiny_overrides(demo_dir, tmp_path / f"e{every}"),
                "train.max_steps=12", f"eval.every_steps={every}"]
        train.main(args)
        finals.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
        log = (tmp_path / f"e{every}" / "logs" / "tiny.txt").read_text().splitlines()
        losses.append([json.loads(line[5:])["loss"] for line in log if line.startswith("step ")])
        evals = [line for line in log if line.startswith("eval ") and '"stage"' not in line]  # periodic ones
        assert len(evals) == (2 if every else 0), evals
    assert losses[0] == losses[1]
    assert finals[0]["pre_quant_val_loss"] == finals[1]["pre_quant_val_loss"]
    assert finals[0]["val_loss"] == finals[1]["val_loss"]


@pytest.mark.parametrize("seqs,source", [(10, "train"), (3, "train"), (16, "train"), (10, "generated")])
def test_calibration_takes_exactly_quant_calib_seqs_sequences(demo_dir, tmp_path, seqs, source):
    """Training-token calibration rounded quant.calib_seqs up to a multiple of 8 (10 gave 16)."""
    from training.export import calibration_batches
    cfg = load_config(None, tiny_overrides(demo_dir, tmp_path) + [f"quant.calib_seqs={seqs}",
                                                                  f"quant.calib_source={source}"])
    model = GPT(cfg.model)
    files = sorted(map(str, demo_dir.glob("fineweb_train_*.bin")))
    batches = calibration_batches(cfg, model, files, torch.device("cpu"))
    assert sum(b.shape[0] for b in batches) == seqs and all(b.shape[1] == cfg.data.seq_len for b in batches)
    # and from the source asked for: the model's own samples, or runs of training tokens
    from data.shards import read_shard
    from quant.calibrate import generate_calibration_tokens
    rows = torch.cat(batches)
    sampled = generate_calibration_tokens(model, seqs, cfg.data.seq_len, seed=cfg.train.seed)
    assert torch.equal(rows, sampled) == (source == "generated")
    if source == "train":
        shards = [read_shard(f).astype(np.int64).tobytes() for f in files]
        for row in rows.numpy().astype(np.int64):
            at = [shard.find(row.tobytes()) for shard in shards]
            assert any(i >= 0 and i % 8 == 0 for i in at), row[:8]


class SliceLoader:
    """Hands out fixed slices of one global batch: rank r of W, micro-step m gets slice m*W + r."""

    def __init__(self, global_batch: torch.Tensor, n_slices: int, rank: int, world: int):
        self.parts = global_batch.chunk(n_slices)
        self.rank, self.world, self.i = rank, world, 0

    def next_batch(self):
        part = self.parts[self.i * self.world + self.rank]
        self.i += 1
        return part[:, :-1], part[:, 1:]


def test_the_step_clips_gradients_at_optim_grad_clip():
    """train_step hands optim.grad_clip to the optimizer step: a clip far below the gradient's norm leaves AdamW's
    tables (whose update is scale-free only above its epsilon) nearly still, no clip moves them by ~lr per entry."""
    moved = {}
    for clip in (0.0, 1e-12):
        cfg = load_config(REPO / "configs/demo.toml", ["model.n_layers=1", "model.d_model=32", "model.n_heads=2",
                                                       "model.n_kv_heads=1", "model.vocab_size=64", "data.seq_len=16",
                                                       "train.batch_tokens=128", "train.micro_batch_seqs=8",
                                                       f"optim.grad_clip={clip}"])
        torch.manual_seed(0)
        model = GPT(cfg.model)
        before = model.embed.weight.detach().clone()
        opts = build_optimizers(model.param_groups(), cfg.optim)
        batch = torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(0))
        train_step(model, SliceLoader(batch, 1, 0, 1), opts, cfg, 1, torch.device("cpu"))
        moved[clip] = (model.embed.weight.detach() - before).abs().max().item()
    assert moved[0.0] > 1e-3 and moved[1e-12] < 1e-2 * moved[0.0], moved


def run_steps(rank: int, world: int, port: int, n_steps: int, out: str) -> None:
    if world > 1:  # joins as train.py does: torchrun's environment, init_distributed, destroy
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        init_distributed("cpu")
    try:
        cfg = load_config(REPO / "configs/demo.toml", ["model.n_layers=2", "model.d_model=32", "model.n_heads=2",
                                                       "model.n_kv_heads=1", "model.vocab_size=64", "data.seq_len=16",
                                                       "train.batch_tokens=256", f"train.micro_batch_seqs={8 // world}"])
        torch.manual_seed(0)
        model = GPT(cfg.model)
        opts = build_optimizers(model.param_groups(), cfg.optim)
        accum = grad_accum_steps(cfg, world)
        losses = []
        for step in range(n_steps):
            batch = torch.randint(0, 64, (16, 17), generator=torch.Generator().manual_seed(step))
            loader = SliceLoader(batch, 16 // (8 // world), rank, world)
            loss = train_step(model, loader, opts, cfg, accum, torch.device("cpu"))
            if world > 1:
                dist.all_reduce(loss, op=dist.ReduceOp.AVG)
            losses.append(loss.item())
        if rank == 0:
            torch.save({"losses": losses, "params": [p.detach() for p in model.parameters()]}, out)
    finally:
        destroy()



def test_two_ranks_reproduce_one_process_at_the_same_global_batch(tmp_path, free_port):
    run_steps(0, 1, 0, 3, str(tmp_path / "one.pt"))
    mp.spawn(run_steps, args=(2, free_port, 3, str(tmp_path / "two.pt")), nprocs=2, join=True)
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    assert one["losses"] == pytest.approx(two["losses"], rel=1e-5)
    # Summation order differs (micro-batches vs ranks) and Newton-Schulz amplifies it a little: a
    # missing or wrong reduction would show up at the scale of lr (~0.03), not 1e-4.
    for a, b in zip(one["params"], two["params"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_an_error_mid_run_closes_the_loader_and_exits_cleanly(demo_dir, tmp_path):
    """An exception after the prefetch thread started (here: in training) reaches the caller with the loader
    closed. Left running, that thread made the interpreter abort at exit (status 134, "terminate called
    without an active exception") instead of exiting 1 with the error."""
    import subprocess
    script = (
        "import sys, threading, train\n"
        "def fail(*a, **k):\n"
        "    assert any(t.name == 'TokenLoader' for t in threading.enumerate())  # the thread is up\n"
        "    raise RuntimeError('injected failure')\n"
        "train.run_training = fail\n"
        "try:\n"
        "    train.main(sys.argv[1:])\n"
        "finally:\n"
        "    print('loader threads left:', sum(t.name == 'TokenLoader' for t in threading.enumerate()))\n")
    done = subprocess.run([sys.executable, "-c", script, "--config", str(REPO / "configs/demo.toml"),
                           *tiny_overrides(demo_dir, tmp_path)], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "RuntimeError: injected failure" in done.stderr and "terminate called" not in done.stderr
    assert "loader threads left: 0" in done.stdout


@pytest.mark.slow
def test_readme_demo_command_completes(tmp_path):
    """`scripts/run_demo.sh` as the README shows it (a shorter budget: the path is the same). Its log and artifact
    go to a temporary folder: in the checkout's logs/ every run of the suite appended another run to one log."""
    import subprocess
    done = subprocess.run([str(REPO / "scripts/run_demo.sh"), "train.time_budget_s=15", "train.run_id=readme-demo",
                           f"train.log_dir={tmp_path}/logs", f"train.out_dir={tmp_path}/runs"],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    final = json.loads(lines[-1])
    assert final["fits_cap"] and final["val_bpb"] > final["source_entropy_bits_per_byte"] > 1.0
    assert any(line.startswith("summary val_bpb") and "source entropy" in line for line in lines)


def test_periodic_eval_self_generated_calibration_and_compile(demo_dir, tmp_path):
    """eval.every_steps, quant.calib_source=generated and train.compile on one tiny CPU run."""
    import train
    final = train.main(["--config", str(REPO / "configs/demo.toml"), *tiny_overrides(demo_dir, tmp_path),
                        "train.max_steps=6", "eval.every_steps=3", "eval.max_tokens=500",
                        "quant.calib_source=generated", "quant.calib_seqs=2", "train.compile=true",
                        "train.run_id=gen"])
    log = (tmp_path / "logs" / "gen.txt").read_text().splitlines()
    periodic = [json.loads(line[5:]) for line in log if line.startswith("eval ") and '"stage"' not in line]
    assert [e["step"] for e in periodic] == [3, 6]
    assert any("compile_warmup" in line for line in log)
    assert final["calib_source"] == "generated" and final["fits_cap"]
