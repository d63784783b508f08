"""modelswap.vllm.template renders what ansible.builtin.template's lookup renders (it is that
lookup) without deep-copying the task's variables first, and leaves them as they were. Run in a
fresh interpreter with the collection loader set up as ansible-playbook sets it up."""
import json
import subprocess
import sys

import pytest

from tests.support.modules import COLLECTIONS, REPO

pytestmark = pytest.mark.unit


PROBE = r"""
import copy, json, sys
from ansible.plugins.loader import init_plugin_loader
init_plugin_loader([sys.argv[1]])
from ansible.parsing.dataloader import DataLoader
from ansible.template import Templar, trust_as_template
folder = sys.argv[2]

class NoDeepCopy:
    # a value a deep copy of the variables cannot take (a large read costs time instead)
    def __deepcopy__(self, memo):
        raise RuntimeError("deep-copied")
    def __str__(self):
        return "shared"

variables = {"slot": {"unit": "vllm.service", "env": {"NCCL_DEBUG": "WARN", "B": "x y"}}, "port": 8000}
before = copy.deepcopy(variables)
templar = Templar(loader=DataLoader(), variables=variables)

def render(lookup, **options):
    args = ", ".join(f"{k}={v!r}" for k, v in options.items())
    expr = "{{ lookup('%s', '%s/unit.j2', template_vars={'extra': 'given'}%s) }}" % (lookup, folder, ", " + args if args else "")
    return templar.template(trust_as_template(expr))

out = {"builtin": render("ansible.builtin.template"), "ours": render("modelswap.vllm.template"),
       "builtin_opts": render("ansible.builtin.template", trim_blocks=False, variable_start_string="[[",
                              variable_end_string="]]"),
       "ours_opts": render("modelswap.vllm.template", trim_blocks=False, variable_start_string="[[",
                           variable_end_string="]]")}
out["unchanged"] = variables == before
variables["opaque"] = NoDeepCopy()
templar = Templar(loader=DataLoader(), variables=variables)
try:
    render("ansible.builtin.template")
    out["builtin_copies"] = False
except Exception as exc:
    out["builtin_copies"] = "deep-copied" in repr(exc) or "deep-copied" in str(exc.__cause__)
out["ours_shares"] = render("modelswap.vllm.template")
print(json.dumps(out))
"""

TEMPLATE = """{{ ansible_managed | comment }}
# unit {{ slot.unit }} on port {{ port }} ({{ extra }}) [[ port ]]
{% for line in slot.env | modelswap.vllm.systemd_env_lines %}
{{ line }}
{% endfor %}
{% include 'part.j2' %}
"""


def test_it_renders_what_the_builtin_renders_without_a_deep_copy(tmp_path):
    (tmp_path / "unit.j2").write_text(TEMPLATE)
    (tmp_path / "part.j2").write_text("included {{ slot.unit }}\n")
    proc = subprocess.run([sys.executable, "-c", PROBE, str(COLLECTIONS), str(tmp_path)], capture_output=True,
                          text=True, timeout=120, check=False, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["ours"] == out["builtin"] and out["ours_opts"] == out["builtin_opts"]
    assert "Ansible managed" in out["ours"] and "NCCL_DEBUG=\"WARN\"" in out["ours"] and "included vllm.service" in out["ours"]
    assert "(given)" in out["ours"] and "[[ port ]]" in out["ours"] and "8000" in out["ours_opts"]
    assert out["unchanged"]
    # the builtin deep-copies every variable; this lookup does not, and renders the same
    assert out["builtin_copies"] is True
    assert out["ours_shares"] == out["builtin"]
