"""Benchmark: vLLM's start with compilation, cold (no compile cache) against warm (its model's cache kept).

    .venv/bin/python tests/bench/bench_warm_start.py [--host gpu1] [--rounds 2] [--json FILE]

On one lab host (`make lab-up`; the hosts carry g++ and the Python headers, which torch.compile's
C++ kernels need on CPU), the vllm_service role deploys tiny-a *without* enforce_eager and without
TORCHDYNAMO_DISABLE, so vLLM compiles its graphs and keeps them under the model's own cache root
(`/var/lib/vllm/cache/vllm/models--lab--tiny-a`, the role's VLLM_CACHE_ROOT). Then, interleaved
--rounds times:

  cold   stop the unit, delete the model's cache folder, start it
  warm   stop the unit, start it (the folder the cold start filled is kept)

and for each start prints where it went, from the unit's journal with the role's own parser
(module_utils/serving/vllm_startup.py: the phases the run record carries):

  total         the unit's main process start -> the first one-token completion answered
  imports       process start -> "Initializing a V1 LLM engine"
  workers       -> "Starting to load model"
  weights       -> "Loading weights took"
  engine init   -> "init engine (profile, create kv cache, warmup model) took": compilation here
  compile       what vLLM reports as its compilation ("compilation: N s")
  api, first    -> the API server listening -> the first token

and the ratio of the median cold total to the median warm one. It is not part of the test suite
(each start with compilation takes minutes of both cores). The host is left stopped (--keep: serving).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / ".collections")]

from ansible_collections.modelswap.vllm.plugins.module_utils.serving import vllm_startup  # noqa: E402
from tests.integration import vllm_lab as V  # noqa: E402
from tests.lab import labctl  # noqa: E402
from tests.lab.fixtures import Lab  # noqa: E402

CACHE = "/var/lib/vllm/cache/vllm/models--lab--tiny-a"
COLUMNS = (("total", "total_s"), ("imports", "imports_and_config_s"), ("workers", "engine_and_workers_s"),
           ("weights", "weights_s"), ("engine init", "engine_init_s"), ("compile", "compile_s"),
           ("api", "api_server_s"), ("first", "first_token_s"))


def compiled_catalog(lab) -> dict:
    models = V.catalog(lab)
    models["tiny-a"]["vllm_args"] = {k: v for k, v in V.CPU_ARGS.items() if k != "enforce_eager"}
    return models


def answered(lab, host, key, deadline) -> float:
    """Poll a one-token completion until it answers; the controller's epoch then (the lab's hosts
    share this machine's clock)."""
    url = "http://%s:%d/v1/completions" % (lab.address(host), V.PORT)
    body = json.dumps({"model": "tiny-a", "prompt": "Hi", "max_tokens": 1}).encode()
    while time.monotonic() < deadline:
        req = urllib.request.Request(url, data=body, headers={"Authorization": "Bearer " + key,
                                                              "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                if resp.status == 200:
                    return time.time()
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.25)
    raise SystemExit("tiny-a did not answer within the budget on %s" % host)


def one_start(lab, host, key, kind: str, budget_s: float) -> dict:
    lab.ssh(host, "systemctl stop vllm.service")
    if kind == "cold":
        lab.ssh(host, "rm -rf %s" % CACHE)
    lab.ssh(host, "systemctl start vllm.service")
    started = float(lab.ssh(host, "date -d \"$(systemctl show --timestamp=us+utc -p ExecMainStartTimestamp "
                                  "--value vllm.service)\" +%s.%N").stdout.strip())
    ready = answered(lab, host, key, time.monotonic() + budget_s)
    lines = lab.ssh(host, "journalctl -u vllm.service -o short-unix --no-pager --since @%d" % int(started - 1)).stdout
    out = vllm_startup.startup_phases(lines.splitlines(), started, ready)
    row = dict(out["phases"], total_s=out["total_s"], compile_s=out["reported"].get("compile_s"))
    row["cache_bytes"] = int(lab.ssh(host, "du -sb %s 2>/dev/null | cut -f1 || echo 0" % CACHE).stdout.strip() or 0)
    return dict(row, kind=kind)


def fmt(value) -> str:
    return "%8.1f" % value if isinstance(value, (int, float)) else "%8s" % "-"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="gpu1")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--budget", type=float, default=900, help="seconds one start may take")
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--keep", action="store_true", help="leave tiny-a serving at the end")
    args = ap.parse_args()
    handle = labctl.lab_from_env()
    state = labctl.load_state(handle)
    if state is None:
        raise SystemExit("the lab is not up: run `make lab-up`")
    lab = Lab(handle, state)
    host, key = args.host, V.new_api_key()
    if lab.ssh(host, "command -v g++", check=False).returncode != 0:
        raise SystemExit("%s has no g++: torch.compile cannot build its CPU kernels; rebuild the lab "
                         "(make lab-down && make lab-up)" % host)
    print("preparing %s: vLLM, tiny-a fetched, deployed with compilation (no enforce_eager) ..." % host, flush=True)
    lab.ssh(host, "systemctl stop vllm-lab.service 2>/dev/null; true")
    V.prepare(lab, [host], key)
    env = {"VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": "1"}       # torch.compile on
    first = lab.playbook(V.DEPLOY, V.role_vars(lab, key, modelswap_serve="tiny-a", modelswap_models=compiled_catalog(lab),
                                               vllm_service_env=env), limit=host)
    if first.rc != 0:
        raise SystemExit(first.stdout[-4000:])
    rows = []
    print("\n%-4s %-5s " % ("run", "kind") + " ".join("%8s" % name[:8] for name, _ in COLUMNS) + " %10s" % "cache MiB")
    try:
        for i in range(args.rounds):
            for kind in ("cold", "warm"):
                row = one_start(lab, host, key, kind, args.budget)
                rows.append(row)
                print("%-4d %-5s " % (len(rows), kind) + " ".join(fmt(row.get(col)) for _, col in COLUMNS)
                      + " %10.1f" % (row["cache_bytes"] / 2**20), flush=True)
    finally:
        if not args.keep:
            V.stop(lab, host)
    cold = [r["total_s"] for r in rows if r["kind"] == "cold" and r["total_s"]]
    warm = [r["total_s"] for r in rows if r["kind"] == "warm" and r["total_s"]]
    if cold and warm:
        print("\nmedian start: cold %.1f s, warm %.1f s: warm is %.2fx faster (%d rounds, %s)"
              % (statistics.median(cold), statistics.median(warm),
                 statistics.median(cold) / statistics.median(warm), args.rounds, host))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
