# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0
"""A catalog entry's quality gate settings (``quality:``): what they may hold, their defaults.

The gate (serving/vllm_quality.py, module vllm_quality) asks the new server a fixed set of
prompts with greedy decoding before it rejoins its pool, and compares the answers with the
entry's reference fingerprint (recorded at the first deployment that passed) and with expected
answers where a prompt has one::

    quality:
      prompts:                       # default: DEFAULT_PROMPTS
        - "The capital of France is"
        - {prompt: "2 + 2 =", expect: "4"}
      max_tokens: 16                 # tokens per answer (greedy)
      min_token_agreement: 0.75      # share of the reference's tokens reproduced, in order
      max_logprob_delta: 0.3         # mean |log-probability difference| of the agreeing tokens
      min_answer_share: 1.0          # share of the prompts with `expect` whose answer holds it
      timeout_s: 120                 # the whole evaluation's budget
      reference: kimi-k2.5-int4      # whose fingerprint to compare with (default: this entry's)

An entry without ``quality`` has no gate. Pure functions.
"""
from __future__ import annotations

import numbers

DEFAULT_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "1, 2, 3, 5, 8, 13,",
)
DEFAULTS = {"max_tokens": 16, "min_token_agreement": 0.75, "max_logprob_delta": 0.3, "min_answer_share": 1.0,
            "timeout_s": 120}
KEYS = ("prompts", "reference") + tuple(DEFAULTS)
MAX_TOKENS_LIMIT = 256
MAX_PROMPTS = 64


def _number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _prompt_problem(i: int, item) -> str:
    if isinstance(item, str) and item:
        return ""
    if isinstance(item, dict):
        unknown = sorted(set(map(str, item)) - {"prompt", "expect"})
        if unknown:
            return "quality.prompts[%d] has unknown key(s) %s (it takes prompt and expect)" % (i, ", ".join(unknown))
        if not isinstance(item.get("prompt"), str) or not item.get("prompt"):
            return "quality.prompts[%d] needs a non-empty prompt string" % i
        if item.get("expect") is not None and (not isinstance(item["expect"], str) or not item["expect"]):
            return "quality.prompts[%d].expect must be a non-empty string (a text the answer contains)" % i
        return ""
    return ("quality.prompts[%d] must be a prompt string or {prompt: ..., expect: ...}, got %r"
            % (i, item))


def quality_problems(value, names=None) -> list:
    """Why a catalog entry's ``quality`` is unusable, one sentence each (empty: usable or absent).
    ``names``: the catalog's names, which ``reference`` must be one of (None: not checked)."""
    if value is None:
        return []
    if not isinstance(value, dict):
        return ["quality must be a mapping such as {min_token_agreement: 0.75} ({} takes the defaults), got %r"
                % (value,)]
    problems = []
    unknown = sorted(set(map(str, value)) - set(KEYS))
    if unknown:
        problems.append("quality has unknown key(s) %s (it takes %s)" % (", ".join(unknown), ", ".join(KEYS)))
    prompts = value.get("prompts")
    if prompts is not None:
        if not isinstance(prompts, list) or not prompts or len(prompts) > MAX_PROMPTS:
            problems.append("quality.prompts must be a list of 1-%d prompts, got %r" % (MAX_PROMPTS, prompts))
        else:
            problems.extend(p for p in (_prompt_problem(i, item) for i, item in enumerate(prompts)) if p)
    tokens = value.get("max_tokens")
    if tokens is not None and (not isinstance(tokens, int) or isinstance(tokens, bool)
                               or not 1 <= tokens <= MAX_TOKENS_LIMIT):
        problems.append("quality.max_tokens must be a whole number of tokens from 1 to %d, got %r"
                        % (MAX_TOKENS_LIMIT, tokens))
    for key in ("min_token_agreement", "min_answer_share"):
        share = value.get(key)
        if share is not None and (not _number(share) or not 0 <= share <= 1):
            problems.append("quality.%s must be a share from 0 to 1 (0.75 is 75 %%), got %r" % (key, share))
    delta = value.get("max_logprob_delta")
    if delta is not None and (not _number(delta) or delta < 0):
        problems.append("quality.max_logprob_delta must be a number of nats >= 0 (0.3 is the default), got %r"
                        % (delta,))
    timeout = value.get("timeout_s")
    if timeout is not None and (not _number(timeout) or timeout <= 0):
        problems.append("quality.timeout_s must be a number of seconds > 0, got %r" % (timeout,))
    reference = value.get("reference")
    if reference is not None:
        if not isinstance(reference, str) or not reference:
            problems.append("quality.reference must be a catalog name, got %r" % (reference,))
        elif names is not None and reference not in names:
            problems.append("quality.reference %r is not in the catalog (it has %s)"
                            % (reference, ", ".join(sorted(map(str, names)))))
    return problems


def quality_settings(name: str, value):
    """The gate's settings with their defaults (None: the entry has no gate). Call after
    quality_problems found nothing. Prompts become [{"prompt", "expect"}] (expect None when the
    prompt has none); ``reference`` is the catalog name whose fingerprint is compared."""
    if value is None:
        return None
    out = dict(DEFAULTS)
    out.update((k, value[k]) for k in DEFAULTS if value.get(k) is not None)
    prompts = value.get("prompts") or list(DEFAULT_PROMPTS)
    out["prompts"] = [{"prompt": p, "expect": None} if isinstance(p, str)
                      else {"prompt": p["prompt"], "expect": p.get("expect")} for p in prompts]
    out["reference"] = value.get("reference") or name
    return out
