"""Module tests of disk_plan and model_purge on real caches filled by real downloads.

The cache is written by huggingface_hub.snapshot_download from the local Hub (tests marked `hub`),
on a file system of its own (tests/support/scratch_fs.py: a loop-mounted ext4 as root), so the
bytes a purge frees are measured with statvfs and compared with what was planned.
Bad-input tests need no Hub (marked `unit`).
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import synthetic_cache
from tests.support.modules import run_module
from tests.support.scratch_fs import scratch_fs, tree_fingerprint, tree_usage

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


# ------------------------------------------------------------------------------------ disk_plan
@pytest.mark.hub
def test_partly_cached_target_needs_only_the_rest(world):
    plan = ok(world.plan())
    t = plan["target"]
    assert plan["changed"] is False
    assert t["source"] == "hub" and t["commit"] == world.commits["target-v2"]
    assert t["files"] == 3
    assert t["download_bytes"] == 400 * KB                      # only the new shard
    assert t["cached_bytes"] == 250 * KB + len(b'{"t": 1}')
    assert t["missing_files"] == 1
    assert t["needed_bytes"] >= 400 * KB
    assert plan["verdict"] == "fits" and plan["fits"] is True and plan["purge"] == []
    # allow/ignore patterns are honoured: ignoring the new shard leaves nothing to download
    models = dict(world.models, target=dict(world.models["target"], ignore_patterns=["model-00002-*"]))
    plan2 = ok(world.plan(models=models))
    assert plan2["target"]["files"] == 2 and plan2["target"]["download_bytes"] == 0


@pytest.mark.hub
def test_candidates_are_unprotected_and_least_recently_used_first(world):
    plan = ok(world.plan())
    order = [c["item"] for c in plan["candidates"]]
    # lab/old (both revisions) first, then the plain dir; never served, target, keep
    assert order[0] == "lab/old" and order[1].endswith("/models/finetune")
    assert len(order) == 2
    rules = {p["rule"] for p in plan["protected"]}
    assert rules == {"served", "target", "keep"}
    assert plan["served"]["name"] == "served" and "deployment_record" in plan["served"]["sources"]
    # lab/target's cached v1 is the only revision: purging it would delete the shard v2 reuses
    v1 = "lab/target@" + world.commits["target-v1"]
    assert any(e["item"] == v1 and "reuses" in e["why"] for e in plan["excluded"]), plan["excluded"]
    listed = world.plan(candidates=[v1])
    assert listed["failed"] and "reuses" in listed["msg"]
    # once v2 is cached, v1 is a candidate that frees only its own snapshot (blobs are shared)
    world.download("lab/target", world.commits["target-v2"])
    plan = ok(world.plan())
    row = next(c for c in plan["candidates"] if c["item"] == v1)
    assert row["size"] < 1 * KB and 0 < row["bytes"] < 64 * KB   # snapshot links + its tree listing
    assert plan["target"]["download_bytes"] == 0


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


@pytest.mark.hub
def test_only_the_served_model_would_make_room(world):
    first = ok(world.plan(candidates=["lab/old"]))
    # headroom so that lab/old alone is not enough but lab/old + the served model is
    avail = first["filesystem"]["available_bytes"]
    need = first["target"]["needed_bytes"]
    old = first["candidates"][0]["bytes"]
    headroom = avail - need + old + 64 * KB
    plan = ok(world.plan(candidates=["lab/old"], headroom=str(headroom), download_rate="1MiB"))
    assert plan["verdict"] == "does_not_fit"
    sp = plan["served_purge"]
    assert sp and sp["would_fit"] is True and sp["items"] == ["lab/served@" + world.commits["served"]]
    assert "serving stops" in sp["downtime"] and "'target'" in sp["downtime"]
    assert sp["estimated_downtime_seconds"] is not None
    assert "only purging the served model" in plan["reason"]
    assert plan["purge"] == [] and plan["downtime"] is False
    failed = world.plan(candidates=["lab/old"], headroom=str(headroom), fail_on_does_not_fit=True)
    assert failed["failed"] is True and "does not fit" in failed["msg"] and failed["served_purge"]
    allowed = ok(world.plan(candidates=["lab/old"], headroom=str(headroom), allow_served_purge=True))
    assert allowed["verdict"] == "fits_after_purge" and allowed["downtime"] is True
    assert allowed["purge"][-1] == "lab/served@" + world.commits["served"]
    # model_purge deletes the served model only when allowed (no vLLM unit on this host)
    res = world.purge(allowed["purge"], check=True)
    assert res["failed"] and "rule: served" in res["msg"]
    before_free, before_usage = world.fs.free(), world.usage()
    res = ok(world.purge(allowed["purge"], allow_served_purge=True))
    measured, du = freed_measured(world, before_free, before_usage)
    assert du == res["planned_bytes"] == allowed["purge_bytes"] == measured


@pytest.mark.hub
def test_a_catalog_candidate_already_gone_is_excluded_and_a_name_the_store_lacks_refused(world):
    """The rerun of a purge whose model went before (its payload's unlink was refused, say): the
    catalog model is not in the cache, so nothing of it is left to purge and the plan goes on; a
    name that is no catalog model and not in the store is a mistake, refused before anything."""
    plan = ok(world.plan(candidates=["ghost", "lab/old"]))
    [absent] = [r for r in plan["excluded"] if r.get("rule") == "absent"]
    assert absent["item"] == "ghost" and "is not in the cache" in absent["why"], absent
    assert [c["item"] for c in plan["candidates"]] == ["lab/old"]
    fp = world.fingerprint()
    bad = world.plan(candidates=["lab/nothere", "lab/old"])
    assert bad.get("failed") and "remove it from candidates" in bad["msg"] and "lab/nothere" in bad["msg"], bad
    assert world.fingerprint() == fp


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


@pytest.mark.hub
def test_token_is_never_returned(world):
    hub = world.hub
    commit = hub.publish("lab/gated", {"config.json": b"{}", "model.safetensors": blob(11, 10 * KB)},
                         gated=True)
    models = dict(world.models, gated={"repo_id": "lab/gated", "revision": commit})
    token = hub.token
    hub.clear_log()
    res = ok(world.plan(models=models, target="gated", token=token, http_endpoint_trusted=True))
    assert res["target"]["download_bytes"] == 10 * KB + 2
    assert token not in json.dumps(res)
    assert hub.requests() and all(r["auth"] for r in hub.requests())   # the token was sent
    wrong = "hf_" + "x" * 30
    bad = world.plan(models=models, target="gated", token=wrong, http_endpoint_trusted=True)
    assert bad["failed"] and "lab/gated" in bad["msg"] and "token" in bad["msg"]
    assert wrong not in json.dumps(bad)


@pytest.mark.hub
def test_offline_tree_listing_explicit_bytes_and_unreachable_hub(world):
    dead = "http://127.0.0.1:9"   # discard port: nothing listens
    # the target is not cached yet: an unreachable Hub is a clear error that names the way out
    res = world.plan(endpoint=dead)
    assert res["failed"] and "cannot reach" in res["msg"] and "target_bytes" in res["msg"]
    # an explicit byte count needs no Hub
    res = ok(world.plan(endpoint=dead, target_bytes=5 * 1024 * KB))
    assert res["target"]["source"] == "explicit" and res["target"]["needed_bytes"] == 5 * 1024 * KB
    # once snapshot_download has cached the pinned commit's tree listing, no Hub is needed
    world.download("lab/target", world.commits["target-v2"])
    world.hub.clear_log()
    res = ok(world.plan(endpoint=dead))
    assert res["target"]["source"] == "tree_cache" and res["target"]["download_bytes"] == 0
    assert world.hub.requests() == []


# ------------------------------------------------------------------------------------ bad input
BAD_PLAN = [
    ("missing-store", {"cache_dir": "{tmp}/nope"}, "does not exist"),
    ("store-is-a-file", {"cache_dir": "{tmp}/file"}, "is not a directory"),
    ("no-store", {"cache_dir": None, "models_dir": None}, "one of the following is required"),
    ("unknown-target", {"target": "nope"}, "unknown model name 'nope' (target)"),
    ("unknown-keep", {"keep": ["nope"]}, "unknown model name 'nope' (keep)"),
    ("malformed-repo-id", {"models": {"t": {"repo_id": "org//bad", "revision": "main"}}}, "malformed"),
    ("malformed-candidate", {"candidates": ["a/b/c"]}, "malformed"),
    ("negative-headroom", {"headroom": "-5%"}, "negative"),
    ("negative-headroom-bytes", {"headroom": "-10G"}, "negative"),
    ("bad-headroom", {"headroom": "lots"}, "not a size"),
    ("negative-target-bytes", {"target_bytes": -1}, "negative"),
    ("candidate-not-in-store", {"candidates": ["org/absent"]}, "not in the model store"),
    ("candidate-protected", {"candidates": ["org/one"], "keep": ["t"],
                             "models": {"t": {"repo_id": "org/one", "revision": "a" * 40}}}, "protected"),
    ("record-malformed", {"deployment_record": "{tmp}/bad.json"}, "not valid JSON"),
]


def _bad_world(tmp_path):
    cache = tmp_path / "hub"
    synthetic_cache.add_revision(cache, "org/one", "a" * 40, {"config.json": b"{}", "model.safetensors": b"w" * 5000})
    (tmp_path / "file").write_text("x")
    (tmp_path / "bad.json").write_text("{not json")
    return cache


@pytest.mark.unit
@pytest.mark.parametrize("extra,words", [b[1:] for b in BAD_PLAN], ids=[b[0] for b in BAD_PLAN])
def test_disk_plan_bad_input(tmp_path, extra, words):
    cache = _bad_world(tmp_path)
    args = {"cache_dir": str(cache), "models": {"t": {"repo_id": "org/new", "revision": "b" * 40}},
            "target": "t", "target_bytes": 100, "vllm_unit": "",
            "deployment_record": str(tmp_path / "none.json")}
    for k, v in extra.items():
        args[k] = v.format(tmp=tmp_path) if isinstance(v, str) else v
    args = {k: v for k, v in args.items() if v is not None}
    fp = tree_fingerprint(tmp_path)
    res = run_module("disk_plan", args)
    assert res.get("failed") is True, res
    assert words in res["msg"], res["msg"]
    assert tree_fingerprint(tmp_path) == fp


@pytest.mark.unit
def test_a_store_still_to_be_created_is_planned_empty_only_when_allowed(tmp_path):
    """The preview of a first install: the store the install step would create does not exist."""
    missing = tmp_path / "lib" / "modelswap" / "hub"
    args = {"cache_dir": str(missing), "models": {"t": {"repo_id": "org/new", "revision": "b" * 40}},
            "target": "t", "target_bytes": 3_000_000, "vllm_unit": "",
            "deployment_record": str(tmp_path / "none.json")}
    refused = run_module("disk_plan", args)
    assert refused.get("failed") and "does not exist" in refused["msg"]
    res = run_module("disk_plan", dict(args, allow_missing_store=True))
    assert not res.get("failed"), res
    assert res["verdict"] == "fits" and res["purge"] == []
    assert res["target"]["download_bytes"] == 3_000_000
    # planned on the file system of the nearest existing parent; nothing was created
    assert res["filesystem"]["path"] == str(tmp_path) and not (tmp_path / "lib").exists()


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
