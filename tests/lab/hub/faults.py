"""Fault injection and the request log of the lab's Hub (both live in the server process).

A fault is ``{"kind": ..., <params>, <selectors>, "count": N | None}``:

Selectors (all optional, ANDed; a request matches a fault when every given selector matches):
  ``method``    HEAD, GET or POST (case-insensitive)
  ``endpoint``  resolve | revision | tree | paths-info | refs | commits | whoami, and for Xet:
                xet-read-token | xet-reconstruction | xet-xorb | xet-telemetry
  ``repo``      fnmatch glob on the repository id ("lab/*"); a CAS request has the repository
                of its xet token (reconstruction) or of the reconstruction that signed its URL (xorb)
  ``file``      fnmatch glob on the file path in the repository; only file downloads have one:
                ``resolve`` and, for Xet, ``xet-reconstruction`` and ``xet-xorb`` (the first path in
                the token's commit with that content), so it never matches an API call
  ``url``       fnmatch glob on the request path, percent-decoded ("/api/models/*")

``count`` is how many requests the fault acts on before it is spent (default 1; ``None`` = no
limit). A use is spent only when the fault actually acts: e.g. ``ignore_range`` only on a request
that carries a Range header, the body faults only on a GET that has a body, ``flip_byte`` only when
the response covers the offset. When several faults of one kind match, the oldest acts.

Kinds (what the server does to a matching request):
  ``http_error``  answer ``status`` (default 500) with a JSON error, before anything else
                  (``message`` optional); the repository need not exist.
  ``delay``       wait ``seconds`` (<= 60) before answering.
  ``throttle``    send the body at ``rate`` bytes/s.
  ``cut``         announce the full Content-Length, send ``after`` body bytes (at most the body
                  length - 1), then drop the connection: the client sees a truncated transfer
                  (httpx: RemoteProtocolError "peer closed connection without sending complete
                  message body").
  ``short_body``  a complete-looking but short response: only the first ``length`` body bytes
                  (default half) are sent and the framing agrees with that: with ``framing``
                  "length" (default) Content-Length is the short length and the connection stays
                  usable; with "close" there is no Content-Length and the server closes after the
                  bytes. The metadata (HEAD, X-Linked-Size) still says the full size.
  ``flip_byte``   XOR the byte at absolute file offset ``offset`` (default: the middle of the
                  file) with ``xor`` (default 0xFF) in the body sent; headers stay truthful.
  ``wrong_etag``  on resolve HEAD/GET, send ``etag`` (default: a made-up value of the right shape:
                  64 hex for LFS files, 40 hex otherwise) in ETag and X-Linked-Etag; body intact.
                  ``like`` ("<revision>:<path>") sends instead the ETag that file of the same
                  repository has at that revision: a wrong ETag that collides with the blob of
                  another (served) revision.
  ``bad_listing`` a malicious or broken mirror's file list: on a tree or paths-info answer, the
                  first file entry whose path matches ``target`` (fnmatch, default "*") gets
                  ``path``, ``oid`` and/or ``lfs_oid`` (an LFS entry is made when it had none) as
                  given, raw (e.g. "../../../../etc/x", an oid with "/"); with ``add`` true a
                  tampered copy is appended and the real entry kept.
  ``ignore_range`` answer a request that has a Range header with 200 and the full body.

Xet kinds (the generic kinds work on the CAS routes too: e.g. ``http_error`` with endpoint
``xet-xorb`` answers a xorb range 5xx, ``cut`` drops it mid-body):
  ``xet_token_expired``  on ``xet-read-token``: the token issued is already expired (exp = now - 1)
                  and the CAS answers it 401; hf_xet refreshes a token that expires within 30 s
                  before using it, so a client sees a second token request, not an error.
  ``xet_truncated_term`` on ``xet-xorb``: the range is answered short by its last ``chunks``
                  (default 1) whole chunks, framing consistent (Content-Length, Content-Range).
  ``xet_bad_chunk``  on ``xet-xorb``: chunk ``chunk`` (default 0) of the range, counted from the
                  range's first, decodes to data with the middle byte XORed with ``xor`` (default
                  0xFF): same unpacked length, wrong content; acts only when the range has that chunk.
"""
from __future__ import annotations

import collections
import fnmatch
import itertools
import threading
from dataclasses import dataclass, field

SELECTORS = ("method", "endpoint", "repo", "file", "url")
ENDPOINTS = ("resolve", "revision", "tree", "paths-info", "refs", "commits", "whoami",
             "xet-read-token", "xet-reconstruction", "xet-xorb", "xet-telemetry")

# kind -> {param: (type, default)}
KINDS: dict[str, dict[str, tuple[type | tuple[type, ...], object]]] = {
    "http_error": {"status": (int, 500), "message": (str, None)},
    "delay": {"seconds": ((int, float), 1.0)},
    "throttle": {"rate": (int, None)},
    "cut": {"after": (int, 0)},
    "short_body": {"length": (int, None), "framing": (str, "length")},
    "flip_byte": {"offset": (int, None), "xor": (int, 0xFF)},
    "wrong_etag": {"etag": (str, None), "like": (str, None)},
    "bad_listing": {"target": (str, "*"), "path": (str, None), "oid": (str, None), "lfs_oid": (str, None),
                    "add": (bool, False)},
    "ignore_range": {},
    "xet_token_expired": {},
    "xet_truncated_term": {"chunks": (int, 1)},
    "xet_bad_chunk": {"chunk": (int, 0), "xor": (int, 0xFF)},
}
MAX_DELAY_S = 60.0


class FaultError(ValueError):
    """A fault specification the server refuses (unknown kind, bad parameter)."""


@dataclass
class Fault:
    id: int
    kind: str
    params: dict
    selectors: dict
    remaining: int | None
    hits: int = 0

    def to_json(self) -> dict:
        return {"id": self.id, "kind": self.kind, **self.params, **self.selectors,
                "count": self.remaining, "hits": self.hits}


def parse_fault(spec: dict, fault_id: int) -> Fault:
    if not isinstance(spec, dict):
        raise FaultError("a fault is a JSON object")
    spec = dict(spec)
    kind = spec.pop("kind", None)
    if kind not in KINDS:
        raise FaultError(f"unknown fault kind {kind!r}; known: {', '.join(sorted(KINDS))}")
    count = spec.pop("count", 1)
    if count is not None and (not isinstance(count, int) or isinstance(count, bool) or count < 1):
        raise FaultError(f"count must be a positive integer or null, not {count!r}")
    selectors = {}
    for name in SELECTORS:
        value = spec.pop(name, None)
        if value is None:
            continue
        if not isinstance(value, str) or not value:
            raise FaultError(f"selector {name} must be a non-empty string")
        if name == "method":
            value = value.upper()
            if value not in ("GET", "HEAD", "POST"):
                raise FaultError(f"method must be GET, HEAD or POST, not {value!r}")
        if name == "endpoint" and value not in ENDPOINTS:
            raise FaultError(f"endpoint must be one of {', '.join(ENDPOINTS)}, not {value!r}")
        selectors[name] = value
    params = {}
    for name, (typ, default) in KINDS[kind].items():
        value = spec.pop(name, default)
        if value is not None and (not isinstance(value, typ) or (isinstance(value, bool) and typ is not bool)):
            raise FaultError(f"{kind}: {name} must be {getattr(typ, '__name__', typ)}, not {value!r}")
        params[name] = value
    if spec:
        raise FaultError(f"{kind}: unknown parameters {', '.join(sorted(spec))}")
    if kind == "http_error" and not 400 <= params["status"] <= 599:
        raise FaultError("http_error: status must be 400-599")
    if kind == "delay" and not 0 <= params["seconds"] <= MAX_DELAY_S:
        raise FaultError(f"delay: seconds must be 0-{MAX_DELAY_S:g}")
    if kind == "throttle" and (params["rate"] is None or params["rate"] < 1):
        raise FaultError("throttle: rate (bytes/s) must be a positive integer")
    if kind == "cut" and params["after"] < 0:
        raise FaultError("cut: after must be >= 0")
    if kind == "short_body":
        if params["framing"] not in ("length", "close"):
            raise FaultError("short_body: framing must be 'length' or 'close'")
        if params["length"] is not None and params["length"] < 0:
            raise FaultError("short_body: length must be >= 0")
    if kind == "flip_byte":
        if params["offset"] is not None and params["offset"] < 0:
            raise FaultError("flip_byte: offset must be >= 0")
        if not 1 <= params["xor"] <= 255:
            raise FaultError("flip_byte: xor must be 1-255")
    if kind == "wrong_etag" and params["etag"] is not None and not params["etag"].isalnum():
        raise FaultError("wrong_etag: etag must be alphanumeric")
    if kind == "wrong_etag" and params["like"] is not None:
        if params["etag"] is not None:
            raise FaultError("wrong_etag: give etag or like, not both")
        rev, sep, path = params["like"].partition(":")
        if not sep or not rev or not path:
            raise FaultError("wrong_etag: like must be '<revision>:<path>'")
    if kind == "bad_listing" and all(params[k] is None for k in ("path", "oid", "lfs_oid")):
        raise FaultError("bad_listing: give at least one of path, oid, lfs_oid")
    if kind == "xet_truncated_term" and params["chunks"] < 1:
        raise FaultError("xet_truncated_term: chunks must be >= 1")
    if kind == "xet_bad_chunk":
        if params["chunk"] < 0:
            raise FaultError("xet_bad_chunk: chunk must be >= 0")
        if not 1 <= params["xor"] <= 255:
            raise FaultError("xet_bad_chunk: xor must be 1-255")
    return Fault(fault_id, kind, params, selectors, count)


@dataclass
class RequestInfo:
    """What the fault selectors look at."""
    method: str
    path: str                 # percent-decoded request path
    endpoint: str | None = None
    repo: str | None = None
    file: str | None = None


def _matches(fault: Fault, req: RequestInfo) -> bool:
    sel = fault.selectors
    if "method" in sel and sel["method"] != req.method:
        return False
    if "endpoint" in sel and sel["endpoint"] != req.endpoint:
        return False
    if "repo" in sel and (req.repo is None or not fnmatch.fnmatchcase(req.repo, sel["repo"])):
        return False
    if "file" in sel and (req.file is None or not fnmatch.fnmatchcase(req.file, sel["file"])):
        return False
    if "url" in sel and not fnmatch.fnmatchcase(req.path, sel["url"]):
        return False
    return True


class FaultRegistry:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._faults: list[Fault] = []
        self._ids = itertools.count(1)

    def add(self, spec: dict) -> Fault:
        with self._lock:
            fault = parse_fault(spec, next(self._ids))
            self._faults.append(fault)
            return fault

    def remove(self, fault_id: int) -> bool:
        with self._lock:
            before = len(self._faults)
            self._faults = [f for f in self._faults if f.id != fault_id]
            return len(self._faults) != before

    def clear(self) -> int:
        with self._lock:
            n = len(self._faults)
            self._faults = []
            return n

    def list(self) -> list[dict]:
        with self._lock:
            return [f.to_json() for f in self._faults]

    def take(self, kind: str, req: RequestInfo, applies=None) -> Fault | None:
        """The oldest live fault of `kind` matching `req` (and `applies(fault)`), one use spent."""
        with self._lock:
            for fault in self._faults:
                if fault.kind == kind and _matches(fault, req) and (applies is None or applies(fault)):
                    fault.hits += 1
                    if fault.remaining is not None:
                        fault.remaining -= 1
                        if fault.remaining <= 0:
                            self._faults.remove(fault)
                    return Fault(fault.id, fault.kind, dict(fault.params), dict(fault.selectors),
                                 fault.remaining, fault.hits)
        return None


@dataclass
class RequestLog:
    """The last `limit` requests (control requests excluded). Never holds a token."""
    limit: int = 20000
    _entries: collections.deque = field(default_factory=collections.deque)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _ids: itertools.count = field(default_factory=lambda: itertools.count(1))

    def add(self, entry: dict) -> None:
        with self._lock:
            entry["id"] = next(self._ids)
            self._entries.append(entry)
            while len(self._entries) > self.limit:
                self._entries.popleft()

    def list(self, since: int = 0) -> list[dict]:
        with self._lock:
            return [dict(e) for e in self._entries if e["id"] > since]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
