# -*- coding: utf-8 -*-
"""The benchmark report: a versioned JSON document, a CSV of the steps, a Markdown summary and PNG
plots, written beside the raw records of a run; and the comparison with the previous run of the
same model on the same host.

Results are laid out as <results_root>/<host>/<model>/<commit>/<run id>/ with report.json,
steps.csv, report.md, throughput.png, latency.png and raw/. Writing is content-based: a file that
would not change is not rewritten (the report has no generation time stamp).
matplotlib draws the plots when it is installed (the controller's requirements.txt has it);
without it the report says that the plots were skipped.
"""
from __future__ import annotations

import csv
import glob
import io
import json
import os
import time
import traceback

from ansible_collections.modelswap.vllm.plugins.module_utils.bench import bench_stats
from ansible_collections.modelswap.vllm.plugins.module_utils.bench import rate_ladder
from ansible_collections.modelswap.vllm.plugins.module_utils.common.fsutil import atomic_write_bytes

try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogFormatter, NullFormatter
    MATPLOTLIB_ERROR = None
except Exception:  # pragma: no cover - depends on the controller
    plt = None
    LogFormatter = object
    MATPLOTLIB_ERROR = traceback.format_exc()

REPORT_FILES = ("report.json", "steps.csv", "report.md")
PLOTS = ("throughput.png", "latency.png")


def iso(wall):
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(wall)) if wall else None


def load_x(step):
    """A step's place on the ladder: its concurrency, or a rate ladder's offered rate."""
    return step["concurrency"] if step.get("concurrency") is not None else step["rate"]["offered"]


def load_label(step):
    """``C=8`` or ``4 req/s``."""
    return f"C={step['concurrency']}" if step.get("concurrency") is not None else f"{step['rate']['offered']:g} req/s"


def build(analysis, *, run_id, host, model, commit, target, deployment=None, previous=None, noise=0.05):
    """The report document (schema modelswap.benchmark/v1) from bench_stats.analyze()."""
    cfg = analysis["config"]
    steps = analysis["steps"]
    by_rate = analysis.get("mode") == "rate"
    if by_rate:
        previous = None     # runs are compared concurrency for concurrency; a rate ladder has its capacity
    report = {
        "schema": bench_stats.SCHEMA,
        "run": {
            "id": run_id, "host": host, "model": model, "commit": commit, "target": target,
            "started": iso(analysis["started_wall"]), "finished": iso(analysis["finished_wall"]),
            "started_wall": analysis["started_wall"], "finished_wall": analysis["finished_wall"],
            "complete": analysis["complete"], "stopped_early": analysis["stopped_early"],
            "steps_planned": analysis["steps_planned"], "steps_run": analysis["steps_run"],
            "load": {"mode": analysis["load_mode"], "host": analysis["load_host"]},
            "settings": {k: cfg.get(k) for k in (
                "api", "input_tokens", "output_tokens", "ignore_eos", "ladder", "ramp_s", "warmup_s",
                "measure_s", "measure_max_s", "min_requests_per_user", "max_requests_per_step",
                "request_timeout_s", "slo", "stop_error_rate", "stop_min_good_ratio", "prompt_format",
                "words_per_token", "prompt_overhead_tokens", "mode", "burstiness", "max_inflight", "limits",
                "search_bisections")},
        },
        # a rate ladder's answer (rate_ladder.capacity) and the sentence that says it
        "capacity": analysis.get("capacity"),
        "headline": rate_ladder.headline(host, analysis["capacity"]) if analysis.get("capacity") else None,
        "deployment": deployment or {},
        "steps": steps,
        "saturation": analysis["saturation"],
        "tokens": analysis["tokens"],
        "comparison": None,
        "definitions": bench_stats.DEFINITIONS,
    }
    if previous is not None:
        prev_doc, prev_path = previous
        rows = bench_stats.compare(steps, prev_doc.get("steps", []), noise=noise)
        sat, psat = analysis["saturation"], prev_doc.get("saturation") or {}
        headline = None
        if sat.get("peak_throughput") and psat.get("peak_throughput"):
            change = sat["peak_throughput"] / psat["peak_throughput"] - 1.0
            headline = {"metric": "peak output_throughput", "previous": psat["peak_throughput"],
                        "current": sat["peak_throughput"], "change": change,
                        "verdict": "same" if abs(change) <= noise else ("better" if change > 0 else "worse"),
                        "previous_knee": psat.get("knee_concurrency"), "current_knee": sat.get("knee_concurrency")}
        report["comparison"] = {
            "previous_run": (prev_doc.get("run") or {}).get("id"), "previous_path": prev_path,
            "previous_commit": (prev_doc.get("run") or {}).get("commit"),
            "previous_deployment": prev_doc.get("deployment"), "noise": noise, "headline": headline,
            "rows": rows,
            "summary": {v: sum(1 for r in rows if r["verdict"] == v) for v in ("better", "worse", "same")}}
    return report


def find_previous(results_root, host, model, current_run_dir, started_wall):
    """The latest complete report.json of the same host and model that finished before this run
    started (any commit), as (document, path), or None."""
    best = None
    pattern = os.path.join(glob.escape(results_root), glob.escape(host), glob.escape(model), "*", "*",
                           "report.json")
    for path in glob.glob(pattern):
        if os.path.abspath(os.path.dirname(path)) == os.path.abspath(current_run_dir):
            continue
        try:
            with open(path, encoding="utf-8") as fh:
                doc = json.load(fh)
        except (OSError, ValueError):
            continue
        run = doc.get("run") or {}
        if doc.get("schema") != bench_stats.SCHEMA or not run.get("complete"):
            continue
        fin = run.get("finished_wall") or 0
        if started_wall and fin >= started_wall:
            continue
        if best is None or fin > best[0]:
            best = (fin, doc, path)
    return (best[1], best[2]) if best else None


# --- renderers ----------------------------------------------------------------------------------
def render_json(report):
    return json.dumps(report, indent=1, sort_keys=False) + "\n"


CSV_COLUMNS = [
    ("concurrency", lambda s: s["concurrency"]),
    ("rate_offered_req_s", lambda s: (s.get("rate") or {}).get("offered")),
    ("rate_achieved_req_s", lambda s: (s.get("rate") or {}).get("achieved")),
    ("dispatch_delay_p99_ms", lambda s: ((s.get("rate") or {}).get("dispatch_delay_ms") or {}).get("p99")),
    ("slo_passed", lambda s: (s.get("slo_verdict") or {}).get("passed")),
    ("valid", lambda s: s["valid"]),
    ("flags", lambda s: " ".join(f["code"] for f in s["flags"])),
    ("window_s", lambda s: s["window_s"]),
    ("measured", lambda s: s["requests"]["measured"]),
    ("completed", lambda s: s["requests"]["completed"]),
    ("failed", lambda s: s["requests"]["failed"]),
    ("error_rate", lambda s: s["error_rate"]),
    ("request_throughput_req_s", lambda s: s["request_throughput"]),
    ("output_throughput_tok_s", lambda s: s["output_throughput"]),
    ("total_token_throughput_tok_s", lambda s: s["total_token_throughput"]),
    ("request_goodput_req_s", lambda s: s["request_goodput"]),
]
for _m in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
    for _stat in ("mean", "median", "p90", "p99", "std"):
        CSV_COLUMNS.append((f"{_m}_{_stat}", lambda s, m=_m, st=_stat: s[m][st]))
CSV_COLUMNS += [
    ("input_tokens_mean", lambda s: s["input_tokens_mean"]),
    ("output_tokens_mean", lambda s: s["output_tokens_mean"]),
    ("server_concurrency_mean", lambda s: (s["server"] or {}).get("concurrency_mean")),
    ("server_waiting_mean", lambda s: (s["server"] or {}).get("waiting_mean")),
    ("server_kv_cache_usage_mean", lambda s: (s["server"] or {}).get("kv_cache_usage_mean")),
    ("server_generation_throughput_tok_s", lambda s: (s["server"] or {}).get("generation_throughput")),
    ("client_cpu_mean_max", lambda s: s["client"]["cpu_mean_max"]),
    ("client_lag_p99_ms", lambda s: s["client"]["lag_p99_ms"]),
    ("littles_law_concurrency", lambda s: (s["littles_law"] or {}).get("concurrency")),
    ("vllm_duration_s", lambda s: (s["vllm_duration"] or {}).get("duration_s")),
    ("vllm_duration_output_throughput_tok_s", lambda s: (s["vllm_duration"] or {}).get("output_throughput")),
]


def render_csv(report):
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow([name for name, _unused in CSV_COLUMNS])
    for s in report["steps"]:
        row = []
        for _name, get in CSV_COLUMNS:
            v = get(s)
            row.append(f"{v:.6g}" if isinstance(v, float) else ("" if v is None else v))
        w.writerow(row)
    return buf.getvalue()


def _f(v, digits=1, pct=False):
    if v is None:
        return "-"
    if pct:
        return f"{v * 100:.{digits}f}%"
    if isinstance(v, float):
        return f"{v:,.{digits}f}"
    return str(v)


def _tokens(counts):
    """'129' when every request had the same count, else 'mean 127.5 (100-129)'."""
    if counts["min"] == counts["max"]:
        return f"{counts['min']:,}"
    return f"mean {counts['mean']:,.1f} ({counts['min']:,}-{counts['max']:,})"


def token_counts(prompt, output, settings):
    """The tokens per request as usage reported them, and what was asked for (the header of report.md)."""
    eos = " with ignore_eos" if settings.get("ignore_eos") else ""
    if output is None:
        return (f"~{settings['input_tokens']} prompt and {settings['output_tokens']} output tokens per request "
                f"asked for{eos}; no completed request reported usage")
    return (f"{_tokens(prompt) if prompt else '?'} prompt tokens (~{settings['input_tokens']} asked for) and "
            f"{_tokens(output)} output tokens ({settings['output_tokens']} asked for{eos}) per request, as "
            f"usage reported them for {output['n']:,} completed requests")


def slo_miss(check):
    """How a step missed one check of the SLO, in words."""
    if check["check"] == "error_rate":
        return f"errors {_f(check['value'], 1, pct=True)} > {_f(check['limit'], 1, pct=True)}"
    if check.get("over") is None:
        return f"{check['check']}: no completed request"
    return (f"{check['check']}: {_f(check['over'], 1, pct=True)} of the samples over {check['limit']:g} ms "
            f"(more than 1%; p99 {_f(check['value'])} ms)")


def render_markdown(report, plots_written=None, plots_error=None):
    run, dep, sat = report["run"], report["deployment"] or {}, report["saturation"]
    s = run["settings"]
    out = [f"# Benchmark: {run['model']} on {run['host']}", ""]
    tok = report["tokens"]
    by_rate = s.get("mode") == "rate"
    if by_rate:
        burst = s.get("burstiness") or 1.0
        loop = ("open loop, Poisson arrivals" if burst == 1 else f"open loop, gamma arrivals of burstiness {burst:g}")
        if s.get("max_inflight"):
            loop += f", at most {s['max_inflight']} in flight"
    else:
        loop = "closed loop"
    out.append(f"Run `{run['id']}`, {run['started']} → {run['finished'] or 'not finished'}, against "
               f"{run['target']} ({s['api']} API, {loop}): "
               + token_counts(tok.get("prompt_tokens_per_request"), tok.get("output_tokens_per_request"), s) + ".")
    out.append("")
    if report.get("headline"):
        out.append(f"**{report['headline']}.**")
        out.append("")
    if by_rate:
        valid = [st for st in report["steps"] if st["valid"]]
        if not valid:
            out.append("**No valid step: no figure can be reported.**")
        elif not report.get("headline"):
            out.append("Rates only, without an SLO (benchmark_slo): no capacity was searched.")
    elif sat.get("peak_throughput") is not None:
        line = (f"**Peak output throughput {_f(sat['peak_throughput'])} tok/s at concurrency "
                f"{sat['peak_concurrency']}.** ")
        if sat.get("knee_concurrency") is not None:
            line += (f"Knee at concurrency **{sat['knee_concurrency']}** ({_f(sat['knee_throughput'])} tok/s, "
                     f"{sat['reason']}); beyond it concurrency buys latency, not throughput.")
        else:
            line += sat["reason"] + "."
        out.append(line)
    else:
        out.append("**No valid step: no throughput can be reported.**")
    invalid = [st for st in report["steps"] if not st["valid"]]
    if invalid:
        out.append("")
        out.append("Invalid steps (not the server's figures): " + "; ".join(
            f"{load_label(st)}: " + ", ".join(f["code"] for f in st["flags"] if f["severity"] == "invalid")
            for st in invalid) + ".")
    if run["stopped_early"]:
        out += ["", f"**Stopped early:** {run['stopped_early']}."]
    if not run["complete"]:
        out += ["", "**The run did not complete**: the figures cover the steps that were measured."]
    out += ["", "## Deployment", ""]
    keys = [("model", dep.get("model") or run["model"]), ("served model name", dep.get("served_model_name")),
            ("commit", dep.get("commit") or run["commit"]), ("model root", dep.get("model_root")),
            ("vLLM version", dep.get("vllm_version")), ("max_model_len", dep.get("max_model_len"))]
    for k, v in sorted((dep.get("vllm_args") or {}).items()):
        keys.append((f"--{k.replace('_', '-')}", v))
    for k, v in sorted((dep.get("extra") or {}).items()):
        keys.append((k, v))
    group = dep.get("replica_group") or {}
    if group.get("nodes"):
        # a model served across hosts: the target is its head, the report the group's
        nodes = group["nodes"]
        keys.append(("replica group", "%s: %s (head), %s" % (group.get("name"), nodes[0], ", ".join(nodes[1:]))))
    out += ["| item | value |", "|---|---|"]
    out += [f"| {k} | {'-' if v is None else v} |" for k, v in keys]
    out += ["", "## Steps", "",
            f"| {'rate' if by_rate else 'C'} | valid | req/s | output tok/s | total tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | "
            "ITL p50 / p99 ms | E2EL p50 / p99 ms | errors | server C (wait) | KV cache | client CPU / lag p99 |",
            "|---:|:---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for st in report["steps"]:
        srv = st["server"] or {}
        cl = st["client"]
        out.append(
            f"| {load_x(st):g} | {'yes' if st['valid'] else '**no**'} | {_f(st['request_throughput'], 2)} | "
            f"{_f(st['output_throughput'])} | {_f(st['total_token_throughput'])} | "
            f"{_f(st['ttft_ms']['median'])} / {_f(st['ttft_ms']['p99'])} | "
            f"{_f(st['tpot_ms']['median'])} / {_f(st['tpot_ms']['p99'])} | "
            f"{_f(st['itl_ms']['median'])} / {_f(st['itl_ms']['p99'])} | "
            f"{_f(st['e2el_ms']['median'], 0)} / {_f(st['e2el_ms']['p99'], 0)} | "
            f"{_f(st['error_rate'], 1, pct=True)} | "
            f"{_f(srv.get('concurrency_mean'))} ({_f(srv.get('waiting_mean'))}) | "
            f"{_f(srv.get('kv_cache_usage_mean'), 0, pct=True)} | "
            f"{_f(cl['cpu_mean_max'], 0, pct=True)} / {_f(cl['lag_p99_ms'])} ms |")
    if by_rate:
        out += ["", "Rate steps in the order they ran (the sweep, then the search's bisections):", "",
                "| rate offered | achieved | dispatch delay p50 / p99 ms | wait at the cap p99 ms | SLO |",
                "|---:|---:|---:|---:|---|"]
        for st in report["steps"]:
            rate, verdict = st["rate"], st.get("slo_verdict")
            dd = rate["dispatch_delay_ms"]
            if verdict is None:
                slo = "-" if st["valid"] else "not judged (invalid)"
            else:
                slo = ("met" if verdict["passed"] else "missed: " + "; ".join(
                    slo_miss(c) for c in verdict["checks"] if not c["passed"]))
            out.append(f"| {rate['offered']:g} | {_f(rate['achieved'], 2)} | {_f(dd['median'], 2)} / {_f(dd['p99'], 2)} | "
                       f"{_f(rate['cap_wait_ms']['p99'], 1)} | {slo} |")
    flagged = [st for st in report["steps"] if st["flags"]]
    if flagged:
        out += ["", "## Flags", ""]
        for st in flagged:
            for fl in st["flags"]:
                out.append(f"- {load_label(st)} **{fl['code']}** ({fl['severity']}): {fl['message']}")
    out += ["", "## Token accounting", "",
            f"Client (usage of every request of the run): {tok['client_completion_tokens']:,} output, "
            f"{tok['client_prompt_tokens']:,} prompt tokens. Server counters (vllm:generation_tokens_total, "
            f"vllm:prompt_tokens_total, first to last sample): "
            f"{_f(tok['server_generation_tokens'])} output, {_f(tok['server_prompt_tokens'])} prompt. "
            + ("They agree." if tok["match"] else ("They differ: other traffic reached the server, or "
                                                   "requests were cut." if tok["match"] is False
                                                   else "No server counters to compare."))]
    cmp = report["comparison"]
    out += ["", "## Compared with the previous run", ""]
    if cmp is None and by_rate:
        out.append("Rate ladders are not compared run to run: their capacity at the SLO is the figure to compare.")
    elif cmp is None:
        out.append("No previous complete run of this model on this host.")
    else:
        out.append(f"Previous run `{cmp['previous_run']}` (commit {cmp['previous_commit'] or '-'}); "
                   f"changes within ±{cmp['noise']:.0%} count as the same.")
        h = cmp.get("headline")
        if h:
            out.append("")
            out.append(f"Peak output throughput {_f(h['previous'])} → {_f(h['current'])} tok/s "
                       f"({h['change']:+.1%}, {h['verdict']}); knee {h['previous_knee']} → {h['current_knee']}.")
        if cmp["rows"]:
            out += ["", "| C | metric | previous | now | change | verdict |", "|---:|---|---:|---:|---:|---|"]
            for r in cmp["rows"]:
                out.append(f"| {r['concurrency']} | {r['metric']} | {_f(r['previous'], 2)} | {_f(r['current'], 2)} | "
                           f"{r['change']:+.1%} | {r['verdict']} |")
        else:
            out.append("")
            out.append("No concurrency was valid in both runs.")
    out += ["", "## Plots", ""]
    if plots_written:
        out += [f"![{p}]({p})" for p in plots_written]
    else:
        out.append(f"Plots skipped: {plots_error or 'not asked for'}.")
    out += ["", "## Definitions (vLLM's, `vllm bench serve`)", ""]
    out += [f"- **{k}**: {v}" for k, v in report["definitions"].items()]
    return "\n".join(out) + "\n"


def plain_number(value, _pos=None):
    """A tick label as people write numbers: 60, 0.5, 1,500 (not 6×10^1)."""
    if value == 0:
        return "0"
    return f"{value:,.6f}".rstrip("0").rstrip(".")


class PlainLogFormatter(LogFormatter):
    """matplotlib's choice of which log-axis ticks get a label (every decade, and some minor ticks
    when the axis spans little), written as plain numbers."""

    def __call__(self, x, pos=None):
        return plain_number(x) if super().__call__(x, pos) else ""


def _concurrency_axis(ax, steps):
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({load_x(s) for s in steps}))
    ax.xaxis.set_major_formatter(FuncFormatter(plain_number))
    ax.xaxis.set_minor_formatter(NullFormatter())
    by_rate = any(s.get("concurrency") is None for s in steps)
    ax.set_xlabel("offered rate (requests / s)" if by_rate else "concurrency (streams)")
    ax.grid(True, which="major", alpha=0.3)


def throughput_figure(report, previous=None):
    """The throughput plot (a matplotlib figure; the caller closes it)."""
    steps = sorted(report["steps"], key=load_x)        # a search runs its rates out of order
    sat = report["saturation"]
    fig, ax = plt.subplots(figsize=(8, 4.8), dpi=100)
    for key, label, color in (("output_throughput", "output tok/s", "tab:blue"),
                              ("total_token_throughput", "total tok/s", "tab:green")):
        xs = [load_x(s) for s in steps if s[key] is not None]
        ys = [s[key] for s in steps if s[key] is not None]
        ax.plot(xs, ys, "-", color=color, label=label)
        ax.scatter([load_x(s) for s in steps if s[key] is not None and s["valid"]],
                   [s[key] for s in steps if s[key] is not None and s["valid"]], color=color, zorder=3)
        bad = [s for s in steps if s[key] is not None and not s["valid"]]
        if bad:
            ax.scatter([load_x(s) for s in bad], [s[key] for s in bad], facecolors="none",
                       edgecolors="red", s=90, zorder=4, label=f"{label} (invalid step)")
    if previous:
        psteps = [s for s in previous.get("steps", []) if s.get("output_throughput") is not None]
        ax.plot([s["concurrency"] for s in psteps], [s["output_throughput"] for s in psteps], "--",
                color="gray", label=f"output tok/s, previous run {(previous.get('run') or {}).get('id')}")
    if sat.get("knee_concurrency"):
        ax.axvline(sat["knee_concurrency"], color="tab:orange", linestyle=":",
                   label=f"knee (C={sat['knee_concurrency']})")
    _concurrency_axis(ax, steps)
    ax.set_ylabel("tokens / s")
    ax.set_ylim(bottom=0)
    ax.set_title(f"Throughput: {report['run']['model']} on {report['run']['host']}")
    ax.legend(fontsize="small")
    fig.tight_layout()
    return fig


def latency_figure(report):
    """The latency percentiles plot, log scales with plain tick labels (the caller closes it)."""
    steps = sorted(report["steps"], key=load_x)
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2), dpi=100)
    for ax, key, title in zip(axes, ("ttft_ms", "tpot_ms", "e2el_ms"), ("TTFT", "TPOT", "E2E latency")):
        for stat, style in (("median", "-o"), ("p90", "--s"), ("p99", ":^")):
            pts = [(load_x(s), s[key][stat]) for s in steps if s[key][stat] is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=stat, markersize=4)
        bad = [s for s in steps if not s["valid"] and s[key]["median"] is not None]
        if bad:
            ax.scatter([load_x(s) for s in bad], [s[key]["median"] for s in bad], facecolors="none",
                       edgecolors="red", s=90, zorder=4, label="invalid step")
        _concurrency_axis(ax, steps)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(PlainLogFormatter(labelOnlyBase=False))
        ax.yaxis.set_minor_formatter(PlainLogFormatter(labelOnlyBase=False))
        ax.set_ylabel("ms")
        ax.set_title(title)
        ax.legend(fontsize="small")
    fig.suptitle(f"Latency percentiles: {report['run']['model']} on {report['run']['host']}")
    fig.tight_layout()
    return fig


def render_plots(report, previous=None):
    """{file name: PNG bytes}; raises RuntimeError when matplotlib is missing."""
    if plt is None:
        raise RuntimeError("matplotlib is not installed on the controller (pip install -r requirements.txt)")
    out = {}
    meta = {"Software": None}
    for name, fig in (("throughput.png", throughput_figure(report, previous)), ("latency.png", latency_figure(report))):
        buf = io.BytesIO()
        fig.savefig(buf, format="png", metadata=meta)
        plt.close(fig)
        out[name] = buf.getvalue()
    return out


def plan_files(report, *, plots=True, previous_doc=None):
    """{file name: bytes} of everything the report writes, and why plots are missing (or None)."""
    files = {}
    plots_written, plots_error = [], None
    if plots:
        try:
            pngs = render_plots(report, previous_doc)
            files.update(pngs)
            plots_written = sorted(pngs)
        except RuntimeError as exc:
            plots_error = str(exc)
    else:
        plots_error = "plots were turned off"
    files["report.json"] = render_json(report).encode()
    files["steps.csv"] = render_csv(report).encode()
    files["report.md"] = render_markdown(report, plots_written, plots_error).encode()
    return files, plots_error


def changed_files(run_dir, files):
    """Names whose content differs from what is on disk."""
    changed = []
    for name, data in files.items():
        path = os.path.join(run_dir, name)
        try:
            with open(path, "rb") as fh:
                if fh.read() == data:
                    continue
        except OSError:
            pass
        changed.append(name)
    return sorted(changed)


def write_files(run_dir, files, names):
    """Write `names` of `files` atomically (temp file + rename), mode 0644."""
    for name in names:
        atomic_write_bytes(os.path.join(run_dir, name), files[name], 0o644)
