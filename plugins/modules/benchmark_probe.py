#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: (c) 2026, modelswap engineers
# Apache License 2.0 (see https://www.apache.org/licenses/LICENSE-2.0.txt)
# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

DOCUMENTATION = r"""
---
module: benchmark_probe
short_description: Check an OpenAI-compatible server before a benchmark puts load on it
version_added: "0.1.0"
description:
  - The benchmark role's preflight, run on the load generator (the controller by default). It
    proves, before any load starts, that the server at O(url) is reachable, accepts O(api_key),
    serves O(model) (C(GET /v1/models)) and completes a one-token request on the chosen O(api);
    otherwise it fails with a message that says which of these broke and what to set.
  - It measures the server tokenizer's words per token and the prompt overhead (chat template)
    with two one-token requests of different lengths, so the benchmark can cut prompts of the
    asked token length from natural text.
  - It reads what the server tells about its deployment (vLLM version from C(/version), the
    model root, which for a Hugging Face snapshot path names the commit, C(max_model_len), the
    cache settings of C(vllm:cache_config_info)) and whether C(/metrics) carries vLLM's
    concurrency gauges.
  - With O(input_tokens) and O(output_tokens) it fails when prompt plus output exceed the
    server's context length.
extends_documentation_fragment:
  - modelswap.vllm.attributes.read_only
  - ansible.builtin.action_common_attributes
  - modelswap.vllm.benchmark_target
options:
  timeout:
    description: Seconds to wait for each answer.
    type: float
    default: 30
  validate_certs:
    description: Verify TLS certificates for C(https) URLs.
    type: bool
    default: true
  calibration_text:
    description:
      - A natural-text file whose words make the calibration prompts (the benchmark's prompt
        source). Without it, one readiness request is sent and no calibration is returned.
    type: path
  metrics:
    description: Read C(/metrics) (vLLM's Prometheus endpoint).
    type: bool
    default: true
  input_tokens:
    description: The benchmark's prompt length in tokens (checked against C(max_model_len)).
    type: int
  output_tokens:
    description: The benchmark's output length in tokens (checked against C(max_model_len)).
    type: int
attributes:
  check_mode:
    support: full
    details:
      - It only reads and sends one-token completions; it runs the same in check mode.
notes:
  - C(/metrics) and C(/version) are read without the key; vLLM's own key check leaves them open,
    and so does the vllm_service role's route guard (its open probes).
author:
  - modelswap engineers (@modelswap)
"""

EXAMPLES = r"""
- name: Check the server and calibrate prompts before the benchmark
  modelswap.vllm.benchmark_probe:
    url: http://10.0.0.5:8000
    model: kimi-k2.5
    api_key: "{{ vllm_service_api_key }}"   # the key the vllm_service role set
    calibration_text: "{{ role_path }}/files/prompts.txt"
    input_tokens: 1024
    output_tokens: 128
  delegate_to: localhost
  register: probe
"""

RETURN = r"""
version:
  description: The server's version from C(/version), or null.
  returned: always
  type: str
  sample: 0.32.0
served:
  description: The model's entry in C(/v1/models).
  returned: always
  type: dict
  sample: {"id": "tiny-a", "root": "/var/lib/modelswap/hf/hub/models--lab--tiny-a/snapshots/3f1c...", "max_model_len": 512}
calibration:
  description: Words per token and the prompt overhead in tokens, with the measured samples
    [words, prompt_tokens]; null without O(calibration_text).
  returned: always
  type: dict
  sample: {"words_per_token": 0.62, "overhead_tokens": 14, "samples": [[40, 79], [160, 272]], "fallback": false}
deployment:
  description: What the server says about its deployment.
  returned: always
  type: dict
  sample: {"served_model_name": "tiny-a", "model_root": "/.../snapshots/3f1c...", "commit": "3f1c...",
           "max_model_len": 512, "vllm_version": "0.32.0", "cache_config": {"block_size": "16"}}
metrics_available:
  description: C(/metrics) answered with vLLM's C(vllm:num_requests_running).
  returned: always
  type: bool
metrics_error:
  description: Why C(/metrics) cannot confirm server concurrency, or null.
  returned: always
  type: str
"""

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.urls import open_url
from ansible.module_utils.six.moves.urllib.error import HTTPError
from ansible_collections.modelswap.vllm.plugins.module_utils.bench import benchmark_probe


def make_fetch(validate_certs):
    def fetch(method, url, body, headers, timeout):
        try:
            resp = open_url(url, method=method, data=body, headers=headers, timeout=timeout,
                            validate_certs=validate_certs, follow_redirects="safe")
            return resp.getcode(), resp.read()
        except HTTPError as exc:
            return exc.code, exc.read() if exc.fp is not None else b""
        except OSError:
            raise
        except Exception as exc:  # ansible's urls raise their own errors for TLS and proxies
            raise OSError(str(exc)) from exc
    return fetch


def main():
    module = AnsibleModule(
        argument_spec=dict(
            **benchmark_probe.TARGET_ARGS,
            timeout=dict(type="float", default=30.0),
            validate_certs=dict(type="bool", default=True),
            calibration_text=dict(type="path"),
            metrics=dict(type="bool", default=True),
            input_tokens=dict(type="int", no_log=False),
            output_tokens=dict(type="int", no_log=False),
        ),
        supports_check_mode=True,
    )
    p = module.params
    if not p["url"].startswith(("http://", "https://")):
        module.fail_json(msg=f"benchmark preflight: url '{p['url']}' is not an http(s) URL; set benchmark_url "
                             "to e.g. http://HOST:8000")
    text = None
    if p["calibration_text"]:
        try:
            with open(p["calibration_text"], encoding="utf-8") as fh:
                text = fh.read()
        except OSError as exc:
            module.fail_json(msg=f"benchmark preflight: cannot read the prompt source {p['calibration_text']}: "
                                 f"{exc}")
        if p["calibration_text"].endswith(".jsonl"):
            text = None        # a user's JSONL is sent as it is: no word calibration
    try:
        facts = benchmark_probe.probe(make_fetch(p["validate_certs"]), p["url"], p["model"], api=p["api"],
                                      api_key=p["api_key"], timeout=p["timeout"], calibration_text=text,
                                      metrics=p["metrics"])
    except benchmark_probe.ProbeError as exc:
        module.fail_json(msg=exc.message, kind=exc.kind)
    dep = facts["deployment"]
    if p["input_tokens"] is not None and p["output_tokens"] is not None:
        problem = benchmark_probe.check_lengths(p["input_tokens"], p["output_tokens"], dep.get("max_model_len"))
        if problem:
            module.fail_json(msg=f"benchmark preflight: {problem}", kind="length", deployment=dep)
    if facts["metrics_error"]:
        module.warn(f"benchmark: {facts['metrics_error']}; steps cannot be checked against the server's "
                    "own count of running requests")
    module.exit_json(changed=False, version=facts["version"], served=facts["model"],
                     calibration=facts["calibration"], deployment=dep,
                     metrics_available=facts["metrics_error"] is None and bool(facts["metrics"]),
                     metrics_error=facts["metrics_error"])


if __name__ == "__main__":
    main()
