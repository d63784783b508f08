"""Run a modelswap module the way Ansible does on a host, without a host.

The module file is executed as a script with ANSIBLE_MODULE_ARGS (what AnsibleModule reads),
with `ansible_collections.modelswap.vllm` resolvable through the repo's .collections link, so
the import paths are exactly the ones an installed collection uses.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Where `ansible_collections.modelswap.vllm` imports from: the repo's .collections link, or the
# folder above ansible_collections/ when this runs from an installed collection (ansible-test units).
COLLECTIONS = REPO / ".collections" if (REPO / ".collections").is_dir() else REPO.parents[2]


def run_module(name: str, args: dict | None = None, *, check_mode: bool = False,
               diff: bool = False, env: dict | None = None, timeout: float = 600) -> dict:
    """Run plugins/modules/<name>.py with `args`; return its JSON result (failed results included)."""
    payload = dict(args or {})
    payload["_ansible_check_mode"] = check_mode
    payload["_ansible_diff"] = diff
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump({"ANSIBLE_MODULE_ARGS": payload}, fh)
        args_file = fh.name
    run_env = dict(os.environ)
    run_env["PYTHONPATH"] = os.pathsep.join([str(COLLECTIONS), run_env.get("PYTHONPATH", "")])
    run_env.update(env or {})
    try:
        proc = subprocess.run([sys.executable, str(REPO / "plugins" / "modules" / f"{name}.py"), args_file],
                              capture_output=True, text=True, env=run_env, timeout=timeout)
    finally:
        os.unlink(args_file)
    try:
        result = json.loads(proc.stdout)
    except json.JSONDecodeError as exc:
        raise AssertionError(f"module {name} printed no JSON (rc={proc.returncode}):\n"
                             f"stdout: {proc.stdout}\nstderr: {proc.stderr}") from exc
    result.setdefault("rc_", proc.returncode)
    return result


def build_collection(out: Path) -> Path:
    """``ansible-galaxy collection build`` of this repository into ``out``; the tarball's path."""
    subprocess.run([Path(sys.executable).parent / "ansible-galaxy", "collection", "build", "--force", "--output-path", out, "."],
                   cwd=REPO, check=True, capture_output=True)
    return next(out.glob("modelswap-vllm-*.tar.gz"))
