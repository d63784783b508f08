"""peer_snapshot's logic (plugins/module_utils/fleet/peer_snapshot.py): a snapshot copied from a peer is
verified against the Hub's file list before anything vouches for it, and a bad copy is undone.

The copy itself is rsync over SSH on the lab (tests/integration/test_peers_lab.py); here a copier
of the test's own does what ``rsync --ignore-existing --files-from`` does between two folders of
one machine, so every outcome (a good copy, a damaged source, a source that lacks a blob, a blob
already here that is bad, a rehash that finds rot) is checked with the real cache layout, the real
verification and huggingface_hub's own reader of the cache.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
from huggingface_hub import scan_cache_dir

from ansible_collections.modelswap.vllm.plugins.module_utils.fleet import peer_files
from ansible_collections.modelswap.vllm.plugins.module_utils.fleet import peer_snapshot
from ansible_collections.modelswap.vllm.plugins.module_utils.fleet import peer_transfer
from ansible_collections.modelswap.vllm.plugins.module_utils.hub import hf_errors
from ansible_collections.modelswap.vllm.plugins.module_utils.hub import hf_snapshot
from ansible_collections.modelswap.vllm.plugins.module_utils.store import snapshot_check
from tests.support import synthetic_cache
from tests.support.modules import run_module
from tests.support.scratch_fs import tree_fingerprint

pytestmark = pytest.mark.unit

REPO = "lab/tiny-b"
FOLDER = synthetic_cache.folder_for(REPO)
COMMIT = "5adf7ab29f6060a97a9982849ec851bb2442f6f2"
OLD = "8976b4494868209c1aa701c350d8990989f06532"
FILES = {"config.json": b'{"model_type": "llama"}\n', "model.safetensors": b"W" * 50_000,
         "tok/tokenizer.json": b"t" * 3000, "tok/copy.json": b"t" * 3000}
OLD_FILES = {"config.json": b'{"model_type": "old"}\n', "model.safetensors": b"W" * 50_000}


def expected(files=FILES):
    return [{"path": p, "size": len(c), "etag": synthetic_cache.etag_for(p, c)} for p, c in sorted(files.items())]


class Copier:
    """What peer_snapshot's rsync copier does, between two local folders: a blob that is a regular
    file, or huggingface_hub's link into the peer's shared Xet store (pulled by the store entry's
    name), lands in the staging folder; any other entry is refused; counts calls. ``source``: the
    peer's cache (``job`` sets it)."""

    def __init__(self, rc=0, source=None):
        self.calls = []
        self.rc = rc
        self.source = source

    def __call__(self, names, folder, staging, lock_dir):
        self.calls.append(list(names))
        assert os.path.isdir(lock_dir) and os.path.isdir(staging)
        out = {"rc": self.rc, "stderr": "", "files": {}, "refused": {}}
        if self.rc:
            out["stderr"] = "ssh: connect to host 10.0.0.11 port 22: Connection refused"
            return out
        for name in names:
            rel = "%s/blobs/%s" % (folder, name)
            src = os.path.join(self.source, rel)
            if not os.path.lexists(src):
                out["rc"] = 23
                out["stderr"] = "rsync: link_stat \"%s\" failed: No such file or directory (2)" % rel
                continue
            if os.path.islink(src):
                rel = peer_files.shared_entry(folder, os.readlink(src))
                if rel is None:
                    out["refused"][name] = "a symbolic link to %r" % os.readlink(src)
                    continue
                src = os.path.join(self.source, rel)
            elif not os.path.isfile(src):
                out["refused"][name] = "not a regular file"
                continue
            out["files"][name] = rel
            dest = os.path.join(staging, rel)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            if not os.path.lexists(dest):
                shutil.copyfile(src, dest + ".tmp")
                os.replace(dest + ".tmp", dest)
        return out


@pytest.fixture
def peer(tmp_path):
    """A peer's cache holding REPO@COMMIT (blobs and links, as hf_snapshot leaves them)."""
    cache = tmp_path / "peer"
    synthetic_cache.add_revision(cache, REPO, COMMIT, FILES)
    return cache


def job(cache, peer_cache=None, copier=None, **opts):
    opts.setdefault("state", "copied" if peer_cache else "read")
    if peer_cache:
        opts.setdefault("source", "10.0.0.11")
        opts.setdefault("source_name", "gpu1")
        opts.setdefault("source_cache_dir", str(peer_cache))
        if copier is not None and getattr(copier, "source", "") is None:
            copier.source = str(peer_cache)
    return peer_snapshot.PeerJob(REPO, COMMIT, copier=copier, cache_dir=str(cache), files=expected(),
                                 revision="main", **opts)


def test_read_reports_what_is_missing_and_writes_nothing(tmp_path):
    out = job(tmp_path / "hub").run(check_mode=False)
    assert out["verified"] is False and out["changed"] is False
    assert out["missing"] == {"blobs": 3, "bytes": 50_000 + 3000 + len(FILES["config.json"])}
    assert "no verified manifest" in out["reason"]
    assert not (tmp_path / "hub").exists()


def test_a_copy_is_verified_then_looks_fetched_to_everyone(tmp_path, peer):
    cache = tmp_path / "hub"
    copier = Copier()
    record = tmp_path / "deployment.json"
    out = job(cache, peer, copier, record=str(record), record_name="tiny-b").run(check_mode=False)
    assert out["changed"] is True and out["verified"] is True, out
    assert out["copied"]["blobs"] == 3 and out["copied"]["from"] == "gpu1"
    assert out["verification"]["ok"] and out["verification"]["files"] == 4
    assert out["links"] == {"created": 4, "replaced": 0}
    assert "copied 3 blob(s)" in out["summary"] and "from gpu1" in out["summary"]
    snap = cache / FOLDER / "snapshots" / COMMIT
    assert os.readlink(snap / "tok" / "tokenizer.json") == "../../../blobs/" + synthetic_cache.etag_for(
        "tok/tokenizer.json", FILES["tok/tokenizer.json"])
    assert (cache / FOLDER / "refs" / "main").read_text() == COMMIT
    # huggingface_hub reads the cache as its own
    info = scan_cache_dir(cache)
    rev = next(iter(next(iter(info.repos)).revisions))
    assert rev.commit_hash == COMMIT and rev.nb_files == 4 and "main" in rev.refs
    # vllm_service's check sees it verified, from the record model_fetch would have written
    rec = json.loads(record.read_text())["fetched"]["tiny-b"]
    assert rec["commit"] == COMMIT and rec["verified"] == "full" and rec["path"] == str(snap)
    check = snapshot_check.check("tiny-b", REPO, COMMIT, record=json.loads(record.read_text()), cache_dir=str(cache))
    assert check["verified"] is True, check["reason"]
    # hf_snapshot with the same patterns plans nothing, offline: as if it had fetched it itself
    hf_job = hf_snapshot.SnapshotJob(REPO, revision=COMMIT, cache_dir=str(cache), offline=True)
    hf_job.setup()
    assert hf_job.plan()["noop"] is True and hf_job.listing_source == "manifest"
    manifest = json.loads((cache / FOLDER / "modelswap" / (COMMIT + ".json")).read_text())
    assert manifest["listing_scope"] == "selected" and manifest["tool"]["copied_from"] == "gpu1"
    # again: nothing to do, the peer is not asked
    again = job(cache, peer, copier, record=str(record), record_name="tiny-b").run(check_mode=False)
    assert again["changed"] is False and again["verified"] is True and len(copier.calls) == 1


def test_check_mode_predicts_the_copy_and_changes_nothing(tmp_path, peer):
    cache = tmp_path / "hub"
    synthetic_cache.add_revision(cache, REPO, OLD, OLD_FILES)       # shares model.safetensors
    before = tree_fingerprint(cache)
    copier = Copier()
    out = job(cache, peer, copier).run(check_mode=True)
    assert out["changed"] is True and out["verified"] is False and copier.calls == []
    assert out["copied"] == {"from": "gpu1", "blobs": 2, "bytes": 3000 + len(FILES["config.json"]), "seconds": 0.0}
    assert "would copy 2 blob(s)" in out["summary"]
    assert tree_fingerprint(cache) == before


def test_only_missing_blobs_travel_and_another_revision_is_never_touched(tmp_path, peer):
    cache = tmp_path / "hub"
    synthetic_cache.add_revision(cache, REPO, OLD, OLD_FILES)
    shared = cache / FOLDER / "blobs" / synthetic_cache.etag_for("model.safetensors", OLD_FILES["model.safetensors"])
    inode = shared.stat().st_ino
    copier = Copier()
    out = job(cache, peer, copier).run(check_mode=False)
    assert out["verified"] and len(copier.calls[0]) == 2
    assert shared.stat().st_ino == inode
    assert {r.commit_hash for r in next(iter(scan_cache_dir(cache).repos)).revisions} == {OLD, COMMIT}


def flip(path, offset=100):
    st = os.stat(path)
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0xFF]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))   # silent rot: size and mtime as before


def test_a_copy_from_a_damaged_peer_is_undone_and_blames_the_peer(tmp_path, peer):
    cache = tmp_path / "hub"
    synthetic_cache.add_revision(cache, REPO, OLD, OLD_FILES)     # its blob must survive
    before_old = tree_fingerprint(cache / FOLDER / "snapshots" / OLD)
    flip(peer / FOLDER / "blobs" / synthetic_cache.etag_for("tok/tokenizer.json", FILES["tok/tokenizer.json"]))
    with pytest.raises(peer_files.PeerError) as err:
        job(cache, peer, Copier()).run(check_mode=False)
    assert err.value.cause == "bad_copy"
    assert "copied from gpu1 do not match" in str(err.value) and "tok/" in str(err.value)
    res = err.value.result
    assert res["verified"] is False and res["verification"]["failures"][0]["path"] == "tok/copy.json"
    # what the copy wrote and the links it made are gone; the other revision is whole
    assert not (cache / FOLDER / "snapshots" / COMMIT / "config.json").exists()
    blobs = sorted(os.listdir(cache / FOLDER / "blobs"))
    assert blobs == sorted(synthetic_cache.etag_for(p, c) for p, c in OLD_FILES.items())
    assert tree_fingerprint(cache / FOLDER / "snapshots" / OLD) == before_old
    assert not (cache / FOLDER / "modelswap" / (COMMIT + ".json")).exists()
    assert res["missing"]["blobs"] == 2           # the next round copies them from another peer


def test_a_peer_that_lacks_a_blob_is_named_and_what_came_is_removed(tmp_path, peer):
    os.unlink(peer / FOLDER / "blobs" / synthetic_cache.etag_for("config.json", FILES["config.json"]))
    cache = tmp_path / "hub"
    with pytest.raises(peer_files.PeerError) as err:
        job(cache, peer, Copier()).run(check_mode=False)
    assert err.value.cause == "source_incomplete" and "rsync exit 23" in str(err.value)
    assert os.listdir(cache / FOLDER / "blobs") == []


def test_a_connection_failure_is_a_copy_failure(tmp_path, peer):
    with pytest.raises(peer_files.PeerError) as err:
        job(tmp_path / "hub", peer, Copier(rc=255)).run(check_mode=False)
    assert err.value.cause == "copy_failed" and "check SSH" in str(err.value)


def test_a_bad_blob_already_here_is_dropped_when_nothing_uses_it_and_the_next_copy_heals(tmp_path, peer):
    cache = tmp_path / "hub"
    blobs = cache / FOLDER / "blobs"
    blobs.mkdir(parents=True)
    etag = synthetic_cache.etag_for("model.safetensors", FILES["model.safetensors"])
    (blobs / etag).write_bytes(b"X" * 50_000)                 # an orphan with the right size, wrong bytes
    with pytest.raises(peer_files.PeerError) as err:
        job(cache, peer, Copier()).run(check_mode=False)
    assert err.value.cause == "local_bad" and "already on this host" in str(err.value)
    assert not (blobs / etag).exists()
    assert job(cache, peer, Copier()).run(check_mode=False)["verified"] is True


def test_rehash_finds_rot_and_the_host_stops_claiming_the_snapshot(tmp_path, peer):
    cache = tmp_path / "hub"
    job(cache, peer, Copier()).run(check_mode=False)
    blob = cache / FOLDER / "blobs" / synthetic_cache.etag_for("model.safetensors", FILES["model.safetensors"])
    flip(blob)
    cheap = job(cache, state="verified").run(check_mode=False)
    assert cheap["verified"] is True and cheap["verification"]["mode"] == "manifest"   # one stat: rot unseen
    with pytest.raises(peer_files.PeerError) as err:
        job(cache, state="verified", rehash=True).run(check_mode=False)
    assert err.value.cause == "bad_content" and not blob.exists()
    after = job(cache).run(check_mode=False)
    assert after["verified"] is False and after["missing"]["blobs"] == 1
    with pytest.raises(peer_files.PeerError) as err:
        job(cache, state="verified").run(check_mode=False)
    assert err.value.cause == "not_verified"


def test_a_shared_store_manifest_says_so(tmp_path, peer):
    cache = tmp_path / "hub"
    job(cache, peer, Copier(), store="nfs1").run(check_mode=False)
    manifest = json.loads((cache / FOLDER / "modelswap" / (COMMIT + ".json")).read_text())
    assert manifest["store"] == "nfs1"
    assert job(cache, state="verified", store="nfs1").run(check_mode=False)["verified"] is True


def test_a_partial_listing_is_not_hf_snapshots_listing_for_other_patterns(tmp_path, peer):
    cache = tmp_path / "hub"
    job(cache, peer, Copier()).run(check_mode=False)
    other = hf_snapshot.SnapshotJob(REPO, revision=COMMIT, cache_dir=str(cache), offline=True,
                                    allow_patterns=["*.json"])
    other.setup()
    with pytest.raises(hf_errors.FetchError, match="no manifest and no cached file list"):
        other.plan()


def test_stale_rsync_temporaries_are_recognised_by_name():
    names = ["ab" * 32]
    present = [".%s.Xy12Zq" % names[0], ".%s.long-suffix" % names[0], names[0], ".other.Xy12Zq"]
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        for n in present:
            open(os.path.join(d, n), "w").close()
        assert peer_transfer.stale_temps(d, names) == [os.path.join(d, ".%s.Xy12Zq" % names[0])]


@pytest.mark.parametrize("files, message", [
    ([], "empty or not a list"),
    ([{"path": "../etc/passwd", "size": 1, "etag": "a" * 40}], "has a '..' segment"),
    ([{"path": "/abs", "size": 1, "etag": "a" * 40}], "is absolute"),
    ([{"path": "a", "size": 1, "etag": "NOTHEX"}], "neither a sha256 nor a git blob id"),
    ([{"path": "a", "size": -1, "etag": "a" * 40}], "not a byte count"),
    ([{"path": "a", "size": 1, "etag": "a" * 40}, {"path": "a", "size": 1, "etag": "a" * 40}], "twice"),
])
def test_an_unsafe_or_broken_file_list_is_refused_before_any_write(tmp_path, files, message):
    with pytest.raises(peer_files.PeerError, match=message) as err:
        peer_snapshot.PeerJob(REPO, COMMIT, cache_dir=str(tmp_path / "hub"), files=files).run(check_mode=False)
    assert err.value.cause == "bad_files" and not (tmp_path / "hub").exists()


def test_lfs_entries_get_the_pointer_blob_id_the_hub_lists():
    sha = "ab" * 32
    entry = peer_files.expected_listing([{"path": "w.safetensors", "size": 5, "etag": sha}])["w.safetensors"]
    pointer = "version https://git-lfs.github.com/spec/v1\noid sha256:%s\nsize 5\n" % sha
    assert entry == {"size": 5, "lfs_sha256": sha, "blob_id": synthetic_cache.git_blob_id(pointer.encode())}


@pytest.mark.parametrize("kwargs, tail, rsh", [
    ({}, ["root@10.0.0.11:/src/", "/dst/peer-incoming/"],
     "ssh -p 22 -o BatchMode=yes -o StrictHostKeyChecking=yes -o ConnectTimeout=10"),
    ({"ssh_key": "/root/.ssh/modelswap_peer", "known_hosts": "/etc/ssh/peers", "port": 2222, "bwlimit": 50000,
      "source": "fd00::11", "user": "fetch", "source_path": ""},
     ["--bwlimit=50000", "fetch@[fd00::11]:", "/dst/peer-incoming/"],
     "ssh -p 2222 -o BatchMode=yes -o StrictHostKeyChecking=yes -o ConnectTimeout=10 -i /root/.ssh/modelswap_peer "
     "-o IdentitiesOnly=yes -o UserKnownHostsFile=/etc/ssh/peers"),
])
def test_the_rsync_command_line(kwargs, tail, rsh):
    args = dict(source="10.0.0.11", user="root", port=22, source_path="/src/", dest="/dst/peer-incoming",
                list_file="/l.txt")
    args.update(kwargs)
    argv = peer_transfer.rsync_argv("/usr/bin/rsync", **args)
    assert argv[:9] == ["/usr/bin/rsync", "--times", "--no-links", "--no-devices", "--no-specials",
                        "--ignore-existing", "--files-from=/l.txt", "--timeout=300", "--rsh=" + rsh]
    assert argv[9:] == tail


def test_the_module_reads_in_check_mode_and_names_a_missing_source(tmp_path):
    args = {"repo_id": REPO, "commit": COMMIT, "files": expected(), "cache_dir": str(tmp_path / "hub")}
    out = run_module("peer_snapshot", dict(args, state="copied", source="10.0.0.11"), check_mode=True)
    assert out.get("failed") is not True, out
    assert out["changed"] is True and out["copied"]["bytes"] == out["missing"]["bytes"] > 0
    assert not (tmp_path / "hub").exists()
    out = run_module("peer_snapshot", dict(args, state="copied"))
    assert out["failed"] and "state is copied but all of the following are missing: source" in out["msg"]
    out = run_module("peer_snapshot", dict(args, files=[{"path": "a", "size": "x", "etag": "a" * 40}]))
    assert out["failed"] and "size" in out["msg"]
