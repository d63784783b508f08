"""The deployment record: merging (current -> previous, foreign keys kept), compatibility with its
readers (served_model, model_fetch's `fetched`), and the deployment_record module."""
from __future__ import annotations

import json
import os

import pytest

from ansible_collections.modelswap.vllm.plugins.module_utils.serving import deployment_record
from ansible_collections.modelswap.vllm.plugins.module_utils.store import hf_manifest
from ansible_collections.modelswap.vllm.plugins.module_utils.serving import served_model
from tests.support.modules import run_module

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


# --- the module --------------------------------------------------------------------------------

def test_module_check_mode_writes_nothing_and_shows_the_diff(tmp_path):
    path = tmp_path / "deployment.json"
    path.write_text(json.dumps({"fetched": FETCHED}))
    before = path.read_bytes()
    res = run_module("deployment_record", {"path": str(path), "deployment": A}, check_mode=True, diff=True)
    assert res["changed"] is True and not res.get("failed")
    assert path.read_bytes() == before
    assert not (tmp_path / "deployment.json.lock").exists()
    assert '"model": "tiny-a"' in res["diff"]["after"] and '"model"' not in res["diff"]["before"]
    assert res["deployment"]["model"] == "tiny-a"


def test_module_records_then_is_idempotent_then_rotates(tmp_path):
    path = tmp_path / "state" / "deployment.json"
    path.parent.mkdir()
    first = run_module("deployment_record", {"path": str(path), "deployment": A})
    assert first["changed"] is True and first["previous"] is None
    stat1 = path.stat()
    again = run_module("deployment_record", {"path": str(path), "deployment": A})
    assert again["changed"] is False
    assert path.stat().st_mtime_ns == stat1.st_mtime_ns
    swapped = run_module("deployment_record", {"path": str(path), "deployment": B}, diff=True)
    assert swapped["changed"] is True
    assert swapped["deployment"]["model"] == "tiny-b" and swapped["previous"]["model"] == "tiny-a"
    assert json.loads(path.read_text())["previous"]["served_model_name"] == "tiny-a"
    read = run_module("deployment_record", {"path": str(path), "state": "read"})
    assert read["changed"] is False and read["record"] == json.loads(path.read_text())


def test_module_errors_name_the_cause(tmp_path):
    path = tmp_path / "deployment.json"
    path.write_text("{oops")
    res = run_module("deployment_record", {"path": str(path), "deployment": A})
    assert res["failed"] and "not valid JSON" in res["msg"] and str(path) in res["msg"]
    res = run_module("deployment_record", {"path": str(tmp_path / "x.json"), "deployment": {"model": "m"}})
    assert res["failed"] and "lacks path" in res["msg"]
    res = run_module("deployment_record", {"path": str(tmp_path / "x.json")})
    assert res["failed"] and "deployment" in res["msg"]


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


def test_module_keeps_active_and_previous_configurations(tmp_path):
    live = {n: tmp_path / ("live." + n) for n in ("unit", "env", "secret")}
    saved = tmp_path / "saved"
    files = [{"name": n, "path": str(p), "mode": "0644" if n == "unit" else "0600"} for n, p in live.items()]

    def args(dep):
        return {"path": str(tmp_path / "deployment.json"), "deployment": dep,
                "unit_file": str(live["unit"]), "env_file": str(live["env"]),
                "saved_dir": str(saved), "saved_files": files}
    A2 = {k: v for k, v in A.items() if k not in ("unit_checksum", "env_checksum")}
    B2 = {k: v for k, v in B.items() if k not in ("unit_checksum", "env_checksum")}
    for name, p in live.items():
        p.write_text("A " + name)
    first = run_module("deployment_record", args(A2))
    assert first["changed"] and first["saved"] == {"rotated": [], "saved": ["unit", "env", "secret"]}
    assert first["deployment"]["unit_checksum"] == deployment_record.sha256_file(str(live["unit"]))
    assert (saved / "active" / "secret").read_text() == "A secret"
    assert oct((saved / "active" / "secret").stat().st_mode & 0o777) == "0o600"
    assert oct((saved / "active" / "unit").stat().st_mode & 0o777) == "0o644"
    assert run_module("deployment_record", args(A2))["changed"] is False
    for name, p in live.items():
        p.write_text("B " + name)
    check = run_module("deployment_record", args(B2), check_mode=True)
    assert check["changed"] and check["saved"]["rotated"] == ["unit", "env", "secret"]
    assert (saved / "active" / "unit").read_text() == "A unit" and not (saved / "previous").exists()
    swap = run_module("deployment_record", args(B2))
    assert swap["saved"] == {"rotated": ["unit", "env", "secret"], "saved": ["unit", "env", "secret"]}
    assert (saved / "previous" / "unit").read_text() == "A unit"
    assert (saved / "active" / "unit").read_text() == "B unit"
    assert swap["previous"]["unit_checksum"] == first["deployment"]["unit_checksum"]
    # nothing of the files' content comes back
    assert "A secret" not in json.dumps(swap) and "B secret" not in json.dumps(swap)
    bad = run_module("deployment_record", {"path": str(tmp_path / "d.json"), "deployment": A,
                                           "saved_files": files})
    assert bad["failed"] and "saved_files needs saved_dir" in bad["msg"]
