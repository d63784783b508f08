"""gpu_ready's NVML logic (plugins/module_utils/gpu/gpu_ready.py) against a fake NVML built on the real pynvml.

The fake (tests/support/fake_pynvml.py) has the real binding's function names and signatures
(checked below), returns the real structures and raises the real NVMLError subclasses.
"""
from __future__ import annotations

import inspect
import os
import pwd
import re
import subprocess
import sys
import time

import pynvml
import pytest

from ansible_collections.modelswap.vllm.plugins.module_utils.gpu import gpu_ready
from tests.support.fake_pynvml import FakeNvml, gpu

pytestmark = pytest.mark.unit

GIB = 1024 ** 3
ME = pwd.getpwuid(os.getuid()).pw_name


class Clock:
    """Monotonic clock and sleep for the wait loop: sleeping only advances time."""

    def __init__(self):
        self.now = 100.0
        self.sleeps = []

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.sleeps.append(seconds)
        self.now += seconds


def run(scenario, clock=None, **expect):
    fake = FakeNvml(scenario)
    clock = clock or Clock()
    result = gpu_ready.check(fake, gpu_ready.expectations(**expect), clock=clock, sleep=clock.sleep)
    return result, fake, clock


@pytest.fixture
def sleeper():
    """A real process (foreign to the GPUs) whose PID the fake reports on a GPU."""
    proc = subprocess.Popen(["sleep", "60"])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # until exec has happened (/proc shows sleep, not python)
        with open("/proc/%d/comm" % proc.pid) as fh:
            if fh.read().strip() == "sleep":
                break
        time.sleep(0.01)
    yield proc
    proc.kill()
    proc.wait(timeout=10)


# ---------------------------------------------------------------------------- fake fidelity

def test_fake_has_the_real_pynvml_names_and_signatures():
    fake = FakeNvml({"devices": []})
    public = [n for n in dir(FakeNvml) if n.startswith("nvml") and callable(getattr(fake, n))]
    assert len(public) >= 18
    for name in public:
        real = getattr(pynvml, name)
        assert inspect.signature(getattr(fake, name)) == inspect.signature(real), name


def test_module_utils_only_calls_functions_the_fake_and_pynvml_have():
    source = inspect.getsource(gpu_ready)
    called = set(re.findall(r"nvml\.(nvml\w+)", source)) | set(re.findall(r'"(nvml[A-Z]\w+)"', source))
    assert called, "no NVML call found"
    for name in called:
        assert hasattr(pynvml, name), name
        assert hasattr(FakeNvml, name), name


def test_fake_returns_real_types_and_raises_real_errors():
    fake = FakeNvml({"devices": [gpu(0, processes=[{"pid": 7, "used": 5 * GIB}],
                                     errors={"nvmlDeviceGetUUID": pynvml.NVML_ERROR_GPU_IS_LOST})]})
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        fake.nvmlDeviceGetCount()
    fake.nvmlInit()
    handle = fake.nvmlDeviceGetHandleByIndex(0)
    assert isinstance(handle, pynvml.c_nvmlDevice_t)
    mem = fake.nvmlDeviceGetMemoryInfo(handle)
    assert isinstance(mem, pynvml.c_nvmlMemory_t)
    assert (mem.total, mem.used, mem.free) == (80 * GIB, 512 * 1024 ** 2, 80 * GIB - 512 * 1024 ** 2)
    procs = fake.nvmlDeviceGetComputeRunningProcesses(handle)
    assert isinstance(procs[0], pynvml.nvmlFriendlyObject)
    assert (procs[0].pid, procs[0].usedGpuMemory) == (7, 5 * GIB)
    with pytest.raises(pynvml.NVMLError_GpuIsLost) as err:
        fake.nvmlDeviceGetUUID(handle)
    assert err.value.value == pynvml.NVML_ERROR_GPU_IS_LOST
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        fake.nvmlDeviceGetHandleByIndex(1)


# ---------------------------------------------------------------------------- reading

def test_all_free_reads_every_fact():
    scenario = {"devices": [gpu(0), gpu(1)], "topology": {"0-1": pynvml.NVML_TOPOLOGY_SINGLE},
                "nvlink_p2p": []}
    res, fake, _unused = run(scenario, tensor_parallel_size=2, gpu_memory_utilization=0.9)
    assert res["ready"] is True and res["problems"] == []
    assert res["available"] is True and res["polls"] == 1
    assert res["system"] == {"driver_version": "550.54.15", "cuda_driver_version": "12.4",
                             "nvml_version": "12.550.54.15"}
    g0 = res["gpus"][0]
    assert g0["name"] == "NVIDIA H100 80GB HBM3"
    assert g0["uuid"].startswith("GPU-00000000")
    assert g0["pci_bus_id"] == "00000000:18:00.0"
    assert g0["memory"] == {"total": 80 * GIB, "used": 512 * 1024 ** 2,
                            "free": 80 * GIB - 512 * 1024 ** 2}
    assert g0["compute_capability"] == "9.0"
    assert g0["ecc"] == {"enabled": True, "uncorrected_volatile": 0, "uncorrected_aggregate": 0}
    assert g0["processes"] == []
    assert res["topology"]["interconnect"] == "pcie"
    assert res["topology"]["pairs"] == [{"gpus": [0, 1], "nvlink": False, "path": "PIX",
                                         "path_description": "through a single PCIe switch"}]
    assert any("NCCL_P2P_LEVEL" in h for h in res["topology"]["hints"])
    assert fake.initialized == 0, "nvmlShutdown must balance nvmlInit"


def test_nvlink_topology_and_active_links():
    scenario = {"devices": [gpu(0, nvlinks=[1] * 18), gpu(1, nvlinks=[1] * 16 + [0, 0])],
                "topology": {"0-1": pynvml.NVML_TOPOLOGY_SYSTEM}, "nvlink_p2p": [[0, 1]]}
    res, _unused, _unused = run(scenario)
    assert res["topology"]["interconnect"] == "nvlink"
    assert res["topology"]["hints"] == []
    assert [g["nvlink_active_links"] for g in res["gpus"]] == [18, 16]


def test_topology_degrades_when_nvml_cannot_tell():
    # No topology API, no P2P status, no NVLink: facts are null, the check still passes.
    res, _unused, _unused = run({"devices": [gpu(0), gpu(1)]})
    assert res["ready"] is True
    assert res["topology"]["interconnect"] == "unknown"
    assert res["topology"]["pairs"][0]["nvlink"] is None
    assert res["topology"]["pairs"][0]["path"] is None
    assert [g["nvlink_active_links"] for g in res["gpus"]] == [None, None]


def test_sys_path_between_numa_nodes_gets_the_acs_hint():
    scenario = {"devices": [gpu(0), gpu(1), gpu(2)], "nvlink_p2p": [[0, 1]],
                "topology": {"0-1": 10, "0-2": 50, "1-2": 50}}
    res, _unused, _unused = run(scenario)
    assert res["topology"]["interconnect"] == "mixed"
    assert "worst path SYS" in res["topology"]["hints"][0]
    assert "ACS" in res["topology"]["hints"][1]


def test_consumer_gpu_without_ecc_reports_null_not_error():
    res, _unused, _unused = run({"devices": [gpu(0, name="NVIDIA GeForce RTX 4090", ecc_mode=None)]})
    assert res["ready"] is True
    assert res["gpus"][0]["ecc"] == {"enabled": None, "uncorrected_volatile": None,
                                     "uncorrected_aggregate": None}


def test_old_driver_falls_back_to_v2_process_listing(sleeper):
    scenario = {"devices": [gpu(0, processes=[{"pid": sleeper.pid, "used": GIB}])],
                "missing_functions": ["nvmlDeviceGetComputeRunningProcesses_v3"]}
    res, fake, _unused = run(scenario)
    assert [p["pid"] for p in res["gpus"][0]["processes"]] == [sleeper.pid]
    assert ("nvmlDeviceGetComputeRunningProcesses_v2", 0) in fake.calls


# ---------------------------------------------------------------------------- expectations

def test_one_gpu_held_by_a_foreign_process_names_pid_user_and_cmdline(sleeper):
    holder = {"pid": sleeper.pid, "used": 70 * GIB, "name": "/usr/bin/sleep"}
    scenario = {"devices": [gpu(0), gpu(1, used=70 * GIB + 300 * 1024 ** 2, processes=[holder])]}
    res, _unused, _unused = run(scenario, tensor_parallel_size=2, gpu_memory_utilization=0.9)
    assert res["ready"] is False
    kinds = sorted((p["gpu"], p["kind"]) for p in res["problems"])
    assert kinds == [(1, "memory"), (1, "process")]
    proc = res["gpus"][1]["processes"][0]
    assert proc == {"pid": sleeper.pid, "name": "/usr/bin/sleep", "comm": "sleep", "user": ME,
                    "uid": os.getuid(), "cmdline": "sleep 60", "used_memory": 70 * GIB,
                    "allowed": False}
    msg = gpu_ready.failure_message(res["problems"], res["waited"], res["timed_out"])
    assert "GPU(s) 1" in msg and "PID %d" % sleeper.pid in msg and "sleep 60" in msg
    assert "less than the 72.0 GiB needed for gpu_memory_utilization 0.9" in msg
    for p in res["problems"]:
        assert p["pids"] == [sleeper.pid]


@pytest.mark.parametrize("allow", [
    {"allowed_pids": "PID"}, {"allowed_users": "ME"}, {"allowed_process_names": ["sle*"]},
    {"check_processes": False},
])
def test_allowed_processes_are_not_foreign(sleeper, allow):
    if "allowed_users" in allow:
        allow = {"allowed_users": [ME]}
    if allow.get("allowed_pids") == "PID":
        allow = {"allowed_pids": [sleeper.pid]}
    scenario = {"devices": [gpu(0, used=2 * GIB, processes=[{"pid": sleeper.pid, "used": GIB}])]}
    res, _unused, _unused = run(scenario, gpu_memory_utilization=0.9, **allow)
    assert res["ready"] is True, res["problems"]


def test_memory_released_after_n_polls():
    held = {"pid": 999999, "used": 75 * GIB}
    scenario = {"devices": [gpu(0, used=76 * GIB, processes=[held],
                                after_reads={"n": 3, "used": 400 * 1024 ** 2, "processes": []})]}
    res, _unused, clock = run(scenario, gpu_memory_utilization=0.92, wait_timeout=60, poll_interval=2)
    assert res["ready"] is True
    assert res["polls"] == 4 and clock.sleeps == [2, 2, 2]
    assert res["waited"] == 6 and res["timed_out"] is False
    assert res["gpus"][0]["memory"]["used"] == 400 * 1024 ** 2


def test_timeout_reports_who_still_holds_what(sleeper):
    held = {"pid": sleeper.pid, "used": 60 * GIB}
    gone = {"pid": 4000000, "used": 10 * GIB}  # a PID /proc does not show (another namespace)
    scenario = {"devices": [gpu(0, used=71 * GIB, processes=[held, gone]), gpu(1)]}
    res, _unused, clock = run(scenario, gpu_memory_utilization=0.9, wait_timeout=10, poll_interval=3)
    assert res["ready"] is False and res["timed_out"] is True
    assert clock.sleeps == [3, 3, 3, 1], "the last sleep is cut to the deadline"
    assert res["polls"] == 5 and res["waited"] == 10
    msg = gpu_ready.failure_message(res["problems"], res["waited"], res["timed_out"])
    assert msg.startswith("GPU readiness check failed after waiting 10 s for GPU memory to be "
                          "released on GPU(s) 0:")
    assert "PID %d (user %s: sleep 60) holds 60.0 GiB" % (sleeper.pid, ME) in msg
    assert "PID 4000000 (user ?: command line unknown" in msg
    memory = [p for p in res["problems"] if p["kind"] == "memory"][0]
    assert sorted(memory["pids"]) == sorted([sleeper.pid, 4000000])


def test_permanent_problems_do_not_wait():
    scenario = {"devices": [gpu(0, ecc_volatile=2, ecc_aggregate=5,
                                processes=[{"pid": 999999, "used": GIB}])]}
    res, _unused, clock = run(scenario, wait_timeout=300)
    assert clock.sleeps == [] and res["polls"] == 1
    ecc = [p for p in res["problems"] if p["kind"] == "ecc"]
    assert len(ecc) == 1 and ecc[0]["transient"] is False
    assert "2 uncorrected ECC error(s)" in ecc[0]["message"]
    assert "(aggregate 5)" in ecc[0]["message"]


def test_ecc_check_can_be_turned_off():
    res, _unused, _unused = run({"devices": [gpu(0, ecc_volatile=1)]}, check_ecc=False)
    assert res["ready"] is True
    assert res["gpus"][0]["ecc"]["uncorrected_volatile"] == 1


@pytest.mark.parametrize("expect,needed,text", [
    ({"tensor_parallel_size": 8}, 8, "tensor_parallel_size 8 x pipeline_parallel_size 1"),
    ({"tensor_parallel_size": 2, "pipeline_parallel_size": 2}, 4,
     "tensor_parallel_size 2 x pipeline_parallel_size 2"),
    ({"min_gpus": 3}, 3, ""),
])
def test_fewer_gpus_than_tp_times_pp(expect, needed, text):
    res, _unused, _unused = run({"devices": [gpu(0), gpu(1)]}, **expect)
    assert res["ready"] is False
    (problem,) = res["problems"]
    assert problem["kind"] == "count" and problem["transient"] is False
    assert problem["message"] == "needs at least %d GPU(s)%s, the host has 2" % (
        needed, " (%s)" % text if text else "")


def test_devices_select_gpus_and_unknown_index_is_a_problem():
    res, _unused, _unused = run({"devices": [gpu(0), gpu(1, used=79 * GIB)]}, devices=[0],
                                gpu_memory_utilization=0.9)
    assert [g["index"] for g in res["gpus"]] == [0] and res["ready"] is True
    res, _unused, _unused = run({"devices": [gpu(0)]}, devices=[0, 3])
    assert [p["kind"] for p in res["problems"]] == ["device"]
    assert "GPU 3 was asked for (devices) but the host has 1 GPU(s)" in res["problems"][0]["message"]


def test_driver_and_compute_capability_minimums():
    scenario = {"driver_version": "535.104.05",
                "devices": [gpu(0, name="Tesla V100-SXM2-32GB", cc=[7, 0]), gpu(1)]}
    res, _unused, _unused = run(scenario, min_driver_version="550.54", min_compute_capability="8.0")
    assert sorted(p["kind"] for p in res["problems"]) == ["compute_capability", "driver"]
    texts = " | ".join(p["message"] for p in res["problems"])
    assert "driver 535.104.05 is older than the required 550.54" in texts
    assert "GPU 0 (Tesla V100-SXM2-32GB" in texts and "compute capability 7.0 is below" in texts
    res, _unused, _unused = run(scenario, min_driver_version="535.104", min_compute_capability="7.0")
    assert res["ready"] is True


# ---------------------------------------------------------------------------- NVML errors

def test_nvml_missing_is_no_gpus_with_a_reason_not_an_error():
    res, _unused, _unused = run({"init_error": pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, "devices": []})
    assert res["available"] is False and res["gpus"] == [] and res["ready"] is True
    assert "libnvidia-ml.so.1 is not installed" in res["reason"]


def test_nvml_missing_fails_when_the_caller_requires_gpus():
    res, _unused, _unused = run({"init_error": pynvml.NVML_ERROR_LIBRARY_NOT_FOUND}, tensor_parallel_size=4)
    assert res["ready"] is False
    assert res["problems"][0]["message"].startswith(
        "needs at least 4 GPU(s) (tensor_parallel_size 4 x pipeline_parallel_size 1) but NVML "
        "not available")
    res, _unused, _unused = run({"init_error": pynvml.NVML_ERROR_DRIVER_NOT_LOADED}, require_gpus=True)
    assert "kernel driver is not loaded" in res["problems"][0]["message"]


def test_binding_missing_uses_the_callers_reason():
    res = gpu_ready.check(None, gpu_ready.expectations(), unavailable_reason="no binding, no driver")
    assert (res["ready"], res["gpus"], res["reason"]) == (True, [], "no binding, no driver")


def test_nvml_working_but_no_gpu():
    res, _unused, _unused = run({"devices": []})
    assert res["gpus"] == [] and res["reason"] == "NVML works but sees no GPU"
    res, _unused, _unused = run({"devices": []}, require_gpus=True)
    assert res["problems"][0]["message"] == "needs GPUs but NVML sees none"


@pytest.mark.parametrize("code,words", [
    (pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH, "driver upgrade without a reboot. Fix: reboot"),
    (pynvml.NVML_ERROR_NO_PERMISSION, "become: true"),
])
def test_broken_nvml_at_init_is_a_clear_failure(code, words):
    with pytest.raises(gpu_ready.NvmlFailure) as err:
        run({"init_error": code, "devices": [gpu(0)]})
    assert "nvmlInit" in str(err.value) and words in str(err.value)
    assert "NVML_ERROR_%s=%d" % (gpu_ready.error_name(pynvml, pynvml.NVMLError(code)), code) in str(err.value)


def test_no_permission_while_reading_a_gpu_fails_once_for_the_host():
    scenario = {"devices": [gpu(0, errors={"nvmlDeviceGetMemoryInfo": pynvml.NVML_ERROR_NO_PERMISSION})]}
    with pytest.raises(gpu_ready.NvmlFailure) as err:
        run(scenario)
    assert "reading GPU 0 (NVIDIA H100 80GB HBM3)" in str(err.value)


def test_gpu_lost_is_reported_for_that_gpu_and_the_others_are_still_read():
    lost = gpu(1, errors={"nvmlDeviceGetMemoryInfo": pynvml.NVML_ERROR_GPU_IS_LOST})
    res, fake, clock = run({"devices": [gpu(0), lost, gpu(2)]}, wait_timeout=60,
                           gpu_memory_utilization=0.9)
    assert [g["error"] is None for g in res["gpus"]] == [True, False, True]
    (problem,) = res["problems"]
    assert problem["gpu"] == 1 and problem["kind"] == "nvml" and not problem["transient"]
    assert "GPU is lost" in problem["message"] and "Xid 79" in problem["message"]
    assert clock.sleeps == [], "a lost GPU does not come back by waiting"
    assert fake.initialized == 0


def test_driver_gone_mid_run_still_shuts_nvml_down():
    scenario = {"devices": [gpu(0, errors={"nvmlDeviceGetHandleByIndex":
                                           pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH})]}
    fake = FakeNvml(scenario)
    with pytest.raises(gpu_ready.NvmlFailure) as err:
        gpu_ready.check(fake, gpu_ready.expectations())
    assert "RM has detected an NVML/RM version mismatch" in str(err.value)
    assert fake.initialized == 0


# ---------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("kwargs,text", [
    ({"min_gpus": -1}, "min_gpus must be an integer >= 0, got -1"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size must be an integer >= 1, got 0"),
    ({"pipeline_parallel_size": -2}, "pipeline_parallel_size must be an integer >= 1, got -2"),
    ({"gpu_memory_utilization": 0}, "gpu_memory_utilization must be a fraction in (0, 1]"),
    ({"gpu_memory_utilization": 1.5}, "got 1.5"),
    ({"gpu_memory_utilization": -0.1}, "got -0.1"),
    ({"gpu_memory_utilization": float("nan")}, "gpu_memory_utilization must be a fraction"),
    ({"wait_timeout": -5}, "wait_timeout must be a number of seconds >= 0, got -5"),
    ({"poll_interval": 0}, "poll_interval must be a number of seconds > 0, got 0"),
    ({"devices": [0, -1]}, "devices entry must be an integer >= 0, got -1"),
    ({"devices": [1, 1]}, "devices lists GPU 1 twice"),
    ({"devices": []}, "devices is empty"),
    ({"allowed_pids": [0]}, "allowed_pids entry must be an integer >= 1, got 0"),
    ({"min_driver_version": "latest"}, "min_driver_version 'latest' is not a version"),
    ({"min_compute_capability": "9"}, "min_compute_capability '9' is not MAJOR.MINOR"),
])
def test_bad_input_is_a_clear_error(kwargs, text):
    with pytest.raises(gpu_ready.InputError) as err:
        gpu_ready.expectations(**kwargs)
    assert text in str(err.value)
    assert str(err.value).startswith("Invalid gpu_ready input: ")


def test_every_bad_value_is_listed_at_once():
    with pytest.raises(gpu_ready.InputError) as err:
        gpu_ready.expectations(min_gpus=-1, gpu_memory_utilization=2)
    assert "min_gpus" in str(err.value) and "gpu_memory_utilization" in str(err.value)


def test_boundaries_that_are_valid():
    exp = gpu_ready.expectations(min_gpus=0, gpu_memory_utilization=1, wait_timeout=0,
                                 tensor_parallel_size=1)
    assert exp["gpu_memory_utilization"] == 1.0 and exp["min_gpus"] == 1
    assert exp["require_gpus"] is True
    assert gpu_ready.expectations()["require_gpus"] is False


def test_library_present_probe():
    assert gpu_ready.library_present(loader=lambda name: None) is True

    def missing(name):
        raise OSError("%s: cannot open shared object file" % name)

    assert gpu_ready.library_present(loader=missing) is False


def test_real_pynvml_on_this_machine_matches_what_the_module_expects():
    """The controller has no GPU: the real binding raises the code the module treats as 'none'."""
    code = subprocess.run(
        [sys.executable, "-c", "import pynvml\ntry:\n pynvml.nvmlInit()\n print('ok')\n"
         "except pynvml.NVMLError as e:\n print(e.value)"],
        capture_output=True, text=True, timeout=30).stdout.strip()
    if code == "ok":  # a machine with a working NVIDIA driver: nothing to check here
        return
    assert int(code) in (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, pynvml.NVML_ERROR_DRIVER_NOT_LOADED)


def test_process_names_nvml_refuses_are_not_fatal(sleeper):
    scenario = {"devices": [gpu(0, processes=[{"pid": sleeper.pid, "used": GIB,
                                               "name": "/usr/bin/sleep"}])]}
    fake = FakeNvml(scenario)

    def denied(pid):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NO_PERMISSION)

    fake.nvmlSystemGetProcessName = denied
    res = gpu_ready.check(fake, gpu_ready.expectations())
    (proc,) = res["gpus"][0]["processes"]
    assert proc["name"] == "sleep" and proc["cmdline"] == "sleep 60"   # from /proc instead


def test_driver_version_unreadable_is_a_clear_failure():
    fake = FakeNvml({"devices": [gpu(0)]})

    def lost():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)

    fake.nvmlSystemGetDriverVersion = lost
    with pytest.raises(gpu_ready.NvmlFailure) as err:
        gpu_ready.check(fake, gpu_ready.expectations())
    assert "reading the driver version" in str(err.value) and "Xid 79" in str(err.value)
    assert fake.initialized == 0
