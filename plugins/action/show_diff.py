# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0 (see galaxy.yml)
"""show_diff: diff entries made on the controller, handed to Ansible's --diff output (no host
is reached; the documentation is plugins/modules/show_diff.py)."""
from __future__ import annotations

from ansible.errors import AnsibleActionFail
from ansible.plugins.action import ActionBase

KEYS = frozenset(("before_header", "after_header", "before", "after", "prepared"))


class ActionModule(ActionBase):
    TRANSFERS_FILES = False
    _requires_connection = False
    _supports_check_mode = True
    _VALID_ARGS = frozenset(("diffs",))

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        diffs = self._task.args.get("diffs")
        if not isinstance(diffs, list) or not all(isinstance(d, dict) and d and set(d) <= KEYS for d in diffs):
            raise AnsibleActionFail("show_diff: diffs must be a list of diff entries (dicts with before_header, "
                                    "after_header, before, after or prepared); got %r" % (type(diffs).__name__,))
        result.update(changed=bool(diffs), diff=diffs)
        return result
