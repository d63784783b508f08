"""The benchmark's workloads (roles/benchmark/files/locustfile.py, class Prompts): fixed lengths,
random lengths within a range ratio, and a prefix every prompt shares. The class is taken from the
locustfile on its own: importing the file would import Locust, which monkey-patches this test
process with gevent."""
from __future__ import annotations

import ast
import json
import random
import statistics
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[3]
PROSE = REPO / "roles" / "benchmark" / "files" / "prompts.txt"


@pytest.fixture(scope="module")
def prompts_class():
    source = (REPO / "roles" / "benchmark" / "files" / "locustfile.py").read_text()
    [node] = [n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "Prompts"]
    namespace = {"json": json, "random": random}
    exec(compile(ast.Module(body=[node], type_ignores=[]), "locustfile.py", "exec"), namespace)
    return namespace["Prompts"]


def config(**over):
    cfg = {"prompt_source": str(PROSE), "prompt_format": "text", "input_tokens": 200, "output_tokens": 100,
           "words_per_token": 0.75, "prompt_overhead_tokens": 0, "seed": 3}
    cfg.update(over)
    return cfg


def words_after_nonce(prompt):
    return len(prompt.split("] ", 1)[1].split())


def test_fixed_lengths_are_the_same_for_every_request(prompts_class):
    p = prompts_class(config(), seed=1)
    asked = [p.next(f"n{i}") for i in range(50)]
    assert {words_after_nonce(prompt) for _m, prompt in asked} == {150}
    assert {p.output_length() for _unused in range(50)} == {100}
    assert all(prompt.startswith(f"[n{i}] ") for i, (_m, prompt) in enumerate(asked))     # the nonce first


def test_random_lengths_are_drawn_within_the_range_ratio(prompts_class):
    p = prompts_class(config(workload="random", range_ratio=0.5), seed=1)
    words = [words_after_nonce(p.next(f"n{i}")[1]) for i in range(2000)]
    outputs = [p.output_length() for _unused in range(2000)]
    assert 75 <= min(words) < 85 and 215 < max(words) <= 225
    assert 50 <= min(outputs) < 55 and 145 < max(outputs) <= 150
    assert statistics.fmean(words) == pytest.approx(150, rel=0.03)
    assert statistics.fmean(outputs) == pytest.approx(100, rel=0.03)


def test_a_shared_prefix_starts_every_prompt_of_every_load_process(prompts_class):
    cfg = config(workload="shared_prefix", prefix_tokens=120)
    first, second = prompts_class(cfg, seed=1), prompts_class(cfg, seed=2)      # two load processes
    prompts = [first.next(f"a{i}")[1] for i in range(20)] + [second.next(f"b{i}")[1] for i in range(20)]
    prefix = prompts[0].split("[a0]")[0]
    assert len(prefix.split()) == 90                                     # 120 tokens at 0.75 words per token
    assert all(p.startswith(prefix) for p in prompts)
    # after the prefix: the nonce, then the rest of the budget (200 - 120 tokens)
    assert {words_after_nonce(p[len(prefix):]) for p in prompts} == {60}
    assert len({p[len(prefix):] for p in prompts}) == 40
