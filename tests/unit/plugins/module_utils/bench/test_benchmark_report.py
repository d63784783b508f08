"""bench_report: the versioned JSON, CSV, Markdown and PNG of a run, the previous run's lookup
and comparison, content-based writes."""
import csv
import io
import json

import pytest

from ansible_collections.modelswap.vllm.plugins.module_utils.bench import benchmark_report
from ansible_collections.modelswap.vllm.plugins.module_utils.bench import bench_stats
from tests.unit.plugins.module_utils.bench.test_bench_stats import synthetic_run

pytestmark = pytest.mark.unit


def report_of(raw, run_id="20261202T120000Z", previous=None, **kw):
    return benchmark_report.build(bench_stats.analyze(raw), run_id=run_id, host="gpu1", model="tiny-a", commit="c" * 40,
                                  target="http://gpu1:8000", deployment={"vllm_version": "0.32.0",
                                                                         "vllm_args": {"max_model_len": 512}},
                                  previous=previous, **kw)


def test_json_is_versioned_and_carries_the_deployment_and_definitions():
    rep = report_of(synthetic_run())
    doc = json.loads(benchmark_report.render_json(rep))
    assert doc["schema"] == "modelswap.benchmark/v1"
    assert doc["run"]["complete"] is True and doc["run"]["started"] == "1970-01-01T00:16:40Z"
    assert doc["deployment"]["vllm_version"] == "0.32.0"
    assert doc["steps"][0]["output_throughput"] == pytest.approx(40.0)
    assert "ttft_ms" in doc["definitions"] and doc["comparison"] is None


def test_csv_has_one_row_per_step_with_columns_named_by_metric():
    rep = report_of(synthetic_run())
    rows = list(csv.DictReader(io.StringIO(benchmark_report.render_csv(rep))))
    assert len(rows) == 1
    assert float(rows[0]["output_throughput_tok_s"]) == pytest.approx(40.0)
    assert float(rows[0]["ttft_ms_p99"]) == pytest.approx(100.0)
    assert rows[0]["valid"] == "True" and rows[0]["concurrency"] == "4"


def test_markdown_says_what_is_invalid_and_why():
    rep = report_of(synthetic_run(cpu=0.97))
    md = benchmark_report.render_markdown(rep, [], "plots were turned off")
    assert "**No valid step" in md
    assert "client_cpu_saturated" in md and "97%" in md
    assert "| --max-model-len | 512 |" in md
    assert "Plots skipped: plots were turned off." in md


def test_a_replica_groups_report_names_its_nodes():
    rep = benchmark_report.build(bench_stats.analyze(synthetic_run()), run_id="r1", host="gpu1", model="tiny-a",
                                 commit="c" * 40, target="http://gpu1:8000",
                                 deployment={"replica_group": {"name": "pair", "nodes": ["gpu1", "gpu2"]}})
    assert json.loads(benchmark_report.render_json(rep))["deployment"]["replica_group"]["nodes"] == ["gpu1", "gpu2"]
    assert "| replica group | pair: gpu1 (head), gpu2 |" in benchmark_report.render_markdown(rep, [], None)
    assert "replica group" not in benchmark_report.render_markdown(report_of(synthetic_run()), [], None)


def test_previous_run_is_found_and_compared(tmp_path):
    root = tmp_path / "results"
    older = root / "gpu1" / "tiny-a" / ("a" * 40) / "20261201T100000Z"
    newer = root / "gpu1" / "tiny-a" / ("b" * 40) / "20261201T110000Z"
    other = root / "gpu2" / "tiny-a" / ("b" * 40) / "20261201T115000Z"
    for d, thr in ((older, synthetic_run(e2el=2.0)), (newer, synthetic_run(e2el=0.5)), (other, synthetic_run())):
        d.mkdir(parents=True)
        rep = report_of(thr, run_id=d.name)
        rep["run"]["finished_wall"] = {"20261201T100000Z": 10, "20261201T110000Z": 20}.get(d.name, 30)
        (d / "report.json").write_text(benchmark_report.render_json(rep))
    current = root / "gpu1" / "tiny-a" / ("c" * 40) / "20261202T120000Z"
    found = benchmark_report.find_previous(str(root), "gpu1", "tiny-a", str(current), started_wall=25)
    assert found is not None and found[0]["run"]["id"] == "20261201T110000Z"     # latest, same host
    assert benchmark_report.find_previous(str(root), "gpu1", "tiny-a", str(current), started_wall=15)[0]["run"]["id"] \
        == "20261201T100000Z"                                                       # finished before start
    rep = report_of(synthetic_run(e2el=1.0), previous=found)
    cmp = rep["comparison"]
    assert cmp["previous_run"] == "20261201T110000Z"
    rows = {r["metric"]: r for r in cmp["rows"]}
    assert rows["output_throughput"]["change"] == pytest.approx(-0.5)           # 80 -> 40 tok/s
    assert rows["output_throughput"]["verdict"] == "worse"
    assert rows["e2el_ms.median"]["verdict"] == "worse"
    md = benchmark_report.render_markdown(rep, [], None)
    assert "Previous run `20261201T110000Z`" in md and "-50.0%" in md


def test_files_are_written_only_when_their_content_changes(tmp_path):
    rep = report_of(synthetic_run())
    files, err = benchmark_report.plan_files(rep, plots=True)
    assert err is None
    assert files["throughput.png"][:8] == b"\x89PNG\r\n\x1a\n" and files["latency.png"][:4] == b"\x89PNG"
    names = benchmark_report.changed_files(str(tmp_path), files)
    assert names == sorted(files)
    benchmark_report.write_files(str(tmp_path), files, names)
    again, _unused = benchmark_report.plan_files(report_of(synthetic_run()), plots=True)
    assert benchmark_report.changed_files(str(tmp_path), again) == []                         # same run: nothing to write
    assert oct((tmp_path / "report.json").stat().st_mode & 0o777) == "0o644"


def test_plots_missing_matplotlib_are_reported_not_fatal(monkeypatch):
    monkeypatch.setattr(benchmark_report, "plt", None)
    files, err = benchmark_report.plan_files(report_of(synthetic_run()), plots=True)
    assert "matplotlib is not installed" in err
    assert "throughput.png" not in files and b"Plots skipped: matplotlib" in files["report.md"]


def test_the_header_states_the_output_tokens_usage_reported_and_what_was_asked():
    raw = synthetic_run(chunks=128, usage=129)
    raw["master"][0]["config"].update(input_tokens=64, output_tokens=128, ignore_eos=True, api="chat")
    rep = report_of(raw)
    assert rep["tokens"]["output_tokens_per_request"]["min"] == rep["tokens"]["output_tokens_per_request"]["max"] == 129
    header = benchmark_report.render_markdown(rep, [], None).splitlines()[2]
    assert ("100 prompt tokens (~64 asked for) and 129 output tokens (128 asked for with ignore_eos) per request, "
            "as usage reported them for ") in header
    assert " 128 output tokens" not in header


def test_the_header_gives_the_range_when_requests_differ_and_says_when_usage_is_missing():
    raw = synthetic_run()
    reqs = [r for r in raw["workers"]["worker-w1.jsonl"] if r["k"] == "req"]
    reqs[0]["u"] = [100, 4]
    settings = {"input_tokens": 100, "output_tokens": 10, "ignore_eos": False}
    tok = bench_stats.token_accounting(raw)
    text = benchmark_report.token_counts(tok["prompt_tokens_per_request"], tok["output_tokens_per_request"], settings)
    assert f"and mean {(4 + 10 * (len(reqs) - 1)) / len(reqs):,.1f} (4-10) output tokens (10 asked for) per request" \
        in text
    for r in reqs:
        r["u"] = None
    tok = bench_stats.token_accounting(raw)
    assert tok["output_tokens_per_request"] is None
    assert benchmark_report.token_counts(None, None, settings) == ("~100 prompt and 10 output tokens per request asked for; "
                                                                   "no completed request reported usage")


def visible_tick_labels(fig):
    """The text of every tick label drawn inside the axes' view, per axis of each subplot."""
    fig.canvas.draw()
    out = []
    for ax in fig.axes:
        for axis, (lo, hi) in ((ax.xaxis, ax.get_xlim()), (ax.yaxis, ax.get_ylim())):
            ticks = axis.get_major_ticks() + axis.get_minor_ticks()
            out.append([t.label1.get_text() for t in ticks
                        if t.label1.get_text() and min(lo, hi) <= t.get_loc() <= max(lo, hi)])
    return out


def test_plots_have_plain_tick_labels_on_log_axes():
    """A latency range within one decade (60-90 ms) gets minor tick labels: they read 60, 70, ...
    and never 6×10^1 (matplotlib's default on log axes)."""
    import matplotlib.pyplot as plt

    rep = report_of(synthetic_run())
    base = rep["steps"][0]
    rep["steps"] = []
    for c, ms in ((1, 60.0), (4, 70.0), (16, 90.0)):
        step = json.loads(json.dumps(base))
        step["concurrency"] = c
        for key in ("ttft_ms", "tpot_ms", "e2el_ms"):
            step[key].update(median=ms, p90=ms * 1.05, p99=ms * 1.1)
        rep["steps"].append(step)
    for fig in (benchmark_report.latency_figure(rep), benchmark_report.throughput_figure(rep)):
        try:
            labels = visible_tick_labels(fig)
        finally:
            plt.close(fig)
        for texts in labels:
            assert texts, "every axis is labelled"
            for text in texts:
                assert not any(mark in text for mark in ("$", "\\times", "×", "^", "e+")), text
                float(text.replace(",", ""))
        assert labels[0] == ["1", "4", "16"]                     # the concurrency axis: the steps
    latency = benchmark_report.latency_figure(rep)
    try:
        ttft_y = visible_tick_labels(latency)[1]
    finally:
        plt.close(latency)
    assert {"60", "70", "80", "90"} <= set(ttft_y)
