"""A remote Locust worker's API key (issue 14, item 6), through playbooks/benchmark.yml against the
simulator on loopback, the worker on a load generator with a local connection:
- the key travels in a 0600 file of the worker's user, never in its environment: a -vvv run's
  output (which shows every remote command line, `environment:` included) never holds it;
- the file and the worker's copies are gone after the run, and also after a run that failed.
"""
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.support.modules import REPO
from tests.unit.roles.test_benchmark import KEY, inventory, runs, settings, sim  # noqa: F401 (fixtures)

pytestmark = pytest.mark.unit


def playbook(inventory, extra, *, verbosity=0):  # noqa: F811
    argv = [str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(inventory),
            "playbooks/benchmark.yml", "-e", "benchmark_hosts=sim1", "-e", json.dumps(extra)]
    if verbosity:
        argv.append("-" + "v" * verbosity)
    env = dict(os.environ, ANSIBLE_CONFIG=str(REPO / "ansible.cfg"), ANSIBLE_NOCOLOR="1",
               PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def worker_settings(sim, tmp_path, **kw):  # noqa: F811
    return settings(sim, tmp_path / "results", benchmark_load_generators=["sim1"],
                    benchmark_master_address="127.0.0.1", benchmark_master_port=16557 + os.getpid() % 1000,
                    benchmark_worker_locust_command=[str(Path(sys.executable).parent / "locust")],
                    benchmark_worker_dir=str(tmp_path / "workers"), **kw)


def watch_key_files(folder: Path, stop: threading.Event, seen: dict):
    """Every api_key file under the workers' folder while the run lasts: its mode and owner."""
    deadline = time.monotonic() + 300
    while not stop.is_set() and time.monotonic() < deadline:
        for path in folder.glob("*/api_key"):
            try:
                st = path.stat()
                seen[str(path)] = (st.st_mode & 0o777, st.st_uid, (path.parent.stat().st_mode & 0o777))
            except FileNotFoundError:
                pass
        time.sleep(0.2)


def worker_pids(folder: Path) -> list[int]:
    """Locust workers this test started (their command line names its own workers' folder)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                argv = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"--worker" in argv and any(str(folder).encode() in a for a in argv):
                pids.append(int(proc.name))
    return pids


def test_the_worker_gets_the_key_in_a_0600_file_and_no_log_shows_it(sim, inventory, tmp_path):  # noqa: F811
    workers = tmp_path / "workers"
    stop, seen = threading.Event(), {}
    watcher = threading.Thread(target=watch_key_files, args=(workers, stop, seen), daemon=True)
    watcher.start()
    try:
        proc = playbook(inventory, worker_settings(sim, tmp_path), verbosity=3)
    finally:
        stop.set()
        watcher.join(10)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert KEY not in proc.stdout + proc.stderr
    assert "EXEC" in proc.stdout and "MODELSWAP_BENCH_API_KEY_FILE=" in proc.stdout   # -vvv shows command lines
    # the key's home while the worker ran: 0600, the worker's user, in a 0700 folder
    assert seen, "no api_key file was seen on the worker"
    assert set(seen.values()) == {(0o600, os.getuid(), 0o700)}
    # ... and gone after the run, with the worker's other copies
    assert not any(workers.iterdir())
    [report] = runs(tmp_path / "results")
    assert list((report.parent / "raw" / "sim1").glob("worker-*.jsonl"))
    for path in report.parent.rglob("*"):
        if path.is_file():
            assert KEY.encode() not in path.read_bytes(), path


def test_a_failed_run_still_removes_the_workers_key_file(sim, inventory, tmp_path):  # noqa: F811
    workers = tmp_path / "workers"
    try:
        # the master cannot start: the ladder fails after the worker was started
        proc = playbook(inventory, worker_settings(sim, tmp_path, benchmark_locust_command=["/bin/false"]))
        assert proc.returncode != 0
        assert "Locust did not start the ladder" in proc.stdout, proc.stdout[-4000:]
        assert "Remove the workers' copies and their API key file" in proc.stdout
        assert workers.is_dir() and not any(workers.iterdir()), list(workers.rglob("*"))
        assert KEY not in proc.stdout
    finally:
        # the worker waits for a master that never came: end it (it would stop at its async bound)
        for pid in worker_pids(workers):
            os.kill(pid, signal.SIGTERM)
