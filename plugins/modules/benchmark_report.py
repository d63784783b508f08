#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: (c) 2026, modelswap engineers
# Apache License 2.0 (see https://www.apache.org/licenses/LICENSE-2.0.txt)
# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

DOCUMENTATION = r"""
---
module: benchmark_report
short_description: Turn a benchmark run's raw records into a report that compares 1:1 with vllm bench serve
version_added: "0.1.0"
description:
  - Reads the raw per-request records that M(modelswap.vllm.benchmark_run) left in
    O(run_dir)C(/raw) and computes, per concurrency step, vLLM's metrics exactly as
    C(vllm bench serve) defines them (TTFT, TPOT, per-chunk ITL, E2E latency with mean, median,
    p90, p99 and std; request, output-token and total-token throughput; goodput under SLOs;
    errors by kind), the concurrency the server really had (C(vllm:num_requests_running) +
    C(vllm:num_requests_waiting)), its KV-cache use, and the load generator's CPU and event-loop
    lag.
  - Flags a step as invalid, rather than reporting it as the server's, when the client was
    saturated (CPU, loop lag), the offered concurrency never arrived (server or client count),
    Little's law does not hold (throughput x mean E2EL differs from the concurrency), or the
    ramp did not finish. Finds the saturation knee among the valid steps.
  - Checks that the client's token counts agree with the server's counters for the run.
  - Compares with the previous complete run of the same O(model) on the same O(host) under
    O(results_root) (better / worse / same, by how much).
  - Writes O(run_dir)C(/report.json) (versioned schema C(modelswap.benchmark/v1)),
    C(steps.csv), C(report.md) and the plots C(throughput.png) and C(latency.png); a file whose
    content would not change is not rewritten.
extends_documentation_fragment:
  - modelswap.vllm.attributes.read_only
  - ansible.builtin.action_common_attributes
options:
  run_dir:
    description: The run's folder (it holds C(raw/)); the report is written here.
    type: path
    required: true
  results_root:
    description: The results tree, C(<results_root>/<host>/<model>/<commit>/<run>), searched for
      the previous run. No comparison without it.
    type: path
  host:
    description: The benchmarked host (inventory name).
    type: str
    required: true
  model:
    description: The model's name as the results tree keys it.
    type: str
    required: true
  commit:
    description: The model's commit (revision) the server runs, when known.
    type: str
  target:
    description: The URL that was benchmarked.
    type: str
  deployment:
    description: The deployment record (model, commit, vLLM version, flags, ...), stored in the report.
    type: dict
    default: {}
  checks:
    description:
      - Thresholds of the validity checks, overriding the defaults - C(client_cpu_max) (0.85),
        C(client_lag_p99_max_ms) (5.0), C(client_lag_mean_max_ms) (1.5),
        C(client_lag_relative_max) (0.025), C(concurrency_min_ratio) (0.9), C(outside_engine_max_ms) (50),
        C(littles_law_tolerance) (0.1), C(knee_fraction) (0.9), C(knee_min_efficiency) (0.5),
        C(prefix_hit_max) (0.05), C(min_requests_per_user) (3).
    type: dict
    default: {}
  compare:
    description: Compare with the previous run.
    type: bool
    default: true
  noise:
    description: Relative changes up to this are reported as the same.
    type: float
    default: 0.05
  plots:
    description: Draw the PNG plots (needs matplotlib on the controller).
    type: bool
    default: true
attributes:
  check_mode:
    support: full
    details:
      - Computes the report and returns its summary; writes nothing.
requirements:
  - matplotlib for the plots (optional; without it the report says they were skipped)
author:
  - modelswap engineers (@modelswap)
"""

EXAMPLES = r"""
- name: Write the report of a run
  modelswap.vllm.benchmark_report:
    run_dir: /srv/results/gpu01/kimi-k2.5/3f1c.../20261202T120000Z
    results_root: /srv/results
    host: gpu01
    model: kimi-k2.5
    commit: 3f1c...
    deployment: "{{ probe.deployment | combine(benchmark_deployment) }}"
  delegate_to: localhost
"""

RETURN = r"""
files:
  description: The report's files (absolute paths).
  returned: always
  type: list
  elements: str
written:
  description: The files whose content changed (in check mode, would change).
  returned: always
  type: list
  elements: str
summary:
  description: Per step - concurrency (or a rate ladder's rate and its SLO verdict), valid, flags, request and output throughput, TTFT/TPOT/ITL/E2EL
    medians and p99s, error rate, server concurrency.
  returned: always
  type: list
  elements: dict
saturation:
  description: The knee (lowest concurrency reaching 90 % of the peak output throughput among valid
    steps), the peak, and the efficiency between steps.
  returned: always
  type: dict
tokens:
  description: Client usage totals against the server's token counters for the run.
  returned: always
  type: dict
stopped_early:
  description: Why the ladder stopped before its last step, or null.
  returned: always
  type: str
comparison:
  description: The previous run compared (id, headline, counts of better/worse/same), or null.
  returned: always
  type: dict
capacity:
  description:
    - A rate ladder with an SLO - the highest rate that met it below every rate that did not (C(rate)), the
      lowest that did not (C(first_failing_rate)), the SLO in words, and whether every rate offered passed
      (C(above_every_rate)) or none did (C(below_every_rate)); null otherwise.
  returned: always
  type: dict
headline:
  description: The capacity in one sentence (C(gpu1 holds 12 req/s at TTFT p99 <= 2 s, ITL p99 <= 80 ms)), or null.
  returned: always
  type: str
lines:
  description: One readable line per step, then the knee or the capacity (and the stop reason).
  returned: always
  type: list
  elements: str
plots_error:
  description: Why plots are missing, or null.
  returned: always
  type: str
"""

import os

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.modelswap.vllm.plugins.module_utils.bench import benchmark_report
from ansible_collections.modelswap.vllm.plugins.module_utils.bench import bench_stats


def summary(report):
    rows = []
    for s in report["steps"]:
        rows.append({
            "concurrency": s["concurrency"], "rate": (s.get("rate") or {}).get("offered"), "valid": s["valid"],
            "slo_passed": (s.get("slo_verdict") or {}).get("passed"),
            "flags": [f["code"] for f in s["flags"]],
            "request_throughput": s["request_throughput"], "output_throughput": s["output_throughput"],
            "ttft_ms_median": s["ttft_ms"]["median"], "ttft_ms_p99": s["ttft_ms"]["p99"],
            "tpot_ms_median": s["tpot_ms"]["median"], "itl_ms_p99": s["itl_ms"]["p99"],
            "e2el_ms_median": s["e2el_ms"]["median"], "error_rate": s["error_rate"],
            "server_concurrency": (s["server"] or {}).get("concurrency_mean")})
    return rows


def lines(report):
    """One readable line per step, and the verdict (for the play's output)."""
    out = []
    for s in report["steps"]:
        def f(v, d=1):
            return "-" if v is None else f"{v:,.{d}f}"
        line = (f"{benchmark_report.load_label(s):<11} {'valid  ' if s['valid'] else 'INVALID'} "
                f"out {f(s['output_throughput'])} tok/s, {f(s['request_throughput'], 2)} req/s, "
                f"TTFT p50/p99 {f(s['ttft_ms']['median'])}/{f(s['ttft_ms']['p99'])} ms, "
                f"TPOT p50 {f(s['tpot_ms']['median'])} ms, ITL p99 {f(s['itl_ms']['p99'])} ms, "
                f"E2EL p50 {f(s['e2el_ms']['median'], 0)} ms, errors {f((s['error_rate'] or 0) * 100)}%, "
                f"server C {f((s['server'] or {}).get('concurrency_mean'))}")
        if s["flags"]:
            line += " [" + ", ".join(fl["code"] for fl in s["flags"]) + "]"
        out.append(line)
    sat = report["saturation"]
    if report.get("headline"):
        out.append(report["headline"])
    elif report["run"]["settings"].get("mode") == "rate":
        out.append("rates only: no SLO, no capacity searched")
    elif sat.get("knee_concurrency") is not None:
        out.append(f"knee at C={sat['knee_concurrency']}; peak {sat['peak_throughput']:,.1f} tok/s at "
                   f"C={sat['peak_concurrency']}")
    else:
        out.append(f"no knee: {sat['reason']}")
    if report["run"]["stopped_early"]:
        out.append(f"stopped early: {report['run']['stopped_early']}")
    return out


def main():
    module = AnsibleModule(
        argument_spec=dict(
            run_dir=dict(type="path", required=True),
            results_root=dict(type="path"),
            host=dict(type="str", required=True),
            model=dict(type="str", required=True),
            commit=dict(type="str"),
            target=dict(type="str"),
            deployment=dict(type="dict", default={}),
            checks=dict(type="dict", default={}),
            compare=dict(type="bool", default=True),
            noise=dict(type="float", default=0.05),
            plots=dict(type="bool", default=True),
        ),
        supports_check_mode=True,
    )
    p = module.params
    run_dir = os.path.abspath(p["run_dir"])
    raw_dir = os.path.join(run_dir, "raw")
    unknown = set(p["checks"]) - set(bench_stats.DEFAULT_CHECKS)
    if unknown:
        module.fail_json(msg=f"benchmark report: unknown checks {', '.join(sorted(unknown))}; known: "
                             f"{', '.join(sorted(bench_stats.DEFAULT_CHECKS))}")
    if not os.path.isdir(raw_dir):
        module.fail_json(msg=f"benchmark report: {raw_dir} does not exist: run modelswap.vllm.benchmark_run "
                             "with this run_dir first")
    try:
        analysis = bench_stats.analyze(bench_stats.load_raw(raw_dir), checks=p["checks"])
    except ValueError as exc:
        module.fail_json(msg=f"benchmark report: cannot read the run in {raw_dir}: {exc}")
    previous = None
    if p["compare"] and p["results_root"]:
        previous = benchmark_report.find_previous(p["results_root"], p["host"], p["model"], run_dir, analysis["started_wall"])
    report = benchmark_report.build(analysis, run_id=os.path.basename(run_dir), host=p["host"], model=p["model"],
                                    commit=p["commit"], target=p["target"] or analysis["config"].get("target"),
                                    deployment=p["deployment"], previous=previous, noise=p["noise"])
    files, plots_error = benchmark_report.plan_files(report, plots=p["plots"], previous_doc=previous[0] if previous else None)
    written = benchmark_report.changed_files(run_dir, files)
    if written and not module.check_mode:
        benchmark_report.write_files(run_dir, files, written)
    if plots_error and p["plots"]:
        module.warn(f"benchmark report: plots skipped: {plots_error}")
    cmp = report["comparison"]
    module.exit_json(
        changed=bool(written), files=[os.path.join(run_dir, n) for n in sorted(files)],
        written=[os.path.join(run_dir, n) for n in written], summary=summary(report),
        saturation=report["saturation"], tokens=report["tokens"], stopped_early=report["run"]["stopped_early"],
        comparison=None if cmp is None else {k: cmp[k] for k in ("previous_run", "previous_path", "headline",
                                                                 "summary")},
        capacity=report.get("capacity"), headline=report.get("headline"),
        plots_error=plots_error, lines=lines(report))


if __name__ == "__main__":
    main()
