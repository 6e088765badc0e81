"""pyproject.toml and requirements.txt describe the same install, and pyproject installs every package."""
import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def requirement_lines() -> set[str]:
    lines = (REPO / "requirements.txt").read_text().splitlines()
    return {re.sub(r"\s+", "", line.replace('"', "'")) for line in lines if line.strip() and not line.startswith("#")}


def test_pyproject_lists_the_requirements():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = {re.sub(r"\s+", "", d.replace('"', "'")) for d in project["dependencies"]}
    assert declared | set(project["optional-dependencies"]["test"]) == requirement_lines()


def test_pyproject_installs_every_package_of_the_repository():
    """Without an explicit list setuptools refused the flat layout (logs/, runs/ and data/ look like packages)."""
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = {p.parent.name for p in REPO.glob("*/__init__.py")}
    assert set(setuptools["packages"]) == packages and setuptools["py-modules"] == ["train"]
