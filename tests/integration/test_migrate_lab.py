"""The whole pivot on the lab (issue 8): playbooks/migrate.yml through the ansible-runner
interface, asserting on its structured results and on the hosts themselves.

One module-scoped story, in order (each real vLLM start costs about a minute):
  tiny-a on both hosts -> preview tiny-b (changes nothing) -> migrate to tiny-b one host at a
  time while the Hub cuts connections and clients load the lab's load balancer (each host is
  drained before its stop and rejoins after its gates: no request fails) -> rerun is changed=0
  with an unreachable host in the inventory -> not enough disk fails before any change -> gpu2
  gets tiny-broken and rolls back while gpu1 completes, under load (gpu2 rejoins serving tiny-b:
  no request fails) -> without the drain, the same swap under load fails requests -> the floor:
  with one of two servers out of the pool, the other is not drained and nothing changes -> the
  pool's stats page does not answer: the run stops before any change, in lb_pool's words.
"""
from __future__ import annotations

import json
import shutil
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from ansible_collections.modelswap.vllm.plugins.plugin_utils import runner
from tests.integration import vllm_lab
from tests.support.lb_load import LoadRun

pytestmark = [pytest.mark.lab, pytest.mark.vllm]
HOSTS = ["gpu1", "gpu2"]
# A closed loop of short streamed completions through the lab's HAProxy, bounded in count and time,
# paced so that it spans a migration (a few minutes) without taking the two cores from it.
LOAD = {"workers": 2, "max_requests": 20000, "max_seconds": 900, "max_tokens": 4, "pause": 0.05}


def load(lab, key) -> LoadRun:
    return LoadRun(lab.lb_url, key, **LOAD)


# Tasks the preview runs per host (ok + skipped). Measured on the lab: 165-171 before the fleet
# redesign (2026-12-04), 18-19 after it (2026-12-05: one read, the plan, one diff task); 18 on
# gpu2 and 25 on gpu1 with the host's lease read and the run named by the hosts' play when --limit
# leaves localhost out (2026-12-05: the first host also runs the play's run_once tasks). 2026-12-06:
# 21 per host, since the migration asks vllm_service for its slot through two entry points
# (layout, expected: one set_fact each) instead of reading its private variables, and 11 more on
# the first host, which runs the play's run_once tasks (the pool read through lb_pool's pool entry
# point is four of them). Lower them when a change removes tasks; raise them only with the reason
# in the commit. 2026-12-07: 3 per host (the read with its lease and refusals, vllm_service's
# expected slot, the plan with the probe of a host that keeps what it serves; the steps' and the
# rollout's plays match no host in a preview) and 17 more on the first host (the run_once tasks:
# the run's name, the listing, the pool, the fleet's plan, the diffs, records, plans and stats, and
# the settled hosts' records and the records' writing, skipped in a preview).
PREVIEW_TASKS_PER_HOST = 3
PREVIEW_TASKS_ONCE = 17


def served(lab, host: str, key: str) -> list[str] | None:
    req = urllib.request.Request(f"http://{lab.address(host)}:8000/v1/models",
                                 headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=3) as resp:
            return [m["id"] for m in json.load(resp)["data"]]
    except OSError:
        return None


def main_pid(lab, host: str) -> str:
    return lab.ssh(host, "systemctl show -p MainPID --value vllm.service").stdout.strip()


def inventory_with(lab, tmp_path: Path, host_vars: dict | None = None, extra_hosts: dict | None = None) -> str:
    """A copy of the lab inventory with per-host variables (and hosts that do not exist)."""
    inv = tmp_path / "inventory"
    inv.mkdir()
    text = Path(lab.inventory).read_text()
    for name, address in (extra_hosts or {}).items():
        text += f"        {name}:\n          ansible_host: {address}\n"
    (inv / "hosts.yml").write_text(text)
    (inv / "group_vars").symlink_to(Path(lab.inventory).parent / "group_vars")
    (inv / "host_vars").mkdir()
    for host, values in (host_vars or {}).items():
        (inv / "host_vars" / f"{host}.yml").write_text(json.dumps(values))
    return str(inv / "hosts.yml")


@pytest.fixture(scope="module")
def story(lab, tmp_path_factory):
    results = tmp_path_factory.mktemp("results")
    for host in HOSTS:
        lab.ssh(host, "systemctl stop vllm-lab.service 2>/dev/null; true")
        vllm_lab.reset_host(lab, host)
        # the story downloads tiny-b: start without it, whatever an earlier test left
        lab.ssh(host, vllm_lab.FORGET_MODEL.format(repo_folder="models--lab--tiny-b", name="tiny-b"))
    state = {"key": lab.api_key, "results": str(results),
             "vars": {"modelswap_results_dir": str(results),
                      "benchmark_results_dir": str(results / "benchmark")}}
    start = runner.migrate(str(lab.inventory), serve="tiny-a", extra_vars=state["vars"])
    assert start["ok"], start["run"]["failures"]
    yield state
    for host in HOSTS:
        vllm_lab.reset_host(lab, host)


def test_1_both_hosts_serve_tiny_a_after_a_first_migration(lab, story):
    for host in HOSTS:
        assert served(lab, host, story["key"]) == ["tiny-a"]


def test_2_the_preview_shows_the_plan_and_changes_nothing(lab, story):
    pids = {h: main_pid(lab, h) for h in HOSTS}
    units = {h: lab.ssh(h, "sha256sum /etc/systemd/system/vllm.service").stdout for h in HOSTS}
    lab.hub.clear_log()
    run = runner.run_playbook("migrate.yml", str(lab.inventory), dict(story["vars"], modelswap_serve="tiny-b"),
                              check=True, diff=True)          # what runner.preview runs, with its output
    out = {"ok": run.ok, "plan": run.custom_stats.get("modelswap_plan", {}), "run": run.to_dict()}
    assert out["ok"], out["run"]["failures"]
    # every host's diffs in one task, run once on the controller, each header naming its host
    diffs = [r for h in HOSTS for r in run.task_results("Show the unit and environment changes of every host "
                                                        "(the preview)", h)][0]["diff"]
    for host in HOSTS:
        # the unit's diff (made on the controller from the read's text): tiny-a's snapshot out, tiny-b's in
        unit = [d for d in diffs if d.get("after_header") == f"{host}: /etc/systemd/system/vllm.service"][0]
        assert "tiny-a" in unit["before"] and "tiny-b" in unit["after"] and "tiny-b" not in unit["before"]
        steps = {s["step"]: s for s in out["plan"][host]["steps"]}
        assert steps["preflight"]["verdict"] == "fits"
        assert steps["fetch"]["bytes"] > 6_000_000 and steps["fetch"]["files"] == 7
        assert steps["swap"]["would_swap"] and steps["swap"]["stop"] == "tiny-a"
        assert steps["benchmark"]["enabled"]
        # nothing changed on the host
        assert main_pid(lab, host) == pids[host]
        assert lab.ssh(host, "sha256sum /etc/systemd/system/vllm.service").stdout == units[host]
        assert lab.ssh(host, "test -e /var/lib/modelswap/hf/hub/models--lab--tiny-b/snapshots",
                       check=False).returncode != 0
    assert story["key"] not in run.stdout and "+ExecStart=" in run.stdout
    # the Hub saw metadata requests only: no file was downloaded
    assert not [r for r in lab.hub.requests() if r["method"] == "GET" and r.get("file")]
    story["preview"] = out["plan"]
    # Each task costs the controller a round trip per host, skipped ones too: a regression in the
    # fleet's preview cost shows here first (issue 16 measures the cost in bench_preview_scaling.py).
    tasks = out["run"]["tasks_per_host"]
    print("preview tasks per host:", tasks)
    # one host (the play's first) also runs the play's run_once tasks
    assert all(0 < tasks[h] for h in HOSTS), tasks
    assert min(tasks[h] for h in HOSTS) <= PREVIEW_TASKS_PER_HOST, tasks
    assert max(tasks[h] for h in HOSTS) <= PREVIEW_TASKS_PER_HOST + PREVIEW_TASKS_ONCE, tasks


def step_results(lab, story, serve: str) -> dict:
    """What each step's own role reports in check mode on the lab's hosts (the stand-alone
    playbooks, which read the hosts themselves): per host, the results migrate_plan takes."""
    extra = dict(story["vars"], modelswap_serve=serve)
    runs = {"preflight": lab.playbook("playbooks/preflight.yml", extra, check=True),
            "purge": lab.playbook("playbooks/purge.yml", extra, check=True),
            "fetch": lab.playbook("playbooks/fetch.yml", extra, check=True),
            "deploy": lab.playbook("playbooks/deploy.yml", dict(extra, vllm_service_preview_unfetched=True,
                                                                vllm_service_api_key=story["key"]), check=True)}
    for name, run in runs.items():
        assert run.rc == 0, (name, run.stdout[-3000:])

    def result(run, task, host, key=None):
        found = [r for r in run.task_results(task, host) if r["_event"] == "runner_on_ok"]
        if not found:
            return None
        return found[0]["ansible_facts"][key] if key else found[0]
    return {host: {
        "plan": result(runs["preflight"], "Plan the disk space for the target model (read-only)", host),
        "purge": result(runs["purge"], "Delete what the plan needs (or everything listed)", host),
        "fetch": result(runs["fetch"], "Start the download of " + serve, host),
        "service": result(runs["deploy"], "Report the outcome", host, "vllm_service_result"),
        "install": result(runs["deploy"], "Publish what the install did (in check mode, would do)", host,
                          "vllm_service_install_result"),
    } for host in HOSTS}


def test_2a_the_previews_plan_is_the_steps_own_in_every_number(lab, story):
    """The preview plans from one read of each host (migrate_facts) instead of running every
    step in check mode, as it did before the fleet redesign (issue 16). Its plan must be the one
    the steps' own roles give in check mode, number for number."""
    from ansible_collections.modelswap.vllm.plugins.filter.migrate import migrate_plan
    got = step_results(lab, story, "tiny-b")
    for host in HOSTS:
        r = got[host]
        assert r["plan"] and r["fetch"] and r["service"] and r["install"], r
        previewed = story["preview"][host]["steps"]
        # the load balancer's pool is the plan's own reading (vllm_service alone drains nothing)
        pool = {s["step"]: s for s in previewed}["swap"].get("pool")
        if pool:
            r["service"] = dict(r["service"], pool={"line": pool})
        steps = migrate_plan({"target": "tiny-b", "disk": r["plan"], "purge": r["purge"], "fetch": r["fetch"],
                              "service": r["service"], "benchmark": {"enabled": True, "concurrency": [1, 4]},
                              "download_rate": 0.0, "install": dict(r["install"], enabled=True)})["steps"]
        assert [s["step"] for s in steps] == [s["step"] for s in previewed]
        for theirs, ours in zip(steps, previewed):
            if theirs["step"] == "preflight":
                # the lab's hosts share this machine's disk, which other work writes to between
                # the runs: free bytes move by a little; every other number must be the same
                for key in ("free_before", "free_after"):
                    assert abs(theirs.pop(key) - ours[key]) < 256 * 1024 ** 2, (key, theirs, ours)
                ours = {k: v for k, v in ours.items() if k not in ("free_before", "free_after", "text")}
                theirs.pop("text")
            assert theirs == ours, (host, theirs["step"])


def test_2b_the_preview_of_a_host_without_vllm_installs_first_and_changes_nothing(lab, story):
    """A host that has no vLLM in modelswap's virtualenv yet (here: a virtualenv path and a store
    that do not exist), such as a fleet run by hand until now."""
    venv, store = "/opt/modelswap/venvs/preview-new", "/var/lib/modelswap-new/hf/hub"
    pids = {h: main_pid(lab, h) for h in HOSTS}
    lab.hub.clear_log()
    out = runner.preview(str(lab.inventory), serve="tiny-b", extra_vars=dict(
        story["vars"], vllm_service_venv=venv, modelswap_hf_python=f"{venv}/bin/python", modelswap_hf_cache=store))
    assert out["ok"], out["run"]["failures"]
    for host in HOSTS:
        steps = {s["step"]: s for s in out["plan"][host]["steps"]}
        assert list(steps) == ["install", "preflight", "purge", "fetch", "swap", "benchmark"]
        assert steps["install"]["would_install"] and steps["install"]["venv"] == venv
        assert steps["preflight"]["verdict"] == "fits" and steps["purge"]["items"] == []
        # the whole of tiny-b, as the preview with vLLM in place listed it on the host
        on_host = {s["step"]: s for s in story["preview"][host]["steps"]}["fetch"]
        assert steps["fetch"]["files"] == on_host["files"] == 7
        assert steps["fetch"]["bytes"] == on_host["bytes"]
        assert steps["swap"]["would_swap"] and steps["swap"]["stop"] == "tiny-a"
        assert main_pid(lab, host) == pids[host]
        assert lab.ssh(host, f"test -e {venv} || test -e /var/lib/modelswap-new", check=False).returncode != 0
    assert not [r for r in lab.hub.requests() if r["method"] == "GET" and r.get("file")]


def test_3_migrating_one_host_at_a_time_keeps_one_serving_through_cut_connections(lab, story):
    lab.hub.fault("cut", after=2_000_000, file="model.safetensors", count=2)
    seen, stop = [], threading.Event()

    def poll():
        while not stop.is_set():
            seen.append([served(lab, h, story["key"]) for h in HOSTS])
            time.sleep(0.5)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    clients = load(lab, story["key"]).start()
    try:
        out = runner.migrate(str(lab.inventory), serve="tiny-b",
                             extra_vars=dict(story["vars"], modelswap_serial=1))
    finally:
        stop.set()
        poller.join(10)
        clients.stop()
    assert out["ok"], out["run"]["failures"]
    # behind the load balancer: each host drained before its stop, back after its gates
    summary = clients.summary()
    print("load during the migration:", {k: summary[k] for k in ("total", "ok", "failed", "models")})
    assert summary["total"] >= 200 and summary["failed"] == 0, summary
    assert set(summary["models"]) <= {"tiny-a", "tiny-b"} and "tiny-b" in summary["models"]
    assert len(seen) > 20
    assert all(any(models for models in poll_) for poll_ in seen), "a moment when no host served"
    assert any(poll_[0] != poll_[1] for poll_ in seen)        # they really swapped one at a time
    for host in HOSTS:
        assert served(lab, host, story["key"]) == ["tiny-b"]
        record = out["records"][host]
        assert record["outcome"] == "migrated" and record["swap"]["replaced_model"] == "tiny-a"
        assert record["swap"]["downtime_s"] > 0 and record["fetch"]["verified"] is True
        assert record["swap"]["startup_phases"]["weights_s"] >= 0 and record["swap"]["startup_reported"]["weights_s"] >= 0
        assert record["benchmark"] and Path(record["benchmark"]["report"]).exists()
        # the preview's numbers are what the run did
        planned = {s["step"]: s for s in story["preview"][host]["steps"]}
        assert record["fetch"]["bytes_downloaded"] == planned["fetch"]["bytes"]
        assert record["swap"]["swapped"] is planned["swap"]["would_swap"] is True
        on_disk = json.loads(Path(out["run_dir"], f"{host}.json").read_text())
        assert on_disk["outcome"] == "migrated"
        assert record["lb"]["drained"] and record["lb"]["rejoined"], record["lb"]
        assert 0 < record["lb"]["seconds_out"] < 600 and record["lb"]["seconds_out"] >= record["swap"]["downtime_s"]
    summary_md = Path(out["run_dir"], "summary.md").read_text()
    assert "| gpu1 | tiny-b | migrated |" in summary_md
    assert "Where each swap's start went" in summary_md and "- gpu1: " in summary_md and " weights " in summary_md
    cuts = [r for r in lab.hub.requests() if any(f.startswith("cut#") for f in r.get("faults") or [])]
    assert cuts, "the Hub never cut a connection"


def test_4_a_rerun_changes_nothing_and_an_unreachable_host_does_not_stop_the_others(lab, story, tmp_path):
    pids = {h: main_pid(lab, h) for h in HOSTS}
    inv = inventory_with(lab, tmp_path, extra_hosts={"gpu9": lab.address("gpu1").rsplit(".", 1)[0] + ".99"})
    result = runner.run_playbook("migrate.yml", inv, dict(story["vars"], modelswap_serve="tiny-b"))
    assert result.count("dark", "gpu9") == 1
    for host in HOSTS:
        assert result.changed(host) == 0 and result.failed(host) == 0
        assert main_pid(lab, host) == pids[host]
        assert result.custom_stats["modelswap_record"][host]["outcome"] == "unchanged"
        assert result.custom_stats["modelswap_record"][host]["benchmark"] is None


def test_5_not_enough_disk_fails_in_preflight_before_any_change(lab, story):
    pids = {h: main_pid(lab, h) for h in HOSTS}
    lab.hub.clear_log()
    out = runner.migrate(str(lab.inventory), serve="tiny-a",
                         extra_vars=dict(story["vars"], preflight_headroom="100000GiB"))
    assert not out["ok"]
    for host in HOSTS:
        assert out["records"][host]["failure"]["step"] == "preflight"
        assert "does not fit" in out["records"][host]["failure"]["msg"]
        assert main_pid(lab, host) == pids[host] and served(lab, host, story["key"]) == ["tiny-b"]
    assert not [r for r in lab.hub.requests() if r["method"] == "GET" and r.get("file")]


@pytest.mark.campaign
def test_6_a_target_that_fails_to_start_rolls_back_on_its_host_while_the_other_completes(lab, story, tmp_path):
    inv = inventory_with(lab, tmp_path, host_vars={"gpu2": {"modelswap_serve": "tiny-broken"}})
    with load(lab, story["key"]) as clients:
        result = runner.run_playbook("migrate.yml", inv,
                                     dict(story["vars"], migrate_benchmark=False, modelswap_serial=1))
    assert result.rc != 0
    summary = clients.summary()
    print("load during the rollback:", {k: summary[k] for k in ("total", "ok", "failed", "models")})
    assert summary["total"] >= 100 and summary["failed"] == 0, summary
    lb = result.custom_stats["modelswap_record"]["gpu2"]["lb"]
    assert lb["drained"] and lb["rejoined"], lb              # back in the pool, serving tiny-b again
    assert lab.lb_servers()["gpu2"] == "UP"
    records = result.custom_stats["modelswap_record"]
    assert records["gpu1"]["outcome"] == "migrated" and served(lab, "gpu1", story["key"]) == ["tiny-a"]
    assert records["gpu2"]["outcome"] == "rolled_back" and records["gpu2"]["failure"]["step"] == "swap"
    assert served(lab, "gpu2", story["key"]) == ["tiny-b"]
    summary = Path(result.custom_stats["modelswap_run_dir"], "summary.md").read_text()
    assert "gpu2: swap failed (rolled back to the previous model)" in summary
    shutil.rmtree(result.custom_stats["modelswap_run_dir"], ignore_errors=True)


@pytest.mark.campaign
def test_7_without_the_drain_the_same_swap_fails_requests(lab, story):
    """The control: gpu1 swaps back to tiny-b with lb_pool_type none, under the same load. The
    load balancer learns of the stop from its health checks only, so requests fail."""
    with load(lab, story["key"]) as clients:
        out = runner.migrate(str(lab.inventory), serve="tiny-b", limit="gpu1,localhost",
                             extra_vars=dict(story["vars"], modelswap_benchmark=False, lb_pool_type="none"))
    assert out["ok"], out["run"]["failures"]
    summary = clients.summary()
    print("load without the drain:", {k: summary[k] for k in ("total", "ok", "failed", "models")})
    assert summary["failed"] > 0, summary
    assert out["records"]["gpu1"]["lb"] is None and served(lab, "gpu1", story["key"]) == ["tiny-b"]


def test_8_the_floor_refuses_to_drain_the_last_server_and_nothing_changes(lab, story):
    """With gpu2 out of the pool (maintenance), draining gpu1 would leave none serving: the plan
    refuses it before anything changes, with lb_pool's sentence."""
    lab.lb_command("disable server vllm/gpu2")
    try:
        pids = {h: main_pid(lab, h) for h in HOSTS}
        out = runner.migrate(str(lab.inventory), serve="tiny-a", limit="gpu1,localhost",
                             extra_vars=dict(story["vars"], modelswap_benchmark=False))
        assert not out["ok"]
        failure = out["records"]["gpu1"]["failure"]
        assert failure["step"] == "swap" and "refusing to take gpu1 out of pool vllm" in failure["msg"]
        assert "fewer than the floor of 1" in failure["msg"]
        assert main_pid(lab, "gpu1") == pids["gpu1"] and served(lab, "gpu1", story["key"]) == ["tiny-b"]
        assert lab.lb_servers()["gpu1"] == "UP"
    finally:
        lab.lb_command("enable server vllm/gpu2")


def test_9_a_pool_that_cannot_be_read_stops_the_run_before_any_change(lab, story):
    """The load balancer's stats page does not answer (a closed port): the plan cannot tell whether
    a drain would leave anyone serving, so the run stops before anything changes, in lb_pool's
    words, and no host leaves the pool."""
    closed = lab.lb_stats_url.replace(":8404/", ":9/")
    assert closed != lab.lb_stats_url
    pids = {h: main_pid(lab, h) for h in HOSTS}
    models = {h: served(lab, h, story["key"]) for h in HOSTS}
    target = "tiny-b" if models["gpu1"] == ["tiny-a"] else "tiny-a"
    out = runner.migrate(str(lab.inventory), serve=target,
                         extra_vars=dict(story["vars"], modelswap_benchmark=False,
                                         lb_pool_haproxy_stats_url=closed))
    assert not out["ok"]
    for host in HOSTS:
        failure = out["records"][host]["failure"]
        assert f"lb_pool: cannot read {closed}" in failure["msg"], failure
        assert main_pid(lab, host) == pids[host] and served(lab, host, story["key"]) == models[host]
    assert lab.lb_servers() == {"gpu1": "UP", "gpu2": "UP"}
