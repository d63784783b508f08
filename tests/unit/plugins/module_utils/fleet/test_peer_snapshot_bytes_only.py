"""A peer sends bytes, never links or special files (plugins/module_utils/fleet/peer_snapshot.py), and its key
serves a read-only store (tests/lab/labctl.py peer_authorized_key, roles/model_fetch/README.md).

The receiver's checks run on what a test copier plants in the staging folder: a symlink (absolute,
or relative into the receiver's own Xet store), a FIFO, a character device (mknod, as root), a
folder. A huggingface_hub 2.4 Xet layout on the peer (blobs as relative links into the cache-wide
store, made by huggingface_hub's own functions) is copied with the real rsync over a local
transport: a fake ``ssh`` that runs the command here, directly or through the real rrsync, as the
peer's forced command would.
"""
from __future__ import annotations

import os
import shutil
import stat
import subprocess

import pytest
from huggingface_hub import scan_cache_dir
from huggingface_hub.utils import _shared_blobs

from ansible_collections.modelswap.vllm.plugins.module_utils.common.command_runner import HostCommands
from ansible_collections.modelswap.vllm.plugins.module_utils.fleet import peer_files
from ansible_collections.modelswap.vllm.plugins.module_utils.fleet import peer_snapshot
from ansible_collections.modelswap.vllm.plugins.module_utils.fleet import peer_transfer
from tests.lab import labctl
from tests.support import synthetic_cache
from tests.unit.plugins.module_utils.fleet.test_peer_snapshot import COMMIT, FILES, FOLDER, REPO, Copier, expected, job

pytestmark = pytest.mark.unit

RSYNC = shutil.which("rsync")
RRSYNC = shutil.which("rrsync") or ("/usr/bin/rrsync" if os.path.exists("/usr/bin/rrsync") else None)
# `make test-unit` installs them (make deps); only a run outside it may skip, never CI's
OPTIONAL = not os.environ.get("CI")
needs_rsync = pytest.mark.skipif(OPTIONAL and not RSYNC, reason="rsync is not installed (make deps)")
needs_rrsync = pytest.mark.skipif(OPTIONAL and not (RSYNC and RRSYNC), reason="rrsync is not installed (make deps)")
XET = "cd" * 32          # the Xet hash the peer's store names the model's payload by
BIG = "model.safetensors"


def etag(path):
    return synthetic_cache.etag_for(path, FILES[path])


# ----------------------------------------------------------------------------- the rsync command
def test_the_copy_takes_bytes_only_and_the_listing_writes_nothing():
    argv = peer_transfer.rsync_argv("rsync", source="gpu1", user="root", port=22, source_path="", dest="/s",
                                    list_file="/l")
    assert argv[1:6] == ["--times", "--no-links", "--no-devices", "--no-specials", "--ignore-existing"]
    for flag in ("--archive", "-a", "--links", "--copy-links", "-L", "--perms", "--owner", "--group", "--devices",
                 "--specials", "--recursive", "--copy-unsafe-links"):
        assert flag not in argv
    assert argv[-2:] == ["root@gpu1:", "/s/"]        # under rrsync: the peer's restricted folder itself
    listing = peer_transfer.rsync_argv("rsync", source="gpu1", user="root", port=22, source_path="hf/hub/",
                                       dest="/s", list_file="/l", bwlimit=10, list_only=True)
    assert listing[1:7] == ["--dry-run", "--links", "--no-devices", "--no-specials", "--itemize-changes",
                            "--out-format=%i|%n|%L"]
    assert "--bwlimit=10" not in listing and listing[-2] == "root@gpu1:hf/hub/"


@pytest.mark.parametrize("cache, root, path", [
    ("/var/lib/modelswap/hf/hub", "", "/var/lib/modelswap/hf/hub/"),
    ("/var/lib/modelswap/hf/hub", "/var/lib/modelswap/hf/hub", ""),
    ("/var/lib/modelswap/hf/hub/", "/var/lib/modelswap/hf/hub/", ""),
    ("/var/lib/modelswap/test/hub", "/var/lib/modelswap", "test/hub/"),
])
def test_the_peers_cache_is_named_relative_to_the_folder_its_rrsync_serves(cache, root, path):
    assert peer_transfer.source_dir(cache, root) == path


@pytest.mark.parametrize("cache, root", [("/srv/hub", "/var/lib/modelswap"), ("/var/lib/x", "/var/lib/x/y"),
                                         ("rel/hub", "/var/lib")])
def test_a_cache_outside_the_served_folder_is_a_bad_option(cache, root):
    with pytest.raises(peer_files.PeerError) as err:
        peer_transfer.source_dir(cache, root)
    assert err.value.cause == "bad_option"


def test_the_listing_resolves_only_huggingface_hubs_links_into_the_xet_store():
    names = ["a" * 64, "b" * 64, "c" * 64, "d" * 64, "e" * 40, "f" * 40, "0" * 40]
    out = "\n".join([
        "cd+++++++++|%s/|" % FOLDER,
        ">f+++++++++|%s/blobs/%s|" % (FOLDER, "a" * 64),
        "cL+++++++++|%s/blobs/%s| -> ../../blobs/cd/%s" % (FOLDER, "b" * 64, XET),
        "cL+++++++++|%s/blobs/%s| -> /etc/shadow" % (FOLDER, "c" * 64),
        "cL+++++++++|%s/blobs/%s| -> ../../blobs/ab/%s" % (FOLDER, "d" * 64, XET),   # wrong prefix folder
        "cd+++++++++|%s/blobs/%s/|" % (FOLDER, "e" * 40),
        "cL+++++++++|%s/blobs/%s| -> ../../../../etc/blobs/cd/%s" % (FOLDER, "f" * 40, XET)])
    err = 'skipping non-regular file "%s/blobs/%s"\n' % (FOLDER, "0" * 40)
    pull, refused = peer_transfer.resolve_listing(FOLDER, names, out, err)
    assert pull == {"a" * 64: "%s/blobs/%s" % (FOLDER, "a" * 64), "b" * 64: "blobs/cd/%s" % XET}
    assert "'/etc/shadow'" in refused["c" * 64] and "shared Xet store" in refused["d" * 64]
    assert refused["0" * 40].startswith("not a regular file") and refused["e" * 40] == "a directory"
    assert "f" * 40 in refused and set(pull) | set(refused) == set(names)


# ----------------------------------------------------------------------------- the receiver's checks
def planting(plant, name):
    """A copier that copies like Copier, then puts ``plant(path)`` at ``name``'s place in staging."""
    inner = Copier()

    def copy(names, folder, staging, lock_dir):
        out = inner(names, folder, staging, lock_dir)
        path = os.path.join(staging, out["files"][name])
        os.unlink(path)
        plant(path)
        return out
    copy.source = None
    copy.inner = inner
    return copy


def run_planted(tmp_path, peer, plant, name):
    cache = tmp_path / "hub"
    copier = planting(plant, name)
    copier.inner.source = str(peer)
    with pytest.raises(peer_files.PeerError) as err:
        job(cache, peer, copier).run(check_mode=False)
    return cache, err.value


def assert_refused_and_nothing_published(cache, err, name, kind):
    assert err.cause == "bad_copy", err
    assert kind in str(err) and "from gpu1" in str(err) and "nothing of the copy was published" in str(err)
    failure = err.result["verification"]["failures"][0]
    assert failure["blob"] == name and kind in failure["kind"]
    assert os.listdir(cache / FOLDER / "blobs") == []                       # nothing published
    assert not (cache / FOLDER / "snapshots").exists()                      # no link made
    assert not (cache / FOLDER / "modelswap" / (COMMIT + ".json")).exists()
    assert not (cache / ".locks" / FOLDER / peer_snapshot.STAGING_NAME).exists()
    assert err.result["verified"] is False and err.result["missing"]["blobs"] == 3


@pytest.fixture
def peer(tmp_path):
    cache = tmp_path / "peer"
    synthetic_cache.add_revision(cache, REPO, COMMIT, FILES)
    return cache


def test_an_absolute_link_to_a_file_with_the_right_bytes_is_refused(tmp_path, peer):
    decoy = tmp_path / "elsewhere" / "weights"
    decoy.parent.mkdir()
    decoy.write_bytes(FILES[BIG])                       # the hash would read through the link and match
    cache, err = run_planted(tmp_path, peer, lambda p: os.symlink(str(decoy), p), etag(BIG))
    assert_refused_and_nothing_published(cache, err, etag(BIG), "a symbolic link to %r" % str(decoy))
    assert decoy.read_bytes() == FILES[BIG]


def test_a_relative_link_into_the_receivers_own_xet_store_is_refused(tmp_path, peer):
    cache = tmp_path / "hub"
    entry = cache / "blobs" / XET[:2] / XET           # the receiver's own store holds the right bytes
    entry.parent.mkdir(parents=True)
    entry.write_bytes(FILES[BIG])
    (cache / "blobs" / _shared_blobs.SHARED_BLOBS_MARKER_NAME).write_text("1\n")
    cache, err = run_planted(tmp_path, peer, lambda p: os.symlink("../../blobs/cd/" + XET, p), etag(BIG))
    assert_refused_and_nothing_published(cache, err, etag(BIG), "a symbolic link to '../../blobs/cd/")


def test_a_fifo_is_refused_without_blocking_on_it(tmp_path, peer):
    cache, err = run_planted(tmp_path, peer, os.mkfifo, etag("config.json"))
    assert_refused_and_nothing_published(cache, err, etag("config.json"), "a FIFO")


def test_a_device_is_refused_and_never_opened(tmp_path, peer):
    def mknod(path):
        try:
            os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        except PermissionError:
            pytest.skip("mknod needs root")
        os.chmod(path, 0o666)
    cache, err = run_planted(tmp_path, peer, mknod, etag(BIG))
    assert_refused_and_nothing_published(cache, err, etag(BIG), "a character device")


def test_a_folder_is_refused(tmp_path, peer):
    def folder(path):
        os.mkdir(path)
        (tmp_path / "x").write_bytes(FILES[BIG])
    cache, err = run_planted(tmp_path, peer, folder, etag(BIG))
    assert_refused_and_nothing_published(cache, err, etag(BIG), "a directory")


def test_a_regular_file_is_published_as_a_regular_blob_with_the_receivers_umask(tmp_path, peer):
    def loose(path):
        with open(path, "wb") as fh:
            fh.write(FILES[BIG])
        os.chmod(path, 0o4777)                          # the peer's mode is not the receiver's
    cache = tmp_path / "hub"
    copier = planting(loose, etag(BIG))
    copier.inner.source = str(peer)
    mask = os.umask(0o022)
    try:
        out = job(cache, peer, copier).run(check_mode=False)
    finally:
        os.umask(mask)
    assert out["verified"] is True and out["copied"]["blobs"] == 3, out
    for name in os.listdir(cache / FOLDER / "blobs"):
        st = os.lstat(cache / FOLDER / "blobs" / name)
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o644 and st.st_nlink == 1, name
    assert not (cache / ".locks" / FOLDER / peer_snapshot.STAGING_NAME).exists()


def test_a_link_already_here_that_leads_out_of_the_store_is_not_trusted(tmp_path, peer):
    cache = tmp_path / "hub"
    decoy = tmp_path / "decoy"
    decoy.write_bytes(FILES[BIG])
    blobs = cache / FOLDER / "blobs"
    blobs.mkdir(parents=True)
    os.symlink(str(decoy), blobs / etag(BIG))           # --ignore-existing keeps it: the check must not
    with pytest.raises(peer_files.PeerError) as err:
        job(cache, peer, Copier()).run(check_mode=False)
    assert err.value.cause == "local_bad" and "a symbolic link to %r" % str(decoy) in str(err.value)
    assert not os.path.lexists(blobs / etag(BIG)) and decoy.read_bytes() == FILES[BIG]
    assert job(cache, peer, Copier()).run(check_mode=False)["verified"] is True     # the next copy heals


def xet_layout(cache, blob_name, size):
    """Turn ``<repo>/blobs/<blob_name>`` into huggingface_hub 2.4's Xet layout, by its own code."""
    blob = os.path.join(str(cache), FOLDER, "blobs", blob_name)
    assert _shared_blobs.publish_blob_to_shared_store(blob_path=blob, xet_hash=XET, cache_dir=str(cache),
                                                      expected_size=size)
    assert os.path.islink(blob) and os.readlink(blob) == "../../blobs/cd/" + XET
    return blob


def test_a_link_into_the_receivers_own_xet_store_already_here_is_trusted(tmp_path, peer):
    cache = tmp_path / "hub"
    synthetic_cache.add_revision(cache, REPO, "8976b4494868209c1aa701c350d8990989f06532", {BIG: FILES[BIG]})
    xet_layout(cache, etag(BIG), len(FILES[BIG]))       # as this host's own hf_xet download left it
    copier = Copier()
    out = job(cache, peer, copier).run(check_mode=False)
    assert out["verified"] is True and etag(BIG) not in copier.calls[0]
    assert os.path.islink(cache / FOLDER / "blobs" / etag(BIG))


# ----------------------------------------------------------------------------- the real rsync
def fake_ssh(tmp_path, rrsync_root=""):
    """An ``ssh`` that runs the remote command here: directly, or as the forced command
    ``rrsync -ro <rrsync_root>`` gets it (SSH_ORIGINAL_COMMAND)."""
    script = tmp_path / ("ssh-rrsync" if rrsync_root else "ssh-plain")
    run = ('SSH_ORIGINAL_COMMAND="$*" exec %s -ro %s' % (RRSYNC, rrsync_root) if rrsync_root else 'exec sh -c "$*"')
    script.write_text("#!/bin/sh\n"
                      "while [ $# -gt 0 ]; do case \"$1\" in -p|-o|-i|-l) shift 2;; -*) shift;; *) break;; esac; done\n"
                      "shift\n%s\n" % run)
    script.chmod(0o755)
    return str(script)


def real_copier(tmp_path, peer, rrsync=False):
    return peer_transfer.rsync_copier(HostCommands.local(), source="gpu1", user="root", port=22,
                                      ssh=fake_ssh(tmp_path, str(peer) if rrsync else ""),
                                      source_cache_dir=str(peer), serve_root=str(peer) if rrsync else "",
                                      io_timeout=30)


@needs_rsync
@pytest.mark.parametrize("rrsync", [False, pytest.param(True, marks=needs_rrsync)], ids=["ssh", "rrsync"])
def test_a_xet_layout_peer_is_copied_as_regular_files_that_verify(tmp_path, peer, rrsync):
    xet_layout(peer, etag(BIG), len(FILES[BIG]))
    os.chmod(os.path.join(str(peer), "blobs", "cd", XET), 0o400)
    cache = tmp_path / "hub"
    out = job(cache, peer, real_copier(tmp_path, peer, rrsync)).run(check_mode=False)
    assert out["verified"] is True and out["copied"]["blobs"] == 3, out
    for name in os.listdir(cache / FOLDER / "blobs"):
        st = os.lstat(cache / FOLDER / "blobs" / name)
        assert stat.S_ISREG(st.st_mode) and st.st_nlink == 1, name
    assert (cache / FOLDER / "blobs" / etag(BIG)).read_bytes() == FILES[BIG]
    assert not (cache / "blobs").exists()                # a regular repo blob, not a store of its own
    rev = next(iter(next(iter(scan_cache_dir(cache).repos)).revisions))
    assert rev.commit_hash == COMMIT and rev.nb_files == 4
    assert job(cache, state="verified", rehash=True).run(check_mode=False)["verified"] is True


@needs_rsync
@pytest.mark.parametrize("rrsync", [False, pytest.param(True, marks=needs_rrsync)], ids=["ssh", "rrsync"])
def test_a_peer_whose_blob_is_a_link_out_of_its_store_is_blamed(tmp_path, peer, rrsync):
    secret = tmp_path / "peer-secret"
    secret.write_bytes(FILES[BIG])
    blob = peer / FOLDER / "blobs" / etag(BIG)
    blob.unlink()
    os.symlink(str(secret), blob)
    cache = tmp_path / "hub"
    with pytest.raises(peer_files.PeerError) as err:
        job(cache, peer, real_copier(tmp_path, peer, rrsync)).run(check_mode=False)
    assert err.value.cause == "bad_copy" and "a symbolic link to %r" % str(secret) in str(err.value)
    assert os.listdir(cache / FOLDER / "blobs") == []


@needs_rsync
def test_a_fifo_on_the_peer_is_blamed_not_waited_for(tmp_path, peer):
    blob = peer / FOLDER / "blobs" / etag("config.json")
    blob.unlink()
    os.mkfifo(blob)
    with pytest.raises(peer_files.PeerError) as err:
        job(tmp_path / "hub", peer, real_copier(tmp_path, peer)).run(check_mode=False)
    assert err.value.cause == "bad_copy" and "not a regular file" in str(err.value)


@needs_rrsync
def test_rrsync_refuses_copy_links_which_is_why_the_receiver_resolves_xet_links(tmp_path, peer):
    dest = tmp_path / "dest"
    dest.mkdir()
    proc = subprocess.run([RSYNC, "--copy-links", "--rsh=" + fake_ssh(tmp_path, str(peer)), "root@gpu1:" + FOLDER + "/",
                           str(dest) + "/"], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "-L has been disabled" in proc.stderr


# ----------------------------------------------------------------------------- the peer key
def test_the_lab_peer_key_is_restricted_to_a_read_only_rsync_from_the_labs_network():
    line = labctl.peer_authorized_key("ssh-ed25519 AAAAC3Nza peer@lab\n", "10.213.7.0/24")
    assert line == ('from="10.213.7.0/24",restrict,command="/usr/bin/rrsync -ro /var/lib/modelswap" '
                    'ssh-ed25519 AAAAC3Nza peer@lab\n')
    with pytest.raises(labctl.LabError):
        labctl.peer_authorized_key("ssh-ed25519 AAAA x", '10.0.0.0/24" ,command="sh')


@needs_rsync
def test_a_folder_on_the_peer_is_blamed_and_its_tree_never_copied(tmp_path, peer):
    blob = peer / FOLDER / "blobs" / etag(BIG)
    blob.unlink()
    (blob / "deep").mkdir(parents=True)
    (blob / "deep" / "junk").write_bytes(b"x" * 1000)
    cache = tmp_path / "hub"
    with pytest.raises(peer_files.PeerError) as err:
        job(cache, peer, real_copier(tmp_path, peer)).run(check_mode=False)
    assert err.value.cause == "bad_copy" and "a directory" in str(err.value)
    assert os.listdir(cache / FOLDER / "blobs") == []


def test_a_killed_copys_staging_folder_is_scrapped_not_trusted(tmp_path, peer):
    cache = tmp_path / "hub"
    staging = cache / ".locks" / FOLDER / peer_snapshot.STAGING_NAME
    (staging / FOLDER / "blobs").mkdir(parents=True)
    os.symlink("/etc/passwd", staging / FOLDER / "blobs" / etag(BIG))      # left by a killed copy
    out = job(cache, peer, Copier()).run(check_mode=False)
    assert out["verified"] is True and str(staging) in out["removed"] and not staging.exists()
    assert stat.S_ISREG(os.lstat(cache / FOLDER / "blobs" / etag(BIG)).st_mode)


# ----------------------------------------------------------------------------- into the receiver's Xet store
def xet_job(cache, peer, copier, xet_hash=XET, **opts):
    """A copy whose expected list carries the Hub's xet hash of the payload (as hf_snapshot's
    target_files does where the Hub stores the file with Xet)."""
    files = [dict(f, xet_hash=xet_hash) if f["path"] == BIG else f for f in expected()]
    if getattr(copier, "source", "") is None:
        copier.source = str(peer)
    return peer_snapshot.PeerJob(REPO, COMMIT, copier=copier, cache_dir=str(cache), files=files, revision="main",
                                 state="copied", source="10.0.0.11", source_name="gpu1",
                                 source_cache_dir=str(peer), **opts)


@needs_rsync
def test_a_copy_with_the_listings_xet_hash_lands_in_the_receivers_store_as_huggingface_hub_would(tmp_path, peer):
    xet_layout(peer, etag(BIG), len(FILES[BIG]))
    cache = tmp_path / "hub"
    out = xet_job(cache, peer, real_copier(tmp_path, peer)).run(check_mode=False)
    assert out["verified"] is True and out["shared_store"] == {"published": 1, "kept": []}, out
    blob = cache / FOLDER / "blobs" / etag(BIG)
    payload = cache / "blobs" / "cd" / XET
    assert os.readlink(blob) == "../../blobs/cd/" + XET and stat.S_ISREG(os.lstat(payload).st_mode)
    assert payload.read_bytes() == FILES[BIG]
    assert stat.S_IMODE(os.lstat(payload).st_mode) & 0o222 == 0          # read-only, as hf_xet's payloads
    # huggingface_hub's own reading of its layout: a marked store, a usable entry, the link listed
    assert _shared_blobs.is_shared_blobs_dir(cache / "blobs")
    assert _shared_blobs.has_shared_blob(xet_hash=XET, cache_dir=cache, expected_size=len(FILES[BIG]))
    assert _shared_blobs._read_valid_manifest_references(payload, cache) == {blob}
    for name in os.listdir(cache / FOLDER / "blobs"):         # the small files stay regular blobs
        if name != etag(BIG):
            assert stat.S_ISREG(os.lstat(cache / FOLDER / "blobs" / name).st_mode), name
    # the manifest still vouches (the payload kept its inode): the rerun does nothing, a rehash agrees
    again = xet_job(cache, peer, real_copier(tmp_path, peer)).run(check_mode=False)
    assert again["verified"] is True and again["changed"] is False and again["copied"]["blobs"] == 0
    assert job(cache, state="verified", rehash=True).run(check_mode=False)["verified"] is True
    # and huggingface_hub's purge of the revision takes the payload with its last link
    scan = scan_cache_dir(cache)
    scan.delete_revisions(COMMIT).execute()
    assert not os.path.lexists(payload) and not os.path.lexists(cache / FOLDER)


def test_without_xet_or_a_hash_the_copy_stays_regular_blobs(tmp_path, peer):
    cache = tmp_path / "hub"
    out = xet_job(cache, peer, Copier(), use_xet=False).run(check_mode=False)
    assert out["verified"] is True and out["shared_store"] == {"published": 0, "kept": []}
    assert stat.S_ISREG(os.lstat(cache / FOLDER / "blobs" / etag(BIG)).st_mode)
    assert not (cache / "blobs").exists()


def test_a_payload_the_store_already_has_is_neither_replaced_nor_trusted(tmp_path, peer):
    """Another repo's payload with that hash: its links and manifests vouch for its inode, so it is
    not replaced; and its bytes were not checked here, so this repo keeps its own checked blob."""
    cache = tmp_path / "hub"
    synthetic_cache.add_revision(cache, "lab/other", "1" * 40, {BIG: FILES[BIG]})
    other_blob = os.path.join(str(cache), "models--lab--other", "blobs", etag(BIG))
    assert _shared_blobs.publish_blob_to_shared_store(blob_path=other_blob, xet_hash=XET, cache_dir=str(cache),
                                                      expected_size=len(FILES[BIG]))
    payload = cache / "blobs" / "cd" / XET
    before = os.lstat(payload)
    out = xet_job(cache, peer, Copier()).run(check_mode=False)
    assert out["verified"] is True and out["shared_store"]["published"] == 0
    [kept] = out["shared_store"]["kept"]
    assert kept["blob"] == etag(BIG) and "already has" in kept["because"], kept
    assert stat.S_ISREG(os.lstat(cache / FOLDER / "blobs" / etag(BIG)).st_mode)
    assert os.path.samestat(before, os.lstat(payload))


def test_an_unmarked_blobs_folder_is_not_adopted_as_a_store(tmp_path, peer):
    cache = tmp_path / "hub"
    (cache / "blobs").mkdir(parents=True)
    (cache / "blobs" / "someone-elses").write_text("x")
    out = xet_job(cache, peer, Copier()).run(check_mode=False)
    assert out["verified"] is True and out["shared_store"]["published"] == 0
    assert "not a marked shared store" in out["shared_store"]["kept"][0]["because"]
    assert sorted(os.listdir(cache / "blobs")) == ["someone-elses"]


def test_a_held_payload_lock_keeps_the_blob_regular(tmp_path, peer):
    import fcntl
    cache = tmp_path / "hub"
    (cache / "blobs" / "cd").mkdir(parents=True)
    (cache / "blobs" / ".huggingface-shared-blobs").write_text("1\n")
    with open(cache / "blobs" / "cd" / (XET + ".lock"), "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        out = xet_job(cache, peer, Copier()).run(check_mode=False)
    assert out["verified"] is True and "holds the lock" in out["shared_store"]["kept"][0]["because"]
    assert stat.S_ISREG(os.lstat(cache / FOLDER / "blobs" / etag(BIG)).st_mode)


def test_a_xet_hash_that_is_not_one_is_refused_before_anything_is_written(tmp_path, peer):
    cache = tmp_path / "hub"
    with pytest.raises(peer_files.PeerError) as err:
        xet_job(cache, peer, Copier(), xet_hash="../../etc").run(check_mode=False)
    assert err.value.cause == "bad_files" and "xet hash '../../etc'" in str(err.value)
    assert not cache.exists()
