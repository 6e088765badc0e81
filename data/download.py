"""Fetch the published FineWeb export and its tokenizer from the Hugging Face Hub.

    python -m data.download --variant sp1024 --train-shards N [--out DIR] [--repo-id ID] [--retries K]

The dataset repo (repo_type dataset) holds `datasets/manifest.json`, which lists each export
(`datasets[].name`, `.tokenizer_name`, `.stats.files_train` / `.files_val`) and each tokenizer
(`tokenizers[].name`, `.model_path`, `.vocab_path`). Shards live under
`datasets/datasets/fineweb10B_<variant>/` and tokenizers under `datasets/tokenizers/`. They land in
DIR/datasets/fineweb10B_<variant>/ and DIR/tokenizers/ (DIR defaults to this package's folder).

Each file is downloaded into DIR/datasets/.staging/<variant> (huggingface_hub resumes partial files there; each
request fetches the manifest through a .staging/.manifest-<pid> of its own), checked against the size and checksum
the Hub reports (the LFS sha256, or the git blob id of a small file; shards also against their own header), and
only then renamed into place. A file already in place that matches is skipped, so re-running resumes; the checksums
of files found good are remembered in DIR/datasets/.verified.json by size and modification time, so a rerun does
not read 16 GB again. Until every file is in place the shard folder holds a marker (data.shards.DOWNLOAD_MARKER)
naming the command and the shards it expects, and the loaders refuse a pattern that matches one still missing: it
would train on part of the set.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from data.files import write_atomic
from data.shards import DOWNLOAD_MARKER, ShardError, read_header

REPO_ID = "willdepueoai/parameter-golf"
REMOTE_ROOT = "datasets"
MANIFEST = f"{REMOTE_ROOT}/manifest.json"
PACKAGE_DIR = Path(__file__).resolve().parent


@dataclass(frozen=True)
class RemoteFile:
    remote: str   # path inside the Hub repo
    local: Path   # final destination
    kind: str     # tokenizer | val | train


def dataset_name(variant: str) -> str:
    if variant.startswith("sp") and variant[2:].isdigit():
        return f"fineweb10B_{variant}"
    # The export's byte260 set comes with a JSON byte tokenizer; training and the byte audit need SentencePiece.
    raise ValueError(f"unknown variant {variant!r}; expected sp<VOCAB> (e.g. sp1024 or sp8192: the SentencePiece "
                     "sets, which this repository's training and byte accounting read)")


def _entry(manifest: dict, section: str, name: str) -> dict:
    entries = manifest.get(section) or []
    for entry in entries:
        if entry.get("name") == name:
            return entry
    known = ", ".join(str(e.get("name")) for e in entries) or "none"
    raise ValueError(f"{MANIFEST}: no {section} entry named {name!r} (available: {known})")


def plan_downloads(manifest: dict, variant: str, train_shards: int, out_dir: Path) -> list[RemoteFile]:
    """Files to fetch for `variant`: tokenizer files, every validation shard, the first `train_shards`
    training shards. Pure: no network, no disk."""
    name = dataset_name(variant)
    dataset = _entry(manifest, "datasets", name)
    stats = dataset.get("stats") or {}
    try:
        n_train, n_val = int(stats["files_train"]), int(stats["files_val"])
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"{MANIFEST}: dataset {name!r} lacks integer stats.files_train / stats.files_val") from None
    if not 0 <= train_shards <= n_train:
        raise ValueError(f"--train-shards {train_shards}: {name} has {n_train} training shards (use 0..{n_train})")
    tokenizer = _entry(manifest, "tokenizers", dataset.get("tokenizer_name"))
    tok_paths = [tokenizer[k] for k in ("model_path", "vocab_path") if tokenizer.get(k)]
    if not any(p.endswith(".model") for p in tok_paths):
        raise ValueError(f"{MANIFEST}: tokenizer {tokenizer.get('name')!r} has no model_path ending in .model")
    files = [RemoteFile(f"{REMOTE_ROOT}/{p}", out_dir / "tokenizers" / Path(p).name, "tokenizer") for p in tok_paths]
    shard_dir = f"{REMOTE_ROOT}/datasets/{name}"
    for split, count in (("val", n_val), ("train", train_shards)):
        for i in range(count):
            shard = f"fineweb_{split}_{i:06d}.bin"
            files.append(RemoteFile(f"{shard_dir}/{shard}", out_dir / "datasets" / name / shard, split))
    return files


@dataclass(frozen=True)
class HubFile:
    """What the Hub says a file is: its size and a checksum (the LFS sha256 where the file is in LFS, else the
    git blob id, a sha1 of b"blob <size>\\0" + content)."""
    size: int
    sha256: str | None = None
    git_oid: str | None = None

    def digest_of(self, path: Path) -> str | None:
        """The digest of `path` of the kind this record holds (None when it holds none)."""
        if self.sha256 is None and self.git_oid is None:
            return None
        h = hashlib.sha256() if self.sha256 else hashlib.sha1(b"blob %d\0" % path.stat().st_size)
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
        return h.hexdigest()

    @property
    def digest(self) -> str | None:
        return self.sha256 or self.git_oid


class Verified:
    """Checksums of files found good, by path, size and modification time (DIR/datasets/.verified.json)."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self.known = json.loads(path.read_text()) if path.is_file() else {}
        except (json.JSONDecodeError, OSError):
            self.known = {}  # a damaged cache only costs a re-read

    def digest(self, path: Path, hub: HubFile) -> str | None:
        st = path.stat()
        key, stamp = str(path.resolve()), [st.st_size, st.st_mtime_ns]
        entry = self.known.get(key)
        if entry and entry[:2] == stamp and entry[2] == hub.digest:
            return entry[2]
        return hub.digest_of(path)

    def remember(self, path: Path, digest: str | None) -> None:
        if digest is None:
            return
        st = path.stat()
        entry, key = [st.st_size, st.st_mtime_ns, digest], str(path.resolve())
        if self.known.get(key) != entry:  # a rerun that finds every file known writes nothing
            self.known[key] = entry
            write_atomic(self.path, (json.dumps(self.known, indent=0) + "\n").encode())


def check_file(path: Path, hub: HubFile | None, verified: Verified | None = None) -> str | None:
    """Why `path` is not a complete, intact copy (None when it is)."""
    if not path.is_file():
        return "missing"
    size = path.stat().st_size
    if hub is not None and size != hub.size:
        return f"{size} bytes, the Hub says {hub.size}"
    if path.suffix == ".bin":
        try:
            read_header(path)
        except ShardError as exc:
            return str(exc)
    if hub is not None and hub.digest is not None:
        digest = verified.digest(path, hub) if verified is not None else hub.digest_of(path)
        if digest != hub.digest:
            return f"checksum {digest[:12]}…, the Hub says {hub.digest[:12]}… (damaged or changed)"
        if verified is not None:
            verified.remember(path, digest)
    return None


# The two network calls, module-level so tests replace them.
def hub_files(repo_id: str, remotes: list[str]) -> dict[str, HubFile]:
    from huggingface_hub import HfApi
    found = {}
    for i in range(0, len(remotes), 100):
        for info in HfApi().get_paths_info(repo_id, remotes[i:i + 100], repo_type="dataset"):
            lfs = getattr(info, "lfs", None)
            found[info.path] = HubFile(info.size, sha256=lfs.sha256 if lfs is not None else None,
                                       git_oid=None if lfs is not None else getattr(info, "blob_id", None))
    return found


def hub_download(repo_id: str, remote: str, staging: Path) -> Path:
    from huggingface_hub import hf_hub_download
    return Path(hf_hub_download(repo_id, remote, repo_type="dataset", local_dir=staging))


def fetch(repo_id: str, item: RemoteFile, hub: HubFile | None, staging: Path, retries: int,
          verified: Verified | None = None) -> None:
    """Download one file with retries and exponential backoff; verify it; move it into place."""
    for attempt in range(1, retries + 1):
        try:
            staged = hub_download(repo_id, item.remote, staging)
            problem = check_file(staged, hub)
            if problem is None:
                item.local.parent.mkdir(parents=True, exist_ok=True)
                os.replace(staged, item.local)
                if verified is not None and hub is not None:
                    verified.remember(item.local, hub.digest)
                return
            staged.unlink()  # a bad copy must not be resumed from
            error: Exception = ValueError(f"{item.remote}: downloaded file is bad ({problem})")
        except Exception as exc:  # network hiccups, Hub errors: retried, then reported
            error = exc
        if attempt < retries:
            delay = min(2 ** (attempt - 1), 30)
            print(f"retry {attempt}/{retries - 1} for {item.remote} in {delay} s: {error}", file=sys.stderr, flush=True)
            time.sleep(delay)
    raise RuntimeError(f"could not download {item.remote} after {retries} attempts: {error}") from error


def load_manifest(repo_id: str, out_dir: Path, retries: int, verified: Verified | None = None) -> dict:
    local = out_dir / "datasets" / "manifest.json"
    hub = hub_files(repo_id, [MANIFEST]).get(MANIFEST)
    if hub is None:
        raise ValueError(f"{repo_id} has no {MANIFEST}")
    if check_file(local, hub, verified) is not None:
        staging = out_dir / "datasets" / ".staging" / f".manifest-{os.getpid()}"  # requests fetch it side by side
        try:
            fetch(repo_id, RemoteFile(MANIFEST, local, "manifest"), hub, staging, retries, verified)
        finally:
            remove_staging(staging)
    try:
        return json.loads(local.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{local}: not valid JSON ({e}); hint: delete it and run the download again") from None


def download(variant: str, train_shards: int, out_dir: Path, repo_id: str = REPO_ID, retries: int = 4) -> list[Path]:
    """Fetch what `plan_downloads` lists; returns the local paths. Raises on the first file that fails."""
    if retries < 1:
        raise ValueError(f"--retries must be >= 1, got {retries}")
    verified = Verified(out_dir / "datasets" / ".verified.json")
    manifest = load_manifest(repo_id, out_dir, retries, verified)
    plan = plan_downloads(manifest, variant, train_shards, out_dir)
    hub = hub_files(repo_id, [f.remote for f in plan])
    # One staging folder per variant: a request clears its own when done, not the partial files of a download of
    # another variant into the same --out. Two requests of one variant would share it: one with anything to fetch
    # is refused below while another is fetching into the variant's shard folders.
    staging = out_dir / "datasets" / ".staging" / variant
    missing = []
    for i, item in enumerate(plan, 1):
        if hub.get(item.remote) is None:
            raise ValueError(f"{repo_id}: {item.remote} is listed by the manifest but not on the Hub")
        if check_file(item.local, hub[item.remote], verified) is None:
            print(f"[{i}/{len(plan)}] have {item.local}", flush=True)
        else:
            missing.append((i, item))
    # Until every shard is in place its folder says which it expects: a glob would otherwise train on those that
    # arrived. The loaders refuse a pattern that matches an expected shard still missing (data.shards.list_shards).
    command = shlex.join(["python", "-m", "data.download", "--variant", variant, "--train-shards", str(train_shards),
                          "--out", str(out_dir), "--repo-id", repo_id])
    folders = {item.local.parent for _, item in missing if item.kind in ("train", "val")}
    shard_folders = {item.local.parent for item in plan if item.kind in ("train", "val")}
    # A live download's marker and staging folder would be taken over, also by a request that
    # fetches only a tokenizer file: it clears the variant's staging folder when done.
    for folder in sorted(shard_folders if missing else ()):
        writer = live_marker_writer(folder)
        if writer:
            raise RuntimeError(f"{folder}: another data.download ({writer}) is fetching into this folder (hint: let it "
                               f"finish, then run this command again; if it is gone, remove {DOWNLOAD_MARKER} there)")
    for folder in sorted(shard_folders - folders):
        clear_stale_marker(folder)  # all this request needs is there: a failed earlier request's marker goes
    for folder in sorted(folders):
        expected = sorted(item.local.name for item in plan if item.local.parent == folder)
        writer = {"pid": os.getpid(), "host": socket.gethostname(), "process": process_identity(os.getpid())}
        write_atomic(folder / DOWNLOAD_MARKER,
                     (json.dumps({"command": command, "files": expected, **writer}) + "\n").encode())
    for i, item in missing:
        fetch(repo_id, item, hub[item.remote], staging, retries, verified)
        print(f"[{i}/{len(plan)}] got {item.local} ({hub[item.remote].size:,} bytes)", flush=True)
    for folder in folders:
        (folder / DOWNLOAD_MARKER).unlink(missing_ok=True)
    if missing:  # only a request that fetched used the staging folder (another may be fetching through it now)
        remove_staging(staging)
    return [item.local for item in plan]


def remove_staging(staging: Path) -> None:
    """Removes one request's staging folder, and .staging itself once no other request stages there."""
    shutil.rmtree(staging, ignore_errors=True)
    try:
        staging.parent.rmdir()
    except OSError:  # not empty: another variant's download is using it
        pass


def clear_stale_marker(folder: Path) -> None:
    """Removes the marker of a request that stopped before it had every shard (it outlived a
    later, smaller request that found all it asked for, and refused its shards), but not the marker of a download
    still running on this machine, nor one of another machine, which this one cannot check."""
    marker = folder / DOWNLOAD_MARKER
    writer = live_marker_writer(folder)
    if writer:
        print(f"{folder}: {writer} has its marker here; it stays (remove {DOWNLOAD_MARKER} if no download runs "
              "there)", flush=True)
        return
    marker.unlink(missing_ok=True)


def live_marker_writer(folder: Path) -> str | None:
    """Who wrote the folder's marker, where that download may still run: another live process on this machine, or
    any process on another machine (which this one cannot check). None for no marker, this process's own, one whose
    process is gone, or one unreadable or written before markers named their writer. A live pid whose process is not
    the writer (the marker records the writer's boot and start time where /proc has them) is a pid reused after the
    writer stopped, or after a reboot: its marker is a leftover too."""
    try:
        fields = json.loads((folder / DOWNLOAD_MARKER).read_text())
        pid, host = int(fields["pid"]), str(fields["host"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if host != socket.gethostname():
        return f"a data.download on {host}, pid {pid}"
    if pid == os.getpid() or not _running(pid):
        return None
    recorded, now = fields.get("process"), process_identity(pid)
    if recorded is not None and now is not None and recorded != now:
        return None
    return f"data.download pid {pid}"


def process_identity(pid: int) -> str | None:
    """'boot id:start time' of a live process on Linux: a pid names one process only within a boot and only while it
    runs, the pair names it for good. None where /proc does not tell (another OS, or the process is gone)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        stat = Path(f"/proc/{pid}/stat").read_text()
        start = stat[stat.rindex(")") + 2:].split()[19]  # field 22, counted past the name (which may hold spaces)
    except (OSError, ValueError, IndexError):
        return None
    return f"{boot}:{start}"


def _running(pid: int) -> bool:
    if not 0 < pid < 2**31:  # 0 and -1 would ask about process groups; a damaged marker's number is no process
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", default="sp1024", help="sp1024 (default), sp8192, ...: a SentencePiece set")
    p.add_argument("--train-shards", type=int, default=80, help="training shards of 100M tokens (default 80)")
    p.add_argument("--out", type=Path, default=PACKAGE_DIR, help="destination root (default: the data/ package)")
    p.add_argument("--repo-id", default=REPO_ID, help=f"Hub dataset repo (default {REPO_ID})")
    p.add_argument("--retries", type=int, default=4, help="attempts per file (default 4)")
    a = p.parse_args(argv)
    try:
        import huggingface_hub  # noqa: F401
    except ImportError:
        sys.exit("data.download: needs the huggingface_hub package (pip install huggingface_hub).")
    try:
        hub_files(a.repo_id, [MANIFEST])  # one quick request first: fail fast and plainly when offline
    except Exception as exc:
        sys.exit(f"data.download: cannot reach the Hugging Face Hub for {a.repo_id} ({type(exc).__name__}: "
                 f"{str(exc).splitlines()[0] if str(exc) else 'no details'}); check the network and retry.")
    try:
        paths = download(a.variant, a.train_shards, a.out, a.repo_id, a.retries)
    except (ValueError, RuntimeError) as exc:
        sys.exit(f"data.download: {exc}")
    print(f"ready: {len(paths)} files under {a.out}")


if __name__ == "__main__":
    main()
