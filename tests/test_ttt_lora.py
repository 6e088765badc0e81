"""Document-LoRA test-time training (eval.ttt=doc_lora): no score depends on a later token, within a chunk, across
chunks, documents and phases; the guards stop an update on targets not yet scored; the adapters and the phases do
change the scores; batching and ranks do not; the model leaves the pass with its own weights."""
import json
import os
import re
from contextlib import nullcontext
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from model.config import ModelConfig
from model.gpt import GPT
from test_distributed_agreement import join_env, join_or_fail
from test_evaluate import simple_lut
from test_ttt import CPU, VOCAB, text, tiny_model
from training import ttt_lora
from training.config import ConfigError, load_config
from training.eval_config import EVAL_RECORDED, EvalConfig
from training.distributed import destroy, init_distributed
from training.score import recorded_eval, score_model
from training.ttt import TTT_KEYS

# BOS at these positions: documents of 45, 25, 80, 10, 70, 70, 10, 30 and 59 targets
BOS = (0, 45, 70, 150, 160, 230, 300, 310, 340)
# Segments: documents 0-1, then 2-3 (a phase after each, through targets 70 and 160), then 4-8 in batches of two,
# longest first ([4, 5], [8, 7], [6]). Chunks of 8 targets, windows of at most 32 tokens, phases in chunks of 32.
SMALL = EvalConfig(context=32, stride=8, batch_seqs=4, ttt="doc_lora", ttt_lora_rank=4, ttt_lora_lr=0.01,
                   ttt_lora_chunk=8, ttt_lora_docs=2, ttt_phases=2, ttt_phase_docs=4, ttt_phase_lr=0.05,
                   ttt_chunk_tokens=32, ttt_batch_seqs=2)


def documents(n: int = 400, seed: int = 0) -> np.ndarray:
    """text() with documents of unequal lengths: BOS where BOS says."""
    tokens = text(n, seed)
    tokens[tokens == 1] = 5
    tokens[[b for b in BOS if b < n]] = 1
    return tokens


def per_target_nll(tokens: np.ndarray, cfg: EvalConfig = SMALL, model: GPT | None = None) -> torch.Tensor:
    """NLL of targets 1..n-1 (index j-1) from one pass; each target must be scored exactly once."""
    model = tiny_model() if model is None else model
    nll = torch.full((len(tokens) - 1,), float("nan"), dtype=torch.float64)
    times = torch.zeros(len(tokens) - 1, dtype=torch.int64)
    for targets, values, _, scored in ttt_lora.doc_lora_scores(model, tokens, simple_lut(VOCAB), cfg, device=CPU):
        nll[targets[scored] - 1] = values[scored]
        times[targets[scored] - 1] += 1
    assert (times == 1).all()
    return nll


def test_documents_and_segments_cover_every_target_once():
    assert ttt_lora.split_documents(np.array([1, 4, 4, 1, 5, 1, 1, 6])) == [(0, 3), (3, 2), (5, 1), (6, 1)]
    assert ttt_lora.split_documents(np.array([4, 4, 1, 5, 1])) == [(0, 2), (2, 2)]  # text before the first BOS
    docs = ttt_lora.split_documents(documents())
    assert [n for _, n in docs] == [45, 25, 80, 10, 70, 70, 10, 30, 59] and sum(n for _, n in docs) == 399
    assert ttt_lora.segments(10, 6, 3) == [range(0, 2), range(2, 4), range(4, 6), range(6, 10)]
    assert ttt_lora.segments(5, 2000, 3) == [range(0, 5)]  # fewer documents than the first part
    assert ttt_lora.segments(5, 6, 3) == [range(0, 2), range(2, 4), range(4, 5)]
    assert ttt_lora.segments(10, 6, 0) == [range(0, 10)]
    assert ttt_lora.segment_batches(docs, range(4, 9), 2) == [[4, 5], [8, 7], [6]]


def test_no_score_depends_on_a_later_token():
    """The NLL of every target before position p is exactly the same when the tokens from p on are replaced, for p
    inside a chunk (50), at a chunk's edge (79: the first target of the third document's second chunk), at a BOS
    (150: gone, two documents of one segment merge, and the segment's batches are sorted otherwise), just past the
    last target the first phase trains on (71), and in the last segment, after the second phase (165)."""
    tokens = documents()
    reference = per_target_nll(tokens)
    rng = np.random.default_rng(1)
    for p in (50, 79, 150, 71, 165):
        changed = tokens.copy()
        changed[p:] = rng.integers(4, VOCAB, len(tokens) - p)
        nll = per_target_nll(changed)
        assert torch.equal(nll[:p - 1], reference[:p - 1]), p  # targets 1..p-1
        assert not torch.equal(nll[p - 1:], reference[p - 1:]), p


def test_the_adapters_and_the_phases_change_the_scores():
    """Fresh adapters score a document's first chunk as the model does, and the phases leave the first segment's
    scores as they are; every later score moves."""
    tokens = documents()
    reference = per_target_nll(tokens)
    no_phase = per_target_nll(tokens, replace(SMALL, ttt_phases=0, ttt_phase_docs=2000, ttt_phase_lr=0.001,
                                              ttt_chunk_tokens=32768, ttt_batch_seqs=32))
    assert torch.equal(no_phase[:70], reference[:70])  # the first segment: documents 0 and 1, targets 1..70
    assert (no_phase[70:] != reference[70:]).all()
    no_step = per_target_nll(tokens, replace(SMALL, ttt_lora_lr=1e-30))
    first_chunks = np.concatenate([np.arange(s, s + min(n, 8)) for s, n in ttt_lora.split_documents(tokens)])
    later = np.setdiff1d(np.arange(len(tokens) - 1), first_chunks)
    assert torch.equal(no_step[first_chunks], reference[first_chunks])
    assert (no_step[later] != reference[later]).all()


def test_without_updates_each_document_is_scored_as_the_model_scores_it_alone():
    """No adapter step and no phase, and a context longer than every document: each target gets the NLL the model
    gives it reading its document whole (to rounding: the windows are shorter)."""
    tokens = documents()
    cfg = replace(SMALL, context=96, ttt_lora_lr=1e-30, ttt_phases=0, ttt_phase_docs=2000, ttt_phase_lr=0.001,
                  ttt_chunk_tokens=32768, ttt_batch_seqs=32)
    nll, model = per_target_nll(tokens, cfg), tiny_model()
    with torch.no_grad():
        for s, n in ttt_lora.split_documents(tokens):
            seq = torch.from_numpy(tokens[s:s + n + 1].astype(np.int64))[None]
            alone = model.token_nll(seq[:, :-1], seq[:, 1:])[0].double()
            assert torch.allclose(nll[s:s + n], alone, rtol=1e-5, atol=1e-6), s


@pytest.mark.parametrize("features", [{}, {"n_streams": 1}, {"n_layers": 2, "xsa_layers": 1, "rope_dims": 8,
                                                                "value_embed_layers": 1, "value_embed_dim": 8,
                                                                "attn_gate": True, "smear_gate": True,
                                                                "bigram_buckets": 64, "bigram_dim": 8,
                                                                "unet_skips": True, "mhc_blocks": 1,
                                                                "lane_start": 1, "recur_end": 0, "recur_times": 2}])
def test_fresh_adapters_leave_the_model_as_it_is(features):
    """B starts at zero: the adapted NLL is the model's token_nll bit for bit, whatever the architecture (mHC, plain,
    the record options with lanes and depth recurrence); a document's adapters change its row alone."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=VOCAB, n_layers=1, d_model=32, n_heads=2, n_kv_heads=1, n_streams=2,
                      mhc_kernels=False)
    model = GPT(replace(cfg, **features)).eval()
    model.recurrence_on = model.cfg.recur_times > 1  # block 0 twice: its adapters act at each pass
    x = torch.from_numpy(documents()[:99].astype(np.int64)).view(3, 33)
    adapters = ttt_lora.Adapters(model, rank=4, docs=3, device=CPU)
    assert len(adapters.sites) == 3 * model.cfg.n_layers  # qkv, the output projection and the MLP of every block
    with torch.no_grad(), ttt_lora.adapted(model, adapters):
        adapted = ttt_lora.adapted_nll(model, adapters.head, x[:, :-1], x[:, 1:], 32)
        tail = ttt_lora.adapted_nll(model, adapters.head, x[:, :-1], x[:, 1:], 8)  # the head reads the last 8 alone
    assert torch.equal(adapted, model.token_nll(x[:, :-1], x[:, 1:])) and torch.equal(tail, adapted[:, -8:])
    with torch.no_grad():
        adapters.loras[2].b[0][0].fill_(0.1)  # the first MLP's (the projections start at zero), document 0 only
        with ttt_lora.adapted(model, adapters):
            moved = ttt_lora.adapted_nll(model, adapters.head, x[:, :-1], x[:, 1:], 32)
    assert not torch.equal(moved[0], adapted[0]) and torch.equal(moved[1:], adapted[1:])


def test_batching_does_not_change_the_scores():
    """A document's row does not see the other rows: two, three or five documents (a whole segment) a batch score
    the same, bit for bit (each row's products run alike on the CPU whatever the rows beside it)."""
    tokens = documents()
    reference = per_target_nll(tokens)
    for docs in (3, 5):
        assert torch.equal(per_target_nll(tokens, replace(SMALL, ttt_lora_docs=docs)), reference), docs


def test_a_chunk_reads_only_the_rows_still_scoring(monkeypatch):
    """Chunk c's pass holds the batch's documents with targets from chunk c on (longest first, so a prefix) and no
    row for one that has ended, but never fewer than two rows where a batch may hold two (a row count of one would
    compile graphs of its own). Segment 4-8 in one batch of five: 70, 70, 59, 30 and 10 targets, chunks of 8."""
    shapes, real = [], ttt_lora.adapted_nll

    def spy(model, head, x, y, tail):
        shapes.append(tuple(x.shape))
        assert tail == 8  # the chunk's targets: the head scores no more
        return real(model, head, x, y, tail)
    monkeypatch.setattr(ttt_lora, "adapted_nll", spy)
    per_target_nll(documents(), replace(SMALL, ttt_lora_docs=5))
    windows = [8, 16, 24, 32, 32, 32, 32, 32, 32, 32]
    first_segments = [(2, w) for w in windows[:6]] + [(2, w) for w in windows]  # documents 0-1 (45, 25), 2-3 (80, 10)
    rows = [5, 5, 4, 4, 3, 3, 3, 3, 2]  # ends after chunk 1 (10 targets), 3 (30) and 7 (59)
    assert shapes == first_segments + list(zip(rows, windows))
    assert ttt_lora.chunk_work(documents(), replace(SMALL, ttt_lora_docs=5)) == (len(shapes),
                                                                                sum(r * w for r, w in shapes))
    for docs in (1, 2, 3):  # the counts the benchmark scales by are the pass's own
        shapes.clear()
        cfg = replace(SMALL, ttt_lora_docs=docs)
        per_target_nll(documents(), cfg)
        assert ttt_lora.chunk_work(documents(), cfg) == (len(shapes), sum(r * w for r, w in shapes))
        assert docs > 1 or {r for r, _ in shapes} == {1}


def test_a_batch_must_come_longest_first():
    model = tiny_model()
    tokens = torch.from_numpy(documents().astype(np.int64))
    with pytest.raises(ValueError, match="the batch's documents must come longest first"):
        next(ttt_lora.score_documents(model, ttt_lora.Adapters(model, 4, 2, CPU), [(45, 25), (70, 80)], tokens,
                                      tokens, SMALL, amp=nullcontext(), before_batch=None, nll_fn=ttt_lora.adapted_nll))


def test_an_adapter_step_on_targets_not_yet_scored_stops(monkeypatch):
    """Training a chunk's adapters on the next chunk would let those targets' scores depend on themselves."""
    real = ttt_lora.trained_targets
    monkeypatch.setattr(ttt_lora, "trained_targets", lambda c, n, chunk: real(c + 1, n, chunk))
    with pytest.raises(RuntimeError, match="would train the adapters on target 16 of the document at 0, scored only "
                                           "through 8"):
        per_target_nll(documents())


def test_a_phase_on_targets_not_yet_scored_stops(monkeypatch):
    """A phase that trained on the next segment too would score it with weights trained on it."""
    real = ttt_lora.phase_end
    monkeypatch.setattr(ttt_lora, "phase_end", lambda docs, segment: real(docs, range(segment.start, segment.stop + 2)))
    with pytest.raises(RuntimeError, match="a phase of test-time training would train on target 160, scored only "
                                           "through 70"):
        per_target_nll(documents())


def test_score_model_reports_doc_lora_beside_the_plain_score_and_keeps_the_weights(tmp_path):
    artifact = tmp_path / "a.mhcg"
    artifact.write_bytes(b"x" * 100)
    tokens, lut, model = documents(), simple_lut(VOCAB), tiny_model()
    trainable = [p.requires_grad for p in model.parameters()]
    result = score_model(artifact, model, {}, tokens, lut, SMALL, device=CPU)
    assert set(TTT_KEYS) <= set(result) and result["ttt"] == "doc_lora"
    assert 0 < result["ttt_phase_time_s"] < result["ttt_time_s"]  # two phases, part of the pass
    assert result["val_bpb_ttt"] < result["val_bpb"]  # learnable text, adapters at lr 0.01
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), tiny_model().parameters()))
    assert [p.requires_grad for p in model.parameters()] == trainable and model.training
    assert artifact.read_bytes() == b"x" * 100


def test_compiled_doc_lora_scores_as_eager_in_two_graphs(monkeypatch):
    """eval.compile: the chunks' windows of 8, 16, 24 and 32 tokens share one graph with the sequence length symbolic,
    with the adapters' gradient, a batch's last chunk too (which trains on nothing, and without the gradient would
    take a graph of its own); the phases' SGD steps take a second. Scores are eager's (dynamo's graphs run eagerly
    here), and a later token still reaches no earlier score. The plain residual stream: the shapes decide the graphs,
    and mHC's Sinkhorn rounds take long to trace on a CPU."""
    from torch._dynamo.testing import CompileCounter

    from training import evaluate

    def plain_model() -> GPT:
        torch.manual_seed(0)
        return GPT(ModelConfig(vocab_size=VOCAB, n_layers=1, d_model=32, n_heads=2, n_kv_heads=1, n_streams=1))
    tokens, cfg = documents(), replace(SMALL, compile=True)
    reference = per_target_nll(tokens, model=plain_model())
    counter = CompileCounter()
    monkeypatch.setattr(evaluate, "COMPILE_BACKEND", counter)
    torch._dynamo.reset()
    try:
        compiled = per_target_nll(tokens, cfg, plain_model())
        assert torch.equal(compiled, reference) and counter.frame_count == 2
        changed = tokens.copy()
        changed[79:] = np.random.default_rng(1).integers(4, VOCAB, len(tokens) - 79)
        nll = per_target_nll(changed, cfg, plain_model())
        assert torch.equal(nll[:78], compiled[:78]) and not torch.equal(nll[78:], compiled[78:])
        assert counter.frame_count == 2
        # adapters of five rows are parameters of other shapes: one graph more, and none for the chunks' row counts,
        # five down to two
        five = replace(SMALL, ttt_lora_docs=5)
        reference = per_target_nll(tokens, five, plain_model())
        assert torch.equal(per_target_nll(tokens, replace(five, compile=True), plain_model()), reference)
        assert counter.frame_count == 3
    finally:
        torch._dynamo.reset()


def test_compiled_doc_lora_traces_each_graph_once_through_mhc(monkeypatch):
    """With the sizes symbolic, Dynamo made the modules' float constants symbolic too, and on the mHC path a later
    pass had to specialize one and restarted the whole trace: AOTAutograd ran twice for the first graph (three backend
    calls for two graphs). Floats are constants from the start: one call a graph, and the scores are eager's."""
    from training import evaluate
    aot, calls = torch._dynamo.lookup_backend("aot_eager"), []
    monkeypatch.setattr(evaluate, "COMPILE_BACKEND", lambda gm, inputs: calls.append(1) or aot(gm, inputs))

    def mhc_model() -> GPT:
        torch.manual_seed(0)
        return GPT(ModelConfig(vocab_size=VOCAB, n_layers=2, d_model=32, n_heads=2, n_kv_heads=1, n_streams=2,
                               mhc_blocks=1))
    tokens = documents()
    torch._dynamo.reset()
    try:
        compiled = per_target_nll(tokens, replace(SMALL, compile=True), mhc_model())
        assert len(calls) == 2  # the chunks (with the adapters' gradient), the phases' steps
        assert torch.allclose(compiled, per_target_nll(tokens, model=mhc_model()), atol=1e-5)
    finally:
        torch._dynamo.reset()


def ranks_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    join_env(rank, world, port)
    init_distributed("cpu")
    try:
        result = ttt_lora.evaluate_bpb_doc_lora(tiny_model(), documents(), simple_lut(VOCAB), SMALL, device=CPU,
                                                rank=rank, world_size=world)
    finally:
        destroy()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def test_two_ranks_score_as_one_process(tmp_path, free_port):
    """Batches dealt to 2 gloo ranks (the first segments' one batch to rank 0 alone), the phases' steps split over
    them: the score of one process, to the rounding of the gradient sums."""
    ranks = mp.spawn(ranks_worker, args=(2, free_port, str(tmp_path)), nprocs=2, join=False)
    join_or_fail(ranks, 120, "a rank waited in a collective the other had left")
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0.pop("phase_time_s") >= 0 and r1.pop("phase_time_s") >= 0  # each rank's own clock
    assert r0 == r1
    single = ttt_lora.evaluate_bpb_doc_lora(tiny_model(), documents(), simple_lut(VOCAB), SMALL, device=CPU)
    assert r0["tokens"] == single["tokens"] and r0["bytes"] == single["bytes"]
    assert r0["val_bpb"] == pytest.approx(single["val_bpb"], rel=1e-5)


@pytest.mark.parametrize("overrides,message", [
    (["eval.ttt_phases=2"], "eval.ttt_phases=2 applies to test-time training, and eval.ttt is 'none'"),
    (["eval.ttt=chunk_sgd", "eval.ttt_lora_rank=8"], "eval.ttt_lora_rank=8 does not apply to eval.ttt=chunk_sgd"),
    (["eval.ttt=doc_lora", "eval.ttt_lr=0.01"], "eval.ttt_lr=0.01 does not apply to eval.ttt=doc_lora"),
    (["eval.ttt=doc_lora", "eval.ttt_phases=0", "eval.ttt_phase_lr=0.01"],
     "eval.ttt_phase_lr=0.01 does not apply to eval.ttt=doc_lora with eval.ttt_phases=0"),
    (["eval.ttt=doc_lora", "eval.ttt_lora_rank=0"], "eval.ttt_lora_rank=0 must be >= 1"),
    (["eval.ttt=doc_lora", "eval.ttt_lora_lr=0"], "eval.ttt_lora_lr=0.0 must be > 0"),
    (["eval.ttt=doc_lora", "eval.ttt_lora_chunk=4096"], "eval.ttt_lora_chunk=4096 must be <= eval.context=2048"),
    (["eval.ttt=doc_lora", "eval.ttt_lora_docs=0"], "eval.ttt_lora_docs=0 must be >= 1"),
    (["eval.ttt=doc_lora", "eval.ttt_lora_wd=-1"], "eval.ttt_lora_wd=-1.0 must be >= 0"),
    (["eval.ttt=doc_lora", "eval.ttt_phases=-1"], "eval.ttt_phases=-1 must be >= 0"),
    (["eval.ttt=doc_lora", "eval.ttt_phase_docs=2"], "eval.ttt_phase_docs=2 must be >= eval.ttt_phases=3"),
    (["eval.ttt=doc_lora", "eval.ttt_phase_lr=0"], "eval.ttt_phase_lr=0.0 must be > 0"),
    (["eval.ttt=doc_lora", "eval.ttt_phase_epochs=0"], "eval.ttt_phase_epochs=0 must be >= 1"),
    (["eval.ttt=doc_lora", "eval.ttt_chunk_tokens=1024"], "eval.ttt_chunk_tokens=1024 must be >= eval.context=2048"),
    (["eval.ttt=doc_lora", "eval.ttt_momentum=1"], "eval.ttt_momentum=1.0 must be in [0, 1)"),
])
def test_bad_doc_lora_settings_are_refused_naming_the_field(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, overrides)


def test_the_defaults_load_and_a_method_switch_drops_the_other_methods_recorded_settings():
    assert load_config(None, ["eval.ttt=doc_lora"]).eval.ttt_lora_rank == 80
    assert load_config(None, ["eval.ttt=doc_lora", "eval.ttt_phases=0"]).eval.ttt_phases == 0
    lora = {f"eval_{key}": getattr(SMALL, key) for key in EVAL_RECORDED}
    assert recorded_eval(lora) == SMALL
    chunk = recorded_eval(lora, ttt="chunk_sgd", ttt_chunk_tokens=32)
    chunk.validate()
    assert chunk.ttt_lora_rank == EvalConfig().ttt_lora_rank and chunk.ttt_batch_seqs == SMALL.ttt_batch_seqs
    sgd = {**{f"eval_{key}": getattr(EvalConfig(), key) for key in EVAL_RECORDED}, "eval_ttt": "chunk_sgd",
           "eval_ttt_lr": 0.01}
    switched = recorded_eval(sgd, ttt="doc_lora")
    switched.validate()
    assert switched.ttt_lr == EvalConfig().ttt_lr


def kernel_model() -> GPT:
    """mHC n=2 started as the lanes on the last two of three blocks, through the Triton mHC and MLP kernels: the
    layout configs/h100_sp8192.toml scores, small; every weight perturbed, so that the zero-init output projections
    do not hide what the kernels compute."""
    from test_model import randomize_
    torch.manual_seed(0)
    return randomize_(GPT(ModelConfig(vocab_size=VOCAB, n_layers=3, d_model=64, n_heads=4, n_kv_heads=2, n_streams=2,
                                      mhc_start=1, mhc_blocks=2, mhc_init="lanes", mhc_kernels=True,
                                      mlp_kernel=True))).cuda()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (inductor around the Triton kernels)")
def test_gpu_compiled_scoring_with_the_kernels_scores_as_eager_and_reads_no_later_token():
    """eval.compile on a GPU, under bf16 autocast as train.py scores: inductor compiles the plain sliding score, the
    chunk_sgd pass and the doc_lora pass (the sequence length and the row count symbolic) around the Triton kernels.
    Each score is eager's to within bf16 rounding; and under doc_lora, new tokens from target 79 on leave the NLL of
    every earlier target as it was, up to the difference two passes over the same tokens show there (zero where the
    GPU's kernels are deterministic)."""
    from training import ttt
    from training.evaluate import evaluate_bpb
    cuda, bf16, lut = torch.device("cuda"), torch.bfloat16, simple_lut(VOCAB)
    tokens = documents()
    torch._dynamo.reset()
    try:
        scores = {}
        for compile in (False, True):  # the plain score, chunk_sgd, doc_lora
            # five documents a batch: the last segment's chunks run 5, 4, 3 and 2 rows
            chunk, lora = replace(SMALL, ttt="chunk_sgd", compile=compile), replace(SMALL, compile=compile,
                                                                                     ttt_lora_docs=5)
            scores[compile] = [
                evaluate_bpb(kernel_model(), tokens, lut, context=32, stride=8, batch_seqs=4, device=cuda,
                             autocast_dtype=bf16, compile=compile)["val_bpb"],
                ttt.evaluate_bpb_ttt(kernel_model(), tokens, lut, chunk, device=cuda, autocast_dtype=bf16)["val_bpb"],
                ttt_lora.evaluate_bpb_doc_lora(kernel_model(), tokens, lut, lora, device=cuda,
                                               autocast_dtype=bf16)["val_bpb"]]
        assert scores[True][0] == pytest.approx(scores[False][0], rel=2e-3), scores
        assert scores[True][1:] == pytest.approx(scores[False][1:], rel=5e-3), scores  # after training steps

        def nll(tokens):
            out = torch.full((len(tokens) - 1,), float("nan"), dtype=torch.float64)
            for targets, values, _, scored in ttt_lora.doc_lora_scores(
                    kernel_model(), tokens, lut, replace(SMALL, compile=True), device=cuda, autocast_dtype=bf16):
                out[targets[scored].cpu() - 1] = values[scored].double().cpu()
            return out
        changed = tokens.copy()
        changed[79:] = np.random.default_rng(1).integers(4, VOCAB, len(tokens) - 79)
        first, again, other = nll(tokens), nll(tokens), nll(changed)
        noise = (again[:78] - first[:78]).abs().max().item()  # targets scored before any phase
        assert noise < 1e-3 and (other[:78] - first[:78]).abs().max().item() <= noise, noise
        assert not torch.equal(other[78:], first[78:])
    finally:
        torch._dynamo.reset()
