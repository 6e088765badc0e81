"""Named sets of config overrides on a tool's command line: `--variant NAME="section.key=value ..."`, the
overrides after `--` that every variant shares (scripts.ablate, scripts.bench_quant), and `--seeds 1337,42,2025`
(scripts.ablate, scripts.reproduce)."""
from __future__ import annotations

import argparse
import re
import shlex
from typing import NamedTuple

NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


class Named(NamedTuple):
    name: str
    overrides: list[str]


def parse_variant(text: str) -> Named:
    """NAME="overrides" split as a shell would; SystemExit naming the argument otherwise."""
    name, sep, overrides = text.partition("=")
    if not sep or not NAME.match(name):
        raise SystemExit(f"--variant {text!r}: expected NAME=\"section.key=value ...\" with NAME made of letters, "
                         "digits, '.', '_' or '-' (it becomes part of the run id)")
    try:
        return Named(name, shlex.split(overrides))
    except ValueError as e:  # an unclosed quote
        raise SystemExit(f"--variant {text!r}: the overrides do not split as a shell would ({e})") from None


def split_common(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the tool's own arguments, the overrides after `--` that every variant shares)."""
    if "--" not in argv:
        return argv, []
    i = argv.index("--")
    return argv[:i], argv[i + 1:]


def parse_seeds(text: str) -> list[int]:
    if not re.fullmatch(r"\s*\d+(\s*,\s*\d+)*\s*", text):  # train.seed must be >= 0
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers >= 0, e.g. 1337,42,2025")
    seeds = [int(s) for s in text.split(",")]
    if len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"{text!r}: each seed once (a repeated seed is not an independent run)")
    return seeds
