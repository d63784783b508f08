"""The model_fetch role (playbooks/fetch.yml) on lab hosts over SSH, against the lab's Hub.

Each test works in its own folder under /var/lib/modelswap-test on the host (cache, progress files,
deployment record) and removes it afterwards; huggingface_hub comes from a small virtualenv of the
test's own (/opt/modelswap-test/hf, installed offline from the lab's wheelhouse), so the tests
neither need nor touch the vLLM virtualenv or any service. The Hub's request log is shared with
other tests: these look only at requests from the host under test, after a mark.
"""
from __future__ import annotations

import hashlib
import json
import secrets
import shlex
from pathlib import Path

import pytest

pytestmark = pytest.mark.lab

REPO = Path(__file__).resolve().parents[2]
PLAYBOOK = REPO / "playbooks" / "fetch.yml"
VENV = "/opt/modelswap-test/hf"
HOST = "gpu2"
START = "Start the download of {}"
PROGRESS = "Show the progress of each host at every interval"
COLLECT = "Collect the result"


def host_wheelhouse(lab) -> str:
    """The wheelhouse folder as the hosts see it (inventory variable modelswap_lab_wheelhouse)."""
    return lab.wheelhouse


def ensure_hf_python(lab, host: str) -> str:
    wheelhouse = host_wheelhouse(lab)
    lab.ssh(host, "test -x {v}/bin/python && {v}/bin/python -c 'import huggingface_hub' 2>/dev/null || "
                  "{{ rm -rf {v} && python3 -m venv {v} && {v}/bin/pip install -q --no-index --find-links {w} "
                  "huggingface_hub; }}".format(v=VENV, w=shlex.quote(wheelhouse)), timeout=600)
    return VENV + "/bin/python"


@pytest.fixture(scope="module")
def hf_python(lab):
    for host in lab.hosts:
        ensure_hf_python(lab, host)
    return VENV + "/bin/python"


@pytest.fixture
def workdir(lab):
    """A fresh folder on every lab host for one test; removed afterwards."""
    name = "/var/lib/modelswap-test/fetch-%s" % secrets.token_hex(4)
    yield name
    for host in lab.hosts:
        lab.ssh(host, "rm -rf %s" % shlex.quote(name), check=False)


def extra_vars(lab, workdir, hf_python, models, serve, **more):
    out = {
        "modelswap_models": models,
        "modelswap_serve": serve,
        "model_fetch_endpoint": lab.hub_url,
        "model_fetch_python": hf_python,
        "model_fetch_use_xet": False,
        "model_fetch_cache_dir": workdir + "/hub",
        "model_fetch_progress_dir": workdir + "/progress",
        "model_fetch_record": workdir + "/deployment.json",
        "model_fetch_poll_interval": 1,
    }
    out.update(more)
    return out


def lab_catalog(lab) -> dict:
    return {name: {"repo_id": m["repo_id"], "revision": m["commit"]} for name, m in lab.models.items()}


def mark(lab) -> int:
    entries = lab.hub.requests()
    return max((e["id"] for e in entries), default=0)


def host_requests(lab, host, since, repo=None):
    addr = lab.address(host)
    out = [e for e in lab.hub.requests(since=since) if e.get("client") == addr]
    if repo:
        out = [e for e in out if repo in e["path"]]
    return out


def labels(run, task, host):
    return [e["event_data"]["res"].get("_ansible_item_label") for e in run.events
            if e.get("event") == "runner_item_on_ok" and e["event_data"].get("task") == task
            and e["event_data"].get("host") == host]


def result(run, task, host):
    found = [r for r in run.task_results(task, host) if r["_event"] != "runner_on_skipped"]
    assert found, "no result for %r on %s (rc=%s):\n%s" % (task, host, run.rc, run.stdout[-4000:])
    return found[-1]


def test_check_mode_downloads_nothing(lab, hf_python, workdir):
    since = mark(lab)
    run = lab.playbook(PLAYBOOK, extra_vars(lab, workdir, hf_python, lab_catalog(lab), "tiny-a"),
                       check=True, limit=HOST)
    assert run.rc == 0, run.stdout[-4000:]
    dry = result(run, START.format("tiny-a"), HOST)
    assert dry["changed"] is True and dry["commit"] == lab.models["tiny-a"]["commit"]
    assert dry["would_fetch"]["files"] and dry["would_fetch"]["bytes"] > 0
    seen = host_requests(lab, HOST, since, "lab/tiny-a")
    assert [e for e in seen if e["method"] == "GET" and "/resolve/" in e["path"]] == []   # no content
    assert len([e for e in seen if e["method"] == "HEAD"]) <= 1                           # one probe
    assert lab.ssh(HOST, "test -e %s/hub || echo absent" % workdir).stdout.strip() == "absent"
    assert lab.ssh(HOST, "test -e %s/deployment.json || echo absent" % workdir).stdout.strip() == "absent"
    assert "would fetch" in run.stdout


def test_fetch_records_then_rerun_is_unchanged_without_requests(lab, hf_python, workdir):
    ev = extra_vars(lab, workdir, hf_python, lab_catalog(lab), "tiny-a")
    commit = lab.models["tiny-a"]["commit"]
    run = lab.playbook(PLAYBOOK, ev, limit=HOST)
    assert run.rc == 0, run.stdout[-4000:]
    done = result(run, COLLECT, HOST)
    assert done["changed"] is True and done["commit"] == commit
    assert done["verification"]["ok"] and done["verification"]["mode"] == "full"
    assert done["files_downloaded"] == done["files"] > 0
    snapshot = "%s/hub/models--lab--tiny-a/snapshots/%s" % (workdir, commit)
    assert done["snapshot_path"] == snapshot
    assert run.changed(HOST) == 1
    assert any(label and "done" in label for label in labels(run, PROGRESS, HOST))
    # the files are the Hub's: compare one with the lab Hub's own store
    config = lab.ssh(HOST, "cat %s/config.json" % snapshot).stdout
    assert json.loads(config)
    record = json.loads(lab.ssh(HOST, "cat %s/deployment.json" % workdir).stdout)
    fetched = record["fetched"]["tiny-a"]
    assert fetched["commit"] == commit and fetched["path"] == snapshot and fetched["verified"] == "full"
    manifest = json.loads(lab.ssh(HOST, "cat %s" % shlex.quote(fetched["manifest"])).stdout)
    sha = manifest["files"]["model.safetensors"]["digest"]
    on_host = lab.ssh(HOST, "sha256sum %s/model.safetensors" % snapshot).stdout.split()[0]
    assert on_host == sha == manifest["listing"]["model.safetensors"]["lfs_sha256"]

    since = mark(lab)
    again = lab.playbook(PLAYBOOK, ev, limit=HOST)
    assert again.rc == 0, again.stdout[-4000:]
    assert again.changed(HOST) == 0
    assert result(again, COLLECT, HOST)["changed"] is False
    assert host_requests(lab, HOST, since) == []
    assert lab.ssh(HOST, "find %s -name '*.incomplete' | wc -l" % workdir).stdout.strip() == "0"


def test_progress_lines_while_a_download_runs(lab, hf_python, workdir):
    repo = "modelswap-test/fetch-progress"
    data = hashlib.sha256(b"progress").digest() * (6 * 1024 * 1024 // 32)
    commit = lab.hub.publish(repo, {"config.json": b'{"model_type": "llama"}\n', "model.safetensors": data})
    fault = lab.hub.fault("throttle", rate=1024 * 1024, method="GET", repo=repo, file="model.safetensors")
    try:
        ev = extra_vars(lab, workdir, hf_python, {"progress-test": {"repo_id": repo, "revision": commit}},
                        "progress-test")
        run = lab.playbook(PLAYBOOK, ev, limit=HOST)
    finally:
        if any(f["id"] == fault["id"] for f in lab.hub.faults()):
            lab.hub.remove_fault(fault["id"])
    assert run.rc == 0, run.stdout[-4000:]
    lines = labels(run, PROGRESS, HOST)
    moving = [x for x in lines if x and " downloading " in x and "ETA" in x]
    assert len(moving) >= 2, lines
    percents = [float(x.split(" downloading ")[1].split("%")[0]) for x in moving]
    assert any(0 < p < 100 for p in percents) and percents == sorted(percents), lines
    assert "/s" in moving[-1] and "MiB" in moving[-1]
    assert lines[-1] and " done " in lines[-1]
    assert result(run, COLLECT, HOST)["bytes_downloaded"] == len(data) + len(b'{"model_type": "llama"}\n')


def test_concurrency_limit_downloads_one_host_after_the_other(lab, hf_python, workdir):
    ev = extra_vars(lab, workdir, hf_python, lab_catalog(lab), "tiny-b", model_fetch_concurrency=1)
    run = lab.playbook(PLAYBOOK, ev)
    assert run.rc == 0, run.stdout[-4000:]
    spans = {}
    for host in lab.hosts:
        start = [e for e in run.events if e.get("event") == "runner_on_ok"
                 and e["event_data"].get("task") == START.format("tiny-b") and e["event_data"].get("host") == host]
        end = [e for e in run.events if e.get("event") == "runner_on_ok"
               and e["event_data"].get("task") == COLLECT and e["event_data"].get("host") == host]
        assert start and end, run.stdout[-4000:]
        spans[host] = (start[0]["event_data"]["start"], end[0]["event_data"]["end"])
        assert result(run, COLLECT, host)["verification"]["ok"]
    first, second = sorted(spans.values())
    assert first[1] <= second[0], spans     # the second group started after the first had finished


def test_a_bad_catalog_entry_fails_before_any_download(lab, hf_python, workdir):
    since = mark(lab)
    run = lab.playbook(PLAYBOOK, extra_vars(lab, workdir, hf_python, lab_catalog(lab), "no-such-model"),
                       limit=HOST)
    assert run.rc != 0
    assert "unknown model" in run.stdout and "no-such-model" in run.stdout
    assert host_requests(lab, HOST, since) == []
    catalog = {"broken": {"repo_id": "lab/does-not-exist", "revision": "main"}}
    run = lab.playbook(PLAYBOOK, extra_vars(lab, workdir, hf_python, catalog, "broken"), limit=HOST)
    assert run.rc != 0
    failed = result(run, COLLECT, HOST)
    assert failed["cause"] == "repo_not_found" and "lab/does-not-exist" in failed["msg"]
