"""A replica group behind HAProxy: the migration swaps the group with no failed request, since a
host outside the group keeps serving while the group is out of the pool (and the group while
that host is).

The main lab's two hosts are the group of test_replica_group_lab.py, with no other server, so
this drill runs on the peer lab (tests/lab/peerlab.py: a lab of its own, with its own HAProxy
whose backend has a server per host at the inventory's port, 8000): gpu1 (head) and gpu2
(headless worker) serve tiny-a together with tensor parallel 2; gpu3 serves tiny-a alone. Under a
bounded client load through HAProxy, `migrate.yml` with `modelswap_serial: 1` rolls the group
(one unit: the head drained, both nodes swapped, the head proved and rejoined), then gpu3. A
campaign drill (`make test-full`): three real vLLM starts, then three more.
"""
from __future__ import annotations

import pytest

from tests.integration import vllm_lab as V
from tests.lab import peerlab
from tests.support.lb_load import LoadRun

pytestmark = [pytest.mark.lab, pytest.mark.vllm, pytest.mark.campaign]

GROUP, SINGLE = ["gpu1", "gpu2"], "gpu3"
HOSTS = GROUP + [SINGLE]
GROUPS = {"pair": {"nodes": GROUP, "distributed_timeout": 60}}
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "TORCHDYNAMO_DISABLE": "1",
       "VLLM_CPU_OMP_THREADS_BIND": "{{ vllm_service_cpu_affinity }}"}
# the port the peer lab's HAProxy checks (the inventory's)
LB_PORT = 8000
# paced so that it spans the two batches without taking the cores from the starts
LOAD = {"workers": 2, "max_requests": 20000, "max_seconds": 1200, "max_tokens": 4, "pause": 0.1}


def catalog(lab) -> dict:
    """tiny-a and tiny-b over the group's two nodes (TP=2) and on one host (the -one entries),
    each under the same served name: a client of the pool asks whichever answers."""
    models = {}
    for name in ("tiny-a", "tiny-b"):
        base = {"repo_id": lab.models[name]["repo_id"], "revision": lab.models[name]["commit"],
                "served_model_name": name}
        models[name] = dict(base, vllm_args=dict(V.CPU_ARGS, tensor_parallel_size=2))
        models[name + "-one"] = dict(base, vllm_args=dict(V.CPU_ARGS))
    return models


def variables(lab, target: str, results: str) -> dict:
    return V.role_vars(
        lab, lab.api_key, modelswap_models=catalog(lab), vllm_service_env=ENV, vllm_service_port=LB_PORT,
        modelswap_serve="{{ '%s-one' if inventory_hostname == '%s' else '%s' }}" % (target, SINGLE, target),
        modelswap_replica_groups=GROUPS, vllm_service_node_ifname="host0", vllm_service_accelerator="cpu",
        lb_pool_type="haproxy", modelswap_benchmark=False, modelswap_results_dir=results,
        # what the main lab's inventory/lab/group_vars give its hosts (the peer lab's inventory has none)
        modelswap_hub_endpoint="{{ modelswap_lab_hub_url }}", modelswap_hub_http_trusted=True,
        model_fetch_use_xet=True, modelswap_hf_python=V.VENV + "/bin/python")


@pytest.fixture(scope="module")
def glab(tmp_path_factory):
    try:
        with peerlab.peer_lab(hosts=6) as lab:
            V.prepare(lab, HOSTS, lab.api_key)
            yield lab, str(tmp_path_factory.mktemp("runs"))
            for host in HOSTS:
                V.stop(lab, host)
    except peerlab.PeerLabError as exc:
        pytest.skip(str(exc))


def test_the_group_migrates_behind_haproxy_with_no_failed_request(glab):
    lab, results = glab
    first = lab.playbook(V.DEPLOY, variables(lab, "tiny-a", results), limit=",".join(HOSTS))
    assert first.rc == 0, "%s\n%s" % (first.failures(), first.stdout[-6000:])
    with LoadRun(lab.lb_url, lab.api_key, **LOAD) as clients:
        run = lab.playbook("playbooks/migrate.yml", dict(variables(lab, "tiny-b", results), modelswap_serial=1),
                           limit=",".join(HOSTS + ["localhost"]))
    assert run.rc == 0, "%s\n%s" % (run.failures(), run.stdout[-6000:])
    summary = clients.summary()
    print("load during the group's migration:", {k: summary[k] for k in ("total", "ok", "failed", "models", "seconds")})
    assert summary["failed"] == 0, summary["failures"]
    assert summary["total"] >= 100 and set(summary["models"]) == {"tiny-a", "tiny-b"}, summary
    records = run.custom_stats["modelswap_record"]
    for host in HOSTS:
        assert records[host]["outcome"] == "migrated", records[host]
    # the group left the pool through its head alone, and came back before gpu3 left
    head, single = records["gpu1"]["lb"], records[SINGLE]["lb"]
    assert head["drained"] and head["rejoined"] and single["drained"] and single["rejoined"], (head, single)
    assert records["gpu2"]["lb"] is None and records["gpu2"]["replica"]["head"] == "gpu1"
    assert records["gpu1"]["steps"]["swap"]["started"] < records[SINGLE]["steps"]["swap"]["started"]
    # two batches: the group's (two hosts) first, then gpu3's
    batches = [ev["event_data"]["play"] for ev in run.events if ev.get("event") == "playbook_on_play_start"]
    assert batches.count("Migrate - swap each GPU host, prove it serves, benchmark it") == 2, batches
    print("out of the pool: the group %.1f s (through gpu1), gpu3 %.1f s" % (head["seconds_out"], single["seconds_out"]))
