"""store_scan and model_store: the fast scanner agrees with huggingface_hub, and predicted freed bytes are exact.

Each deletion case builds a real cache on disk, predicts with DeletionSimulator, performs the
deletion the way model_purge does (huggingface_hub's delete strategy, rmtree for plain dirs) and
measures the allocated bytes that left the tree (distinct inodes, st_blocks) — an independent count.
"""
from __future__ import annotations

import os
import shutil

import pytest
from huggingface_hub import scan_cache_dir

from ansible_collections.modelswap.vllm.plugins.module_utils.store import cache_layout
from ansible_collections.modelswap.vllm.plugins.module_utils.store import model_store
from ansible_collections.modelswap.vllm.plugins.module_utils.store import store_scan
from tests.support import synthetic_cache
from tests.support.scratch_fs import tree_usage
from tests.support.synthetic_cache import A, B, C, W1, W2

pytestmark = pytest.mark.unit


def build(tmp_path):
    cache = tmp_path / "hub"
    models = tmp_path / "models"
    models.mkdir()
    synthetic_cache.add_two_repos(cache)
    synthetic_cache.add_orphan(cache, "org/two", "f" * 64, 5000)
    synthetic_cache.make_plain_dir(models, "plain", {"w.bin": b"p" * 7000, "sub/c.json": b"{}"})
    return cache, models


def test_scan_agrees_with_huggingface_hub(tmp_path):
    cache, models = build(tmp_path)
    store = store_scan.scan_store(str(cache), str(models))
    hf = scan_cache_dir(cache)
    assert not hf.warnings
    assert {r.repo_id for r in hf.repos} == {r.repo_id for r in store.repos.values()}
    for hrepo in hf.repos:
        repo = store.repo(hrepo.repo_id)
        assert repo.size == hrepo.size_on_disk
        assert set(repo.revisions) == {r.commit_hash for r in hrepo.revisions}
        for hrev in hrepo.revisions:
            assert repo.revision_size(hrev.commit_hash) == hrev.size_on_disk
            assert repo.revisions[hrev.commit_hash].refs == set(hrev.refs)
            assert repo.revisions[hrev.commit_hash].files == len(hrev.files)
        assert repo.last_used == hrepo.last_accessed
        assert not repo.problems
    assert {o.path for o in store.orphans} == {str(i.file_path) for i in hf.incomplete_files}
    assert store.dirs["plain"].size == 7002 and store.dirs["plain"].files == 2


def _hf_delete(cache, commits):
    strategy = scan_cache_dir(cache).delete_revisions(*commits)
    strategy.execute()
    return strategy.expected_freed_size


# (case id, ordered steps, expected apparent bytes freed by the regular files that go)
DELETIONS = [
    # one revision of two: only the config blob and refs/snapshot metadata go, weights shared
    ("revision-sharing-blobs", [("revision", "org/one", A)], len(W1["config.json"])),
    # the other revision too: now the whole repo folder goes (weights counted once)
    ("both-revisions-one-by-one", [("revision", "org/one", A), ("revision", "org/one", B)],
     len(W1["config.json"]) + len(W2["config.json"]) + 9000 + 3000 + len(B)),
    ("whole-repo", [("repo", "org/one", "")],
     len(W1["config.json"]) + len(W2["config.json"]) + 9000 + 3000 + len(B)),
    ("repo-with-orphan", [("repo", "org/two", "")], 8 + 20000 + 5000 + len(C)),
    ("orphan-then-repo", [("orphan", "org/two", ""), ("repo", "org/two", "")],
     8 + 20000 + 5000 + len(C)),
    ("plain-dir", [("dir", "plain", "")], 7002),
]


@pytest.mark.parametrize("steps,apparent", [c[1:] for c in DELETIONS], ids=[c[0] for c in DELETIONS])
def test_predicted_bytes_equal_measured(tmp_path, steps, apparent):
    cache, models = build(tmp_path)
    store = store_scan.scan_store(str(cache), str(models))
    sim = model_store.DeletionSimulator(store)
    predicted = predicted_size = 0
    before = tree_usage(cache, models)
    for kind, repo_id, commit in steps:
        folder = synthetic_cache.folder_for(repo_id) if kind != "dir" else ""
        if kind == "orphan":
            orphan = store.repos[folder].orphans[0]
            item = model_store.Item("orphan", folder=folder, path=orphan.path)
        elif kind == "dir":
            item = model_store.Item("dir", name=repo_id, path=str(models / repo_id))
        else:
            item = model_store.Item(kind, folder=folder, commit=commit)
        effect = sim.apply(item)
        predicted += effect.bytes
        predicted_size += effect.size
        # do it for real, the way model_purge does
        if kind == "dir":
            shutil.rmtree(models / repo_id)
        elif kind == "orphan":
            os.unlink(item.path)
        else:
            commits = [commit] if kind == "revision" else list(store.repos[folder].revisions)
            _hf_delete(cache, commits)
            if effect.removes_repo:
                shutil.rmtree(cache / ".locks" / folder, ignore_errors=True)
    measured = before - tree_usage(cache, models)
    assert predicted == measured > 0
    assert predicted_size == apparent


def test_step_after_repo_is_gone_frees_nothing(tmp_path):
    cache, models = build(tmp_path)
    store = store_scan.scan_store(str(cache), str(models))
    sim = model_store.DeletionSimulator(store)
    folder = synthetic_cache.folder_for("org/one")
    assert sim.apply(model_store.Item("repo", folder=folder)).bytes > 0
    assert sim.apply(model_store.Item("revision", folder=folder, commit=A)).bytes == 0
    assert sim.apply(model_store.Item("repo", folder=folder)).bytes == 0


def test_hardlinked_file_is_freed_only_with_its_last_link(tmp_path):
    cache, models = build(tmp_path)
    blob = next((cache / synthetic_cache.folder_for("org/two") / "blobs").glob("*"))
    os.link(blob, models / "plain" / "linked.safetensors")
    store = store_scan.scan_store(str(cache), str(models))
    sim = model_store.DeletionSimulator(store)
    alone_dir = model_store.DeletionSimulator(store).apply(model_store.Item("dir", name="plain")).bytes
    first = sim.apply(model_store.Item("repo", folder=synthetic_cache.folder_for("org/two"))).bytes
    second = sim.apply(model_store.Item("dir", name="plain")).bytes
    big = os.lstat(blob).st_blocks * 512
    assert second - alone_dir == big     # the weights go when the second link goes
    total_before = tree_usage(cache, models)
    _hf_delete(cache, [C])
    shutil.rmtree(models / "plain")
    shutil.rmtree(cache / ".locks", ignore_errors=True)
    assert first + second == total_before - tree_usage(cache, models)


def test_foreign_and_broken_links_are_reported(tmp_path):
    cache, models = build(tmp_path)
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"x" * 10)
    snap = cache / synthetic_cache.folder_for("org/two") / "snapshots" / C
    os.symlink(str(outside), snap / "evil.bin")
    os.symlink("../../blobs/" + "0" * 64, snap / "gone.bin")
    store = store_scan.scan_store(str(cache), "")
    rev = store.repo("org/two").revisions[C]
    assert rev.foreign_links and str(outside) in rev.foreign_links[0]
    assert rev.broken_links == [str(snap / "gone.bin")]
    assert any("broken" in p for p in store.repo("org/two").problems)


def test_shared_xet_store_payload_counted_once_and_only_when_all_links_go(tmp_path):
    """Two repos link one payload of the cache-wide shared store (huggingface_hub >= 2.x Xet)."""
    from huggingface_hub.utils import _shared_blobs

    cache = tmp_path / "hub"
    payload_hash = "ab" + "c" * 62
    store_dir = cache / "blobs"
    (store_dir / "ab").mkdir(parents=True)
    (store_dir / _shared_blobs.SHARED_BLOBS_MARKER_NAME).write_text("1\n")
    payload = store_dir / "ab" / payload_hash
    payload.write_bytes(b"S" * 50000)
    refs = []
    for repo_id, commit in (("org/x", A), ("org/y", B)):
        folder = synthetic_cache.folder_for(repo_id)
        etag = "e" * 64
        blobs = cache / folder / "blobs"
        blobs.mkdir(parents=True)
        os.symlink("../../blobs/ab/" + payload_hash, blobs / etag)
        snap = cache / folder / "snapshots" / commit
        snap.mkdir(parents=True)
        os.symlink("../../blobs/" + etag, snap / "model.safetensors")
        refs.append("%s/blobs/%s" % (folder, etag))
    manifest = "".join(r + "\n" for r in refs)
    (store_dir / "ab" / (payload_hash + ".refs")).write_text(manifest)
    store = store_scan.scan_store(str(cache), "")
    assert list(store.shared) == [str(payload)]
    sim = model_store.DeletionSimulator(store)
    x = sim.apply(model_store.Item("repo", folder=synthetic_cache.folder_for("org/x")))
    y = sim.apply(model_store.Item("repo", folder=synthetic_cache.folder_for("org/y")))
    assert x.size == 0 and y.size == 50000 + len(manifest)  # payload and its manifest
    # huggingface_hub agrees: one repo frees no payload, both free it once
    hf = scan_cache_dir(cache)
    assert hf.delete_revisions(A).expected_freed_size == 0
    assert hf.delete_revisions(A, B).expected_freed_size == 50000
    before = tree_usage(cache)
    hf.delete_revisions(A, B).execute()
    assert x.bytes + y.bytes == before - tree_usage(cache)


@pytest.mark.parametrize("repo_id,ok", [
    ("org/name", True), ("gpt2", True), ("Org-1/Name_2.v3", True),
    ("org//name", False), ("a/b/c", False), ("org/na me", False), ("-org/name", False),
    ("org/name-", False), ("org/na--me", False), ("org/..", False), ("org/name.git", False),
    ("", False), ("org/" + "x" * 97, False), ("café/x", False),
])
def test_validate_repo_id(repo_id, ok):
    if ok:
        assert cache_layout.validate_repo_id(repo_id) == repo_id
    else:
        with pytest.raises(cache_layout.StoreError, match="malformed|non-empty"):
            cache_layout.validate_repo_id(repo_id)


def test_listing_drops_removed_items(tmp_path):
    cache, models = build(tmp_path)
    store = store_scan.scan_store(str(cache), str(models))
    before = model_store.listing(store)
    after = model_store.listing(store, [model_store.Item("revision", folder=synthetic_cache.folder_for("org/one"), commit=A)])
    assert len(before) == 5  # 3 revisions, 1 partial, 1 dir
    assert [line for line in before if line not in after] == [
        line for line in before if line.startswith("hf org/one@" + A)]


def test_models_dir_holding_the_cache_does_not_list_the_cache(tmp_path):
    cache = tmp_path / "models" / "hub"
    synthetic_cache.add_revision(cache, "org/one", A, W1)
    synthetic_cache.make_plain_dir(tmp_path / "models", "plain", {"w": b"1"})
    store = store_scan.scan_store(str(cache), str(tmp_path / "models"))
    assert set(store.dirs) == {"plain"}
