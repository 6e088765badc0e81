"""What a record's train_gpt.py costs, module by module, and under which compressor.

    python -m scripts.record_bytes

Makes train_gpt.py as training.packing does (the bytes a checkout's run counts, with
training.shipped_code.CONFIG_BYTES beside them), then once more without each module in turn: a module's cost is the
bytes the script loses without it. The compressor finds text shared between modules, so the costs add up to less
than the script. Beside it: the packed text under xz -9e instead of Brotli, each as base85 text in the script.
"""
from __future__ import annotations

import base64
import lzma
from pathlib import Path

import brotli

from training.packing import (BROTLI_WINDOW_BITS, minified_sources, module_path, runtime_source, script_text,
                              shipped_modules)

REPO = Path(__file__).resolve().parents[1]


def module_costs(repo: Path) -> list[dict]:
    """One row per shipped module: its source's bytes, minified, and the script's bytes without it; the first row
    ('all') is the whole script."""
    modules = shipped_modules(repo)
    sources, runtime = minified_sources(modules), runtime_source(repo)
    whole = len(script_text(runtime, sources).encode())
    rows = [{"module": "all", "source": sum(p.stat().st_size for p, _ in modules.values()),
             "minified": sum(len(s.encode()) for _, s in sources.values()), "cost": whole}]
    for name, (path, is_pkg) in modules.items():
        rest = {other: value for other, value in sources.items() if other != name}
        rows.append({"module": module_path(name, is_pkg), "source": path.stat().st_size,
                     "minified": len(sources[name][1].encode()), "cost": whole - len(script_text(runtime, rest).encode())})
    return rows


def compressors(repo: Path) -> dict[str, int]:
    """Bytes of the packed text (runtime and modules, NUL-joined as the script holds them): raw, Brotli-11 and
    xz -9e, and each compressed form as base85 text."""
    sources = minified_sources(shipped_modules(repo))
    text = "\0".join([runtime_source(repo)] + [f for name, (is_pkg, source) in sources.items()
                                                for f in (module_path(name, is_pkg), source)]).encode()
    packed = {"brotli": brotli.compress(text, quality=11, lgwin=BROTLI_WINDOW_BITS),
              "xz": lzma.compress(text, preset=9 | lzma.PRESET_EXTREME)}
    return {"raw": len(text), **{k: len(v) for k, v in packed.items()},
            **{f"{k} base85": len(base64.b85encode(v)) for k, v in packed.items()}}


def main() -> None:
    rows = module_costs(REPO)
    print("| module | source bytes | minified bytes | bytes of train_gpt.py |\n|---|---|---|---|")
    for row in sorted(rows[1:], key=lambda r: -r["cost"]) + rows[:1]:
        print(f"| {row['module']} | {row['source']:,} | {row['minified']:,} | {row['cost']:,} |")
    print("\n| packed text | bytes |\n|---|---|")
    for name, size in compressors(REPO).items():
        print(f"| {name} | {size:,} |")


if __name__ == "__main__":
    main()
