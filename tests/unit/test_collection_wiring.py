"""The repo resolves as the collection modelswap.vllm (docs/architecture.md: the collection, here and installed)."""
import platform

import pytest

from tests.support.modules import REPO, run_module

pytestmark = [pytest.mark.unit, pytest.mark.repo]


def test_the_code_lives_in_plugins_and_the_top_level_links_point_there():
    for folder in ("modules", "module_utils"):
        assert (REPO / "plugins" / folder).is_dir() and not (REPO / "plugins" / folder).is_symlink()
    # the playbook-adjacent names an ad-hoc `ansible -m` run and ansible.cfg use
    assert (REPO / "library").resolve() == REPO / "plugins" / "modules"
    assert (REPO / "module_utils").resolve() == REPO / "plugins" / "module_utils"
    assert (REPO / ".collections" / "ansible_collections" / "modelswap" / "vllm").resolve() == REPO


def test_trivial_module_imports_its_helper_by_collection_path():
    result = run_module("modelswap_info")
    assert result.get("failed") is not True, result
    assert result["collection"] == "modelswap.vllm"
    assert result["python"] == platform.python_version()
