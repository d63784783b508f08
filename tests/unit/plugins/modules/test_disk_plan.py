"""The disk_plan module on real caches filled by real downloads, and its bad input.

The cache is written by huggingface_hub.snapshot_download from the local Hub (tests marked `hub`),
on a file system of its own (tests/support/scratch_fs.py: a loop-mounted ext4 as root); the world
these tests plan on (World) is the one model_purge's module tests purge, in test_model_purge.py
beside this file. Bad-input tests need no Hub (marked `unit`). The plan's logic is table-tested in
tests/unit/plugins/module_utils/store/test_disk_plan.py.
"""
from __future__ import annotations

import json
import os

import pytest

from tests.support.modules import run_module
from tests.support.scratch_fs import scratch_fs, tree_fingerprint
from tests.unit.plugins.modules.test_model_purge import KB, World, _bad_world, blob, freed_measured, ok


@pytest.fixture
def world(local_hub, hf_env):
    env = {**os.environ, **hf_env}
    with scratch_fs() as fs:
        yield World(local_hub, env, fs).populate()


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
def test_a_removed_models_vllm_cache_counts_as_freed(world):
    caches = world.fs.root / "vllm-cache"
    graphs = caches / "models--lab--old" / "torch_compile_cache" / "0a1b"
    graphs.mkdir(parents=True)
    (graphs / "inductor.bin").write_bytes(os.urandom(96 * KB))
    (caches / "models--lab--served").mkdir()
    bare = ok(world.plan())
    plan = ok(world.plan(compile_cache_root=str(caches)))
    row, bare_row = (next(c for c in p["candidates"] if c["item"] == "lab/old") for p in (plan, bare))
    assert row["compile_cache_bytes"] >= 96 * KB and bare_row["compile_cache_bytes"] == 0
    assert row["bytes"] == bare_row["bytes"]             # the store's; the cache beside it
    assert row["cumulative_bytes"] == bare_row["cumulative_bytes"] + row["compile_cache_bytes"]
    assert plan["compile_caches"]["folders"] == 2 and plan["compile_caches"]["bytes"] >= 96 * KB
    # nothing is deleted by planning
    assert (graphs / "inductor.bin").stat().st_size == 96 * KB


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
