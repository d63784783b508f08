"""Downloads over Xet on lab hosts: the real huggingface_hub + hf_xet on a host, against the lab
Hub's CAS (tests/lab/hub/xet.py), as from huggingface.co.

Each test works in its own cache under /var/lib/modelswap-test on the host and removes it
afterwards; modules run as Ansible runs them (hf_snapshot, model_purge) with the small
huggingface_hub virtualenv of test_model_fetch_lab. The Hub's request log is shared: these look only
at requests from the host under test, after a mark.
"""
from __future__ import annotations

import hashlib
import json
import secrets
import shlex

import pytest

from tests.integration.test_model_fetch_lab import ensure_hf_python, host_requests, mark
from tests.lab.fixtures import write_playbook

pytestmark = pytest.mark.lab

HOST = "gpu1"


@pytest.fixture(scope="module")
def hf_python(lab):
    return ensure_hf_python(lab, HOST)


@pytest.fixture
def cache(lab):
    folder = "/var/lib/modelswap-test/xet-%s" % secrets.token_hex(4)
    yield folder
    lab.ssh(HOST, "rm -rf %s" % shlex.quote(folder), check=False)


def publish(lab, payload: bytes, tag: str) -> tuple:
    """A fresh repository with one LFS payload and a small config: (repo, commit, sha256)."""
    repo = "modelswap-test/xet-%s-%s" % (tag, secrets.token_hex(3))
    commit = lab.hub.publish(repo, {"config.json": b'{"model_type": "llama", "tag": "%s"}\n' % tag.encode(),
                                    "model.safetensors": payload})
    return repo, commit, hashlib.sha256(payload).hexdigest()


def payload_of(seed: str, size: int = 1536 * 1024) -> bytes:
    return hashlib.sha256(seed.encode()).digest() * (size // 32)


def run_tasks(lab, tmp_path, hf_python, tasks: list):
    book = write_playbook(tmp_path, [{"name": "xet", "hosts": HOST, "gather_facts": False,
                                      "vars": {"ansible_python_interpreter": hf_python},
                                      "tasks": tasks}])
    return lab.playbook(book)


def snapshot_task(lab, cache, repo, commit, name="fetch", **more) -> dict:
    args = {"repo_id": repo, "revision": commit, "cache_dir": cache + "/hub", "endpoint": lab.hub_url,
            "use_xet": True, "retries": 2, "retry_delay": 1}
    args.update(more)
    return {"name": name, "modelswap.vllm.hf_snapshot": args, "ignore_errors": True}


def only(run, task):
    """The task's result, with "failed" set from the event (an ignored failure's result does not
    carry it)."""
    found = run.task_results(task, HOST)
    assert found, "no result for %r (rc=%s):\n%s" % (task, run.rc, run.stdout[-4000:])
    return dict(found[-1], failed=found[-1]["_event"] == "runner_on_failed")


def store_payload_digests(lab, cache) -> dict:
    """{payload path: sha256} of every payload in the host's shared (Xet) blob store."""
    out = lab.ssh(HOST, "cd %s/hub/blobs 2>/dev/null && find . -mindepth 2 -maxdepth 2 -type f "
                        "-regextype posix-extended -regex './[0-9a-f]{2}/[0-9a-f]{64}' -exec sha256sum {} +"
                  % shlex.quote(cache), check=False).stdout
    return {line.split()[1]: line.split()[0] for line in out.splitlines() if line.strip()}


def test_a_host_downloads_over_xet_into_the_shared_store_and_reruns_without_requests(lab, hf_python, cache, tmp_path):
    repo, commit, sha = publish(lab, payload_of("xet-first"), "first")
    since = mark(lab)
    run = run_tasks(lab, tmp_path, hf_python, [snapshot_task(lab, cache, repo, commit)])
    got = only(run, "fetch")
    assert not got.get("failed"), got.get("msg")
    assert got["verification"]["ok"] and got["verification"]["mode"] == "full"
    seen = host_requests(lab, HOST, since)
    kinds = {e.get("endpoint") for e in seen}
    assert {"xet-read-token", "xet-reconstruction", "xet-xorb"} <= kinds, sorted(filter(None, kinds))
    payload_gets = [e for e in seen if e.get("endpoint") == "resolve" and e["method"] == "GET"
                    and e["path"].endswith("/model.safetensors")]
    assert payload_gets == []                         # the payload came from xorbs, not the resolve route
    assert all(e["range"] for e in seen if e.get("endpoint") == "xet-xorb")     # byte ranges of xorbs
    # huggingface_hub's cache-wide store: the repo blob is a link to the payload named by its xet hash
    layout = lab.ssh(HOST, "cd %s/hub && cat blobs/.huggingface-shared-blobs && readlink models--%s/blobs/%s"
                     % (shlex.quote(cache), repo.replace("/", "--"), sha)).stdout.split()
    assert layout[0] == "1" and layout[1].startswith("../../blobs/")
    assert list(store_payload_digests(lab, cache).values()) == [sha]

    since = mark(lab)
    again = run_tasks(lab, tmp_path, hf_python, [snapshot_task(lab, cache, repo, commit, name="again")])
    assert only(again, "again")["changed"] is False
    assert host_requests(lab, HOST, since) == []


def test_a_wrong_chunk_of_the_right_length_is_caught_and_nothing_corrupt_is_kept(lab, hf_python, cache, tmp_path):
    """hf_xet checks sizes, not content: a chunk with wrong bytes passes it. Our sha256 catches it;
    the corrupt payload it published into the shared store goes, the revision already there stays."""
    good_repo, good_commit, good_sha = publish(lab, payload_of("xet-kept"), "kept")
    repo, commit, sha = publish(lab, payload_of("xet-bad-chunk"), "bad")
    lab.hub.fault("xet_bad_chunk", repo=repo, file="model.safetensors", count=None)
    try:
        run = run_tasks(lab, tmp_path, hf_python, [
            snapshot_task(lab, cache, good_repo, good_commit, name="kept"),
            snapshot_task(lab, cache, repo, commit, name="corrupt"),
            snapshot_task(lab, cache, good_repo, good_commit, name="check kept", offline=True, reverify=True)])
    finally:
        lab.hub.clear_faults()
    assert only(run, "kept")["verification"]["ok"]
    bad = only(run, "corrupt")
    assert bad["failed"] and bad.get("cause") == "corrupt", json.dumps(bad, indent=1)[:3000]
    assert "model.safetensors" in bad["msg"] and "does not match" in bad["msg"], bad["msg"]
    kept = only(run, "check kept")
    assert not kept.get("failed") and kept["verification"]["ok"], kept
    # nothing corrupt in the content store, and no snapshot of the bad revision
    assert set(store_payload_digests(lab, cache).values()) <= {good_sha, sha}
    assert lab.ssh(HOST, "test -e %s/hub/models--%s/snapshots/%s/model.safetensors || echo absent"
                   % (shlex.quote(cache), repo.replace("/", "--"), commit)).stdout.strip() == "absent"

    # once the CAS answers right again, the rerun fetches and verifies it
    rerun = run_tasks(lab, tmp_path, hf_python, [snapshot_task(lab, cache, repo, commit, name="rerun")])
    got = only(rerun, "rerun")
    assert not got.get("failed") and got["verification"]["ok"], got
    assert set(store_payload_digests(lab, cache).values()) == {good_sha, sha}


def test_a_truncated_term_a_5xx_range_and_an_expired_token_are_retried_or_refreshed(lab, hf_python, cache, tmp_path):
    repo, commit, sha = publish(lab, payload_of("xet-faults"), "faults")
    lab.hub.fault("xet_truncated_term", repo=repo, file="model.safetensors", count=1)
    lab.hub.fault("http_error", status=503, endpoint="xet-xorb", repo=repo, count=1)
    lab.hub.fault("xet_token_expired", repo=repo, count=1)
    since = mark(lab)
    try:
        run = run_tasks(lab, tmp_path, hf_python, [snapshot_task(lab, cache, repo, commit)])
        spent = [f for f in lab.hub.faults() if f.get("repo") == repo]
    finally:
        lab.hub.clear_faults()
    got = only(run, "fetch")
    assert not got.get("failed") and got["verification"]["ok"], got
    assert spent == [] or all(f["count"] == 0 for f in spent), spent     # every fault acted
    tokens = [e for e in host_requests(lab, HOST, since) if e.get("endpoint") == "xet-read-token"]
    assert len(tokens) >= 2                          # the expired token was refreshed
    assert list(store_payload_digests(lab, cache).values()) == [sha]


def test_purging_one_of_two_repos_sharing_a_payload_leaves_the_other_verified(lab, hf_python, cache, tmp_path):
    shared = payload_of("xet-shared")
    one, one_commit, sha = publish(lab, shared, "one")
    two, two_commit, _ = publish(lab, shared, "two")
    run = run_tasks(lab, tmp_path, hf_python, [
        snapshot_task(lab, cache, one, one_commit, name="one"),
        snapshot_task(lab, cache, two, two_commit, name="two"),
        {"name": "purge one", "modelswap.vllm.model_purge": {
            "items": [one], "cache_dir": cache + "/hub", "roots": [cache]}, "ignore_errors": True},
        snapshot_task(lab, cache, two, two_commit, name="two after", offline=True, reverify=True),
        {"name": "purge two", "modelswap.vllm.model_purge": {
            "items": [two], "cache_dir": cache + "/hub", "roots": [cache]}, "ignore_errors": True}])
    assert not only(run, "one").get("failed") and not only(run, "two").get("failed")
    purged = only(run, "purge one")
    assert not purged.get("failed"), purged.get("msg")
    after = only(run, "two after")
    assert not after.get("failed") and after["verification"]["ok"], after
    # one payload served both repos; it went with the last link, not before
    assert purged["shared_removed"] == [] and purged["expected_freed_size"] < len(shared)
    last = only(run, "purge two")
    assert not last.get("failed"), last.get("msg")
    assert [p["size"] for p in last["shared_removed"]] == [len(shared)]
    assert last["expected_freed_size"] >= len(shared)
    assert store_payload_digests(lab, cache) == {}
