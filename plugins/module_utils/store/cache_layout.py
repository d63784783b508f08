# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0
"""The hub cache's names and rules: repo types and folder names, the commit and xet hash regexes,
the shared (Xet) store's file names, repo id validation, and the byte and path arithmetic every
reader of the store shares (allocated bytes, block rounding, containment).

Pure stdlib and data: no file is read here, so every other file of the store can import it.
"""
from __future__ import annotations

import os
import re

from ansible_collections.modelswap.vllm.plugins.module_utils.common import catalog

REPO_TYPES = {"models": "model", "datasets": "dataset", "spaces": "space", "kernels": "kernel"}
FOLDER_PREFIX = {v: k for k, v in REPO_TYPES.items()}
# The catalog owns the commit and repo id rules.
COMMIT_RE = catalog.COMMIT_RE
XET_HASH_RE = re.compile(r"^[0-9a-f]{64}\Z")
IGNORED_NAMES = frozenset({".DS_Store", "Thumbs.db", "desktop.ini"})
# huggingface_hub's shared blob store (utils/_shared_blobs.py: SHARED_BLOBS_DIR_NAME,
# SHARED_BLOBS_MARKER_NAME, SHARED_BLOBS_LAYOUT_VERSION, the .refs and .lock suffixes)
SHARED_STORE_DIR = "blobs"
SHARED_STORE_MARKER = ".huggingface-shared-blobs"
SHARED_STORE_LAYOUT = "1\n"
PREFIX_RE = re.compile(r"^[0-9a-f]{2}\Z")


class StoreError(Exception):
    """A model store that cannot be read or an identifier that is malformed (message is final)."""


def validate_repo_id(repo_id) -> str:
    """Return ``repo_id`` if it is a valid Hub repo id, else raise StoreError saying why."""
    problem = catalog.repo_id_problem(repo_id)
    if problem:
        raise StoreError(problem)
    return repo_id


def repo_folder_name(repo_id: str, repo_type: str = "model") -> str:
    """The cache folder of a repo: ``models--org--name`` (huggingface_hub's repo_folder_name)."""
    return "--".join([FOLDER_PREFIX[repo_type]] + repo_id.split("/"))


def parse_repo_folder(name: str):
    """``models--org--name`` -> ("model", "org/name"); None when the name is not a repo folder."""
    prefix, sep, rest = name.partition("--")
    if not sep or prefix not in REPO_TYPES or not rest:
        return None
    return REPO_TYPES[prefix], rest.replace("--", "/")


def allocated(st) -> int:
    """Bytes the file system allocates to an inode (what deleting its last link frees)."""
    return st.st_blocks * 512


def round_up(size: int, block: int) -> int:
    """``size`` rounded up to whole blocks of ``block`` bytes (an estimate of a new file's use)."""
    if block <= 0:
        return size
    return -(-size // block) * block


def is_within(path: str, root: str) -> bool:
    """Whether ``path`` is ``root`` or below it (both absolute and normalised)."""
    path = os.path.normpath(path)
    root = os.path.normpath(root)
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)
