"""Benchmark: the downtime of a model swap by the vllm_service role, next to vLLM's own start-up.

    .venv/bin/python tests/bench/bench_swap_downtime.py [--host gpu1] [--swaps 4] [--json FILE]

On one lab host (`make lab-up`), it deploys tiny-a with playbooks/deploy.yml, then swaps
tiny-a <-> tiny-b --swaps times, each a real run of the playbook, and prints per swap:

  downtime      old server stopping (its unit's ActiveExitTimestamp) -> new server ready (the
                moment vllm_ready's last gate passed), on the host's monotonic clock: what the
                role reports as vllm_service_result.downtime_s
  client        the same seen from outside: last answer of the old model -> first answer of the
                new one, from a prober on the controller that asks /v1/models every 0.25 s
  vllm start    vLLM's own start-up: its process start (ExecMainStartTimestamp) -> "Application
                startup complete." in its journal
  overhead      downtime - vllm start: what modelswap adds, split into
    stop          the old server's stop (ActiveExit -> InactiveEnter: SIGTERM to a dead cgroup)
    gap           old gone -> new process started (the role's checks: processes and port gone,
                  gpu_ready's GPU-memory wait and /dev/shm cleanup, daemon-reload, start)
    detect        startup complete -> vllm_ready's gates all passed (poll interval + the probes)
  playbook      the whole ansible-playbook run

It is not part of the test suite (each swap starts vLLM: ~30-60 s and 2.7 GiB here). The host is
left serving tiny-a and stopped at the end unless --keep.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / ".collections")]

from tests.integration import vllm_lab as V  # noqa: E402
from tests.lab import labctl  # noqa: E402
from tests.lab.fixtures import Lab  # noqa: E402


class Prober(threading.Thread):
    """Asks /v1/models every `interval` s; keeps (controller monotonic, served name or None)."""

    def __init__(self, url, key, interval=0.25):
        super().__init__(daemon=True)
        self.url, self.key, self.interval = url, key, interval
        self.samples = []
        self.stop = threading.Event()

    def run(self):
        while not self.stop.is_set():
            t = time.monotonic()
            name = None
            try:
                req = urllib.request.Request(self.url, headers={"Authorization": "Bearer " + self.key})
                with urllib.request.urlopen(req, timeout=1.0) as resp:
                    name = json.load(resp)["data"][0]["id"]
            except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError):
                pass
            self.samples.append((t, name))
            self.stop.wait(max(0.0, self.interval - (time.monotonic() - t)))

    def outage(self, old, new):
        """Seconds from the last answer of `old` (before the first `new`) to the first of `new`."""
        first_new = next((t for t, n in self.samples if n == new), None)
        if first_new is None:
            return None
        last_old = max((t for t, n in self.samples if n == old and t < first_new), default=None)
        return None if last_old is None else first_new - last_old


def vllm_startup(lab, host):
    """vLLM's own start-up of the running unit, on the host's monotonic clock: its process start
    (ExecMainStartTimestampMonotonic) -> its journal line "Application startup complete."."""
    show = V.unit_show(lab, host, "MainPID", "ExecMainStartTimestampMonotonic")
    line = lab.ssh(host, "journalctl -u %s _PID=%s -o short-monotonic --no-pager | "
                         "grep -m1 'Application startup complete'" % (V.UNIT, show["MainPID"]),
                   check=False).stdout
    try:
        complete = float(line.split("]", 1)[0].strip("[ "))
    except ValueError:
        return None
    return complete - int(show["ExecMainStartTimestampMonotonic"]) / 1e6


def one_swap(lab, host, key, old, new):
    prober = Prober(V.url(lab, host, "/v1/models"), key)
    prober.start()
    time.sleep(1.0)
    wall = time.monotonic()
    run = lab.playbook(V.DEPLOY, V.role_vars(lab, key, modelswap_serve=new), limit=host)
    wall = time.monotonic() - wall
    time.sleep(0.5)
    prober.stop.set()
    prober.join(5)
    if run.rc != 0:
        raise SystemExit("the swap to %s failed on %s:\n%s" % (new, host, run.stdout[-4000:]))
    out = next(r["ansible_facts"]["vllm_service_result"]
               for r in run.task_results("Report the outcome", host) if r["_event"] == "runner_on_ok")
    stopped = next(r for r in run.task_results("Wait until the old server's processes and port are gone", host))
    ready = next(r for r in run.task_results(
        "Wait until the new server serves (port, /health, /v1/models, a one-token completion)", host))
    old_state = stopped["unit_state"]
    exit_t = int(old_state["ActiveExitTimestampMonotonic"]) / 1e6
    inactive_t = int(old_state["InactiveEnterTimestampMonotonic"]) / 1e6
    new_start = int(ready["unit_state"]["ExecMainStartTimestampMonotonic"]) / 1e6
    startup = vllm_startup(lab, host)
    downtime = out["downtime_s"]
    row = {
        "from": old, "to": new, "downtime": downtime, "client": prober.outage(old, new),
        "vllm_start": startup, "overhead": None if startup is None else downtime - startup,
        "stop": inactive_t - exit_t, "gap": new_start - inactive_t,
        "detect": None if startup is None else ready["monotonic"] - new_start - startup,
        "playbook": wall, "gates": out["gates"],
    }
    return row


def fmt(value, width=8):
    return ("%*.2f" % (width, value)) if isinstance(value, (int, float)) else "%*s" % (width, "-")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="gpu1")
    ap.add_argument("--swaps", type=int, default=4)
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--keep", action="store_true", help="leave the service running at the end")
    args = ap.parse_args()
    handle = labctl.lab_from_env()
    state = labctl.load_state(handle)
    if state is None:
        raise SystemExit("the lab is not up: run `make lab-up`")
    lab = Lab(handle, state)
    key = V.new_api_key()
    host = args.host
    print("preparing %s: vLLM, models fetched and verified, tiny-a served ..." % host, flush=True)
    lab.ssh(host, "systemctl stop vllm-lab.service 2>/dev/null; true")
    V.prepare(lab, [host], key)
    first = lab.playbook(V.DEPLOY, V.role_vars(lab, key, modelswap_serve="tiny-a"), limit=host)
    if first.rc != 0:
        raise SystemExit(first.stdout[-4000:])
    rows = []
    header = ("swap", "from->to", "downtime", "client", "vllm st", "overhead", "stop", "gap", "detect", "playbook")
    print("\n%-4s %-16s %8s %8s %8s %8s %8s %8s %8s %8s" % header)
    print("%-4s %-16s %8s %8s %8s %8s %8s %8s %8s %8s" % ("", "", "s", "s", "s", "s", "s", "s", "s", "s"))
    models = ["tiny-a", "tiny-b"]
    try:
        for i in range(args.swaps):
            old, new = models[i % 2], models[(i + 1) % 2]
            row = one_swap(lab, host, key, old, new)
            rows.append(row)
            print("%-4d %-16s %s %s %s %s %s %s %s %s" % (
                i + 1, "%s->%s" % (old, new), fmt(row["downtime"]), fmt(row["client"]),
                fmt(row["vllm_start"]), fmt(row["overhead"]), fmt(row["stop"]), fmt(row["gap"]),
                fmt(row["detect"]), fmt(row["playbook"])), flush=True)
    finally:
        if not args.keep:
            V.stop(lab, host)
    if rows:
        med = {k: statistics.median([r[k] for r in rows if isinstance(r[k], (int, float))] or [0])
               for k in ("downtime", "client", "vllm_start", "overhead", "stop", "gap", "detect", "playbook")}
        print("%-4s %-16s %s %s %s %s %s %s %s %s" % (
            "med", "", fmt(med["downtime"]), fmt(med["client"]), fmt(med["vllm_start"]),
            fmt(med["overhead"]), fmt(med["stop"]), fmt(med["gap"]), fmt(med["detect"]), fmt(med["playbook"])))
        print("\nmodelswap's overhead per swap (downtime - vLLM's own start-up): median %.2f s "
              "(stop %.2f + gap %.2f + detect %.2f)" % (med["overhead"], med["stop"], med["gap"], med["detect"]))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
