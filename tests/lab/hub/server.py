"""The lab's local Hugging Face Hub: `python -m tests.lab.hub.server --root DIR --host H --port P`.

Speaks the part of the Hub's HTTP API that huggingface_hub 2.x uses for downloads, over plain
HTTP and over Xet (hf_xet), from the store under --root (see store.py), and reads the store on
every request, so repositories and commits published while it runs are served at once.

  GET  /api/models/{repo}[/revision/{rev}][?blobs=true]   info: sha, siblings (sizes with blobs)
  GET  /api/models/{repo}/tree/{rev}[/{path}]?recursive=&expand=   listing, paged by Link rel="next"
  POST /api/models/{repo}/paths-info/{rev}                 form or JSON "paths"
  GET  /api/models/{repo}/refs, /api/models/{repo}/commits/{rev}
  HEAD|GET /{repo}/resolve/{rev}/{path}                    the file: X-Repo-Commit, ETag (git blob id;
        sha256 and X-Linked-Etag/X-Linked-Size for LFS files), Accept-Ranges, Range -> 206; a
        non-empty LFS file also carries X-Xet-Hash, X-Xet-Refresh-Route and Link rel="xet-auth"
        (the token route below, at the commit) and rel="xet-reconstruction-info" (not followed:
        the body is still the file, so a client without xet downloads it as before)
  GET  /api/whoami-v2                                      for a valid Bearer token
Xet (see xet.py; off with --no-xet; tree and paths-info entries of LFS files then carry xetHash):
  GET  /api/models/{repo}/xet-read-token/{rev}             a xet access token for the repository
        (gated repositories: the same checks as their files): JSON {accessToken, exp, casUrl} and
        headers X-Xet-Access-Token, X-Xet-Token-Expiration, X-Xet-Cas-Url (casUrl = <this server>/cas);
        tokens live --xet-token-ttl seconds (default 3600) and are HMAC-signed, not stored
  GET  /cas/v2/reconstructions/{file hash}, /cas/v1/...    the file's terms and xorb fetch URLs
        (v2: "xorbs" multi-range entries, v1: "fetch_info"); Range -> that part; 416 past the end;
        401 without a valid, unexpired token; 404 for a file not in the token's repository
  GET  /cas/xorbs/default/{xorb hash}?<signed>             xorb bytes: the Range header must lie in
        the URL's signed range (X-Xet-Signed-Range, Expires, Signature) -> 206, else 403; no
        Authorization needed, like the Hub's presigned CDN URLs
  POST /cas/v1/telemetry                                   hf_xet's transfer report, dropped (200)
Errors carry X-Error-Code (RepoNotFound, RevisionNotFound, EntryNotFound, GatedRepo), X-Error-Message
and a JSON {"error": ...}. A gated repository's files need `Authorization: Bearer <token>` of a
token in tokens.json (401 without, 403 for a token without gated access); its metadata stays public,
as on the Hub. An unknown token gets 401 "Invalid credentials in Authorization header" everywhere.

Test control (not part of the Hub's API; needs header X-Lab-Control: <root/control.key>):
  GET|POST|DELETE /_lab/faults, DELETE /_lab/faults/{id}   fault injection (see faults.py)
  GET|DELETE      /_lab/log[?since=ID]                     request log (control requests excluded)
  GET             /_lab/health                             no key needed

Prints "READY <url>" on stdout once listening; SIGTERM/SIGINT stop it (exit 0).
"""
from __future__ import annotations

import argparse
import contextlib
import fnmatch
import hashlib
import hmac
import json
import os
import posixpath
import signal
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

from tests.lab.hub.faults import FaultError, FaultRegistry, RequestInfo, RequestLog
from tests.lab.hub.store import Commit, FileEntry, Store
from tests.lab.hub.xet import FileIndex, XetStore, is_hash_hex, parse_chunks

API_KEYWORDS = ("revision", "tree", "paths-info", "refs", "commits", "xet-read-token")
MAX_REQUEST_BODY = 1024 * 1024
SEND_CHUNK = 256 * 1024
INVALID_CREDENTIALS = "Invalid credentials in Authorization header"


class ClientGone(Exception):
    """The client went away while we were answering."""


class HubError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers or {}


class Body:
    """A response body: bytes, or a byte range of a file on disk (streamed, never loaded)."""

    def __init__(self, data: bytes | None = None, path: Path | None = None, start: int = 0,
                 length: int | None = None):
        self.data, self.path, self.start = data, path, start
        self.length = len(data) if data is not None else (length or 0)


class HubHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, address, store: Store, *, max_threads: int, page_size: int, access_log: bool,
                 xet: bool = True, xet_token_ttl: int = 3600):
        self.store = store
        self.xet = XetStore(store.root, store.object_path) if xet else None
        self.xet_token_ttl = xet_token_ttl
        self.faults = FaultRegistry()
        self.log = RequestLog()
        self.page_size = page_size
        self.access_log = access_log
        self.control_key = store.control_key(create=True)
        self.stopping = threading.Event()
        self._slots = threading.BoundedSemaphore(max_threads)
        self._active = 0  # connections being served (idle keep-alive ones included)
        self._busy = 0    # requests being answered
        self._active_lock = threading.Lock()
        super().__init__(address, HubHandler)

    # bounded threads: the accept loop waits for a free slot (polling so shutdown is never stuck)
    def process_request(self, request, client_address):
        while not self._slots.acquire(timeout=0.2):
            if self.stopping.is_set():
                self.shutdown_request(request)
                return
        with self._active_lock:
            self._active += 1
        try:
            super().process_request(request, client_address)
        except Exception:
            self._release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release()

    def _release(self):
        with self._active_lock:
            self._active -= 1
        self._slots.release()

    @property
    def active(self) -> int:
        with self._active_lock:
            return self._active

    @property
    def busy(self) -> int:
        with self._active_lock:
            return self._busy

    @contextlib.contextmanager
    def answering(self):
        with self._active_lock:
            self._busy += 1
        try:
            yield
        finally:
            with self._active_lock:
                self._busy -= 1

    def handle_error(self, request, client_address):
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError, socket.timeout)):
            return
        print(f"hub: error serving {client_address}: {exc!r}", file=sys.stderr, flush=True)


class HubHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "modelswap-lab-hub/1"
    timeout = 30  # idle keep-alive connections and stalled clients are dropped after this
    server: HubHTTPServer

    def log_message(self, format, *args):  # noqa: A002 - stdlib signature
        if self.server.access_log:
            sys.stderr.write("hub: %s %s\n" % (self.address_string(), format % args))

    def do_GET(self):
        self._dispatch("GET")

    def do_HEAD(self):
        self._dispatch("HEAD")

    def do_POST(self):
        self._dispatch("POST")

    def do_DELETE(self):
        self._dispatch("DELETE")

    # ------------------------------------------------------------------ plumbing
    def _dispatch(self, method: str) -> None:
        with self.server.answering():
            self._answer(method)

    def _answer(self, method: str) -> None:
        started = time.monotonic()
        split = urlsplit(self.path)
        raw_path, query = split.path, split.query
        self._status = 0
        self._sent = 0
        self._outcome = "ok"
        self._faults_applied: list[str] = []
        self._revision = self._user = None
        self._req = RequestInfo(method=method, path=unquote(raw_path))
        self._faults_allowed = not (raw_path == "/_lab" or raw_path.startswith("/_lab/"))
        if not self._faults_allowed:
            try:
                self._control(method, raw_path, query)
            except ClientGone:
                self.close_connection = True
            return
        auth = self.headers.get("Authorization")
        entry = {"time": time.time(), "method": method, "path": self._req.path, "query": query,
                 "range": self.headers.get("Range"), "auth": auth is not None, "client": self.client_address[0]}
        try:
            self._body = self._read_body()
            self._route(method, raw_path, query)
        except ClientGone:
            self._outcome = "client_gone"
            self.close_connection = True
        except HubError as e:
            self._send_error(e)
        except Exception as e:  # a bug here must not take the server down
            print(f"hub: internal error on {method} {self._req.path}: {e!r}", file=sys.stderr, flush=True)
            self._outcome = "server_error"
            if self._status:  # headers are out: all we can do is end the connection
                self._abort()
            else:
                with contextlib.suppress(ClientGone):
                    self._send_error(HubError(500, f"internal error: {type(e).__name__}"))
        finally:
            entry.update(status=self._status, bytes_sent=self._sent, outcome=self._outcome,
                         endpoint=self._req.endpoint, repo=self._req.repo, file=self._req.file,
                         revision=self._revision, user=self._user,
                         faults=self._faults_applied, duration=round(time.monotonic() - started, 4))
            self.server.log.add(entry)

    def _read_body(self) -> bytes:
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            self.close_connection = True
            raise HubError(400, "bad Content-Length") from None
        if length < 0 or length > MAX_REQUEST_BODY:
            self.close_connection = True
            raise HubError(413, "request body too large")
        return self.rfile.read(length) if length else b""

    def _write(self, data: bytes) -> None:
        try:
            self.wfile.write(data)
        except (ConnectionError, TimeoutError, socket.timeout, OSError) as e:
            raise ClientGone() from e
        self._sent += len(data)

    def _start(self, status: int, headers: dict) -> None:
        self._status = status
        try:
            self.send_response(status)
            for k, v in headers.items():
                v = str(v)
                if not v.isascii() or "\r" in v or "\n" in v:  # header values are latin-1 on the wire
                    v = quote(v, safe=" !#$&'()*+,-./:;<=>?@[]^_`{|}~\"")
                self.send_header(k, v)
            self.end_headers()
        except (ConnectionError, TimeoutError, socket.timeout, OSError) as e:
            raise ClientGone() from e

    def _send_json(self, status: int, payload, headers: dict | None = None, *, faulty: bool = True) -> None:
        data = json.dumps(payload).encode()
        h = {"Content-Type": "application/json; charset=utf-8", "Content-Length": len(data)}
        h.update(headers or {})
        self._send(status, h, Body(data), faulty=faulty and self._faults_allowed)

    def _send_error(self, e: HubError) -> None:
        headers = dict(e.headers)
        if e.code:
            headers["X-Error-Code"] = e.code
        headers["X-Error-Message"] = e.message
        self._send_json(e.status, {"error": e.message}, headers, faulty=False)

    def _abort(self) -> None:
        """Drop the connection without a clean end of the response."""
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.wfile.flush()
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)

    # ------------------------------------------------------------------ sending, with body faults
    def _send(self, status: int, headers: dict, body: Body, *, total: int | None = None,
              faulty: bool = True) -> None:
        """Send headers and (unless HEAD) the body, applying the body faults that match.

        `total` is the size of the whole entity the body is a range of (for flip_byte offsets).
        """
        method = self._req.method
        if method == "HEAD" or body.length == 0:
            self._start(status, headers)
            return
        if not faulty or method != "GET":
            self._start(status, headers)
            if body.data is not None:
                self._write(body.data)
            else:
                self._sendfile(body.path, body.start, body.length)
            return
        faults = self.server.faults
        req = self._req
        entity = total if total is not None else body.length
        send_len = body.length
        cut_at = None
        close_after = False
        short = faults.take("short_body", req)
        if short is not None:
            length = short.params["length"]
            send_len = min(body.length, body.length // 2 if length is None else length)
            if short.params["framing"] == "close":
                headers.pop("Content-Length", None)
                headers["Connection"] = "close"
                close_after = True
            else:
                headers["Content-Length"] = send_len
            self._faults_applied.append(f"short_body#{short.id}")
        cut = faults.take("cut", req) if send_len > 0 else None
        if cut is not None:
            cut_at = min(cut.params["after"], send_len - 1)
            self._faults_applied.append(f"cut#{cut.id}")
        flip_at = None

        def covers(f):
            off = f.params["offset"] if f.params["offset"] is not None else entity // 2
            return body.start <= off < body.start + send_len

        flip = faults.take("flip_byte", req, covers)
        if flip is not None:
            off = flip.params["offset"] if flip.params["offset"] is not None else entity // 2
            flip_at = (off - body.start, flip.params["xor"])
            self._faults_applied.append(f"flip_byte#{flip.id}")
        throttle = faults.take("throttle", req)
        rate = throttle.params["rate"] if throttle is not None else None
        if throttle is not None:
            self._faults_applied.append(f"throttle#{throttle.id}")

        self._start(status, headers)
        limit = cut_at if cut_at is not None else send_len
        if body.data is not None:
            self._send_chunks(iter([body.data[:limit]]), flip_at, rate)
        elif flip_at is None and rate is None:
            self._sendfile(body.path, body.start, limit)
        else:
            self._send_chunks(self._file_chunks(body.path, body.start, limit, rate), flip_at, rate)
        if cut_at is not None:
            self._outcome = "cut"
            self._abort()
        elif close_after:
            self._outcome = "short_body"
            self._abort()
        elif short is not None:
            self._outcome = "short_body"

    @staticmethod
    def _file_chunks(path: Path, start: int, length: int, rate: int | None):
        size = SEND_CHUNK if rate is None else max(1024, min(SEND_CHUNK, rate // 20))
        with open(path, "rb") as f:
            f.seek(start)
            left = length
            while left > 0:
                chunk = f.read(min(size, left))
                if not chunk:
                    raise OSError(f"{path} is shorter than the store says")
                left -= len(chunk)
                yield chunk

    def _send_chunks(self, chunks, flip_at, rate) -> None:
        pos = 0
        t0 = time.monotonic()
        step = SEND_CHUNK if rate is None else max(1024, min(SEND_CHUNK, rate // 20))
        for chunk in chunks:
            if flip_at is not None and pos <= flip_at[0] < pos + len(chunk):
                i = flip_at[0] - pos
                chunk = chunk[:i] + bytes([chunk[i] ^ flip_at[1]]) + chunk[i + 1:]
            for j in range(0, len(chunk), step):
                piece = chunk[j:j + step]
                self._write(piece)
                if rate is not None:
                    ahead = (pos + j + len(piece)) / rate - (time.monotonic() - t0)
                    if ahead > 0:
                        time.sleep(ahead)
            pos += len(chunk)

    def _sendfile(self, path: Path, start: int, length: int) -> None:
        try:
            self.wfile.flush()
        except OSError as e:
            raise ClientGone() from e
        with open(path, "rb") as f:
            offset, left = start, length
            while left > 0:
                try:
                    n = self.connection.sendfile(f, offset, min(left, 8 * 1024 * 1024))
                except (ConnectionError, TimeoutError, socket.timeout, OSError) as e:
                    raise ClientGone() from e
                if n == 0:
                    raise ClientGone()
                offset += n
                left -= n
                self._sent += n

    # ------------------------------------------------------------------ auth
    def _token_user(self) -> tuple[bool, dict | None]:
        """(header present, the token's record or None). The token itself is never kept."""
        header = self.headers.get("Authorization")
        if header is None:
            return False, None
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return True, None
        token = token.strip()
        for known, info in self.server.store.tokens().items():
            if hmac.compare_digest(known.encode(), token.encode()):
                return True, info
        return True, None

    def _check_auth(self, gated_file_of: str | None = None) -> None:
        present, info = self._token_user()
        self._user = info.get("user") if info else None
        if gated_file_of is not None:
            msg = f"Access to model {gated_file_of} is restricted."
            if info is None:
                extra = INVALID_CREDENTIALS if present else "You must be authenticated to access it."
                raise HubError(401, f"{msg} {extra}", "GatedRepo")
            if not info.get("gated_access", True):
                raise HubError(403, f"{msg} You are not in the authorized list.", "GatedRepo")
        elif present and info is None:
            raise HubError(401, INVALID_CREDENTIALS)

    # ------------------------------------------------------------------ routing
    def _route(self, method: str, raw_path: str, query: str) -> None:
        segs = raw_path.split("/")[1:]
        params = parse_qs(query, keep_blank_values=True)
        req = self._req
        if segs[:2] == ["api", "whoami-v2"] and len(segs) == 2:
            req.endpoint = "whoami"
            self._pre_faults()
            return self._whoami(method)
        if segs[:2] == ["api", "models"] and len(segs) >= 3:
            rest = [unquote(s) for s in segs[2:]]
            if len(rest) >= 3 and rest[2] in API_KEYWORDS:
                repo, kw, tail = f"{rest[0]}/{rest[1]}", rest[2], rest[3:]
            elif len(rest) >= 2 and rest[1] in API_KEYWORDS:
                repo, kw, tail = rest[0], rest[1], rest[2:]
            elif len(rest) <= 2 and all(rest):
                repo, kw, tail = "/".join(rest), "revision", []
            else:
                raise HubError(404, "no such API endpoint")
            req.repo, req.endpoint = repo, kw
            self._pre_faults()
            body = self._body
            expected = "POST" if kw == "paths-info" else "GET"
            if method != expected and not (method == "HEAD" and expected == "GET"):
                raise HubError(405, f"{method} is not allowed on {kw}")
            return getattr(self, "_api_" + kw.replace("-", "_"))(repo, tail, params, body)
        if len(segs) >= 4 and (segs[2] == "resolve" or segs[1] == "resolve"):
            split = 2 if segs[2] == "resolve" else 1
            repo = "/".join(unquote(s) for s in segs[:split])
            tail = segs[split + 1:]
            if len(tail) < 2 or not all(tail):
                raise HubError(404, "no such file path")
            req.repo, req.endpoint = repo, "resolve"
            req.file = "/".join(unquote(s) for s in tail[1:])
            self._pre_faults()
            if method not in ("GET", "HEAD"):
                raise HubError(405, f"{method} is not allowed on resolve")
            return self._resolve(method, repo, unquote(tail[0]), req.file)
        if segs[0] == "cas" and self.server.xet is not None:
            return self._cas(method, [unquote(s) for s in segs[1:]], params)
        self._pre_faults()
        raise HubError(404, f"not found: {req.path}")

    def _pre_faults(self) -> None:
        faults, req = self.server.faults, self._req
        delay = faults.take("delay", req)
        if delay is not None:
            self._faults_applied.append(f"delay#{delay.id}")
            time.sleep(delay.params["seconds"])
        err = faults.take("http_error", req)
        if err is not None:
            self._faults_applied.append(f"http_error#{err.id}")
            status = err.params["status"]
            raise HubError(status, err.params["message"] or f"lab fault: injected HTTP {status}")

    def _repo(self, repo_id: str) -> dict:
        meta = self.server.store.repo_meta(repo_id)
        if meta is None:
            self._check_auth()
            raise HubError(404, "Repository not found", "RepoNotFound")
        return meta

    def _base_url(self) -> str:
        """This server as the client reached it (links we hand out must work from where it is)."""
        host = self.headers.get("Host") or "%s:%d" % self.server.server_address[:2]
        return f"http://{host}"

    def _commit(self, repo_id: str, revision: str) -> Commit:
        commit_id = self.server.store.resolve(repo_id, revision)
        if commit_id is None:
            raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        self._revision = revision
        return self.server.store.commit(repo_id, commit_id)

    # ------------------------------------------------------------------ API endpoints
    def _whoami(self, method: str) -> None:
        present, info = self._token_user()
        if info is None:
            raise HubError(401, INVALID_CREDENTIALS if present else "Invalid username or password.")
        self._user = info["user"]
        self._send_json(200, {"type": "user", "id": hashlib.sha1(info["user"].encode()).hexdigest()[:24],
                              "name": info["user"], "fullname": info["user"], "orgs": [],
                              "auth": {"type": "access_token",
                                       "accessToken": {"displayName": "lab", "role": "read"}}})

    def _api_revision(self, repo_id: str, tail: list[str], params: dict, body: bytes) -> None:
        meta = self._repo(repo_id)
        self._check_auth()
        commit = self._commit(repo_id, "/".join(tail) if tail else "main")
        blobs = params.get("blobs", ["false"])[-1].lower() in ("1", "true")
        siblings = []
        for f in sorted(commit.files.values(), key=lambda f: f.path):
            s: dict = {"rfilename": f.path}
            if blobs:
                s.update(size=f.size, blobId=f.oid)
                if f.lfs:
                    s["lfs"] = {"size": f.size, "sha256": f.sha256, "pointerSize": f.pointer_size}
            siblings.append(s)
        author = repo_id.split("/")[0] if "/" in repo_id else None
        self._send_json(200, {
            "_id": hashlib.sha1(repo_id.encode()).hexdigest()[:24], "id": repo_id, "modelId": repo_id,
            "author": author, "sha": commit.id, "lastModified": commit.date, "createdAt": meta["created_at"],
            "private": False, "gated": "manual" if meta["gated"] else False, "disabled": False,
            "downloads": 0, "likes": 0, "tags": [], "siblings": siblings,
            "usedStorage": self.server.store.used_storage(repo_id)})

    def _entry_json(self, f: FileEntry, last_commit: dict | None) -> dict:
        d = {"type": "file", "oid": f.oid, "size": f.size, "path": f.path}
        if f.lfs:
            d["lfs"] = {"oid": f.sha256, "size": f.size, "pointerSize": f.pointer_size}
            index = self._xet_index(f)
            if index is not None:
                d["xetHash"] = index.file_hash
        if last_commit is not None:
            d["lastCommit"] = last_commit
        return d

    def _last_commits(self, repo_id: str, commit: Commit) -> dict[str, dict]:
        """path -> the commit that last changed it (files and directories), walking the history."""
        history = self.server.store.history(repo_id, commit.id)
        out: dict[str, dict] = {}
        items = [(p, f.oid) for p, f in commit.files.items()] + [(d, t) for d, t in commit.dirs.items() if d]
        for path, oid in items:
            last = commit
            for older in history[1:]:
                older_oid = older.files[path].oid if path in older.files else older.dirs.get(path)
                if older_oid != oid:
                    break
                last = older
            out[path] = {"id": last.id, "title": last.message.splitlines()[0] if last.message else "",
                         "date": last.date}
        return out

    def _api_tree(self, repo_id: str, tail: list[str], params: dict, body: bytes) -> None:
        self._repo(repo_id)
        self._check_auth()
        if not tail:
            raise HubError(404, "missing revision")
        commit = self._commit(repo_id, tail[0])
        base = "/".join(tail[1:]).strip("/")
        if base and base not in commit.dirs:
            raise HubError(404, f"Entry not found: {base} is not a directory at {commit.id}", "EntryNotFound",
                           {"X-Repo-Commit": commit.id})
        recursive = params.get("recursive", ["false"])[-1].lower() in ("1", "true")
        expand = params.get("expand", ["false"])[-1].lower() in ("1", "true")
        prefix = base + "/" if base else ""

        def wanted(path: str) -> bool:
            if not path.startswith(prefix) or path == base:
                return False
            return recursive or "/" not in path[len(prefix):]

        last = self._last_commits(repo_id, commit) if expand else {}
        entries = [{"type": "directory", "oid": tree, "size": 0, "path": d, **(
            {"lastCommit": last[d]} if expand else {})} for d, tree in sorted(commit.dirs.items()) if d and wanted(d)]
        entries += [self._entry_json(f, last.get(f.path) if expand else None)
                    for f in sorted(commit.files.values(), key=lambda f: f.path) if wanted(f.path)]
        entries = self._tamper_listing(entries)
        page_size = max(1, self.server.page_size // (20 if expand else 1))
        try:
            start = int(params.get("cursor", ["0"])[-1])
        except ValueError:
            raise HubError(400, "bad cursor") from None
        page = entries[start:start + page_size]
        headers = {}
        if start + page_size < len(entries):
            next_q = "&".join(f"{k}={quote(v[-1], safe='')}" for k, v in params.items() if k != "cursor")
            next_q += ("&" if next_q else "") + f"cursor={start + page_size}"
            headers["Link"] = f'<{self._base_url()}{urlsplit(self.path).path}?{next_q}>; rel="next"'
        self._send_json(200, page, headers)

    def _api_paths_info(self, repo_id: str, tail: list[str], params: dict, body: bytes) -> None:
        self._repo(repo_id)
        self._check_auth()
        if not tail:
            raise HubError(404, "missing revision")
        commit = self._commit(repo_id, "/".join(tail))
        ctype = (self.headers.get("Content-Type") or "").lower()
        try:
            if "json" in ctype:
                form = json.loads(body or b"{}")
                paths, expand = form.get("paths", []), bool(form.get("expand"))
            else:
                form = parse_qs(body.decode(), keep_blank_values=True)
                paths, expand = form.get("paths", []), form.get("expand", ["false"])[-1].lower() == "true"
        except (ValueError, UnicodeDecodeError, AttributeError):
            raise HubError(400, "bad paths-info body") from None
        last = self._last_commits(repo_id, commit) if expand else {}
        out = []
        for p in paths if isinstance(paths, list) else [paths]:
            p = str(p).strip("/")
            if p in commit.files:
                out.append(self._entry_json(commit.files[p], last.get(p) if expand else None))
            elif p in commit.dirs and p:
                out.append({"type": "directory", "oid": commit.dirs[p], "size": 0, "path": p})
        self._send_json(200, self._tamper_listing(out))

    def _tamper_listing(self, entries: list[dict]) -> list[dict]:
        """Apply a ``bad_listing`` fault: one file entry gets the given path / oid / lfs oid, raw."""
        def applies(f):
            return any(e["type"] == "file" and fnmatch.fnmatchcase(e["path"], f.params["target"]) for e in entries)

        fault = self.server.faults.take("bad_listing", self._req, applies)
        if fault is None:
            return entries
        self._faults_applied.append(f"bad_listing#{fault.id}")
        out = list(entries)
        for i, e in enumerate(out):
            if e["type"] != "file" or not fnmatch.fnmatchcase(e["path"], fault.params["target"]):
                continue
            bad = json.loads(json.dumps(e))
            if fault.params["path"] is not None:
                bad["path"] = fault.params["path"]
            if fault.params["oid"] is not None:
                bad["oid"] = fault.params["oid"]
            if fault.params["lfs_oid"] is not None:
                bad.setdefault("lfs", {"size": e["size"], "pointerSize": 134})["oid"] = fault.params["lfs_oid"]
            if fault.params["add"]:
                out.append(bad)
            else:
                out[i] = bad
            break
        return out

    def _api_refs(self, repo_id: str, tail: list[str], params: dict, body: bytes) -> None:
        self._repo(repo_id)
        self._check_auth()
        refs = self.server.store.refs(repo_id)

        def listing(kind):
            return [{"name": n, "ref": f"refs/{kind}/{n}", "targetCommit": c} for n, c in sorted(refs[kind].items())]

        self._send_json(200, {"branches": listing("heads"), "tags": listing("tags"), "converts": []})

    def _api_commits(self, repo_id: str, tail: list[str], params: dict, body: bytes) -> None:
        self._repo(repo_id)
        self._check_auth()
        commit = self._commit(repo_id, "/".join(tail) if tail else "main")
        self._send_json(200, [{"id": c.id, "title": c.message.splitlines()[0] if c.message else "",
                               "message": c.message, "authors": [{"user": "lab"}], "date": c.date}
                              for c in self.server.store.history(repo_id, commit.id)])

    # ------------------------------------------------------------------ files
    def _resolve(self, method: str, repo_id: str, revision: str, path: str) -> None:
        meta = self._repo(repo_id)
        self._check_auth(gated_file_of=repo_id if meta["gated"] else None)
        commit = self._commit(repo_id, revision)
        entry = commit.files.get(path)
        if entry is None:
            raise HubError(404, f"Entry not found: {path}", "EntryNotFound", {"X-Repo-Commit": commit.id})
        blob = self.server.store.object_path(entry.sha256)
        faults, req = self.server.faults, self._req
        etag = entry.etag
        wrong = faults.take("wrong_etag", req)
        if wrong is not None:
            self._faults_applied.append(f"wrong_etag#{wrong.id}")
            if wrong.params["like"]:
                rev, _, other_path = wrong.params["like"].partition(":")
                other_id = self.server.store.resolve(repo_id, rev)
                other = self.server.store.commit(repo_id, other_id).files.get(other_path) if other_id else None
                if other is None:
                    raise HubError(400, f"lab fault: wrong_etag like={wrong.params['like']!r}: no such file")
                etag = other.etag
            else:
                etag = wrong.params["etag"] or hashlib.new(
                    "sha256" if entry.lfs else "sha1", b"lab-wrong-etag:" + etag.encode()).hexdigest()
        headers = {"Content-Type": "application/octet-stream", "Accept-Ranges": "bytes",
                   "ETag": f'"{etag}"', "X-Repo-Commit": commit.id,
                   "Content-Disposition": f'inline; filename="{quote(posixpath.basename(path))}"'}
        if entry.lfs:
            headers["X-Linked-Etag"] = f'"{etag}"'
            headers["X-Linked-Size"] = entry.size
            headers.update(self._xet_file_headers(repo_id, commit, entry))
        size = entry.size
        rng = self.headers.get("Range")
        ignore = faults.take("ignore_range", req) if rng is not None and method == "GET" else None
        if ignore is not None:
            self._faults_applied.append(f"ignore_range#{ignore.id}")
            rng = None
        span = _parse_range(rng, size) if rng is not None else None
        if span == "unsatisfiable":
            raise HubError(416, f"Range {rng} not satisfiable for {size} bytes", None,
                           {"Content-Range": f"bytes */{size}", "X-Repo-Commit": commit.id})
        if span is None:
            headers["Content-Length"] = size
            self._send(200, headers, Body(path=blob, start=0, length=size), total=size)
        else:
            start, end = span
            headers["Content-Length"] = end - start + 1
            headers["Content-Range"] = f"bytes {start}-{end}/{size}"
            self._send(206, headers, Body(path=blob, start=start, length=end - start + 1), total=size)

    # ------------------------------------------------------------------ xet: Hub side
    def _xet_index(self, entry: FileEntry) -> FileIndex | None:
        """The xet index of an LFS file (built on first use); None when xet is off or the file is empty."""
        if self.server.xet is None or not entry.lfs or entry.size == 0:
            return None
        return self.server.xet.index(entry.sha256)

    def _xet_file_headers(self, repo_id: str, commit: Commit, entry: FileEntry) -> dict:
        index = self._xet_index(entry)
        if index is None:
            return {}
        base = self._base_url()
        # the token route names the commit, so a token is for exactly what this answer described
        refresh = f"{base}/api/models/{quote(repo_id)}/xet-read-token/{commit.id}"
        return {"X-Xet-Hash": index.file_hash, "X-Xet-Refresh-Route": refresh,
                "Link": f'<{refresh}>; rel="xet-auth", '
                        f'<{base}/cas/v2/reconstructions/{index.file_hash}>; rel="xet-reconstruction-info"'}

    def _api_xet_read_token(self, repo_id: str, tail: list[str], params: dict, body: bytes) -> None:
        meta = self._repo(repo_id)
        self._check_auth(gated_file_of=repo_id if meta["gated"] else None)
        if self.server.xet is None:
            raise HubError(404, "this Hub serves no xet (--no-xet)")
        commit = self._commit(repo_id, "/".join(tail) if tail else "main")
        exp = int(time.time()) + self.server.xet_token_ttl
        expired = self.server.faults.take("xet_token_expired", self._req)
        if expired is not None:
            self._faults_applied.append(f"xet_token_expired#{expired.id}")
            exp = int(time.time()) - 1
        token = self.server.xet.signer.token({"repo": repo_id, "commit": commit.id, "exp": exp,
                                              "user": self._user})
        cas = f"{self._base_url()}/cas"
        self._send_json(200, {"accessToken": token, "exp": exp, "casUrl": cas},
                        {"X-Xet-Access-Token": token, "X-Xet-Token-Expiration": exp, "X-Xet-Cas-Url": cas})

    # ------------------------------------------------------------------ xet: the CAS
    def _cas(self, method: str, segs: list[str], params: dict) -> None:
        req = self._req
        if len(segs) == 3 and segs[0] in ("v1", "v2") and segs[1] == "reconstructions":
            req.endpoint = "xet-reconstruction"
            return self._cas_reconstruction(method, int(segs[0][1]), segs[2])
        if len(segs) == 3 and segs[:2] == ["xorbs", "default"]:
            req.endpoint = "xet-xorb"
            return self._cas_xorb(method, segs[2], params)
        if segs == ["v1", "telemetry"]:
            req.endpoint = "xet-telemetry"
            self._pre_faults()
            self._xet_claims(required=True)
            return self._send_json(200, {})
        self._pre_faults()
        raise HubError(404, f"no CAS endpoint {method} {req.path}")

    def _xet_claims(self, *, required: bool) -> dict | None:
        """The claims of the request's xet access token; with `required`, 401 unless valid and unexpired."""
        scheme, _, token = (self.headers.get("Authorization") or "").partition(" ")
        claims = self.server.xet.signer.claims(token.strip()) if scheme.lower() == "bearer" else None
        if claims is not None:
            self._user = claims.get("user")
        if not required:
            return claims
        if claims is None:
            raise HubError(401, "a valid xet access token is needed (Authorization: Bearer <accessToken>)")
        if claims["exp"] <= time.time():
            raise HubError(401, "the xet access token has expired")
        return claims

    def _xet_paths(self, claims: dict | None, sha256: str) -> list[str]:
        """Paths with this content in the token's commit or its history (empty: not this repository's)."""
        if claims is None or self.server.store.repo_meta(claims["repo"]) is None:
            return []
        for commit in self.server.store.history(claims["repo"], claims["commit"]):
            paths = sorted(p for p, f in commit.files.items() if f.sha256 == sha256)
            if paths:
                return paths
        return []

    def _cas_reconstruction(self, method: str, version: int, file_hash: str) -> None:
        xet, req = self.server.xet, self._req
        index = xet.index_by_hash(file_hash)
        claims = self._xet_claims(required=False)
        paths = self._xet_paths(claims, index.sha256) if index is not None else []
        req.repo = claims["repo"] if claims else None
        req.file = paths[0] if paths else None
        self._pre_faults()
        if method != "GET":
            raise HubError(405, f"{method} is not allowed on reconstructions")
        self._xet_claims(required=True)
        if index is None or not paths:
            raise HubError(404, f"no file {file_hash} in the token's repository")
        rng = self.headers.get("Range")
        span = _parse_range(rng, index.size) if rng is not None else None
        if span == "unsatisfiable":
            raise HubError(416, f"Range {rng} not satisfiable for {index.size} bytes")
        first, last = span if span is not None else (0, index.size - 1)

        def xorb_url(xorb: str, byte_first: int, byte_last: int) -> str:
            query = xet.signer.xorb_query(xorb, byte_first, byte_last, req.repo, req.file)
            return f"{self._base_url()}/cas/xorbs/default/{xorb}?{query}"

        self._send_json(200, xet.reconstruction(index, first, last, version, xorb_url))

    def _cas_xorb(self, method: str, xorb: str, params: dict) -> None:
        req = self._req
        req.repo, req.file = params.get("repo", [None])[-1], params.get("file", [None])[-1]
        self._pre_faults()
        if method != "GET":
            raise HubError(405, f"{method} is not allowed on xorbs")
        signed = self.server.xet.signer.check_xorb_query(xorb, params) if is_hash_hex(xorb) else "not a xorb hash"
        if isinstance(signed, str):
            raise HubError(403, f"xorb URL refused: {signed}")
        path = self.server.xet.xorb_path(xorb)
        try:
            total = path.stat().st_size
        except FileNotFoundError:
            raise HubError(404, f"no xorb {xorb}") from None
        rng = self.headers.get("Range")
        span = _parse_range(rng, total) if rng is not None else None
        if not isinstance(span, tuple) or span[0] < signed[0] or span[1] > signed[1]:
            raise HubError(403, f"Range {rng} is not within the URL's signed range {signed[0]}-{signed[1]}")
        start, end = span
        body = self._xet_tampered_range(xorb, start, end)
        if body is None:
            body = Body(path=path, start=start, length=end - start + 1)
        headers = {"Content-Type": "application/octet-stream", "Accept-Ranges": "bytes",
                   "Content-Length": body.length}
        if body.length:
            headers["Content-Range"] = f"bytes {start}-{start + body.length - 1}/{total}"
        self._send(206, headers, body, total=total)

    def _xet_tampered_range(self, xorb: str, start: int, end: int) -> Body | None:
        """The range as the xet faults change it (whole chunks dropped, a chunk's bytes changed), or None."""
        faults, req, xet = self.server.faults, self._req, self.server.xet
        n_chunks = xet.chunks_in_range(xorb, start, end)
        truncate = faults.take("xet_truncated_term", req)
        bad = None if truncate else faults.take("xet_bad_chunk", req, lambda f: f.params["chunk"] < n_chunks)
        if truncate is None and bad is None:
            return None
        with open(xet.xorb_path(xorb), "rb") as f:
            f.seek(start)
            chunks = parse_chunks(f.read(end - start + 1))
        if truncate is not None:
            self._faults_applied.append(f"xet_truncated_term#{truncate.id}")
            kept = chunks[:max(0, len(chunks) - truncate.params["chunks"])]
            return Body(b"".join(c.raw() for c in kept))
        self._faults_applied.append(f"xet_bad_chunk#{bad.id}")
        out = [c.raw() for c in chunks]
        out[bad.params["chunk"]] = chunks[bad.params["chunk"]].corrupted(bad.params["xor"])
        return Body(b"".join(out))

    # ------------------------------------------------------------------ control API
    def _control(self, method: str, raw_path: str, query: str) -> None:
        path = raw_path.rstrip("/")
        if path == "/_lab/health" and method in ("GET", "HEAD"):
            return self._send_json(200, {"ok": True, "pid": os.getpid(), "connections": self.server.active,
                                         "busy": self.server.busy})
        given = self.headers.get("X-Lab-Control") or ""
        try:
            body = self._read_body()
        except HubError as e:
            return self._send_json(e.status, {"error": e.message})
        if not hmac.compare_digest(given.encode(), self.server.control_key.encode()):
            return self._send_json(403, {"error": "the control API needs header X-Lab-Control: <root/control.key>"})
        faults, log = self.server.faults, self.server.log
        if path == "/_lab/faults":
            if method == "GET":
                return self._send_json(200, faults.list())
            if method == "DELETE":
                return self._send_json(200, {"removed": faults.clear()})
            if method == "POST":
                try:
                    fault = faults.add(json.loads(body or b"null"))
                except (FaultError, ValueError) as e:
                    return self._send_json(400, {"error": str(e)})
                return self._send_json(201, fault.to_json())
        if path.startswith("/_lab/faults/") and method == "DELETE":
            try:
                removed = faults.remove(int(path.rsplit("/", 1)[1]))
            except ValueError:
                removed = False
            return self._send_json(200 if removed else 404, {"removed": int(removed)})
        if path == "/_lab/log":
            if method == "GET":
                try:
                    since = int(parse_qs(query).get("since", ["0"])[-1])
                except ValueError:
                    since = 0
                return self._send_json(200, log.list(since))
            if method == "DELETE":
                log.clear()
                return self._send_json(200, {"cleared": True})
        return self._send_json(404, {"error": f"no control endpoint {method} {path}"})


def _parse_range(header: str, size: int):
    """(start, end) inclusive, None to ignore the header (multi-range, not bytes), or "unsatisfiable"."""
    unit, _, spec = header.partition("=")
    if unit.strip().lower() != "bytes" or "," in spec:
        return None
    first, dash, last = spec.strip().partition("-")
    if not dash:
        return None
    try:
        if first == "":
            n = int(last)
            if n <= 0:
                return "unsatisfiable"
            return (max(0, size - n), size - 1) if size else "unsatisfiable"
        start = int(first)
        end = int(last) if last else size - 1
    except ValueError:
        return None
    if start >= size:
        return "unsatisfiable"
    if start < 0 or end < start:
        return None
    return start, min(end, size - 1)


def serve(root: str, host: str, port: int, *, max_threads: int = 128, page_size: int = 1000,
          access_log: bool = False, port_file: str | None = None, grace_s: float = 1.0,
          xet: bool = True, xet_token_ttl: int = 3600) -> int:
    store = Store(root)
    store.root.mkdir(parents=True, exist_ok=True)
    try:
        server = HubHTTPServer((host, port), store, max_threads=max_threads, page_size=page_size,
                               access_log=access_log, xet=xet, xet_token_ttl=xet_token_ttl)
    except OSError as e:
        print(f"hub: cannot listen on {host}:{port}: {e.strerror or e}", file=sys.stderr, flush=True)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True)
    thread.start()
    bound_port = server.server_address[1]
    url = f"http://{host}:{bound_port}"
    if port_file:
        tmp = f"{port_file}.{os.getpid()}.tmp"
        Path(tmp).write_text(str(bound_port))
        os.replace(tmp, port_file)
    print(f"READY {url}", flush=True)
    while not stop.wait(0.5):
        pass
    server.stopping.set()
    server.shutdown()
    server.server_close()
    deadline = time.monotonic() + grace_s
    while server.busy and time.monotonic() < deadline:  # in-flight answers get a short grace
        time.sleep(0.05)
    print("hub: stopped", file=sys.stderr, flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.lab.hub.server", description=__doc__.split("\n")[0])
    ap.add_argument("--root", required=True, help="the store folder (created if missing)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="0 picks a free port (printed on the READY line)")
    ap.add_argument("--port-file", help="write the bound port here once listening")
    ap.add_argument("--max-threads", type=int, default=128, help="connections served at once")
    ap.add_argument("--tree-page-size", type=int, default=1000, help="tree entries per page (Hub: 1000)")
    ap.add_argument("--access-log", action="store_true", help="log every request on stderr")
    ap.add_argument("--no-xet", dest="xet", action="store_false",
                    help="plain LFS only, like a Hub repository not on Xet: no xet headers, token or CAS routes")
    ap.add_argument("--xet-token-ttl", type=int, default=3600, help="seconds a xet access token lives")
    args = ap.parse_args(argv)
    return serve(args.root, args.host, args.port, max_threads=args.max_threads, page_size=args.tree_page_size,
                 access_log=args.access_log, port_file=args.port_file, xet=args.xet,
                 xet_token_ttl=args.xet_token_ttl)


if __name__ == "__main__":
    sys.exit(main())
