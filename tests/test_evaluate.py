"""BPB evaluation: window plans score every target once; the BPB formula; sliding vs non-overlapping."""
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

from conftest import TINY_SEEDS
from data.tokenizer import ByteLUT
from training.evaluate import audit_bytes, evaluate_bpb, plan_windows, target_bytes

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("n,context,stride", [(1000, 128, 32), (1000, 128, 0), (50, 128, 64), (129, 128, 128),
                                              (130, 128, 1), (2, 4, 2)])
def test_window_plan_scores_each_target_once_with_enough_context(n, context, stride):
    scored = np.zeros(n, dtype=int)
    for w in plan_windows(n, context, stride):
        assert 0 <= w.start and w.start + w.length <= n - 1 and w.length <= context
        targets = np.arange(w.start + 1, w.start + w.length + 1)[w.score_from:]
        scored[targets] += 1
        if w.start > 0:  # every scored target sees at least context - stride tokens
            assert w.score_from >= context - (stride or context)
    assert scored[0] == 0 and (scored[1:] == 1).all()


def test_window_plan_rejects_bad_stride():
    with pytest.raises(ValueError, match="stride"):
        plan_windows(100, 64, 65)


def simple_lut(vocab: int) -> ByteLUT:
    """ids 0-3 control (0 bytes, boundaries); even ids: 2 bytes; odd ids: '▁x' (1 byte + space)."""
    base = np.where(np.arange(vocab) % 2 == 0, 2, 1).astype(np.int16)
    base[:4] = 0
    space = (np.arange(vocab) % 2 == 1) & (np.arange(vocab) >= 4)
    boundary = np.arange(vocab) < 4
    return ByteLUT(base_bytes=base, has_leading_space=space, is_boundary=boundary)


def test_target_bytes_adds_leading_space_except_after_a_boundary():
    lut = simple_lut(16)
    tokens = torch.tensor([1, 5, 5, 6, 1, 7])
    # targets: 5 after BOS -> 1 (no space), 5 after 5 -> 2, 6 -> 2, BOS -> 0, 7 after BOS -> 1
    assert target_bytes(tokens, lut).tolist() == [1, 2, 2, 0, 1]


class Bigram(nn.Module):
    """A model whose prediction depends on the previous token only: window context cannot matter."""

    def __init__(self, vocab: int):
        super().__init__()
        torch.manual_seed(0)
        self.table = nn.Parameter(torch.randn(vocab, vocab))

    def token_nll(self, x, y):
        logp = torch.log_softmax(self.table[x], dim=-1)
        return -logp.gather(-1, y.unsqueeze(-1)).squeeze(-1)


def test_bpb_matches_direct_computation_in_every_window_mode():
    vocab = 16
    rng = np.random.default_rng(0)
    tokens = rng.integers(4, vocab, size=777).astype(np.uint16)
    tokens[[0, 300, 500]] = 1
    lut, model = simple_lut(vocab), Bigram(vocab)
    t = torch.from_numpy(tokens.astype(np.int64))
    nll = model.token_nll(t[:-1], t[1:]).double().sum().item()
    nbytes = int(target_bytes(t, lut).sum())
    for context, stride in [(64, 16), (64, 0), (1000, 0), (32, 1)]:
        r = evaluate_bpb(model, tokens, lut, context=context, stride=stride, batch_seqs=7, device=torch.device("cpu"))
        assert r["tokens"] == 776 and r["bytes"] == nbytes
        assert r["val_loss"] == pytest.approx(nll / 776, rel=1e-9)
        assert r["val_bpb"] == pytest.approx(nll / math.log(2) / nbytes, rel=1e-9)


def test_uniform_model_scores_log2_vocab_bits_per_token():
    class Uniform(nn.Module):
        def token_nll(self, x, y):
            return torch.full(y.shape, math.log(32.0))

    tokens = np.random.default_rng(1).integers(4, 32, size=200).astype(np.uint16)
    r = evaluate_bpb(Uniform(), tokens, simple_lut(32), context=16, stride=8, batch_seqs=4, device=torch.device("cpu"))
    assert r["val_bpb"] == pytest.approx(5.0 * r["tokens"] / r["bytes"])


SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


def test_byte_audit_on_real_text_with_the_official_tokenizer():
    tok = SHARED / "tokenizers" / "fineweb_1024_bpe.model"
    corpus = SHARED / "corpus" / "dev_val_fineweb.jsonl.xz"
    if not tok.exists() or not corpus.exists():
        pytest.skip(f"shared data absent ({SHARED})")
    from data.tokenizer import build_byte_lut, iter_texts, load_sp
    sp = load_sp(str(tok))
    ids = []
    for i, text in enumerate(iter_texts([str(corpus)])):
        ids += [1] + sp.encode(text)
        if i == 60:
            break
    tokens = np.array(ids, dtype=np.uint16)
    counted, decoded = audit_bytes(tokens, sp, build_byte_lut(sp))
    assert counted == decoded > 50_000
    # and a wrong LUT is caught: a leading space counted twice (a bug that sank a real submission)
    lut = build_byte_lut(sp)
    broken = ByteLUT(lut.base_bytes + lut.has_leading_space, lut.has_leading_space, lut.is_boundary)
    assert audit_bytes(tokens, sp, broken)[0] != decoded


def test_byte_audit_holds_wherever_the_tokens_are_cut():
    """eval.max_tokens may cut inside a character spelled in byte-fallback pieces; decoded, the unfinished bytes were
    one U+FFFD (3 bytes) against the 1-3 counted, and the audit refused some caps with a wrong hint."""
    tok = SHARED / "tokenizers" / "fineweb_1024_bpe.model"
    if not tok.exists():
        pytest.skip(f"shared data absent ({SHARED})")
    from data.tokenizer import build_byte_lut, load_sp
    from training.evaluate import unfinished_character
    sp = load_sp(str(tok))
    lut = build_byte_lut(sp)
    ids = [1] + sp.encode("the café is open: 日本語, naïve 🙂 ok") + [1] + sp.encode("à")
    assert sum(sp.is_byte(i) for i in ids) >= 10  # the text really spells characters in byte pieces
    cuts = {}
    for end in range(2, len(ids) + 1):
        counted, decoded = audit_bytes(np.array(ids[:end], dtype=np.uint16), sp, lut)
        assert counted == decoded, end
        cuts[end] = unfinished_character(ids[:end], sp)
    assert set(cuts.values()) >= {0, 1, 2, 3}  # cuts after 1, 2 and 3 bytes of a 4-byte character were met


def test_artifact_trained_with_fa3_loads_where_fa3_is_missing(tmp_path, monkeypatch):
    """The artifact's model config names the attention backend it trained with; scoring rebuilds the
    model with 'auto', so an FA3-trained artifact is scored by SDPA where FA3 is not installed."""
    import dataclasses
    import sys

    from model.config import ModelConfig
    from model.gpt import GPT
    from quant.export import export_artifact
    from training.score import load_model
    monkeypatch.setitem(sys.modules, "flash_attn_interface", None)  # FA3 import fails
    cfg = ModelConfig(vocab_size=64, n_layers=1, d_model=32, n_heads=4, n_kv_heads=2, n_streams=2)
    model = GPT(cfg)
    meta = {"model_config": {**dataclasses.asdict(cfg), "attention": "fa3"}, "tokenizer_sha256": "0" * 64}
    path = tmp_path / "a.mhcg"
    export_artifact(model, [torch.randint(0, 64, (2, 16))], str(path), meta, 10**7, log=lambda _: None,
                    observed_patterns=("mhc.*.phi",))
    loaded, loaded_meta = load_model(path, torch.device("cpu"))
    assert loaded_meta["model_config"]["attention"] == "fa3"
    assert loaded.cfg.attention == "auto" and all(a.body.fa3 is None for a in loaded.sublayers[::2])


def rewritten(path: Path, out: Path, edit, edit_text=lambda text: text) -> Path:
    """The artifact at `path` with its header edited by `edit(header)` (then its JSON text by `edit_text`) and the
    sha256 recomputed: a forged file."""
    import hashlib
    import json
    import lzma
    import struct
    data = path.read_bytes()
    header_len, payload_len = struct.unpack_from("<IQ", data, 12)
    header = json.loads(lzma.decompress(data[24:24 + header_len]))
    edit(header)
    packed = lzma.compress(edit_text(json.dumps(header)).encode())
    body = data[:12] + struct.pack("<IQ", len(packed), payload_len) + packed + data[24 + header_len:-32]
    out.write_bytes(body + hashlib.sha256(body).digest())
    return out


def test_a_model_config_the_artifact_cannot_hold_is_refused_before_loading(tmp_path):
    """The artifact's model config used to be trusted: a missing or unknown key, or a wrong type, was a KeyError or
    TypeError traceback; a config whose shapes differ from the tensors failed in load_state_dict, after building the
    model (vocab_size=2**27 tried to allocate 16 GiB first); a float tensor relabelled int32 loaded and scored
    wrongly. Each is now one ArtifactError naming the file, raised before a tensor is decompressed."""
    import dataclasses

    from model.config import ModelConfig
    from model.gpt import GPT
    from quant.container import ArtifactError
    from quant.export import export_artifact
    from training.score import load_model, recorded_eval
    cfg = ModelConfig(vocab_size=64, n_layers=1, d_model=32, n_heads=4, n_kv_heads=2, n_streams=2)
    good = tmp_path / "good.mhcg"
    export_artifact(GPT(cfg), [torch.randint(0, 64, (2, 16))], str(good), {"model_config": dataclasses.asdict(cfg),
                    "tokenizer_sha256": "0" * 64}, 10**7, log=lambda _: None, observed_patterns=("mhc.*.phi",))
    gain = next(name for name in GPT(cfg).state_dict() if name.endswith("q_gain"))  # [n_heads], stored as float32

    def set_config(**changes):
        return lambda h: h["meta"]["model_config"].update(changes)

    def relabel(h):
        entry = next(e for e in h["tensors"] if e["name"] == gain)
        assert entry["dtype"] == "float32"
        entry["dtype"] = "int32"
    cases = {
        "no_config": (lambda h: h["meta"].pop("model_config"), "model config cannot build a model: artifact meta "
                                                              "needs 'model_config'"),
        "unknown": (set_config(foo=1), "model config cannot build a model: unknown key 'foo'"),
        "as_text": (set_config(n_layers="1"), "n_layers='1' is not of type int"),
        "invalid": (set_config(n_layers=0), "model.n_layers=0 must be >= 1"),
        "heads": (set_config(n_heads=8), rf"tensor '{gain}' is stored as float \[4\], the model config makes it "
                                         r"float32 \[8\]"),
        "vocab": (set_config(vocab_size=2 ** 27), r"its model config \(vocab_size 134217728, d_model 32, n_layers 1\) "
                                                  r"does not match its \d+ tensors \(embed.weight \[64, 32\]\)"),
        # these allocated gigabytes (the rotary tables are real tensors even in a shapes-only
        # build), ran for minutes, or ended in an OverflowError or TypeError traceback
        "wide": (set_config(d_model=2 ** 20, n_heads=1, n_kv_heads=1), r"d_model 1048576.* does not match"),
        "deep": (set_config(n_layers=200_000), r"n_layers 200000\) does not match its \d+ tensors"),
        "inf_mlp": (set_config(mlp_mult=float("inf")), "mlp_mult=inf is not a finite number"),
        "huge_mlp": (set_config(mlp_mult=1e300), "model config cannot build a model"),
        "relabelled": (relabel, rf"tensor '{gain}' is stored as int32 \[4\], the model config makes it float32"),
        "extra": (lambda h: h["tensors"][-1].update(name="x.weight"), "tensors do not match the model config"),
    }
    for name, (edit, message) in cases.items():
        with pytest.raises(ArtifactError, match=rf"{name}.mhcg: .*{message}"):
            load_model(rewritten(good, tmp_path / f"{name}.mhcg", edit), torch.device("cpu"))
    model, meta = load_model(good, torch.device("cpu"))
    with pytest.raises(ArtifactError, match=r"a.mhcg: its meta records eval_context='32', not an integer"):
        recorded_eval({**meta, "eval_context": "32"}, "a.mhcg")


def test_a_forged_header_or_payload_is_one_error(tmp_path, monkeypatch):
    """A 5,000-digit integer in the header was a bare ValueError from json, NaN scales loaded and
    scored NaN as success, and a file of any size was read whole before any check."""
    import dataclasses

    from model.config import ModelConfig
    from model.gpt import GPT
    from quant import container
    from quant.container import ArtifactError, load_artifact
    from quant.export import export_artifact
    cfg = ModelConfig(vocab_size=64, n_layers=1, d_model=32, n_heads=4, n_kv_heads=2, n_streams=2)
    good = tmp_path / "good.mhcg"
    export_artifact(GPT(cfg), [torch.randint(0, 64, (2, 16))], str(good), {"model_config": dataclasses.asdict(cfg),
                    "tokenizer_sha256": "0" * 64}, 10**7, log=lambda _: None, observed_patterns=("mhc.*.phi",))
    big = rewritten(good, tmp_path / "big.mhcg", lambda h: h["meta"].update(x="BIG"),
                    lambda text: text.replace('"BIG"', "9" * 5000))
    with pytest.raises(ArtifactError, match="big.mhcg: header is not valid JSON: Exceeds the limit"):
        load_artifact(big)
    meta, stored = load_artifact(good, stored=True)
    quant_name = next(name for name, value in stored.items() if hasattr(value, "scales"))
    real_decode = container.decode_scales
    monkeypatch.setattr(container, "decode_scales", lambda data, count: np.full(count, np.nan, np.float16)
                        if count == stored[quant_name].scales.shape[0] else real_decode(data, count))
    with pytest.raises(ArtifactError, match=r"good.mhcg: tensor '.*' is invalid: its scales hold NaN or Inf"):
        load_artifact(good)
    monkeypatch.setattr(container, "decode_scales", real_decode)
    monkeypatch.setattr(container, "MAX_RAW_BYTES", good.stat().st_size - 1)
    with pytest.raises(ArtifactError, match=r"good.mhcg: [\d,]+ bytes, more than the [\d,]+ any artifact's tensors"):
        load_artifact(good)


def test_scoring_defaults_to_what_the_run_recorded():
    """scripts.evaluate's --context/--stride/--max-tokens default to the artifact's eval_* values; a value
    given always wins (0 included); artifacts written before the record get EvalConfig's defaults."""
    from training.score import recorded_eval
    from training.eval_config import EvalConfig
    meta = {"seq_len": 128, "eval_context": 96, "eval_stride": 32, "eval_max_tokens": 5000, "eval_batch_seqs": 7}
    got = recorded_eval(meta)
    assert (got.context, got.stride, got.max_tokens, got.batch_seqs) == (96, 32, 5000, 7)
    got = recorded_eval(meta, context=64, stride=0, max_tokens=0, batch_seqs=4)
    assert (got.context, got.stride, got.max_tokens, got.batch_seqs) == (64, 0, 0, 4)
    older, default = recorded_eval({"seq_len": 32}), EvalConfig()
    assert (older.context, older.stride, older.max_tokens, older.batch_seqs) == \
        (default.context, default.stride, default.max_tokens, default.batch_seqs)


def test_the_command_line_names_bad_input_in_one_line(demo_dir, tmp_path, capsys):
    """Each of these used to end in a traceback (a bare FileNotFoundError, sentencepiece's 'could not parse
    ModelProto', an assertion inside torch): now one line that names the file or flag, with a hint."""
    from scripts import evaluate
    val, tok = str(demo_dir), str(demo_dir / "tokenizer.model")
    not_a_model = tmp_path / "tokenizer.vocab"
    not_a_model.write_text("<pad>\t0\n")
    cases = [
        (["--artifact", "README.md", "--val", str(tmp_path / "none_*.bin"), "--tokenizer", tok],
         f"scripts.evaluate: no shard files match '{tmp_path}/none_*.bin'"),
        (["--artifact", "README.md", "--val", val, "--tokenizer", str(not_a_model)],
         f"scripts.evaluate: {not_a_model}: not a SentencePiece model"),
        (["--artifact", str(tmp_path / "gone.mhcg"), "--val", val, "--tokenizer", tok],
         f"scripts.evaluate: {tmp_path}/gone.mhcg: no such artifact (hint: train.py writes"),
        (["--artifact", str(REPO / "README.md"), "--val", val, "--tokenizer", tok],
         "README.md: not an mhcgolf artifact"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as stop:
            evaluate.main([*argv, "--device", "cpu"])
        assert message in str(stop.value), (argv, stop.value)
    with pytest.raises(SystemExit) as stop:
        evaluate.main(["--artifact", "a", "--val", val, "--tokenizer", tok, "--device", "gpu"])
    assert stop.value.code == 2 and "--device 'gpu': expected cpu, cuda or cuda:N" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        evaluate.main(["--artifact", "a", "--val", val, "--tokenizer", tok, "--device", "meta"])
    assert "--device 'meta': expected cpu, cuda or cuda:N" in capsys.readouterr().err
    beyond = torch.cuda.device_count()
    with pytest.raises(SystemExit):
        evaluate.main(["--artifact", "a", "--val", val, "--tokenizer", tok, "--device", f"cuda:{beyond}"])
    assert f"--device cuda:{beyond}: {beyond} CUDA device(s) visible (hint: --device cpu)" in capsys.readouterr().err


def test_shards_of_a_larger_vocabulary_are_named_before_scoring(tiny_seed_runs, demo_dir, tmp_path):
    """Validation shards made with a larger tokenizer than --tokenizer crashed inside the byte
    table with an IndexError traceback; and the tokenizer check came after the byte audit."""
    from data.shards import write_shard
    from scripts import evaluate
    artifact = tiny_seed_runs.root / "runs" / f"tiny-run-s{TINY_SEEDS[0]}.mhcg"
    (tmp_path / "val").mkdir()
    write_shard(tmp_path / "val" / "fineweb_val_000000.bin", np.array([1, 5, 981, 7] * 50, dtype=np.uint16))
    with pytest.raises(SystemExit, match=r"scripts.evaluate: .*fineweb_val_\*.bin: token id 981 is outside the "
                                         r"tokenizer's .* vocabulary of 512 ids .*another tokenizer"):
        evaluate.main(["--artifact", str(artifact), "--val", str(tmp_path / "val"), "--tokenizer",
                       str(demo_dir / "tokenizer.model"), "--device", "cpu"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_an_artifact_asking_for_kernels_its_shape_cannot_take_is_scored_by_the_reference(tmp_path):
    """On a GPU such an artifact ended in check_streams' bare ValueError. The reference computes
    the same function, so scoring takes it."""
    import dataclasses

    from model.config import ModelConfig
    from model.gpt import GPT
    from quant.export import export_artifact
    from training.score import load_model
    cfg = ModelConfig(vocab_size=64, n_layers=1, d_model=40, n_heads=4, n_kv_heads=2, n_streams=2)  # 40: not 16k
    meta = {"model_config": {**dataclasses.asdict(cfg), "mhc_kernels": True}, "tokenizer_sha256": "0" * 64}
    path = tmp_path / "a.mhcg"
    export_artifact(GPT(cfg), [torch.randint(0, 64, (2, 16))], str(path), meta, 10**7, log=lambda _: None,
                    observed_patterns=("mhc.*.phi",))
    model, _ = load_model(path, torch.device("cuda"))
    assert not model.cfg.mhc_kernels
    x = torch.randint(0, 64, (2, 16), device="cuda")
    assert torch.isfinite(model.token_nll(x[:, :-1], x[:, 1:])).all()


def test_shards_of_another_tokenizer_without_a_manifest_are_refused(tiny_seed_runs, demo_dir, tmp_path):
    """Shards with no manifest.json beside them were scored with whatever --tokenizer was given: ids of another
    tokenizer of the same size (here: the demo's ids under a permuted vocabulary) were decoded and their bytes
    counted by the wrong one, with no error."""
    from data.loader import load_tokens
    from data.shards import list_shards, write_shard
    from scripts import evaluate
    artifact = tiny_seed_runs.root / "runs" / f"tiny-run-s{TINY_SEEDS[0]}.mhcg"
    tokens = load_tokens(list_shards(str(demo_dir / "fineweb_val_*.bin")))
    ids = np.arange(512)
    ids[4:] = np.random.default_rng(0).permutation(ids[4:])  # control ids (BOS = 1) stay
    for name, shard in (("same", tokens), ("other", ids[tokens])):
        (tmp_path / name).mkdir()
        write_shard(tmp_path / name / "fineweb_val_000000.bin", shard.astype(np.uint16))
    args = ["--artifact", str(artifact), "--tokenizer", str(demo_dir / "tokenizer.model"), "--device", "cpu",
            "--max-tokens", "4000"]
    evaluate.main([*args, "--val", str(tmp_path / "same")])  # the right ids pass without a manifest
    with pytest.raises(SystemExit, match=r"scripts.evaluate: .*fineweb_val_\*.bin: decoded with .*tokenizer.model and "
                                         r"encoded again, \d+ of the first \d+ documents come back as other ids"):
        evaluate.main([*args, "--val", str(tmp_path / "other")])


def tiny_gpt() -> nn.Module:
    from model.config import ModelConfig
    from model.gpt import GPT
    torch.manual_seed(0)
    return GPT(ModelConfig(vocab_size=32, n_layers=1, d_model=32, n_heads=2, n_kv_heads=1, n_streams=2,
                           mhc_kernels=False)).eval()


def test_a_padded_batch_scores_what_the_batch_scores_and_reads_no_later_token():
    """eval.compile pads a batch to [batch_seqs, context]: its padding rows and the positions past a short window's
    end are never scored, and hold token 0, not the tokens after the window (a later token never reaches a score)."""
    from training.evaluate import Window, score_batch
    model = tiny_gpt()
    tokens = torch.from_numpy(np.random.default_rng(0).integers(4, 32, 100))
    all_bytes = target_bytes(tokens, simple_lut(32)).to(torch.int32)
    batch = [Window(start=10, score_from=2, length=8), Window(start=40, score_from=5, length=8)]
    seen = []

    def token_nll(x, y):
        seen.append((x, y))
        return model.token_nll(x, y)
    with torch.no_grad():
        plain = score_batch(token_nll, batch, tokens, all_bytes)
        padded = score_batch(token_nll, batch, tokens, all_bytes, shape=(4, 16))
    assert plain[0].tolist() == list(range(13, 19)) + list(range(46, 49))
    assert all(torch.equal(a, b) for a, b in zip(plain, padded))
    x, y = seen[1]
    assert x.shape == y.shape == (4, 16) and torch.equal(x[:2, :8], seen[0][0]) and torch.equal(y[:2, :8], seen[0][1])
    assert not x[:2, 8:].any() and not y[:2, 8:].any() and not x[2:].any() and not y[2:].any()


def test_compiled_sliding_score_is_the_eager_score_in_one_graph(monkeypatch):
    """eval.compile: one graph takes every batch of the pass (the last, smaller one; a validation set shorter than
    the context), reads the weights as they are when called (the EMA swap copies them in place), and aot_eager
    (torch.compile without inductor's codegen) scores exactly what eager does."""
    from torch._dynamo.testing import CompileCounter

    from training import evaluate
    model, lut = tiny_gpt(), simple_lut(32)
    tokens = np.random.default_rng(2).integers(4, 32, 150).astype(np.uint16)
    settings = dict(context=24, stride=8, batch_seqs=5, device=torch.device("cpu"))
    counter = CompileCounter()
    monkeypatch.setattr(evaluate, "COMPILE_BACKEND", counter)
    torch._dynamo.reset()
    try:
        for n in (150, 20):  # 16 windows in batches of 5, 5, 5 and 1; one window of 19 targets
            eager = evaluate_bpb(model, tokens[:n], lut, **settings)
            assert evaluate_bpb(model, tokens[:n], lut, **settings, compile=True) == pytest.approx(eager, rel=1e-12)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.5)
        eager = evaluate_bpb(model, tokens, lut, **settings)
        assert evaluate_bpb(model, tokens, lut, **settings, compile=True) == pytest.approx(eager, rel=1e-12)
        assert counter.frame_count == 1
        monkeypatch.setattr(evaluate, "COMPILE_BACKEND", "aot_eager")
        assert evaluate_bpb(model, tokens, lut, **settings, compile=True) == eager
    finally:
        torch._dynamo.reset()


def test_dynamic_graphs_are_compiled_without_inductor_shape_padding(monkeypatch):
    """Padded matmuls broke the backward of the symbolic-length document-LoRA graph on a GPU (tests/test_ttt_lora.py's
    GPU test): graphs with dynamic shapes go to inductor with shape padding off; fixed-shape graphs, and other
    backends (which take no inductor options), as torch.compile has them by default."""
    from training import evaluate
    calls = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: calls.append(kwargs) or fn)
    assert evaluate.compiled(len, False, dynamic=True) is len and calls == []
    evaluate.compiled(len, True, dynamic=True)
    evaluate.compiled(len, True, dynamic=False)
    monkeypatch.setattr(evaluate, "COMPILE_BACKEND", "aot_eager")
    evaluate.compiled(len, True, dynamic=True)
    assert calls == [dict(backend="inductor", dynamic=True, options={"shape_padding": False}),
                     dict(backend="inductor", dynamic=False, options=None),
                     dict(backend="aot_eager", dynamic=True, options=None)]
