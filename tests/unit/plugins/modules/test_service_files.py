"""service_files: a service's configuration files in one call (the vllm_service role's render
step, the migration's preview). Run as Ansible runs it, on real files: check mode writes nothing
and shows one diff per file; a secret's content is never returned or diffed; a failing check
changes no file; a second run changes nothing."""
from __future__ import annotations

import json
import os
import stat

import pytest

from tests.support.modules import run_module

pytestmark = pytest.mark.unit
KEY = "marker-key-5f3b9c"
OK_CHECK = "/bin/sh -c 'grep -q Service \"$1\"' check %s"


def args(tmp_path, unit="[Service]\nExecStart=/bin/true\n", env="A=1\n", key=KEY, check=OK_CHECK):
    return {"files": [{"path": str(tmp_path / "x.service"), "content": unit, "mode": "0644", "validate": check},
                      {"path": str(tmp_path / "x.env"), "content": env, "mode": "0600"}],
            "secret_files": [{"path": str(tmp_path / "x.secret.env")}], "secret_contents": [f'KEY="{key}"\n']}


def tree(tmp_path) -> dict:
    return {p.name: (p.read_bytes(), stat.S_IMODE(p.stat().st_mode)) for p in sorted(tmp_path.iterdir())}


def test_check_mode_shows_one_diff_per_file_and_writes_nothing(tmp_path):
    (tmp_path / "x.env").write_text("A=0\n")
    before = tree(tmp_path)
    out = run_module("service_files", args(tmp_path), check_mode=True, diff=True)
    assert out["changed"] is True and tree(tmp_path) == before
    assert sorted(os.path.basename(p) for p in out["changed_paths"]) == ["x.env", "x.secret.env", "x.service"]
    diffs = {d.get("after_header") or d["prepared"].split(":")[0]: d for d in out["diff"]}
    assert diffs[str(tmp_path / "x.env")]["before"] == "A=0\n" and diffs[str(tmp_path / "x.env")]["after"] == "A=1\n"
    assert diffs[str(tmp_path / "x.service")]["before_header"].endswith("(absent)")
    assert "would change (a secret file: not shown)" in diffs[str(tmp_path / "x.secret.env")]["prepared"]
    assert KEY not in json.dumps(out)


def test_a_run_writes_every_file_with_its_mode_then_changes_nothing(tmp_path):
    out = run_module("service_files", args(tmp_path), diff=True)
    assert out["changed"] is True, out
    files = tree(tmp_path)
    assert files["x.service"] == (b"[Service]\nExecStart=/bin/true\n", 0o644)
    assert files["x.env"] == (b"A=1\n", 0o600) and files["x.secret.env"] == (f'KEY="{KEY}"\n'.encode(), 0o600)
    assert KEY not in json.dumps(out)
    assert [f for f in out["files"] if f["secret"]][0].get("sha1") is None
    again = run_module("service_files", args(tmp_path), diff=True)
    assert again["changed"] is False and again["changed_paths"] == [] and "diff" not in again
    assert tree(tmp_path) == files


def test_a_mode_change_alone_is_a_change(tmp_path):
    run_module("service_files", args(tmp_path))
    os.chmod(tmp_path / "x.env", 0o644)
    out = run_module("service_files", args(tmp_path))
    assert out["changed_paths"] == [str(tmp_path / "x.env")]
    assert stat.S_IMODE((tmp_path / "x.env").stat().st_mode) == 0o600


def test_a_file_its_check_refuses_changes_no_file(tmp_path):
    run_module("service_files", args(tmp_path))
    before = tree(tmp_path)
    out = run_module("service_files", args(tmp_path, unit="[Unit]\nno service section\n", env="A=2\n", key="other"))
    assert out.get("failed") is True
    assert "x.service was not replaced: its check" in out["msg"] and "other" not in json.dumps(out)
    assert tree(tmp_path) == before                     # not even the env file that passed


@pytest.mark.parametrize("spec, message", [
    ({"path": "relative/x.env", "content": "A=1\n"}, "is not absolute"),
    ({"path": "/tmp", "content": "A=1\n"}, "is a directory"),
    ({"path": "/tmp/modelswap-test-x.env", "content": "A=1\n", "owner": "no-such-user-x"}, "unknown owner or group"),
], ids=["relative", "directory", "unknown-owner"])
def test_bad_input_is_a_clear_error(spec, message):
    out = run_module("service_files", {"files": [spec]}, check_mode=True)
    assert out.get("failed") is True and message in out["msg"], out


def test_a_secret_without_its_content_is_refused(tmp_path):
    out = run_module("service_files", {"secret_files": [{"path": str(tmp_path / "k.env")}], "secret_contents": []})
    assert out.get("failed") is True and "1 secret_files but 0 secret_contents" in out["msg"]


def test_folders_are_created_with_their_mode_first_and_then_left_alone(tmp_path):
    spec = {"directories": [{"path": str(tmp_path / "etc" / "saved"), "mode": "0700"}],
            "files": [{"path": str(tmp_path / "etc" / "saved" / "unit"), "content": "x\n", "mode": "0600"}]}
    check = run_module("service_files", spec, check_mode=True, diff=True)
    assert check["changed"] is True and not (tmp_path / "etc").exists()
    assert "directory would be created" in check["diff"][0]["prepared"]
    out = run_module("service_files", spec)
    assert out["changed"] is True and stat.S_IMODE((tmp_path / "etc" / "saved").stat().st_mode) == 0o700
    assert (tmp_path / "etc" / "saved" / "unit").read_text() == "x\n"
    again = run_module("service_files", spec)
    assert again["changed"] is False and again["changed_paths"] == []
    (tmp_path / "blocked").write_text("a file where a folder should be")
    bad = run_module("service_files", {"directories": [{"path": str(tmp_path / "blocked")}]}, check_mode=True)
    assert bad.get("failed") is True and "exists and is not a directory" in bad["msg"]
