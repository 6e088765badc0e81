"""train.py refuses what cannot run, at setup and in one line: an artifact over the cap, a budget the code leaves no
room for, a broken manifest, validation shards that are training shards, nothing to score, shards the model cannot
read or another tokenizer made, a missing codec, shapes the GPU kernels cannot take. End to end: tests/test_train.py."""
import json
import os
import re
import shutil
import sys

import pytest
import torch

from conftest import started
from data.shards import ShardError
from test_train import REPO, tiny_overrides
from training.config import ConfigError


def test_artifact_over_the_cap_is_never_reported_as_success(demo_dir, tmp_path, capsys):
    import train
    from training.shipped_code import code_bytes
    small_cap = f"quant.cap_bytes={code_bytes() + 1000}"  # 1 kB for the artifact: the tiny model needs ~39
    with pytest.raises(SystemExit, match="no artifact: even the coarsest grid of every tensor is over the budget"):
        train.main(["--config", str(REPO / "configs/demo.toml"), *tiny_overrides(demo_dir, tmp_path),
                    "train.max_steps=2", small_cap, "quant.margin_bytes=0", "train.time_budget_s=600",
                    "train.schedule=time"])
    out = capsys.readouterr().out
    final = json.loads(out.strip().splitlines()[-1])
    assert final["fits_cap"] is False and "over the budget" in final["export_error"]
    assert "val_bpb" not in final and final["pre_quant_val_bpb"] > 0
    assert "calibration data" in out and not re.search(r"calibration .* s budget", out)  # partial timing: no verdict


@pytest.mark.parametrize("override, says", [
    ("quant.cap_bytes=40000", "quant.margin_bytes=20,000 with"),      # less than the code itself
    ("quant.budget_bytes=15990000", "quant.budget_bytes=15,990,000 with")])
def test_a_budget_that_cannot_fit_beside_the_code_stops_the_run_at_setup(demo_dir, tmp_path, override, says):
    """A quant.budget_bytes above what the cap leaves beside the code trained the whole budget
    and failed only at the export (a cap below the code did too)."""
    import train
    with pytest.raises(ConfigError, match=rf"{says} [\d,]+ bytes of counted code leaves an artifact budget of "
                                          r"-?[\d,]+ bytes under quant.cap_bytes=.*fit under the cap together"):
        train.main(["--config", str(REPO / "configs/demo.toml"), *tiny_overrides(demo_dir, tmp_path), override])
    assert not (tmp_path / "logs").exists() or not list((tmp_path / "logs").iterdir())  # refused before a log


def test_a_broken_manifest_beside_the_tokenizer_stops_the_run_at_setup(demo_dir, tmp_path, capsys):
    """The manifest that states the demo's source entropy is read before training, not after the export,
    where a bad one used to cost the run its final line."""
    import shutil
    import train
    data = tmp_path / "data"
    data.mkdir()
    for f in demo_dir.iterdir():
        shutil.copy(f, data / f.name)
    (data / "manifest.json").write_text("{truncated")
    with pytest.raises(ConfigError, match=r"manifest.json: not a data manifest .*hint"):
        train.main(["--config", str(REPO / "configs/demo.toml"), *tiny_overrides(data, tmp_path)])
    assert "phase setup" not in capsys.readouterr().out


def test_validation_shards_that_are_also_training_shards_are_refused(demo_dir, tmp_path):
    import train
    overrides = [o for o in tiny_overrides(demo_dir, tmp_path) if not o.startswith("data.val_files=")]
    with pytest.raises(ShardError, match=r"fineweb_train_000000.bin is the validation shard .*fineweb_train_000000"
                                         r".bin \(the same file; hint: data.train_files and data.val_files"):
        train.main(["--config", str(REPO / "configs/demo.toml"), *overrides,
                    f"data.val_files={demo_dir}/fineweb_*_000000.bin"])


@pytest.mark.parametrize("link, kind", [(os.link, "the same file"), (os.symlink, "the same file"),
                                        (shutil.copyfile, "an identical copy")], ids=["hard_link", "symlink", "copy"])
def test_a_validation_shard_under_another_name_is_refused(demo_dir, tmp_path, link, kind):
    """The check compared real paths: a hard link to the validation shard, or a copy of it, among the training
    shards passed. Training and calibration would have read validation text."""
    import train
    train_dir = tmp_path / "train"
    train_dir.mkdir()
    for shard in demo_dir.glob("fineweb_train_*.bin"):
        os.symlink(shard, train_dir / shard.name)
    val = next(demo_dir.glob("fineweb_val_*.bin"))
    link(val, train_dir / "fineweb_train_999999.bin")
    overrides = [o for o in tiny_overrides(demo_dir, tmp_path) if not o.startswith("data.train_files=")]
    with pytest.raises(ShardError, match=rf"fineweb_train_999999.bin is the validation shard {val} \({kind};"):
        train.main(["--config", str(REPO / "configs/demo.toml"), *overrides,
                    f"data.train_files={train_dir}/fineweb_train_*.bin"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the check runs where the kernels run)")
def test_shapes_the_mhc_kernels_cannot_take_are_refused_at_setup_on_a_gpu(demo_dir, tmp_path):
    import train
    with pytest.raises(ConfigError, match=re.escape("model.n_streams=3 with model.mhc_kernels=true")):
        train.main(["--config", str(REPO / "configs/demo.toml"), *tiny_overrides(demo_dir, tmp_path),
                    "model.n_streams=3", "model.mhc_kernels=true", "train.device=cuda"])
    assert not (tmp_path / "logs" / "tiny.txt").exists()


@pytest.mark.parametrize("tokens,message", [([1], "1 validation token(s) leave no target to score"),
                                            ([1, 1, 1], "the 2 validation targets decode to no bytes")])
def test_validation_with_nothing_to_score_is_refused_at_setup(demo_dir, tmp_path, tokens, message):
    """It trained the whole budget, then divided by zero in the evaluation."""
    import numpy as np

    import train
    from data.shards import write_shard
    from training.evaluate import ByteAuditError
    write_shard(tmp_path / "fineweb_val_000000.bin", np.array(tokens, dtype=np.uint16))
    overrides = [o for o in tiny_overrides(demo_dir, tmp_path) if not o.startswith("data.val_files=")]
    with pytest.raises(ByteAuditError, match=re.escape(message)):
        train.main(["--config", str(REPO / "configs/demo.toml"), *overrides,
                    f"data.val_files={tmp_path}/fineweb_val_*.bin"])
    assert not (tmp_path / "logs" / "tiny.txt").exists(), "refused before the run log, so before any training"


def test_shards_the_model_cannot_read_are_named_and_a_stub_shard_is_left_out(demo_dir, tmp_path):
    """A validation shard with ids past model.vocab_size failed inside the model (an index error naming no file);
    a last training shard of a few tokens, which data.prepare can write, made the loader refuse the whole set."""
    import numpy as np

    import train
    from data.shards import write_shard
    data = tmp_path / "data"
    data.mkdir()
    for shard in demo_dir.glob("fineweb_*.bin"):
        os.symlink(shard, data / shard.name)
    write_shard(data / "fineweb_train_999999.bin", np.array([1, 5, 6], dtype=np.uint16))
    overrides = [o for o in tiny_overrides(demo_dir, tmp_path) if not o.startswith(("data.train_files=", "train."
                                                                                     "max_steps="))]
    final = train.main(["--config", str(REPO / "configs/demo.toml"), *overrides, "train.max_steps=2",
                        f"data.train_files={data}/fineweb_train_*.bin"])
    assert final["steps"] == 2
    log = (tmp_path / "logs" / "tiny.txt").read_text()
    assert f"data: {data}/fineweb_train_999999.bin left out: its 3 tokens are fewer than data.seq_len + 1 = 33" in log
    val = tmp_path / "val"
    val.mkdir()
    write_shard(val / "fineweb_val_000000.bin", np.array([1, 5, 600, 7], dtype=np.uint16))
    with pytest.raises(ShardError, match=r"fineweb_val_\*.bin: token id 600 is outside the model's vocabulary of 512"):
        train.main(["--config", str(REPO / "configs/demo.toml"), *tiny_overrides(demo_dir, tmp_path),
                    f"data.val_files={val}/fineweb_val_*.bin", "train.run_id=badval"])
    # a model vocabulary smaller than the tokenizer's: the ids were blamed on the shards, the fix is the vocab size
    with pytest.raises(ConfigError, match=r"tokenizer.model has 512 ids but model.vocab_size=300 \(hint: set "
                                          r"model.vocab_size=512\)"):
        train.main(["--config", str(REPO / "configs/demo.toml"), *tiny_overrides(demo_dir, tmp_path),
                    "model.vocab_size=300", "train.run_id=smallvocab"])


def test_bad_input_is_one_line_without_a_traceback(demo_dir, tmp_path):
    """On the command line, an input error (here a misspelt key, then a missing tokenizer) prints its message,
    which names the field or file, with no traceback; exit status 1."""
    base = [sys.executable, str(REPO / "train.py"), "--config", str(REPO / "configs/demo.toml"),
            *tiny_overrides(demo_dir, tmp_path)]
    cases = [("model.n_layer=2", "train.py: command line: unknown key 'model.n_layer'"),
             (f"data.tokenizer={tmp_path}/none.model", f"train.py: {tmp_path}/none.model: no such"),
             (f"data.val_files={tmp_path}/none_*.bin", f"train.py: no shard files match '{tmp_path}/none_*.bin'"),
             ("train.micro_batch_seqs=0", "+ the overrides: train.micro_batch_seqs=0 must be >= 1"),
             (f"data.tokenizer={REPO / 'README.md'}", "README.md: not a SentencePiece model")]
    with started([[*base, override] for override, _ in cases]) as procs:  # each is mostly Python's and torch's start
        for proc, (_, message) in zip(procs, cases):
            _, stderr = proc.communicate(timeout=300)
            assert proc.returncode == 1 and message in stderr and "Traceback" not in stderr, stderr
    assert not (tmp_path / "logs").exists(), "a run that could not start left a log behind"


def test_a_missing_brotli_module_stops_the_run_at_setup(demo_dir, tmp_path, monkeypatch):
    """The export compresses with brotli after training: without the module the run used to train for its whole
    budget and then lose the artifact to an ImportError. It now stops before anything runs, with one line."""
    import runpy
    monkeypatch.setitem(sys.modules, "brotli", None)  # `import brotli` raises ImportError
    monkeypatch.setattr(sys, "argv", ["train.py", "--config", str(REPO / "configs/demo.toml"),
                                      *tiny_overrides(demo_dir, tmp_path)])
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(str(REPO / "train.py"), run_name="__main__")
    assert str(stop.value).startswith("train.py: the brotli module is not installed; hint: `pip install brotli`")
    assert not (tmp_path / "logs").exists()  # stopped before the run log was opened


def test_what_rank_0_alone_opens_is_checked_at_setup(demo_dir, tmp_path, monkeypatch):
    """wandb and the run log's folder are opened by rank 0 alone; a failure there used to come after the other
    ranks' checks (wandb: a SystemExit on rank 0 only). They are now part of the setup checks every rank waits for."""
    import train
    from training.config import ConfigError
    base = ["--config", str(REPO / "configs/demo.toml"), *tiny_overrides(demo_dir, tmp_path)]
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ConfigError, match=r"train.wandb=true but wandb is not installed \(hint: pip install wandb"):
        train.main([*base, "train.wandb=true"])
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ConfigError, match=rf"train.log_dir={tmp_path}/a_file/logs: cannot make"):
        train.main([*base, f"train.log_dir={tmp_path}/a_file/logs"])
    assert not (tmp_path / "logs").exists()
    # the checkpoint and artifact folder too: it was first written after training, which the traceback then lost
    with pytest.raises(ConfigError, match=rf"train.out_dir={tmp_path}/a_file/runs: cannot make .*\(hint: another "
                                          r"train.out_dir\)"):
        train.main([*base, f"train.out_dir={tmp_path}/a_file/runs"])
    assert not (tmp_path / "logs").exists()


def test_shards_made_with_another_tokenizer_are_refused_at_setup(demo_dir, tmp_path):
    """Validation shards of another demo corpus (another tokenizer) were scored with no word:
    the byte audit decodes with the tokenizer it is given, so it agreed with itself. The shard folder's manifest
    names its tokenizer."""
    import train
    from data.demo import make_demo
    from scripts import evaluate
    other = tmp_path / "other"
    make_demo(other, seed=5, train_docs=300, val_docs=10)
    args = ["--config", str(REPO / "configs/demo.toml"), *tiny_overrides(demo_dir, tmp_path),
            f"data.val_files={other}/fineweb_val_*.bin"]
    with pytest.raises(ShardError, match=rf"{other}: its manifest.json says these shards were made with another "
                                         r"tokenizer .*\(hint: the tokenizer the folder was prepared with"):
        train.main(args)
    artifact = tmp_path / "a.mhcg"  # scripts.evaluate checks the same (after the artifact's own tokenizer check)
    train.main(["--config", str(REPO / "configs/demo.toml"), *tiny_overrides(demo_dir, tmp_path), "train.max_steps=1",
                "eval.max_tokens=200", "eval.pre_quant=false", f"train.out_dir={tmp_path}", "train.run_id=a"])
    with pytest.raises(SystemExit, match="its manifest.json says these shards were made with another tokenizer"):
        evaluate.main(["--artifact", str(artifact), "--val", str(other), "--tokenizer",
                       str(demo_dir / "tokenizer.model"), "--device", "cpu"])
