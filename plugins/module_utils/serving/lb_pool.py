# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0 (see galaxy.yml)
"""A host's place in its load balancer's pool: the pool as read, the floor, the lb_pool role's results.

The lb_pool role takes a host out of its load balancer's pool before its vLLM stops (drain) and
puts it back once the new model proved it serves (rejoin). Whatever the load balancer, the role
sees the pool as a list of servers, ``{"name", "status", "serving", "healthy", "admin",
"sessions", "weight", "check", "lastchg"}``:

- HAProxy: its stats page as CSV (``haproxy_servers``), the same columns ``show stat`` prints on
  the runtime API;
- any other load balancer: what the role's state hook sets (``hook_servers`` checks it), at least
  ``name`` and ``serving``.

``pool_view`` judges the floor: a drain is refused when fewer than ``min_serving`` servers would
still serve, counting every server that leaves with this one (the hosts of the same serial
batch). A server that does not serve now can always leave: taking it out lowers nothing (and a
fleet where nothing serves yet can be deployed). ``pool_result`` turns the view and the tasks'
results into the fact each entry point publishes, with a one-line message for the preview.

Pure functions over plain values, used on the controller through plugins/filter/lb_pool.py and
table-tested in tests/unit/plugins/filter/test_lb_pool.py.
"""
from __future__ import annotations

import csv
from collections.abc import Mapping

# HAProxy's server statuses that receive new requests: "UP", "UP 1/3" (up, a check failed:
# going down), "no check" (no health check: always up). "NOLB", "DRAIN", "MAINT", "DOWN" and
# "DOWN 1/2" (down, going up) do not.
SERVER_ROWS_EXCLUDED = ("FRONTEND", "BACKEND")


class PoolError(Exception):
    """The pool cannot be read or judged; the message names what, where, and the fix."""


def _int(value, default=0):
    try:
        return int(float(value))
    except (TypeError, ValueError):
        return default


def haproxy_status_serving(status: str, weight: int = 1) -> bool:
    """Does a server of this HAProxy status (and weight) receive new requests?"""
    status = (status or "").strip()
    up = status == "UP" or status.startswith("UP ") or status == "no check"
    return up and weight > 0


def haproxy_admin(status: str) -> str:
    """The administrative state an HAProxy status shows: maint, drain or ready."""
    status = (status or "").strip().upper()
    if status.startswith("MAINT"):
        return "maint"
    if status.startswith("DRAIN"):
        return "drain"
    return "ready"


def haproxy_servers(text, backend: str, source: str = "the stats") -> list:
    """The servers of ``backend`` in HAProxy's stats CSV (the stats page's ``;csv`` or the
    runtime API's ``show stat``), in the configuration's order. ``text`` may also be the result
    of the ansible.builtin.uri read of the stats page (its status is checked, its content read)."""
    if isinstance(text, Mapping):
        if text.get("status") != 200:
            raise PoolError("cannot read %s: %s" % (source, text.get("msg") or "HTTP %s" % text.get("status")))
        text = text.get("content")
    if not isinstance(text, str) or not text.strip():
        raise PoolError("%s answered nothing: is it HAProxy's stats page (its URL ends in ;csv)?" % source)
    rows = list(csv.DictReader(text.lstrip("# ").splitlines()))
    if not rows or "pxname" not in rows[0] or "status" not in rows[0]:
        raise PoolError("%s is not HAProxy's stats CSV (no pxname and status columns): %s"
                        % (source, text.strip().splitlines()[0][:120]))
    backends = sorted({r["pxname"] for r in rows if r.get("svname") == "BACKEND"})
    if backend not in backends:
        raise PoolError("backend %r is not in %s (backends there: %s): set lb_pool_haproxy_backend"
                        % (backend, source, ", ".join(backends) or "none"))
    servers = []
    for row in rows:
        if row.get("pxname") != backend or row.get("svname") in SERVER_ROWS_EXCLUDED:
            continue
        status = (row.get("status") or "").strip()
        weight = _int(row.get("weight"), 1)
        servers.append({
            "name": row["svname"],
            "status": status,
            "serving": haproxy_status_serving(status, weight),
            "healthy": status in ("UP", "no check"),
            "admin": haproxy_admin(status),
            "sessions": _int(row.get("scur")),
            "weight": weight,
            "check": (row.get("check_status") or "").strip() or None,
            "lastchg": _int(row.get("lastchg"), None),
        })
    return servers


HOOK_CONTRACT = ("the state hook (lb_pool_state_tasks) must set lb_pool_hook_servers to a list of "
                 "{name: <server>, serving: <bool>} (status, sessions optional) or a mapping of "
                 "server name to serving (a bool)")


def hook_servers(value) -> list:
    """The servers a state hook reported (lb_pool_hook_servers), checked and in the view's shape:
    a list of {name, serving, status?, sessions?, healthy?, admin?, weight?, check?}, or a mapping
    {name: serving} (the shortest thing a hook can build with filters)."""
    if isinstance(value, dict):
        value = [{"name": name, "serving": serving} for name, serving in value.items()]
    if not isinstance(value, list):
        raise PoolError("%s; it set %s" % (HOOK_CONTRACT, "nothing" if value is None else type(value).__name__))
    servers = []
    for item in value:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) \
                or not isinstance(item.get("serving"), bool):
            raise PoolError("%s; one item is %r" % (HOOK_CONTRACT, item))
        status = str(item.get("status") or ("serving" if item["serving"] else "out"))
        servers.append({
            "name": item["name"], "status": status, "serving": item["serving"],
            "healthy": bool(item.get("healthy", item["serving"])),
            "admin": str(item.get("admin") or ("ready" if item["serving"] else "out")),
            "sessions": _int(item.get("sessions"), None), "weight": _int(item.get("weight"), None),
            "check": item.get("check"), "lastchg": _int(item.get("lastchg"), None),
        })
    return servers


def _status_list(servers) -> str:
    return ", ".join("%s %s" % (s["name"], s["status"]) for s in servers) or "no server"


def pool_label(pool: str) -> str:
    """How messages name a pool: "pool vllm", or a name that already reads ("the pool")."""
    pool = pool or "the pool"
    return pool if pool.startswith("the ") else "pool %s" % pool


def pool_view(servers: list, server: str, min_serving: int = 1, leaving=None, pool: str = "the pool",
              lb_type: str = "haproxy") -> dict:
    """The pool as this host sees it, and the floor's verdict on taking ``server`` out.

    ``leaving``: the servers that leave together with this one (the hosts of the same serial
    batch); ``server`` always leaves. Only those of them that serve now lower the count.
    """
    min_serving = _int(min_serving, 1)
    label = pool_label(pool)
    names = [s["name"] for s in servers]
    this = next((s for s in servers if s["name"] == server), None)
    leave = [n for n in dict.fromkeys(list(leaving or []) + [server]) if n in names]
    serving = [s["name"] for s in servers if s["serving"]]
    would_stay = [n for n in serving if n not in leave]
    view = {
        "type": lb_type, "pool": pool, "server": server, "found": this is not None,
        "this": this, "status": this["status"] if this else None,
        "servers": servers, "serving": len(serving), "serving_names": serving,
        "total": len(servers), "leaving": leave, "would_stay": len(would_stay),
        "min_serving": min_serving, "floor_ok": True, "problem": None,
        "label": label,
        "line": "%s: %s (%d of %d serving)" % (label, _status_list(servers), len(serving), len(servers)),
    }
    if this is None:
        view["floor_ok"] = False
        view["problem"] = ("lb_pool: %s is not a server of %s (servers: %s): set lb_pool_server to its "
                           "name there. Nothing was changed." % (server, label, ", ".join(names) or "none"))
    elif this["serving"] and len(would_stay) < min_serving:
        view["floor_ok"] = False
        others = [n for n in leave if n != server and n in serving]
        view["problem"] = (
            "lb_pool: refusing to take %s out of %s: %d of %d servers serve now (%s) and %d would stay "
            "serving%s, fewer than the floor of %d (lb_pool_min_serving, modelswap_min_serving). "
            "Nothing was changed. Bring another server back into service first, roll fewer hosts at "
            "a time (serial), or lower modelswap_min_serving, and run again."
            % (server, label, len(serving), len(servers), _status_list(servers), len(would_stay),
               " (leaving with it: %s)" % ", ".join(others) if others else "", min_serving))
    return view


def host_pool(lb_type, stats, backend: str, server: str, source: str = "the stats") -> dict:
    """One host's place in its pool, for the fleet table (fleet_status): ``{"type", "found",
    "status", "serving", "admin", "check", "label", "text"}``. ``label`` is the table's column
    (HAProxy's status without its "(via ...)" detail, "not in the pool", "unreadable" or "-"),
    ``text`` the same with the reason. HAProxy: ``stats`` is the pool entry point's result
    (lb_pool_result, read once for every host: its ``servers``), ``{"failed": true, "msg"}`` when
    that read failed, or the uri read of the stats page (or the CSV). none, and the hooks (their
    state task file is not run here): "-". Never raises: an unreadable pool is a state of the table."""
    lb_type = lb_type or "none"
    out = {"type": lb_type, "found": None, "status": None, "serving": None, "admin": None, "check": None,
           "label": "-", "text": "-"}
    if lb_type != "haproxy":
        return out
    if isinstance(stats, Mapping) and stats.get("skipped"):
        return dict(out, label="unreadable", text="unreadable: %s was not read (the task was skipped)" % source)
    if isinstance(stats, Mapping) and stats.get("failed"):
        return dict(out, label="unreadable", text="unreadable: %s" % str(stats.get("msg") or "the pool could not be read").strip())
    try:
        servers = (list(stats["servers"]) if isinstance(stats, Mapping) and stats.get("action") == "pool"
                   else haproxy_servers(stats, backend, source))
    except PoolError as exc:
        return dict(out, label="unreadable", text="unreadable: %s" % exc)
    view = pool_view(servers, server, pool=backend)
    this = view["this"]
    if this is None:
        return dict(out, found=False, label="not in the pool",
                    text="not in the pool (%s: %s)" % (view["label"], _status_list(servers)))
    # UP with weight 0 gets no requests: say so, or "UP" would read as serving
    weight0 = ", weight 0" if not this["serving"] and this["status"].startswith("UP") else ""
    return dict(out, found=True, status=this["status"], serving=this["serving"], admin=this["admin"],
                check=this["check"], label=(this["status"].split(" (", 1)[0] or "?") + weight0,
                text=this["status"] + weight0)


def _seconds(value):
    try:
        return round(float(value), 1)
    except (TypeError, ValueError):
        return None


def _secs_text(value) -> str:
    """Seconds for a message: 300 -> "300", 2.46 -> "2.5"."""
    secs = _seconds(value)
    if secs is None:
        return "?"
    return "%d" % secs if secs == int(secs) else "%.1f" % secs


def _in_flight_text(counts, absent=False) -> str:
    if absent:
        return "nothing answers on its vLLM port"
    if not counts:
        return "no reading"
    return "%d running, %d waiting" % (counts.get("running", 0), counts.get("waiting", 0))


def pool_result(action: str, view: dict, *, check_mode: bool = False, now: float = 0.0, changed: bool = False,
                before: dict | None = None, after: dict | None = None, idle: dict | None = None,
                drain: dict | None = None, timeout: float | None = None, lb_type: str | None = None,
                out_at: float | None = None, sessions_left: int | None = None) -> dict:
    """The fact an entry point publishes (lb_pool_result; lb_pool_results[action]).

    action: pool, drain or rejoin. view: pool_view of the pool read before the action (or, for a
    rejoin, after it). before / after: {"status"} of the server as the change saw it before and
    after (community.general.haproxy's state_before / state_after). idle:
    vllm_ready state=idle's result (drain; None when the wait gave up before it). drain: the
    host's drain result (rejoin: how long it was out). now: the controller's epoch seconds.
    timeout: the bound the action waits with. out_at: epoch seconds when the drain took the
    server out. sessions_left: the load balancer's sessions on the server when its wait ended
    (HAProxy), 0 when they all ended.
    """
    lb_type = lb_type or view.get("type") or "none"
    this = view.get("this") or {}
    out = {
        "action": action, "type": lb_type, "pool": view.get("pool"), "server": view.get("server"),
        "check_mode": bool(check_mode),
        "changed": bool(changed) and not check_mode and action in ("drain", "rejoin") and lb_type != "none",
        "status_before": this.get("status"), "status_after": None,
        # each server as read (a caller judges its own host against them: the migration's plan,
        # the fleet table)
        "servers": [dict(s) for s in view.get("servers") or []],
        "serving": view.get("serving"), "total": view.get("total"),
        "min_serving": view.get("min_serving"), "floor_ok": view.get("floor_ok"),
        "at": round(float(now), 3) if now else None, "message": "",
    }
    name, pool = out["server"], view.get("label") or pool_label(out["pool"])
    if lb_type == "none":
        out.update(status_before=None, serving=None, total=None, floor_ok=None, servers=[])
        out["message"] = ("no load balancer (lb_pool_type: none): %s is not %s" %
                          (name, {"pool": "in a pool that modelswap knows",
                                  "drain": "taken out of a pool before its server stops",
                                  "rejoin": "put back into a pool"}.get(action, "touched")))
        return out
    if action == "pool":
        out["status_after"] = out["status_before"]
        out["message"] = view.get("line", "")
        if view.get("problem"):
            out["message"] += "; a drain of %s would be refused: %s" % (name, view["problem"])
        return out
    if action == "drain":
        idle = idle or {}
        out["sessions_at_start"] = this.get("sessions")
        out["in_flight_at_start"] = idle.get("in_flight")
        out["serving_after"] = view.get("would_stay")
        if check_mode:
            out.update(status_after=out["status_before"], out_since=None, drain_seconds=None, idle=None,
                       sessions_left=None)
            lb_now = "%s on the load balancer, " % out["sessions_at_start"] if lb_type == "haproxy" else ""
            out["message"] = (
                "would take %s out of %s (%s now; %d of %d serving, %d would stay, floor %d) and wait up to "
                "%s s for its requests in flight (%s%s now)"
                % (name, pool, out["status_before"], view.get("serving", 0), view.get("total", 0),
                   view.get("would_stay", 0), view.get("min_serving", 0), _secs_text(timeout), lb_now,
                   _in_flight_text(idle.get("in_flight"), idle.get("server_absent"))))
            return out
        out["status_after"] = (after or {}).get("status")
        out["out_since"] = round(float(out_at), 3) if out_at else None
        out["drain_seconds"] = round(float(now) - float(out_at), 1) if (out_at and now) else None
        out["sessions_left"] = sessions_left
        vllm_idle = bool(idle.get("ready"))
        out["idle"] = vllm_idle and not sessions_left
        if sessions_left:
            waited = ("%d request(s) still in flight on the load balancer after %s s: they end when the "
                      "server stops" % (sessions_left, _secs_text(out["drain_seconds"])))
        elif idle.get("server_absent"):
            waited = "nothing answered on its vLLM port: nothing was in flight"
        elif vllm_idle:
            lb_start = ("%s on the load balancer; " % out["sessions_at_start"]
                        if out["sessions_at_start"] is not None else "")
            waited = "its requests in flight (%s%s) ended in %s s" % (
                lb_start, _in_flight_text(idle.get("in_flight")), _secs_text(out["drain_seconds"]))
        else:
            waited = "requests still in flight after %s s (%s): they end when the server stops" % (
                _secs_text(out["drain_seconds"]), _in_flight_text(idle.get("in_flight_last")))
        out["message"] = "%s out of %s (%s -> %s; %d of %d still serving); %s" % (
            name, pool, out["status_before"], out["status_after"], view.get("would_stay", 0),
            view.get("total", 0), waited)
        return out
    if action == "rejoin":
        drain = drain or {}
        out["status_before"] = ((before or {}).get("status") or drain.get("status_after")
                                or out["status_before"])
        since = drain.get("out_since")
        if check_mode:
            out["status_after"] = out["status_before"]
            out["message"] = ("would put %s back into %s (%s) and wait up to %s s until the load balancer "
                              "says it serves" % (name, pool, "out of it after the drain" if drain else
                                                  "%s now" % (this.get("status") or "not found"),
                                                  _secs_text(timeout)))
            out["seconds_out"] = None
            return out
        out["status_after"] = this.get("status")
        out["seconds_out"] = round(float(now) - float(since), 1) if (since and now) else None
        out["rejoin_seconds"] = this.get("lastchg") if lb_type == "haproxy" else None
        out["message"] = "%s back in %s (%s -> %s%s%s; %d of %d serving)" % (
            name, pool, out["status_before"] or "?", out["status_after"],
            (", UP within 1 s" if out["rejoin_seconds"] < 1 else ", UP after %s s" % _secs_text(out["rejoin_seconds"]))
            if out["rejoin_seconds"] is not None else "",
            ", out of the pool for %s s" % _secs_text(out["seconds_out"]) if out["seconds_out"] is not None else "",
            view.get("serving", 0), view.get("total", 0))
        return out
    raise PoolError("lb_pool: unknown action %r (pool, drain or rejoin)" % action)


def haproxy_sessions(text, backend: str, server: str) -> int:
    """The sessions HAProxy holds on one server now (its requests in flight, streams included);
    0 when the server is not listed."""
    this = next((s for s in haproxy_servers(text, backend) if s["name"] == server), None)
    return int(this["sessions"] or 0) if this else 0


def rejoin_failure(view: dict, timeout) -> str:
    """Why a rejoin did not end with the server serving, and what to check."""
    this = view.get("this") or {}
    return ("lb_pool: %s was put back into %s but the load balancer did not say it serves within %s s "
            "(now %s%s): its health check fails or it serves nothing. The host stays as it is: check "
            "its server, then rejoin it (tasks_from: rejoin) or take it out (tasks_from: drain)."
            % (view.get("server"), view.get("label") or pool_label(view.get("pool")), _secs_text(timeout),
               this.get("status") or "not found",
               ", check %s" % this["check"] if this.get("check") else ""))
