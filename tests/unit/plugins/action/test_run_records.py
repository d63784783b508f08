"""run_records (an action plugin: the controller only): every host's run record written in one task,
as to_nice_json writes it, atomically, nothing written in check mode, bad input refused by name.
Run through ansible-playbook on localhost, as the migrate role runs it."""
import json
import os
import sys

import pytest

from ansible_collections.modelswap.vllm.plugins.plugin_utils import runner

pytestmark = pytest.mark.unit

PLAY = """
- name: Write records
  hosts: localhost
  gather_facts: false
  tasks:
    - name: Write them
      modelswap.vllm.run_records:
        dir: "{{ folder }}"
        records: "{{ records }}"
    - name: The same records as the copy module would write one
      ansible.builtin.copy:
        content: "{{ records['gpu1'] | to_nice_json }}\\n"
        dest: "{{ folder }}.copy.json"
        mode: "0644"
      when: not ansible_check_mode
"""
RECORDS = {"gpu1": {"host": "gpu1", "target": "tiny-b", "steps": [{"step": "swap", "text": "nothing to do ü"}],
                    "ok": True, "free_bytes": 12, "ratio": 0.5},
           "gpu-2.example:22": {"host": "gpu-2", "failure": None}}


def play(tmp_path, folder, records, check=False):
    (tmp_path / "play.yml").write_text(PLAY)
    (tmp_path / "hosts.yml").write_text(json.dumps({"all": {"hosts": {"localhost": {
        "ansible_connection": "local", "ansible_python_interpreter": sys.executable}}}}))
    return runner.run_playbook(str(tmp_path / "play.yml"), str(tmp_path / "hosts.yml"),
                               {"folder": str(folder), "records": records}, check=check)


def test_every_record_is_written_as_to_nice_json_writes_it(tmp_path):
    folder = tmp_path / "results" / "run-1"
    result = play(tmp_path, folder, RECORDS)
    assert result.ok, result.stdout[-3000:]
    out = result.task_results("Write them", "localhost")[0]
    assert out["changed"] is False and sorted(out["written"]) == sorted(RECORDS)
    assert json.loads((folder / "gpu1.json").read_text()) == RECORDS["gpu1"]
    assert json.loads((folder / "gpu-2.example:22.json").read_text()) == RECORDS["gpu-2.example:22"]
    assert (folder / "gpu1.json").read_text() == (tmp_path / "results" / "run-1.copy.json").read_text()
    assert oct((folder / "gpu1.json").stat().st_mode & 0o777) == oct(0o644)
    assert sorted(os.listdir(folder)) == ["gpu-2.example:22.json", "gpu1.json"]  # no temporary file left


def test_a_file_that_holds_the_record_is_left_alone(tmp_path):
    folder = tmp_path / "run"
    assert play(tmp_path, folder, RECORDS).ok
    before = (folder / "gpu1.json").stat().st_mtime_ns
    changed = dict(RECORDS, **{"gpu-2.example:22": {"host": "gpu-2", "failure": "stopped"}})
    out = play(tmp_path, folder, changed).task_results("Write them", "localhost")[0]
    assert out["written"] == ["gpu-2.example:22"]
    assert (folder / "gpu1.json").stat().st_mtime_ns == before
    assert json.loads((folder / "gpu-2.example:22.json").read_text())["failure"] == "stopped"


def test_check_mode_writes_nothing_and_says_where(tmp_path):
    folder = tmp_path / "run"
    out = play(tmp_path, folder, RECORDS, check=True).task_results("Write them", "localhost")[0]
    assert out["paths"]["gpu1"] == str(folder / "gpu1.json") and "written" not in out
    assert not folder.exists()


@pytest.mark.parametrize("folder, records, message", [
    ("relative/run", RECORDS, "dir must be an absolute path"),
    (None, ["gpu1"], "records must be a dict of host name to its run record"),
    (None, {"gpu1": "text"}, "records must be a dict of host name to its run record"),
    (None, {"../etc/passwd": {}, ".hidden": {}}, "host names that cannot name a file"),
])
def test_bad_input_is_refused_by_name_and_nothing_is_written(tmp_path, folder, records, message):
    target = tmp_path / "run"
    result = play(tmp_path, folder or target, records)
    assert not result.ok
    assert message in json.dumps(result.failures())
    assert not target.exists()
