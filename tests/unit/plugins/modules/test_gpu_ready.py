"""plugins/modules/gpu_ready.py run as Ansible runs it (tests.support.modules.run_module).

NVML: the real pynvml on this GPU-less machine (-> no GPUs), or the fake of
tests/support/fake_pynvml.py put first on PYTHONPATH as `pynvml` (the module imports it exactly
as on a host). /dev/shm: a temporary directory standing in for it, with real holder processes,
inside a fresh PID namespace (see tests/support/shm_ns.py); gpu_ready only reports its stale
segments (stale_shm) and leaves every file in place (shm_cleanup removes them, see
tests/unit/plugins/modules/test_shm_cleanup.py).
"""
from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess

import pynvml
import pytest

from tests.support.fake_pynvml import gpu
from tests.support.modules import COLLECTIONS, REPO, run_module
from tests.support.shm_ns import NEEDS_NAMESPACE, in_namespace, populate

pytestmark = pytest.mark.unit

GIB = 1024 ** 3
ME = pwd.getpwuid(os.getuid()).pw_name
SHIM = REPO / "tests" / "support" / "fakenvml"


def warnings(result):
    """Warning texts of a result (ansible-core 2.19 returns structured WarningSummary dicts)."""
    out = []
    for w in result.get("warnings", []):
        out.append(w["event"]["msg"] if isinstance(w, dict) else str(w))
    return out


def run_fake(tmp_path, scenario, args=None, **kw):
    path = tmp_path / "scenario.json"
    path.write_text(json.dumps(scenario))
    env = {"PYTHONPATH": os.pathsep.join([str(SHIM), str(COLLECTIONS)]),
           "MODELSWAP_FAKE_NVML": str(path)}
    return run_module("gpu_ready", args or {}, env=env, **kw)


@pytest.fixture
def sleeper():
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    proc.kill()
    proc.wait(timeout=10)


# ---------------------------------------------------------------------------- documentation

def test_documentation_matches_the_argument_spec():
    import importlib.util

    import yaml

    spec = importlib.util.spec_from_file_location("gpu_ready_doc", REPO / "plugins" / "modules" / "gpu_ready.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    doc = yaml.safe_load(mod.DOCUMENTATION)["options"]
    argspec = mod.argument_spec()
    assert sorted(doc) == sorted(argspec)
    for name, arg in argspec.items():
        assert doc[name]["type"] == arg["type"], name
        assert doc[name].get("default") == arg.get("default"), name
        assert doc[name].get("elements") == arg.get("elements"), name
    yaml.safe_load(mod.EXAMPLES)
    yaml.safe_load(mod.RETURN)


# ---------------------------------------------------------------------------- no NVML

def test_cpu_host_reports_no_gpus_with_the_reason():
    result = run_module("gpu_ready", {"gpu_memory_utilization": 0.9})
    assert result.get("failed") is not True, result
    assert result["changed"] is False and result["ready"] is True
    assert result["gpus"] == [] and result["nvml"]["available"] is False
    assert "libnvidia-ml.so.1 is not installed" in result["nvml"]["reason"]
    assert result["msg"].startswith("No GPUs: NVML not available")


def test_cpu_host_fails_when_the_caller_requires_gpus():
    result = run_module("gpu_ready", {"tensor_parallel_size": 2, "pipeline_parallel_size": 2})
    assert result["failed"] is True and result["ready"] is False and result["gpus"] == []
    assert result["msg"].startswith(
        "GPU readiness check failed: needs at least 4 GPU(s) (tensor_parallel_size 2 x "
        "pipeline_parallel_size 2) but NVML not available")


def test_no_binding_and_no_driver_is_no_gpus(tmp_path):
    shadow = tmp_path / "nobinding"
    shadow.mkdir()
    (shadow / "pynvml.py").write_text("raise ImportError('No module named pynvml')\n")
    env = {"PYTHONPATH": os.pathsep.join([str(shadow), str(COLLECTIONS)])}
    result = run_module("gpu_ready", {}, env=env)
    assert result.get("failed") is not True, result
    assert result["gpus"] == []
    assert "nvidia-ml-py (pynvml) is not installed" in result["nvml"]["reason"]


def test_no_binding_but_a_driver_is_missing_required_lib(tmp_path):
    shadow = tmp_path / "nobinding"
    shadow.mkdir()
    (shadow / "pynvml.py").write_text("raise ImportError('No module named pynvml')\n")
    libdir = tmp_path / "lib"
    libdir.mkdir()
    # Any loadable shared object stands in for the driver's library.
    import ctypes.util
    donor = ctypes.util.find_library("z") or ctypes.util.find_library("m")
    donor_path = next(p for p in ("/lib/x86_64-linux-gnu/" + donor, "/usr/lib/x86_64-linux-gnu/"
                                  + donor, "/lib64/" + donor, "/usr/lib64/" + donor)
                      if os.path.exists(p))
    shutil.copy(donor_path, libdir / "libnvidia-ml.so.1")
    env = {"PYTHONPATH": os.pathsep.join([str(shadow), str(COLLECTIONS)]),
           "LD_LIBRARY_PATH": str(libdir)}
    result = run_module("gpu_ready", {}, env=env)
    assert result["failed"] is True
    assert "Failed to import the required Python library (nvidia-ml-py)" in result["msg"]
    assert "libnvidia-ml.so.1 is present" in result["msg"]


# ---------------------------------------------------------------------------- fake NVML

def test_all_free_with_the_fake(tmp_path):
    scenario = {"devices": [gpu(0), gpu(1)], "topology": {"0-1": 20}, "nvlink_p2p": []}
    result = run_fake(tmp_path, scenario, {"tensor_parallel_size": 2,
                                           "gpu_memory_utilization": 0.92})
    assert result.get("failed") is not True, result
    assert result["ready"] is True and result["changed"] is False
    assert [g["index"] for g in result["gpus"]] == [0, 1]
    assert result["nvml"] == {"available": True, "reason": None, "driver_version": "550.54.15",
                              "cuda_driver_version": "12.4", "nvml_version": "12.550.54.15"}
    assert result["topology"]["interconnect"] == "pcie"
    assert result["topology"]["pairs"][0]["path"] == "PXB"
    assert result["msg"] == "2 GPU(s) ready (NVIDIA H100 80GB HBM3)"
    assert "comm" not in json.dumps(result["gpus"])


def test_foreign_process_fails_naming_pid_and_cmdline(tmp_path, sleeper):
    busy = gpu(1, used=40 * GIB, processes=[{"pid": sleeper.pid, "used": 39 * GIB}])
    scenario = {"devices": [gpu(0), busy]}
    result = run_fake(tmp_path, scenario, {"gpu_memory_utilization": 0.9})
    assert result["failed"] is True and result["ready"] is False
    assert result["msg"].startswith("GPU readiness check failed on GPU(s) 1: ")
    assert "PID %d (user %s: sleep 60) holds 39.0 GiB" % (sleeper.pid, ME) in result["msg"]
    assert {p["kind"] for p in result["problems"]} == {"process", "memory"}
    assert result["gpus"][1]["processes"][0]["cmdline"] == "sleep 60"


def test_wait_until_memory_is_released(tmp_path):
    scenario = {"devices": [gpu(0, used=70 * GIB, processes=[{"pid": 999999, "used": 69 * GIB}],
                                after_reads={"n": 3, "used": GIB // 2, "processes": []})]}
    result = run_fake(tmp_path, scenario, {"gpu_memory_utilization": 0.9, "wait_timeout": 30,
                                           "poll_interval": 0.05})
    assert result.get("failed") is not True, result
    assert result["ready"] is True and result["polls"] == 4 and result["timed_out"] is False
    assert 0.1 <= result["waited"] < 10
    assert result["msg"].startswith("1 GPU(s) ready (NVIDIA H100 80GB HBM3) after 4 polls in")


def test_wait_times_out_and_says_who_holds_what(tmp_path, sleeper):
    scenario = {"devices": [gpu(0, used=70 * GIB,
                                processes=[{"pid": sleeper.pid, "used": 69 * GIB}])]}
    result = run_fake(tmp_path, scenario, {"gpu_memory_utilization": 0.9, "wait_timeout": 0.5,
                                           "poll_interval": 0.1})
    assert result["failed"] is True and result["timed_out"] is True
    assert result["polls"] >= 3
    assert "after waiting 0 s for GPU memory to be released" in result["msg"] or \
        "after waiting 1 s for GPU memory to be released" in result["msg"]
    assert "PID %d (user %s: sleep 60)" % (sleeper.pid, ME) in result["msg"]


def test_report_mode_returns_problems_without_failing(tmp_path):
    scenario = {"devices": [gpu(0, ecc_volatile=3)]}
    result = run_fake(tmp_path, scenario, {"fail_when_not_ready": False})
    assert result.get("failed") is not True
    assert result["ready"] is False and [p["kind"] for p in result["problems"]] == ["ecc"]
    assert result["msg"] == "1 GPU(s) not ready (NVIDIA H100 80GB HBM3)"


@pytest.mark.parametrize("code,words", [
    (pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH, "different versions, usually after a driver upgrade"),
    (pynvml.NVML_ERROR_NO_PERMISSION, "NVML denied access"),
    (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, None),
])
def test_nvml_errors_at_init(tmp_path, code, words):
    result = run_fake(tmp_path, {"init_error": code, "devices": [gpu(0)]})
    if words is None:  # driver not loaded: no GPUs, not an error unless required
        assert result.get("failed") is not True and result["gpus"] == []
        assert "kernel driver is not loaded" in result["nvml"]["reason"]
        return
    assert result["failed"] is True and result["gpus"] == []
    assert result["msg"].startswith("Cannot check the GPUs: NVML error while initializing NVML")
    assert words in result["msg"]


def test_report_mode_turns_a_broken_nvml_into_a_problem(tmp_path):
    scenario = {"init_error": pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH, "devices": [gpu(0)]}
    result = run_fake(tmp_path, scenario, {"fail_when_not_ready": False})
    assert result.get("failed") is not True, result
    assert result["ready"] is False and [p["kind"] for p in result["problems"]] == ["nvml"]
    assert "reboot the host" in result["nvml"]["reason"]


def test_gpu_lost_names_the_gpu(tmp_path):
    scenario = {"devices": [gpu(0), gpu(1, errors={"nvmlDeviceGetMemoryInfo":
                                                   pynvml.NVML_ERROR_GPU_IS_LOST})]}
    result = run_fake(tmp_path, scenario)
    assert result["failed"] is True
    assert "on GPU(s) 1:" in result["msg"] and "GPU is lost" in result["msg"]
    assert result["gpus"][0]["error"] is None and "GPU is lost" in result["gpus"][1]["error"]


# ---------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("args,text", [
    ({"min_gpus": -2}, "min_gpus must be an integer >= 0, got -2"),
    ({"tensor_parallel_size": -1}, "tensor_parallel_size must be an integer >= 1, got -1"),
    ({"gpu_memory_utilization": 1.2}, "gpu_memory_utilization must be a fraction in (0, 1]"),
    ({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization must be a fraction in (0, 1]"),
    ({"wait_timeout": -1}, "wait_timeout must be a number of seconds >= 0"),
    ({"service_user": "root", "shm_patterns": ["/etc/*"]}, "is absolute"),
    ({"service_user": "root", "shm_patterns": ["../*"]},
     "unknown shm pattern(s): '../*' contains '/'"),
    ({"service_user": "root", "shm_patterns": ["*"]},
     "would match almost any file name"),
    ({"service_user": "no-such-user-ms"},
     "service user 'no-such-user-ms' does not exist on this host"),
    # The readiness check removes nothing: the cleanup's switch is gone (shm_cleanup is a module).
    ({"shm_cleanup": True, "service_user": "root"}, "Unsupported parameters for (basic.py) module: shm_cleanup"),
])
def test_bad_input_fails_clearly_before_anything(args, text):
    result = run_module("gpu_ready", args)
    assert result["failed"] is True, result
    assert text in result["msg"]
    assert "gpus" not in result


# ---------------------------------------------------------------------------- /dev/shm: reported, never removed

@NEEDS_NAMESPACE
def test_stale_segments_are_reported_and_left_in_place(tmp_path):
    """The readiness check changes nothing: with service_user it lists the stale segments (what
    shm_cleanup would remove), in check mode, a real run and a diff run alike, and every file stays."""
    shmdir = tmp_path / "shm"
    populate(shmdir)
    before = sorted(os.listdir(shmdir))
    args = {"service_user": ME, "shm_dir": str(shmdir), "shm_patterns": ["sem.loky-*"]}
    out = in_namespace(tmp_path, {"dir": str(shmdir), "hold_fd": ["psm_held"], "hold_map": ["nccl-mapped"],
                                  "runs": [{"module": "gpu_ready", "args": args},
                                           {"module": "gpu_ready", "args": args, "check_mode": True},
                                           {"module": "gpu_ready", "args": args, "diff": True}]})
    for run in out["runs"]:
        result = run["result"]
        assert result.get("failed") is not True, result
        assert run["after"] == before
        assert result["changed"] is False and "diff" not in result and "shm" not in result
        assert [(os.path.basename(e["path"]), e["size"], e["pattern"]) for e in result["stale_shm"]] == [
            ("nccl-1a2b", 32768, "nccl-*"), ("psm_9f8e", 4096, "psm_*"), ("sem.loky-7", 32, "sem.loky-*"),
            ("sem.mp-abc", 32, "sem.mp-*"), ("vllm_buf", 1024, "vllm_*")]
        assert result["msg"].endswith("; 5 stale /dev/shm segment(s) of %s (37 KiB) left in place "
                                      "(modelswap.vllm.shm_cleanup removes them)" % ME)


@NEEDS_NAMESPACE
def test_gpus_not_ready_still_removes_nothing(tmp_path):
    shmdir = tmp_path / "shm"
    populate(shmdir)
    before = sorted(os.listdir(shmdir))
    args = {"service_user": ME, "shm_dir": str(shmdir), "min_gpus": 1}
    out = in_namespace(tmp_path, {"dir": str(shmdir), "runs": [{"module": "gpu_ready", "args": args}]})
    result = out["runs"][0]["result"]
    assert result["failed"] is True and result["changed"] is False
    assert len(result["stale_shm"]) == 6          # psm_held and nccl-mapped are not held here
    assert out["runs"][0]["after"] == before


def test_without_service_user_the_shm_directory_is_not_read(tmp_path):
    result = run_module("gpu_ready", {"shm_dir": str(tmp_path / "absent")})
    assert result.get("failed") is not True, result
    assert "stale_shm" not in result and result["changed"] is False
