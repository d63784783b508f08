"""model_purge's plan functions (plugins/module_utils/store/model_purge.py), called directly on synthetic caches.

The host's state is what protections.build_protections makes of a catalog, a deployment record, a
unit and running servers given as plain values, so every refusal rule is tested without a host.
The module itself (the same rules end to end, the guarded apply) is tested in
tests/unit/plugins/modules/test_model_purge.py; the delete plan it applies (unlink_plan) in
test_unlink_plan.py beside this file.

A purge is verified (issue 27 item 5: "A purge reports deletions that did not happen").

huggingface_hub's DeleteCacheStrategy.execute() only logs a path it cannot delete (an immutable
file, an NFS root_squash mount, a task without become) and returns normally; model_purge used to
report the item removed, changed, and a fraction of the planned bytes freed while the repo was
still there. Now every planned path is looked at again after its step (model_purge.leftovers),
what is still there is removed once more or named with its cause, and the module fails.

A deletion is made to really fail as it does on a host: as root the file is made immutable
(``chattr +i``, EPERM, "Operation not permitted") on a file system that supports it (the scratch
ext4 of tests/support/scratch_fs.py, else /var/tmp or the repo's build/); without root its folder
is made read-only (EACCES, "Permission denied"). Either is always undone. (immutable_capable and
undeletable below; the module's tests use them too.)
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
from ansible_collections.modelswap.vllm.plugins.module_utils.store import model_store
from ansible_collections.modelswap.vllm.plugins.module_utils.store import store_scan
from ansible_collections.modelswap.vllm.plugins.module_utils.store import unlink_plan
from tests.support import synthetic_cache
from tests.support.modules import REPO
from tests.support.synthetic_cache import A, B, C, W1
from tests.support.scratch_fs import tree_fingerprint

pytestmark = pytest.mark.unit

ONE = synthetic_cache.folder_for("org/one")
TWO = synthetic_cache.folder_for("org/two")
MODELS = {"one-a": {"repo_id": "org/one", "revision": A}, "one-b": {"repo_id": "org/one", "revision": B},
          "two": {"repo_id": "org/two", "revision": C}}


@pytest.fixture
def world(tmp_path):
    """org/one at A and B (sharing blobs), org/two at C, plain dirs `plain` and `served-dir`, a
    symlink `alias` to `plain` and one `escape` to a folder outside the roots."""
    cache = tmp_path / "hub"
    models = tmp_path / "models"
    synthetic_cache.add_two_repos(cache)
    synthetic_cache.make_plain_dir(models, "plain", {"w.bin": b"p" * 7000})
    synthetic_cache.make_plain_dir(models, "served-dir", {"w.bin": b"s" * 5000})
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "data.bin").write_bytes(b"keep me")
    os.symlink(models / "plain", models / "alias")
    os.symlink(outside, models / "escape")
    return tmp_path, cache, models


def scanned(cache, models):
    store = store_scan.scan_store(str(cache), str(models))
    return store, [store.cache_dir, store.models_dir]


def state_for(store, **host):
    """The host's state from plain values (record, unit, processes, target, keep, protect_paths)."""
    return protections.build_protections(store, models=MODELS, **host)


def judge(store, roots, items, state=None, **options):
    return model_purge.judge_items(store, items, roots=roots, models=MODELS,
                                   state=state or state_for(store), **options)


# (id, items with {cache} {models} {tmp}, host state, options, [(item, rule, words in why)])
REFUSALS = [
    ("outside-the-roots", ["/etc"], {}, {}, [("/etc", "roots", "outside the roots")]),
    ("a-root-itself", ["{cache}"], {}, {}, [("{cache}", "roots", "root itself")]),
    ("leaves-through-a-symlink", ["{models}/escape"], {}, {},
     [("{models}/escape", "roots", "resolves through a symlink to {tmp}/outside")]),
    ("a-symlink-inside", ["{models}/alias"], {}, {}, [("{models}/alias", "roots", "is a symlink (to")]),
    ("served-by-record", ["org/two"], {"record": {"model": "two", "repo_id": "org/two", "commit": C}}, {},
     [("org/two", "served", "served model 'two' (deployment record")]),
    ("served-by-option", ["two"], {"served": "two"}, {}, [("two", "served", "served option")]),
    ("target", ["org/one@" + B], {"target": "one-b"}, {}, [("org/one@" + B, "target", "target model 'one-b'")]),
    ("keep", ["org/two"], {"keep": ["two"]}, {}, [("org/two", "keep", "keep list")]),
    ("protected-path", ["plain"], {"protect_paths": ["{models}/plain/w.bin"]}, {},
     [("plain", "path", "protected path")]),
    ("served-allowed-but-a-server-runs-it", ["{models}/served-dir"],
     {"processes": [{"pid": 4242, "model": "{models}/served-dir"}]}, {"allow_served_purge": True},
     [("{models}/served-dir", "served", "running vLLM server, PID 4242; stop that server")]),
    ("served-allowed-but-its-unit-runs", ["org/two"],
     {"unit": {"model": "org/two", "active": True, "unit_state": "active"}, "unit_name": "vllm.service"},
     {"allow_served_purge": True, "unit_name": "vllm.service"},
     [("org/two", "served", "unit vllm.service is running; stop the service")]),
    ("served-allowed-but-its-unit-state-unknown", ["org/two"],
     {"unit": {"model": "org/two", "active": None, "unit_state": "unknown (systemd not running)"},
      "unit_name": "vllm.service"},
     {"allow_served_purge": True, "unit_name": "vllm.service"},
     [("org/two", "served", "unit vllm.service is in an unknown state")]),
    ("allow-served-purge-covers-no-target", ["org/one@" + B], {"target": "one-b", "served": "one-b"},
     {"allow_served_purge": True}, [("org/one@" + B, "served", "served option")]),
    ("missing-fail", ["org/absent"], {}, {"missing": "fail"},
     [("org/absent", "missing", "is not in the model store (no models--org--absent in {cache}) (missing=fail)")]),
    ("malformed", ["org/na me"], {}, {}, [("org/na me", "input", "malformed")]),
    ("all-judged-together", ["org/one", "/etc", "org/two"], {"keep": ["two"]}, {},
     [("/etc", "roots", "outside"), ("org/two", "keep", "keep list")]),
]


@pytest.mark.parametrize("items,host,options,expected", [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_refusal_rules(world, items, host, options, expected):
    tmp, cache, models = world
    fmt = {"cache": str(cache), "models": str(models), "tmp": str(tmp)}

    def filled(value):
        if isinstance(value, str):
            return value.format(**fmt)
        if isinstance(value, list):
            return [filled(v) for v in value]
        if isinstance(value, dict):
            return {k: filled(v) for k, v in value.items()}
        return value

    store, roots = scanned(cache, models)
    fp = tree_fingerprint(tmp)
    refused, absent, chosen = judge(store, roots, filled(items), state_for(store, **filled(host)), **options)
    assert [(r["item"], r["rule"]) for r in refused] == [(filled(i), rule) for i, rule, _unused in expected]
    for row, (_unused, _unused, words) in zip(refused, expected):
        assert filled(words) in row["why"], row["why"]
    assert absent == []
    # one refusal spoils the whole purge: plan_purge refuses with every reason, nothing planned
    with pytest.raises(model_purge.PurgeRefused) as refusal:
        model_purge.plan_purge(store, state_for(store, **filled(host)), roots=roots, items=filled(items),
                               models=MODELS, **options)
    assert str(refusal.value) == model_purge.refusal_message(refused)
    assert str(refusal.value).startswith("model_purge refused ") and str(refusal.value).endswith(
        "; nothing was deleted")
    assert refusal.value.details == {"refused": refused, "changed": False}
    assert tree_fingerprint(tmp) == fp


def test_refusal_message_names_each_item_its_cause_and_rule():
    message = model_purge.refusal_message([{"item": "org/x", "why": "it is the target model 't'", "rule": "target"},
                                           {"item": "/etc", "why": "it is outside the roots (/r)", "rule": "roots"}])
    assert message == ("model_purge refused 'org/x': it is the target model 't' (rule: target); "
                       "'/etc': it is outside the roots (/r) (rule: roots); nothing was deleted")


@pytest.mark.parametrize("host,options", [
    ({"record": {"model": "x", "path": "{models}/served-dir"}}, {"allow_served_purge": True}),
    ({"unit": {"model": "{models}/served-dir", "active": False, "unit_state": "inactive"},
      "unit_name": "vllm.service"}, {"allow_served_purge": True, "unit_name": "vllm.service"}),
], ids=["record-no-unit", "unit-stopped"])
def test_the_served_model_goes_when_allowed_and_nothing_serves_it(world, host, options):
    tmp, cache, models = world
    store, roots = scanned(cache, models)
    host = {k: ({kk: vv.format(models=models) if isinstance(vv, str) else vv for kk, vv in v.items()}
                if isinstance(v, dict) else v) for k, v in host.items()}
    state = state_for(store, **host)
    items = [str(models / "served-dir")]
    refused, _unused, _unused = judge(store, roots, items, state)
    assert [r["rule"] for r in refused] == ["served"]
    refused, absent, chosen = judge(store, roots, items, state, **options)
    assert refused == [] and absent == [] and [i.name for i in chosen] == ["served-dir"]


def test_missing_items_are_absent_by_default(world):
    tmp, cache, models = world
    store, roots = scanned(cache, models)
    refused, absent, chosen = judge(store, roots, ["org/absent", "org/two", "nope"])
    assert refused == [] and absent == ["org/absent", "nope"] and [i.ident for i in chosen] == ["org/two"]


def test_a_revision_whose_links_leave_the_repo_is_refused_but_its_repo_may_go(world):
    tmp, cache, models = world
    outside = tmp / "outside.bin"
    outside.write_bytes(b"x" * 10)
    os.symlink(str(outside), cache / TWO / "snapshots" / C / "evil.bin")
    store, roots = scanned(cache, models)
    refused, _unused, _unused = judge(store, roots, ["org/two@" + C])
    assert [r["rule"] for r in refused] == ["roots"]
    assert "leave the repo's blobs" in refused[0]["why"] and str(outside) in refused[0]["why"]
    assert "purge the whole repo" in refused[0]["why"]
    refused, _unused, chosen = judge(store, roots, ["org/two"])
    assert refused == [] and [i.kind for i in chosen] == ["repo"]


def test_items_are_chosen_once_in_the_order_given(world):
    tmp, cache, models = world
    store, roots = scanned(cache, models)
    _unused, _unused, chosen = judge(store, roots, ["plain", "org/one@" + A, str(models / "plain"), "one-a",
                                     str(cache / ONE / "snapshots" / A)])
    assert [(i.kind, i.ident) for i in chosen] == [("dir", str(models / "plain")), ("revision", "org/one@" + A)]


def items(store, texts):
    return [purge_items.resolve_item(store, t, MODELS) for t in texts]


# (id, items, [(kind, key, [item idents])])
GROUPS = [
    ("revisions-of-one-repo-in-one-step", ["org/one@" + A, "org/two", "org/one@" + B],
     [("revisions", ONE, ["org/one@" + A, "org/one@" + B]), ("repo", TWO, ["org/two"])]),
    ("a-repo-covers-its-revisions", ["org/one@" + A, "org/one", "org/one@" + B],
     [("repo", ONE, ["org/one"])]),
    ("dirs-one-step-each", ["plain", "served-dir", "org/two@" + C],
     [("dir", "plain", None), ("dir", "served-dir", None), ("revisions", TWO, ["org/two@" + C])]),
    ("nothing", [], []),
]


@pytest.mark.parametrize("texts,expected", [g[1:] for g in GROUPS], ids=[g[0] for g in GROUPS])
def test_group_steps(world, texts, expected):
    tmp, cache, models = world
    store, _unused = scanned(cache, models)
    steps = model_purge.group_steps(items(store, texts))
    assert [(kind, key) for kind, key, _unused in steps] == [(kind, key) for kind, key, _unused in expected]
    for (_unused, _unused, group), (_unused, _unused, idents) in zip(steps, expected):
        if idents is not None:
            assert [i.ident for i in group] == idents


def test_every_revision_of_a_repo_removes_the_repo_and_counts_its_bytes_once(world):
    tmp, cache, models = world
    store, _unused = scanned(cache, models)
    steps = model_purge.group_steps(items(store, ["org/one@" + A, "org/one@" + B]))
    removed, deletions = model_purge.plan_removal(store, steps, model_store.DeletionSimulator(store), MODELS)
    assert [r["item"] for r in removed] == ["org/one@" + A, "org/one@" + B]
    assert [r.get("removes_repo") for r in removed] == [True, True]
    assert removed[0]["bytes"] > 0 and removed[1]["bytes"] == 0
    whole = model_store.DeletionSimulator(store).apply(model_store.Item("repo", folder=ONE))
    assert removed[0]["bytes"] == whole.bytes
    assert [d.folder for d in deletions] == [ONE] and deletions[0].whole


def test_one_revision_of_two_frees_only_what_it_alone_links(world):
    tmp, cache, models = world
    store, _unused = scanned(cache, models)
    steps = model_purge.group_steps(items(store, ["org/one@" + A]))
    removed, deletions = model_purge.plan_removal(store, steps, model_store.DeletionSimulator(store), MODELS)
    assert "removes_repo" not in removed[0] and removed[0]["kind"] == "revision"
    blob_paths = [u.path for d in deletions for u in d.unlinks if u.kind == "blob"]
    assert blob_paths == [str(cache / ONE / "blobs" / synthetic_cache.etag_for("config.json", synthetic_cache.W1["config.json"]))]


def test_revisions_of_a_damaged_repo_are_refused(world):
    tmp, cache, models = world
    os.symlink("../../blobs/" + "0" * 64, cache / ONE / "snapshots" / A / "gone.bin")
    store, _unused = scanned(cache, models)
    steps = model_purge.group_steps(items(store, ["org/one@" + B]))
    with pytest.raises(model_purge.PurgeRefused, match="the cached repo is damaged .*purge the whole repo instead; "
                                                       "nothing was deleted") as refusal:
        model_purge.plan_removal(store, steps, model_store.DeletionSimulator(store), MODELS)
    assert refusal.value.details == {"changed": False}


def test_orphans_and_stale_locks_in_repos_that_stay(world):
    tmp, cache, models = world
    orphan_one = synthetic_cache.add_orphan(cache, "org/one", "e" * 64, 3000)
    orphan_two = synthetic_cache.add_orphan(cache, "org/two", "f" * 64, 2000)
    locks = cache / ".locks"
    (locks / ONE).mkdir(parents=True)
    (locks / ONE / ("e" * 64 + ".lock")).write_text("")
    (locks / TWO).mkdir()
    (locks / TWO / "x.lock").write_text("")
    (locks / TWO / "notes.txt").write_text("")
    (locks / synthetic_cache.folder_for("org/gone")).mkdir()
    store, roots = scanned(cache, models)
    state = state_for(store)
    plan = model_purge.plan_purge(store, state, roots=roots, items=["org/one"], models=MODELS)
    # org/one goes whole: its orphan and its locks go with it, not as orphans or stale locks
    assert [o["path"] for o in plan.orphans] == [str(orphan_two)] and plan.busy_orphans == []
    assert plan.orphans[0]["repo_id"] == "org/two" and plan.orphans[0]["bytes"] > 0
    assert [(s["path"], s["dir"]) for s in plan.stale] == [
        (str(locks / synthetic_cache.folder_for("org/gone")), True), (str(locks / TWO / "x.lock"), False)]
    # nothing is cleaned when the cache is outside the roots, or when asked not to
    plan = model_purge.plan_purge(store, state, roots=[store.models_dir], items=[], models=MODELS)
    assert plan.orphans == [] and plan.stale == []
    plan = model_purge.plan_purge(store, state, roots=roots, items=[], models=MODELS, clean_orphans=False,
                                  clean_stale_locks=False)
    assert plan.orphans == [] and plan.stale == [] and plan.result()["changed"] is False
    assert orphan_one.exists() and orphan_two.exists()


def test_the_plans_result_and_diff(world):
    tmp, cache, models = world
    store, roots = scanned(cache, models)
    fp = tree_fingerprint(tmp)
    plan = model_purge.plan_purge(store, state_for(store), roots=roots, items=["org/two", "org/absent", "plain"],
                                  models=MODELS)
    result = plan.result()
    assert sorted(result) == ["absent", "changed", "expected_freed_size", "freed_bytes", "locks_removed",
                              "orphans_busy", "orphans_removed", "planned_bytes", "removed", "shared_kept",
                              "shared_removed"]
    assert result["changed"] is True and result["absent"] == ["org/absent"] and result["freed_bytes"] is None
    assert [r["item"] for r in result["removed"]] == ["org/two", str(models / "plain")]
    assert result["planned_bytes"] == sum(r["bytes"] for r in result["removed"])
    assert result["expected_freed_size"] == len(synthetic_cache.W3["config.json"]) + len(synthetic_cache.W3["model.safetensors"])
    assert plan.needs_huggingface_hub()
    diff = model_purge.purge_diff(store, plan)
    assert diff["before"] != diff["after"] and "org/two" in diff["before"] and "org/two" not in diff["after"]
    assert tree_fingerprint(tmp) == fp


def test_roots_are_real_existing_folders(world, tmp_path):
    tmp, cache, models = world
    store, _unused = scanned(cache, models)
    assert model_purge.purge_roots(store, None) == [store.cache_dir, store.models_dir]
    os.symlink(models, tmp / "models-link")
    assert model_purge.purge_roots(store, [str(tmp / "models-link")]) == [store.models_dir]
    with pytest.raises(model_purge.PurgeRefused) as refusal:
        model_purge.purge_roots(store, [str(tmp / "nope")])
    assert str(refusal.value) == ("model_purge: root %s is not an existing directory; fix roots (nothing was "
                                  "deleted)" % (tmp / "nope"))
    assert refusal.value.details == {}


@pytest.mark.parametrize("path,roots,words", [
    ("/etc/passwd", ["/srv"], "outside the roots (/srv)"),
    ("/srv", ["/srv"], "root itself (/srv)"),
    ("/srv/models/m", ["/srv"], ""),
])
def test_path_refusal(path, roots, words):
    why = model_purge.path_refusal(path, roots)
    assert (words in why) if words else why == ""


# ------------------------------------------------------------------ a deletion that fails, made to fail
ROOT = os.geteuid() == 0
EPERM_TEXT = "Operation not permitted" if ROOT else "Permission denied"
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
