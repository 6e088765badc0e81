"""Download planning and fetching, offline: the Hub calls are replaced by fakes."""
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import data.download as dl
from data.shards import HEADER_BYTES, write_shard

ROOT = Path(__file__).resolve().parents[1]
FAKE_MANIFEST = {
    "datasets": [{"name": "fineweb10B_sp1024", "tokenizer_name": "sp_bpe_1024",
                  "stats": {"files_train": 3, "files_val": 2}},
                 {"name": "fineweb10B_sp8192", "tokenizer_name": "sp_bpe_8192", "stats": {}}],
    "tokenizers": [{"name": "sp_bpe_1024", "model_path": "tokenizers/fineweb_1024_bpe.model",
                    "vocab_path": "tokenizers/fineweb_1024_bpe.vocab"}],
}


def test_plan_lists_tokenizer_val_and_requested_train_shards(tmp_path):
    plan = dl.plan_downloads(FAKE_MANIFEST, "sp1024", 2, tmp_path)
    assert [(f.kind, f.remote) for f in plan] == [
        ("tokenizer", "datasets/tokenizers/fineweb_1024_bpe.model"),
        ("tokenizer", "datasets/tokenizers/fineweb_1024_bpe.vocab"),
        ("val", "datasets/datasets/fineweb10B_sp1024/fineweb_val_000000.bin"),
        ("val", "datasets/datasets/fineweb10B_sp1024/fineweb_val_000001.bin"),
        ("train", "datasets/datasets/fineweb10B_sp1024/fineweb_train_000000.bin"),
        ("train", "datasets/datasets/fineweb10B_sp1024/fineweb_train_000001.bin")]
    assert plan[0].local == tmp_path / "tokenizers" / "fineweb_1024_bpe.model"
    assert plan[-1].local == tmp_path / "datasets" / "fineweb10B_sp1024" / "fineweb_train_000001.bin"


@pytest.mark.parametrize("variant, shards, match", [
    ("gpt2", 1, "unknown variant 'gpt2'"),
    ("byte260", 1, "unknown variant 'byte260'; expected sp<VOCAB>"),  # offered once; its tokenizer is JSON
    ("sp4096", 1, "no datasets entry named 'fineweb10B_sp4096' \\(available: fineweb10B_sp1024, fineweb10B_sp8192\\)"),
    ("sp1024", 4, "--train-shards 4: fineweb10B_sp1024 has 3 training shards"),
    ("sp8192", 1, "lacks integer stats.files_train"),
])
def test_plan_errors_say_what_is_wrong(tmp_path, variant, shards, match):
    with pytest.raises(ValueError, match=match):
        dl.plan_downloads(FAKE_MANIFEST, variant, shards, tmp_path)


class FakeHub:
    """Serves FAKE_MANIFEST, valid shards and a tokenizer; can hand out a truncated copy first."""

    def __init__(self, truncate_first=(), fail_always=()):
        self.files = {dl.MANIFEST: json.dumps(FAKE_MANIFEST).encode()}
        for remote in ["datasets/tokenizers/fineweb_1024_bpe.model", "datasets/tokenizers/fineweb_1024_bpe.vocab"]:
            self.files[remote] = b"tokenizer bytes " + remote.encode()
        self.truncate_first, self.fail_always = set(truncate_first), set(fail_always)
        self.calls = []

    def shard(self, remote):
        if remote not in self.files:
            n = 100 + len(self.files)
            tmp = Path(os.environ["PYTEST_TMP"]) / "shard.bin"
            write_shard(tmp, np.arange(n))
            self.files[remote] = tmp.read_bytes()
        return self.files[remote]

    def info(self, repo_id, remotes):
        """As the Hub's paths-info: LFS files (shards, tokenizers) carry a sha256, the small manifest a git blob id."""
        assert repo_id == self.repo_id
        found = {}
        for r in remotes:
            data = self.shard(r) if r.endswith(".bin") else self.files[r]
            if r == dl.MANIFEST:
                found[r] = dl.HubFile(len(data), git_oid=hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest())
            else:
                found[r] = dl.HubFile(len(data), sha256=hashlib.sha256(data).hexdigest())
        return found

    def download(self, repo_id, remote, staging):
        self.calls.append(remote)
        if remote in self.fail_always:
            raise ConnectionError("connection reset")
        data = self.shard(remote) if remote.endswith(".bin") else self.files[remote]
        if remote in self.truncate_first:
            self.truncate_first.discard(remote)
            data = data[:HEADER_BYTES + 3]
        path = staging / remote
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return path


@pytest.fixture
def hub(monkeypatch, tmp_path):
    monkeypatch.setenv("PYTEST_TMP", str(tmp_path))
    fake = FakeHub()
    fake.repo_id = dl.REPO_ID
    monkeypatch.setattr(dl, "hub_files", fake.info)
    monkeypatch.setattr(dl, "hub_download", fake.download)
    monkeypatch.setattr(dl.time, "sleep", lambda s: None)
    return fake


def test_download_places_verifies_and_resumes(hub, tmp_path):
    out = tmp_path / "data"
    val = "datasets/datasets/fineweb10B_sp1024/fineweb_val_000001.bin"
    hub.truncate_first = {val}
    paths = dl.download("sp1024", 1, out, retries=2)
    assert hub.calls.count(val) == 2  # the truncated copy was caught by its size and fetched again
    assert (out / "datasets" / "manifest.json").is_file() and (out / "tokenizers" / "fineweb_1024_bpe.model").is_file()
    assert sorted(p.name for p in (out / "datasets" / "fineweb10B_sp1024").iterdir()) == [
        "fineweb_train_000000.bin", "fineweb_val_000000.bin", "fineweb_val_000001.bin"]
    assert all(p.is_file() for p in paths) and not (out / "datasets" / ".staging").exists()
    hub.calls.clear()
    dl.download("sp1024", 2, out, retries=2)  # a rerun fetches only what is missing
    assert hub.calls == ["datasets/datasets/fineweb10B_sp1024/fineweb_train_000001.bin"]
    (out / "tokenizers" / "fineweb_1024_bpe.vocab").write_bytes(b"damaged")
    hub.calls.clear()
    dl.download("sp1024", 2, out, retries=1)
    assert hub.calls == ["datasets/tokenizers/fineweb_1024_bpe.vocab"]


def test_a_damaged_file_of_the_right_size_is_fetched_again_and_good_files_are_not_reread(hub, tmp_path,
                                                                                        monkeypatch):
    """Only sizes and headers were checked: a shard with a damaged body, or a tokenizer overwritten with as many
    bytes, counted as present."""
    out = tmp_path / "data"
    dl.download("sp1024", 1, out, retries=1)
    shard = out / "datasets" / "fineweb10B_sp1024" / "fineweb_train_000000.bin"
    body = bytearray(shard.read_bytes())
    body[-4:] = b"\xff\xff\xff\xff"
    shard.write_bytes(bytes(body))
    tokenizer = out / "tokenizers" / "fineweb_1024_bpe.model"
    tokenizer.write_bytes(b"X" * tokenizer.stat().st_size)
    hub.calls.clear()
    dl.download("sp1024", 1, out, retries=1)
    assert sorted(hub.calls) == ["datasets/datasets/fineweb10B_sp1024/fineweb_train_000000.bin",
                                 "datasets/tokenizers/fineweb_1024_bpe.model"]
    assert tokenizer.read_bytes().startswith(b"tokenizer bytes")
    hashed = []
    real = dl.HubFile.digest_of
    monkeypatch.setattr(dl.HubFile, "digest_of", lambda self, path: hashed.append(path.name) or real(self, path))
    hub.calls.clear()
    dl.download("sp1024", 1, out, retries=1)  # everything verified before and unchanged: nothing read again
    assert hub.calls == [] and hashed == []
    (out / "datasets" / ".verified.json").write_text("{broken")  # a damaged cache costs a re-read, nothing else
    dl.download("sp1024", 1, out, retries=1)
    assert hub.calls == [] and len(hashed) == 6  # the manifest and the five files


def test_persistent_failure_is_reported_after_retries(hub, tmp_path):
    bad = "datasets/datasets/fineweb10B_sp1024/fineweb_val_000000.bin"
    hub.fail_always = {bad}
    with pytest.raises(RuntimeError, match="could not download .*fineweb_val_000000.bin after 3 attempts"):
        dl.download("sp1024", 0, tmp_path, retries=3)
    assert hub.calls.count(bad) == 3
    assert not (tmp_path / "datasets" / "fineweb10B_sp1024" / "fineweb_val_000000.bin").exists()


def test_cli_flags(hub, tmp_path, capsys):
    hub.repo_id = "someone/mirror"
    dl.main(["--variant", "sp1024", "--train-shards", "1", "--out", str(tmp_path), "--repo-id", "someone/mirror",
             "--retries", "1"])
    assert "ready: 5 files" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--retries must be >= 1"):
        dl.main(["--out", str(tmp_path), "--repo-id", "someone/mirror", "--retries", "0"])
    with pytest.raises(SystemExit, match="has 3 training shards"):
        dl.main(["--out", str(tmp_path), "--repo-id", "someone/mirror"])  # default 80 shards


def test_no_network_exits_with_one_clear_sentence(tmp_path):
    pytest.importorskip("huggingface_hub")
    env = dict(os.environ, HF_ENDPOINT="http://127.0.0.1:9")  # nothing listens there: fails at once
    out = subprocess.run([sys.executable, "-m", "data.download", "--train-shards", "1", "--out", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("data.download: cannot reach the Hugging Face Hub"), out.stderr
    assert not list(tmp_path.iterdir())


def test_a_manifest_that_is_not_json_is_named_with_a_hint(hub, tmp_path):
    hub.files[dl.MANIFEST] = b"{broken"
    with pytest.raises(ValueError, match=r"datasets/manifest.json: not valid JSON .*delete it and run the download"):
        dl.download("sp1024", 0, tmp_path, retries=1)


def test_a_pattern_that_an_unfinished_download_leaves_short_is_refused_until_it_finishes(hub, tmp_path):
    """A failed download left some shards in place, and a glob matched them: training used part of the set with no
    word (a leftover of an interrupted download). The folder now carries a marker with the command and the shards it expects; a
    pattern that matches a missing one is refused, others (the complete validation shards) pass."""
    from data.shards import DOWNLOAD_MARKER, ShardError, list_shards
    out = tmp_path / "my data"
    hub.fail_always = {"datasets/datasets/fineweb10B_sp1024/fineweb_train_000001.bin"}
    with pytest.raises(RuntimeError, match="could not download"):
        dl.download("sp1024", 2, out, retries=1)
    folder = out / "datasets" / "fineweb10B_sp1024"
    assert (folder / "fineweb_train_000000.bin").is_file() and (folder / DOWNLOAD_MARKER).is_file()
    with pytest.raises(ShardError, match=r"has not finished fetching this folder \(1 of the shards "
                                         r"'fineweb_train_\*.bin' matches, e.g. fineweb_train_000001.bin\).*run "
                                         r"`python -m data.download --variant sp1024 --train-shards 2 --out '.*my "
                                         r"data' --repo-id"):
        list_shards(str(folder / "fineweb_train_*.bin"))
    assert len(list_shards(str(folder / "fineweb_val_*.bin"))) == 2  # complete: scoring may go on
    assert len(list_shards(str(folder / "fineweb_train_000000.bin"))) == 1  # a prefix chosen on purpose
    hub.fail_always = set()
    dl.download("sp1024", 2, out, retries=1)  # the rerun resumes and clears the marker
    assert not (folder / DOWNLOAD_MARKER).exists() and len(list_shards(str(folder / "fineweb_train_*.bin"))) == 2
    (folder / DOWNLOAD_MARKER).write_text("garbage")  # unreadable: the folder is in doubt
    with pytest.raises(ShardError, match=r"has not finished fetching this folder: the pattern would read part"):
        list_shards(str(folder / "fineweb_val_*.bin"))
    # A larger request that failed, then a smaller one that finds all it asks for in place: the smaller one's
    # success clears the larger one's marker (it stayed and refused the shards)
    hub.fail_always = {"datasets/datasets/fineweb10B_sp1024/fineweb_train_000002.bin"}
    with pytest.raises(RuntimeError, match="could not download"):
        dl.download("sp1024", 3, out, retries=1)
    dl.download("sp1024", 2, out, retries=1)
    assert not (folder / DOWNLOAD_MARKER).exists() and len(list_shards(str(folder / "fineweb_train_*.bin"))) == 2


def test_a_download_clears_its_own_staging_folder_not_another_variants(hub, tmp_path):
    """Two downloads of different variants into one --out may run at once (their shard folders differ): the one
    that finishes first removes its staging folder, not the partial files the other is still fetching."""
    out = tmp_path / "d"
    other = out / "datasets" / ".staging" / "sp8192" / "datasets" / "datasets" / "fineweb10B_sp8192"
    other.mkdir(parents=True)
    (other / "fineweb_train_000003.bin.incomplete").write_bytes(b"partial")
    manifest = out / "datasets" / ".staging" / ".manifest-1" / "datasets"  # another request's manifest, half there
    manifest.mkdir(parents=True)
    (manifest / "manifest.json.incomplete").write_bytes(b"{")
    dl.download("sp1024", 1, out, retries=1)  # fetches the manifest, the shards and the tokenizer
    assert (other / "fineweb_train_000003.bin.incomplete").read_bytes() == b"partial"
    assert (manifest / "manifest.json.incomplete").read_bytes() == b"{"
    assert not (out / "datasets" / ".staging" / "sp1024").exists()
    assert hub.calls and all(c.startswith("datasets/") for c in hub.calls)


@pytest.fixture
def downloaded(hub, tmp_path):
    """Two shards of sp1024 in place: (the --out folder, the shard folder, its marker's path)."""
    from data.shards import DOWNLOAD_MARKER
    out = tmp_path / "d"
    dl.download("sp1024", 2, out, retries=1)
    folder = out / "datasets" / "fineweb10B_sp1024"
    return out, folder, folder / DOWNLOAD_MARKER


@pytest.fixture
def live_process():
    """Another live process on this machine (it stands for a download still running)."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield process
    process.kill()
    process.wait()


def test_a_marker_of_a_download_still_running_or_of_another_machine_stays(downloaded, live_process, capsys):
    """A request that finds all it needs clears a stopped request's marker, but not that of a download still
    fetching on this machine (its glob would read a partial set), nor one it cannot check (another machine)."""
    import socket
    out, folder, marker = downloaded
    fetching = live_process
    for host in (socket.gethostname(), "elsewhere"):
        marker.write_text(json.dumps({"command": "c", "files": [], "pid": fetching.pid, "host": host}))
        dl.download("sp1024", 2, out, retries=1)
        assert marker.exists(), host
    assert "a data.download on elsewhere, pid" in capsys.readouterr().out
    # this process's pid on another machine (containers reuse small pids) is not this process
    marker.write_text(json.dumps({"command": "c", "files": [], "pid": os.getpid(), "host": "elsewhere"}))
    dl.download("sp1024", 2, out, retries=1)
    assert marker.exists()
    # a request that has shards to fetch does not take over a live download's marker and staging folder
    (folder / "fineweb_train_000001.bin").unlink()
    marker.write_text(json.dumps({"command": "c", "files": [], "pid": fetching.pid, "host": socket.gethostname()}))
    with pytest.raises(RuntimeError, match=rf"another data.download \(data.download pid {fetching.pid}\) is "
                                           r"fetching into this folder \(hint: let it finish"):
        dl.download("sp1024", 2, out, retries=1)
    # nor does one that fetches only a tokenizer file (it clears the variant's staging folder when done)
    dl.download("sp1024", 1, out, retries=1)
    next((out / "tokenizers").glob("*.vocab")).unlink()
    with pytest.raises(RuntimeError, match=rf"another data.download \(data.download pid {fetching.pid}\)"):
        dl.download("sp1024", 1, out, retries=1)
    fetching.kill()  # the other download stops: its marker is a leftover now
    fetching.wait()
    for pid in (0, -1, 2**40):  # a damaged marker's number is no live process
        marker.write_text(json.dumps({"command": "c", "files": [], "pid": pid, "host": socket.gethostname()}))
        assert dl.live_marker_writer(folder) is None
    marker.write_text(json.dumps({"command": "c", "files": [], "pid": fetching.pid, "host": socket.gethostname()}))
    dl.download("sp1024", 2, out, retries=1)  # its writer is gone: a stopped request's leftover
    assert not marker.exists()


@pytest.mark.skipif(dl.process_identity(os.getpid()) is None, reason="needs Linux's /proc (boot id, start times)")
def test_a_marker_whose_pid_now_names_another_process_is_a_leftover(downloaded, live_process, monkeypatch):
    """A download that stopped leaves its marker; after a reboot, or once the pid is reused, a live process holds the
    marker's pid. The marker records its writer's boot id and start time, so that process is not taken for the
    writer; a marker of the live writer itself stays, and one written before markers recorded it is kept."""
    import socket
    out, folder, marker = downloaded
    writer = {"command": "c", "files": [], "pid": live_process.pid, "host": socket.gethostname()}
    identity = dl.process_identity(live_process.pid)
    assert identity is not None and identity != dl.process_identity(os.getpid())
    for process, stays in ((identity, True), (None, True), ("another-boot:12345", False),
                           (identity.split(":")[0] + ":1", False)):
        marker.write_text(json.dumps({**writer, "process": process}))
        dl.download("sp1024", 2, out, retries=1)
        assert marker.exists() == stays, process
    (folder / "fineweb_train_000001.bin").unlink()  # a request that fetches records its own process
    seen, real_fetch = {}, dl.fetch

    def fetch_and_look(*args, **kwargs):
        seen.update(json.loads(marker.read_text()))
        return real_fetch(*args, **kwargs)
    monkeypatch.setattr(dl, "fetch", fetch_and_look)
    dl.download("sp1024", 2, out, retries=1)
    assert seen["pid"] == os.getpid() and seen["process"] == dl.process_identity(os.getpid())
    assert not marker.exists()
