# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0 (see galaxy.yml)
"""The model store and the served model, as disk_plan and model_purge both read them."""
from __future__ import annotations


class ModuleDocFragment:
    DOCUMENTATION = r"""
options:
  cache_dir:
    description:
      - The Hugging Face hub cache (the folder holding C(models--org--name) folders, e.g.
        C(~/.cache/huggingface/hub)).
      - At least one of O(cache_dir) and O(models_dir) is required.
    type: path
  models_dir:
    description:
      - A folder whose sub-directories are plain model directories (each one an item as a whole).
    type: path
  models:
    description:
      - The model catalog, name to C({repo_id, revision, allow_patterns,
        ignore_patterns, ...}). Catalog names in the other options are looked up in it.
    type: dict
    default: {}
  keep:
    description:
      - Catalog names never to purge (fallback models).
    type: list
    elements: str
    default: []
  served:
    description:
      - Catalog name of the model the host serves, in addition to what O(deployment_record) and
        O(vllm_unit) say. Protected like them.
    type: str
  deployment_record:
    description:
      - The host's deployment record (JSON with C(model), C(repo_id), C(commit), C(path)), written by
        the vllm_service role. A missing file is fine; a malformed one is an error.
    type: path
    default: /var/lib/modelswap/deployment.json
  vllm_unit:
    description:
      - The systemd unit that runs vLLM. The model in its C(ExecStart) is protected as served.
        Empty to skip.
    type: str
    default: vllm.service
  protect_paths:
    description:
      - Extra paths never to purge (and whatever contains them).
    type: list
    elements: path
    default: []
  scan_workers:
    description:
      - Threads that scan cache repos. One is fastest on a warm page cache; more help on a cold cache
        of a slow or network disk (measured, 50k files cold, 8 threads - 7.1 s down to 4.0 s).
    type: int
    default: 1
"""
