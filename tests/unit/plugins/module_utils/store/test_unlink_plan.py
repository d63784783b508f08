"""model_purge's delete plan: computed once from the module's own scan, re-checked before deleting.

The plan (unlink_plan.delete_plan, plugins/module_utils/store/unlink_plan.py) names every path a
purge unlinks; it must match huggingface_hub's own delete strategy on an untouched cache (the
semantics the module promises: shared blobs stay while a remaining revision links them), and
unlink_plan.plan_changes must catch every change made to the cache after the plan. The module
tests that change the cache *between* plan and apply are in
tests/unit/plugins/modules/test_model_purge.py (they build their caches with build() below).
"""
from __future__ import annotations

import os
import shutil

import pytest
from huggingface_hub import scan_cache_dir

from ansible_collections.modelswap.vllm.plugins.module_utils.store import model_store
from ansible_collections.modelswap.vllm.plugins.module_utils.store import store_scan
from ansible_collections.modelswap.vllm.plugins.module_utils.store import unlink_plan
from tests.support import synthetic_cache
from tests.support.synthetic_cache import A, B, C, W1, W2, W3

pytestmark = pytest.mark.unit

ONE = synthetic_cache.folder_for("org/one")
TWO = synthetic_cache.folder_for("org/two")


def build(tmp_path):
    """org/one: A (no ref) and B (main) sharing two blobs, with trees/ and modelswap/ metadata
    per commit and a .no_exist marker for A; org/two: C; a plain model directory."""
    cache = tmp_path / "hub"
    models = tmp_path / "models"
    models.mkdir()
    synthetic_cache.add_two_repos(cache)
    for commit in (A, B):
        for sub in ("trees", "modelswap"):
            (cache / ONE / sub).mkdir(exist_ok=True)
            (cache / ONE / sub / (commit + ".json")).write_text("{}")
    (cache / ONE / ".no_exist" / A).mkdir(parents=True)
    (cache / ONE / ".no_exist" / A / "generation_config.json").write_text("")
    synthetic_cache.make_plain_dir(models, "plain", {"w.bin": b"p" * 7000})
    return cache, models


def blob_of(rel: str, files: dict) -> str:
    return "blobs/" + synthetic_cache.etag_for(rel, files[rel])


def plan_for(store, folder, commits=None, dirs=()):
    sim = model_store.DeletionSimulator(store)
    steps = []
    if folder:
        effect = (sim.apply(model_store.Item("repo", folder=folder)) if commits is None
                  else sim.apply_revisions(folder, commits))
        steps.append((folder, effect))
    return unlink_plan.delete_plan(store, steps, dirs)


def rel_unlinks(plan, cache, models):
    out = []
    for step in plan:
        for u in step.unlinks:
            base = cache / step.folder if step.folder else models
            out.append((u.kind, os.path.relpath(u.path, base)))
    return out


# (id, folder, commits (None: the whole repo), dirs, planned (kind, path in the repo folder))
PLANS = [
    ("one-revision-of-two", ONE, [A], (), [
        ("snapshot", "snapshots/" + A), ("blob", blob_of("config.json", W1)),
        ("meta_dir", ".no_exist/" + A), ("meta", "modelswap/%s.json" % A),
        ("meta", "trees/%s.json" % A)]),
    ("the-revision-main-names", ONE, [B], (), [
        ("snapshot", "snapshots/" + B), ("ref", "refs/main"), ("blob", blob_of("config.json", W2)),
        ("meta", "modelswap/%s.json" % B), ("meta", "trees/%s.json" % B)]),
    ("every-revision-is-the-repo", ONE, [A, B], (), [("repo", ".")]),
    ("the-repo", TWO, None, (), [("repo", ".")]),
    ("a-plain-directory", "", None, ("plain",), [("dir", "plain")]),
]


@pytest.mark.parametrize("folder,commits,dirs,planned", [p[1:] for p in PLANS], ids=[p[0] for p in PLANS])
def test_delete_plan_names_exactly_what_goes_as_huggingface_hub_would(
        tmp_path, folder, commits, dirs, planned):
    cache, models = build(tmp_path)
    store = store_scan.scan_store(str(cache), str(models))
    plan = plan_for(store, folder, commits, dirs)
    assert rel_unlinks(plan, cache, models) == planned
    if not folder:
        assert plan[0].whole and not plan[0].uses_hf and plan[0].expected == 0
        return
    # huggingface_hub's own strategy on the same, untouched cache agrees path for path and in bytes
    hf_commits = commits if commits is not None else list(store.repos[folder].revisions)
    hf = scan_cache_dir(cache).delete_revisions(*hf_commits)
    step = plan[0]
    assert step.uses_hf
    assert {str(p) for p in hf.blobs} == set(step.paths("blob"))
    assert {str(p) for p in hf.snapshots} == set(step.paths("snapshot"))
    assert {str(p) for p in hf.refs} == set(step.paths("ref"))
    assert {str(p) for p in hf.repos} == set(step.paths("repo"))
    assert step.expected == hf.expected_freed_size


def test_a_plan_still_matching_the_store_has_no_changes(tmp_path):
    cache, models = build(tmp_path)
    store = store_scan.scan_store(str(cache), str(models))
    plan = plan_for(store, ONE, [A]) + plan_for(store, "", dirs=("plain",))
    assert unlink_plan.plan_changes(store, plan) == []


def _retarget(link, target):
    os.unlink(link)
    os.symlink(target, link)


def _swap_for_link(path, target):
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.move(path, target)
    else:
        os.unlink(path)
    os.symlink(target, path)


# (id, what another writer does after the plan of "org/one@A" and "plain", words of the refusal)
CHANGES = [
    ("doomed-link-retargeted-outside",
     lambda c, m, o: _retarget(c / ONE / "snapshots" / A / "config.json", str(o / "canary")),
     ["revision " + A, "leaves the repo's blobs", "canary"]),
    ("kept-link-retargeted-to-a-doomed-blob",
     lambda c, m, o: _retarget(c / ONE / "snapshots" / B / "config.json", "../../" + blob_of("config.json", W1)),
     ["revision " + B, "now links other blobs"]),
    ("planned-blob-gone",
     lambda c, m, o: os.unlink(c / ONE / blob_of("config.json", W1)),
     ["is gone"]),
    ("planned-blob-replaced",
     lambda c, m, o: ((c / ONE / "blobs" / "new.tmp").write_bytes(b'{"a": 1}'),   # atomic rename
                      os.replace(c / ONE / "blobs" / "new.tmp", c / ONE / blob_of("config.json", W1))),
     ["blob", "was replaced"]),
    ("planned-blob-now-a-link-outside",
     lambda c, m, o: _swap_for_link(str(c / ONE / blob_of("config.json", W1)), str(o / "canary")),
     ["is now a symlink to", "canary"]),
    ("blobs-folder-now-a-link",
     lambda c, m, o: _swap_for_link(str(c / ONE / "blobs"), str(o / "blobs")),
     ["reached through a symlink"]),
    ("snapshot-folder-now-a-file",
     lambda c, m, o: (shutil.rmtree(c / ONE / "snapshots" / A), (c / ONE / "snapshots" / A).write_text("x")),
     ["no longer a folder"]),
    ("metadata-folder-now-a-link",
     lambda c, m, o: _swap_for_link(str(c / ONE / "trees"), str(o / "trees")),
     ["reached through a symlink"]),
    ("new-revision",
     lambda c, m, o: synthetic_cache.add_revision(c, "org/one", C, W3, refs=("dev",)),
     ["revision %s appeared" % C, "refs changed"]),
    ("plain-directory-now-a-link",
     lambda c, m, o: _swap_for_link(str(m / "plain"), str(o / "plain")),
     ["model directory", "is now a symlink to"]),
]


@pytest.mark.parametrize("change,words", [c[1:] for c in CHANGES], ids=[c[0] for c in CHANGES])
def test_plan_changes_catches_every_change_after_the_plan(tmp_path, change, words):
    cache, models = build(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "canary").write_bytes(b"precious")
    store = store_scan.scan_store(str(cache), str(models))
    plan = plan_for(store, ONE, [A]) + plan_for(store, "", dirs=("plain",))
    change(cache, models, outside)
    found = unlink_plan.plan_changes(store, plan)
    text = "; ".join(found)
    for w in words:
        assert w in text, found
