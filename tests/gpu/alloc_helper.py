"""Hold GPU memory until told to let go: the "foreign process" of the device check.

    python3 alloc_helper.py BYTES [MAX_SECONDS]

Allocates BYTES on the first visible CUDA device with whatever is there - torch, else cupy, else
the CUDA driver API through ctypes (libcuda.so.1, present wherever the NVIDIA driver is) - then
prints `ALLOCATED <backend> <bytes> <pid>` and waits for a line `free` on stdin (or EOF, or
MAX_SECONDS, default 120). It then frees the memory and exits, which also drops its CUDA context.
Errors go to stderr as `ERROR ...` with exit status 2.
"""
from __future__ import annotations

import ctypes
import os
import select
import sys
import time


def alloc_torch(nbytes):
    import torch  # noqa: F401  (only if importable)

    if not torch.cuda.is_available():
        raise RuntimeError("torch sees no CUDA device")
    buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    buf.fill_(1)
    torch.cuda.synchronize()

    def free():
        nonlocal buf
        del buf
        torch.cuda.empty_cache()
    return free


def alloc_cupy(nbytes):
    import cupy

    buf = cupy.empty(nbytes, dtype=cupy.uint8)
    buf.fill(1)
    cupy.cuda.Device().synchronize()

    def free():
        nonlocal buf
        del buf
        cupy.get_default_memory_pool().free_all_blocks()
    return free


def alloc_driver_api(nbytes):
    cuda = ctypes.CDLL("libcuda.so.1")

    def check(rc, what):
        if rc != 0:
            name = ctypes.c_char_p()
            cuda.cuGetErrorName(rc, ctypes.byref(name))
            raise RuntimeError("%s failed: CUresult %d (%s)" % (what, rc,
                                                                (name.value or b"?").decode()))

    dev = ctypes.c_int()
    ctx = ctypes.c_void_p()
    ptr = ctypes.c_uint64()
    check(cuda.cuInit(0), "cuInit")
    check(cuda.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    check(cuda.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    check(cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(nbytes)), "cuMemAlloc_v2")
    check(cuda.cuMemsetD8_v2(ptr, ctypes.c_ubyte(1), ctypes.c_size_t(nbytes)), "cuMemsetD8_v2")
    check(cuda.cuCtxSynchronize(), "cuCtxSynchronize")

    def free():
        check(cuda.cuMemFree_v2(ptr), "cuMemFree_v2")
        check(cuda.cuDevicePrimaryCtxRelease(dev), "cuDevicePrimaryCtxRelease")
    return free


def main():
    nbytes = int(sys.argv[1])
    limit = float(sys.argv[2]) if len(sys.argv) > 2 else 120.0
    errors = []
    for name, fn in (("torch", alloc_torch), ("cupy", alloc_cupy), ("cuda-driver", alloc_driver_api)):
        try:
            free = fn(nbytes)
        except ImportError as exc:
            errors.append("%s: not importable (%s)" % (name, exc))
            continue
        except Exception as exc:  # report every backend's failure, then give up
            errors.append("%s: %s" % (name, exc))
            continue
        break
    else:
        sys.stderr.write("ERROR no backend could allocate GPU memory: %s\n" % "; ".join(errors))
        sys.exit(2)
    print("ALLOCATED %s %d %d" % (name, nbytes, os.getpid()), flush=True)
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        ready, _, _ = select.select([sys.stdin], [], [], 1.0)
        if ready:
            line = sys.stdin.readline()
            if not line or line.strip() == "free":
                break
    free()
    print("FREED", flush=True)


if __name__ == "__main__":
    main()
