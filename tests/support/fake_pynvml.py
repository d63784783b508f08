"""A fake NVML with the real pynvml's names, signatures, return types and exceptions.

The lab has no NVIDIA GPU, so NVML is the one thing tests fake (docs/lab.md, "NVML"). The fake is
built on the installed nvidia-ml-py: constants, NVMLError and its per-code subclasses
(NVMLError_GpuIsLost, ...), NVMLLibraryMismatchError, and the return structures
(c_nvmlMemory_t, nvmlPciInfo_t, c_nvmlDevice_t handles, nvmlFriendlyObject process entries)
are the real ones; only the C library behind them is replaced by a scenario:

    {
      "init_error": null | <NVML_ERROR_* code>,     # nvmlInit raises NVMLError(code)
      "driver_version": "550.54.15", "cuda_driver_version": 12040, "nvml_version": "12.550.54.15",
      "missing_functions": ["nvmlDeviceGetComputeRunningProcesses_v3", ...],
      "topology": {"0-1": 10}, "nvlink_p2p": [[0, 1]],
      "devices": [{
          "name": ..., "uuid": ..., "pci_bus_id": ..., "total": bytes, "used": bytes,
          "cc": [9, 0], "ecc_mode": 1 | 0 | null (NOT_SUPPORTED),
          "ecc_volatile": 0, "ecc_aggregate": 0, "nvlinks": [1, 1, 0] | null,
          "processes": [{"pid": 123, "used": bytes | null, "name": "/usr/bin/python3"}],
          "errors": {"nvmlDeviceGetMemoryInfo": <code>, ...},
          "after_reads": {"n": 3, "used": bytes, "processes": []}   # state after n memory reads
      }]
    }

The same class serves in-process tests (passed as the `nvml` argument of module_utils.nvml)
and, through tests/support/fakenvml/pynvml.py, a module run as a subprocess that imports
`pynvml` exactly as on a host.
"""
from __future__ import annotations

import copy
import ctypes

_HANDLE_BASE = 0x5A00  # fake device handles are c_nvmlDevice_t pointers to BASE + index


class FakeNvml:
    """Functions of pynvml over a scenario; attributes are the real module's constants."""

    def __init__(self, scenario, real=None):
        if real is None:
            import pynvml as real  # the installed nvidia-ml-py
        self._real = real
        for name in dir(real):
            if name.startswith(("NVML_", "NVMLError", "NVMLLibraryMismatchError", "c_nvml",
                                "nvmlFriendlyObject", "nvmlStructToFriendlyObject",
                                "nvmlPciInfo_t")):
                setattr(self, name, getattr(real, name))
        self.scenario = copy.deepcopy(scenario)
        self.devices = self.scenario.get("devices", [])
        self.initialized = 0
        self.calls = []
        self.memory_reads = {}

    # -- plumbing ------------------------------------------------------------------------------
    def _enter(self, fn, *args, device=None):
        self.calls.append((fn,) + tuple(args))
        if fn in self.scenario.get("missing_functions", ()):
            raise self._real.NVMLError(self._real.NVML_ERROR_FUNCTION_NOT_FOUND)
        if fn != "nvmlInit" and not self.initialized:
            raise self._real.NVMLError(self._real.NVML_ERROR_UNINITIALIZED)
        if device is not None:
            code = self.devices[device].get("errors", {}).get(fn)
            if code:
                raise self._real.NVMLError(code)

    def _index(self, handle):
        value = ctypes.cast(handle, ctypes.c_void_p).value
        index = (value or 0) - _HANDLE_BASE
        if not 0 <= index < len(self.devices):
            raise self._real.NVMLError(self._real.NVML_ERROR_INVALID_ARGUMENT)
        return index

    def _state(self, index):
        dev = self.devices[index]
        after = dev.get("after_reads")
        if after and self.memory_reads.get(index, 0) >= after["n"]:
            merged = dict(dev)
            merged.update({k: v for k, v in after.items() if k != "n"})
            return merged
        return dev

    # -- library -------------------------------------------------------------------------------
    def nvmlInit(self):
        self.calls.append(("nvmlInit",))
        code = self.scenario.get("init_error")
        if code:
            raise self._real.NVMLError(code)
        self.initialized += 1

    def nvmlShutdown(self):
        self._enter("nvmlShutdown")
        self.initialized -= 1

    def nvmlSystemGetDriverVersion(self):
        self._enter("nvmlSystemGetDriverVersion")
        return self.scenario.get("driver_version", "550.54.15")

    def nvmlSystemGetCudaDriverVersion(self):
        self._enter("nvmlSystemGetCudaDriverVersion")
        return self.scenario.get("cuda_driver_version", 12040)

    def nvmlSystemGetNVMLVersion(self):
        self._enter("nvmlSystemGetNVMLVersion")
        return self.scenario.get("nvml_version", "12.550.54.15")

    def nvmlSystemGetProcessName(self, pid):
        self._enter("nvmlSystemGetProcessName", pid)
        for index in range(len(self.devices)):
            for proc in self._state(index).get("processes", []):
                if proc["pid"] == pid and proc.get("name"):
                    return proc["name"]
        raise self._real.NVMLError(self._real.NVML_ERROR_NOT_FOUND)

    # -- devices -------------------------------------------------------------------------------
    def nvmlDeviceGetCount(self):
        self._enter("nvmlDeviceGetCount")
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index):
        self._enter("nvmlDeviceGetHandleByIndex", index)
        if not 0 <= index < len(self.devices):
            raise self._real.NVMLError(self._real.NVML_ERROR_INVALID_ARGUMENT)
        code = self.devices[index].get("errors", {}).get("nvmlDeviceGetHandleByIndex")
        if code:
            raise self._real.NVMLError(code)
        return ctypes.cast(ctypes.c_void_p(_HANDLE_BASE + index), self._real.c_nvmlDevice_t)

    def nvmlDeviceGetName(self, handle):
        i = self._index(handle)
        self._enter("nvmlDeviceGetName", i, device=i)
        return self.devices[i].get("name", "NVIDIA H100 80GB HBM3")

    def nvmlDeviceGetUUID(self, handle):
        i = self._index(handle)
        self._enter("nvmlDeviceGetUUID", i, device=i)
        return self.devices[i].get("uuid", "GPU-%08d-fake-0000-0000-000000000000" % i)

    def nvmlDeviceGetPciInfo(self, handle):
        i = self._index(handle)
        self._enter("nvmlDeviceGetPciInfo", i, device=i)
        info = self._real.nvmlPciInfo_t()
        info.busId = self.devices[i].get("pci_bus_id", "00000000:%02X:00.0" % (0x18 + i)).encode()
        return info

    def nvmlDeviceGetMemoryInfo(self, handle, version=None):
        i = self._index(handle)
        self._enter("nvmlDeviceGetMemoryInfo", i, device=i)
        state = self._state(i)
        self.memory_reads[i] = self.memory_reads.get(i, 0) + 1
        mem = self._real.c_nvmlMemory_t()
        mem.total = state["total"]
        mem.used = state["used"]
        mem.free = state["total"] - state["used"]
        return mem

    def nvmlDeviceGetCudaComputeCapability(self, handle):
        i = self._index(handle)
        self._enter("nvmlDeviceGetCudaComputeCapability", i, device=i)
        major, minor = self.devices[i].get("cc", [9, 0])
        return (major, minor)

    def nvmlDeviceGetEccMode(self, handle):
        i = self._index(handle)
        self._enter("nvmlDeviceGetEccMode", i, device=i)
        mode = self.devices[i].get("ecc_mode", 1)
        if mode is None:
            raise self._real.NVMLError(self._real.NVML_ERROR_NOT_SUPPORTED)
        return [mode, mode]

    def nvmlDeviceGetTotalEccErrors(self, handle, errorType, counterType):
        i = self._index(handle)
        self._enter("nvmlDeviceGetTotalEccErrors", i, errorType, counterType, device=i)
        dev = self.devices[i]
        if dev.get("ecc_mode", 1) is None:
            raise self._real.NVMLError(self._real.NVML_ERROR_NOT_SUPPORTED)
        if errorType != self._real.NVML_MEMORY_ERROR_TYPE_UNCORRECTED:
            return 0
        if counterType == self._real.NVML_VOLATILE_ECC:
            return dev.get("ecc_volatile", 0)
        return dev.get("ecc_aggregate", dev.get("ecc_volatile", 0))

    def _processes(self, fn, handle):
        i = self._index(handle)
        self._enter(fn, i, device=i)
        out = []
        for proc in self._state(i).get("processes", []):
            info = self._real.c_nvmlProcessInfo_t()
            info.pid = proc["pid"]
            used = proc.get("used")
            info.usedGpuMemory = self._real.NVML_VALUE_NOT_AVAILABLE_ulonglong.value \
                if used is None else used
            obj = self._real.nvmlStructToFriendlyObject(info)
            if obj.usedGpuMemory == self._real.NVML_VALUE_NOT_AVAILABLE_ulonglong.value:
                obj.usedGpuMemory = None  # as the real binding does
            out.append(obj)
        return out

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        # The real one calls _v3 and turns FUNCTION_NOT_FOUND into NVMLLibraryMismatchError.
        if "nvmlDeviceGetComputeRunningProcesses_v3" in self.scenario.get("missing_functions", ()):
            raise self._real.NVMLLibraryMismatchError(
                "Unversioned function called and the pyNVML version does not match the NVML lib "
                "version. Either use matching pyNVML and NVML lib versions or use a versioned "
                "function such as nvmlDeviceGetComputeRunningProcesses_v2")
        return self._processes("nvmlDeviceGetComputeRunningProcesses", handle)

    def nvmlDeviceGetComputeRunningProcesses_v2(self, handle):
        return self._processes("nvmlDeviceGetComputeRunningProcesses_v2", handle)

    def nvmlDeviceGetTopologyCommonAncestor(self, device1, device2):
        a, b = sorted((self._index(device1), self._index(device2)))
        self._enter("nvmlDeviceGetTopologyCommonAncestor", a, b, device=a)
        topo = self.scenario.get("topology")
        if topo is None:
            raise self._real.NVMLError(self._real.NVML_ERROR_NOT_SUPPORTED)
        return topo.get("%d-%d" % (a, b), self._real.NVML_TOPOLOGY_SYSTEM)

    def nvmlDeviceGetP2PStatus(self, device1, device2, p2pIndex):
        a, b = sorted((self._index(device1), self._index(device2)))
        self._enter("nvmlDeviceGetP2PStatus", a, b, p2pIndex, device=a)
        if p2pIndex != self._real.NVML_P2P_CAPS_INDEX_NVLINK:
            return self._real.NVML_P2P_STATUS_OK
        if "nvlink_p2p" not in self.scenario:
            raise self._real.NVMLError(self._real.NVML_ERROR_NOT_SUPPORTED)
        linked = [sorted(p) for p in self.scenario["nvlink_p2p"]]
        return self._real.NVML_P2P_STATUS_OK if [a, b] in linked \
            else self._real.NVML_P2P_STATUS_NOT_SUPPORTED

    def nvmlDeviceGetNvLinkState(self, device, link):
        i = self._index(device)
        self._enter("nvmlDeviceGetNvLinkState", i, link, device=i)
        links = self.devices[i].get("nvlinks")
        if links is None:
            raise self._real.NVMLError(self._real.NVML_ERROR_NOT_SUPPORTED)
        if link >= len(links):
            raise self._real.NVMLError(self._real.NVML_ERROR_INVALID_ARGUMENT)
        return self._real.NVML_FEATURE_ENABLED if links[link] else self._real.NVML_FEATURE_DISABLED


def gpu(index=0, *, total=80 * 1024 ** 3, used=512 * 1024 ** 2, **extra):
    """A device entry for a scenario (an idle H100 by default)."""
    dev = {"name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-%08d-aaaa-bbbb-cccc-000000000000" % index,
           "pci_bus_id": "00000000:%02X:00.0" % (0x18 + index), "total": total, "used": used,
           "cc": [9, 0], "ecc_mode": 1, "ecc_volatile": 0, "ecc_aggregate": 0, "processes": []}
    dev.update(extra)
    return dev
