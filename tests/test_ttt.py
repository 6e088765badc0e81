"""Score-first test-time training: no score depends on an update that saw its token (or anything after it), the
updates do change the weights and the scores, no update means the plain score, and ranks agree."""
import json
import os
import re
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from model.config import ModelConfig
from model.gpt import GPT
from test_distributed_agreement import join_env, join_or_fail
from test_evaluate import simple_lut
from training import ttt
from training.config import ConfigError, load_config, parse_setting
from training.eval_config import EVAL_RECORDED, EvalConfig
from training.distributed import destroy, init_distributed
from training.evaluate import evaluate_bpb, plan_windows
from training.score import recorded_eval, score_model

CPU = torch.device("cpu")
VOCAB = 64
# chunks of 64 targets, each trained on as 2 sequences of 32 tokens, one step an epoch, 2 epochs
SMALL = EvalConfig(context=32, stride=8, batch_seqs=4, ttt="chunk_sgd", ttt_chunk_tokens=64, ttt_lr=0.05,
                   ttt_epochs=2, ttt_batch_seqs=2)
# 3 sequences a chunk, all in one step: split 1 + 2 over two ranks
UNEVEN = replace(SMALL, ttt_chunk_tokens=96, ttt_batch_seqs=3)


def without_ttt(cfg: EvalConfig) -> EvalConfig:
    return replace(cfg, **{key: getattr(EvalConfig(), key) for key in EVAL_RECORDED if key.startswith("ttt")})


def tiny_model() -> GPT:
    torch.manual_seed(0)
    return GPT(ModelConfig(vocab_size=VOCAB, n_layers=1, d_model=32, n_heads=2, n_kv_heads=1, n_streams=2,
                           mhc_kernels=False))


def text(n: int, seed: int = 0) -> np.ndarray:
    """A repeating phrase with noise and document starts: something a few SGD steps can learn."""
    rng = np.random.default_rng(seed)
    tokens = np.tile(np.arange(4, 20), n // 16 + 1)[:n]
    noise = rng.random(n) < 0.2
    tokens[noise] = rng.integers(4, VOCAB, noise.sum())
    tokens[::97] = 1
    return tokens.astype(np.uint16)


def per_target_nll(tokens: np.ndarray, cfg: EvalConfig = SMALL) -> tuple[torch.Tensor, GPT]:
    """NLL of targets 1..n-1 (index j-1) from one TTT pass; each target must be scored exactly once."""
    model = tiny_model()
    nll = torch.full((len(tokens) - 1,), float("nan"), dtype=torch.float64)
    times = torch.zeros(len(tokens) - 1, dtype=torch.int64)
    for targets, values, _ in ttt.ttt_scores(model, tokens, simple_lut(VOCAB), cfg, device=CPU):
        nll[targets - 1] = values
        times[targets - 1] += 1
    assert (times == 1).all()
    return nll, model


@pytest.mark.parametrize("n,context,stride,chunk", [(300, 32, 8, 64), (300, 32, 0, 40), (1000, 128, 48, 130),
                                                    (200, 16, 16, 8 * 16), (90, 32, 32, 32)])
def test_chunks_train_only_on_targets_already_scored(n, context, stride, chunk):
    windows = plan_windows(n, context, stride)
    chunks = ttt.chunk_windows(windows, n - 1, chunk)
    assert [w for c in chunks for w in c] == windows  # every window once, in order
    scored_through = 0
    for c, ws in enumerate(chunks):
        assert all(c * chunk < w.start + w.score_from + 1 <= (c + 1) * chunk for w in ws)
        scored_through = max([scored_through] + [w.start + w.length for w in ws])
        for s in ttt.training_starts(c, n - 1, chunk, context):
            assert c * chunk + 1 <= s + 1 and s + context <= min((c + 1) * chunk, scored_through)


@pytest.mark.parametrize("compiled", [False, True])
def test_no_score_depends_on_a_later_token(compiled, monkeypatch):
    """The NLL of every target before position p is exactly the same when the tokens from p on are replaced, for p
    at, before and after chunk boundaries: no update that scored them saw a token at p or later. With eval.compile
    too (dynamo's graphs run eagerly here), whose score batches are padded."""
    monkeypatch.setattr("training.evaluate.COMPILE_BACKEND", "eager")
    cfg = replace(SMALL, compile=compiled)
    tokens = text(250)
    reference, _ = per_target_nll(tokens, cfg)
    rng = np.random.default_rng(1)
    for p in (30, 64, 65, 129, 200):
        changed = tokens.copy()
        changed[p:] = rng.integers(4, VOCAB, len(tokens) - p)
        nll, _ = per_target_nll(changed, cfg)
        assert torch.equal(nll[:p - 1], reference[:p - 1]), p  # targets 1..p-1
        assert not torch.equal(nll[p - 1:], reference[p - 1:]), p


def test_a_pass_that_would_train_on_targets_not_yet_scored_stops(monkeypatch):
    """After scoring chunk c, training on chunk c+1's targets would let their scores depend on themselves."""
    real_starts = ttt.training_starts
    monkeypatch.setattr(ttt, "training_starts", lambda c, n, chunk, seq: real_starts(c + 1, n, chunk, seq))
    with pytest.raises(RuntimeError, match="test-time training would train on target 128, scored only through 64"):
        per_target_nll(text(250))


def test_updates_change_the_weights_and_lower_the_loss_on_learnable_text():
    tokens, lut = text(600), simple_lut(VOCAB)
    plain = evaluate_bpb(tiny_model(), tokens, lut, context=32, stride=8, batch_seqs=4, device=CPU)
    model = tiny_model()
    adapted = ttt.evaluate_bpb_ttt(model, tokens, lut, SMALL, device=CPU)
    assert adapted["tokens"] == plain["tokens"] and adapted["bytes"] == plain["bytes"]
    assert adapted["val_bpb"] < plain["val_bpb"] - 0.05
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), tiny_model().parameters()))


def test_without_an_update_the_score_is_the_plain_score():
    """One chunk holding every target is the last, never trained on: the plain sliding score, bit for bit. With
    the updates taken out, many chunks score the same windows in other batches: the same score to rounding."""
    tokens, lut = text(300), simple_lut(VOCAB)
    plain = evaluate_bpb(tiny_model(), tokens, lut, context=32, stride=8, batch_seqs=4, device=CPU)
    one_chunk = ttt.evaluate_bpb_ttt(tiny_model(), tokens, lut, replace(SMALL, ttt_chunk_tokens=299), device=CPU)
    assert one_chunk == plain
    ttt_train = ttt.train_on_chunk
    try:
        ttt.train_on_chunk = lambda *args, **kwargs: None
        many = ttt.evaluate_bpb_ttt(tiny_model(), tokens, lut, SMALL, device=CPU)
    finally:
        ttt.train_on_chunk = ttt_train
    assert many["val_bpb"] == pytest.approx(plain["val_bpb"], rel=1e-12)


def test_score_model_reports_the_ttt_score_beside_the_plain_one(tmp_path):
    artifact = tmp_path / "a.mhcg"
    artifact.write_bytes(b"x" * 100)
    tokens, lut = text(300), simple_lut(VOCAB)
    plain = score_model(artifact, tiny_model(), {}, tokens, lut, without_ttt(SMALL), device=CPU)
    both = score_model(artifact, tiny_model(), {}, tokens, lut, SMALL, device=CPU)
    assert not set(ttt.TTT_KEYS) & set(plain) and set(ttt.TTT_KEYS) <= set(both)
    assert both["val_bpb"] == plain["val_bpb"] and both["val_bpb_ttt"] != both["val_bpb"]
    assert both["ttt"] == "chunk_sgd" and both["ttt_time_s"] >= 0 and plain["score_time_s"] >= 0
    assert "ttt_phase_time_s" not in both  # doc_lora's alone


def test_compiled_chunk_sgd_is_the_eager_pass_in_two_graphs(monkeypatch):
    """eval.compile: the windows' scoring takes one graph (the plain score's: padded batches), the SGD steps another
    (every step has the same rows here), and aot_eager trains to the same weights and scores exactly what eager does."""
    from torch._dynamo.testing import CompileCounter
    tokens, lut = text(300), simple_lut(VOCAB)
    eager_model = tiny_model()
    eager = ttt.evaluate_bpb_ttt(eager_model, tokens, lut, SMALL, device=CPU)
    counter = CompileCounter()
    monkeypatch.setattr("training.evaluate.COMPILE_BACKEND", counter)
    torch._dynamo.reset()
    try:
        model = tiny_model()
        plain = evaluate_bpb(model, tokens, lut, context=32, stride=8, batch_seqs=4, device=CPU, compile=True)
        assert ttt.evaluate_bpb_ttt(model, tokens, lut, replace(SMALL, compile=True), device=CPU) == \
            pytest.approx(eager, rel=1e-9)
        assert counter.frame_count == 2 and plain["val_bpb"] != eager["val_bpb"]
        monkeypatch.setattr("training.evaluate.COMPILE_BACKEND", "aot_eager")
        model = tiny_model()
        assert ttt.evaluate_bpb_ttt(model, tokens, lut, replace(SMALL, compile=True), device=CPU) == eager
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), eager_model.parameters()))
    finally:
        torch._dynamo.reset()


def ranks_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    join_env(rank, world, port)
    init_distributed("cpu")  # which imports torch._dynamo before the group exists, as torch.optim.SGD needs
    try:
        model = tiny_model()
        result = ttt.evaluate_bpb_ttt(model, text(300), simple_lut(VOCAB), UNEVEN,
                                      device=CPU, rank=rank, world_size=world)
        result["weights"] = [p.detach().double().sum().item() for p in model.parameters()]
    finally:
        destroy()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def test_two_ranks_hold_the_same_weights_and_score_as_one_process(tmp_path, free_port):
    """Windows and each step's sequences split over 2 gloo ranks, unevenly: the gradients summed over the ranks
    make the single process's steps."""
    ranks = mp.spawn(ranks_worker, args=(2, free_port, str(tmp_path)), nprocs=2, join=False)
    join_or_fail(ranks, 120, "a rank waited in a collective the other had left")
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0 == r1
    model = tiny_model()
    single = ttt.evaluate_bpb_ttt(model, text(300), simple_lut(VOCAB), UNEVEN, device=CPU)
    assert r0["val_bpb"] == pytest.approx(single["val_bpb"], rel=1e-5)
    assert r0["weights"] == pytest.approx([p.detach().double().sum().item() for p in model.parameters()], rel=1e-4)


@pytest.mark.parametrize("overrides,message", [
    (["eval.ttt=sgd"], "eval.ttt='sgd': expected one of none, chunk_sgd"),
    (["eval.ttt_lr=0.01"], "eval.ttt_lr=0.01 applies to test-time training, and eval.ttt is 'none'"),
    (["eval.ttt=chunk_sgd", "eval.ttt_chunk_tokens=1024"], "eval.ttt_chunk_tokens=1024 must be >= eval.context=2048"),
    (["eval.ttt=chunk_sgd", "eval.ttt_lr=0"], "eval.ttt_lr=0.0 must be > 0"),
    (["eval.ttt=chunk_sgd", "eval.ttt_momentum=1"], "eval.ttt_momentum=1.0 must be in [0, 1)"),
    (["eval.ttt=chunk_sgd", "eval.ttt_epochs=0"], "eval.ttt_epochs=0 must be >= 1"),
    (["eval.ttt=chunk_sgd", "eval.ttt_batch_seqs=0"], "eval.ttt_batch_seqs=0 must be >= 1"),
])
def test_bad_ttt_settings_are_refused_naming_the_field(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, overrides)
    assert load_config(None, ["eval.ttt=chunk_sgd", "eval.ttt_chunk_tokens=2048"]).eval.ttt == "chunk_sgd"


def test_the_artifact_records_ttt_and_scoring_takes_or_overrides_it():
    recorded = {f"eval_{key}": getattr(SMALL, key) for key in EVAL_RECORDED}
    assert recorded_eval(recorded) == SMALL
    assert recorded_eval(recorded, ttt_lr=0.01).ttt_lr == 0.01
    off = recorded_eval(recorded, ttt="none")  # the recorded ttt_* settings are left out with it
    off.validate()
    assert off.ttt == "none" and off.ttt_lr == EvalConfig().ttt_lr
    older = recorded_eval({"eval_context": 32})
    assert older.ttt == "none"
    from quant.container import ArtifactError
    with pytest.raises(ArtifactError, match=r"a.mhcg: its meta records eval_ttt_lr='0.05', not a number"):
        recorded_eval({**recorded, "eval_ttt_lr": "0.05"}, "a.mhcg")


def test_settings_on_the_command_line_take_the_field_types():
    keys = ("ttt", "ttt_lr", "ttt_epochs")
    assert parse_setting("eval.ttt=chunk_sgd", "eval", keys) == ("ttt", "chunk_sgd")
    assert parse_setting("eval.ttt_lr=1e-3", "eval", keys) == ("ttt_lr", 0.001)
    assert parse_setting("eval.ttt_epochs=2", "eval", keys) == ("ttt_epochs", 2)
    for bad, message in (("eval.context=3", "expected eval.KEY=VALUE with KEY one of ttt, ttt_lr, ttt_epochs"),
                         ("ttt=chunk_sgd", "expected eval.KEY"), ("eval.ttt_epochs=two", "expected an integer")):
        with pytest.raises(ConfigError, match=message):
            parse_setting(bad, "eval", keys)


def test_a_run_scores_with_ttt_and_scripts_evaluate_reproduces_it_from_the_artifact(demo_dir, tmp_path, capsys,
                                                                                    monkeypatch):
    import train
    from scripts import evaluate
    from test_train import REPO, tiny_overrides
    from training.log_reader import parse_log
    final = train.main(["--config", str(REPO / "configs/demo.toml"), *tiny_overrides(demo_dir, tmp_path),
                        "train.max_steps=2", "eval.pre_quant=false", "quant.method=rtn", "eval.max_tokens=1200", "eval.ttt=chunk_sgd",
                        "eval.ttt_chunk_tokens=256", "eval.ttt_lr=0.02"])
    assert final["val_bpb_ttt"] != final["val_bpb"] and final["ttt_time_s"] >= 0
    assert parse_log(tmp_path / "logs" / "tiny.txt").final == final
    assert "with test-time training" in capsys.readouterr().out
    argv = ["--artifact", str(tmp_path / "runs" / "tiny.mhcg"), "--val", str(demo_dir), "--tokenizer",
            str(demo_dir / "tokenizer.model"), "--device", "cpu"]
    evaluate.main(argv)  # the run's TTT settings, from the artifact
    again = json.loads(capsys.readouterr().out)
    assert (again["val_bpb"], again["val_bpb_ttt"]) == (final["val_bpb"], final["val_bpb_ttt"])
    evaluate.main([*argv, "eval.ttt=none"])
    plain = json.loads(capsys.readouterr().out)
    assert plain["val_bpb"] == final["val_bpb"] and "val_bpb_ttt" not in plain
    monkeypatch.setattr("training.evaluate.COMPILE_BACKEND", "eager")  # eval.compile, not recorded: given here
    evaluate.main([*argv, "eval.ttt=none", "eval.compile=true"])
    assert json.loads(capsys.readouterr().out)["val_bpb"] == pytest.approx(final["val_bpb"], rel=1e-6)
    # the other method, on the same path; the recorded chunk_sgd-only settings (eval.ttt_lr) are left out
    evaluate.main([*argv, "eval.ttt=doc_lora", "eval.ttt_lora_rank=4", "eval.ttt_lora_chunk=16", "eval.ttt_lora_docs=4",
                   "eval.ttt_phases=2", "eval.ttt_phase_docs=4"])
    lora = json.loads(capsys.readouterr().out)
    assert lora["ttt"] == "doc_lora" and lora["val_bpb"] == final["val_bpb"]
    assert lora["val_bpb_ttt"] not in (final["val_bpb"], final["val_bpb_ttt"])
    with pytest.raises(SystemExit):
        evaluate.main([*argv, "eval.ttt_chunk_tokens=16"])
    assert "eval.ttt_chunk_tokens=16 must be >= eval.context=32" in capsys.readouterr().err
