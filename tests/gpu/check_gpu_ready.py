"""Device check: modelswap.vllm.gpu_ready against a real NVIDIA GPU (run by run_gpu_check.sh).

1. read:    gpu_ready sees every GPU NVML counts, with name, UUID, memory, compute capability.
2. foreign: a helper process (tests/gpu/alloc_helper.py) allocates memory on GPU 0; gpu_ready,
            asked for the memory that was free before, fails and names the helper's PID.
3. wait:    gpu_ready waits (wait_timeout) while the helper frees its memory and exits; the
            wait must end ready, after more than one poll.

Prints one line per step and PASS/FAIL; exits 0 on PASS, 1 on FAIL. Where there is no NVIDIA
GPU (no driver, no NVML, no device) it prints `SKIP: ...` and exits 0. Budget: under 3 minutes.
Needs only python3, pynvml and ansible's module_utils (the venv's, or carried to a bare box).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HELPER = Path(__file__).resolve().parent / "alloc_helper.py"
GIB = 1024 ** 3
START = time.monotonic()
BUDGET = 170.0


def say(text):
    print("[%5.1fs] %s" % (time.monotonic() - START, text), flush=True)


def fail(text):
    say("FAIL: " + text)
    sys.exit(1)


def skip(text):
    print("SKIP: " + text, flush=True)
    sys.exit(0)


def left():
    return max(5.0, BUDGET - (time.monotonic() - START))


def module_proc(args):
    """Start plugins/modules/gpu_ready.py as Ansible runs it; returns (Popen, args file)."""
    fh = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
    json.dump({"ANSIBLE_MODULE_ARGS": dict(args, _ansible_check_mode=False)}, fh)
    fh.close()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / ".collections"), env.get("PYTHONPATH", "")])
    proc = subprocess.Popen([sys.executable, str(REPO / "plugins" / "modules" / "gpu_ready.py"), fh.name],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    return proc, fh.name


def module_result(proc, args_file, timeout):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        fail("gpu_ready did not return within %.0f s" % timeout)
    finally:
        os.unlink(args_file)
    try:
        return json.loads(out)
    except json.JSONDecodeError:
        fail("gpu_ready printed no JSON (rc=%s): %s %s" % (proc.returncode, out[-2000:], err[-2000:]))


def run_module(args, timeout=60):
    proc, path = module_proc(args)
    return module_result(proc, path, timeout)


def probe():
    """SKIP unless NVML works and sees a GPU; FAIL if a GPU is there but cannot be read."""
    try:
        import pynvml
    except ImportError:
        if os.path.exists("/dev/nvidia0") or os.path.exists("/dev/nvidiactl"):
            fail("this host has NVIDIA devices but the pynvml module (nvidia-ml-py) is not "
                 "importable: pip install nvidia-ml-py, or carry "
                 ".venv/lib/python3.11/site-packages/pynvml.py")
        skip("no NVIDIA GPU here (no /dev/nvidia*, no pynvml)")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        if exc.value in (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, pynvml.NVML_ERROR_DRIVER_NOT_LOADED):
            skip("no NVIDIA GPU here (nvmlInit: %s)" % exc)
        fail("nvmlInit failed on a host with NVML: %s (code %s)" % (exc, exc.value))
    try:
        count = pynvml.nvmlDeviceGetCount()
    finally:
        pynvml.nvmlShutdown()
    if count == 0:
        skip("NVML works but sees no GPU")
    return count


def main():
    count = probe()
    try:
        import ansible.module_utils.basic  # noqa: F401
    except ImportError:
        fail("ansible's module_utils are not importable: use the venv, or carry "
             ".venv/lib/python3.11/site-packages/ansible")
    say("NVML sees %d GPU(s); python %s" % (count, sys.version.split()[0]))

    # 1. read
    res = run_module({"fail_when_not_ready": False})
    if res.get("failed"):
        fail("gpu_ready (read only) failed: %s" % res.get("msg"))
    gpus = res["gpus"]
    if not res["nvml"]["available"] or len(gpus) != count:
        fail("gpu_ready saw %d GPU(s) (nvml=%s), NVML counts %d" % (len(gpus), res["nvml"], count))
    for g in gpus:
        if g["error"] or not g["name"] or not g["uuid"] or not g["memory"]["total"] \
                or not g["compute_capability"]:
            fail("GPU %d read incompletely: %s" % (g["index"], json.dumps(g)))
        say("read: GPU %d %s %s cc %s, memory %.1f/%.1f GiB used, %d process(es), ECC %s"
            % (g["index"], g["name"], g["uuid"], g["compute_capability"],
               g["memory"]["used"] / GIB, g["memory"]["total"] / GIB, len(g["processes"] or []),
               g["ecc"]))
    say("read: driver %s, CUDA %s, NVML %s; topology %s"
        % (res["nvml"]["driver_version"], res["nvml"]["cuda_driver_version"],
           res["nvml"]["nvml_version"], json.dumps(res["topology"])))
    g0 = gpus[0]
    baseline = sorted({p["pid"] for p in g0["processes"] or []})
    total, free0 = g0["memory"]["total"], g0["memory"]["free"]
    alloc = int(min(4 * GIB, free0 * 0.25)) // (2 * 1024 ** 2) * (2 * 1024 ** 2)
    if alloc < 256 * 1024 ** 2:
        fail("GPU 0 has only %.2f GiB free: too little for the check" % (free0 / GIB))
    # Ready iff free memory is back near where it was: the threshold sits half an allocation
    # below the baseline, so the helper's allocation (plus its context) makes it fail.
    util = int((free0 - alloc / 2) / total * 1000) / 1000.0

    # 2. foreign process
    env = dict(os.environ, CUDA_DEVICE_ORDER="PCI_BUS_ID", CUDA_VISIBLE_DEVICES=g0["uuid"])
    helper = subprocess.Popen([sys.executable, str(HELPER), str(alloc), "120"], env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    try:
        line = helper.stdout.readline()
        if not line.startswith("ALLOCATED"):
            fail("the helper could not allocate GPU memory: %s" % helper.stderr.read()[-2000:])
        _, backend, nbytes, pid = line.split()
        pid = int(pid)
        say("helper PID %d allocated %.2f GiB on GPU 0 with %s" % (pid, int(nbytes) / GIB, backend))
        args = {"devices": [0], "gpu_memory_utilization": util, "allowed_pids": baseline,
                "topology": False}
        res = run_module(dict(args, wait_timeout=0))
        if not res.get("failed"):
            fail("gpu_ready passed while the helper held %.2f GiB: %s" % (alloc / GIB, res.get("msg")))
        say("foreign: gpu_ready failed as expected: %s" % res["msg"])
        listed = {p["pid"]: p for p in res["gpus"][0]["processes"] or []}
        if pid not in listed:
            new = {k: v for k, v in listed.items() if k not in baseline}
            fail("gpu_ready did not list the helper's PID %d among GPU 0's processes %s "
                 "(NVML PIDs from another PID namespace?)" % (pid, json.dumps(new)))
        if "PID %d" % pid not in res["msg"]:
            fail("the failure message does not name PID %d" % pid)
        kinds = sorted({p["kind"] for p in res["problems"]})
        if kinds != ["memory", "process"]:
            fail("expected memory and process problems, got %s" % kinds)
        proc = listed[pid]
        say("foreign: named PID %d user %s cmdline %r holding %s bytes"
            % (pid, proc["user"], (proc["cmdline"] or "")[:120], proc["used_memory"]))

        # 3. wait for the release
        waiter_start = time.monotonic()
        waiter, path = module_proc(dict(args, wait_timeout=60, poll_interval=1))
        time.sleep(3)
        released_at = time.monotonic()
        helper.stdin.write("free\n")
        helper.stdin.flush()
        helper.wait(timeout=30)
        say("helper freed its memory and exited (rc %s)" % helper.returncode)
        res = module_result(waiter, path, timeout=min(90, left()))
        if res.get("failed") or not res["ready"]:
            fail("gpu_ready did not see the memory released: %s" % res.get("msg"))
        if res["polls"] < 2:
            fail("gpu_ready was ready at the first poll: the wait was not exercised (%s)" % res)
        say("wait: ready after %d polls, %.1f s of polling (the helper was told to free %.1f s "
            "after gpu_ready started)" % (res["polls"], res["waited"], released_at - waiter_start))
    finally:
        if helper.poll() is None:
            helper.kill()
            helper.wait(timeout=10)
    say("PASS: gpu_ready read %d GPU(s), named the foreign PID, and waited for the release"
        % count)


if __name__ == "__main__":
    main()
