"""scripts/bench_compress.py: every flag, on tiny inputs."""
import numpy as np
import pytest

from scripts import bench_compress as bench

TINY = ["--layers", "1", "--d-model", "32", "--mlp-mult", "2", "--vocab", "48", "--heads", "4", "--kv-heads", "2"]


def test_synthetic_all_compressors_and_layouts(capsys):
    rows = bench.main(["--synthetic", *TINY, "--seed", "3", "--widths", "5,6", "--layouts", "byte,dense,bitplane",
                       "--compressors", "brotli,lzma,zstd,brotli-chunks", "--threads", "1"])
    out = capsys.readouterr().out
    assert "compressed" in out and "brotli-chunks" in out and "bitplane" in out
    assert len(rows) == 2 * 3 * 4
    # d=32, hidden 64, kv_dim 16: embed 48*32, qkv 64*32, proj 32*32, up 64*32, down 32*64, norms 3*32, q_gain 4.
    assert "8,804 parameters" in out
    for r in rows:
        assert 0 < r["bytes"] and r["seconds"] >= 0
        if r["layout"] == "byte":  # a byte per code, fp16 scales for 240 rows, fp16 for 100 other values
            assert r["raw"] == 8704 + 2 * 240 + 2 * 100
    byte5 = {r["compressor"]: r for r in rows if r["width"] == 5 and r["layout"] == "byte"}
    byte6 = {r["compressor"]: r for r in rows if r["width"] == 6 and r["layout"] == "byte"}
    assert byte6["brotli"]["bytes"] > byte5["brotli"]["bytes"]  # one more bit per code costs bytes
    dense5 = next(r for r in rows if r["width"] == 5 and r["layout"] == "dense" and r["compressor"] == "brotli")
    assert dense5["raw"] < byte5["brotli"]["raw"]


def test_seed_and_table_patterns_change_the_payload():
    a = bench.main(["--synthetic", *TINY, "--seed", "1", "--widths", "5", "--layouts", "byte", "--compressors", "zstd"])
    b = bench.main(["--synthetic", *TINY, "--seed", "2", "--widths", "5", "--layouts", "byte", "--compressors", "zstd"])
    c = bench.main(["--synthetic", *TINY, "--seed", "1", "--widths", "5", "--layouts", "byte", "--compressors", "zstd",
                    "--table-patterns", ""])
    assert a[0]["bytes"] != b[0]["bytes"]
    assert a[0]["matrix_codes"] - c[0]["matrix_codes"] == -48 * 32  # the embedding became an int5 matrix


def test_artifact_state_npz(tmp_path, capsys):
    rng = np.random.default_rng(0)
    path = tmp_path / "w.npz"
    np.savez(path, **{"tok_emb.weight": rng.standard_normal((40, 16), dtype=np.float32),
                      "blocks.0.w": rng.standard_normal((24, 16)).astype(np.float64), "ln": np.ones(16, np.float32)})
    rows = bench.main(["--artifact-state", str(path), "--widths", "6", "--layouts", "bitplane",
                       "--compressors", "brotli", "--table-patterns", "tok_*"])
    assert rows[0]["matrix_codes"] == 24 * 16
    assert "w.npz, 3 tensors, 1,040 parameters" in capsys.readouterr().out


def test_bad_inputs(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--synthetic", "--widths", "4"])
    assert "--widths [4]: expected a comma-separated subset of (5, 6)" in capsys.readouterr().err
    # each of these was a traceback or accepted silently
    for flags, says in ((["--widths", "a"], "--widths 'a': expected comma-separated integers"),
                        (["--widths", ""], "--widths '': expected comma-separated integers"),
                        (["--vocab", "0"], "--vocab 0: sizes must be > 0"),
                        (["--layers", "-1"], "--layers -1: sizes must be > 0"),
                        (["--threads", "-3"], "--threads -3: sizes must be > 0 (and --threads >= 0")):
        with pytest.raises(SystemExit):
            bench.main(["--synthetic", *flags])
        assert says in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--synthetic", "--compressors", "gzip"])
    assert "--compressors ['gzip']: expected a comma-separated subset of ('brotli'," in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main([])  # a source is required
    assert "one of the arguments --artifact-state --synthetic --artifact is required" in capsys.readouterr().err
    bad = tmp_path / "int.npz"
    np.savez(bad, ids=np.arange(4))
    with pytest.raises(SystemExit, match="non-float"):
        bench.main(["--artifact-state", str(bad)])
    with pytest.raises(SystemExit, match="cannot read"):
        bench.main(["--artifact-state", str(tmp_path / "missing.npz")])


def test_artifact_as_shipped(tmp_path, capsys):
    """--artifact benchmarks the exact stored codes (mixed widths), and the 'brotli-chunks' row in the
    artifact's own layout rebuilds a file of the artifact's size."""
    import torch

    from quant.container import save_artifact
    from quant.gptq import rtn_quantize
    g = torch.Generator().manual_seed(0)
    quantized = {"a.weight": rtn_quantize(torch.randn(24, 16, generator=g), 5)[0],
                 "b.weight": rtn_quantize(torch.randn(16, 24, generator=g), 6)[0],
                 "norm": np.ones(16, np.float32)}
    meta = {"model_config": {"bench": True}, "tokenizer_sha256": "0" * 64}
    path = tmp_path / "run.mhcg"
    written = save_artifact(path, meta, quantized, "brotli", "byte")
    rows = bench.main(["--artifact", str(path), "--layouts", "byte,dense", "--compressors", "brotli-chunks,lzma",
                       "--threads", "1"])
    out = capsys.readouterr().out
    assert "as shipped, 3 tensors, 784 parameters, widths [5, 6]" in out and "  mix byte" in out
    assert [(r["layout"], r["compressor"]) for r in rows] == [("byte", "brotli-chunks"), ("byte", "lzma"),
                                                             ("dense", "brotli-chunks"), ("dense", "lzma")]
    assert rows[0]["bytes"] == written and rows[0]["matrix_codes"] == 2 * 24 * 16
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(SystemExit, match="run.mhcg: cannot read the artifact"):
        bench.main(["--artifact", str(path)])


def test_stream_variants_cut_the_same_payload_differently(tmp_path):
    """One stream per tensor is the artifact's payload; the other cuts and transforms are measured beside it."""
    import json
    import lzma
    import struct

    import torch

    from quant.container import save_artifact
    from quant.gptq import rtn_quantize
    g = torch.Generator().manual_seed(0)
    quantized = {f"sublayers.{i}.body.{part}.weight": rtn_quantize(torch.randn(64, 32, generator=g) *
                                                                   torch.rand(64, 1, generator=g), 6)[0]
                 for i, part in enumerate(("qkv", "up", "up", "down"))}
    path = tmp_path / "run.mhcg"
    save_artifact(path, {"model_config": {}, "tokenizer_sha256": "0" * 64}, quantized)
    data = path.read_bytes()
    header = json.loads(lzma.decompress(data[24:24 + struct.unpack_from("<I", data, 12)[0]]))
    payload = sum(e["nbytes"] for e in header["tensors"])
    variants = "brotli-tensors,brotli-roles,brotli-plainscales,brotli-sortedrows"
    rows = {r["compressor"]: r for r in bench.main(["--artifact", str(path), "--layouts", "byte", "--compressors",
                                                     variants, "--threads", "1"])}
    assert rows["brotli-tensors"]["bytes"] == payload
    assert rows["brotli-roles"]["bytes"] != payload  # the two up matrices share a stream
    assert rows["brotli-plainscales"]["bytes"] != payload  # the scales' bytes in another order
    assert rows["brotli-sortedrows"]["bytes"] > 0 and set(rows) == set(variants.split(","))
