"""The training code as a set of module sources: what a record's train_gpt.py embeds, and the digest a run logs.

collect_modules walks train.py's imports (lazy ones inside functions too) through the repository, so the set does
not depend on the config a run takes. code_digest hashes those sources: two runs with the same digest ran the same
code, whatever git said (a checkout with a stale .git, uncommitted edits). scripts.reproduce and
scripts.export_record compare it before they count a logged run as a run of the code at hand. A record's
train_gpt.py carries these sources minified (training.packing), but for the count of a checkout's code, and logs the
digest of the originals, which it holds.
"""
from __future__ import annotations

import ast
import hashlib
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def module_file(repo: Path, name: str) -> tuple[Path, bool] | None:
    """(file, is_package) of a module of the repository, or None when `name` is not one."""
    base = repo.joinpath(*name.split("."))
    if (base / "__init__.py").is_file():
        return base / "__init__.py", True
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py"), False
    return None


def imported_names(source: str, where: str) -> set[str]:
    """Every module name an import statement anywhere in the file may refer to (lazy imports too)."""
    names = set()
    for node in ast.walk(ast.parse(source, where)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                raise ValueError(f"{where}: relative import 'from {'.' * node.level}{node.module or ''} import …' "
                                 "(hint: the generator resolves absolute imports only; write it absolute)")
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)  # `from pkg import submodule`
    return names


def collect_modules(repo: Path, entry: str = "train", stop: tuple[str, ...] = ()) -> dict[str, tuple[Path, bool]]:
    """`entry` and, transitively, every repository module it imports, with their parent packages; the modules of
    `stop` are left out, and what only they import."""
    found: dict[str, tuple[Path, bool]] = {}
    todo = [entry]
    while todo:
        name = todo.pop()
        if name in found or name in stop:
            continue
        located = module_file(repo, name)
        if located is None:
            raise FileNotFoundError(f"module {name!r} not found under {repo}")
        found[name] = located
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]
        todo += [n for n in imported_names(located[0].read_text(), str(located[0])) if module_file(repo, n)]
    return dict(sorted(found.items()))


def module_sources(modules: dict[str, tuple[Path, bool]]) -> dict[str, tuple[bool, str]]:
    """{module name: (is a package, source text)}: the form a record embeds."""
    return {name: (is_pkg, path.read_text(encoding="utf-8")) for name, (path, is_pkg) in modules.items()}


def sources_digest(sources: dict[str, tuple[bool, str]]) -> str:
    """sha256 (16 hex digits) of the module names, their kinds and their sources, in name order."""
    canonical = json.dumps(sorted([name, bool(is_pkg), text] for name, (is_pkg, text) in sources.items()),
                           ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]


def code_digest(repo: Path = REPO) -> str | None:
    """The digest of the training code under `repo` (train.py and every module it imports), or None where the walk
    fails (a relative import, a module that cannot be read): the run then logs none, and the tools that compare
    digests treat it as unknown code."""
    try:
        return sources_digest(module_sources(collect_modules(repo)))
    except (ValueError, OSError, SyntaxError):
        return None
