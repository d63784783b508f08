"""show_diff (an action plugin: the controller only): the preview's diffs reach Ansible's --diff
output as a file module's would, and bad input is refused by name. Run through ansible-playbook
on localhost, as a role would run it."""
import json
import sys

import pytest

from ansible_collections.modelswap.vllm.plugins.plugin_utils import runner

pytestmark = pytest.mark.unit

PLAY = """
- name: Show diffs
  hosts: localhost
  gather_facts: false
  tasks:
    - name: Show them
      modelswap.vllm.show_diff:
        diffs: "{{ diffs }}"
"""
UNIT = {"before_header": "/etc/systemd/system/vllm.service", "after_header": "/etc/systemd/system/vllm.service",
        "before": "ExecStart=vllm serve old\n", "after": "ExecStart=vllm serve new\n"}
KEY = {"prepared": "/etc/modelswap/vllm.secret.env: the content would change (a secret file: not shown)\n"}


def play(tmp_path, diffs):
    (tmp_path / "play.yml").write_text(PLAY)
    (tmp_path / "hosts.yml").write_text(json.dumps({"all": {"hosts": {"localhost": {
        "ansible_connection": "local", "ansible_python_interpreter": sys.executable}}}}))
    return runner.run_playbook(str(tmp_path / "play.yml"), str(tmp_path / "hosts.yml"), {"diffs": diffs},
                               check=True, diff=True)


def test_the_diffs_are_shown_and_count_as_a_change(tmp_path):
    result = play(tmp_path, [UNIT, KEY])
    assert result.ok, result.stdout[-3000:]
    shown = result.task_results("Show them", "localhost")[0]
    assert shown["changed"] is True and shown["diff"] == [UNIT, KEY]
    assert "-ExecStart=vllm serve old" in result.stdout and "+ExecStart=vllm serve new" in result.stdout
    assert "a secret file: not shown" in result.stdout


def test_no_diff_is_no_change(tmp_path):
    result = play(tmp_path, [])
    assert result.ok and result.task_results("Show them", "localhost")[0]["changed"] is False


def test_what_is_not_a_diff_entry_is_refused_by_name(tmp_path):
    result = play(tmp_path, [{"text": "x"}])
    assert not result.ok
    assert "diffs must be a list of diff entries" in json.dumps(result.failures())
