# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0
"""Is a vLLM server ready, and is the old one gone? Gates, budgets, port owners, unit states.

vLLM's readiness is proved in gates, in order (docs/vllm-operations.md): the port accepts a TCP
connection -> ``/health`` answers 200 -> ``/v1/models`` lists the served name -> a one-token
completion succeeds. ``wait_ready`` walks them within a budget and returns the seconds each gate
took; it stops early on answers that cannot improve by waiting (a wrong API key, another model
on the port, a unit that exited) and reports the gate, the last error and what to do.

The port owner is read from /proc (``/proc/net/tcp*`` -> socket inode -> ``/proc/PID/fd``), and a
process's systemd unit from ``/proc/PID/cgroup``, so a second vLLM sharing the port
(SO_REUSEPORT) or a stray process is caught, not mistaken for the new service.

Before a server is stopped behind a load balancer, ``wait_until_idle`` waits until it has no
request in flight: ``vllm:num_requests_running`` + ``vllm:num_requests_waiting`` of the served
model, read from ``/metrics`` (serving/vllm_metrics.py's parser), stay 0 for a settle time.

The module vllm_ready is a thin shell over ``wait_until_ready`` / ``wait_until_stopped`` /
``wait_until_idle``: they take
plain option values, a ``UnitReader`` (systemctl and journalctl through a ``HostCommands``) and
the clock. Every function that touches the system takes the procfs root, a clock, a HostCommands
or a callable, so the tests drive it with a local HTTP server, fake /proc trees and fake commands.
"""
from __future__ import annotations

import json
import os
import re
import socket
import time
import urllib.error

from ansible.module_utils.urls import ConnectionError as UrlsConnectionError
from ansible.module_utils.urls import SSLValidationError, open_url
from ansible_collections.modelswap.vllm.plugins.module_utils.serving.vllm_metrics import parse_metrics
from ansible_collections.modelswap.vllm.plugins.module_utils.common import procfs
from ansible_collections.modelswap.vllm.plugins.module_utils.serving.served_model import parse_systemctl_show

GATES = ("port", "health", "models", "completion")
PROC = "/proc"


# --------------------------------------------------------------------------------------------
# budget
# --------------------------------------------------------------------------------------------
BUDGET_BASE_S = 180          # interpreter, imports, engine and API server start, one process
BUDGET_PER_GIB_S = 4         # weight loading, pessimistic (~0.25 GiB/s from disk to devices)
BUDGET_PER_EXTRA_GPU_S = 30  # worker processes, NCCL init, the P2P check, per extra GPU
BUDGET_COMPILE_S = 180       # torch.compile and CUDA graph capture (skipped with enforce_eager)


def startup_budget(size_bytes: int = 0, parallel: int = 1, enforce_eager: bool = False) -> int:
    """Seconds to allow a vLLM start, from the model's size on disk and its parallelism.

    Calibrated on the start-up times seen in practice (docs/vllm-operations.md): 7B ~40 s,
    Llama-70B-FP8 TP=8 several minutes, 72B TP=4 ~17 min, Llama-4-Scout TP=4 ~10 min; the
    budget is generous for small models and close to those for the large ones.
    """
    gib = max(0, int(size_bytes or 0)) / float(1 << 30)
    budget = BUDGET_BASE_S + BUDGET_PER_GIB_S * gib + BUDGET_PER_EXTRA_GPU_S * max(0, int(parallel or 1) - 1)
    if not enforce_eager:
        budget += BUDGET_COMPILE_S
    return int(round(budget))


def tree_size(path: str) -> int:
    """Bytes of the files under ``path`` (symlinks followed: a cache snapshot links to blobs)."""
    total = 0
    seen = set()
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                st = os.stat(os.path.join(root, name))
            except OSError:
                continue
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            total += st.st_size
    return total


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


def env_file_value(text: str, name: str):
    """The value of ``name`` in a systemd EnvironmentFile's text (last assignment wins), or None.

    Handles ``NAME=value``, ``NAME="value"`` (backslash escapes) and ``NAME='value'``; comments
    and blank lines are skipped.
    """
    value = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        key, sep, raw = line.partition("=")
        if not sep or key.strip() != name:
            continue
        raw = raw.strip()
        if len(raw) >= 2 and raw[0] == raw[-1] == '"':
            out, i, body = [], 0, raw[1:-1]
            while i < len(body):
                if body[i] == "\\" and i + 1 < len(body):
                    out.append(body[i + 1])
                    i += 2
                else:
                    out.append(body[i])
                    i += 1
            value = "".join(out)
        elif len(raw) >= 2 and raw[0] == raw[-1] == "'":
            value = raw[1:-1]
        else:
            value = raw
    return value


_JOURNAL_PREFIX = re.compile(r"^\S+ \S+ [^\s:]+\[\d+\]: ")
_VLLM_PREFIX = re.compile(r"^\((?:APIServer|EngineCore|Worker)[^)]*\) "
                          r"(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) \S+ \S+ \[[^\]]*\] ?")
_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b:?")
_SYSTEMD_FAIL = re.compile(r"(Main process exited|Failed with result|code=killed|status=\d+/)")


def journal_errors(lines, limit: int = 8) -> list:
    """The lines of a unit's journal that say why it failed, oldest first, without repeats.

    Keeps exception lines (``RuntimeError: ...``), vLLM's ERROR-level messages and systemd's
    exit lines, without their prefixes; leaves out traceback frames and code. vLLM logs one
    error from several processes: each text is kept once. The last ``limit`` are returned.
    """
    seen = set()
    picked = []
    for line in lines or []:
        body = _JOURNAL_PREFIX.sub("", line.rstrip("\n"), count=1)
        level = None
        match = _VLLM_PREFIX.match(body)
        if match:
            level = match.group("level")
            body = body[match.end():]
        if not body.strip() or body[0].isspace() or body.startswith(("Traceback", "Process ")):
            continue
        body = body.strip()
        if not (_EXCEPTION.match(body) or level in ("ERROR", "CRITICAL") or _SYSTEMD_FAIL.search(body)):
            continue
        if body in seen:
            continue
        seen.add(body)
        picked.append(body)
    return picked[-limit:] if limit else picked


# --------------------------------------------------------------------------------------------
# systemd unit state
# --------------------------------------------------------------------------------------------
UNIT_PROPERTIES = ("LoadState", "ActiveState", "SubState", "Result", "MainPID", "NRestarts",
                   "ExecMainStatus", "ExecMainCode", "ControlGroup", "InvocationID",
                   "ExecMainStartTimestampMonotonic", "ActiveEnterTimestampMonotonic",
                   "ActiveExitTimestampMonotonic", "InactiveEnterTimestampMonotonic")


def unit_problem(show: dict, restarts_before: int = 0):
    """Why a unit that should be starting cannot become ready, or None while it still may.

    ``show`` is parsed ``systemctl show`` output; ``restarts_before`` the NRestarts seen when the
    wait began (a restart since then means the process died during start-up).
    """
    unit = show.get("Id") or "the unit"
    if show.get("LoadState") not in (None, "loaded"):
        return "%s is not loaded (LoadState=%s)" % (unit, show.get("LoadState"))
    active, sub = show.get("ActiveState"), show.get("SubState")
    status = show.get("ExecMainStatus")
    code = show.get("ExecMainCode")
    how = ""
    if status not in (None, "", "0") or code not in (None, "", "0"):
        how = " (main process exit status %s, %s)" % (status, show.get("Result") or "failed")
    try:
        restarts = int(show.get("NRestarts") or 0)
    except ValueError:
        restarts = 0
    if active == "failed":
        return "%s failed during start-up%s" % (unit, how)
    if sub == "auto-restart" or restarts > restarts_before:
        return "%s exited during start-up%s and systemd is restarting it" % (unit, how)
    if active in ("inactive", "deactivating"):
        return "%s stopped during start-up%s" % (unit, how)
    return None


# --------------------------------------------------------------------------------------------
# who listens on a port, and which unit a process belongs to
# --------------------------------------------------------------------------------------------
def _hex_ipv4(text):
    raw = bytes.fromhex(text)
    return socket.inet_ntop(socket.AF_INET, raw[::-1])


def _hex_ipv6(text):
    raw = bytes.fromhex(text)
    # four 32-bit words, each in host (little-endian) order
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
    return socket.inet_ntop(socket.AF_INET6, words)


def parse_proc_net_tcp(text: str, ipv6: bool = False) -> list:
    """LISTEN sockets of a /proc/net/tcp or tcp6 table: [{"address", "port", "uid", "inode"}]."""
    out = []
    for line in text.splitlines()[1:]:
        parts = line.split()
        if len(parts) < 10 or parts[3] != "0A":
            continue
        addr, _, port_hex = parts[1].rpartition(":")
        try:
            address = _hex_ipv6(addr) if ipv6 else _hex_ipv4(addr)
            out.append({"address": address, "port": int(port_hex, 16), "uid": int(parts[7]),
                        "inode": int(parts[9])})
        except (ValueError, OSError):
            continue
    return out


def listening_sockets(port: int, proc: str = PROC) -> list:
    """LISTEN sockets on ``port`` in the reading process's network namespace."""
    found = []
    for name, v6 in (("tcp", False), ("tcp6", True)):
        try:
            with open(os.path.join(proc, "net", name), encoding="ascii", errors="replace") as fh:
                text = fh.read()
        except OSError:
            continue
        found += [s for s in parse_proc_net_tcp(text, v6) if s["port"] == port]
    return found


def unit_of_cgroup(text: str):
    """The systemd unit (``*.service`` / ``*.scope``) of a /proc/PID/cgroup content, or None."""
    best = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hier, controllers, path = parts
        if not (hier == "0" or controllers == "name=systemd"):
            continue
        for comp in reversed(path.strip("/").split("/")):
            if comp.endswith((".service", ".scope")):
                best = comp
                break
        if best and controllers == "name=systemd":
            break
    return best


def unit_of_pid(pid: int, proc: str = PROC):
    try:
        with open(os.path.join(proc, str(pid), "cgroup"), encoding="utf-8", errors="replace") as fh:
            return unit_of_cgroup(fh.read())
    except OSError:
        return None


def socket_owners(inodes, proc: str = PROC) -> dict:
    """{inode: [pid, ...]} for the sockets in ``inodes`` (from /proc/PID/fd links)."""
    wanted = {"socket:[%d]" % i: i for i in inodes}
    owners = {}
    if not wanted:
        return owners
    for pid in procfs.pids(proc):
        fd_dir = os.path.join(proc, str(pid), "fd")
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(os.path.join(fd_dir, fd))
            except OSError:
                continue
            inode = wanted.get(link)
            if inode is not None and pid not in owners.setdefault(inode, []):
                owners[inode].append(pid)
    return owners


def port_listeners(port: int, proc: str = PROC) -> list:
    """Who listens on ``port``: [{"pid", "user", "name", "cmdline", "unit", "address"}].

    A socket whose owner cannot be seen (no permission, or a process in another PID namespace
    that shares this network namespace) is listed with ``pid: null`` and the socket's uid.
    """
    socks = listening_sockets(port, proc)
    owners = socket_owners([s["inode"] for s in socks], proc)
    out = []
    for sock in socks:
        pids = owners.get(sock["inode"]) or [None]
        for pid in pids:
            info = procfs.process_info(pid, proc) if pid is not None else None
            out.append({
                "pid": pid,
                "user": info["user"] if info else procfs.user_name(sock["uid"]),
                "name": info["name"] if info else None,
                "cmdline": info["cmdline"] if info else None,
                "unit": unit_of_pid(pid, proc) if pid is not None else None,
                "address": sock["address"],
            })
    out.sort(key=lambda e: (e["pid"] is None, e["pid"] or 0, e["address"]))
    # one entry per (pid, address)
    dedup, seen = [], set()
    for e in out:
        key = (e["pid"], e["address"])
        if key not in seen:
            seen.add(key)
            dedup.append(e)
    return dedup


def foreign_listeners(listeners: list, unit, also=()) -> list:
    """The listeners that belong neither to ``unit`` nor to the units in ``also`` (all of them
    when ``unit`` is empty)."""
    return [e for e in listeners if not unit or e.get("unit") not in (unit, *also)]


def unit_processes(unit: str, proc: str = PROC) -> list:
    """Processes whose systemd unit is ``unit`` (from /proc/PID/cgroup)."""
    out = []
    for pid in procfs.pids(proc):
        if unit_of_pid(pid, proc) == unit:
            info = procfs.process_info(pid, proc)
            if info:
                out.append(info)
    return out


def describe_listener(e: dict) -> str:
    who = "pid %s" % e["pid"] if e.get("pid") is not None else "an unseen process"
    bits = [who]
    if e.get("user"):
        bits.append("user %s" % e["user"])
    if e.get("unit"):
        bits.append("unit %s" % e["unit"])
    text = ", ".join(bits)
    if e.get("cmdline"):
        text += ": %s" % e["cmdline"][:160]
    return text


# --------------------------------------------------------------------------------------------
# the module's logic: options, the unit reader, the two waits and their results
# --------------------------------------------------------------------------------------------
# Journal lines scanned for the errors of a failed start (the root cause can be a traceback or
# two before the end).
JOURNAL_SCAN = 2000

# An unspecified or all-addresses bind is probed on the loopback address of its family.
_PROBE_HOSTS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


# state=idle: the default budget, and how long running + waiting must stay 0.
IDLE_TIMEOUT_S = 300.0


class ReadyError(Exception):
    """The module fails with this message and no result (a bad option, an unreadable unit)."""


def format_seconds(value) -> str:
    """Seconds for a message: whole above 10 s, one decimal below."""
    return "%.0f" % value if value >= 10 else "%.1f" % value


def probe_host(host: str) -> str:
    return _PROBE_HOSTS.get(host, host)


def options_problem(params: dict):
    """What is wrong with the module's options (the message it fails with), or None."""
    if params.get("idle_settle") is not None and params["idle_settle"] < 0:
        return "vllm_ready: idle_settle must be >= 0 seconds"
    if not 0 < params["port"] < 65536:
        return "vllm_ready: port %d is not a TCP port (1..65535)" % params["port"]
    if params["timeout"] is not None and params["timeout"] < 0:
        return "vllm_ready: timeout must be >= 0 seconds"
    if params["poll_interval"] <= 0 or params["request_timeout"] <= 0:
        return "vllm_ready: poll_interval and request_timeout must be > 0"
    return None


def api_key_from_file(path: str, read_text=None):
    """The VLLM_API_KEY of the unit's EnvironmentFile ``path``; None when the file is missing or
    lacks it (the server then runs without a key). ReadyError when it cannot be read."""
    try:
        text = read_text(path) if read_text else _read_text(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ReadyError("vllm_ready: cannot read the API key file %s: %s; run with become"
                         % (path, exc.strerror or exc))
    return env_file_value(text, "VLLM_API_KEY")


def _read_text(path):
    with open(path, encoding="utf-8") as fh:
        return fh.read()


def budget_for(params: dict, size_of=tree_size) -> dict:
    """The wait's time limit: the timeout given, 120 s to stop, or derived from the model."""
    if params["timeout"] is not None:
        return {"seconds": params["timeout"], "derived": False, "model_bytes": None}
    if params["state"] == "stopped":
        return {"seconds": 120.0, "derived": False, "model_bytes": None}
    if params["state"] == "idle":
        return {"seconds": IDLE_TIMEOUT_S, "derived": False, "model_bytes": None}
    size = size_of(params["model_path"]) if params["model_path"] else 0
    seconds = startup_budget(size, params["parallel_size"], params["enforce_eager"])
    return {"seconds": float(seconds), "derived": True, "model_bytes": size}


def _searched_path() -> str:
    # the folders Ansible's get_bin_path searches, for the same message it fails with
    paths = os.environ.get("PATH", "").split(os.pathsep)
    paths += [p for p in ("/sbin", "/usr/sbin", "/usr/local/sbin") if p not in paths and os.path.exists(p)]
    return os.pathsep.join(paths)


class UnitReader:
    """Reads a unit's state and journal through systemctl/journalctl (a HostCommands)."""

    def __init__(self, commands, name):
        self.commands = commands
        self.name = name
        self.systemctl = commands.which("systemctl")
        if not self.systemctl:
            raise ReadyError('Failed to find required executable "systemctl" in paths: %s' % _searched_path())
        self.journalctl = commands.which("journalctl")

    def show(self) -> dict:
        rc, out, err = self.commands.run(
            [self.systemctl, "show", "--property=Id," + ",".join(UNIT_PROPERTIES), "--", self.name])
        if rc != 0:
            raise ReadyError("reading the state of %s failed: systemctl show exited %d: %s"
                             % (self.name, rc, err.strip()))
        return parse_systemctl_show(out)

    def journal(self, since_epoch, lines=JOURNAL_SCAN) -> list:
        """The unit's newest ``lines`` journal lines since ``since_epoch``, oldest first.

        (With --since, journalctl's --lines counts from the start of the range; --reverse makes
        it keep the newest.)
        """
        if not self.journalctl or lines <= 0:
            return []
        rc, out, _err = self.commands.run(
            [self.journalctl, "--unit", self.name, "--since", "@%d" % int(since_epoch),
             "--reverse", "--lines", str(lines), "--no-pager", "--output", "short-iso", "--quiet"])
        return out.splitlines()[::-1] if rc == 0 else []


def _restarts(show: dict) -> int:
    try:
        return int(show.get("NRestarts") or 0)
    except ValueError:
        return 0


def wait_until_stopped(params: dict, unit, budget: dict, *, clock=time.monotonic, sleep=time.sleep,
                       processes_of=unit_processes, listeners_on=port_listeners):
    """Wait until no process of the unit is left and nothing listens on the port.

    Returns (result, failure message or None); the message only with fail_when_not_ready.
    """
    start = clock()
    while True:
        procs = processes_of(params["unit"]) if params["unit"] else []
        listeners = listeners_on(params["port"])
        if not procs and not listeners:
            break
        if clock() - start >= budget["seconds"]:
            break
        sleep(min(params["poll_interval"], 0.5))
    result = {"ready": not procs and not listeners, "elapsed": round(clock() - start, 3),
              "budget": budget, "processes": procs, "port_listeners": listeners,
              "monotonic": clock(), "changed": False}
    if unit:
        result["unit_state"] = unit.show()
    if result["ready"]:
        return result, None
    parts = []
    if procs:
        parts.append("%d process(es) of %s remain: %s" % (
            len(procs), params["unit"],
            "; ".join("pid %d %s" % (p["pid"], p["cmdline"][:120]) for p in procs[:5])))
    if listeners:
        parts.append("port %d is still held by %s" % (
            params["port"], "; ".join(describe_listener(e) for e in listeners)))
    result["last_error"] = "; ".join(parts)
    if not params["fail_when_not_ready"]:
        return result, None
    return result, ("vllm_ready: waiting for the old vLLM service to be gone failed after "
                    "%s s: %s. Stop the listed processes (or raise the timeout) and run "
                    "again." % (format_seconds(result["elapsed"]), result["last_error"]))


def journal_since(started_epoch: float, unit_state: dict, now_epoch: float, now_monotonic: float) -> float:
    """Epoch seconds the failure's journal starts at: the wait's start, or the unit's last start
    (monotonic microseconds -> epoch) when that is later; a second early for rounding."""
    since = started_epoch - 1
    start_us = int(unit_state.get("ExecMainStartTimestampMonotonic") or 0)
    if start_us:
        since = max(since, now_epoch - (now_monotonic - start_us / 1e6) - 1)
    return since


def not_ready_message(params: dict, outcome: dict, budget: dict, result: dict) -> str:
    """The failure message of a wait for ready: the gate, the error, the budget, the journal."""
    what = params["served_model_name"] or "the server"
    msg = ("vllm_ready: %s on %s:%d is not ready - gate '%s' failed after %s s (budget %s s): %s"
           % (what, probe_host(params["host"]), params["port"], outcome["failed_gate"],
              format_seconds(outcome["elapsed"]), format_seconds(budget["seconds"]), outcome["last_error"]))
    if outcome["stopped_by"] == "timeout":
        msg += ". The budget ran out: raise the timeout if the model needs longer, or read the journal"
    if result.get("journal_errors"):
        msg += ". Errors in the unit's journal: " + " | ".join(result["journal_errors"])
    elif result.get("journal"):
        msg += ". Last journal lines: " + " | ".join(result["journal"][-5:])
    return msg


def wait_until_ready(params: dict, unit, budget: dict, *, clock=time.monotonic, sleep=time.sleep,
                     epoch=time.time, listeners_on=port_listeners, walk_gates=wait_ready):
    """Walk the gates (stopping early on the unit's failure or a foreign port owner).

    Returns (result, failure message or None); the message only with fail_when_not_ready.
    ReadyError when the unit is not loaded.
    """
    started_epoch = epoch()
    restarts_before = 0
    if unit:
        first = unit.show()
        if first.get("LoadState") != "loaded":
            raise ReadyError("vllm_ready: the unit %s is not loaded (LoadState=%s); deploy it "
                             "before waiting for it" % (params["unit"], first.get("LoadState")))
        restarts_before = _restarts(first)
    seen = {"listeners": []}

    def check():
        if unit:
            problem = unit_problem(unit.show(), restarts_before)
            if problem:
                return problem
        if unit and params["check_port_owner"]:
            listeners = listeners_on(params["port"])
            seen["listeners"] = listeners
            foreign = foreign_listeners(listeners, params["unit"])
            if foreign:
                return ("port %d is held by a process outside %s: %s" % (
                    params["port"], params["unit"], "; ".join(describe_listener(e) for e in foreign)))
        return None

    outcome = walk_gates(
        host=probe_host(params["host"]), port=params["port"],
        served_name=params["served_model_name"], api_key=params["api_key"],
        budget=budget["seconds"], poll=params["poll_interval"],
        request_timeout=params["request_timeout"], completion=params["completion"],
        prompt=params["prompt"], scheme=params["scheme"], check=check, api=params["api"],
        clock=clock, sleep=sleep)
    result = dict(outcome, budget=budget, changed=False, monotonic=clock(),
                  port_listeners=seen["listeners"] or listeners_on(params["port"]))
    if unit:
        result["unit_state"] = unit.show()
    if outcome["ready"]:
        return result, None
    if unit:
        since = journal_since(started_epoch, result.get("unit_state", {}), epoch(), clock())
        scanned = unit.journal(since, max(JOURNAL_SCAN, params["journal_lines"]))
        result["journal_errors"] = journal_errors(scanned)
        result["journal"] = scanned[-params["journal_lines"]:] if params["journal_lines"] > 0 else []
    if not params["fail_when_not_ready"]:
        return result, None
    return result, not_ready_message(params, outcome, budget, result)


def _base_url(params: dict) -> str:
    host = probe_host(params["host"])
    return "%s://%s:%d" % (params["scheme"], host if ":" not in host else "[%s]" % host, params["port"])


def wait_until_idle(params: dict, budget: dict, *, clock=time.monotonic, sleep=time.sleep,
                    read=read_in_flight):
    """Wait until the server has no request in flight: running + waiting of the served model stay
    0 for ``idle_settle`` seconds (a request spends a moment in the API server before the engine
    counts it, and its last chunks leave after the engine is done with it). A server that refuses
    the connection has nothing in flight (idle at once, ``server_absent``). One reading at least,
    whatever the budget: with ``timeout: 0`` the result says what is in flight now. A settle
    that began within the budget may end after it (by ``idle_settle`` at most): a server seen idle
    at the deadline is not reported busy.

    Returns (result, failure message or None); the message only with fail_when_not_ready.
    """
    base = _base_url(params)
    settle = params.get("idle_settle")
    settle = 1.0 if settle is None else settle
    start = clock()
    first = last = None
    idle_since = None
    samples = 0
    last_error = None
    stopped_by = None
    absent = False
    while True:
        now = clock()
        try:
            counts = read(base, params["served_model_name"], params["api_key"], params["request_timeout"])
        except GateError as exc:
            if exc.refused:
                absent, last_error = True, None
                break
            last_error = str(exc)
            idle_since = None
            if exc.final:
                stopped_by = "final"
                break
        else:
            samples += 1
            first = first or counts
            last = counts
            last_error = None
            if counts["running"] + counts["waiting"] == 0:
                idle_since = now if idle_since is None else idle_since
                if now - idle_since >= settle:
                    break
            else:
                idle_since = None
        remaining = budget["seconds"] - (clock() - start)
        if idle_since is not None:          # settling: at most idle_settle past the deadline
            remaining = max(remaining, idle_since + settle - clock())
        if remaining <= 0:
            stopped_by = "timeout"
            break
        sleep(min(params["poll_interval"], remaining))
    ready = absent or (stopped_by is None)
    result = {"ready": ready, "elapsed": round(clock() - start, 3), "budget": budget,
              "in_flight": first, "in_flight_last": last, "samples": samples, "server_absent": absent,
              "idle_settle": settle, "monotonic": clock(), "changed": False}
    if ready:
        return result, None
    result["stopped_by"] = stopped_by
    result["last_error"] = last_error or "%d running, %d waiting" % (last["running"], last["waiting"])
    if not params["fail_when_not_ready"]:
        return result, None
    return result, not_idle_message(params, base, result)


def not_idle_message(params: dict, base: str, result: dict) -> str:
    """The failure message of a wait for idle: what was and still is in flight, and the fix."""
    name = params["served_model_name"] or "the server"
    if result["stopped_by"] == "final" or result["in_flight_last"] is None:
        return ("vllm_ready: cannot tell whether %s on %s is idle: %s"
                % (name, base, result["last_error"]))
    first, last = result["in_flight"], result["in_flight_last"]
    return ("vllm_ready: %s on %s still had requests in flight after %s s (budget %s s): %d running, "
            "%d waiting (%d running, %d waiting when the wait began). Raise the timeout, or find the "
            "clients that reach the server without the load balancer"
            % (name, base, format_seconds(result["elapsed"]), format_seconds(result["budget"]["seconds"]),
               last["running"], last["waiting"], first["running"], first["waiting"]))
