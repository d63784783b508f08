"""Crash-point campaign: a swap behind the lab's HAProxy, its controller killed at every task start.

    .venv/bin/python tests/bench/bench_crash_points.py [--host gpu1] [--from N] [--to M] [--every K]
                                                       [--json FILE]

On one lab host (`make lab-up`), a reference run of `migrate.yml` swapping tiny-a -> tiny-b lists
the run's own task starts (the host's and the controller's, in order). Then, for each of them
(or every K-th, or those from N to M), a swap to the other model is started and `ansible-playbook`
is killed (SIGKILL, its whole process group) the moment that task starts; the same command is
run once more (with `-e modelswap_break_lease=<the killed run's id>` when the killed run held the
host's lease: an operator's explicit takeover), and the host is checked:

  converged   it serves the target and passed the gates, it is UP in the pool, the record names
              the target and `previous` what served before, saved/active is the target's unit,
              no drain mark is left, both models' blobs hash to their names
  idempotent  a second rerun reports changed=0 and outcome "unchanged"

It prints a line per crash point and the totals; --json writes them. Each point starts vLLM once
or twice (about 1-2 minutes here): the whole campaign over the ~60 task starts of a swap takes
about two hours, so it is not part of `make test` (tests/integration/test_converge_lab.py runs
three of its points there). The host is left serving what the last point swapped to.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / ".collections")]

from ansible_collections.modelswap.vllm.plugins.plugin_utils import runner  # noqa: E402
from tests.integration import vllm_lab  # noqa: E402
from tests.lab import labctl  # noqa: E402
from tests.lab.fixtures import Lab  # noqa: E402
from tests.support.crash import DRAIN_MARK, convergence_problems, run_killed_at  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="gpu1")
    parser.add_argument("--from", dest="first", type=int, default=1, help="first crash point (1-based)")
    parser.add_argument("--to", dest="last", type=int, default=0, help="last crash point (0: the last task)")
    parser.add_argument("--every", type=int, default=1, help="every K-th crash point")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)

    handle = labctl.lab_from_env()
    state = labctl.load_state(handle)
    if not state:
        print("the lab is not up: run `make lab-up`", file=sys.stderr)
        return 2
    lab = Lab(handle, state)
    host, limit, key = args.host, f"{args.host},localhost", lab.api_key
    results_dir = REPO / "build" / "crash-points"
    base = {"modelswap_results_dir": str(results_dir), "benchmark_results_dir": str(results_dir / "benchmark"),
            "modelswap_benchmark": False, "modelswap_min_serving": 0}
    inventory = str(lab.inventory)

    vllm_lab.reset_host(lab, host)
    lab.ssh(host, f"rm -f {DRAIN_MARK} /var/lib/modelswap/lease.json")
    lab.lb_command(f"enable server vllm/{host}")
    start = runner.migrate(inventory, serve="tiny-a", limit=limit, extra_vars=base)
    if not start["ok"]:
        print("could not serve tiny-a first:", start["run"]["failures"], file=sys.stderr)
        return 1
    reference = run_killed_at("migrate.yml", inventory, dict(base, modelswap_serve="tiny-b"), kill_at=None, limit=limit)
    if reference["rc"] != 0:
        print(reference["output"][-3000:], file=sys.stderr)
        return 1
    tasks = reference["tasks"]
    last = args.last or len(tasks)
    points = list(range(max(1, args.first), last + 1, max(1, args.every)))
    print(f"reference swap tiny-a -> tiny-b: {len(tasks)} task starts; crash points: {len(points)}")
    print(f"{'#':>3} {'task':<72} {'killed':>6} {'rerun':>6} {'conv':>5} {'again':>6} {'s':>5}")
    serving, rows = "tiny-b", []
    for n in points:
        name = tasks[n - 1]
        occurrence = tasks[:n].count(name)
        target = "tiny-a" if serving == "tiny-b" else "tiny-b"
        began = time.monotonic()
        crashed = run_killed_at("migrate.yml", inventory, dict(base, modelswap_serve=target), kill_at=name,
                                occurrence=occurrence, limit=limit)
        extra = dict(base, modelswap_serve=target)
        holder = lab.ssh(host, "cat /var/lib/modelswap/lease.json 2>/dev/null", check=False).stdout
        if holder.strip():
            try:
                extra["modelswap_break_lease"] = json.loads(holder)["run_id"]
            except (ValueError, KeyError):
                pass
        rerun = runner.run_playbook("migrate.yml", inventory, extra, limit=limit)
        problems = convergence_problems(lab, host, key, target, serving) if rerun.ok else ["the rerun failed"]
        again = runner.run_playbook("migrate.yml", inventory, dict(base, modelswap_serve=target), limit=limit)
        idempotent = again.ok and again.changed(host) == 0
        row = {"point": n, "task": name, "occurrence": occurrence, "target": target, "killed": crashed["killed"],
               "rerun_ok": rerun.ok, "rerun_failures": rerun.failures(), "problems": problems,
               "converged": rerun.ok and not problems, "idempotent": idempotent,
               "seconds": round(time.monotonic() - began, 1)}
        rows.append(row)
        print(f"{n:>3} {name[:72]:<72} {str(crashed['killed']):>6} {str(rerun.ok):>6} "
              f"{str(row['converged']):>5} {str(idempotent):>6} {row['seconds']:>5.0f}")
        for problem in problems:
            print(f"      - {problem}")
        if rerun.ok:
            serving = target
        else:
            # start the next point from a known state: the target served again
            recover = runner.migrate(inventory, serve=target, limit=limit, extra_vars=dict(
                base, modelswap_break_lease=extra.get("modelswap_break_lease", "")))
            serving = target if recover["ok"] else serving
    converged = sum(r["converged"] and r["idempotent"] for r in rows)
    print(f"crash points: {len(rows)}; converged on one rerun and changed=0 on the next: {converged}")
    if args.json:
        Path(args.json).write_text(json.dumps({"tasks": tasks, "points": rows}, indent=2))
    return 0 if converged == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
