"""How often a migration asks the Hub: disk_plan resolves the target's revision and lists its
files; hf_snapshot, given that commit (resolved_commit, as the migrate role passes it), resolves
nothing again, and a commit whose tree huggingface_hub's cache holds is listed by nobody.

Counted in the local Hub's request log, by endpoint: ``revision`` (repo_info, the resolve),
``tree`` (list_repo_tree), ``resolve`` (file downloads).
"""
from __future__ import annotations

from collections import Counter

import pytest

from tests.support.modules import run_module
from tests.support.synthetic_cache import incompressible as blob

pytestmark = pytest.mark.hub

FILES = {"config.json": b'{"architectures": ["LlamaForCausalLM"]}\n', "tokenizer.json": b'{"v": {}}\n' * 50,
         "model.safetensors": blob("q", 300_000)}


@pytest.fixture(scope="module")
def commit(_local_hub_server):
    return _local_hub_server.publish("org/counted", FILES)


def counts(hub) -> dict:
    """{endpoint: requests} of the Hub's log, then an empty log; a HEAD (huggingface_hub's
    metadata request before a download) counts apart as "HEAD <endpoint>"."""
    seen = Counter(r["endpoint"] if r["method"] == "GET" else "%s %s" % (r["method"], r["endpoint"])
                   for r in hub.requests())
    hub.clear_log()
    return dict(seen)


def downloads(n: int) -> dict:
    """What fetching n files costs: huggingface_hub's HEAD for the metadata, then the GET."""
    return {"HEAD resolve": n, "resolve": n}


def plan(hub, env, cache, tmp_path) -> dict:
    r = run_module("disk_plan", {"cache_dir": str(cache), "endpoint": hub.url, "target": "counted",
                                 "models": {"counted": {"repo_id": "org/counted", "revision": "main"}},
                                 "deployment_record": str(tmp_path / "deployment.json"), "vllm_unit": ""}, env=env)
    assert r.get("failed") is not True, r.get("msg")
    return r


def fetch(hub, env, cache, **extra) -> dict:
    r = run_module("hf_snapshot", dict({"repo_id": "org/counted", "revision": "main", "endpoint": hub.url,
                                        "use_xet": False, "cache_dir": str(cache)}, **extra), env=env)
    assert r.get("failed") is not True, r.get("msg")
    return r


def test_a_migration_resolves_the_branch_once(local_hub, hf_env, commit, tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    planned = plan(local_hub, hf_env, cache, tmp_path)
    assert planned["target"]["commit"] == commit and planned["target"]["source"] == "hub"
    assert counts(local_hub) == {"revision": 1, "tree": 1}

    fetched = fetch(local_hub, hf_env, cache, resolved_commit=planned["target"]["commit"])
    assert fetched["changed"] is True and fetched["commit"] == commit and fetched["revision"] == "main"
    assert fetched["resolved_by"] == "given" and fetched["listing_source"] == "hub"
    assert counts(local_hub) == dict(tree=1, **downloads(len(FILES)))           # no second resolve

    # hf_snapshot wrote huggingface_hub's tree cache: the next plan resolves, and lists nothing
    again = plan(local_hub, hf_env, cache, tmp_path)
    assert again["target"]["source"] == "tree_cache" and again["target"]["download_bytes"] == 0
    assert counts(local_hub) == {"revision": 1}
    # ... and a fetch given the commit asks the Hub nothing at all
    assert fetch(local_hub, hf_env, cache, resolved_commit=commit)["changed"] is False
    assert counts(local_hub) == {}


def test_without_a_resolved_commit_the_fetch_resolves_itself(local_hub, hf_env, commit, tmp_path):
    fetched = fetch(local_hub, hf_env, tmp_path / "cache")
    assert fetched["commit"] == commit and fetched["resolved_by"] == "hub"
    assert counts(local_hub) == dict(revision=1, tree=1, **downloads(len(FILES)))
    # the tree is cached now: a fetch of another pattern set lists nothing, a branch still resolves
    assert fetch(local_hub, hf_env, tmp_path / "cache", allow_patterns=["*.json"])["listing_source"] == "manifest"
    assert counts(local_hub) == {"revision": 1}


def test_a_resolved_commit_with_a_cached_tree_lists_nothing(local_hub, hf_env, commit, tmp_path):
    first = tmp_path / "first"
    fetch(local_hub, hf_env, first, resolved_commit=commit, allow_patterns=["config.json"])
    assert counts(local_hub) == dict(tree=1, **downloads(1))
    # another download of the same commit into the same cache, with other patterns: the tree cache
    # (written by the first) answers, only the new files are fetched
    manifest = first / "models--org--counted" / "modelswap" / (commit + ".json")
    manifest.unlink()
    r = fetch(local_hub, hf_env, first, resolved_commit=commit)
    assert r["listing_source"] == "tree_cache" and r["files_downloaded"] == len(FILES) - 1
    assert counts(local_hub) == downloads(len(FILES) - 1)
