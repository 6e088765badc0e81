"""What a resume refuses, in one line naming the checkpoint: a checkpoint of fewer ranks, one that would run code
when loaded, a damaged part, other optimizer settings, another model without a saved config; and what it does not:
a config key newer than the checkpoint. Straight and resumed runs, signals: tests/test_checkpoint.py."""
import pytest


def test_resuming_on_more_ranks_than_wrote_the_checkpoint_says_so(tmp_path):
    from training.checkpoint import load_checkpoint
    ck = tmp_path / "step_00000002"
    ck.mkdir()
    (ck / "rank0.pt").write_bytes(b"")
    with pytest.raises(ValueError, match=r"written by 1 rank\(s\), resuming on 2: it has no rank1.pt .*nproc_per_node"):
        load_checkpoint(ck, None, [], None, None, rank=1, world_size=2)


RAN = []


class Payload:
    """Unpickling this calls RAN.append: what a checkpoint loaded without weights_only would execute."""

    def __reduce__(self):
        return (RAN.append, ("executed",))


def test_a_checkpoint_cannot_execute_code_when_loaded(tmp_path):
    import torch
    from training.checkpoint import CheckpointError, load_checkpoint
    ck = tmp_path / "step_00000002"
    ck.mkdir()
    torch.save({"world_size": 1, "model": Payload()}, ck / "rank0.pt")
    with pytest.raises(CheckpointError, match=r"rank0.pt: unreadable \(UnpicklingError: Weights only load failed"):
        load_checkpoint(ck, None, [], None, None, rank=0, world_size=1)
    assert RAN == []


def test_a_damaged_part_is_named_with_the_way_out(tmp_path):
    """A truncated part was an OSError without a path, a traceback past train.py's one-line errors."""
    import torch
    from training.checkpoint import CheckpointError, load_checkpoint
    ck = tmp_path / "step_00000002"
    ck.mkdir()
    torch.save({"world_size": 1, "model": {"w": torch.zeros(1000)}}, ck / "rank0.pt")
    data = (ck / "rank0.pt").read_bytes()
    (ck / "rank0.pt").write_bytes(data[:len(data) // 2])
    with pytest.raises(CheckpointError, match=rf"{ck / 'rank0.pt'}: unreadable \(.*\) \(hint: train.resume=<an older "
                                              r"step_NNNNNNNN folder>, or move this one away"):
        load_checkpoint(ck, None, [], None, None, rank=0, world_size=1)
    torch.save([1, 2], ck / "rank0.pt")
    with pytest.raises(CheckpointError, match=r"rank0.pt: not a checkpoint part written by train.py"):
        load_checkpoint(ck, None, [], None, None, rank=0, world_size=1)


class Cursor:
    """A loader's resumable state alone."""

    def __init__(self):
        self.state = {"at": 0}

    def state_dict(self):
        return dict(self.state)

    def load_state_dict(self, state):
        self.state = dict(state)


def test_a_resume_with_other_optimizer_settings_is_refused(tmp_path):
    """Loading a checkpoint restored its peak LRs, weight decay, Newton-Schulz steps and EMA settings over the
    command line's, while the log recorded the command line's: a run resumed with
    optim.matrix_lr=0.1 trained on at the old 0.025. Now the settings must agree; the same ones load."""
    import torch
    from model.gpt import GPT
    from training.checkpoint import CheckpointError, Checkpointer, load_checkpoint
    from training.config import load_config
    from training.ema import maybe_ema
    from training.optim import build_optimizers

    def fresh(*overrides):
        cfg = load_config(None, ["model.n_layers=1", "model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1",
                                 "model.vocab_size=64", *overrides])
        torch.manual_seed(0)
        model = GPT(cfg.model)
        return model, build_optimizers(model.param_groups(), cfg.optim), maybe_ema(model, cfg.optim)
    model, opts, ema = fresh()
    path = Checkpointer(tmp_path, every_steps=1, keep=1, rank=0, world_size=1).save(3, 1.0, model, opts, ema, Cursor())
    for override, says in (("optim.matrix_lr=0.1", r"trained with initial_lr=0.025 in group 'matrix', this run's "
                                                   r"config gives 0.1 \(hint: resume with the run's optim"),
                           ("optim.ns_steps=4", "trained with ns_steps=5 in group 'matrix', this run's config gives 4"),
                           ("optim.weight_decay=0.5", "trained with weight_decay=0.04 in group"),
                           ("optim.ema_decay=0.9", r"trained with decay, warmup_steps=\(0.997, 10\) in group 'ema'")):
        with pytest.raises(CheckpointError, match=says):
            load_checkpoint(path, *fresh(override), Cursor(), rank=0, world_size=1)
    assert load_checkpoint(path, *fresh(), Cursor(), rank=0, world_size=1).step == 3

    class OtherShards(Cursor):
        def load_state_dict(self, state):
            raise ValueError("TokenLoader.load_state_dict: state has shard_tokens=[9000] but this loader has [1000]")
    with pytest.raises(CheckpointError, match=r"step_00000003.*: TokenLoader.load_state_dict: state has shard_tokens"):
        load_checkpoint(path, *fresh(), OtherShards(), rank=0, world_size=1)  # one line, not a traceback


def test_a_checkpoint_without_its_config_and_another_model_is_one_error(tmp_path):
    """Checkpoints from before the config was saved: another model is named, not a load_state_dict traceback."""
    import torch
    from model.gpt import GPT
    from training.checkpoint import CheckpointError, Checkpointer, load_checkpoint
    from training.config import load_config
    from training.optim import build_optimizers

    def model_of(layers):
        cfg = load_config(None, [f"model.n_layers={layers}", "model.d_model=32", "model.n_heads=2",
                                 "model.n_kv_heads=1", "model.vocab_size=64"])
        model = GPT(cfg.model)
        return model, build_optimizers(model.param_groups(), cfg.optim)
    model, opts = model_of(1)
    path = Checkpointer(tmp_path, every_steps=1, keep=1, rank=0, world_size=1).save(3, 1.0, model, opts, None, Cursor())
    other, other_opts = model_of(2)
    with pytest.raises(CheckpointError, match=r"step_00000003: its weights do not fit this run's model \((Missing "
                                              r"key|Unexpected key|size mismatch)"):  # what differs, not the header
        load_checkpoint(path, other, other_opts, None, Cursor(), rank=0, world_size=1)
    assert "config" not in torch.load(path / "rank0.pt", weights_only=True)


def test_a_config_key_newer_than_the_checkpoint_does_not_refuse_it():
    """A key on one side only compared as None against its value, so a field added to the config
    since a checkpoint was written made every older checkpoint unresumable."""
    from training.checkpoint import trajectory_differences
    from training.config import Config, to_dict
    mine = to_dict(Config())
    older = {section: dict(values) for section, values in mine.items()}
    del older["model"]["xsa_layers"]
    assert trajectory_differences(older, mine) == []
    older["model"]["n_layers"] += 1
    assert trajectory_differences(older, mine) == [f"model.n_layers: checkpoint {mine['model']['n_layers'] + 1}, "
                                                   f"this run {mine['model']['n_layers']}"]
