"""vllm_unit: catalog vllm_args -> `vllm serve` argv -> systemd ExecStart; environment files."""
from __future__ import annotations

import shlex

import pytest

from ansible_collections.modelswap.vllm.plugins.module_utils.common import vllm_args as vllm_args_rules
from ansible_collections.modelswap.vllm.plugins.module_utils.serving import vllm_unit
from ansible_collections.modelswap.vllm.plugins.module_utils.serving.served_model import (
    exec_start_argv,
    model_from_argv,
)

pytestmark = pytest.mark.unit

VLLM = "/opt/modelswap/venvs/vllm-0.32.0/bin/vllm"
SNAP = "/var/lib/modelswap/hf/hub/models--moonshotai--Kimi-K2.5/snapshots/" + "0" * 40


def test_kimi_k25_int4_tp8_expert_parallel():
    """The example fleet's deployment: TP=8 with expert parallelism on an 8-GPU box."""
    args = {"tensor_parallel_size": 8, "enable_expert_parallel": True, "max_model_len": 131072,
            "gpu_memory_utilization": 0.92, "trust_remote_code": True,
            "extra_args": ["--tool-call-parser", "kimi_k2", "--reasoning-parser", "kimi_k2"]}
    argv = vllm_unit.serve_argv(VLLM, SNAP, "kimi-k2.5", "0.0.0.0", 8000, args)
    assert argv == [
        VLLM, "serve", SNAP, "--host", "0.0.0.0", "--port", "8000",
        "--served-model-name", "kimi-k2.5",
        "--tensor-parallel-size", "8", "--enable-expert-parallel", "--max-model-len", "131072",
        "--gpu-memory-utilization", "0.92", "--trust-remote-code",
        "--tool-call-parser", "kimi_k2", "--reasoning-parser", "kimi_k2"]
    assert vllm_args_rules.parallel_size(args) == 8
    line = vllm_unit.systemd_exec(argv)
    # Plain words stay unquoted; what systemd parses back is the same argv, and served_model
    # (the purge's "served model" rule) finds the snapshot in it.
    assert line.startswith(VLLM + " serve " + SNAP + " --host 0.0.0.0")
    assert shlex.split(line) == argv
    assert model_from_argv(exec_start_argv(line)) == SNAP
    assert vllm_unit.argv_settings(argv) == {"parallel": 8, "enforce_eager": False,
                                             "gpu_memory_utilization": 0.92}


@pytest.mark.parametrize("vllm_args, expected", [
    ({}, []),
    (None, []),
    ({"enforce_eager": False, "dtype": None}, []),
    ({"dtype": "float32", "max_model_len": 512, "enforce_eager": True},
     ["--max-model-len", "512", "--dtype", "float32", "--enforce-eager"]),
    # known arguments first in a fixed order, the rest sorted by name
    ({"swap_space": 4, "pipeline_parallel_size": 2, "tensor_parallel_size": 4, "block_size": 16},
     ["--tensor-parallel-size", "4", "--pipeline-parallel-size", "2", "--block-size", "16",
      "--swap-space", "4"]),
    ({"gpu_memory_utilization": 1}, ["--gpu-memory-utilization", "1"]),
    ({"gpu_memory_utilization": 0.9}, ["--gpu-memory-utilization", "0.9"]),
    ({"kv_cache_dtype": "fp8", "data_parallel_size": 2, "enable_expert_parallel": True},
     ["--data-parallel-size", "2", "--enable-expert-parallel", "--kv-cache-dtype", "fp8"]),
    ({"hf_overrides": {"rope_scaling": {"factor": 4.0, "type": "yarn"}}},
     ["--hf-overrides", '{"rope_scaling":{"factor":4.0,"type":"yarn"}}']),
    ({"allowed_local_media_path": ["/a", "/b"], "served_extra": []},
     ["--allowed-local-media-path", "/a", "/b"]),
    ({"extra_args": ["--disable-custom-all-reduce"]}, ["--disable-custom-all-reduce"]),
])
def test_vllm_args_rendering(vllm_args, expected):
    assert vllm_args_rules.vllm_args_argv(vllm_args) == expected


@pytest.mark.parametrize("vllm_args, message", [
    ({"api_key": "x"}, "vllm_args.api_key is not allowed"),
    ({"port": 1}, "use vllm_service_port"),
    ({"host": "h"}, "use vllm_service_host"),
    ({"served_model_name": "m"}, "served_model_name on the catalog entry"),
    ({"model": "/x"}, "snapshot path is the role's"),
    ({"revision": "main"}, "pins the commit"),
    ({"tensor_parallel_size": 0}, "positive integer"),
    ({"tensor_parallel_size": "8"}, "positive integer"),
    ({"pipeline_parallel_size": True}, "positive integer"),
    ({"gpu_memory_utilization": 1.5}, "fraction in (0, 1]"),
    ({"Max-Model-Len": 1}, "not a vLLM argument name"),
    ({"extra_args": "--foo bar"}, "extra_args must be a list of strings"),
    ({"extra_args": [1]}, "extra_args must be a list of strings"),
    ({"dtype": "a\nb"}, "newline"),
    ({"dtype": object()}, "type object"),
    (["--x"], "must be a mapping"),
])
def test_vllm_args_refused(vllm_args, message):
    with pytest.raises(vllm_unit.ArgsError, match=__import__("re").escape(message)):
        vllm_args_rules.vllm_args_argv(vllm_args)


@pytest.mark.parametrize("path, name, port, message", [
    ("relative/path", "m", 8000, "absolute path"),
    ("", "m", 8000, "absolute path"),
    ("/m", "", 8000, "served model name"),
    ("/m", "m", 0, "1..65535"),
    ("/m", "m", "x", "port must be an integer"),
])
def test_serve_argv_refused(path, name, port, message):
    with pytest.raises(vllm_unit.ArgsError, match=message):
        vllm_unit.serve_argv(VLLM, path, name, "0.0.0.0", port, {})


@pytest.mark.parametrize("drain, words", [
    (60, ["--shutdown-timeout", "60"]),
    ("45", ["--shutdown-timeout", "45"]),
    (0, []),        # vLLM's default (abort in-flight requests): the flag is left out
])
def test_serve_argv_drain_before_the_catalogs_arguments(drain, words):
    argv = vllm_unit.serve_argv(VLLM, SNAP, "m", "0.0.0.0", 8000, {"max_model_len": 512},
                                middleware="g.M", shutdown_timeout=drain)
    assert argv == [VLLM, "serve", SNAP, "--host", "0.0.0.0", "--port", "8000", "--served-model-name", "m",
                    "--middleware", "g.M"] + words + ["--max-model-len", "512"]


@pytest.mark.parametrize("drain", [-1, "x", None, True, 1.5])
def test_serve_argv_refuses_a_drain_that_is_not_whole_seconds(drain):
    with pytest.raises(vllm_unit.ArgsError, match="vllm_service_shutdown_timeout must be whole seconds"):
        vllm_unit.serve_argv(VLLM, SNAP, "m", "0.0.0.0", 8000, {}, shutdown_timeout=drain)


@pytest.mark.parametrize("drain, stop, ok", [
    (60, 120, True), (90, 120, True), (91, 120, False), (0, 30, True), (0, 29, False), ("60", "120", True)])
def test_stop_leaves_room_for_the_drain_and_the_teardown(drain, stop, ok):
    problems = vllm_unit.stop_problems(drain, stop)
    assert (problems == []) is ok, problems
    if not ok:
        assert "must be at least vllm_service_shutdown_timeout (%d s) + 30 s" % int(drain) in problems[0]


@pytest.mark.parametrize("word, quoted", [
    ("/opt/x/bin/vllm", "/opt/x/bin/vllm"),
    ("--max-model-len", "--max-model-len"),
    ("a b", '"a b"'),
    ('say "hi"', '"say \\"hi\\""'),
    ("back\\slash", '"back\\\\slash"'),
    ("50%", "50%%"),
    ("$HOME", '"$$HOME"'),
    ('{"a":1}', '"{\\"a\\":1}"'),
    ("", '""'),
    (";", '";"'),
])
def test_systemd_quote(word, quoted):
    assert vllm_unit.systemd_quote(word) == quoted


def test_systemd_exec_needs_absolute_program_and_refuses_newlines():
    with pytest.raises(vllm_unit.ArgsError, match="absolute path"):
        vllm_unit.systemd_exec(["vllm", "serve"])
    with pytest.raises(vllm_unit.ArgsError, match="newline"):
        vllm_unit.systemd_exec(["/bin/vllm", "a\nb"])


def test_env_lines_sorted_quoted_and_validated():
    assert vllm_unit.env_lines({"NCCL_PROTO": "LL", "B": 1, "A": True, "GONE": None, "Q": 'a"b\\c'}) == [
        'A="1"', 'B="1"', 'NCCL_PROTO="LL"', 'Q="a\\"b\\\\c"']
    with pytest.raises(vllm_unit.ArgsError, match="name '1BAD' is not valid"):
        vllm_unit.env_lines({"1BAD": "x"})
    with pytest.raises(vllm_unit.ArgsError, match="newline"):
        vllm_unit.env_lines({"X": "a\nb"})
    with pytest.raises(vllm_unit.ArgsError, match="mapping"):
        vllm_unit.env_lines(["X=1"])


def test_merge_env_later_wins_and_null_removes():
    base = {"HF_HUB_OFFLINE": "1", "NCCL_DEBUG": "WARN"}
    assert vllm_unit.merge_env(base, {"NCCL_DEBUG": "INFO", "NCCL_PROTO": "LL"}, {"HF_HUB_OFFLINE": None}) == {
        "NCCL_DEBUG": "INFO", "NCCL_PROTO": "LL"}
    assert vllm_unit.merge_env(base, None) == base


@pytest.mark.parametrize("argv, settings", [
    ([VLLM, "serve", "/m"], {"parallel": 1, "enforce_eager": False, "gpu_memory_utilization": 0.9}),
    ([VLLM, "serve", "/m", "--tensor-parallel-size", "4", "--pipeline-parallel-size=2", "--enforce-eager",
      "--gpu-memory-utilization", "0.8"],
     {"parallel": 8, "enforce_eager": True, "gpu_memory_utilization": 0.8}),
    ([VLLM, "serve", "/m", "-tp", "2", "--data-parallel-size", "2"],
     {"parallel": 4, "enforce_eager": False, "gpu_memory_utilization": 0.9}),
    ([], {"parallel": 1, "enforce_eager": False, "gpu_memory_utilization": 0.9}),
])
def test_argv_settings(argv, settings):
    assert vllm_unit.argv_settings(argv) == settings


def test_units_to_replace_are_the_running_or_enabled_ones():
    units = [
        {"unit": "gone.service", "loaded": False, "active_state": "inactive", "unit_file_state": None},
        {"unit": "off.service", "loaded": True, "active_state": "inactive", "unit_file_state": "disabled"},
        {"unit": "boot.service", "loaded": True, "active_state": "failed", "unit_file_state": "enabled"},
        {"unit": "hand.service", "loaded": True, "active_state": "active", "unit_file_state": "disabled"},
        {"unit": "start.service", "loaded": True, "active_state": "activating", "unit_file_state": "enabled"},
    ]
    assert [u["unit"] for u in vllm_unit.units_to_replace(units)] == ["hand.service", "start.service", "boot.service"]
    assert vllm_unit.units_to_replace([]) == [] and vllm_unit.units_to_replace(None) == []
