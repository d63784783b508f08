"""hf_snapshot against a Hub (or a disk) that lies: nothing it says makes the module touch what it
did not create, a served revision survives, and a token never crosses plain HTTP unasked.

The local Hub's faults play the liar: ``bad_listing`` (a file list with a path that climbs out, a
blob id with '/'), ``wrong_etag`` with ``like`` (an ETag that collides with a served revision's
blob) or with a random value (a file whose content equals a served one's). Real huggingface_hub,
the module run as Ansible runs it.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from ansible_collections.modelswap.vllm.plugins.module_utils.store import snapshot_check
from tests.support.modules import run_module
from tests.support.scratch_fs import tree_fingerprint
from tests.support.synthetic_cache import MB, git_blob_id
from tests.support.synthetic_cache import incompressible as blob

pytestmark = pytest.mark.hub

CANARY = b"precious, not modelswap's\n"


FILES = {
    "config.json": b'{"architectures": ["LlamaForCausalLM"]}\n',
    "tokenizer.json": b'{"model": {"vocab": {}}}\n' * 50,
    "model.safetensors": blob("t", 300_000),
}


@pytest.fixture
def run(local_hub, hf_env, tmp_path):
    """run(repo_id, **args) -> hf_snapshot's result (cache under tmp_path/cache unless local_dir)."""
    def call(repo_id, *, check_mode=False, **args):
        full = {"repo_id": repo_id, "endpoint": local_hub.url, "use_xet": False, "retry_delay": 0.05,
                "retries": 1, "cache_dir": str(tmp_path / "cache")}
        full.update(args)
        if full.get("local_dir"):
            full.pop("cache_dir", None)
        return run_module("hf_snapshot", full, check_mode=check_mode, env=hf_env)
    return call


@pytest.fixture
def canary(tmp_path) -> Path:
    path = tmp_path / "canary.txt"
    path.write_bytes(CANARY)
    return path


def resolve_gets(hub):
    return hub.requests(method="GET", endpoint="resolve")


def assert_intact_and_verified(cache: Path, repo_id: str, commit: str, files: dict):
    """Revision ``commit`` is whole: every file readable and right, every blob named by its hash,
    its manifest still verifies (what vllm_service checks before it starts a model)."""
    snap = cache / ("models--" + repo_id.replace("/", "--")) / "snapshots" / commit
    for name, data in files.items():
        link = snap / name
        assert link.read_bytes() == data, name
        target = link.resolve()
        want = hashlib.sha256(data).hexdigest() if name.endswith(".safetensors") else git_blob_id(data)
        assert target.name == want, name
        digest = hashlib.sha256 if len(want) == 64 else None
        got = digest(target.read_bytes()).hexdigest() if digest else git_blob_id(target.read_bytes())
        assert got == want, name
    state = snapshot_check.check("m", repo_id, commit, cache_dir=str(cache), mode="full")
    assert state["verified"] is True, state["reason"]


# ------------------------------------------------------------------------------------------ item 1
@pytest.mark.parametrize("layout, fault, shown", [
    ("cache", {"target": "config.json", "path": "../../../../canary.txt"}, "'../../../../canary.txt'"),
    ("cache", {"target": "config.json", "path": "{canary}"}, "is absolute"),
    ("cache", {"target": "config.json", "oid": "../../../canary.txt"}, "blob id '../../../canary.txt'"),
    ("cache", {"target": "*.safetensors", "lfs_oid": "../../../canary.txt"}, "LFS sha256 '../../../canary.txt'"),
    ("cache", {"target": "config.json", "path": "sub//config.json", "add": True}, "empty segment"),
    ("local_dir", {"target": "config.json", "path": "../../canary.txt"}, "'../../canary.txt'"),
    ("local_dir", {"target": "tokenizer.json", "path": "../../canary.txt", "add": True}, "'..' segment"),
    ("local_dir_check", {"target": "config.json", "path": "../../canary.txt"}, "'..' segment"),
])
def test_a_listing_that_climbs_out_is_refused_before_anything_is_touched(run, local_hub, tmp_path, canary,
                                                                         layout, fault, shown):
    repo_id = "evil/listing-%s" % layout.replace("_", "-")
    commit = local_hub.publish(repo_id, FILES)
    fault = {k: (v.format(canary=canary) if isinstance(v, str) else v) for k, v in fault.items()}
    local_hub.fault("bad_listing", endpoint="tree", repo=repo_id, count=None, **fault)
    # the destination exists (an earlier commit's local_dir; a killed run's snapshot folder), so a
    # climbing path leads to the canary: that file "is present", fails verification, gets deleted
    if layout.startswith("local_dir"):
        target = tmp_path / "models" / "m"
        target.mkdir(parents=True)
        where = {"local_dir": str(target)}
    else:
        (tmp_path / "cache" / ("models--" + repo_id.replace("/", "--")) / "snapshots" / commit).mkdir(parents=True)
        where = {}
    before = tree_fingerprint(tmp_path)
    r = run(repo_id, revision=commit, check_mode=layout.endswith("_check"), **where)
    assert canary.read_bytes() == CANARY, r.get("msg")
    assert r["failed"] is True and r["cause"] == "bad_listing", r["msg"]
    assert shown.format(canary=canary) in r["msg"] and repo_id in r["msg"]
    assert "nothing was written or deleted" in r["msg"] and "check the endpoint" in r["msg"]
    assert tree_fingerprint(tmp_path) == before                 # not a file created, changed or removed
    assert resolve_gets(local_hub) == [] and local_hub.requests(method="HEAD", endpoint="resolve") == []


@pytest.mark.parametrize("tamper, shown", [
    ({"rename": "../../../../canary.txt"}, "'../../../../canary.txt' has a '..' segment"),
    ({"blob_id": "../../../canary.txt"}, "blob id '../../../canary.txt'"),
    ({"blob_id": "A" * 40}, "is not a blob id"),
])
def test_a_tampered_tree_cache_is_refused_and_the_revision_stays_intact(
        run, local_hub, tmp_path, canary, tamper, shown):
    repo_id = "evil/tree-cache"
    commit = local_hub.publish(repo_id, FILES)
    first = run(repo_id, revision=commit)
    assert first.get("failed") is not True, first.get("msg")
    cache = tmp_path / "cache"
    repo = cache / "models--evil--tree-cache"
    os.unlink(first["manifest"])               # the tree cache alone now says what the commit holds
    tree_file = repo / "trees" / f"{commit}.json"
    tree = json.loads(tree_file.read_text())
    info = tree["files"].pop("config.json")
    if "rename" in tamper:
        tree["files"][tamper["rename"]] = info
    else:
        tree["files"]["config.json"] = dict(info, blob_id=tamper["blob_id"])
    tree_file.write_text(json.dumps(tree))
    local_hub.clear_log()
    before = tree_fingerprint(tmp_path)
    for offline in (False, True):
        r = run(repo_id, revision=commit, offline=offline, reverify=True)
        assert canary.read_bytes() == CANARY, r.get("msg")
        assert r["failed"] is True and r["cause"] == "bad_listing", r["msg"]
        assert str(tree_file) in r["msg"] and shown in r["msg"]
        assert "remove that file" in r["msg"] and "nothing was written or deleted" in r["msg"]
    assert tree_fingerprint(tmp_path) == before and canary.read_bytes() == CANARY
    assert local_hub.requests() == []           # a pinned commit's cached listing: refused offline
    for name, data in FILES.items():
        assert (repo / "snapshots" / commit / name).read_bytes() == data


# ------------------------------------------------------------------------------------------ item 2
def served_revision(run, hub, repo_id, files):
    commit = hub.publish(repo_id, files)
    r = run(repo_id, revision=commit)
    assert r.get("failed") is not True and r["verification"]["ok"], r.get("msg")
    return commit


def served_and_newer(run, hub, repo_id, changes):
    """Revision A fetched and verified (the served one), then B = A with `changes` published:
    (A's commit, B's files, B's commit)."""
    served = served_revision(run, hub, repo_id, FILES)
    newer = dict(FILES, **changes)
    return served, newer, hub.publish(repo_id, newer)


def test_a_wrong_etag_equal_to_a_served_blob_leaves_the_served_revision_whole(run, local_hub, tmp_path):
    repo_id = "evil/collide"
    cache = tmp_path / "cache"
    served, newer, commit_b = served_and_newer(run, local_hub, repo_id,
                                               {"config.json": b'{"architectures": ["Other"]}\n'})
    # B's small (non-LFS) config.json always arrives under the ETag of A's config.json blob
    local_hub.fault("wrong_etag", method="HEAD", repo=repo_id, file="config.json",
                    like=f"{served}:config.json", count=None)
    r = run(repo_id, revision=commit_b)
    assert r["failed"] is True and r["cause"] == "corrupt", r["msg"]
    assert "config.json" in r["msg"] and "wrong ETag" in r["msg"]
    assert [k["blob"] for k in r["kept_blobs"]] == [git_blob_id(FILES["config.json"])] * 2
    assert "snapshot %s links to it" % served[:12] in r["kept_blobs"][0]["because"]
    assert_intact_and_verified(cache, repo_id, served, FILES)
    assert not (cache / "models--evil--collide" / "modelswap" / f"{commit_b}.json").exists()
    again = run(repo_id, revision=served, offline=True, reverify=True)     # hashing agrees
    assert again.get("failed") is not True and again["changed"] is False, again.get("msg")
    local_hub.clear_faults()
    fixed = run(repo_id, revision=commit_b)                               # the truth, later: B is fetched
    assert fixed.get("failed") is not True, fixed.get("msg")
    assert Path(fixed["snapshot_path"], "config.json").read_bytes() == newer["config.json"]
    assert_intact_and_verified(cache, repo_id, served, FILES)


def test_same_content_under_a_random_wrong_etag_leaves_the_served_revision_whole(run, local_hub, tmp_path):
    repo_id = "evil/same-content"
    cache = tmp_path / "cache"
    # B keeps config.json as it is (same blob as A's) and changes another file
    served, _, commit_b = served_and_newer(
        run, local_hub, repo_id, {"tokenizer.json": b'{"model": {"vocab": {"a": 1}}}\n'})
    local_hub.fault("wrong_etag", method="HEAD", repo=repo_id, file="config.json", count=None)
    r = run(repo_id, revision=commit_b)
    assert r["failed"] is True and r["cause"] == "corrupt", r["msg"]
    assert "config.json" in r["msg"]
    assert {k["blob"] for k in r["kept_blobs"]} == {git_blob_id(FILES["config.json"])}
    assert_intact_and_verified(cache, repo_id, served, FILES)
    blobs = sorted(p.name for p in (cache / "models--evil--same-content" / "blobs").iterdir())
    made_up = hashlib.sha1(b"lab-wrong-etag:" + git_blob_id(FILES["config.json"]).encode()).hexdigest()
    assert made_up not in blobs                 # the wrongly named copy was cleaned up
    # the served revision also survives a verified manifest whose links someone removed
    os.unlink(cache / "models--evil--same-content" / "snapshots" / served / "config.json")
    r = run(repo_id, revision=commit_b)
    assert r["failed"] is True
    assert (cache / "models--evil--same-content" / "blobs" / git_blob_id(FILES["config.json"])).exists()
    assert "the verified manifest of %s lists it" % served[:12] in r["kept_blobs"][0]["because"]


# ------------------------------------------------------------------------------------------ item 8
def test_a_token_is_never_sent_to_plain_http_unless_the_endpoint_is_trusted(run, local_hub, hf_env, tmp_path):
    token = local_hub.token
    commit = local_hub.publish("evil/gated", FILES, gated=True)
    r = run("evil/gated", revision="main", token=token)
    assert r["failed"] is True and r["cause"] == "insecure_endpoint", r["msg"]
    assert "clear text" in r["msg"] and local_hub.url in r["msg"] and "http_endpoint_trusted=true" in r["msg"]
    assert token not in json.dumps(r)
    assert local_hub.requests() == []                       # refused before any request
    assert not (tmp_path / "cache").exists()
    # the endpoint from HF_ENDPOINT counts the same
    args = {"repo_id": "evil/gated", "revision": commit, "use_xet": False, "token": token,
            "cache_dir": str(tmp_path / "cache")}
    r = run_module("hf_snapshot", args, env=hf_env)
    assert r["failed"] is True and r["cause"] == "insecure_endpoint" and local_hub.requests() == []
    # in check mode too (the preview's controller-side listing)
    assert run("evil/gated", revision=commit, token=token, check_mode=True)["cause"] == "insecure_endpoint"
    assert local_hub.requests() == []
    ok = run("evil/gated", revision=commit, token=token, http_endpoint_trusted=True)
    assert ok.get("failed") is not True and ok["changed"] is True, ok.get("msg")
    assert local_hub.requests() and all(q["auth"] for q in local_hub.requests(endpoint="resolve"))
    # no token: plain HTTP stays allowed (that is what the lab's other tests do throughout)
    public = local_hub.publish("evil/public", {"config.json": b"{}\n"})
    assert run("evil/public", revision=public).get("failed") is not True


# ------------------------------------------------------------------------------------------ bytes
def test_bytes_received_counts_a_transfer_that_restarted_from_zero(run, local_hub):
    repo_id = "evil/restart"
    data = blob("r", 3 * MB)
    commit = local_hub.publish(repo_id, {"config.json": b"{}\n", "w.safetensors": data})
    # cut after 1.5 MiB (the client resumes from 1 MiB with a Range), then ignore that Range: the
    # library starts the file over from byte 0
    local_hub.fault("cut", method="GET", repo=repo_id, file="w.safetensors", after=MB + MB // 2)
    local_hub.fault("ignore_range", method="GET", repo=repo_id, file="w.safetensors")
    r = run(repo_id, revision=commit)
    assert r.get("failed") is not True, r.get("msg")
    gets = [q for q in resolve_gets(local_hub) if q["path"].endswith("/w.safetensors")]
    assert len(gets) == 2 and gets[1]["range"] == "bytes=%d-" % MB and gets[1]["status"] == 200
    assert r["bytes_downloaded"] == len(data) + 3                 # the files' bytes
    assert r["bytes_received"] == len(data) + 3 + MB              # what arrived: 1 MiB more
    assert r["bytes_received"] > r["bytes_downloaded"]
