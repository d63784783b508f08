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
