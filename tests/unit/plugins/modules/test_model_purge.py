"""The model_purge module, run as Ansible runs it (tests.support.modules.run_module).

Module tests of model_purge (and of disk_plan's plan that it carries out) on real caches filled by
real downloads: the cache is written by huggingface_hub.snapshot_download from the local Hub (tests
marked `hub`), on a file system of its own (tests/support/scratch_fs.py: a loop-mounted ext4 as
root), so the bytes a purge frees are measured with statvfs and compared with what was planned.
Bad-input tests need no Hub (marked `unit`). disk_plan's own module tests use the same world
(test_disk_plan.py beside this file).

Then the guarded apply on synthetic caches (marked `unit`): the cache changed *between* plan and
apply, and a deletion that fails (the purge is verified). The plan logic is table-tested in
tests/unit/plugins/module_utils/store/test_model_purge.py (the refusal rules, leftovers()) and
test_unlink_plan.py (the delete plan and its re-check) there.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from ansible_collections.modelswap.vllm.plugins.module_utils.store import model_purge
from ansible_collections.modelswap.vllm.plugins.module_utils.store import protections
from ansible_collections.modelswap.vllm.plugins.module_utils.store import purge_items
from ansible_collections.modelswap.vllm.plugins.module_utils.store import store_scan
from tests.support import synthetic_cache
from tests.support.modules import COLLECTIONS, REPO, run_module
from tests.support.scratch_fs import scratch_fs, tree_fingerprint, tree_usage
from tests.support.synthetic_cache import A, B, W1
from tests.unit.plugins.module_utils.store.test_model_purge import (
    EPERM_TEXT, ONE, TWO, W1_CONFIG, W1_WEIGHTS, immutable_capable, undeletable)
from tests.unit.plugins.module_utils.store.test_unlink_plan import _retarget, blob_of, build

KB = 1024
DOWNLOAD = ("import sys; from huggingface_hub import snapshot_download; "
            "print(snapshot_download(sys.argv[1], revision=sys.argv[2], cache_dir=sys.argv[3]))")


def blob(seed: int, size: int) -> bytes:
    """Incompressible-looking deterministic content."""
    out = bytearray()
    counter = 0
    while len(out) < size:
        out += hashlib.sha256(b"%d-%d" % (seed, counter)).digest()
        counter += 1
    return bytes(out[:size])


CONTENT = {
    "old-v1": {"config.json": b'{"v": 1}', "model.safetensors": blob(1, 300 * KB),
               "tokenizer.json": blob(2, 40 * KB)},
    "old-v2": {"config.json": b'{"v": 2}', "model.safetensors": blob(1, 300 * KB),
               "tokenizer.json": blob(2, 40 * KB)},
    "served": {"config.json": b'{"s": 1}', "model.safetensors": blob(3, 200 * KB)},
    "keep": {"config.json": b'{"k": 1}', "model.safetensors": blob(4, 150 * KB)},
    "target-v1": {"config.json": b'{"t": 1}', "model-00001-of-00002.safetensors": blob(5, 250 * KB)},
    "target-v2": {"config.json": b'{"t": 1}', "model-00001-of-00002.safetensors": blob(5, 250 * KB),
                  "model-00002-of-00002.safetensors": blob(6, 400 * KB)},
}


class World:
    """A populated store: hub commits, catalog, cache and models dir on a scratch file system."""

    def __init__(self, hub, env, fs):
        self.hub, self.env, self.fs = hub, env, fs
        self.cache = fs.root / "hub"
        self.models_dir = fs.root / "models"
        self.record = fs.root / "deployment.json"
        c = {}
        c["old-v1"] = hub.publish("lab/old", CONTENT["old-v1"])
        c["old-v2"] = hub.publish("lab/old", CONTENT["old-v2"])
        c["served"] = hub.publish("lab/served", CONTENT["served"])
        c["keep"] = hub.publish("lab/keep", CONTENT["keep"])
        c["target-v1"] = hub.publish("lab/target", CONTENT["target-v1"])
        c["target-v2"] = hub.publish("lab/target", CONTENT["target-v2"])
        self.commits = c
        self.models = {
            "old-1": {"repo_id": "lab/old", "revision": c["old-v1"], "served_model_name": "old"},
            "old-2": {"repo_id": "lab/old", "revision": c["old-v2"], "served_model_name": "old"},
            "served": {"repo_id": "lab/served", "revision": c["served"], "served_model_name": "s"},
            "keeper": {"repo_id": "lab/keep", "revision": c["keep"], "served_model_name": "k"},
            "target": {"repo_id": "lab/target", "revision": c["target-v2"], "served_model_name": "t"},
            "ghost": {"repo_id": "lab/ghost", "revision": "0" * 40, "served_model_name": "g"},
        }

    def download(self, repo_id: str, commit: str) -> Path:
        proc = subprocess.run([sys.executable, "-c", DOWNLOAD, repo_id, commit, str(self.cache)],
                              env=self.env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return Path(proc.stdout.strip().splitlines()[-1])

    def populate(self):
        self.download("lab/old", self.commits["old-v1"])
        self.download("lab/old", self.commits["old-v2"])
        served = self.download("lab/served", self.commits["served"])
        self.download("lab/keep", self.commits["keep"])
        self.download("lab/target", self.commits["target-v1"])
        synthetic_cache.make_plain_dir(self.models_dir, "finetune",
                                       {"weights.bin": blob(7, 100 * KB), "config.json": b"{}"})
        self.record.write_text(json.dumps({"model": "served", "repo_id": "lab/served",
                                           "commit": self.commits["served"], "path": str(served)}))
        # LRU order: old oldest, then the plain dir, then keep and served
        now = time.time()
        for repo_id, age in (("lab/old", 5000), ("lab/keep", 100), ("lab/served", 50), ("lab/target", 10)):
            synthetic_cache.set_last_used(self.cache, repo_id, now - age)
        for path in (self.models_dir / "finetune").rglob("*"):
            os.utime(path, (now - 3000, now - 3000))
        return self

    def args(self, **extra) -> dict:
        base = {"cache_dir": str(self.cache), "models_dir": str(self.models_dir), "models": self.models,
                "deployment_record": str(self.record), "vllm_unit": "", "target": "target",
                "keep": ["keeper"]}
        base.update(extra)
        return base

    def plan(self, **extra) -> dict:
        args = self.args(**{"endpoint": self.hub.url, **extra})
        return run_module("disk_plan", args, env=self.env)

    def purge(self, items, check=False, **extra) -> dict:
        return run_module("model_purge", self.args(items=items, **extra), check_mode=check, diff=True,
                          env=self.env)

    def fingerprint(self) -> str:
        return tree_fingerprint(self.fs.root)

    def usage(self) -> int:
        return tree_usage(self.fs.root)


@pytest.fixture
def world(local_hub, hf_env):
    env = {**os.environ, **hf_env}
    with scratch_fs() as fs:
        yield World(local_hub, env, fs).populate()


def ok(result: dict) -> dict:
    assert not result.get("failed"), result.get("msg", result)
    return result


def freed_measured(world, before_free, before_usage):
    """(statvfs delta if the file system is ours alone, du delta)."""
    du = before_usage - world.usage()
    return (world.fs.free() - before_free) if world.fs.isolated else du, du


@pytest.mark.hub
def test_plan_then_purge_frees_exactly_what_was_planned(world):
    first = ok(world.plan())
    # make room for the target the hard way: headroom so that only purging lab/old suffices
    old_bytes = first["candidates"][0]["bytes"]
    headroom = first["filesystem"]["available_bytes"] - first["target"]["needed_bytes"] + old_bytes // 2
    plan = ok(world.plan(headroom=str(headroom)))
    assert plan["verdict"] == "fits_after_purge", plan["reason"]
    assert plan["purge"] == ["lab/old"]
    assert plan["purge_bytes"] == old_bytes

    fp = world.fingerprint()
    check = ok(world.purge(plan["purge"], check=True))
    assert check["changed"] is True and check["freed_bytes"] is None
    assert [r["item"] for r in check["removed"]] == ["lab/old"]
    # the stale download locks of every repo are cleaned too (0-byte files)
    assert check["planned_bytes"] == plan["purge_bytes"]
    assert world.fingerprint() == fp, "check mode changed the file system"
    assert any(line.startswith("hf lab/old@") for line in check["diff"]["before"].splitlines())
    assert not any(line.startswith("hf lab/old@") for line in check["diff"]["after"].splitlines())

    before_free, before_usage = world.fs.free(), world.usage()
    real = ok(world.purge(plan["purge"]))
    measured, du = freed_measured(world, before_free, before_usage)
    assert real["changed"] is True
    assert real["planned_bytes"] == check["planned_bytes"]
    assert real["freed_bytes"] == measured if world.fs.isolated else True
    assert du == real["planned_bytes"] == plan["purge_bytes"]
    if world.fs.isolated:
        assert real["freed_bytes"] == plan["purge_bytes"]
    # huggingface_hub's own expectation: every blob of both revisions, shared ones once; check mode
    # returns the same planned figure
    assert real["expected_freed_size"] == 300 * KB + 40 * KB + 2 * len(b'{"v": 1}')
    assert check["expected_freed_size"] == real["expected_freed_size"]
    assert not (world.cache / "models--lab--old").exists()
    assert not (world.cache / ".locks" / "models--lab--old").exists()

    again = ok(world.purge(plan["purge"]))
    assert again["changed"] is False and again["absent"] == ["lab/old"]
    after = ok(world.plan(headroom=str(headroom)))
    assert after["verdict"] == "fits"


@pytest.mark.hub
def test_old_revision_goes_and_shared_blobs_survive(world):
    v1, v2_commit = world.commits["old-v1"], world.commits["old-v2"]
    manifests = world.cache / "models--lab--old" / "modelswap"    # hf_snapshot's, per commit
    manifests.mkdir(exist_ok=True)
    for commit in (v1, v2_commit):
        (manifests / (commit + ".json")).write_text("{}")
    check = ok(world.purge(["lab/old@" + v1], check=True))
    before_free, before_usage = world.fs.free(), world.usage()
    res = ok(world.purge(["lab/old@" + v1]))
    measured, du = freed_measured(world, before_free, before_usage)
    assert res["removed"][0]["kind"] == "revision"
    assert du == res["planned_bytes"] and measured == res["planned_bytes"]
    assert res["expected_freed_size"] == len(b'{"v": 1}')   # only v1's config was its own
    assert check["expected_freed_size"] == res["expected_freed_size"]
    assert check["planned_bytes"] == res["planned_bytes"]
    v2 = world.cache / "models--lab--old" / "snapshots" / world.commits["old-v2"]
    assert (v2 / "model.safetensors").read_bytes() == CONTENT["old-v2"]["model.safetensors"]
    assert not (world.cache / "models--lab--old" / "snapshots" / v1).exists()
    assert not (world.cache / "models--lab--old" / "trees" / (v1 + ".json")).exists()
    assert not (manifests / (v1 + ".json")).exists() and (manifests / (v2_commit + ".json")).exists()
    assert ok(world.purge(["lab/old@" + v1]))["changed"] is False


# (id, items, extra args, words the refusal must contain)
REFUSALS = [
    ("served-by-record", ["lab/served"], {}, ["served model 'served'", "deployment record", "rule: served"]),
    ("served-by-name", ["served"], {}, ["rule: served"]),
    ("target", ["lab/target"], {}, ["target model 'target'", "rule: target"]),
    ("keep", ["keeper"], {}, ["keep list", "rule: keep"]),
    ("protected-path", ["finetune"], {"protect_paths": ["{models}/finetune/weights.bin"]}, ["rule: path"]),
    ("outside-roots", ["/etc"], {}, ["outside the roots", "rule: roots"]),
    ("a-root-itself", ["{cache}"], {}, ["root itself", "rule: roots"]),
    ("symlink-escape", ["{models}/escape"], {}, ["symlink", "rule: roots"]),
    ("one-bad-spoils-all", ["lab/old", "lab/served"], {}, ["rule: served"]),
    ("served-allowed-but-state-known", ["lab/old", "lab/target@{target-v1}", "lab/served"],
     {"allow_served_purge": True, "target": "old-2"}, ["rule: target"]),
]


@pytest.mark.hub
@pytest.mark.parametrize("items,extra,words", [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_refusals_delete_nothing(world, tmp_path, items, extra, words):
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "data.bin").write_bytes(b"keep me")
    os.symlink(outside, world.models_dir / "escape")
    fmt = {"cache": str(world.cache), "models": str(world.models_dir), **world.commits}
    items = [i.format(**fmt) for i in items]
    extra = {k: ([x.format(**fmt) for x in v] if isinstance(v, list) else v) for k, v in extra.items()}
    fp = world.fingerprint()
    for check in (True, False):
        res = world.purge(items, check=check, **extra)
        assert res.get("failed") is True, res
        assert "nothing was deleted" in res["msg"]
        for w in words:
            assert w in res["msg"], res["msg"]
    assert world.fingerprint() == fp
    assert (outside / "data.bin").read_bytes() == b"keep me"


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError("timed out waiting for " + what)


@pytest.mark.hub
def test_orphans_are_cleaned_only_when_no_download_holds_the_lock(world):
    """A live download's partial file is never touched; once killed, it is an orphan and goes."""
    hub = world.hub
    big = blob(9, 16 * 1024 * KB)   # > huggingface_hub's 10 MiB write chunk
    commit = hub.publish("lab/slow", {"config.json": b"{}", "model.safetensors": big})
    hub.fault("throttle", rate=1024 * KB, file="model.safetensors", count=None)
    blobs = world.cache / "models--lab--slow" / "blobs"
    proc = subprocess.Popen([sys.executable, "-c", DOWNLOAD, "lab/slow", commit, str(world.cache)],
                            env=world.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        etag = hashlib.sha256(big).hexdigest()
        partial = _wait_for(lambda: list(blobs.glob(etag + ".*.incomplete")) if blobs.exists() else [],
                            30, "the partial file")[0]
        # a live download: its partial file is in use, never touched
        plan = ok(world.plan())
        states = {f["path"]: f["state"] for f in plan["orphans"]["files"]}
        assert states[str(partial)] == "in_use"
        res = ok(world.purge([]))
        assert str(partial) in res["orphans_busy"] and partial.exists()
        assert proc.poll() is None, "the purge broke the live download"
        # killed after its first 10 MiB write: an orphan nobody will resume
        _wait_for(lambda: partial.stat().st_size >= 10 * 1024 * KB, 30, "the first 10 MiB write")
        assert proc.poll() is None
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
        hub.clear_faults()
    plan = ok(world.plan())
    assert [f["state"] for f in plan["orphans"]["files"]] == ["reclaimable"]
    assert plan["orphans"]["reclaimable_bytes"] >= 10 * 1024 * KB
    fp = world.fingerprint()
    check = ok(world.purge([], check=True))
    assert [o["path"] for o in check["orphans_removed"]] == [str(partial)]
    assert world.fingerprint() == fp
    before_free, before_usage = world.fs.free(), world.usage()
    res = ok(world.purge([]))
    measured, du = freed_measured(world, before_free, before_usage)
    assert not partial.exists() and res["changed"] is True
    assert du == res["planned_bytes"] == check["planned_bytes"] == measured
    assert ok(world.purge([]))["changed"] is False
    # the cache still works: the download completes from scratch
    assert (world.download("lab/slow", commit) / "model.safetensors").read_bytes() == big


# ------------------------------------------------------------------------------------ bad input
def _bad_world(tmp_path):
    cache = tmp_path / "hub"
    synthetic_cache.add_revision(cache, "org/one", "a" * 40, {"config.json": b"{}", "model.safetensors": b"w" * 5000})
    (tmp_path / "file").write_text("x")
    (tmp_path / "bad.json").write_text("{not json")
    return cache


BAD_PURGE = [
    ("missing-store", {"models_dir": "{tmp}/nope"}, "does not exist"),
    ("store-is-a-file", {"cache_dir": "{tmp}/file"}, "is not a directory"),
    ("unknown-target", {"target": "nope"}, "unknown model name 'nope' (target)"),
    ("malformed-repo-id", {"items": ["org/na me"]}, "malformed"),
    ("malformed-revision", {"items": ["org/one@not a ref"]}, "neither a commit hash nor a ref"),
    ("not-in-store-fail", {"items": ["org/absent"], "missing": "fail"}, "not in the model store"),
    ("not-a-purgeable-path", {"items": ["{tmp}/hub/models--org--one/blobs"]}, "not a purgeable item"),
    ("bad-root", {"roots": ["{tmp}/nope"]}, "not an existing directory"),
]


@pytest.mark.unit
@pytest.mark.parametrize("extra,words", [b[1:] for b in BAD_PURGE], ids=[b[0] for b in BAD_PURGE])
def test_model_purge_bad_input(tmp_path, extra, words):
    cache = _bad_world(tmp_path)
    args = {"cache_dir": str(cache), "models": {"t": {"repo_id": "org/new", "revision": "b" * 40}},
            "target": "t", "items": ["org/one"], "vllm_unit": "",
            "deployment_record": str(tmp_path / "none.json")}
    for k, v in extra.items():
        if isinstance(v, str):
            v = v.format(tmp=tmp_path)
        elif isinstance(v, list):
            v = [x.format(tmp=tmp_path) for x in v]
        args[k] = v
    fp = tree_fingerprint(tmp_path)
    for check in (True, False):
        res = run_module("model_purge", args, check_mode=check)
        assert res.get("failed") is True, res
        assert words in res["msg"], res["msg"]
        assert tree_fingerprint(tmp_path) == fp


@pytest.mark.unit
def test_model_purge_absent_item_is_idempotent_by_default(tmp_path):
    cache = _bad_world(tmp_path)
    res = run_module("model_purge", {"cache_dir": str(cache), "items": ["org/absent"], "vllm_unit": "",
                                     "deployment_record": str(tmp_path / "none.json")})
    assert res.get("failed") is not True and res["changed"] is False and res["absent"] == ["org/absent"]


@pytest.fixture
def hand_started_vllm(tmp_path):
    """A real process whose command line is a vLLM server's, started by hand from the store's
    folder with a relative model path (as an operator does in tmux): `vllm serve ./old --port 0`."""
    models = tmp_path / "models"
    for name in ("old", "spare"):
        (models / name).mkdir(parents=True)
        (models / name / "model.safetensors").write_bytes(b"w" * 50_000)
    script = tmp_path / "bin" / "vllm"
    script.parent.mkdir()
    script.write_text("#!%s\nimport time\ntime.sleep(120)\n" % sys.executable)
    script.chmod(0o755)
    proc = subprocess.Popen([str(script), "serve", "./old", "--port", "0"], cwd=models)
    try:
        for _unused in range(100):   # until /proc shows its own command line (not the interpreter's yet)
            if b"serve" in Path(f"/proc/{proc.pid}/cmdline").read_bytes():
                break
            time.sleep(0.05)
        yield models, proc.pid
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.unit
def test_a_model_served_by_a_vllm_started_by_hand_is_never_purged(tmp_path, hand_started_vllm):
    models, pid = hand_started_vllm
    common = {"models_dir": str(models), "vllm_unit": "", "deployment_record": str(tmp_path / "none.json")}
    plan = run_module("disk_plan", dict(common, target_bytes=10))
    assert not plan.get("failed"), plan
    assert "process" in plan["served"]["sources"] and plan["served"]["path"] == str(models / "old")
    assert [c["item"] for c in plan["candidates"]] == [str(models / "spare")]
    assert any(f"PID {pid}" in p["what"] for p in plan["protected"])
    fp = tree_fingerprint(models)
    for extra in ({}, {"allow_served_purge": True}):
        res = run_module("model_purge", dict(common, items=[str(models / "old")], **extra))
        assert res.get("failed") and f"the running vLLM server, PID {pid}" in res["msg"], res
    assert tree_fingerprint(models) == fp


# ======================================================================= between plan and apply
# The module tests change the cache *between* plan and apply: a hook run in the module's own
# process fires right after the module has taken its download locks (the moment after planning),
# the way another writer of a shared store would. (tests/unit/plugins/module_utils/store/
# test_unlink_plan.py tests the plan and its re-check alone.)
HOOK = r"""
import json, os, runpy, sys
from ansible_collections.modelswap.vllm.plugins.module_utils.store import store_locks
change = json.loads(os.environ["MODELSWAP_TEST_CHANGE"])
original = store_locks.LockSet.acquire_all
fired = []

def acquire_all(self):
    busy = original(self)
    if not fired:   # the module has planned and now holds its first locks: another writer acts
        fired.append(1)
        for op, path, target in change:
            if op == "retarget":
                os.unlink(path)
                os.symlink(target, path)
    return busy

store_locks.LockSet.acquire_all = acquire_all
sys.argv = [sys.argv[1], sys.argv[2]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_purge_hooked(args: dict, change: list, check_mode: bool = False) -> dict:
    """Run plugins/modules/model_purge.py as run_module does, with ``change`` applied right after the
    module's first LockSet.acquire_all (after planning, before deleting)."""
    payload = dict(args, _ansible_check_mode=check_mode, _ansible_diff=False)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump({"ANSIBLE_MODULE_ARGS": payload}, fh)
        args_file = fh.name
    env = dict(os.environ, MODELSWAP_TEST_CHANGE=json.dumps(change))
    env["PYTHONPATH"] = os.pathsep.join([str(COLLECTIONS), env.get("PYTHONPATH", "")])
    try:
        proc = subprocess.run([sys.executable, "-c", HOOK, str(REPO / "plugins" / "modules" / "model_purge.py"),
                               args_file], capture_output=True, text=True, env=env, timeout=300)
    finally:
        os.unlink(args_file)
    assert proc.stdout.strip(), proc.stderr[-3000:]
    return json.loads(proc.stdout)


def purge_args(cache, tmp_path, items):
    return {"cache_dir": str(cache), "items": items, "vllm_unit": "",
            "deployment_record": str(tmp_path / "none.json")}


@pytest.mark.unit
def test_a_link_retargeted_outside_between_plan_and_apply_deletes_nothing(tmp_path):
    """Before the fix the deletion went through huggingface_hub's fresh scan, which took the
    retargeted link's target for A's own blob and unlinked the canary outside the cache."""
    cache, models = build(tmp_path)
    canary = tmp_path / "outside" / "canary"
    canary.parent.mkdir()
    canary.write_bytes(b"precious")
    link = cache / ONE / "snapshots" / A / "config.json"
    change = [["retarget", str(link), str(canary)]]
    res = run_purge_hooked(purge_args(cache, tmp_path, ["org/one@" + A]), change)
    assert res.get("failed") is True, res
    assert "changed since it was planned" in res["msg"] and "nothing was deleted" in res["msg"]
    assert "leaves the repo's blobs" in res["msg"] and str(canary) in res["msg"]
    assert res["changed"] is False
    assert canary.read_bytes() == b"precious"
    # nothing at all was deleted: the cache is the planned one plus the retargeted link
    assert os.readlink(link) == str(canary)
    assert (cache / ONE / blob_of("config.json", W1)).read_bytes() == W1["config.json"]
    assert (cache / ONE / "snapshots" / A).is_dir() and (cache / ONE / "trees" / (A + ".json")).exists()
    # put the link back: the same purge now succeeds and frees A alone
    _retarget(link, "../../" + blob_of("config.json", W1))
    res = run_module("model_purge", purge_args(cache, tmp_path, ["org/one@" + A]))
    assert not res.get("failed"), res
    assert not (cache / ONE / "snapshots" / A).exists() and (cache / ONE / "snapshots" / B).is_dir()
    assert canary.read_bytes() == b"precious"


@pytest.mark.unit
def test_a_kept_revision_relinked_to_a_doomed_blob_between_plan_and_apply_is_refused(tmp_path):
    cache, models = build(tmp_path)
    link = cache / ONE / "snapshots" / B / "config.json"
    change = [["retarget", str(link), "../../" + blob_of("config.json", W1)]]
    res = run_purge_hooked(purge_args(cache, tmp_path, ["org/one@" + A]), change)
    assert res.get("failed") is True and "now links other blobs" in res["msg"], res
    assert "nothing was deleted" in res["msg"]
    # B still reads the blob it now links, A is whole: nothing was deleted
    assert link.read_bytes() == W1["config.json"]
    assert (cache / ONE / "snapshots" / A / "config.json").read_bytes() == W1["config.json"]
    assert (cache / ONE / "trees" / (A + ".json")).exists()


def _blob_bytes(cache):
    """Apparent bytes of every repo blob entry (what expected_freed_size counts)."""
    return sum(os.lstat(os.path.join(d, n)).st_size for d, _unused, names in os.walk(cache)
               if os.path.basename(d) == "blobs" for n in names)


@pytest.mark.unit
@pytest.mark.parametrize("items", [["org/one@" + A], ["org/one"], ["org/one@" + B, "org/two"]],
                         ids=["one-revision", "a-repo", "a-revision-and-a-repo"])
def test_check_mode_returns_the_planned_expected_freed_size_the_real_run_frees(tmp_path, items):
    cache, models = build(tmp_path)
    args = purge_args(cache, tmp_path, items)
    fp = tree_fingerprint(tmp_path)
    check = run_module("model_purge", args, check_mode=True)
    assert not check.get("failed"), check
    assert tree_fingerprint(tmp_path) == fp
    assert check["expected_freed_size"] > 0
    before = _blob_bytes(cache)
    real = run_module("model_purge", args)
    assert not real.get("failed"), real
    assert real["expected_freed_size"] == check["expected_freed_size"] == before - _blob_bytes(cache)
    assert real["planned_bytes"] == check["planned_bytes"]


# ======================================================================= a purge is verified
# Issue 27 item 5: a deletion that fails (made to fail by undeletable: chattr +i as root, a read-only
# folder otherwise) is named with its cause and the module fails (tests/unit/plugins/module_utils/
# store/test_model_purge.py tests leftovers() alone and says why).
@pytest.fixture
def store():
    """org/one at A and B (sharing blobs), org/two at C, a plain model directory `plain`, on a
    file system of its own where a deletion can be made to fail."""
    with scratch_fs() as fs, immutable_capable(fs.root) as (base, isolated):
        cache, models = base / "hub", base / "models"
        synthetic_cache.add_two_repos(cache)
        synthetic_cache.make_plain_dir(models, "plain", {"w.bin": b"p" * 70000, "config.json": b"{}"})
        yield cache, models, (lambda: os.statvfs(base).f_bfree * os.statvfs(base).f_frsize), \
            isolated and fs.isolated


def purge(cache, models, items, check=False):
    return run_module("model_purge", {"cache_dir": str(cache), "models_dir": str(models), "items": items,
                                      "vllm_unit": "", "deployment_record": str(cache.parent / "none.json")},
                      check_mode=check)


# (id, items, the failing item's ident (the message's and left's), where its stuck file is, the
#  items really removed, what of the failing item must still be on disk)
SHAPES = [
    ("a-whole-repo", ["org/one", "org/two"], "org/one",
     lambda c, m: c / ONE / "blobs" / W1_WEIGHTS, ["org/two"], lambda c, m: c / ONE),
    ("a-revision", ["org/one@" + A, "org/two"], "org/one@" + A,
     lambda c, m: c / ONE / "blobs" / W1_CONFIG, ["org/two"], lambda c, m: c / ONE / "snapshots" / B),
    ("a-plain-directory", ["plain", "org/two"], None,
     lambda c, m: m / "plain" / "w.bin", ["org/two"], lambda c, m: m / "plain"),
]


@pytest.mark.unit
@pytest.mark.parametrize("items,failing,stuck_at,really_removed,still",
                         [s[1:] for s in SHAPES], ids=[s[0] for s in SHAPES])
def test_a_deletion_that_fails_is_named_and_the_module_fails(store, items, failing, stuck_at,
                                                             really_removed, still):
    cache, models, free, isolated = store
    stuck = stuck_at(cache, models)
    failing = failing or str(models / "plain")
    with undeletable(stuck):
        # check mode never deletes: unchanged, it plans both
        fp = tree_fingerprint(cache.parent)
        check = purge(cache, models, items, check=True)
        assert not check.get("failed"), check
        assert [r["item"] for r in check["removed"]] == [failing, "org/two"]
        assert "left" not in check and tree_fingerprint(cache.parent) == fp

        before = free()
        res = purge(cache, models, items)
        freed = free() - before
        assert stuck.exists() and still(cache, models).exists()
    assert res.get("failed") is True, res
    msg = res["msg"]
    assert msg.startswith("model_purge: deleted 1 of 2; %s: still on disk: %s (%s)" % (failing, stuck, EPERM_TEXT)), msg
    assert [r["item"] for r in res["removed"]] == really_removed
    assert res["left"] == [{"item": failing, "paths": [str(stuck)], "cause": EPERM_TEXT}]
    assert res["changed"] is True
    assert not (cache / TWO).exists()
    assert res["freed_bytes"] > 0
    if isolated:
        assert res["freed_bytes"] == freed
    if "@" in failing:
        # huggingface_hub deleted the revision's snapshot before its blob failed: a rerun finds the
        # revision gone (absent) and the blob, linked by no revision, stays until its repo goes
        again = purge(cache, models, [failing])
        assert not again.get("failed") and again["absent"] == [failing], again
        assert stuck.exists()
        return
    # the cause fixed, the purge is run again: what was left goes
    again = purge(cache, models, [failing])
    assert not again.get("failed"), again
    assert again["left"] == [] and not stuck.exists() and not still(cache, models).exists()


@pytest.mark.unit
def test_the_same_purge_without_a_failure_is_clean(store):
    cache, models, free, isolated = store
    items = ["org/one@" + A, "plain", "org/two"]
    check = purge(cache, models, items, check=True)
    before = free()
    res = purge(cache, models, items)
    freed = free() - before
    assert not res.get("failed"), res
    assert res["left"] == [] and res["changed"] is True
    assert [r["item"] for r in res["removed"]] == [r["item"] for r in check["removed"]] == [
        "org/one@" + A, str(models / "plain"), "org/two"]
    assert res["freed_bytes"] > 0
    if isolated:
        assert res["freed_bytes"] == freed == check["planned_bytes"]
    assert not (cache / ONE / "snapshots" / A).exists() and (cache / ONE / "snapshots" / B).is_dir()
    assert not (models / "plain").exists() and not (cache / TWO).exists()


@pytest.mark.unit
def test_a_second_removal_that_succeeds_is_no_leftover(store, monkeypatch):
    """The strategy missed a path (it logs and goes on); the check removes it as planned."""
    cache, models, _free, _isolated = store
    s = store_scan.scan_store(str(cache), str(models))
    roots = model_purge.purge_roots(s, None)
    state = protections.build_protections(s, models={})
    plan = model_purge.plan_purge(s, state, roots=roots, items=["org/two"])

    class Lazy:
        """A strategy that deletes nothing, as when every path failed and was only logged."""
        def __init__(self, **kwargs):
            pass

        def execute(self):
            pass

    monkeypatch.setattr(model_purge, "DeleteCacheStrategy", Lazy)
    monkeypatch.setattr(model_purge.dataclasses, "fields", lambda _cls: [])
    result = model_purge.apply_purge(s, plan, plan.result())
    assert result["left"] == [] and [r["item"] for r in result["removed"]] == ["org/two"]
    assert not (cache / TWO).exists()


@pytest.mark.unit
def test_what_a_refused_delete_left_of_a_repo_is_purged_by_its_name_on_the_rerun(tmp_path):
    """A purge of the only revision of org/two (by catalog name) was refused mid-way: its
    snapshot is gone, a blob is left. The rerun, named the same way (catalog name or repo@commit),
    takes the folder's remains whole (nothing of it can serve) instead of failing as 'not in the
    cache' while the bytes stay on disk."""
    cache, models = tmp_path / "hub", tmp_path / "models"
    synthetic_cache.add_two_repos(cache)
    models.mkdir()
    catalog = {"two": {"repo_id": "org/two", "revision": synthetic_cache.C}}
    shutil.rmtree(cache / TWO / "snapshots")
    shutil.rmtree(cache / TWO / "refs")
    assert any((cache / TWO / "blobs").iterdir())
    store = store_scan.scan_store(str(cache), str(models))
    for text in ("two", "org/two@" + synthetic_cache.C):
        item = purge_items.resolve_item(store, text, catalog)
        assert (item.kind, item.path) == ("repo", str(cache / TWO)), item
    res = run_module("model_purge", {"cache_dir": str(cache), "models_dir": str(models), "items": ["two"],
                                     "models": catalog, "vllm_unit": "",
                                     "deployment_record": str(tmp_path / "none.json")})
    assert not res.get("failed"), res
    assert res["left"] == [] and not (cache / TWO).exists() and (cache / ONE).is_dir()
