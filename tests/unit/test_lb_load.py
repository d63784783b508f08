"""tests/support/lb_load.py against a local streaming server: the bounds (count, time, stop()), what
each request records (status, model, [DONE], a cut stream, a refused connection), the summary."""
from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.support.lb_load import LoadRun

pytestmark = pytest.mark.unit


class FakeStreamServer:
    """POST /v1/completions streams `chunks` SSE chunks of `model` and [DONE]; `mode` picks a fault."""

    def __init__(self, model="tiny-a", chunks=3, mode="ok", delay=0.0, key="k"):
        self.model, self.chunks, self.mode, self.delay, self.key = model, chunks, mode, delay, key
        self.bodies, self.auth = [], []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_POST(self):
                fake.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                fake.auth.append(self.headers.get("Authorization"))
                if fake.mode == "503":
                    body = b"<html>503 Service Unavailable</html>"
                    self.send_response(503)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                for i in range(fake.chunks):
                    time.sleep(fake.delay)
                    chunk = {"id": "cmpl-1", "object": "text_completion", "model": fake.model,
                             "choices": [{"index": 0, "text": f" w{i}"}]}
                    self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                    self.wfile.flush()
                    if fake.mode == "cut":
                        return           # the connection closes mid-stream
                self.wfile.write(b"data: [DONE]\n\n")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = "http://127.0.0.1:%d" % self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def server():
    made = []

    def make(**kwargs):
        made.append(FakeStreamServer(**kwargs))
        return made[-1]
    yield make
    for s in made:
        s.close()


def test_stops_at_the_request_count_and_records_each_request(server):
    srv = server()
    run = LoadRun(srv.url, "k", workers=3, max_requests=10, max_seconds=30).start().wait()
    summary = run.summary()
    assert summary["total"] == 10 and summary["ok"] == 10 and summary["failed"] == 0
    assert summary["models"] == {"tiny-a": 10} and summary["statuses"] == {"200": 10}
    assert len(srv.bodies) == 10 and set(srv.auth) == {"Bearer k"}
    assert srv.bodies[0] == {"prompt": "The quick brown fox", "max_tokens": 8, "stream": True, "temperature": 0,
                             "ignore_eos": True}                     # no model: the server serves its own
    for rec in run.as_dicts():
        assert rec["ok"] and rec["done"] and rec["chunks"] == 3 and rec["end"] >= rec["start"] > 0


def test_stops_at_the_time_bound(server):
    srv = server(delay=0.05)
    started = time.monotonic()
    run = LoadRun(srv.url, None, workers=2, max_requests=10_000, max_seconds=1.0, model="tiny-a").start().wait()
    assert time.monotonic() - started < 5
    assert 0 < run.summary()["total"] < 10_000 and srv.bodies[0]["model"] == "tiny-a" and srv.auth[0] is None


def test_stop_ends_a_run_early(server):
    srv = server(delay=0.02)
    with LoadRun(srv.url, "k", workers=2, max_requests=10_000, max_seconds=60) as run:
        time.sleep(0.5)
    assert run.summary()["total"] > 0 and run.stopped - run.started < 10


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("mode, status, error", [
    ("503", 503, "HTTP 503: <html>503 Service Unavailable</html>"),
    ("cut", 200, "the stream ended before data: [DONE]"),
    ("refused", None, "ConnectionRefusedError: [Errno 111] Connection refused"),
])
def test_failures_are_recorded(server, mode, status, error):
    url = "http://127.0.0.1:%d" % free_port() if mode == "refused" else server(mode=mode).url
    run = LoadRun(url, "k", workers=1, max_requests=2, max_seconds=10).start().wait()
    summary = run.summary()
    assert summary["total"] == 2 and summary["failed"] == 2 and summary["models"] == {}
    assert [(f["status"], f["error"]) for f in summary["failures"]] == [(status, error)] * 2


def test_models_seen_and_between(server):
    a, b = server(model="tiny-a"), server(model="tiny-b")
    run = LoadRun(a.url, "k", workers=1, max_requests=3, max_seconds=10).start().wait()
    mid = time.time()
    run2 = LoadRun(b.url, "k", workers=1, max_requests=2, max_seconds=10).start().wait()
    run.records.extend(run2.records)
    assert run.summary()["models"] == {"tiny-a": 3, "tiny-b": 2}
    assert run.served_between(mid, time.time()) == {"tiny-b": 2}


@pytest.mark.parametrize("kwargs", [dict(workers=0, max_requests=1, max_seconds=1),
                                    dict(workers=1, max_requests=0, max_seconds=1),
                                    dict(workers=1, max_requests=1, max_seconds=0)])
def test_both_bounds_are_required(kwargs):
    with pytest.raises(ValueError, match="needs workers >= 1, max_requests >= 1 and max_seconds > 0"):
        LoadRun("http://127.0.0.1:1", None, **kwargs)
