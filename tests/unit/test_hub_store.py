"""The lab Hub's store (real git ids, LFS, content addressing) and its fault/range logic, no server."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

from tests.lab.hub.faults import FaultError, FaultRegistry, RequestInfo, parse_fault
from tests.lab.hub.server import _parse_range
from tests.lab.hub.store import (
    COMMIT_EPOCH, EMPTY_TREE, LFS_THRESHOLD, Store, StoreError, git_blob_id, is_lfs, lfs_pointer,
)

pytestmark = pytest.mark.unit

FILES = {
    "config.json": b'{"model_type": "llama"}\n',
    "model.safetensors": b"\x00weights" * 100,
    "tokenizer/vocab.txt": b"a\nb\n",
    "tokenizer/sub/x.txt": b"",
    "tokenizer.json": b"{}",  # sorts between "tokenizer" (a dir, compared as "tokenizer/") and others
    "big.dat": b"\x01" * LFS_THRESHOLD,
}


def git(cwd, *args, env=None):
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}).stdout.strip()


def test_blob_ids_and_lfs_pointer_are_gits():
    assert git_blob_id(b"") == "e69de29bb2d1d6434b8b29ae775ad8c2e48c5391"
    assert git_blob_id(b"hello\n") == "ce013625030ba8dba906f756967f9e9ca394464a"
    sha = hashlib.sha256(b"x").hexdigest()
    assert lfs_pointer(sha, 1) == f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha}\nsize 1\n".encode()


@pytest.mark.parametrize("path,size,lfs", [
    ("model.safetensors", 10, True), ("pytorch_model.bin", 1, True), ("m.gguf", 0, True),
    ("weights.PT", 5, True), ("config.json", 100, False), ("tokenizer.json", LFS_THRESHOLD - 1, False),
    ("tokenizer.json", LFS_THRESHOLD, True),
])
def test_lfs_classification(path, size, lfs):
    assert is_lfs(path, size) is lfs


def test_tree_and_commit_ids_equal_real_git(tmp_path):
    store = Store(tmp_path / "store")
    commit = store.publish("lab/same-as-git", FILES, message="first")
    rec = store.commit("lab/same-as-git", commit)

    work = tmp_path / "git"
    work.mkdir()
    git(work, "init", "-q")
    for path, data in FILES.items():
        target = work / path
        target.parent.mkdir(parents=True, exist_ok=True)
        entry = rec.files[path]
        target.write_bytes(lfs_pointer(entry.sha256, entry.size) if entry.lfs else data)
    git(work, "add", "-A")
    tree = git(work, "write-tree")
    assert rec.tree == tree
    assert rec.dirs["tokenizer"] == git(work, "rev-parse", f"{tree}:tokenizer")
    date = f"{COMMIT_EPOCH} +0000"
    env = {"GIT_AUTHOR_NAME": "modelswap lab", "GIT_AUTHOR_EMAIL": "lab@modelswap.invalid",
           "GIT_COMMITTER_NAME": "modelswap lab", "GIT_COMMITTER_EMAIL": "lab@modelswap.invalid",
           "GIT_AUTHOR_DATE": date, "GIT_COMMITTER_DATE": date}
    assert commit == git(work, "commit-tree", tree, "-m", "first", env=env)
    # the tree listing's oid of a file is the blob id git has for it (the pointer for LFS files)
    for path, entry in rec.files.items():
        assert entry.oid == git(work, "rev-parse", f"{tree}:{path}")


def test_publish_is_content_addressed_idempotent_and_deterministic(tmp_path):
    a, b = Store(tmp_path / "a"), Store(tmp_path / "b")
    c1 = a.publish("lab/one", FILES)
    assert a.publish("lab/one", dict(FILES)) == c1  # same tree: no new commit
    assert b.publish("lab/one", FILES) == c1  # same inputs, another machine: same id
    a.publish("lab/two", {"again.bin": FILES["big.dat"]})
    objects = [p for p in (tmp_path / "a" / "objects").rglob("*") if p.is_file()]
    assert len(objects) == len(set(FILES.values()))  # big.dat's bytes are stored once for both repos
    for p in objects:
        assert hashlib.sha256(p.read_bytes()).hexdigest() == p.name

    c2 = a.publish("lab/one", {**FILES, "config.json": b"{}"})
    assert c2 != c1
    rec = a.commit("lab/one", c2)
    assert rec.parent == c1 and rec.depth == 1
    assert a.resolve("lab/one", "main") == c2
    assert a.resolve("lab/one", c1) == c1  # the old commit stays
    assert a.commit("lab/one", c1).files["config.json"].sha256 == hashlib.sha256(FILES["config.json"]).hexdigest()


def test_empty_repo_has_gits_empty_tree(tmp_path):
    store = Store(tmp_path)
    commit = store.publish("lab/empty", {})
    assert store.commit("lab/empty", commit).tree == EMPTY_TREE


def test_revisions_branches_tags(tmp_path):
    store = Store(tmp_path)
    main = store.publish("lab/r", {"a": b"1"})
    dev = store.publish("lab/r", {"a": b"2"}, branch="feature/x", tag="v1")
    assert dev != main
    assert store.resolve("lab/r", "main") == main
    assert store.resolve("lab/r", "feature/x") == dev
    assert store.resolve("lab/r", "refs/heads/feature/x") == dev
    assert store.resolve("lab/r", "v1") == dev == store.resolve("lab/r", "refs/tags/v1")
    assert store.tag("lab/r", "v0", "main") == main
    assert store.refs("lab/r") == {"heads": {"main": main, "feature/x": dev}, "tags": {"v1": dev, "v0": main}}
    for missing in ("nope", "0" * 40, "refs/heads/v1", "../main", "feature"):
        assert store.resolve("lab/r", missing) is None
    assert store.resolve("lab/other", "main") is None


def test_gated_flag_is_kept_unless_given(tmp_path):
    store = Store(tmp_path)
    store.publish("lab/g", {"a": b"1"}, gated=True)
    store.publish("lab/g", {"a": b"2"})
    assert store.repo_meta("lab/g")["gated"] is True
    store.publish("lab/g", {"a": b"3"}, gated=False)
    assert store.repo_meta("lab/g")["gated"] is False


def test_publish_folder_skips_git_and_rejects_bad_input(tmp_path):
    src = tmp_path / "src"
    (src / ".git").mkdir(parents=True)
    (src / ".git" / "HEAD").write_text("ref")
    (src / "sub").mkdir()
    (src / "sub" / "f.txt").write_bytes(b"f")
    store = Store(tmp_path / "store")
    commit = store.publish("lab/folder", src)
    assert list(store.commit("lab/folder", commit).files) == ["sub/f.txt"]
    with pytest.raises(StoreError, match="not a directory"):
        store.publish("lab/folder", src / "sub" / "f.txt")


@pytest.mark.parametrize("repo_id,files,match", [
    ("lab/ok", {"../x": b""}, "invalid file path"),
    ("lab/ok", {"/abs": b""}, "invalid file path"),
    ("lab/ok", {"a//b": b""}, "invalid file path"),
    ("lab/ok", {".git/config": b""}, "invalid file path"),
    ("lab/ok", {"a": b"", "a/b": b""}, "both a file and a directory"),
    ("lab/ok", {"a": "text"}, "must be bytes"),
    ("lab--x/y", {}, "invalid repo id"),
    ("a/b/c", {}, "invalid repo id"),
    ("lab/..", {}, "invalid repo id"),
    ("", {}, "invalid repo id"),
])
def test_publish_rejects(tmp_path, repo_id, files, match):
    with pytest.raises(StoreError, match=match):
        Store(tmp_path).publish(repo_id, files)


def test_bad_branch_names_rejected(tmp_path):
    for name in ("", "../x", "a..b", "x.lock", "-x", "a/", "0123456789" * 4):  # the last looks like a commit
        with pytest.raises(StoreError):
            Store(tmp_path).publish("lab/b", {}, branch=name)


def test_tokens_and_control_key(tmp_path):
    store = Store(tmp_path)
    token = store.ensure_token()
    assert token.startswith("hf_lab") and store.ensure_token() == token
    other = store.add_token("nobody", gated_access=False)
    assert store.tokens()[other] == {"user": "nobody", "gated_access": False}
    assert oct((tmp_path / "tokens.json").stat().st_mode & 0o777) == "0o600"
    key = store.control_key(create=True)
    assert store.control_key() == key and len(key) == 32
    assert oct((tmp_path / "control.key").stat().st_mode & 0o777) == "0o600"


def test_publish_cli(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "w.safetensors").write_bytes(b"w" * 10)
    cmd = [sys.executable, "-m", "tests.lab.hub.publish", "--root", str(tmp_path / "s"), "lab/cli", str(src), "--gated"]
    first = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()
    again = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()
    assert len(first) == 40 and first == again
    meta = json.loads((tmp_path / "s" / "repos" / "models--lab--cli" / "repo.json").read_text())
    assert meta["gated"] is True
    bad = subprocess.run(cmd[:-3] + ["lab/cli", str(tmp_path / "missing")], capture_output=True, text=True)
    assert bad.returncode == 1 and "not a directory" in bad.stderr


# --------------------------------------------------------------------------- faults and ranges

@pytest.mark.parametrize("spec,match", [
    ({"kind": "explode"}, "unknown fault kind"),
    ({"kind": "cut", "after": -1}, "after must be"),
    ({"kind": "cut", "after": "10"}, "after must be int"),
    ({"kind": "throttle"}, "rate"),
    ({"kind": "http_error", "status": 200}, "400-599"),
    ({"kind": "delay", "seconds": 600}, "seconds"),
    ({"kind": "short_body", "framing": "chunked"}, "framing"),
    ({"kind": "flip_byte", "xor": 0}, "xor"),
    ({"kind": "cut", "count": 0}, "count"),
    ({"kind": "cut", "method": "PUT"}, "method"),
    ({"kind": "cut", "endpoint": "upload"}, "endpoint"),
    ({"kind": "cut", "bogus": 1}, "unknown parameters"),
    ({"kind": "wrong_etag", "etag": "a\"b"}, "alphanumeric"),
    ({"kind": "wrong_etag", "like": "main"}, "'<revision>:<path>'"),
    ({"kind": "wrong_etag", "like": "main:a", "etag": "abc"}, "not both"),
    ({"kind": "bad_listing"}, "at least one of path, oid, lfs_oid"),
    ({"kind": "bad_listing", "path": "x", "add": "yes"}, "add must be bool"),
])
def test_bad_fault_specs(spec, match):
    with pytest.raises(FaultError, match=match):
        parse_fault(spec, 1)


def test_fault_selectors_counts_and_order():
    reg = FaultRegistry()
    file_req = RequestInfo("GET", "/lab/a/resolve/main/w.bin", "resolve", "lab/a", "w.bin")
    api_req = RequestInfo("GET", "/api/models/lab/a/revision/main", "revision", "lab/a")
    first = reg.add({"kind": "cut", "after": 5, "file": "*.bin", "count": 2})
    second = reg.add({"kind": "cut", "after": 9, "repo": "lab/*", "count": None})
    assert reg.take("cut", api_req).id == second.id  # a file selector never matches an API call
    assert reg.take("cut", file_req).id == first.id  # the oldest matching fault acts
    assert reg.take("cut", file_req).id == first.id
    assert reg.take("cut", file_req).id == second.id  # first is spent after 2 uses
    assert [f["id"] for f in reg.list()] == [second.id]
    assert reg.take("cut", RequestInfo("GET", "/x/y/resolve/main/w.bin", "resolve", "x/y", "w.bin")) is None
    assert reg.take("cut", RequestInfo("HEAD", "/", None)) is None  # no repo: repo selector fails
    head_only = reg.add({"kind": "http_error", "method": "head", "url": "/lab/*"})
    assert reg.take("http_error", file_req) is None
    assert reg.take("http_error", RequestInfo("HEAD", file_req.path, "resolve", "lab/a", "w.bin")).id == head_only.id
    applies_never = reg.add({"kind": "flip_byte"})
    assert reg.take("flip_byte", file_req, lambda f: False) is None  # not applied: not spent
    assert any(f["id"] == applies_never.id for f in reg.list())
    assert reg.remove(applies_never.id) and not reg.remove(applies_never.id)
    assert reg.clear() == 1


@pytest.mark.parametrize("header,size,expected", [
    ("bytes=0-", 10, (0, 9)), ("bytes=4-", 10, (4, 9)), ("bytes=2-5", 10, (2, 5)),
    ("bytes=2-500", 10, (2, 9)), ("bytes=-3", 10, (7, 9)), ("bytes=-30", 10, (0, 9)),
    ("bytes=10-", 10, "unsatisfiable"), ("bytes=11-12", 10, "unsatisfiable"), ("bytes=-0", 10, "unsatisfiable"),
    ("bytes=5-2", 10, None), ("bytes=0-1,4-5", 10, None), ("items=0-1", 10, None), ("bytes=x-", 10, None),
])
def test_range_parsing(header, size, expected):
    assert _parse_range(header, size) == expected
