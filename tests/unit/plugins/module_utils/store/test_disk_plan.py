"""disk_planning: the verdict, the purge proposal and the inputs, table-driven on real cache layouts."""
from __future__ import annotations

import os
import time

import pytest
from huggingface_hub.utils import filter_repo_objects

from ansible_collections.modelswap.vllm.plugins.module_utils.fleet import store_context
from ansible_collections.modelswap.vllm.plugins.module_utils.store import disk_plan
from ansible_collections.modelswap.vllm.plugins.module_utils.store import plan_inputs
from ansible_collections.modelswap.vllm.plugins.module_utils.store import purge_items
from ansible_collections.modelswap.vllm.plugins.module_utils.store import target_needs
from ansible_collections.modelswap.vllm.plugins.module_utils.store.protections import build_protections, protect_model, protecting
from ansible_collections.modelswap.vllm.plugins.module_utils.hub import hub_client
from ansible_collections.modelswap.vllm.plugins.module_utils.store import cache_layout
from ansible_collections.modelswap.vllm.plugins.module_utils.store import model_store
from ansible_collections.modelswap.vllm.plugins.module_utils.store import store_scan
from tests.support import synthetic_cache

pytestmark = pytest.mark.unit

KB = 1024
V1, V2, S, K, T1 = "1" * 40, "2" * 40, "5" * 40, "6" * 40, "7" * 40
WEIGHTS = b"W" * (400 * KB)
OLD_V1 = {"config.json": b'{"v":1}', "model.safetensors": WEIGHTS}
OLD_V2 = {"config.json": b'{"v":2}', "model.safetensors": WEIGHTS}      # shares the weights
SERVED = {"config.json": b"{}", "model.safetensors": b"S" * (800 * KB)}
KEEP = {"config.json": b"{}", "model.safetensors": b"K" * (100 * KB)}
TARGET_V1 = {"config.json": b'{"t":1}', "shard-1.safetensors": b"A" * (300 * KB)}
MODELS = {
    "old-1": {"repo_id": "org/old", "revision": V1},
    "old-2": {"repo_id": "org/old", "revision": V2},
    "served": {"repo_id": "org/served", "revision": S},
    "keeper": {"repo_id": "org/keep", "revision": K},
    "target": {"repo_id": "org/target", "revision": "9" * 40},
}
# the target at its pinned commit: shard-1 already cached (from v1), shard-2 new
TARGET_FILES = [
    {"path": "config.json", "size": 7, "etag": synthetic_cache.etag_for("config.json", b'{"t":1}')},
    {"path": "shard-1.safetensors", "size": 300 * KB, "etag": synthetic_cache.etag_for("shard-1.safetensors", b"A" * (300 * KB))},
    {"path": "shard-2.safetensors", "size": 500 * KB, "etag": "b" * 64},
]


@pytest.fixture
def store(tmp_path):
    cache, models = tmp_path / "hub", tmp_path / "models"
    synthetic_cache.add_revision(cache, "org/old", V1, OLD_V1, refs=())
    synthetic_cache.add_revision(cache, "org/old", V2, OLD_V2)
    synthetic_cache.add_revision(cache, "org/served", S, SERVED)
    synthetic_cache.add_revision(cache, "org/keep", K, KEEP)
    synthetic_cache.add_revision(cache, "org/target", T1, TARGET_V1)
    synthetic_cache.add_orphan(cache, "org/old", "c" * 64, 200 * KB)
    synthetic_cache.make_plain_dir(models, "scratch", {"w.bin": b"D" * (250 * KB)})
    now = time.time()
    for repo_id, age in (("org/old", 900), ("org/keep", 500), ("org/served", 10), ("org/target", 5)):
        synthetic_cache.set_last_used(cache, repo_id, now - age)
    for p in (models / "scratch").rglob("*"):
        os.utime(p, (now - 700, now - 700))
    return store_scan.scan_store(str(cache), str(models))


def protections(store, **kw):
    return build_protections(store, models=MODELS, target="target", keep=["keeper"],
                             served="served", **kw)


def orphans_of(store):
    return store.orphans


def item_bytes(store, *items):
    sim = model_store.DeletionSimulator(store)
    return [sim.apply(i).bytes for i in items]


def test_target_needs_only_what_is_not_cached(store):
    needs = target_needs.target_needs(store, "org/target", "9" * 40, TARGET_FILES, 4096)
    assert needs["cached_bytes"] == 7 + 300 * KB
    assert needs["download_bytes"] == 500 * KB and needs["missing_files"] == 1
    # new blocks rounded up + one link block per file of the new snapshot
    assert needs["needed_bytes"] == cache_layout.round_up(500 * KB, 4096) + 3 * 4096
    nothing = target_needs.target_needs(store, "org/absent", "9" * 40, TARGET_FILES, 4096)
    assert nothing["cached_bytes"] == 0 and nothing["missing_files"] == 3
    dup = target_needs.target_needs(store, "org/absent", "", TARGET_FILES + [dict(TARGET_FILES[2], path="copy")], 4096)
    assert dup["missing_files"] == 3 and dup["download_bytes"] == 7 + 300 * KB + 500 * KB


def test_candidates_skip_protected_and_order_lru(store):
    state = protections(store)
    items, excluded = purge_items.all_candidates(store, state["protections"])
    ordered = [i.ident for i in purge_items.order_lru(store, items)]
    assert ordered[0] == "org/old" and ordered[1].endswith("/models/scratch")
    assert ordered[2] == "org/target@" + T1      # not the pinned target commit
    why = {e["item"]: e["why"] for e in excluded}
    assert "served model 'served'" in why["org/served@" + S]
    assert "keep list" in why["org/keep@" + K]
    # the target's cached v1 holds the shard it reuses: excluded when the planner knows the files
    reuse = ("models--org--target", {f["etag"] for f in TARGET_FILES})
    items2, excluded2 = purge_items.all_candidates(store, state["protections"], reuse=reuse)
    assert "org/target@" + T1 not in [i.ident for i in items2]
    assert any("reuses" in e["why"] for e in excluded2)


def _items(store, *texts):
    return [purge_items.resolve_item(store, t, MODELS) for t in texts]


# (case, available bytes, needed, headroom, candidate texts, with orphans, allow served,
#  expected verdict, expected purge, extra check)
PLANS = [
    ("fits", 10 ** 9, 100 * KB, 0, ["org/old"], True, False, "fits", [], None),
    ("orphans-alone-suffice", 50 * KB, 200 * KB, 0, ["org/old"], True, False,
     "fits_after_purge", [], lambda r: r["purge_orphans"] and r["purge_bytes"] == r["orphan_bytes"]),
    ("shared-blobs-counted-once", 0, 450 * KB, 0, ["old-1", "old-2"], False, False,
     "fits_after_purge", ["org/old@" + V1, "org/old@" + V2],
     lambda r: r["candidates"][0]["bytes"] < 64 * KB and r["candidates"][1]["size"] >= 400 * KB),
    ("minimal-prefix-lru", 0, 300 * KB, 0, None, False, False, "fits_after_purge", ["org/old"], None),
    ("operator-order", 0, 300 * KB, 0, ["scratch", "org/old"], False, False,
     "fits_after_purge", ["{scratch}", "org/old"], None),
    ("nothing-fits", 0, 10 ** 9, 0, ["org/old"], True, False, "does_not_fit", [],
     lambda r: r["shortfall_bytes"] == 10 ** 9 - r["orphan_bytes"] - r["candidates_bytes"]
     and r["served_purge"] is None),
    ("only-served-would-make-room", 0, 1200 * KB, 0, ["org/old"], True, False, "does_not_fit", [],
     lambda r: r["served_purge"]["would_fit"] and "serving stops" in r["served_purge"]["downtime"]
     and r["downtime"] is False),
    ("served-purge-allowed", 0, 1200 * KB, 0, ["org/old"], True, True, "fits_after_purge",
     ["org/old", "org/served@" + S], lambda r: r["downtime"] is True),
    ("headroom-counts", 500 * KB, 100 * KB, 450 * KB, ["org/old"], False, False,
     "fits_after_purge", ["org/old"], lambda r: r["required_bytes"] == 550 * KB),
]


@pytest.mark.parametrize("available,needed,headroom,cands,with_orphans,allow,verdict,purge,extra",
                         [p[1:] for p in PLANS], ids=[p[0] for p in PLANS])
def test_plan(store, available, needed, headroom, cands, with_orphans, allow, verdict, purge, extra):
    state = protections(store)
    if cands is None:
        items = purge_items.order_lru(store, purge_items.all_candidates(store, state["protections"])[0])
    else:
        items = _items(store, *cands)
    fs = {"available": available, "block_size": 4096}
    result = disk_plan.make_plan(store, fs, needed_bytes=needed, headroom_bytes=headroom, candidates=items,
                                 orphans=orphans_of(store) if with_orphans else [],
                                 served_items=state["served_items"], served_label=state["served_label"],
                                 target_label="'target'", allow_served_purge=allow, download_rate=10 * 1024 ** 2)
    assert result["verdict"] == verdict, result["reason"]
    scratch = store.dirs["scratch"].path
    assert result["purge"] == [p.format(scratch=scratch) for p in purge]
    # the cumulative column is the running sum: shared blobs are counted once
    running = result["orphan_bytes"]
    for row in result["candidates"]:
        running += row["bytes"]
        assert row["cumulative_bytes"] == running
    if extra:
        assert extra(result), result
    assert disk_plan.summary_line(result).endswith(("fits", "fits_after_purge", ")", "room (downtime)"))


def test_purge_bytes_of_a_plan_equal_a_fresh_simulation(store):
    state = protections(store)
    items = purge_items.order_lru(store, purge_items.all_candidates(store, state["protections"])[0])
    plan = disk_plan.make_plan(store, {"available": 0}, needed_bytes=10 ** 9, headroom_bytes=0,
                               candidates=items, orphans=orphans_of(store))
    sim = model_store.DeletionSimulator(store)
    total = sum(sim.apply(model_store.Item("orphan", folder=o.folder, path=o.path)).bytes for o in store.orphans)
    total += sum(sim.apply(i).bytes for i in items)
    assert plan["orphan_bytes"] + plan["candidates_bytes"] == total


# ------------------------------------------------------------------------- vLLM's caches
CACHES = {"models--org--old": 300 * KB, "models--org--served": 500 * KB, "models--org--keep": 50 * KB}


def test_a_step_that_removes_a_model_frees_its_vllm_cache_folder_too(store):
    state = protections(store)
    # org/old's two revisions: the first leaves the model (its cache stays), the second removes it
    items = _items(store, "old-1", "old-2", "scratch")
    bare = disk_plan.make_plan(store, {"available": 0}, needed_bytes=10 ** 9, headroom_bytes=0, candidates=items)
    plan = disk_plan.make_plan(store, {"available": 0}, needed_bytes=10 ** 9, headroom_bytes=0, candidates=items,
                               compile_caches=dict(CACHES))
    caches = [row["compile_cache_bytes"] for row in plan["candidates"]]
    assert caches == [0, 300 * KB, 0]
    # a row's bytes stay the store's (what model_purge deletes); the running total counts both
    assert [row["bytes"] for row in plan["candidates"]] == [row["bytes"] for row in bare["candidates"]]
    assert [row["cumulative_bytes"] for row in plan["candidates"]] == [
        row["cumulative_bytes"] + sum(caches[:i + 1]) for i, row in enumerate(bare["candidates"])]
    assert plan["candidates_bytes"] == bare["candidates_bytes"] + 300 * KB
    # a need the store alone cannot meet fits once the cache is counted, with the same purge
    need = bare["candidates_bytes"] + 100 * KB
    assert disk_plan.make_plan(store, {"available": 0}, needed_bytes=need, headroom_bytes=0,
                               candidates=items)["verdict"] == "does_not_fit"
    fits = disk_plan.make_plan(store, {"available": 0}, needed_bytes=need, headroom_bytes=0, candidates=items,
                               compile_caches=dict(CACHES))
    assert fits["verdict"] == "fits_after_purge" and fits["purge"] == [i.ident for i in items]
    assert fits["purge_bytes"] == bare["candidates_bytes"] and fits["purge_compile_cache_bytes"] == 300 * KB
    assert " (+300.0 KiB of their vLLM caches): org/old@" in disk_plan.summary_line(fits), disk_plan.summary_line(fits)

    # the served model's cache counts toward a served purge too
    def served_plan(extra, **kw):
        return disk_plan.make_plan(store, {"available": 0}, needed_bytes=bare["candidates_bytes"] + extra,
                                   headroom_bytes=0, candidates=items, served_items=state["served_items"],
                                   allow_served_purge=True, **kw)
    assert served_plan(700 * KB, compile_caches=dict(CACHES))["served_purge"]["bytes"] == \
        served_plan(700 * KB)["served_purge"]["bytes"] + 500 * KB
    assert served_plan(1000 * KB)["verdict"] == "does_not_fit"
    allowed = served_plan(1000 * KB, compile_caches=dict(CACHES))
    assert allowed["verdict"] == "fits_after_purge" and allowed["downtime"] is True
    assert allowed["purge_compile_cache_bytes"] == 800 * KB      # org/old's and the served model's


def test_the_store_counts_only_the_cache_folders_on_its_file_system(tmp_path):
    root = tmp_path / "cache" / "vllm"
    for folder, size in (("models--org--old", 64 * KB), ("models--org--new", 8 * KB)):
        (root / folder / "torch_compile_cache" / "abc").mkdir(parents=True)
        (root / folder / "torch_compile_cache" / "abc" / "graph.py").write_bytes(b"g" * size)
    (root / "modelinfos").mkdir()                                  # vLLM's own, not a model's
    device = os.stat(tmp_path).st_dev
    found = store_context.compile_caches_on(str(root), device, "disk_plan")
    assert set(found) == {"models--org--old", "models--org--new"}
    assert found["models--org--old"] >= 64 * KB > found["models--org--new"] >= 8 * KB
    assert store_context.compile_caches_on(str(root), device + 1, "disk_plan") == {}
    assert store_context.compile_caches_on(None, device, "disk_plan") == {}
    assert store_context.compile_caches_on(str(tmp_path / "absent"), device, "disk_plan") == {}
    with pytest.raises(store_context.StoreError, match="disk_plan: the compile cache root must be an absolute "
                                                       "path, got 'cache/vllm': give the folder of vLLM's caches"):
        store_context.compile_caches_on("cache/vllm", device, "disk_plan")


# ---------------------------------------------------------------------------------- inputs
@pytest.mark.parametrize("text,expected", [
    ("0", 0), ("1048576", 1048576), ("10K", 10240), ("10KiB", 10240), ("10kB", 10000),
    ("1.5G", int(1.5 * 1024 ** 3)), ("2GB", 2 * 1000 ** 3), ("1T", 1024 ** 4), (4096, 4096),
])
def test_parse_bytes(text, expected):
    assert plan_inputs.parse_bytes(text) == expected


@pytest.mark.parametrize("text,words", [
    ("-1", "negative"), ("-5G", "negative"), ("lots", "not a size"), ("5 parsecs", "not a size"),
    (True, "not a size"),
])
def test_parse_bytes_errors(text, words):
    with pytest.raises(plan_inputs.PlanError, match=words):
        plan_inputs.parse_bytes(text)


@pytest.mark.parametrize("text,total,expected", [
    ("5%", 1000, 50), ("0%", 1000, 0), ("100%", 1000, 1000), ("12.5%", 800, 100), ("1K", 10, 1024),
])
def test_parse_headroom(text, total, expected):
    assert plan_inputs.parse_headroom(text, total) == expected


@pytest.mark.parametrize("text,words", [("-5%", "negative"), ("101%", "over 100"), ("x%", "percentage"),
                                        ("-1G", "negative")])
def test_parse_headroom_errors(text, words):
    with pytest.raises(plan_inputs.PlanError, match=words):
        plan_inputs.parse_headroom(text, 1000)


PATHS = ["config.json", "model-00001.safetensors", "sub/dir/x.bin", ".gitattributes", "original/consolidated.pth",
         "tokenizer.json", "a\\b.txt"]


@pytest.mark.parametrize("allow,ignore", [
    (None, None), (["*.safetensors"], None), (None, ["original/*"]), (["*.json", "sub/"], ["token*"]),
    ("*.json", None), (["nothing*"], None), (None, ["*"]),
])
def test_filter_paths_matches_huggingface_hub(allow, ignore):
    expected = list(filter_repo_objects(PATHS, allow_patterns=allow, ignore_patterns=ignore))
    assert hub_client.filter_paths(PATHS, allow, ignore) == expected


@pytest.mark.parametrize("name,models,words", [
    ("nope", MODELS, "unknown model name 'nope' (target): the catalog has keeper, old-1"),
    ("x", {}, "empty"),
    ("x", {"x": {"revision": "main"}}, "has no repo_id"),
    ("x", {"x": {"repo_id": "a/b/c"}}, "malformed"),
    ("x", {"x": {"repo_id": "a/b", "revision": ""}}, "revision must be"),
    ("x", {"x": {"repo_id": "a/b", "allow_patterns": "*.json"}}, "list of glob"),
    ("x", {"x": "a/b"}, "not a mapping"),
])
def test_catalog_errors(name, models, words):
    with pytest.raises(plan_inputs.PlanError, match=words.replace("(", r"\(").replace(")", r"\)")):
        plan_inputs.catalog_entry(models, name, "target")


def test_catalog_entry_defaults():
    e = plan_inputs.catalog_entry({"m": {"repo_id": "a/b"}}, "m", "target")
    assert e == {"name": "m", "repo_id": "a/b", "revision": "main", "allow_patterns": None,
                 "ignore_patterns": None}


@pytest.mark.parametrize("text,kind,ident", [
    ("org/old", "repo", "org/old"),
    ("org/old@" + V1, "revision", "org/old@" + V1),
    ("org/old@main", "revision", "org/old@" + V2),
    ("old-1", "revision", "org/old@" + V1),
    ("model:org/old", "repo", "org/old"),
    ("scratch", "dir", "{models}/scratch"),
    ("{cache}/models--org--old", "repo", "org/old"),
    ("{cache}/models--org--old/snapshots/" + V2, "revision", "org/old@" + V2),
    ("{models}/scratch", "dir", "{models}/scratch"),
])
def test_resolve_item(store, text, kind, ident):
    fmt = {"cache": store.cache_dir, "models": store.models_dir}
    item = purge_items.resolve_item(store, text.format(**fmt), MODELS)
    assert item.kind == kind and item.ident == ident.format(**fmt)


@pytest.mark.parametrize("text,error,words", [
    ("org/absent", plan_inputs.NotInStore, "not in the model store"),
    ("org/old@" + "f" * 40, plan_inputs.NotInStore, "not cached"),
    ("target", plan_inputs.NotInStore, "not in the cache"),
    ("org/na me", plan_inputs.PlanError, "malformed"),
    ("a/b/c", plan_inputs.PlanError, "malformed"),
    ("org/old@bad ref!", plan_inputs.PlanError, "neither a commit"),
    ("{cache}/models--org--old/blobs", plan_inputs.PlanError, "not a purgeable item"),
    ("{models}/scratch/w.bin", plan_inputs.PlanError, "only whole model directories"),
    ("/etc", plan_inputs.PlanError, "outside the model store"),
    ("", plan_inputs.PlanError, "empty"),
])
def test_resolve_item_errors(store, text, error, words):
    fmt = {"cache": store.cache_dir, "models": store.models_dir}
    with pytest.raises(error, match=words):
        purge_items.resolve_item(store, text.format(**fmt), MODELS)


def test_ambiguous_item(store, tmp_path):
    synthetic_cache.add_revision(tmp_path / "hub", "scratch", V1, {"a": b"1"})
    store2 = store_scan.scan_store(store.cache_dir, store.models_dir)
    with pytest.raises(plan_inputs.PlanError, match="ambiguous"):
        purge_items.resolve_item(store2, "scratch", MODELS)


def test_served_from_record_path_and_unit(store):
    snap = store.repo("org/old").revisions[V2].path
    record = {"model": "old-2", "repo_id": None, "commit": None, "path": snap + "/"}
    state = build_protections(store, models=MODELS, record=record, record_path="/r.json",
                              unit={"model": "org/keep", "active": True, "unit_state": "active"},
                              unit_name="vllm.service")
    prot = state["protections"]
    old_v2 = purge_items.resolve_item(store, "org/old@" + V2, MODELS)
    old_v1 = purge_items.resolve_item(store, "org/old@" + V1, MODELS)
    keep_repo = purge_items.resolve_item(store, "org/keep", MODELS)
    assert "deployment record /r.json" in protecting(old_v2, prot).label
    assert protecting(old_v1, prot) is None                     # another revision may go
    assert "unit vllm.service" in protecting(keep_repo, prot).label   # a repo id: every revision
    assert state["served"]["sources"] == ["deployment_record", "unit"]
    assert state["served"]["unit_active"] is True
    assert [i.ident for i in state["served_items"]] == ["org/old@" + V2, "org/keep"]


def test_served_model_that_is_also_kept_is_not_a_served_purge_item(store):
    state = build_protections(store, models=MODELS, served="keeper", keep=["keeper"])
    assert state["served_items"] == []


def test_plain_dir_protected_by_a_path_inside_it(store):
    d = purge_items.resolve_item(store, "scratch", MODELS)
    state = build_protections(store, protect_paths=[store.dirs["scratch"].path + "/w.bin"])
    assert protecting(d, state["protections"]).rule == "path"


def test_branch_revision_protected_through_the_cached_ref(store):
    p = protect_model(store, "org/old", "main", "keep", "kept")
    assert p.commit == V2
    unresolved = protect_model(store, "org/old", "dev", "keep", "kept")
    assert unresolved.commit == ""   # every revision: the branch cannot be pinned from the cache


# ------------------------------------------------------------------ what the module shell calls
def test_read_target_with_explicit_bytes_asks_no_hub(tmp_path):
    store = store_scan.scan_store("", "")
    entry = {"repo_id": "org/new", "revision": "b" * 40, "allow_patterns": None, "ignore_patterns": None}
    target, listed = store_context.read_target(store, entry, name="t", target_bytes=1000, block_size=4096,
                                               endpoint="http://127.0.0.1:9")
    assert listed is None
    assert target["source"] == "explicit" and target["needed_bytes"] == 1000 and target["commit"] == "b" * 40


def test_store_warnings_and_the_does_not_fit_message(tmp_path):
    cache = tmp_path / "hub"
    synthetic_cache.add_revision(cache, "org/one", "a" * 40, {"config.json": b"{}"})
    os.symlink("../../blobs/" + "0" * 64, cache / synthetic_cache.folder_for("org/one") / "snapshots" / ("a" * 40) / "gone.bin")
    store = store_scan.scan_store(str(cache), "")
    warnings = disk_plan.store_warnings(store)
    assert len(warnings) == 1 and warnings[0].startswith("disk_plan: cache repo org/one: ") and "broken" in warnings[0]
    assert (disk_plan.does_not_fit_message(None, "/data", "needs more") ==
            "disk_plan: 'the target' does not fit on /data: needs more")
    assert disk_plan.does_not_fit_message("t", "/data", "x") == "disk_plan: 't' does not fit on /data: x"


def test_orphan_in_use_only_while_a_lock_is_held(tmp_path):
    cache = tmp_path / "hub"
    synthetic_cache.add_revision(cache, "org/one", "a" * 40, {"config.json": b"{}"})
    synthetic_cache.add_orphan(cache, "org/one", "e" * 64, 100)
    store = store_scan.scan_store(str(cache), "")
    (orphan,) = store.orphans
    assert disk_plan.orphan_in_use(store)(orphan) is False
