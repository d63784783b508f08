# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0 (see galaxy.yml)
"""migrate_host_plan: one host's migration planned on the controller, registered by the caller,
and the host failed with the plan's refusal in the same task; in a preview, a host that keeps what
it serves is probed in the same task too (the documentation is plugins/modules/migrate_host_plan.py)."""
from __future__ import annotations

import time

from ansible.errors import AnsibleActionFail
from ansible.module_utils.parsing.convert_bool import boolean
from ansible.plugins.action import ActionBase
from ansible_collections.modelswap.vllm.plugins.module_utils.fleet import host_plan


class ActionModule(ActionBase):
    TRANSFERS_FILES = False
    _supports_check_mode = True
    _VALID_ARGS = frozenset(("target", "read", "expected", "settings", "probe", "settle", "lease"))

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        args = self._task.args
        read, expected, settings = args.get("read"), args.get("expected"), args.get("settings")
        if not isinstance(read, dict) or not isinstance(expected, dict) or not isinstance(settings, dict):
            raise AnsibleActionFail("migrate_host_plan: read, expected and settings must be dicts "
                                    "(migrate_read's result, vllm_service_expected, the plan's settings)")
        plan = host_plan.read_plan(args.get("target"), read, expected.get("files") or {}, settings)
        result.update(plan, changed=False, target=args.get("target"), settings=settings, expected=expected,
                      marks={"preflight": time.time()})
        if plan["failure"] is not None:
            return dict(result, failed=True, msg=plan["failure"]["msg"])
        todo, check = plan["todo"], self._play_context.check_mode
        # a preview proves what a host keeps; a run settles a host with nothing to do here: proved,
        # its lease given back, no further task (the rollout proves the others)
        nothing = not any(todo.get(step) for step in ("install", "purge", "fetch", "configure", "swap",
                                                      "record", "rejoin"))
        settle = not check and nothing and boolean(args.get("settle", False), strict=False)
        if (check and not todo["swap"] and boolean(args.get("probe", False), strict=False)) or settle:
            result["marks"]["swap"] = time.time()
            proved = self._execute_module(module_name="modelswap.vllm.vllm_ready", task_vars=task_vars,
                                          module_args=probe_args(expected.get("probe") or {}, todo["record"]))
            result["service"] = dict(result["service"], gates=proved.get("gates") or {})
            result["probe"] = proved
            if proved.get("warnings"):
                result.setdefault("warnings", []).extend(proved["warnings"])
            if proved.get("failed"):
                return dict(result, failed=True, msg=proved.get("msg", "vllm_ready failed"))
        if settle and args.get("lease"):
            released = self._execute_module(module_name="modelswap.vllm.host_lease", task_vars=task_vars,
                                            module_args=dict(args["lease"], state="released"))
            if released.get("failed"):
                return dict(result, failed=True, msg=released.get("msg", "host_lease failed"))
            result["settled"] = True
        return result


def probe_args(probe: dict, wait_for_start: bool) -> dict:
    """vllm_ready's options for a slot that keeps what it serves, as vllm_service's verify entry
    point sets them: a record that names another deployment means an interrupted run may have
    started this server moments ago, so it gets the start-up budget and checks."""
    args = {key: probe[key] for key in ("host", "port", "served_model_name", "api_key_file", "unit",
                                        "check_port_owner", "timeout", "poll_interval", "journal_lines")
            if key in probe}
    start = probe.get("start") or {}
    if wait_for_start:
        args.pop("timeout", None)
        if float(start.get("timeout") or 0) > 0:
            args["timeout"] = start["timeout"]
        args.update(model_path=start.get("model_path"), parallel_size=int(start.get("parallel_size") or 1),
                    enforce_eager=bool(start.get("enforce_eager")))
    return args
