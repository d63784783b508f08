"""The deployment_record module as Ansible runs it: check mode, recording, rotation, errors, and the
saved configurations (active = last verified, previous = the one it replaced). The record's logic is
tested in tests/unit/plugins/module_utils/serving/test_deployment_record.py (A, B and FETCHED come
from there); a failed write, in test_deployment_record_crash.py beside this file."""
from __future__ import annotations

import json

import pytest

from ansible_collections.modelswap.vllm.plugins.module_utils.serving import deployment_record
from tests.support.modules import run_module
from tests.unit.plugins.module_utils.serving.test_deployment_record import A, B, FETCHED

pytestmark = pytest.mark.unit


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
