# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0 (see galaxy.yml)
"""run_records: the run records of many hosts written as JSON files on the controller, in one task
(no host is reached; the documentation is plugins/modules/run_records.py). A copy task per host
costs two module runs each (stat, then copy): a thousand for a rerun of 500 hosts."""
from __future__ import annotations

import json
import os
import re

from ansible.errors import AnsibleActionFail
from ansible.module_utils.common.json import get_encoder
from ansible.plugins.action import ActionBase
from ansible_collections.modelswap.vllm.plugins.module_utils.common import fsutil

# an inventory host name as a file name: no folder, nothing hidden
HOST_FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:@-]*$")


def record_text(record) -> str:
    """The record as the to_nice_json filter writes it (the run's other records are written so)."""
    return json.dumps(record, cls=get_encoder("tagless"), indent=4, sort_keys=True, separators=(",", ": ")) + "\n"


class ActionModule(ActionBase):
    TRANSFERS_FILES = False
    _requires_connection = False
    _supports_check_mode = True
    _VALID_ARGS = frozenset(("dir", "records"))

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        folder, records = self._task.args.get("dir"), self._task.args.get("records")
        if not isinstance(folder, str) or not os.path.isabs(folder):
            raise AnsibleActionFail("run_records: dir must be an absolute path (the run's folder on the "
                                    "controller); got %r" % (folder,))
        if not isinstance(records, dict) or not all(isinstance(r, dict) for r in records.values()):
            raise AnsibleActionFail("run_records: records must be a dict of host name to its run record (a dict)")
        bad = sorted(str(h) for h in records if not HOST_FILE_NAME.match(str(h)))
        if bad:
            raise AnsibleActionFail("run_records: host names that cannot name a file in %s: %s (letters, digits, "
                                    "'_', '.', ':', '@' and '-', not starting with '.' or '-')" % (folder, ", ".join(bad)))
        paths = {str(h): os.path.join(folder, "%s.json" % h) for h in records}
        result.update(changed=False, paths=paths)
        if self._task.check_mode:
            return result
        os.makedirs(folder, mode=0o755, exist_ok=True)
        # each through a temporary file: a reader never sees half a record
        written = [h for h in sorted(paths) if fsutil.write_text_if_changed(paths[h], record_text(records[h]))]
        # a log of the run on the controller, not a change to a host: a no-op run stays changed=0
        result["written"] = written
        return result
