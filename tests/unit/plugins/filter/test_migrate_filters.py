"""The migration's plan (preview) and run record, from the roles' results (issue 8)."""
from __future__ import annotations

import pytest

from ansible_collections.modelswap.vllm.plugins.filter.migrate import (
    FilterModule, host_records, human_bytes, migrate_plan, migrate_record, plan_lines)

pytestmark = pytest.mark.unit
GIB = 1024 ** 3

PLAN = {"verdict": "fits_after_purge", "filesystem": {"available_bytes": 100 * GIB},
        "target": {"commit": "c" * 40, "needed_bytes": 547 * GIB, "download_bytes": 547 * GIB, "missing_files": 64},
        "purge": [{"name": "kimi-k2.5-nvfp4", "bytes": 540 * GIB}], "purge_bytes": 540 * GIB,
        "served": {"name": "minimax-m2.5"}}
PURGE = {"removed": [{"name": "kimi-k2.5-nvfp4", "revision": "r" * 40, "bytes": 540 * GIB}],
         "planned_bytes": 540 * GIB, "freed_bytes": None}
FETCH_CHECK = {"commit": "c" * 40, "would_fetch": {"files": [f"f{i}" for i in range(64)], "bytes": 547 * GIB}}
SERVICE_CHECK = {"would_swap": True, "swapped": False, "replaced_model": "minimax-m2.5", "unit": "vllm.service"}


def test_the_preview_reads_like_the_seeds_todo_list_with_numbers():
    plan = migrate_plan({"target": "kimi-k2.5-int4", "disk": PLAN, "purge": PURGE, "fetch": FETCH_CHECK,
                         "service": SERVICE_CHECK, "benchmark": {"enabled": True, "concurrency": [1, 8, 1024]},
                         "download_rate": 1.25e9})
    steps = {s["step"]: s for s in plan["steps"]}
    assert list(steps) == ["preflight", "purge", "fetch", "swap", "benchmark"]
    assert steps["preflight"]["free_before"] == 100 * GIB
    assert steps["preflight"]["free_after"] == (100 + 540 - 547) * GIB
    assert steps["purge"]["items"] == [{"name": "kimi-k2.5-nvfp4", "revision": "r" * 40, "bytes": 540 * GIB}]
    assert steps["fetch"]["files"] == 64 and steps["fetch"]["bytes"] == 547 * GIB
    assert steps["fetch"]["eta_s"] == pytest.approx(547 * GIB / 1.25e9)
    assert steps["swap"]["stop"] == "minimax-m2.5" and steps["swap"]["start"] == "kimi-k2.5-int4"
    assert steps["benchmark"]["enabled"] and plan["ready"] and plan["changes"]
    lines = plan_lines(plan, "gpu-a01")
    assert lines[0] == "gpu-a01: migrate to kimi-k2.5-int4"
    assert lines[2] == "  [ ] 2. Delete what the plan frees: delete 1 item(s), freeing 540.0 GiB"
    assert "download 64 file(s), 547.0 GiB, about 8 min at 1.2 GiB/s" in lines[3]


def test_a_host_already_serving_the_target_has_nothing_to_do():
    plan = migrate_plan({"target": "tiny-b", "disk": {"verdict": "fits", "filesystem": {"available_bytes": GIB},
                                                      "target": {"needed_bytes": 0, "download_bytes": 0}},
                         "purge": {"removed": [], "planned_bytes": 0},
                         "fetch": {"commit": "c" * 40, "would_fetch": {"files": [], "bytes": 0}},
                         "service": {"would_swap": False, "swapped": False},
                         "benchmark": {"enabled": True, "concurrency": [1]}})
    assert not plan["changes"]
    assert [s["text"] for s in plan["steps"][1:]] == [
        "nothing to delete", "already downloaded and verified",
        "tiny-b already serves with this configuration: no restart", "skipped"]


def test_a_failed_step_is_marked_in_the_plan():
    failure = {"step": "preflight", "msg": "kimi does not fit: short by 7 GiB"}
    plan = migrate_plan({"target": "kimi", "disk": PLAN, "benchmark": {"enabled": True}, "failure": failure})
    assert not plan["ready"]
    assert plan["steps"][0]["failed"] == failure["msg"]
    assert plan_lines(plan, "h")[0] == "h: migrate to kimi - would fail: kimi does not fit: short by 7 GiB"
    assert plan_lines(plan, "h", check_mode=False)[0] == "h: migrate to kimi - failed: kimi does not fit: short by 7 GiB"


@pytest.mark.parametrize("service, failure, check, outcome, rolled_back", [
    ({"swapped": True, "downtime_s": 41.5}, None, False, "migrated", False),
    ({"swapped": False}, None, False, "unchanged", False),
    (None, {"step": "swap", "msg": "vllm_service: tiny-broken failed to start; rolled back to tiny-a"}, False,
     "rolled_back", True),
    (None, {"step": "swap", "msg": "NOT rolled back: no earlier configuration"}, False, "failed", False),
    ({"would_swap": True}, None, True, "preview", False),
])
def test_the_record_names_the_outcome(service, failure, check, outcome, rolled_back):
    plan = migrate_plan({"target": "tiny-b", "service": service, "failure": failure})
    record = migrate_record({"host": "gpu1", "run_id": "20261202T000000Z", "target": "tiny-b", "plan": plan,
                             "timings": {"preflight": 10.0, "end": 12.5}, "service": service,
                             "failure": failure, "check_mode": check})
    assert record["outcome"] == outcome and record["rolled_back"] is rolled_back
    assert record["schema"] == 1 and record["host"] == "gpu1"


def test_the_record_times_each_step_from_its_marks():
    marks = {"install": 100.0, "preflight": 101.0, "purge": 103.5, "fetch": 104.0, "swap": 110.0,
             "benchmark": 150.0, "end": 170.0}
    fetch = {"commit": "c" * 40, "bytes_downloaded": 3_000_000, "seconds": 5.5, "verification": {"ok": True}}
    service = {"swapped": True, "downtime_s": 38.2, "replaced_model": "tiny-a"}
    record = migrate_record({"host": "gpu1", "run_id": "run", "target": "tiny-b",
                             "plan": migrate_plan({"target": "tiny-b", "fetch": fetch, "service": service}),
                             "timings": marks, "fetch": fetch, "service": service,
                             "benchmark": {"report": "r.md", "run_dir": "d"}, "check_mode": False})
    assert {k: v["seconds"] for k, v in record["steps"].items()} == {
        "install": 1.0, "preflight": 2.5, "purge": 0.5, "fetch": 6.0, "swap": 40.0, "benchmark": 20.0}
    assert record["fetch"]["verified"] is True and record["swap"]["downtime_s"] == 38.2
    assert record["benchmark"]["report"] == "r.md"


INSTALL = {"enabled": True, "changed": True, "version": "0.32.0", "venv": "/opt/modelswap/venvs/vllm-0.32.0",
           "installed_version": None, "source": "/opt/wheelhouse/requirements.lock"}


def test_a_first_install_is_the_first_step_of_the_preview():
    listing = {"commit": "c" * 40, "would_fetch": {"files": ["a", "b"], "bytes": 3 * GIB}, "listed_by": "controller"}
    plan = migrate_plan({"target": "tiny-a", "disk": {"verdict": "fits", "filesystem": {"available_bytes": 50 * GIB},
                                                      "target": {"needed_bytes": 3 * GIB, "download_bytes": 3 * GIB}},
                         "fetch": listing, "service": {"would_swap": True, "unit": "vllm.service"},
                         "benchmark": {"enabled": False}, "download_rate": 0, "install": INSTALL})
    steps = {s["step"]: s for s in plan["steps"]}
    assert list(steps) == ["install", "preflight", "purge", "fetch", "swap", "benchmark"]
    assert steps["install"]["would_install"] and plan["changes"]
    assert steps["install"]["text"] == ("install vLLM 0.32.0 into /opt/modelswap/venvs/vllm-0.32.0 from "
                                        "/opt/wheelhouse/requirements.lock; the service keeps running")
    assert steps["fetch"]["files"] == 2 and "listed by the controller" in steps["fetch"]["text"]
    assert steps["swap"]["stop"] is None
    assert steps["swap"]["text"] == "start tiny-a (vllm.service); nothing serves on this host yet"


def test_a_download_of_a_size_given_in_the_inventory_has_no_file_count():
    plan = migrate_plan({"target": "kimi", "disk": {"verdict": "fits", "filesystem": {"available_bytes": 900 * GIB},
                                                    "target": {"needed_bytes": 547 * GIB, "download_bytes": 547 * GIB,
                                                               "missing_files": None}}})
    assert {s["step"]: s for s in plan["steps"]}["fetch"]["text"] == "download 547.0 GiB"


def test_an_installed_vllm_is_no_change_and_an_upgrade_names_the_old_version():
    same = migrate_plan({"target": "t", "download_rate": 0, "install": dict(INSTALL, changed=False)})
    assert same["steps"][0]["text"] == "vLLM 0.32.0 already installed in /opt/modelswap/venvs/vllm-0.32.0"
    assert not same["changes"]
    upgrade = migrate_plan({"target": "t", "download_rate": 0, "install": dict(INSTALL, installed_version="0.31.1")})
    assert "(replacing 0.31.1)" in upgrade["steps"][0]["text"]
    off = migrate_plan({"target": "t", "download_rate": 0, "install": dict(INSTALL, enabled=False)})
    assert off["steps"][0]["step"] == "preflight"
    failed = migrate_plan({"target": "t", "failure": {"step": "install", "msg": "pip failed"}, "download_rate": 0,
                           "install": {"enabled": True}})
    assert failed["steps"][0]["failed"] == "pip failed"
    assert [s["text"] for s in failed["steps"]] == ["failed"] + ["not reached"] * 5


def test_steps_after_a_failure_say_they_were_not_reached():
    failure = {"step": "preflight", "msg": "does not fit"}
    plan = migrate_plan({"target": "kimi", "disk": PLAN, "benchmark": {"enabled": True, "concurrency": [1]},
                         "failure": failure, "download_rate": 0, "install": INSTALL})
    texts = {s["step"]: s["text"] for s in plan["steps"]}
    assert texts["install"].startswith("install vLLM") and texts["preflight"].startswith("free 100.0 GiB")
    assert [texts[s] for s in ("purge", "fetch", "swap", "benchmark")] == ["not reached"] * 4
    assert [s.get("reached", True) for s in plan["steps"]] == [True, True, False, False, False, False]


def test_a_unit_set_up_by_hand_that_the_swap_replaces_is_named():
    service = {"would_swap": True, "unit": "vllm.service", "replaced_units": ["vllm-minimax.service"]}
    plan = migrate_plan({"target": "kimi", "service": service})
    swap = {s["step"]: s for s in plan["steps"]}["swap"]
    assert swap["stop"] == "vllm-minimax.service" and swap["replaced_units"] == ["vllm-minimax.service"]
    assert swap["text"] == ("stop and disable vllm-minimax.service (set up outside modelswap), start kimi; "
                            "serving stops until the new model is ready")


def test_filters_are_registered_and_bytes_read_like_df():
    assert set(FilterModule().filters()) >= {"migrate_plan", "migrate_plan_lines", "migrate_record", "human_bytes"}
    assert human_bytes(0) == "0 B" and human_bytes(1536) == "1.5 KiB" and human_bytes(None) == "?"


def test_the_record_names_the_benchmark_report_by_a_normalized_path():
    bench = {"run_dir": "/srv/infra/playbooks/../results/benchmark/gpu1/tiny-b/c/20261202T000000Z",
             "report": "/srv/infra/playbooks/../results/benchmark/gpu1/tiny-b/c/20261202T000000Z/report.md",
             "saturation": {"knee_concurrency": None}, "stopped_early": None, "comparison": None}
    record = migrate_record({"host": "gpu1", "run_id": "run", "target": "tiny-b",
                             "plan": migrate_plan({"target": "tiny-b", "service": {"swapped": True}}),
                             "timings": {}, "service": {"swapped": True}, "benchmark": bench, "check_mode": False})
    assert record["benchmark"]["run_dir"] == "/srv/infra/results/benchmark/gpu1/tiny-b/c/20261202T000000Z"
    assert record["benchmark"]["report"].endswith("/srv/infra/results/benchmark/gpu1/tiny-b/c/20261202T000000Z/report.md")
    assert record["benchmark"]["saturation"] == {"knee_concurrency": None}


def test_hosts_without_a_record_count_as_not_reached():
    """An unreachable host, or one left out by --limit, has no migrate_record: the fleet summary
    lists it as not reached instead of failing."""
    hostvars = {"gpu1": {"migrate_record": {"host": "gpu1"}}, "gpu2": {"ansible_host": "10.0.0.2"}}
    assert host_records(["gpu1", "gpu2", "gpu9"], hostvars) == [{"host": "gpu1"}, None, None]
    assert host_records([], hostvars) == []


# ------------------------------------------------------------------------------------------
# The plan from one host read (migrate_facts, issue 16): the same numbers the steps report.
# ------------------------------------------------------------------------------------------
from ansible_collections.modelswap.vllm.plugins.filter.migrate import failure_of, read_plan  # noqa: E402

UNIT, ENV = "/etc/systemd/system/vllm.service", "/etc/modelswap/vllm.env"
UNIT_TEXT, ENV_TEXT, NEW_UNIT = "[Service]\nExecStart=vllm serve old\n", "A=1\n", "[Service]\nExecStart=vllm serve new\n"


def sha1(text):
    import hashlib
    return hashlib.sha1(text.encode()).hexdigest()


READ = {
    "disk": dict(PLAN, verdict="fits", summary="free 100 GiB; fits", purge=[], purge_bytes=0),
    "purge": None,
    "fetch": FETCH_CHECK,
    "service": {"unit": {"active_state": "active"}, "deployment": {"model": "minimax-m2.5"}},
    "install": {"matches": True, "version": "0.32.0"},
    "config": {"sha1": {UNIT: sha1(UNIT_TEXT), ENV: sha1(ENV_TEXT)}, "secret_matches": True},
}
SETTINGS = {"host": "gpu-a01", "unit": "vllm.service",
            "install": {"enabled": True, "version": "0.32.0", "venv": "/opt/v", "source": "index"},
            "force_restart": False, "replaced_todo": [], "purge_allowed": True, "purge_all_listed": False,
            "fail_on_does_not_fit": True, "benchmark": {"enabled": True, "concurrency": [1, 8]},
            "download_rate": 0, "host_problems": []}


def planned(read=None, expected=None, **settings):
    return read_plan("kimi-k2.5-int4", dict(READ, **(read or {})),
                     expected or {UNIT: NEW_UNIT, ENV: ENV_TEXT}, dict(SETTINGS, **settings))


def test_the_plan_from_one_read_is_the_plan_from_the_steps_results():
    out = planned()
    service = {"action": "deploy", "model": "kimi-k2.5-int4", "unit": "vllm.service", "swapped": False,
               "would_swap": True, "replaced_model": "minimax-m2.5", "replaced_units": [],
               "restart_reasons": [], "repairs": []}
    assert out["service"] == service
    assert out["plan"] == migrate_plan({"target": "kimi-k2.5-int4", "disk": READ["disk"], "fetch": FETCH_CHECK,
                                        "service": service, "benchmark": {"enabled": True, "concurrency": [1, 8]},
                                        "download_rate": 0.0, "install": dict(out["install"], enabled=True)})
    assert out["todo"] == {"install": False, "purge": False, "fetch": True, "configure": True, "swap": True,
                           "record": False, "rejoin": False, "drift": [UNIT]}
    assert out["failure"] is None


@pytest.mark.parametrize("read, expected, settings, todo", [
    # the same files, the service active: nothing to restart
    ({"fetch": {"verified": True, "would_fetch": {"files": [], "bytes": 0}}}, {UNIT: UNIT_TEXT, ENV: ENV_TEXT}, {},
     {"fetch": False, "configure": False, "swap": False}),
    # only the API key file differs: configure and restart, the key named as "API key file"
    ({"config": {"sha1": {UNIT: sha1(UNIT_TEXT), ENV: sha1(ENV_TEXT)}, "secret_matches": False}}, {UNIT: UNIT_TEXT, ENV: ENV_TEXT},
     {}, {"configure": True, "swap": True, "drift": ["API key file"]}),
    # the same files but the service is not running: start it
    ({"service": {"unit": {"active_state": "failed"}}}, {UNIT: UNIT_TEXT, ENV: ENV_TEXT}, {},
     {"configure": False, "swap": True}),
    ({}, {UNIT: UNIT_TEXT, ENV: ENV_TEXT}, {"force_restart": True}, {"swap": True}),
    ({}, {UNIT: UNIT_TEXT, ENV: ENV_TEXT}, {"replaced_todo": [{"unit": "old.service"}]}, {"swap": True}),
    ({"install": {"matches": False, "version": None}}, None, {}, {"install": True}),
    ({"install": {"matches": False, "version": None}}, None, {"install": {"enabled": False}}, {"install": False}),
    ({"purge": {"items": ["org/old"], "removed": [], "planned_bytes": 1}}, None, {}, {"purge": True}),
], ids=["converged", "key-only", "not-running", "forced", "replaces", "install", "install-off", "purge"])
def test_which_steps_run(read, expected, settings, todo):
    out = planned(read, expected, **settings)
    assert {k: out["todo"][k] for k in todo} == todo


# What an interrupted run leaves, read as divergences (issue 27): the files already the target's
# while systemd or the running process still have the old ones; the target serving while the
# record names the old deployment; the host out of the pool with this run's drain mark on it.
MARK = "/var/lib/modelswap/lb-drained.json"
STAGED = "/var/lib/modelswap/vllm/vllm/.staged/for.json"
OLD = "/hub/models--org--minimax/snapshots/" + "a" * 40
NEW = "/hub/models--org--kimi/snapshots/" + "c" * 40
SERVES_TARGET = {"unit": {"active_state": "active", "model": NEW, "running_model": NEW},
                 "deployment": {"model": "kimi-k2.5-int4", "commit": "c" * 40}, "files": {MARK: False}}
SAME_FILES = {UNIT: UNIT_TEXT, ENV: ENV_TEXT}


@pytest.mark.parametrize("service, pool, todo, words", [
    (SERVES_TARGET, None, {"swap": False, "record": False, "rejoin": False}, "already serves with this configuration"),
    # killed between writing the files and the stop: systemd has not loaded the new unit
    (dict(SERVES_TARGET, unit={"active_state": "active", "model": OLD, "running_model": OLD, "need_daemon_reload": True}),
     None, {"swap": True, "record": False}, "restart (the unit file changed since systemd loaded it)"),
    # the unit was reloaded, but the process that runs was started from the old snapshot
    (dict(SERVES_TARGET, unit={"active_state": "active", "model": NEW, "running_model": OLD}),
     None, {"swap": True}, "the running process serves org/minimax@aaaaaaaaaaaa, the unit says org/kimi@cccccccccccc"),
    # killed after the start, before the record: the record names the old model
    (dict(SERVES_TARGET, deployment={"model": "minimax-m2.5", "commit": "a" * 40}), None,
     {"swap": False, "record": True, "rejoin": False}, "repair the record: it names minimax-m2.5@aaaaaaaaaaaa"),
    (dict(SERVES_TARGET, deployment={"model": "kimi-k2.5-int4", "commit": "b" * 40}), None,
     {"swap": False, "record": True}, "repair the record"),
    # killed after the drain: out of the pool, this run's mark on the host
    (dict(SERVES_TARGET, files={MARK: True}), {"status": "MAINT"}, {"swap": False, "record": False, "rejoin": True},
     "rejoin the pool: gpu-a01 is MAINT there since an interrupted run drained it"),
    (dict(SERVES_TARGET, files={MARK: True}), {"status": "UP"}, {"rejoin": True}, "forget the drain mark"),
    # an operator's maintenance (no mark of a run) is left alone
    (SERVES_TARGET, {"status": "MAINT"}, {"rejoin": False}, "already serves with this configuration"),
    # killed inside the record's write, after its commit: the staged configurations are published
    (dict(SERVES_TARGET, files={MARK: False, STAGED: True}), None, {"swap": False, "record": True},
     "finish the record's interrupted write"),
], ids=["converged", "reload-pending", "stale-process", "record-old-model", "record-old-commit", "drained",
        "mark-only", "operator-maint", "record-staged"])
def test_an_interrupted_run_is_repaired_by_the_plan(service, pool, todo, words):
    out = planned({"service": service, "fetch": {"commit": "c" * 40, "verified": True,
                                                 "would_fetch": {"files": [], "bytes": 0}}},
                  SAME_FILES, drain_mark=MARK, staged_record=STAGED, fleet={"pool": dict(pool, line="pool") if pool else {}})
    assert {k: out["todo"][k] for k in todo} == todo
    swap = {s["step"]: s for s in out["plan"]["steps"]}["swap"]
    assert words in swap["text"], swap["text"]
    repaired = todo.get("record") or todo.get("rejoin")
    assert out["plan"]["changes"] is bool(todo.get("swap") or repaired)
    assert bool(swap["repairs"]) is bool(repaired)


def test_the_preview_diffs_are_made_from_the_reads_texts_and_never_show_the_key():
    read = {"config": {"sha1": {UNIT: sha1(UNIT_TEXT), ENV: sha1(ENV_TEXT)},
                       "text": {UNIT: UNIT_TEXT, ENV: ENV_TEXT}, "secret_matches": False}}
    out = planned(read, {UNIT: NEW_UNIT, ENV: ENV_TEXT}, secret_path="/etc/modelswap/vllm.secret.env")
    unit, key = out["diffs"]
    # the unit as service_files would show it in check mode: the host's text against the new one
    assert unit == {"before_header": UNIT, "after_header": UNIT, "before": UNIT_TEXT, "after": NEW_UNIT}
    assert key == {"prepared": "/etc/modelswap/vllm.secret.env: the content would change (a secret file: not shown)\n"}


@pytest.mark.parametrize("sums, texts, want", [
    ({UNIT: None, ENV: sha1(ENV_TEXT)}, {ENV: ENV_TEXT},
     {"before_header": UNIT + " (absent)", "after_header": UNIT, "before": "", "after": NEW_UNIT}),
    ({UNIT: "0" * 40, ENV: sha1(ENV_TEXT)}, {UNIT: None, ENV: ENV_TEXT},
     {"prepared": UNIT + ": the content would change (not shown: not small UTF-8 text)\n"}),
], ids=["absent", "too-large"])
def test_a_new_file_diffs_from_nothing_and_an_unshowable_one_is_named(sums, texts, want):
    out = planned({"config": {"sha1": sums, "text": texts, "secret_matches": True}}, {UNIT: NEW_UNIT, ENV: ENV_TEXT})
    assert out["diffs"] == [want]


def test_a_converged_host_has_no_diff():
    read = {"config": {"sha1": {UNIT: sha1(UNIT_TEXT), ENV: sha1(ENV_TEXT)},
                       "text": {UNIT: UNIT_TEXT, ENV: ENV_TEXT}, "secret_matches": True}}
    assert planned(read, {UNIT: UNIT_TEXT, ENV: ENV_TEXT})["diffs"] == []


@pytest.mark.parametrize("read, settings, step, words", [
    ({"disk": dict(READ["disk"], verdict="does_not_fit", reason="short by 7 GiB",
                   filesystem={"path": "/models", "available_bytes": 1})}, {}, "preflight",
     "kimi-k2.5-int4 does not fit on /models: short by 7 GiB"),
    ({"disk": dict(READ["disk"], verdict="fits_after_purge", purge=["org/old"])}, {"purge_allowed": False}, "purge",
     "gpu-a01: free 100 GiB; fits. kimi-k2.5-int4 needs a purge of org/old but model_purge_allowed is false; "
     "nothing was deleted"),
    ({}, {"host_problems": ["vllm_service: refusing to deploy on gpu-a01:8000: the port is held"]}, "swap",
     "vllm_service: refusing to deploy on gpu-a01:8000: the port is held"),
    ({"disk": dict(READ["disk"], verdict="does_not_fit", reason="short", filesystem={"path": "/m"})},
     {"host_problems": ["port held"]}, "preflight", "does not fit"),      # the earliest step's refusal wins
], ids=["does-not-fit", "purge-forbidden", "port-held", "earliest-first"])
def test_a_refusal_fails_the_plan_at_its_step_and_later_steps_are_not_reached(read, settings, step, words):
    out = planned(read, **settings)
    assert out["failure"]["step"] == step and words in out["failure"]["msg"]
    steps = {s["step"]: s for s in out["plan"]["steps"]}
    assert steps[step]["failed"] == out["failure"]["msg"] and not out["plan"]["ready"]
    later = [s for s in out["plan"]["steps"] if s.get("reached") is False]
    assert later and all(s["text"] == "not reached" for s in later)


def test_a_failed_task_is_charged_to_the_step_last_started():
    marks = {"preflight": 10.0, "fetch": 30.0, "purge": 20.0, "end": 40.0}
    assert failure_of(marks, {"name": "Start the download"}, {"msg": "gated"}) == {
        "step": "fetch", "task": "Start the download", "msg": "gated"}
    assert failure_of({}, None, {"stderr": "boom"}) == {"step": "preflight", "task": "", "msg": "boom"}


# ------------------------------------------------------------------------------------------
# The fleet-wide part of the plan: peers' sources and shared stores' protections (issue 19).
# ------------------------------------------------------------------------------------------
from ansible_collections.modelswap.vllm.plugins.filter.migrate import fleet_plan  # noqa: E402

C_OLD, C_NEW = "a" * 40, "b" * 40
MODELS2 = {"old": {"repo_id": "org/old"}, "new": {"repo_id": "org/new"}, "other": {"repo_id": "org/other"}}


def host(serve="new", verified=False, nbytes=1000, store="", site="s1", serves="old", purge=None):
    read = {"fetch": {"commit": C_NEW, "verified": verified, "would_fetch": {"bytes": 0 if verified else nbytes}},
            "service": {"deployment": {"model": serves, "repo_id": MODELS2[serves]["repo_id"], "commit": C_OLD}},
            "purge": {"items": purge} if purge else None}
    return {"__migrate_read": read, "modelswap_serve": serve, "modelswap_models": MODELS2,
            "modelswap_site": site, "modelswap_store": store}


def test_with_peers_one_host_of_a_site_downloads_and_the_others_copy():
    hv = {"g1": host(), "g2": host(), "g3": host(), "g4": host(verified=True, nbytes=0)}
    out = fleet_plan(["g1", "g2", "g3", "g4"], hv, True)
    sources = {h: (v["source"]["source"], v["source"].get("from")) for h, v in out["hosts"].items()}
    assert sources["g4"] == ("verified", None)
    assert sorted(s for s, _unused in sources.values()) == ["peer", "peer", "peer", "verified"]  # g4 has it: no Hub
    assert out["sources"]["totals"]["hub_bytes"] == 0


def test_a_shared_store_keeps_what_another_of_its_hosts_serves():
    hv = {"g5": host(store="nfs1", serves="old", purge=["org/other@" + C_OLD]),
          "g6": host(store="nfs1", serves="other"),
          "g7": host(store="", serves="other", purge=["org/other"])}
    out = fleet_plan(["g5", "g6", "g7"], hv)
    assert "org/other@" + C_OLD in out["stores"]["nfs1"]
    problem = out["hosts"]["g5"]["store_problem"]
    assert problem.startswith("model_purge: org/other@%s is in the shared store nfs1, where g6 serves it (other)" % C_OLD)
    assert "store_problem" not in out["hosts"]["g6"] and "store_problem" not in out["hosts"]["g7"]   # g7: own disk
    assert "sources" not in out


def outside(store="nfs1", serve="new", models=None):
    """An inventory host of a shared store that the play did not read (--limit, unreachable)."""
    return {"modelswap_store": store, "modelswap_serve": serve, "modelswap_models": models or MODELS2}


def test_the_hosts_of_a_store_outside_the_play_are_read_apart():
    from ansible_collections.modelswap.vllm.plugins.filter.migrate import store_others
    hv = {"g5": host(store="nfs1"), "g6": outside(), "g7": host(store="nfs1"), "g8": outside(store="nfs2"),
          "g9": host(), "lb": {}}
    # g6: left out by --limit; g7: in the play (its own read); g8: another store; g9: own disk
    assert store_others(["g5", "g6", "g7", "g8", "g9", "lb"], hv, ["g5", "g7", "g9"]) == ["g6"]
    assert store_others(["g5", "g6"], hv, ["g9"]) == []        # no store in the play: nothing to read


def test_a_store_host_outside_the_play_keeps_what_it_serves_and_targets():
    models = dict(MODELS2, pinned={"repo_id": "org/pinned", "revision": C_NEW})
    hv = {"g5": host(store="nfs1", purge=["org/other@" + C_OLD]), "g6": outside(serve="pinned", models=models)}
    others = [{"item": "g6", "deployment": {"model": "other", "repo_id": "org/other", "commit": C_OLD}}]
    out = fleet_plan(["g5"], hv, others=others)
    assert out["hosts"]["g5"]["store_problem"].startswith(
        "model_purge: org/other@%s is in the shared store nfs1, where g6 serves it (other)" % C_OLD)
    assert "org/pinned@" + C_NEW in out["stores"]["nfs1"]     # its target, at the catalog's commit
    # the other commit of what g6 serves is not protected; what g6 targets is, by its pinned commit
    assert "store_problem" not in fleet_plan(["g5"], dict(hv, g5=host(store="nfs1", purge=["org/other@" + C_NEW])),
                                             others=others)["hosts"]["g5"]
    hit = fleet_plan(["g5"], dict(hv, g5=host(store="nfs1", purge=["org/pinned"])), others=others)
    assert "where g6 targets it (pinned)" in hit["hosts"]["g5"]["store_problem"]


def test_an_unreadable_host_of_the_store_stops_its_purge():
    hv = {"g5": host(store="nfs1", purge=["org/other@" + C_OLD]), "g6": outside(), "g8": outside(store="nfs2"),
          "g9": host(store="nfs2", purge=["org/other"]), "g10": host(store="nfs1")}
    others = [{"item": "g6", "unreachable": True, "msg": "Failed to connect to the host via ssh: timed out\n"},
              {"item": "g8", "deployment": None}]
    out = fleet_plan(["g5", "g9", "g10"], hv, others=others)
    assert out["hosts"]["g5"]["store_problem"] == (
        "model_purge: the shared store nfs1 is also mounted by g6 (unreachable: Failed to connect to the host via "
        "ssh: timed out), which this run could not read: what it serves is unknown, so nothing is purged from the "
        "store. Reach it and run again, or take modelswap_store off a host that no longer mounts it; nothing was deleted")
    assert "store_problem" not in out["hosts"]["g10"]          # nothing to purge: nothing refused
    assert "store_problem" not in out["hosts"]["g9"]           # g8 serves nothing (no record)
    failed = fleet_plan(["g5"], hv, others=[{"item": "g6", "failed": True, "msg": "Permission denied"}])
    assert "g6 (its record could not be read: Permission denied)" in failed["hosts"]["g5"]["store_problem"]
    # a host of the play whose read did not succeed (unreachable, refused by its lease) counts the same
    lost = dict(hv, g10=dict(host(store="nfs1"), __migrate_read={"failed": True, "msg": "boom"}), g11=outside())
    out = fleet_plan(["g5", "g10", "g11"], lost)
    assert "also mounted by g10 (its read in this run did not succeed), g11 (its read" in out["hosts"]["g5"]["store_problem"]
    assert set(out["hosts"]) == {"g5"}


def test_the_plan_takes_the_hosts_source_and_counts_a_store_once():
    source = {"source": "store", "from": None, "round": 1, "bytes": 0, "line": "in the shared store nfs1, which g5 fills from the Hub (round 1)"}
    out = planned(fleet={"source": source})
    fetch = {s["step"]: s for s in out["plan"]["steps"]}["fetch"]
    assert fetch["bytes"] == 0 and fetch["source"] == "store"
    assert fetch["text"].endswith("which g5 fills from the Hub (round 1)")
    refused = planned(fleet={"store_problem": "model_purge: org/x is in the shared store nfs1"})
    assert refused["failure"]["step"] == "purge" and "shared store nfs1" in refused["failure"]["msg"]


def test_a_shared_store_is_purged_by_its_first_host_only():
    hv = {"g5": host(store="nfs1", purge=["org/x"]), "g6": host(store="nfs1", purge=["org/x"]), "g7": host()}
    out = fleet_plan(["g5", "g6", "g7"], hv)
    assert "purge_by" not in out["hosts"]["g5"] and out["hosts"]["g6"]["purge_by"] == "g5"
    assert "purge_by" not in out["hosts"]["g7"]
    planned_g6 = planned({"purge": {"items": ["org/x"], "removed": [{"name": "x", "bytes": 5}], "planned_bytes": 5}},
                         fleet={"purge_by": "g5"})
    assert planned_g6["todo"]["purge"] is False
    purge = {s["step"]: s for s in planned_g6["plan"]["steps"]}["purge"]
    assert purge["text"] == "the shared store's purge is g5's" and purge["bytes"] == 0
