"""bench_stats: vLLM's metric definitions on raw records, windows, flags, knee, comparison;
bench_ladder: settings, bounds; bench_target: the preflight's judgements (no network)."""
import json
import random

import numpy as np
import pytest

from ansible_collections.modelswap.vllm.plugins.module_utils.bench import benchmark_run
from ansible_collections.modelswap.vllm.plugins.module_utils.bench import bench_stats
from ansible_collections.modelswap.vllm.plugins.module_utils.bench import benchmark_probe
from ansible_collections.modelswap.vllm.plugins.module_utils.serving import vllm_metrics

pytestmark = pytest.mark.unit


# --- statistics: the same numbers numpy gives (vLLM uses numpy) ---------------------------------
@pytest.mark.parametrize("n", [1, 2, 3, 10, 101, 1000])
def test_percentiles_and_std_match_numpy(n):
    rng = random.Random(n)
    vals = [rng.expovariate(1 / 20) for _unused in range(n)]
    s = bench_stats.summarize(vals)
    for p, key in ((50, "median"), (90, "p90"), (99, "p99")):
        assert s[key] == pytest.approx(float(np.percentile(vals, p)), rel=1e-12)
    assert s["mean"] == pytest.approx(float(np.mean(vals)), rel=1e-12)
    assert s["std"] == pytest.approx(float(np.std(vals)), rel=1e-9, abs=1e-12)   # population std
    assert (s["min"], s["max"]) == (min(vals), max(vals))


def test_summary_of_nothing_is_empty_not_zero():
    s = bench_stats.summarize([])
    assert s["n"] == 0 and s["mean"] is None and s["p99"] is None


# --- one request ---------------------------------------------------------------------------------------
def chat_record(st=100.0, offsets=(0.050, 0.050, 0.070, 0.090, 0.110), usage=(30, 4), **kw):
    """A chat stream: role-only delta and first token together, then a token every 20 ms."""
    rec = {"k": "req", "w": "w1", "s": 0, "p": "measure", "id": "r", "t": 0, "st": st, "c": list(offsets),
           "u": list(usage) if usage else None, "f": "length", "h": 200, "e": None, "m": None,
           "d": True, "r": True}
    rec.update(kw)
    return rec


def test_request_metrics_follow_vllm_definitions():
    m = bench_stats.request_metrics(chat_record())
    assert m["ttft"] == pytest.approx(0.050)            # first choice-bearing message (the role delta)
    assert m["e2el"] == pytest.approx(0.110)            # last choice-bearing message (not usage, not DONE)
    assert m["itl"] == pytest.approx([0.0, 0.020, 0.020, 0.020])   # per chunk, the role gap included
    assert m["tpot"] == pytest.approx((0.110 - 0.050) / (4 - 1))   # usage tokens, not chunks
    assert m["output_tokens"] == 4


def test_tpot_needs_more_than_one_token_and_output_tokens_fall_back_to_chunks():
    assert bench_stats.request_metrics(chat_record(offsets=(0.05, 0.05), usage=(30, 1)))["tpot"] is None
    # without usage: token-bearing chunks (the role-only delta is not one)
    assert bench_stats.output_tokens(chat_record(usage=None)) == 4
    assert bench_stats.output_tokens(chat_record(usage=None, r=False)) == 5


def test_multi_token_chunks_spread_usage_over_chunks():
    rec = chat_record(offsets=(0.05, 0.05, 0.07), usage=(10, 8))      # 2 token chunks of 4
    arr = bench_stats.token_arrivals(rec)
    assert [round(t - 100.0, 3) for t, _unused in arr] == [0.05, 0.07]
    assert [n for _unused, n in arr] == [4.0, 4.0]


@pytest.mark.parametrize("rec, ok", [
    (chat_record(), True),
    (chat_record(h=500, e="http_500", c=[]), False),
    (chat_record(e="disconnected"), False),
    (chat_record(c=[], e=None), False),
])
def test_success_is_vllms(rec, ok):
    assert bench_stats.request_success(rec) is ok


# --- a synthetic run: known windows, known arrivals ---------------------------------------------------
def synthetic_run(*, c=4, e2el=1.0, chunks=10, window=(10.0, 20.0), cpu=0.2, lags=0.5, server_c=None,
                  errors=0, stagger=True, gap=0.0, until=30.0, usage=None):
    """C closed-loop users from t=0 to `until`, each request `e2el` long with `chunks` evenly spaced
    one-token chunks (no role delta; usage reports `usage` tokens, `chunks` by default), users
    staggered evenly (or all starting together), windows per the master's phases."""
    t0, t1 = window
    end = until + 2.0
    recs = [{"k": "phase", "w": "w1", "s": 0, "p": p, "t": t, "wall": 0, "users": c}
            for p, t in (("ramp", 0.0), ("warmup", 2.0), ("measure", t0), ("drain", t1), ("end", end))]
    n_err = 0
    for u in range(c):
        st = (e2el + gap) * u / c if stagger else 0.0
        while st < until:
            phase = "measure" if t0 <= st < t1 else ("warmup" if st < t0 else "drain")
            offs = [e2el * (i + 1) / chunks for i in range(chunks)]
            rec = {"k": "req", "w": "w1", "s": 0, "p": phase, "id": f"{u}-{st}", "t": 0, "st": st, "c": offs,
                   "u": [100, chunks if usage is None else usage], "f": "length", "h": 200, "e": None, "m": None, "d": True, "r": False}
            if phase == "measure" and n_err < errors:
                rec.update(h=500, e="http_500", c=[], u=None)
                n_err += 1
            recs.append(rec)
            st += e2el + gap
    for sec in range(int(end)):
        p = "measure" if t0 <= sec < t1 else "warmup"
        recs.append({"k": "cpu", "w": "w1", "s": 0, "p": p, "t": sec + 0.5, "cpu": cpu, "lags": [lags] * 50,
                     "preempted": 0, "inflight": c})
    master = [{"k": "start", "t": 0.0, "wall": 1000.0, "mode": "local", "host": "lg",
               "config": {"ladder": [c], "target": "http://x", "slo": {}}}]
    master += [{"k": "phase", "w": "master", "s": 0, "p": p, "t": t, "wall": 1000 + t, "users": c,
                "ramp_s": 1.0, "users_reached": c}
               for p, t in (("ramp", 0.0), ("warmup", 2.0), ("measure", t0), ("drain", t1))]
    master.append({"k": "phase", "w": "master", "s": 0, "p": "end", "t": end, "wall": 1000 + end, "users": c,
                   "drained": True, "stop_reason": None})
    sc = c if server_c is None else server_c
    master += [{"k": "srv", "t": float(t), "s": 0, "p": "x", "ok": True, "running": sc, "waiting": 0,
                "kv": 0.5, "gen": 0.0 + t * 10, "prompt": 0.0, "pfx_q": 0.0 + t, "pfx_h": 0.0}
               for t in range(int(end) + 1)]
    master.append({"k": "done", "t": end + 1, "wall": 1001 + end})
    return {"master": master, "workers": {"worker-w1.jsonl": recs}}


def test_window_throughput_and_latency_of_a_steady_closed_loop():
    raw = synthetic_run(c=4, e2el=1.0, chunks=10)
    st = bench_stats.step_metrics(raw, 0, 4)
    # 4 users, 1 s per request, 10 tokens each: 4 req/s, 40 tok/s, exactly, over the window
    assert st["request_throughput"] == pytest.approx(4.0)
    assert st["output_throughput"] == pytest.approx(40.0)
    assert st["total_token_throughput"] == pytest.approx(40.0 + 400.0)
    assert st["requests"]["measured"] == 40 and st["requests"]["completed"] == 40
    assert st["ttft_ms"]["mean"] == pytest.approx(100.0)
    assert st["itl_ms"]["p99"] == pytest.approx(100.0)
    assert st["tpot_ms"]["mean"] == pytest.approx(100.0)
    assert st["e2el_ms"]["median"] == pytest.approx(1000.0)
    # vLLM's duration: window start to the end of the last measured request (1 s past the window)
    assert st["vllm_duration"]["duration_s"] == pytest.approx(10.75)
    assert st["littles_law"]["ratio"] == pytest.approx(1.0)
    assert st["server"]["concurrency_mean"] == pytest.approx(4.0)
    assert st["server"]["generation_throughput"] == pytest.approx(10.0)
    assert st["valid"] and [f["code"] for f in st["flags"]] == []


@pytest.mark.parametrize("kw, code", [
    ({"cpu": 0.95}, "client_cpu_saturated"),
    ({"lags": 6.0}, "client_lag"),
    ({"server_c": 2}, "concurrency_not_reached"),
    ({"gap": 1.0}, "littles_law"),                 # the client idles 1 s between requests
])
def test_steps_where_the_client_set_the_pace_are_invalid(kw, code):
    st = bench_stats.step_metrics(synthetic_run(**kw), 0, 4)
    codes = [f["code"] for f in st["flags"]]
    assert code in codes
    assert st["valid"] is False


def test_client_lag_limit_scales_with_the_measured_chunk_gap():
    # 100 ms chunks: the absolute limits hold (5 ms at p99, 1.5 ms on average)
    assert bench_stats.step_metrics(synthetic_run(lags=1.0), 0, 4)["valid"] is True
    assert bench_stats.step_metrics(synthetic_run(lags=6.0), 0, 4)["valid"] is False
    # 1 s chunks (and TTFT): 2.5 % of them, 25 ms, is tolerated; 30 ms is not
    assert bench_stats.step_metrics(synthetic_run(e2el=10.0, lags=20.0), 0, 4)["valid"] is True
    assert bench_stats.step_metrics(synthetic_run(e2el=10.0, lags=30.0), 0, 4)["valid"] is False


def test_errors_are_counted_by_kind_and_warned_not_invalidating():
    st = bench_stats.step_metrics(synthetic_run(errors=3), 0, 4)
    assert st["requests"]["failed"] == 3 and st["requests"]["errors"] == {"http_500": 3}
    assert st["error_rate"] == pytest.approx(3 / 40)
    assert "errors" in [f["code"] for f in st["flags"]]


def test_goodput_counts_requests_meeting_every_slo():
    raw = synthetic_run()
    assert bench_stats.step_metrics(raw, 0, 4, slo={"ttft_ms": 200})["request_goodput"] == pytest.approx(4.0)
    assert bench_stats.step_metrics(raw, 0, 4, slo={"ttft_ms": 50})["request_goodput"] == 0


def test_analyze_and_token_accounting():
    raw = synthetic_run()
    a = bench_stats.analyze(raw)
    assert a["complete"] and a["steps_run"] == 1 and a["stopped_early"] is None
    tok = a["tokens"]
    assert tok["client_completion_tokens"] == sum(r["u"][1] for r in raw["workers"]["worker-w1.jsonl"]
                                                  if r["k"] == "req")
    assert tok["server_generation_tokens"] == 320 and tok["match"] is False   # the fake counter says 320


def test_analyze_refuses_a_folder_without_a_run():
    with pytest.raises(ValueError, match="did not start"):
        bench_stats.analyze({"master": [], "workers": {}})


# --- knee ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("points, knee", [
    # slots = 8: linear to 8, flat after
    ([(1, 10), (2, 20), (4, 40), (8, 80), (16, 80), (32, 79)], 8),
    # smooth saturation: 90 % of the peak first reached at 128
    ([(1, 100), (8, 700), (32, 2000), (128, 3800), (256, 4000), (512, 4010)], 128),
    # still linear at the top: no knee
    ([(1, 10), (2, 20), (4, 40)], None),
    # one point: no knee
    ([(8, 80)], None),
    # flat into the last step: the knee is the last step
    ([(1, 10), (2, 19), (4, 20)], 2),
])
def test_knee(points, knee):
    assert bench_stats.find_knee(points)["knee_concurrency"] == knee


# --- comparison ------------------------------------------------------------------------------------
def test_compare_says_better_or_worse_by_how_much():
    def step(c, out, ttft, valid=True):
        return {"concurrency": c, "valid": valid, "output_throughput": out, "request_throughput": out / 10,
                "ttft_ms": {"median": ttft, "p99": ttft * 2}, "tpot_ms": {"median": 20}, "itl_ms": {"p99": 25},
                "e2el_ms": {"median": 1000}}
    prev = [step(8, 100, 50), step(16, 200, 60), step(32, 250, 70, valid=False)]
    cur = [step(8, 103, 40), step(16, 150, 60), step(32, 300, 70)]
    rows = {(r["concurrency"], r["metric"]): r for r in bench_stats.compare(cur, prev)}
    assert rows[(8, "output_throughput")]["verdict"] == "same"            # +3 % is noise
    assert rows[(8, "ttft_ms.median")]["verdict"] == "better"             # lower latency
    assert rows[(8, "ttft_ms.median")]["change"] == pytest.approx(-0.2)
    assert rows[(16, "output_throughput")]["verdict"] == "worse"
    assert rows[(16, "output_throughput")]["change"] == pytest.approx(-0.25)
    assert not any(c == 32 for c, _unused in rows)                             # invalid before: not compared


# --- the ladder's settings ---------------------------------------------------------------------------
@pytest.mark.parametrize("ladder, ok", [
    ([1, 8, 32], True), ([5], True), ([], False), ([0, 1], False), ([-1], False), ([4, 2], False),
    ([2, 2], False), (["8"], False), ([True], False), (None, False),
])
def test_ladder_validation(ladder, ok):
    assert (benchmark_run.validate_ladder(ladder) is None) is ok


def settings(**kw):
    p = dict(concurrency=[1, 8], input_tokens=64, output_tokens=16, measure_s=10, measure_max_s=20,
             request_timeout_s=60, max_requests_per_step=1000, ramp_s=2, warmup_s=3, min_requests_per_user=3,
             stop_error_rate=0.05, stop_min_good_ratio=0.9, slo={}, processes=0, url="http://h:8000/",
             api="chat", model="m", ignore_eos=True, prompt_source="/p.txt", prompt_format="text",
             words_per_token=0.7, prompt_overhead_tokens=5, metrics_url="http://h:8000/metrics", extra_body={})
    p.update(kw)
    return p


@pytest.mark.parametrize("kw, fragment", [
    ({"measure_max_s": 5}, "measure_max_s (5) must be at least measure_s"),
    ({"output_tokens": 0}, "output_tokens must be above 0"),
    ({"stop_error_rate": 1.5}, "stop_error_rate"),
    ({"slo": {"ttft_ms": -1}}, "slo.ttft_ms"),
    ({"processes": -3}, "processes"),
])
def test_settings_validation(kw, fragment):
    assert any(fragment in m for m in benchmark_run.validate(settings(**kw)))
    assert benchmark_run.validate(settings()) == []


def test_bounds_cover_every_phase_at_its_longest():
    b = benchmark_run.bounds(settings())
    per_step = 2 + benchmark_run.RAMP_GRACE_S + 3 + 20 + 65 + 2
    assert b["seconds_per_step_max"] == per_step
    assert b["seconds"] == benchmark_run.START_GRACE_S + 2 * per_step + 65
    assert b["measured_requests"] == 2000


def test_config_carries_no_secret_and_drops_unset_slos():
    cfg = benchmark_run.config(settings(api_key="sekret", slo={"ttft_ms": 100, "tpot_ms": None}), "/r/raw")
    assert "sekret" not in json.dumps(cfg)
    assert cfg["slo"] == {"ttft_ms": 100} and cfg["target"] == "http://h:8000"
    assert benchmark_run.config(settings(), "/r/raw")["stop_min_good_ratio"] is None    # no SLO, no SLO stop


def test_locust_command_line_modes():
    one = benchmark_run.locust_argv(["locust"], "/f.py", "/l.log")
    assert "--processes" not in one and "--master" not in one and "--headless" in one
    assert benchmark_run.locust_argv(["locust"], "/f.py", "/l.log", processes=4)[-2:] == ["--processes", "4"]
    master = benchmark_run.locust_argv(["locust"], "/f.py", "/l.log", expect_workers=2, master_bind_port=5557)
    assert master[master.index("--expect-workers") + 1] == "2" and "--expect-workers-max-wait" in master


# --- the preflight's judgements ------------------------------------------------------------------------
MODELS = json.dumps({"object": "list", "data": [
    {"id": "tiny-a", "root": "/var/lib/hf/hub/models--lab--tiny-a/snapshots/" + "ab" * 20, "max_model_len": 512}]}).encode()


@pytest.mark.parametrize("status, body, model, key, kind, fragment", [
    (401, b'{"error":"Unauthorized"}', "tiny-a", True, "auth", "the API key was refused"),
    (401, b'{"error":"Unauthorized"}', "tiny-a", False, "auth", "requires an API key"),
    (200, MODELS, "tiny-b", False, "model", "does not serve model 'tiny-b' (it serves: tiny-a)"),
    (500, b"oops", "tiny-a", False, "http", "HTTP 500"),
    (200, b"<html>", "tiny-a", False, "http", "did not return a model list"),
])
def test_models_answer_errors_say_what_to_fix(status, body, model, key, kind, fragment):
    with pytest.raises(benchmark_probe.ProbeError) as err:
        benchmark_probe.check_models(status, body, "http://h:8000", model, key)
    assert err.value.kind == kind and fragment in err.value.message


def fake_fetch(routes):
    def fetch(method, url, body, headers, timeout):
        path = "/" + url.split("/", 3)[3]
        answer = routes[path]
        if isinstance(answer, Exception):
            raise answer
        if callable(answer):
            return answer(json.loads(body) if body else None)
        return answer
    return fetch


def test_probe_calibrates_words_per_token_and_reads_the_deployment():
    def completion(req):
        words = len(req["messages"][0]["content"].split())
        return 200, json.dumps({"usage": {"prompt_tokens": 12 + int(words * 1.5), "completion_tokens": 1}}).encode()
    routes = {"/v1/models": (200, MODELS), "/version": (200, b'{"version": "0.32.0"}'),
              "/v1/chat/completions": completion,
              "/metrics": (200, b'vllm:num_requests_running{engine="0",model_name="tiny-a"} 0.0\n'
                                b'vllm:cache_config_info{block_size="16",engine="0"} 1.0\n')}
    facts = benchmark_probe.probe(fake_fetch(routes), "http://h:8000/", "tiny-a", calibration_text="one two three four")
    assert facts["calibration"]["words_per_token"] == pytest.approx(1 / 1.5)
    assert facts["calibration"]["overhead_tokens"] == 12
    dep = facts["deployment"]
    assert dep["commit"] == "ab" * 20 and dep["vllm_version"] == "0.32.0" and dep["max_model_len"] == 512
    assert dep["cache_config"]["block_size"] == "16"
    assert facts["metrics_error"] is None


def test_probe_unreachable_and_failed_completion():
    with pytest.raises(benchmark_probe.ProbeError, match="connection refused") as err:
        benchmark_probe.probe(fake_fetch({"/v1/models": ConnectionRefusedError(111, "Connection refused")}), "http://h:1", "m")
    assert err.value.kind == "unreachable"
    routes = {"/v1/models": (200, MODELS), "/version": (404, b""),
              "/v1/chat/completions": lambda req: (500, b'{"error": {"message": "engine dead"}}'),
              "/metrics": (200, b"")}
    with pytest.raises(benchmark_probe.ProbeError, match="engine dead"):
        benchmark_probe.probe(fake_fetch(routes), "http://h:8000", "tiny-a")


def test_parse_metrics_keeps_the_served_models_samples():
    text = ('vllm:num_requests_running{engine="0",model_name="a"} 3.0\n'
            'vllm:num_requests_running{engine="1",model_name="a"} 2.0\n'
            'vllm:num_requests_running{engine="0",model_name="b"} 7.0\n'
            '# HELP x\nvllm:generation_tokens_total{model_name="a"} 1.5e3\n')
    values, _unused = vllm_metrics.parse_metrics(text, "a")
    assert values["vllm:num_requests_running"] == 5.0
    assert values["vllm:generation_tokens_total"] == 1500.0


def test_lengths_must_fit_the_context():
    assert benchmark_probe.check_lengths(400, 100, 512) is None
    assert "exceeds the server's max_model_len (512)" in benchmark_probe.check_lengths(500, 100, 512)


def test_a_few_ms_outside_the_engine_is_the_frontends_share_not_a_missing_concurrency():
    # 100 ms requests, 4 offered, 40 req/s; the engine held 3.5: (4 - 3.5) / 40 = 12.5 ms per request
    st = bench_stats.step_metrics(synthetic_run(e2el=0.1, server_c=3.5), 0, 4)
    assert st["valid"] and [f["code"] for f in st["flags"]] == ["frontend_share"]
    assert st["server"]["outside_engine_ms"] == pytest.approx(12.5, rel=0.01)
    # 1.5 held: 62.5 ms per request is more than overhead, the concurrency did not arrive
    st = bench_stats.step_metrics(synthetic_run(e2el=0.1, server_c=1.5), 0, 4)
    assert not st["valid"] and "concurrency_not_reached" in [f["code"] for f in st["flags"]]


# --- the measured window's least length (Little's law) ----------------------------------------------
@pytest.mark.parametrize("tolerance, e2el_s, per_user, multiple, seconds", [
    (0.1, None, 11, 10.0, None),
    (0.1, 2.0, 11, 10.0, 20.0),
    (0.25, 1.0, 5, 4.0, 4.0),
    (0.3, 1.0, 5, 1 / 0.3, 1 / 0.3),
    (0.05, 0.5, 21, 20.0, 10.0),
    (0.5, 3.0, 3, 2.0, 6.0),
    (1.0, 3.0, 2, 1.0, 3.0),
])
def test_littles_law_window(tolerance, e2el_s, per_user, multiple, seconds):
    need = bench_stats.littles_law_window(tolerance, e2el_s)
    assert need["requests_per_user"] == per_user
    assert need["e2el_multiple"] == pytest.approx(multiple)
    assert need["seconds"] == (None if seconds is None else pytest.approx(seconds))


@pytest.mark.parametrize("tolerance", [0, -0.1, None])
def test_littles_law_window_needs_a_positive_tolerance(tolerance):
    with pytest.raises(ValueError, match="littles_law_tolerance must be above 0"):
        bench_stats.littles_law_window(tolerance)


def test_the_window_rule_holds_for_the_worst_case_closed_loop():
    """One user (no other user's phase averages the error out): every window holding at least the
    rule's requests per user passes the ±10 % check; shorter ones can fail it."""
    need = bench_stats.littles_law_window(bench_stats.DEFAULT_CHECKS["littles_law_tolerance"])["requests_per_user"]
    failed_short = 0
    for e2el in (0.7, 1.3, 2.9, 4.1):
        for tenth in range(10, 600, 37):
            window = (10.0, 10.0 + tenth / 10)
            st = bench_stats.step_metrics(synthetic_run(c=1, e2el=e2el, window=window, stagger=False,
                                                        until=window[1] + 3 * e2el), 0, 1)
            flagged = "littles_law" in [f["code"] for f in st["flags"]]
            if st["requests"]["measured"] >= need:
                assert not flagged, (e2el, window, st["littles_law"])
            elif flagged:
                failed_short += 1
    assert failed_short > 0


def test_a_window_too_short_for_littles_law_says_what_it_needs():
    # 1 user, 4 s requests, a 10 s window: 2 requests, throughput × E2EL = 0.8
    st = bench_stats.step_metrics(synthetic_run(c=1, e2el=4.0, window=(10.0, 20.0), stagger=False), 0, 1)
    [flag] = [f for f in st["flags"] if f["code"] == "littles_law"]
    assert st["valid"] is False
    assert "the window held 2.0 requests per user, too few to tell" in flag["message"]
    assert "needs at least 11 (a window of 10 × the mean E2EL, 40.0 s here)" in flag["message"]
    assert "raise benchmark_min_requests_per_user to 11 (and benchmark_measure_max_s to at least 44 s)" \
        in flag["message"]
    # a window that held enough and still broke Little's law is the client's fault: no such advice
    idle = bench_stats.step_metrics(synthetic_run(gap=1.0, until=60.0, window=(10.0, 50.0)), 0, 4)
    [flag] = [f for f in idle["flags"] if f["code"] == "littles_law"]
    assert "too few to tell" not in flag["message"]


@pytest.mark.parametrize("kw, tolerance, fragments", [
    ({"min_requests_per_user": 3}, None,
     ["holding only 3 requests per user; Little's law (±10%) needs at least 11 (a window of 10 × the step's "
      "E2E latency)", "set min_requests_per_user (benchmark_min_requests_per_user) to 11",
      "or measure_s to at least 10 × the E2E latency expected at C=8"]),
    ({"min_requests_per_user": 11}, None, []),
    ({"min_requests_per_user": 5}, 0.25, []),
    ({"min_requests_per_user": 4}, 0.25, ["needs at least 5"]),
    ({"min_requests_per_user": 11, "max_requests_per_step": 50}, None,
     ["max_requests_per_step (50) closes the window at C=8 after 6.2 requests per user", "at least 88"]),
])
def test_window_warnings_before_the_run(kw, tolerance, fragments):
    warnings = benchmark_run.window_warnings(settings(**kw), tolerance)
    assert len(warnings) == (1 if fragments else 0)
    for fragment in fragments:
        assert fragment in warnings[0]


def test_the_plan_lines_name_the_ladder_windows_bounds_and_target():
    p = settings(min_requests_per_user=11, slo={"ttft_ms": 500}, scheduling="realtime")
    lines = benchmark_run.plan_lines(p, benchmark_run.bounds(p), ["a warning"])
    text = "\n".join(lines)
    assert "  target: http://h:8000 (chat API), model m" in lines
    assert "  ladder: C=1,8 (closed loops, no wait); ~64 prompt tokens, 16 output tokens per request (ignore_eos)" \
        in lines
    assert ("each step: ramp 2 s, warm-up 3 s (discarded), measured window 10 s to 20 s until it holds 11 requests "
            "per user (at most 1,000), then a drain of at most 65 s") in text
    assert "requests time out after 60 s; SLOs: TTFT <= 500 ms; stops early on: a step's error rate above 5.0% " \
           "or fewer than 90% of a step's requests meeting the SLOs" in text
    assert f"bounds: at most {benchmark_run.bounds(p)['seconds']:,} s in all" in text and "2,000 measured requests" in text
    assert "load: one Locust process, scheduling realtime" in text
    assert lines[-1] == "  WARNING: a warning"


@pytest.mark.repo
def test_the_locustfile_reads_metrics_with_the_probes_rules():
    """The load generator samples /metrics during a run; it must read what the probe reads. The
    role ships the probe's parser beside the locustfile (a link), and the locustfile maps it to
    the raw record's short keys, summing the engines of the served model only."""
    import ast
    from pathlib import Path

    files = Path(__file__).resolve().parents[5] / "roles" / "benchmark" / "files"
    assert (files / "vllm_metrics.py").resolve() == Path(vllm_metrics.__file__).resolve()
    tree = ast.parse((files / "locustfile.py").read_text())
    wanted = [n for n in tree.body if (isinstance(n, ast.FunctionDef) and n.name == "server_sample")
              or (isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "METRIC_KEYS")]
    assert len(wanted) == 2
    assert not [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "parse_metrics"]
    namespace = {"parse_metrics": vllm_metrics.parse_metrics}
    exec(compile(ast.Module(body=wanted, type_ignores=[]), "locustfile.py", "exec"), namespace)
    text = ('vllm:num_requests_running{engine="0",model_name="a"} 3.0\n'
            'vllm:num_requests_running{engine="1",model_name="a"} 2.0\n'
            'vllm:num_requests_waiting{engine="0",model_name="b"} 7.0\n'
            'vllm:kv_cache_usage_perc{engine="0",model_name="a"} 0.25\n'
            'vllm:cache_config_info{block_size="16",model_name="a"} 1.0\n'
            'vllm:iteration_tokens_total_bucket{le="1",model_name="a"} 9.0\n')
    assert namespace["server_sample"](text, "a") == {"running": 5.0, "kv": 0.25}


def test_the_processes_a_saturated_step_needs_are_sized_from_what_one_process_handled():
    cl = {"per_process": {"w1": {"cpu_mean": 0.95}}, "chunks_per_s": {"w1": 5000.0}, "chunks_per_s_total": 5000.0}
    # at 85 % of a core one process takes 5000 * 0.85 / 0.95 = 4474 chunks/s; the step offered 5000
    words = bench_stats.processes_needed(cl, 0.85)
    assert words == ("; one load process received 5,000 chunks/s at 95% of a core, and this step's 5,000 chunks/s "
                     "need about 2 processes at 85% each: set benchmark_processes to 2 (on this host) or spread the "
                     "load over benchmark_load_generators")
    two = {"per_process": {"a": {"cpu_mean": 0.9}, "b": {"cpu_mean": 0.5}}, "chunks_per_s": {"a": 9000.0, "b": 5000.0},
           "chunks_per_s_total": 14000.0}
    assert "need about 4 processes at 42%" in bench_stats.processes_needed(two, 0.425)     # 14000 / 4250 per process
    assert bench_stats.processes_needed({"per_process": {}, "chunks_per_s": {}, "chunks_per_s_total": None}, 0.85) == ""
