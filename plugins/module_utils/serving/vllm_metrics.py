# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0 (see galaxy.yml)
"""vLLM's Prometheus text (`/metrics`), read one way by the probe and by the load generator.

Standard library only: the benchmark role ships this file beside the locustfile to load hosts
that have Locust but not this collection (roles/benchmark/files/vllm_metrics.py links here).
"""
from __future__ import annotations

import re

LABEL = re.compile(r'(\w+)="([^"]*)"')


def parse_metrics(text, model=None):
    """({metric name: value summed over label sets}, labels of vllm:cache_config_info) of the
    `vllm:` samples in ``text``; samples labelled with another model_name than ``model`` are left
    out (one server may serve several names; engines of one model are summed)."""
    values, cache_config = {}, {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name, brace, rest = line.partition("{")
        labels = ""
        if brace:
            labels, _unused, value = rest.rpartition("}")
        else:
            name, _unused, value = line.partition(" ")
        if model and 'model_name="' in labels and f'model_name="{model}"' not in labels:
            continue
        if name == "vllm:cache_config_info":
            cache_config.update(dict(LABEL.findall(labels)))
            continue
        try:
            sample = float(value.split()[0])
        except (ValueError, IndexError):
            continue
        values[name] = values.get(name, 0.0) + sample
    return values, cache_config
