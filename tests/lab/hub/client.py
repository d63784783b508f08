"""Control client of a running lab Hub: publish through its store, faults and log over HTTP."""
from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Mapping

from tests.lab.hub.store import Store

# the control API is on the lab's own addresses: never send it through a proxy from the environment
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class HubControlError(RuntimeError):
    pass


class HubClient:
    """`HubClient(url, root)`: the Hub listening at `url`, serving the store at `root` (same machine).

    publish() writes the store directly (the server picks changes up on the next request);
    fault()/clear_faults()/requests()/clear_log() talk to the server's /_lab control API.
    """

    def __init__(self, url: str, root: str | os.PathLike, *, timeout: float = 10.0):
        self.url = url.rstrip("/")
        self.root = Path(root)
        self.store = Store(self.root)
        self.timeout = timeout

    def __repr__(self) -> str:
        return f"HubClient({self.url!r}, {str(self.root)!r})"

    # ------------------------------------------------------------------ content
    def publish(self, repo_id: str, files: Mapping[str, bytes] | str | os.PathLike, *,
                gated: bool | None = None, branch: str = "main", tag: str | None = None,
                message: str | None = None) -> str:
        """Publish `files` ({path: bytes} or a folder) as the head of `branch`; return the commit (40-hex).

        Unchanged files give the same commit; `gated=None` keeps the repository's setting.
        """
        return self.store.publish(repo_id, files, gated=gated, branch=branch, tag=tag, message=message)

    def tag(self, repo_id: str, tag: str, revision: str = "main") -> str:
        return self.store.tag(repo_id, tag, revision)

    def set_gated(self, repo_id: str, gated: bool = True) -> None:
        self.store.set_gated(repo_id, gated)

    def resolve(self, repo_id: str, revision: str = "main") -> str | None:
        return self.store.resolve(repo_id, revision)

    @property
    def token(self) -> str:
        """A token valid for gated repositories (created in the store on first use)."""
        return self.store.ensure_token()

    # ------------------------------------------------------------------ control API
    def _call(self, method: str, path: str, payload=None):
        key = self.store.control_key()
        if key is None:
            raise HubControlError(f"no control key in {self.root}: is the Hub serving this store?")
        data = json.dumps(payload).encode() if payload is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"X-Lab-Control": key, "Content-Type": "application/json"})
        try:
            with _OPENER.open(req, timeout=self.timeout) as resp:
                return json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")
            raise HubControlError(f"{method} {path} on the lab Hub failed: HTTP {e.code}: {detail}") from None

    def health(self) -> dict:
        req = urllib.request.Request(self.url + "/_lab/health")
        with _OPENER.open(req, timeout=self.timeout) as resp:
            return json.loads(resp.read())

    def wait_ready(self, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.health()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def settled(self, timeout: float = 5.0) -> "HubClient":
        """This client once every answer in flight is logged (a request is logged just after its
        last byte, so a client can be done before the log has it); /_lab/health counts itself as busy."""
        deadline = time.monotonic() + timeout
        while self.health()["busy"] > 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        return self

    def fault(self, kind: str, **params) -> dict:
        """Inject a fault (see tests.lab.hub.faults); returns it with its id. `count` defaults to 1."""
        return self._call("POST", "/_lab/faults", {"kind": kind, **params})

    def faults(self) -> list[dict]:
        return self._call("GET", "/_lab/faults")

    def remove_fault(self, fault_id: int) -> None:
        self._call("DELETE", f"/_lab/faults/{int(fault_id)}")

    def clear_faults(self) -> None:
        self._call("DELETE", "/_lab/faults")

    def requests(self, since: int = 0, **match) -> list[dict]:
        """Logged requests, oldest first; `match` keeps those whose fields equal the given values
        (e.g. `method="GET", endpoint="resolve"`)."""
        entries = self._call("GET", f"/_lab/log?since={int(since)}")
        return [e for e in entries if all(e.get(k) == v for k, v in match.items())]

    def payload_downloads(self, repo: str, file: str, since: int = 0) -> list[dict]:
        """The requests that started a download of `file`'s bytes, by either path: a GET of its
        resolve route (plain HTTP) or of its Xet reconstruction (the xorb ranges that follow are
        parts of that one download)."""
        return [e for e in self.requests(since, repo=repo, file=file)
                if e["method"] == "GET" and e.get("endpoint") in ("resolve", "xet-reconstruction")]

    def clear_log(self) -> None:
        self._call("DELETE", "/_lab/log")
