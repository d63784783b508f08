# -*- coding: utf-8 -*-
"""NVIDIA GPUs through NVML: read them, judge them against what a model needs, wait for them.

Every function takes `nvml`, the pynvml module (from the nvidia-ml-py package) or anything with
its names: the module passes the real one, unit tests pass a fake with the same functions,
return types and exceptions. Nothing here imports pynvml itself, so this file loads on hosts
without it (CPU hosts, where "no GPUs" is a legitimate answer).

Units: memory in bytes. Problems are dicts {gpu, kind, transient, message, pids}; a transient
problem (memory still held, a foreign process still running) may go away by waiting, the
others (too few GPUs, ECC errors, old driver, a lost GPU) never do.
"""
from __future__ import annotations

import ctypes
import fnmatch
import math
import os
import re
import time

from ansible_collections.modelswap.vllm.plugins.module_utils.common import procfs

GIB = 1024 ** 3
MIB = 1024 ** 2
LIBRARY = "libnvidia-ml.so.1"

# nvmlDeviceGetTopologyCommonAncestor levels, named as `nvidia-smi topo -m` names the path.
TOPOLOGY_PATHS = {
    0: ("BOARD", "on the same board (multi-GPU card)"),
    10: ("PIX", "through a single PCIe switch"),
    20: ("PXB", "through multiple PCIe switches, without the host bridge"),
    30: ("PHB", "through a PCIe host bridge (the CPU)"),
    40: ("NODE", "across PCIe host bridges within one NUMA node"),
    50: ("SYS", "across the CPU interconnect between NUMA nodes (QPI/UPI/xGMI)"),
}

# What each NVML error means for an operator, and what to do.
ERROR_HINTS = {
    "LIBRARY_NOT_FOUND": "the NVML library %s is not installed: this host has no NVIDIA driver "
                         "(a CPU host?)" % LIBRARY,
    "DRIVER_NOT_LOADED": "the NVIDIA kernel driver is not loaded (no GPU, or the module failed to "
                         "load: see `dmesg | grep -i nvidia`; load it with `modprobe nvidia`)",
    "LIB_RM_VERSION_MISMATCH": "the NVIDIA kernel driver and the user-space library "
                               "(libnvidia-ml) are different versions, usually after a driver "
                               "upgrade without a reboot. Fix: reboot the host, or stop every GPU "
                               "process and reload the nvidia kernel modules",
    "NO_PERMISSION": "NVML denied access. Fix: run the task with `become: true`, or give the user "
                     "access to /dev/nvidia* (in a container: expose the GPU devices)",
    "GPU_IS_LOST": "the GPU fell off the bus or stopped responding (look for Xid 79 in dmesg). "
                   "Fix: reset it (`nvidia-smi -r -i N`) or reboot; replace it if it recurs",
    "RESET_REQUIRED": "the GPU needs a reset. Fix: `nvidia-smi -r -i N` with no process on it, or "
                      "reboot",
    "CORRUPTED_INFOROM": "the GPU's infoROM is corrupted. Fix: contact the hardware vendor; do not "
                         "serve from this GPU",
    "UNINITIALIZED": "NVML was not initialized (a bug in the caller)",
    "TIMEOUT": "the driver did not answer in time (GPU hung?). Fix: check dmesg for Xid errors",
    "IRQ_ISSUE": "the driver reports an interrupt problem. Fix: check dmesg; reboot",
    "OPERATING_SYSTEM": "the operating system blocked the request",
    "FUNCTION_NOT_FOUND": "the installed driver is older than this pynvml expects. Fix: upgrade "
                          "the driver or install an older nvidia-ml-py",
}
UNAVAILABLE = ("LIBRARY_NOT_FOUND", "DRIVER_NOT_LOADED")
OPTIONAL = ("NOT_SUPPORTED", "FUNCTION_NOT_FOUND", "NOT_FOUND", "INVALID_ARGUMENT",
            "NO_DATA", "NOT_READY")


class NvmlFailure(Exception):
    """NVML is present but broken (mismatch, no permission, ...); the message says what to do."""


class InputError(ValueError):
    """Bad module input; the message names every bad value and what is allowed."""


# --------------------------------------------------------------------------------------------
# Small helpers


def gib(n):
    """Bytes as a short human string (GiB, MiB, KiB or B)."""
    if n is None:
        return "?"
    if n >= GIB / 10:
        return "%.1f GiB" % (n / GIB)
    if n >= MIB:
        return "%.0f MiB" % (n / MIB)
    if n >= 1024:
        return "%.0f KiB" % (n / 1024)
    return "%d B" % n


def error_name(nvml, exc):
    """'GPU_IS_LOST' for an NVMLError with that code (names come from `nvml` itself)."""
    value = getattr(exc, "value", None)
    for attr in dir(nvml):
        if attr.startswith("NVML_ERROR_") and getattr(nvml, attr) == value:
            return attr[len("NVML_ERROR_"):]
    return "UNKNOWN"


def describe_error(nvml, exc, action):
    """One sentence an operator can act on: what failed, NVML's words and code, and the fix."""
    name = error_name(nvml, exc)
    hint = ERROR_HINTS.get(name)
    text = "NVML error while %s: %s (NVML_ERROR_%s=%s)" % (action, exc, name,
                                                           getattr(exc, "value", "?"))
    return "%s: %s." % (text, hint) if hint else text + "."


def is_nvml_error(nvml, exc):
    cls = getattr(nvml, "NVMLError", None)
    return cls is not None and isinstance(exc, cls)


def _optional(nvml, fn_name, *args):
    """Call nvml.<fn_name>(*args); None when the GPU or driver does not offer it.

    NOT_SUPPORTED and friends, a function the driver lacks, and pynvml's
    NVMLLibraryMismatchError mean "no data here", not "the GPU is broken". Other NVML errors
    (GPU lost, no permission) propagate.
    """
    fn = getattr(nvml, fn_name, None)
    if fn is None:
        return None
    mismatch = getattr(nvml, "NVMLLibraryMismatchError", None)
    try:
        return fn(*args)
    except Exception as exc:  # NVMLError or pynvml's mismatch error; others re-raised below
        if mismatch is not None and isinstance(exc, mismatch):
            return None
        if is_nvml_error(nvml, exc) and error_name(nvml, exc) in OPTIONAL:
            return None
        raise


def _text(value):
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value


def parse_version(text, what):
    """'550.54.15' -> (550, 54, 15); InputError naming `what` otherwise."""
    text = str(text).strip()
    if not re.match(r"^\d+(\.\d+)*$", text):
        raise InputError("%s %r is not a version of dot-separated numbers (e.g. '550.54.15')"
                         % (what, text))
    return tuple(int(p) for p in text.split("."))


def version_lt(have, need):
    width = max(len(have), len(need))
    return tuple(have) + (0,) * (width - len(have)) < tuple(need) + (0,) * (width - len(need))


def library_present(loader=ctypes.CDLL):
    """Whether the NVML shared library can be loaded (used when the pynvml binding is missing)."""
    try:
        loader(LIBRARY)
    except OSError:
        return False
    return True


# --------------------------------------------------------------------------------------------
# Expectations (validated input)


def expectations(min_gpus=0, tensor_parallel_size=None, pipeline_parallel_size=None,
                 require_gpus=False, gpu_memory_utilization=None, allowed_pids=(),
                 allowed_process_names=(), allowed_users=(), check_processes=True,
                 check_ecc=True, min_driver_version=None, min_compute_capability=None,
                 devices=None, wait_timeout=0, poll_interval=2.0):
    """Validate what the caller expects; return it as a dict. InputError lists every bad value."""
    bad = []

    def count(name, value, low):
        if value is None:
            return
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            bad.append("%s must be an integer >= %d, got %r" % (name, low, value))

    count("min_gpus", min_gpus, 0)
    count("tensor_parallel_size", tensor_parallel_size, 1)
    count("pipeline_parallel_size", pipeline_parallel_size, 1)
    if gpu_memory_utilization is not None:
        try:
            frac = float(gpu_memory_utilization)
        except (TypeError, ValueError):
            frac = None
        if frac is None or math.isnan(frac) or not 0 < frac <= 1:
            bad.append("gpu_memory_utilization must be a fraction in (0, 1] (vLLM's "
                       "--gpu-memory-utilization, e.g. 0.9), got %r" % (gpu_memory_utilization,))
        else:
            gpu_memory_utilization = frac
    for pid in allowed_pids or ():
        count("allowed_pids entry", pid, 1)
    devices_list = None
    if devices is not None:
        devices_list = []
        for index in devices:
            count("devices entry", index, 0)
            if index in devices_list:
                bad.append("devices lists GPU %r twice" % (index,))
            devices_list.append(index)
        if not devices_list:
            bad.append("devices is empty; omit it to check every GPU")
    for pattern in allowed_process_names or ():
        if not isinstance(pattern, str) or not pattern.strip():
            bad.append("allowed_process_names has an empty entry")
    try:
        wait = float(wait_timeout)
        if math.isnan(wait) or wait < 0:
            raise ValueError
    except (TypeError, ValueError):
        bad.append("wait_timeout must be a number of seconds >= 0, got %r" % (wait_timeout,))
        wait = 0.0
    try:
        interval = float(poll_interval)
        if math.isnan(interval) or interval <= 0:
            raise ValueError
    except (TypeError, ValueError):
        bad.append("poll_interval must be a number of seconds > 0, got %r" % (poll_interval,))
        interval = 1.0
    driver = cc = None
    if min_driver_version not in (None, ""):
        try:
            driver = parse_version(min_driver_version, "min_driver_version")
        except InputError as exc:
            bad.append(str(exc))
    if min_compute_capability not in (None, ""):
        text = str(min_compute_capability).strip()
        if not re.match(r"^\d+\.\d+$", text):
            bad.append("min_compute_capability %r is not MAJOR.MINOR (e.g. '8.0')"
                       % (min_compute_capability,))
        else:
            cc = tuple(int(p) for p in text.split("."))
    if bad:
        raise InputError("Invalid gpu_ready input: %s." % "; ".join(bad))

    needed = min_gpus or 0
    parallel = None
    if tensor_parallel_size is not None or pipeline_parallel_size is not None:
        parallel = (tensor_parallel_size or 1) * (pipeline_parallel_size or 1)
        needed = max(needed, parallel)
    return {
        "min_gpus": needed,
        "tensor_parallel_size": tensor_parallel_size,
        "pipeline_parallel_size": pipeline_parallel_size,
        "require_gpus": bool(require_gpus) or needed > 0,
        "gpu_memory_utilization": gpu_memory_utilization,
        "allowed_pids": list(allowed_pids or ()),
        "allowed_process_names": list(allowed_process_names or ()),
        "allowed_users": list(allowed_users or ()),
        "check_processes": bool(check_processes),
        "check_ecc": bool(check_ecc),
        "min_driver_version": driver,
        "min_compute_capability": cc,
        "devices": devices_list,
        "wait_timeout": wait,
        "poll_interval": interval,
    }


# --------------------------------------------------------------------------------------------
# Reading


def open_nvml(nvml):
    """nvmlInit. Returns None when NVML works, or the reason it is not there (no driver/library).

    Raises NvmlFailure when NVML is there but broken (version mismatch, no permission...).
    """
    try:
        nvml.nvmlInit()
    except Exception as exc:
        if not is_nvml_error(nvml, exc):
            raise NvmlFailure("NVML failed to start (nvmlInit): %s" % exc)
        name = error_name(nvml, exc)
        if name in UNAVAILABLE:
            return "NVML not available: %s (%s)" % (ERROR_HINTS[name], exc)
        raise NvmlFailure(describe_error(nvml, exc, "initializing NVML (nvmlInit)"))
    return None


def close_nvml(nvml):
    try:
        nvml.nvmlShutdown()
    except Exception:  # shutting down is best effort; the data is read already
        pass


def read_system(nvml):
    """Driver, CUDA driver and NVML versions (None where the driver does not say)."""
    driver = _text(_optional(nvml, "nvmlSystemGetDriverVersion"))
    cuda = _optional(nvml, "nvmlSystemGetCudaDriverVersion")
    nvml_version = _text(_optional(nvml, "nvmlSystemGetNVMLVersion"))
    return {
        "driver_version": driver,
        "cuda_driver_version": "%d.%d" % (cuda // 1000, (cuda % 1000) // 10) if cuda else None,
        "nvml_version": nvml_version,
    }


def is_allowed(proc, exp):
    """Whether a compute process is one the caller allows (by PID, user or process name)."""
    if proc["pid"] in exp["allowed_pids"]:
        return True
    if proc.get("user") and proc["user"] in exp["allowed_users"]:
        return True
    names = set()
    for candidate in (proc.get("name"), proc.get("comm")):
        if candidate:
            names.add(os.path.basename(candidate))
    argv0 = (proc.get("cmdline") or "").split(" ", 1)[0]
    if argv0:
        names.add(os.path.basename(argv0))
    return any(fnmatch.fnmatchcase(n, p) for n in names for p in exp["allowed_process_names"])


def read_processes(nvml, handle, proc_root=procfs.PROC):
    """Compute processes on a GPU: PID, memory, name (NVML), owner and command line (/proc).

    None when the driver cannot list them (NOT_SUPPORTED, e.g. some vGPU setups).
    """
    mismatch = getattr(nvml, "NVMLLibraryMismatchError", None)
    try:
        raw = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
    except Exception as exc:
        older = (mismatch is not None and isinstance(exc, mismatch)) or (
            is_nvml_error(nvml, exc) and error_name(nvml, exc) == "FUNCTION_NOT_FOUND")
        if older and hasattr(nvml, "nvmlDeviceGetComputeRunningProcesses_v2"):
            raw = _optional(nvml, "nvmlDeviceGetComputeRunningProcesses_v2", handle)
        elif is_nvml_error(nvml, exc) and error_name(nvml, exc) in OPTIONAL:
            raw = None
        else:
            raise
    if raw is None:
        return None
    out = []
    for entry in raw:
        pid = int(entry.pid)
        used = getattr(entry, "usedGpuMemory", None)
        try:
            name = _text(_optional(nvml, "nvmlSystemGetProcessName", pid))
        except Exception as exc:  # a name is a nicety: NO_PERMISSION etc. must not stop the check
            if not is_nvml_error(nvml, exc):
                raise
            name = None
        info = procfs.process_info(pid, proc=proc_root) or {}
        out.append({
            "pid": pid,
            "name": name or info.get("name"),
            "comm": info.get("name"),
            "user": info.get("user"),
            "uid": info.get("uid"),
            "cmdline": info.get("cmdline"),
            "used_memory": int(used) if used is not None else None,
        })
    return out


def _nvlink_active(nvml, handle):
    """Active NVLink links of a GPU; None when the GPU has no NVLink or NVML cannot tell."""
    max_links = getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18)
    active = 0
    for link in range(max_links):
        try:
            state = nvml.nvmlDeviceGetNvLinkState(handle, link)
        except Exception as exc:
            if is_nvml_error(nvml, exc) and error_name(nvml, exc) in OPTIONAL:
                return active if link else None
            raise
        if state == getattr(nvml, "NVML_FEATURE_ENABLED", 1):
            active += 1
    return active


def read_gpu(nvml, index, exp, proc_root=procfs.PROC):
    """One GPU's facts. Returns (gpu dict, handle or None). A broken GPU gets an `error`."""
    gpu = {"index": index, "name": None, "uuid": None, "pci_bus_id": None,
           "memory": {"total": None, "used": None, "free": None},
           "compute_capability": None,
           "ecc": {"enabled": None, "uncorrected_volatile": None, "uncorrected_aggregate": None},
           "nvlink_active_links": None, "processes": None, "error": None}
    action = "reading GPU %d" % index
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        gpu["name"] = _text(nvml.nvmlDeviceGetName(handle))
        action = "reading GPU %d (%s)" % (index, gpu["name"])
        gpu["uuid"] = _text(_optional(nvml, "nvmlDeviceGetUUID", handle))
        pci = _optional(nvml, "nvmlDeviceGetPciInfo", handle)
        if pci is not None:
            gpu["pci_bus_id"] = _text(getattr(pci, "busId", None)) or None
        mem = nvml.nvmlDeviceGetMemoryInfo(handle)
        gpu["memory"] = {"total": int(mem.total), "used": int(mem.used), "free": int(mem.free)}
        cc = _optional(nvml, "nvmlDeviceGetCudaComputeCapability", handle)
        if cc is not None:
            gpu["compute_capability"] = "%d.%d" % (cc[0], cc[1])
        mode = _optional(nvml, "nvmlDeviceGetEccMode", handle)
        if mode is not None:
            gpu["ecc"]["enabled"] = mode[0] == getattr(nvml, "NVML_FEATURE_ENABLED", 1)
        if gpu["ecc"]["enabled"] is not False:
            uncorrected = getattr(nvml, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1)
            gpu["ecc"]["uncorrected_volatile"] = _optional(
                nvml, "nvmlDeviceGetTotalEccErrors", handle, uncorrected,
                getattr(nvml, "NVML_VOLATILE_ECC", 0))
            gpu["ecc"]["uncorrected_aggregate"] = _optional(
                nvml, "nvmlDeviceGetTotalEccErrors", handle, uncorrected,
                getattr(nvml, "NVML_AGGREGATE_ECC", 1))
        procs = read_processes(nvml, handle, proc_root)
        if procs is not None:
            for p in procs:
                p["allowed"] = is_allowed(p, exp)
        gpu["processes"] = procs
    except Exception as exc:
        if not is_nvml_error(nvml, exc):
            raise
        if error_name(nvml, exc) in UNAVAILABLE + ("LIB_RM_VERSION_MISMATCH", "NO_PERMISSION",
                                                   "UNINITIALIZED"):
            # Host-wide problems: say so once, not per GPU.
            raise NvmlFailure(describe_error(nvml, exc, action))
        gpu["error"] = describe_error(nvml, exc, action)
        return gpu, None
    return gpu, handle


def read_topology(nvml, handles):
    """Pairwise links between the GPUs in `handles` ({index: handle}), degrading to None.

    Returns {"pairs": [...], "interconnect": nvlink|pcie|mixed|single|unknown, "hints": [...]}.
    Each pair: {"gpus": [a, b], "nvlink": bool|None, "path": PIX|PXB|PHB|NODE|SYS|BOARD|None,
    "path_description": str|None}.
    """
    indices = sorted(handles)
    pairs = []
    for i, a in enumerate(indices):
        for b in indices[i + 1:]:
            pair = {"gpus": [a, b], "nvlink": None, "path": None, "path_description": None}
            try:
                level = _optional(nvml, "nvmlDeviceGetTopologyCommonAncestor",
                                  handles[a], handles[b])
            except Exception as exc:
                if not is_nvml_error(nvml, exc):
                    raise
                level = None
            if level is not None and level in TOPOLOGY_PATHS:
                pair["path"], pair["path_description"] = TOPOLOGY_PATHS[level]
            nvlink_index = getattr(nvml, "NVML_P2P_CAPS_INDEX_NVLINK", 2)
            try:
                status = _optional(nvml, "nvmlDeviceGetP2PStatus", handles[a], handles[b],
                                   nvlink_index)
            except Exception as exc:
                if not is_nvml_error(nvml, exc):
                    raise
                status = None
            if status is not None:
                pair["nvlink"] = status == getattr(nvml, "NVML_P2P_STATUS_OK", 0)
            pairs.append(pair)
    hints = []
    if len(indices) < 2:
        interconnect = "single"
    elif any(p["nvlink"] is None for p in pairs):
        interconnect = "unknown"
    elif all(p["nvlink"] for p in pairs):
        interconnect = "nvlink"
    elif not any(p["nvlink"] for p in pairs):
        interconnect = "pcie"
    else:
        interconnect = "mixed"
    if interconnect in ("pcie", "mixed"):
        worst = None
        for p in pairs:
            if not p["nvlink"] and p["path"] and (worst is None or _rank(p["path"]) > _rank(worst)):
                worst = p["path"]
        hints.append("GPU pairs without NVLink talk over PCIe%s: vLLM advises pipeline over tensor "
                     "parallelism without NVLink, and NCCL settings matter (NCCL_P2P_LEVEL, "
                     "NCCL_PROTO; 8-GPU PCIe hosts have served with NCCL_PROTO=LL, NCCL_P2P_LEVEL=SYS)"
                     % (" (worst path %s)" % worst if worst else ""))
        if worst == "SYS":
            hints.append("some GPU pairs cross the CPU interconnect (SYS): peer-to-peer is often "
                         "off there; if NCCL hangs, check PCIe ACS/IOMMU settings")
    return {"pairs": pairs, "interconnect": interconnect, "hints": hints}


def _rank(path):
    for level, (name, _unused) in TOPOLOGY_PATHS.items():
        if name == path:
            return level
    return -1


def read_all(nvml, exp, proc_root=procfs.PROC):
    """Every selected GPU. Returns (gpus, handles, count, problems-with-selection)."""
    try:
        count = nvml.nvmlDeviceGetCount()
    except Exception as exc:
        if not is_nvml_error(nvml, exc):
            raise
        raise NvmlFailure(describe_error(nvml, exc, "counting GPUs (nvmlDeviceGetCount)"))
    selected = exp["devices"] if exp["devices"] is not None else list(range(count))
    problems = []
    gpus, handles = [], {}
    for index in selected:
        if index >= count:
            problems.append(_problem(index, "device", False,
                                     "GPU %d was asked for (devices) but the host has %d GPU(s) "
                                     "(indices 0-%d)" % (index, count, count - 1)
                                     if count else
                                     "GPU %d was asked for (devices) but NVML sees no GPU" % index))
            continue
        gpu, handle = read_gpu(nvml, index, exp, proc_root)
        gpus.append(gpu)
        if handle is not None:
            handles[index] = handle
    return gpus, handles, count, problems


# --------------------------------------------------------------------------------------------
# Judging


def _problem(gpu, kind, transient, message, pids=None):
    return {"gpu": gpu, "kind": kind, "transient": transient, "message": message,
            "pids": list(pids or [])}


def describe_process(p):
    who = p.get("user") or "?"
    cmd = p.get("cmdline") or p.get("name") or "command line unknown (PID not visible in /proc)"
    return "PID %d (user %s: %s) holds %s" % (p["pid"], who, cmd, gib(p.get("used_memory")))


def gpu_label(gpu):
    return "GPU %d (%s%s)" % (gpu["index"], gpu.get("name") or "?",
                              ", " + gpu["uuid"] if gpu.get("uuid") else "")


def evaluate(gpus, system, exp, available=True, reason=None):
    """Every reason the GPUs are not ready for the caller's expectations, as problem dicts."""
    problems = []
    needed = exp["min_gpus"]
    if not available:
        if exp["require_gpus"]:
            what = ("at least %d GPU(s)%s" % (needed, _parallel_text(exp))) if needed else "GPUs"
            problems.append(_problem(None, "count", False, "needs %s but %s" % (what, reason)))
        return problems
    if exp["require_gpus"] and not gpus and not needed:
        problems.append(_problem(None, "count", False, "needs GPUs but NVML sees none"))
    if needed and len(gpus) < needed:
        problems.append(_problem(None, "count", False,
                                 "needs at least %d GPU(s)%s, the host has %d%s"
                                 % (needed, _parallel_text(exp), len(gpus),
                                    " (among devices %s)" % exp["devices"]
                                    if exp["devices"] is not None else "")))
    if exp["min_driver_version"] and system.get("driver_version"):
        try:
            have = parse_version(system["driver_version"], "driver version")
        except InputError:
            have = None
        if have is not None and version_lt(have, exp["min_driver_version"]):
            problems.append(_problem(None, "driver", False,
                                     "driver %s is older than the required %s"
                                     % (system["driver_version"],
                                        ".".join(map(str, exp["min_driver_version"])))))
    for gpu in gpus:
        label = gpu_label(gpu)
        if gpu["error"]:
            problems.append(_problem(gpu["index"], "nvml", False, gpu["error"]))
            continue
        cc = exp["min_compute_capability"]
        if cc and gpu["compute_capability"]:
            have = tuple(int(p) for p in gpu["compute_capability"].split("."))
            if have < cc:
                problems.append(_problem(gpu["index"], "compute_capability", False,
                                         "%s: compute capability %s is below the required %d.%d"
                                         % (label, gpu["compute_capability"], cc[0], cc[1])))
        if exp["check_ecc"]:
            volatile = gpu["ecc"]["uncorrected_volatile"]
            if volatile:
                problems.append(_problem(gpu["index"], "ecc", False,
                                         "%s: %d uncorrected ECC error(s) since the driver loaded "
                                         "(aggregate %s): the GPU needs a reset (nvidia-smi -r) or "
                                         "a reboot, and replacement if it recurs"
                                         % (label, volatile,
                                            gpu["ecc"]["uncorrected_aggregate"])))
        procs = gpu["processes"] or []
        foreign = [p for p in procs if not p["allowed"]]
        if exp["check_processes"] and foreign:
            problems.append(_problem(gpu["index"], "process", True,
                                     "%s: compute process(es) other than the allowed ones: %s"
                                     % (label, "; ".join(describe_process(p) for p in foreign)),
                                     [p["pid"] for p in foreign]))
        frac = exp["gpu_memory_utilization"]
        mem = gpu["memory"]
        if frac and mem["total"]:
            required = int(math.ceil(frac * mem["total"]))
            if mem["free"] < required:
                holders = [p for p in procs if p.get("used_memory") or not p["allowed"]]
                held = ("; held by " + "; ".join(describe_process(p) for p in holders)) \
                    if holders else "; no compute process is listed (held by the driver, "\
                    "a graphics process or a process in another container)"
                problems.append(_problem(gpu["index"], "memory", True,
                                         "%s: %s free of %s, less than the %s needed for "
                                         "gpu_memory_utilization %g (used %s)%s"
                                         % (label, gib(mem["free"]), gib(mem["total"]),
                                            gib(required), frac, gib(mem["used"]), held),
                                         [p["pid"] for p in holders]))
    return problems


def _parallel_text(exp):
    tp, pp = exp["tensor_parallel_size"], exp["pipeline_parallel_size"]
    if tp is None and pp is None:
        return ""
    return " (tensor_parallel_size %d x pipeline_parallel_size %d)" % (tp or 1, pp or 1)


def failure_message(problems, waited, timed_out):
    """The module's failure text: every failing GPU and why, the PIDs and who they are."""
    failing = sorted({p["gpu"] for p in problems if p["gpu"] is not None})
    head = "GPU readiness check failed"
    if timed_out:
        head += " after waiting %.0f s for GPU memory to be released" % waited
    if failing:
        head += " on GPU(s) %s" % ", ".join(str(i) for i in failing)
    return head + ": " + " | ".join(p["message"] for p in problems)


# --------------------------------------------------------------------------------------------
# The whole check, with the bounded wait


def check(nvml, exp, *, topology=True, proc_root=procfs.PROC, clock=time.monotonic,
          sleep=time.sleep, unavailable_reason=None):
    """Read the GPUs, judge them, and wait (bounded) while only transient problems remain.

    `nvml` None means the pynvml binding is absent; `unavailable_reason` then says why.
    Returns a dict: available, reason, system, gpus, topology, problems, ready, polls,
    waited (seconds), timed_out. Raises NvmlFailure for a broken NVML.
    """
    result = {"available": False, "reason": unavailable_reason, "system": {}, "gpus": [],
              "topology": None, "problems": [], "ready": False, "polls": 0, "waited": 0.0,
              "timed_out": False, "count": 0}
    if nvml is None:
        result["problems"] = evaluate([], {}, exp, available=False, reason=unavailable_reason)
        result["ready"] = not result["problems"]
        return result
    reason = open_nvml(nvml)
    if reason:
        result["reason"] = reason
        result["problems"] = evaluate([], {}, exp, available=False, reason=reason)
        result["ready"] = not result["problems"]
        return result
    result["available"] = True
    start = clock()
    try:
        try:
            result["system"] = read_system(nvml)
        except Exception as exc:
            if not is_nvml_error(nvml, exc):
                raise
            raise NvmlFailure(describe_error(nvml, exc, "reading the driver version"))
        while True:
            gpus, handles, count, problems = read_all(nvml, exp, proc_root)
            result["polls"] += 1
            problems += evaluate(gpus, result["system"], exp)
            if result["topology"] is None and topology:
                result["topology"] = read_topology(nvml, handles)
                for gpu in gpus:
                    if gpu["index"] in handles:
                        gpu["nvlink_active_links"] = _nvlink_active_safe(nvml, handles[gpu["index"]])
            elif result["topology"] is not None:
                previous = {g["index"]: g["nvlink_active_links"] for g in result["gpus"]}
                for gpu in gpus:
                    gpu["nvlink_active_links"] = previous.get(gpu["index"])
            result["gpus"], result["count"], result["problems"] = gpus, count, problems
            elapsed = clock() - start
            result["waited"] = round(elapsed, 3)
            if not problems:
                break
            if not all(p["transient"] for p in problems):
                break
            remaining = exp["wait_timeout"] - elapsed
            if remaining <= 0:
                result["timed_out"] = exp["wait_timeout"] > 0
                break
            sleep(min(exp["poll_interval"], remaining))
    finally:
        close_nvml(nvml)
    if count == 0 and not result["gpus"]:
        result["reason"] = "NVML works but sees no GPU"
    result["ready"] = not result["problems"]
    return result


def _nvlink_active_safe(nvml, handle):
    try:
        return _nvlink_active(nvml, handle)
    except Exception as exc:
        if is_nvml_error(nvml, exc):
            return None
        raise
