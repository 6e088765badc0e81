"""scripts.bench_scoring: each method under each compile setting timed on a prefix, and the full-split estimate."""
import re
from dataclasses import replace

import numpy as np
import pytest

from conftest import TINY_SEEDS
from data.shards import list_shards, read_header
from scripts import bench_scoring
from scripts.bench_scoring import Row
from training import ttt_lora
from training.eval_config import EvalConfig


def test_the_estimate_is_the_warm_up_then_the_full_count_at_each_timed_rate():
    plain = Row("none", False, warmup_s=3.0, plain_s=2.0, ttt_s=None, tokens=1_000)
    assert plain.full_split_s(10_000) == pytest.approx((3.0 + 20.0, 3.0 + 20.0))
    ttt = Row("chunk_sgd", True, warmup_s=10.0, plain_s=2.0, ttt_s=4.0, tokens=1_000)
    assert ttt.full_split_s(10_000) == pytest.approx((10.0 + 20.0 + 40.0,) * 2)
    table = bench_scoring.format_table([plain, ttt], 10_000)
    assert "| none | false | 3.00 | 2.00 | 500 | — | — | 23.0 |" in table
    assert "| chunk_sgd | true | 10.00 | 2.00 | 500 | 4.00 | 250 | 70.0 |" in table


def test_a_document_lora_row_spans_its_two_work_ratios():
    """The plain pass by tokens (10x); the document-LoRA pass by its chunk steps' ratio and by its window positions'
    (given here: 4x and 2.5x, in either order), the smaller giving the low end."""
    for work in ((4.0, 2.5), (2.5, 4.0)):
        row = Row("doc_lora", False, warmup_s=1.0, plain_s=2.0, ttt_s=5.0, tokens=1_000, ttt_work=work)
        assert row.full_split_s(10_000) == pytest.approx((1.0 + 20.0 + 12.5, 1.0 + 20.0 + 20.0))
    row.phase_s = 1.5  # the phases train on the split's first documents, timed whole: not scaled
    assert row.full_split_s(10_000) == pytest.approx((1.0 + 20.0 + 3.5 * 2.5 + 1.5, 1.0 + 20.0 + 3.5 * 4.0 + 1.5))
    assert "| doc_lora | false | 1.00 | 2.00 | 500 | 5.00 (1.50 in phases) | 200 | 31.2–36.5 |" in \
        bench_scoring.format_table([row], 10_000)


def test_the_work_ratios_read_the_documents_and_name_untimed_phases():
    """Documents of 40 targets in the timed tokens, of 200 in the split (BOS, token 1, opens each): per token the
    split's chunks compute more positions in fewer steps (its batches hold longer documents), and the ratios are the
    two passes' own counts."""
    def docs(n_docs: int, targets: int) -> np.ndarray:
        tokens = np.full(n_docs * targets + 1, 7, dtype=np.uint16)
        tokens[::targets] = 1
        return tokens
    cfg = EvalConfig(context=64, ttt="doc_lora", ttt_lora_chunk=8, ttt_lora_docs=4, ttt_phase_docs=6, ttt_phases=2)
    timed, split = docs(3, 40), docs(20, 200)
    (steps_t, positions_t), (steps_s, positions_s) = ttt_lora.chunk_work(timed, cfg), ttt_lora.chunk_work(split, cfg)
    ratios, lines = bench_scoring.lora_work_lines(cfg, timed, split)
    assert ratios == (steps_s / steps_t, positions_s / positions_t)
    assert positions_s / len(split) > positions_t / len(timed)
    assert steps_s / len(split) < steps_t / len(timed)

    def counts(steps: int, positions: int, tokens: np.ndarray) -> str:
        return f"{1000 * steps / len(tokens):.2f} and {positions / len(tokens):.1f}"
    assert lines[0] == ("doc_lora: chunk steps per 1,000 tokens and window positions per token: "
                        f"{counts(steps_t, positions_t, timed)} in the timed tokens, "
                        f"{counts(steps_s, positions_s, split)} in the split: the estimate spans both ratios")
    assert lines[1] == ("doc_lora: the timed tokens hold 3 documents, so 0 of the split's 2 phases of global SGD ran "
                        "(eval.ttt_phase_docs 6 in 2 parts): the estimate counts those alone; timed tokens holding "
                        "more than 6 documents time them all")
    assert bench_scoring.lora_work_lines(cfg, docs(4, 40), split)[1][1].startswith(
        "doc_lora: the timed tokens hold 4 documents, so 1 of the split's 2 phases")
    whole = f"{counts(steps_s, positions_s, split)} in the timed tokens, {counts(steps_s, positions_s, split)} in"
    assert bench_scoring.lora_work_lines(cfg, split, split) == ((1.0, 1.0), [
        f"doc_lora: chunk steps per 1,000 tokens and window positions per token: {whole} the split: the estimate "
        "spans both ratios"])  # 20 documents: every phase
    ratios, lines = bench_scoring.lora_work_lines(replace(cfg, ttt_phases=0), timed, None)  # --full-tokens: no split
    assert ratios is None and len(lines) == 1 and lines[0].endswith("in the timed tokens")


def test_a_sample_is_whole_batches_spread_over_the_split_with_the_splits_targets():
    """20 documents of 5 to 62 targets in a shuffled order, batches of four: the pass's five batches run from the
    longest four to the shortest four. Two batches: the middle ones of the first three and of the last two (the
    second and the fourth), their documents in validation order with their own targets, and the sample's own batches
    are those two again; five: the split itself."""
    rng = np.random.default_rng(0)
    lengths = [5 + 3 * i for i in rng.permutation(20)]
    tokens = np.concatenate([np.concatenate([[1], rng.integers(4, 50, n - 1)]) for n in lengths] + [[1]])
    tokens = tokens.astype(np.uint16)
    cfg = EvalConfig(ttt="doc_lora", ttt_lora_docs=4, ttt_phase_docs=0, ttt_phases=0)
    docs = ttt_lora.split_documents(tokens)
    plan = ttt_lora.segment_batches(docs, range(len(docs)), 4)
    assert np.array_equal(bench_scoring.sampled_batches(tokens, cfg, 5), tokens)
    sample = bench_scoring.sampled_batches(tokens, cfg, 2)
    picked = sorted(plan[1] + plan[3])
    own = ttt_lora.split_documents(sample)
    assert [n for _, n in own] == [docs[d][1] for d in picked]
    for (s, n), d in zip(own, picked):
        assert np.array_equal(sample[s:s + n + 1], tokens[docs[d][0]:docs[d][0] + n + 1])
    own_plan = ttt_lora.segment_batches(own, range(len(own)), 4)
    assert [[own[d][1] for d in b] for b in own_plan] == [[docs[d][1] for d in b] for b in (plan[1], plan[3])]
    for n in (0, 6):
        with pytest.raises(ValueError, match=rf"--sample-batches {n}: expected 1 to 5, the document-LoRA pass's "
                                             r"batches over the split at eval.ttt_lora_docs 4"):
            bench_scoring.sampled_batches(tokens, cfg, n)


def test_the_timed_tokens_can_be_a_sample_of_the_splits_batches(tiny_seed_runs, demo_dir, monkeypatch, capsys):
    """--sample-batches: every row times the sample's tokens after a warm-up on all of them, and the document-LoRA
    estimate scales by the whole split's work over the sample's."""
    timed = []

    def fixed(artifact, tokens, warmup, lut, settings, device):
        assert np.array_equal(warmup, tokens)
        timed.append(tokens)
        return Row(settings["ttt"], settings["compile"], 1.0, 2.0, 3.0, len(tokens))
    monkeypatch.setattr(bench_scoring, "time_row", fixed)
    artifact = tiny_seed_runs.root / "runs" / f"tiny-run-s{TINY_SEEDS[0]}.mhcg"
    bench_scoring.main(["--artifact", str(artifact), "--val", str(demo_dir), "--tokenizer",
                        str(demo_dir / "tokenizer.model"), "--sample-batches", "2", "--passes", "none,doc_lora",
                        "--compile", "false", "--device", "cpu", "eval.ttt_lora_docs=2"])
    out = capsys.readouterr().out
    from data.loader import load_tokens
    split = load_tokens(list_shards(str(demo_dir / "fineweb_val_*.bin")))
    cfg = EvalConfig(ttt="doc_lora", ttt_lora_docs=2)
    sample = bench_scoring.sampled_batches(split, cfg, 2)
    assert len(timed) == 2 and all(np.array_equal(t, sample) for t in timed)
    assert f"{len(sample):,} timed tokens (the documents of 2 document-LoRA batches), {len(sample):,} warm-up" in out
    assert ttt_lora.chunk_work(sample, cfg) != ttt_lora.chunk_work(split, cfg)
    assert re.search(r"in the timed tokens, [\d.]+ and [\d.]+ in the split: the estimate spans both ratios", out)


def table_rows(out: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines()
            if line.startswith("| ") and not line.startswith("| eval.ttt")]


def test_every_method_and_compile_setting_gets_a_timed_row(tiny_seed_runs, demo_dir, monkeypatch, capsys):
    """The three methods, eager and compiled (compiled through Dynamo's eager backend: no C++ compiler on the CPU),
    on a prefix of the tiny run's validation tokens; the estimate defaults to every token of --val."""
    monkeypatch.setattr("training.evaluate.COMPILE_BACKEND", "eager")
    artifact = tiny_seed_runs.root / "runs" / f"tiny-run-s{TINY_SEEDS[0]}.mhcg"
    bench_scoring.main(["--artifact", str(artifact), "--val", str(demo_dir), "--tokenizer",
                        str(demo_dir / "tokenizer.model"), "--tokens", "600", "--warmup-tokens", "300",
                        "--device", "cpu", "eval.ttt_chunk_tokens=128", "eval.ttt_lora_chunk=16"])
    out = capsys.readouterr().out
    in_split = sum(read_header(s) for s in list_shards(str(demo_dir / "fineweb_val_*.bin")))
    assert f"600 timed tokens, 300 warm-up tokens, on cpu; estimates for {in_split:,} tokens" in out
    rows = table_rows(out)
    # the document-LoRA rows scale by their chunks' steps and positions, from every document of --val; the whole
    # split holds too few documents for the default phases, so the estimate leaves none out
    assert re.search(r"\ndoc_lora: chunk steps per 1,000 tokens and window positions per token: [\d.]+ and [\d.]+ "
                     r"in the timed tokens, [\d.]+ and [\d.]+ in the split: the estimate spans both ratios\n", out)
    assert "phases of global SGD ran" not in out
    assert [(r[0], r[1]) for r in rows] == [(m, c) for m in ("none", "chunk_sgd", "doc_lora")
                                            for c in ("false", "true")]
    # an eval setting the artifact's context cannot take is named, with the artifact
    with pytest.raises(SystemExit, match=r"tiny-run-s7.mhcg: eval.ttt_lora_chunk=48 must be <= eval.context=32"):
        bench_scoring.main(["--artifact", str(artifact), "--val", str(demo_dir), "--tokenizer",
                            str(demo_dir / "tokenizer.model"), "--tokens", "600", "--passes", "doc_lora",
                            "--compile", "false", "--device", "cpu", "eval.ttt_lora_chunk=48"])
    for method, _, warmup, plain, plain_rate, ttt, ttt_rate, estimate in rows:
        assert float(warmup) > 0 and float(plain) >= 0 and int(plain_rate.replace(",", "")) > 0
        assert (ttt == "—") == (method == "none") and (ttt_rate == "—") == (method == "none")
        low, _, high = estimate.replace(",", "").partition("–")
        assert float(warmup) <= float(low) <= float(high or low)
        assert (high != "") == (method == "doc_lora")  # a range where the pass's steps and positions scale apart


def test_the_count_to_estimate_for_can_be_given(tiny_seed_runs, demo_dir, monkeypatch, capsys):
    """--full-tokens replaces the split's count; the row's timings are fixed here, so the estimate is exact."""
    def fixed(artifact, tokens, warmup, lut, settings, device):
        return Row(settings["ttt"], settings["compile"], 1.0, 2.0, None, len(tokens))
    monkeypatch.setattr(bench_scoring, "time_row", fixed)
    artifact = tiny_seed_runs.root / "runs" / f"tiny-run-s{TINY_SEEDS[0]}.mhcg"
    bench_scoring.main(["--artifact", str(artifact), "--val", str(demo_dir), "--tokenizer",
                        str(demo_dir / "tokenizer.model"), "--tokens", "400", "--warmup-tokens", "200",
                        "--passes", "none", "--compile", "false", "--full-tokens", "40600000", "--device", "cpu"])
    out = capsys.readouterr().out
    assert "estimates for 40,600,000 tokens" in out
    assert "| none | false | 1.00 | 2.00 | 200 | — | — | 203,001.0 |" in out  # 1 s + 40.6M tokens at 200 tokens/s


@pytest.mark.parametrize("flags,message", [
    (["--passes", "none,sgd"], "--passes 'none,sgd': expected a comma-separated list of none, chunk_sgd, doc_lora"),
    (["--compile", "yes"], "--compile 'yes': expected a comma-separated list of false, true"),
    (["--tokens", "1"], "--tokens 1: expected at least 2"),
    (["--warmup-tokens", "0"], "--warmup-tokens 0: expected at least 2"),
    (["--full-tokens", "-5"], "--full-tokens -5: expected 0 (every token of --val) or a positive count"),
    (["--device", "gpu"], "--device 'gpu': expected cpu, cuda or cuda:N"),
    (["eval.compile=true"], "eval.compile"),
    (["eval.ttt=chunk_sgd"], "eval.ttt"),
    (["--passes", "none", "eval.ttt_lr=0.01"], "eval.ttt_lr is read by none of --passes none"),
    (["--sample-batches", "-1"], "--sample-batches -1: expected 0 (a prefix) or a number of batches"),
    (["--sample-batches", "2", "--passes", "none"], "--sample-batches samples the document-LoRA pass's batches: "
                                                    "expected doc_lora in --passes"),
    (["--sample-batches", "2", "--tokens", "600"], "--sample-batches and --tokens: give one"),
    (["--sample-batches", "2", "--full-tokens", "600"], "--sample-batches with --full-tokens: the sample is drawn"),
])
def test_bad_flags_are_named_by_the_parser(demo_dir, flags, message, capsys):
    with pytest.raises(SystemExit) as stop:
        bench_scoring.main(["--artifact", "a.mhcg", "--val", str(demo_dir), "--tokenizer",
                            str(demo_dir / "tokenizer.model"), *flags])
    assert stop.value.code == 2 and message in capsys.readouterr().err


def test_bad_input_is_named_in_one_line(tiny_seed_runs, demo_dir, tmp_path):
    artifact = tiny_seed_runs.root / "runs" / f"tiny-run-s{TINY_SEEDS[0]}.mhcg"
    base = ["--val", str(demo_dir), "--tokenizer", str(demo_dir / "tokenizer.model"), "--device", "cpu"]
    with pytest.raises(SystemExit, match=re.escape(f"scripts.bench_scoring: {tmp_path}/gone.mhcg: no such artifact")):
        bench_scoring.main(["--artifact", str(tmp_path / "gone.mhcg"), *base])
    in_split = sum(read_header(s) for s in list_shards(str(demo_dir / "fineweb_val_*.bin")))
    with pytest.raises(SystemExit, match=rf"--tokens {in_split + 1:,}: .* holds {in_split:,} tokens "
                                         rf"\(hint: --tokens {in_split} or fewer\)"):
        bench_scoring.main(["--artifact", str(artifact), *base, "--tokens", str(in_split + 1)])
