"""Bad input for the modules that read a Hub's file list or send its token (hf_snapshot, disk_plan):
what was tried, the error it gets, and that nothing changed on disk (a fingerprint of every file,
link and folder under the test's folder, a canary outside the cache included).

No Hub is needed: the endpoint is a port where nothing listens, so a row that reached the network
would fail with "cannot reach" instead of the error it names. Each row runs the module as Ansible
runs it on a host.
"""
from __future__ import annotations

import hashlib
import json

import pytest

from ansible_collections.modelswap.vllm.plugins.module_utils.store import hf_manifest
from ansible_collections.modelswap.vllm.plugins.module_utils.hub import hub_client
from tests.support import synthetic_cache
from tests.support.modules import run_module
from tests.support.scratch_fs import tree_fingerprint

pytestmark = pytest.mark.unit

DEAD = "http://127.0.0.1:9"          # discard port: nothing listens
REPO_ID = "o/r"
COMMIT = synthetic_cache.commit_for("bad-inputs")
FILES = {"config.json": b'{"a": 1}\n', "model.safetensors": b"w" * 1000}
CANARY = b"not modelswap's\n"
TOKEN = "hf_" + "t" * 34


def listing() -> dict:
    out = {}
    for path, data in FILES.items():
        out[path] = {"size": len(data), "blob_id": hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()}
        if path.endswith(".safetensors"):
            out[path]["lfs_sha256"] = hashlib.sha256(data).hexdigest()
    return out


def tampered(change) -> dict:
    """The commit's listing with one change: ("rename", new path) or (field, value) on config.json
    (or on model.safetensors for lfs_sha256)."""
    files = listing()
    kind, value = change
    if kind == "rename":
        files[value] = files.pop("config.json")
    else:
        files["model.safetensors" if kind == "lfs_sha256" else "config.json"][kind] = value
    return files


def write_tree(root, files: dict) -> None:
    data = {"format_version": 1, "files": {p: dict(e, **({"lfs_size": e["size"]} if "lfs_sha256" in e else {}))
                                           for p, e in files.items()}}
    hf_manifest.atomic_write_json(hub_client.tree_path(str(root), COMMIT), data)


@pytest.fixture
def world(tmp_path):
    """A cache holding o/r@COMMIT (blobs, links) and a canary beside it; returns tmp_path."""
    synthetic_cache.add_revision(tmp_path / "cache", REPO_ID, COMMIT, FILES)
    (tmp_path / "canary.txt").write_bytes(CANARY)
    (tmp_path / "models" / "r").mkdir(parents=True)
    return tmp_path


def repo_path(tmp_path):
    return tmp_path / "cache" / "models--o--r"


def hf_snapshot(tmp_path, extra: dict, env=None, check_mode=False) -> dict:
    args = {"repo_id": REPO_ID, "revision": COMMIT, "endpoint": DEAD, "use_xet": False, "retries": 0,
            "cache_dir": str(tmp_path / "cache")}
    args.update(extra)
    if args.get("local_dir"):
        args.pop("cache_dir")
    if args.get("endpoint") is None:
        args.pop("endpoint")
    env = dict({"HF_HOME": str(tmp_path / "hf-home"), "HF_TOKEN": "", "HF_HUB_OFFLINE": "0"}, **(env or {}))
    return run_module("hf_snapshot", args, env=env, check_mode=check_mode)


def disk_plan(tmp_path, extra: dict) -> dict:
    args = {"cache_dir": str(tmp_path / "cache"), "models": {"t": {"repo_id": REPO_ID, "revision": COMMIT}},
            "target": "t", "deployment_record": str(tmp_path / "deployment.json"), "vllm_unit": "",
            "endpoint": DEAD}
    args.update(extra)
    return run_module("disk_plan", args, env={"HF_HOME": str(tmp_path / "hf-home"), "HF_TOKEN": ""})


# (id, module, how the world is spoiled, module args, extra env, error substrings)
ROWS = [
    # hf_snapshot: huggingface_hub's tree cache, tampered (cache mode)
    ("tree-path-climbs", "hf_snapshot", ("tree", ("rename", "../../../../canary.txt")), {}, {},
     ["'../../../../canary.txt' has a '..' segment", "trees", "remove that file"]),
    ("tree-path-absolute", "hf_snapshot", ("tree", ("rename", "/etc/hostname")), {}, {}, ["is absolute"]),
    ("tree-path-empty-segment", "hf_snapshot", ("tree", ("rename", "sub//config.json")), {}, {}, ["empty segment"]),
    ("tree-path-dot-segment", "hf_snapshot", ("tree", ("rename", "./config.json")), {}, {}, ["'.' segment"]),
    ("tree-path-inner-dotdot", "hf_snapshot", ("tree", ("rename", "sub/../../x")), {}, {}, ["'..' segment"]),
    ("tree-path-newline", "hf_snapshot", ("tree", ("rename", "config.json\nExecStart=/bin/sh")), {}, {},
     ["control character"]),
    ("tree-path-nul", "hf_snapshot", ("tree", ("rename", "config.json\0x")), {}, {}, ["control character"]),
    ("tree-oid-climbs", "hf_snapshot", ("tree", ("blob_id", "../../../canary.txt")), {}, {},
     ["blob id '../../../canary.txt'", "40 or 64 lowercase hex"]),
    ("tree-oid-uppercase", "hf_snapshot", ("tree", ("blob_id", "A" * 40)), {}, {}, ["is not a blob id"]),
    ("tree-oid-short", "hf_snapshot", ("tree", ("blob_id", "a" * 39)), {}, {}, ["is not a blob id"]),
    ("tree-oid-trailing-newline", "hf_snapshot", ("tree", ("blob_id", "a" * 40 + "\n")), {}, {},
     ["is not a blob id"]),
    ("tree-lfs-climbs", "hf_snapshot", ("tree", ("lfs_sha256", "../" + "a" * 61)), {}, {}, ["LFS sha256"]),
    ("tree-lfs-not-sha256", "hf_snapshot", ("tree", ("lfs_sha256", "a" * 40)), {}, {}, ["is not a sha256"]),
    ("tree-size-negative", "hf_snapshot", ("tree", ("size", -1)), {}, {}, ["size -1"]),
    # hf_snapshot: local_dir mode's tree cache, and a manifest's copy of the listing
    ("local-dir-tree-climbs", "hf_snapshot", ("local_tree", ("rename", "../../canary.txt")), {"local_dir": "{models}"},
     {}, ["'../../canary.txt' has a '..' segment", ".cache/huggingface/trees"]),
    ("manifest-listing-climbs", "hf_snapshot", ("manifest", ("rename", "../../../../canary.txt")), {}, {},
     ["the manifest", "'..' segment", "remove that manifest"]),
    # hf_snapshot: a token and a plain http:// endpoint nobody said is trusted
    ("token-over-http", "hf_snapshot", None, {"token": TOKEN}, {},
     ["refusing to fetch o/r", "clear text", DEAD, "http_endpoint_trusted=true", "nothing was sent"]),
    ("token-over-http-from-env", "hf_snapshot", None, {"token": TOKEN, "endpoint": None}, {"HF_ENDPOINT": DEAD},
     ["clear text", DEAD]),
    ("token-over-http-check-mode", "hf_snapshot", None, {"token": TOKEN, "_check": True}, {}, ["clear text"]),
    # disk_plan
    ("plan-token-over-http", "disk_plan", None, {"token": TOKEN}, {},
     ["refusing to list o/r@", "clear text", "http_endpoint_trusted=true"]),
    ("plan-tree-path-climbs", "disk_plan", ("tree", ("rename", "../../../../canary.txt")), {}, {},
     ["tree cache", "'..' segment", "nothing was written or deleted"]),
    ("plan-tree-oid-climbs", "disk_plan", ("tree", ("blob_id", "../x")), {}, {}, ["blob id '../x'"]),
]


@pytest.mark.parametrize("row_id, module, spoil, extra, env, words", ROWS, ids=[r[0] for r in ROWS])
def test_bad_input_is_refused_clearly_and_changes_nothing(world, row_id, module, spoil, extra, env, words):
    tmp_path = world
    extra = {k: (v.format(models=tmp_path / "models" / "r") if isinstance(v, str) else v) for k, v in extra.items()}
    if spoil is not None:
        where, change = spoil
        files = tampered(change)
        if where == "tree":
            write_tree(repo_path(tmp_path), files)
        elif where == "local_tree":
            write_tree(tmp_path / "models" / "r" / ".cache" / "huggingface", files)
        else:
            snap = str(repo_path(tmp_path) / "snapshots" / COMMIT)
            manifest = hf_manifest.build_manifest(repo_id=REPO_ID, revision=COMMIT, commit=COMMIT, endpoint=DEAD,
                                                  layout="cache", snapshot=snap, listing=files, verified={}, mode="full",
                                                  patterns={}, tool={})
            hf_manifest.atomic_write_json(hf_manifest.manifest_path(str(repo_path(tmp_path)), COMMIT), manifest)
    before = tree_fingerprint(tmp_path)
    check_mode = extra.pop("_check", False)
    if module == "hf_snapshot":
        r = hf_snapshot(tmp_path, extra, env, check_mode=check_mode)
    else:
        r = disk_plan(tmp_path, extra)
    assert r.get("failed") is True, r
    for word in words:
        assert word in r["msg"], (word, r["msg"])
    assert "cannot reach" not in r["msg"]                     # refused before any request
    assert TOKEN not in json.dumps(r)
    assert (tmp_path / "canary.txt").read_bytes() == CANARY
    assert tree_fingerprint(tmp_path) == before, "something changed on disk"


def test_the_table_covers_both_modules():
    assert len(ROWS) == 22
    assert {r[1] for r in ROWS} == {"hf_snapshot", "disk_plan"}
