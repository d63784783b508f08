# modelswap benchmark: Locust at a rising concurrency ladder against an OpenAI-compatible server.
#
# Run by the modelswap.vllm benchmark role (module benchmark_run); standalone use:
#   MODELSWAP_BENCH_CONFIG=run/config.json locust -f locustfile.py --headless
# The config (JSON) is written by benchmark_run; the API key comes from MODELSWAP_BENCH_API_KEY.
#
# Why it is written this way (see the role's README):
# - Streams are read one SSE line at a time with geventhttpclient's response.readline (the HTTP
#   stack of Locust's FastHttpUser). FastHttpSession.iter_lines/iter_content read fixed 1 KB
#   blocks and bunch events (+150 ms TTFT measured); readline returns each event as it arrives.
# - Every request is a raw record (JSONL, one file per load process): send time, the arrival of
#   every choice-bearing chunk, usage, finish reason, HTTP status, error. The report computes
#   vLLM's metrics from these exactly; Locust's own rounded aggregates are not used.
# - One Locust run walks the whole ladder through a LoadTestShape, so Locust's distributed mode
#   (--processes, or --master/--worker across hosts) works unchanged. Per step: ramp, warm-up
#   (discarded), measured window, drain (the load is held until every measured request has
#   finished, so the last measured requests see the same concurrency as the first). The master
#   tells workers the phase with a custom message; workers label each request with the phase it
#   was sent in and report progress back, so the window's start and end are each worker's own
#   clock readings (no cross-host clock sync needed).
# - Closed loop without wait time: `--max-concurrency C` of `vllm bench serve` == C users here.
# - Rate mode (open loop): one user per load process sends each request at a scheduled time, the
#   gaps from a seeded gamma process (rate_ladder.interarrival, `vllm bench serve --request-rate R
#   --burstiness B`), each request in a greenlet of its own; a request records when it was due, so
#   the report sees how late the client sent it (dispatch delay). With a search, the master picks
#   each next rate from the steps' SLO verdicts (rate_ladder.next_rate). Between two rates nothing
#   is sent until every request has ended ("rest"): a rate past the server's leaves a queue that
#   would otherwise be measured at the next one.
from __future__ import annotations

import gc
import json
import os
import random
import resource
import socket
import time
import uuid
from urllib.parse import urlsplit

import gevent
from geventhttpclient import HTTPClient
from gevent.lock import BoundedSemaphore
from locust import LoadTestShape, User, constant, events, task
from locust.runners import MasterRunner, WorkerRunner
# Shipped beside this file (the collection's plugins/module_utils/serving/vllm_metrics.py): the probe reads
# /metrics with the same rules.
from vllm_metrics import parse_metrics
# Shipped beside this file too (the collection's plugins/module_utils/bench/rate_ladder.py).
from rate_ladder import count_over, interarrival, judge_counts, next_rate

perf = time.perf_counter
SCHEMA = 1
FAST_CHOICE = b'"choices":[{'
FAST_NOT_FINISHED = b'"finish_reason":null'

CONFIG = None       # dict, loaded at init
STATE = None        # the load process's state (workers and local runner)
MASTER = None       # the master's state (master and local runner)


def load_config():
    path = os.environ.get("MODELSWAP_BENCH_CONFIG")
    if not path:
        raise SystemExit("MODELSWAP_BENCH_CONFIG is not set: it must name the benchmark's config JSON")
    with open(path, encoding="utf-8") as fh:
        cfg = json.load(fh)
    if cfg.get("schema") != SCHEMA:
        raise SystemExit(f"config schema {cfg.get('schema')} is not {SCHEMA}: role and locustfile differ")
    # a remote load generator keeps its copies of the prompts and its records elsewhere
    if os.environ.get("MODELSWAP_BENCH_OUT"):
        cfg["out_dir"] = os.environ["MODELSWAP_BENCH_OUT"]
    if os.environ.get("MODELSWAP_BENCH_PROMPTS"):
        cfg["prompt_source"] = os.environ["MODELSWAP_BENCH_PROMPTS"]
    cfg["api_key"] = read_api_key(os.environ)
    return cfg


def read_api_key(environ):
    """The server's API key: from the 0600 file MODELSWAP_BENCH_API_KEY_FILE names (remote workers:
    the key never enters a process's environment or an Ansible log), else from
    MODELSWAP_BENCH_API_KEY (the load host's own run); None when neither is set."""
    path = environ.get("MODELSWAP_BENCH_API_KEY_FILE")
    if not path:
        return environ.get("MODELSWAP_BENCH_API_KEY") or None
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise SystemExit(f"cannot read the API key file {path} (MODELSWAP_BENCH_API_KEY_FILE): "
                         f"{exc.strerror}") from None
    with os.fdopen(fd, encoding="utf-8") as fh:
        mode = os.fstat(fh.fileno()).st_mode
        if mode & 0o077:
            raise SystemExit(f"the API key file {path} is readable by others (mode {mode & 0o777:04o}): "
                             "it must be 0600, owned by the user Locust runs as")
        return fh.read().strip() or None


class Prompts:
    """Natural-text prompts of about `input_tokens` tokens, each with a unique nonce first.

    Text source: words of a prose file, a window starting at a random word (wrapping around), sized
    with the words-per-token ratio the probe measured on the server's own tokenizer; or the lines of
    a user's JSONL ({"prompt": str} or {"messages": [...]}). The nonce goes first so no two requests
    share a prefix-cache block.

    Workloads of the prose: `fixed` (every prompt and answer its set length), `random` (each length
    drawn uniformly within ± `range_ratio` of it, `vllm bench serve --random-range-ratio`), and
    `shared_prefix` (the same `prefix_tokens` of prose first in every prompt, the same for every
    load process, then the nonce and the rest: what prefix caching serves from its cache).
    """

    def __init__(self, cfg, seed):
        self.rng = random.Random(seed)
        self.fmt = cfg.get("prompt_format", "text")
        self.workload = cfg.get("workload") or "fixed"
        self.range_ratio = float(cfg.get("range_ratio") or 0.0)
        self.output_tokens = int(cfg["output_tokens"])
        with open(cfg["prompt_source"], encoding="utf-8") as fh:
            if self.fmt == "jsonl":
                self.items = [json.loads(line) for line in fh if line.strip()]
            else:
                self.words = fh.read().split()
        wpt = float(cfg.get("words_per_token", 0.75))
        budget = max(1, cfg["input_tokens"] - int(cfg.get("prompt_overhead_tokens", 0)))
        self.prefix = ""
        if self.workload == "shared_prefix" and self.fmt != "jsonl":
            n_prefix = max(1, int(round(int(cfg.get("prefix_tokens") or 0) * wpt)))
            start = random.Random(f"{cfg.get('seed', 0)}:prefix").randrange(len(self.words))
            self.prefix = " ".join(self._window(start, n_prefix)) + " "
            budget = max(1, budget - int(cfg.get("prefix_tokens") or 0))
        self.n_words = max(1, int(round(budget * wpt)))

    def _window(self, start, n):
        words = self.words
        picked = words[start:start + n]
        while len(picked) < n:
            picked += words[:n - len(picked)]
        return picked

    def _ranged(self, n):
        if self.workload != "random" or self.range_ratio <= 0:
            return n
        return max(1, int(round(n * self.rng.uniform(1.0 - self.range_ratio, 1.0 + self.range_ratio))))

    def output_length(self):
        """This request's output tokens (max_tokens)."""
        return self._ranged(self.output_tokens)

    def next(self, nonce):
        if self.fmt == "jsonl":
            item = self.items[self.rng.randrange(len(self.items))]
            if "messages" in item:
                msgs = [dict(m) for m in item["messages"]]
                for m in msgs:
                    if m.get("role") == "user":
                        m["content"] = f"[{nonce}] {m.get('content', '')}"
                        break
                return msgs, None
            return None, f"[{nonce}] {item['prompt']}"
        picked = self._window(self.rng.randrange(len(self.words)), self._ranged(self.n_words))
        return None, f"{self.prefix}[{nonce}] " + " ".join(picked)


class LoadState:
    """Phase, counters and the raw record file of one load process."""

    def __init__(self, cfg, wid):
        self.cfg = cfg
        self.wid = wid
        self.step = -1
        self.phase = "idle"
        self.users = 0
        self.rate = 0.0          # rate mode: this process's share of the step's rate (req/s)
        self.inflight = 0
        self.sent = {}
        self.done = {}
        self.err = {}
        self.good = {}
        os.makedirs(cfg["out_dir"], exist_ok=True)
        self.fh = open(os.path.join(cfg["out_dir"], f"worker-{wid}.jsonl"), "a", buffering=1 << 20)
        self.prompts = Prompts(cfg, seed=hash((cfg.get("seed", 0), wid)) & 0xFFFFFFFF)
        url = urlsplit(cfg["target"])
        self.host, self.port, self.ssl = url.hostname, url.port, url.scheme == "https"
        self.path = "/v1/chat/completions" if cfg["api"] == "chat" else "/v1/completions"
        self.headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if cfg.get("api_key"):
            self.headers["Authorization"] = f"Bearer {cfg['api_key']}"
        slo = cfg.get("slo") or {}
        self.slo = (slo.get("ttft_ms"), slo.get("tpot_ms"), slo.get("e2el_ms"))
        # rate mode: the SLO's p99 limits, counted per step for the master's search
        self.limits = cfg.get("limits") or {}
        self.over = {}
        cap = int(cfg.get("max_inflight") or 0)
        self.cap = BoundedSemaphore(cap) if cfg.get("mode") == "rate" and cap > 0 else None

    def write(self, rec):
        self.fh.write(json.dumps(rec, separators=(",", ":")) + "\n")

    def set_phase(self, step, phase, users, rate=None):
        self.step, self.phase, self.users = step, phase, users
        if rate is not None:
            self.rate = rate
        self.write({"k": "phase", "w": self.wid, "s": step, "p": phase, "t": perf(), "wall": time.time(),
                    "users": users, "rate": rate})
        if phase in ("drain", "end"):
            self.fh.flush()

    def progress(self):
        s = self.step
        return {"w": self.wid, "s": s, "p": self.phase, "sent": self.sent.get(s, 0),
                "done": self.done.get(s, 0), "err": self.err.get(s, 0), "good": self.good.get(s, 0),
                "inflight": self.inflight, "over": self.over.get(s, {})}

    def count_over(self, step, ttft, e2el, gaps):
        """Rate mode: a completed measured request against the SLO's p99 limits (judge_counts)."""
        if not self.limits:
            return
        c = self.over.setdefault(step, {"ok": 0, "ttft_over": 0, "e2el_over": 0, "itl_over": 0, "itl_n": 0})
        c["ok"] += 1
        for key, values in (("ttft", (ttft,)), ("e2el", (e2el,)), ("itl", gaps)):
            limit = self.limits.get(f"{key}_p99_ms")
            if limit is not None:
                c[f"{key}_over"] += count_over((v * 1000.0 for v in values), limit)
        c["itl_n"] += len(gaps)

    def is_good(self, ttft, tpot, e2el):
        for limit, value in zip(self.slo, (ttft, tpot, e2el)):
            if limit is not None and value is not None and value * 1000.0 > limit:
                return False
        return True


class MasterState:
    """The ladder's clock (master or local runner): phases, progress from workers, /metrics."""

    def __init__(self, cfg):
        self.cfg = cfg
        os.makedirs(cfg["out_dir"], exist_ok=True)
        self.fh = open(os.path.join(cfg["out_dir"], "master.jsonl"), "a", buffering=1 << 16)
        self.progress = {}
        self.step = -1
        self.phase = "idle"
        self.metrics = None
        if cfg.get("metrics_url"):
            u = urlsplit(cfg["metrics_url"])
            self.metrics = (HTTPClient(u.hostname, u.port, ssl=u.scheme == "https",
                                       insecure=not cfg.get("validate_certs", True),
                                       connection_timeout=5, network_timeout=5), u.path or "/metrics")

    def write(self, rec):
        self.fh.write(json.dumps(rec, separators=(",", ":")) + "\n")
        self.fh.flush()

    def sample_server(self):
        if self.metrics is None:
            return
        client, path = self.metrics
        rec = {"k": "srv", "t": perf(), "wall": time.time(), "s": self.step, "p": self.phase}
        try:
            with gevent.Timeout(5):
                resp = client.get(path)
                text = resp.read().decode("utf-8", "replace")
            if resp.status_code != 200:
                raise ValueError(f"HTTP {resp.status_code}")
            rec.update(server_sample(text, self.cfg.get("served_model_name") or self.cfg["model"]))
            rec["ok"] = True
        except (Exception, gevent.Timeout) as exc:   # noqa: BLE001 - a sample may fail; say so
            rec.update(ok=False, err=f"{type(exc).__name__}: {exc}"[:200])
            client.close()
        self.fh.write(json.dumps(rec, separators=(",", ":")) + "\n")


METRIC_KEYS = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv",
    "vllm:gpu_cache_usage_perc": "kv",          # vLLM < 0.10
    "vllm:generation_tokens_total": "gen",
    "vllm:prompt_tokens_total": "prompt",
    "vllm:prefix_cache_queries_total": "pfx_q",
    "vllm:prefix_cache_hits_total": "pfx_h",
    "vllm:request_success_total": "ok_total",
}


def server_sample(text, model):
    """The served model's gauges and counters, by the short keys of a raw record."""
    values, _unused = parse_metrics(text, model)
    out = {}
    for name, value in values.items():
        key = METRIC_KEYS.get(name)
        if key is not None:
            out[key] = out.get(key, 0.0) + value
    return out


# --- the users: one closed-loop stream each ---------------------------------------------------------
class LLMUser(User):
    wait_time = constant(0)
    host = "http://modelswap.invalid"   # the target comes from the config

    def on_start(self):
        self.http = self._client()
        self.idle = []                 # rate mode: connections of finished requests, for the next ones

    def on_stop(self):
        self.http.close()
        for http in self.idle:
            http.close()

    def _client(self):
        s = STATE
        timeout = float(CONFIG["request_timeout_s"])
        return HTTPClient(s.host, s.port, ssl=s.ssl, insecure=not CONFIG.get("validate_certs", True), concurrency=1,
                          connection_timeout=min(timeout, 30.0), network_timeout=timeout)

    @task
    def generate(self):
        s = STATE
        if s.phase in ("idle", "end"):
            gevent.sleep(0.05)
            return
        if CONFIG.get("mode") == "rate":
            self._dispatch()
        else:
            self.http = self._request(self.http)

    def _dispatch(self):
        """Rate mode: send requests at this process's share of the step's rate, on a seeded
        schedule that starts again with each step, each in its own greenlet, until the run ends."""
        s, cfg = STATE, CONFIG
        # a worker learns its index from the master's ack, after init and before its users start
        index = max(0, getattr(self.environment.runner, "worker_index", 0))
        rng = random.Random(f"{cfg.get('seed', 0)}:{index}:arrivals")
        step, due = None, 0.0
        while s.phase not in ("idle", "end"):
            if s.phase == "rest" or s.rate <= 0:      # between steps: nothing is sent
                step = None
                gevent.sleep(0.02)
                continue
            if s.step != step:
                step, due = s.step, perf()
            due += interarrival(rng, s.rate, float(cfg.get("burstiness") or 1.0))
            ahead = due - perf()
            if ahead > 0:
                gevent.sleep(ahead)
            if s.step == step and s.phase not in ("idle", "end", "rest"):
                gevent.spawn(self._scheduled, due)

    def _scheduled(self, due):
        s = STATE
        waited = 0.0
        if s.cap is not None:           # the in-flight cap: a request waits for a free place
            t = perf()
            s.cap.acquire()
            waited = perf() - t
        http = self.idle.pop() if self.idle else self._client()
        try:
            http = self._request(http, due=due, waited=waited)
            self.idle.append(http)
        finally:
            if s.cap is not None:
                s.cap.release()

    def _request(self, http, due=None, waited=0.0):
        """One streamed request on ``http``; returns the connection to use next (a new one after a
        failure). ``due``: rate mode's scheduled send time; ``waited``: its time at the cap."""
        s, cfg = STATE, CONFIG
        rid = uuid.uuid4().hex
        messages, prompt = s.prompts.next(rid[:12])
        out_tokens = s.prompts.output_length()
        if cfg["api"] == "chat":
            payload = {"model": cfg["model"], "messages": messages or [{"role": "user", "content": prompt}],
                       "max_completion_tokens": out_tokens}
        else:
            payload = {"model": cfg["model"], "prompt": prompt, "max_tokens": out_tokens}
        payload.update(stream=True, stream_options={"include_usage": True})
        if cfg.get("ignore_eos", True):
            payload["ignore_eos"] = True
        payload.update(cfg.get("extra_body") or {})
        body = json.dumps(payload).encode()
        headers = dict(s.headers, **{"X-Request-Id": rid})
        step, phase = s.step, s.phase
        measured = phase == "measure"
        if measured:
            s.sent[step] = s.sent.get(step, 0) + 1
        s.inflight += 1
        chunks = []
        usage = finish = err = msg = None
        status = 0
        done = role_first = False
        nbytes = 0
        wall = time.time()
        st = perf()                                   # vLLM: monotonic clock just before the POST
        try:
            with gevent.Timeout(float(cfg["request_timeout_s"])):
                resp = http.request("POST", s.path, body=body, headers=headers)
                status = resp.status_code
                if status != 200:
                    text = resp.read()
                    nbytes = len(text)
                    err, msg = f"http_{status}", error_message(text)
                else:
                    readline = resp.readline
                    while True:
                        line = readline(b"\n")
                        if not line:
                            break
                        nbytes += len(line)
                        if not line.startswith(b"data:"):
                            continue                  # blank separators, SSE comments (pings)
                        now = perf()
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            done = True
                            continue
                        if chunks and FAST_CHOICE in data and FAST_NOT_FINISHED in data:
                            # A plain token chunk after the first: non-empty choices, no finish
                            # reason (neither text can occur inside a JSON string, where quotes
                            # are escaped). Skipping its JSON parse keeps the per-chunk cost low;
                            # any other shape (spaces, usage, errors) takes the full parse below.
                            chunks.append(now)
                            continue
                        obj = json.loads(data)
                        choices = obj.get("choices")
                        if choices:
                            if not chunks:
                                delta = choices[0].get("delta")
                                role_first = bool(delta is not None and "role" in delta
                                                  and not delta.get("content"))
                            chunks.append(now)
                            fr = choices[0].get("finish_reason")
                            if fr:
                                finish = fr
                        elif obj.get("usage"):
                            u = obj["usage"]
                            usage = [u.get("prompt_tokens"), u.get("completion_tokens")]
                        elif "error" in obj:
                            err, msg = "stream_error", str(obj["error"])[:200]
                    if err is None and not chunks:
                        err, msg = "no_choice_chunk", "the stream carried no choice-bearing chunk"
        except gevent.Timeout:
            err, msg = "timeout", f"no complete answer within {cfg['request_timeout_s']} s"
        except (ConnectionRefusedError, socket.gaierror) as exc:
            err, msg = "connect_error", str(exc)[:200]
        except (OSError, ValueError, Exception) as exc:   # noqa: BLE001 - every failure is a record
            err = "disconnected" if chunks or status == 200 else "connect_error"
            if isinstance(exc, ValueError):
                err = "bad_chunk"
            msg = f"{type(exc).__name__}: {exc}"[:200]
        finally:
            if err is not None:
                # a half-read response must not go back to the pool
                http.close()
                http = self._client()
            s.inflight -= 1
        e2el = ttft = tpot = None
        if chunks:
            ttft = chunks[0] - st
            e2el = chunks[-1] - st
            if usage and usage[1] and usage[1] > 1:
                tpot = (e2el - ttft) / (usage[1] - 1)
        if measured:
            s.done[step] = s.done.get(step, 0) + 1
            if err is not None:
                s.err[step] = s.err.get(step, 0) + 1
            else:
                if s.is_good(ttft, tpot, e2el):
                    s.good[step] = s.good.get(step, 0) + 1
                s.count_over(step, ttft, e2el, [b - a for a, b in zip(chunks, chunks[1:])])
        rec = {"k": "req", "w": s.wid, "s": step, "p": phase, "id": rid, "t": wall, "st": st,
               "c": [round(c - st, 7) for c in chunks], "u": usage, "f": finish, "h": status,
               "e": err, "m": msg, "d": done, "r": role_first}
        if due is not None:
            # how late it left: the send minus its scheduled time, and the part spent at the cap
            rec["q"], rec["qw"] = round(st - due, 7), round(waited, 7)
        s.write(rec)
        self.environment.events.request.fire(
            request_type="POST", name=s.path, response_time=(e2el or (perf() - st)) * 1000.0,
            response_length=nbytes, exception=RuntimeError(f"{err}: {msg}") if err else None,
            context={})
        return http


def error_message(raw):
    try:
        obj = json.loads(raw)
        if isinstance(obj.get("error"), dict):
            return str(obj["error"].get("message"))[:200]
        return str(obj.get("error") or obj.get("detail") or obj)[:200]
    except (ValueError, AttributeError):
        return raw[:200].decode("utf-8", "replace")


# --- the ladder ----------------------------------------------------------------------------------------
class Ladder(LoadTestShape):
    """Steps of the ladder: ramp → warm-up → measure → drain, then the next step or the end.

    tick() runs about once a second on the master (or the local runner). A step's window closes
    when it has lasted measure_s and holds at least min_requests_per_user × C requests, or at
    measure_max_s, or at max_requests_per_step; the drain ends when every measured request has
    finished (or the drain timeout passes). After a step, stop early when its error rate or its
    share of requests meeting the SLOs is past the configured limits.
    """

    def __init__(self):
        super().__init__()
        self.i = -1
        self.phase = "idle"
        self.since = 0.0
        self.finished = False
        # rate mode: each step's rate (the sweep's, then the search's) and its verdict
        self.rates = []
        self.verdicts = []

    @property
    def rate_mode(self):
        return CONFIG.get("mode") == "rate"

    def _users(self):
        """The step's users: its concurrency, or in rate mode one per load process."""
        if self.rate_mode:
            return self._expected_workers() if 0 <= self.i < len(self.rates) else 0
        ladder = CONFIG["ladder"]
        return ladder[self.i] if 0 <= self.i < len(ladder) else 0

    def _steps(self):
        return len(self.rates) if self.rate_mode else len(CONFIG["ladder"])

    def _go(self, phase, **extra):
        m = MASTER
        self.phase, self.since = phase, perf()
        users = self._users()
        m.step, m.phase = self.i, phase
        rec = {"k": "phase", "w": "master", "s": self.i, "p": phase, "t": self.since, "wall": time.time(),
               "users": users}
        msg = {"s": self.i, "p": phase, "users": users}
        if self.rate_mode and 0 <= self.i < len(self.rates):
            rec["rate"] = self.rates[self.i]
            msg["rate"] = self.rates[self.i] / max(1, users)     # each load process's share
        rec.update(extra)
        m.write(rec)
        self.runner.send_message("bench_phase", msg)

    def _next_rate(self, t):
        """Rate mode, after a step's drain: judge it (with an SLO) and pick the next rate, or None."""
        cfg = CONFIG
        limits = cfg.get("limits") or {}
        if limits:
            over = {"sent": t["sent"], "err": t["err"]}
            for p in MASTER.progress.values():
                if p["s"] == self.i and p["p"] == "drain":
                    for k, v in (p.get("over") or {}).items():
                        over[k] = over.get(k, 0) + v
            self.verdicts.append((self.rates[self.i], judge_counts(over, limits)))
        if limits and cfg.get("search_bisections") is not None:
            return next_rate(cfg["ladder"], self.verdicts, int(cfg["search_bisections"]))
        return cfg["ladder"][self.i + 1] if self.i + 1 < len(cfg["ladder"]) else None

    def _totals(self, phase):
        """Sum of the workers' latest progress for the current step, counting only reports made
        after the worker itself entered `phase` (so none predates the phase change)."""
        t = {"sent": 0, "done": 0, "err": 0, "good": 0, "inflight": 0, "workers": 0}
        for p in MASTER.progress.values():
            if p["s"] == self.i and p["p"] == phase:
                t["workers"] += 1
                for k in ("sent", "done", "err", "good", "inflight"):
                    t[k] += p[k]
        return t

    def _expected_workers(self):
        r = self.runner
        return max(1, len(r.clients)) if isinstance(r, MasterRunner) else 1

    def tick(self):
        cfg = CONFIG
        ladder = cfg["ladder"]
        now = perf()
        age = now - self.since
        if self.phase == "idle":
            self.i = 0
            if self.rate_mode:
                self.rates.append(ladder[0])
            self._go("ramp")
        elif self.phase == "ramp":
            c = self._users()
            if self.get_current_user_count() >= c or age > cfg["ramp_s"] + 30:
                self._go("warmup", ramp_s=round(age, 3), users_reached=self.get_current_user_count())
        elif self.phase == "warmup":
            if age >= cfg["warmup_s"]:
                self._go("measure")
        elif self.phase == "measure":
            t = self._totals("measure")
            c = self._users()
            # an open loop's window holds what its rate sends: min_requests_per_user is the closed loop's
            enough = self.rate_mode or t["sent"] >= cfg["min_requests_per_user"] * c
            if (age >= cfg["measure_s"] and enough) or age >= cfg["measure_max_s"] \
                    or t["sent"] >= cfg["max_requests_per_step"]:
                self._go("drain", measured_s=round(age, 3), sent=t["sent"], enough=enough)
        elif self.phase == "drain":
            t = self._totals("drain")
            drained = t["workers"] >= self._expected_workers() and t["done"] >= t["sent"]
            if drained or age > cfg["drain_timeout_s"]:
                reason = self._stop_reason(t)
                if self.rate_mode:
                    rate = self._next_rate(t)
                    if rate is not None and not reason:
                        self.rates.append(rate)
                self.i += 1
                if reason or self.i >= self._steps():
                    self.i -= 1
                    self._go("end", drained=drained, stop_reason=reason, sent=t["sent"], done=t["done"],
                             err=t["err"], good=t["good"])
                elif self.rate_mode:
                    # an open loop leaves a queue behind when its rate was past the server's: the next
                    # rate starts once every request sent so far has ended
                    self.i -= 1
                    self._go("rest", drained=drained, sent=t["sent"], done=t["done"], err=t["err"], good=t["good"])
                else:
                    self._go("ramp", prev_drained=drained, prev_sent=t["sent"], prev_done=t["done"],
                             prev_err=t["err"], prev_good=t["good"])
        elif self.phase == "rest":
            t = self._totals("rest")
            idle = t["workers"] >= self._expected_workers() and t["inflight"] == 0
            if idle or age > cfg["drain_timeout_s"]:
                self.i += 1
                self._go("ramp", rested_s=round(age, 3), idle=idle)
        elif self.phase == "end":
            t = self._totals("end")
            idle = t["workers"] >= self._expected_workers() and t["inflight"] == 0
            if idle or age > cfg["drain_timeout_s"]:
                if not self.finished:
                    self.finished = True
                    gevent.sleep(1.0)        # let the server's counters catch up with the last chunk
                    MASTER.sample_server()
                    MASTER.write({"k": "done", "t": perf(), "wall": time.time(), "idle": idle})
                return None
        if self.rate_mode:
            return (self._users(), 1000.0)
        return (ladder[self.i], self._rate())

    def _rate(self):
        """Users started per second during this step's ramp (the previous step's users stay)."""
        cfg, ladder = CONFIG, CONFIG["ladder"]
        prev = ladder[self.i - 1] if self.i > 0 else 0
        rate = max(1.0, (ladder[self.i] - prev) / max(float(cfg["ramp_s"]), 0.001))
        return min(rate, float(cfg.get("max_spawn_rate", 1000)))

    def _where(self):
        return f"rate {self.rates[self.i]:g} req/s" if self.rate_mode else f"concurrency {CONFIG['ladder'][self.i]}"

    def _stop_reason(self, t):
        cfg = CONFIG
        if self.rate_mode and cfg.get("search_bisections") is not None:
            return None             # a capacity search runs past failing steps on purpose
        sent = max(t["sent"], 1)
        limit = cfg.get("stop_error_rate")
        if limit is not None and t["err"] / sent > limit:
            return f"error rate {t['err'] / sent:.1%} > {limit:.1%} at {self._where()}"
        min_good = cfg.get("stop_min_good_ratio")
        if min_good is not None and any(v is not None for v in (cfg.get("slo") or {}).values()):
            good = t["good"] / sent
            if good < min_good:
                return f"only {good:.1%} of requests met the SLOs (< {min_good:.0%}) at {self._where()}"
        return None


# --- wiring ------------------------------------------------------------------------------------------
def _on_phase(environment, msg, **_unused):
    d = msg.data
    if d["p"] == "warmup":
        # The users and their connections now exist: move them (and everything else alive) out
        # of the collector's reach, so collections during the measured window stay short. The
        # pause of this collection falls into the discarded warm-up.
        gc.collect()
        gc.freeze()
    _collector_for(d["p"])
    STATE.set_phase(d["s"], d["p"], d["users"], d.get("rate"))


# While a step is measured the automatic collector is off: at 1,024 streams its pauses (up to
# 34 ms, several a second) made the event loop late at p99 and the step invalid. Garbage that
# refcounting cannot free waits for the next phase (the window is bounded), unless live container
# objects grow past this many since the last collection (the monitor then collects once).
GC_MEASURE_BOUND = 2_000_000


def _collector_for(phase):
    if phase == "measure":
        gc.disable()
    elif not gc.isenabled():
        gc.enable()
        gc.collect()


def _bound_garbage():
    if not gc.isenabled() and gc.get_count()[0] > GC_MEASURE_BOUND:
        gc.collect()


def _on_progress(environment, msg, **_unused):
    MASTER.progress[msg.node_id] = msg.data


def _progress_loop(runner):
    while True:
        gevent.sleep(0.5)
        runner.send_message("bench_progress", STATE.progress())


def _steal_ticks():
    """Ticks the hypervisor took from the CPUs this process may run on (/proc/stat, Linux), or None."""
    try:
        cpus = {f"cpu{n}" for n in os.sched_getaffinity(0)}
        total = 0
        with open("/proc/stat", encoding="ascii") as fh:
            for line in fh:
                f = line.split()
                if f and f[0] in cpus and len(f) > 8:
                    total += int(f[8])
        return total, len(cpus)
    except (OSError, ValueError, AttributeError):
        return None


def _client_monitor():
    """Once a second: this process's CPU share, how often the OS preempted it, how much CPU time
    the hypervisor stole from its CPUs, and the event loop's lag (a greenlet sleeps 20 ms, 50 times
    a second, and notes how late it wakes: a chunk that arrives while the loop is busy, preempted
    or stolen from waits as long). The report flags a step whose lag or CPU says the client could
    not time chunks to the millisecond."""
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    last_wall, last_cpu = perf(), time.process_time()
    last_ivcsw = resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw
    last_steal = _steal_ticks()
    while True:
        lags = []
        for _unused in range(50):
            t = perf()
            gevent.sleep(0.02)
            lags.append(perf() - t - 0.02)
        now, cpu = perf(), time.process_time()
        ivcsw = resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw
        steal = _steal_ticks()
        s = STATE
        rec = {"k": "cpu", "w": s.wid, "s": s.step, "p": s.phase, "t": now,
               "cpu": round((cpu - last_cpu) / (now - last_wall), 4),
               "lags": [round(x * 1000, 2) for x in lags], "preempted": ivcsw - last_ivcsw,
               "inflight": s.inflight}
        if steal is not None and last_steal is not None:
            rec["steal"] = round((steal[0] - last_steal[0]) / hz / (now - last_wall) / steal[1], 4)
        s.write(rec)
        _bound_garbage()
        last_wall, last_cpu, last_ivcsw, last_steal = now, cpu, ivcsw, steal


def _metrics_loop():
    interval = float(CONFIG.get("metrics_interval_s", 1.0))
    while True:
        MASTER.sample_server()
        gevent.sleep(interval)


@events.init.add_listener
def _on_init(environment, **_unused):
    global CONFIG, STATE, MASTER
    CONFIG = load_config()
    runner = environment.runner
    is_master = isinstance(runner, MasterRunner)
    is_worker = isinstance(runner, WorkerRunner)
    if not is_master:
        wid = f"{socket.gethostname()}-{os.getpid()}"
        STATE = LoadState(CONFIG, wid)
        runner.register_message("bench_phase", _on_phase)
        gevent.spawn(_client_monitor)
        gevent.spawn(_progress_loop, runner)
    if not is_worker:
        MASTER = MasterState(CONFIG)
        runner.register_message("bench_progress", _on_progress)
        MASTER.write({"k": "start", "t": perf(), "wall": time.time(), "host": socket.gethostname(),
                      "mode": "master" if is_master else "local", "config": {
                          k: v for k, v in CONFIG.items() if k != "api_key"}})
        MASTER.sample_server()
        if CONFIG.get("metrics_url"):
            gevent.spawn(_metrics_loop)


@events.test_start.add_listener
def _on_test_start(environment, **_unused):
    # Startup left ~10^5 long-lived objects (Locust, gevent, the config, the prompts): move them out
    # of the collector's reach, so a full collection during the load does not stall every stream
    # (one took 38 ms here and showed as late chunks).
    gc.collect()
    gc.freeze()


@events.quitting.add_listener
def _on_quitting(environment, **_unused):
    for st in (STATE, MASTER):
        if st is not None:
            st.fh.flush()
