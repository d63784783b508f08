"""The Hub's content store: repositories with real git commits over content-addressed blobs.

Layout under the store root (every file is written to ``tmp/`` first and renamed into place, so a
server reading the store while a publish runs sees either the old or the new state, never half of
one)::

    objects/<aa>/<sha256>            file contents, stored once per distinct content
    repos/models--<ns>--<name>/
        repo.json                    {"id", "type", "gated", "created_at"}
        commits/<commit>.json        one immutable record per commit (tree, parent, files)
        refs/heads/<branch>          a commit id
        refs/tags/<tag>              a commit id
        .lock                        serialises publishes to one repository
    tokens.json                      {"tokens": {"<token>": {"user": "...", "gated_access": true}}} (0600)
    control.key                      the key of the server's /_lab control API (0600)
    tmp/

Ids are git's: a file's ``oid`` is the git blob id of its content (or, for an LFS file, of its LFS
pointer file), a directory's is its git tree id, and a commit id is the git commit id of the
commit object over the root tree and the parent. Commit objects carry a fixed author and a
deterministic time, so publishing the same files in the same order gives the same commit ids on
every machine; publishing a tree equal to the branch head changes nothing.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Iterator, Mapping

LFS_SUFFIXES = (
    ".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".onnx", ".msgpack",
    ".npy", ".npz", ".pkl", ".pickle", ".zip", ".tar", ".gz", ".zst",
)
LFS_THRESHOLD = 1024 * 1024  # files this large or larger are stored as LFS whatever their name
CHUNK = 1024 * 1024
COMMIT_EPOCH = 1767225600  # 2026-01-01T00:00:00Z: commit times are this plus the commit's depth
AUTHOR = "modelswap lab <lab@modelswap.invalid>"
EMPTY_TREE = "4b825dc642cb6eb9a060e54bf8d69288fbee4904"

_REPO_ID = re.compile(r"^(?:[A-Za-z0-9][A-Za-z0-9._-]{0,95}/)?[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
_REF_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(?:/[A-Za-z0-9][A-Za-z0-9._-]*)*$")
_HEX40 = re.compile(r"^[0-9a-f]{40}$")


class StoreError(ValueError):
    """A publish or lookup that the store refuses (bad name, bad path, unknown revision)."""


def is_lfs(path: str, size: int) -> bool:
    return size >= LFS_THRESHOLD or path.lower().endswith(LFS_SUFFIXES)


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


def validate_repo_id(repo_id: str) -> str:
    if not isinstance(repo_id, str) or not _REPO_ID.match(repo_id) or "--" in repo_id or ".." in repo_id:
        raise StoreError(f"invalid repo id {repo_id!r}: expected 'namespace/name' of letters, digits, '.', '_', '-'")
    return repo_id


def validate_ref_name(name: str) -> str:
    if (not isinstance(name, str) or not _REF_NAME.match(name) or ".." in name or name.endswith(".lock")
            or _HEX40.match(name)):
        raise StoreError(f"invalid branch or tag name {name!r}")
    return name


def validate_file_path(path: str) -> str:
    parts = path.split("/")
    if (not path or path.startswith("/") or "\\" in path or "\0" in path
            or any(p in ("", ".", "..") for p in parts) or parts[0] == ".git" or ".git" in parts):
        raise StoreError(f"invalid file path {path!r} in a repository")
    return path


def repo_dir_name(repo_id: str) -> str:
    return "models--" + validate_repo_id(repo_id).replace("/", "--")


@dataclass(frozen=True)
class FileEntry:
    path: str
    size: int
    sha256: str
    oid: str            # git blob id as the tree lists it (of the pointer file for LFS files)
    lfs: bool
    pointer_size: int | None = None

    @property
    def etag(self) -> str:
        """The ETag the Hub sends: the sha256 for LFS files, the git blob id otherwise."""
        return self.sha256 if self.lfs else self.oid

    def to_json(self) -> dict:
        d = {"path": self.path, "size": self.size, "sha256": self.sha256, "oid": self.oid, "lfs": self.lfs}
        if self.lfs:
            d["pointer_size"] = self.pointer_size
        return d

    @classmethod
    def from_json(cls, d: dict) -> "FileEntry":
        return cls(d["path"], d["size"], d["sha256"], d["oid"], d["lfs"], d.get("pointer_size"))


@dataclass
class Commit:
    id: str
    tree: str
    parent: str | None
    message: str
    date: str
    depth: int
    files: dict[str, FileEntry]
    dirs: dict[str, str] = field(default_factory=dict)  # directory path -> git tree id ("" = root)

    def to_json(self) -> dict:
        return {"id": self.id, "tree": self.tree, "parent": self.parent, "message": self.message,
                "date": self.date, "depth": self.depth, "dirs": self.dirs,
                "files": [f.to_json() for f in sorted(self.files.values(), key=lambda f: f.path)]}

    @classmethod
    def from_json(cls, d: dict) -> "Commit":
        files = {f["path"]: FileEntry.from_json(f) for f in d["files"]}
        return cls(d["id"], d["tree"], d["parent"], d["message"], d["date"], d["depth"], files, d["dirs"])


# --------------------------------------------------------------------------- git objects

def _tree_ids(files: Mapping[str, FileEntry]) -> dict[str, str]:
    """Git tree id of every directory (the root is ""), as `git write-tree` computes them."""
    children: dict[str, dict[str, tuple[str, str]]] = {"": {}}
    for path, entry in files.items():
        parts = path.split("/")
        for i in range(1, len(parts)):
            parent, name = "/".join(parts[:i - 1]), parts[i - 1]
            children.setdefault(parent, {})[name] = ("40000", "/".join(parts[:i]))
            children.setdefault("/".join(parts[:i]), {})
        children["/".join(parts[:-1])][parts[-1]] = ("100644", entry.oid)
    ids: dict[str, str] = {}
    for directory in sorted(children, key=lambda d: d.count("/") if d else -1, reverse=True):
        body = b""
        # git sorts entries by name, a directory's name compared as if it ended in "/"
        for name, (mode, ref) in sorted(children[directory].items(),
                                        key=lambda kv: kv[0] + ("/" if kv[1][0] == "40000" else "")):
            oid = ids[ref] if mode == "40000" else ref
            body += f"{mode} {name}".encode() + b"\0" + bytes.fromhex(oid)
        ids[directory] = hashlib.sha1(b"tree %d\0" % len(body) + body).hexdigest()
    return ids


def _commit_id(tree: str, parent: str | None, message: str, when: int) -> str:
    lines = [f"tree {tree}"]
    if parent:
        lines.append(f"parent {parent}")
    lines += [f"author {AUTHOR} {when} +0000", f"committer {AUTHOR} {when} +0000", "", message.rstrip("\n"), ""]
    body = "\n".join(lines).encode()
    return hashlib.sha1(b"commit %d\0" % len(body) + body).hexdigest()


# --------------------------------------------------------------------------- the store

class Store:
    """A Hub content store rooted at `root` (created on first use)."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self._commit_cache: dict[tuple[str, str], Commit] = {}

    # ----------------------------------------------------------------- small helpers
    def _ensure_layout(self) -> None:
        for sub in ("objects", "repos", "tmp"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)

    def _atomic_write(self, dest: Path, data: bytes, mode: int = 0o644) -> None:
        self._ensure_layout()
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.root / "tmp" / f"{dest.name}.{os.getpid()}.{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chmod(tmp, mode)
            os.replace(tmp, dest)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def object_path(self, sha256: str) -> Path:
        return self.root / "objects" / sha256[:2] / sha256

    def repo_path(self, repo_id: str) -> Path:
        return self.root / "repos" / repo_dir_name(repo_id)

    @contextlib.contextmanager
    def _repo_lock(self, repo_id: str) -> Iterator[None]:
        path = self.repo_path(repo_id)
        path.mkdir(parents=True, exist_ok=True)
        with open(path / ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    # ----------------------------------------------------------------- content
    def _store_bytes(self, path: str, data: bytes) -> FileEntry:
        sha256 = hashlib.sha256(data).hexdigest()
        dest = self.object_path(sha256)
        if not dest.exists():
            self._atomic_write(dest, data)
        return self._entry(path, len(data), sha256, git_blob_id(data))

    def _store_file(self, path: str, src: Path) -> FileEntry:
        self._ensure_layout()
        tmp = self.root / "tmp" / f"obj.{os.getpid()}.{secrets.token_hex(4)}"
        try:
            with open(src, "rb") as f, open(tmp, "wb") as out:
                size = os.fstat(f.fileno()).st_size
                sha1 = hashlib.sha1(b"blob %d\0" % size)
                sha256 = hashlib.sha256()
                copied = 0
                while chunk := f.read(CHUNK):
                    sha1.update(chunk)
                    sha256.update(chunk)
                    out.write(chunk)
                    copied += len(chunk)
            if copied != size:
                raise StoreError(f"{src} changed size while it was being published ({size} -> {copied} bytes)")
            digest = sha256.hexdigest()
            dest = self.object_path(digest)
            if not dest.exists():
                dest.parent.mkdir(parents=True, exist_ok=True)
                os.chmod(tmp, 0o644)
                os.replace(tmp, dest)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        return self._entry(path, size, digest, sha1.hexdigest())

    @staticmethod
    def _entry(path: str, size: int, sha256: str, blob_id: str) -> FileEntry:
        if is_lfs(path, size):
            pointer = lfs_pointer(sha256, size)
            return FileEntry(path, size, sha256, git_blob_id(pointer), True, len(pointer))
        return FileEntry(path, size, sha256, blob_id, False)

    # ----------------------------------------------------------------- publish
    def publish(self, repo_id: str, files: Mapping[str, bytes] | str | os.PathLike, *,
                gated: bool | None = None, branch: str = "main", tag: str | None = None,
                message: str | None = None) -> str:
        """Make the branch's head hold exactly `files`; return the commit id.

        `files` is {relative path: bytes} or a folder (its `.git` is skipped). A tree equal to the
        head's changes nothing and returns the head. `gated` None keeps the repository's setting
        (a new repository is not gated). `tag`, when given, is pointed at the resulting commit.
        """
        validate_repo_id(repo_id)
        validate_ref_name(branch)
        if tag is not None:
            validate_ref_name(tag)
        entries: dict[str, FileEntry] = {}
        if isinstance(files, Mapping):
            for path, data in files.items():
                if not isinstance(data, (bytes, bytearray)):
                    raise StoreError(f"content of {path!r} must be bytes, not {type(data).__name__}")
                entries[validate_file_path(path)] = self._store_bytes(path, bytes(data))
        else:
            folder = Path(files)
            if not folder.is_dir():
                raise StoreError(f"cannot publish {folder}: not a directory")
            for src in sorted(folder.rglob("*")):
                rel = src.relative_to(folder).as_posix()
                if rel == ".git" or rel.startswith(".git/") or not src.is_file():
                    continue
                if src.is_symlink() and not src.resolve().is_relative_to(folder.resolve()):
                    raise StoreError(f"cannot publish {src}: a symlink that leaves {folder}")
                entries[validate_file_path(rel)] = self._store_file(rel, src)
        for path in entries:  # a path cannot be both a file and a directory
            parent = PurePosixPath(path).parent
            while str(parent) != ".":
                if str(parent) in entries:
                    raise StoreError(f"{parent} is both a file and a directory")
                parent = parent.parent

        with self._repo_lock(repo_id):
            repo = self.repo_path(repo_id)
            meta = self.repo_meta(repo_id)
            now = time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime())
            if meta is None or (gated is not None and bool(gated) != meta["gated"]):
                meta = meta or {"id": repo_id, "type": "model", "gated": False, "created_at": now}
                meta["gated"] = bool(gated) if gated is not None else meta["gated"]
                self._atomic_write(repo / "repo.json", json.dumps(meta, indent=1).encode())
            head = self.resolve(repo_id, branch)
            dirs = _tree_ids(entries)
            if head is not None and self.commit(repo_id, head).tree == dirs[""]:
                commit_id = head
            else:
                parent = self.commit(repo_id, head) if head else None
                depth = parent.depth + 1 if parent else 0
                when = COMMIT_EPOCH + depth
                msg = message or f"Publish {len(entries)} files"
                commit_id = _commit_id(dirs[""], head, msg, when)
                record = Commit(commit_id, dirs[""], head, msg,
                                time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(when)), depth, entries, dirs)
                commit_path = repo / "commits" / f"{commit_id}.json"
                if not commit_path.exists():
                    self._atomic_write(commit_path, json.dumps(record.to_json(), indent=1).encode())
                self._atomic_write(repo / "refs" / "heads" / branch, commit_id.encode())
            if tag is not None:
                self._atomic_write(repo / "refs" / "tags" / tag, commit_id.encode())
        return commit_id

    def tag(self, repo_id: str, tag: str, revision: str = "main") -> str:
        """Point tag `tag` at `revision`; return the commit id."""
        validate_ref_name(tag)
        with self._repo_lock(repo_id):
            commit_id = self.resolve(repo_id, revision)
            if commit_id is None:
                raise StoreError(f"{repo_id}: unknown revision {revision!r}")
            self._atomic_write(self.repo_path(repo_id) / "refs" / "tags" / tag, commit_id.encode())
        return commit_id

    def set_gated(self, repo_id: str, gated: bool) -> None:
        with self._repo_lock(repo_id):
            meta = self.repo_meta(repo_id)
            if meta is None:
                raise StoreError(f"unknown repository {repo_id!r}")
            meta["gated"] = bool(gated)
            self._atomic_write(self.repo_path(repo_id) / "repo.json", json.dumps(meta, indent=1).encode())

    # ----------------------------------------------------------------- reads (used by the server)
    def repo_meta(self, repo_id: str) -> dict | None:
        try:
            path = self.repo_path(repo_id) / "repo.json"
        except StoreError:
            return None
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            return None

    def resolve(self, repo_id: str, revision: str) -> str | None:
        """Commit id of `revision` (a 40-hex commit, a branch, a tag, or refs/heads|tags/NAME), or None."""
        repo = self.repo_path(repo_id)
        if _HEX40.match(revision):
            return revision if (repo / "commits" / f"{revision}.json").is_file() else None
        candidates = []
        for kind in ("heads", "tags"):
            if revision.startswith(f"refs/{kind}/"):
                candidates = [(kind, revision[len(f"refs/{kind}/"):])]
                break
        else:
            candidates = [("heads", revision), ("tags", revision)]
        for kind, name in candidates:
            try:
                validate_ref_name(name)
                return (repo / "refs" / kind / name).read_text().strip() or None
            except (StoreError, FileNotFoundError, NotADirectoryError, IsADirectoryError):
                continue
        return None

    def commit(self, repo_id: str, commit_id: str) -> Commit:
        key = (repo_id, commit_id)
        cached = self._commit_cache.get(key)
        if cached is None:
            path = self.repo_path(repo_id) / "commits" / f"{commit_id}.json"
            cached = Commit.from_json(json.loads(path.read_text()))
            if len(self._commit_cache) > 4096:
                self._commit_cache.clear()
            self._commit_cache[key] = cached
        return cached

    def history(self, repo_id: str, commit_id: str, limit: int = 1000) -> list[Commit]:
        out = []
        while commit_id and len(out) < limit:
            c = self.commit(repo_id, commit_id)
            out.append(c)
            commit_id = c.parent
        return out

    def refs(self, repo_id: str) -> dict[str, dict[str, str]]:
        result: dict[str, dict[str, str]] = {"heads": {}, "tags": {}}
        for kind in result:
            base = self.repo_path(repo_id) / "refs" / kind
            if base.is_dir():
                for ref in base.rglob("*"):
                    if ref.is_file():
                        result[kind][ref.relative_to(base).as_posix()] = ref.read_text().strip()
        return result

    def used_storage(self, repo_id: str) -> int:
        """Bytes of the distinct contents over the repository's whole history (the Hub's usedStorage)."""
        seen: dict[str, int] = {}
        for path in (self.repo_path(repo_id) / "commits").glob("*.json"):
            for f in self.commit(repo_id, path.stem).files.values():
                seen[f.sha256] = f.size
        return sum(seen.values())

    # ----------------------------------------------------------------- tokens and the control key
    def tokens(self) -> dict[str, dict]:
        try:
            return json.loads((self.root / "tokens.json").read_text()).get("tokens", {})
        except FileNotFoundError:
            return {}

    def add_token(self, user: str = "lab", *, gated_access: bool = True, token: str | None = None) -> str:
        token = token or "hf_lab" + secrets.token_hex(16)
        self._ensure_layout()
        with open(self.root / "tmp" / ".tokens.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            tokens = self.tokens()
            tokens[token] = {"user": user, "gated_access": gated_access}
            self._atomic_write(self.root / "tokens.json", json.dumps({"tokens": tokens}, indent=1).encode(), 0o600)
        return token

    def ensure_token(self, user: str = "lab") -> str:
        """A token of `user` with access to gated repositories (made on first call)."""
        for token, info in self.tokens().items():
            if info.get("user") == user and info.get("gated_access", True):
                return token
        return self.add_token(user)

    def control_key(self, create: bool = False) -> str | None:
        """The key the /_lab control API wants in X-Lab-Control (made when `create` and missing)."""
        path = self.root / "control.key"
        try:
            return path.read_text().strip()
        except FileNotFoundError:
            if not create:
                return None
        self._ensure_layout()
        tmp = self.root / "tmp" / f"control.key.{os.getpid()}.{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(16))
        try:
            os.link(tmp, path)  # atomic, and the first writer wins
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
        return path.read_text().strip()
