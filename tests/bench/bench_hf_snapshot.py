"""Benchmark hf_snapshot against a bare snapshot_download, and its hashing against hashlib.

    .venv/bin/python tests/bench/bench_hf_snapshot.py [--hub lab|local|URL] [--mb 384] [--files 4]
                                                       [--rounds 2] [--workers 8] [--xet]

Side by side in one run, on the same files (a repo of --files safetensors shards of --mb MB in all,
plus small JSON files, published to the Hub by this script):

1. download: a bare ``huggingface_hub.snapshot_download`` (max_workers=--workers) against the
   hf_snapshot module (run exactly as Ansible runs it) with full verification, each into a fresh
   cache, alternating, --rounds times. Throughput = bytes / wall time of the process; the ratio
   is hf_snapshot's throughput over the bare download's (target >= 0.9: verification overlaps
   the transfer).
2. verification: ``hashlib.sha256`` over the files on one core (the baseline; 0.8-1.6 GB/s here with the
   CPU's SHA instructions) against hf_verify.verify_all with 1 and 2 worker threads (the files are
   in the page cache: this measures hashing, not the disk).

--hub lab uses the running lab's Hub (make lab-up); --hub local starts a Hub on loopback. Not
part of the test suite (it moves a few hundred MB).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / ".collections"))

from ansible_collections.modelswap.vllm.plugins.module_utils.hub import hf_verify  # noqa: E402

MB = 1000 * 1000
BARE = r"""
import sys, time
from huggingface_hub import snapshot_download
t = time.monotonic()
path = snapshot_download(sys.argv[1], revision=sys.argv[2], cache_dir=sys.argv[3], endpoint=sys.argv[4],
                         max_workers=int(sys.argv[5]))
print(time.monotonic() - t)
"""


def shard(seed: int, size: int) -> bytes:
    """Incompressible, deterministic bytes, quickly (a hash-seeded random stream)."""
    import random
    return random.Random(seed).randbytes(size)


def hub_for(kind: str, tmp: Path):
    from tests.lab.hub.client import HubClient
    if kind == "local":
        from tests.lab.hub.fixtures import LocalHub
        return LocalHub(tmp / "store", tmp), True
    if kind == "lab":
        state = json.loads(Path("/var/lib/modelswap-lab/msl/state.json").read_text())
        return HubClient(state["hub_url"], Path("/var/lib/modelswap-lab/msl/hub")), False
    raise SystemExit("--hub must be lab or local")


# --xet: both sides download through hf_xet (the Hub's reconstruction API), as from huggingface.co.
USE_XET = False


def env_for(home: Path) -> dict:
    no_proxy = ",".join(filter(None, ["127.0.0.1", "localhost", "10.213.7.1", os.environ.get("NO_PROXY")]))
    env = dict(os.environ, HF_HOME=str(home), HF_HUB_CACHE=str(home / "hub"), HF_XET_CACHE=str(home / "xet"),
               HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_PROGRESS_BARS="1", HF_TOKEN="",
               NO_PROXY=no_proxy, no_proxy=no_proxy,
               PYTHONPATH=os.pathsep.join([str(REPO / ".collections"), os.environ.get("PYTHONPATH", "")]))
    env.pop("HF_HUB_DISABLE_XET", None)
    if not USE_XET:
        env["HF_HUB_DISABLE_XET"] = "1"
    return env


def run_bare(hub, repo, commit, cache, env, workers) -> float:
    t = time.monotonic()
    subprocess.run([sys.executable, "-c", BARE, repo, commit, str(cache), hub.url, str(workers)], env=env,
                   check=True, capture_output=True)
    return time.monotonic() - t


def run_module(hub, repo, commit, cache, env, workers, tmp, verify="full") -> tuple:
    args = tmp / "args.json"
    args.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": {
        "repo_id": repo, "revision": commit, "cache_dir": str(cache), "endpoint": hub.url,
        "use_xet": USE_XET, "workers": workers, "verify": verify}}))
    t = time.monotonic()
    out = subprocess.run([sys.executable, str(REPO / "plugins" / "modules" / "hf_snapshot.py"), str(args)], env=env,
                         capture_output=True, text=True)
    wall = time.monotonic() - t
    result = json.loads(out.stdout)
    if result.get("failed"):
        raise SystemExit("hf_snapshot failed: %s" % result["msg"])
    return wall, result


def _cpu_seconds_per_gb(hub, repo, commit, tmp, workers) -> dict:
    """User+system CPU of one download process of each kind (what a busy host pays)."""
    out = {}
    for kind in ("bare", "module"):
        cache = tmp / f"cpu-{kind}"
        env = env_for(tmp / f"cpu-home-{kind}")
        before = os.times()
        if kind == "bare":
            run_bare(hub, repo, commit, cache, env, workers)
            size = sum(p.stat().st_size for p in (cache).rglob("*") if p.is_file() and "blobs" in p.parts)
        else:
            _, result = run_module(hub, repo, commit, cache, env, workers, tmp)
            size = result["bytes_downloaded"]
        after = os.times()
        cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
        out[kind] = cpu / (size / 1e9)
        shutil.rmtree(cache, ignore_errors=True)
    return out


def sha256_one_core(paths) -> float:
    t = time.monotonic()
    for p in paths:
        h = hashlib.sha256()
        with open(p, "rb", buffering=0) as fh:
            while True:
                chunk = fh.read(1 << 20)
                if not chunk:
                    break
                h.update(chunk)
        h.hexdigest()
    return time.monotonic() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hub", default="lab")
    ap.add_argument("--mb", type=int, default=384, help="total size of the shards, MB (10^6 bytes)")
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--xet", action="store_true",
                    help="download through hf_xet (the Hub's Xet path, the default on huggingface.co) on both sides")
    ap.add_argument("--rate", type=float, default=0.0,
                    help="throttle each file's transfer to this many MB/s on the Hub (a network-bound link "
                         "with CPU to spare, as on a GPU host); 0: as fast as the machine goes")
    a = ap.parse_args()
    global USE_XET
    USE_XET = a.xet

    tmp = Path(tempfile.mkdtemp(prefix="bench-hf-snapshot-"))
    hub, owned = hub_for(a.hub, tmp)
    repo = None
    try:
        size = a.mb * MB // a.files
        files = {f"model-{i + 1:05d}-of-{a.files:05d}.safetensors": shard(i, size) for i in range(a.files)}
        files.update({"config.json": b'{"architectures": ["LlamaForCausalLM"]}\n',
                      "tokenizer.json": b'{"model": {}}\n' * 5000})
        total = sum(len(v) for v in files.values())
        repo = f"bench/hf-snapshot-{a.mb}mb-{a.files}"
        commit = hub.publish(repo, files)
        nfiles = len(files)
        if a.rate > 0:
            hub.fault("throttle", rate=int(a.rate * MB), method="GET", repo=repo, count=None)
        del files
        print(f"hub {hub.url}  repo {repo}@{commit[:12]}  {nfiles} files, "
              f"{total / MB:.0f} MB  workers {a.workers}  cpus {hf_verify.default_workers()}  "
              f"load {os.getloadavg()[0]:.1f}  {'xet' if a.xet else 'http'}  "
              + (f"throttled to {a.rate:g} MB/s per file" if a.rate else "unthrottled"))
        bare_t, mod_t, size_t, mod_results = [], [], [], []
        last = None
        kinds = ["bare", "module", "size"]
        for r in range(a.rounds):
            for kind in kinds[r % 3:] + kinds[:r % 3]:      # rotate the order between rounds
                home = tmp / f"home-{kind}-{r}"
                cache = tmp / f"cache-{kind}-{r}"
                env = env_for(home)
                if kind == "bare":
                    bare_t.append(run_bare(hub, repo, commit, cache, env, a.workers))
                elif kind == "size":
                    wall, result = run_module(hub, repo, commit, cache, env, a.workers, tmp, verify="size")
                    size_t.append(wall)
                    assert USE_XET or result["bytes_downloaded"] == total
                else:
                    wall, result = run_module(hub, repo, commit, cache, env, a.workers, tmp)
                    mod_t.append(wall)
                    mod_results.append(result)
                    # over Xet bytes_downloaded counts what hf_xet reports (the wire's bytes), not the files'
                    got = (result["bytes_downloaded"], result["verification"]["hashed_bytes"])
                    assert got[1] == total and (USE_XET or got[0] == total), (got, total)
                if kind != "module":
                    shutil.rmtree(cache, ignore_errors=True)
                else:   # keep the latest module download for the hashing part
                    if last is not None:
                        shutil.rmtree(last, ignore_errors=True)
                    last = cache
        snapshot = Path(mod_results[-1]["snapshot_path"])
        paths = [str(p.resolve()) for p in sorted(snapshot.iterdir())]

        def best(ts):
            return min(ts)

        def median(ts):
            return sorted(ts)[len(ts) // 2]

        print()
        print("download + verification (wall time of the process; best of %d rounds, median in the ratio line)"
              % a.rounds)
        print(f"  {'':28}{'seconds':>10}{'MB/s':>10}")
        print(f"  {'snapshot_download (bare)':28}{best(bare_t):>10.2f}{total / MB / best(bare_t):>10.1f}"
              f"   runs: {', '.join('%.2f' % t for t in bare_t)}")
        print(f"  {'hf_snapshot (full verify)':28}{best(mod_t):>10.2f}{total / MB / best(mod_t):>10.1f}"
              f"   runs: {', '.join('%.2f' % t for t in mod_t)}")
        print(f"  {'hf_snapshot (verify=size)':28}{best(size_t):>10.2f}{total / MB / best(size_t):>10.1f}"
              f"   runs: {', '.join('%.2f' % t for t in size_t)}")
        ratio = best(bare_t) / best(mod_t)
        print(f"  throughput ratio hf_snapshot / bare = {ratio:.2f} best, {median(bare_t) / median(mod_t):.2f} median "
              f"(target >= 0.90); without content hashing {best(bare_t) / best(size_t):.2f} best, "
              f"{median(bare_t) / median(size_t):.2f} median")
        cpu = _cpu_seconds_per_gb(hub, repo, commit, tmp, a.workers)
        print(f"  CPU seconds per GB (client process): bare {cpu['bare']:.2f}, hf_snapshot {cpu['module']:.2f}")
        m = mod_results[-1]
        print(f"  inside hf_snapshot: download {m['mb_per_s']} MB/s, verification overlapped "
              f"{m['verification']['seconds']:.2f} s from first to last file, module total {m['seconds']:.2f} s")

        # hashing: warm page cache, same files
        sha256_one_core(paths)
        base = min(sha256_one_core(paths) for _ in range(2))
        items = []
        listing = json.loads(Path(m["manifest"]).read_text())["listing"]
        for p in sorted(snapshot.iterdir()):
            items.append((str(p.resolve()), listing[p.name]))
        rows = [("hashlib.sha256, 1 core", base, 1.0)]
        for w in (1, 2):
            best_dt, cores = None, 0.0
            for _ in range(3):
                t, c = time.monotonic(), time.process_time()
                res = hf_verify.verify_all(items, workers=w)
                dt, cpu = time.monotonic() - t, time.process_time() - c
                assert all(x["ok"] for x in res)
                if best_dt is None or dt < best_dt:
                    best_dt, cores = dt, cpu / dt
            rows.append(("hf_verify, %d worker%s" % (w, "s" if w > 1 else ""), best_dt, cores))
        print()
        print("verification of the same %d MB (page cache warm; cores used = CPU time / wall time)" % (total // MB))
        print(f"  {'':28}{'seconds':>10}{'GB/s':>10}{'vs 1 core':>11}{'cores used':>12}")
        for name, dt, cores in rows:
            print(f"  {name:28}{dt:>10.3f}{total / 1e9 / dt:>10.2f}{base / dt:>10.2f}x{cores:>12.2f}")
        print(f"  (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs: other work competes for the cores)")
    finally:
        if a.rate > 0 and repo:
            for f in hub.faults():
                if f.get("repo") == repo:
                    hub.remove_fault(f["id"])
        if owned:
            hub.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
