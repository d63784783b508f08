"""pytest fixtures for tests that run on the lab (`make lab-up`): hosts over SSH, the lab's Hub.

A missing lab skips these tests locally; under CI=true (and `make test`) tests/conftest.py turns
that skip into a failure.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.lab import labctl

REPO = labctl.REPO
# ansible-runner starts `ansible-playbook` by name: the one beside this interpreter (the venv's).
os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])


@dataclass
class PlaybookResult:
    rc: int
    status: str
    stats: dict
    events: list
    stdout: str

    def task_results(self, task_name: str, host: str | None = None) -> list[dict]:
        """Module results of a task (by name) from the runner's events, optionally for one host."""
        found = []
        for ev in self.events:
            data = ev.get("event_data", {})
            if ev.get("event") in ("runner_on_ok", "runner_on_failed", "runner_on_skipped") \
                    and data.get("task") == task_name and (host is None or data.get("host") == host):
                found.append(dict(data.get("res", {}), _event=ev["event"], _host=data.get("host")))
        return found

    def changed(self, host: str) -> int:
        return self.stats.get("changed", {}).get(host, 0)

    def failed(self, host: str) -> int:
        return self.stats.get("failures", {}).get(host, 0)


class Lab:
    def __init__(self, lab: labctl.Lab, state: dict):
        self._lab = lab
        self.state = state
        self.hosts = list(state["hosts"])
        self.inventory = REPO / "inventory" / "lab" / "hosts.yml"
        self.hub_url = state["hub_url"]
        self.models = state.get("models", {})
        self.wheelhouse = state.get("wheelhouse")

    def address(self, host: str) -> str:
        return self._lab.address(host)

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
                 inventory: str | Path | None = None, timeout: int = 1800) -> PlaybookResult:
        import ansible_runner

        cmdline = []
        if check:
            cmdline.append("--check")
        if diff:
            cmdline.append("--diff")
        with tempfile.TemporaryDirectory(prefix="modelswap-runner-") as pdd:
            run = ansible_runner.run(
                private_data_dir=pdd, project_dir=str(REPO),
                playbook=str(Path(path) if Path(path).is_absolute() else REPO / path),
                inventory=str(inventory or self.inventory), extravars=extra_vars or {},
                limit=limit, tags=tags, cmdline=" ".join(cmdline) or None, quiet=True,
                # ansible-runner turns host key checking off unless told: keep ansible.cfg's.
                envvars={"ANSIBLE_CONFIG": str(REPO / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1",
                         "ANSIBLE_HOST_KEY_CHECKING": "True"},
                timeout=timeout)
            # The artifacts live in the temporary folder: read everything before it goes.
            return PlaybookResult(rc=run.rc, status=run.status, stats=run.stats or {},
                                  events=list(run.events), stdout=run.stdout.read())


@pytest.fixture(scope="session")
def lab() -> Lab:
    handle = labctl.lab_from_env()
    state = labctl.load_state(handle)
    if state is None:
        pytest.skip(f"lab '{handle.name}' is not up: run `make lab-up`")
    problems = labctl.healthy(handle, state)
    if problems:
        pytest.skip(f"lab '{handle.name}' is not healthy ({'; '.join(problems)}): run `make lab-up`")
    return Lab(handle, state)


def write_playbook(tmp_path: Path, plays: list[dict]) -> Path:
    """A throwaway playbook file for a test (YAML is a superset of JSON)."""
    path = tmp_path / "playbook.yml"
    path.write_text(json.dumps(plays, indent=2))
    return path
