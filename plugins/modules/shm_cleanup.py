#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: (c) 2026, modelswap engineers
# Apache License 2.0 (see https://www.apache.org/licenses/LICENSE-2.0.txt)
# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

DOCUMENTATION = r"""
---
module: shm_cleanup
short_description: Remove a service user's stale shared-memory segments from /dev/shm
version_added: "0.2.0"
description:
  - Processes of vLLM, NCCL and torch that die hard (a killed server, an engine that outlived
    its API process) leave files in O(shm_dir) - C(nccl-*) (about 32 MB each), C(psm_*),
    C(sem.mp-*), C(vllm_*). They fill the tmpfs and confuse the next start. This module removes
    those of O(service_user) that no live process still holds open (a descriptor in
    C(/proc/PID/fd)) or maps (C(/proc/PID/maps)); run it after the server stopped and before it
    starts again.
  - Stale means all of - the name matches C(nccl-*), C(psm_*), C(sem.mp-*), C(vllm_*) or one of
    O(patterns); it is a regular file directly in O(shm_dir) (symlinks, folders and special
    files are kept and listed in RV(skipped)); O(service_user) owns it (other users' files are
    kept and listed in RV(other_owner)); no live process holds it open or maps it, matched by
    device and inode (files in use are kept and listed with their holders in RV(in_use)).
  - When some process cannot be inspected (no become, a hardened C(/proc), an LSM) no file is
    proven unused, so nothing is removed; the files are listed in RV(unverified) with a warning.
  - Before removing the first file it checks that every removal can succeed - the file is still
    the one planned (same inode and owner), the directory is writable and not on a read-only
    mount, the sticky bit lets this user remove it, neither the directory nor the file is
    immutable or append-only. One refusal fails the task with every refused file and its reason
    and removes nothing. A removal the kernel still refuses after that check (an LSM) fails the
    task too, naming the file, and RV(removed) lists exactly what went.
extends_documentation_fragment:
  - modelswap.vllm.attributes
  - ansible.builtin.action_common_attributes
options:
  service_user:
    description:
      - The account that runs the vLLM service; only its files are removed. Must exist on the
        host.
    type: str
    required: true
  shm_dir:
    description:
      - The shared-memory directory, an absolute path to an existing directory.
    type: path
    default: /dev/shm
  patterns:
    description:
      - Extra file-name globs to remove besides C(nccl-*), C(psm_*), C(sem.mp-*) and C(vllm_*),
        e.g. C(sem.loky-*). A pattern is a name inside O(shm_dir), never a path; absolute
        patterns, patterns with C(/), starting with C(.), or made of wildcards only are rejected.
    type: list
    elements: str
    default: []
attributes:
  check_mode:
    support: full
    details:
      - Plans and checks exactly as a real run, lists in RV(removed) the files that would be
        removed with their sizes, and removes none. A removal that would be refused fails the
        task as the real run would.
  diff_mode:
    support: full
    details:
      - The service user's matching files before and after (the files in use stay).
notes:
  - Run it with C(become=true) - reading other users' C(/proc/PID/fd) and removing their files
    needs root. Without it the module usually removes nothing and warns (see RV(unverified)).
  - Inside a container with its own PID namespace only that namespace's processes are seen; run
    it on the host (or in the service's namespace) so every holder counts.
  - Each file is checked again (same inode and owner) just before it is unlinked; a file opened
    in the instant between that check and the unlink is still removed from the directory (the
    process keeps its mapping).
  - M(modelswap.vllm.gpu_ready) only reports these files (its RV(modelswap.vllm.gpu_ready#module:stale_shm));
    it never removes them.
seealso:
  - module: modelswap.vllm.gpu_ready
    description: Waits for GPU memory after a stop and reports stale segments without removing them.
author:
  - modelswap engineers (@modelswap)
"""

EXAMPLES = r"""
- name: Remove the vLLM service user's stale /dev/shm segments before the start
  modelswap.vllm.shm_cleanup:
    service_user: vllm
    patterns: ["sem.loky-*", "vllm_offload_*"]
  become: true
  register: shm

- name: Say what would be removed (check mode removes nothing)
  modelswap.vllm.shm_cleanup:
    service_user: vllm
  become: true
  check_mode: true
  register: shm_preview
"""

RETURN = r"""
dir:
  description: The directory cleaned.
  returned: when the directory was read (not on invalid options)
  type: str
  sample: /dev/shm
service_user:
  description: Whose files were eligible.
  returned: when the directory was read (not on invalid options)
  type: str
  sample: vllm
patterns:
  description: All patterns used, the default ones first.
  returned: when the directory was read (not on invalid options)
  type: list
  elements: str
  sample: ["nccl-*", "psm_*", "sem.mp-*", "vllm_*", "sem.loky-*"]
removed:
  description: The files removed (in check mode, the files that would be removed), with their
    sizes in bytes and the pattern each matched; on a failed removal, only those really gone.
  returned: always
  type: list
  elements: dict
  sample: [{"path": "/dev/shm/nccl-2f1a", "size": 33554432, "pattern": "nccl-*"}]
bytes_freed:
  description: The total size of RV(removed) (in check mode, what would be freed).
  returned: always
  type: int
  sample: 33554432
in_use:
  description: The service user's matching files kept because a live process holds them open
    (fd) or maps them (mmap), with the holders' PIDs, users and command lines.
  returned: when the directory was read (not on invalid options)
  type: list
  elements: dict
  sample: [{"path": "/dev/shm/psm_9f8e", "owner": vllm, "size": 4096,
            "holders": [{"pid": 4242, "user": vllm, "cmdline": "python3 -m vllm.entrypoints.openai.api_server",
                         "via": ["fd"]}]}]
other_owner:
  description: Matching files of other users, kept.
  returned: when the directory was read (not on invalid options)
  type: list
  elements: dict
  sample: [{"path": "/dev/shm/nccl-77aa", "owner": alice, "size": 4096}]
skipped:
  description: Matching entries that are not regular files (symlinks, folders) or cannot be
    read, kept.
  returned: when the directory was read (not on invalid options)
  type: list
  elements: dict
  sample: [{"path": "/dev/shm/nccl-link", "reason": "symlink, not a regular file"}]
unverified:
  description: The service user's files not removed because some processes could not be
    inspected, so nothing proves them unused.
  returned: when the directory was read (not on invalid options)
  type: list
  elements: str
  sample: []
refused:
  description: Files whose removal was refused, with the reason; with any, the task failed.
  returned: always
  type: list
  elements: dict
  sample: [{"path": "/dev/shm/nccl-2f1a", "reason": "the file is immutable (chattr +i)"}]
msg:
  description: A one-line summary, or on failure every refused file and why.
  returned: always
  type: str
  sample: "/dev/shm: 3 stale segment(s) of vllm removed (96.0 MiB), 1 in use kept"
"""

import os

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.modelswap.vllm.plugins.module_utils.common.units import human_bytes
from ansible_collections.modelswap.vllm.plugins.module_utils.gpu import shm


def argument_spec():
    return dict(
        service_user=dict(type="str", required=True),
        shm_dir=dict(type="path", default=shm.SHM_DIR),
        patterns=dict(type="list", elements="str", default=[]),
    )


def warn_kept(module, planned, user, shm_dir):
    """Warnings for the files kept: unverified (some process not inspectable) and in use."""
    if planned["uninspectable"] and planned["remove"]:
        fix = ("Run the task with become: true." if os.geteuid() != 0 else
               "Even root may not read them (a hardened /proc, an LSM, or processes of a parent "
               "user namespace); clean these files by hand after checking them.")
        module.warn("Not removing %d file(s) of %s in %s: %d process(es) could not be inspected "
                    "(PIDs %s), so nothing proves the files unused. %s"
                    % (len(planned["remove"]), user, shm_dir, len(planned["uninspectable"]),
                       ", ".join(map(str, planned["uninspectable"][:10])), fix))
    for entry in planned["in_use"]:
        module.warn("Kept %s: still in use by %s" % (entry["path"], "; ".join(
            "PID %d (%s, %s: %s)" % (h["pid"], "/".join(h["via"]), h["user"], h["cmdline"])
            for h in entry["holders"])))


def diff_of(planned, going, user, shm_dir, patterns):
    """The service user's matching files before and after the removal of `going`."""
    before = sorted([e["path"] for e in planned["remove"]] + [e["path"] for e in planned["in_use"]])
    removing = {e["path"] for e in going}
    header = "%s (files of %s matching %s)" % (shm_dir, user, " ".join(patterns))
    return {"before_header": header, "after_header": header,
            "before": "".join(x + "\n" for x in before),
            "after": "".join(x + "\n" for x in before if x not in removing)}


def refused_text(refused):
    return "; ".join("%s: %s" % (e["path"], e["reason"]) for e in refused)


def main():
    module = AnsibleModule(argument_spec=argument_spec(), supports_check_mode=True)
    p = module.params
    shm_dir = p["shm_dir"]

    # Validate everything before touching anything.
    try:
        shm.validate_dir(shm_dir)
        shm.validate_patterns(p["patterns"])
        uid, user = shm.resolve_user(p["service_user"])
    except shm.ShmError as exc:
        module.fail_json(msg=str(exc), changed=False, removed=[], bytes_freed=0, refused=[])
    patterns = shm.with_defaults(p["patterns"])

    try:
        planned = shm.plan(shm_dir, uid, patterns)
        to_remove, unverified = shm.removable(planned)
        ready, refused = shm.refusals(to_remove, shm_dir)
    except shm.ShmError as exc:
        module.fail_json(msg=str(exc), changed=False, removed=[], bytes_freed=0, refused=[])

    result = {"changed": False, "dir": shm_dir, "service_user": user, "patterns": patterns,
              "removed": [], "bytes_freed": 0, "in_use": planned["in_use"],
              "other_owner": planned["other_owner"], "skipped": planned["skipped"],
              "unverified": [e["path"] for e in unverified], "refused": refused}
    warn_kept(module, planned, user, shm_dir)

    if refused:
        module.fail_json(
            msg="Refusing to remove the stale shared-memory segments of %s in %s: %d of %d "
                "file(s) cannot be removed - %s. Nothing was removed. Fix: make them removable "
                "(run with become: true, remount the directory read-write, chattr -i/-a), or "
                "check and remove them by hand, then run again."
                % (user, shm_dir, len(refused), len(refused) + len(ready), refused_text(refused)),
            **result)

    if module._diff:
        result["diff"] = diff_of(planned, ready, user, shm_dir, patterns)

    if module.check_mode:
        result["removed"] = shm.public(ready)
    else:
        removed, errors = shm.apply(ready, shm_dir)
        by_path = {e["path"]: e for e in ready}
        result["removed"] = shm.public([by_path[r["path"]] for r in removed])
        if errors:
            result["refused"] = errors
            result["bytes_freed"] = sum(r["size"] for r in result["removed"])
            result["changed"] = bool(removed)
            result.pop("diff", None)
            module.fail_json(
                msg="Removing the stale shared-memory segments of %s in %s failed for %d file(s) "
                    "- %s. Removed %d other(s) (listed in removed); the failed ones are still "
                    "there. Fix: check the files' owner, attributes and the host's security "
                    "policy (SELinux, AppArmor), that the task runs with become: true, then run "
                    "again." % (user, shm_dir, len(errors), refused_text(errors), len(removed)),
                **result)
    result["bytes_freed"] = sum(r["size"] for r in result["removed"])
    result["changed"] = bool(result["removed"])
    result["msg"] = "%s: %d stale segment(s) of %s %s (%s), %d in use kept%s" % (
        shm_dir, len(result["removed"]), user,
        "would be removed" if module.check_mode else "removed", human_bytes(result["bytes_freed"]),
        len(planned["in_use"]),
        ", %d unverified kept" % len(unverified) if unverified else "")
    module.exit_json(**result)


if __name__ == "__main__":
    main()
