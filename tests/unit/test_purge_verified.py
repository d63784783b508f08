"""A purge is verified (issue 27 item 5: "A purge reports deletions that did not happen").

huggingface_hub's DeleteCacheStrategy.execute() only logs a path it cannot delete (an immutable
file, an NFS root_squash mount, a task without become) and returns normally; model_purge used to
report the item removed, changed, and a fraction of the planned bytes freed while the repo was
still there. Now every planned path is looked at again after its step (model_purge.leftovers),
what is still there is removed once more or named with its cause, and the module fails.

A deletion is made to really fail as it does on a host: as root the file is made immutable
(``chattr +i``, EPERM, "Operation not permitted") on a file system that supports it (the scratch
ext4 of tests/support/scratch_fs.py, else /var/tmp or the repo's build/); without root its folder
is made read-only (EACCES, "Permission denied"). Either is always undone.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from ansible_collections.modelswap.vllm.plugins.module_utils.store import protections
from ansible_collections.modelswap.vllm.plugins.module_utils.store import purge_items
from ansible_collections.modelswap.vllm.plugins.module_utils.store import model_purge
from ansible_collections.modelswap.vllm.plugins.module_utils.store import store_scan
from ansible_collections.modelswap.vllm.plugins.module_utils.store import unlink_plan
from tests.support import synthetic_cache
from tests.support.modules import REPO, run_module
from tests.support.scratch_fs import scratch_fs, tree_fingerprint
from tests.support.synthetic_cache import A, B, W1

pytestmark = pytest.mark.unit

ROOT = os.geteuid() == 0
EPERM_TEXT = "Operation not permitted" if ROOT else "Permission denied"
ONE = synthetic_cache.folder_for("org/one")
TWO = synthetic_cache.folder_for("org/two")
W1_WEIGHTS = synthetic_cache.etag_for("model.safetensors", W1["model.safetensors"])
W1_CONFIG = synthetic_cache.etag_for("config.json", W1["config.json"])


def _chattr(flag: str, path) -> bool:
    return shutil.which("chattr") is not None and subprocess.run(
        ["chattr", flag, str(path)], capture_output=True).returncode == 0


def _chattr_works(folder) -> bool:
    probe = Path(folder) / ".chattr-probe"
    probe.write_bytes(b"")
    try:
        if not _chattr("+i", probe):
            return False
        try:
            probe.unlink()
        except PermissionError:
            return True
        return False
    finally:
        _chattr("-i", probe)
        if probe.exists():
            probe.unlink()


@contextlib.contextmanager
def immutable_capable(folder):
    """A folder under ``folder`` where ``undeletable`` works: ``folder`` itself without root (a
    read-only folder stops the owner) or where chattr +i works; else one under /var/tmp or the
    repo's build/ (never a skip: the test must run)."""
    if not ROOT or _chattr_works(folder):
        yield Path(folder), True
        return
    for base in ("/var/tmp", str(REPO / "build")):
        os.makedirs(base, exist_ok=True)
        there = Path(tempfile.mkdtemp(prefix="modelswap-immutable-", dir=base))
        try:
            if _chattr_works(there):
                yield there, False
                return
        finally:
            shutil.rmtree(there, ignore_errors=True)
    pytest.fail("chattr +i works nowhere here (%s, /var/tmp, build/): a root test cannot make a "
                "deletion fail" % folder)


@contextlib.contextmanager
def undeletable(path):
    """``path`` cannot be deleted until the block ends: immutable as root, its folder read-only
    otherwise."""
    path = Path(path)
    if ROOT:
        assert _chattr("+i", path), "chattr +i %s failed" % path
        try:
            yield
        finally:
            _chattr("-i", path)
    else:
        mode = path.parent.stat().st_mode
        path.parent.chmod(0o555)
        try:
            yield
        finally:
            path.parent.chmod(mode)


# ------------------------------------------------------------------ leftovers(), table-tested
def _unlink(kind: str, path, key=None) -> unlink_plan.Unlink:
    if key is None:
        st = os.lstat(path)
        key = (st.st_dev, st.st_ino)
    return unlink_plan.Unlink(kind, str(path), key)


# each case builds under ``base`` and returns (the planned unlinks, the expected leftovers as
# (path relative to base, words in the cause), the file made undeletable or None, paths that must
# survive untouched)
def case_gone(base):
    return [unlink_plan.Unlink("blob", str(base / "blobs" / "gone"), ()),
            unlink_plan.Unlink("repo", str(base / "no-such-repo"), ())], [], None, []


def case_file_left_is_removed(base):
    (base / "blobs").mkdir()
    (base / "blobs" / "x").write_bytes(b"x" * 100)
    return [_unlink("blob", base / "blobs" / "x")], [], None, []


def case_link_is_removed_not_followed(base):
    (base / "keep").write_bytes(b"precious")
    (base / "blobs").mkdir()
    os.symlink(base / "keep", base / "blobs" / "x")
    # a blob entry of a shared store is such a link, planned with its target
    u = unlink_plan.Unlink("blob", str(base / "blobs" / "x"), (), link=str(base / "keep"))
    return [u], [], None, [base / "keep"]


def case_folder_left_is_removed(base):
    synthetic_cache.make_plain_dir(base, "plain", {"w.bin": b"p" * 5000, "sub/c.json": b"{}"})
    return [_unlink("dir", base / "plain")], [], None, []


def case_immutable_file(base):
    (base / "blobs").mkdir()
    (base / "blobs" / "x").write_bytes(b"x" * 100)
    return [_unlink("blob", base / "blobs" / "x")], [("blobs/x", EPERM_TEXT)], base / "blobs" / "x", []


def case_folder_holding_an_immutable_file(base):
    repo = base / ONE
    synthetic_cache.add_revision(base, "org/one", A, W1)
    stuck = repo / "blobs" / W1_WEIGHTS
    return [_unlink("repo", repo)], [(os.path.relpath(stuck, base), EPERM_TEXT)], stuck, []


def case_replaced_since_the_plan(base):
    (base / "x").write_bytes(b"new")
    return ([unlink_plan.Unlink("blob", str(base / "x"), (0, 1))], [("x", "was replaced by another file")],
            None, [base / "x"])


def case_folder_now_a_symlink(base):
    (base / "elsewhere").mkdir()
    (base / "elsewhere" / "canary").write_bytes(b"precious")
    os.symlink(base / "elsewhere", base / "plain")
    return ([unlink_plan.Unlink("dir", str(base / "plain"), ())], [("plain", "is now a symlink to")], None,
            [base / "plain", base / "elsewhere" / "canary"])


LEFTOVERS = [
    ("all-gone", case_gone),
    ("a-file-the-strategy-missed-is-removed", case_file_left_is_removed),
    ("a-link-is-removed-its-target-kept", case_link_is_removed_not_followed),
    ("a-folder-the-strategy-missed-is-removed", case_folder_left_is_removed),
    ("an-undeletable-file", case_immutable_file),
    ("a-repo-folder-holding-an-undeletable-blob", case_folder_holding_an_immutable_file),
    ("replaced-since-the-plan-is-left-alone", case_replaced_since_the_plan),
    ("a-folder-now-a-symlink-is-left-alone", case_folder_now_a_symlink),
]


@pytest.mark.parametrize("build", [c[1] for c in LEFTOVERS], ids=[c[0] for c in LEFTOVERS])
def test_leftovers_names_what_is_still_on_disk_with_its_cause(tmp_path, build):
    with immutable_capable(tmp_path) as (base, _unused):
        unlinks, expected, stuck, kept = build(base)
        step = unlink_plan.PurgeStep("org/x", "", True, False, unlinks)
        with undeletable(stuck) if stuck else contextlib.nullcontext():
            left = model_purge.leftovers(step)
            assert stuck is None or stuck.exists()
        assert [os.path.relpath(p, base) for p, _unused in left] == [rel for rel, _unused in expected], left
        for (_unused, cause), (_unused, words) in zip(left, expected):
            assert words in cause, left
        for path in kept:
            assert os.path.lexists(path), path
        if not expected:
            # what the second removal deleted is not a leftover: it is gone now
            assert not any(os.path.lexists(u.path) for u in unlinks)
        if stuck:
            # the rest of what the plan named is gone already; the stuck file goes once it can
            assert [p for p in Path(base).rglob("*") if p.is_file()] == [stuck]
            assert model_purge.leftovers(step) == []
            assert not any(os.path.lexists(u.path) for u in unlinks)


def test_the_failure_message_names_item_paths_and_cause():
    left = [{"item": "org/old", "paths": ["/s/hub/models--org--old/blobs/%d" % i for i in range(5)],
             "cause": "Permission denied"}]
    assert model_purge.leftover_message(1, 2, left) == (
        "model_purge: deleted 1 of 2; org/old: still on disk: /s/hub/models--org--old/blobs/0, "
        "/s/hub/models--org--old/blobs/1, /s/hub/models--org--old/blobs/2 and 2 more (Permission denied); "
        "find why (lsattr shows an immutable file; a read-only or root_squash mount; a task without "
        "become), fix it and run the purge again")
    step = unlink_plan.PurgeStep("org/old@" + A, ONE, False, True, [])
    assert model_purge.left_row(step, [("/p/a", "Operation not permitted"), ("/p/b", "Operation not permitted"),
                                       ("/p/c", "Permission denied")]) == {
        "item": "org/old@" + A, "paths": ["/p/a", "/p/b", "/p/c"],
        "cause": "Operation not permitted; Permission denied"}


# ------------------------------------------------------------------------------- the module
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
