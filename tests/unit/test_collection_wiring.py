"""The repo resolves as the collection modelswap.vllm (docs/architecture.md: the collection, here and installed)."""
import platform

import pytest

from tests.support.modules import REPO, run_module

pytestmark = pytest.mark.unit


def test_plugins_link_to_library_and_module_utils():
    assert (REPO / "plugins" / "modules").resolve() == REPO / "library"
    assert (REPO / "plugins" / "module_utils").resolve() == REPO / "module_utils"
    assert (REPO / ".collections" / "ansible_collections" / "modelswap" / "vllm").resolve() == REPO


def test_trivial_module_imports_its_helper_by_collection_path():
    result = run_module("modelswap_info")
    assert result.get("failed") is not True, result
    assert result["collection"] == "modelswap.vllm"
    assert result["python"] == platform.python_version()
