"""Build Hugging Face hub caches on disk with the exact layout huggingface_hub writes.

``models--org--name/blobs/<etag>`` holds the content (etag: sha256 for LFS-style files, the git blob
sha1 for the rest), ``snapshots/<commit>/<path>`` are relative links ``../../blobs/<etag>`` (one
``../`` more per sub-folder), ``refs/<branch>`` holds a commit. Used by the unit tests (checked
against ``huggingface_hub.scan_cache_dir``) and by the disk_plan benchmark.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

LFS_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")


MB = 1024 * 1024

# Two repositories' worth of revisions for the store tests: W2 shares its weights and tokenizer
# blobs with W1 (only config.json differs); W3 shares nothing.
A = "a" * 40
B = "b" * 40
C = "c" * 40
W1 = {"config.json": b'{"a": 1}', "model.safetensors": b"W" * 9000, "tok/tokenizer.json": b"t" * 3000}
W2 = dict(W1, **{"config.json": b'{"a": 2}'})
W3 = {"config.json": b'{"c": 3}', "model.safetensors": b"X" * 20000}


def add_two_repos(cache_dir) -> None:
    """org/one at A (no ref) and B (main), sharing two blobs; org/two at C (main)."""
    add_revision(cache_dir, "org/one", A, W1, refs=())
    add_revision(cache_dir, "org/one", B, W2, refs=("main",))
    add_revision(cache_dir, "org/two", C, W3)


def incompressible(seed: str, size: int) -> bytes:
    """Deterministic incompressible bytes (a model file's stand-in that no layer can compress)."""
    out = bytearray()
    counter = 0
    while len(out) < size:
        out += hashlib.sha256(f"{seed}:{counter}".encode()).digest() * 64
        counter += 1
    return bytes(out[:size])


def git_blob_id(content: bytes) -> str:
    """The git blob sha1: the Hub's ETag of a small (non-LFS) file."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


def etag_for(path: str, content: bytes) -> str:
    if path.endswith(LFS_SUFFIXES):
        return hashlib.sha256(content).hexdigest()
    return git_blob_id(content)


def commit_for(*parts) -> str:
    return hashlib.sha1(repr(parts).encode()).hexdigest()


def folder_for(repo_id: str, repo_type: str = "model") -> str:
    return "--".join([repo_type + "s"] + repo_id.split("/"))


def add_revision(cache_dir, repo_id: str, commit: str, files: dict, *, refs=("main",),
                 repo_type: str = "model") -> Path:
    """Write one revision: ``files`` maps a repo path to its bytes. Returns the snapshot dir."""
    repo = Path(cache_dir) / folder_for(repo_id, repo_type)
    blobs = repo / "blobs"
    snap = repo / "snapshots" / commit
    blobs.mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True, exist_ok=True)
    for rel, content in files.items():
        etag = etag_for(rel, content)
        blob = blobs / etag
        if not blob.exists():
            blob.write_bytes(content)
        link = snap / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        depth = rel.count("/")
        if not link.is_symlink():
            os.symlink("../" * (depth + 2) + "blobs/" + etag, link)
    for ref in refs:
        ref_path = repo / "refs" / ref
        ref_path.parent.mkdir(parents=True, exist_ok=True)
        ref_path.write_text(commit)
    return snap


def add_orphan(cache_dir, repo_id: str, etag: str, size: int, *, suffix: str = "a1b2c3d4",
               repo_type: str = "model") -> Path:
    """A partial download as huggingface_hub >= 1.18 leaves it: blobs/<etag>.<random>.incomplete."""
    blobs = Path(cache_dir) / folder_for(repo_id, repo_type) / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    path = blobs / ("%s.%s.incomplete" % (etag, suffix))
    path.write_bytes(b"\1" * size)
    return path


def set_last_used(cache_dir, repo_id: str, when: float, repo_type: str = "model") -> None:
    """Set every blob's atime/mtime (what LRU ordering reads)."""
    blobs = Path(cache_dir) / folder_for(repo_id, repo_type) / "blobs"
    for blob in blobs.iterdir():
        os.utime(blob, (when, when), follow_symlinks=False)


def make_plain_dir(models_dir, name: str, files: dict, when: float | None = None) -> Path:
    root = Path(models_dir) / name
    for rel, content in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(content)
        if when is not None:
            os.utime(p, (when, when))
    return root


def synthetic_cache(cache_dir, *, repos: int = 200, files: int = 50_000, revisions: int = 2,
                    file_size: int = 64) -> dict:
    """A big cache for the benchmark: ``repos`` repos, ``files`` snapshot files in all.

    Each repo has ``revisions`` revisions; consecutive revisions share all files but one (shared
    blobs), files sit in a few sub-folders like sharded checkpoints. Returns counts.
    """
    per_rev = max(1, files // (repos * revisions))
    made = blobs = 0
    for r in range(repos):
        repo_id = "bench/model-%03d" % r
        base = {}
        for i in range(per_rev):
            rel = ("model-%05d-of-%05d.safetensors" % (i, per_rev)) if i % 4 else "cfg/part-%05d.json" % i
            base[rel] = (b"%s/%d;" % (repo_id.encode(), i)) * (file_size // 16 + 1)
        for v in range(revisions):
            content = dict(base)
            first = next(iter(content))
            content[first] = content[first] + b"rev%d" % v
            add_revision(cache_dir, repo_id, commit_for(repo_id, v), content,
                         refs=("main",) if v == revisions - 1 else ())
            made += len(content)
        blobs += per_rev - 1 + revisions
    return {"repos": repos, "snapshot_files": made, "blobs": blobs}
