# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0
"""What a vLLM unit and its port are now: the unit's state and journal, the port's owners.

``UnitReader`` reads a unit's state (``systemctl show``) and journal (``journalctl``) through a
``HostCommands``; ``unit_problem`` says why a starting unit cannot become ready, ``journal_errors``
picks the lines of its journal that say why it failed.

The port owner is read from /proc (``/proc/net/tcp*`` -> socket inode -> ``/proc/PID/fd``), and a
process's systemd unit from ``/proc/PID/cgroup``, so a second vLLM sharing the port
(SO_REUSEPORT) or a stray process is caught, not mistaken for the new service. Every function
that reads /proc takes the procfs root, so the tests drive it with fake /proc trees.
"""
from __future__ import annotations

import os
import re
import socket

from ansible_collections.modelswap.vllm.plugins.module_utils.common import procfs
from ansible_collections.modelswap.vllm.plugins.module_utils.serving.served_model import parse_systemctl_show

PROC = "/proc"

# Journal lines scanned for the errors of a failed start (the root cause can be a traceback or
# two before the end).
JOURNAL_SCAN = 2000


class ReadyError(Exception):
    """The module fails with this message and no result (a bad option, an unreadable unit)."""


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

    def journal(self, since_epoch, lines=JOURNAL_SCAN, output="short-iso") -> list:
        """The unit's newest ``lines`` journal lines since ``since_epoch``, oldest first
        (``output``: journalctl's format; ``short-unix`` starts each line with epoch seconds).

        (With --since, journalctl's --lines counts from the start of the range; --reverse makes
        it keep the newest.)
        """
        if not self.journalctl or lines <= 0:
            return []
        rc, out, _err = self.commands.run(
            [self.journalctl, "--unit", self.name, "--since", "@%d" % int(since_epoch),
             "--reverse", "--lines", str(lines), "--no-pager", "--output", output, "--quiet"])
        return out.splitlines()[::-1] if rc == 0 else []


# --------------------------------------------------------------------------------------------
# why a unit failed, from its journal
# --------------------------------------------------------------------------------------------
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
        addr, _unused, port_hex = parts[1].rpartition(":")
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
