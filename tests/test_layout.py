"""scripts/ holds command-line tools alone: each runs as `python -m scripts.X`, edits no sys.path and imports no
other script; what several tools (or train.py) share lives in the packages."""
import ast

from conftest import REPO

SCRIPTS = sorted(p for p in (REPO / "scripts").glob("*.py") if p.name != "__init__.py")


def test_every_script_is_a_tool_that_imports_no_other_script():
    for path in SCRIPTS:
        source = path.read_text()
        tree = ast.parse(source, str(path))
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module} | \
            {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert not any(name == "scripts" or name.startswith("scripts.") for name in imported), path.name
        assert "sys.path" not in source, f"{path.name}: run it as python -m scripts.{path.stem}"
        assert 'if __name__ == "__main__":' in source, f"{path.name}: not a command-line tool"


def test_training_imports_no_tool():
    """train.py imported scripts.evaluate, so a tool's bytes counted against the cap and shipped in every record."""
    from training.sources import collect_modules
    assert not [name for name in collect_modules(REPO) if name.startswith("scripts")]
