"""Shared file-system helpers: atomic writes, folder listings and suffix scans."""
from __future__ import annotations

import os

import pytest

from ansible_collections.modelswap.vllm.plugins.module_utils.common.fsutil import (
    atomic_write_text, files_with_suffix, listed, nearest_existing)

pytestmark = pytest.mark.unit


def test_atomic_write_replaces_the_file_with_its_mode_and_leaves_no_temp(tmp_path):
    target = tmp_path / "sub" / "record.json"
    atomic_write_text(str(target), "one", 0o600, makedirs=True)
    atomic_write_text(str(target), "two", 0o640)
    assert target.read_text() == "two" and (target.stat().st_mode & 0o777) == 0o640
    assert os.listdir(target.parent) == ["record.json"]


def test_a_failed_write_keeps_the_old_file(tmp_path, monkeypatch):
    target = tmp_path / "record.json"
    target.write_text("old")

    def broken(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken)
    with pytest.raises(OSError, match="disk full"):
        atomic_write_text(str(target), "new")
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["record.json"]


def test_files_with_suffix_skips_symlinks_and_descends_only_when_asked(tmp_path):
    (tmp_path / "a.lock").write_text("")
    (tmp_path / "deep").mkdir()
    (tmp_path / "deep" / "b.lock").write_text("")
    (tmp_path / "link.lock").symlink_to(tmp_path / "a.lock")
    (tmp_path / "c.incomplete").write_text("")
    assert files_with_suffix(str(tmp_path), ".lock") == [str(tmp_path / "a.lock")]
    assert files_with_suffix(str(tmp_path), ".lock", recursive=True) == [
        str(tmp_path / "a.lock"), str(tmp_path / "deep" / "b.lock")]
    assert files_with_suffix(str(tmp_path / "missing"), ".lock") == []


def test_nearest_existing_is_the_path_or_its_closest_parent(tmp_path):
    (tmp_path / "a").mkdir()
    assert nearest_existing(str(tmp_path / "a")) == str(tmp_path / "a")
    assert nearest_existing(str(tmp_path / "a" / "b" / "c")) == str(tmp_path / "a")
    assert nearest_existing("/") == "/"


def test_listed_sorts_names_and_lists_nothing_for_a_missing_or_unreadable_folder(tmp_path):
    for name in ("b.json", "a.json", "c"):
        (tmp_path / name).write_text("")
    assert listed(str(tmp_path)) == ["a.json", "b.json", "c"]
    assert listed(str(tmp_path / "missing")) == []
    assert listed(str(tmp_path / "a.json")) == []        # a file, not a folder
