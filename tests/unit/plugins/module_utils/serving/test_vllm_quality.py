"""vllm_quality: a server's greedy answers judged against a reference fingerprint."""
from __future__ import annotations

import itertools
import json

import pytest

from ansible_collections.modelswap.vllm.plugins.module_utils.common.quality_settings import quality_settings
from ansible_collections.modelswap.vllm.plugins.module_utils.serving import vllm_quality
from ansible_collections.modelswap.vllm.plugins.module_utils.serving.vllm_gates import GateError

pytestmark = pytest.mark.unit

SETTINGS = quality_settings("tiny-a", {"prompts": ["The capital of France is", {"prompt": "2 + 2 =", "expect": "4"}],
                                       "max_tokens": 4})
IDENTITY = {"name": "tiny-a", "repo_id": "lab/tiny-a", "commit": "8976b4494868209c1aa701c350d8990989f06532",
            "served_model_name": "tiny-a", "host": "gpu1"}


def response(tokens, logprobs, finish="length"):
    """A /v1/completions answer shaped like vLLM 0.32's with logprobs=1."""
    offsets = list(itertools.accumulate([0] + [len(t) for t in tokens[:-1]]))
    return {"id": "cmpl-1", "object": "text_completion", "model": "tiny-a",
            "choices": [{"index": 0, "text": "".join(tokens), "finish_reason": finish, "stop_reason": None,
                         "logprobs": {"text_offset": offsets, "token_logprobs": logprobs, "tokens": tokens,
                                      "top_logprobs": [{t: lp} for t, lp in zip(tokens, logprobs)]}}],
            "usage": {"prompt_tokens": 6, "completion_tokens": len(tokens), "total_tokens": 6 + len(tokens)}}


GOOD = [response([" Paris", ".", " It", " is"], [-0.5, -1.0, -2.0, -0.25]),
        response([" 4", ".", " 5", " +"], [-0.1, -0.2, -3.0, -1.5])]


def answers(responses):
    return [vllm_quality.answer_of(p["prompt"], r) for p, r in zip(SETTINGS["prompts"], responses)]


def reference(responses=None):
    return vllm_quality.reference_document(SETTINGS, answers(responses or GOOD), IDENTITY, vllm_version="0.32.0",
                                           recorded_at="2026-12-06T19:00:00Z")


def test_the_request_is_greedy_with_one_logprob_per_token():
    assert vllm_quality.completion_request("tiny-a", "hi", 16) == {
        "model": "tiny-a", "prompt": "hi", "max_tokens": 16, "temperature": 0, "logprobs": 1, "stream": False}


def test_the_same_answers_pass_with_full_agreement():
    verdict = vllm_quality.judge(SETTINGS, answers(GOOD), reference())
    assert verdict["passed"] is True and verdict["failed"] == []
    figures = {c["check"]: c["value"] for c in verdict["checks"]}
    assert figures == {"expected_answers": 1.0, "token_agreement": 1.0, "logprob_delta": 0.0}
    message = vllm_quality.verdict_message(verdict, reference())
    assert message.startswith("quality gate passed against the reference recorded on gpu1 from "
                              "lab/tiny-a@8976b4494868 (vLLM 0.32.0) at 2026-12-06T19:00:00Z")


def test_a_drifted_model_fails_on_agreement_and_names_the_first_difference():
    drifted = [response([" Paris", " and", " the", " sea"], [-0.6, -4.0, -1.0, -1.0]),
               response([" 5", " 4", ".", "."], [-0.3, -0.2, -0.2, -0.2])]
    verdict = vllm_quality.judge(SETTINGS, answers(drifted), reference())
    assert verdict["failed"] == ["token_agreement"]
    agreement = next(c for c in verdict["checks"] if c["check"] == "token_agreement")
    assert agreement["value"] == 0.125           # 1 of the reference's 8 tokens, in order
    assert agreement["detail"] == "prompt 1 ('The capital of France is') went another way at token 2: ' and' " \
                                  "where the reference has '.'"
    # " 4" is still in the second answer's text: the expected answer holds
    assert next(c for c in verdict["checks"] if c["check"] == "expected_answers")["passed"] is True
    assert next(c for c in verdict["checks"] if c["check"] == "logprob_delta")["value"] == pytest.approx(0.1)
    message = vllm_quality.verdict_message(verdict, reference())
    assert "quality gate failed against the reference recorded on gpu1" in message
    assert "token agreement 0.125 < 0.75 (prompt 1" in message


def test_same_tokens_from_other_numbers_fail_on_the_logprob_delta():
    shifted = [response([" Paris", ".", " It", " is"], [-1.5, -2.0, -3.0, -1.25]),
               response([" 4", ".", " 5", " +"], [-1.1, -1.2, -4.0, -2.5])]
    verdict = vllm_quality.judge(SETTINGS, answers(shifted), reference())
    assert verdict["failed"] == ["logprob_delta"]
    assert "mean log-probability delta 1.000 > 0.3" in vllm_quality.verdict_message(verdict, reference())


def test_nothing_in_common_fails_both_comparisons():
    garbage = [response(["x", "y"], [-7.0, -7.0], "stop"), response(["z"], [-7.0], "stop")]
    verdict = vllm_quality.judge(SETTINGS, answers(garbage), reference())
    assert verdict["failed"] == ["expected_answers", "token_agreement", "logprob_delta"]
    delta = next(c for c in verdict["checks"] if c["check"] == "logprob_delta")
    assert delta["value"] is None and delta["detail"] == "no token agreed with the reference"
    expected = next(c for c in verdict["checks"] if c["check"] == "expected_answers")
    assert expected["detail"] == "prompt 2 ('2 + 2 =') answered 'z', which does not contain '4'"


def test_an_answer_that_ends_early_counts_as_a_difference():
    short = [response([" Paris", "."], [-0.5, -1.0], "stop"), GOOD[1]]
    verdict = vllm_quality.judge(SETTINGS, answers(short), reference())
    agreement = verdict["compared"]
    assert agreement["share"] == 0.75 and agreement["first_difference"].endswith("at token 3: '(end)' where the "
                                                                                 "reference has ' It'")
    assert verdict["passed"] is True               # 0.75 is the limit itself


def test_without_a_reference_only_expected_answers_count():
    verdict = vllm_quality.judge(SETTINGS, answers(GOOD), None)
    assert [c["check"] for c in verdict["checks"]] == ["expected_answers"] and verdict["passed"] is True
    assert vllm_quality.verdict_message(vllm_quality.judge(quality_settings("m", {}), [], None)).endswith(
        "(nothing to compare yet: this deployment's answers become the reference)")


def test_the_reference_document_says_where_it_came_from():
    doc = reference()
    assert doc["format"] == 1 and doc["host"] == "gpu1" and doc["vllm_version"] == "0.32.0"
    assert doc["prompts"] == ["The capital of France is", "2 + 2 ="] and doc["max_tokens"] == 4
    assert doc["answers"][0]["tokens"] == [" Paris", ".", " It", " is"]
    assert vllm_quality.reference_identity(doc) == {
        "name": "tiny-a", "repo_id": "lab/tiny-a", "commit": IDENTITY["commit"], "host": "gpu1",
        "vllm_version": "0.32.0", "recorded_at": "2026-12-06T19:00:00Z"}


@pytest.mark.parametrize("change, words", [
    ({"prompts": ["The capital of France is"]}, "was taken with other prompts"),
    ({"max_tokens": 8}, "was taken with max_tokens 8, the entry asks 4"),
    ({"format": 0}, "is not a modelswap fingerprint"),
    ({"answers": []}, "has 0 answers for 2 prompts"),
])
def test_a_reference_of_other_settings_is_refused_with_the_fix(change, words):
    problem = vllm_quality.comparable_problem(SETTINGS, dict(reference(), **change), "results/quality/tiny-a.json")
    assert words in problem
    assert "remove the reference (results/quality/tiny-a.json) so that the next deployment that passes " \
           "records a new one" in problem
    assert vllm_quality.comparable_problem(SETTINGS, reference()) == ""


def test_an_answer_without_logprobs_is_refused():
    with pytest.raises(vllm_quality.QualityError, match="has no tokens with log-probabilities"):
        vllm_quality.answer_of("hi", {"choices": [{"text": "x", "logprobs": None}]})
    bad = response(["a", "b"], [-1.0])
    with pytest.raises(vllm_quality.QualityError, match="has 2 tokens but 1 log-probabilities"):
        vllm_quality.answer_of("hi", bad)


class Server:
    """The request callable: answers in turn, each call recorded; the clock moves 1 s per call."""

    def __init__(self, *replies):
        self.replies, self.calls, self.now = list(replies), [], 0.0

    def request(self, url, api_key=None, body=None, timeout=10.0):
        self.calls.append((url, api_key, body, timeout))
        self.now += 1.0
        reply = self.replies.pop(0)
        if isinstance(reply, Exception):
            raise reply
        return reply

    def clock(self):
        return self.now


def test_ask_sends_each_prompt_with_the_key_and_what_is_left_of_the_budget():
    server = Server((200, GOOD[0]), (200, GOOD[1]))
    got = vllm_quality.ask(SETTINGS, "http://127.0.0.1:8100", "tiny-a", "k", server.request, clock=server.clock,
                           deadline=120.0)
    assert got == answers(GOOD)
    assert [c[0] for c in server.calls] == ["http://127.0.0.1:8100/v1/completions"] * 2
    assert server.calls[1][1] == "k" and server.calls[1][2]["prompt"] == "2 + 2 =" and server.calls[1][3] == 119.0


@pytest.mark.parametrize("replies, deadline, words", [
    ([(401, {"error": "Unauthorized"})], 120.0, "the server answered prompt 1 with HTTP 401"),
    ([GateError("no answer from http://127.0.0.1:8100/v1/completions: timed out")], 120.0,
     "prompt 1 got no answer: no answer from"),
    ([(200, GOOD[0])], 1.0, "ran out of time (timeout_s 120) after 1 of 2 prompts"),
])
def test_ask_fails_in_words(replies, deadline, words):
    server = Server(*replies)
    with pytest.raises(vllm_quality.QualityError, match=words.replace("(", r"\(").replace(")", r"\)")):
        vllm_quality.ask(SETTINGS, "http://127.0.0.1:8100", "tiny-a", None, server.request, clock=server.clock,
                         deadline=deadline)


def test_the_version_is_a_label_never_a_failure():
    assert vllm_quality.server_version("http://h", Server((200, {"version": "0.32.0"})).request) == "0.32.0"
    assert vllm_quality.server_version("http://h", Server((404, "not found")).request) is None
    assert vllm_quality.server_version("http://h", Server(GateError("refused")).request) is None


def test_the_reference_is_read_from_its_files_text_and_a_damaged_one_is_named():
    doc = reference()
    assert vllm_quality.parse_reference("", "q/tiny-a.json") is None
    assert vllm_quality.parse_reference(None) is None and vllm_quality.parse_reference({}) is None
    assert vllm_quality.parse_reference(doc) is doc
    assert vllm_quality.parse_reference(json.dumps(doc), "q/tiny-a.json") == doc
    with pytest.raises(vllm_quality.QualityError, match=r"the quality reference q/tiny-a.json is not JSON \(.*\); "
                                                        r"restore it, or remove it so that the next deployment"):
        vllm_quality.parse_reference('{"format": 1, "answ', "q/tiny-a.json")
    with pytest.raises(vllm_quality.QualityError, match="is not a JSON object"):
        vllm_quality.parse_reference("[1, 2]", "q/tiny-a.json")
