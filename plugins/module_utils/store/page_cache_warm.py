# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0 (see galaxy.yml)
"""Pre-staging a model: read a snapshot's files into the page cache before the old server stops.

vLLM loads safetensors weights through the page cache (mmap and reads). When the new model's
files are already cached, the load after the stop reads memory instead of the disk, which
shortens the downtime by about the time one sequential read of the weights takes. The read is
worth it only when the whole snapshot fits in memory that is free: otherwise it evicts what it
read first (or what the running server uses), and the load reads the disk anyway.

``plan`` decides from ``MemAvailable`` (/proc/meminfo) and the snapshot's size: read it all when
it fits within ``max_fraction`` of the available memory (and ``max_bytes``, when given), skip it
with the reason otherwise. ``warm`` reads the files sequentially in large chunks into one buffer,
bounded in time, and measures. ``run`` is the module's logic, from plain option values.
"""
from __future__ import annotations

import os
import time

from ansible_collections.modelswap.vllm.plugins.module_utils.common.units import human_bytes

CHUNK = 8 << 20          # 8 MiB reads: sequential throughput without a large buffer
MEMINFO = "/proc/meminfo"


class WarmError(Exception):
    """The module fails with this message (a missing folder, an unreadable /proc/meminfo)."""


def parse_meminfo(text: str) -> dict:
    """/proc/meminfo as {name: bytes} (its values are in kB = KiB)."""
    out = {}
    for line in text.splitlines():
        name, _unused, rest = line.partition(":")
        parts = rest.split()
        if not parts:
            continue
        try:
            value = int(parts[0])
        except ValueError:
            continue
        out[name.strip()] = value * 1024 if len(parts) > 1 and parts[1] == "kB" else value
    return out


def mem_available(read_text=None) -> int:
    """MemAvailable in bytes: the kernel's estimate of memory that can be used without swapping,
    page cache that can be dropped included."""
    try:
        text = read_text() if read_text else _read(MEMINFO)
    except OSError as exc:
        raise WarmError("page_cache_warm: cannot read %s: %s" % (MEMINFO, exc.strerror or exc))
    info = parse_meminfo(text)
    if "MemAvailable" not in info:
        raise WarmError("page_cache_warm: %s has no MemAvailable (a kernel older than 3.14?)" % MEMINFO)
    return info["MemAvailable"]


def _read(path):
    with open(path, encoding="ascii", errors="replace") as fh:
        return fh.read()


def snapshot_files(path: str) -> list:
    """[(path, size)] of the regular files under ``path``, links followed (a Hugging Face cache
    snapshot links to its blobs), each file once, in path order."""
    if not os.path.isdir(path):
        raise WarmError("page_cache_warm: %s is not a folder (the snapshot to read)" % path)
    found, seen = [], set()
    for root, dirs, files in os.walk(path, followlinks=True):
        dirs.sort()
        for name in sorted(files):
            full = os.path.join(root, name)
            try:
                st = os.stat(full)
            except OSError:
                continue
            key = (st.st_dev, st.st_ino)
            if key in seen or not os.path.isfile(full):
                continue
            seen.add(key)
            found.append((full, st.st_size))
    return found


def plan(total_bytes: int, available: int, max_fraction: float = 0.8, max_bytes: int = 0) -> dict:
    """Read or skip: {"read", "budget_bytes", "reason"}. The budget is ``max_fraction`` of the
    available memory, capped at ``max_bytes`` when it is above 0."""
    budget = int(available * max_fraction)
    why = "%d%% of %s available" % (round(max_fraction * 100), human_bytes(available))
    if max_bytes and max_bytes < budget:
        budget, why = int(max_bytes), "max_bytes"
    if total_bytes <= 0:
        return {"read": False, "budget_bytes": budget, "reason": "the snapshot holds no bytes to read"}
    if total_bytes > budget:
        return {"read": False, "budget_bytes": budget,
                "reason": "the snapshot (%s) is larger than the budget (%s: %s): reading it would evict "
                          "what it read first, and the load would read the disk anyway"
                          % (human_bytes(total_bytes), human_bytes(budget), why)}
    return {"read": True, "budget_bytes": budget, "reason": None}


def read_file(path: str, buf: bytearray, deadline=None, clock=time.monotonic) -> tuple:
    """Read ``path`` whole (sequentially, into ``buf``); (bytes read, finished). Stops at
    ``deadline`` (a ``clock`` value) between two chunks."""
    view = memoryview(buf)
    done = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)   # larger readahead
        while True:
            if deadline is not None and clock() >= deadline:
                return done, False
            n = os.readv(fd, [view])
            if n <= 0:
                return done, True
            done += n
    finally:
        os.close(fd)


def warm(files: list, timeout: float = 0, clock=time.monotonic, reader=read_file) -> dict:
    """Read ``files`` ([(path, size)]) in order, within ``timeout`` s (0: no limit); what was read."""
    start = clock()
    deadline = start + timeout if timeout and timeout > 0 else None
    buf = bytearray(CHUNK)
    read_bytes = read_files = 0
    complete = True
    for path, _size in files:
        got, finished = reader(path, buf, deadline, clock)
        read_bytes += got
        if not finished:
            complete = False
            break
        read_files += 1
    seconds = clock() - start
    return {"bytes_read": read_bytes, "files_read": read_files, "complete": complete,
            "seconds": round(seconds, 3),
            "bytes_per_s": int(read_bytes / seconds) if seconds > 0 else None}


def run(params: dict, check_mode: bool = False, *, available=mem_available, list_files=snapshot_files,
        do_warm=warm) -> dict:
    """The module's result for its options: the plan, then (not in check mode) the read."""
    if not 0 < params["max_fraction"] <= 1:
        raise WarmError("page_cache_warm: max_fraction must be above 0 and at most 1, not %s" % params["max_fraction"])
    if params["max_bytes"] < 0 or params["timeout"] < 0:
        raise WarmError("page_cache_warm: max_bytes and timeout must be >= 0")
    files = list_files(params["path"])
    total = sum(size for _path, size in files)
    before = available()
    decision = plan(total, before, params["max_fraction"], params["max_bytes"])
    result = {"changed": False, "path": params["path"], "files": len(files), "bytes_total": total,
              "mem_available_before": before, "budget_bytes": decision["budget_bytes"],
              "skipped": not decision["read"], "reason": decision["reason"], "bytes_read": 0,
              "files_read": 0, "seconds": 0.0, "bytes_per_s": None, "complete": False,
              "mem_available_after": None}
    if not decision["read"]:
        result["msg"] = "skipped: %s" % decision["reason"]
        return result
    if check_mode:
        result["msg"] = ("would read %d file(s), %s, into the page cache (budget %s)"
                         % (len(files), human_bytes(total), human_bytes(decision["budget_bytes"])))
        result["would_read_bytes"] = total
        return result
    outcome = do_warm(files, params["timeout"])
    result.update(outcome)
    result["mem_available_after"] = available()
    if outcome["complete"]:
        result["msg"] = "read %d file(s), %s, in %.1f s (%s/s)" % (
            outcome["files_read"], human_bytes(outcome["bytes_read"]), outcome["seconds"],
            human_bytes(outcome["bytes_per_s"] or 0))
    else:
        result["reason"] = "stopped at the timeout (%s s) with %s of %s read" % (
            params["timeout"], human_bytes(outcome["bytes_read"]), human_bytes(total))
        result["msg"] = result["reason"]
    return result
