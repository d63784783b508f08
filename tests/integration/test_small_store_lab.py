"""The disk-full operator's migration on a store that is really small (issue 35).

The lab's hosts have tens of GiB free, so no migration ever had to delete the old model before
the target could come; the one that had to (a purge inside migrate.yml) had never deleted
anything. Here gpu2's model store is a file system of 12 MiB (`labctl small-store`): it holds
tiny-a (3.4 MB, served, the fallback kept like the example fleet's MiniMax) and tiny-broken
(3.4 MB, the old weights nobody wants, like its Kimi-K2.5-NVFP4), and tiny-b (7.1 MB, + 5 %
headroom) fits only once one of them is gone.

One module-scoped story, in order (each real vLLM start costs about a minute):
  tiny-a served from the small store, tiny-broken beside it -> with tiny-broken kept, only
  purging the served model would make room: the migration to tiny-b is refused before anything
  changes, and so is one that would not fit even with it -> the preview plans the purge of
  tiny-broken (never the served fallback) -> the run purges exactly that, frees what statvfs
  sees, downloads, swaps and benchmarks, with the preview's numbers -> the disk fills up in the
  middle of the next download: the fetch fails as disk_full, tiny-b keeps serving, intact; once
  the space is back, the rerun completes.
"""
from __future__ import annotations

import subprocess

import pytest

from ansible_collections.modelswap.vllm.plugins.plugin_utils import runner
from tests.integration import vllm_lab
from tests.lab import labctl
from tests.support.crash import served_models

pytestmark = [pytest.mark.lab, pytest.mark.vllm]
HOST = "gpu2"
LIMIT = f"{HOST},localhost"
SIZE = 12 * 1024 ** 2
STORE = f"{labctl.SMALL_STORE_IN_HOST}/hub"
REPO = {"tiny-a": "models--lab--tiny-a", "tiny-b": "models--lab--tiny-b",
        "tiny-broken": "models--lab--tiny-broken"}


def served(lab, key: str) -> list[str] | None:
    return served_models(lab.address(HOST), key)


def main_pid(lab) -> str:
    return lab.ssh(HOST, "systemctl show -p MainPID --value vllm.service").stdout.strip()


def statvfs(lab) -> dict:
    """The small store's file system as statvfs gives it: size, free (for root), available."""
    out = lab.ssh(HOST, f"stat -f -c '%S %b %f %a' {labctl.SMALL_STORE_IN_HOST}").stdout.split()
    block, blocks, free, avail = (int(x) for x in out)
    return {"size": block * blocks, "free": block * free, "available": block * avail}


def repos(lab) -> set[str]:
    out = lab.ssh(HOST, f"ls {STORE}", check=False).stdout.split()
    return {name for name, folder in REPO.items() if folder in out}


def blob_sums(lab, name: str) -> str:
    """sha256 of every blob of a model in the store (the served model's files, byte for byte)."""
    return lab.ssh(HOST, f"cd {STORE}/{REPO[name]}/blobs && sha256sum * | sort").stdout


def file_gets(lab) -> list:
    return [r for r in lab.hub.requests() if r["method"] == "GET" and r.get("file")]


@pytest.fixture(scope="module")
def small(lab, tmp_path_factory):
    results = tmp_path_factory.mktemp("results")
    vllm_lab.reset_host(lab, HOST)
    store = lab.small_store(HOST, SIZE)
    assert store["size"] == SIZE
    base = {"modelswap_results_dir": str(results), "benchmark_results_dir": str(results / "benchmark"),
            "modelswap_hf_cache": STORE, "lb_pool_type": "none"}
    # the served model is the fallback the operator keeps; tiny-broken is the old weights
    state = {"key": lab.api_key, "base": base, "vars": dict(base, modelswap_keep=["tiny-a"])}
    start = runner.migrate(str(lab.inventory), serve="tiny-a", limit=LIMIT,
                           extra_vars=dict(state["vars"], modelswap_benchmark=False))
    assert start["ok"], start["run"]["failures"]
    fetched = lab.playbook("playbooks/fetch.yml", dict(base, modelswap_serve="tiny-broken"), limit=HOST)
    assert fetched.rc == 0, fetched.stdout[-3000:]
    assert served(lab, state["key"]) == ["tiny-a"] and repos(lab) == {"tiny-a", "tiny-broken"}
    yield state
    lab.ssh(HOST, f"rm -f {labctl.SMALL_STORE_IN_HOST}/filler", check=False)
    vllm_lab.reset_host(lab, HOST)
    labctl.reset(lab._lab)          # unmounts the small store and forgets what was fetched there


def test_1_a_target_that_fits_only_by_purging_the_served_model_is_refused_unless_allowed(lab, small):
    """With tiny-broken kept, only purging the served tiny-a would make room, and the operator has
    not allowed that downtime; with both kept, nothing would: the migration is refused in
    preflight, each time saying why, and nothing is deleted, downloaded or restarted."""
    keep_old = dict(small["vars"], modelswap_keep=["tiny-broken"])
    keep_both = dict(small["vars"], modelswap_keep=["tiny-a", "tiny-broken"])
    pid, before, sums = main_pid(lab), statvfs(lab), blob_sums(lab, "tiny-a")
    lab.hub.clear_log()
    refused = runner.run_playbook("migrate.yml", str(lab.inventory), dict(keep_old, modelswap_serve="tiny-b"),
                                  limit=LIMIT)
    assert not refused.ok
    failure = refused.custom_stats["modelswap_record"][HOST]["failure"]
    assert failure["step"] == "preflight", failure
    assert "only purging the served model" in failure["msg"] and "allow_served_purge" in failure["msg"]
    # a real run's plan says what failed; "would fail" is the preview's word
    assert f"{HOST}: migrate to tiny-b - failed: " in refused.stdout and "would fail" not in refused.stdout
    too_big = runner.migrate(str(lab.inventory), serve="tiny-b", limit=LIMIT, extra_vars=keep_both)
    assert not too_big["ok"]
    failure = too_big["records"][HOST]["failure"]
    assert failure["step"] == "preflight" and "does not fit" in failure["msg"], failure
    assert "even after purging every allowed candidate" in failure["msg"]
    # nothing changed: the same process serves tiny-a from the same bytes; the store is as it was
    assert main_pid(lab) == pid and served(lab, small["key"]) == ["tiny-a"]
    assert repos(lab) == {"tiny-a", "tiny-broken"} and blob_sums(lab, "tiny-a") == sums
    assert statvfs(lab)["free"] == before["free"]
    assert not file_gets(lab)


def test_2_the_preview_plans_the_purge_of_the_old_weights_and_never_the_fallback(lab, small):
    out = runner.preview(str(lab.inventory), serve="tiny-b", limit=LIMIT, extra_vars=small["vars"])
    assert out["ok"], out["run"]["failures"]
    steps = {s["step"]: s for s in out["plan"][HOST]["steps"]}
    assert steps["preflight"]["verdict"] == "fits_after_purge"
    assert [i["name"] for i in steps["purge"]["items"]] == ["lab/tiny-broken"], steps["purge"]
    assert steps["purge"]["bytes"] >= 3_400_000
    assert steps["fetch"]["files"] == 7 and steps["fetch"]["bytes"] > 7_000_000
    assert steps["swap"]["would_swap"] and steps["swap"]["stop"] == "tiny-a"
    assert repos(lab) == {"tiny-a", "tiny-broken"}
    small["preview"] = steps


def test_3_the_migration_purges_downloads_swaps_and_benchmarks_with_the_previews_numbers(lab, small):
    before, fallback = statvfs(lab), blob_sums(lab, "tiny-a")
    out = runner.migrate(str(lab.inventory), serve="tiny-b", limit=LIMIT, extra_vars=small["vars"])
    assert out["ok"], out["run"]["failures"]
    record, planned = out["records"][HOST], small["preview"]
    after = statvfs(lab)
    print("small store:", {"size": SIZE, "free_before": before["free"], "free_after": after["free"],
                           "planned_purge": planned["purge"]["bytes"], "freed": record["purge"]["freed_bytes"],
                           "downloaded": record["fetch"]["bytes_downloaded"],
                           "downtime_s": record["swap"]["downtime_s"]})
    assert record["outcome"] == "migrated" and served(lab, small["key"]) == ["tiny-b"]
    assert record["purge"]["removed"] == 1
    # the bytes freed are statvfs's, and the preview said them
    assert record["purge"]["freed_bytes"] == planned["purge"]["bytes"] == record["purge"]["planned_bytes"]
    assert record["fetch"]["bytes_downloaded"] == planned["fetch"]["bytes"] and record["fetch"]["verified"]
    # what tiny-b holds: over Xet its blobs are links into the cache-wide store, counted through
    # them, and each payload there has its list of links (<xet hash>.refs)
    stored = int(lab.ssh(HOST, f"cd {STORE}/{REPO['tiny-b']} && {{ du -s -L -B1 .; for b in blobs/*; do "
                               f"[ -L $b ] && du -B1 $(readlink -f $b).refs; done; }} | "
                               "awk '{s += $1} END {print s}'").stdout)
    assert after["free"] == before["free"] + record["purge"]["freed_bytes"] - stored
    assert repos(lab) == {"tiny-a", "tiny-b"} and blob_sums(lab, "tiny-a") == fallback
    assert record["benchmark"] and record["benchmark"]["report"]
    small["tiny-b"] = blob_sums(lab, "tiny-b")


FILL_DURING_DOWNLOAD = r"""
d={store}; incoming={store}/hub/{repo}/blobs
for i in $(seq 1 1200); do
  ls "$incoming"/*.incomplete >/dev/null 2>&1 && break
  sleep 0.05
done
ls "$incoming"/*.incomplete >/dev/null 2>&1 || {{ echo "no download seen"; exit 3; }}
# the download writes meanwhile: what was free a moment ago may be gone, so leave a little more
# room at each try (the rest of the download is megabytes: it still cannot fit)
for spare in 8192 65536 262144 1048576; do
  size=$(( $(stat -f -c '%a * %S' "$d") - spare ))
  if fallocate -l $size "$d/filler" 2>/dev/null; then echo "filled $size bytes"; exit 0; fi
  rm -f "$d/filler"
done
echo "could not fill the store"; exit 4
"""


def test_4_a_disk_that_fills_in_the_middle_of_the_download_fails_it_and_the_rerun_completes(lab, small):
    """Something else writes to the store while tiny-a downloads (here: a file as large as what
    was free, once the download has begun): the fetch fails as disk_full, tiny-b keeps serving
    from intact files, nothing half-downloaded stays; with the space back, the rerun completes."""
    # room to download tiny-a again, without a purge: the stand-alone purge takes it, by name
    purged = lab.playbook("playbooks/purge.yml", dict(small["base"], modelswap_serve="tiny-b",
                                                      model_purge_items=["tiny-a"], model_purge_all_listed=True),
                          limit=HOST)
    assert purged.rc == 0, purged.stdout[-3000:]
    assert repos(lab) == {"tiny-b"}
    pid = main_pid(lab)
    # every transfer of the payload throttled (over Xet: each xorb range) until cleared below
    lab.hub.fault("throttle", rate=400_000, repo="lab/tiny-a", file="model.safetensors", count=None)
    filler = subprocess.Popen(labctl.ssh_argv(lab._lab, HOST) + [FILL_DURING_DOWNLOAD.format(
        store=labctl.SMALL_STORE_IN_HOST, repo=REPO["tiny-a"])], text=True, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT)
    try:
        run = runner.run_playbook("migrate.yml", str(lab.inventory), dict(small["vars"], modelswap_serve="tiny-a"),
                                  limit=LIMIT)
    finally:
        lab.hub.clear_faults()
        said, _ = filler.communicate(timeout=120)
    assert "filled" in said, said
    assert not run.ok
    failure = run.custom_stats["modelswap_record"][HOST]["failure"]
    assert failure["step"] == "fetch" and "the disk is full" in failure["msg"], failure
    assert "No space left on device" in failure["msg"]
    causes = [ev["event_data"].get("res", {}).get("cause") for ev in run.events if ev.get("event") == "runner_on_failed"]
    assert "disk_full" in causes, run.failures()
    # the served model was never touched
    assert main_pid(lab) == pid and served(lab, small["key"]) == ["tiny-b"]
    assert blob_sums(lab, "tiny-b") == small["tiny-b"]
    assert not lab.ssh(HOST, f"ls {STORE}/{REPO['tiny-a']}/blobs/ | grep incomplete", check=False).stdout
    # the space comes back: the rerun downloads, swaps and serves tiny-a
    lab.ssh(HOST, f"rm -f {labctl.SMALL_STORE_IN_HOST}/filler")
    rerun = runner.migrate(str(lab.inventory), serve="tiny-a", limit=LIMIT,
                           extra_vars=dict(small["vars"], modelswap_benchmark=False))
    assert rerun["ok"], rerun["run"]["failures"]
    assert rerun["records"][HOST]["outcome"] == "migrated" and served(lab, small["key"]) == ["tiny-a"]
    assert rerun["records"][HOST]["fetch"]["verified"]


def test_5_a_purge_that_cannot_delete_fails_naming_what_is_left(lab, small):
    """A file of tiny-b is immutable (as on a store an operator protected with chattr, or an NFS
    export that squashes root): huggingface_hub's delete strategy logs the PermissionError and
    returns; the purge reads the store again and fails, naming the model and the cause, instead of
    reporting it removed. Once the file may go, the same purge completes."""
    blob = lab.ssh(HOST, f"readlink -f {STORE}/{REPO['tiny-b']}/snapshots/*/model.safetensors").stdout.strip()
    # over Xet the bytes are the cache-wide store's payload, which the repo's blob links to
    xet = blob.startswith(f"{STORE}/blobs/")
    assert xet or blob.startswith(f"{STORE}/{REPO['tiny-b']}/blobs/"), blob
    purge = dict(small["base"], modelswap_serve="tiny-a", model_purge_items=["tiny-b"], model_purge_all_listed=True)
    lab.ssh(HOST, f"chattr +i {blob}")
    try:
        refused = lab.playbook("playbooks/purge.yml", purge, limit=HOST)
        assert refused.rc != 0, refused.stdout[-3000:]
        failed = [ev["event_data"]["res"] for ev in refused.events if ev.get("event") == "runner_on_failed"]
        assert failed, refused.stdout[-3000:]
        res = failed[-1]
        assert "Operation not permitted" in res["msg"] and blob in res["msg"], res["msg"]
        if xet:     # the repo's links went; the payload they led to stays, named, for the rerun
            assert "deleted 1 of 1" in res["msg"], res["msg"]
            assert [row["item"] for row in res["left"]] == [f"shared payload {blob}"], res["left"]
            assert [row["repo_id"] for row in res["removed"]] == ["lab/tiny-b"], res["removed"]
        else:
            assert "deleted 0 of 1" in res["msg"] and "lab/tiny-b" in res["msg"], res["msg"]
            assert [row["item"] for row in res["left"]] == ["lab/tiny-b"] and blob in res["left"][0]["paths"]
            assert not res.get("removed"), res.get("removed")
        assert lab.ssh(HOST, f"test -e {blob} && echo there").stdout.strip() == "there"
        assert served(lab, small["key"]) == ["tiny-a"]
    finally:
        lab.ssh(HOST, f"chattr -i {blob}", check=False)
    again = lab.playbook("playbooks/purge.yml", purge, limit=HOST)
    assert again.rc == 0, again.stdout[-3000:]
    assert "tiny-b" not in repos(lab) and served(lab, small["key"]) == ["tiny-a"]
    assert lab.ssh(HOST, f"test -e {blob} || echo gone", check=False).stdout.strip() == "gone"
