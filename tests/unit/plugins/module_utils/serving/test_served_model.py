"""served_model (deployment record, vLLM ExecStart): plugins/module_utils/serving/served_model.py."""
from __future__ import annotations

import json

import pytest

from ansible_collections.modelswap.vllm.plugins.module_utils.common.command_runner import HostCommands
from ansible_collections.modelswap.vllm.plugins.module_utils.serving import served_model

pytestmark = pytest.mark.unit

SNAP = "/data/hf/hub/models--org--m/snapshots/" + "a" * 40


@pytest.mark.parametrize("value,model", [
    ("{ path=/opt/vllm/bin/vllm ; argv[]=/opt/vllm/bin/vllm serve %s --port 8000 --tensor-parallel-size 8 ; "
     "ignore_errors=no ; start_time=[n/a] ; stop_time=[n/a] ; pid=0 ; code=(null) ; status=0/0 }" % SNAP, SNAP),
    ("/opt/vllm/bin/vllm serve %s --served-model-name m" % SNAP, SNAP),
    ("-/opt/vllm/bin/python -m vllm.entrypoints.openai.api_server --model org/m --port 8000", "org/m"),
    ("/opt/vllm/bin/python -m vllm.entrypoints.openai.api_server --model=%s" % SNAP, SNAP),
    ("/opt/vllm/bin/python -m vllm.entrypoints.cli.main serve org/m", "org/m"),
    ("vllm serve --help", None),
    ("/usr/bin/sleep 100", None),
    ("", None),
])
def test_model_from_exec_start(value, model):
    assert served_model.model_from_argv(served_model.exec_start_argv(value)) == model


@pytest.mark.parametrize("argv,server", [
    (["/opt/vllm/bin/vllm", "serve", SNAP, "--port", "8000"], True),
    (["/opt/vllm/bin/python3", "/opt/vllm/bin/vllm", "serve", "org/m"], True),
    (["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "org/m"], True),
    (["/usr/bin/python3", "-m", "vllm.entrypoints.cli.main", "serve", "org/m"], True),
    (["/usr/bin/vim", "serve", "notes.txt"], False),
    (["/usr/bin/python3", "train.py", "--model", "org/m"], False),     # --model alone is no server
    (["/usr/bin/grep", "vllm", "serve"], False),
    ([], False),
])
def test_is_vllm_server(argv, server):
    assert served_model.is_vllm_server(argv) is server


def test_served_by_processes_resolves_local_folders_and_merges_workers():
    procs = [
        (40, ["/v/bin/vllm", "serve", "kimi", "--tensor-parallel-size", "8"], "/data/models"),
        (41, ["/v/bin/vllm", "serve", "kimi", "--tensor-parallel-size", "8"], "/data/models"),  # a forked worker
        (50, ["/v/bin/vllm", "serve", "org/m"], "/root"),          # a repo id: no such folder under /root
        (60, ["/v/bin/vllm", "serve", "./x"], None),               # working folder unreadable
        (70, ["/usr/bin/sleep", "100"], "/"),
    ]
    found = served_model.served_by_processes(procs, exists=lambda path: path == "/data/models/kimi")
    assert found == [{"pid": 40, "model": "/data/models/kimi"}, {"pid": 50, "model": "org/m"},
                     {"pid": 60, "model": "./x"}]


def test_unit_file_exec_start_with_continuation():
    text = "[Service]\nExecStartPre=/bin/true\nExecStart=/opt/vllm/bin/vllm serve \\\n  /models/m \\\n  --port 1\n"
    assert served_model.model_from_argv(served_model.exec_start_argv(served_model.exec_start_from_unit_file(text))) == "/models/m"


@pytest.mark.parametrize("show,expected", [
    ("LoadState=loaded\nActiveState=active\nExecStart={ path=/v ; argv[]=/v/vllm serve /m ; }\n",
     {"model": "/m", "active": True, "unit_state": "active"}),
    ("LoadState=loaded\nActiveState=inactive\nExecStart=\n", {"model": None, "active": False, "unit_state": "inactive"}),
    ("LoadState=not-found\nActiveState=inactive\nExecStart=\n", None),
])
def test_served_from_unit(show, expected):
    assert served_model.served_from_unit(served_model.parse_systemctl_show(show)) == expected


def fake_systemctl(rc: int, out: str, calls: list, installed: bool = True) -> HostCommands:
    """A HostCommands shaped like the real calls: which() finds systemctl, run() answers ``systemctl
    show`` with (rc, out, '') and notes each argv with the locale it ran under."""
    def run(argv, env):
        calls.append((argv, env))
        return rc, out, ""
    return HostCommands(run, lambda name: "/usr/bin/" + name if installed and name == "systemctl" else None)


SHOW_ACTIVE = "LoadState=loaded\nActiveState=active\nExecStart={ path=/v ; argv[]=/v/vllm serve /m ; }\n"
UNIT_FILE = "[Service]\nExecStart=/opt/vllm/bin/vllm serve /models/from-file \\\n  --port 8000\n"


# (id, systemctl installed, its rc, its output, unit file in the unit folder, expected)
READ_UNIT = [
    ("systemctl-loaded", True, 0, SHOW_ACTIVE, None, {"model": "/m", "active": True, "unit_state": "active"}),
    ("systemctl-not-found", True, 0, "LoadState=not-found\nActiveState=inactive\nExecStart=\n", UNIT_FILE, None),
    ("systemd-not-running-unit-file", True, 1, "", UNIT_FILE,
     {"model": "/models/from-file", "active": None, "unit_state": "unknown (systemd not running)"}),
    ("no-systemctl-unit-file", False, 0, SHOW_ACTIVE, UNIT_FILE,
     {"model": "/models/from-file", "active": None, "unit_state": "unknown (systemd not running)"}),
    ("no-systemctl-no-unit-file", False, 0, "", None, None),
]


@pytest.mark.parametrize("installed,rc,out,unit_file,expected", [r[1:] for r in READ_UNIT],
                         ids=[r[0] for r in READ_UNIT])
def test_read_unit(tmp_path, monkeypatch, installed, rc, out, unit_file, expected):
    monkeypatch.setattr(served_model, "UNIT_DIRS", (str(tmp_path / "none"), str(tmp_path)))
    if unit_file is not None:
        (tmp_path / "vllm.service").write_text(unit_file)
    calls = []
    assert served_model.read_unit(fake_systemctl(rc, out, calls, installed), "vllm.service") == expected
    if installed:   # one systemctl show, under the C locale its output is parsed in
        assert calls == [(["/usr/bin/systemctl", "show", "--property=LoadState,ActiveState,ExecStart", "--",
                           "vllm.service"], {"LANG": "C", "LC_ALL": "C"})]
    else:
        assert calls == []


def test_read_unit_without_a_unit_name_asks_nothing():
    calls = []
    assert served_model.read_unit(fake_systemctl(0, SHOW_ACTIVE, calls), "") is None
    assert calls == []


def test_read_unit_on_this_host_for_a_unit_that_does_not_exist():
    """The real runner: systemctl (running or not) or the unit folders know no such unit."""
    assert served_model.read_unit(HostCommands.local(), "modelswap-test-no-such-unit.service") is None


def test_deployment_record(tmp_path):
    path = tmp_path / "deployment.json"
    assert served_model.read_deployment_record(str(path)) is None
    path.write_text(json.dumps({"model": "m", "repo_id": "org/m", "commit": "a" * 40, "path": SNAP,
                                "previous": {"model": "old"}}))
    assert served_model.read_deployment_record(str(path)) == {"model": "m", "repo_id": "org/m", "commit": "a" * 40,
                                                              "path": SNAP}
    path.write_text("{broken")
    with pytest.raises(served_model.ServedError, match="not valid JSON"):
        served_model.read_deployment_record(str(path))
    path.write_text("{}")
    with pytest.raises(served_model.ServedError, match="names no model"):
        served_model.read_deployment_record(str(path))
    # model_fetch notes what it fetched before anything is deployed: nothing is served yet
    path.write_text(json.dumps({"fetched": {"m": {"repo_id": "org/m", "commit": "a" * 40}}}))
    assert served_model.read_deployment_record(str(path)) is None
