"""The vllm_service role and the vllm_ready module on the lab: real systemd, real vLLM (CPU),
models fetched and verified from the lab's Hub by model_fetch.

One deployed state is shared by the module, in this order (each vLLM start costs ~50 s and
2.7 GiB here, so as few as possible):

  deploy tiny-a on both hosts -> bad inputs on gpu1 (each fails before the old service is
  stopped) and the check-mode preview, all at once -> swap both to tiny-b -> a second run
  changes nothing -> gpu1 swaps to tiny-broken (and rolls back to tiny-b), then to tiny-a-drifted
  (it serves, fails the quality gate against tiny-a's reference and rolls back to tiny-b), while
  gpu2 runs playbooks/rollback.yml (back to tiny-a) -> the API keys appear in no output, log or
  file but their own -> vllm_ready on its own -> `systemctl stop` on gpu1 during a stream (vLLM
  drains).

The catalog has the quality gate on tiny-a and tiny-b (defaults) and on tiny-a-drifted (compared
with tiny-a's reference); the references go to a folder of this module's own, so the first
deployment of each records it.

Read-only runs and runs on different hosts go in parallel (threads around ansible-runner): they
wait on SSH and vLLM, and the suite must stay well under 10 minutes on this 2-core machine.

CPU hosts and parallelism: the lab hosts have no NVIDIA GPU, so the role serves on CPU as one
process and refuses tensor/pipeline/data parallel sizes above 1 there (documented in the role's
README); on GPU hosts the same assert compares them with gpu_ready's GPU count.
"""
from __future__ import annotations

import json
import pathlib
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.integration import vllm_lab as V

pytestmark = [pytest.mark.lab, pytest.mark.vllm]

HOSTS = ["gpu1", "gpu2"]
# an operator's evaluation harness, played by one greedy completion (vllm_service_quality_hook)
QUALITY_HOOK = str(pathlib.Path(__file__).parent / "tasks" / "quality_hook.yml")
STOP_TASK = "Stop the old service (its whole control group)"


class Ctx:
    def __init__(self, lab, quality_dir):
        self.lab = lab
        self.key = V.new_api_key()
        self.keys = [self.key]
        self.runs = []
        self.started = {h: V.host_epoch(lab, h) for h in HOSTS}
        self.quality_dir = quality_dir

    def run(self, model, *, playbook=V.DEPLOY, limit="gpu1,gpu2", check=False, diff=False,
            key=None, **extra):
        extra.setdefault("modelswap_serve", model)
        extra.setdefault("modelswap_models", V.catalog(self.lab, quality=True))
        extra.setdefault("vllm_service_quality_dir", str(self.quality_dir))
        result = self.lab.playbook(playbook, V.role_vars(self.lab, key or self.key, **extra),
                                   limit=limit, check=check, diff=diff)
        self.runs.append(result)
        return result

    def outcome(self, result, host):
        """The role's vllm_service_result fact for a host."""
        for res in result.task_results("Report the outcome", host):
            if res["_event"] == "runner_on_ok":
                return res["ansible_facts"]["vllm_service_result"]
        raise AssertionError("no outcome for %s:\n%s" % (host, result.stdout[-4000:]))

    def failure(self, result, host):
        """(task, msg) of the host's last failure (a failure its block rescued comes earlier)."""
        found = None
        for ev in result.events:
            data = ev.get("event_data", {})
            if ev.get("event") == "runner_on_failed" and data.get("host") == host \
                    and not data.get("ignore_errors"):
                found = data["task"], data["res"].get("msg", "")
        if found is None:
            raise AssertionError("%s did not fail:\n%s" % (host, result.stdout[-4000:]))
        return found


def parallel(**calls):
    """Run independent playbook runs at once (each waits on SSH and the hosts, not on us)."""
    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        futures = {name: pool.submit(call) for name, call in calls.items()}
        return {name: f.result() for name, f in futures.items()}


def main_pid(lab, host):
    return int(V.unit_show(lab, host, "MainPID")["MainPID"])


def sums(lab, host):
    return lab.ssh(host, "sha256sum /etc/systemd/system/vllm.service /etc/modelswap/vllm.env "
                         "/etc/modelswap/vllm.secret.env %s" % V.RECORD).stdout


@pytest.fixture(scope="module")
def ctx(lab, tmp_path_factory):
    for host in HOSTS:
        V.reset_host(lab, host)
    c = Ctx(lab, tmp_path_factory.mktemp("quality"))
    V.prepare(lab, HOSTS, c.key)      # vLLM from the wheelhouse, models via model_fetch
    c.first = c.run("tiny-a", diff=True)
    yield c
    for host in HOSTS:               # give the CPUs and memory back
        V.stop(lab, host)


def test_deploy_tiny_a_on_both_hosts(ctx):
    lab, run = ctx.lab, ctx.first
    # the failed tasks first: CI's short summary shows the message's first line
    assert run.rc == 0, "%s\n%s" % (run.failures(), run.stdout[-6000:])
    for host in HOSTS:
        out = ctx.outcome(run, host)
        assert out["swapped"] is True and out["model"] == "tiny-a"
        assert set(out["gates"]) == {"port", "health", "models", "completion"}
        assert V.served_names(lab, host, ctx.key) == ["tiny-a"]
        rec = V.record(lab, host)
        assert rec["model"] == "tiny-a" and rec["previous"] is None
        assert rec["commit"] == lab.models["tiny-a"]["commit"]
        assert rec["path"].endswith("/models--lab--tiny-a/snapshots/" + rec["commit"])
        # model_fetch's notes kept (other tests may have added their own: the lab reset keeps them)
        assert {"tiny-a", "tiny-b", "tiny-broken"} <= set(rec["fetched"])
        unit_sum = lab.ssh(host, "sha256sum /etc/systemd/system/vllm.service").stdout.split()[0]
        assert rec["unit_checksum"] == unit_sum
        assert rec["vllm_version"] == "0.32.0+cpu"
        # a dedicated non-root user runs it
        show = V.unit_show(lab, host, "User", "MainPID", "KillMode")
        assert show["User"] == "vllm" and show["KillMode"] == "mixed"
        assert lab.ssh(host, "ps -o user= -p %s" % show["MainPID"]).stdout.strip() == "vllm"
        # the quality gate ran with nothing to compare yet (both hosts started at once)
        quality = out["quality"]
        assert quality["passed"] is True and quality["reference"] is None and quality["checks"] == []
        assert quality["vllm_version"] == "0.32.0"          # what GET /version says
    # ... and one of them recorded tiny-a's reference, never overwritten by the other
    reference = json.loads((ctx.quality_dir / "tiny-a.json").read_text())
    assert reference["host"] in HOSTS and reference["commit"] == lab.models["tiny-a"]["commit"]
    assert reference["vllm_version"] == "0.32.0" and len(reference["answers"]) == 4
    assert all(len(a["tokens"]) == len(a["logprobs"]) > 0 for a in reference["answers"])
    ctx.tiny_a_reference = (ctx.quality_dir / "tiny-a.json").read_bytes()


def test_the_served_api_requires_the_key(ctx):
    for host in HOSTS:
        assert V.http(ctx.lab, host, "/v1/models")[0] == 401
        assert V.http(ctx.lab, host, "/v1/models", api_key="wrong-key")[0] == 401
        status, body = V.http(ctx.lab, host, "/v1/completions", ctx.key,
                              {"model": "tiny-a", "prompt": "Hi", "max_tokens": 2})
        assert status == 200 and body["usage"]["completion_tokens"] == 2
        assert V.http(ctx.lab, host, "/v1/completions", None,
                      {"model": "tiny-a", "prompt": "Hi", "max_tokens": 2})[0] == 401


def test_rendered_unit_passes_systemd_analyze_verify(ctx):
    lab = ctx.lab
    for host in HOSTS:
        proc = lab.ssh(host, "systemd-analyze verify --man=no /etc/systemd/system/vllm.service", check=False)
        assert proc.returncode == 0 and proc.stdout == "" and proc.stderr == "", proc
        modes = lab.ssh(host, "stat -c '%a %U %n' /etc/modelswap/vllm.env /etc/modelswap/vllm.secret.env "
                              "/etc/systemd/system/vllm.service").stdout.split("\n")
        assert modes[:3] == ["600 root /etc/modelswap/vllm.env", "600 root /etc/modelswap/vllm.secret.env",
                             "644 root /etc/systemd/system/vllm.service"]
        unit = lab.ssh(host, "cat /etc/systemd/system/vllm.service").stdout
        assert unit.startswith("#\n# Ansible managed")
        for line in ("KillMode=mixed", "Restart=on-failure", "StartLimitBurst=3",
                     "TimeoutStopSec=120", "EnvironmentFile=/etc/modelswap/vllm.secret.env",
                     "ProtectSystem=strict", "NoNewPrivileges=yes", "User=vllm"):
            assert line in unit.splitlines()
        assert "HF_HUB_OFFLINE=\"1\"" in lab.ssh(host, "cat /etc/modelswap/vllm.env").stdout


BAD_INPUTS = [
    ("not_in_catalog", "tiny-zzz", {}, "it is not in the model catalog"),
    ("not_fetched", "tiny-c", {}, "is not on this host"),
    ("tp_larger_than_gpus", "tiny-a-tp2", {}, "has no NVIDIA GPU"),
    ("port_held", "tiny-a", {"vllm_service_port": 8101}, "is held by a process outside vllm.service"),
    ("missing_vllm", "tiny-a", {"vllm_service_install": False,
                                "vllm_service_venv": "/opt/modelswap/venvs/missing"},
     "has no usable vLLM"),
    ("no_api_key", "tiny-a", {"vllm_service_api_key": ""}, "vllm_service_api_key is empty"),
    # the role checks a changed unit with systemd-analyze before it replaces the live one
    ("unit_rejected", "tiny-a", {"vllm_service_hardening": {"ProtectSystem": "bogus"}},
     "does not pass `systemd-analyze verify`"),
    # a swap that would run a missing evaluation hook is refused before the stop
    ("hook_missing", "tiny-b", {"vllm_service_quality_hook": "no/such/hook.yml"},
     "no/such/hook.yml is not a file on the controller"),
    # an entry compared with another entry's reference, which was never recorded (an empty folder)
    ("reference_missing", "tiny-b", {"quality_of_tiny_b": {"reference": "tiny-a"}},
     "the quality gate of 'tiny-b' compares it with the reference of 'tiny-a', but "),
]


def bad_input_vars(models, extra, tmp):
    """A bad input's variables: the catalog, with tiny-b's quality gate when the case sets one (and
    then an empty reference folder)."""
    extra = dict(extra)
    quality = extra.pop("quality_of_tiny_b", None)
    if quality is None:
        return dict(extra, modelswap_models=models)
    return dict(extra, modelswap_models=dict(models, **{"tiny-b": dict(models["tiny-b"], quality=quality)}),
                vllm_service_quality_dir=str(tmp))


@pytest.fixture(scope="module")
def read_only_runs(ctx, tmp_path_factory):
    """The bad inputs (on gpu1) and the check-mode preview (both hosts), run at once: none of
    them may change anything, which the tests check on the hosts afterwards."""
    lab = ctx.lab
    before = {h: (main_pid(lab, h), sums(lab, h)) for h in HOSTS}
    models = V.catalog(lab)
    models["tiny-c"] = dict(models["tiny-a"], repo_id="lab/tiny-c", revision="c" * 40,
                            served_model_name="tiny-c")
    ctx.preview_key = V.new_api_key()
    ctx.keys.append(ctx.preview_key)
    tmp = tmp_path_factory.mktemp("no-references")
    holder = lab.ssh("gpu1", "setsid timeout 300 python3 -m http.server 8101 --bind 0.0.0.0 "
                             ">/dev/null 2>&1 </dev/null & echo $!").stdout.strip()
    try:
        assert V.wait_for(lambda: lab.ssh("gpu1", "ss -ltnH 'sport = :8101'").stdout.strip(), 20)
        calls = {case: (lambda m=model, e=extra: ctx.run(m, limit="gpu1", **bad_input_vars(models, e, tmp)))
                 for case, model, extra, _ in BAD_INPUTS}
        calls["check_mode"] = lambda: ctx.run(
            "tiny-b", check=True, diff=True, key=ctx.preview_key,
            vllm_service_nccl_env={"NCCL_DEBUG": "WARN", "NCCL_P2P_LEVEL": "SYS"})
        runs = parallel(**calls)
    finally:
        lab.ssh("gpu1", "kill -- -%s 2>/dev/null; kill %s 2>/dev/null; true" % (holder, holder),
                check=False)
    after = {h: (main_pid(lab, h), sums(lab, h)) for h in HOSTS}
    return runs, before, after


@pytest.mark.parametrize("case, model, extra, message", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_fails_before_the_old_service_is_stopped(ctx, read_only_runs, case, model, extra, message):
    lab = ctx.lab
    runs, before, after = read_only_runs
    run = runs[case]
    assert run.rc != 0 and run.failed("gpu1") == 1
    task, msg = ctx.failure(run, "gpu1")
    assert message in msg, (task, msg)
    assert "nothing was changed" in msg.lower() or "was not touched" in msg
    if case == "port_held":
        assert "python3 -m http.server 8101" in msg
    if case == "unit_rejected":
        assert "Failed to parse protect system value, ignoring: bogus" in msg
    # the old service was never stopped: same process, same files, still serving tiny-a
    assert not [r for r in run.task_results(STOP_TASK, "gpu1") if r["_event"] == "runner_on_ok"]
    assert after["gpu1"] == before["gpu1"]
    assert V.served_names(lab, "gpu1", ctx.key) == ["tiny-a"]


def test_check_mode_previews_the_swap_and_changes_nothing(ctx, read_only_runs):
    lab = ctx.lab
    runs, before, after = read_only_runs
    run = runs["check_mode"]
    assert run.rc == 0, run.stdout[-6000:]
    out = run.stdout
    b_path = "/models--lab--tiny-b/snapshots/" + lab.models["tiny-b"]["commit"]
    assert any(line.startswith("+ExecStart=") and b_path in line and "--served-model-name tiny-b" in line
               for line in out.splitlines())
    assert any(line.startswith("-ExecStart=") and "--served-model-name tiny-a" in line
               for line in out.splitlines())
    assert '+NCCL_P2P_LEVEL="SYS"' in out.splitlines()
    assert "secret.env: the content would change (a secret file: not shown)" in out     # service_files
    assert "vllm.service (serving tiny-a): would stop it, then start it serving tiny-b" in " ".join(out.split())
    for host in HOSTS:
        assert ctx.outcome(run, host)["would_swap"] is True
        assert after[host] == before[host]
        assert V.served_names(lab, host, ctx.key) == ["tiny-a"]
    # the keys, old and new, are in no output of the run
    dump = out + json.dumps(run.events)
    assert ctx.key not in dump and ctx.preview_key not in dump


def test_swap_to_tiny_b(ctx, tmp_path):
    lab = ctx.lab
    old_pids = {h: lab.ssh(h, "pgrep -u vllm").stdout.split() for h in HOSTS}
    t0 = {h: V.host_epoch(lab, h) for h in HOSTS}
    run = ctx.run("tiny-b", vllm_service_quality_hook=QUALITY_HOOK, hook_dir=str(tmp_path), hook_expect="")
    ctx.swap = run
    assert run.rc == 0, run.stdout[-6000:]
    for host in HOSTS:
        out = ctx.outcome(run, host)
        assert out["swapped"] is True and out["replaced_model"] == "tiny-a"
        assert V.served_names(lab, host, ctx.key) == ["tiny-b"]
        # the old processes were gone before the new one started
        assert old_pids[host]
        assert lab.ssh(host, "ps -o pid= -p %s" % ",".join(old_pids[host]), check=False).stdout.strip() == ""
        assert out["stopped_confirmed_monotonic"] < out["new_main_start_monotonic"]
        journal = V.journal_since(lab, host, t0[host]).splitlines()
        stopped = [i for i, line in enumerate(journal) if "vllm.service: Deactivated successfully" in line]
        started = [i for i, line in enumerate(journal) if "Started vllm.service" in line]
        assert stopped and started and stopped[0] < started[-1], "\n".join(journal[-40:])
        # the port is owned by the new unit's main process
        pid = main_pid(lab, host)
        owners = lab.ssh(host, "ss -ltnpH 'sport = :%d'" % V.PORT).stdout
        assert "pid=%d," % pid in owners and owners.count("pid=") == 1, owners
        assert "/vllm.service" in lab.ssh(host, "cat /proc/%d/cgroup" % pid).stdout
        rec = V.record(lab, host)
        assert rec["model"] == "tiny-b" and rec["previous"]["model"] == "tiny-a"
        # downtime = old stopping -> new ready; vLLM's own start is most of it
        assert out["downtime_s"] >= out["start_to_ready_s"] > 0
        assert out["downtime_s"] - out["start_to_ready_s"] < 30
        # and where the start went, from vLLM's own lines: every phase, adding up to the whole
        startup = out["startup"]
        assert list(startup["phases"]) == ["imports_and_config_s", "engine_and_workers_s", "weights_s",
                                           "engine_init_s", "api_server_s", "first_token_s"], startup
        assert abs(sum(startup["phases"].values()) - startup["total_s"]) < 0.1, startup
        assert abs(startup["total_s"] - out["start_to_ready_s"]) < 3, (startup, out["start_to_ready_s"])
        assert set(startup["reported"]) == {"weights_s", "engine_init_s"}     # enforce_eager: no compile
        assert out["quality"]["passed"] is True
        # the operator's evaluation hook ran against the new server before it was recorded
        hooked = json.loads((tmp_path / ("%s.json" % host)).read_text())
        assert hooked["candidate"] == {
            "model": "tiny-b", "repo_id": "lab/tiny-b", "commit": lab.models["tiny-b"]["commit"],
            "served_model_name": "tiny-b", "base_url": "http://%s:%d" % (lab.address(host), V.PORT), "port": V.PORT}
        assert isinstance(hooked["text"], str)      # the server answered its completion
    assert json.loads((ctx.quality_dir / "tiny-b.json").read_text())["commit"] == lab.models["tiny-b"]["commit"]


def test_second_run_reports_no_changes(ctx):
    lab = ctx.lab
    pids = {h: main_pid(lab, h) for h in HOSTS}
    run = ctx.run("tiny-b")
    assert run.rc == 0, run.stdout[-6000:]
    for host in HOSTS:
        assert run.changed(host) == 0, run.stdout[-6000:]
        out = ctx.outcome(run, host)
        assert out["swapped"] is False and set(out["gates"]) == {"port", "health", "models", "completion"}
        assert main_pid(lab, host) == pids[host]
        assert out["quality"] is None         # recorded and unchanged: no new answers to check


@pytest.fixture(scope="module")
def late_runs(ctx):
    """gpu1 swaps to tiny-broken (and must roll back to tiny-b by itself) while gpu2 previews and
    runs playbooks/rollback.yml (back to tiny-a): two vLLM starts at a time, not four in a row."""
    lab = ctx.lab
    ctx.unit_before_broken = lab.ssh("gpu1", "cat /etc/systemd/system/vllm.service").stdout

    def rollback_gpu2():
        check = ctx.run("tiny-a", playbook=V.ROLLBACK, limit="gpu2", check=True, diff=True)
        serving = V.served_names(lab, "gpu2", ctx.key)
        return check, serving, ctx.run("tiny-a", playbook=V.ROLLBACK, limit="gpu2")
    def broken_then_drifted_gpu1():
        broken = ctx.run("tiny-broken", limit="gpu1")
        return broken, ctx.run("tiny-a-drifted", limit="gpu1")
    return parallel(broken=broken_then_drifted_gpu1, rollback=rollback_gpu2)


def test_swap_to_a_model_that_fails_rolls_back(ctx, late_runs):
    lab = ctx.lab
    run = late_runs["broken"][0]
    assert run.rc != 0 and run.failed("gpu1") == 1 and "gpu2" not in run.stats.get("processed", {})
    task, msg = ctx.failure(run, "gpu1")
    assert task == "Fail the host - the swap failed and was rolled back", (task, msg)
    assert "deploy of 'tiny-broken' FAILED at Wait until the new server serves" in msg
    assert "exited during start-up" in msg
    assert "Rolled back: 'tiny-b' serves again on port %d" % V.PORT in msg
    assert "exceeds dimension size" in msg            # the root cause, from the journal
    assert V.served_names(lab, "gpu1", ctx.key) == ["tiny-b"]
    assert lab.ssh("gpu1", "cat /etc/systemd/system/vllm.service").stdout == ctx.unit_before_broken
    rec = V.record(lab, "gpu1")
    assert rec["model"] == "tiny-b" and rec["previous"]["model"] == "tiny-a"


def test_a_model_that_answers_otherwise_fails_the_quality_gate_and_rolls_back(ctx, late_runs):
    lab = ctx.lab
    run = late_runs["broken"][1]
    assert run.rc != 0 and run.failed("gpu1") == 1
    task, msg = ctx.failure(run, "gpu1")
    assert task == "Fail the host - the swap failed and was rolled back", (task, msg)
    # it started and passed the readiness gates: only its answers gave it away
    gates = [r for r in run.task_results("Wait until the new server serves (port, /health, /v1/models, a one-token "
                                         "completion)", "gpu1") if r["_event"] == "runner_on_ok"]
    assert gates and gates[0]["ready"] is True
    assert ("deploy of 'tiny-a-drifted' FAILED at Check the new server's answers against its catalog entry's "
            "reference (the quality gate): quality gate failed against the reference recorded on ") in msg
    assert "from lab/tiny-a@%s (vLLM 0.32.0)" % lab.models["tiny-a"]["commit"][:12] in msg
    assert "token agreement " in msg and "< 0.75 (prompt " in msg, msg
    assert "Rolled back: 'tiny-b' serves again on port %d" % V.PORT in msg
    failed = [r for r in run.task_results("Check the new server's answers against its catalog entry's reference "
                                          "(the quality gate)", "gpu1") if r["_event"] == "runner_on_failed"]
    checks = {c["check"]: c for c in failed[0]["checks"]}
    assert checks["token_agreement"]["passed"] is False and checks["token_agreement"]["value"] < 0.75
    assert V.served_names(lab, "gpu1", ctx.key) == ["tiny-b"]
    assert V.record(lab, "gpu1")["model"] == "tiny-b"
    # the reference it was compared with is tiny-a's, untouched; the failed model recorded none
    assert (ctx.quality_dir / "tiny-a.json").read_bytes() == ctx.tiny_a_reference
    assert not (ctx.quality_dir / "tiny-a-drifted.json").exists()


def test_rollback_playbook_returns_to_the_previous_model(ctx, late_runs):
    lab = ctx.lab
    check, serving_after_check, run = late_runs["rollback"]
    assert check.rc == 0, check.stdout[-6000:]
    assert any(line.startswith("+ExecStart=") and "--served-model-name tiny-a" in line
               for line in check.stdout.splitlines())
    assert serving_after_check == ["tiny-b"]          # the preview changed nothing
    assert run.rc == 0, run.stdout[-6000:]
    assert ctx.outcome(run, "gpu2")["swapped"] is True
    assert V.served_names(lab, "gpu2", ctx.key) == ["tiny-a"]
    rec = V.record(lab, "gpu2")
    assert rec["model"] == "tiny-a" and rec["previous"]["model"] == "tiny-b"
    assert "--served-model-name tiny-a" in lab.ssh("gpu2", "cat /etc/systemd/system/vllm.service").stdout


def test_api_keys_appear_in_no_log_result_diff_or_other_file(ctx):
    lab = ctx.lab
    assert len(ctx.runs) >= 10
    for run in ctx.runs:
        dump = run.stdout + json.dumps(run.events)
        for key in ctx.keys:
            assert key not in dump
    for host in HOSTS:
        journal = lab.ssh(host, "journalctl --since @%d --no-pager" % int(ctx.started[host])).stdout
        files = lab.ssh(host, "cat /etc/systemd/system/vllm.service /etc/modelswap/vllm.env %s; "
                              "ps -ww -e -o args" % V.RECORD).stdout
        argv = lab.ssh(host, "systemctl show -p ExecStart -p Environment vllm.service").stdout
        for key in ctx.keys:
            assert key not in journal and key not in files and key not in argv
        # where it is meant to be
        assert ctx.key in lab.ssh(host, "cat /etc/modelswap/vllm.secret.env").stdout


def test_vllm_ready_on_a_lab_host_reports_gates_and_port_owner(ctx, tmp_path):
    """The module on its own, over SSH, with the unit's key file (the key never leaves the host)."""
    lab = ctx.lab
    play = [{"name": "vllm_ready on its own", "hosts": "gpu1", "gather_facts": False, "tasks": [
        {"name": "Wait for the server", "modelswap.vllm.vllm_ready": {
            "host": lab.address("gpu1"), "port": V.PORT, "served_model_name": "tiny-b",
            "api_key_file": "/etc/modelswap/vllm.secret.env", "unit": "vllm.service", "timeout": 30}},
        {"name": "Ask for a model that is not served", "modelswap.vllm.vllm_ready": {
            "host": lab.address("gpu1"), "port": V.PORT, "served_model_name": "tiny-a",
            "api_key_file": "/etc/modelswap/vllm.secret.env", "unit": "vllm.service", "timeout": 30},
         "ignore_errors": True}]}]
    path = tmp_path / "play.yml"
    path.write_text(json.dumps(play))
    started = time.monotonic()
    run = lab.playbook(str(path), limit="gpu1")
    ctx.runs.append(run)
    [ok] = run.task_results("Wait for the server", "gpu1")
    assert ok["ready"] is True and list(ok["gates"]) == ["port", "health", "models", "completion"]
    [owner] = ok["port_listeners"]
    assert owner["unit"] == "vllm.service" and owner["user"] == "vllm"
    assert owner["pid"] == int(ok["unit_state"]["MainPID"])
    [bad] = run.task_results("Ask for a model that is not served", "gpu1")
    assert bad["failed_gate"] == "models" and bad["stopped_by"] == "final"
    assert "not 'tiny-a'" in bad["msg"]
    assert time.monotonic() - started < 60
    assert ctx.key not in run.stdout + json.dumps(run.events)


def test_a_later_deployment_of_tiny_a_matches_its_reference(ctx, late_runs, tmp_path):
    """gpu2 serves tiny-a again (playbooks/rollback.yml): the module on its own, with the reference
    the first deployment recorded, finds the same answers - the comparison a later deployment of the
    entry gets, here after another swap and a restart, possibly on the other host."""
    lab = ctx.lab
    reference = json.loads(ctx.tiny_a_reference)
    play = [{"name": "vllm_quality on its own", "hosts": "gpu2", "gather_facts": False, "tasks": [
        {"name": "Compare with tiny-a's reference", "modelswap.vllm.vllm_quality": {
            "host": lab.address("gpu2"), "port": V.PORT, "served_model_name": "tiny-a",
            "api_key_file": "/etc/modelswap/vllm.secret.env", "settings": {}, "reference": reference}}]}]
    path = tmp_path / "play.yml"
    path.write_text(json.dumps(play))
    run = lab.playbook(str(path), limit="gpu2")
    ctx.runs.append(run)
    assert run.rc == 0, run.stdout[-4000:]
    [ok] = run.task_results("Compare with tiny-a's reference", "gpu2")
    checks = {c["check"]: c["value"] for c in ok["checks"]}
    assert ok["passed"] is True and checks["token_agreement"] == 1.0 and checks["logprob_delta"] < 1e-3, ok["checks"]
    assert ok["reference"]["host"] == reference["host"] and ok["changed"] is False
    assert [a["tokens"] for a in ok["document"]["answers"]] == [a["tokens"] for a in reference["answers"]]
    assert ctx.key not in run.stdout + json.dumps(run.events)


def stream_completion(lab, host, key, model, max_tokens, seen):
    """A streamed completion read to its end: tokens counted into ``seen`` as they arrive; returns
    (finish_reason, the usage's completion tokens, whether [DONE] came, the error if it broke)."""
    req = urllib.request.Request(
        V.url(lab, host, "/v1/completions"),
        data=json.dumps({"model": model, "prompt": "Once", "max_tokens": max_tokens, "ignore_eos": True,
                         "stream": True, "stream_options": {"include_usage": True}}).encode(),
        headers={"Content-Type": "application/json", "Authorization": "Bearer " + key})
    finish, tokens, done = None, None, False
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                for choice in chunk.get("choices") or []:
                    seen.append(1)
                    finish = choice.get("finish_reason") or finish
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    except (OSError, ValueError) as exc:
        return finish, tokens, done, repr(exc)
    return finish, tokens, done, None


def test_stop_during_a_stream_lets_it_finish_and_refuses_new_requests(ctx):
    """vLLM drains on `systemctl stop` (--shutdown-timeout, KillMode=mixed): a stream in flight
    ends normally and in full, a new request is refused, and the unit stops cleanly. (Before: the
    stream was cut, the client hung, and systemd killed the unit after TimeoutStopSec.)"""
    lab, host = ctx.lab, "gpu1"
    model = V.record(lab, host)["model"]
    t0 = V.host_epoch(lab, host)
    seen, out = [], {}
    reader = threading.Thread(target=lambda: out.update(
        result=stream_completion(lab, host, ctx.key, model, 480, seen)))
    reader.start()
    deadline = time.monotonic() + 60
    while len(seen) < 5 and reader.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(seen) >= 5 and reader.is_alive(), "the stream did not start: %s" % out
    lab.ssh(host, "systemctl stop --no-block vllm.service")     # SIGTERM now; the drain begins
    try:    # while the stream drains: refused by the engine (or, once down, by the port)
        refused = V.http(lab, host, "/v1/completions", ctx.key, {"model": model, "prompt": "Hi", "max_tokens": 2},
                         timeout=30)
    except urllib.error.URLError as exc:
        refused = (None, repr(exc))
    reader.join(90)
    assert not reader.is_alive()
    finish, tokens, done, error = out["result"]
    assert (finish, tokens, done, error) == ("length", 480, True, None), (out, len(seen))
    assert refused[0] != 200, refused
    state = {}
    for _ in range(120):
        state = V.unit_show(lab, host, "ActiveState", "Result")
        if state["ActiveState"] in ("inactive", "failed"):
            break
        time.sleep(0.5)
    assert state == {"ActiveState": "inactive", "Result": "success"}, state
    journal = V.journal_since(lab, host, t0)
    assert "[shutdown] EngineCore: draining in-flight requests count=1" in journal, journal[-3000:]
    assert "timed out" not in journal and "died unexpectedly" not in journal, journal[-3000:]


@pytest.mark.campaign
def test_an_evaluation_hook_that_fails_rolls_the_swap_back(ctx, late_runs, tmp_path):
    """gpu2 serves tiny-a (playbooks/rollback.yml): a swap to tiny-b passes the readiness and quality
    gates, then the operator's evaluation hook finds its answer wanting - the swap rolls back like
    after a failed gate, and the message names the hook's task."""
    lab = ctx.lab
    run = ctx.run("tiny-b", limit="gpu2", vllm_service_quality_hook=QUALITY_HOOK, hook_dir=str(tmp_path),
                  hook_expect="no model says this")
    assert run.rc != 0 and run.failed("gpu2") == 1
    task, msg = ctx.failure(run, "gpu2")
    assert task == "Fail the host - the swap failed and was rolled back", (task, msg)
    assert "deploy of 'tiny-b' FAILED at Judge the answer: evaluation hook: the answer" in msg, msg
    assert "lacks 'no model says this'" in msg and "Rolled back: 'tiny-a' serves again" in msg, msg
    assert json.loads((tmp_path / "gpu2.json").read_text())["candidate"]["model"] == "tiny-b"
    assert V.served_names(lab, "gpu2", ctx.key) == ["tiny-a"]
    assert V.record(lab, "gpu2")["model"] == "tiny-a"
    assert ctx.key not in run.stdout + json.dumps(run.events)
