#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: (c) 2026, modelswap engineers
# Apache License 2.0 (see https://www.apache.org/licenses/LICENSE-2.0.txt)
# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

DOCUMENTATION = r"""
---
module: vllm_ready
short_description: Wait until a vLLM server is ready, idle, or gone
version_added: "0.1.0"
description:
  - With O(state=ready), waits - bounded by O(timeout) - through four gates in order, the port
    accepts a TCP connection, C(/health) answers 200, C(/v1/models) lists O(served_model_name),
    and a one-token completion succeeds (with the API key). Returns the seconds each gate took.
  - Stops early, without waiting for the budget, when waiting cannot help - the server rejects
    the API key, another model is served on the port, the systemd O(unit) failed, exited and is
    being restarted, or stopped, or a process outside O(unit) listens on the port (two vLLM
    processes of one user can share a port through SO_REUSEPORT).
  - On failure it reports the gate that failed, the last error, and the unit's recent journal
    lines, so the cause is in the result.
  - Without O(timeout) the budget is derived from the model's size on disk (O(model_path)) and
    its parallelism - 180 s, plus 4 s per GiB, plus 30 s per GPU beyond the first, plus 180 s
    for compilation unless O(enforce_eager).
  - With O(state=stopped), waits until no process of O(unit) is left and nothing listens on the
    port, so a new server can start without sharing the port or memory with the old one.
  - With O(state=idle), waits until the server has no request in flight - C(vllm:num_requests_running)
    plus C(vllm:num_requests_waiting) of O(served_model_name), read from C(/metrics), stay 0 for
    O(idle_settle) seconds - so a server taken out of its load balancer is stopped only after its
    last request ended. A server that refuses the connection has nothing in flight (RV(server_absent)).
    It reads at least once, so O(timeout=0) with O(idle_settle=0) returns what is in flight now
    (what a preview shows); a settle that began before the deadline may end after it, by
    O(idle_settle) at most.
extends_documentation_fragment:
  - modelswap.vllm.attributes.read_only
  - ansible.builtin.action_common_attributes
options:
  state:
    description:
      - C(ready) waits for the gates; C(stopped) waits until the unit's processes and the
        port's listeners are gone; C(idle) waits until no request is in flight.
    type: str
    choices: [ready, stopped, idle]
    default: ready
  host:
    description:
      - Address to probe; V(0.0.0.0) and V(::) (a server bound to all addresses) are probed on
        the loopback address.
    type: str
    default: 127.0.0.1
  port:
    description:
      - The server's port.
    type: int
    required: true
  scheme:
    description:
      - C(http) or C(https) (certificates are verified).
    type: str
    choices: [http, https]
    default: http
  served_model_name:
    description:
      - The name C(/v1/models) must list (the first C(--served-model-name)). Without it any
        listed model passes and the completion uses the first one.
      - With O(state=idle), only this model's requests count (the C(model_name) label of the
        metrics); without it, every model's.
    type: str
  api_key:
    description:
      - The server's API key (C(VLLM_API_KEY)), sent as a bearer token to C(/v1) routes (and to
        C(/metrics) with O(state=idle), for a server that does not leave it open).
    type: str
  api_key_file:
    description:
      - A systemd EnvironmentFile on the host whose C(VLLM_API_KEY) is the key - the unit's own,
        so the probe uses exactly the key the server has, and the key never leaves the host.
        A missing file or a file without the variable means no key.
    type: path
  timeout:
    description:
      - Seconds to wait in total. Default for O(state=ready) - derived from the model's size
        and parallelism (see the description); for O(state=stopped) - 120; for O(state=idle) -
        300.
    type: float
  model_path:
    description:
      - The served snapshot; its size on disk feeds the derived budget.
    type: path
  parallel_size:
    description:
      - GPUs one replica uses (tensor x pipeline x data parallel), for the derived budget.
    type: int
    default: 1
  enforce_eager:
    description:
      - The server runs with C(--enforce-eager) (no compilation), for the derived budget.
    type: bool
    default: false
  poll_interval:
    description:
      - Seconds between attempts.
    type: float
    default: 2
  request_timeout:
    description:
      - Seconds each probe may take (C(/health) can be slow under load).
    type: float
    default: 10
  completion:
    description:
      - Run the completion gate. Turn off only for servers that cannot complete (embeddings).
    type: bool
    default: true
  api:
    description:
      - Pass the C(/v1/models) and completion gates too. C(false) stops after C(/health), for a
        server whose API key modelswap does not know (a unit set up by hand that a failed swap
        starts again).
    type: bool
    default: true
  prompt:
    description:
      - The prompt of the one-token completion.
    type: str
    default: Hello
  unit:
    description:
      - The systemd unit that runs the server. Enables the early stop on a failed unit, the
        port owner check, the journal lines on failure, and O(state=stopped). O(state=idle)
        does not use it.
    type: str
  check_port_owner:
    description:
      - With O(unit), the port must be held only by processes of O(unit).
    type: bool
    default: true
  journal_lines:
    description:
      - How many of the unit's journal lines (since the wait began, or since the unit's last
        start when that is later) to return on failure.
    type: int
    default: 40
  fail_when_not_ready:
    description:
      - Fail when the gates do not pass (or the service is not gone, or not idle). With C(false)
        the result says RV(ready=false) and why.
    type: bool
    default: true
  idle_settle:
    description:
      - O(state=idle) - seconds the running and waiting requests must stay 0 before the server
        counts as idle (a request spends a moment in the API server before the engine counts it,
        and its last chunks leave after the engine is done with it). V(0) takes the first reading
        of 0.
    type: float
    default: 1.0
attributes:
  check_mode:
    support: full
    details:
      - Probing changes nothing; the module runs the same in check mode.
notes:
  - Run it on the serving host (as root to see other users' sockets and processes).
  - The API key never appears in the result; the journal lines are returned as the unit logged
    them (vLLM logs no key when it comes from the environment).
seealso:
  - module: modelswap.vllm.gpu_ready
  - name: vLLM health and readiness
    description: Why /health alone does not prove a server can generate (vllm#36960).
    link: https://github.com/vllm-project/vllm/issues/36960
author:
  - modelswap engineers (@modelswap)
"""

EXAMPLES = r"""
- name: Wait until vLLM serves kimi-k2.5
  modelswap.vllm.vllm_ready:
    port: 8000
    served_model_name: kimi-k2.5
    api_key: "{{ vllm_service_api_key }}"   # the key the vllm_service role set
    unit: vllm.service
    model_path: /var/lib/modelswap/hf/hub/models--moonshotai--Kimi-K2.5/snapshots/0123456789abcdef0123456789abcdef01234567
    parallel_size: 8
  register: ready

- name: Show how long each gate took
  ansible.builtin.debug:
    msg: "{{ ready.gates }}"

- name: Wait until the old server's processes and port are gone
  modelswap.vllm.vllm_ready:
    state: stopped
    port: 8000
    unit: vllm.service
    timeout: 120

- name: Wait until the requests in flight have ended (the host is out of its load balancer)
  modelswap.vllm.vllm_ready:
    state: idle
    port: 8000
    served_model_name: kimi-k2.5
    timeout: 300
    poll_interval: 0.5
  register: idle

- name: Say how long it took and what was in flight
  ansible.builtin.debug:
    msg: "{{ idle.elapsed }} s; in flight at the start: {{ idle.in_flight }}"
"""

RETURN = r"""
ready:
  description: O(state=ready) - all gates passed. O(state=stopped) - the service is gone.
    O(state=idle) - no request was in flight for O(idle_settle) seconds (or nothing listens).
  returned: always
  type: bool
  sample: true
gates:
  description: Seconds each passed gate took (from the previous gate), in order.
  returned: state=ready
  type: dict
  sample: {"port": 31.2, "health": 0.01, "models": 0.01, "completion": 0.09}
elapsed:
  description: Seconds waited in total.
  returned: always
  type: float
  sample: 31.31
budget:
  description: The time limit used, and whether it was derived.
  returned: always
  type: dict
  sample: {"seconds": 180, "derived": true, "model_bytes": 2412544}
failed_gate:
  description: The gate that did not pass (C(port), C(health), C(models), C(completion)).
  returned: when not ready
  type: str
  sample: health
last_error:
  description: The last error seen at the failed gate, or why the wait stopped early; with
    O(state=idle), what was still in flight at the end, or the error of the last reading.
  returned: when not ready
  type: str
  sample: vllm.service exited during start-up (main process exit status 1, exit-code)
stopped_by:
  description: Why the wait ended early - C(check) (the unit or the port owner), C(final)
    (an answer that waiting cannot change), or C(timeout).
  returned: when not ready
  type: str
in_flight:
  description: O(state=idle) - the requests in flight at the first reading (when the wait began),
    C(null) when no reading succeeded.
  returned: state=idle
  type: dict
  sample: {"running": 3, "waiting": 1}
in_flight_last:
  description: O(state=idle) - the requests in flight at the last reading.
  returned: state=idle
  type: dict
  sample: {"running": 0, "waiting": 0}
samples:
  description: O(state=idle) - how many readings of C(/metrics) succeeded.
  returned: state=idle
  type: int
  sample: 7
server_absent:
  description: O(state=idle) - the connection was refused, nothing listens on the port, so
    nothing is in flight.
  returned: state=idle
  type: bool
  sample: false
idle_settle:
  description: O(state=idle) - the settle time used, in seconds.
  returned: state=idle
  type: float
  sample: 1.0
models:
  description: The model names C(/v1/models) listed.
  returned: state=ready, once that gate passed
  type: list
  elements: str
  sample: ["kimi-k2.5"]
completion:
  description: The one-token completion's text and usage.
  returned: state=ready, once that gate passed
  type: dict
port_listeners:
  description: Processes listening on the port at the end (PID, user, command line, systemd unit).
  returned: state=ready or state=stopped
  type: list
  elements: dict
  sample: [{"pid": 812, "user": "vllm", "unit": "vllm.service", "address": "0.0.0.0",
            "name": "vllm", "cmdline": "/opt/modelswap/venvs/vllm-0.32.0/bin/python3 ..."}]
processes:
  description: O(state=stopped) - the unit's processes still alive at the end.
  returned: state=stopped
  type: list
  elements: dict
unit_state:
  description: The unit's C(systemctl show) properties at the end (state, PIDs, restarts,
    exit status and the monotonic timestamps of its last start and stop, in microseconds).
  returned: when O(unit) is given
  type: dict
monotonic:
  description: The host's CLOCK_MONOTONIC (seconds) when the wait ended, comparable with the
    unit's C(*TimestampMonotonic) values (microseconds).
  returned: always
  type: float
startup:
  description:
    - Where the start went, from vLLM's own log lines in the unit's journal - C(milestones) (seconds
      after the main process started), C(phases) (seconds each - C(imports_and_config_s),
      C(engine_and_workers_s), C(weights_s), C(engine_init_s) (memory profile, KV cache,
      compilation, graph capture, warm-up), C(api_server_s), C(first_token_s)), C(reported)
      (what vLLM printed itself - C(weights_s), C(engine_init_s), C(compile_s), C(graph_capture_s))
      and C(total_s) (main process start to ready).
    - A phase whose log line is missing is left out.
  returned: state=ready with O(unit), when the unit started at most 60 s before the wait began
  type: dict
  sample: {"phases": {"imports_and_config_s": 15.61, "engine_and_workers_s": 8.02, "weights_s": 0.11,
           "engine_init_s": 2.43, "api_server_s": 0.51, "first_token_s": 0.61},
           "reported": {"weights_s": 0.01, "engine_init_s": 1.94}, "total_s": 27.28,
           "milestones": {"process_started": 0.0, "engine_configured": 15.606, "ready": 27.284}}
journal:
  description: The unit's recent journal lines (since the wait began or the unit last started).
  returned: when not ready and O(unit) is given
  type: list
  elements: str
journal_errors:
  description: The journal lines that say why it failed (exceptions, ERROR lines, exit status),
    without repeats; also in the failure message.
  returned: when not ready and O(unit) is given
  type: list
  elements: str
  sample: ["RuntimeError: start (0) + length (256) exceeds dimension size (128)",
           "vllm.service: Main process exited, code=exited, status=1/FAILURE"]
"""

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.modelswap.vllm.plugins.module_utils.common.command_runner import HostCommands
from ansible_collections.modelswap.vllm.plugins.module_utils.serving import vllm_ready
from ansible_collections.modelswap.vllm.plugins.module_utils.serving import vllm_unit_state


def main():
    module = AnsibleModule(
        argument_spec=dict(
            state=dict(type="str", choices=["ready", "stopped", "idle"], default="ready"),
            host=dict(type="str", default="127.0.0.1"),
            port=dict(type="int", required=True),
            scheme=dict(type="str", choices=["http", "https"], default="http"),
            served_model_name=dict(type="str"),
            api_key=dict(type="str", no_log=True),
            api_key_file=dict(type="path"),
            timeout=dict(type="float"),
            model_path=dict(type="path"),
            parallel_size=dict(type="int", default=1),
            enforce_eager=dict(type="bool", default=False),
            poll_interval=dict(type="float", default=2.0),
            request_timeout=dict(type="float", default=10.0),
            completion=dict(type="bool", default=True),
            api=dict(type="bool", default=True),
            prompt=dict(type="str", default="Hello"),
            unit=dict(type="str"),
            check_port_owner=dict(type="bool", default=True),
            journal_lines=dict(type="int", default=40),
            fail_when_not_ready=dict(type="bool", default=True),
            idle_settle=dict(type="float", default=1.0),
        ),
        required_if=[("state", "stopped", ("unit",), True)],
        mutually_exclusive=[("api_key", "api_key_file")],
        supports_check_mode=True,
    )
    params = module.params
    try:
        problem = vllm_ready.options_problem(params)
        if problem:
            module.fail_json(msg=problem)
        if params["api_key_file"]:
            params["api_key"] = vllm_ready.api_key_from_file(params["api_key_file"])
            if params["api_key"]:
                module.no_log_values.add(params["api_key"])
        budget = vllm_ready.budget_for(params)
        if params["state"] == "idle":
            result, failure = vllm_ready.wait_until_idle(params, budget)
        else:
            unit = vllm_unit_state.UnitReader(HostCommands.of(module), params["unit"]) if params["unit"] else None
            wait = vllm_ready.wait_until_stopped if params["state"] == "stopped" else vllm_ready.wait_until_ready
            result, failure = wait(params, unit, budget)
    except vllm_unit_state.ReadyError as exc:
        module.fail_json(msg=str(exc))
    if failure:
        module.fail_json(msg=failure, **result)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
