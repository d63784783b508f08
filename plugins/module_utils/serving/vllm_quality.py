# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0
"""The quality gate's judgement: a server's greedy answers against a reference fingerprint.

A healthy, fast server can still answer garbage (a wrong kernel, a mismatched tokenizer, a
shard corrupted in a way no size check sees). The gate asks the settings' prompts with greedy
decoding (temperature 0) and one log-probability per token, and keeps per prompt the tokens,
their log-probabilities, the text and why it stopped: the *fingerprint*. The first deployment
of a catalog entry that passes records its fingerprint as the entry's *reference*; every later
deployment (another host, another vLLM version, a re-download) is compared with it:

- token agreement: the share of the reference's tokens reproduced in order (each prompt counts
  up to its first differing token: greedy decoding goes its own way after one);
- log-probability delta: the mean |difference| of the agreeing tokens' log-probabilities (the
  same tokens from different numbers are a warning sign too);
- expected answers: the share of the prompts with ``expect`` whose text contains it.

Pure functions over the completions' JSON (common/quality_settings.py owns the settings); the
two that ask the server take the request callable (vllm_gates.request_json in the module).
"""
from __future__ import annotations

import json

from ansible_collections.modelswap.vllm.plugins.module_utils.serving.vllm_gates import GateError

FORMAT = 1


class QualityError(Exception):
    """The gate could not judge (an answer of the wrong shape, a reference of other settings)."""


def completion_request(served_model_name: str, prompt: str, max_tokens: int) -> dict:
    """The body of one gate request: greedy, one log-probability per token, no streaming."""
    return {"model": served_model_name, "prompt": prompt, "max_tokens": int(max_tokens), "temperature": 0,
            "logprobs": 1, "stream": False}


def answer_of(prompt: str, response) -> dict:
    """One prompt's part of the fingerprint from a /v1/completions answer; QualityError when the
    answer has no choice with per-token log-probabilities."""
    try:
        choice = response["choices"][0]
        logprobs = choice["logprobs"]
        tokens = [str(t) for t in logprobs["tokens"]]
        values = [float(v) if v is not None else None for v in logprobs["token_logprobs"]]
        text = str(choice.get("text") or "")
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise QualityError("the answer to %r has no tokens with log-probabilities (%s: %s); the gate asks "
                           "/v1/completions with logprobs=1" % (prompt[:60], type(exc).__name__, exc))
    if len(tokens) != len(values):
        raise QualityError("the answer to %r has %d tokens but %d log-probabilities"
                           % (prompt[:60], len(tokens), len(values)))
    return {"prompt": prompt, "text": text, "tokens": tokens, "logprobs": values,
            "finish_reason": choice.get("finish_reason")}


def reference_document(settings: dict, answers: list, identity: dict, *, vllm_version, recorded_at: str) -> dict:
    """What is written as an entry's reference: the answers, the settings they were asked with
    and where they came from (``identity``: name, repo_id, commit, served_model_name, host)."""
    ident = dict(identity or {})
    return {"format": FORMAT, "name": ident.get("name"), "repo_id": ident.get("repo_id"),
            "commit": ident.get("commit"), "served_model_name": ident.get("served_model_name"),
            "host": ident.get("host"), "vllm_version": vllm_version, "recorded_at": recorded_at,
            "max_tokens": int(settings["max_tokens"]), "prompts": [p["prompt"] for p in settings["prompts"]],
            "answers": answers}


def parse_reference(raw, path: str = ""):
    """The reference from what the caller read (the file's text, '' when there is none, or the
    mapping itself): None without one; QualityError naming the file and the fix when it is not JSON."""
    if raw is None or raw == "" or raw == {}:
        return None
    if isinstance(raw, dict):
        return raw
    try:
        parsed = json.loads(raw)
    except (TypeError, ValueError) as exc:
        raise QualityError("the quality reference %s is not JSON (%s); restore it, or remove it so that the next "
                           "deployment that passes records a new one" % (path or "given", exc))
    if not isinstance(parsed, dict):
        raise QualityError("the quality reference %s is not a JSON object; restore it, or remove it so that the next "
                           "deployment that passes records a new one" % (path or "given"))
    return parsed


def comparable_problem(settings: dict, reference: dict, path: str = "") -> str:
    """Why ``reference`` cannot be compared with answers asked with ``settings`` ('' when it can)."""
    where = " (%s)" % path if path else ""
    fix = ("; restore the settings it was taken with, or remove the reference%s so that the next deployment "
           "that passes records a new one" % where)
    if not isinstance(reference, dict) or reference.get("format") != FORMAT or not isinstance(
            reference.get("answers"), list):
        return "the quality reference%s is not a modelswap fingerprint (format %d)%s" % (where, FORMAT, fix)
    if reference.get("prompts") != [p["prompt"] for p in settings["prompts"]]:
        return "the quality reference%s was taken with other prompts%s" % (where, fix)
    if reference.get("max_tokens") != int(settings["max_tokens"]):
        return ("the quality reference%s was taken with max_tokens %s, the entry asks %s%s"
                % (where, reference.get("max_tokens"), settings["max_tokens"], fix))
    if len(reference["answers"]) != len(settings["prompts"]):
        return "the quality reference%s has %d answers for %d prompts%s" % (
            where, len(reference["answers"]), len(settings["prompts"]), fix)
    return ""


def _agreed(ref_tokens: list, tokens: list) -> int:
    n = 0
    for a, b in zip(ref_tokens, tokens):
        if a != b:
            break
        n += 1
    return n


def _short(text: str, limit: int = 40) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def token_agreement(reference_answers: list, answers: list) -> dict:
    """The share of the reference's tokens reproduced in order, the mean log-probability delta of
    those tokens, and the first prompt where the answer went another way."""
    total = agreed = 0
    deltas = []
    first = None
    for i, (ref, ans) in enumerate(zip(reference_answers, answers)):
        n = _agreed(ref["tokens"], ans["tokens"])
        total += len(ref["tokens"])
        agreed += n
        deltas.extend(abs(a - b) for a, b in zip(ref["logprobs"][:n], ans["logprobs"][:n])
                      if a is not None and b is not None)
        if first is None and (n < len(ref["tokens"]) or len(ans["tokens"]) != len(ref["tokens"])):
            got = ans["tokens"][n] if n < len(ans["tokens"]) else "(end)"
            want = ref["tokens"][n] if n < len(ref["tokens"]) else "(end)"
            first = "prompt %d (%s) went another way at token %d: %s where the reference has %s" % (
                i + 1, _short(ref["prompt"]), n + 1, _short(got), _short(want))
    return {"share": (agreed / total) if total else 1.0, "tokens": total, "agreed": agreed,
            "logprob_delta": (sum(deltas) / len(deltas)) if deltas else None, "first_difference": first}


def answer_share(settings: dict, answers: list) -> dict:
    """The share of the prompts with ``expect`` whose answer contains it, and the first miss."""
    asked = [(i, p, a) for i, (p, a) in enumerate(zip(settings["prompts"], answers)) if p.get("expect")]
    hits = [i for i, p, a in asked if p["expect"] in a["text"]]
    miss = next(((i, p, a) for i, p, a in asked if i not in hits), None)
    return {"share": (len(hits) / len(asked)) if asked else None, "asked": len(asked), "held": len(hits),
            "first_miss": ("prompt %d (%s) answered %s, which does not contain %s" % (
                miss[0] + 1, _short(miss[1]["prompt"]), _short(miss[2]["text"]), _short(miss[1]["expect"]))
                if miss else None)}


def _check(name: str, value, limit, passed: bool, detail) -> dict:
    return {"check": name, "value": None if value is None else round(value, 4), "limit": limit,
            "passed": passed, "detail": detail}


def judge(settings: dict, answers: list, reference=None) -> dict:
    """The gate's verdict on ``answers``: its checks (each with value, limit and detail), passed
    when every check passed. Without a reference only the expected answers are checked (the
    caller records this deployment's fingerprint once it passed)."""
    checks = []
    expected = answer_share(settings, answers)
    if expected["share"] is not None:
        limit = float(settings["min_answer_share"])
        checks.append(_check("expected_answers", expected["share"], limit, expected["share"] >= limit,
                             expected["first_miss"]))
    compared = None
    if reference is not None:
        compared = token_agreement(reference["answers"], answers)
        limit = float(settings["min_token_agreement"])
        checks.append(_check("token_agreement", compared["share"], limit, compared["share"] >= limit,
                             compared["first_difference"]))
        limit = float(settings["max_logprob_delta"])
        delta = compared["logprob_delta"]
        checks.append(_check("logprob_delta", delta, limit, delta is not None and delta <= limit,
                             None if delta is not None else "no token agreed with the reference"))
    failed = [c["check"] for c in checks if not c["passed"]]
    return {"passed": not failed, "checks": checks, "failed": failed, "compared": compared,
            "expected": expected}


def reference_identity(reference):
    """Where a reference came from, as data (None without one)."""
    if not reference:
        return None
    return {k: reference.get(k) for k in ("name", "repo_id", "commit", "host", "vllm_version", "recorded_at")}


def reference_summary(reference) -> str:
    """Where a reference came from, in words."""
    if not reference:
        return "no reference"
    commit = str(reference.get("commit") or "")[:12]
    return "the reference recorded on %s from %s@%s (vLLM %s) at %s" % (
        reference.get("host") or "?", reference.get("repo_id") or reference.get("name") or "?", commit or "?",
        reference.get("vllm_version") or "?", reference.get("recorded_at") or "?")


def _figure(check: dict) -> str:
    names = {"token_agreement": ("token agreement", "<"), "logprob_delta": ("mean log-probability delta", ">"),
             "expected_answers": ("expected answers", "<")}
    label, op = names[check["check"]]
    value = "n/a" if check["value"] is None else "%.3f" % check["value"]
    text = "%s %s %s %s" % (label, value, op, check["limit"])
    return text + (" (%s)" % check["detail"] if check["detail"] else "")


def verdict_message(verdict: dict, reference=None) -> str:
    """One sentence: what passed, or which check failed and by how much."""
    against = (" against %s" % reference_summary(reference)) if reference else ""
    if verdict["passed"]:
        parts = ["%s %s" % (c["check"].replace("_", " "), "n/a" if c["value"] is None else "%.3f" % c["value"])
                 for c in verdict["checks"]]
        return "quality gate passed%s%s" % (against, (": " + ", ".join(parts)) if parts else
                                            " (nothing to compare yet: this deployment's answers become the reference)")
    bad = [_figure(c) for c in verdict["checks"] if not c["passed"]]
    return "quality gate failed%s: %s" % (against, "; ".join(bad))


def ask(settings: dict, base: str, served_model_name: str, api_key, request, *, clock, deadline: float) -> list:
    """The fingerprint's answers: each prompt asked in turn within the settings' budget.
    ``request(url, api_key=, body=, timeout=)`` returns (status, JSON); QualityError when the
    server does not answer 200 or the time is up."""
    answers = []
    for i, spec in enumerate(settings["prompts"]):
        left = deadline - clock()
        if left <= 0:
            asked = (settings["timeout_s"], i, len(settings["prompts"]))
            raise QualityError("the quality gate ran out of time (timeout_s %s) after %d of %d prompts; raise "
                               "quality.timeout_s or ask fewer tokens" % asked)
        body = completion_request(served_model_name, spec["prompt"], settings["max_tokens"])
        try:
            status, payload = request(base + "/v1/completions", api_key=api_key, body=body, timeout=left)
        except GateError as exc:
            raise QualityError("prompt %d got no answer: %s" % (i + 1, exc))
        if status != 200:
            text = payload if isinstance(payload, str) else str(payload)
            raise QualityError("the server answered prompt %d with HTTP %s: %s" % (i + 1, status, text[:300]))
        answers.append(answer_of(spec["prompt"], payload))
    return answers


def server_version(base: str, request, timeout: float = 5.0):
    """vLLM's version from GET /version (None when it does not say)."""
    try:
        status, payload = request(base + "/version", timeout=timeout)
    except GateError:   # the version is a label in the reference, never a reason to fail
        return None
    return payload.get("version") if status == 200 and isinstance(payload, dict) else None
