"""The vllm_service role's files: argument specs mirror the defaults, every default is commented,
the filters turn rendering errors into Ansible errors."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ansible.errors import AnsibleFilterError

from ansible_collections.modelswap.vllm.plugins.filter.vllm_service import FilterModule
from tests.support.role_files import role_defaults

pytestmark = pytest.mark.unit

ROLE = Path(__file__).resolve().parents[3] / "roles" / "vllm_service"


def test_argument_specs_mirror_the_defaults():
    defaults = role_defaults("vllm_service")  # its own, and its inputs the shared defaults define
    specs = yaml.safe_load((ROLE / "meta" / "argument_specs.yml").read_text())["argument_specs"]["main"]["options"]
    assert set(defaults) == set(specs)
    for name, spec in specs.items():
        assert spec.get("description"), name
        if "default" in spec:
            assert spec["default"] == defaults[name], name
        else:   # a default templated from a fleet-wide variable: described, not repeated
            assert "{{" in str(defaults[name]), name
    assert specs["vllm_service_api_key"].get("no_log") is True
    assert not [v for v in defaults if not v.startswith("vllm_service_")]


def test_every_default_is_commented():
    lines = (ROLE / "defaults" / "main.yml").read_text().splitlines()
    for i, line in enumerate(lines):
        if line and not line[0].isspace() and not line.startswith(("#", "---")):
            assert lines[i - 1].startswith("#") and not lines[i - 1].startswith("# ---"), line


def test_filters():
    filters = FilterModule().filters()
    argv = filters["vllm_serve_argv"]({"tensor_parallel_size": 2}, "/v/bin/vllm", "/m", "m", "0.0.0.0", 8000)
    assert argv[-2:] == ["--tensor-parallel-size", "2"]
    assert filters["systemd_exec"](["/v/bin/vllm", "a b"]) == '/v/bin/vllm "a b"'
    assert filters["vllm_parallel_size"]({"tensor_parallel_size": 2, "data_parallel_size": 2}) == 4
    assert filters["systemd_env_lines"]({"B": 1, "A": "x"}) == ['A="x"', 'B="1"']
    assert filters["merge_env"]({"A": 1}, {"A": None, "B": 2}) == {"B": 2}
    assert filters["vllm_argv_settings"](argv)["parallel"] == 2
    with pytest.raises(AnsibleFilterError, match="vllm_args.api_key is not allowed"):
        filters["vllm_serve_argv"]({"api_key": "k"}, "/v", "/m", "m", "h", 1)
