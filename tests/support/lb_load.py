"""A bounded load for tests: a closed loop of short streamed completions through a load balancer.

N workers each send one request at a time (a new connection each, so every request is balanced
on its own) until the run has sent ``max_requests``, ``max_seconds`` have passed, or ``stop()``
is called; each request has its own timeout. Both bounds are required: nothing here runs
unbounded. Every request is recorded: start and end (epoch seconds, comparable with the
controller's clock in the lb_pool results), the HTTP status or the exception, the ``model``
field of the response, the chunks received, and whether the stream ended with ``[DONE]``.

    from tests.support.lb_load import LoadRun
    with LoadRun(lab.lb_url, lab.api_key, workers=4, max_requests=500, max_seconds=300) as load:
        lab.playbook(...)                    # a migration behind the load balancer
    summary = load.summary()                 # {"total", "ok", "failed", "models", "failures", ...}
    assert summary["failed"] == 0, summary["failures"]

Or from a shell: ``python -m tests.support.lb_load --url http://10.213.7.1:8400 --api-key-file
/var/lib/modelswap-lab/msl/api_key --workers 4 --max-requests 100 --max-seconds 60``.

Standard library only. A request counts as ok when the status is 200 and the stream ended with
``data: [DONE]``: a stream cut when a server stops mid-answer is a failure, as it is for a
client.
"""
from __future__ import annotations

import argparse
import http.client
import json
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from urllib.parse import urlsplit


@dataclass
class RequestRecord:
    worker: int
    start: float                      # epoch seconds
    end: float = 0.0
    status: int | None = None         # HTTP status; None when no answer came
    error: str | None = None          # the exception, or what was wrong with the answer
    model: str | None = None          # the response's `model` field (the first chunk's)
    chunks: int = 0
    done: bool = False                # the stream ended with data: [DONE]

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.done and self.error is None


@dataclass
class LoadRun:
    """The load, run by threads in the background between start() and stop() (or a with block)."""
    url: str                          # the load balancer's base URL, e.g. http://10.213.7.1:8400
    api_key: str | None
    workers: int
    max_requests: int
    max_seconds: float
    model: str | None = None          # the request's model; None leaves it out (vLLM serves its own)
    max_tokens: int = 8
    prompt: str = "The quick brown fox"
    request_timeout: float = 30.0
    pause: float = 0.0                # seconds a worker waits between its requests (a paced loop)
    records: list = field(default_factory=list, repr=False)

    def __post_init__(self):
        if not (self.workers >= 1 and self.max_requests >= 1 and self.max_seconds > 0):
            raise ValueError("LoadRun needs workers >= 1, max_requests >= 1 and max_seconds > 0 "
                             f"(got {self.workers}, {self.max_requests}, {self.max_seconds})")
        parts = urlsplit(self.url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"LoadRun speaks plain http to a host: {self.url!r}")
        self._host, self._port = parts.hostname, parts.port or 80
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._issued = 0
        self._threads: list[threading.Thread] = []
        self.started = self.stopped = None

    # ------------------------------------------------------------------ running
    def start(self) -> "LoadRun":
        self.started = time.time()
        self._deadline = time.monotonic() + self.max_seconds
        self._threads = [threading.Thread(target=self._worker, args=(i,), daemon=True, name=f"lb-load-{i}")
                         for i in range(self.workers)]
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> "LoadRun":
        """Ask the workers to stop after their current request, and wait for them (bounded by the
        request timeout)."""
        self._stop.set()
        for thread in self._threads:
            thread.join(self.request_timeout + 5)
        self.stopped = time.time()
        return self

    def wait(self) -> "LoadRun":
        """Wait until a bound ends the run by itself (max_requests or max_seconds)."""
        for thread in self._threads:
            thread.join(self.max_seconds + self.request_timeout + 5)
        self.stopped = time.time()
        return self

    def __enter__(self) -> "LoadRun":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _claim(self) -> bool:
        with self._lock:
            if self._stop.is_set() or self._issued >= self.max_requests or time.monotonic() >= self._deadline:
                return False
            self._issued += 1
            return True

    def _worker(self, index: int) -> None:
        while self._claim():
            record = self.request(index)
            with self._lock:
                self.records.append(record)
            if self.pause and self._stop.wait(self.pause):
                break

    def request(self, worker: int = 0) -> RequestRecord:
        """One streamed completion; its record (never raises)."""
        body = {"prompt": self.prompt, "max_tokens": self.max_tokens, "stream": True, "temperature": 0,
                "ignore_eos": True}
        if self.model:
            body["model"] = self.model
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        record = RequestRecord(worker=worker, start=time.time())
        conn = http.client.HTTPConnection(self._host, self._port, timeout=self.request_timeout)
        try:
            conn.request("POST", "/v1/completions", body=json.dumps(body), headers=headers)
            resp = conn.getresponse()
            record.status = resp.status
            if resp.status != 200:
                record.error = f"HTTP {resp.status}: {resp.read(300).decode(errors='replace').strip()}"
                return record
            for raw in resp:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    record.done = True
                    break
                try:
                    chunk = json.loads(data)
                except ValueError:
                    record.error = f"a chunk that is not JSON: {data[:120]}"
                    break
                if "error" in chunk:
                    record.error = f"an error in the stream: {json.dumps(chunk['error'])[:200]}"
                    break
                record.chunks += 1
                record.model = record.model or chunk.get("model")
            if not record.done and record.error is None:
                record.error = "the stream ended before data: [DONE]"
        except (OSError, http.client.HTTPException) as exc:
            record.error = f"{type(exc).__name__}: {exc}"
        finally:
            record.end = time.time()
            conn.close()
        return record

    # ------------------------------------------------------------------ results
    def summary(self, max_failures: int = 10) -> dict:
        """Totals, the models that answered, the first failures (time, status, error)."""
        with self._lock:
            records = sorted(self.records, key=lambda r: r.start)
        failed = [r for r in records if not r.ok]
        models: dict[str, int] = {}
        statuses: dict[str, int] = {}
        for r in records:
            if r.ok:
                models[r.model or "?"] = models.get(r.model or "?", 0) + 1
            key = str(r.status) if r.status is not None else "no answer"
            statuses[key] = statuses.get(key, 0) + 1
        seconds = ((self.stopped or time.time()) - self.started) if self.started else 0.0
        return {
            "total": len(records), "ok": len(records) - len(failed), "failed": len(failed),
            "models": models, "statuses": statuses, "seconds": round(seconds, 1),
            "requests_per_s": round(len(records) / seconds, 2) if seconds else None,
            "first": records[0].start if records else None, "last": records[-1].end if records else None,
            "failures": [{"start": round(r.start, 3), "end": round(r.end, 3), "status": r.status, "error": r.error,
                          "model": r.model} for r in failed[:max_failures]],
        }

    def served_between(self, start: float, end: float) -> dict:
        """{model: ok requests} among the requests that started within [start, end] (epoch s)."""
        out: dict[str, int] = {}
        with self._lock:
            for r in self.records:
                if r.ok and start <= r.start <= end:
                    out[r.model or "?"] = out.get(r.model or "?", 0) + 1
        return out

    def as_dicts(self) -> list[dict]:
        with self._lock:
            return [dict(asdict(r), ok=r.ok) for r in sorted(self.records, key=lambda r: r.start)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
    parser.add_argument("--url", required=True, help="the load balancer's base URL")
    parser.add_argument("--api-key-file", help="a file holding the API key (the lab's: <state dir>/api_key)")
    parser.add_argument("--model", help="the request's model (default: left out)")
    parser.add_argument("--workers", type=int, required=True)
    parser.add_argument("--max-requests", type=int, required=True)
    parser.add_argument("--max-seconds", type=float, required=True)
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args(argv)
    key = open(args.api_key_file, encoding="utf-8").read().strip() if args.api_key_file else None
    run = LoadRun(args.url, key, workers=args.workers, max_requests=args.max_requests,
                  max_seconds=args.max_seconds, model=args.model, max_tokens=args.max_tokens)
    run.start().wait()
    summary = run.summary()
    print(json.dumps(summary, indent=2))
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
