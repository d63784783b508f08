# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0
"""The readiness gates of a vLLM server over HTTP, and its requests in flight from ``/metrics``.

vLLM's readiness is proved in gates, in order (docs/vllm-operations.md): the port accepts a TCP
connection -> ``/health`` answers 200 -> ``/v1/models`` lists the served name -> a one-token
completion succeeds. ``wait_ready`` walks them within a budget and returns the seconds each gate
took; it stops early on answers that cannot improve by waiting (a wrong API key, another model
on the port, or whatever its ``check`` callable says: a unit that exited) and reports the gate
and the last error.

``read_in_flight`` reads ``vllm:num_requests_running`` + ``vllm:num_requests_waiting`` of the
served model from ``/metrics`` (serving/vllm_metrics.py's parser), for vllm_ready's idle wait.
Every probe takes its clock, sleep or request callable, so the tests drive it with a local HTTP
server.
"""
from __future__ import annotations

import json
import socket
import time
import urllib.error

from ansible.module_utils.urls import ConnectionError as UrlsConnectionError
from ansible.module_utils.urls import SSLValidationError, open_url
from ansible_collections.modelswap.vllm.plugins.module_utils.serving.vllm_metrics import parse_metrics

GATES = ("port", "health", "models", "completion")


# --------------------------------------------------------------------------------------------
# HTTP gates
# --------------------------------------------------------------------------------------------
class GateError(Exception):
    """A gate did not pass. ``final`` means waiting cannot fix it; ``refused`` that nothing
    listens on the port (the connection was refused)."""

    def __init__(self, message, final=False, refused=False):
        Exception.__init__(self, message)
        self.final = final
        self.refused = refused


def _request(url, *, api_key=None, body=None, timeout=10.0):
    """(status, parsed JSON or text) of a GET (or POST with ``body``); GateError on no answer."""
    headers = {"Accept": "application/json"}
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    if api_key:
        headers["Authorization"] = "Bearer " + api_key
    try:
        # no proxy: the probe talks to the server on its own host
        resp = open_url(url, data=data, headers=headers, method="POST" if data else "GET",
                        timeout=timeout, use_proxy=False, validate_certs=True)
        try:
            status, raw = resp.status, resp.read(1 << 20)
        finally:
            resp.close()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read(1 << 16) if exc.fp else b""
    except (urllib.error.URLError, OSError, ValueError, UrlsConnectionError, SSLValidationError) as exc:
        reason = getattr(exc, "reason", exc)
        raise GateError("no answer from %s: %s" % (url.split("?")[0], reason),
                        refused=isinstance(reason, ConnectionRefusedError) or isinstance(exc, ConnectionRefusedError))
    text = raw.decode("utf-8", "replace")
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def request_json(url, *, api_key=None, body=None, timeout=10.0):
    """(status, parsed JSON or text) of a GET, or a POST of ``body``; GateError when nothing
    answers (for other probes of the server: the quality gate's questions)."""
    return _request(url, api_key=api_key, body=body, timeout=timeout)


def _short(payload, limit=300):
    text = payload if isinstance(payload, str) else json.dumps(payload)
    return text if len(text) <= limit else text[:limit] + "..."


def gate_port(host, port, timeout):
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return {}
    except OSError as exc:
        raise GateError("port %s:%d does not accept connections (%s)"
                        % (host, port, exc.strerror or exc))


def gate_health(base, timeout):
    status, payload = _request(base + "/health", timeout=timeout)
    if status != 200:
        raise GateError("/health answered %d %s" % (status, _short(payload)))
    return {}


def _auth_error(status, path):
    if status in (401, 403):
        return GateError("%s answered %d: the server rejected the API key; the unit's "
                         "environment file and vllm_service_api_key disagree" % (path, status),
                         final=True)
    return None


def gate_models(base, served_name, api_key, timeout):
    status, payload = _request(base + "/v1/models", api_key=api_key, timeout=timeout)
    err = _auth_error(status, "/v1/models")
    if err:
        raise err
    if status != 200 or not isinstance(payload, dict) or not isinstance(payload.get("data"), list):
        raise GateError("/v1/models answered %d %s" % (status, _short(payload)))
    names = [m.get("id") for m in payload["data"] if isinstance(m, dict)]
    if served_name and served_name not in names:
        raise GateError("/v1/models lists %s, not %r: another model is served on this port"
                        % (names or "no model", served_name), final=True)
    if not names:
        raise GateError("/v1/models lists no model yet")
    return {"models": names}


def gate_completion(base, model, api_key, prompt, timeout):
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    status, payload = _request(base + "/v1/completions", api_key=api_key, body=body, timeout=timeout)
    err = _auth_error(status, "/v1/completions")
    if err:
        raise err
    if status != 200 or not isinstance(payload, dict) or not payload.get("choices"):
        raise GateError("a one-token completion answered %d %s" % (status, _short(payload)),
                        final=400 <= status < 500 and status not in (404, 408, 429))
    return {"completion": {"text": payload["choices"][0].get("text"),
                           "usage": payload.get("usage")}}


def wait_ready(*, host, port, served_name=None, api_key=None, budget=300.0, poll=2.0,
               request_timeout=10.0, completion=True, prompt="Hello", scheme="http",
               check=None, clock=time.monotonic, sleep=time.sleep, api=True) -> dict:
    """Walk the gates until all pass, a final error, ``check()`` says stop, or the budget ends.

    ``check()`` is called between attempts (and before each gate): it returns None to go on or a
    message that ends the wait (the unit exited, a foreign process owns the port).

    ``api=False`` stops after /health (a server whose API key is not known here).

    Returns {"ready", "gates": {gate: seconds}, "elapsed", "failed_gate", "last_error",
    "models", "completion", "stopped_by"}.
    """
    base = "%s://%s:%d" % (scheme, host if ":" not in host else "[%s]" % host, port)
    gates = [g for g in GATES if (completion or g != "completion") and (api or g in ("port", "health"))]
    start = clock()
    mark = start
    done = {}
    extra = {}
    last_error = None
    idx = 0
    while True:
        gate = gates[idx]
        stop = check() if check else None
        if stop:
            return _outcome(False, done, clock() - start, gate, stop, extra, "check")
        try:
            if gate == "port":
                out = gate_port(host, port, request_timeout)
            elif gate == "health":
                out = gate_health(base, request_timeout)
            elif gate == "models":
                out = gate_models(base, served_name, api_key, request_timeout)
            else:
                names = extra.get("models") or [served_name]
                out = gate_completion(base, served_name or names[0], api_key, prompt, request_timeout)
        except GateError as exc:
            last_error = str(exc)
            if exc.final:
                return _outcome(False, done, clock() - start, gate, last_error, extra, "final")
        else:
            now = clock()
            done[gate] = round(now - mark, 3)
            mark = now
            extra.update(out)
            idx += 1
            if idx == len(gates):
                return _outcome(True, done, now - start, None, None, extra, None)
            continue
        remaining = budget - (clock() - start)
        if remaining <= 0:
            return _outcome(False, done, clock() - start, gate, last_error, extra, "timeout")
        sleep(min(poll, remaining))


def _outcome(ready, gates, elapsed, failed_gate, error, extra, stopped_by):
    return {"ready": ready, "gates": gates, "elapsed": round(elapsed, 3), "failed_gate": failed_gate,
            "last_error": error, "models": extra.get("models"), "completion": extra.get("completion"),
            "stopped_by": stopped_by}


# --------------------------------------------------------------------------------------------
# requests in flight (/metrics)
# --------------------------------------------------------------------------------------------
IN_FLIGHT_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting")


def in_flight_of(text: str, served_name=None) -> dict:
    """{"running": n, "waiting": n} of a /metrics text, for ``served_name`` (every model when
    None); GateError (final) when the text has neither gauge (not vLLM, or another version)."""
    values, _cache = parse_metrics(text, served_name)
    if not any(name in values for name in IN_FLIGHT_METRICS):
        raise GateError("/metrics has no %s%s: not a vLLM server, or one that does not serve that model"
                        % (" or ".join(IN_FLIGHT_METRICS),
                           " for model_name=%r" % served_name if served_name else ""), final=True)
    return {"running": int(values.get(IN_FLIGHT_METRICS[0], 0)),
            "waiting": int(values.get(IN_FLIGHT_METRICS[1], 0))}


def read_in_flight(base, served_name=None, api_key=None, timeout=10.0, request=None) -> dict:
    """The requests in flight on the server at ``base`` (GET /metrics): {"running", "waiting"}.
    GateError when it does not answer (``refused`` when nothing listens), final when the answer
    cannot change by waiting (a rejected key, no /metrics, no gauges)."""
    status, payload = (request or _request)(base + "/metrics", api_key=api_key, timeout=timeout)
    err = _auth_error(status, "/metrics")
    if err:
        raise err
    if status != 200:
        raise GateError("/metrics answered %d %s" % (status, _short(payload)), final=status == 404)
    if not isinstance(payload, str):
        raise GateError("/metrics answered JSON, not Prometheus text: %s" % _short(payload), final=True)
    return in_flight_of(payload, served_name)
