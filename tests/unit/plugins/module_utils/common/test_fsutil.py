"""Shared file-system helpers: atomic writes, folder listings and suffix scans."""
from __future__ import annotations

import os

import pytest

from ansible_collections.modelswap.vllm.plugins.module_utils.common.fsutil import (
    atomic_copy, atomic_write_bytes, atomic_write_text, files_with_suffix, listed, nearest_existing,
    write_text_if_changed)

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


def test_the_mode_is_set_before_the_content_is_written(tmp_path, monkeypatch):
    """A 0600 file (a saved environment file holds the API key) is never readable by others, not
    even while it is being written."""
    seen = []
    real_fdopen = os.fdopen

    def spying_fdopen(fd, *args, **kwargs):
        seen.append(os.fstat(fd).st_mode & 0o777)
        return real_fdopen(fd, *args, **kwargs)

    monkeypatch.setattr(os, "fdopen", spying_fdopen)
    atomic_write_bytes(str(tmp_path / "env"), b"KEY=secret\n", 0o600)
    assert seen == [0o600] and (tmp_path / "env").read_bytes() == b"KEY=secret\n"


def test_write_if_changed_leaves_a_file_that_holds_the_text(tmp_path):
    path = tmp_path / "refs" / "main"
    assert write_text_if_changed(str(path), "abc", 0o600, makedirs=True) is True
    assert path.read_text() == "abc" and path.stat().st_mode & 0o777 == 0o600
    before = path.stat().st_mtime_ns
    assert write_text_if_changed(str(path), "abc") is False and path.stat().st_mtime_ns == before
    assert write_text_if_changed(str(path), "def") is True and path.read_text() == "def"
    assert os.listdir(path.parent) == ["main"]


def test_atomic_copy_copies_in_chunks_with_the_mode_and_the_folder_mode(tmp_path):
    src = tmp_path / "big"
    src.write_bytes(os.urandom(3 * (1 << 20) + 17))
    dest = tmp_path / "saved" / "active" / "big"
    atomic_copy(str(src), str(dest), 0o600, makedirs=True, dir_mode=0o700)
    assert dest.read_bytes() == src.read_bytes() and (dest.stat().st_mode & 0o777) == 0o600
    assert (dest.parent.stat().st_mode & 0o777) == 0o700 and os.listdir(dest.parent) == ["big"]


def test_a_failed_copy_keeps_the_old_file_and_leaves_no_temp(tmp_path):
    dest = tmp_path / "unit"
    dest.write_text("old")
    with pytest.raises(FileNotFoundError):
        atomic_copy(str(tmp_path / "missing"), str(dest), 0o644)
    assert dest.read_text() == "old" and os.listdir(tmp_path) == ["unit"]


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
