# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0 (see galaxy.yml)
"""One migration at a time per host: the host's lease (issue 27).

A lease is a small JSON file on the host (default /var/lib/modelswap/lease.json) naming the run
that holds it::

    {"schema": 1, "run_id": "20261205T141200Z-ab12cd", "controller": "ctl01", "user": "alice",
     "pid": 4242, "started": 1796472720.0, "renewed": 1796472720.0, "expires": 1796487120.0,
     "purpose": "migrate"}

A run takes it before it changes the host and gives it back at the end; a second run finds it held
and refuses before it changes anything, naming the holder and how to take a dead run's lease over:
the lease expires, or the operator names the dead run (``-e modelswap_break_lease=<run id>``), as
Terraform's state lock and ``force-unlock`` do. A takeover is always said, never silent.

``decide`` is the pure rule (tested as a table); ``apply`` reads, decides and writes under an
exclusive ``flock`` on ``<path>.lock``, so of two runs that come at once one takes the lease and
the other sees it held; ``plan`` decides without writing (check mode). Nothing here imports Ansible.
"""
from __future__ import annotations

import json
import os
import re
import time

from ansible_collections.modelswap.vllm.plugins.module_utils.common.fsutil import atomic_write_text, locked

SCHEMA = 1
STATES = ("held", "released", "read")
ACTIONS = ("take", "renew", "refuse", "release", "none")
FIELDS = ("schema", "run_id", "controller", "user", "pid", "started", "renewed", "expires", "purpose")
DEFAULT_PATH = "/var/lib/modelswap/lease.json"


class LeaseError(Exception):
    """The lease file cannot be used; the message names it and says what to do."""


# --------------------------------------------------------------------------------------------
# words: times in UTC, durations, the holder
# --------------------------------------------------------------------------------------------
def duration(seconds: float) -> str:
    """``42s``, ``5m``, ``3h55m``, ``2d4h``: a span as an operator reads it."""
    seconds = int(abs(seconds))
    if seconds < 60:
        return "%ds" % seconds
    minutes = seconds // 60
    if minutes < 60:
        return "%dm" % minutes
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return "%dh%02dm" % (hours, minutes)
    days, hours = divmod(hours, 24)
    return "%dd%dh" % (days, hours)


def utc(epoch, now: float) -> str:
    """``14:12:00 UTC`` on the day of ``now`` (UTC), ``2026-12-04 14:12:00 UTC`` on another day."""
    try:
        moment = time.gmtime(float(epoch))
    except (TypeError, ValueError, OverflowError, OSError):
        return "an unknown time"
    same_day = moment[:3] == time.gmtime(now)[:3]
    return time.strftime("%H:%M:%S UTC" if same_day else "%Y-%m-%d %H:%M:%S UTC", moment)


def _relative(epoch, now: float) -> str:
    try:
        delta = float(epoch) - now
    except (TypeError, ValueError):
        return "?"
    return ("in " + duration(delta)) if delta > 0 else (duration(delta) + " ago")


def describe(lease: dict, now: float) -> str:
    """``run R (controller C, user U, PID P, since T, expires E (in 3h55m), for migrate)``: what
    the lease says of its run (``expired E (5m ago)`` once past; fields it lacks are left out)."""
    who = ["%s %s" % (label, lease[key]) for key, label in
           (("controller", "controller"), ("user", "user"), ("pid", "PID")) if lease.get(key)]
    try:
        past = float(lease.get("expires")) <= now
    except (TypeError, ValueError):
        past = False
    when = ["since %s" % utc(lease.get("started"), now),
            "%s %s (%s)" % ("expired" if past else "expires", utc(lease.get("expires"), now),
                            _relative(lease.get("expires"), now))]
    purpose = ["for %s" % lease["purpose"]] if lease.get("purpose") else []
    return "run %s (%s)" % (lease.get("run_id"), ", ".join(who + when + purpose))


def refusal_message(holder: dict, host: str, now: float, break_lease: str = "") -> str:
    """Why a run may not change ``host``: who holds it, and how to take over a dead run's lease.
    With ``break_lease`` (a run id that is not the holder's), says so: the wrong lease is never
    broken."""
    run_id = holder.get("run_id")
    if break_lease and break_lease != run_id:
        return ("host_lease: %s is held by %s, not by run %s that modelswap_break_lease names: the lease "
                "of another run is never broken; if run %s is dead, run again with -e "
                "modelswap_break_lease=%s; nothing was changed"
                % (host, describe(holder, now), break_lease, run_id, run_id))
    return ("host_lease: %s is held by %s: another migration is changing this host; wait for it to "
            "finish, or if that run is dead, run again with -e modelswap_break_lease=%s; nothing was "
            "changed" % (host, describe(holder, now), run_id))


# --------------------------------------------------------------------------------------------
# the rule
# --------------------------------------------------------------------------------------------
def new_lease(request: dict, now: float, started=None) -> dict:
    ttl = float(request.get("ttl") or 0)
    if ttl <= 0:
        raise ValueError("ttl must be a number of seconds above 0, not %r" % request.get("ttl"))
    return {"schema": SCHEMA, "run_id": request["run_id"], "controller": request.get("controller") or "",
            "user": request.get("user") or "", "pid": int(request.get("pid") or 0),
            "started": now if started is None else started, "renewed": now, "expires": now + ttl,
            "purpose": request.get("purpose") or "migrate"}


def decide(current, request: dict, now: float) -> dict:
    """What to do with the lease ``current`` (a dict, or None when nobody holds it) for
    ``request`` (state held|released|read, run_id, controller, user, pid, ttl, break_lease,
    purpose) at ``now``.

    Returns {"action": take|renew|refuse|release|none, "reason", "previous": current,
    "lease": what to write (take, renew) or None, "taken_over": bool}.
    """
    state = request.get("state") or "held"
    if state not in STATES:
        raise ValueError("state must be one of %s, not %r" % (", ".join(STATES), state))
    run_id = request.get("run_id") or ""
    if state != "read" and not run_id:
        raise ValueError("state=%s needs the run's run_id" % state)
    out = {"action": "none", "reason": "", "previous": current, "lease": None, "taken_over": False}
    mine = bool(current) and current.get("run_id") == run_id
    if state == "read":
        out["reason"] = ("held by " + describe(current, now)) if current else "not held"
        return out
    if state == "released":
        if mine:
            out.update(action="release", reason="released by run %s" % run_id)
        elif current:
            out["reason"] = ("held by another run, %s: left as it is (a run only gives back its own "
                             "lease)" % describe(current, now))
        else:
            out["reason"] = "not held: nothing to give back"
        return out
    break_lease = request.get("break_lease") or ""
    if not current:
        out.update(action="take", lease=new_lease(request, now), reason="taken by run %s" % run_id)
    elif mine:
        out.update(action="renew", lease=new_lease(request, now, started=current.get("started", now)),
                   reason="renewed by run %s" % run_id)
    elif break_lease and break_lease != current.get("run_id"):
        out.update(action="refuse",
                   reason="modelswap_break_lease=%s does not name the holder: the lease is held by %s; "
                          "the lease of another run is never broken" % (break_lease, describe(current, now)))
    elif float(current["expires"]) <= now:
        out.update(action="take", lease=new_lease(request, now), taken_over=True,
                   reason="took over the expired lease of %s" % describe(current, now))
    elif break_lease:
        out.update(action="take", lease=new_lease(request, now), taken_over=True,
                   reason="taken over from run %s as asked (modelswap_break_lease); its lease: %s"
                          % (current.get("run_id"), describe(current, now)))
    else:
        out.update(action="refuse", reason="held by " + describe(current, now))
    return out


# --------------------------------------------------------------------------------------------
# the file
# --------------------------------------------------------------------------------------------
def _corrupt(path: str, why: str) -> LeaseError:
    return LeaseError("the lease file %s is not a lease (%s); inspect it, and remove it if no migration "
                      "runs on this host" % (path, why))


def parse(text: str, path: str):
    """The lease in ``text`` (the content of ``path``); None for an empty file."""
    if not text.strip():
        return None
    try:
        lease = json.loads(text)
    except ValueError as exc:
        raise _corrupt(path, "not JSON: %s" % exc)
    if not isinstance(lease, dict):
        raise _corrupt(path, "not a JSON object")
    if not isinstance(lease.get("run_id"), str) or not lease["run_id"]:
        raise _corrupt(path, "no run_id")
    if isinstance(lease.get("expires"), bool) or not isinstance(lease.get("expires"), (int, float)):
        raise _corrupt(path, "no expires time")
    return lease


def read(path: str):
    """The lease at ``path``, or None when there is none."""
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except FileNotFoundError:
        return None
    except UnicodeDecodeError as exc:
        raise _corrupt(path, "not UTF-8 text: %s" % exc)
    return parse(text, path)


def dumps(lease: dict) -> str:
    return json.dumps(lease, indent=2, sort_keys=True) + "\n"


def plan(path: str, request: dict, now: float) -> dict:
    """The decision, without a lock or a write (check mode, state=read)."""
    return decide(read(path), request, now)


def apply(path: str, request: dict, now: float) -> dict:
    """Read, decide and do it (write the lease, 0644, atomically; or remove it), all under the
    lock: of two runs at once, one takes the lease and the other sees it held."""
    with locked(path, mode=0o644):   # the lease's lock file is readable, like the lease
        decision = decide(read(path), request, now)
        if decision["action"] in ("take", "renew"):
            atomic_write_text(path, dumps(decision["lease"]), 0o644)
        elif decision["action"] == "release":
            os.unlink(path)
        return decision


_RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:+-]*\Z")
# what check mode says it would do, per action
WOULD = {"take": "would take the lease", "renew": "would renew the lease", "release": "would give the lease back",
         "refuse": "would refuse", "none": "would change nothing"}
# a request's fields (host_lease's options but path)
REQUEST_FIELDS = ("state", "run_id", "controller", "user", "pid", "ttl", "break_lease", "purpose")
# the options every lease request takes besides state and run_id, as an argument_spec (host_lease's
# own, and migrate_info's lease option)
LEASE_OPTIONS = dict(
    path=dict(type="path", default=DEFAULT_PATH),
    controller=dict(type="str", default=""),
    user=dict(type="str", default=""),
    pid=dict(type="int", default=0),
    ttl=dict(type="int", default=14400),
    break_lease=dict(type="str", default=""),
    purpose=dict(type="str", default="migrate"),
)


def request_problem(request: dict) -> str:
    """Why a request is unusable (naming the option), or ''."""
    if request["ttl"] <= 0:
        return "ttl must be a number of seconds above 0, not %d" % request["ttl"]
    for option in ("run_id", "break_lease"):
        value = request[option]
        if value and not _RUN_ID_RE.match(value):
            return ("%s %r is not a run id (letters, digits, '_', '.', ':', '+', '-'; no blanks)"
                    % (option, value))
    if request["state"] != "read" and not request["run_id"]:
        return "state=%s needs run_id (the id of this run)" % request["state"]
    return ""


def outcome(path: str, request: dict, now: float, check_mode: bool, host: str) -> dict:
    """What a module reports for a request: its result, and `failed` with `msg` (nothing was
    changed) when the request is unusable, the lease cannot be read or written, or another run
    holds it. Check mode and state=read only decide; otherwise the decision is applied."""
    why = request_problem(request)
    if why:
        return {"failed": True, "msg": "host_lease: %s (nothing was changed)" % why, "path": path}
    try:
        if check_mode or request["state"] == "read":
            decision = plan(path, request, now)
        else:
            decision = apply(path, request, now)
    except LeaseError as exc:
        return {"failed": True, "msg": "host_lease: %s; nothing was changed" % exc, "path": path}
    except OSError as exc:
        return {"failed": True, "path": path,
                "msg": "host_lease: %s: %s; run with become, and check that its folder is writable; "
                       "nothing was changed" % (getattr(exc, "filename", None) or path, exc.strerror or exc)}
    action = decision["action"]
    if action in ("take", "renew"):
        lease = decision["lease"]
    elif action == "release":
        lease = None
    else:
        lease = decision["previous"]
    result = {"action": action, "reason": decision["reason"], "lease": lease, "previous": decision["previous"],
              "taken_over": decision["taken_over"], "path": path,
              "changed": action in ("take", "renew", "release")}
    if check_mode:
        result["would"] = "%s (%s); check mode: nothing was written" % (
            WOULD[action] + (" for run %s" % request["run_id"] if action in ("take", "renew") else ""),
            decision["reason"])
    if action == "refuse":
        # the holder is also the lease now: a refusal changes nothing
        result.update(failed=True, changed=False, holder=decision["previous"],
                      msg=refusal_message(decision["previous"], host, now, request["break_lease"]))
    return result
