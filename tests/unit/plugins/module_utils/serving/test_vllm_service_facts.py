"""vllm_service_facts' logic without the module: unit and vLLM facts read through a HostCommands
built from plain functions shaped like systemctl's output and a virtualenv's python, the port's
listeners, and the options and record errors the module fails with."""
from __future__ import annotations

import json
import stat

import pytest

from ansible_collections.modelswap.vllm.plugins.module_utils.common.command_runner import HostCommands
from ansible_collections.modelswap.vllm.plugins.module_utils.serving import vllm_service_facts

pytestmark = pytest.mark.unit

SNAPSHOT = "/var/lib/modelswap/hf/hub/models--lab--tiny-a/snapshots/" + "0a" * 20
SHOW_LOADED = """LoadState=loaded
ActiveState=active
SubState=running
MainPID=812
NRestarts=2
FragmentPath=/etc/systemd/system/vllm.service
ExecStart={ path=/opt/venv/bin/vllm ; argv[]=/opt/venv/bin/vllm serve %s --port 8000 ; ignore_errors=no ; \
start_time=[n/a] ; stop_time=[n/a] ; pid=0 ; code=(null) ; status=0/0 }
ControlGroup=/system.slice/vllm.service
UnitFileState=enabled
""" % SNAPSHOT
OLD_SNAPSHOT = "/var/lib/modelswap/hf/hub/models--lab--tiny-b/snapshots/" + "0b" * 20
SHOW_NOT_FOUND = """LoadState=not-found
ActiveState=inactive
SubState=dead
MainPID=0
NRestarts=[not set]
FragmentPath=
ExecStart=
ControlGroup=
UnitFileState=
"""


def commands(answers, installed=("systemctl",), calls=None):
    """A HostCommands whose run answers by the argv's first word (its basename)."""
    def run(argv, env):
        if calls is not None:
            calls.append((argv, env))
        return answers[argv[0].rsplit("/", 1)[-1]]
    return HostCommands(run, lambda name: "/usr/bin/" + name if name in installed else None)


@pytest.mark.parametrize("answer, installed, expected", [
    ((0, SHOW_LOADED, ""), ("systemctl",),
     {"loaded": True, "active_state": "active", "sub_state": "running", "main_pid": 812, "n_restarts": 2,
      "fragment_path": "/etc/systemd/system/vllm.service", "unit_file_state": "enabled", "model": SNAPSHOT,
      "need_daemon_reload": False, "running_model": OLD_SNAPSHOT}),
    ((0, SHOW_LOADED + "NeedDaemonReload=yes\n", ""), ("systemctl",),
     {"loaded": True, "active_state": "active", "sub_state": "running", "main_pid": 812, "n_restarts": 2,
      "fragment_path": "/etc/systemd/system/vllm.service", "unit_file_state": "enabled", "model": SNAPSHOT,
      "need_daemon_reload": True, "running_model": OLD_SNAPSHOT}),
    ((0, SHOW_NOT_FOUND, ""), ("systemctl",),
     {"loaded": False, "active_state": "inactive", "sub_state": "dead", "main_pid": 0, "n_restarts": 0,
      "fragment_path": None, "unit_file_state": None, "model": None, "need_daemon_reload": False,
      "running_model": None}),
    ((1, "", "System has not been booted with systemd as init system (PID 1). Can't operate.\n"), ("systemctl",),
     dict(vllm_service_facts.NO_UNIT,
          reason="System has not been booted with systemd as init system (PID 1). Can't operate.")),
    ((1, "out only\n", ""), ("systemctl",), dict(vllm_service_facts.NO_UNIT, reason="out only")),
    (None, (), dict(vllm_service_facts.NO_UNIT, reason="systemctl not found")),
])
def test_unit_facts(answer, installed, expected, tmp_path):
    """``running_model`` is read from the main process's command line (a /proc of the test's own:
    PID 812 was started with the old snapshot, whatever the unit file says now)."""
    (tmp_path / "812").mkdir()
    (tmp_path / "812" / "cmdline").write_bytes(b"\0".join(
        [b"/opt/venv/bin/python", b"/opt/venv/bin/vllm", b"serve", OLD_SNAPSHOT.encode(), b"--port", b"8000", b""]))
    calls = []
    got = vllm_service_facts.unit_facts(commands({"systemctl": answer}, installed, calls), "vllm.service",
                                        proc_root=str(tmp_path))
    assert got == expected
    if installed:
        assert calls == [(["/usr/bin/systemctl", "show", "--property=LoadState,ActiveState,SubState,MainPID,"
                           "NRestarts,FragmentPath,ExecStart,ControlGroup,UnitFileState,NeedDaemonReload",
                           "--", "vllm.service"], {"LANG": "C", "LC_ALL": "C"})]


@pytest.mark.parametrize("cmdline, expected", [
    (b"/opt/venv/bin/python\0/opt/venv/bin/vllm\0serve\0/m/a\0--port\0" b"8000\0", "/m/a"),
    (b"/usr/sbin/sshd\0-D\0", None),                     # not vLLM
    (None, None),                                         # the process is gone
])
def test_the_running_process_says_what_it_serves(cmdline, expected, tmp_path):
    if cmdline is not None:
        (tmp_path / "4242").mkdir()
        (tmp_path / "4242" / "cmdline").write_bytes(cmdline)
    assert vllm_service_facts.process_model(4242, str(tmp_path)) == expected
    assert vllm_service_facts.process_model(0, str(tmp_path)) is None


def executable(path, text="#!/bin/sh\nexit 0\n"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.mark.parametrize("answer, version", [
    ((0, "some warning\n0.32.0+cpu\n", ""), "0.32.0+cpu"),    # the last line is the version
    ((0, "  \n", ""), None),
    ((1, "", "PackageNotFoundError: vllm"), None),
])
def test_vllm_facts_asks_the_virtualenvs_python(tmp_path, answer, version):
    venv = tmp_path / "venv"
    executable(venv / "bin" / "python")
    executable(venv / "bin" / "vllm")
    calls = []
    out = vllm_service_facts.vllm_facts(commands({"python": answer}, calls=calls), str(venv), None)
    assert out == {"binary": str(venv / "bin" / "vllm"), "exists": True, "python": str(venv / "bin" / "python"),
                   "version": version}
    assert calls == [([str(venv / "bin" / "python"), "-c", vllm_service_facts.VERSION_SNIPPET],
                      {"LANG": "C", "LC_ALL": "C"})]


def test_vllm_facts_of_a_binary_finds_its_python_and_runs_nothing_without_one(tmp_path):
    binary = executable(tmp_path / "saved" / "bin" / "vllm")
    out = vllm_service_facts.vllm_facts(commands({}), None, str(binary))
    assert out == {"binary": str(binary), "exists": True, "python": str(tmp_path / "saved" / "bin" / "python"),
                   "version": None}
    missing = vllm_service_facts.vllm_facts(commands({}), str(tmp_path / "novenv"), None)
    assert missing["exists"] is False and missing["version"] is None


def test_port_facts_marks_listeners_outside_the_units():
    own = {"pid": 812, "user": "vllm", "unit": "vllm.service", "address": "0.0.0.0", "name": "vllm",
           "cmdline": "/opt/venv/bin/vllm serve"}
    handmade = dict(own, pid=700, unit="vllm-old.service")
    stray = dict(own, pid=900, unit="session-1.scope", cmdline=None)
    out = vllm_service_facts.port_facts(8000, "vllm.service", ["vllm-old.service"],
                                        listeners_on=lambda port: [own, handmade, stray])
    assert out["port"] == 8000 and len(out["listeners"]) == 3
    assert out["foreign"] == [stray]
    assert stray["text"] == "pid 900, user vllm, unit session-1.scope"
    assert own["text"] == "pid 812, user vllm, unit vllm.service: /opt/venv/bin/vllm serve"


def params(**overrides):
    base = dict(unit="vllm.service", replaces=[], port=None, record_path="/nonexistent/deployment.json",
                model=None, snapshot_path=None, cache_dir=None, verification="full", venv=None, binary=None,
                paths=[])
    base.update(overrides)
    return base


def test_gather_without_a_record_or_systemd(tmp_path):
    present = tmp_path / "vllm.env"
    present.write_text("")
    result = vllm_service_facts.gather(
        params(replaces=["old.service"], paths=[str(present), str(tmp_path / "gone")]), commands({}, installed=()))
    assert result["changed"] is False and result["record"] is None and result["deployment"] is None
    assert result["unit"]["reason"] == "systemctl not found"
    assert result["replaces"] == [dict(vllm_service_facts.NO_UNIT, reason="systemctl not found", unit="old.service")]
    assert result["files"] == {str(present): True, str(tmp_path / "gone"): False}
    assert not {"port", "snapshot", "vllm"} & set(result)


def test_gather_reads_the_record(tmp_path):
    record = tmp_path / "deployment.json"
    record.write_text(json.dumps({"model": "tiny-b", "path": "/p", "previous": {"model": "tiny-a"}}))
    result = vllm_service_facts.gather(params(record_path=str(record), port=8000), commands({}, installed=()),
                                       listeners_on=lambda port: [])
    assert result["deployment"]["model"] == "tiny-b" and result["previous"] == {"model": "tiny-a"}
    assert result["port"] == {"port": 8000, "listeners": [], "foreign": []}


def test_gather_fails_on_bad_options_and_a_broken_record(tmp_path):
    with pytest.raises(vllm_service_facts.FactsError, match="^vllm_service_info: unit 'vllm service' is not a "
                                                            "systemd unit name"):
        vllm_service_facts.gather(params(unit="vllm service"), commands({}))
    broken = tmp_path / "deployment.json"
    broken.write_text("{")
    with pytest.raises(vllm_service_facts.FactsError, match="^vllm_service_info: .*not valid JSON"):
        vllm_service_facts.gather(params(record_path=str(broken)), commands({}))
