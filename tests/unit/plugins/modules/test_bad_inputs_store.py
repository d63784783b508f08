"""Bad input to the store modules: a clear error that names the problem and the fix, and nothing changed.

One table per module (model_purge, disk_plan, gpu_ready, shm_cleanup, deployment_record, vllm_service_info):
what was tried (bad option values, typo'd option and model names, paths outside the roots,
symlinks escaping them, a missing store...), words the error must contain, and, for every row,
that the whole scratch tree (cache, models folder, a canary outside both, the shm folder, the
deployment record) is byte for byte what it was (tests/support/scratch_fs.tree_fingerprint).
Modules that change things run each row in check mode and for real.
"""
from __future__ import annotations

import json
import os
import pwd

import pytest

from tests.support import synthetic_cache
from tests.support.modules import run_module
from tests.support.scratch_fs import tree_fingerprint

pytestmark = pytest.mark.unit

A = "a" * 40
C = "c" * 40
ME = pwd.getpwuid(os.getuid()).pw_name
GOOD = {"model": "tiny-a", "repo_id": "lab/tiny-a", "commit": A,
        "path": "/var/lib/modelswap/hf/hub/models--lab--tiny-a/snapshots/" + A,
        "served_model_name": "tiny-a", "unit": "vllm.service", "port": 8100}
CATALOG = {"t": {"repo_id": "org/new", "revision": "b" * 40}, "k": {"repo_id": "org/two", "revision": C}}


@pytest.fixture
def world(tmp_path):
    """The scratch tree every row runs against; returns the values the rows' templates use."""
    cache = tmp_path / "hub"
    models = tmp_path / "models"
    models.mkdir()
    synthetic_cache.add_revision(cache, "org/one", A, {"config.json": b"{}", "model.safetensors": b"w" * 5000})
    synthetic_cache.add_revision(cache, "org/two", C, {"config.json": b"[]", "model.safetensors": b"v" * 3000})
    synthetic_cache.make_plain_dir(models, "plain", {"w.bin": b"p" * 700})
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "canary").write_bytes(b"precious")
    os.symlink(outside, models / "escape")
    os.symlink(outside, cache / "models--org--evil")
    shm = tmp_path / "shm"
    shm.mkdir()
    (shm / "nccl-1a2b").write_bytes(b"x" * 64)     # a leftover the cleanup would take
    (tmp_path / "file").write_text("x")
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "record.json").write_text(json.dumps(dict(GOOD, when="t0", schema=1, previous=None)))
    return {"tmp": str(tmp_path), "cache": str(cache), "models": str(models), "outside": str(outside),
            "shm": str(shm)}


def fill(value, values):
    if isinstance(value, str):
        return value.format(**values)
    if isinstance(value, list):
        return [fill(v, values) for v in value]
    if isinstance(value, dict):
        return {k: fill(v, values) for k, v in value.items()}
    return value


BASE = {
    "model_purge": {"cache_dir": "{cache}", "models_dir": "{models}", "vllm_unit": "",
                    "deployment_record": "{tmp}/none.json", "models": CATALOG, "items": ["org/two"]},
    "disk_plan": {"cache_dir": "{cache}", "models_dir": "{models}", "vllm_unit": "",
                  "deployment_record": "{tmp}/none.json", "models": CATALOG, "target": "t",
                  "target_bytes": 100},
    "gpu_ready": {"service_user": ME, "shm_dir": "{shm}"},
    "shm_cleanup": {"service_user": ME, "shm_dir": "{shm}"},
    "deployment_record": {"path": "{tmp}/record.json", "deployment": dict(GOOD, model="tiny-b")},
    "vllm_service_info": {"record_path": "{tmp}/record.json", "unit": "vllm.service"},
}
CHANGES_THINGS = {"model_purge", "shm_cleanup", "deployment_record"}

# (module, id, options over BASE (None removes one), words the error must contain)
# The /dev/shm inputs gpu_ready (which reports stale segments) and shm_cleanup (which removes them)
# judge alike; "patterns" is gpu_ready's shm_patterns.
SHM_ROWS = [
    ("shm-dir-missing", {"shm_dir": "{tmp}/noshm"}, ["{tmp}/noshm does not exist", "Fix:"]),
    ("shm-dir-a-file", {"shm_dir": "{tmp}/file"}, ["is not a directory", "Fix:"]),
    ("shm-dir-relative", {"shm_dir": "shm"}, ["'shm' is not an absolute path", "/dev/shm"]),
    ("pattern-with-slash", {"patterns": ["../*"]}, ["contains '/'", "Fix:"]),
    ("pattern-absolute", {"patterns": ["/etc/*"]}, ["is absolute"]),
    ("pattern-too-wide", {"patterns": ["*"]}, ["would match almost any file name"]),
    ("typo-user", {"service_user": ME + "x"}, ["service user '%sx' does not exist" % ME]),
]
ROWS = [
    # ---------------------------------------------------------------------------- model_purge
    ("model_purge", "missing-store", {"cache_dir": "{tmp}/nope"}, ["{tmp}/nope does not exist", "fix the path"]),
    ("model_purge", "store-is-a-file", {"cache_dir": "{tmp}/file"}, ["is not a directory", "point it at"]),
    ("model_purge", "no-store", {"cache_dir": None, "models_dir": None},
     ["one of the following is required: cache_dir, models_dir"]),
    ("model_purge", "typo-option", {"itmes": ["org/two"]}, ["Unsupported parameters", "itmes"]),
    ("model_purge", "bad-choice", {"missing": "skip"}, ["missing must be one of: ignore, fail"]),
    ("model_purge", "scan-workers-zero", {"scan_workers": 0}, ["scan_workers must be 1 or more"]),
    ("model_purge", "relative-protect-path", {"protect_paths": ["models/plain"]},
     ["protect_paths entry 'models/plain' is not an absolute path", "full path"]),
    ("model_purge", "typo-target", {"target": "tt"}, ["unknown model name 'tt' (target)"]),
    ("model_purge", "typo-keep", {"keep": ["kk"]}, ["unknown model name 'kk' (keep)"]),
    ("model_purge", "catalog-repo-id-newline",
     {"target": "t", "models": {"t": {"repo_id": "org/new\n", "revision": "main"}}},
     ["malformed"]),
    ("model_purge", "malformed-repo-id", {"items": ["org/na me"]}, ["malformed", "namespace/name"]),
    ("model_purge", "dotdot-item", {"items": ["../outside"]}, ["malformed"]),
    ("model_purge", "malformed-revision", {"items": ["org/one@not a ref"]}, ["neither a commit hash nor a ref"]),
    ("model_purge", "revision-not-cached", {"items": ["org/one@" + C], "missing": "fail"},
     ["revision %s of org/one is not cached" % C, "missing=fail"]),
    ("model_purge", "typo-repo", {"items": ["org/onee"], "missing": "fail"}, ["not in the model store"]),
    ("model_purge", "empty-item", {"items": [""]}, ["is empty", "name a catalog model"]),
    ("model_purge", "path-outside-roots", {"items": ["{outside}/canary"]}, ["outside the roots", "rule: roots"]),
    ("model_purge", "dotdot-path", {"items": ["{cache}/../outside"]}, ["outside the roots"]),
    ("model_purge", "symlink-escape-dir", {"items": ["{models}/escape"]},
     ["resolves through a symlink to {outside}", "rule: roots"]),
    ("model_purge", "symlink-escape-repo", {"items": ["{cache}/models--org--evil"]},
     ["resolves through a symlink to {outside}"]),
    ("model_purge", "a-root-itself", {"items": ["{cache}"]}, ["root itself", "name an item inside it"]),
    ("model_purge", "inside-a-repo", {"items": ["{cache}/models--org--one/blobs"]}, ["not a purgeable item"]),
    ("model_purge", "root-missing", {"roots": ["{tmp}/nope"]}, ["not an existing directory", "fix roots"]),
    ("model_purge", "roots-exclude-cache", {"roots": ["{models}"]}, ["outside the roots ({models})"]),
    ("model_purge", "kept-model", {"items": ["k"], "keep": ["k"]}, ["keep list", "rule: keep"]),
    ("model_purge", "one-bad-spoils-all", {"items": ["org/one", "{outside}/canary"]},
     ["outside the roots", "nothing was deleted"]),
    ("model_purge", "record-not-json", {"deployment_record": "{tmp}/bad.json"}, ["not valid JSON", "fix or remove it"]),
    # ---------------------------------------------------------------------------- disk_plan
    ("disk_plan", "missing-store", {"cache_dir": "{tmp}/nope"}, ["does not exist", "fix the path"]),
    ("disk_plan", "store-is-a-file", {"models_dir": "{tmp}/file"}, ["is not a directory"]),
    ("disk_plan", "typo-option", {"targte": "t"}, ["Unsupported parameters", "targte"]),
    ("disk_plan", "typo-target", {"target": "tt"}, ["unknown model name 'tt' (target)"]),
    ("disk_plan", "typo-keep", {"keep": ["kk"]}, ["unknown model name 'kk' (keep)"]),
    ("disk_plan", "catalog-repo-id-newline", {"models": {"t": {"repo_id": "org/new\n", "revision": "b" * 40}}},
     ["malformed"]),
    ("disk_plan", "catalog-entry-not-a-mapping", {"models": {"t": "org/new"}}, ["catalog entry 't' is not a mapping"]),
    ("disk_plan", "catalog-entry-no-repo-id", {"models": {"t": {"revision": "main"}}}, ["has no repo_id"]),
    ("disk_plan", "malformed-candidate", {"candidates": ["a/b/c"]}, ["malformed"]),
    ("disk_plan", "candidate-outside-store", {"candidates": ["{outside}"]}, ["{outside}"]),
    ("disk_plan", "candidate-symlink-escape", {"candidates": ["{models}/escape"]},
     ["is a symlink (to {outside})", "name the directory itself"]),
    ("disk_plan", "candidate-not-in-store", {"candidates": ["org/absent"]}, ["not in the model store"]),
    ("disk_plan", "negative-headroom", {"headroom": "-5%"}, ["negative"]),
    ("disk_plan", "headroom-over-100", {"headroom": "150%"}, ["over 100%"]),
    ("disk_plan", "bad-download-rate", {"download_rate": "fast"}, ["download_rate 'fast' is not a size"]),
    ("disk_plan", "scan-workers-zero", {"scan_workers": 0}, ["scan_workers must be 1 or more"]),
    ("disk_plan", "relative-protect-path", {"protect_paths": ["plain"]}, ["is not an absolute path"]),
    ("disk_plan", "record-is-a-directory", {"deployment_record": "{tmp}"}, ["cannot read the deployment record"]),
    # ---------------------------------------------------------------------------- gpu_ready
    # the /dev/shm inputs both modules take (SHM_ROWS, below) and gpu_ready's own
    ("gpu_ready", "removed-option", {"shm_cleanup": True}, ["Unsupported parameters", "shm_cleanup"]),
    ("gpu_ready", "utilization-over-1", {"gpu_memory_utilization": 1.5}, ["gpu_memory_utilization must be", "got 1.5"]),
    ("gpu_ready", "tp-zero", {"tensor_parallel_size": 0}, ["tensor_parallel_size must be an integer >= 1"]),
    ("gpu_ready", "device-twice", {"devices": [0, 0]}, ["devices lists GPU 0 twice"]),
    ("gpu_ready", "negative-wait", {"wait_timeout": -1}, ["wait_timeout must be", ">= 0"]),
    ("gpu_ready", "bad-driver-version", {"min_driver_version": "abc"}, ["'abc' is not a version"]),
    ("gpu_ready", "typo-option", {"shm_clean": True}, ["Unsupported parameters", "shm_clean"]),
    # ---------------------------------------------------------------------------- shm_cleanup
    # the /dev/shm inputs both modules take (SHM_ROWS, below) and shm_cleanup's own
    ("shm_cleanup", "pattern-hidden", {"patterns": [".nccl*"]}, ["starts with '.'"]),
    ("shm_cleanup", "empty-user", {"service_user": ""}, ["service_user is empty", "Fix:"]),
    ("shm_cleanup", "no-service-user", {"service_user": None}, ["missing required arguments: service_user"]),
    ("shm_cleanup", "gpu-ready-option-name", {"shm_patterns": ["sem.loky-*"]},
     ["Unsupported parameters", "shm_patterns"]),
    ("shm_cleanup", "typo-option", {"pattern": ["sem.loky-*"]}, ["Unsupported parameters", "pattern"]),
    # ---------------------------------------------------------------------------- deployment_record
    ("deployment_record", "mode-not-octal", {"mode": "rw"}, ["mode 'rw' is not an octal permission"]),
    ("deployment_record", "mode-world-writable", {"mode": "0666"}, ["mode '0666' lets other users rewrite", "0644"]),
    ("deployment_record", "saved-mode-group-writable",
     {"saved_dir": "{tmp}/saved", "saved_files": [{"name": "env", "path": "{tmp}/file", "mode": "0660"}]},
     ["saved_files env mode '0660' lets other users rewrite"]),
    ("deployment_record", "saved-name-escapes",
     {"saved_dir": "{tmp}/saved", "saved_files": [{"name": "../x", "path": "{tmp}/file"}]},
     ["saved_files name '../x' is not a plain file name"]),
    ("deployment_record", "saved-name-twice",
     {"saved_dir": "{tmp}/saved", "saved_files": [{"name": "a", "path": "{tmp}/file"},
                                                  {"name": "a", "path": "{tmp}/bad.json"}]},
     ["saved_files name 'a' is listed twice"]),
    ("deployment_record", "saved-without-dir", {"saved_files": [{"name": "a", "path": "{tmp}/file"}]},
     ["saved_files needs saved_dir"]),
    ("deployment_record", "deployment-lacks-keys", {"deployment": {"model": "m"}},
     ["lacks path, served_model_name, unit"]),
    ("deployment_record", "typo-deployment-key", {"deployment": dict(GOOD, modle="x")},
     ["unknown deployment keys modle"]),
    ("deployment_record", "relative-path", {"deployment": dict(GOOD, path="models/tiny")},
     ["deployment path 'models/tiny' is not an absolute path"]),
    ("deployment_record", "commit-not-hex", {"deployment": dict(GOOD, commit="main")},
     ["deployment commit 'main' is not a 40-hex commit hash"]),
    ("deployment_record", "repo-id-malformed", {"deployment": dict(GOOD, repo_id="lab//tiny")},
     ["deployment repo id 'lab//tiny' is malformed"]),
    ("deployment_record", "unit-with-newline", {"deployment": dict(GOOD, unit="vllm.service\nExecStart=/x")},
     ["deployment unit", "control character"]),
    ("deployment_record", "unit-with-slash", {"deployment": dict(GOOD, unit="../vllm.service")},
     ["is not a systemd unit name"]),
    ("deployment_record", "name-with-newline", {"deployment": dict(GOOD, served_model_name="a\nb")},
     ["deployment served_model_name", "control character"]),
    ("deployment_record", "port-out-of-range", {"deployment": dict(GOOD, port=70000)},
     ["deployment port 70000 is not a TCP port"]),
    ("deployment_record", "record-not-json", {"path": "{tmp}/bad.json"}, ["not valid JSON", "fix or remove it"]),
    ("deployment_record", "read-a-directory", {"path": "{tmp}", "state": "read", "deployment": None},
     ["reading the deployment record", "Is a directory"]),
    ("deployment_record", "record-is-a-directory", {"path": "{shm}"},
     ["recording the deployment in {shm} failed", "Is a directory"]),
    ("deployment_record", "typo-state", {"state": "presnt"}, ["state must be one of: present, read"]),
    # ----------------------------------------------------------------------------- vllm_service_info
    ("vllm_service_info", "record-not-json", {"record_path": "{tmp}/bad.json"}, ["not valid JSON", "fix or remove it"]),
    ("vllm_service_info", "record-is-a-directory", {"record_path": "{tmp}"}, ["cannot read the deployment record"]),
    ("vllm_service_info", "port-out-of-range", {"port": 70000}, ["port 70000 is not a TCP port (1-65535)"]),
    ("vllm_service_info", "port-zero", {"port": 0}, ["port 0 is not a TCP port"]),
    ("vllm_service_info", "model-repo-id-malformed", {"model": {"name": "m", "repo_id": "lab//tiny"}},
     ["model.repo id 'lab//tiny' is malformed"]),
    ("vllm_service_info", "model-repo-id-newline", {"model": {"name": "m", "repo_id": "lab/tiny\n"}},
     ["is malformed"]),
    ("vllm_service_info", "model-without-repo-id", {"model": {"name": "m"}}, ["missing required arguments: repo_id"]),
    ("vllm_service_info", "unit-with-newline", {"unit": "vllm.service\nx"}, ["unit", "is not a systemd unit name"]),
    ("vllm_service_info", "unit-path", {"unit": "../../etc/passwd"}, ["is not a systemd unit name"]),
    ("vllm_service_info", "replaces-bad", {"replaces": ["old vllm"]}, ["replaces 'old vllm' is not a systemd unit"]),
    ("vllm_service_info", "typo-choice", {"verification": "sha"}, ["verification must be one of: full, size, none"]),
    ("vllm_service_info", "typo-option", {"record": "{tmp}/record.json"}, ["Unsupported parameters", "record"]),
] + [(module, case, {(key if key != "patterns" else patterns): value for key, value in args.items()}, expect)
     for module, patterns in (("gpu_ready", "shm_patterns"), ("shm_cleanup", "patterns"))
     for case, args, expect in SHM_ROWS]


@pytest.mark.parametrize("module,row,extra,words", ROWS, ids=["%s-%s" % (r[0], r[1]) for r in ROWS])
def test_bad_input_fails_clearly_and_changes_nothing(tmp_path, world, module, row, extra, words):
    args = dict(BASE[module], **extra)
    args = fill({k: v for k, v in args.items() if v is not None}, world)
    before = tree_fingerprint(tmp_path)
    for check in ((True, False) if module in CHANGES_THINGS else (False,)):
        res = run_module(module, args, check_mode=check)
        assert res.get("failed") is True, res
        assert res.get("changed") in (None, False), res
        for w in words:
            assert fill(w, world) in res["msg"], res["msg"]
        assert tree_fingerprint(tmp_path) == before, "check mode" if check else "a real run"
    assert (tmp_path / "outside" / "canary").read_bytes() == b"precious"


def test_every_module_has_rows():
    counts = {m: sum(1 for r in ROWS if r[0] == m) for m in BASE}
    assert all(n >= 10 for n in counts.values()), counts
    assert len({(r[0], r[1]) for r in ROWS}) == len(ROWS)


@pytest.mark.parametrize("module", sorted(BASE))
def test_the_base_arguments_work(tmp_path, world, module):
    """The rows fail because of what each changes: the base arguments alone succeed."""
    args = fill(BASE[module], world)
    res = run_module(module, args, check_mode=True)
    assert not res.get("failed"), res
