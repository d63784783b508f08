# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0 (see galaxy.yml)
"""The server a benchmark talks to, as benchmark_probe and benchmark_run both take it."""
from __future__ import annotations


class ModuleDocFragment:
    DOCUMENTATION = r"""
options:
  url:
    description: Base URL of the server, without C(/v1), e.g. C(http://10.0.0.5:8000).
    type: str
    required: true
  model:
    description: The served model name (vLLM's C(--served-model-name)).
    type: str
    required: true
  api:
    description: C(chat) uses C(/v1/chat/completions), C(completions) uses C(/v1/completions).
    type: str
    choices: [chat, completions]
    default: chat
  api_key:
    description:
      - The server's API key, sent as a Bearer token. Never logged, written or returned
        (benchmark_run hands it to Locust in its environment).
    type: str
"""
