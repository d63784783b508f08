"""Real processes that hold a file open or map it, for the /dev/shm cleanup tests.

Each helper is a child process started by the test, bounded in time (it exits on its own after
`seconds`) and ended by PID when the test is done.
"""
from __future__ import annotations

import contextlib
import subprocess
import sys
import time

MAP_SCRIPT = r"""
import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                      ctypes.c_long]
fd = os.open(sys.argv[1], os.O_RDONLY)
size = os.fstat(fd).st_size or 1
addr = libc.mmap(None, size, 1, 1, fd, 0)   # PROT_READ, MAP_SHARED (Python's mmap keeps a dup fd)
if addr in (None, ctypes.c_void_p(-1).value):
    raise SystemExit("mmap failed: errno %d" % ctypes.get_errno())
os.close(fd)                      # only the mapping remains: /proc/PID/maps, not /proc/PID/fd
print("ready", flush=True)
time.sleep(float(sys.argv[2]))
"""

OPEN_SCRIPT = r"""
import sys, time
fh = open(sys.argv[1], "rb")      # an open descriptor, no mapping
print("ready", flush=True)
time.sleep(float(sys.argv[2]))
"""


@contextlib.contextmanager
def holding(path, how, seconds=60):
    """Yield the PID of a process that holds `path` open (how="fd") or mapped (how="mmap")."""
    script = {"fd": OPEN_SCRIPT, "mmap": MAP_SCRIPT}[how]
    proc = subprocess.Popen([sys.executable, "-c", script, str(path), str(seconds)],
                            stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        line = proc.stdout.readline()
        if line.strip() != "ready" or time.monotonic() > deadline:
            raise RuntimeError("holder for %s did not start (rc=%s)" % (path, proc.poll()))
        yield proc.pid
    finally:
        proc.kill()
        proc.wait(timeout=10)
        proc.stdout.close()
