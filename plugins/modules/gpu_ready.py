#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: (c) 2026, modelswap engineers
# Apache License 2.0 (see https://www.apache.org/licenses/LICENSE-2.0.txt)
# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

DOCUMENTATION = r"""
---
module: gpu_ready
short_description: Check that NVIDIA GPUs are ready for a model
version_added: "0.1.0"
description:
  - Reads the NVIDIA GPUs through NVML (the C(pynvml) module of the C(nvidia-ml-py) package) per
    GPU index, name, UUID, PCI bus id, memory total/used/free, compute capability, uncorrected
    ECC errors, the compute processes with PID, owner, command line and memory; the driver and
    CUDA versions; and topology hints (which GPU pairs share NVLink and which only PCIe, with the
    PCIe path), so NCCL settings can be checked.
  - Asserts what the caller expects, all optional - GPU count (at least O(min_gpus), or
    O(tensor_parallel_size) x O(pipeline_parallel_size)), enough free memory on every GPU for
    the planned O(gpu_memory_utilization), no compute process other than allowed ones, no
    uncorrected ECC error, a minimum driver version and compute capability. A failure lists
    every GPU that fails and why, with the offending PIDs and their command lines.
  - Can wait, bounded by O(wait_timeout), until GPU memory is released after a service stop
    (vLLM's engine processes can outlive the API process). It waits only while the remaining
    problems can go away by themselves (memory still held, foreign processes still running);
    on timeout it reports who still holds what.
  - A readiness check changes nothing. With O(service_user) it also reports, in RV(stale_shm),
    that user's stale shared-memory segments in O(shm_dir) (C(nccl-*), C(psm_*), C(sem.mp-*),
    C(vllm_*) and O(shm_patterns) that no live process holds open or maps) and leaves them in
    place; M(modelswap.vllm.shm_cleanup) removes them.
  - A host without the NVIDIA driver or NVML (a CPU serving host) returns RV(gpus=[]) with the
    reason in RV(nvml.reason); it is a failure only when the caller requires GPUs
    (O(require_gpus), O(min_gpus) > 0 or a parallel size).
  - NVML errors become messages that say what to do (driver/library version mismatch, no
    permission, GPU lost, ...).
extends_documentation_fragment:
  - modelswap.vllm.attributes.read_only
  - ansible.builtin.action_common_attributes
options:
  devices:
    description:
      - GPU indices (as NVML numbers them) to check. All GPUs when omitted.
    type: list
    elements: int
  min_gpus:
    description:
      - The least number of GPUs the host must have (among O(devices) when given).
    type: int
    default: 0
  tensor_parallel_size:
    description:
      - The model's tensor parallel size; the host needs O(tensor_parallel_size) x
        O(pipeline_parallel_size) GPUs (and at least O(min_gpus)).
    type: int
  pipeline_parallel_size:
    description:
      - The model's pipeline parallel size (1 when only O(tensor_parallel_size) is given).
    type: int
  require_gpus:
    description:
      - Fail when NVML is absent or sees no GPU. Implied by O(min_gpus) > 0 or a parallel size.
    type: bool
    default: false
  gpu_memory_utilization:
    description:
      - The fraction of each GPU's memory vLLM will claim (C(--gpu-memory-utilization)), in
        (0, 1]. Every checked GPU must have at least this fraction of its total memory free,
        as vLLM checks at start-up.
    type: float
  allowed_pids:
    description:
      - Compute processes with these PIDs are not foreign.
    type: list
    elements: int
    default: []
  allowed_users:
    description:
      - Compute processes of these users are not foreign.
    type: list
    elements: str
    default: []
  allowed_process_names:
    description:
      - Glob patterns on the process name (executable base name, e.g. C(dcgm*)); matching
        compute processes are not foreign.
    type: list
    elements: str
    default: []
  check_processes:
    description:
      - Fail when a GPU has a compute process that is not allowed.
    type: bool
    default: true
  check_ecc:
    description:
      - Fail when a GPU has uncorrected ECC errors since the driver loaded.
    type: bool
    default: true
  min_driver_version:
    description:
      - The oldest acceptable NVIDIA driver version, e.g. C(550.54).
    type: str
  min_compute_capability:
    description:
      - The lowest acceptable CUDA compute capability, C(MAJOR.MINOR), e.g. C(8.0).
    type: str
  wait_timeout:
    description:
      - Seconds to keep polling while only memory or process problems remain. C(0) checks once.
    type: float
    default: 0
  poll_interval:
    description:
      - Seconds between polls while waiting.
    type: float
    default: 2
  topology:
    description:
      - Read topology hints (NVLink and PCIe paths between GPU pairs).
    type: bool
    default: true
  fail_when_not_ready:
    description:
      - Fail when an expectation is not met. With C(false) the module returns RV(ready=false)
        and RV(problems) instead (for reports).
    type: bool
    default: true
  service_user:
    description:
      - Report this account's stale shared-memory segments in RV(stale_shm); nothing is
        removed. Must exist on the host. Without it O(shm_dir) is not read.
    type: str
  shm_dir:
    description:
      - The shared-memory directory read for RV(stale_shm) (with O(service_user)).
    type: path
    default: /dev/shm
  shm_patterns:
    description:
      - Extra file-name globs to report besides C(nccl-*), C(psm_*), C(sem.mp-*) and C(vllm_*),
        e.g. C(sem.loky-*) (with O(service_user)). A pattern is a name inside O(shm_dir), never a
        path; absolute patterns, patterns with C(/), starting with C(.), or made of wildcards only
        are rejected.
    type: list
    elements: str
    default: []
attributes:
  check_mode:
    support: full
    details:
      - Reading, judging and waiting change nothing; the module runs the same in check mode.
notes:
  - NVML reports host PIDs; inside a container with its own PID namespace the owners and command
    lines of GPU processes are unknown (reported as null).
  - Reading other users' C(/proc/PID/fd) for RV(stale_shm) needs root (C(become=true)); when
    some processes cannot be inspected the segments listed are not proven unused, and the
    module warns.
requirements:
  - nvidia-ml-py (the C(pynvml) module) on hosts with NVIDIA GPUs; without it and without the
    NVIDIA driver the module reports no GPUs.
seealso:
  - module: modelswap.vllm.shm_cleanup
    description: Removes the stale shared-memory segments RV(stale_shm) lists.
  - name: vLLM --gpu-memory-utilization
    description: The fraction of GPU memory vLLM claims; start-up fails when less is free.
    link: https://docs.vllm.ai/en/latest/configuration/engine_args.html
author:
  - modelswap engineers (@modelswap)
"""

EXAMPLES = r"""
- name: Check the GPUs before deploying an 8-way tensor parallel model
  modelswap.vllm.gpu_ready:
    tensor_parallel_size: 8
    gpu_memory_utilization: 0.92
    min_compute_capability: "8.0"
  register: gpus

- name: After stopping vLLM, wait until its GPU memory is free (and list its stale /dev/shm segments)
  modelswap.vllm.gpu_ready:
    min_gpus: 8
    gpu_memory_utilization: 0.92
    wait_timeout: 120
    poll_interval: 2
    service_user: vllm
  become: true
  register: gpus_released

- name: Remove those segments before the start
  modelswap.vllm.shm_cleanup:
    service_user: vllm
    patterns: ["sem.loky-*", "vllm_offload_*"]
  become: true

- name: Report GPU state without failing (status page)
  modelswap.vllm.gpu_ready:
    fail_when_not_ready: false
  register: gpu_state
"""

RETURN = r"""
ready:
  description: Whether every expectation holds.
  returned: always
  type: bool
  sample: true
nvml:
  description: Whether NVML could be used, why not, and the driver versions.
  returned: always
  type: dict
  contains:
    available:
      description: NVML works on this host.
      type: bool
    reason:
      description: Why there are no GPUs (no driver, driver not loaded, no binding, none seen).
      type: str
      sample: "NVML not available: the NVML library libnvidia-ml.so.1 is not installed: ..."
    driver_version:
      description: The NVIDIA driver version.
      type: str
      sample: "550.54.15"
    cuda_driver_version:
      description: The CUDA version the driver supports.
      type: str
      sample: "12.4"
    nvml_version:
      description: The NVML library version.
      type: str
  sample: {"available": true, "reason": null, "driver_version": "550.54.15",
           "cuda_driver_version": "12.4", "nvml_version": "12.550.54.15"}
gpus:
  description: One entry per checked GPU; empty on a host without NVML or GPUs.
  returned: always
  type: list
  elements: dict
  sample:
    - index: 0
      name: NVIDIA H100 80GB HBM3
      uuid: GPU-5d0c1f8e-...
      pci_bus_id: "00000000:18:00.0"
      memory: {total: 85520809984, used: 536870912, free: 84983939072}
      compute_capability: "9.0"
      ecc: {enabled: true, uncorrected_volatile: 0, uncorrected_aggregate: 0}
      nvlink_active_links: 18
      processes:
        - {pid: 4242, name: /opt/vllm/bin/python3, user: vllm, uid: 998,
           cmdline: "/opt/vllm/bin/python3 -m vllm.entrypoints.openai.api_server ...",
           used_memory: 76000000000, allowed: false}
      error: null
topology:
  description: Links between GPU pairs and a summary; null when not read.
  returned: always
  type: dict
  contains:
    pairs:
      description: Per GPU pair - nvlink (bool or null when unknown), path (BOARD, PIX, PXB,
        PHB, NODE, SYS, or null) and its description.
      type: list
      elements: dict
    interconnect:
      description: nvlink, pcie, mixed, single (fewer than 2 GPUs) or unknown.
      type: str
    hints:
      description: What the topology means for NCCL and parallelism.
      type: list
      elements: str
problems:
  description: Every unmet expectation; kind is count, device, driver, compute_capability,
    ecc, nvml, memory or process; transient ones (memory, process) may clear by waiting.
  returned: always
  type: list
  elements: dict
  sample:
    - gpu: 0
      kind: process
      transient: true
      pids: [4242]
      message: "GPU 0 (NVIDIA H100 80GB HBM3, GPU-...): compute process(es) other than the allowed ones: PID 4242 ..."
polls:
  description: How many times the GPUs were read.
  returned: always
  type: int
waited:
  description: Seconds spent polling.
  returned: always
  type: float
timed_out:
  description: The wait ended at O(wait_timeout) with problems left.
  returned: always
  type: bool
stale_shm:
  description: The stale shared-memory segments of O(service_user) in O(shm_dir) - matching
    regular files no live process holds open or maps, what M(modelswap.vllm.shm_cleanup) would
    remove - with their sizes and the pattern each matched. Reported only; left in place.
  returned: when service_user is given
  type: list
  elements: dict
  sample: [{"path": "/dev/shm/nccl-2f1a", "size": 33554432, "pattern": "nccl-*"}]
msg:
  description: A one-line summary, or on failure every failing GPU and why.
  returned: always
  type: str
"""

import traceback

from ansible.module_utils.basic import AnsibleModule, missing_required_lib
from ansible_collections.modelswap.vllm.plugins.module_utils.gpu import gpu_ready
from ansible_collections.modelswap.vllm.plugins.module_utils.gpu import shm

try:
    import pynvml
    PYNVML_IMPORT_ERROR = None
except ImportError:
    pynvml = None
    PYNVML_IMPORT_ERROR = traceback.format_exc()


def argument_spec():
    return dict(
        devices=dict(type="list", elements="int"),
        min_gpus=dict(type="int", default=0),
        tensor_parallel_size=dict(type="int"),
        pipeline_parallel_size=dict(type="int"),
        require_gpus=dict(type="bool", default=False),
        gpu_memory_utilization=dict(type="float"),
        allowed_pids=dict(type="list", elements="int", default=[]),
        allowed_users=dict(type="list", elements="str", default=[]),
        allowed_process_names=dict(type="list", elements="str", default=[]),
        check_processes=dict(type="bool", default=True),
        check_ecc=dict(type="bool", default=True),
        min_driver_version=dict(type="str"),
        min_compute_capability=dict(type="str"),
        wait_timeout=dict(type="float", default=0),
        poll_interval=dict(type="float", default=2),
        topology=dict(type="bool", default=True),
        fail_when_not_ready=dict(type="bool", default=True),
        service_user=dict(type="str"),
        shm_dir=dict(type="path", default=shm.SHM_DIR),
        shm_patterns=dict(type="list", elements="str", default=[]),
    )


def stale_shm(module, p):
    """The service user's stale /dev/shm segments, as shm_cleanup would plan them; none removed."""
    uid, user = shm.resolve_user(p["service_user"])
    planned = shm.plan(p["shm_dir"], uid, shm.with_defaults(p["shm_patterns"]))
    if planned["uninspectable"] and planned["remove"]:
        module.warn("%d process(es) could not be inspected (PIDs %s): the %d /dev/shm segment(s) "
                    "of %s listed in stale_shm are not proven unused. Run the task with become: "
                    "true." % (len(planned["uninspectable"]),
                               ", ".join(map(str, planned["uninspectable"][:10])),
                               len(planned["remove"]), user))
    return shm.public(planned["remove"]), user


def summary(res, stale, user):
    if res["available"] and res["gpus"]:
        names = sorted({g["name"] for g in res["gpus"] if g.get("name")})
        text = "%d GPU(s) %s (%s)" % (len(res["gpus"]), "ready" if res["ready"] else "not ready",
                                      ", ".join(names))
        if res["polls"] > 1:
            text += " after %d polls in %.1f s" % (res["polls"], res["waited"])
    else:
        text = "No GPUs: %s" % res["reason"]
    if stale:
        text += ("; %d stale /dev/shm segment(s) of %s (%s) left in place (modelswap.vllm.shm_cleanup "
                 "removes them)" % (len(stale), user, gpu_ready.gib(sum(e["size"] for e in stale))))
    return text


def main():
    module = AnsibleModule(
        argument_spec=argument_spec(),
        supports_check_mode=True,
    )
    p = module.params

    # Validate everything before touching anything.
    try:
        exp = gpu_ready.expectations(
            min_gpus=p["min_gpus"], tensor_parallel_size=p["tensor_parallel_size"],
            pipeline_parallel_size=p["pipeline_parallel_size"], require_gpus=p["require_gpus"],
            gpu_memory_utilization=p["gpu_memory_utilization"], allowed_pids=p["allowed_pids"],
            allowed_process_names=p["allowed_process_names"], allowed_users=p["allowed_users"],
            check_processes=p["check_processes"], check_ecc=p["check_ecc"],
            min_driver_version=p["min_driver_version"],
            min_compute_capability=p["min_compute_capability"], devices=p["devices"],
            wait_timeout=p["wait_timeout"], poll_interval=p["poll_interval"])
        if p["service_user"] is not None:
            shm.validate_dir(p["shm_dir"])
            shm.validate_patterns(p["shm_patterns"])
            shm.resolve_user(p["service_user"])
    except (gpu_ready.InputError, shm.ShmError) as exc:
        module.fail_json(msg=str(exc))

    binding = pynvml
    reason = None
    if binding is None:
        if gpu_ready.library_present():
            module.fail_json(
                msg=missing_required_lib(
                    "nvidia-ml-py", reason="to read this host's NVIDIA GPUs (the NVIDIA driver's "
                    "%s is present, so the host has GPUs this module cannot see without it)"
                    % gpu_ready.LIBRARY),
                exception=PYNVML_IMPORT_ERROR)
        reason = ("NVML not available: no NVIDIA driver (%s not found) and the Python binding "
                  "nvidia-ml-py (pynvml) is not installed" % gpu_ready.LIBRARY)
    try:
        res = gpu_ready.check(binding, exp, topology=p["topology"], unavailable_reason=reason)
    except gpu_ready.NvmlFailure as exc:
        if p["fail_when_not_ready"]:
            module.fail_json(msg="Cannot check the GPUs: %s" % exc, gpus=[], ready=False)
        res = {"available": False, "reason": str(exc), "system": {}, "gpus": [],
               "topology": None, "ready": False, "polls": 0, "waited": 0.0, "timed_out": False,
               "problems": [{"gpu": None, "kind": "nvml", "transient": False,
                             "message": str(exc), "pids": []}]}

    result = {
        "changed": False,
        "ready": res["ready"],
        "nvml": dict({"available": res["available"], "reason": res["reason"]},
                     **{k: res["system"].get(k) for k in ("driver_version", "cuda_driver_version",
                                                          "nvml_version")}),
        "gpus": res["gpus"],
        "topology": res["topology"],
        "problems": res["problems"],
        "polls": res["polls"],
        "waited": res["waited"],
        "timed_out": res["timed_out"],
    }
    for gpu in result["gpus"]:
        for proc in gpu.get("processes") or []:
            proc.pop("comm", None)
    stale, user = None, None
    if p["service_user"] is not None:
        try:
            stale, user = stale_shm(module, p)
        except shm.ShmError as exc:
            module.fail_json(msg=str(exc), **result)
        result["stale_shm"] = stale
    if not res["ready"] and p["fail_when_not_ready"]:
        module.fail_json(msg=gpu_ready.failure_message(res["problems"], res["waited"], res["timed_out"]),
                         **result)
    result["msg"] = summary(res, stale, user)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
