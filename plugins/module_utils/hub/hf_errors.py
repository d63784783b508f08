# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0
"""hf_snapshot's failures and retry rules: ``FetchError`` (a final message with its cause), the
classification of an exception (the Hub's as hub_client classifies them, this host's disk and
permission errors here), and the retry with backoff that gives up at once on a permanent failure.
"""
from __future__ import annotations

import errno
import os
import re

from ansible_collections.modelswap.vllm.plugins.module_utils.hub import hub_client

MAX_BACKOFF_S = 60.0
# hf_xet reports a failed write of this host as a RuntimeError that carries Rust's io::Error text:
# "File reconstruction error: IO Error: No space left on device (os error 28)"
RUST_OS_ERROR_RE = re.compile(r"\(os error (\d+)\)")


class FetchError(Exception):
    """A failure whose message is final (what, where, why, what to do)."""

    def __init__(self, msg: str, cause: str = "error", transient: bool = False):
        super().__init__(msg)
        self.cause = cause
        self.transient = transient

    @classmethod
    def from_hub(cls, err: hub_client.HubError) -> "FetchError":
        """The job's error for a HubError (its kind is the cause)."""
        return cls(str(err), err.kind, err.transient)


class Cancelled(Exception):
    """The job is stopping after another failure."""


def os_errno(exc):
    """The errno of an OSError, or of an I/O error hf_xet raised as a RuntimeError; else None."""
    if isinstance(exc, OSError):
        return exc.errno
    if isinstance(exc, RuntimeError):
        found = RUST_OS_ERROR_RE.findall(str(exc))
        return int(found[-1]) if found else None
    return None


def classify(exc, hf, *, repo_id: str, revision: str, where: str, token_given: bool,
             what: str, dest: str = "") -> FetchError:
    """A FetchError for an exception raised while doing ``what``: the Hub's failures as
    hub_client classifies them, this host's (a full disk, a folder it cannot write) here."""
    def local(e):
        code = os_errno(e)
        if code in (errno.ENOSPC, errno.EDQUOT):
            return FetchError(
                "%s: the disk is full (%s) under %s; free space (disk_plan proposes what to purge, "
                "model_purge removes it) or choose another cache_dir/local_dir, then run again"
                % (what, os.strerror(code), dest or "the destination"), "disk_full")
        if code in (errno.EACCES, errno.EPERM, errno.EROFS):
            return FetchError(
                "%s: cannot write under %s (%s); make it writable for uid %d or choose another "
                "destination" % (what, dest or "the destination", os.strerror(code), os.getuid()),
                "not_writable")
        return None

    if isinstance(exc, FetchError):
        return exc
    err = hub_client.classify(exc, getattr(hf, "errors", None), repo_id=repo_id, revision=revision, where=where,
                              token_given=token_given, what=what, local=local)
    return err if isinstance(err, FetchError) else FetchError.from_hub(err)


def backoff(attempt: int, retry_delay: float) -> float:
    """Seconds to wait before retry ``attempt`` (1-based): doubling from ``retry_delay``, capped."""
    return min(MAX_BACKOFF_S, float(retry_delay) * (2 ** (attempt - 1)))


def retrying(fn, what: str, *, retries: int, retry_delay: float, stop, fail, note):
    """``fn()``, tried again after a transient failure up to ``retries`` times with backoff.

    ``fail(exc, what)`` classifies an exception into a FetchError; a permanent one is raised at
    once, a transient one after the last attempt (saying how many were made). ``stop`` (a
    threading.Event) cancels between attempts and cuts a backoff short; ``note(line)`` records
    each retry for the result.
    """
    attempts = max(1, int(retries) + 1)
    for attempt in range(1, attempts + 1):
        if stop.is_set():
            raise Cancelled(what)
        try:
            return fn()
        except Cancelled:
            raise
        except Exception as exc:  # classified below; nothing is swallowed
            err = fail(exc, what)
            if not err.transient or attempt == attempts:
                if err.transient:
                    err = FetchError("%s (gave up after %d attempts)" % (err, attempt), err.cause)
                raise err from None
            delay = backoff(attempt, retry_delay)
            note("retry %d/%d of %s in %.1fs: %s" % (attempt, attempts - 1, what, delay, err))
            if stop.wait(delay):
                raise Cancelled(what)
