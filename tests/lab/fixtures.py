"""pytest fixtures for tests that run on the lab (`make lab-up`): hosts over SSH, the lab's Hub.

A missing lab skips these tests locally; under CI=true (and `make test`) tests/conftest.py turns
that skip into a failure.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from ansible_collections.modelswap.vllm.plugins.plugin_utils.runner import RunResult, run_playbook
from tests.lab import labctl

REPO = labctl.REPO

# Tests drive playbooks through the same ansible-runner interface that programs use.
PlaybookResult = RunResult


class Lab:
    def __init__(self, lab: labctl.Lab, state: dict):
        self._lab = lab
        self.state = state
        self.hosts = list(state["hosts"])
        self.inventory = labctl.INVENTORY
        self.hub_url = state["hub_url"]
        self.models = state.get("models", {})
        self.wheelhouse = state.get("wheelhouse")

    @property
    def api_key(self) -> str:
        """The lab's vLLM API key (inventory: vllm_service_api_key from this 0600 file)."""
        return (self._lab.state_dir / "api_key").read_text().strip()

    def address(self, host: str) -> str:
        return self._lab.address(host)

    @property
    def lb_url(self) -> str:
        """The load balancer's frontend (HAProxy on the bridge), where clients send requests."""
        return self._lab.lb_url

    @property
    def lb_stats_url(self) -> str:
        """HAProxy's stats page as CSV, which lb_pool reads (the inventory's lb_pool_haproxy_stats_url)."""
        return self._lab.lb_stats_url

    def lb_servers(self) -> dict[str, str]:
        """{server: HAProxy status} of the load balancer's backend (UP, DOWN, MAINT, ...)."""
        return labctl.lb_servers(self._lab)

    def lb_rows(self) -> dict[str, dict]:
        """{server: HAProxy's `show stat` row} (status, scur, lbtot, lastchg, ...)."""
        return labctl.lb_rows(self._lab)

    def lb_command(self, command: str) -> str:
        """One command on HAProxy's runtime API (tests set up states the role must meet)."""
        return labctl.lb_command(self._lab, command)

    def small_store(self, host: str, size: int) -> dict:
        """An empty model store of ``size`` bytes on ``host`` (labctl.small_store): path, size, free."""
        return labctl.small_store(self._lab, host, size)

    @property
    def hub(self):
        from tests.lab.hub.client import HubClient
        return HubClient(self.hub_url, self._lab.state_dir / "hub")

    def ssh(self, host: str, command: str, check: bool = True, timeout: float = 300
            ) -> subprocess.CompletedProcess:
        proc = subprocess.run(labctl.ssh_argv(self._lab, host) + [command], text=True,
                              capture_output=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"ssh {host} {command!r} exited {proc.returncode}:\n"
                                 f"{proc.stdout}\n{proc.stderr}")
        return proc

    def playbook(self, path: str | Path, extra_vars: dict | None = None, *, check: bool = False,
                 diff: bool = False, limit: str | None = None, tags: str | None = None,
                 inventory: str | Path | None = None, timeout: int = 1800) -> RunResult:
        return run_playbook(str(Path(path) if Path(path).is_absolute() else REPO / path),
                            str(inventory or self.inventory), extra_vars, check=check, diff=diff,
                            limit=limit, tags=tags, timeout=timeout)


@pytest.fixture(scope="session")
def lab() -> Lab:
    handle = labctl.lab_from_env()
    state = labctl.load_state(handle)
    if state is None:
        pytest.skip(f"lab '{handle.name}' is not up: run `make lab-up`")
    problems = labctl.healthy(handle, state)
    if problems:
        pytest.skip(f"lab '{handle.name}' is not healthy ({'; '.join(problems)}): run `make lab-up`")
    # The tests own the lab's state: whatever a demo, an earlier run or an interrupted one left
    # serving or configured on the hosts is stopped and removed before the first lab test.
    labctl.reset(handle, state)
    return Lab(handle, state)


def write_playbook(tmp_path: Path, plays: list[dict]) -> Path:
    """A throwaway playbook file for a test (YAML is a superset of JSON)."""
    path = tmp_path / "playbook.yml"
    path.write_text(json.dumps(plays, indent=2))
    return path
