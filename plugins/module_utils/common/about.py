# -*- coding: utf-8 -*-
"""Version and identity of the modelswap.vllm collection, shared by its modules."""
from __future__ import annotations

COLLECTION = "modelswap.vllm"
VERSION = "0.1.0"


def about(python_version: str) -> dict:
    """What a host reports about this collection's code running on it (pure, for tests)."""
    return {"collection": COLLECTION, "version": VERSION, "python": python_version}
