"""pytest fixtures for the local Hub: `local_hub` (a real server process on loopback), `hf_env` and
`hf_xet_env`.

Registered in tests/conftest.py through `pytest_plugins`. Tests using them are marked `hub`.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.lab.hub.client import HubClient

REPO_ROOT = Path(__file__).resolve().parents[3]
START_TIMEOUT_S = 20
TREE_PAGE_SIZE = 50  # small pages (the Hub's are 1000) so that paging is exercised by ordinary tests


class LocalHub(HubClient):
    """A Hub server process of its own (127.0.0.1, free port) over a fresh store."""

    def __init__(self, root: Path, log_dir: Path, extra_args: tuple[str, ...] = ()):
        self.log_path = log_dir / "hub-server.log"
        out = open(self.log_path, "wb")
        env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), PYTHONUNBUFFERED="1")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.lab.hub.server", "--root", str(root), "--host", "127.0.0.1",
             "--port", "0", "--tree-page-size", str(TREE_PAGE_SIZE), *extra_args],
            cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        out.close()
        deadline = time.monotonic() + START_TIMEOUT_S
        url = None
        while url is None:
            text = self.log_path.read_text(errors="replace")
            for line in text.splitlines():
                if line.startswith("READY "):
                    url = line.split()[1]
            if url is None:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"the local Hub did not start: {text[-2000:]}")
                time.sleep(0.05)
        super().__init__(url, root)

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self, timeout: float = 10.0) -> int | None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        return self.process.returncode


@pytest.fixture(scope="module")
def _local_hub_server(tmp_path_factory):
    base = tmp_path_factory.mktemp("hub")
    hub = LocalHub(base / "store", base)
    try:
        yield hub
    finally:
        hub.stop()


@pytest.fixture
def local_hub(_local_hub_server) -> LocalHub:
    """The module's Hub, with no faults and an empty request log at the start of each test."""
    hub = _local_hub_server
    if hub.process.poll() is not None:
        pytest.fail(f"the local Hub exited with {hub.process.returncode}: {hub.log_path.read_text()[-2000:]}")
    hub.clear_faults()
    hub.clear_log()
    return hub


@pytest.fixture
def hf_env(local_hub, tmp_path) -> dict[str, str]:
    """Environment for a huggingface_hub client of `local_hub`: private HF_HOME, no xet, no token,
    no telemetry, no proxy for loopback. Use as `env={**os.environ, **hf_env}`."""
    home = tmp_path / "hf-home"
    home.mkdir()
    no_proxy = ",".join(filter(None, ["127.0.0.1", "localhost", os.environ.get("NO_PROXY")]))
    return {
        "HF_ENDPOINT": local_hub.url,
        "HF_HOME": str(home),
        "HF_HUB_CACHE": str(home / "hub"),
        "HF_HUB_DISABLE_XET": "1",
        "HF_HUB_ETAG_TIMEOUT": "10",
        "HF_HUB_DOWNLOAD_TIMEOUT": "10",
        "HF_HUB_OFFLINE": "0",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_UPDATE_CHECK": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "DO_NOT_TRACK": "1",
        "HF_TOKEN": "",
        "HUGGING_FACE_HUB_TOKEN": "",
        "NO_PROXY": no_proxy,
        "no_proxy": no_proxy,
    }


@pytest.fixture
def hf_xet_env(hf_env, tmp_path) -> dict[str, str]:
    """`hf_env` with Xet on (hf_xet downloads from the Hub's CAS): hf_xet's cache in the test's folder,
    retries 50 ms apart (HF_XET_CLIENT_RETRY_MAX_ATTEMPTS: 3 after the first try), no telemetry.
    hf_xet reads these once per process: give them to a client process, not to this one."""
    env = {k: v for k, v in hf_env.items() if k != "HF_HUB_DISABLE_XET"}
    env.update(HF_XET_CACHE=str(tmp_path / "xet-cache"), HF_XET_CLIENT_RETRY_BASE_DELAY="50ms",
               HF_XET_CLIENT_RETRY_MAX_ATTEMPTS="3", HF_XET_TELEMETRY_ENABLED="0")
    return env
