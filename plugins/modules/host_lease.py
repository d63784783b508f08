#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: (c) 2026, modelswap engineers
# Apache License 2.0 (see https://www.apache.org/licenses/LICENSE-2.0.txt)
# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

DOCUMENTATION = r"""
---
module: host_lease
short_description: Let one migration at a time change a host (the host's lease)
version_added: "0.1.0"
description:
  - Two C(ansible-playbook) runs against the same host must not interleave. The first run takes
    the host's lease before it changes anything; a second run finds the lease held and stops
    before it changes anything, naming the run that holds it and how to take over a dead run's
    lease (like Terraform's state lock and C(force-unlock)).
  - The lease is a small JSON file on the host (O(path)) naming the run that holds it - its run
    id, the controller and user that started it, the PID of its C(ansible-playbook), when it
    started, when it was last renewed, when it expires, and what it is for.
  - O(state=held) takes the lease when nobody holds it, and renews it when this run (O(run_id))
    holds it (a new expiry; C(started) is kept).
  - When another run holds it, O(state=held) takes it over only when that lease has expired, or
    when O(break_lease) names that run's id (the operator says that run is dead); a takeover is
    reported as a warning naming the run whose lease was taken. Otherwise the task fails, naming
    the holder (run id, controller, user, PID, since when, until when) and the fix
    (if that run is dead, run again with O(break_lease) set to its run id), and nothing was changed.
  - A value of O(break_lease) that does not name the run holding the lease is refused, even when
    that lease has expired - the wrong lease is never broken; the message names the real holder.
  - O(state=released) gives the lease back when this run holds it. Another run's lease, or no
    lease, is left as it is (a run never removes another run's lease).
  - O(state=read) only reads the lease and reports it.
  - Every read, decision and write of O(state=held) and O(state=released) happens under an
    exclusive lock on C(<path>.lock), so of two runs that come at once exactly one takes the lease
    and the other sees it held. The lease is written atomically (mode C(0644)); the folder is
    created (mode C(0755)) when missing.
  - C(changed) says whether the lease file was written or removed. The migrate role reports these
    writes as no change to the host (C(changed_when) false) - the lease is a run's lock, not the
    state the host converges to.
extends_documentation_fragment:
  - modelswap.vllm.attributes
  - ansible.builtin.action_common_attributes
options:
  path:
    description:
      - The lease file; its lock is C(<path>.lock) beside it.
    type: path
    default: /var/lib/modelswap/lease.json
  state:
    description:
      - C(held) takes or renews the lease (or takes over a dead run's lease, as described above).
      - C(released) gives this run's lease back.
      - C(read) only reports the lease.
    type: str
    choices: [held, released, read]
    default: held
  run_id:
    description:
      - The id of this run (the migrate role names each run). Required with O(state=held) and
        O(state=released).
    type: str
  controller:
    description:
      - The host name of the controller the run started on, recorded in the lease for whoever
        finds it held.
    type: str
    default: ""
  user:
    description:
      - The user who started the run, recorded in the lease.
    type: str
    default: ""
  pid:
    description:
      - The PID of the run's C(ansible-playbook) on the controller, recorded in the lease (C(0) -
        unknown).
    type: int
    default: 0
  ttl:
    description:
      - How many seconds the lease lasts from now; each renewal starts it again. After it, another
        run may take the lease over without O(break_lease). Must be above 0; make it longer than
        the longest step between two renewals (a model download).
    type: int
    default: 14400
  break_lease:
    description:
      - The run id of a live lease to take over - that run is dead (its controller crashed or was
        killed). It must name the run that holds the lease; any other value is refused.
    type: str
    default: ""
  purpose:
    description:
      - What the run does, recorded in the lease and shown to a refused run.
    type: str
    default: migrate
attributes:
  check_mode:
    support: full
    details:
      - Reads the lease and says what it would do (C(would)); never writes, removes or locks
        anything. A run that would be refused fails in check mode too.
  diff_mode:
    support: none
seealso:
  - module: modelswap.vllm.deployment_record
author:
  - modelswap engineers (@modelswap)
"""

EXAMPLES = r"""
- name: Take the host's lease before changing it (or renew it, later in the same run)
  modelswap.vllm.host_lease:
    run_id: "{{ migrate_run_id }}"
    controller: "{{ lookup('ansible.builtin.pipe', 'hostname') }}"
    user: "{{ lookup('ansible.builtin.env', 'USER') }}"
    ttl: 21600
  become: true
  changed_when: false

- name: Renew it when a long step starts
  modelswap.vllm.host_lease:
    state: held
    run_id: "{{ migrate_run_id }}"
  become: true
  changed_when: false

- name: Give it back at the end of the run
  modelswap.vllm.host_lease:
    state: released
    run_id: "{{ migrate_run_id }}"
  become: true
  changed_when: false

- name: Take over the lease of a run that died (its id from the refusal message)
  modelswap.vllm.host_lease:
    run_id: "{{ migrate_run_id }}"
    break_lease: 20261205T141200Z-ab12cd
  become: true
  changed_when: false

- name: Who holds the host?
  modelswap.vllm.host_lease:
    state: read
  register: lease
"""

RETURN = r"""
action:
  description: What was done (in check mode, what would be done) - C(take), C(renew), C(release),
    C(refuse) or C(none) (nothing to do, or O(state=read)).
  returned: always
  type: str
  sample: take
reason:
  description: The decision in words - whose lease, taken over why, left alone why.
  returned: always
  type: str
  sample: taken by run 20261205T141200Z-ab12cd
lease:
  description: The lease on the host after the task (in check mode, as it would be); null when
    there is none.
  returned: always
  type: dict
  sample: {"schema": 1, "run_id": "20261205T141200Z-ab12cd", "controller": "ctl01", "user": "alice",
           "pid": 4242, "started": 1796472720.0, "renewed": 1796472720.0, "expires": 1796487120.0,
           "purpose": "migrate"}
previous:
  description: The lease found before the task (another run's, when it was taken over); null when
    there was none.
  returned: always
  type: dict
holder:
  description: The lease of the run that holds the host, when the task was refused.
  returned: failure
  type: dict
taken_over:
  description: Whether another run's lease was taken over (it had expired, or O(break_lease) named
    it).
  returned: always
  type: bool
would:
  description: In check mode, what the task would do, in words; nothing was written.
  returned: in check mode
  type: str
  sample: would take the lease for run 20261205T141200Z-ab12cd (taken by run 20261205T141200Z-ab12cd)
path:
  description: The lease file.
  returned: always
  type: str
  sample: /var/lib/modelswap/lease.json
"""

import platform
import time

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.modelswap.vllm.plugins.module_utils.common import host_lease


def main():
    module = AnsibleModule(
        argument_spec=dict(
            host_lease.LEASE_OPTIONS,
            state=dict(type="str", choices=list(host_lease.STATES), default="held"),
            run_id=dict(type="str"),
        ),
        required_if=[("state", "held", ("run_id",)), ("state", "released", ("run_id",))],
        supports_check_mode=True,
    )
    p = module.params
    request = {key: p[key] for key in host_lease.REQUEST_FIELDS}
    request["run_id"] = request["run_id"] or ""
    result = host_lease.outcome(p["path"], request, time.time(), module.check_mode, platform.node())
    if result.pop("failed", False):
        module.fail_json(**result)
    if result["taken_over"]:
        module.warn("host_lease: %s" % result["reason"])
    module.exit_json(**result)


if __name__ == "__main__":
    main()
