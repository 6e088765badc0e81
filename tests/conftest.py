"""Fixtures shared by several test files."""
from pathlib import Path

import pytest

from data.demo import make_demo


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory) -> Path:
    """A small demo corpus (train/val shards, tokenizer, manifest), built once per test session."""
    out = tmp_path_factory.mktemp("demo")
    make_demo(out, seed=0, train_docs=1500, val_docs=40)
    return out
