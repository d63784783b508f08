"""Benchmark: how the migration preview's wall time grows with the number of hosts.

    .venv/bin/python tests/bench/bench_preview_scaling.py [--hosts 2,4,8] [--rounds 3]
        [--serve tiny-b] [--prepare tiny-a] [--json FILE]

Needs a running lab with as many hosts as the largest count (`make lab-up LAB_HOSTS=8`). With
--prepare MODEL it first brings every host to "vLLM installed, MODEL downloaded and verified"
(migrate.yml without the swap and the benchmark: about 5 min for 8 fresh hosts here, 2.5 GB of
virtualenv per host; no vLLM is started, 8 of them would not fit in this machine's memory).

Then, in interleaved rounds (2, 4, 8, 2, 4, 8, ... so that the machine's noise spreads over every
count), it runs next to each other on the first N hosts of gpu_hosts:

  preview    playbooks/migrate.yml --check --diff -e modelswap_serve=SERVE (ansible-runner)
  baseline   a one-task play (ansible.builtin.ping) on the same hosts: Ansible's own cost of
             reaching N hosts, which no modelswap change can remove

and prints per count the median wall time and controller CPU (user+sys of ansible-playbook and
its workers), the growth per added host (least squares over all runs), and the tasks with the
most summed time over hosts at the largest count (ansible-runner's per-task durations).
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / ".collections")]

from ansible_collections.modelswap.vllm.plugins.plugin_utils import runner  # noqa: E402
from tests.lab import labctl  # noqa: E402

PING_PLAY = """- name: Reach the hosts (the baseline)
  hosts: gpu_hosts
  gather_facts: false
  tasks:
    - name: Ping
      ansible.builtin.ping:
"""


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(playbook: str, inventory: str, extra: dict, limit: str, check: bool) -> dict:
    cpu, wall = children_cpu(), time.monotonic()
    result = runner.run_playbook(playbook, inventory, extra, check=check, diff=check, limit=limit)
    wall, cpu = time.monotonic() - wall, children_cpu() - cpu
    if not result.ok:
        raise SystemExit(f"{playbook} on {limit} failed: {result.failures()}\n{result.stdout[-3000:]}")
    tasks = defaultdict(float)
    for ev in result.events:
        data = ev.get("event_data") or {}
        if ev.get("event", "").startswith("runner_on_") and data.get("duration") is not None:
            tasks[data.get("task", "?")] += float(data["duration"])
    return {"wall_s": wall, "cpu_s": cpu, "tasks": dict(tasks),
            "tasks_per_host": {h: n for h, n in result.tasks_per_host().items() if h != "localhost"}}


def slope(points: list[tuple[int, float]]) -> float:
    """Seconds per added host (least squares)."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", default="2,8,16,32", help="host counts, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--serve", default="tiny-b", help="the model the preview plans for")
    ap.add_argument("--prepare", metavar="MODEL", help="first install vLLM and fetch MODEL on every host")
    ap.add_argument("--inventory", default=str(labctl.INVENTORY))
    ap.add_argument("--json", help="write every run's figures here")
    args = ap.parse_args()
    counts = sorted({int(n) for n in args.hosts.split(",")})
    inventory = args.inventory
    if not Path(inventory).exists():
        raise SystemExit(f"no lab inventory at {inventory}: bring the lab up (make lab-up LAB_HOSTS={counts[-1]})")
    results = Path(tempfile.mkdtemp(prefix="modelswap-bench-preview-"))
    extra = {"modelswap_results_dir": str(results)}
    limit = f"gpu_hosts[0:{counts[-1] - 1}]"
    if args.prepare:
        print(f"preparing {limit}: vLLM installed, {args.prepare} downloaded (no service started)", flush=True)
        started = time.monotonic()
        prep = runner.run_playbook("migrate.yml", inventory, dict(extra, modelswap_serve=args.prepare),
                                   limit=limit, skip_tags="swap,benchmark")
        if not prep.ok:
            raise SystemExit(f"preparation failed: {prep.failures()}\n{prep.stdout[-3000:]}")
        print(f"prepared in {time.monotonic() - started:.0f} s", flush=True)
    ping = Path(tempfile.mkdtemp(prefix="modelswap-bench-ping-")) / "ping.yml"
    ping.write_text(PING_PLAY)

    runs = []
    for rnd in range(1, args.rounds + 1):
        for n in counts:
            hosts = f"gpu_hosts[0:{n - 1}]"
            prev = timed("migrate.yml", inventory, dict(extra, modelswap_serve=args.serve), hosts, True)
            base = timed(str(ping), inventory, {}, hosts, False)
            runs.append({"round": rnd, "hosts": n, "preview": prev, "baseline": base})
            print(f"round {rnd} hosts {n}: preview {prev['wall_s']:.1f} s (cpu {prev['cpu_s']:.1f} s), "
                  f"baseline {base['wall_s']:.1f} s", flush=True)

    print("\nhosts  preview wall s (median, min-max)  controller cpu s (median, min-max)  ping wall s  ping cpu s")
    for n in counts:
        mine = [r for r in runs if r["hosts"] == n]
        walls = [r["preview"]["wall_s"] for r in mine]
        cpus = [r["preview"]["cpu_s"] for r in mine]
        print(f"{n:5d}  {statistics.median(walls):7.1f} ({min(walls):.1f}-{max(walls):.1f})"
              f"{statistics.median(cpus):21.1f} ({min(cpus):.1f}-{max(cpus):.1f})"
              f"{statistics.median(r['baseline']['wall_s'] for r in mine):15.1f}"
              f"{statistics.median(r['baseline']['cpu_s'] for r in mine):11.1f}")
    per_host = slope([(r["hosts"], r["preview"]["wall_s"]) for r in runs])
    cpu_per_host = slope([(r["hosts"], r["preview"]["cpu_s"]) for r in runs])
    base_per_host = slope([(r["hosts"], r["baseline"]["wall_s"]) for r in runs])
    base_cpu_per_host = slope([(r["hosts"], r["baseline"]["cpu_s"]) for r in runs])
    print(f"\ngrowth per added host: preview {per_host:.2f} s wall, {cpu_per_host:.2f} s controller cpu; "
          f"ping {base_per_host:.2f} s wall, {base_cpu_per_host:.2f} s cpu")
    for a, b in zip(counts, counts[1:]):
        step = [statistics.median(r["preview"]["cpu_s"] for r in runs if r["hosts"] == n) for n in (a, b)]
        print(f"  {a} -> {b} hosts: {(step[1] - step[0]) / (b - a):.2f} s controller cpu per added host")
    tasks = [r["preview"].get("tasks_per_host") for r in runs if r["hosts"] == counts[-1]]
    if tasks and tasks[0]:
        print(f"tasks per host in the preview: {sorted(set(tasks[0].values()))}")
    top = defaultdict(list)
    for r in runs:
        if r["hosts"] == counts[-1]:
            for task, secs in r["preview"]["tasks"].items():
                top[task].append(secs)
    print(f"\ntasks with the most time summed over {counts[-1]} hosts (median of rounds):")
    for task, secs in sorted(top.items(), key=lambda kv: -statistics.median(kv[1]))[:10]:
        print(f"  {statistics.median(secs):7.1f} s  {task}")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "per_host_s": per_host}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
