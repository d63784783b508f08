# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0
"""Where a vLLM start-up went, by phase, from vLLM's own log lines.

A swap's downtime per host is vLLM's start: Python imports and the configuration, the engine and
worker processes, the weights, the engine's initialisation (memory profile, KV cache,
torch.compile, graph capture, warm-up), the API server, the first token. vLLM logs a line at the
end of each (the same lines on CPU and GPU, one per worker for the weights); their times in the
unit's journal (``journalctl --output short-unix``: epoch seconds first) split the start into
phases, and the durations vLLM prints itself (weights, compilation, graph capture) are kept
beside them. A line that is missing (another vLLM version, a log level above INFO) leaves its
phase out rather than guessing.
"""
from __future__ import annotations

import re

# (milestone, the line that marks it, which match counts): "first" for the start of a step,
# "last" where every worker logs the same line (the step ends with the slowest).
MILESTONES = (
    ("engine_configured", re.compile(r"Initializing a V1 LLM engine"), "first"),
    ("model_load_started", re.compile(r"Starting to load model "), "first"),
    ("weights_loaded", re.compile(r"(?:Loading weights|Model loading) took "), "last"),
    ("engine_ready", re.compile(r"init engine \(profile, create kv cache, warmup model\) took "), "first"),
    ("api_listening", re.compile(r"Starting vLLM server on |Application startup complete"), "first"),
)
# (phase, from milestone, to milestone); "process_started" is the unit's main process start and
# "ready" the first one-token completion (vllm_ready's last gate).
PHASES = (
    ("imports_and_config_s", "process_started", "engine_configured"),
    ("engine_and_workers_s", "engine_configured", "model_load_started"),
    ("weights_s", "model_load_started", "weights_loaded"),
    ("engine_init_s", "weights_loaded", "engine_ready"),
    ("api_server_s", "engine_ready", "api_listening"),
    ("first_token_s", "api_listening", "ready"),
)
# What vLLM reports itself, seconds (the largest where each worker says it).
REPORTED = (
    ("weights_s", re.compile(r"Model loading took [\d.]+ GiB memory and ([\d.]+) seconds"
                             r"|Loading weights took ([\d.]+) seconds")),
    ("engine_init_s", re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s")),
    ("compile_s", re.compile(r"\(compilation: ([\d.]+) s")),
    ("graph_capture_s", re.compile(r"Graph capturing finished in ([\d.]+) secs")),
)
_UNIX_LINE = re.compile(r"^(?P<epoch>\d+(?:\.\d+)?) (?P<body>.*)$")
# A line just before the start belongs to the process before it (its stop).
_EARLY_S = 0.5


def _timed(lines, started_epoch):
    for line in lines or ():
        match = _UNIX_LINE.match(str(line))
        if not match:
            continue
        epoch = float(match.group("epoch"))
        if epoch >= started_epoch - _EARLY_S:
            yield epoch, match.group("body")


def startup_phases(lines, started_epoch, ready_epoch=None) -> dict:
    """The start-up's milestones (seconds after the main process started), its phases (seconds
    each; absent when a line is missing), what vLLM reported, and the total to ``ready_epoch``.

    ``lines``: the unit's journal since the start, ``short-unix`` (``<epoch> <host> <id>: <text>``);
    ``started_epoch``: when the unit's main process started; ``ready_epoch``: when it answered.
    """
    started_epoch = float(started_epoch)
    at = {"process_started": 0.0}
    reported = {}
    for epoch, body in _timed(lines, started_epoch):
        offset = round(epoch - started_epoch, 3)
        for name, pattern, which in MILESTONES:
            if pattern.search(body) and (which == "last" or name not in at):
                at[name] = offset
        for name, pattern in REPORTED:
            match = pattern.search(body)
            if match:
                seconds = float(next(g for g in match.groups() if g is not None))
                reported[name] = max(seconds, reported.get(name, 0.0))
    if ready_epoch is not None:
        at["ready"] = round(float(ready_epoch) - started_epoch, 3)
    phases = {}
    for name, begin, end in PHASES:
        if begin in at and end in at and at[end] >= at[begin]:
            phases[name] = round(at[end] - at[begin], 2)
    return {"milestones": at, "phases": phases, "reported": reported,
            "total_s": at.get("ready")}
