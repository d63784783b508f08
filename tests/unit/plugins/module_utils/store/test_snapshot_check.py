"""snapshot_check: is a catalog model fetched and verified on this host, and where.

The manifests are built with hf_manifest (hf_snapshot's own format) over real files, in the cache
layout hf_snapshot writes (models--org--name/{blobs,snapshots/<commit>,modelswap/<commit>.json}).
"""
from __future__ import annotations

import hashlib
import json
import os

import pytest

from ansible_collections.modelswap.vllm.plugins.module_utils.store import hf_manifest
from ansible_collections.modelswap.vllm.plugins.module_utils.store import snapshot_check

pytestmark = pytest.mark.unit

REPO = "lab/tiny-a"
COMMIT = "8976b4494868209c1aa701c350d8990989f06532"
FILES = {"config.json": b'{"architectures": ["LlamaForCausalLM"]}',
         "model.safetensors": b"\x00" * 4096,
         "tokenizer.json": b'{"version": "1.0"}'}


def git_blob(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def make_snapshot(cache, repo=REPO, commit=COMMIT, files=FILES, verify="full", manifest=True):
    """A cache snapshot like hf_snapshot leaves: blobs, symlinks, and a verified manifest."""
    repo_dir = cache / ("models--" + repo.replace("/", "--"))
    snap = repo_dir / "snapshots" / commit
    (repo_dir / "blobs").mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True, exist_ok=True)
    listing, verified = {}, {}
    for name, data in files.items():
        lfs = name.endswith(".safetensors")
        digest = hashlib.sha256(data).hexdigest() if lfs else git_blob(data)
        blob = repo_dir / "blobs" / digest
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snap), snap / name)
        entry = {"size": len(data), "blob_id": git_blob(data)}
        if lfs:
            entry["lfs_sha256"] = digest
        listing[name] = entry
        st = os.stat(snap / name)
        verified[name] = dict(hf_manifest.fingerprint(st), algo="sha256" if lfs else "git-sha1",
                              digest=digest)
    if manifest:
        data = hf_manifest.build_manifest(
            repo_id=repo, revision="main", commit=commit, endpoint="http://hub", layout="cache",
            snapshot=str(snap), listing=listing, verified=verified, mode=verify, patterns={},
            tool={"name": "test"})
        hf_manifest.atomic_write_json(hf_manifest.manifest_path(str(repo_dir), commit), data)
    return snap


def test_a_verified_cache_snapshot_is_found_by_commit(tmp_path):
    snap = make_snapshot(tmp_path)
    out = snapshot_check.check("tiny-a", REPO, COMMIT, cache_dir=str(tmp_path))
    assert out["verified"] is True, out["reason"]
    assert out["path"] == str(snap) and out["commit"] == COMMIT
    assert out["source"] == "cache %s" % tmp_path
    assert out["files"] == 3 and out["bytes"] == sum(len(d) for d in FILES.values())
    assert out["manifest"].endswith("models--lab--tiny-a/modelswap/%s.json" % COMMIT)
    assert out["reason"] is None and out["verify"] == "full"


def test_not_fetched_names_the_model_and_the_fix(tmp_path):
    out = snapshot_check.check("tiny-a", REPO, COMMIT, cache_dir=str(tmp_path))
    assert out["verified"] is False
    assert "tiny-a (lab/tiny-a@%s) is not on this host" % COMMIT in out["reason"]
    assert "playbooks/fetch.yml" in out["reason"]


def test_downloaded_without_verification_is_refused(tmp_path):
    make_snapshot(tmp_path, manifest=False)
    out = snapshot_check.check("tiny-a", REPO, COMMIT, cache_dir=str(tmp_path))
    assert out["verified"] is False and "has no verified manifest" in out["reason"]
    assert snapshot_check.check("tiny-a", REPO, COMMIT, cache_dir=str(tmp_path), mode="none")["verified"] is True


def test_a_file_changed_since_verification_is_refused(tmp_path):
    snap = make_snapshot(tmp_path)
    target = os.path.realpath(snap / "model.safetensors")
    with open(target, "r+b") as fh:
        fh.write(b"\x01")
    os.utime(target, ns=(0, 0))
    out = snapshot_check.check("tiny-a", REPO, COMMIT, cache_dir=str(tmp_path))
    assert out["verified"] is False
    assert "1 file(s)" in out["reason"] and "model.safetensors" in out["reason"]


def test_a_vanished_file_is_refused(tmp_path):
    snap = make_snapshot(tmp_path)
    os.unlink(snap / "tokenizer.json")
    out = snapshot_check.check("tiny-a", REPO, COMMIT, cache_dir=str(tmp_path))
    assert out["verified"] is False and "tokenizer.json" in out["reason"]


def test_size_only_verification_needs_mode_size(tmp_path):
    make_snapshot(tmp_path, verify="size")
    full = snapshot_check.check("tiny-a", REPO, COMMIT, cache_dir=str(tmp_path))
    assert full["verified"] is False and "verified by size only" in full["reason"]
    assert snapshot_check.check("tiny-a", REPO, COMMIT, cache_dir=str(tmp_path), mode="size")["verified"] is True


def test_no_config_json_is_not_a_model(tmp_path):
    make_snapshot(tmp_path, files={"model.safetensors": b"x" * 10})
    out = snapshot_check.check("tiny-a", REPO, COMMIT, cache_dir=str(tmp_path))
    assert out["verified"] is False and "no config.json" in out["reason"]


def test_a_manifest_of_another_repo_does_not_count(tmp_path):
    make_snapshot(tmp_path, repo="lab/tiny-b")
    os.rename(tmp_path / "models--lab--tiny-b", tmp_path / "models--lab--tiny-a")
    out = snapshot_check.check("tiny-a", REPO, COMMIT, cache_dir=str(tmp_path))
    assert out["verified"] is False and "no verified manifest" in out["reason"]


def test_a_branch_is_resolved_through_the_record(tmp_path):
    snap = make_snapshot(tmp_path)
    record = {"fetched": {"tiny-a": {"repo_id": REPO, "revision": "main", "commit": COMMIT,
                                     "path": str(snap),
                                     "manifest": hf_manifest.manifest_path(str(snap.parent.parent), COMMIT)}}}
    out = snapshot_check.check("tiny-a", REPO, "main", record=record)
    assert out["verified"] is True and out["source"] == "record fetched.tiny-a"
    # without the record a branch cannot be placed
    out = snapshot_check.check("tiny-a", REPO, "main", cache_dir=str(tmp_path))
    assert out["verified"] is False and "is not a commit" in out["reason"]
    # a record entry of another repo is ignored
    record["fetched"]["tiny-a"]["repo_id"] = "lab/other"
    assert snapshot_check.check("tiny-a", REPO, "main", record=record)["verified"] is False


def test_an_explicit_local_dir_uses_its_own_manifest(tmp_path):
    folder = tmp_path / "models" / "tiny-a"
    folder.mkdir(parents=True)
    listing, verified = {}, {}
    for name, data in FILES.items():
        (folder / name).write_bytes(data)
        listing[name] = {"size": len(data), "blob_id": git_blob(data)}
        verified[name] = dict(hf_manifest.fingerprint(os.stat(folder / name)), algo="git-sha1",
                              digest=git_blob(data))
    manifest = hf_manifest.build_manifest(
        repo_id=REPO, revision=COMMIT, commit=COMMIT, endpoint="e", layout="local_dir",
        snapshot=str(folder), listing=listing, verified=verified, mode="full", patterns={}, tool={})
    hf_manifest.atomic_write_json(
        hf_manifest.manifest_path(str(folder / ".cache" / "huggingface"), COMMIT), manifest)
    out = snapshot_check.check("tiny-a", REPO, COMMIT, path=str(folder) + "/")
    assert out["verified"] is True, out["reason"]
    assert out["path"] == str(folder) and out["source"] == "vllm_service_snapshot_path"


@pytest.mark.parametrize("repo_id", ["", "a/b/c", "../x", "lab/tiny-a\n", "lab/tiny a", None])
def test_malformed_repo_ids(repo_id):
    out = snapshot_check.check("m", repo_id, COMMIT, cache_dir="/nonexistent")
    assert out["verified"] is False and "repo id" in out["reason"]
    assert out["path"] is None


@pytest.mark.parametrize("repo_id", ["gpt2", "org/name", "Org.x/Mod_el-7B.v1"])
def test_hub_repo_ids_single_name_included_are_looked_up(repo_id):
    out = snapshot_check.check("m", repo_id, COMMIT, cache_dir="/nonexistent")
    assert out["verified"] is False and "is not on this host" in out["reason"]
    assert out["path"] == "/nonexistent/models--%s/snapshots/%s" % (repo_id.replace("/", "--"), COMMIT)


def test_a_commit_with_a_trailing_newline_is_not_a_commit():
    out = snapshot_check.locate("m", "lab/tiny-a", COMMIT + "\n", cache_dir="/nonexistent")
    assert out["commit"] is None and out["path"] is None


def test_manifest_is_json_readable_by_the_check(tmp_path):
    make_snapshot(tmp_path)
    path = hf_manifest.manifest_path(str(tmp_path / "models--lab--tiny-a"), COMMIT)
    data = json.loads(open(path).read())
    assert data["format"] == hf_manifest.FORMAT
