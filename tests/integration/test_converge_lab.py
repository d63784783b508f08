"""A rerun repairs what an interrupted migration left (issue 27), on the lab behind HAProxy.

The controller is killed (SIGKILL to ansible-playbook's whole process group) the moment a task
of gpu1's swap starts; the same command run again must converge: the host serves the target and
passes the gates, is UP in the pool, the record names what serves and ``previous`` what served
before, and a second rerun changes nothing. The kill points sampled here (the campaign over every
task start is tests/bench/bench_crash_points.py): between the stop and the start, during the
gates, and between the gates and the rejoin. Also here: a run with ``--limit`` and no localhost
gets a results folder of its own.

gpu1 alone serves here (the floor is 0: the pool's other server is not part of the story).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from ansible_collections.modelswap.vllm.plugins.plugin_utils import runner
from tests.integration import vllm_lab
from tests.support.crash import DRAIN_MARK as MARK
from tests.support.crash import convergence_problems, run_killed_at, served_models

pytestmark = [pytest.mark.lab, pytest.mark.vllm]
HOST = "gpu1"
# the migration's one read of a host (its lease, what it serves, the disk plan)
READ_TASK = "Read the host (refusals, lease, what it serves and has, the disk plan, the GPUs)"
LIMIT = f"{HOST},localhost"
LEASE = "/var/lib/modelswap/lease.json"


@pytest.fixture(scope="module")
def story(lab, tmp_path_factory):
    results = tmp_path_factory.mktemp("results")
    vllm_lab.reset_host(lab, HOST)
    lab.ssh(HOST, f"rm -f {MARK} {LEASE}")
    state = {"key": lab.api_key, "results": results,
             "vars": {"modelswap_results_dir": str(results), "benchmark_results_dir": str(results / "benchmark"),
                      "modelswap_benchmark": False, "modelswap_min_serving": 0}}
    start = runner.migrate(str(lab.inventory), serve="tiny-a", limit=LIMIT, extra_vars=state["vars"])
    assert start["ok"], start["run"]["failures"]
    assert lab.lb_servers()[HOST] == "UP"
    yield state
    vllm_lab.reset_host(lab, HOST)
    lab.ssh(HOST, f"rm -f {MARK} {LEASE}", check=False)
    lab.lb_command(f"enable server vllm/{HOST}")


def kill_then_rerun(lab, story, target: str, kill_at: str, before: str, inspect=None) -> dict:
    """Kill the swap to ``target`` where ``kill_at`` starts, check the state it left (and call
    ``inspect()`` on it), rerun: the rerun's result, after the invariants of a converged host are
    checked."""
    crashed = run_killed_at("migrate.yml", str(lab.inventory), dict(story["vars"], modelswap_serve=target),
                            kill_at=kill_at, limit=LIMIT)
    assert crashed["killed"], crashed["output"][-3000:]
    assert lab.lb_servers()[HOST].startswith("MAINT"), lab.lb_servers()       # left out of the pool
    if inspect:
        inspect()
    # the dead run still holds the host's lease: the operator takes it over by name
    dead = json.loads(lab.ssh(HOST, f"cat {LEASE}").stdout)["run_id"]
    rerun = runner.run_playbook("migrate.yml", str(lab.inventory),
                                dict(story["vars"], modelswap_serve=target, modelswap_break_lease=dead), limit=LIMIT)
    assert rerun.ok, rerun.failures()
    converged(lab, story, target, before)
    again = runner.run_playbook("migrate.yml", str(lab.inventory), dict(story["vars"], modelswap_serve=target),
                                limit=LIMIT)
    assert again.ok and again.changed(HOST) == 0, again.failures()
    assert again.custom_stats["modelswap_record"][HOST]["outcome"] == "unchanged"
    return {"crashed": crashed, "rerun": rerun}


def converged(lab, story, target: str, before: str) -> None:
    """Serves the target (the gates' completion included), UP in the pool, the record names it
    and `previous` what served before, the saved configuration a rollback restores is the one
    that serves, no drain mark is left, both models' files intact."""
    assert convergence_problems(lab, HOST, story["key"], target, before) == []


def test_1_killed_between_the_stop_and_the_start(lab, story):
    out = kill_then_rerun(lab, story, "tiny-b", "Wait for GPU memory to be released", before="tiny-a")
    assert out["rerun"].custom_stats["modelswap_record"][HOST]["outcome"] == "migrated"
    # the dead run's lease was taken over by name, and said so
    leases = [r["lease"] for r in out["rerun"].task_results(READ_TASK, HOST)]
    assert leases[0]["taken_over"] and "as asked (modelswap_break_lease)" in leases[0]["reason"], leases[0]


def status_lines(lab, story) -> list[str]:
    """playbooks/status.yml's table, line by line."""
    run = lab.playbook("playbooks/status.yml", {"vllm_service_api_key": story["key"]})
    assert run.rc == 0, run.stdout[-3000:]
    shown = [r for r in run.task_results("Show the fleet table", "localhost")]
    assert shown, run.stdout[-3000:]
    return shown[-1]["msg"]


@pytest.mark.campaign
def test_2_killed_during_the_gates_the_rerun_repairs_the_record_and_rejoins(lab, story):
    seen = {}

    def status_of_the_killed_run():
        # the server the killed run started comes up; status.yml then says what the rerun repairs
        for _ in range(180):
            if served_models_now(lab, story) == ["tiny-a"]:
                break
            time.sleep(1)
        seen["lines"] = status_lines(lab, story)

    out = kill_then_rerun(lab, story, "tiny-a", "Wait until the new server serves", before="tiny-b",
                          inspect=status_of_the_killed_run)
    flagged = [line for line in seen["lines"] if line.startswith(f"! {HOST}:")]
    assert flagged == [f"! {HOST}: record names tiny-b, serves tiny-a: rerun migrate.yml to repair it",
                       f"! {HOST}: serves but MAINT in the pool (an interrupted migrate.yml drained it): "
                       "rerun migrate.yml to rejoin it"], seen["lines"]
    row = next(line.split() for line in seen["lines"] if line.startswith(HOST + " "))
    assert row[1:3] == ["tiny-b", "tiny-a"] and row[5] == "MAINT", row
    after = status_lines(lab, story)
    assert not [line for line in after if line.startswith(f"! {HOST}:")], after
    row = next(line.split() for line in after if line.startswith(HOST + " "))
    assert row[1:3] == ["tiny-a", "tiny-a"] and row[5] == "UP", row
    rec = out["rerun"].custom_stats["modelswap_record"][HOST]
    # the server the killed run started is kept: no second restart, the plan repairs the rest
    assert not rec["swap"]["swapped"] and rec["outcome"] == "changed", rec
    swap = {s["step"]: s for s in rec["plan"]["steps"]}["swap"]
    assert "repair the record: it names tiny-b" in swap["text"] and "rejoin the pool" in swap["text"], swap


@pytest.mark.campaign
def test_3_killed_between_the_gates_and_the_rejoin(lab, story):
    out = kill_then_rerun(lab, story, "tiny-b", "Put the host back in the pool (the generation gate passed)",
                          before="tiny-a")
    rec = out["rerun"].custom_stats["modelswap_record"][HOST]
    assert not rec["swap"]["swapped"], rec
    assert any("rejoin the pool" in line for line in {s["step"]: s for s in rec["plan"]["steps"]}["swap"]["repairs"])


def test_4_a_limited_run_without_localhost_gets_its_own_results_folder(lab, story):
    runs = [runner.migrate(str(lab.inventory), serve="tiny-b", limit=HOST, extra_vars=story["vars"]) for _ in range(2)]
    for out in runs:
        assert out["ok"], out["run"]["failures"]
        assert Path(out["run_dir"], f"{HOST}.json").exists() and Path(out["run_dir"], "summary.md").exists()
        assert Path(out["run_dir"]).parent == Path(story["results"]) / "runs"
    assert runs[0]["run_dir"] != runs[1]["run_dir"]
    assert not (Path(story["results"]) / "runs" / "adhoc").exists()


def test_5_a_second_run_beside_the_first_refuses_naming_it_and_changes_nothing(lab, story):
    """A run to tiny-a, and while it holds gpu1 a run to tiny-b: the second refuses before it reads
    or changes anything, naming the first; the first completes."""
    import threading
    first: dict = {}
    worker = threading.Thread(target=lambda: first.update(run_killed_at(
        "migrate.yml", str(lab.inventory), dict(story["vars"], modelswap_serve="tiny-a"), kill_at=None, limit=LIMIT)))
    worker.start()
    holder = None
    for _ in range(600):
        text = lab.ssh(HOST, f"cat {LEASE} 2>/dev/null", check=False).stdout
        if text.strip():
            holder = json.loads(text)
            break
        time.sleep(0.1)
    assert holder, "the first run never took the lease"
    second = runner.run_playbook("migrate.yml", str(lab.inventory), dict(story["vars"], modelswap_serve="tiny-b"),
                                 limit=LIMIT)
    worker.join(900)
    assert not second.ok
    failure = second.custom_stats["modelswap_record"][HOST]["failure"]
    assert f"is held by run {holder['run_id']}" in failure["msg"], failure
    assert f"-e modelswap_break_lease={holder['run_id']}" in failure["msg"]
    assert second.changed(HOST) == 0
    assert first["rc"] == 0, first["output"][-3000:]
    assert convergence_problems(lab, HOST, story["key"], "tiny-a", "tiny-b") == []
    assert lab.ssh(HOST, f"test -e {LEASE}", check=False).returncode != 0       # given back


@pytest.mark.campaign
def test_6_killed_during_the_download_the_rerun_follows_the_orphaned_download(lab, story):
    """The controller dies while tiny-b downloads (slowly: the Hub throttles it): the download, an
    async job on the host, goes on and holds the store's lock. The rerun's plan says it follows it;
    its fetch waits for that download (past model_fetch_lock_timeout, since it progresses) instead
    of failing as locked, downloads nothing itself, verifies, and the swap completes."""
    if lab.ssh(HOST, "test -d /var/lib/modelswap/hf/hub/models--lab--tiny-b", check=False).returncode == 0:
        purged = lab.playbook("playbooks/purge.yml", dict(story["vars"], modelswap_serve="tiny-a",
                                                          model_purge_items=["tiny-b"], model_purge_all_listed=True),
                              limit=HOST)
        assert purged.rc == 0, purged.stdout[-3000:]
    # every transfer of the payload throttled (over Xet: its reconstruction's answer and each xorb
    # range), until cleared below: the orphan is still downloading when the rerun looks
    lab.hub.fault("throttle", rate=250_000, repo="lab/tiny-b", file="model.safetensors", count=None)
    lab.hub.clear_log()
    try:
        # its progress file is written every second (half the poll interval): a sign of life the
        # rerun's short model_fetch_lock_timeout can see
        crashed = run_killed_at("migrate.yml", str(lab.inventory),
                                dict(story["vars"], modelswap_serve="tiny-b", model_fetch_poll_interval=2),
                                kill_at="Show the progress of each host at every interval", limit=LIMIT)
        assert crashed["killed"], crashed["output"][-3000:]
        dead = json.loads(lab.ssh(HOST, f"cat {LEASE}").stdout)["run_id"]
        ev = dict(story["vars"], modelswap_serve="tiny-b", modelswap_break_lease=dead, model_fetch_lock_timeout=5,
                  model_fetch_poll_interval=2)
        preview = runner.preview(str(lab.inventory), serve="tiny-b", limit=LIMIT, extra_vars=ev)
        fetch = {s["step"]: s for s in preview["plan"][HOST]["steps"]}["fetch"]
        assert "follow the download started by run" in fetch["text"], fetch
        rerun = runner.run_playbook("migrate.yml", str(lab.inventory), ev, limit=LIMIT)
    finally:
        lab.hub.clear_faults()
    assert rerun.ok, rerun.failures()
    assert "following the download of run" in rerun.stdout
    rec = rerun.custom_stats["modelswap_record"][HOST]
    assert rec["outcome"] == "migrated" and rec["fetch"]["bytes_downloaded"] == 0 and rec["fetch"]["verified"], rec
    starts = lab.hub.payload_downloads("lab/tiny-b", "model.safetensors")
    assert len(starts) == 1, starts                      # the orphan's download, never a second one
    converged(lab, story, "tiny-b", "tiny-a")


SAVED = "/var/lib/modelswap/vllm"
# The saved configurations' folder moved onto a 1 MiB tmpfs (its files copied in) and filled: the
# next write there fails with ENOSPC, as on a full /var/lib/modelswap. Undone by FREE_SAVED.
FULL_SAVED = r"""
set -e
d={d}; keep=$(mktemp -d)
cp -a "$d"/. "$keep"/
mount -t tmpfs -o size=1M,mode=0755 modelswap-full "$d"
cp -a "$keep"/. "$d"/ && rm -rf "$keep"
fallocate -l $(( $(stat -f -c '%a * %S' "$d") )) "$d/filler"
if echo x > "$d/probe" 2>/dev/null; then echo "still room"; exit 3; fi
rm -f "$d/probe"
echo full
"""
FREE_SAVED = r"""
d={d}; keep=$(mktemp -d)
rm -f "$d/filler" "$d/probe"
if mountpoint -q "$d"; then cp -a "$d"/. "$keep"/ && umount "$d" && cp -a "$keep"/. "$d"/; fi
rm -rf "$keep"
"""


def saved_state(lab) -> tuple:
    """The record's deployment (what serves and what served before; its notes of what was fetched
    apart, which a download's verification updates) and every saved configuration, byte for byte
    (a staged write's leftovers apart)."""
    record = json.loads(lab.ssh(HOST, "cat /var/lib/modelswap/deployment.json").stdout)
    record.pop("fetched", None)
    return record, lab.ssh(HOST, f"cd {SAVED} && find . -type f ! -name filler ! -path './*/.staged/*' "
                                 "| sort | xargs sha256sum").stdout


@pytest.mark.campaign
def test_7_a_record_write_that_fails_on_a_full_disk_leaves_the_old_state_and_the_rerun_completes(lab, story):
    """The disk under the saved configurations is full when the swap records it: the
    record write fails (ENOSPC) after the new server started. With no rollback asked, the host
    serves the target while the record and every saved configuration are still the old one's, byte for byte
    (the old state, not a mix: a later rollback would restore the right model). With the space
    back, the rerun repairs the record without a restart and the host converges."""
    serving = served_models_now(lab, story)
    assert serving in (["tiny-a"], ["tiny-b"]), serving
    old, new = serving[0], {"tiny-a": "tiny-b", "tiny-b": "tiny-a"}[serving[0]]
    before = saved_state(lab)
    assert lab.ssh(HOST, FULL_SAVED.format(d=SAVED)).stdout.strip().endswith("full")
    try:
        failed = runner.run_playbook("migrate.yml", str(lab.inventory),
                                     dict(story["vars"], modelswap_serve=new, vllm_service_rollback_on_failure=False),
                                     limit=LIMIT)
        assert not failed.ok
        failure = failed.custom_stats["modelswap_record"][HOST]["failure"]
        assert "No space left on device" in failure["msg"], failure
        assert served_models_now(lab, story) == [new]
        assert saved_state(lab) == before                  # the old record and configurations, intact
        assert lab.ssh(HOST, f"ls {SAVED}/*/.staged/for.json", check=False).returncode != 0
    finally:
        lab.ssh(HOST, FREE_SAVED.format(d=SAVED), check=False)
    rerun = runner.run_playbook("migrate.yml", str(lab.inventory), dict(story["vars"], modelswap_serve=new),
                                limit=LIMIT)
    assert rerun.ok, rerun.failures()
    rec = rerun.custom_stats["modelswap_record"][HOST]
    assert not rec["swap"]["swapped"], rec
    assert any(("repair the record: it names %s" % old) in line
               for line in {s["step"]: s for s in rec["plan"]["steps"]}["swap"]["repairs"]), rec["plan"]
    converged(lab, story, new, old)


def served_models_now(lab, story):
    return served_models(lab.address(HOST), story["key"])
