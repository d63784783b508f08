"""A controller that dies mid-run: ansible-playbook killed (SIGKILL, its whole process group) the
moment a chosen task starts, as when the operator's laptop loses power or its SSH session drops.

Used by the lab's convergence tests and by tests/bench/bench_crash_points.py, which kills a swap
at every task start of its own task list.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TASK_LINE = re.compile(r"^TASK \[(?P<name>.*)\] \**$")


def playbook_argv(playbook: str, inventory: str, vars_file: str, limit: str | None = None,
                  check: bool = False) -> list[str]:
    argv = [str(Path(sys.executable).parent / "ansible-playbook"), "-i", inventory,
            str(REPO / "playbooks" / playbook), "-e", f"@{vars_file}"]
    if limit:
        argv += ["--limit", limit]
    if check:
        argv += ["--check", "--diff"]
    return argv


def run_killed_at(playbook: str, inventory: str, extra_vars: dict, *, kill_at: str | None,
                  occurrence: int = 1, limit: str | None = None, timeout: float = 1200) -> dict:
    """Run ``playbook``; when the ``occurrence``-th task whose ``ROLE : name`` contains ``kill_at``
    starts, SIGKILL the run's whole process group (ansible-playbook, its workers, its SSH).

    Returns {"killed": bool, "task": the task line it died at, "tasks": every task started,
    "rc": exit status, "output": the run's output}. ``kill_at=None`` runs to the end (the list of
    task starts is what a crash campaign iterates over). Bounded by ``timeout`` (killed then too)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump(extra_vars, handle)
        vars_file = handle.name
    env = dict(os.environ, ANSIBLE_CONFIG=str(REPO / "ansible.cfg"), ANSIBLE_FORCE_COLOR="0",
               ANSIBLE_NOCOLOR="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(playbook_argv(playbook, inventory, vars_file, limit), cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    out, tasks, killed, seen = [], [], None, 0
    deadline = time.monotonic() + timeout
    try:
        for line in proc.stdout:
            out.append(line)
            match = TASK_LINE.match(line.strip())
            if match:
                tasks.append(match.group("name"))
                if kill_at is not None and kill_at in match.group("name"):
                    seen += 1
                    if seen == occurrence:
                        killed = match.group("name")
                        os.killpg(proc.pid, signal.SIGKILL)
                        break
            if time.monotonic() > deadline:
                os.killpg(proc.pid, signal.SIGKILL)
                out.append(f"[crash] the run passed its {timeout:.0f} s bound: killed\n")
                break
        rest, _unused = proc.communicate(timeout=60)
        out.append(rest or "")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        os.unlink(vars_file)
    return {"killed": killed is not None, "task": killed, "tasks": tasks, "rc": proc.returncode,
            "output": "".join(out)}


DRAIN_MARK = "/var/lib/modelswap/lb-drained.json"


def served_models(address: str, key: str, port: int = 8000) -> list[str] | None:
    """What a host's vLLM lists at /v1/models (None when it does not answer)."""
    import urllib.request
    req = urllib.request.Request(f"http://{address}:{port}/v1/models", headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=3) as resp:
            return [m["id"] for m in json.load(resp)["data"]]
    except OSError:
        return None


def convergence_problems(lab, host: str, key: str, target: str, before: str) -> list[str]:
    """What keeps ``host`` from being converged on ``target`` (empty: converged): it serves the
    target, it is UP in the pool, the record names the target and `previous` what served before,
    the configuration a rollback restores is the target's, no drain mark is left, and both
    models' files are intact in the store."""
    problems = []
    models = served_models(lab.address(host), key)
    if models != [target]:
        problems.append(f"serves {models}, not [{target!r}]")
    status = lab.lb_servers().get(host)
    if status != "UP":
        problems.append(f"the pool has it {status}")
    proc = lab.ssh(host, "cat /var/lib/modelswap/deployment.json", check=False)
    try:
        rec = json.loads(proc.stdout)
    except ValueError:
        rec = {}
    if rec.get("model") != target:
        problems.append(f"the record names {rec.get('model')}")
    if (rec.get("previous") or {}).get("model") != before:
        problems.append(f"the record's previous is {(rec.get('previous') or {}).get('model')}, not {before}")
    active = lab.ssh(host, "cat /var/lib/modelswap/vllm/*/active/unit", check=False).stdout
    if f"models--lab--{target}/" not in active:
        problems.append("saved/active is not the target's unit")
    if lab.ssh(host, f"test -e {DRAIN_MARK}", check=False).returncode == 0:
        problems.append("the drain mark is still there")
    for model in dict.fromkeys((target, before)):   # each once, in order
        # an LFS blob is named by its sha256: every one must hash to its name
        check = lab.ssh(host, f"cd /var/lib/modelswap/hf/hub/models--lab--{model}/blobs && "
                              "ls | grep -E '^[0-9a-f]{64}$' | sed 's/.*/&  &/' | grep . | sha256sum -c --quiet",
                        check=False)
        if check.returncode != 0:
            problems.append(f"{model}'s files are not intact")
    return problems
