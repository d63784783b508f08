"""hf_snapshot against the local Hub with the real huggingface_hub (plain HTTP, no xet).

Every test runs the module exactly as Ansible does on a host (tests.support.modules.run_module, or
a subprocess of the same command when the test must watch or kill it) and checks the outcome on
disk and in the Hub's request log. Models here are a few KB to a few MB.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.support.modules import REPO, run_module
from tests.support.synthetic_cache import MB
from tests.support.synthetic_cache import incompressible as blob
from tests.support.waiting import wait_for

pytestmark = pytest.mark.hub


FILES = {
    "config.json": b'{"architectures": ["LlamaForCausalLM"], "hidden_size": 128}\n',
    "tokenizer.json": b'{"model": {"vocab": {}}}\n' * 200,
    "model-00001-of-00002.safetensors": blob("a", 3 * MB),
    "model-00002-of-00002.safetensors": blob("b", 2 * MB + 123),
    "sub/generation_config.json": b'{"do_sample": false}\n',
}
TOTAL = sum(len(v) for v in FILES.values())


@pytest.fixture(scope="module")
def models(_local_hub_server):
    hub = _local_hub_server
    return {
        "main": hub.publish("org/tiny", FILES),
        "gated": hub.publish("org/gated", {"config.json": b"{}\n", "w.safetensors": blob("g", 200_000)}, gated=True),
        "big": hub.publish("org/big", {"config.json": b"{}\n", "a.safetensors": blob("x", 12 * MB),
                                       "b.safetensors": blob("y", 12 * MB)}),
        "two": hub.publish("org/two", {"config.json": b"{}\n", "small.safetensors": blob("s", 4 * MB),
                                       "large.safetensors": blob("l", 8 * MB)}),
        "progress": hub.publish("org/progress", {"config.json": b"{}\n", "w.safetensors": blob("p", 8 * MB)}),
    }


@pytest.fixture
def snap(local_hub, hf_env, tmp_path):
    """run(args) -> result of hf_snapshot with the Hub's endpoint and test-friendly retries."""
    def run(args=None, *, check_mode=False, diff=False, **kw):
        full = {"repo_id": "org/tiny", "endpoint": local_hub.url, "use_xet": False, "retry_delay": 0.05,
                "cache_dir": str(tmp_path / "cache")}
        full.update(args or {})
        full.update(kw)
        if full.get("local_dir"):
            full.pop("cache_dir", None)
        return run_module("hf_snapshot", full, check_mode=check_mode, diff=diff, env=hf_env)
    return run


def resolves(hub, method=None, name=None):
    out = [r for r in hub.requests() if "/resolve/" in r["path"]]
    if method:
        out = [r for r in out if r["method"] == method]
    if name:
        out = [r for r in out if r["path"].endswith("/" + name)]
    return out


def tree_files(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and ".cache" not in p.relative_to(root).parts}


def incompletes(root: Path) -> list:
    return sorted(str(p) for p in root.rglob("*.incomplete"))


def module_cmd(args: dict, workdir: Path, check_mode: bool = False):
    """argv to run hf_snapshot as Ansible would, as a process the test controls."""
    args_file = workdir / f"args-{time.monotonic_ns()}.json"
    module_args = dict(args, _ansible_check_mode=check_mode, _ansible_diff=False)
    args_file.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": module_args}))
    return [sys.executable, str(REPO / "plugins" / "modules" / "hf_snapshot.py"), str(args_file)]


def module_env(hf_env):
    env = dict(os.environ, **hf_env)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / ".collections"), env.get("PYTHONPATH", "")])
    return env


# ------------------------------------------------------------------------------------------ success
def test_fresh_download_into_cache_verified_then_noop_without_requests(snap, local_hub, models, tmp_path):
    r = snap(revision="main")
    assert r.get("failed") is not True, r.get("msg")
    assert r["changed"] is True
    assert r["commit"] == models["main"]
    snapshot = tmp_path / "cache" / "models--org--tiny" / "snapshots" / models["main"]
    assert r["snapshot_path"] == str(snapshot)
    assert tree_files(snapshot) == FILES
    assert (r["files"], r["bytes_total"], r["files_downloaded"]) == (5, TOTAL, 5)
    assert r["bytes_downloaded"] == r["bytes_received"] == TOTAL
    v = r["verification"]
    assert v["ok"] and v["mode"] == "full" and v["files"] == 5 and v["hashed_bytes"] == TOTAL
    manifest = json.loads(Path(r["manifest"]).read_text())
    assert manifest["commit"] == models["main"] and sorted(manifest["files"]) == sorted(FILES)
    sha = hashlib.sha256(FILES["model-00001-of-00002.safetensors"]).hexdigest()
    assert manifest["files"]["model-00001-of-00002.safetensors"]["digest"] == sha
    # the ref and huggingface_hub's tree cache are written as snapshot_download would
    repo = tmp_path / "cache" / "models--org--tiny"
    assert (repo / "refs" / "main").read_text() == models["main"]
    assert json.loads((repo / "trees" / f"{models['main']}.json").read_text())["format_version"] == 1

    local_hub.clear_log()
    again = snap(revision=models["main"])
    assert again["changed"] is False and again["files_downloaded"] == 0
    assert again["verification"]["source"] == "manifest"
    assert local_hub.requests() == []            # a pinned commit: no request at all

    local_hub.clear_log()
    by_branch = snap(revision="main")
    assert by_branch["changed"] is False
    assert [r["method"] for r in local_hub.requests()] == ["GET"]   # only the revision lookup
    assert "/resolve/" not in local_hub.requests()[0]["path"]

    local_hub.clear_log()
    checked = snap(revision=models["main"], check_mode=True)
    assert checked["changed"] is False and checked["would_fetch"]["files"] == []
    assert local_hub.requests() == []


def test_fresh_download_into_local_dir_then_noop(snap, local_hub, models, tmp_path):
    target = tmp_path / "models" / "tiny"
    r = snap(revision=models["main"], local_dir=str(target))
    assert r.get("failed") is not True, r.get("msg")
    assert r["changed"] is True and r["layout"] == "local_dir" and r["snapshot_path"] == str(target)
    assert tree_files(target) == FILES
    assert Path(r["manifest"]).parent == target / ".cache" / "huggingface" / "modelswap"
    local_hub.clear_log()
    again = snap(revision=models["main"], local_dir=str(target))
    assert again["changed"] is False
    assert local_hub.requests() == []
    assert incompletes(target) == []


def test_local_dir_reports_files_the_new_commit_does_not_have(snap, local_hub, tmp_path):
    target = tmp_path / "models" / "shrinking"
    first = local_hub.publish("org/shrinking", {"config.json": b"{}\n", "old.safetensors": b"o" * 1000})
    assert snap(repo_id="org/shrinking", revision=first, local_dir=str(target))["changed"] is True
    second = local_hub.publish("org/shrinking", {"config.json": b'{"v": 2}\n'})
    r = snap(repo_id="org/shrinking", revision=second, local_dir=str(target))
    assert r["changed"] is True and r["extra_files"] == ["old.safetensors"]
    assert "old.safetensors" in json.dumps(r["warnings"])
    manifests = sorted(p.name for p in (target / ".cache" / "huggingface" / "modelswap").iterdir())
    assert manifests == [second + ".json"]     # one commit lives in a local_dir


def test_check_mode_downloads_and_writes_nothing(snap, local_hub, models, tmp_path):
    r = snap(revision="main", check_mode=True, diff=True, progress_file=str(tmp_path / "state" / "p.json"),
             record=str(tmp_path / "state" / "record.json"), record_name="tiny")
    assert r.get("failed") is not True, r.get("msg")
    assert r["changed"] is True
    assert r["commit"] == models["main"]
    assert sorted(r["would_fetch"]["files"]) == sorted(FILES)
    assert r["would_fetch"]["bytes"] == TOTAL
    assert "model-00001-of-00002.safetensors" in r["diff"]["after"]
    assert resolves(local_hub, "GET") == []                     # no file content moved
    assert len(resolves(local_hub, "HEAD")) == 1                 # one access probe
    assert not (tmp_path / "cache").exists()                     # nothing written
    assert not (tmp_path / "state").exists()
    assert r["record"]["changed"] is True


def test_only_the_changed_file_of_a_new_commit_is_downloaded(snap, local_hub, tmp_path):
    first = local_hub.publish("org/evolving", {"config.json": b'{"v": 1}\n', "w.safetensors": blob("e", 2 * MB)})
    r1 = snap(repo_id="org/evolving", revision=first)
    assert r1["changed"] is True
    second = local_hub.publish("org/evolving", {"config.json": b'{"v": 2}\n', "w.safetensors": blob("e", 2 * MB)})
    local_hub.clear_log()
    r2 = snap(repo_id="org/evolving", revision=second)
    assert r2["changed"] is True and r2["commit"] == second
    assert r2["files_downloaded"] == 2 and r2["bytes_downloaded"] == len(b'{"v": 2}\n')
    assert [x["path"].rsplit("/", 1)[1] for x in resolves(local_hub, "GET")] == ["config.json"]


def test_patterns_select_files_and_a_pattern_matching_nothing_fails(snap, local_hub, models, tmp_path):
    r = snap(revision=models["main"], allow_patterns=["*.json"], ignore_patterns=["tokenizer*"])
    assert r["changed"] is True
    assert sorted(tree_files(Path(r["snapshot_path"]))) == ["config.json", "sub/generation_config.json"]
    everything = snap(revision=models["main"])          # only the rest is fetched
    assert everything["changed"] is True and everything["files_downloaded"] == 3
    assert sorted(json.loads(Path(everything["manifest"]).read_text())["files"]) == sorted(FILES)
    local_hub.clear_log()
    assert snap(revision=models["main"], allow_patterns=["*.json"])["changed"] is False
    assert local_hub.requests() == []
    bad = snap(revision=models["main"], allow_patterns=["*.gguf"], cache_dir=str(tmp_path / "c2"))
    assert bad["failed"] is True and bad["cause"] == "no_match"
    assert "*.gguf" in bad["msg"] and "match none of the 5 files" in bad["msg"] and "fix the patterns" in bad["msg"]
    assert not (tmp_path / "c2" / "models--org--tiny" / "snapshots").exists()


# ------------------------------------------------------------------------------------------ kill, resume
def test_killed_download_leaves_orphans_that_the_rerun_removes(local_hub, hf_env, models, tmp_path):
    cache = tmp_path / "cache"
    args = {"repo_id": "org/big", "revision": models["big"], "endpoint": local_hub.url, "use_xet": False,
            "cache_dir": str(cache), "retry_delay": 0.05}
    local_hub.fault("throttle", rate=2 * MB, method="GET", endpoint="resolve", count=None)
    proc = subprocess.Popen(module_cmd(args, tmp_path), env=module_env(hf_env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        blobs = cache / "models--org--big" / "blobs"
        wait_for(lambda: any(p.stat().st_size > MB for p in blobs.glob("*.incomplete")) if blobs.is_dir() else False,
                 timeout=30, interval=0.05, what="a partial file over 1 MiB")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        proc.stdout.close()
        proc.stderr.close()
    local_hub.clear_faults()
    orphans = incompletes(cache)
    assert orphans, "a killed huggingface_hub download leaves its partial files"
    orphan_bytes = sum(Path(p).stat().st_size for p in orphans)

    r = run_module("hf_snapshot", args, env=hf_env)
    assert r.get("failed") is not True, r.get("msg")
    assert r["changed"] is True and r["verification"]["ok"]
    assert sorted(o["path"] for o in r["orphans_removed"]) == orphans
    assert incompletes(cache) == []
    # disk use equals the model: the blobs are exactly its three files; besides them only small
    # metadata (refs, the tree listing, the manifest) and the snapshot's symlinks
    repo = cache / "models--org--big"
    blob_sizes = sorted(p.stat().st_size for p in (repo / "blobs").iterdir())
    assert blob_sizes == sorted([3, 12 * MB, 12 * MB])
    data = sum(p.lstat().st_size for p in repo.rglob("*") if p.is_file() and not p.is_symlink()
               and p.relative_to(repo).parts[0] == "blobs")
    assert data == 24 * MB + 3
    other = sum(p.lstat().st_size for p in repo.rglob("*") if p.is_file() and not p.is_symlink()
                and p.relative_to(repo).parts[0] != "blobs")
    assert other < 64 * 1024
    assert orphan_bytes > MB


# ------------------------------------------------------------------------------------------ corruption
def test_flipped_byte_is_detected_and_fetched_once_more(snap, local_hub, models):
    name = "model-00001-of-00002.safetensors"
    local_hub.fault("flip_byte", method="GET", file=name, offset=1234567)
    r = snap(revision=models["main"])
    assert r.get("failed") is not True, r.get("msg")
    assert [x["path"] for x in r["verification"]["refetched"]] == [name]
    assert "sha256" in r["verification"]["refetched"][0]["reason"]
    assert len(resolves(local_hub, "GET", name)) == 2
    assert Path(r["snapshot_path"], name).read_bytes() == FILES[name]


def test_persistent_corruption_fails_naming_the_file_and_leaves_nothing_verified(snap, local_hub, models, tmp_path):
    name = "tokenizer.json"
    local_hub.fault("flip_byte", method="GET", file=name, count=None)
    r = snap(revision=models["main"])
    assert r["failed"] is True and r["cause"] == "corrupt"
    assert name in r["msg"] and "failed after a fresh download" in r["msg"] and "deleted" in r["msg"]
    assert len(resolves(local_hub, "GET", name)) == 2            # fetched once more, then given up
    repo = tmp_path / "cache" / "models--org--tiny"
    assert not (repo / "snapshots" / models["main"] / name).exists()
    sha1 = hashlib.sha1(b"blob %d\0" % len(FILES[name]) + FILES[name]).hexdigest()
    assert not (repo / "blobs" / sha1).exists()
    assert not (repo / "modelswap").exists()                     # no manifest: nothing claims completeness
    assert r["verify_failures"][0]["path"] == name
    # huggingface_hub itself no longer finds the file in the cache
    code = ("import sys; from huggingface_hub import try_to_load_from_cache as t; "
            "print(t('org/tiny', sys.argv[1], cache_dir=sys.argv[2], revision=sys.argv[3]))")
    out = subprocess.run([sys.executable, "-c", code, name, str(tmp_path / "cache"), models["main"]],
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == "None"


def test_wrong_etag_is_caught_and_refetched(snap, local_hub, models):
    name = "model-00002-of-00002.safetensors"
    local_hub.fault("wrong_etag", method="HEAD", file=name)
    r = snap(revision=models["main"])
    assert r.get("failed") is not True, r.get("msg")
    assert [x["path"] for x in r["verification"]["refetched"]] == [name]
    assert "wrong ETag" in r["verification"]["refetched"][0]["reason"]
    sha = hashlib.sha256(FILES[name]).hexdigest()
    assert os.readlink(Path(r["snapshot_path"], name)).endswith("/" + sha)


def test_reverify_offline_finds_silent_disk_corruption(snap, local_hub, models, tmp_path):
    r = snap(revision=models["main"])
    assert r["changed"] is True
    name = "model-00001-of-00002.safetensors"
    path = Path(r["snapshot_path"], name).resolve()
    st = path.stat()
    with open(path, "r+b") as fh:          # bit rot: same size, same mtime
        fh.seek(100)
        byte = fh.read(1)
        fh.seek(100)
        fh.write(bytes([byte[0] ^ 1]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    local_hub.clear_log()
    assert snap(revision=models["main"])["changed"] is False     # a stat cannot see it ...
    intact = snap(revision=models["main"], offline=True, reverify=True, allow_patterns=["*.json"])
    assert intact["changed"] is False and intact["verification"]["files"] == 3
    bad = snap(revision=models["main"], offline=True, reverify=True)   # ... hashing does, offline
    assert bad["failed"] is True and bad["cause"] == "offline", bad["msg"]
    assert name in bad["msg"] and "network" in bad["msg"] and "deleted" in bad["msg"]
    assert local_hub.requests() == []
    assert not path.exists() and not Path(r["snapshot_path"], name).exists()   # not left as if verified
    fixed = snap(revision=models["main"])                              # online: fetched again
    assert fixed["changed"] is True and fixed["files_downloaded"] == 1
    assert Path(fixed["snapshot_path"], name).read_bytes() == FILES[name]


def test_a_touched_file_is_verified_again_without_download(snap, local_hub, models):
    r = snap(revision=models["main"])
    os.utime(Path(r["snapshot_path"], "config.json").resolve())
    local_hub.clear_log()
    again = snap(revision=models["main"])
    assert again["changed"] is True
    assert again["files_downloaded"] == 0 and again["verification"]["files"] == 1
    assert local_hub.requests() == []


# ------------------------------------------------------------------------------------------ network faults
def test_connection_cut_is_resumed(snap, local_hub, models):
    # huggingface_hub resumes from the last whole chunk it received (hf_snapshot's chunks: 1 MiB)
    name = "model-00001-of-00002.safetensors"
    local_hub.fault("cut", method="GET", file=name, after=MB + MB // 2)
    r = snap(revision=models["main"])
    assert r.get("failed") is not True, r.get("msg")
    gets = resolves(local_hub, "GET", name)
    assert len(gets) == 2 and gets[1]["range"] == "bytes=%d-" % MB
    assert Path(r["snapshot_path"], name).read_bytes() == FILES[name]
    assert r["verification"]["ok"] and r["verification"]["refetched"] == []
    assert any("resume" in m for m in r["library_messages"])


def test_5xx_bursts_are_retried(snap, local_hub, models):
    local_hub.fault("http_error", status=503, method="GET", endpoint="resolve", count=4)
    local_hub.fault("http_error", status=502, endpoint="tree", count=1)
    local_hub.fault("http_error", status=500, endpoint="revision", count=2)
    r = snap(revision="main")
    assert r.get("failed") is not True, r.get("msg")
    assert r["changed"] is True and r["verification"]["ok"]
    assert tree_files(Path(r["snapshot_path"])) == FILES
    assert any("retry" in m for m in r["library_messages"])


@pytest.mark.parametrize("fault, revision", [
    ({"kind": "http_error", "status": 503, "endpoint": "revision"}, "main"),
    ({"kind": "http_error", "status": 503, "method": "GET", "endpoint": "resolve"}, None),
])
def test_permanent_outage_is_a_clear_error(snap, local_hub, models, tmp_path, fault, revision):
    local_hub.fault(count=None, **fault)
    started = time.monotonic()
    r = snap(revision=revision or models["main"], retries=2)
    assert r["failed"] is True and r["cause"] == "hub_unavailable"
    assert "HTTP 503" in r["msg"] and "gave up after 3 attempts" in r["msg"] and local_hub.url in r["msg"]
    assert "retry later" in r["msg"]
    assert time.monotonic() - started < 60
    assert not list((tmp_path / "cache").rglob("modelswap/*.json"))


def test_unreachable_hub_is_a_clear_error(snap, tmp_path):
    r = snap(revision="main", endpoint="http://127.0.0.1:9", retries=1)
    assert r["failed"] is True and r["cause"] == "unreachable"
    assert "cannot reach the Hub at http://127.0.0.1:9" in r["msg"] and "check the endpoint" in r["msg"]


# ------------------------------------------------------------------------------------------ disk
@contextlib.contextmanager
def tmpfs(size_mb: int, *, readonly: bool = False):
    if os.geteuid() != 0:
        pytest.skip("mounting a test file system needs root")
    mnt = Path(tempfile.mkdtemp(prefix="hfs-tmpfs-"))
    opts = f"size={size_mb}m,mode=0755" + (",ro" if readonly else "")
    subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "hfs-test", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
        with contextlib.suppress(OSError):
            mnt.rmdir()


def test_disk_too_small_fails_before_downloading(snap, local_hub, models):
    with tmpfs(20) as mnt:
        r = snap(repo_id="org/big", revision=models["big"], cache_dir=str(mnt / "hub"))
        assert r["failed"] is True and r["cause"] == "disk_full"
        assert "not enough space" in r["msg"] and "nothing was downloaded" in r["msg"]
        assert "model_purge" in r["msg"]
        assert resolves(local_hub, "GET") == []
        assert not list(mnt.rglob("modelswap/*.json")) and incompletes(mnt) == []


def test_disk_filling_up_mid_download_is_a_clear_error(snap, local_hub, hf_env, models, tmp_path):
    with tmpfs(20) as mnt:
        cache = mnt / "hub"
        args = {"repo_id": "org/two", "revision": models["two"], "endpoint": local_hub.url, "use_xet": False,
                "cache_dir": str(cache), "retry_delay": 0.05, "retries": 1}
        local_hub.fault("throttle", rate=1 * MB, method="GET", file="large.safetensors")
        proc = subprocess.Popen(module_cmd(args, tmp_path), env=module_env(hf_env), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        try:
            blobs = cache / "models--org--two" / "blobs"
            large = hashlib.sha256(blob("l", 8 * MB)).hexdigest()
            wait_for(lambda: blobs.is_dir() and any(blobs.glob(large + ".*.incomplete")),
                     timeout=30, interval=0.05, what="the large file's partial download")
            # someone else fills the disk meanwhile
            with open(mnt / "ballast", "wb") as fh:
                with contextlib.suppress(OSError):
                    while True:
                        fh.write(b"\0" * MB)
                        fh.flush()
            out, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        r = json.loads(out)
        assert r["failed"] is True and r["cause"] == "disk_full", r["msg"]
        assert "disk is full" in r["msg"] and str(cache) in r["msg"] and "model_purge" in r["msg"]
        assert not list(mnt.rglob("modelswap/*.json"))
        assert incompletes(mnt) == []
        snapshot = cache / "models--org--two" / "snapshots" / models["two"]
        assert not (snapshot / "large.safetensors").exists()


def test_non_writable_destination_is_a_clear_error(snap, local_hub, models):
    with tmpfs(4, readonly=True) as mnt:
        for check_mode in (True, False):
            r = snap(revision=models["main"], cache_dir=str(mnt / "hub"), check_mode=check_mode)
            assert r["failed"] is True and r["cause"] == "not_writable", r
            assert str(mnt) in r["msg"] and "writable" in r["msg"]
        # (a killed download of an earlier test may still be draining on the server: only this repo counts)
        assert [r for r in resolves(local_hub, "GET") if r["path"].startswith("/org/tiny/")] == []


# ------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("args, cause, words", [
    ({"repo_id": "org/missing", "revision": "main"}, "repo_not_found",
     ["org/missing", "was not found", "fix the repo id"]),
    ({"revision": "no-such-branch"}, "revision_not_found", ["'no-such-branch'", "was not found", "pin an existing"]),
    ({"revision": "0" * 40}, "revision_not_found", ["0" * 40, "was not found", "pin an existing"]),
    ({"repo_id": "org/gated", "revision": "main"}, "gated", ["org/gated is a gated repository", "no token was given",
                                                             "pass that account's token"]),
    ({"repo_id": "org//bad--id"}, "bad_repo_id", ["'org//bad--id' is malformed", "fix repo_id"]),
    ({"repo_id": "org/tiny", "token": "hf_not_a_valid_token", "http_endpoint_trusted": True}, "unauthorized",
     ["refused the credentials (HTTP 401)", "fix or renew the token"]),
])
def test_bad_input_fails_naming_cause_and_fix(snap, local_hub, models, tmp_path, args, cause, words):
    r = snap(args)
    assert r["failed"] is True and r["cause"] == cause, r["msg"]
    for word in words:
        assert word in r["msg"]
    assert r["msg"].startswith("hf_snapshot: ")
    assert not list((tmp_path / "cache").rglob("modelswap/*.json"))


def test_token_is_used_and_never_appears_in_output_or_files(local_hub, hf_env, models, tmp_path):
    token = local_hub.token
    record = tmp_path / "state" / "deployment.json"
    progress = tmp_path / "state" / "progress.json"
    base = {"repo_id": "org/gated", "revision": "main", "endpoint": local_hub.url, "use_xet": False,
            "cache_dir": str(tmp_path / "cache"), "token": token, "progress_file": str(progress),
            "record": str(record), "record_name": "gated", "retry_delay": 0.05, "http_endpoint_trusted": True}
    outputs = []
    for args, check in ((base, True), (base, False), (base, False), (dict(base, reverify=True), False),
                        (dict(base, revision="nope"), False)):
        proc = subprocess.run(module_cmd(args, tmp_path, check), env=module_env(hf_env), capture_output=True,
                              text=True)
        outputs.append(proc.stdout + proc.stderr)
        result = json.loads(proc.stdout)
        if args is base and not check:
            assert result.get("failed") is not True, result.get("msg")
    assert json.loads(outputs[2])["changed"] is False
    assert '"failed": true' in outputs[4]
    for out in outputs:
        assert token not in out
    # the files it wrote (including the progress file and the record) never hold it
    for path in tmp_path.rglob("*"):
        if path.is_file() and not path.name.startswith("args-"):
            assert token.encode() not in path.read_bytes(), path
    assert all(r["auth"] for r in resolves(local_hub))


# ------------------------------------------------------------------------------------------ locks, record, progress
def test_another_download_holding_the_repository_lock_is_waited_for_then_reported(snap, models, tmp_path):
    lock = tmp_path / "cache" / ".locks" / "models--org--tiny" / "modelswap.lock"
    lock.parent.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time, json\n"
        "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o664)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "os.write(fd, json.dumps({'pid': os.getpid(), 'host': 'h', 'since': 's'}).encode())\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"), str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        r = snap(revision=models["main"], lock_timeout=1)
        assert r["failed"] is True and r["cause"] == "locked"
        assert f"pid {holder.pid}" in r["msg"] and "wait for it to end" in r["msg"]
        assert not (tmp_path / "cache" / "models--org--tiny" / "snapshots").exists()
    finally:
        holder.kill()
        holder.wait(timeout=10)
        holder.stdout.close()
    assert snap(revision=models["main"], lock_timeout=1)["changed"] is True


def test_record_notes_the_snapshot_and_keeps_other_keys(snap, models, tmp_path):
    record = tmp_path / "deployment.json"
    record.write_text(json.dumps({"model": "old", "repo_id": "org/old", "commit": "c" * 40, "path": "/x"}))
    r = snap(revision="main", record=str(record), record_name="tiny")
    assert r["changed"] is True and r["record"]["changed"] is True
    data = json.loads(record.read_text())
    assert data["model"] == "old" and data["repo_id"] == "org/old"
    entry = data["fetched"]["tiny"]
    assert entry["commit"] == models["main"] and entry["verified"] == "full" and entry["bytes"] == TOTAL
    assert entry["path"] == r["snapshot_path"] and entry["manifest"] == r["manifest"]
    assert snap(revision="main", record=str(record), record_name="tiny", check_mode=True)["changed"] is False
    assert snap(revision="main", record=str(record), record_name="tiny")["changed"] is False
    other = tmp_path / "fresh.json"
    predicted = snap(revision="main", record=str(other), record_name="tiny", check_mode=True)
    assert predicted["changed"] is True and not other.exists()


def test_progress_file_shows_bytes_rate_and_eta_while_running(local_hub, hf_env, models, tmp_path):
    progress = tmp_path / "progress.json"
    # bytes are counted per 1 MiB chunk: an 8 MiB file at 2 MiB/s moves for ~4 s
    args = {"repo_id": "org/progress", "revision": models["progress"], "endpoint": local_hub.url,
            "use_xet": False, "cache_dir": str(tmp_path / "cache"), "progress_file": str(progress),
            "progress_id": "run-1", "progress_interval": 0.3}
    local_hub.fault("throttle", rate=2 * MB, method="GET", file="w.safetensors")
    proc = subprocess.Popen(module_cmd(args, tmp_path), env=module_env(hf_env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    seen = []
    try:
        while proc.poll() is None and len(seen) < 200:
            poll = run_module("hf_snapshot_progress", {"path": str(progress), "progress_id": "run-1"})
            seen.append(poll)
            time.sleep(0.3)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert json.loads(out)["changed"] is True
    running = [s for s in seen if s.get("state") == "downloading" and 0 < s.get("bytes_done", 0) < 8 * MB]
    assert len(running) >= 2, [s.get("line") for s in seen]
    assert all(not s["finished"] and s["alive"] for s in running)
    assert running[-1]["bytes_done"] > running[0]["bytes_done"]
    sample = running[-1]
    assert sample["bytes_total"] == 8 * MB + 3 and 0 < sample["percent"] < 100
    assert sample["rate_bps"] > 0 and sample["eta_s"] is not None
    assert "%" in sample["line"] and "/s" in sample["line"] and "ETA" in sample["line"]
    final = run_module("hf_snapshot_progress", {"path": str(progress), "progress_id": "run-1"})
    assert final["finished"] is True and final["state"] == "done" and final["percent"] == 100.0
    other = run_module("hf_snapshot_progress", {"path": str(progress), "progress_id": "run-2"})
    assert other["finished"] is False and other["found"] is False


def test_a_second_run_waits_for_the_first_and_then_has_nothing_to_do(local_hub, hf_env, models, tmp_path):
    args = {"repo_id": "org/two", "revision": models["two"], "endpoint": local_hub.url, "use_xet": False,
            "cache_dir": str(tmp_path / "cache"), "progress_file": str(tmp_path / "p1.json")}
    local_hub.fault("throttle", rate=4 * MB, method="GET", file="large.safetensors")
    first = subprocess.Popen(module_cmd(args, tmp_path), env=module_env(hf_env), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: (tmp_path / "p1.json").exists() and
                 json.loads((tmp_path / "p1.json").read_text())["state"] == "downloading", timeout=30, interval=0.05, what="the first run")
        second = run_module("hf_snapshot", dict(args, progress_file=str(tmp_path / "p2.json")), env=hf_env)
        out, _ = first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait(timeout=10)
    assert json.loads(out)["changed"] is True
    assert second.get("failed") is not True, second.get("msg")
    assert second["changed"] is False and second["files_downloaded"] == 0
    assert second["verification"]["source"] == "manifest"
    assert len(resolves(local_hub, "GET", "large.safetensors")) == 1


def test_a_cache_filled_by_huggingface_hub_is_verified_offline(snap, local_hub, hf_env, models, tmp_path):
    code = ("import sys; from huggingface_hub import snapshot_download as s; "
            "print(s('org/tiny', revision=sys.argv[1], cache_dir=sys.argv[2], endpoint=sys.argv[3]))")
    subprocess.run([sys.executable, "-c", code, models["main"], str(tmp_path / "cache"), local_hub.url],
                   env=dict(os.environ, **hf_env), check=True, capture_output=True)
    local_hub.clear_log()
    r = snap(revision=models["main"], offline=True)      # huggingface_hub's tree cache has the hashes
    assert r.get("failed") is not True, r.get("msg")
    assert r["changed"] is True and r["files_downloaded"] == 0 and r["listing_source"] == "tree_cache"
    assert r["verification"]["files"] == 5 and r["verification"]["hashed_bytes"] == TOTAL
    assert local_hub.requests() == []
    assert snap(revision=models["main"], offline=True)["changed"] is False


def test_a_xet_layout_cache_is_verified_offline_and_rerun_without_requests(
        snap, local_hub, hf_env, models, tmp_path):
    """The same on the Xet layout: each repo blob is published to the cache-wide shared store with
    huggingface_hub's own publish_blob_to_shared_store (what hf_hub_download does after a Xet
    download), so every repo blob is a relative link into <cache>/blobs/<xx>/<hash>."""
    from huggingface_hub.utils import _shared_blobs

    cache = Path(os.path.realpath(tmp_path / "cache"))
    code = ("import sys; from huggingface_hub import snapshot_download as s; "
            "print(s('org/tiny', revision=sys.argv[1], cache_dir=sys.argv[2], endpoint=sys.argv[3]))")
    subprocess.run([sys.executable, "-c", code, models["main"], str(cache), local_hub.url],
                   env=dict(os.environ, **hf_env), check=True, capture_output=True)
    blobs = cache / "models--org--tiny" / "blobs"
    for blob in sorted(blobs.iterdir()):
        data = blob.read_bytes()
        assert _shared_blobs.publish_blob_to_shared_store(
            blob_path=str(blob), xet_hash=hashlib.sha256(b"xet:" + data).hexdigest(), cache_dir=cache,
            expected_size=len(data))
        assert blob.is_symlink() and _shared_blobs.shared_blob_target(blob, cache) is not None
    local_hub.clear_log()
    r = snap(revision=models["main"], offline=True)
    assert r.get("failed") is not True, r.get("msg")
    assert r["changed"] is True and r["files_downloaded"] == 0 and r["listing_source"] == "tree_cache"
    assert r["verification"]["files"] == 5 and r["verification"]["hashed_bytes"] == TOTAL
    assert local_hub.requests() == []
    again = snap(revision=models["main"], offline=True)
    assert again["changed"] is False and again["verification"]["source"] == "manifest"
    assert snap(revision=models["main"])["changed"] is False       # a pinned commit, online: no request
    assert local_hub.requests() == []
    # a repo blob retargeted outside the store is refused, never read, and fetched again
    weights = blobs / hashlib.sha256(FILES["model-00001-of-00002.safetensors"]).hexdigest()
    outside = tmp_path / "outside.bin"
    outside.write_bytes(FILES["model-00001-of-00002.safetensors"])
    os.unlink(weights)
    os.symlink(str(outside), weights)
    bad = snap(revision=models["main"], reverify=True, retry_delay=0.05)
    assert bad.get("failed") is not True, bad.get("msg")
    refetched = bad["verification"]["refetched"]
    assert [f["path"] for f in refetched] == ["model-00001-of-00002.safetensors"]
    assert "untrusted" in refetched[0]["reason"]
    assert outside.read_bytes() == FILES["model-00001-of-00002.safetensors"] and not weights.is_symlink()


def test_a_python_without_huggingface_hub_is_told_what_to_do(hf_env, tmp_path):
    fake = tmp_path / "site"
    fake.mkdir()
    (fake / "huggingface_hub.py").write_text("raise ImportError('No module named huggingface_hub')\n")
    env = dict(hf_env, PYTHONPATH=os.pathsep.join([str(fake), str(REPO / ".collections")]))
    r = run_module("hf_snapshot", {"repo_id": "org/tiny", "cache_dir": str(tmp_path / "c")}, env=env)
    assert r["failed"] is True and r["cause"] == "missing_library"
    assert "huggingface_hub" in r["msg"] and "python" in r["msg"]
