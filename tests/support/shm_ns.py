"""Run gpu_ready's /dev/shm cleanup inside a fresh PID namespace (a container's view of /proc).

    unshare --pid --fork --mount-proc python -m tests.support.shm_ns SPEC.json

The module refuses to remove anything while some process cannot be inspected; on some machines
(this project's VMs) PID 1 hides its maps even from root. Inside a new PID namespace every
process is the test's own, so the cleanup can be exercised end to end: the holders started here
are real processes holding files open or mapped, and the module runs exactly as Ansible runs it.

SPEC: {"dir": path, "hold_fd": [names], "hold_map": [names],
       "runs": [{"args": {...}, "check_mode": bool, "diff": bool}, ...]}
Prints JSON: {"holders": {name: pid}, "runs": [{"result": {...}, "after": [names]}]}.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys

from tests.support.holders import holding
from tests.support.modules import run_module


def main(spec_path):
    with open(spec_path, encoding="utf-8") as fh:
        spec = json.load(fh)
    out = {"holders": {}, "runs": [], "pid": os.getpid()}
    with contextlib.ExitStack() as stack:
        for how in ("fd", "map"):
            for name in spec.get("hold_" + how, []):
                path = os.path.join(spec["dir"], name)
                out["holders"][name] = stack.enter_context(
                    holding(path, "mmap" if how == "map" else "fd", seconds=120))
        for run in spec["runs"]:
            result = run_module("gpu_ready", run["args"], check_mode=run.get("check_mode", False),
                                diff=run.get("diff", False), timeout=120)
            out["runs"].append({"result": result, "after": sorted(os.listdir(spec["dir"]))})
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1])
