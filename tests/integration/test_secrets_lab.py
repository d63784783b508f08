"""Secrets never leave their 0600 home (issue 14): the secret scan of
tests/integration/test_vllm_service_lab.py widened to a whole migration.

One `playbooks/migrate.yml` run at -vvv (ansible-runner verbosity 3), a first deploy of tiny-a on
gpu1 (vLLM installed from the wheelhouse, tiny-a downloaded from the lab Hub with a Hub token,
the service started, the benchmark run with a Locust worker on gpu2), with a marker Hub token and a
marker API key: unique strings, handed over the way operators do (inventory variables that read
0600 files on the controller; never extra vars). Then zero hits of either marker in
- the controller's output and ansible-runner's events and artifacts,
- the run records (results/runs/...) and the benchmark report (results/benchmark/...),
- each host's journal since the run started,
- `ps -ww -eo args` taken every second on each host during the whole run,
- every file under /etc/systemd, /etc/modelswap, /opt/modelswap, /var/lib, /var/tmp, /tmp, /root
  on the hosts but the 0600 root files that are the API key's home (their paths and modes are
  printed and checked).
While hf_snapshot downloads (the Hub throttles tiny-a's weights so it lasts), the files on gpu1 that
hold the Hub token are read: Ansible's async job (its AnsiballZ wrapper, module arguments inside)
sits in the connection user's remote tmp folder, and nobody but root can read it.

The markers are sent through stdin to every remote grep, so no command line holds them.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.integration import vllm_lab
from tests.lab import labctl

pytestmark = [pytest.mark.lab, pytest.mark.vllm]

TARGET, LOADGEN = "gpu1", "gpu2"
MODEL = "tiny-a"
HOST_TREES = ["/etc/systemd", "/etc/modelswap", "/opt/modelswap", "/var/lib", "/var/tmp", "/tmp", "/root"]
# the API key's homes on the target: the service's key file and the saved copies of it
KEY_HOMES = {"/etc/modelswap/vllm.secret.env", "/var/lib/modelswap/vllm/vllm/active/secret",
             "/var/lib/modelswap/vllm/vllm/previous/secret"}
LOCUST_DIR = "/opt/modelswap-test/locust"
RUN_LIMIT_S = 1500


def ssh(lab, host: str, command: str, stdin: str = "", timeout: float = 300) -> subprocess.CompletedProcess:
    """A command on a lab host; `stdin` (the markers) never appears on a command line."""
    return subprocess.run(labctl.ssh_argv(lab._lab, host) + [command], input=stdin, text=True,
                          capture_output=True, timeout=timeout)


def install_locust(lab, host: str) -> None:
    """Locust for the host's own /usr/bin/python3 (3.11, as here): the packages Locust imports,
    copied from the controller's virtualenv (the lab hosts have no package index)."""
    probe = ("import sys, locust.main, locust.contrib.fasthttp, zmq.green, geventhttpclient\n"
             "sp = [p for p in sys.path if p.endswith('site-packages')][0]\n"
             "tops = {m.__file__[len(sp) + 1:].split('/')[0] for m in list(sys.modules.values())\n"
             "        if (getattr(m, '__file__', None) or '').startswith(sp + '/')}\n"
             "print(sp); print('\\n'.join(sorted(tops | {'pyzmq.libs'})))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    site = out[0]
    tops = [t for t in out[1:] if os.path.exists(os.path.join(out[0], t))]
    tar = subprocess.run(["tar", "-C", site, "-cf", "-"] + tops, capture_output=True, check=True).stdout
    put = subprocess.run(labctl.ssh_argv(lab._lab, host) + [
        f"rm -rf {LOCUST_DIR} && mkdir -p {LOCUST_DIR} && tar -C {LOCUST_DIR} -xf - && "
        f"PYTHONPATH={LOCUST_DIR} /usr/bin/python3 -c 'import locust.main'"], input=tar, capture_output=True,
        timeout=120)
    assert put.returncode == 0, put.stderr.decode()[-2000:]


def write_inventory(lab, folder: Path, key_file: Path, token_file: Path, master_port: int) -> Path:
    """The lab's inventory with gpu1 as the only GPU host and gpu2 as a load generator; gpu1's
    secrets are read from the 0600 files by lookups (the way a vault would hand them over)."""
    inv = folder / "inventory"
    inv.mkdir()
    lab_inv = yaml.safe_load(Path(lab.inventory).read_text())
    group = lab_inv["all"]["children"]["gpu_hosts"]
    common = group["vars"]
    hosts = group["hosts"]
    # the connection settings per group, not under `all` (whose variables localhost inherits)
    doc = {"all": {"children": {
        "gpu_hosts": {"vars": common, "hosts": {TARGET: hosts[TARGET]}},
        "load_generators": {"vars": common, "hosts": {LOADGEN: hosts[LOADGEN]}}}}}
    (inv / "hosts.yml").write_text(yaml.safe_dump(doc))
    (inv / "group_vars").symlink_to(Path(lab.inventory).parent / "group_vars")
    (inv / "host_vars").mkdir()
    (inv / "host_vars" / f"{TARGET}.yml").write_text(yaml.safe_dump({
        "vllm_service_api_key": "{{ lookup('ansible.builtin.file', '%s') }}" % key_file,
        "modelswap_hub_token": "{{ lookup('ansible.builtin.file', '%s') }}" % token_file,
        # the lab Hub is plain HTTP on the lab bridge (hf_snapshot's trusted-endpoint option, where
        # it exists, says so)
        "modelswap_hub_http_trusted": True,
        "benchmark_load_generators": [LOADGEN],
        "benchmark_master_address": lab._lab.gateway,
        "benchmark_master_port": master_port,
        "benchmark_worker_locust_command": ["/usr/bin/env", f"PYTHONPATH={LOCUST_DIR}", "/usr/bin/python3",
                                            "-m", "locust"],
    }))
    return inv / "hosts.yml"


class PsPoller:
    """`ps -ww -eo args` on a host every second, over one SSH session, until stopped (at most
    RUN_LIMIT_S snapshots)."""

    def __init__(self, lab, host: str):
        self.host = host
        self.stop_file = f"/run/modelswap-ps-stop-{secrets.token_hex(4)}"
        loop = (f"rm -f {self.stop_file}; i=0; while [ $i -lt {RUN_LIMIT_S} ] && [ ! -e {self.stop_file} ]; do "
                f"ps -ww -eo args; echo '@@snapshot@@'; i=$((i+1)); sleep 1; done; rm -f {self.stop_file}")
        self.lab = lab
        self.proc = subprocess.Popen(labctl.ssh_argv(lab._lab, host) + [loop], stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, text=True)
        self.text = ""
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        self.text = self.proc.stdout.read()

    def stop(self) -> None:
        ssh(self.lab, self.host, f"touch {self.stop_file}", timeout=30)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.terminate()
            self.proc.wait(timeout=10)
        self.reader.join(10)

    @property
    def snapshots(self) -> int:
        return self.text.count("@@snapshot@@")


def token_files_during_download(lab, marker: str, stop: threading.Event, found: list) -> None:
    """While hf_snapshot runs on the target: the files under the remote tmp folders that hold the
    token, with the mode and owner of each and of every folder above it (at most 3 looks)."""
    look = ("pgrep -f 'AnsiballZ_hf_snapsho[t]' >/dev/null || exit 3; "
            "grep -rlsF -f - /root/.ansible /root/.ansible_async /tmp /var/tmp | while IFS= read -r f; do "
            "echo \"file $(stat -c '%a %U %G' \"$f\") $f\"; d=$f; "
            "while d=$(dirname \"$d\"); [ \"$d\" != / ]; do echo \"dir $(stat -c '%a %U %G' \"$d\") $d\"; done; done")
    deadline = time.monotonic() + RUN_LIMIT_S
    while not stop.is_set() and time.monotonic() < deadline and len(found) < 3:
        res = ssh(lab, TARGET, look, stdin=marker + "\n", timeout=60)
        if res.returncode == 0 and res.stdout.strip():
            found.append(res.stdout)
        time.sleep(1)


def grep_host(lab, host: str, markers: list[str]) -> list[tuple[str, str, str]]:
    """(mode, owner, path) of every file under HOST_TREES that holds a marker."""
    res = ssh(lab, host, "grep -rlsF -f - %s | while IFS= read -r f; do echo \"$(stat -c '%%a %%U' \"$f\") $f\"; done"
              % " ".join(HOST_TREES), stdin="\n".join(markers) + "\n", timeout=600)
    hits = []
    for line in res.stdout.splitlines():
        mode, owner, path = line.split(" ", 2)
        hits.append((mode, owner, path))
    return hits


def served(lab, host: str, key: str | None):
    req = urllib.request.Request(f"http://{lab.address(host)}:8000/v1/models",
                                 headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, [m["id"] for m in json.load(resp)["data"]]
    except urllib.error.HTTPError as exc:
        return exc.code, None


def controller_hits(root: Path, markers: list[str]) -> list[str]:
    hits = []
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            data = path.read_bytes()
            hits += [f"{path}: {m[:6]}..." for m in markers if m.encode() in data]
    return hits


@pytest.fixture(scope="module")
def scan(lab, tmp_path_factory):
    import ansible_runner

    work = tmp_path_factory.mktemp("secrets")
    token = "hf_msmarkertok" + secrets.token_hex(12)
    key = "msk-msmarkerkey" + secrets.token_hex(12)
    vault = Path(tempfile.mkdtemp(prefix="modelswap-marker-secrets-"))     # 0700
    key_file, token_file = vault / "api_key", vault / "hub_token"
    for path, value in ((key_file, key), (token_file, token)):
        path.touch(mode=0o600)
        path.write_text(value + "\n")
    lab.hub.store.add_token(user="marker", token=token)
    inventory = write_inventory(lab, work, key_file, token_file, 25557 + os.getpid() % 1000)
    results = work / "results"
    private = work / "runner"
    private.mkdir()

    # gpu1: no deployment and no tiny-a, so the run deploys, downloads (with the token) and
    # benchmarks; gpu2: Locust for the worker
    for host in (TARGET, LOADGEN):
        vllm_lab.reset_host(lab, host)
    lab.ssh(TARGET, vllm_lab.FORGET_MODEL.format(repo_folder="models--lab--tiny-a", name=MODEL))
    install_locust(lab, LOADGEN)
    lab.hub.clear_log()
    # the payload's every transfer throttled (over Xet: each xorb range) until the run ends
    lab.hub.fault("throttle", rate=400_000, repo="lab/tiny-a", file="model.safetensors", count=None)

    started = {h: vllm_lab.host_epoch(lab, h) for h in (TARGET, LOADGEN)}
    pollers = [PsPoller(lab, h) for h in (TARGET, LOADGEN)]
    stop, during = threading.Event(), []
    watcher = threading.Thread(target=token_files_during_download, args=(lab, token, stop, during), daemon=True)
    watcher.start()
    os.environ["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    try:
        run = ansible_runner.run(
            private_data_dir=str(private), project_dir=str(labctl.REPO),
            playbook=str(labctl.REPO / "playbooks" / "migrate.yml"), inventory=str(inventory),
            extravars={"modelswap_serve": MODEL, "modelswap_results_dir": str(results)},
            verbosity=3, quiet=True, timeout=RUN_LIMIT_S,
            envvars={"ANSIBLE_CONFIG": str(labctl.REPO / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1",
                     "ANSIBLE_HOST_KEY_CHECKING": "True"})
        events = list(run.events)
        stdout = run.stdout.read()
    finally:
        stop.set()
        for p in pollers:
            p.stop()
        watcher.join(60)
        lab.hub.clear_faults()
    state = {"rc": run.rc, "stdout": stdout, "events": events, "token": token, "key": key,
             "results": results, "private": private, "pollers": pollers, "during": during,
             "hub": lab.hub.requests(), "started": started}
    state["journals"] = {h: ssh(lab, h, "journalctl --no-pager --since @%d" % int(started[h])).stdout
                         for h in (TARGET, LOADGEN)}
    state["files"] = {h: grep_host(lab, h, [token, key]) for h in (TARGET, LOADGEN)}
    yield state
    vllm_lab.reset_host(lab, TARGET)
    ssh(lab, LOADGEN, f"rm -rf {LOCUST_DIR}")
    shutil.rmtree(vault, ignore_errors=True)


def test_the_migration_deployed_downloaded_with_the_token_and_benchmarked_with_a_remote_worker(lab, scan):
    assert scan["rc"] == 0, scan["stdout"][-6000:]
    assert "EXEC" in scan["stdout"] and "<%s> ESTABLISH SSH CONNECTION" % lab.address(TARGET) in scan["stdout"]
    [record_file] = list((scan["results"] / "runs").glob(f"*/{TARGET}.json"))
    record = json.loads(record_file.read_text())
    assert record["outcome"] == "migrated" and record["fetch"]["verified"] is True
    # the Hub saw the marker token on the file downloads (so the token really travelled); over Xet
    # on the read-token and reconstruction requests, while the xorb ranges go by signed URLs that
    # carry no token (as huggingface.co's CAS)
    gets = [r for r in scan["hub"] if r["method"] == "GET" and r.get("file")]
    signed = [r for r in gets if r.get("endpoint") == "xet-xorb"]
    assert [r for r in gets if r.get("endpoint") == "resolve"] or signed, gets[:3]
    assert all(r.get("user") == "marker" for r in gets if r not in signed), gets[:3]
    assert all(r.get("user") is None and r["status"] in (200, 206) for r in signed), signed[:3]
    xet_tokens = [r for r in scan["hub"] if r.get("endpoint") == "xet-read-token"]
    assert not signed or (xet_tokens and all(r.get("user") == "marker" for r in xet_tokens)), xet_tokens[:3]
    assert any(f.startswith("throttle#") for r in scan["hub"] for f in r.get("faults") or [])
    # the benchmark's load came from the worker on gpu2
    [report] = list((scan["results"] / "benchmark" / TARGET).glob("*/*/*/report.json"))
    doc = json.loads(report.read_text())
    assert doc["run"]["load"]["mode"] == "master"
    assert list((report.parent / "raw" / LOADGEN).glob("worker-*.jsonl"))
    assert all(s["requests"]["completed"] > 0 for s in doc["steps"])
    # the worker's copies, its API key file among them, are gone
    assert ssh(lab, LOADGEN, "ls -A /var/tmp/modelswap-benchmark 2>/dev/null").stdout.strip() == ""
    # the service serves with the marker key, and refuses a request without it
    assert served(lab, TARGET, scan["key"]) == (200, [MODEL])
    assert served(lab, TARGET, None)[0] == 401


def test_no_marker_in_the_controllers_output_events_or_runner_artifacts(scan):
    text = scan["stdout"] + json.dumps(scan["events"])
    for marker in (scan["token"], scan["key"]):
        assert marker not in text
    artifacts = list(scan["private"].rglob("*"))
    assert any(p.name == "stdout" for p in artifacts) and any("job_events" in str(p) for p in artifacts)
    assert controller_hits(scan["private"], [scan["token"], scan["key"]]) == []


def test_no_marker_in_run_records_or_benchmark_reports(scan):
    files = [p for p in scan["results"].rglob("*") if p.is_file()]
    assert any(p.match("runs/*/summary.md") for p in files) and any(p.name == "report.json" for p in files)
    assert any("/raw/" in str(p) for p in files)
    assert controller_hits(scan["results"], [scan["token"], scan["key"]]) == []


def test_no_marker_in_the_hosts_journals(scan):
    for host, journal in scan["journals"].items():
        assert journal.count("\n") > 10, host
        assert scan["token"] not in journal and scan["key"] not in journal, host
    assert "vllm" in scan["journals"][TARGET]


def test_no_marker_in_any_process_list_during_the_run(scan):
    for poller in scan["pollers"]:
        assert poller.snapshots >= 60, (poller.host, poller.snapshots)       # the whole run, every second
        assert "AnsiballZ" in poller.text
        assert scan["token"] not in poller.text and scan["key"] not in poller.text, poller.host
    target = next(p for p in scan["pollers"] if p.host == TARGET)
    loadgen = next(p for p in scan["pollers"] if p.host == LOADGEN)
    assert "AnsiballZ_hf_snapshot" in target.text and "vllm" in target.text
    assert "--worker" in loadgen.text
    # when a snapshot caught the worker's launch (Ansible's `environment:` is on that command line),
    # it named the key's file, never the key
    assert "MODELSWAP_BENCH_API_KEY=" not in loadgen.text
    for line in loadgen.text.splitlines():
        if "MODELSWAP_BENCH_API_KEY_FILE=" in line:
            assert "MODELSWAP_BENCH_API_KEY_FILE=/var/tmp/modelswap-benchmark/" in line, line


def test_only_the_0600_key_files_hold_a_marker_on_the_hosts(scan):
    print("\nfiles on the hosts that hold a marker (mode owner path):")
    for host, hits in scan["files"].items():
        for mode, owner, path in hits:
            print(f"  {host}: {mode} {owner} {path}")
    assert scan["files"][LOADGEN] == []
    hits = scan["files"][TARGET]
    assert {p for _, _, p in hits} <= KEY_HOMES, hits
    assert "/etc/modelswap/vllm.secret.env" in {p for _, _, p in hits}
    assert all(mode == "600" and owner == "root" for mode, owner, _ in hits), hits


def test_the_token_in_the_async_download_job_is_readable_by_root_only(scan):
    """Where Ansible keeps hf_snapshot's arguments (the token) while the async download runs."""
    assert scan["during"], "the download was never seen holding the token in a file"
    print("\nfiles that held the Hub token while hf_snapshot ran (mode owner group path):")
    for look in scan["during"]:
        print("  " + look.strip().replace("\n", "\n  "))
    for look in scan["during"]:
        entries = [line.split(" ", 4) for line in look.strip().splitlines()]
        files = [e for e in entries if e[0] == "file"]
        assert files
        for _, mode, owner, group, path in files:
            assert owner == "root", (mode, owner, path)
            # closed to others: the file itself, or a root folder above it that only root may enter
            above = [e for e in entries if e[0] == "dir" and path.startswith(e[4] + "/")]
            assert int(mode, 8) & 0o077 == 0 or any(
                int(m, 8) & 0o077 == 0 and o == "root" for _, m, o, _, _ in above), (path, mode, above)
