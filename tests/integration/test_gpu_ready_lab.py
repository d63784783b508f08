"""gpu_ready's stale /dev/shm report and shm_cleanup on a real lab host, over SSH, through a playbook.

On the host: a dedicated service user, files in the real /dev/shm (its tmpfs) named like NCCL,
torch and vLLM leftovers, a process of that user holding one open, another mapping one (fd
closed), and a file of another user. gpu_ready only lists the unused ones (stale_shm) and changes
nothing; shm_cleanup's check mode removes nothing; its real run removes only the service user's
unused files; a second run changes nothing. The lab hosts have no NVIDIA driver, so gpu_ready
must also say `gpus: []` with the reason.
"""
from __future__ import annotations

import secrets
import shlex
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.lab

PLAYBOOK = Path(__file__).parent / "playbooks" / "gpu_ready_shm.yml"
USER = "msl-shmtest"
REPORT = "Check GPU readiness and report stale /dev/shm segments"
TASK = "Remove the stale /dev/shm segments"

HOLD_OPEN = "import sys, time; fh = open(sys.argv[1], 'rb'); time.sleep(float(sys.argv[2]))"
HOLD_MAP = (
    "import ctypes, os, sys, time\n"
    "libc = ctypes.CDLL(None)\n"
    "libc.mmap.restype = ctypes.c_void_p\n"
    "libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,"
    " ctypes.c_int, ctypes.c_long]\n"
    "fd = os.open(sys.argv[1], os.O_RDONLY)\n"
    "assert libc.mmap(None, os.fstat(fd).st_size, 1, 1, fd, 0) not in (None, 2**64 - 1)\n"
    "os.close(fd)\n"
    "time.sleep(float(sys.argv[2]))\n"
)


def module_result(run, task=TASK):
    """A task's result (the shm_cleanup task's by default) from the playbook's ansible-runner events."""
    for event in run.events:
        data = event.get("event_data", {})
        if event.get("event") in ("runner_on_ok", "runner_on_failed") and data.get("task") == task:
            return data["res"]
    raise AssertionError("no result for task %r in the run (rc=%s):\n%s"
                         % (task, run.rc, run.stdout[-4000:]))


def reported_and_removed(run, unused):
    """gpu_ready's and shm_cleanup's results of a run: gpu_ready reported the unused files and
    changed nothing, shm_cleanup removed (or would remove) exactly those."""
    assert run.rc == 0, run.stdout[-4000:]
    report, res = module_result(run, REPORT), module_result(run)
    assert report["changed"] is False
    assert sorted(Path(r["path"]).name for r in report["stale_shm"]) == sorted(unused)
    assert res["changed"] is True
    assert sorted(Path(r["path"]).name for r in res["removed"]) == sorted(unused)
    return report, res


def listing(lab, host, tag):
    out = lab.ssh(host, "ls -1 /dev/shm | grep -F -- %s || true" % shlex.quote(tag)).stdout
    return sorted(out.split())


def start_holder(lab, host, script, path, seconds=180):
    """A process of the service user holding `path`; returns its PID once /proc shows it."""
    cmd = ("setsid runuser -u %s -- python3 -c %s %s %d </dev/null >/dev/null 2>&1 & echo $!"
           % (USER, shlex.quote(script), shlex.quote(path), seconds))
    pid = int(lab.ssh(host, cmd).stdout.split()[-1])
    deadline = time.monotonic() + 20
    probe = ("{ grep -ls -- %s /proc/[0-9]*/maps; find /proc/[0-9]*/fd -lname %s; } "
             "2>/dev/null | head -1" % (shlex.quote(path), shlex.quote(path)))
    while time.monotonic() < deadline:
        # runuser forks: its python child holds the file once /proc shows it in fds or maps.
        if lab.ssh(host, probe, check=False).stdout.strip():
            return pid
        time.sleep(0.3)
    raise AssertionError("holder of %s did not start on %s" % (path, host))


def test_shm_cleanup_on_a_lab_host(lab):
    host = lab.hosts[0]
    tag = "mstest%s" % secrets.token_hex(3)
    unused = ["nccl-%s-1" % tag, "psm_%s" % tag, "sem.mp-%s" % tag, "vllm_%s_buf" % tag,
              "sem.loky-%s" % tag]
    held, mapped, theirs = "psm_%s_held" % tag, "nccl-%s-mapped" % tag, "vllm_%s_theirs" % tag
    everything = sorted(unused + [held, mapped, theirs])
    lab.ssh(host, "id -u %s >/dev/null 2>&1 || useradd --system --no-create-home "
                  "--shell /usr/sbin/nologin %s" % (USER, USER))
    make = " && ".join(
        "head -c 4096 /dev/zero > /dev/shm/%s && chown %s /dev/shm/%s"
        % (name, "nobody" if name == theirs else USER, name) for name in everything)
    lab.ssh(host, make)
    holders = []
    try:
        holders.append(start_holder(lab, host, HOLD_OPEN, "/dev/shm/" + held))
        holders.append(start_holder(lab, host, HOLD_MAP, "/dev/shm/" + mapped))
        extra = {"gpu_ready_test_hosts": host, "gpu_ready_test_user": USER,
                 "gpu_ready_test_patterns": ["sem.loky-*"]}

        # Check mode: gpu_ready lists the stale files, shm_cleanup what would go; nothing is removed.
        check = lab.playbook(str(PLAYBOOK), extra, check=True, diff=True, limit=host)
        report, res = reported_and_removed(check, unused)
        assert res["bytes_freed"] == 4096 * len(unused)
        assert listing(lab, host, tag) == everything

        # The lab host has no NVIDIA driver: no GPUs, with the reason, and not an error.
        assert report["gpus"] == [] and report["nvml"]["available"] is False
        assert "NVML not available" in report["nvml"]["reason"]

        # The real run: gpu_ready still removes nothing, shm_cleanup exactly the unused files of
        # the service user.
        real = lab.playbook(str(PLAYBOOK), extra, diff=True, limit=host)
        report, res = reported_and_removed(real, unused)
        assert listing(lab, host, tag) == sorted([held, mapped, theirs])
        in_use = {Path(e["path"]).name: e["holders"] for e in res["in_use"]}
        assert sorted(in_use) == sorted([held, mapped])
        assert "fd" in in_use[held][0]["via"] and in_use[held][0]["user"] == USER
        assert in_use[mapped][0]["via"] == ["mmap"] and in_use[mapped][0]["user"] == USER
        assert [Path(e["path"]).name for e in res["other_owner"]] == [theirs]
        assert res["unverified"] == [] and res["refused"] == []

        # Nothing left to do.
        again = lab.playbook(str(PLAYBOOK), extra, limit=host)
        assert again.rc == 0
        assert module_result(again, REPORT)["stale_shm"] == []
        assert module_result(again)["changed"] is False
        assert listing(lab, host, tag) == sorted([held, mapped, theirs])
    finally:
        for pid in holders:
            # The holder was started through setsid: end its whole session (it is ours).
            lab.ssh(host, "kill -- -%d 2>/dev/null; kill %d 2>/dev/null; true" % (pid, pid),
                    check=False)
        lab.ssh(host, "rm -f -- %s" % " ".join("/dev/shm/" + n for n in everything), check=False)
