"""write_atomic: every file a reader may open (shards, tokenizer, manifests, artifacts, summaries, records) is
written to a temp file beside it, fsynced and renamed over it, so a reader sees the old file or the whole new
one, even after a power loss. (Folders: training.checkpoint.replace_folder.)"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path


def current_umask() -> int:
    """The process umask (reading it means setting it, so it is set back at once)."""
    umask = os.umask(0)
    os.umask(umask)
    return umask


# Read once: reading it sets it to 0 for a moment, and another thread (wandb's, say) creating a file then would
# make it world-writable.
FILE_MODE = 0o666 & ~current_umask()


def write_atomic(path: str | os.PathLike, *chunks) -> None:
    """Write the bytes-like `chunks` to `path`, making its folder. The mode is a plain open()'s at import time
    (mkstemp's 0600 would make an artifact private). A failure keeps the old file and leaves no temp file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, FILE_MODE)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
