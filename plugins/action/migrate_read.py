# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0 (see galaxy.yml)
"""migrate_read: one host's read for the migration in one task (the documentation is
plugins/modules/migrate_read.py). Ansible's cost is per task and host, so the preview's one
touch of a host runs the refusals, the lease, migrate_info and gpu_ready here, in order."""
from __future__ import annotations

from ansible.errors import AnsibleActionFail
from ansible.plugins.action import ActionBase
from ansible_collections.modelswap.vllm.plugins.module_utils.common import catalog
from ansible_collections.modelswap.vllm.plugins.module_utils.serving import vllm_service_settings

# where deployment_record leaves an interrupted write's staged copies, under the slot's saved_dir
STAGED_RECORD = "/.staged/for.json"


def read_args(info: dict, layout: dict, secret_sha1: str, extra_paths: list) -> dict:
    """migrate_info's arguments: the caller's (listing, store, purge, fetch) and the slot's from
    its layout (what vllm_service_info and the config check read)."""
    read = layout["read"]
    service = {key: read[key] for key in ("unit", "replaces", "port", "record_path", "cache_dir", "verification")}
    if read.get("snapshot_path"):
        service["snapshot_path"] = read["snapshot_path"]
    service["paths"] = list(layout["saved_files"]) + list(extra_paths) + [layout["saved_dir"] + STAGED_RECORD]
    return dict(info, service=service,
                install={"venv": layout["install"]["venv"], "expected": layout["install"]["fingerprint"]},
                config={"files": layout["config_files"], "secret_path": layout["secret_path"],
                        "secret_sha1": secret_sha1})


class ActionModule(ActionBase):
    TRANSFERS_FILES = False
    _supports_check_mode = True
    _VALID_ARGS = frozenset(("layout_inputs", "secret_sha1", "info", "extra_paths", "lease", "gpus",
                             "gpus_python"))

    def _module(self, name, args, task_vars, result):
        """One module's result; its warnings (a lease taken over, say) are the task's."""
        out = self._execute_module(module_name="modelswap.vllm." + name, module_args=args, task_vars=task_vars)
        result.setdefault("warnings", []).extend(out.pop("warnings", None) or [])
        return out

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        args = self._task.args
        info = args.get("info")
        if not isinstance(info, dict) or not isinstance(info.get("store"), dict):
            raise AnsibleActionFail("migrate_read: info must be migrate_info's arguments (a dict with store)")
        layout = vllm_service_settings.layout(args.get("layout_inputs") or {})
        store = info["store"]
        # the catalog's and the slot settings' refusals (a replica group's too), before the host is reached
        problems = (catalog.target_refusals(store.get("models") or {}, store.get("target"), store.get("keep") or [])
                    or layout["problems"])
        result.update(changed=False, layout=layout)
        if problems:
            return dict(result, failed=True, msg=problems[0], refusals=problems)
        # the lease comes first, in the same module run (one SSH round trip less per host): a plan
        # read while another run changes the host would be stale
        read_with = read_args(info, layout, args.get("secret_sha1") or "", args.get("extra_paths") or [])
        if args.get("lease"):
            read_with["lease"] = args["lease"]
        read = self._module("migrate_info", read_with, task_vars, result)
        result.update({k: v for k, v in read.items() if k != "changed"})
        if read.get("failed"):
            return result
        gpus = {"skipped": True}
        if args.get("gpus") is not None:
            # nvidia-ml-py comes with vLLM: its virtualenv's Python reads the GPUs once it exists
            python = (layout["install"]["venv"] + "/bin/python" if (read.get("install") or {}).get("exists")
                      else args.get("gpus_python") or "auto_silent")
            gpus = self._module("gpu_ready", args["gpus"], dict(task_vars, ansible_python_interpreter=python), result)
            if gpus.get("failed"):
                result.update(failed=True, msg=gpus.get("msg", "gpu_ready failed"))
        result["gpus"] = gpus
        return result
