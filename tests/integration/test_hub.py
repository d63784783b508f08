"""Real huggingface_hub (plain HTTP, no xet) against the lab's local Hub, with injected faults.

Each fault test asserts what the library does (docs/huggingface.md) and proves it on the Hub's
request log. Library behaviour relied on (huggingface_hub 2.4, file_download.http_get and
utils/_http.py): a body is read in 10 MiB chunks and a dropped connection is resumed from the last
whole chunk (Range) up to 5 times, 1 s apart; a GET answered 5xx is not retried; a HEAD answered
5xx is retried (1, 2, 4... s) only when nothing is cached; only sizes are checked.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import httpx2
import pytest
from huggingface_hub import HfApi, constants, get_hf_file_metadata, hf_hub_download, hf_hub_url, snapshot_download
from huggingface_hub.errors import (
    EntryNotFoundError, GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError, RemoteEntryNotFoundError,
    RepositoryNotFoundError, RevisionNotFoundError,
)

from tests.lab.hub.fixtures import LocalHub
from tests.lab.hub.store import git_blob_id

pytestmark = pytest.mark.hub

MiB = 1024 * 1024
CHUNK = constants.DOWNLOAD_CHUNK_SIZE  # 10 MiB: the library resumes from a multiple of this
NO_PROXY_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def payload(size: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(size)


SMALL = {
    "config.json": b'{"architectures": ["LlamaForCausalLM"], "hidden_size": 128}\n',
    "tokenizer.json": payload(20_000, 1),
    "model.safetensors": payload(2 * MiB, 2),
    "sub/notes.txt": b"tiny\n",
}
BIG = payload(CHUNK + 2 * MiB, 3)  # 12 MiB: one whole library chunk plus some, to see a real resume


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def repo(request) -> str:
    """A repository name of this test's own."""
    name = re.sub(r"-+", "-", re.sub(r"[^A-Za-z0-9._-]", "-", request.node.name)).strip("-.")
    return f"lab/{name[:90]}"


class HF:
    """huggingface_hub in this process, pointed at the local Hub with a private cache, no token."""

    def __init__(self, hub: LocalHub, env: dict):
        self.hub = hub
        self.cache = Path(env["HF_HUB_CACHE"])

    def snapshot(self, repo_id, **kw):
        kw.setdefault("token", False)
        kw.setdefault("cache_dir", self.cache)
        return Path(snapshot_download(repo_id, endpoint=self.hub.url, **kw))

    def file(self, repo_id, filename, **kw):
        kw.setdefault("token", False)
        kw.setdefault("cache_dir", self.cache)
        return Path(hf_hub_download(repo_id, filename, endpoint=self.hub.url, **kw))

    def api(self, token=False) -> HfApi:
        return HfApi(endpoint=self.hub.url, token=token)

    def storage(self, repo_id) -> Path:
        return self.cache / ("models--" + repo_id.replace("/", "--"))

    def leftovers(self, repo_id) -> list[Path]:
        return list(self.storage(repo_id).rglob("*.incomplete"))


@pytest.fixture
def hf(local_hub, hf_env, monkeypatch) -> HF:
    for key, value in hf_env.items():
        monkeypatch.setenv(key, value)
    # constants are read at import: set the ones the env would have set
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(constants, "HF_HOME", hf_env["HF_HOME"])
    monkeypatch.setattr(constants, "HF_HUB_CACHE", hf_env["HF_HUB_CACHE"])
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", os.path.join(hf_env["HF_HOME"], "token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", os.path.join(hf_env["HF_HOME"], "stored_tokens"))
    return HF(local_hub, hf_env)


def resolve_gets(hub, **match):
    return hub.settled().requests(method="GET", endpoint="resolve", **match)


def assert_tree_equal(folder: Path, files: dict):
    got = {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*")
           if p.is_file() and ".cache" not in p.relative_to(folder).parts}
    assert got.keys() == files.keys()
    for name, data in files.items():
        assert got[name] == data, f"{name} differs"


# --------------------------------------------------------------------------- downloads

def test_snapshot_into_cache_is_byte_identical(hf, local_hub, repo):
    commit = local_hub.publish(repo, SMALL)
    path = hf.snapshot(repo)
    assert path == hf.storage(repo) / "snapshots" / commit
    assert_tree_equal(path, SMALL)
    # blobs are named by ETag: sha256 for the LFS file, git blob id for the others
    blobs = {p.name for p in (hf.storage(repo) / "blobs").iterdir()}
    assert blobs == {sha256(SMALL["model.safetensors"])} | {
        git_blob_id(d) for n, d in SMALL.items() if n != "model.safetensors"}
    log = local_hub.settled().requests()
    assert [e["endpoint"] for e in log if e["endpoint"] != "resolve"] == ["revision", "tree"]
    assert sorted(e["file"] for e in log if e["method"] == "HEAD") == sorted(SMALL)
    gets = resolve_gets(local_hub)
    assert sorted(e["file"] for e in gets) == sorted(SMALL)
    assert all(e["status"] == 200 and e["range"] is None for e in gets)
    assert sum(e["bytes_sent"] for e in gets) == sum(map(len, SMALL.values()))
    assert not any(e["auth"] for e in log)


def test_snapshot_into_local_dir_is_byte_identical(hf, local_hub, repo, tmp_path):
    commit = local_hub.publish(repo, SMALL)
    target = tmp_path / "model"
    assert hf.snapshot(repo, local_dir=target) == target
    assert_tree_equal(target, SMALL)
    assert not any(p.is_symlink() for p in target.rglob("*"))
    meta = (target / ".cache" / "huggingface" / "download" / "model.safetensors.metadata").read_text().split("\n")
    assert meta[:2] == [commit, sha256(SMALL["model.safetensors"])]
    assert len(resolve_gets(local_hub)) == len(SMALL)

    # a local_dir of a snapshot already in the cache is a full copy from the cache: no file transfer
    hf.snapshot(repo)
    local_hub.clear_log()
    second = tmp_path / "copy"
    hf.snapshot(repo, local_dir=second)
    assert_tree_equal(second, SMALL)
    assert resolve_gets(local_hub) == []
    assert not (second / "model.safetensors").is_symlink()


def test_second_run_transfers_nothing(hf, local_hub, repo, tmp_path):
    commit = local_hub.publish(repo, SMALL)
    hf.snapshot(repo)
    hf.snapshot(repo, local_dir=tmp_path / "ld")
    local_hub.clear_log()

    hf.snapshot(repo)  # by branch: one revision call, nothing else
    hf.snapshot(repo, local_dir=tmp_path / "ld")
    log = local_hub.settled().requests()
    assert [(e["method"], e["endpoint"]) for e in log] == [("GET", "revision")] * 2

    local_hub.clear_log()
    assert hf.snapshot(repo, revision=commit).name == commit  # by commit: not one request
    hf.snapshot(repo, revision=commit, local_dir=tmp_path / "ld")
    assert local_hub.settled().requests() == []


def test_new_commit_redownloads_only_the_changed_file(hf, local_hub, repo, tmp_path):
    old = local_hub.publish(repo, SMALL)
    hf.snapshot(repo)
    changed = {**SMALL, "config.json": b'{"hidden_size": 256}\n'}
    new = local_hub.publish(repo, changed)
    assert new != old
    local_hub.clear_log()
    path = hf.snapshot(repo)
    assert path.name == new
    assert_tree_equal(path, changed)
    assert [e["file"] for e in resolve_gets(local_hub)] == ["config.json"]
    # the older commit stays servable, to a fresh client too
    assert_tree_equal(hf.snapshot(repo, revision=old, cache_dir=tmp_path / "fresh"), SMALL)
    assert local_hub.publish(repo, changed) == new  # same files: same commit


def test_branches_tags_and_refs(hf, local_hub, repo):
    main = local_hub.publish(repo, {"f.txt": b"main"})
    dev = local_hub.publish(repo, {"f.txt": b"dev"}, branch="dev", tag="v1")
    assert (hf.snapshot(repo, revision="dev") / "f.txt").read_bytes() == b"dev"
    assert hf.snapshot(repo, revision="v1").name == dev
    assert (hf.snapshot(repo) / "f.txt").read_bytes() == b"main"
    refs = hf.api().list_repo_refs(repo)
    assert {b.name: b.target_commit for b in refs.branches} == {"main": main, "dev": dev}
    assert {t.name: t.target_commit for t in refs.tags} == {"v1": dev}
    assert [c.commit_id for c in hf.api().list_repo_commits(repo, revision="dev")] == [dev]


def test_metadata_tree_pages_paths_info_and_dry_run(hf, local_hub, repo):
    files = {**SMALL, **{f"shards/part-{i:03d}.txt": str(i).encode() for i in range(120)}}
    commit = local_hub.publish(repo, files)
    api = hf.api()
    info = api.model_info(repo, files_metadata=True)
    assert info.sha == commit and info.gated is False
    sizes = {s.rfilename: s.size for s in info.siblings}
    assert sizes == {n: len(d) for n, d in files.items()}
    lfs = {s.rfilename: s.lfs.sha256 for s in info.siblings if s.lfs}
    assert lfs == {"model.safetensors": sha256(SMALL["model.safetensors"])}

    local_hub.clear_log()
    tree = list(api.list_repo_tree(repo, recursive=True))
    assert {e.path for e in tree if hasattr(e, "size")} == set(files)
    assert {e.path for e in tree if not hasattr(e, "size")} == {"sub", "shards"}
    assert len(local_hub.settled().requests(endpoint="tree")) == 3  # 122 entries, pages of 50 (Link rel="next")
    top = {e.path for e in api.list_repo_tree(repo)}
    assert top == {"config.json", "tokenizer.json", "model.safetensors", "sub", "shards"}

    paths = api.get_paths_info(repo, ["config.json", "sub", "missing.txt"])
    assert [(p.path, type(p).__name__) for p in paths] == [("config.json", "RepoFile"), ("sub", "RepoFolder")]
    assert paths[0].blob_id == git_blob_id(SMALL["config.json"])

    local_hub.clear_log()
    dry = snapshot_download(repo, endpoint=local_hub.url, cache_dir=hf.cache, token=False, dry_run=True,
                            allow_patterns=["*.json", "*.safetensors"])
    assert {d.filename: (d.file_size, d.will_download) for d in dry} == {
        n: (len(files[n]), True) for n in ("config.json", "tokenizer.json", "model.safetensors")}
    assert resolve_gets(local_hub) == []  # a dry run transfers no data: HEADs only
    assert len(local_hub.settled().requests(method="HEAD")) == 3


def test_unknown_repo_revision_and_file_raise_the_librarys_errors(hf, local_hub, repo):
    commit = local_hub.publish(repo, SMALL)
    with pytest.raises(RepositoryNotFoundError):
        hf.snapshot("lab/no-such-repo")
    with pytest.raises(RepositoryNotFoundError):
        hf.file("lab/no-such-repo", "config.json")
    with pytest.raises(RepositoryNotFoundError):
        hf.api().model_info("lab/no-such-repo")
    with pytest.raises(RevisionNotFoundError):
        hf.snapshot(repo, revision="no-such-branch")
    with pytest.raises(RevisionNotFoundError):
        hf.file(repo, "config.json", revision="f" * 40)
    with pytest.raises(RemoteEntryNotFoundError) as err:
        hf.file(repo, "no-such-file.json")
    assert isinstance(err.value, EntryNotFoundError)
    # the library remembers the absence per commit (X-Repo-Commit on the 404)
    assert (hf.storage(repo) / ".no_exist" / commit / "no-such-file.json").exists()
    codes = {(e["endpoint"], e["status"]) for e in local_hub.settled().requests()}
    assert codes == {("revision", 404), ("resolve", 404)}


def test_gated_repo_needs_a_valid_token_which_never_reaches_the_log(hf, local_hub, repo):
    local_hub.publish(repo, SMALL, gated=True)
    token = local_hub.token
    assert hf.api().model_info(repo).gated == "manual"  # metadata is public, as on the Hub
    with pytest.raises(GatedRepoError):
        hf.file(repo, "config.json")
    with pytest.raises(GatedRepoError):
        hf.snapshot(repo)
    with pytest.raises(GatedRepoError):
        hf.file(repo, "config.json", token="hf_not_a_valid_token")
    no_access = local_hub.store.add_token("outsider", gated_access=False)
    with pytest.raises(GatedRepoError) as err:
        hf.file(repo, "config.json", token=no_access)
    assert err.value.response.status_code == 403
    assert_tree_equal(hf.snapshot(repo, token=token), SMALL)
    assert hf.api(token).whoami()["name"] == "lab"

    # an unknown token is refused on a public repository too (401, not "not found")
    public = repo + "-public"
    local_hub.publish(public, {"a.txt": b"a"})
    with pytest.raises(HfHubHTTPError) as err:
        hf.file(public, "a.txt", token="hf_not_a_valid_token")
    assert err.value.response.status_code == 401 and not isinstance(err.value, RepositoryNotFoundError)

    log = local_hub.settled().requests()
    assert any(e["auth"] and e["status"] == 200 and e["user"] == "lab" for e in log)
    assert {e["status"] for e in log if e["endpoint"] == "resolve" and not e["auth"]} == {401}
    dumped = json.dumps(log) + local_hub.log_path.read_text()
    for secret in (token, no_access, "hf_not_a_valid_token"):
        assert secret not in dumped


def test_wire_protocol_headers_ranges_and_xet_only_on_lfs_files(local_hub, repo):
    commit = local_hub.publish(repo, SMALL)
    base = f"{local_hub.url}/{repo}/resolve/main"

    def call(url, method="GET", headers=None):
        req = urllib.request.Request(url, method=method, headers=headers or {})
        try:
            with NO_PROXY_OPENER.open(req, timeout=10) as r:
                return r.status, r.headers, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.headers, e.read()

    weights = SMALL["model.safetensors"]
    status, h, body = call(f"{base}/model.safetensors", "HEAD")
    assert status == 200 and body == b""
    assert h["X-Repo-Commit"] == commit and h["Accept-Ranges"] == "bytes"
    assert h["ETag"] == h["X-Linked-Etag"] == f'"{sha256(weights)}"'
    assert int(h["X-Linked-Size"]) == int(h["Content-Length"]) == len(weights)
    status, h, _ = call(f"{base}/config.json", "HEAD")
    assert h["ETag"] == f'"{git_blob_id(SMALL["config.json"])}"' and "X-Linked-Etag" not in h
    status, h, body = call(f"{base}/model.safetensors", headers={"Range": "bytes=100-199"})
    assert (status, body, h["Content-Range"]) == (206, weights[100:200], f"bytes 100-199/{len(weights)}")
    status, h, body = call(f"{base}/model.safetensors", headers={"Range": f"bytes={len(weights) - 7}-"})
    assert (status, body) == (206, weights[-7:])
    status, h, _ = call(f"{base}/model.safetensors", headers={"Range": f"bytes={len(weights)}-"})
    assert status == 416 and h["Content-Range"] == f"bytes */{len(weights)}"
    for url, code in [(f"{local_hub.url}/lab/nope/resolve/main/x", "RepoNotFound"),
                      (f"{local_hub.url}/{repo}/resolve/nope/x", "RevisionNotFound"),
                      (f"{base}/nope.json", "EntryNotFound"),
                      (f"{local_hub.url}/api/models/{repo}/revision/nope", "RevisionNotFound")]:
        status, h, body = call(url)
        assert (status, h["X-Error-Code"]) == (404, code) and json.loads(body)["error"] == h["X-Error-Message"]
    tree = json.loads(call(f"{local_hub.url}/api/models/{repo}/tree/{commit}?recursive=true")[2])
    expanded = json.loads(call(f"{local_hub.url}/api/models/{repo}/tree/{commit}?recursive=true&expand=true")[2])
    heads = {n: call(f"{base}/{n}", "HEAD")[1] for n in SMALL}
    # Xet (test_hub_xet.py) is advertised on LFS files only; the rest is plain git content
    with_xet = {n for n, h in heads.items() if any(k.lower().startswith("x-xet") for k in h)}
    assert with_xet == {"model.safetensors"} == {e["path"] for e in tree if "xetHash" in e}
    assert heads["model.safetensors"]["X-Xet-Hash"] == next(e["xetHash"] for e in tree if "xetHash" in e)
    assert all(entry["lastCommit"]["id"] == commit for entry in expanded)


# --------------------------------------------------------------------------- faults

@pytest.mark.parametrize("framing", ["length", "close"])
def test_short_body_fails_the_size_check_and_leaves_nothing(hf, local_hub, repo, framing):
    local_hub.publish(repo, SMALL)
    local_hub.fault("short_body", file="model.safetensors", framing=framing, length=1000)
    with pytest.raises(OSError, match="Consistency check failed"):
        hf.file(repo, "model.safetensors")
    assert hf.leftovers(repo) == []
    assert not (hf.storage(repo) / "blobs" / sha256(SMALL["model.safetensors"])).exists()
    (get,) = resolve_gets(local_hub)
    assert get["bytes_sent"] == 1000 and get["outcome"] == "short_body" and get["faults"]
    # the fault is spent: a rerun downloads the file whole
    assert hf.file(repo, "model.safetensors").read_bytes() == SMALL["model.safetensors"]


def test_cut_connection_resumes_with_range_from_the_last_whole_chunk(hf, local_hub, repo):
    local_hub.publish(repo, {"big.safetensors": BIG})
    after = CHUNK + MiB // 2
    local_hub.fault("cut", file="big.safetensors", after=after)
    assert sha256(hf.file(repo, "big.safetensors").read_bytes()) == sha256(BIG)
    first, second = resolve_gets(local_hub)
    assert (first["status"], first["outcome"], first["bytes_sent"]) == (200, "cut", after)
    assert second["range"] == f"bytes={CHUNK}-"  # the half chunk received after 10 MiB is fetched again
    assert (second["status"], second["bytes_sent"]) == (206, len(BIG) - CHUNK)
    assert hf.leftovers(repo) == []


def test_cut_before_the_first_chunk_restarts_from_zero(hf, local_hub, repo):
    local_hub.publish(repo, SMALL)
    local_hub.fault("cut", file="model.safetensors", after=MiB)
    assert hf.file(repo, "model.safetensors").read_bytes() == SMALL["model.safetensors"]
    first, second = resolve_gets(local_hub)
    assert first["outcome"] == "cut" and first["bytes_sent"] == MiB
    assert second["range"] is None and second["bytes_sent"] == 2 * MiB


def test_connection_cut_every_time_gives_up_after_five_retries(hf, local_hub, repo):
    local_hub.publish(repo, SMALL)
    local_hub.fault("cut", file="model.safetensors", after=1000, count=None)
    started = time.monotonic()
    with pytest.raises(httpx2.RemoteProtocolError):
        hf.file(repo, "model.safetensors")
    assert time.monotonic() - started >= 5  # five 1 s pauses
    assert [e["outcome"] for e in resolve_gets(local_hub)] == ["cut"] * 6
    assert hf.leftovers(repo) == []


def test_ignored_range_makes_the_library_start_over(hf, local_hub, repo):
    local_hub.publish(repo, {"big.safetensors": BIG})
    after = CHUNK + MiB
    local_hub.fault("cut", file="big.safetensors", after=after)
    local_hub.fault("ignore_range", file="big.safetensors")
    assert sha256(hf.file(repo, "big.safetensors").read_bytes()) == sha256(BIG)
    first, second = resolve_gets(local_hub)
    assert first["outcome"] == "cut"
    assert second["range"] == f"bytes={CHUNK}-" and second["status"] == 200
    assert second["bytes_sent"] == len(BIG)  # the whole file again: the library truncated and restarted


def test_flipped_byte_is_stored_silently(hf, local_hub, repo):
    local_hub.publish(repo, SMALL)
    offset = 12345
    local_hub.fault("flip_byte", file="model.safetensors", offset=offset)
    path = hf.file(repo, "model.safetensors")  # no error: the library only checks the size
    got, want = path.read_bytes(), SMALL["model.safetensors"]
    assert len(got) == len(want) and got != want
    assert [i for i in range(len(want)) if got[i] != want[i]] == [offset]
    assert got[offset] == want[offset] ^ 0xFF
    # the blob is named by the sha256 it does not have: only a verifier (modelswap's) can tell
    blob = path.resolve()
    assert blob.name == sha256(want) != sha256(got)
    # and the library never looks again: the next run serves the corrupted file from the cache
    local_hub.clear_log()
    assert hf.file(repo, "model.safetensors", revision=hf.api().model_info(repo).sha).read_bytes() == got
    assert resolve_gets(local_hub) == []


def test_wrong_etag_is_used_as_the_blob_name_unchecked(hf, local_hub, repo):
    files = {"a.safetensors": payload(50_000, 7), "b.safetensors": payload(50_000, 8)}
    local_hub.publish(repo, files)
    local_hub.fault("wrong_etag", file="a.safetensors", count=None)
    path = hf.file(repo, "a.safetensors")
    assert path.read_bytes() == files["a.safetensors"]
    assert path.resolve().name != sha256(files["a.safetensors"])  # stored under the made-up name

    # a wrong ETag equal to a blob already cached: that blob is linked in, with no transfer at all
    local_hub.fault("wrong_etag", file="b.safetensors", etag=path.resolve().name)
    local_hub.clear_log()
    b = hf.file(repo, "b.safetensors")
    assert b.read_bytes() == files["a.safetensors"] != files["b.safetensors"]
    assert resolve_gets(local_hub) == []


def test_wrong_etag_like_names_the_blob_of_another_revision(hf, local_hub, repo):
    first = local_hub.publish(repo, {"config.json": b'{"v": 1}\n'})
    local_hub.publish(repo, {"config.json": b'{"v": 2}\n'})
    local_hub.fault("wrong_etag", method="HEAD", file="config.json", like=f"{first}:config.json")
    meta = hf.api().get_paths_info(repo, ["config.json"], revision=first)[0]
    got = get_hf_file_metadata(hf_hub_url(repo, "config.json", endpoint=local_hub.url), token=False)
    assert got.etag == meta.blob_id                        # the first revision's blob id, for the second's file
    assert get_hf_file_metadata(hf_hub_url(repo, "config.json", endpoint=local_hub.url),
                                token=False).etag != meta.blob_id   # spent: the truth again


def test_bad_listing_serves_the_tampered_entry_raw(hf, local_hub, repo):
    local_hub.publish(repo, {"config.json": b"{}\n", "w.safetensors": payload(1000, 3)})
    local_hub.fault("bad_listing", endpoint="tree", target="config.json", path="../../../../etc/x")
    local_hub.fault("bad_listing", endpoint="tree", target="w.safetensors", lfs_oid="../" + "a" * 61, add=True)
    tree = {f.path: f for f in hf.api().list_repo_tree(repo, recursive=True)}
    assert sorted(tree) == ["../../../../etc/x", "w.safetensors"]
    assert tree["../../../../etc/x"].blob_id == git_blob_id(b"{}\n")
    tree = [f for f in hf.api().list_repo_tree(repo, recursive=True)]   # the first fault is spent
    lfs = sorted(f.lfs.sha256 for f in tree if f.path == "w.safetensors")
    assert lfs == sorted([sha256(payload(1000, 3)), "../" + "a" * 61])
    assert [f.path for f in tree if f.path == "config.json"] == ["config.json"]
    local_hub.fault("bad_listing", endpoint="paths-info", oid="a/b")
    assert hf.api().get_paths_info(repo, ["config.json"])[0].blob_id == "a/b"
    applied = [e["faults"] for e in local_hub.settled().requests(endpoint="paths-info")]
    assert len(applied) == 1 and applied[0][0].startswith("bad_listing#")
    assert hf.api().get_paths_info(repo, ["config.json"])[0].blob_id == git_blob_id(b"{}\n")


def test_throttle_slows_but_completes(hf, local_hub, repo):
    data = payload(512 * 1024, 9)
    local_hub.publish(repo, {"w.safetensors": data})
    local_hub.fault("throttle", file="w.safetensors", rate=512 * 1024)
    started = time.monotonic()
    assert hf.file(repo, "w.safetensors").read_bytes() == data
    assert time.monotonic() - started >= 0.9
    (get,) = resolve_gets(local_hub)
    assert get["duration"] >= 0.9 and get["bytes_sent"] == len(data)


def test_5xx_on_head_is_retried_when_nothing_is_cached(hf, local_hub, repo):
    local_hub.publish(repo, SMALL)
    local_hub.fault("http_error", status=503, method="HEAD", file="config.json", count=2)
    assert hf.file(repo, "config.json").read_bytes() == SMALL["config.json"]
    heads = local_hub.settled().requests(method="HEAD")
    assert [e["status"] for e in heads] == [503, 503, 200]


def test_5xx_on_get_is_not_retried(hf, local_hub, repo):
    local_hub.publish(repo, SMALL)
    local_hub.fault("http_error", status=500, method="GET", file="model.safetensors")
    with pytest.raises(HfHubHTTPError) as err:
        hf.file(repo, "model.safetensors")
    assert err.value.response.status_code == 500
    assert [e["status"] for e in resolve_gets(local_hub)] == [500]
    assert hf.leftovers(repo) == []
    assert hf.file(repo, "model.safetensors").read_bytes() == SMALL["model.safetensors"]


def test_5xx_on_the_revision_call_falls_back_to_the_cached_snapshot(hf, local_hub, repo):
    old = local_hub.publish(repo, SMALL)
    local_hub.fault("http_error", status=502, endpoint="revision")
    with pytest.raises(LocalEntryNotFoundError):  # nothing cached yet: an error
        hf.snapshot(repo)
    hf.snapshot(repo)
    local_hub.publish(repo, {**SMALL, "config.json": b"{}"})
    local_hub.fault("http_error", status=502, endpoint="revision")
    # the branch moved on, but the library silently returns the stale snapshot it has cached
    assert hf.snapshot(repo).name == old


def test_5xx_on_the_tree_listing_is_retried(hf, local_hub, repo):
    local_hub.publish(repo, SMALL)
    local_hub.fault("http_error", status=503, endpoint="tree")
    assert_tree_equal(hf.snapshot(repo), SMALL)
    assert [e["status"] for e in local_hub.settled().requests(endpoint="tree")] == [503, 200]


def test_delay_fault_and_fault_bookkeeping(local_hub, repo):
    local_hub.publish(repo, {"a.txt": b"a"})
    f = local_hub.fault("delay", seconds=0.5, endpoint="revision", count=2)
    assert f["count"] == 2 and f["id"] > 0
    started = time.monotonic()
    with NO_PROXY_OPENER.open(f"{local_hub.url}/api/models/{repo}", timeout=10) as r:
        assert json.loads(r.read())["id"] == repo
    assert time.monotonic() - started >= 0.5
    (left,) = local_hub.faults()
    assert left["count"] == 1 and left["hits"] == 1
    local_hub.remove_fault(f["id"])
    assert local_hub.faults() == []
    with pytest.raises(Exception, match="unknown fault kind"):
        local_hub.fault("nonsense")


# --------------------------------------------------------------------------- the server itself

def test_control_api_needs_the_key_and_is_not_logged(local_hub):
    req = urllib.request.Request(f"{local_hub.url}/_lab/faults", data=b'{"kind": "cut"}', method="POST")
    with pytest.raises(urllib.error.HTTPError) as err:
        NO_PROXY_OPENER.open(req, timeout=10)
    assert err.value.code == 403
    assert local_hub.faults() == []
    local_hub.health()
    assert local_hub.settled().requests() == []


def test_many_connections_and_clients_that_leave_mid_body(local_hub, repo):
    data = payload(256 * 1024, 11)
    local_hub.publish(repo, {"w.bin": data, "slow.bin": data})
    local_hub.fault("throttle", file="slow.bin", rate=64 * 1024, count=None)
    url = f"{local_hub.url}/{repo}/resolve/main"
    errors, results = [], []

    def full():
        try:
            with NO_PROXY_OPENER.open(f"{url}/w.bin", timeout=30) as r:
                results.append(r.read() == data)
        except Exception as e:  # noqa: BLE001 - collected for the assertion
            errors.append(e)

    def leave():
        try:
            with NO_PROXY_OPENER.open(f"{url}/slow.bin", timeout=30) as r:
                r.read(4096)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=full) for _ in range(40)] + [threading.Thread(target=leave) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == [] and results == [True] * 40
    deadline = time.monotonic() + 10
    while len(local_hub.settled().requests(file="slow.bin", outcome="client_gone")) < 8 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(local_hub.settled().requests(file="slow.bin", outcome="client_gone")) == 8
    assert local_hub.health()["ok"]
    with NO_PROXY_OPENER.open(f"{url}/w.bin", timeout=10) as r:
        assert r.read() == data


def test_threads_are_bounded_and_excess_connections_wait(tmp_path):
    hub = LocalHub(tmp_path / "store", tmp_path, ("--max-threads", "2"))
    try:
        data = payload(64 * 1024, 13)
        hub.publish("lab/t", {"slow.bin": data, "fast.bin": data})
        hub.fault("throttle", file="slow.bin", rate=64 * 1024, count=2)  # 1 s each
        done = {}

        def get(name):
            with NO_PROXY_OPENER.open(f"{hub.url}/lab/t/resolve/main/{name}", timeout=30) as r:
                assert r.read() == data
            done.setdefault(name, []).append(time.monotonic())

        threads = [threading.Thread(target=get, args=("slow.bin",)) for _ in range(2)]
        for t in threads:
            t.start()
        time.sleep(0.3)
        started = time.monotonic()
        get("fast.bin")  # both slots are held by the slow transfers: this one waits for one of them
        for t in threads:
            t.join(30)
        assert len(done["slow.bin"]) == 2
        assert done["fast.bin"][0] >= min(done["slow.bin"]) - 0.05
        assert done["fast.bin"][0] - started >= 0.25
    finally:
        assert hub.stop() == 0


def test_unicode_and_space_in_paths(hf, local_hub, repo):
    files = {"dir with space/ünïcödé.txt": b"u", "a+b=c.json": b"{}"}
    local_hub.publish(repo, files)
    assert_tree_equal(hf.snapshot(repo), files)
    with pytest.raises(RemoteEntryNotFoundError):
        hf.file(repo, "dir with space/nö.txt")


def test_publishing_while_serving_is_atomic(local_hub, repo):
    local_hub.publish(repo, {"v.txt": b"0"})
    stop, problems, seen = threading.Event(), [], set()

    def reader():
        while not stop.is_set():
            try:
                with NO_PROXY_OPENER.open(f"{local_hub.url}/api/models/{repo}?blobs=true", timeout=10) as r:
                    info = json.loads(r.read())
                seen.add(info["sha"])
                for s in info["siblings"]:
                    with NO_PROXY_OPENER.open(f"{local_hub.url}/{repo}/resolve/{info['sha']}/{s['rfilename']}",
                                              timeout=10) as r:
                        if len(r.read()) != s["size"]:
                            problems.append(s)
            except Exception as e:  # noqa: BLE001
                problems.append(e)

    t = threading.Thread(target=reader)
    t.start()
    commits = []
    try:
        for i in range(1, 8):
            commits.append(local_hub.publish(repo, {"v.txt": str(i).encode() * (i * 1000),
                                                    f"new-{i}.txt": b"n" * i}))
            deadline = time.monotonic() + 5
            while commits[-1] not in seen and time.monotonic() < deadline and not problems:
                time.sleep(0.01)  # the running server serves the new commit without a restart
    finally:
        stop.set()
        t.join(20)
    assert problems == []
    assert len(set(commits)) == 7 and set(commits) <= seen


def test_sigterm_stops_the_server_cleanly_mid_download(tmp_path):
    hub = LocalHub(tmp_path / "store", tmp_path)
    try:
        hub.publish("lab/s", {"w.bin": payload(256 * 1024, 12)})
        hub.fault("throttle", rate=16 * 1024, count=None)
        out = []

        def download():
            try:
                with NO_PROXY_OPENER.open(f"{hub.url}/lab/s/resolve/main/w.bin", timeout=30) as r:
                    out.append(len(r.read()))
            except Exception as e:  # noqa: BLE001 - the expected outcome
                out.append(e)

        t = threading.Thread(target=download)
        t.start()
        time.sleep(0.5)
        started = time.monotonic()
        hub.process.send_signal(signal.SIGTERM)
        assert hub.process.wait(10) == 0
        assert time.monotonic() - started < 5
        t.join(30)
        assert out and isinstance(out[0], Exception)  # the in-flight transfer was cut, not completed
        assert "hub: stopped" in hub.log_path.read_text()
    finally:
        hub.stop()


def test_a_taken_port_is_reported_plainly(local_hub, tmp_path):
    port = local_hub.url.rsplit(":", 1)[1]
    proc = subprocess.run([sys.executable, "-m", "tests.lab.hub.server", "--root", str(tmp_path / "s"),
                           "--host", "127.0.0.1", "--port", port], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in proc.stderr and "READY" not in proc.stdout
    assert local_hub.health()["ok"]


def test_hf_env_drives_a_real_client_process(local_hub, hf_env, repo, tmp_path):
    local_hub.publish(repo, SMALL)
    script = ("import sys, huggingface_hub as h; "
              "print(h.snapshot_download(sys.argv[1], local_dir=sys.argv[2]))")
    proc = subprocess.run([sys.executable, "-c", script, repo, str(tmp_path / "out")],
                          env={**os.environ, **hf_env}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert_tree_equal(tmp_path / "out", SMALL)
    assert len(resolve_gets(local_hub)) == len(SMALL)
    assert not any("xet" in (e["path"] + e["query"]).lower() for e in local_hub.settled().requests())
