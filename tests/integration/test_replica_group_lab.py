"""A replica group on the lab: the two lab hosts serve one model together (vLLM's multi-node
multiprocessing backend, tensor parallel 2 over gloo on the lab bridge), deployed, swapped and
rolled back as one unit by the vllm_service role (playbooks/deploy.yml) and by the migration
(playbooks/migrate.yml: the group in one batch, its worker restarted with its head).

One story, in order (each group start costs about a minute on the two shared cores):

  deploy tiny-a (TP=2) on the group -> bad inventories refused before anything changes (a group
  the model cannot fill, a node left out by --limit, an unreachable node, a node in two groups)
  -> a migration to tiny-b whose worker cannot start rolls the whole group back to tiny-a -> a
  migration left with one node (--limit) refused before anything changes -> the migration's
  preview (the group as one unit) -> the migration to tiny-b -> a rerun changes nothing -> a
  head whose drain fails leaves the group untouched -> the fleet table -> deploy.yml's preview -> (campaign, `make test-full`) the rollback to tiny-a, a
  controller killed between the worker's start and the head's that converges on rerun, and the
  migration back.

gpu1 is the head (node rank 0, the API server), gpu2 the headless worker; each node is pinned to
its own core (the inventory's vllm_service_cpu_affinity, VLLM_CPU_OMP_THREADS_BIND the same).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration import vllm_lab as V
from tests.support.crash import run_killed_at

pytestmark = [pytest.mark.lab, pytest.mark.vllm]

HOSTS = ["gpu1", "gpu2"]
TASKS = str(Path(__file__).parent / "tasks")
HEAD, WORKER = HOSTS
# The head fails this long after a worker that never joins (the lab's short rendezvous).
GROUPS = {"pair": {"nodes": HOSTS, "distributed_timeout": 45}}
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "TORCHDYNAMO_DISABLE": "1",
       "VLLM_CPU_OMP_THREADS_BIND": "{{ vllm_service_cpu_affinity }}"}


def catalog(lab) -> dict:
    """tiny-a and tiny-b over two nodes (tensor parallel 2), and tiny-a on one (which a group of
    two cannot split)."""
    models = {}
    for name in ("tiny-a", "tiny-b"):
        models[name] = {"repo_id": lab.models[name]["repo_id"], "revision": lab.models[name]["commit"],
                        "served_model_name": name, "vllm_args": dict(V.CPU_ARGS, tensor_parallel_size=2)}
    models["tiny-a-one"] = dict(models["tiny-a"], vllm_args=dict(V.CPU_ARGS))
    return models


class Ctx:
    def __init__(self, lab, results):
        self.lab = lab
        self.key = V.new_api_key()
        self.results = results

    def run(self, model, *, limit="gpu1,gpu2", env=None, **extra):
        extra.setdefault("modelswap_replica_groups", GROUPS)
        extra.setdefault("vllm_service_node_ifname", "host0")
        extra.setdefault("vllm_service_accelerator", "cpu")
        return self.lab.playbook(V.DEPLOY, V.role_vars(self.lab, self.key, modelswap_serve=model,
                                                       modelswap_models=catalog(self.lab),
                                                       vllm_service_env=dict(ENV, **(env or {})), **extra),
                                 limit=limit)

    def migrate(self, model, *, limit="gpu1,gpu2,localhost", check=False, env=None, **extra):
        """playbooks/migrate.yml on the group (no load balancer: the lab's HAProxy checks another
        port, and the two lab hosts are the group, so no other server would keep serving)."""
        for key, value in (("modelswap_replica_groups", GROUPS), ("vllm_service_node_ifname", "host0"),
                           ("vllm_service_accelerator", "cpu"), ("lb_pool_type", "none"),
                           ("modelswap_benchmark", False), ("modelswap_results_dir", self.results)):
            extra.setdefault(key, value)
        return self.lab.playbook("playbooks/migrate.yml", V.role_vars(
            self.lab, self.key, modelswap_serve=model, modelswap_models=catalog(self.lab),
            vllm_service_env=dict(ENV, **(env or {})), **extra), limit=limit, check=check, diff=check)

    def outcome(self, result, host):
        for res in result.task_results("Report the outcome", host):
            if res["_event"] == "runner_on_ok":
                return res["ansible_facts"]["vllm_service_result"]
        raise AssertionError("no outcome for %s:\n%s" % (host, result.stdout[-4000:]))

    def state(self):
        """What a refused run must leave as it was: each node's main PID, unit, env and record."""
        return {h: (V.unit_show(self.lab, h, "MainPID")["MainPID"],
                    self.lab.ssh(h, "sha256sum /etc/systemd/system/vllm.service /etc/modelswap/vllm.env %s"
                                 % V.RECORD).stdout) for h in HOSTS}

    def argv(self, host):
        return V.unit_show(self.lab, host, "ExecStart")["ExecStart"]

    def serves(self, model):
        """The group answers through its head with the model; the worker has no API."""
        assert V.served_names(self.lab, HEAD, self.key) == [model]
        status, body = V.http(self.lab, HEAD, "/v1/completions", self.key,
                              {"model": model, "prompt": "Hello", "max_tokens": 4, "temperature": 0})
        assert status == 200 and body["usage"]["completion_tokens"] == 4, body
        assert self.lab.ssh(WORKER, "ss -Htln 'sport = :%d'" % V.PORT).stdout.strip() == ""
        for host in HOSTS:
            assert V.unit_show(self.lab, host, "ActiveState")["ActiveState"] == "active"
            assert V.record(self.lab, host)["model"] == model


def failures(result, host):
    return [(ev["event_data"]["task"], ev["event_data"]["res"].get("msg", ""))
            for ev in result.events if ev.get("event") == "runner_on_failed"
            and ev["event_data"].get("host") == host and not ev["event_data"].get("ignore_errors")]


@pytest.fixture(scope="module")
def ctx(lab, tmp_path_factory):
    for host in HOSTS:
        V.reset_host(lab, host)
    c = Ctx(lab, str(tmp_path_factory.mktemp("runs")))
    V.prepare(lab, HOSTS, c.key)
    c.first = c.run("tiny-a")
    yield c
    for host in HOSTS:
        V.stop(lab, host)


def test_two_hosts_serve_tiny_a_as_one_group(ctx):
    run = ctx.first
    assert run.rc == 0, "%s\n%s" % (run.failures(), run.stdout[-6000:])
    ctx.serves("tiny-a")
    head, worker = ctx.argv(HEAD), ctx.argv(WORKER)
    rendezvous = "--master-addr %s --master-port 29501 --distributed-timeout-seconds 45" % ctx.lab.address(HEAD)
    assert "--nnodes 2 --node-rank 0 " + rendezvous in head and "--headless" not in head
    assert "--headless --nnodes 2 --node-rank 1 " + rendezvous in worker
    assert "--tensor-parallel-size 2" in head and "--tensor-parallel-size 2" in worker
    for host in HOSTS:
        env = ctx.lab.ssh(host, "cat /etc/modelswap/vllm.env").stdout
        assert 'VLLM_HOST_IP="%s"' % ctx.lab.address(host) in env and 'GLOO_SOCKET_IFNAME="host0"' in env
        assert ctx.outcome(run, host)["swapped"] is True
    # the worker started first and proved the group through its head
    assert run.task_results("Start the new service on the workers of a replica group", WORKER)
    assert run.task_results("Prove the group serves through its head, with this worker running", WORKER)


def test_bad_inventories_are_refused_before_anything_changes(ctx):
    lab, before = ctx.lab, ctx.state()
    # the model needs one GPU (here one process), the group has two nodes
    run = ctx.run("tiny-a-one")
    assert run.rc != 0
    assert any("cannot be split evenly" in msg for _, msg in failures(run, WORKER)), run.failures()
    # a node left out of the play: the other is not stopped alone
    run = ctx.run("tiny-b", limit=HEAD)
    assert run.rc != 0
    assert any("whose gpu2 is not in this play" in msg for _, msg in failures(run, HEAD)), run.failures()
    # an unreachable node (its address leads nowhere): the head refuses the swap
    run = ctx.run("tiny-b", ansible_host="{{ '10.213.7.250' if inventory_hostname == 'gpu2' else '%s' }}"
                  % lab.address(HEAD), ansible_ssh_timeout=5)
    assert run.rc != 0
    assert any("whose gpu2 is not in this play" in msg for _, msg in failures(run, HEAD)), run.failures()
    # a node in two groups
    run = ctx.run("tiny-b", modelswap_replica_groups=dict(GROUPS, other={"nodes": [WORKER, "gpu3"]}))
    assert run.rc != 0
    assert any("gpu2 is a node of both 'pair' and 'other'" in msg for _, msg in failures(run, HEAD)), run.failures()
    assert ctx.state() == before
    ctx.serves("tiny-a")


def test_a_worker_that_cannot_start_rolls_the_whole_group_back(ctx):
    # the worker's vLLM dies at import (an unknown log level); the head waits for it, then fails
    run = ctx.migrate("tiny-b", env={"VLLM_LOGGING_LEVEL": "{{ 'NOPE' if inventory_hostname == 'gpu2' else 'INFO' }}"})
    assert run.rc != 0
    head_msgs = " ".join(msg for _, msg in failures(run, HEAD))
    worker_msgs = " ".join(msg for _, msg in failures(run, WORKER))
    assert "FAILED at Wait until the new server serves" in head_msgs and "Rolled back: 'tiny-a'" in head_msgs
    assert "the head gpu1 of replica group pair did not serve 'tiny-b'" in worker_msgs
    assert "Rolled back: 'tiny-a'" in worker_msgs
    records = run.custom_stats["modelswap_record"]
    for host in HOSTS:
        assert records[host]["outcome"] == "rolled_back" and records[host]["failure"]["step"] == "swap"
        assert records[host]["replica"]["group"] == "pair"
    ctx.serves("tiny-a")
    assert "models--lab--tiny-a" in ctx.argv(WORKER) and "--headless" in ctx.argv(WORKER)


def test_a_migration_left_with_one_node_of_the_group_is_refused_before_anything_changes(ctx):
    before = ctx.state()
    run = ctx.migrate("tiny-b", limit="gpu1,localhost")
    assert run.rc != 0
    msgs = " ".join(msg for _, msg in failures(run, HEAD))
    assert "whose gpu2 is not in this play" in msgs, run.failures()
    # refused at its plan: no purge, download or swap task ran
    assert not run.task_results("Prepare the host", HEAD) and not run.task_results("Render, swap, prove and record")
    assert ctx.state() == before


def test_the_migrations_preview_shows_the_group_as_one_unit_and_changes_nothing(ctx):
    before = ctx.state()
    run = ctx.migrate("tiny-b", check=True)
    assert run.rc == 0, run.failures()
    plans = run.custom_stats["modelswap_plan"]
    swap = {h: {s["step"]: s for s in plans[h]["steps"]}["swap"] for h in HOSTS}
    assert swap[HEAD]["text"].startswith("replica group pair (gpu1, gpu2; the head: it serves the API): ")
    assert swap[WORKER]["text"].startswith("replica group pair (gpu1, gpu2; headless, served through gpu1): ")
    assert swap[HEAD]["would_swap"] and swap[WORKER]["would_swap"] and swap[WORKER]["stop"] == "tiny-a"
    summary = "\n".join(run.task_results("Show the fleet summary")[0]["msg"])
    assert "- pair: gpu1, gpu2 (head gpu1): would restart as one unit (gpu1, gpu2 must)" in summary, summary
    assert ctx.state() == before


def test_the_migration_swaps_the_group_to_tiny_b_and_a_rerun_changes_nothing(ctx):
    run = ctx.migrate("tiny-b")
    assert run.rc == 0, "%s\n%s" % (run.failures(), run.stdout[-6000:])
    ctx.serves("tiny-b")
    records = run.custom_stats["modelswap_record"]
    for host in HOSTS:
        assert records[host]["outcome"] == "migrated" and records[host]["swap"]["replaced_model"] == "tiny-a"
        assert records[host]["replica"] == {"group": "pair", "nodes": HOSTS, "rank": HOSTS.index(host), "head": HEAD}
    # one batch: the worker started before its head, in the same play
    order = [(ev["event_data"]["task"], ev["event_data"]["host"]) for ev in run.events
             if ev.get("event") == "runner_on_ok" and ev["event_data"]["task"].startswith("Start the new service")]
    assert order.index(("Start the new service on the workers of a replica group", WORKER)) < \
        order.index(("Start the new service", HEAD)), order
    pids = {h: V.unit_show(ctx.lab, h, "MainPID")["MainPID"] for h in HOSTS}
    again = ctx.migrate("tiny-b")
    assert again.rc == 0, again.failures()
    for host in HOSTS:
        assert again.changed(host) == 0 and again.custom_stats["modelswap_record"][host]["outcome"] == "unchanged"
    assert {h: V.unit_show(ctx.lab, h, "MainPID")["MainPID"] for h in HOSTS} == pids


def test_a_head_whose_drain_fails_leaves_its_group_serving_untouched(ctx):
    # a load balancer (lb_pool hooks) that refuses to take the head out: the worker is not swapped alone
    before = ctx.state()
    run = ctx.migrate("tiny-a", lb_pool_type="hooks", lb_pool_state_tasks=TASKS + "/lb_state_serving.yml",
                      lb_pool_drain_tasks=TASKS + "/lb_drain_refused.yml",
                      lb_pool_rejoin_tasks=TASKS + "/lb_state_serving.yml")
    assert run.rc != 0
    assert "the test's load balancer refused to take gpu1 out" in " ".join(m for _, m in failures(run, HEAD))
    assert "whose gpu1 did not get this far in this run" in " ".join(m for _, m in failures(run, WORKER)), \
        run.failures()
    records = run.custom_stats["modelswap_record"]
    assert records[HEAD]["failure"]["step"] == records[WORKER]["failure"]["step"] == "swap"
    assert not run.task_results("Start the new service on the workers of a replica group")
    assert ctx.state() == before
    ctx.serves("tiny-b")
    # the head keeps the mark of a drain that may have happened (a rerun puts it back); the worker has none
    mark = "/var/lib/modelswap/lb-drained.json"
    assert ctx.lab.ssh(HEAD, "test -e " + mark, check=False).returncode == 0
    assert ctx.lab.ssh(WORKER, "test -e " + mark, check=False).returncode != 0
    ctx.lab.ssh(HEAD, "rm -f " + mark)


def test_the_fleet_table_reads_a_worker_through_its_head(ctx):
    # (the lab's HAProxy checks the inventory's port, not the one this module serves on: no pool here)
    run = ctx.lab.playbook("playbooks/status.yml", {"vllm_service_api_key": ctx.key,
                                                    "vllm_service_port": V.PORT, "lb_pool_type": "none",
                                                    "modelswap_replica_groups": GROUPS})
    assert run.rc == 0, run.failures()
    for host in HOSTS:
        (res,) = [r for r in run.task_results("Note this host's status", host) if r["_event"] == "runner_on_ok"]
        status = res["ansible_facts"]["fleet_status_result"]
        assert status["record_model"] == "tiny-b" and status["serving"] == ["tiny-b"], status
        assert status["problems"] == [], status
        assert status["replica"] == {"group": "pair", "rank": HOSTS.index(host), "head": HEAD, "nodes": HOSTS}
    table = "\n".join(run.task_results("Show the fleet table")[0]["msg"])
    assert "replica group pair: gpu1 serves the API; gpu2 runs headless (their rows read the group through gpu1)" \
        in table and "no problems: record, service and server agree on each of the 2" in table, table
    # the worker is no server of the pool: the group is reached through its head
    assert [r for r in run.task_results("Note this host's status", WORKER)
            if r["_event"] == "runner_on_ok"][0]["ansible_facts"]["fleet_status_result"]["pool"] is None


def test_the_preview_says_what_each_node_would_do(ctx):
    before = ctx.state()
    run = ctx.lab.playbook(V.DEPLOY, V.role_vars(
        ctx.lab, ctx.key, modelswap_serve="tiny-a", modelswap_models=catalog(ctx.lab), vllm_service_env=ENV,
        modelswap_replica_groups=GROUPS, vllm_service_node_ifname="host0", vllm_service_accelerator="cpu"),
        limit="gpu1,gpu2", check=True, diff=True)
    assert run.rc == 0, run.failures()
    said = {h: " ".join(run.task_results("Say what is stopped and started", h)[0]["msg"].split()) for h in HOSTS}
    assert "would stop it, then start it serving tiny-a as 'tiny-a' on port 8100" in said[HEAD]
    assert "(node 0 of replica group pair: gpu1, gpu2)" in said[HEAD]
    assert "start it serving tiny-a as 'tiny-a' as a headless worker" in said[WORKER]
    assert "(node 1 of replica group pair: gpu1, gpu2)" in said[WORKER]
    assert ctx.state() == before


@pytest.mark.campaign
def test_the_rollback_returns_the_whole_group_to_tiny_a(ctx):
    run = ctx.lab.playbook(V.ROLLBACK, V.role_vars(
        ctx.lab, ctx.key, modelswap_models=catalog(ctx.lab), vllm_service_env=ENV,
        modelswap_replica_groups=GROUPS, vllm_service_node_ifname="host0", vllm_service_accelerator="cpu"),
        limit="gpu1,gpu2")
    assert run.rc == 0, "%s\n%s" % (run.failures(), run.stdout[-6000:])
    ctx.serves("tiny-a")
    for host in HOSTS:
        assert ctx.outcome(run, host)["swapped"] is True and V.record(ctx.lab, host)["previous"]["model"] == "tiny-b"
    assert "--headless --nnodes 2 --node-rank 1" in ctx.argv(WORKER)


@pytest.mark.campaign
def test_a_controller_killed_between_the_worker_and_the_head_converges_on_rerun(ctx):
    before = V.record(ctx.lab, HEAD)["model"]
    target = "tiny-a" if before == "tiny-b" else "tiny-b"     # (make test leaves out the rollback above)
    extra = V.role_vars(ctx.lab, ctx.key, modelswap_serve=target, modelswap_models=catalog(ctx.lab),
                        vllm_service_env=ENV, modelswap_replica_groups=GROUPS, vllm_service_node_ifname="host0",
                        vllm_service_accelerator="cpu")
    # the second task named so: the head's start, after the worker's ("... on the workers ...")
    crashed = run_killed_at("deploy.yml", str(ctx.lab.inventory), extra, kill_at="Start the new service",
                            occurrence=2, limit="gpu1,gpu2")
    assert crashed["killed"], crashed["output"][-3000:]
    assert V.unit_show(ctx.lab, WORKER, "ActiveState")["ActiveState"] in ("active", "activating")
    assert "models--lab--%s" % target in ctx.argv(WORKER)
    assert V.record(ctx.lab, WORKER)["model"] == before        # not recorded: nothing was proved
    # the same command again (a group the dead run started may still be coming up)
    run = ctx.run(target, vllm_service_verify_wait_for_start=True)
    assert run.rc == 0, "%s\n%s" % (run.failures(), run.stdout[-6000:])
    ctx.serves(target)
    for host in HOSTS:
        assert V.record(ctx.lab, host)["previous"]["model"] == before


@pytest.mark.campaign
def test_the_migration_swaps_the_group_back(ctx):
    target = "tiny-a" if V.record(ctx.lab, HEAD)["model"] == "tiny-b" else "tiny-b"
    run = ctx.migrate(target)
    assert run.rc == 0, "%s\n%s" % (run.failures(), run.stdout[-6000:])
    ctx.serves(target)
