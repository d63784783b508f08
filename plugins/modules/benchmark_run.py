#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: (c) 2026, modelswap engineers
# Apache License 2.0 (see https://www.apache.org/licenses/LICENSE-2.0.txt)
# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

DOCUMENTATION = r"""
---
module: benchmark_run
short_description: Run Locust at a rising concurrency or rate ladder against an OpenAI-compatible server
version_added: "0.1.0"
description:
  - Runs the benchmark role's locustfile headless, on the host the task runs on (the controller
    by default), and leaves the raw per-request records (JSONL) under O(run_dir)C(/raw) for
    M(modelswap.vllm.benchmark_report).
  - The ladder is one Locust run driven by a C(LoadTestShape). Each step of O(concurrency) has a
    ramp (O(ramp_s)), a discarded warm-up (O(warmup_s)), a measured window of at least
    O(measure_s) that extends until it holds O(min_requests_per_user) requests per user (at most
    O(measure_max_s) or O(max_requests_per_step)), and a drain during which the load is held
    until every measured request has finished. Users are closed loops without wait time (C(-u C)
    = C(vllm bench serve --max-concurrency C)).
  - Stops early, and says so, when a step's error rate exceeds O(stop_error_rate), or when SLOs
    are set (O(slo)) and fewer than O(stop_min_good_ratio) of its requests met all of them.
  - Bounded - every step's phases have time limits, each request has O(request_timeout_s), and
    Locust is killed (with its worker processes) when the whole run passes its time bound
    (RV(bounds)). Requests in flight at the end are let finish, so the server's token counters
    match the records.
  - With O(mode=rate) the ladder is O(rates) in requests per second, an open loop - each request
    is sent at a scheduled time from a seeded Poisson or gamma process (O(burstiness)), whatever
    the server's latency (C(vllm bench serve --request-rate R --burstiness B)), optionally capped
    at O(max_inflight) requests in flight. Every request records how late it was sent (the report
    flags a step the client could not keep on schedule).
  - With O(capacity_slo) a rate ladder searches the highest rate that meets the SLO - the rates
    are a sweep, run until one misses it, then O(bisections) steps halve the gap between the
    highest rate that met it and the lowest that did not.
  - One load process by default; O(processes) forks Locust workers on this host
    (C(--processes)); O(expect_workers) makes this a Locust master for workers on other hosts.
extends_documentation_fragment:
  - modelswap.vllm.attributes.read_only
  - ansible.builtin.action_common_attributes
  - modelswap.vllm.benchmark_target
options:
  mode:
    description: C(concurrency) - closed loops at each of O(concurrency); C(rate) - an open loop at each of O(rates).
    type: str
    choices: [concurrency, rate]
    default: concurrency
  concurrency:
    description: The ladder of C(mode=concurrency) - rising positive numbers of concurrent streams.
    type: list
    elements: int
    default: []
  rates:
    description: The ladder of C(mode=rate) - rising request rates (requests per second, above 0).
    type: list
    elements: float
    default: []
  burstiness:
    description: The gamma shape of a rate ladder's arrivals - 1 is a Poisson process, below 1 burstier,
      above 1 more regular (C(vllm bench serve --burstiness)).
    type: float
    default: 1.0
  max_inflight:
    description: A rate ladder's cap on requests in flight (a request due while the cap is reached waits,
      and the report counts that wait apart from the client's lateness); 0 for none.
    type: int
    default: 0
  capacity_slo:
    description:
      - The SLO a rate ladder's capacity is searched at - C(ttft_p99), C(itl_p99), C(e2el_p99) as durations
        with their unit (C(2 s), C(80 ms)) and C(error_rate) as a percentage (C(1%)); any subset.
      - The run judges each step by the share of requests (of gaps, for ITL) over each limit - at most 1%
        for a p99 - to pick the next rate; the report judges every step again with its exact percentiles.
    type: dict
    default: {}
  workload:
    description:
      - How the prompts are cut from O(prompt_source)'s prose - C(fixed) (every prompt and answer its set
        length), C(random) (each prompt and answer length drawn within O(range_ratio) of O(input_tokens) and
        O(output_tokens), C(vllm bench serve --random-range-ratio)), C(shared_prefix) (the same O(prefix_tokens)
        first in every prompt, for prefix caching; the report does not flag its cache hits).
      - A JSONL prompt file brings its own prompts - C(fixed) only.
    type: str
    choices: [fixed, random, shared_prefix]
    default: fixed
  range_ratio:
    description: With O(workload=random), the share (above 0, below 1) within which each length is drawn.
    type: float
    default: 0.0
  prefix_tokens:
    description: With O(workload=shared_prefix), the tokens every prompt shares first (below O(input_tokens)).
    type: int
    default: 0
  bisections:
    description: Steps of a capacity search after its sweep, each halving the gap between the highest rate
      that met O(capacity_slo) and the lowest that did not; 0 runs the sweep alone.
    type: int
    default: 2
  input_tokens:
    description: Prompt length in tokens (approximate for text prompts, cut by O(words_per_token)).
    type: int
    default: 1024
  output_tokens:
    description: Output tokens per request (C(max_tokens) / C(max_completion_tokens)).
    type: int
    default: 128
  ignore_eos:
    description: Send C(ignore_eos) so every request produces O(output_tokens) (vLLM extension).
    type: bool
    default: true
  prompt_source:
    description: A natural-text file (prompts are windows of its words) or a JSONL file of
      C({"prompt" - str}) or C({"messages" - [...]}) lines.
    type: path
    required: true
  prompt_format:
    description: C(text) or C(jsonl); by default from the file name (C(.jsonl) is JSONL).
    type: str
    choices: [text, jsonl]
  words_per_token:
    description: Words per token of the server's tokenizer (from M(modelswap.vllm.benchmark_probe)).
    type: float
    default: 0.75
  prompt_overhead_tokens:
    description: Tokens the server adds to every prompt (chat template).
    type: int
    default: 0
  ramp_s:
    description: Seconds over which each step's new users start.
    type: float
    default: 10
  warmup_s:
    description: Seconds after the ramp whose requests are discarded.
    type: float
    default: 10
  measure_s:
    description: The measured window's least length in seconds.
    type: float
    default: 60
  measure_max_s:
    description: The measured window's greatest length in seconds.
    type: float
    default: 300
  min_requests_per_user:
    description: The window extends (up to O(measure_max_s)) until it holds this many requests
      per concurrent user; 11 is the least with which the report's Little's law check (10 %) can
      hold (see O(littles_law_tolerance)).
    type: float
    default: 11
  max_requests_per_step:
    description: The window closes when this many requests were sent in it.
    type: int
    default: 200000
  request_timeout_s:
    description: A request that has not finished after this many seconds fails as C(timeout); it
      also bounds each drain. Keep it well above the expected E2E latency at the top concurrency.
    type: float
    default: 600
  slo:
    description: Latency objectives per request in ms (C(ttft_ms), C(tpot_ms), C(e2el_ms));
      a request meets them when it meets every one set (vLLM's goodput).
    type: dict
    default: {}
  stop_error_rate:
    description: Stop after a step whose measured error rate is above this fraction; null never stops.
    type: float
  stop_min_good_ratio:
    description: With SLOs, stop after a step where fewer than this fraction of measured requests
      met them.
    type: float
    default: 0.9
  metrics_url:
    description: vLLM's C(/metrics), sampled every second (server concurrency, KV cache, token
      counters). Empty to not sample.
    type: str
  extra_body:
    description: Extra fields for every request body (e.g. C(temperature)).
    type: dict
    default: {}
  run_dir:
    description: The run's folder; the config and C(raw/) are written here. Must not hold a run.
    type: path
    required: true
  locustfile:
    description: The locustfile (the benchmark role's C(files/locustfile.py)).
    type: path
    required: true
  locust_command:
    description: How to start Locust; by default the module's Python with C(-m locust).
    type: list
    elements: str
  processes:
    description: Locust C(--processes) - worker processes on this host (C(-1) one per core, C(0)
      a single process).
    type: int
    default: 0
  expect_workers:
    description: Run as a Locust master and wait for this many workers (started on other hosts
      with the same locustfile and config).
    type: int
    default: 0
  master_bind_host:
    description: Interface the master listens on for workers.
    type: str
  master_bind_port:
    description: Port the master listens on for workers.
    type: int
  seed:
    description: Seed of the prompt picker.
    type: int
    default: 0
  validate_certs:
    description: Verify TLS certificates of C(https) URLs (the requests and the C(/metrics) samples).
    type: bool
    default: true
  scheduling:
    description:
      - How the load processes are scheduled. C(normal); C(nice) (nice -10); C(realtime)
        (SCHED_RR priority 1 through C(chrt), needs root or CAP_SYS_NICE). On a shared load
        generator C(realtime) keeps other processes from delaying the client's chunk timestamps
        (the report flags steps where the client's event loop ran late).
    type: str
    choices: [normal, nice, realtime]
    default: normal
  cpu_affinity:
    description:
      - CPUs the load processes may run on (through C(taskset)), for example C([1]). Leave it empty for any CPU.
      - On a load generator that shares its cores with the server under test (a lab, a single box),
        give the client cores of its own, so that its event loop is not delayed by the server and
        its steps stay valid; pin the server to other cores (this option places only the load processes).
    type: list
    elements: int
    default: []
  prepare_only:
    description: Write the run's C(config.json) (for remote workers) and return; start no load.
    type: bool
    default: false
  littles_law_tolerance:
    description:
      - The tolerance of the report's Little's law check (M(modelswap.vllm.benchmark_report)'s
        C(littles_law_tolerance), 0.1 by default). A measured window can only pass that check when
        it holds at least C(ceil(1 / tolerance) + 1) requests per user (11 at 0.1), a window of
        C(1 / tolerance) times the step's E2E latency; settings that let a window close earlier
        (O(min_requests_per_user), O(max_requests_per_step)) are named in RV(window_warnings).
    type: float
attributes:
  check_mode:
    support: full
    details:
      - Validates and returns the plan and its bounds; starts no load and writes nothing. In check
        mode the window warnings are also issued as warnings.
requirements:
  - locust (and its geventhttpclient) for the Python that runs Locust
author:
  - modelswap engineers (@modelswap)
"""

EXAMPLES = r"""
- name: Run the ladder from the controller
  modelswap.vllm.benchmark_run:
    url: http://10.0.0.5:8000
    model: kimi-k2.5
    api_key: "{{ vllm_service_api_key }}"   # the key the vllm_service role set
    concurrency: [1, 8, 32, 128, 256, 512, 1024]
    prompt_source: "{{ role_path }}/files/prompts.txt"
    locustfile: "{{ role_path }}/files/locustfile.py"
    words_per_token: "{{ probe.calibration.words_per_token }}"
    metrics_url: http://10.0.0.5:8000/metrics
    run_dir: /srv/results/gpu01/kimi-k2.5/3f1c.../20261202T120000Z
  delegate_to: localhost

- name: Search the highest request rate that meets the SLO (Poisson arrivals)
  modelswap.vllm.benchmark_run:
    url: http://10.0.0.5:8000
    model: kimi-k2.5
    api_key: "{{ vllm_service_api_key }}"
    mode: rate
    rates: [2, 4, 8, 16, 32]
    capacity_slo: {ttft_p99: 2 s, itl_p99: 80 ms, error_rate: 1%}
    bisections: 2
    prompt_source: "{{ role_path }}/files/prompts.txt"
    locustfile: "{{ role_path }}/files/locustfile.py"
    run_dir: /srv/results/gpu01/kimi-k2.5/3f1c.../20261202T130000Z
  delegate_to: localhost
"""

RETURN = r"""
run_dir:
  description: The run's folder.
  returned: always
  type: str
raw_dir:
  description: Where the raw records are (C(master.jsonl), C(worker-*.jsonl)).
  returned: always
  type: str
plan:
  description: The ladder and its timing settings.
  returned: always
  type: dict
config:
  description: The locustfile's config file (written unless in check mode).
  returned: always
  type: str
lines:
  description: The plan as an operator reads it - target, ladder, each step's ramp, warm-up, window and
    drain, timeouts, stop conditions, bounds, load processes, and the window warnings.
  returned: always
  type: list
  elements: str
window_warnings:
  description: Why a step's measured window may hold too few requests per user for the report's
    Little's law check, with the settings that fix it; empty when none.
  returned: always
  type: list
  elements: str
bounds:
  description: The run's bound in seconds (Locust is killed past it) and in measured requests.
  returned: always
  type: dict
  sample: {"seconds": 4327, "measured_requests": 1400000, "seconds_per_step_max": 601}
status:
  description: Whether the run started and completed, the stop reason when it stopped early,
    and how many steps were measured.
  returned: success
  type: dict
  sample: {"started": true, "complete": true, "stopped_early": null, "steps_measured": 7}
seconds:
  description: How long Locust ran.
  returned: success
  type: float
"""

import json
import os
import sys
import time

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.modelswap.vllm.plugins.module_utils.bench import benchmark_probe
from ansible_collections.modelswap.vllm.plugins.module_utils.bench import benchmark_run
from ansible_collections.modelswap.vllm.plugins.module_utils.common.fsutil import atomic_write_text


def tail(path, n=4000):
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read()[-n:]
    except OSError:
        return ""


def main():
    module = AnsibleModule(
        argument_spec=dict(
            **benchmark_probe.TARGET_ARGS,
            mode=dict(type="str", choices=["concurrency", "rate"], default="concurrency"),
            concurrency=dict(type="list", elements="int", default=[]),
            rates=dict(type="list", elements="float", default=[]),
            burstiness=dict(type="float", default=1.0),
            max_inflight=dict(type="int", default=0),
            capacity_slo=dict(type="dict", default={}),
            bisections=dict(type="int", default=2),
            workload=dict(type="str", choices=["fixed", "random", "shared_prefix"], default="fixed"),
            range_ratio=dict(type="float", default=0.0),
            prefix_tokens=dict(type="int", default=0, no_log=False),
            input_tokens=dict(type="int", default=1024, no_log=False),
            output_tokens=dict(type="int", default=128, no_log=False),
            ignore_eos=dict(type="bool", default=True),
            prompt_source=dict(type="path", required=True),
            prompt_format=dict(type="str", choices=["text", "jsonl"]),
            words_per_token=dict(type="float", default=0.75, no_log=False),
            prompt_overhead_tokens=dict(type="int", default=0, no_log=False),
            ramp_s=dict(type="float", default=10.0),
            warmup_s=dict(type="float", default=10.0),
            measure_s=dict(type="float", default=60.0),
            measure_max_s=dict(type="float", default=300.0),
            min_requests_per_user=dict(type="float", default=11.0),
            max_requests_per_step=dict(type="int", default=200000),
            request_timeout_s=dict(type="float", default=600.0),
            slo=dict(type="dict", default={}),
            stop_error_rate=dict(type="float"),
            stop_min_good_ratio=dict(type="float", default=0.9),
            metrics_url=dict(type="str"),
            extra_body=dict(type="dict", default={}),
            run_dir=dict(type="path", required=True),
            locustfile=dict(type="path", required=True),
            locust_command=dict(type="list", elements="str"),
            processes=dict(type="int", default=0),
            expect_workers=dict(type="int", default=0),
            master_bind_host=dict(type="str"),
            master_bind_port=dict(type="int"),
            seed=dict(type="int", default=0),
            scheduling=dict(type="str", choices=["normal", "nice", "realtime"], default="normal"),
            cpu_affinity=dict(type="list", elements="int", default=[]),
            validate_certs=dict(type="bool", default=True),
            prepare_only=dict(type="bool", default=False),
            littles_law_tolerance=dict(type="float"),
        ),
        supports_check_mode=True,
    )
    p = dict(module.params)
    for key in ("prompt_source", "locustfile", "run_dir"):
        p[key] = os.path.abspath(p[key])      # Locust runs inside run_dir
    if not p["prompt_format"]:
        p["prompt_format"] = "jsonl" if p["prompt_source"].endswith(".jsonl") else "text"
    unknown_slo = set(p["slo"]) - {"ttft_ms", "tpot_ms", "e2el_ms"}
    problems = benchmark_run.validate(p)
    tolerance = p["littles_law_tolerance"]
    if tolerance is not None and not tolerance > 0:
        problems.append(f"littles_law_tolerance must be above 0; got {tolerance}")
    if p["processes"] and p["expect_workers"]:
        problems.append("use either processes (workers on this host) or expect_workers (workers on other "
                        "hosts), not both")
    usable_cpus = sorted(os.sched_getaffinity(0))
    if any(cpu not in usable_cpus for cpu in p["cpu_affinity"]):
        problems.append(f"cpu_affinity {p['cpu_affinity']} names CPUs this host cannot run on "
                        f"(usable: {usable_cpus}); choose among those or leave it empty")
    if unknown_slo:
        problems.append(f"slo accepts ttft_ms, tpot_ms and e2el_ms; unknown: {', '.join(sorted(unknown_slo))}")
    for key in ("prompt_source", "locustfile"):
        if not os.path.isfile(p[key]):
            problems.append(f"{key} {p[key]} is not a file")
    if problems:
        module.fail_json(msg="benchmark: the run's settings are not usable: " + "; ".join(problems),
                         problems=problems)
    run_dir = p["run_dir"]
    raw_dir = os.path.join(run_dir, "raw")
    cfg = benchmark_run.config(p, raw_dir)
    bounds = benchmark_run.bounds(p)
    plan = {k: cfg[k] for k in ("ladder", "ramp_s", "warmup_s", "measure_s", "measure_max_s",
                                "min_requests_per_user", "max_requests_per_step", "request_timeout_s",
                                "input_tokens", "output_tokens", "api", "target", "slo", "stop_error_rate",
                                "stop_min_good_ratio", "mode", "burstiness", "max_inflight", "limits",
                                "search_bisections")}
    config_path = os.path.join(run_dir, "config.json")
    window_warnings = benchmark_run.window_warnings(p, tolerance)
    result = dict(changed=True, run_dir=run_dir, raw_dir=raw_dir, plan=plan, bounds=bounds, config=config_path,
                  window_warnings=window_warnings, lines=benchmark_run.plan_lines(p, bounds, window_warnings))
    if module.check_mode:
        for warning in window_warnings:
            module.warn(f"benchmark: {warning}")
        module.exit_json(**result)

    if os.path.exists(os.path.join(raw_dir, "master.jsonl")):
        module.fail_json(msg=f"benchmark: {run_dir} already holds a run (raw/master.jsonl); give each run "
                             "its own folder", **result)
    os.makedirs(raw_dir, exist_ok=True)
    atomic_write_text(config_path, json.dumps(cfg, indent=1), 0o644)
    if p["prepare_only"]:
        module.exit_json(**result)

    timeout_bin = module.get_bin_path("timeout", required=True)
    command = p["locust_command"] or [sys.executable, "-m", "locust"]
    log_file = os.path.join(run_dir, "locust.log")
    prefix = [timeout_bin, "--kill-after=30", str(bounds["seconds"])]
    if p["cpu_affinity"]:
        prefix += [module.get_bin_path("taskset", required=True), "--cpu-list",
                   ",".join(str(cpu) for cpu in p["cpu_affinity"])]
    if p["scheduling"] == "realtime":
        prefix += [module.get_bin_path("chrt", required=True), "--rr", "1"]
    elif p["scheduling"] == "nice":
        prefix += [module.get_bin_path("nice", required=True), "-n", "-10"]
    argv = prefix + benchmark_run.locust_argv(
        command, p["locustfile"], log_file, processes=p["processes"], expect_workers=p["expect_workers"],
        master_bind_host=p["master_bind_host"], master_bind_port=p["master_bind_port"],
        stop_timeout=p["request_timeout_s"])
    env = {"MODELSWAP_BENCH_CONFIG": config_path, "MODELSWAP_BENCH_API_KEY": p["api_key"] or "",
           "PYTHONUNBUFFERED": "1"}
    started = time.monotonic()
    rc, out, err = module.run_command(argv, cwd=run_dir, environ_update=env)
    seconds = round(time.monotonic() - started, 3)
    status = benchmark_run.run_status(raw_dir)
    result.update(status=status, seconds=seconds, rc=rc)
    logs = (tail(log_file, 3000) + "\n" + (err or "")[-2000:]).strip()
    if rc in (124, 137):
        module.fail_json(msg=f"benchmark: the load run passed its bound of {bounds['seconds']} s and was "
                             f"stopped (last phase: {status['last_phase']}); raise request_timeout_s or "
                             f"measure_max_s only if the server is that slow. Locust's log: {logs[-1500:]}",
                         **result)
    if not status["started"]:
        module.fail_json(msg=f"benchmark: Locust did not start the ladder (exit {rc}): {logs[-3000:]}",
                         **result)
    if not status["complete"]:
        module.fail_json(msg=f"benchmark: the load run ended before the ladder did (exit {rc}, last phase "
                             f"{status['last_phase']}): {logs[-3000:]}", **result)
    if status["stopped_early"]:
        module.warn(f"benchmark stopped early: {status['stopped_early']}")
    module.exit_json(**result)


if __name__ == "__main__":
    main()
