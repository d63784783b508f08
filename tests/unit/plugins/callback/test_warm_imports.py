"""warm_imports (a callback, in ansible-playbook's own process): once it has run, Ansible's plugin
loaders find every action and filter plugin of the collection, and the module_utils they import,
already imported under the names they look up: a forked worker compiles none of them again.
Run in a fresh interpreter with the collection loader set up as ansible-playbook sets it up."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[4]
# where ansible_collections/modelswap/vllm lives: the repo's .collections link, or the tree that
# ansible-test runs the collection's units in
COLLECTIONS = (REPO.parents[2] if REPO.parent.name == "modelswap" and REPO.parents[1].name == "ansible_collections"
               else REPO / ".collections")

PROBE = r"""
import json, sys
from ansible.plugins.loader import init_plugin_loader, callback_loader, action_loader, filter_loader
init_plugin_loader([sys.argv[1]])
ours = lambda: {m for m in sys.modules if m.startswith("ansible_collections.modelswap.")}
before = ours()
cb = callback_loader.get("modelswap.vllm.warm_imports")
warmed = ours()
# what a worker looks up: each action plugin, and one filter of each filter file
actions = [action_loader.get("modelswap.vllm." + n, class_only=True) for n in sys.argv[2].split(",")]
filters = [filter_loader.get("modelswap.vllm." + n) for n in sys.argv[3].split(",")]
print(json.dumps({"before": sorted(before), "warmed": sorted(warmed), "after": sorted(ours()),
                  "imported": cb.imported, "failed": cb.failed,
                  "loaded": all(actions) and all(filters)}))
"""


def probe(filters):
    actions = sorted(p.stem for p in (REPO / "plugins" / "action").glob("*.py") if p.stem != "__init__")
    proc = subprocess.run([sys.executable, "-c", PROBE, str(COLLECTIONS), ",".join(actions), ",".join(filters)],
                          capture_output=True, text=True, timeout=120, check=False, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), actions


def test_the_loaders_find_every_plugin_already_imported():
    # one filter per filter file (the loader imports the whole file for one of its filters)
    out, actions = probe(["vllm_serve_argv", "catalog_entry", "migrate_fleet", "migrate_plan",
                          "fleet_status_served", "lb_pool_read_failure"])
    assert out["loaded"] and not out["failed"]
    assert not [m for m in out["before"] if ".plugins.action." in m or ".plugins.filter." in m]
    for name in actions:
        assert f"ansible_collections.modelswap.vllm.plugins.action.{name}" in out["imported"]
    assert {m.rsplit(".", 1)[1] for m in out["imported"] if ".filter." in m} == {
        p.stem for p in (REPO / "plugins" / "filter").glob("*.py")}
    assert any(".plugins.module_utils." in m for m in out["warmed"])
    # nothing of the collection was imported anew when the loaders looked the plugins up
    assert set(out["after"]) - set(out["warmed"]) == set()
