"""Benchmark: one download per site (model_fetch with peers) against every host from the Hub.

    .venv/bin/python tests/bench/bench_peers.py [--hosts 4,8] [--big-mib 128] [--xet] [--json FILE]

Runs on the peer lab (tests/lab/peerlab.py: reused when one of at least 8 hosts is up, else
brought up for the run and torn down after). For each model (the lab's tiny-b, 6.8 MiB in 7
files, and a synthetic one of --big-mib MiB in one LFS file, published on the lab's Hub for the
run; 0 skips it) and each host count N (the first N hosts, gpu1..gpuN, one site), it runs
playbooks/fetch.yml into a fresh cache folder on every host twice:

  hub     model_fetch_peers false: every host downloads and verifies from the Hub (as before)
  peers   model_fetch_peers true: gpu1 downloads, the others copy from verified hosts in rounds

and prints the wall time of the playbook and the bytes of file content the Hub served (its request
log: resolve bodies and, with --xet, where hosts download through hf_xet as from huggingface.co,
the CAS's xorb ranges). Every host of both modes gets huggingface_hub first (not timed).

What it can and cannot show here: the Hub's bytes are the point (N snapshots against one), and
they do not depend on the machine. The wall times do: the lab's hosts, its Hub and the
controller share this machine's two cores and one disk, the "network" is a bridge in memory, and
no uplink is slower than the hosts' links as on a real site; so peers pay their rounds (about log2 N
of them, each a few Ansible tasks and an rsync over SSH) without the uplink they save. On a site
whose uplink is the bottleneck the download term of the Hub mode grows with N and that of peers
does not.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import secrets
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / ".collections")]

from tests.lab import peerlab  # noqa: E402

BIG_REPO = "bench/peers-big"


def big_files(mib: int) -> dict:
    """A model-shaped repo: a config and one LFS weight file of ``mib`` MiB, deterministic."""
    block = b"".join(hashlib.sha256(b"peers-bench/%d" % i).digest() for i in range(32 * 1024))   # 1 MiB
    return {"config.json": b'{"model_type": "llama"}\n', "model.safetensors": block * mib}


def hub_bytes(lab, since: int, repo: str) -> tuple:
    got = [e for e in lab.hub.requests(since=since)
           if e["method"] == "GET" and ((e.get("endpoint") == "resolve" and repo in e["path"])
                                        or (e.get("endpoint") == "xet-xorb" and e.get("repo") == repo))]
    return sum(e.get("bytes_sent") or 0 for e in got), len(got)


def one_run(lab, catalog, model, repo, hosts, peers: bool, xet: bool = False) -> dict:
    # under the folder each host serves to its peers (read-only, through rrsync: labctl.peer_authorized_key)
    work = "%s/bench-peers-%s" % (peerlab.labctl.PEER_SERVE_ROOT_IN_HOST, secrets.token_hex(4))
    ev = {"modelswap_models": catalog, "modelswap_serve": model, "model_fetch_peers": peers,
          "model_fetch_endpoint": lab.hub_url, "model_fetch_use_xet": xet,
          "model_fetch_python": peerlab.HF_VENV + "/bin/python", "model_fetch_cache_dir": work + "/hub",
          "model_fetch_progress_dir": work + "/progress", "model_fetch_record": work + "/deployment.json",
          "model_fetch_poll_interval": 1, "model_fetch_peer_serve_root": peerlab.labctl.PEER_SERVE_ROOT_IN_HOST,
          # a folder of each host's own: gpu5 and gpu6 do not share it, whatever their store
          "model_fetch_store": ""}
    since = max((e["id"] for e in lab.hub.requests()), default=0)
    started = time.monotonic()
    run = lab.playbook("playbooks/fetch.yml", ev, limit=",".join(hosts))
    wall = time.monotonic() - started
    try:
        if run.rc != 0:
            raise SystemExit("fetch (%s, %d hosts) failed:\n%s" % ("peers" if peers else "hub", len(hosts),
                                                                   run.stdout[-4000:]))
        served, bodies = hub_bytes(lab, since, repo)
        return {"wall_s": round(wall, 1), "hub_bytes": served, "hub_gets": bodies,
                "tasks_per_host": round(sum(run.tasks_per_host().values()) / len(hosts), 1)}
    finally:
        for host in hosts:
            lab.ssh(host, "rm -rf %s" % work, check=False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", default="4,8", help="host counts, comma-separated (at most the lab's)")
    ap.add_argument("--big-mib", type=int, default=128, help="size of the synthetic model (0: tiny-b only)")
    ap.add_argument("--xet", action="store_true", help="download through hf_xet (the lab Hub's CAS)")
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args()
    counts = [int(n) for n in args.hosts.split(",")]
    with peerlab.peer_lab(hosts=max(counts)) as lab:
        names = lab.hosts[:max(counts)]
        for host in names:
            peerlab.ensure_hf_python(lab, host)
        catalog = {n: {"repo_id": m["repo_id"], "revision": m["commit"]} for n, m in lab.models.items()}
        models = [("tiny-b", "lab/tiny-b")]
        if args.big_mib:
            catalog["big"] = {"repo_id": BIG_REPO, "revision": lab.hub.publish(BIG_REPO, big_files(args.big_mib))}
            models.append(("big", BIG_REPO))
        rows = []
        for model, repo in models:
            for n in counts:
                for peers in (False, True):
                    r = one_run(lab, catalog, model, repo, names[:n], peers, args.xet)
                    r.update(model=model, hosts=n, mode="peers" if peers else "hub")
                    rows.append(r)
                    print("%-7s %2d hosts %-5s  wall %6.1f s   from the Hub %8.1f MiB (%d requests)   "
                          "%.0f tasks per host" % (model, n, r["mode"], r["wall_s"], r["hub_bytes"] / 2**20,
                                                   r["hub_gets"], r["tasks_per_host"]), flush=True)
    print()
    print("| model | hosts | mode | wall (s) | from the Hub (MiB) | requests with bytes from the Hub | tasks per host |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print("| %s | %d | %s | %.1f | %.1f | %d | %.0f |" % (
            r["model"], r["hosts"], r["mode"], r["wall_s"], r["hub_bytes"] / 2**20, r["hub_gets"], r["tasks_per_host"]))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
