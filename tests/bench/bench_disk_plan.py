"""Benchmark: disk_plan's planning time on a big synthetic Hugging Face cache, side by side with
huggingface_hub.scan_cache_dir() alone, in the same run.

    .venv/bin/python tests/bench/bench_disk_plan.py [--repos 200] [--files 50000] [--repeat 5]

It builds the cache under /tmp (real blobs, relative snapshot links, refs, as huggingface_hub writes
them), times each variant --repeat times (median and best), checks that both scanners agree on every
repo's and revision's size, prints the figures, and removes the cache. Variants:

  hf.scan_cache_dir           huggingface_hub.scan_cache_dir() alone
  hf.scan+delete_revisions    what a plan costs with huggingface_hub's API: the scan, then one
                              delete_revisions(...).expected_freed_size per repo
  store_scan.scan_store (N threads)    modelswap's scanner with N threads (pays on a cold cache)
  store_scan.scan_store                modelswap's scanner (plugins/module_utils/store/store_scan.py) alone, one thread
  model_store.plan (scan+order+sim)    the whole plan as disk_plan computes it: scan, protections, candidates
                              in LRU order, freed bytes per step (shared blobs once), the verdict
  disk_plan module            the Ansible module end to end (a process, as on a host), target_bytes

--cold drops the page cache before each run (root; disturbs other work on the machine).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / ".collections")]

from ansible_collections.modelswap.vllm.plugins.module_utils.store import disk_plan  # noqa: E402
from ansible_collections.modelswap.vllm.plugins.module_utils.store import protections  # noqa: E402
from ansible_collections.modelswap.vllm.plugins.module_utils.store import purge_items  # noqa: E402
from ansible_collections.modelswap.vllm.plugins.module_utils.store import model_store  # noqa: E402
from ansible_collections.modelswap.vllm.plugins.module_utils.store import store_scan  # noqa: E402
from tests.support import synthetic_cache  # noqa: E402
from tests.support.modules import run_module  # noqa: E402


def drop_caches():
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as fh:
        fh.write("3\n")


def timed(fn, repeat, cold):
    times, result = [], None
    for _ in range(repeat):
        if cold:
            drop_caches()
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return times, result


def ms_plan(cache, workers):
    store = store_scan.scan_store(str(cache), workers=workers)
    state = protections.build_protections(store, models={}, protect_paths=[])
    items, _ = purge_items.all_candidates(store, state["protections"])
    items = purge_items.order_lru(store, items)
    plan = disk_plan.make_plan(store, {"available": 0}, needed_bytes=10 ** 15, headroom_bytes=0,
                               candidates=items, orphans=store.orphans)
    return store, plan


def hf_plan(cache):
    from huggingface_hub import scan_cache_dir
    info = scan_cache_dir(cache)
    freed = {}
    for repo in info.repos:
        freed[repo.repo_id] = info.delete_revisions(*[r.commit_hash for r in repo.revisions]).expected_freed_size
    return info, freed


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repos", type=int, default=200)
    ap.add_argument("--files", type=int, default=50_000, help="snapshot files in all")
    ap.add_argument("--revisions", type=int, default=2, help="revisions per repo (sharing blobs)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--workers", type=int, default=8, help="threads of the threaded scan variant")
    ap.add_argument("--cold", action="store_true", help="drop the page cache before each run (root)")
    ap.add_argument("--json", help="also write the figures to this file")
    ap.add_argument("--keep", action="store_true", help="keep the synthetic cache (path printed)")
    args = ap.parse_args()

    from huggingface_hub import __version__ as hf_version, scan_cache_dir

    root = Path(tempfile.mkdtemp(prefix="modelswap-bench-", dir="/tmp"))
    cache = root / "hub"
    try:
        t0 = time.perf_counter()
        made = synthetic_cache.synthetic_cache(cache, repos=args.repos, files=args.files, revisions=args.revisions)
        build_s = time.perf_counter() - t0
        print("synthetic cache: %(repos)d repos, %(snapshot_files)d snapshot files, %(blobs)d blobs" % made,
              "(built in %.1f s) at %s" % (build_s, cache))
        print("huggingface_hub %s, python %s, %d CPU(s), %s page cache, %d run(s) each\n" % (
            hf_version, sys.version.split()[0], os.cpu_count() or 1, "cold" if args.cold else "warm",
            args.repeat))

        rows = []
        t, hf_info = timed(lambda: scan_cache_dir(cache), args.repeat, args.cold)
        rows.append(("hf.scan_cache_dir", t))
        t, (_, hf_freed) = timed(lambda: hf_plan(cache), args.repeat, args.cold)
        rows.append(("hf.scan+delete_revisions", t))
        t, _ = timed(lambda: store_scan.scan_store(str(cache), workers=args.workers), args.repeat, args.cold)
        rows.append(("ms.scan_store (%d threads)" % args.workers, t))
        t, store = timed(lambda: store_scan.scan_store(str(cache)), args.repeat, args.cold)
        rows.append(("ms.scan_store", t))
        t, (store, plan) = timed(lambda: ms_plan(cache, args.workers if args.cold else 1), args.repeat, args.cold)
        rows.append(("ms.plan (scan+order+sim)", t))
        module_args = {"cache_dir": str(cache), "target_bytes": 10 ** 15, "vllm_unit": "",
                       "deployment_record": str(root / "none.json"), "headroom": "0"}
        if args.cold:
            module_args["scan_workers"] = args.workers
        t, result = timed(lambda: run_module("disk_plan", module_args), args.repeat, args.cold)
        assert not result.get("failed"), result.get("msg")
        rows.append(("disk_plan module", t))

        # agreement: sizes per repo and revision, and whole-repo freed sizes
        mismatches = 0
        for repo in hf_info.repos:
            mine = store.repo(repo.repo_id, repo.repo_type)
            mismatches += mine.size != repo.size_on_disk
            for rev in repo.revisions:
                mismatches += mine.revision_size(rev.commit_hash) != rev.size_on_disk
        sim_apparent = {store.repos[i.folder].repo_id: model_store.DeletionSimulator(store).apply(i).size
                        for i in (model_store.Item("repo", folder=f) for f in store.repos)}
        refs_bytes = {store.repos[f].repo_id: sum(40 for _ in store.repos[f].refs) for f in store.repos}
        freed_mismatch = sum(1 for rid, size in hf_freed.items() if sim_apparent[rid] - refs_bytes[rid] != size)

        base = statistics.median(rows[0][1])
        print("%-28s %10s %10s %10s" % ("variant", "median s", "best s", "vs hf scan"))
        for name, times in rows:
            med = statistics.median(times)
            print("%-28s %10.3f %10.3f %9.2fx" % (name, med, min(times), base / med))
        print("\nplan: %d candidates, %s reclaimable, module timings %s" % (
            len(plan["candidates"]), model_store.human_bytes(plan["candidates_bytes"]), result["timings"]))
        print("agreement with huggingface_hub: %d size mismatches over %d repos / %d revisions; "
              "%d whole-repo freed-size mismatches" % (
                  mismatches, len(hf_info.repos), sum(len(r.revisions) for r in hf_info.repos), freed_mismatch))
        if args.json:
            Path(args.json).write_text(json.dumps({
                "cache": made, "cold": args.cold, "repeat": args.repeat, "huggingface_hub": hf_version,
                "variants": {n: {"median_s": statistics.median(t), "best_s": min(t), "runs_s": t} for n, t in rows},
                "mismatches": mismatches, "freed_mismatches": freed_mismatch}, indent=2))
        return 1 if mismatches or freed_mismatch else 0
    finally:
        if args.keep:
            print("kept", cache)
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
