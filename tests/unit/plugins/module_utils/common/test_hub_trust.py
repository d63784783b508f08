"""hub_trust: what a listing may name, where an unlink may go, when a token may cross plain HTTP;
and hf_download's layouts applying them (confined, sharing-aware removal of a bad file)."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from ansible_collections.modelswap.vllm.plugins.module_utils.hub import hf_errors
from ansible_collections.modelswap.vllm.plugins.module_utils.hub import hf_layout
from ansible_collections.modelswap.vllm.plugins.module_utils.hub import hf_snapshot
from ansible_collections.modelswap.vllm.plugins.module_utils.store import hf_manifest
from ansible_collections.modelswap.vllm.plugins.module_utils.hub import hub_client
from ansible_collections.modelswap.vllm.plugins.module_utils.common import hub_trust
from tests.support import synthetic_cache

pytestmark = pytest.mark.unit

A40 = "a" * 40
S64 = "b" * 64


# ------------------------------------------------------------------------------------------ paths
@pytest.mark.parametrize("path, problem", [
    ("config.json", ""),
    ("sub/dir/model-00001-of-00002.safetensors", ""),
    ("name with space.txt", ""),
    ("ünïcode/файл.json", ""),
    ("..hidden", ""),                       # a name that starts with dots is a name
    ("a..b", ""),
    (".gitattributes", ""),
    ("", "is empty"),
    ("/etc/passwd", "is absolute"),
    ("../../../../etc/x", "'..' segment"),
    ("sub/../../x", "'..' segment"),
    ("..", "'..' segment"),
    ("./config.json", "'.' segment"),
    ("sub/./x", "'.' segment"),
    ("a//b", "empty segment"),
    ("sub/", "empty segment"),
    ("a\0b", "control character"),
    ("a\nb", "control character"),
    ("a\rb", "control character"),
    ("a\tb", "control character"),
    ("a\x7fb", "control character"),
    (None, "not a string"),
    (42, "not a string"),
    ("x" * 5000, "longer than"),
])
def test_path_problem(path, problem):
    got = hub_trust.path_problem(path)
    assert (got == "") if problem == "" else (problem in got), got


# ------------------------------------------------------------------------------------------ ids
@pytest.mark.parametrize("value, lfs, ok", [
    (A40, False, True),
    (S64, False, True),                     # a sha256 git blob id
    (S64, True, True),
    (A40, True, False),                     # an LFS oid is a sha256
    ("A" * 40, False, False),               # lowercase only
    ("a" * 39, False, False),
    ("a" * 41, False, False),
    ("g" * 40, False, False),
    ("../../../x", False, False),
    ("a" * 38 + "/x", False, False),
    ("../" + "a" * 61, True, False),
    (A40 + "\n", False, False),             # \Z, not $: no trailing newline
    (S64 + "\n", True, False),
    ("", False, False),
    (None, False, False),
    (123, True, False),
])
def test_id_problem(value, lfs, ok):
    assert (hub_trust.id_problem(value, lfs) == "") is ok


@pytest.mark.parametrize("entry, words", [
    ({"size": 3, "blob_id": A40}, None),
    ({"size": 0, "blob_id": A40, "lfs_sha256": S64}, None),
    ({"size": -1, "blob_id": A40}, "size -1"),
    ({"size": "3", "blob_id": A40}, "size '3'"),
    ({"size": True, "blob_id": A40}, "size True"),
    ({"blob_id": A40}, "size None"),
    ({"size": 3, "blob_id": "../x"}, "blob id '../x'"),
    ({"size": 3}, "blob id None"),
    ({"size": 3, "blob_id": A40, "lfs_sha256": "../" + "a" * 61}, "LFS sha256"),
    ("not a dict", "not a mapping"),
])
def test_entry_problem(entry, words):
    got = hub_trust.entry_problem("f.bin", entry)
    assert (got == "") if words is None else (words in got and "'f.bin'" in got), got


def test_check_listing_names_the_bad_entries_and_the_fix():
    good = {"config.json": {"size": 3, "blob_id": A40}}
    assert hub_trust.check_listing(good, "the list", "fix it") is good
    bad = dict(good, **{"../../etc/x": {"size": 3, "blob_id": A40}, "w": {"size": 1, "blob_id": "x/y"}})
    with pytest.raises(hub_trust.ListingError) as err:
        hub_trust.check_listing(bad, "the file list of o/r", "check the endpoint")
    msg = str(err.value)
    assert msg.startswith("the file list of o/r has an unsafe entry: ")
    assert "'../../etc/x' has a '..' segment" in msg and "'x/y'" in msg
    assert "nothing was written or deleted; check the endpoint" in msg
    assert hub_trust.listing_problems(["a"]) == ["the file list is not a mapping of paths"]
    many = {"../%d" % i: {"size": 1, "blob_id": A40} for i in range(10)}
    assert len(hub_trust.listing_problems(many)) == 3


# ------------------------------------------------------------------------------------------ inside
def test_inside_resolves_folders_but_not_the_last_link(tmp_path):
    root = tmp_path / "repo"
    (root / "snap").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / "snap" / "link").symlink_to(outside / "file")        # a link in the folder: inside
    (root / "escape").symlink_to(outside)                         # a folder leading out: not
    assert hub_trust.inside(str(root / "snap" / "file"), str(root))
    assert hub_trust.inside(str(root / "snap" / "link"), str(root))
    assert not hub_trust.inside(str(root / "escape" / "file"), str(root))
    assert not hub_trust.inside(str(root / "snap" / ".." / ".." / "outside" / "file"), str(root))
    assert not hub_trust.inside(str(root), str(root))
    assert not hub_trust.inside(str(tmp_path / "repo-sibling" / "x"), str(root))   # a prefix is not a parent
    assert not hub_trust.inside(str(root / "snap" / ".."), str(root))


# ------------------------------------------------------------------------------------------ token
@pytest.mark.parametrize("endpoint, token, trusted, refused", [
    ("http://10.0.0.1:8480", True, False, True),
    ("HTTP://mirror.local", True, False, True),
    (" http://mirror.local/", True, False, True),
    ("http://10.0.0.1:8480", True, True, False),
    ("http://10.0.0.1:8480", False, False, False),     # no token: nothing to leak
    ("https://huggingface.co", True, False, False),
    ("https://mirror.local", True, True, False),
])
def test_token_endpoint_problem(endpoint, token, trusted, refused):
    got = hub_trust.token_endpoint_problem(endpoint, token, trusted)
    assert bool(got) is refused
    if refused:
        assert "clear text" in got and "http_endpoint_trusted=true" in got and "https://" in got
        assert "nothing was sent" in got


# ------------------------------------------------------------------------------------------ layouts
def blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def served_cache(tmp_path):
    """A cache with revision A of o/r (config.json, w.safetensors) and a verified manifest of A."""
    cache = tmp_path / "cache"
    files = {"config.json": b'{"a": 1}\n', "w.safetensors": b"w" * 100}
    commit_a = synthetic_cache.commit_for("A")
    snap = synthetic_cache.add_revision(cache, "o/r", commit_a, files)
    listing = {p: {"size": len(d), "blob_id": blob_id(d)} for p, d in files.items()}
    listing["w.safetensors"]["lfs_sha256"] = hashlib.sha256(files["w.safetensors"]).hexdigest()
    layout = hf_layout.CacheLayout(str(cache), "o/r")
    verified = {p: dict(hf_manifest.fingerprint(os.stat(snap / p)),
                        algo="sha256" if "lfs_sha256" in listing[p] else "git-sha1",
                        digest=listing[p].get("lfs_sha256") or listing[p]["blob_id"]) for p in files}
    manifest = hf_manifest.build_manifest(repo_id="o/r", revision="main", commit=commit_a, endpoint="e", layout="cache",
                                          snapshot=str(snap), listing=listing, verified=verified, mode="full",
                                          patterns={}, tool={})
    hf_manifest.atomic_write_json(hf_manifest.manifest_path(layout.meta_root, commit_a), manifest)
    return cache, layout, commit_a, snap, listing


def bad_link(layout, commit: str, path: str, blob: str) -> Path:
    pointer = Path(layout.locate(commit, path))
    pointer.parent.mkdir(parents=True, exist_ok=True)
    pointer.symlink_to("../../blobs/" + blob)
    return pointer


def test_remove_keeps_a_blob_another_snapshot_links_to(tmp_path):
    cache, layout, commit_a, snap, listing = served_cache(tmp_path)
    a_blob = listing["config.json"]["blob_id"]
    commit_b = synthetic_cache.commit_for("B")
    # B's config.json (another content) arrived under a wrong ETag equal to A's blob: linked to it
    pointer = bad_link(layout, commit_b, "config.json", a_blob)
    entry_b = {"size": 5, "blob_id": blob_id(b"b: 2\n")}
    removed = layout.remove(commit_b, "config.json", entry_b)
    assert removed == [str(pointer)]
    assert (snap / "config.json").read_bytes() == b'{"a": 1}\n'           # A intact
    assert layout.kept == [{"blob": a_blob, "because": "snapshot %s links to it (config.json)" % commit_a[:12]}]


def test_remove_keeps_a_blob_a_verified_manifest_lists_even_without_links(tmp_path):
    cache, layout, commit_a, snap, listing = served_cache(tmp_path)
    a_blob = listing["config.json"]["blob_id"]
    os.unlink(snap / "config.json")          # A's link gone; its manifest still vouches for the blob
    commit_b = synthetic_cache.commit_for("B")
    wrong = "c" * 40
    (Path(layout.repo_path) / "blobs" / wrong).write_bytes(b'{"a": 1}\n')
    # B's config.json has A's content, arrived under a random wrong ETag
    pointer = bad_link(layout, commit_b, "config.json", wrong)
    removed = layout.remove(commit_b, "config.json", {"size": 9, "blob_id": a_blob})
    assert sorted(removed) == sorted([str(pointer), os.path.join(layout.repo_path, "blobs", wrong)])
    assert (Path(layout.repo_path) / "blobs" / a_blob).exists()
    assert "the verified manifest of %s lists it" % commit_a[:12] in layout.kept[0]["because"]


def test_remove_deletes_what_nobody_else_uses(tmp_path):
    cache, layout, commit_a, snap, listing = served_cache(tmp_path)
    a_blob = listing["config.json"]["blob_id"]
    # re-verifying A itself found its blob bad: A's own manifest does not protect it
    removed = layout.remove(commit_a, "config.json", listing["config.json"])
    assert sorted(removed) == sorted([str(snap / "config.json"), os.path.join(layout.repo_path, "blobs", a_blob)])
    assert layout.kept == []
    assert (snap / "w.safetensors").exists()


def test_remove_refuses_a_pointer_whose_folder_leads_outside(tmp_path):
    cache, layout, commit_a, snap, listing = served_cache(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    canary = outside / "generation_config.json"
    canary.write_text("precious")
    (snap / "sub").symlink_to(outside)
    with pytest.raises(hf_errors.FetchError) as err:
        layout.remove(commit_a, "sub/generation_config.json", {"size": 3, "blob_id": A40})
    assert err.value.cause == "unsafe_path" and "resolves outside" in str(err.value)
    assert canary.read_text() == "precious"


def test_local_dir_remove_is_confined(tmp_path):
    root = tmp_path / "models" / "r"
    root.mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    canary = outside / "x.json"
    canary.write_text("precious")
    (root / "sub").symlink_to(outside)
    layout = hf_layout.LocalDirLayout(str(root), "o/r")
    with pytest.raises(hf_errors.FetchError, match="refusing to delete"):
        layout.remove("c" * 40, "sub/x.json", {"size": 1, "blob_id": A40})
    assert canary.read_text() == "precious"
    (root / "ok.json").write_text("bad")
    assert layout.remove("c" * 40, "ok.json", {"size": 1, "blob_id": A40}) == [str(root / "ok.json")]


def test_tree_cache_and_manifest_listings_are_checked_where_they_enter(tmp_path):
    cache, layout, commit_a, snap, listing = served_cache(tmp_path)
    job = hf_snapshot.SnapshotJob("o/r", revision=commit_a, cache_dir=str(cache), offline=True)
    job.layout, job.commit = layout, commit_a
    job.load_manifest()
    assert job.load_listing() == listing and job.listing_source == "manifest"
    manifest = json.loads(Path(job.manifest_file).read_text())
    manifest["listing"]["../../../../x"] = {"size": 1, "blob_id": A40}
    Path(job.manifest_file).write_text(json.dumps(manifest))
    job.load_manifest()
    with pytest.raises(hf_errors.FetchError) as err:
        job.load_listing()
    assert err.value.cause == "bad_listing" and job.manifest_file in str(err.value)
    assert "remove that manifest" in str(err.value)
    os.unlink(job.manifest_file)
    job.load_manifest()
    hub_client.write_tree(layout.repo_path, commit_a, dict(listing, **{"w.safetensors": {"size": 1, "blob_id": "../x"}}))
    with pytest.raises(hf_errors.FetchError) as err:
        job.load_listing()
    assert err.value.cause == "bad_listing" and "trees" in str(err.value) and "'../x'" in str(err.value)


def test_snapshot_check_refuses_a_manifest_that_names_files_outside(tmp_path):
    from ansible_collections.modelswap.vllm.plugins.module_utils.store import snapshot_check
    cache, layout, commit_a, snap, listing = served_cache(tmp_path)
    assert snapshot_check.check("m", "o/r", commit_a, cache_dir=str(cache))["verified"] is True
    outside = tmp_path / "outside.json"
    outside.write_text("{}")
    path = hf_manifest.manifest_path(layout.meta_root, commit_a)
    manifest = json.loads(Path(path).read_text())
    rel = "../../../../outside.json"
    manifest["listing"][rel] = {"size": 2, "blob_id": A40}
    manifest["files"][rel] = dict(hf_manifest.fingerprint(os.stat(outside)), algo="git-sha1", digest=A40)
    Path(path).write_text(json.dumps(manifest))
    state = snapshot_check.check("m", "o/r", commit_a, cache_dir=str(cache))
    assert state["verified"] is False
    assert "unsafe entry" in state["reason"] and rel in state["reason"] and "remove it" in state["reason"]
