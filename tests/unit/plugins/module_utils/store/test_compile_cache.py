"""store.compile_cache: vLLM's per-model cache folders listed, judged against the store, and removed
only inside the root; the module as Ansible runs it (check mode, diff, listed, a refused root)."""
from __future__ import annotations

import os

import pytest

from ansible_collections.modelswap.vllm.plugins.module_utils.store import compile_cache as cc
from tests.support.modules import run_module

pytestmark = pytest.mark.unit


def cache(root, folder, size=10_000):
    path = root / folder / "torch_compile_cache" / "0a1b2c3d4e" / "rank_0_0" / "backbone"
    path.mkdir(parents=True)
    (path / "artifact").write_bytes(b"x" * size)
    return root / folder


def stored(store, repo_id, snapshot=True):
    folder = store / ("models--" + repo_id.replace("/", "--"))
    (folder / "snapshots").mkdir(parents=True)
    if snapshot:
        (folder / "snapshots" / ("a" * 40)).mkdir()


@pytest.fixture
def host(tmp_path):
    root, store = tmp_path / "cache" / "vllm", tmp_path / "hub"
    store.mkdir()
    for repo in ("lab/tiny-a", "lab/tiny-b", "lab/tiny-c"):
        cache(root, "models--" + repo.replace("/", "--"))
    stored(store, "lab/tiny-a")
    stored(store, "lab/tiny-c", snapshot=False)        # a repo folder a purge emptied
    (root / "torch_compile_cache").mkdir()              # vLLM's own, from before per-model roots
    (root / "models--lab--linked").symlink_to(tmp_path)  # a link is never followed nor removed
    return root, store


def test_entries_are_the_model_folders_with_their_bytes(host):
    root = host[0]
    found = cc.entries(str(root))
    assert [(e["folder"], e["repo_id"]) for e in found] == [
        ("models--lab--tiny-a", "lab/tiny-a"), ("models--lab--tiny-b", "lab/tiny-b"), ("models--lab--tiny-c", "lab/tiny-c")]
    assert all(e["bytes"] >= 10_000 for e in found)
    assert cc.entries(str(root / "missing")) == []


def test_the_plan_prunes_what_the_store_no_longer_holds_except_what_is_kept(host):
    root, store = host
    held = cc.store_repos(str(store))
    assert held == {"lab/tiny-a"}
    prune, kept = cc.prune_plan(cc.entries(str(root)), held, keep=["lab/tiny-b"])
    assert [r["repo_id"] for r in prune] == ["lab/tiny-c"]
    assert {r["repo_id"]: r["reason"] for r in kept} == {
        "lab/tiny-a": "kept: the model is in the store", "lab/tiny-b": "kept: named in keep (served or its fallback)"}


def test_remove_stays_inside_the_root_and_reports_what_is_left(host, tmp_path):
    root = host[0]
    rows = [{"folder": "models--lab--tiny-c", "repo_id": "lab/tiny-c", "bytes": 1},
            {"folder": "models--lab--linked", "repo_id": "lab/linked", "bytes": 1},
            {"folder": "../hub", "repo_id": "x", "bytes": 1},
            {"folder": "models--lab--gone", "repo_id": "lab/gone", "bytes": 1}]
    removed, left = cc.remove(str(root), rows)
    assert [r["folder"] for r in removed] == ["models--lab--tiny-c", "models--lab--gone"]
    assert {r["folder"]: r["cause"] for r in left} == {
        "models--lab--linked": "no longer a folder (a link or a file): left alone",
        "../hub": "not a model folder directly under %s" % root}
    assert not (root / "models--lab--tiny-c").exists() and (tmp_path / "hub").is_dir()
    assert os.path.islink(root / "models--lab--linked") and (root / "models--lab--tiny-a").is_dir()


@pytest.mark.parametrize("root", ["relative/path", "/", "//"])
def test_a_root_that_cannot_hold_caches_is_refused(root):
    assert cc.root_problem(root)


def test_the_module_previews_prunes_then_has_nothing_to_do(host):
    root, store = host
    args = {"root": str(root), "store": str(store), "keep": ["lab/tiny-b"]}
    preview = run_module("compile_cache", args, check_mode=True, diff=True)
    assert preview["changed"] and [r["folder"] for r in preview["pruned"]] == ["models--lab--tiny-c"]
    assert "models--lab--tiny-c" in preview["diff"]["before"] and "models--lab--tiny-c" not in preview["diff"]["after"]
    assert (root / "models--lab--tiny-c").is_dir()                          # check mode removed nothing
    done = run_module("compile_cache", args)
    assert done["changed"] and done["freed_bytes"] == preview["freed_bytes"] >= 10_000
    assert not (root / "models--lab--tiny-c").exists() and (root / "models--lab--tiny-b").is_dir()
    assert "1 pruned" in done["msg"]
    again = run_module("compile_cache", args)
    assert not again["changed"] and again["pruned"] == []


def test_the_module_lists_without_removing(host):
    root, store = host
    out = run_module("compile_cache", {"root": str(root), "store": str(store), "state": "listed"})
    assert not out["changed"] and out["pruned"] == [] and (root / "models--lab--tiny-c").is_dir()
    reasons = {r["folder"]: r["reason"] for r in out["caches"]}
    assert reasons["models--lab--tiny-c"] == "would be pruned: the model is no longer in the store"


def test_the_module_refuses_a_relative_root_and_changes_nothing(host):
    store = host[1]
    out = run_module("compile_cache", {"root": "cache/vllm", "store": str(store)})
    assert out["failed"] and "must be an absolute path" in out["msg"] and not out["changed"]
