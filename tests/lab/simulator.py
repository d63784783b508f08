"""A known-timing, OpenAI-compatible streaming server: the benchmark's ground truth.

It speaks the part of vLLM's HTTP API that the benchmark role uses (`/v1/chat/completions`,
`/v1/completions` with `stream` and `stream_options.include_usage`, `/v1/models`, `/health`,
`/version`, `/metrics` with vLLM's metric names) and generates text on a fixed schedule:

- a request waits for one of `slots` generation slots (FIFO queue beyond them, like a saturated
  vLLM scheduler; `slots=0` means no limit);
- `ttft_ms` after it got its slot it writes the first choice-bearing chunk (for chat: the
  role-only delta and the first content chunk, together, as vLLM does);
- then one content chunk every `chunk_ms`, each carrying `tokens_per_chunk` tokens, until
  `max_tokens` (`max_completion_tokens` for chat) tokens are out (ignore_eos semantics);
- then the usage-only chunk and `data: [DONE]`.

The truth is not the nominal settings but its own record: with `--record FILE` it appends one
JSON line per request when the request ends, with `time.perf_counter()` stamps (CLOCK_MONOTONIC,
shared by every process on the machine) of when the request was received (`recv`), when it got
a slot (`slot`), when each choice-bearing chunk was handed to the kernel (`writes`, with the
tokens each carried in `tokens`), and when it ended (`end`). The request id is the client's
`X-Request-Id` header.

Faults for tests: `--api-key` (401 on /v1 without it, like vLLM), unknown model names (404, with
vLLM's message), `--fail-every N` (every Nth generation request answers 500).

Run: `python -m tests.lab.simulator --port 0 --port-file F --ttft-ms 50 --chunk-ms 20 --slots 8`.
`SimulatorProcess` starts it as a child process for tests and stops it by PID.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

perf = time.perf_counter
MAX_HEADER = 64 * 1024
MAX_BODY = 16 * 1024 * 1024


class Settings:
    def __init__(self, *, model="sim", ttft_ms=50.0, chunk_ms=20.0, tokens_per_chunk=1, slots=0,
                 api_key=None, fail_every=0, max_model_len=8192, default_max_tokens=16):
        self.model = model
        self.ttft = ttft_ms / 1000.0
        self.chunk = chunk_ms / 1000.0
        self.tokens_per_chunk = max(1, int(tokens_per_chunk))
        self.slots = max(0, int(slots))
        self.api_key = api_key
        self.fail_every = max(0, int(fail_every))
        self.max_model_len = max_model_len
        self.default_max_tokens = default_max_tokens


class Stats:
    def __init__(self):
        self.running = 0
        self.waiting = 0
        self.generation_tokens = 0
        self.prompt_tokens = 0
        self.success = 0
        self.aborted = 0
        self.generation_requests = 0


def prompt_tokens_of(body: dict, chat: bool) -> int:
    """A deterministic stand-in for a tokenizer: one token per 4 bytes of prompt text, plus a
    fixed template overhead for chat."""
    if chat:
        text = "".join(str(m.get("content", "")) for m in body.get("messages") or [])
        return max(1, (len(text.encode()) + 3) // 4) + 6
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
        prompt = " ".join(map(str, prompt))
    return max(1, (len(str(prompt).encode()) + 3) // 4)


class Generation:
    """One streaming request: queued, then scheduled chunk by chunk with loop.call_at."""

    __slots__ = ("conn", "server", "rid", "chat", "max_tokens", "prompt_tokens", "recv", "slot",
                 "writes", "tokens", "end", "sent_tokens", "n_chunks", "timer", "content", "first",
                 "finish", "usage", "created", "state", "next_due", "stream")

    def __init__(self, conn, server, rid, chat, max_tokens, prompt_tokens, recv, stream):
        self.conn = conn
        self.server = server
        self.rid = rid
        self.chat = chat
        self.max_tokens = max_tokens
        self.prompt_tokens = prompt_tokens
        self.recv = recv
        self.slot = None
        self.writes = []
        self.tokens = []
        self.end = None
        self.sent_tokens = 0
        self.timer = None
        self.state = "queued"
        self.stream = stream
        self.created = int(time.time())
        k = server.settings.tokens_per_chunk
        self.n_chunks = -(-max_tokens // k)
        oid = ("chatcmpl-" if chat else "cmpl-") + rid.replace("-", "")[:24]
        model = server.settings.model
        # Chunks are prebuilt once per request: the hot path only writes bytes and stamps time.
        if chat:
            head = '{"id":"%s","object":"chat.completion.chunk","created":%d,"model":"%s","choices":[' % (
                oid, self.created, model)
            self.first = sse(head + '{"index":0,"delta":{"role":"assistant","content":""},'
                             '"logprobs":null,"finish_reason":null}]}')
            self.content = {n: sse(head + '{"index":0,"delta":{"content":"%s"},"logprobs":null,'
                                   '"finish_reason":null}]}' % (" tok" * n)) for n in {k, max_tokens % k or k}}
            self.finish = {n: sse(head + '{"index":0,"delta":{"content":"%s"},"logprobs":null,'
                                  '"finish_reason":"length","stop_reason":null}]}' % (" tok" * n))
                           for n in {k, max_tokens % k or k}}
            obj = "chat.completion.chunk"
        else:
            head = '{"id":"%s","object":"text_completion","created":%d,"model":"%s","choices":[' % (
                oid, self.created, model)
            self.first = b""
            self.content = {n: sse(head + '{"index":0,"text":"%s","logprobs":null,"finish_reason":null,'
                                   '"stop_reason":null}]}' % (" tok" * n)) for n in {k, max_tokens % k or k}}
            self.finish = {n: sse(head + '{"index":0,"text":"%s","logprobs":null,"finish_reason":"length",'
                                  '"stop_reason":null}]}' % (" tok" * n)) for n in {k, max_tokens % k or k}}
            obj = "text_completion"
        self.usage = sse('{"id":"%s","object":"%s","created":%d,"model":"%s","choices":[],'
                         '"usage":{"prompt_tokens":%d,"total_tokens":%d,"completion_tokens":%d}}' % (
                             oid, obj, self.created, model, prompt_tokens, prompt_tokens + max_tokens,
                             max_tokens)) + b"data: [DONE]\n\n"

    def start(self, now_loop):
        self.state = "running"
        self.slot = perf()
        self.next_due = now_loop + self.server.settings.ttft
        self.timer = self.server.loop.call_at(self.next_due, self.step)

    def step(self):
        self.timer = None
        conn = self.conn
        if conn.closed:
            return
        if conn.paused:                       # the client is not reading: wait, do not buffer
            conn.resume_cb = self.step
            return
        s = self.server
        k = s.settings.tokens_per_chunk
        remaining = self.max_tokens - self.sent_tokens
        n = k if remaining > k else remaining
        last = n == remaining
        body = (self.finish if last else self.content)[n]
        if not self.writes and self.chat:
            body = self.first + body
        if not self.stream:
            now = perf()
            self._account(now, n, first_chat=not self.writes and self.chat)
            if last:
                self._finish_nonstream(now)
            else:
                self._schedule()
            return
        if last:
            body += self.usage
            conn.transport.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
        else:
            conn.transport.write(b"%x\r\n%s\r\n" % (len(body), body))
        now = perf()
        self._account(now, n, first_chat=not self.writes and self.chat)
        if last:
            self.end = now
            s.finish(self, aborted=False)
            conn.request_done()
        else:
            self._schedule()

    def _account(self, now, n, first_chat):
        if first_chat:                         # the role-only delta carries no token
            self.writes.append(now)
            self.tokens.append(0)
        self.writes.append(now)
        self.tokens.append(n)
        self.sent_tokens += n
        self.server.stats.generation_tokens += n

    def _schedule(self):
        s = self.server
        if s.settings.chunk <= 0:
            self.timer = s.loop.call_soon(self.step)
            return
        self.next_due += s.settings.chunk
        self.timer = s.loop.call_at(self.next_due, self.step)

    def _finish_nonstream(self, now):
        text = " tok" * self.max_tokens
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "finish_reason": "length"}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "finish_reason": "length"}
            obj = "text_completion"
        payload = {"id": "cmpl-" + self.rid, "object": obj, "created": self.created,
                   "model": self.server.settings.model, "choices": [choice],
                   "usage": {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.max_tokens,
                             "total_tokens": self.prompt_tokens + self.max_tokens}}
        self.end = now
        self.server.finish(self, aborted=False)
        self.conn.send_json(200, payload)

    def abort(self):
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.state in ("queued", "running"):
            self.end = perf()
            self.server.finish(self, aborted=True)

    def record(self, aborted):
        return {"id": self.rid, "chat": self.chat, "recv": self.recv, "slot": self.slot,
                "writes": self.writes, "tokens": self.tokens, "end": self.end,
                "prompt_tokens": self.prompt_tokens, "max_tokens": self.max_tokens,
                "aborted": aborted, "stream": self.stream}


def sse(text: str) -> bytes:
    return b"data: " + text.encode() + b"\n\n"


class Connection(asyncio.Protocol):
    def __init__(self, server):
        self.server = server
        self.transport = None
        self.buf = bytearray()
        self.closed = False
        self.paused = False
        self.resume_cb = None
        self.current = None        # the Generation in progress on this connection
        self.keep_alive = True

    def connection_made(self, transport):
        self.transport = transport

    def connection_lost(self, exc):
        self.closed = True
        if self.current is not None:
            self.current.abort()
            self.current = None

    def pause_writing(self):
        self.paused = True

    def resume_writing(self):
        self.paused = False
        cb, self.resume_cb = self.resume_cb, None
        if cb is not None:
            cb()

    def data_received(self, data):
        self.buf += data
        if len(self.buf) > MAX_HEADER + MAX_BODY:
            self.transport.close()
            return
        self.process()

    def process(self):
        while self.current is None and not self.closed:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buf) > MAX_HEADER:
                    self.transport.close()
                return
            head = bytes(self.buf[:end]).decode("latin-1")
            lines = head.split("\r\n")
            try:
                method, target, version = lines[0].split(" ", 2)
            except ValueError:
                self.transport.close()
                return
            headers = {}
            for line in lines[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            length = int(headers.get("content-length") or 0)
            if len(self.buf) < end + 4 + length:
                return
            body = bytes(self.buf[end + 4:end + 4 + length])
            del self.buf[:end + 4 + length]
            self.keep_alive = headers.get("connection", "").lower() != "close" and version == "HTTP/1.1"
            self.server.handle(self, method, target.split("?", 1)[0], headers, body, perf())

    def request_done(self):
        self.current = None
        if not self.keep_alive:
            self.transport.close()
        elif self.buf:
            self.process()

    def send(self, status, body: bytes, content_type="application/json"):
        reason = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found",
                  405: "Method Not Allowed", 500: "Internal Server Error"}.get(status, "Error")
        self.transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n%s\r\n%s" % (
                status, reason.encode(), content_type.encode(), len(body),
                b"" if self.keep_alive else b"connection: close\r\n", body))
        self.request_done()

    def send_json(self, status, payload):
        self.send(status, json.dumps(payload).encode())

    def start_stream(self):
        self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
                             b"transfer-encoding: chunked\r\n\r\n")


class Server:
    def __init__(self, settings: Settings, record_path: str | None):
        self.settings = settings
        self.stats = Stats()
        self.queue = collections.deque()
        self.loop = None
        self.record_fh = open(record_path, "a", buffering=1 << 16) if record_path else None
        self.counter = 0

    # --- routes -------------------------------------------------------------------------------
    def handle(self, conn, method, path, headers, body, recv):
        s = self.settings
        if path == "/health":
            return conn.send(200, b"", "text/plain")
        if path == "/version":
            return conn.send_json(200, {"version": "0.0.0+simulator"})
        if path == "/metrics":
            return conn.send(200, self.metrics().encode(), "text/plain; version=0.0.4")
        if path.startswith("/v1/"):
            if s.api_key and headers.get("authorization") != f"Bearer {s.api_key}":
                return conn.send_json(401, {"error": "Unauthorized"})
            if path == "/v1/models":
                return conn.send_json(200, {"object": "list", "data": [
                    {"id": s.model, "object": "model", "created": 0, "owned_by": "simulator",
                     "root": f"/models/{s.model}", "parent": None, "max_model_len": s.max_model_len}]})
            if path in ("/v1/chat/completions", "/v1/completions"):
                if method != "POST":
                    return conn.send_json(405, {"error": {"message": "Method Not Allowed"}})
                return self.generate(conn, path == "/v1/chat/completions", headers, body, recv)
        return conn.send_json(404, {"detail": "Not Found"})

    def generate(self, conn, chat, headers, body, recv):
        s = self.settings
        try:
            req = json.loads(body or b"{}")
        except ValueError:
            return conn.send_json(400, {"error": {"message": "invalid JSON body", "type": "BadRequestError",
                                                  "code": 400}})
        model = req.get("model")
        if model != s.model:
            return conn.send_json(404, {"error": {
                "message": f"The model `{model}` does not exist.", "type": "NotFoundError",
                "param": "model", "code": 404}})
        self.counter += 1
        if s.fail_every and self.counter % s.fail_every == 0:
            return conn.send_json(500, {"error": {"message": "injected failure", "type": "InternalServerError",
                                                  "code": 500}})
        max_tokens = req.get("max_completion_tokens") if chat else None
        max_tokens = int(max_tokens or req.get("max_tokens") or s.default_max_tokens)
        if max_tokens < 1:
            return conn.send_json(400, {"error": {"message": "max_tokens must be at least 1",
                                                  "type": "BadRequestError", "code": 400}})
        stream = bool(req.get("stream"))
        rid = headers.get("x-request-id") or uuid.uuid4().hex
        ptoks = prompt_tokens_of(req, chat)
        gen = Generation(conn, self, rid, chat, max_tokens, ptoks, recv, stream)
        self.stats.prompt_tokens += ptoks
        self.stats.generation_requests += 1
        conn.current = gen
        if stream:
            conn.start_stream()
        if s.slots and self.stats.running >= s.slots:
            self.queue.append(gen)
            self.stats.waiting += 1
        else:
            self.stats.running += 1
            gen.start(self.loop.time())

    def finish(self, gen, aborted):
        st = self.stats
        if aborted:
            st.aborted += 1
        else:
            st.success += 1
        if gen.state == "running":
            st.running -= 1
            if self.queue:                     # hand the slot to the next queued request
                nxt = self.queue.popleft()
                st.waiting -= 1
                st.running += 1
                nxt.start(self.loop.time())
        elif gen.state == "queued":            # a client gave up while queued
            self.queue.remove(gen)
            st.waiting -= 1
        gen.state = "aborted" if aborted else "done"
        self._record(gen, aborted)

    def _record(self, gen, aborted):
        if self.record_fh is not None:
            self.record_fh.write(json.dumps(gen.record(aborted), separators=(",", ":")) + "\n")

    def metrics(self) -> str:
        s, st = self.settings, self.stats
        labels = f'engine="0",model_name="{s.model}"'
        kv = (st.running / s.slots) if s.slots else 0.0
        return "\n".join([
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{labels}}} {float(st.running)}",
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{labels}}} {float(st.waiting)}",
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{{{labels}}} {kv}",
            "# HELP vllm:generation_tokens_total Number of generation tokens processed.",
            "# TYPE vllm:generation_tokens_total counter",
            f"vllm:generation_tokens_total{{{labels}}} {float(st.generation_tokens)}",
            "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.",
            "# TYPE vllm:prompt_tokens_total counter",
            f"vllm:prompt_tokens_total{{{labels}}} {float(st.prompt_tokens)}",
            "# HELP vllm:request_success_total Count of successfully processed requests.",
            "# TYPE vllm:request_success_total counter",
            f'vllm:request_success_total{{{labels},finished_reason="length"}} {float(st.success)}',
            "# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.",
            "# TYPE vllm:prefix_cache_queries_total counter",
            f"vllm:prefix_cache_queries_total{{{labels}}} {float(st.prompt_tokens)}",
            "# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.",
            "# TYPE vllm:prefix_cache_hits_total counter",
            f"vllm:prefix_cache_hits_total{{{labels}}} 0.0",
            ""])

    async def serve(self, host, port, port_file=None):
        self.loop = asyncio.get_running_loop()
        srv = await self.loop.create_server(lambda: Connection(self), host, port, backlog=4096,
                                            reuse_address=True)
        actual = srv.sockets[0].getsockname()[1]
        if port_file:
            tmp = f"{port_file}.tmp"
            Path(tmp).write_text(str(actual))
            os.replace(tmp, port_file)
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.loop.add_signal_handler(sig, stop.set)
        async with srv:
            await stop.wait()
        if self.record_fh is not None:
            self.record_fh.flush()
            self.record_fh.close()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--port-file", help="write the bound port here once listening")
    p.add_argument("--model", default="sim")
    # vLLM's flag: the name clients ask for, where --model is the weights' path (a stand-in's
    # command line then names the path as vLLM's does, which is what a host's read compares)
    p.add_argument("--served-model-name", help="the model's name in the API (default: --model)")
    p.add_argument("--ttft-ms", type=float, default=50.0)
    p.add_argument("--chunk-ms", type=float, default=20.0)
    p.add_argument("--tokens-per-chunk", type=int, default=1)
    p.add_argument("--slots", type=int, default=0, help="concurrent generations (0: unlimited)")
    p.add_argument("--api-key", default=os.environ.get("SIM_API_KEY"))
    p.add_argument("--fail-every", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--record", help="append one JSON line per request (the timing truth)")
    p.add_argument("--max-seconds", type=float, default=3600.0,
                   help="exit by itself after this long (a bound for stray runs)")
    a = p.parse_args(argv)
    settings = Settings(model=a.served_model_name or a.model, ttft_ms=a.ttft_ms, chunk_ms=a.chunk_ms,
                        tokens_per_chunk=a.tokens_per_chunk, slots=a.slots, api_key=a.api_key,
                        fail_every=a.fail_every, max_model_len=a.max_model_len)
    server = Server(settings, a.record)
    signal.signal(signal.SIGALRM, lambda *_: os.kill(os.getpid(), signal.SIGTERM))
    signal.setitimer(signal.ITIMER_REAL, a.max_seconds)
    asyncio.run(server.serve(a.host, a.port, a.port_file))


# --- test helper ---------------------------------------------------------------------------------
def set_priority(nice):
    """nice < 0: a higher share of the CPU; nice == 'rt': SCHED_RR priority 1 (root only), so other
    processes on the shared machine cannot preempt a timing measurement for a whole time slice."""
    if nice == "rt":
        try:
            os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(1))
        except (OSError, AttributeError):
            pass
    elif nice:
        try:
            os.nice(int(nice))
        except OSError:
            pass


class SimulatorProcess:
    """Start the simulator as a child process (optionally pinned to CPUs), stop it by PID.

    >>> with SimulatorProcess(tmp, ttft_ms=50, chunk_ms=20, slots=8) as sim:
    ...     sim.url, sim.records()
    """

    def __init__(self, workdir, *, cpus=None, nice=0, max_seconds=900, **settings):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.settings = settings
        self.cpus = cpus
        self.nice = nice
        self.max_seconds = max_seconds
        self.record_path = self.workdir / "sim-records.jsonl"
        self.port_file = self.workdir / "sim.port"
        self.proc = None
        self.port = None

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout=20.0):
        argv = [sys.executable, "-m", "tests.lab.simulator", "--port", "0", "--port-file",
                str(self.port_file), "--record", str(self.record_path),
                "--max-seconds", str(self.max_seconds)]
        for key, value in self.settings.items():
            if value is not None:
                argv += [f"--{key.replace('_', '-')}", str(value)]
        cpus, nice = self.cpus, self.nice

        def pin():
            if cpus is not None:
                os.sched_setaffinity(0, cpus)
            set_priority(nice)

        repo = Path(__file__).resolve().parents[2]
        self.port_file.unlink(missing_ok=True)
        self.proc = subprocess.Popen(argv, cwd=repo, preexec_fn=pin, stdout=subprocess.DEVNULL,
                                     stderr=open(self.workdir / "sim.log", "ab"))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.port_file.exists():
                self.port = int(self.port_file.read_text())
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"simulator exited with {self.proc.returncode}: "
                                   f"{(self.workdir / 'sim.log').read_text()[-2000:]}")
            time.sleep(0.05)
        self.stop()
        raise RuntimeError("simulator did not start listening in time")

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)

    def records(self) -> list[dict]:
        if not self.record_path.exists():
            return []
        with open(self.record_path) as fh:
            return [json.loads(line) for line in fh if line.strip()]

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


if __name__ == "__main__":
    main()
