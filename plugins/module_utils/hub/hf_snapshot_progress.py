# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0
"""Progress of a long download, written to a JSON file while it runs, and read back by a poller.

An Ansible module cannot stream output, so hf_snapshot (started with ``async``/``poll: 0``)
writes its progress every few seconds to a small JSON file, atomically; the model_fetch role
polls it with hf_snapshot_progress and prints one line per host per interval::

    {"id": "<run id>", "pid": 1234, "pid_start": "<clock ticks>", "state": "downloading",
     "bytes_total": ..., "bytes_done": ..., "percent": 45.2, "rate_bps": ..., "eta_s": ...,
     "files_total": 7, "files_done": 3, "verified_files": 2, "verified_bytes": ..., "line": "..."}

``bytes_*`` count what must be fetched in this run (files already present are not counted, so
the percentage and ETA speak of the transfer). The rate is measured over the last
``RATE_WINDOW_S`` seconds. ``ProgressBar`` is the ``tqdm_class`` handed to huggingface_hub: the
library creates one per file and reports bytes through ``update``/``update_transfer``.

``pid`` with ``pid_start`` (the process start time from /proc) lets a reader tell a live writer
from a dead one even after the pid is reused. Pure stdlib: unit-tested directly.

A run that waits for another run's repository lock follows it (``HolderWatch``): it waits while
the holder's progress moves, and leaves the progress file to the holder when both use one path
(``Progress.mute``); a poller of the waiting run then reads the holder's progress (``read_progress``).
"""
from __future__ import annotations

import collections
import contextlib
import json
import os
import socket
import threading
import time

from ansible_collections.modelswap.vllm.plugins.module_utils.common.fsutil import atomic_write_text
from ansible_collections.modelswap.vllm.plugins.module_utils.common.units import human_bytes

STATES = ("starting", "resolving", "waiting", "cleaning", "downloading", "verifying", "done", "failed")
FINAL_STATES = ("done", "failed")
RATE_WINDOW_S = 20.0


def human_duration(seconds) -> str:
    if seconds is None:
        return "?"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return "%d:%02d:%02d" % (hours, minutes, secs)


def process_start(pid: int):
    """The start time (clock ticks since boot) of process ``pid`` from /proc, or None."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as fh:
            data = fh.read().decode("ascii", "replace")
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: split after the last ')'
    fields = data[data.rfind(")") + 2:].split()
    try:
        return fields[19]   # field 22 overall
    except IndexError:
        return None


def format_line(p: dict) -> str:
    """One human line for a progress snapshot."""
    what = "%s@%s" % (p.get("repo_id") or "?", (p.get("commit") or p.get("revision") or "?")[:12])
    state = p.get("state", "?")
    if state == "waiting" and p.get("following"):
        return "%s following the download of run %s (%s)" % (what, p["following"], p.get("lock_holder") or "?")
    if state == "waiting":
        return "%s waiting for the repository lock (held by %s)" % (what, p.get("lock_holder") or "another download")
    if state in ("starting", "resolving", "cleaning"):
        return "%s %s" % (what, state)
    parts = [what, state]
    total = p.get("bytes_total") or 0
    if state == "downloading" or (state in FINAL_STATES and total):
        parts.append("%.1f%%" % (p.get("percent") or 0.0))
        parts.append("%s of %s" % (human_bytes(p.get("bytes_done", 0)), human_bytes(total)))
        if state == "downloading":
            parts.append("%s/s" % human_bytes(p.get("rate_bps") or 0))
            parts.append("ETA %s" % human_duration(p.get("eta_s")))
    if p.get("files_total") or state != "done":
        parts.append("%d/%d files" % (p.get("files_done", 0), p.get("files_total", 0)))
    else:
        parts.append("nothing to download")
    if p.get("verified_files"):
        parts.append("verified %d (%s)" % (p["verified_files"], human_bytes(p.get("verified_bytes", 0))))
    if state == "failed" and p.get("error"):
        parts.append("error: %s" % p["error"][:200])
    return " ".join(parts)


class Progress:
    """Thread-safe counters of one run, and a writer thread that saves them every ``interval`` s."""

    def __init__(self, path: str = "", *, run_id: str = "", interval: float = 5.0,
                 clock=time.monotonic, wall=time.time):
        self.path = path
        self.interval = max(0.2, float(interval))
        self._clock = clock
        self._wall = wall
        self._lock = threading.Lock()
        self._samples = collections.deque()
        self._received = {}
        self._stop = threading.Event()
        self._thread = None
        self._muted = False
        self.started = clock()
        self.data = {
            "id": run_id, "pid": os.getpid(), "pid_start": process_start(os.getpid()),
            "state": "starting", "repo_id": None, "revision": None, "commit": None,
            "bytes_total": 0, "bytes_done": 0, "bytes_written": 0, "bytes_transferred": 0, "bytes_received": 0,
            "files_total": 0, "files_done": 0, "verified_files": 0, "verified_bytes": 0,
            "started_at": wall(), "error": None,
        }

    # ---------------------------------------------------------------- counters
    def set(self, **fields) -> None:
        with self._lock:
            moved = "state" in fields and fields["state"] != self.data.get("state")
            self.data.update(fields)
        if moved and self._thread is not None and not self._stop.is_set():
            self.write()   # a new phase shows at once, not at the next tick

    def add(self, **deltas) -> None:
        with self._lock:
            for key, value in deltas.items():
                self.data[key] = self.data.get(key, 0) + value

    def add_bytes(self, n: int) -> None:
        """Bytes written to a file being fetched (may be negative when a transfer restarts)."""
        with self._lock:
            self.data["bytes_done"] = max(0, self.data["bytes_done"] + n)

    def add_written(self, n: int) -> None:
        """Bytes this run wrote into files (a bar's content updates, without what a resume started
        from; negative when a transfer restarts). Over Xet the transfer updates count the wire's
        compressed bytes instead, so this, not them, is the files' bytes fetched by this run."""
        with self._lock:
            self.data["bytes_written"] = max(0, self.data["bytes_written"] + n)

    def add_transfer(self, n: int) -> None:
        with self._lock:
            self.data["bytes_transferred"] = max(0, self.data["bytes_transferred"] + n)

    def add_received(self, n: int, kind: str) -> None:
        """Bytes that arrived over the network (never rolled back when a transfer restarts).

        ``kind`` is ``data`` (a bar's content updates) or ``transfer`` (its transfer updates, which
        huggingface_hub sends alongside, and which for xet count the bytes on the wire).
        """
        if n > 0:
            with self._lock:
                key = "_received_" + kind
                self._received[key] = self._received.get(key, 0) + n
                self.data["bytes_received"] = self._received.get("_received_transfer") or \
                    self._received.get("_received_data", 0)

    def snapshot(self) -> dict:
        now = self._clock()
        with self._lock:
            p = dict(self.data)
            self._samples.append((now, p["bytes_done"]))
            while len(self._samples) > 2 and now - self._samples[0][0] > RATE_WINDOW_S:
                self._samples.popleft()
            first_t, first_b = self._samples[0]
        span = now - first_t
        rate = (p["bytes_done"] - first_b) / span if span > 0.5 else None
        if rate is None:
            elapsed = now - self.started
            rate = p["bytes_done"] / elapsed if elapsed > 0.5 and p["bytes_done"] else 0.0
        total = p["bytes_total"]
        remaining = max(0, total - p["bytes_done"])
        p["percent"] = round(min(100.0, 100.0 * p["bytes_done"] / total), 1) if total else (
            100.0 if p["state"] == "done" else 0.0)
        p["rate_bps"] = int(rate)
        p["eta_s"] = int(remaining / rate) if rate > 0 and remaining else (0 if not remaining else None)
        p["elapsed_s"] = round(now - self.started, 1)
        p["updated"] = self._wall()
        p["line"] = format_line(p)
        return p

    # ---------------------------------------------------------------- file
    def mute(self, muted: bool) -> None:
        """Leave the file alone (``True``) or write it again: while this run follows another whose
        progress goes to the same file, two writers would make its poller's line flicker."""
        self._muted = bool(muted)

    def write(self) -> dict:
        p = self.snapshot()
        if self.path and not self._muted:
            with contextlib.suppress(OSError):
                _atomic_write(self.path, p)
        return p

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.write()

    def start(self) -> "Progress":
        if self.path:
            directory = os.path.dirname(self.path)
            if directory:
                os.makedirs(directory, exist_ok=True)
            self.write()
            self._thread = threading.Thread(target=self._run, name="hf-progress", daemon=True)
            self._thread.start()
        return self

    def finish(self, state: str, error: str = "") -> dict:
        """Stop the writer and save the final state (done or failed)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.set(state=state, error=error or None)
        return self.write()

    # ---------------------------------------------------------------- huggingface_hub
    def bar_class(self):
        """A ``tqdm_class`` for huggingface_hub that feeds this Progress."""
        progress = self

        class ProgressBar:
            """Minimal tqdm stand-in (the interface snapshot_download's _AggregatedTqdm has)."""

            def __init__(self, *args, **kwargs):
                self.total = kwargs.get("total")
                self.n = kwargs.get("initial") or 0
                self._written = 0
                self.desc = kwargs.get("desc")
                self.disable = False
                self.format_dict = {"rate": None}
                if self.n:
                    progress.add_bytes(self.n)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

            def update(self, n=1):
                n = int(n or 0)
                self.n += n
                progress.add_bytes(n)
                # a rollback takes back only what this bar wrote, not what a resume started from
                written = max(0, self._written + n)
                progress.add_written(written - self._written)
                self._written = written
                progress.add_received(n, "data")

            def update_transfer(self, n=1):
                progress.add_transfer(int(n or 0))
                progress.add_received(int(n or 0), "transfer")

            def set_postfix_str(self, *args, **kwargs):
                pass

            set_transfer_postfix_str = set_postfix_str
            set_description = set_postfix_str
            set_description_str = set_postfix_str

            def refresh(self, *args, **kwargs):
                pass

            def reset(self, total=None):
                self.total = total

            def close(self):
                pass

        return ProgressBar


def _atomic_write(path: str, data: dict) -> None:
    # No fsync: the file is rewritten every second or so, and a crash loses only a progress line.
    atomic_write_text(path, json.dumps(data, sort_keys=True), 0o644, fsync=False)


# --------------------------------------------------------------------------------------------
# the reader side (hf_snapshot_progress)
# --------------------------------------------------------------------------------------------
def job_finished(results_file: str):
    """Whether the Ansible async job whose results file is ``results_file`` has ended.

    async_wrapper writes ``{"started": ..., "finished": false}`` while the job runs and the
    module's result (or its own failure) when it ends (what async_status reads). None: unknown.
    """
    if not results_file:
        return None
    data = read_json_object(os.path.expanduser(results_file))    # None also while being written
    if data is None:
        return None
    return "started" not in data or bool(data.get("finished"))


def read_json_object(path: str):
    """A progress file's content (a dict), or None when absent, unreadable or not a JSON object."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def writer_alive(data: dict, start_of=process_start):
    """Whether the process that wrote ``data`` (its pid and start time) still runs; None: unknown."""
    pid = data.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return None
    start = start_of(pid)
    return start is not None and (data.get("pid_start") in (None, start))


def read_progress(path: str, run_id: str = "", results_file: str = "", now=None) -> dict:
    """What a poller reports: the writer's latest progress plus ``finished`` and ``alive``.

    ``finished`` is true when the progress says done/failed, when the writer process is gone, or
    when the async job has ended; then the poller stops and collects the job's result. A file
    that holds another live run's progress is the download this run follows (it waits for that
    run's repository lock and leaves the file to it): ``following`` names that run.
    """
    now = time.time() if now is None else now
    out = {"finished": False, "alive": None, "state": "starting", "line": "", "age_s": None, "found": False}
    data = read_json_object(path)
    if data is not None and (not run_id or data.get("id") == run_id):
        out.update(data)
        out["found"] = True
        out["age_s"] = round(now - float(data.get("updated") or now), 1)
        out["alive"] = writer_alive(data)
        pid = data.get("pid")
        if data.get("state") in FINAL_STATES:
            out["finished"] = True
        elif out["alive"] is False:
            out["finished"] = True
            out["line"] = "%s (the download process %s has ended without a final report)" % (
                data.get("line") or "", pid)
    elif data is not None and data.get("id") and writer_alive(data):
        out["state"] = "waiting"
        out["following"] = data["id"]
        out["line"] = "following the download of run %s (pid %s): %s" % (
            data["id"], data.get("pid"), data.get("line") or data.get("state") or "?")
    else:
        out["line"] = "waiting for the download to start"
    done = job_finished(results_file)
    if done:
        out["finished"] = True
    out["job_finished"] = done
    return out


def wait_progress(path: str, progress_id: str = "", results_file: str = "", wait: float = 0.0,
                  clock=time.monotonic, sleep=time.sleep, poll: float = 0.5) -> dict:
    """read_progress, after waiting up to ``wait`` seconds for the download to finish (checked
    every ``poll`` seconds): a poller that asks every N seconds hears of the end at once."""
    deadline = clock() + max(0.0, wait)
    info = read_progress(path, progress_id, results_file)
    while not info["finished"] and clock() < deadline:
        sleep(min(poll, max(0.0, deadline - clock())))
        info = read_progress(path, progress_id, results_file)
    return info


# --------------------------------------------------------------------------------------------
# following the holder of a repository lock
# --------------------------------------------------------------------------------------------
# What moves while a download goes on: bytes arrive, files land, files are verified, phases change.
MARK_KEYS = ("state", "bytes_done", "bytes_written", "bytes_transferred", "bytes_received", "files_done",
             "verified_files", "verified_bytes")


def progress_mark(data) -> tuple:
    """What of a progress snapshot shows headway (not ``updated``: a stuck writer still ticks)."""
    return tuple(data.get(key) for key in MARK_KEYS)


def holder_progress(info, read=read_json_object, start_of=process_start, host=None):
    """The progress of a repository lock's holder (``info``: the lock file's record), or None.

    Only a file the holder itself writes counts: its run id and pid, the pid alive on this host
    with the holder's start time (a reused pid is another process). A holder on another host
    (a shared store) or one that names no progress file shows none.
    """
    if not isinstance(info, dict) or not info.get("progress_file"):
        return None
    if info.get("host") != (socket.gethostname() if host is None else host):
        return None
    data = read(info["progress_file"])
    if not isinstance(data, dict) or data.get("pid") != info.get("pid"):
        return None
    if info.get("run") and data.get("id") != info["run"]:
        return None
    if not writer_alive(dict(data, pid_start=info.get("pid_start", data.get("pid_start"))), start_of):
        return None
    return data


class HolderWatch:
    """Whether to keep waiting for a repository lock's holder: while its progress moves.

    ``keep_waiting(info)`` is asked at every poll with the holder's lock record. It says no once
    the holder has shown no headway for ``stall_s`` seconds (since the wait began, or since its
    progress last moved; a holder without a progress file never moves: a fixed wait), or once
    ``limit_s`` seconds have passed since the wait began, whatever the holder does (never less
    than ``stall_s``). ``reason`` then says which: ``stalled`` or ``limit``.
    """

    def __init__(self, stall_s: float, limit_s: float = 0.0, clock=time.monotonic, read=holder_progress):
        self.stall_s = max(0.0, float(stall_s))
        self.limit_s = max(self.stall_s, float(limit_s or 0.0))
        self._clock = clock
        self._read = read
        self.started = self.moved = clock()
        self.mark = None
        self.progress = None
        self.reason = ""

    def keep_waiting(self, info) -> bool:
        now = self._clock()
        data = self._read(info)
        if data is not None:
            mark = progress_mark(data)
            if self.mark is not None and mark != self.mark:
                self.moved = now
            self.mark, self.progress = mark, data
        if now - self.moved >= self.stall_s:
            self.reason = "stalled"
        elif now - self.started >= self.limit_s:
            self.reason = "limit"
        return not self.reason
