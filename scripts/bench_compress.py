"""Compare compressors and code layouts on a quantized payload; prints a table.

    python -m scripts.bench_compress --synthetic                      # random weights, reference size
    python -m scripts.bench_compress --artifact-state weights.npz     # named float weights of a real model
    python -m scripts.bench_compress --artifact runs/<run_id>.mhcg      # the exact codes a run shipped

The payload is what the container stores: every 2-D tensor quantized per row by round-to-nearest with
clip search (int5 or int6 for matrices, int8 for tables matching --table-patterns), other tensors as
fp16. GPTQ needs calibration data this script does not have; its codes follow nearly the same
distribution, so the byte counts carry over. Random weights are Gaussian, trained weights are
heavier-tailed and compress better: use --artifact-state for the numbers that matter.

With --artifact the payload is the artifact's own tensors as stored (its GPTQ codes and bit widths,
width column "mix"), re-encoded in each layout: the codec comparison for what actually ships.

Rows: each compressor on the whole payload (brotli-11, lzma-9e, zstd-22), and "brotli-chunks": the real
artifact (quant.container.build_artifact: one brotli-11 chunk per tensor, header and hash included).
Other ways to cut the payload into brotli-11 streams, payload only (no header): "brotli-roles", one stream per
role (embedding tables, attention qkv, attention out, MLP up, MLP down, mHC phi, the rest); "brotli-tensors",
one stream per tensor; "brotli-plainscales", the same with the fp16 scales not byte-shuffled;
"brotli-sortedrows", the same with each matrix's rows sorted by scale (the permutation counted, as int16).
"""
from __future__ import annotations

import argparse
import fnmatch
import lzma
import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch


from quant.container import ArtifactError, build_artifact, encode_tensor, load_artifact
from quant.gptq import rtn_quantize
from quant.pack import LAYOUTS, QuantizedTensor, encode_codes

COMPRESSORS = ("brotli", "lzma", "zstd", "brotli-chunks", "brotli-roles", "brotli-tensors", "brotli-plainscales",
               "brotli-sortedrows")
ROLES = (("tables", ("embed", "bigram", "value_embed")), ("qkv", (".qkv.",)), ("attn-out", (".proj.",)),
         ("mlp-up", (".up.",)), ("mlp-down", (".down.",)), ("phi", (".phi",)))
BENCH_META = {"model_config": {"bench": True}, "tokenizer_sha256": "0" * 64}


def synthetic_state(layers: int, d_model: int, mlp_mult: float, vocab: int, heads: int, kv_heads: int,
                    seed: int) -> dict[str, np.ndarray]:
    """Reference-shaped weights (names as in model/gpt.py with n_streams=1), N(0, 1/fan_in)."""
    rng = np.random.default_rng(seed)
    hidden, kv_dim = int(round(mlp_mult * d_model)), kv_heads * (d_model // heads)

    def mat(rows, cols):
        return (rng.standard_normal((rows, cols), dtype=np.float32) / np.sqrt(cols)).astype(np.float32)
    state = {"embed.weight": (rng.standard_normal((vocab, d_model), dtype=np.float32) * 0.005)}
    for i in range(layers):
        a, m = f"sublayers.{2 * i}", f"sublayers.{2 * i + 1}"
        state[f"{a}.norm.weight"] = np.ones(d_model, np.float32)
        state[f"{a}.body.qkv.weight"] = mat(d_model + 2 * kv_dim, d_model)
        state[f"{a}.body.proj.weight"] = mat(d_model, d_model)
        state[f"{a}.body.q_gain"] = np.full(heads, 1.5, np.float32)
        state[f"{m}.norm.weight"] = np.ones(d_model, np.float32)
        state[f"{m}.body.up.weight"] = mat(hidden, d_model)
        state[f"{m}.body.down.weight"] = mat(d_model, hidden)
    state["final_norm.weight"] = np.ones(d_model, np.float32)
    return state


def load_state(path: str) -> dict[str, np.ndarray]:
    """Float arrays from an .npz, never unpickling (allow_pickle=False refuses object arrays)."""
    try:
        with np.load(path, allow_pickle=False) as npz:
            state = {name: npz[name] for name in npz.files}
    except (OSError, ValueError) as exc:
        raise SystemExit(f"{path}: cannot read as an .npz of float arrays: {exc}")
    bad = [n for n, a in state.items() if a.dtype.kind != "f"]
    if bad or not state:
        raise SystemExit(f"{path}: expected named float arrays, got non-float {bad[:3]}" if bad else f"{path}: empty .npz")
    return state


def quantize_state(state: dict[str, np.ndarray], width: int, table_patterns: list[str]) -> dict:
    out = {}
    for name, array in state.items():
        if array.ndim == 2:
            is_table = any(fnmatch.fnmatchcase(name, p) for p in table_patterns)
            out[name] = rtn_quantize(torch.from_numpy(array.astype(np.float32)), 8 if is_table else width)[0]
        else:
            out[name] = array.astype(np.float16)
    return out


def compress_whole(payload: bytes, compressor: str) -> bytes:
    if compressor == "brotli":
        import brotli
        return brotli.compress(payload, quality=11)
    if compressor == "lzma":
        return lzma.compress(payload, preset=9 | lzma.PRESET_EXTREME)
    if compressor == "zstd":
        import zstandard
        return zstandard.ZstdCompressor(level=22).compress(payload)
    raise ValueError(f"unknown compressor {compressor!r}")


def role(name: str) -> str:
    return next((r for r, keys in ROLES if any(k in name for k in keys)), "other")


def tensor_raw(name: str, value, layout: str, compressor: str) -> bytes:
    """A tensor's bytes as the stream variants store them (see the module doc)."""
    if compressor == "brotli-plainscales" and hasattr(value, "codes"):
        return encode_codes(value.codes, value.bits, layout) + value.scales.astype("<f2").tobytes()
    if compressor == "brotli-sortedrows" and hasattr(value, "codes"):
        order = np.argsort(value.scales.astype(np.float32), kind="stable")
        moved = QuantizedTensor(value.codes[order], value.scales[order], value.bits)
        return encode_tensor(name, moved, layout)[1] + order.astype("<u2").tobytes()
    return encode_tensor(name, value, layout)[1]


def compress_streams(quantized: dict, layout: str, compressor: str, threads: int) -> int:
    """Bytes of the payload cut into brotli-11 streams: one per role, or one per tensor."""
    groups: dict[str, list[bytes]] = {}
    for name, value in quantized.items():
        key = role(name) if compressor == "brotli-roles" else name
        groups.setdefault(key, []).append(tensor_raw(name, value, layout, compressor))
    with ThreadPoolExecutor(max_workers=threads or os.cpu_count() or 1) as pool:
        return sum(pool.map(lambda parts: len(compress_whole(b"".join(parts), "brotli")), groups.values()))


def bench_rows(quantized: dict, width: int, layouts: list[str], compressors: list[str], threads: int) -> list[dict]:
    n_matrix = sum(v.codes.size for v in quantized.values() if hasattr(v, "codes") and v.bits != 8)
    n_params = sum(v.codes.size if hasattr(v, "codes") else v.size for v in quantized.values())
    rows = []
    for layout in layouts:
        payload = b"".join(encode_tensor(n, v, layout)[1] for n, v in quantized.items())
        for compressor in compressors:
            t = time.perf_counter()
            if compressor == "brotli-chunks":
                size = len(build_artifact(BENCH_META, quantized, "brotli", layout, threads=threads))
            elif compressor.startswith("brotli-"):
                size = compress_streams(quantized, layout, compressor, threads)
            else:
                size = len(compress_whole(payload, compressor))
            rows.append({"width": width, "layout": layout, "compressor": compressor, "raw": len(payload),
                         "bytes": size, "seconds": time.perf_counter() - t, "matrix_codes": n_matrix,
                         "params": n_params})
            print(format_row(rows[-1]), flush=True)  # rows appear as measured: brotli-11 on 30 MB takes minutes
    return rows


TABLE_HEADER = (f"{'width':>5} {'layout':<9} {'compressor':<18} {'raw bytes':>12} {'compressed':>12} {'ratio':>6} "
                f"{'bits/param':>10} {'seconds':>8}")


def format_row(r: dict) -> str:
    """bits/param: compressed bits over all parameters (scales and small tensors included)."""
    width = r["width"] if isinstance(r["width"], str) else f"int{r['width']}"
    return (f"{width:>5} {r['layout']:<9} {r['compressor']:<18} {r['raw']:>12,} {r['bytes']:>12,} "
            f"{r['bytes'] / r['raw']:>6.3f} {8 * r['bytes'] / max(1, r['params']):>10.3f} {r['seconds']:>8.2f}")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--artifact-state", metavar="STATE.npz", help="named float weights of a trained model")
    src.add_argument("--synthetic", action="store_true", help="random weights of the reference model size")
    src.add_argument("--artifact", metavar="RUN.mhcg", help="an artifact written by train.py: its codes as shipped")
    p.add_argument("--layers", type=int, default=11, help="synthetic: transformer layers")
    p.add_argument("--d-model", type=int, default=512, help="synthetic: model width")
    p.add_argument("--mlp-mult", type=float, default=3.5, help="synthetic: MLP hidden = mult * d_model")
    p.add_argument("--vocab", type=int, default=1024, help="synthetic: vocabulary size")
    p.add_argument("--heads", type=int, default=8, help="synthetic: query heads")
    p.add_argument("--kv-heads", type=int, default=4, help="synthetic: key/value heads")
    p.add_argument("--seed", type=int, default=0, help="synthetic: random seed")
    p.add_argument("--widths", default="5,6", help="matrix bit widths to try, comma-separated (5, 6)")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"code layouts, comma-separated {LAYOUTS}")
    p.add_argument("--compressors", default="brotli,lzma,zstd,brotli-chunks", help=f"comma-separated {COMPRESSORS}")
    p.add_argument("--table-patterns", default="*embed*", help="fnmatch patterns of 2-D tensors stored int8")
    p.add_argument("--threads", type=int, default=0, help="brotli-chunks compression threads (0: one per CPU)")
    args = p.parse_args(argv)
    if not all(w.strip().isdigit() for w in args.widths.split(",")):
        p.error(f"--widths {args.widths!r}: expected comma-separated integers, e.g. 5,6")
    sizes = (("--layers", args.layers), ("--d-model", args.d_model), ("--vocab", args.vocab), ("--heads", args.heads),
             ("--kv-heads", args.kv_heads), ("--mlp-mult", args.mlp_mult))
    bad = [f"{name} {value}" for name, value in sizes if not value > 0] + \
        [f"--threads {args.threads}"] * (args.threads < 0)
    if bad:
        p.error(f"{bad[0]}: sizes must be > 0 (and --threads >= 0, 0 = one per CPU)")
    args.widths = [int(w) for w in args.widths.split(",")]
    args.layouts, args.compressors = args.layouts.split(","), args.compressors.split(",")
    args.table_patterns = [s for s in args.table_patterns.split(",") if s]
    for name, values, allowed in (("--widths", args.widths, (5, 6)), ("--layouts", args.layouts, LAYOUTS),
                                  ("--compressors", args.compressors, COMPRESSORS)):
        if not values or any(v not in allowed for v in values):
            p.error(f"{name} {values}: expected a comma-separated subset of {allowed}")
    return args


def load_stored(path: str) -> dict:
    """The artifact's tensors as stored (codes, scales, arrays); refuses a damaged file by name."""
    try:
        return load_artifact(path, stored=True)[1]
    except (OSError, ArtifactError) as exc:
        raise SystemExit(f"{path}: cannot read the artifact: {exc}")


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.artifact:
        stored = load_stored(args.artifact)
        params = sum(v.codes.size if hasattr(v, "codes") else v.size for v in stored.values())
        widths = sorted({v.bits for v in stored.values() if hasattr(v, "bits")})
        print(f"source: {args.artifact} as shipped, {len(stored)} tensors, {params:,} parameters, widths {widths}")
        print(TABLE_HEADER, flush=True)
        return bench_rows(stored, "mix", args.layouts, args.compressors, args.threads)
    if args.synthetic:
        state = synthetic_state(args.layers, args.d_model, args.mlp_mult, args.vocab, args.heads, args.kv_heads, args.seed)
        source = f"synthetic {args.layers}x{args.d_model} (Gaussian weights)"
    else:
        state, source = load_state(args.artifact_state), args.artifact_state
    params = sum(a.size for a in state.values())
    print(f"source: {source}, {len(state)} tensors, {params:,} parameters")
    print(TABLE_HEADER, flush=True)
    rows = []
    for width in args.widths:
        quantized = quantize_state(state, width, args.table_patterns)
        rows += bench_rows(quantized, width, args.layouts, args.compressors, args.threads)
    return rows


if __name__ == "__main__":
    main()
