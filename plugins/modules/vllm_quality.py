#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: (c) 2026, modelswap engineers
# Apache License 2.0 (see https://www.apache.org/licenses/LICENSE-2.0.txt)
# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

DOCUMENTATION = r"""
---
module: vllm_quality
short_description: Check that a vLLM server answers like a known-good deployment of its model
version_added: "0.2.0"
description:
  - The quality gate of a swap, run after the readiness gates and before the host rejoins its pool. It
    asks the O(settings) prompts over C(/v1/completions) with greedy decoding (temperature 0) and one
    log-probability per token, and keeps per prompt the tokens, their log-probabilities and the text
    (the fingerprint).
  - With O(reference) (the fingerprint of an earlier deployment that passed, RV(document) of that run)
    it checks the share of the reference's tokens reproduced in order (C(token_agreement), each prompt
    counted up to its first differing token) and the mean difference of the agreeing tokens'
    log-probabilities (C(logprob_delta)). Prompts with an C(expect) text are checked in every case
    (C(expected_answers)).
  - Fails, naming each failed check with its value and limit and the first prompt that went another
    way, when a check is below its limit; fails too when the reference was taken with other prompts
    or C(max_tokens), or the server does not answer within C(timeout_s).
  - Without O(reference) only expected answers are checked; RV(document) is what a caller records as
    the reference (the vllm_service role writes it on the controller once the deployment passed).
  - Sends only inference requests; changes nothing.
extends_documentation_fragment:
  - modelswap.vllm.attributes.read_only
  - ansible.builtin.action_common_attributes
options:
  host:
    description: Address of the server (on its own host, loopback).
    type: str
    default: 127.0.0.1
  port:
    description: The server's port.
    type: int
    required: true
  served_model_name:
    description: The model name the server serves (the requests' C(model)).
    type: str
    required: true
  api_key_file:
    description: The unit's EnvironmentFile holding C(VLLM_API_KEY) (read on the host, never returned).
    type: path
  settings:
    description:
      - The catalog entry's C(quality), its defaults filled in here - C(prompts) (prompt
        strings or C({prompt, expect})), C(max_tokens), C(min_token_agreement), C(max_logprob_delta),
        C(min_answer_share), C(timeout_s), C(reference).
    type: dict
    required: true
  reference:
    description: The reference fingerprint to compare with (RV(document) of a deployment that passed), as
      a mapping or as the text of its file; omitted or empty when none is recorded yet.
    type: raw
  reference_path:
    description: Where the reference is kept, named in the messages that ask to remove it.
    type: str
    default: ""
  identity:
    description: What RV(document) says was deployed - C(name), C(repo_id), C(commit),
      C(served_model_name), C(host).
    type: dict
    default: {}
author:
  - modelswap engineers (@modelswap)
"""

EXAMPLES = r"""
- name: Check the new server's answers against the reference of its catalog entry
  modelswap.vllm.vllm_quality:
    port: 8000
    served_model_name: kimi-k2.5
    api_key_file: /etc/modelswap/vllm.secret.env
    settings: "{{ (modelswap_models | modelswap.vllm.catalog_entry('kimi-k2.5-int4')).quality }}"
    reference: "{{ lookup('ansible.builtin.file', 'results/quality/kimi-k2.5-int4.json') }}"
    identity: {name: kimi-k2.5-int4, repo_id: moonshotai/Kimi-K2.5, commit: "{{ commit }}", host: "{{ inventory_hostname }}"}
  become: true
"""

RETURN = r"""
passed:
  description: Whether every check passed.
  returned: always
  type: bool
checks:
  description: Each check - C(check) (C(expected_answers), C(token_agreement), C(logprob_delta)), C(value),
    C(limit), C(passed) and C(detail) (the first prompt that went another way, or missed its expected text).
  returned: always
  type: list
  elements: dict
  sample: [{"check": "token_agreement", "value": 0.0625, "limit": 0.75, "passed": false,
            "detail": "prompt 1 ('The capital of France is') went another way at token 1: 'ĠA' where the reference has 'Ġthe'"}]
failed_checks:
  description: The names of the checks that failed.
  returned: always
  type: list
  elements: str
reference:
  description: Where the reference compared with came from (host, repo, commit, vLLM version, time); null without one.
  returned: always
  type: dict
vllm_version:
  description: The server's vLLM version (C(GET /version)); null when it does not say.
  returned: always
  type: str
document:
  description: This deployment's fingerprint with the settings it was asked with and where it came
    from - what is recorded as the reference when none exists yet.
  returned: when the server answered every prompt
  type: dict
message:
  description: The verdict in one sentence.
  returned: always
  type: str
seconds:
  description: How long the evaluation took.
  returned: always
  type: float
"""

import time

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.modelswap.vllm.plugins.module_utils.common.quality_settings import quality_problems, quality_settings
from ansible_collections.modelswap.vllm.plugins.module_utils.serving import vllm_quality
from ansible_collections.modelswap.vllm.plugins.module_utils.serving.vllm_gates import request_json
from ansible_collections.modelswap.vllm.plugins.module_utils.serving.vllm_ready import api_key_from_file, base_url
from ansible_collections.modelswap.vllm.plugins.module_utils.serving.vllm_unit_state import ReadyError


def main():
    module = AnsibleModule(
        argument_spec=dict(
            host=dict(type="str", default="127.0.0.1"),
            port=dict(type="int", required=True),
            served_model_name=dict(type="str", required=True),
            api_key_file=dict(type="path"),
            settings=dict(type="dict", required=True),
            reference=dict(type="raw"),
            reference_path=dict(type="str", default=""),
            identity=dict(type="dict", default={}),
        ),
        supports_check_mode=True,
    )
    p = module.params
    problems = quality_problems(p["settings"])
    if problems:
        module.fail_json(msg="vllm_quality: settings: %s" % "; ".join(problems))
    settings = quality_settings(p["identity"].get("name") or "", p["settings"])
    started = time.monotonic()
    result = {"passed": False, "checks": [], "failed_checks": [], "reference": None, "vllm_version": None}
    try:
        reference = vllm_quality.parse_reference(p["reference"], p["reference_path"])
        api_key = api_key_from_file(p["api_key_file"]) if p["api_key_file"] else None
        if api_key:
            module.no_log_values.add(api_key)
        problem = vllm_quality.comparable_problem(settings, reference, p["reference_path"]) if reference else ""
        if problem:
            module.fail_json(msg=problem, seconds=0.0, **result)
        base = base_url({"scheme": "http", "host": p["host"], "port": p["port"]})
        result["vllm_version"] = vllm_quality.server_version(base, request_json)
        answers = vllm_quality.ask(settings, base, p["served_model_name"], api_key, request_json,
                                   clock=time.monotonic, deadline=started + float(settings["timeout_s"]))
    except (ReadyError, vllm_quality.QualityError, KeyError, TypeError, ValueError) as exc:
        module.fail_json(msg="quality gate: %s" % exc, seconds=round(time.monotonic() - started, 3), **result)
    verdict = vllm_quality.judge(settings, answers, reference)
    result.update(passed=verdict["passed"], checks=verdict["checks"], failed_checks=verdict["failed"],
                  reference=vllm_quality.reference_identity(reference),
                  document=vllm_quality.reference_document(settings, answers, p["identity"],
                                                           vllm_version=result["vllm_version"],
                                                           recorded_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())),
                  message=vllm_quality.verdict_message(verdict, reference),
                  seconds=round(time.monotonic() - started, 3))
    if not verdict["passed"]:
        module.fail_json(msg=result["message"], **result)
    module.exit_json(changed=False, **result)


if __name__ == "__main__":
    main()
