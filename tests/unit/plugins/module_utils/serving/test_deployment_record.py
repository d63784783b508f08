"""The deployment record (plugins/module_utils/serving/deployment_record.py): merging (current ->
previous, foreign keys kept), compatibility with its readers (served_model, model_fetch's
`fetched`), the saved configurations' plan. The deployment_record module is tested in
tests/unit/plugins/modules/ (test_deployment_record.py; a failed write in test_deployment_record_crash.py)."""
from __future__ import annotations

import os

import pytest

from ansible_collections.modelswap.vllm.plugins.module_utils.serving import deployment_record
from ansible_collections.modelswap.vllm.plugins.module_utils.store import hf_manifest
from ansible_collections.modelswap.vllm.plugins.module_utils.serving import served_model

pytestmark = pytest.mark.unit

A = {"model": "tiny-a", "repo_id": "lab/tiny-a", "commit": "a" * 40,
     "path": "/var/lib/modelswap/hf/hub/models--lab--tiny-a/snapshots/" + "a" * 40,
     "served_model_name": "tiny-a", "unit": "vllm.service", "unit_checksum": "1" * 64,
     "env_checksum": "2" * 64, "vllm_version": "0.32.0+cpu",
     "args": ["/opt/v/bin/vllm", "serve", "/p", "--port", "8100"], "host": "0.0.0.0", "port": 8100}
B = dict(A, model="tiny-b", repo_id="lab/tiny-b", commit="b" * 40, served_model_name="tiny-b",
         path="/var/lib/modelswap/hf/hub/models--lab--tiny-b/snapshots/" + "b" * 40, unit_checksum="3" * 64)
FETCHED = {"tiny-a": {"repo_id": "lab/tiny-a", "commit": "a" * 40, "path": A["path"]}}


def test_first_deployment_has_no_previous_and_keeps_foreign_keys():
    rec, changed = deployment_record.record_deployment({"fetched": FETCHED}, A, "2026-12-02T10:00:00Z")
    assert changed
    assert rec["fetched"] == FETCHED
    assert rec["previous"] is None and rec["when"] == "2026-12-02T10:00:00Z" and rec["schema"] == 1
    assert {k: rec[k] for k in deployment_record.DEPLOYMENT_KEYS} == A


def test_same_deployment_changes_nothing_not_even_when():
    rec, _unused = deployment_record.record_deployment(None, A, "t1")
    again, changed = deployment_record.record_deployment(rec, dict(A), "t2")
    assert not changed and again == rec and again["when"] == "t1"


def test_new_deployment_moves_the_current_to_previous_without_nesting():
    r1, _unused = deployment_record.record_deployment({"fetched": FETCHED}, A, "t1")
    r2, changed = deployment_record.record_deployment(r1, B, "t2")
    assert changed and r2["model"] == "tiny-b" and r2["when"] == "t2"
    assert r2["previous"] == dict(A, when="t1")
    r3, _unused = deployment_record.record_deployment(r2, A, "t3")           # a rollback is the previous deployed again
    assert r3["model"] == "tiny-a" and r3["previous"] == dict(B, when="t2")
    assert "previous" not in r3["previous"]
    assert r3["fetched"] == FETCHED


def test_any_deployment_key_counts_as_a_change():
    r1, _unused = deployment_record.record_deployment(None, A, "t1")
    r2, changed = deployment_record.record_deployment(r1, dict(A, unit_checksum="9" * 64), "t2")
    assert changed and r2["previous"]["unit_checksum"] == "1" * 64


def test_an_old_record_without_schema_is_upgraded_in_place():
    old = dict(A, when="t0", previous=None)
    rec, changed = deployment_record.record_deployment(old, A, "t1")
    assert changed and rec["schema"] == 1 and rec["when"] == "t0" and rec["previous"] is None


@pytest.mark.parametrize("deployment, message", [
    ({"model": "m"}, "lacks path, served_model_name, unit"),
    (dict(A, colour="red"), "unknown deployment keys colour"),
    (dict(A, args="vllm serve"), "argv as a list"),
    (dict(A, port="http"), "port must be an integer"),
    ("tiny-a", "must be a mapping"),
])
def test_bad_deployments_are_refused(deployment, message):
    with pytest.raises(deployment_record.RecordError, match=message):
        deployment_record.record_deployment(None, deployment, "t")


def test_written_record_is_what_the_other_readers_expect(tmp_path):
    path = str(tmp_path / "deployment.json")
    rec, _unused = deployment_record.record_deployment(None, A, "t1")
    deployment_record.write(path, rec)
    # issue 3's reader (the purge never removes the served model)
    assert served_model.read_deployment_record(path) == {
        "model": "tiny-a", "repo_id": "lab/tiny-a", "commit": "a" * 40, "path": A["path"]}
    # model_fetch notes fetched models under the same lock; both keys survive each other's writes
    hf_manifest.update_record(path, "tiny-b", {"repo_id": "lab/tiny-b", "commit": "b" * 40})
    assert deployment_record.read(path)["model"] == "tiny-a"
    rec2, _unused = deployment_record.record_deployment(deployment_record.read(path), B, "t2")
    deployment_record.write(path, rec2)
    assert deployment_record.read(path)["fetched"]["tiny-b"]["commit"] == "b" * 40
    assert oct(os.stat(path).st_mode & 0o777) == "0o644"


@pytest.mark.parametrize("text, message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "not a JSON object"),
    ('{"previous": 3}', "'previous' that is not a mapping"),
])
def test_unusable_records_are_reported(tmp_path, text, message):
    path = tmp_path / "deployment.json"
    path.write_text(text)
    with pytest.raises(deployment_record.RecordError, match=message):
        deployment_record.read(str(path))


# --- saved configurations (active = last verified, previous = the one it replaced) ------------

FILES = [{"name": "unit", "path": "/u", "mode": "0644"}, {"name": "env", "path": "/e", "mode": "0600"}]


@pytest.mark.parametrize("sums, replaced, actions", [
    # first deployment: nothing saved yet
    ({("live", "unit"): "u1", ("live", "env"): "e1"}, False, [("save", "unit"), ("save", "env")]),
    # nothing new: active already equals live
    ({("live", "unit"): "u1", ("active", "unit"): "u1", ("live", "env"): "e1", ("active", "env"): "e1"},
     False, []),
    # a new deployment replaced the recorded one: keep its files as previous, then save the new
    ({("live", "unit"): "u2", ("active", "unit"): "u1", ("previous", "unit"): "u0",
      ("live", "env"): "e1", ("active", "env"): "e1", ("previous", "env"): "e1"}, True,
     [("rotate", "unit"), ("save", "unit")]),
    # a swap back and forth: previous already equals active for env, nothing to rotate there
    ({("live", "unit"): "u1", ("active", "unit"): "u2", ("previous", "unit"): "u1",
      ("live", "env"): "e1", ("active", "env"): "e1", ("previous", "env"): "e0"}, True,
     [("rotate", "unit"), ("rotate", "env"), ("save", "unit")]),
    # the record did not change but active is stale (an interrupted run): only save
    ({("live", "unit"): "u2", ("active", "unit"): "u1"}, False, [("save", "unit")]),
    # a live file that does not exist is not saved
    ({("live", "unit"): None, ("active", "unit"): "u1"}, False, []),
])
def test_plan_saved(sums, replaced, actions):
    assert deployment_record.plan_saved(FILES, sums, replaced) == actions
