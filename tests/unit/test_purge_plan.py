"""model_purge's delete plan: computed once from the module's own scan, re-checked before deleting.

The plan (unlink_plan.delete_plan) names every path a purge unlinks; it must match huggingface_hub's
own delete strategy on an untouched cache (the semantics the module promises: shared blobs stay
while a remaining revision links them), and unlink_plan.plan_changes must catch every change made
to the cache after the plan. The module tests change the cache *between* plan and apply: a hook
run in the module's own process fires right after the module has taken its download locks (the
moment after planning), the way another writer of a shared store would.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
from huggingface_hub import scan_cache_dir

from ansible_collections.modelswap.vllm.plugins.module_utils.store import model_store
from ansible_collections.modelswap.vllm.plugins.module_utils.store import store_scan
from ansible_collections.modelswap.vllm.plugins.module_utils.store import unlink_plan
from tests.support import synthetic_cache
from tests.support.synthetic_cache import A, B, C, W1, W2, W3
from tests.support.modules import COLLECTIONS, REPO, run_module
from tests.support.scratch_fs import tree_fingerprint

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


# ------------------------------------------------------------------------ the module, hooked
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
