"""Validate shards and print one JSON line per shard: path, tokens, docs (BOS count), max_id.

    python -m data.inspect SHARD... [--vocab-size N]

A SHARD may be a quoted glob ('DIR/fineweb_*.bin'), expanded as the configs' data.* patterns are.

Exits with status 1 and a message naming the file on the first corrupt, truncated or oversized shard.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys

from data.shards import ShardError, count_documents, read_shard

CHUNK = 1 << 24  # tokens per reduction step: a memory-mapped shard is never loaded whole


def shard_summary(path: str, vocab_size: int | None = None) -> dict:
    tokens = read_shard(path, vocab_size=vocab_size)
    max_id = max((int(tokens[i:i + CHUNK].max()) for i in range(0, len(tokens), CHUNK)), default=None)
    return {"path": path, "tokens": int(len(tokens)), "docs": count_documents(tokens, CHUNK), "max_id": max_id}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shards", nargs="+", metavar="SHARD")
    p.add_argument("--vocab-size", type=int, default=None, help="also require every id to be below this")
    a = p.parse_args(argv)
    paths = [match for pattern in a.shards
             for match in (sorted(glob.glob(os.path.expanduser(pattern))) if glob.has_magic(pattern) else [pattern])]
    if not paths:
        sys.exit(f"data.inspect: no shard files match {' '.join(a.shards)} (hint: check the path)")
    for path in paths:
        try:
            print(json.dumps(shard_summary(path, a.vocab_size)), flush=True)
        except ShardError as exc:
            sys.exit(f"data.inspect: {exc}")
        except OSError as exc:  # a folder, a missing or unreadable file
            sys.exit(f"data.inspect: {path}: {exc.strerror} (hint: give shard files, e.g. DIR/fineweb_train_*.bin)")


if __name__ == "__main__":
    main()
