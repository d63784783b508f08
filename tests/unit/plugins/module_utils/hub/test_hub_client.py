"""hub_client, the one owner of Hub access: error kinds, patterns, the tree cache, the requests a
HubClient sends (a fake HfApi counts them), and hf_snapshot's resolved_commit."""
from __future__ import annotations

import errno
import json

import pytest

from ansible_collections.modelswap.vllm.plugins.module_utils.hub import target_listing
from ansible_collections.modelswap.vllm.plugins.module_utils.store import plan_inputs
from ansible_collections.modelswap.vllm.plugins.module_utils.hub import hf_errors
from ansible_collections.modelswap.vllm.plugins.module_utils.hub import hf_snapshot
from ansible_collections.modelswap.vllm.plugins.module_utils.hub import hub_client
from tests.support.hub_errors import http_error, local_entry_error_from
from tests.support.modules import run_module

pytestmark = pytest.mark.unit

COMMIT = "c" * 40
A40, B40, S64 = "a" * 40, "b" * 40, "5" * 64
LISTING = {"config.json": {"size": 3, "blob_id": A40},
           "w.safetensors": {"size": 10, "blob_id": B40, "lfs_sha256": S64}}
DEAD = "http://127.0.0.1:9"          # discard port: nothing listens


# ------------------------------------------------------------------------------------------ errors
def errors_module():
    from huggingface_hub import errors
    return errors


# (exception, kind, transient, words in the message of a fetch, words left out of a plan's)
@pytest.mark.parametrize("make, kind, transient, words, fetch_only", [
    (lambda: http_error("GatedRepoError", 401), "gated", False, ["o/r is a gated repository", "no token was given"],
     "model_fetch_token"),
    (lambda: http_error("RepositoryNotFoundError", 404), "repo_not_found", False, ["repository o/r was not found",
                                                                                   "HTTP 404"], None),
    (lambda: http_error("RevisionNotFoundError", 404), "revision_not_found", False, ["revision 'main'",
                                                                                     "pin an existing"], None),
    (lambda: http_error("RemoteEntryNotFoundError", 404), "entry_not_found", True, ["answered 404"], None),
    (lambda: http_error("HfHubHTTPError", 401), "unauthorized", False, ["HTTP 401", "fix or renew the token",
                                                                        "may be private"], None),
    (lambda: http_error("HfHubHTTPError", 403), "forbidden", False, ["HTTP 403", "denied access to o/r"], None),
    (lambda: http_error("HfHubHTTPError", 503), "hub_unavailable", True, ["HTTP 503", "retry later"],
     "completed files are kept"),
    (lambda: http_error("HfHubHTTPError", 429), "hub_unavailable", True, ["HTTP 429"], None),
    (lambda: http_error("HfHubHTTPError", 400), "http_error", False, ["HTTP 400"], None),
    (lambda: ConnectionRefusedError(111, "refused"), "unreachable", True, ["cannot reach the Hub at http://hub"],
     "completed files are kept"),
    (lambda: TimeoutError("slow"), "unreachable", True, ["cannot reach"], None),
    (lambda: OSError("Consistency check failed: file should be of size 3"), "short_transfer", True,
     ["ended short"], None),
    (lambda: ValueError("file too large to be downloaded"), "needs_xet", False, ["use_xet=true"], None),
    (lambda: RuntimeError("weird"), "error", False, ["doing it failed: RuntimeError: weird"], None),
])
def test_classify_table(make, kind, transient, words, fetch_only):
    ctx = dict(repo_id="o/r", revision="main", where="the Hub at http://hub", token_given=False, what="doing it")
    err = hub_client.classify(make(), errors_module(), **ctx)
    assert isinstance(err, hub_client.HubError) and err.kind == kind and err.transient is transient
    for word in words:
        assert word in str(err), (word, str(err))
    plan = hub_client.classify(make(), errors_module(), fetching=False, **ctx)
    assert plan.kind == kind
    if fetch_only:
        assert fetch_only in str(err) and fetch_only not in str(plan)


def test_classify_searches_the_chain_and_asks_local_last():
    err = hub_client.classify(local_entry_error_from(http_error("GatedRepoError", 403)), errors_module(), repo_id="o/r",
                              revision="main", where="w", token_given=True, what="x")
    assert err.kind == "gated" and "the token given has no access" in str(err)
    disk = OSError(errno.ENOSPC, "No space left on device")
    local = hub_client.classify(disk, None, repo_id="o/r", revision="main", where="w", token_given=False, what="x",
                                local=lambda e: hub_client.HubError("full", "disk_full") if getattr(e, "errno", None) else None)
    assert local.kind == "disk_full"
    # hf_errors keeps its own kinds for this host's failures, the Hub's come from hub_client
    assert hf_errors.classify(disk, None, repo_id="o/r", revision="main", where="w", token_given=False,
                              what="x").cause == "disk_full"
    assert hf_errors.classify(ConnectionRefusedError(111, "no"), None, repo_id="o/r", revision="main", where="w",
                              token_given=False, what="x").cause == "unreachable"


def test_an_insecure_endpoint_is_refused_before_any_request():
    with pytest.raises(hub_client.HubError) as info:
        hub_client.refuse_insecure("http://mirror", True, False, "list o/r@main")
    assert info.value.kind == "insecure_endpoint" and str(info.value).startswith("refusing to list o/r@main: ")
    hub_client.refuse_insecure("http://mirror", True, True, "x")      # trusted
    hub_client.refuse_insecure("http://mirror", False, False, "x")    # no token
    hub_client.refuse_insecure("https://hub", True, False, "x")


# ------------------------------------------------------------------------------------------ patterns
@pytest.mark.parametrize("allow, ignore, kept", [
    (None, None, ["config.json", "onnx/model.onnx", "w.safetensors"]),
    (["*.json"], None, ["config.json"]),
    ("*.json", None, ["config.json"]),
    (None, ["onnx/"], ["config.json", "w.safetensors"]),
    (["*.json", "onnx\\"], ["config*"], ["onnx/model.onnx"]),
])
def test_filter_paths_and_select(allow, ignore, kept):
    paths = ["config.json", "onnx/model.onnx", "w.safetensors"]
    assert hub_client.filter_paths(paths, allow, ignore) == kept
    assert sorted(hub_client.select({p: {} for p in paths}, allow, ignore, "o/r", COMMIT)) == kept


@pytest.mark.parametrize("listing, allow, kind, words", [
    ({}, None, "empty_repo", ["has no files"]),
    ({"config.json": {}}, ["*.gguf"], "no_match", ["match none of the 1 files", '["*.gguf"]', "fix the patterns"]),
])
def test_select_that_keeps_nothing_is_an_error(listing, allow, kind, words):
    with pytest.raises(hub_client.HubError) as info:
        hub_client.select(listing, allow, None, "o/r", COMMIT)
    assert info.value.kind == kind and all(w in str(info.value) for w in words)


# ------------------------------------------------------------------------------------------ tree cache
def test_tree_cache_write_read_and_checks(tmp_path):
    root = hub_client.tree_root(str(tmp_path), "o/r")
    assert root == str(tmp_path / "models--o--r")
    assert hub_client.read_tree(root, COMMIT) is None and hub_client.cached_listing([root], "o/r", COMMIT) is None
    assert hub_client.write_tree(root, COMMIT, LISTING) is True
    assert hub_client.write_tree(root, COMMIT, LISTING) is False                # only when missing
    data = json.loads((tmp_path / "models--o--r" / "trees" / (COMMIT + ".json")).read_text())
    assert data["format_version"] == 1 and data["files"]["w.safetensors"]["lfs_size"] == 10
    assert hub_client.read_tree(root, COMMIT) == LISTING
    listing, path = hub_client.cached_listing([str(tmp_path / "elsewhere"), root], "o/r", COMMIT)
    assert listing == LISTING and path == hub_client.tree_path(root, COMMIT)
    assert hub_client.read_tree(root, "main") is None                           # only a commit names a tree


@pytest.mark.parametrize("content", ["{not json", json.dumps({"format_version": 2, "files": {}}),
                                     json.dumps({"format_version": 1, "files": []}),
                                     json.dumps({"format_version": 1, "files": {"a": {"size": 1}}})])
def test_a_damaged_or_foreign_tree_cache_is_a_miss(tmp_path, content):
    path = tmp_path / "trees" / (COMMIT + ".json")
    path.parent.mkdir()
    path.write_text(content)
    assert hub_client.read_tree(str(tmp_path), COMMIT) is None


def test_an_unsafe_tree_cache_is_an_error_not_a_miss(tmp_path):
    hub_client.write_tree(str(tmp_path), COMMIT, dict(LISTING, **{"../x": {"size": 1, "blob_id": A40}}))
    with pytest.raises(hub_client.HubError) as info:
        hub_client.cached_listing([str(tmp_path)], "o/r", COMMIT)
    assert info.value.kind == "bad_listing" and "'..' segment" in str(info.value)
    assert "remove that file" in str(info.value)


# ------------------------------------------------------------------------------------------ the client
class RepoFile:
    def __init__(self, path, size, blob_id, sha=None):
        self.path, self.size, self.blob_id = path, size, blob_id
        self.lfs = {"sha256": sha} if sha else None


class Folder:
    path = "sub"


class FakeApi:
    """HfApi's repo_info and list_repo_tree, counting calls."""

    def __init__(self, files=None, fail=None):
        self.calls = []
        self.files = files if files is not None else [RepoFile("config.json", 3, A40), Folder(),
                                                      RepoFile("w.safetensors", 10, B40, S64)]
        self.fail = fail

    def repo_info(self, repo_id, revision, repo_type):
        self.calls.append(("repo_info", revision))
        if self.fail:
            raise self.fail

        class Info:
            sha = COMMIT
        return Info()

    def list_repo_tree(self, repo_id, revision, recursive, repo_type):
        self.calls.append(("list_repo_tree", revision))
        if self.fail:
            raise self.fail
        return iter(self.files)


class Lib:
    RepoFile = RepoFile
    errors = None


def client(api, **kw):
    return hub_client.HubClient("o/r", Lib, api=api, endpoint="http://hub", **kw)


def test_client_resolves_a_branch_once_and_a_commit_never(tmp_path):
    api = FakeApi()
    c = client(api)
    assert c.resolve("main") == COMMIT and c.resolve(COMMIT) == COMMIT
    assert api.calls == [("repo_info", "main")] and c.requests == {"resolve": 1, "list": 0}


def test_client_lists_once_then_reads_the_tree_cache(tmp_path):
    api = FakeApi()
    c = client(api)
    root = hub_client.tree_root(str(tmp_path), "o/r")
    listing, source = c.listing(COMMIT, [root])
    assert (listing, source) == (LISTING, "hub")
    hub_client.write_tree(root, COMMIT, listing)
    assert c.listing(COMMIT, [root]) == (LISTING, "tree_cache")
    assert api.calls == [("list_repo_tree", COMMIT)] and c.requests == {"resolve": 0, "list": 1}


def test_client_refuses_an_unsafe_listing_and_classifies_failures():
    evil = client(FakeApi(files=[RepoFile("../../etc/x", 1, A40)]))
    with pytest.raises(hub_client.HubError) as info:
        evil.list_tree(COMMIT)
    assert info.value.kind == "bad_listing" and "a real Hub never lists such a file" in str(info.value)
    down = client(FakeApi(fail=ConnectionRefusedError(111, "refused")))
    with pytest.raises(hub_client.HubError) as info:
        down.resolve("main")
    assert info.value.kind == "unreachable" and "resolving o/r@main: cannot reach the Hub at http://hub" in str(info.value)
    calls = []
    retried = client(FakeApi(), call=lambda fn, what: calls.append(what) or fn())
    assert retried.resolve("main") == COMMIT and calls == ["resolving o/r@main"]


def test_disk_planning_lists_through_the_client(tmp_path):
    api = FakeApi()
    made = []

    def connect(repo_id, **kw):
        made.append(kw)
        return client(api, fetching=kw["fetching"])

    listed = target_listing.list_target("o/r", "main", cache_dir=str(tmp_path), allow_patterns=["*.safetensors"],
                                        connect=connect)
    assert listed == {"commit": COMMIT, "source": "hub", "files": [{"path": "w.safetensors", "size": 10, "etag": S64}]}
    assert api.calls == [("repo_info", "main"), ("list_repo_tree", COMMIT)] and made[0]["fetching"] is False
    # a pinned commit whose tree is cached: no client at all
    hub_client.write_tree(hub_client.tree_root(str(tmp_path), "o/r"), COMMIT, LISTING)
    cached = target_listing.list_target("o/r", COMMIT, cache_dir=str(tmp_path), connect=None)
    assert cached["source"] == "tree_cache" and len(cached["files"]) == 2
    # a branch: resolved (one request), then the tree cache of its commit
    api.calls.clear()
    assert target_listing.list_target("o/r", "main", cache_dir=str(tmp_path), connect=connect)["source"] == "tree_cache"
    assert api.calls == [("repo_info", "main")]
    down = FakeApi(fail=ConnectionRefusedError(111, "refused"))
    with pytest.raises(plan_inputs.PlanError, match="cannot reach .* or pass target_bytes"):
        target_listing.list_target("o/r", "dev", cache_dir=str(tmp_path), connect=lambda r, **kw: client(down, fetching=False))
    with pytest.raises(plan_inputs.PlanError, match="match none of the 2 files"):
        target_listing.list_target("o/r", COMMIT, cache_dir=str(tmp_path), allow_patterns=["*.gguf"])


# ------------------------------------------------------------------------------------------ resolved_commit
def test_a_resolved_commit_skips_the_resolve():
    job = hf_snapshot.SnapshotJob("o/r", revision="main", resolved_commit=COMMIT)
    assert job.resolve() == COMMIT and job.resolved_by == "given" and job.requests_made is False
    pinned = hf_snapshot.SnapshotJob("o/r", revision=COMMIT, resolved_commit=COMMIT)
    assert pinned.resolve() == COMMIT and pinned.resolved_by == "pinned"


@pytest.mark.parametrize("value, words", [
    ("abc", ["resolved_commit 'abc' is not a commit", "40 lowercase hex"]),
    ("C" * 40, ["is not a commit"]),
    ("c" * 40 + "\n", ["is not a commit"]),
    ("d" * 40, ["contradicts revision " + COMMIT]),
])
def test_a_bad_resolved_commit_is_refused_before_any_request(tmp_path, value, words):
    revision = COMMIT if value == "d" * 40 else "main"
    r = run_module("hf_snapshot", {"repo_id": "o/r", "revision": revision, "resolved_commit": value,
                                   "endpoint": DEAD, "cache_dir": str(tmp_path / "cache"), "retries": 0},
                   env={"HF_HOME": str(tmp_path / "hf-home"), "HF_TOKEN": ""})
    assert r.get("failed") is True and r["cause"] == "bad_option", r
    for word in words:
        assert word in r["msg"], (word, r["msg"])
    assert "cannot reach" not in r["msg"] and not (tmp_path / "cache").exists()
