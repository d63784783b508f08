"""The lab itself (issue 2): hosts boot under systemd, answer over SSH, run units, stay apart."""
from __future__ import annotations

import json
import shlex
import time
import urllib.error
import urllib.request

import pytest

pytestmark = pytest.mark.lab


def fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.read().decode().strip()


def test_every_host_runs_systemd_as_pid1_and_is_running(lab):
    assert lab.hosts == ["gpu1", "gpu2"]
    for host in lab.hosts:
        assert lab.ssh(host, "cat /proc/1/comm").stdout.strip() == "systemd"
        assert lab.ssh(host, "systemctl is-system-running").stdout.strip() == "running"
        assert lab.ssh(host, "hostname").stdout.strip() == host


def test_hosts_have_distinct_machine_ids_and_host_keys(lab):
    ids = {lab.ssh(h, "cat /etc/machine-id").stdout.strip() for h in lab.hosts}
    keys = {lab.ssh(h, "cat /etc/ssh/ssh_host_ed25519_key.pub").stdout.split()[1] for h in lab.hosts}
    assert len(ids) == len(lab.hosts) and "" not in ids
    assert len(keys) == len(lab.hosts)


def test_ansible_reaches_every_host_over_ssh_with_host_key_checking(lab, tmp_path):
    from tests.lab.fixtures import write_playbook
    book = write_playbook(tmp_path, [{
        "name": "ping", "hosts": "gpu_hosts", "gather_facts": False,
        "tasks": [{"name": "ping", "ansible.builtin.ping": {}},
                  {"name": "about", "modelswap.vllm.modelswap_info": {}}]}])
    result = lab.playbook(book)
    assert result.rc == 0, result.stdout
    for host in lab.hosts:
        assert result.task_results("ping", host)[0]["ping"] == "pong"
        about = result.task_results("about", host)[0]
        assert about["collection"] == "modelswap.vllm" and about["python"].startswith("3.11")


def test_a_host_whose_key_is_not_the_known_one_is_refused(lab, tmp_path):
    from tests.lab.fixtures import write_playbook
    wrong = tmp_path / "known_hosts"
    other_key = lab.ssh("gpu2", "cat /etc/ssh/ssh_host_ed25519_key.pub").stdout.split()[:2]
    wrong.write_text(f"{lab.address('gpu1')} {' '.join(other_key)}\n")   # gpu2's key for gpu1
    book = write_playbook(tmp_path, [{
        "name": "ping", "hosts": "gpu1", "gather_facts": False,
        "vars": {"ansible_ssh_common_args": f"-o UserKnownHostsFile={wrong} -o StrictHostKeyChecking=yes",
                 # a fresh connection: a live ControlMaster would skip the key exchange
                 "ansible_ssh_args": "-o ControlMaster=no -o ControlPath=none"},
        "tasks": [{"name": "ping", "ansible.builtin.ping": {}}]}])
    result = lab.playbook(book)
    assert result.rc != 0
    assert result.stats.get("dark", {}).get("gpu1") == 1
    assert "REMOTE HOST IDENTIFICATION HAS CHANGED" in result.stdout or "Host key verification failed" in result.stdout


def test_a_templated_unit_starts_answers_on_its_own_address_and_stops(lab):
    book = "tests/integration/playbooks/lab_unit.yml"
    started = lab.playbook(book)
    assert started.rc == 0, started.stdout
    try:
        for host in lab.hosts:
            assert fetch(f"http://{lab.address(host)}:8088/index.html") == host
        # Each host's service listens on its own address only: the neighbour's address is not it.
        probe = lab.ssh("gpu1", f"curl -s --max-time 3 http://{lab.address('gpu2')}:8088/index.html")
        assert probe.stdout.strip() == "gpu2"
        assert lab.ssh("gpu1", "ss -ltnH 'sport = :8088'").stdout.count("LISTEN") == 1
    finally:
        stopped = lab.playbook(book, {"lab_unit_state": "stopped"})
    assert stopped.rc == 0, stopped.stdout
    for host in lab.hosts:
        with pytest.raises(urllib.error.URLError):
            fetch(f"http://{lab.address(host)}:8088/index.html")


def test_stopping_a_unit_on_one_host_leaves_the_other_serving(lab):
    book = "tests/integration/playbooks/lab_unit.yml"
    assert lab.playbook(book).rc == 0
    try:
        assert lab.playbook(book, {"lab_unit_state": "stopped"}, limit="gpu1").rc == 0
        with pytest.raises(urllib.error.URLError):
            fetch(f"http://{lab.address('gpu1')}:8088/index.html")
        assert fetch(f"http://{lab.address('gpu2')}:8088/index.html") == "gpu2"
    finally:
        lab.playbook(book, {"lab_unit_state": "stopped"})


def test_a_host_reboots_and_comes_back(lab, tmp_path):
    from tests.lab.fixtures import write_playbook
    book = write_playbook(tmp_path, [{
        "name": "reboot", "hosts": "gpu2", "gather_facts": False,
        "tasks": [{"name": "reboot", "ansible.builtin.reboot": {"reboot_timeout": 120}}]}])
    started = time.monotonic()
    result = lab.playbook(book)
    assert result.rc == 0, result.stdout
    assert lab.ssh("gpu2", "systemctl is-system-running --wait").stdout.strip() == "running"
    # The launcher booted a new container: its PID 1 is younger than this test.
    init_age = int(lab.ssh("gpu2", "ps -o etimes= -p 1").stdout)
    assert init_age <= time.monotonic() - started + 1


def test_reset_stops_and_removes_what_a_demo_or_an_earlier_run_left(lab):
    """The state a demo leaves (a vLLM slot unit serving on the tests' port as the service user,
    its configuration, a deployment, /dev/shm files of that user) and a unit set up by hand are
    gone after `labctl reset`; the model store's notes and the virtualenvs stay."""
    from tests.lab import labctl
    host = "gpu2"
    lab.ssh(host, "id -u vllm >/dev/null 2>&1 || useradd --system --home-dir /var/lib/vllm vllm")
    unit = ("[Unit]\nDescription=stand-in for a served model (reset test)\n[Service]\nUser=vllm\n"
            "ExecStart=/usr/bin/python3 -m http.server 8000 --bind 0.0.0.0\n"
            "[Install]\nWantedBy=multi-user.target\n")
    lab.ssh(host, "mkdir -p /etc/modelswap /var/lib/modelswap/vllm/vllm/active && "
                  f"printf %s {shlex.quote(unit)} > /etc/systemd/system/vllm.service && "
                  f"printf %s {shlex.quote(unit.replace('8000', '8001'))} > /etc/systemd/system/vllm-handmade.service && "
                  "echo VLLM_API_KEY=x > /etc/modelswap/vllm.secret.env && "
                  "echo '{\"model\": \"tiny-a\", \"fetched\": {\"lab/tiny-a\": {\"commit\": \"c\"}}}' "
                  "> /var/lib/modelswap/deployment.json && "
                  "systemctl daemon-reload && systemctl enable --now vllm.service vllm-handmade.service && "
                  "runuser -u vllm -- sh -c 'echo x > /dev/shm/psm_resettest'")
    deadline = time.monotonic() + 30
    while lab.ssh(host, "ss -Hltn 'sport = :8000'").stdout.strip() == "":
        assert time.monotonic() < deadline, "the stand-in server did not start"
        time.sleep(0.5)

    labctl.reset(labctl.lab_from_env())

    out = lab.ssh(host, "ls /etc/systemd/system | grep '^vllm' || true; ls /etc/modelswap 2>&1 || true; "
                        "ls /dev/shm; pgrep -u vllm || true; ss -Hltn 'sport = :8000 or sport = :8001'; "
                        "cat /var/lib/modelswap/deployment.json").stdout
    assert "vllm.service" not in out and "vllm-handmade" not in out
    assert "psm_resettest" not in out and "secret.env" not in out
    assert ":8000" not in out and ":8001" not in out
    assert json.loads(out.strip().splitlines()[-1]) == {"fetched": {"lab/tiny-a": {"commit": "c"}}}
    assert lab.ssh(host, "systemctl is-active vllm.service", check=False).stdout.strip() != "active"


def test_the_load_balancer_fronts_every_host_and_reset_sets_its_servers_ready(lab):
    """HAProxy lists a server per host on the vLLM port, its stats page answers on the bridge, the
    inventory says where it is; a server left in maintenance or drain is ready again after
    `labctl reset`."""
    import yaml

    from tests.lab import labctl
    handle = labctl.lab_from_env()
    stats = fetch(handle.lb_stats_url)
    assert stats.startswith("# pxname,svname,") and "\nvllm,gpu1," in stats and "\nvllm,gpu2," in stats
    assert set(lab.lb_servers()) == set(lab.hosts)
    config = handle.lb_config.read_text()
    assert f"server gpu1 {lab.address('gpu1')}:8000 check" in config and f"bind {handle.gateway}:" in config
    variables = yaml.safe_load(lab.inventory.read_text())["all"]["children"]["gpu_hosts"]["vars"]
    assert variables["lb_pool_haproxy_socket"] == str(handle.lb_socket) and variables["lb_pool_type"] == "haproxy"
    assert variables["modelswap_lab_lb_url"] == lab.lb_url

    lab.lb_command("disable server vllm/gpu1")
    lab.lb_command("set server vllm/gpu2 state drain")
    assert lab.lb_servers()["gpu1"] == "MAINT"
    labctl.reset(handle)
    assert not any(status.startswith(("MAINT", "DRAIN")) for status in lab.lb_servers().values())
