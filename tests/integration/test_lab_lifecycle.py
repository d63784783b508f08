"""`make lab-up` / `make lab-down` themselves (issue 2): refusals that change nothing, reuse of a
healthy lab, replacement of a broken one, a teardown that ends only what the lab started and will
not delete a tree still in use. Runs a second, one-host lab beside the main one."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.lab import labctl

pytestmark = pytest.mark.lab

NAME, SUBNET, PORT = "msltest", "10.213.9", "8481"


@pytest.fixture
def env(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("the lab needs root")
    env = dict(os.environ, MODELSWAP_LAB=NAME, MODELSWAP_LAB_SUBNET=SUBNET,
               MODELSWAP_LAB_HUB_PORT=PORT, MODELSWAP_LAB_INVENTORY=str(tmp_path / "hosts.yml"))
    yield env
    subprocess.run([sys.executable, "-m", "tests.lab.labctl", "down"], env=env, cwd=labctl.REPO,
                   capture_output=True, timeout=120)


def labctl_run(env, *args, timeout=600):
    return subprocess.run([sys.executable, "-m", "tests.lab.labctl", *args], env=env,
                          cwd=labctl.REPO, capture_output=True, text=True, timeout=timeout)


def state_dir() -> Path:
    return labctl.STATE_ROOT / NAME


def bridge_exists() -> bool:
    return Path(f"/sys/class/net/{NAME}-br").exists()


def test_up_refuses_a_bridge_that_is_taken_and_changes_nothing(env):
    subprocess.run(["ip", "link", "add", f"{NAME}-br", "type", "bridge"], check=True)
    try:
        proc = labctl_run(env, "up", "--hosts", "1", "--no-wheelhouse")
        assert proc.returncode == 2
        assert f"{NAME}-br already exists" in proc.stderr and "MODELSWAP_LAB" in proc.stderr
        assert not (state_dir() / "state.json").exists()
        assert bridge_exists()          # someone else's bridge is left alone
    finally:
        subprocess.run(["ip", "link", "del", f"{NAME}-br"], check=True)


def test_up_refuses_a_subnet_that_is_routed_elsewhere(env):
    subprocess.run(["ip", "link", "add", "msltestdum", "type", "bridge"], check=True)
    try:
        subprocess.run(["ip", "addr", "add", f"{SUBNET}.200/24", "dev", "msltestdum"], check=True)
        subprocess.run(["ip", "link", "set", "msltestdum", "up"], check=True)
        proc = labctl_run(env, "up", "--hosts", "1", "--no-wheelhouse")
        assert proc.returncode == 2
        assert f"{SUBNET}.0/24 is already routed via msltestdum" in proc.stderr
        assert not bridge_exists() and not (state_dir() / "state.json").exists()
    finally:
        subprocess.run(["ip", "link", "del", "msltestdum"], check=True)


def test_up_refuses_a_port_that_is_taken(env):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", int(PORT)))
        holder.listen()
        proc = labctl_run(env, "up", "--hosts", "1", "--no-wheelhouse")
    assert proc.returncode == 2
    assert f"TCP port {PORT}" in proc.stderr and "MODELSWAP_LAB_HUB_PORT" in proc.stderr
    assert not bridge_exists() and not (state_dir() / "state.json").exists()


def test_lifecycle_reuse_replace_refuse_and_teardown(env):
    proc = labctl_run(env, "up", "--hosts", "1", "--no-wheelhouse")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert labctl_run(env, "status").returncode == 0
    inventory = Path(env["MODELSWAP_LAB_INVENTORY"]).read_text()
    assert f"ansible_host: {SUBNET}.11" in inventory

    # A healthy lab is reused, not rebuilt.
    again = labctl_run(env, "up", "--hosts", "1", "--no-wheelhouse")
    assert again.returncode == 0 and "reusing the running lab" in again.stdout

    # A broken one (its host killed) is replaced.
    handle = labctl.Lab(name=NAME, subnet=SUBNET, hosts=["gpu1"])
    os.kill(labctl.nspawn_pid(handle, "gpu1"), signal.SIGKILL)
    replaced = labctl_run(env, "up", "--hosts", "1", "--no-wheelhouse")
    assert replaced.returncode == 0, replaced.stderr
    assert "replacing lab" in replaced.stdout and "host gpu1 is not running" in replaced.stdout
    assert labctl_run(env, "status").returncode == 0

    # The teardown refuses to delete a host tree that a process still uses...
    root = handle.root("gpu1")
    squatter = subprocess.Popen(["sleep", "120"], cwd=root)
    try:
        refused = labctl_run(env, "down")
        assert refused.returncode == 2
        assert f"PIDs [{squatter.pid}]" in refused.stderr
        assert (root / "etc" / "hostname").exists()     # nothing deleted
    finally:
        squatter.kill()
        squatter.wait()

    # ...and then removes everything the lab made.
    done = labctl_run(env, "down")
    assert done.returncode == 0, done.stderr
    assert not bridge_exists()
    assert not os.path.ismount(root) and not (state_dir() / "hosts").exists()
    assert not (state_dir() / "state.json").exists()
    assert not any(handle.cgroup(h).exists() for h in labctl.CGROUP_HIERARCHIES)
    assert not Path(env["MODELSWAP_LAB_INVENTORY"]).exists()
    assert labctl_run(env, "status").returncode == 1


def test_a_half_built_lab_is_cleaned_by_down(env, monkeypatch):
    for key in ("MODELSWAP_LAB", "MODELSWAP_LAB_SUBNET", "MODELSWAP_LAB_INVENTORY"):
        monkeypatch.setenv(key, env[key])
    monkeypatch.setattr(labctl, "HUB_PORT", int(PORT))
    monkeypatch.setattr(labctl, "INVENTORY", Path(env["MODELSWAP_LAB_INVENTORY"]))

    def broken_publish(lab):
        raise labctl.LabError("injected failure while publishing models")

    monkeypatch.setattr(labctl, "publish_models", broken_publish)
    handle = labctl.lab_from_env()
    with pytest.raises(labctl.LabError, match="injected failure"):
        labctl.up(handle, 1, with_wheelhouse=False)
    state = labctl.load_state(handle)
    assert state and bridge_exists() and labctl.nspawn_pid(handle, "gpu1")
    hub_pid, lb_pid = state["hub_pid"], state["lb_pid"]
    assert labctl.pid_alive(lb_pid, labctl.LB_CONFIG_NAME)

    labctl.down(labctl.lab_from_env())
    assert not bridge_exists() and not labctl.pid_alive(hub_pid) and not labctl.pid_alive(lb_pid)
    assert not os.path.ismount(handle.root("gpu1"))
    assert labctl.load_state(handle) is None
