"""Benchmark: how the migration preview's and a converged rerun's controller cost grow with the hosts.

    .venv/bin/python tests/bench/bench_preview_scaling.py [--hosts 2,8,16,32] [--rounds 2]
        [--serve tiny-b] [--current tiny-a] [--prepare MODEL | --standin [--prepared]] [--json FILE]

Needs a running lab with as many hosts as the largest count (`make lab-up LAB_HOSTS=32`). With
--prepare MODEL it first brings every host to "vLLM installed, MODEL downloaded and verified"
(migrate.yml without the swap and the benchmark: about 5 min for 8 fresh hosts here, 2.5 GB of
virtualenv per host; no vLLM is started, 8 of them would not fit in this machine's memory).
With --standin it instead puts bench_fleet_rollout.py's vLLM stand-in on every host (the lab's
simulator where the role installs vLLM) and migrates them all to CURRENT (no benchmark), so that
every host serves: then a rerun to CURRENT is a converged rerun (nothing to do).

Then, in interleaved rounds (2, 8, 16, 32, 2, ... so that the machine's noise spreads over every
count), it runs next to each other on the first N hosts of gpu_hosts:

  preview    playbooks/migrate.yml --check --diff -e modelswap_serve=SERVE (ansible-runner)
  rerun      playbooks/migrate.yml -e modelswap_serve=CURRENT (with --standin: a converged rerun)
  baseline   a one-task play (ansible.builtin.ping) on the same hosts: Ansible's own cost of
             reaching N hosts, which no modelswap change can remove

each with SSH connections of its own (a fresh ControlPath folder: none of them reuses the
connections an earlier one opened, as a preview run first in a while does not), and prints per
count the median wall time and controller CPU (user+sys of ansible-playbook and
its workers), the growth per added host (least squares over all runs) and its ratio to ping's,
the tasks per host, and the tasks with the most summed time over hosts at the largest count
(ansible-runner's per-task durations).
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

sys.path.insert(0, str(REPO / "tests" / "bench"))
import bench_fleet_rollout as rollout  # noqa: E402  pylint: disable=wrong-import-position

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
    # every measured command opens its own SSH connections (an empty ControlPath folder), as the
    # first command in a while does: otherwise whichever runs first pays them for the others
    control = tempfile.mkdtemp(prefix="msb-cp-")
    cpu, wall = children_cpu(), time.monotonic()
    result = runner.run_playbook(playbook, inventory, extra, check=check, diff=check, limit=limit,
                                 envvars={"ANSIBLE_SSH_CONTROL_PATH_DIR": control})
    if playbook == "migrate.yml" and check is False and result.ok:
        # a converged rerun changes nothing on any host
        changed = {h: result.changed(h) for h in result.tasks_per_host() if h != "localhost"}
        if any(changed.values()):
            raise SystemExit(f"the rerun was not converged: changed per host {changed}")
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


def standin(inventory: str, limit: str, current: str, extra: dict) -> None:
    """bench_fleet_rollout.py's vLLM stand-in on every host, then CURRENT served everywhere."""
    work = Path(tempfile.mkdtemp(prefix="modelswap-bench-standin-"))
    (work / "vllm").write_text(rollout.STANDIN)
    wheelhouse = next(line.split(": ", 1)[1].strip() for line in Path(inventory).read_text().splitlines()
                      if "modelswap_lab_wheelhouse:" in line)
    play = work / "standin.yml"
    play.write_text(rollout.PREPARE_PLAY.format(venv=rollout.VENV, wheelhouse=wheelhouse, standin=work / "vllm",
                                                simulator=REPO / "tests/lab/simulator.py"))
    for label, result in (("stand-in", lambda: runner.run_playbook(str(play), inventory, {}, limit=limit)),
                          (f"serve {current}", lambda: runner.run_playbook(
                              "migrate.yml", inventory, dict(extra, modelswap_serve=current, modelswap_benchmark=False,
                                             # half at a time: the load balancer's floor
                                             modelswap_serial="50%"),
                              limit=limit + ",localhost"))):
        started = time.monotonic()
        res = result()
        if not res.ok:
            raise SystemExit(f"{label} failed: {res.failures()}\n{res.stdout[-3000:]}")
        print(f"{label}: {time.monotonic() - started:.0f} s", flush=True)


def summary(runs: list, counts: list, kind: str) -> dict:
    """Per count the medians, and the growth per added host (least squares), of ``kind``."""
    mine = [r for r in runs if kind in r]
    if not mine:
        return {}
    print(f"\n{kind}: hosts  wall s (median, min-max)  controller cpu s (median, min-max)  ping wall s  ping cpu s")
    for n in counts:
        at = [r for r in mine if r["hosts"] == n]
        walls = [r[kind]["wall_s"] for r in at]
        cpus = [r[kind]["cpu_s"] for r in at]
        print(f"{n:5d}  {statistics.median(walls):7.1f} ({min(walls):.1f}-{max(walls):.1f})"
              f"{statistics.median(cpus):21.1f} ({min(cpus):.1f}-{max(cpus):.1f})"
              f"{statistics.median(r['baseline']['wall_s'] for r in at):15.1f}"
              f"{statistics.median(r['baseline']['cpu_s'] for r in at):11.1f}")
    out = {"wall_per_host_s": slope([(r["hosts"], r[kind]["wall_s"]) for r in mine]),
           "cpu_per_host_s": slope([(r["hosts"], r[kind]["cpu_s"]) for r in mine]),
           "ping_wall_per_host_s": slope([(r["hosts"], r["baseline"]["wall_s"]) for r in mine]),
           "ping_cpu_per_host_s": slope([(r["hosts"], r["baseline"]["cpu_s"]) for r in mine])}
    ratio = out["cpu_per_host_s"] / out["ping_cpu_per_host_s"] if out["ping_cpu_per_host_s"] > 0 else float("nan")
    print(f"growth per added host: {kind} {out['wall_per_host_s']:.2f} s wall, {out['cpu_per_host_s']:.2f} s "
          f"controller cpu ({ratio:.1f}x ping's); ping {out['ping_wall_per_host_s']:.2f} s wall, "
          f"{out['ping_cpu_per_host_s']:.2f} s cpu")
    for a, b in zip(counts, counts[1:]):
        step = [statistics.median(r[kind]["cpu_s"] for r in mine if r["hosts"] == n) for n in (a, b)]
        print(f"  {a} -> {b} hosts: {(step[1] - step[0]) / (b - a):.2f} s controller cpu per added host")
    tasks = [r[kind].get("tasks_per_host") for r in mine if r["hosts"] == counts[-1]]
    if tasks and tasks[0]:
        print(f"tasks per host: {sorted(set(tasks[0].values()))}")
    top = defaultdict(list)
    for r in mine:
        if r["hosts"] == counts[-1]:
            for task, secs in r[kind]["tasks"].items():
                top[task].append(secs)
    print(f"tasks with the most time summed over {counts[-1]} hosts (median of rounds):")
    for task, secs in sorted(top.items(), key=lambda kv: -statistics.median(kv[1]))[:6]:
        print(f"  {statistics.median(secs):7.1f} s  {task}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", default="2,8,16,32", help="host counts, comma-separated")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--serve", default="tiny-b", help="the model the preview plans for")
    ap.add_argument("--current", default="tiny-a", help="the model the hosts serve (the rerun's target)")
    prep = ap.add_mutually_exclusive_group()
    prep.add_argument("--prepare", metavar="MODEL", help="first install vLLM and fetch MODEL on every host")
    prep.add_argument("--standin", action="store_true",
                      help="first put the vLLM stand-in on every host and serve CURRENT (then the rerun is measured)")
    ap.add_argument("--prepared", action="store_true",
                    help="with --standin: the hosts already serve CURRENT on the stand-in (an earlier --standin "
                         "run prepared them); measure at once")
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
        prepared = runner.run_playbook("migrate.yml", inventory, dict(extra, modelswap_serve=args.prepare),
                                       limit=limit, skip_tags="swap,benchmark")
        if not prepared.ok:
            raise SystemExit(f"preparation failed: {prepared.failures()}\n{prepared.stdout[-3000:]}")
        print(f"prepared in {time.monotonic() - started:.0f} s", flush=True)
    if args.standin and not args.prepared:
        standin(inventory, limit, args.current, extra)
    ping = Path(tempfile.mkdtemp(prefix="modelswap-bench-ping-")) / "ping.yml"
    ping.write_text(PING_PLAY)

    runs = []
    for rnd in range(1, args.rounds + 1):
        for n in counts:
            hosts = f"gpu_hosts[0:{n - 1}]"
            row = {"round": rnd, "hosts": n,
                   "preview": timed("migrate.yml", inventory, dict(extra, modelswap_serve=args.serve), hosts, True)}
            if args.standin:
                row["rerun"] = timed("migrate.yml", inventory, dict(extra, modelswap_serve=args.current,
                                                                    modelswap_benchmark=False), hosts, False)
            row["baseline"] = timed(str(ping), inventory, {}, hosts, False)
            runs.append(row)
            print(f"round {rnd} hosts {n}: " + ", ".join(
                f"{kind} {row[kind]['wall_s']:.1f} s (cpu {row[kind]['cpu_s']:.1f} s)"
                for kind in ("preview", "rerun", "baseline") if kind in row), flush=True)
    figures = {kind: summary(runs, counts, kind) for kind in ("preview", "rerun")}
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "figures": figures}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
