# -*- coding: utf-8 -*-
"""The benchmark's preflight against an OpenAI-compatible server (vLLM): reachable, the API key
accepted, the model served, a completion answers, /metrics present - and the tokenizer's words
per token, so prompts of the asked length can be cut from natural text.

Every failure becomes a `ProbeError` whose message names the action, the URL, the cause and the
fix; the benchmark role shows it and starts no load. HTTP goes through a `fetch(method, url,
body, headers, timeout) -> (status, body bytes)` callable, so the logic is tested without a
network (fetch raises `OSError` for a transport failure).
"""
from __future__ import annotations

import json
import re
import socket

from ansible_collections.modelswap.vllm.plugins.module_utils.serving import vllm_metrics

SNAPSHOT_COMMIT = re.compile(r"/snapshots/([0-9a-f]{40})(?:/|$)")
CALIBRATION_WORDS = (40, 160)

# The server a benchmark talks to: the options benchmark_probe and benchmark_run share (their
# documentation is the modelswap.vllm.benchmark_target fragment).
TARGET_ARGS = dict(
    url=dict(type="str", required=True),
    model=dict(type="str", required=True),
    api=dict(type="str", choices=["chat", "completions"], default="chat"),
    api_key=dict(type="str", no_log=True),
)


class ProbeError(Exception):
    def __init__(self, kind, message):
        super().__init__(message)
        self.kind = kind
        self.message = message


def describe_transport_error(exc):
    """A short cause for a connection failure (refused, timeout, name, TLS, ...)."""
    text = str(getattr(exc, "reason", exc))
    if isinstance(exc, ConnectionRefusedError) or "refused" in text.lower():
        return "connection refused (nothing listens on that port)"
    if isinstance(exc, (socket.timeout, TimeoutError)) or "timed out" in text.lower():
        return "timed out"
    if isinstance(exc, socket.gaierror) or "name or service not known" in text.lower() \
            or "nodename nor servname" in text.lower():
        return f"the host name does not resolve ({text})"
    return text


def _json(body):
    try:
        return json.loads(body.decode("utf-8", "replace") if isinstance(body, bytes) else body)
    except ValueError:
        return None


def error_text(body):
    """The server's error message from a JSON error body (vLLM and OpenAI shapes)."""
    obj = _json(body)
    if isinstance(obj, dict):
        err = obj.get("error", obj.get("detail", obj.get("message")))
        if isinstance(err, dict):
            err = err.get("message", err)
        if err:
            return str(err)[:300]
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else str(body)
    return text.strip()[:300]


def check_models(status, body, url, model, has_key):
    """The /v1/models answer: the served model's entry, or a ProbeError that says what to fix."""
    if status in (401, 403):
        fix = ("the API key was refused: set benchmark_api_key to the server's key (VLLM_API_KEY / --api-key)"
               if has_key else
               "the server requires an API key: set benchmark_api_key (the server's VLLM_API_KEY / --api-key)")
        raise ProbeError("auth", f"benchmark preflight: GET {url}/v1/models answered HTTP {status}: {fix}")
    if status != 200:
        raise ProbeError("http", f"benchmark preflight: GET {url}/v1/models answered HTTP {status} "
                                 f"({error_text(body)}): is {url} an OpenAI-compatible server (vLLM)?")
    obj = _json(body)
    if not isinstance(obj, dict) or not isinstance(obj.get("data"), list):
        raise ProbeError("http", f"benchmark preflight: GET {url}/v1/models did not return a model list: "
                                 f"is {url} an OpenAI-compatible server (vLLM)?")
    served = [m.get("id") for m in obj["data"] if isinstance(m, dict)]
    for m in obj["data"]:
        if isinstance(m, dict) and m.get("id") == model:
            return m
    raise ProbeError("model", f"benchmark preflight: the server at {url} does not serve model '{model}' "
                              f"(it serves: {', '.join(map(str, served)) or 'nothing'}): set benchmark_model "
                              "to the served model name (vLLM's --served-model-name)")


def completion_request(api, model, text, max_tokens=1):
    """(path, body) of a small non-streamed request, for the readiness proof and calibration."""
    if api == "chat":
        return "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": text}],
                                        "max_completion_tokens": max_tokens, "stream": False}
    return "/v1/completions", {"model": model, "prompt": text, "max_tokens": max_tokens, "stream": False}


def check_completion(status, body, url, path):
    """The usage of a small completion, or a ProbeError."""
    if status in (401, 403):
        raise ProbeError("auth", f"benchmark preflight: POST {url}{path} answered HTTP {status}: the API key "
                                 "was refused; set benchmark_api_key to the server's key")
    if status == 404:
        raise ProbeError("model", f"benchmark preflight: POST {url}{path} answered HTTP 404 "
                                  f"({error_text(body)}): check benchmark_model and benchmark_api")
    if status != 200:
        raise ProbeError("completion", f"benchmark preflight: POST {url}{path} answered HTTP {status} "
                                       f"({error_text(body)}): the server cannot complete a request; "
                                       "fix the server before benchmarking it")
    obj = _json(body)
    usage = obj.get("usage") if isinstance(obj, dict) else None
    if not isinstance(usage, dict) or usage.get("prompt_tokens") is None:
        raise ProbeError("completion", f"benchmark preflight: POST {url}{path} returned no usage: the "
                                       "benchmark needs usage.prompt_tokens / completion_tokens")
    return usage


def calibrate(samples):
    """Words per token and the fixed prompt overhead (chat template) from [(words, prompt_tokens)].

    Two prompts of different lengths: slope = words / token, overhead = tokens at zero words.
    """
    (w1, t1), (w2, t2) = samples[0], samples[-1]
    if t2 <= t1 or w2 <= w1:
        return {"words_per_token": 0.75, "overhead_tokens": 0, "samples": samples, "fallback": True}
    tokens_per_word = (t2 - t1) / float(w2 - w1)
    overhead = max(0, int(round(t1 - w1 * tokens_per_word)))
    return {"words_per_token": 1.0 / tokens_per_word, "overhead_tokens": overhead, "samples": samples,
            "fallback": False}


def deployment_facts(model_entry, version, cache_config):
    """What the server says about its deployment: version, model root (a Hugging Face snapshot path
    names the commit), context length, cache settings."""
    root = model_entry.get("root")
    m = SNAPSHOT_COMMIT.search(root or "")
    return {"served_model_name": model_entry.get("id"), "model_root": root,
            "commit": m.group(1) if m else None, "max_model_len": model_entry.get("max_model_len"),
            "vllm_version": version, "cache_config": cache_config or None}


def words(text, n):
    """The first n words of text, repeated if it is shorter."""
    ws = text.split()
    if not ws:
        raise ValueError("the prompt source has no words")
    out = []
    while len(out) < n:
        out.extend(ws[:n - len(out)])
    return " ".join(out)


def probe(fetch, url, model, *, api="chat", api_key=None, timeout=30.0, calibration_text=None,
          metrics=True):
    """Run the preflight; returns the facts or raises ProbeError. See the module docstring."""
    url = url.rstrip("/")
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    try:
        status, body = fetch("GET", f"{url}/v1/models", None, headers, timeout)
    except OSError as exc:
        raise ProbeError("unreachable", f"benchmark preflight: cannot reach the server at {url}: "
                                        f"{describe_transport_error(exc)}; is vLLM running and listening on "
                                        "that address and port (benchmark_url)?") from exc
    entry = check_models(status, body, url, model, bool(api_key))
    version = None
    try:
        vs, vb = fetch("GET", f"{url}/version", None, headers, timeout)
        if vs == 200:
            version = (_json(vb) or {}).get("version")
    except OSError:
        pass
    # a completion must work (the model really serves), and it measures the tokenizer
    samples = []
    text = calibration_text or "The quick brown fox jumps over the lazy dog. " * 40
    for n in CALIBRATION_WORDS if calibration_text is not None else (CALIBRATION_WORDS[0],):
        path, req = completion_request(api, model, words(text, n))
        try:
            status, body = fetch("POST", f"{url}{path}", json.dumps(req).encode(), headers, timeout)
        except OSError as exc:
            raise ProbeError("completion", f"benchmark preflight: POST {url}{path} failed: "
                                           f"{describe_transport_error(exc)}") from exc
        usage = check_completion(status, body, url, path)
        samples.append((n, int(usage["prompt_tokens"])))
    cal = calibrate(samples) if len(samples) > 1 else None
    cache_config, metric_values, metrics_error = {}, None, None
    if metrics:
        try:
            ms, mb = fetch("GET", f"{url}/metrics", None, {}, timeout)
            if ms == 200:
                metric_values, cache_config = vllm_metrics.parse_metrics(mb.decode("utf-8", "replace"), model)
                if "vllm:num_requests_running" not in metric_values:
                    metrics_error = "/metrics has no vllm:num_requests_running: server concurrency unconfirmed"
            else:
                metrics_error = f"GET {url}/metrics answered HTTP {ms}"
        except OSError as exc:
            metrics_error = f"GET {url}/metrics failed: {describe_transport_error(exc)}"
    return {"url": url, "model": entry, "version": version, "calibration": cal,
            "metrics": metric_values, "metrics_error": metrics_error,
            "deployment": deployment_facts(entry, version, cache_config)}


def check_lengths(input_tokens, output_tokens, max_model_len):
    """None, or why prompt + output do not fit the server's context length."""
    if max_model_len and input_tokens + output_tokens > max_model_len:
        return (f"benchmark_input_tokens ({input_tokens}) + benchmark_output_tokens ({output_tokens}) = "
                f"{input_tokens + output_tokens} exceeds the server's max_model_len ({max_model_len}): every "
                "request would fail; lower them")
    return None
