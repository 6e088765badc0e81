"""The train_gpt.py a record made from this tree ships, which is also the code a checkout's run counts.

The file is a function of the tree alone (no title, commit or run name in it): the modules train.py imports, each
minified (training.minify), and the record's runtime (training.record_script), joined by NULs into one text,
Brotli-compressed (quality 11, 16 MiB window: smaller than xz -9e on these sources, docs/journal.md), base85-encoded
into one bytes literal. Left out: training.shipped_code, which the runtime replaces with the record's own, and what
only it imports (this module, the minifier, the runtime's template, the digest walk); they run only in a checkout.
"""
from __future__ import annotations

import ast
import base64
from pathlib import Path

import brotli

from training.minify import minify_source
from training.record_script import HEAD, RUNTIME
from training.sources import collect_modules, module_sources, sources_digest

SEAM = "training.shipped_code"  # a record brings its own (training.record_script.RUNTIME's shipped_code)
BROTLI_WINDOW_BITS = 24  # Brotli's largest window: the whole text (~270 KB) is one match window


def shipped_modules(repo: Path) -> dict[str, tuple[Path, bool]]:
    """{module name: (file, is a package)} of what a record ships: train.py's import closure but SEAM's."""
    return collect_modules(repo, stop=(SEAM,))


def module_path(name: str, is_package: bool) -> str:
    """The module's file relative to the repository root, as the runtime places it: training/score.py."""
    return name.replace(".", "/") + ("/__init__.py" if is_package else ".py")


def minified_sources(modules: dict[str, tuple[Path, bool]]) -> dict[str, tuple[bool, str]]:
    """{module name: (is a package, minified source)}: what the record embeds."""
    return {name: (is_package, minify_source(source, str(modules[name][0])))
            for name, (is_package, source) in module_sources(modules).items()}


def runtime_source(repo: Path) -> str:
    """The record's runtime, minified, holding the digest a checkout's run logs (training.sources.code_digest)."""
    digest = sources_digest(module_sources(collect_modules(repo)))
    return minify_source(RUNTIME.replace("@DIGEST@", digest), "training/record_script.py")


def script_text(runtime: str, sources: dict[str, tuple[bool, str]]) -> str:
    """train_gpt.py holding `runtime` and `sources` ({module name: (is a package, source)})."""
    fields = [runtime] + [f for name, (is_pkg, source) in sources.items() for f in (module_path(name, is_pkg), source)]
    if any("\0" in field for field in fields):
        raise ValueError("a shipped source holds a NUL character, which separates the packed fields")
    packed = brotli.compress("\0".join(fields).encode("utf-8"), quality=11, lgwin=BROTLI_WINDOW_BITS)
    return HEAD.replace("@PAYLOAD@", base64.b85encode(packed).decode("ascii"))


def generate_script(repo: Path) -> str:
    """The record's train_gpt.py; checked to unpack to exactly the minified sources."""
    sources = minified_sources(shipped_modules(repo))
    script = script_text(runtime_source(repo), sources)
    if embedded_sources(script) != sources:  # read back out of the generated text: byte-identical
        raise AssertionError("generated train_gpt.py does not reproduce the module sources exactly")
    return script


def unpacked_fields(script: str) -> list[str]:
    """The runtime's source, then a path and a source per module, read from a generated script without running it."""
    for node in ast.walk(ast.parse(script)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "b85decode":
            return brotli.decompress(base64.b85decode(node.args[0].value)).decode("utf-8").split("\0")
    raise ValueError("not a generated train_gpt.py: it holds no packed literal")


def embedded_sources(script: str) -> dict[str, tuple[bool, str]]:
    """{module name: (is a package, source)} of a generated script."""
    fields = unpacked_fields(script)
    embedded = {}
    for path, source in zip(fields[1::2], fields[2::2]):
        parts = path.removesuffix(".py").split("/")
        is_package = parts[-1] == "__init__"
        embedded[".".join(parts[:-1] if is_package else parts)] = (is_package, source)
    return embedded


_MADE: dict[Path, tuple[tuple, str]] = {}  # repo -> (the stat of every file the script was made from, the script)


def _stats(files) -> tuple:
    return tuple((str(f), f.stat().st_mtime_ns, f.stat().st_size) for f in files)


def made_script(repo: Path) -> str:
    """generate_script(repo), made again only when a file it was made from changed (making it takes seconds on a
    CPU; asking, a millisecond): a run counts it and a record ships it, in one process more than once. A new
    module needs an import in a file that changed."""
    made = _MADE.get(repo.resolve())
    try:
        if made is not None and _stats(Path(f) for f, _, _ in made[0]) == made[0]:
            return made[1]
    except OSError:  # a file gone: make it again
        pass
    files = [path for path, _ in collect_modules(repo).values()]  # the runtime's digest covers them all
    stats = _stats(files)
    _MADE[repo.resolve()] = (stats, generate_script(repo))
    return _MADE[repo.resolve()][1]


def script_bytes(repo: Path) -> int:
    """len(made_script(repo)) in bytes: the code a checkout's run counts."""
    return len(made_script(repo).encode("utf-8"))
