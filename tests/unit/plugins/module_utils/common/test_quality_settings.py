"""quality_settings: a catalog entry's quality gate settings, refused in words or filled in."""
from __future__ import annotations

import pytest

from ansible_collections.modelswap.vllm.plugins.module_utils.common import catalog
from ansible_collections.modelswap.vllm.plugins.module_utils.common.quality_settings import (
    DEFAULT_PROMPTS, quality_problems, quality_settings)

pytestmark = pytest.mark.unit

NAMES = ["tiny-a", "tiny-b"]


def test_absent_means_no_gate_and_empty_takes_every_default():
    assert quality_problems(None) == [] and quality_settings("tiny-a", None) is None
    settings = quality_settings("tiny-a", {})
    assert settings["prompts"] == [{"prompt": p, "expect": None} for p in DEFAULT_PROMPTS]
    assert settings["max_tokens"] == 16 and settings["min_token_agreement"] == 0.75
    assert settings["max_logprob_delta"] == 0.3 and settings["min_answer_share"] == 1.0
    assert settings["timeout_s"] == 120 and settings["reference"] == "tiny-a"


def test_given_values_win_and_prompts_may_carry_an_expected_text():
    settings = quality_settings("tiny-x", {"prompts": ["a", {"prompt": "2 + 2 =", "expect": "4"}], "max_tokens": 8,
                                           "min_token_agreement": 0.5, "reference": "tiny-a"})
    assert settings["prompts"] == [{"prompt": "a", "expect": None}, {"prompt": "2 + 2 =", "expect": "4"}]
    assert settings["max_tokens"] == 8 and settings["min_token_agreement"] == 0.5
    assert settings["reference"] == "tiny-a"
    # the filled-in settings are valid settings themselves (the module takes either)
    assert quality_problems(settings, NAMES) == []


@pytest.mark.parametrize("value, words", [
    ("yes", "quality must be a mapping"),
    ({"treshold": 0.5}, "unknown key(s) treshold"),
    ({"prompts": []}, "a list of 1-64 prompts"),
    ({"prompts": "hello"}, "a list of 1-64 prompts"),
    ({"prompts": [""]}, "quality.prompts[0] must be a prompt string"),
    ({"prompts": [{"prompt": "x", "expected": "y"}]}, "quality.prompts[0] has unknown key(s) expected"),
    ({"prompts": [{"expect": "y"}]}, "quality.prompts[0] needs a non-empty prompt string"),
    ({"prompts": [{"prompt": "x", "expect": ""}]}, "quality.prompts[0].expect must be a non-empty string"),
    ({"max_tokens": 0}, "quality.max_tokens must be a whole number of tokens from 1 to 256"),
    ({"max_tokens": 16.5}, "quality.max_tokens must be a whole number"),
    ({"max_tokens": True}, "quality.max_tokens must be a whole number"),
    ({"min_token_agreement": 75}, "quality.min_token_agreement must be a share from 0 to 1"),
    ({"min_answer_share": "all"}, "quality.min_answer_share must be a share from 0 to 1"),
    ({"max_logprob_delta": -0.1}, "quality.max_logprob_delta must be a number of nats >= 0"),
    ({"timeout_s": 0}, "quality.timeout_s must be a number of seconds > 0"),
    ({"reference": "tiny-z"}, "quality.reference 'tiny-z' is not in the catalog (it has tiny-a, tiny-b)"),
    ({"reference": 3}, "quality.reference must be a catalog name"),
])
def test_bad_settings_are_named(value, words):
    problems = quality_problems(value, NAMES)
    assert len(problems) == 1 and words in problems[0], problems


def test_the_catalog_refuses_a_bad_gate_before_anything_changes():
    models = {"tiny-a": {"repo_id": "lab/tiny-a", "quality": {"min_token_agreement": 2}},
              "tiny-b": {"repo_id": "lab/tiny-b", "quality": {"reference": "tiny-c"}}}
    refusals = catalog.target_refusals(models, "tiny-a")
    assert len(refusals) == 1 and "quality.min_token_agreement must be a share from 0 to 1" in refusals[0]
    assert "nothing was changed" in refusals[0]
    assert any("quality.reference 'tiny-c' is not in the catalog" in p
               for p in catalog.selection_problems(models, "tiny-b"))
    # the normalized entry carries the gate only when the entry has one
    assert "quality" not in catalog.normalized("tiny-a", {"repo_id": "lab/tiny-a"})
    assert catalog.normalized("tiny-b", {"repo_id": "lab/tiny-b", "quality": {}})["quality"]["reference"] == "tiny-b"
