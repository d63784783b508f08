"""Run shm_cleanup (or gpu_ready's stale report) inside a fresh PID namespace (a container's view of /proc).

    unshare --pid --fork --mount-proc python -m tests.support.shm_ns SPEC.json

The module refuses to remove anything while some process cannot be inspected; on some machines
(this project's VMs) PID 1 hides its maps even from root. Inside a new PID namespace every
process is the test's own, so the cleanup can be exercised end to end: the holders started here
are real processes holding files open or mapped, and the module runs exactly as Ansible runs it.

SPEC: {"dir": path, "hold_fd": [names], "hold_map": [names], "readonly": bool (bind-mount "dir"
       read-only in the namespace's own mount table first),
       "runs": [{"module": name (default shm_cleanup), "args": {...}, "check_mode": bool,
                 "diff": bool, "env": {...}}, ...]}
Prints JSON: {"holders": {name: pid}, "runs": [{"result": {...}, "after": [names]}]}.

Tests call `in_namespace(tmp_path, spec)` (and mark themselves with `NEEDS_NAMESPACE`).
"""
from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import subprocess
import sys

import pytest

from tests.support.holders import holding
from tests.support.modules import REPO, run_module

UNSHARE = shutil.which("unshare")
NEEDS_NAMESPACE = pytest.mark.skipif(os.geteuid() != 0 or not UNSHARE,
                                     reason="a PID namespace (unshare, root) isolates the /proc scan")


def in_namespace(tmp_path, spec):
    """Run SPEC (see above) in a fresh PID and mount namespace; its printed JSON."""
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    proc = subprocess.run([UNSHARE, "--pid", "--fork", "--mount-proc", sys.executable, "-m",
                           "tests.support.shm_ns", str(path)], cwd=REPO, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def main(spec_path):
    with open(spec_path, encoding="utf-8") as fh:
        spec = json.load(fh)
    out = {"holders": {}, "runs": [], "pid": os.getpid()}
    if spec.get("readonly"):
        # --mount-proc gave this process a private mount namespace: the host's view is untouched.
        for argv in (["mount", "--bind", spec["dir"], spec["dir"]],
                     ["mount", "-o", "remount,bind,ro", spec["dir"], spec["dir"]]):
            subprocess.run(argv, check=True, capture_output=True, timeout=60)
    with contextlib.ExitStack() as stack:
        for how in ("fd", "map"):
            for name in spec.get("hold_" + how, []):
                path = os.path.join(spec["dir"], name)
                out["holders"][name] = stack.enter_context(
                    holding(path, "mmap" if how == "map" else "fd", seconds=120))
        for run in spec["runs"]:
            result = run_module(run.get("module", "shm_cleanup"), run["args"],
                                check_mode=run.get("check_mode", False), diff=run.get("diff", False),
                                env=run.get("env"), timeout=120)
            out["runs"].append({"result": result, "after": sorted(os.listdir(spec["dir"]))})
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1])


def populate(d):
    """A /dev/shm stand-in with one file of each kind: the default patterns' (nccl-, psm_,
    sem.mp-, vllm_), an extra pattern's (sem.loky-), two a test holds (psm_held, nccl-mapped),
    another user's (vllm_theirs) and one no pattern names (keep-me)."""
    d.mkdir()
    for name, size in (("nccl-1a2b", 32768), ("psm_9f8e", 4096), ("sem.mp-abc", 32),
                       ("vllm_buf", 1024), ("sem.loky-7", 32), ("psm_held", 4096),
                       ("nccl-mapped", 8192), ("vllm_theirs", 10), ("keep-me", 10)):
        (d / name).write_bytes(b"x" * size)
    os.chown(d / "vllm_theirs", pwd.getpwnam("nobody").pw_uid, -1)
