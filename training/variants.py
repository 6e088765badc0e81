"""Named sets of config overrides on a tool's command line: `--variant NAME="section.key=value ..."`, and the
overrides after `--` that every variant shares (scripts.ablate, scripts.bench_quant)."""
from __future__ import annotations

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
