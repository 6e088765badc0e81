"""Size accounting: which code files count, and the 16,000,000-byte cap."""
from pathlib import Path

import pytest

from quant.size import CAP_BYTES, CODE_FILES, SizeCapError, check_total, code_bytes, code_files, require_fits

REPO = Path(__file__).resolve().parents[1]


def make_repo(root: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)


def fake_repo_files() -> dict[str, bytes]:
    files = {rel.replace("*", "a"): b"x" * (i + 1) for i, rel in enumerate(CODE_FILES)}
    files.update({"quant/gptq.py": b"NOT SHIPPED" * 9, "training/optim.py": b"no" * 40, "train.py": b"t" * 5})
    return files


def test_code_bytes_counts_exactly_the_listed_files(tmp_path):
    make_repo(tmp_path, fake_repo_files())
    names = {p.relative_to(tmp_path).as_posix() for p in code_files(tmp_path)}
    assert names == {rel.replace("*", "a") for rel in CODE_FILES}
    assert code_bytes(tmp_path) == sum(range(1, len(CODE_FILES) + 1))


def test_a_pattern_matching_nothing_is_an_error(tmp_path):
    files = fake_repo_files()
    del files["training/evaluate.py"]
    make_repo(tmp_path, files)
    with pytest.raises(FileNotFoundError, match="'training/evaluate.py' matches no file.*CODE_FILES"):
        code_bytes(tmp_path)
    with pytest.raises(FileNotFoundError, match="not a directory"):
        code_bytes(tmp_path / "missing")


def test_counted_code_covers_everything_the_evaluator_imports():
    """What loads and scores an artifact must be counted: the import closure of scripts/evaluate.py."""
    from scripts.export_record import collect_modules
    counted = set(code_files(REPO))
    needed = {path.resolve() for path, _ in collect_modules(REPO, "scripts.evaluate").values()}
    missing = sorted(str(p.relative_to(REPO)) for p in needed - {p.resolve() for p in counted})
    assert not missing, f"imported by scripts/evaluate.py but not counted in quant.size.CODE_FILES: {missing}"


def test_code_files_patterns_cover_this_repository_loader():
    """The shipped quant files exist here; patterns are relative globs."""
    assert CODE_FILES[0] == "model/*.py"
    for rel in ("quant/__init__.py", "quant/container.py", "quant/pack.py"):
        assert rel in CODE_FILES and (REPO / rel).is_file()
    assert code_bytes(REPO, ("quant/container.py", "quant/pack.py")) == sum(
        (REPO / "quant" / n).stat().st_size for n in ("container.py", "pack.py"))


def test_check_total_and_cap_enforcement():
    ok = check_total(15_000_000, 999_999)
    assert ok == {"artifact_bytes": 15_000_000, "code_bytes": 999_999, "total_bytes": 15_999_999,
                  "cap": CAP_BYTES, "fits": True, "over_by": 0}
    assert require_fits(ok) is ok
    assert check_total(15_000_000, 1_000_000)["fits"]  # exactly at the cap fits
    over = check_total(15_900_000, 100_123)
    assert not over["fits"] and over["over_by"] == 123
    with pytest.raises(SizeCapError, match="15900000 \\+ code 100123 = 16000123 bytes is over the cap of "
                                           "16000000 bytes by 123 bytes"):
        require_fits(over)
    assert check_total(10, 5, cap=12)["over_by"] == 3
    with pytest.raises(ValueError, match=">= 0"):
        check_total(-1, 0)
