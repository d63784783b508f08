"""Every module that reads or changes a Hugging Face cache works on the Xet cache layout.

huggingface_hub >= 2.x downloading through hf_xet keeps a cache-wide shared store: payloads at
``<cache>/blobs/<xx>/<xet hash>`` (regular, read-only), ``<hash>.refs`` and ``<hash>.lock`` beside
them, the marker ``<cache>/blobs/.huggingface-shared-blobs``; each repo's ``blobs/<etag>`` is a
relative link into it. The caches here are built by huggingface_hub's own functions: a plain cache
(tests.support.synthetic_cache) whose repo blobs are then published with
``huggingface_hub.utils._shared_blobs.publish_blob_to_shared_store``, exactly what
``hf_hub_download`` does after a Xet download, so two repos with the same file share one payload.
"""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest
from huggingface_hub import scan_cache_dir
from huggingface_hub.utils import _shared_blobs

from ansible_collections.modelswap.vllm.plugins.module_utils.hub import hf_verify
from ansible_collections.modelswap.vllm.plugins.module_utils.store import disk_plan
from ansible_collections.modelswap.vllm.plugins.module_utils.store import plan_inputs
from ansible_collections.modelswap.vllm.plugins.module_utils.store import protections
from ansible_collections.modelswap.vllm.plugins.module_utils.store import purge_items
from ansible_collections.modelswap.vllm.plugins.module_utils.store import model_purge
from ansible_collections.modelswap.vllm.plugins.module_utils.store import model_store
from ansible_collections.modelswap.vllm.plugins.module_utils.store import store_scan
from ansible_collections.modelswap.vllm.plugins.module_utils.store import xet_store
from ansible_collections.modelswap.vllm.plugins.module_utils.store import page_cache_warm
from tests.support import synthetic_cache
from tests.support.scratch_fs import tree_usage
from tests.support.synthetic_cache import A, B, C, W1

pytestmark = pytest.mark.unit

ONE = synthetic_cache.folder_for("org/one")
TWO = synthetic_cache.folder_for("org/two")
THREE = synthetic_cache.folder_for("org/three")
D = "d" * 40
W1_WEIGHTS = synthetic_cache.etag_for("model.safetensors", W1["model.safetensors"])


def xet_hash(data: bytes) -> str:
    """A stand-in Xet file hash: content-addressed, 64 hex (what the store is keyed by)."""
    return hashlib.sha256(b"xet:" + data).hexdigest()


def xetify(cache: Path, repo_id: str) -> list:
    """Publish every regular blob of ``repo_id`` to the shared store, as hf_hub_download does after
    a Xet download; returns the payload paths."""
    blobs = cache / synthetic_cache.folder_for(repo_id) / "blobs"
    out = []
    for blob in sorted(blobs.iterdir()):
        if blob.is_symlink() or not blob.is_file() or blob.name.endswith(".incomplete"):
            continue
        data = blob.read_bytes()
        h = xet_hash(data)
        assert _shared_blobs.publish_blob_to_shared_store(
            blob_path=str(blob), xet_hash=h, cache_dir=cache, expected_size=len(data))
        out.append(cache / "blobs" / h[:2] / h)
    return out


def payload_of(data: bytes, cache: Path) -> Path:
    h = xet_hash(data)
    return cache / "blobs" / h[:2] / h


@pytest.fixture
def xet_cache(tmp_path):
    """org/one at A and B (sharing blobs), org/two at C, org/three at D with W1's files (its
    weights share one payload with org/one): all published to the shared store."""
    cache = (tmp_path / "hub")
    synthetic_cache.add_two_repos(cache)
    synthetic_cache.add_revision(cache, "org/three", D, W1)
    cache = Path(os.path.realpath(cache))
    for repo_id in ("org/one", "org/two", "org/three"):
        xetify(cache, repo_id)
    return cache


@pytest.fixture
def mixed_cache(tmp_path):
    """The same repos, only org/one and org/three published (org/two stays a plain repo)."""
    cache = tmp_path / "hub"
    synthetic_cache.add_two_repos(cache)
    synthetic_cache.add_revision(cache, "org/three", D, W1)
    cache = Path(os.path.realpath(cache))
    for repo_id in ("org/one", "org/three"):
        xetify(cache, repo_id)
    return cache


def test_the_layout_is_huggingface_hubs(xet_cache):
    store_dir = xet_cache / "blobs"
    assert _shared_blobs.is_shared_blobs_dir(store_dir)
    assert (store_dir / ".huggingface-shared-blobs").read_text() == "1\n"
    link = xet_cache / ONE / "blobs" / W1_WEIGHTS
    payload = payload_of(W1["model.safetensors"], xet_cache)
    assert os.readlink(link) == "../../blobs/%s/%s" % (payload.parent.name, payload.name)
    assert _shared_blobs.shared_blob_target(link, xet_cache) == payload
    # one payload for the two repos' weights, both links in its manifest
    refs = Path(str(payload) + ".refs").read_text().split()
    assert sorted(refs) == sorted(["%s/blobs/%s" % (ONE, W1_WEIGHTS), "%s/blobs/%s" % (THREE, W1_WEIGHTS)])


# ------------------------------------------------------------------------------------ 1. reading
@pytest.mark.parametrize("layout", ["xet", "mixed"])
def test_the_store_folder_is_not_a_repo_and_the_scan_agrees_with_huggingface_hub(layout, xet_cache, mixed_cache):
    cache = xet_cache if layout == "xet" else mixed_cache
    store = store_scan.scan_store(str(cache), "")
    hf = scan_cache_dir(cache)
    assert not hf.warnings and not store.warnings
    assert sorted(store.repos) == sorted([ONE, TWO, THREE])   # no "blobs" repo, no warning
    for hrepo in hf.repos:
        repo = store.repo(hrepo.repo_id)
        assert not repo.problems
        assert repo.size == hrepo.size_on_disk
        for hrev in hrepo.revisions:
            assert repo.revision_size(hrev.commit_hash) == hrev.size_on_disk
            assert repo.revisions[hrev.commit_hash].files == len(hrev.files)
    # the store itself: each payload once
    assert sorted(store.shared) == sorted(str(p) for p in _shared_blobs.shared_store_blob_paths(cache))
    assert sum(sp.size for sp in store.shared.values()) + sum(
        b.size for r in store.repos.values() for b in r.blobs.values() if not b.shared) == hf.size_on_disk
    assert store.unreferenced_payloads() == []


def test_the_store_folder_is_never_a_purge_item(xet_cache):
    store = store_scan.scan_store(str(xet_cache), "")
    for path in (xet_cache / "blobs", next((xet_cache / "blobs").glob("*/*"))):
        with pytest.raises(plan_inputs.PlanError, match="not a purgeable item"):
            purge_items.item_for_path(store, str(path))
    state = protections.build_protections(store, models={})
    refused, absent, chosen = model_purge.judge_items(store, [str(xet_cache / "blobs"), "blobs"],
                                                      roots=[str(xet_cache)], models={}, state=state)
    assert not chosen and [r["rule"] for r in refused] == ["input"] and absent == ["blobs"]
    items, _excluded = purge_items.all_candidates(store, [])
    assert sorted(i.ident for i in items) == ["org/one", "org/three", "org/two"]


# ------------------------------------------------------------------------------ 2. disk accounting
CASES = [
    ("one-repo-whose-weights-another-repo-links", [[A, B]]),
    ("the-other-repo-then-the-shared-weights-go", [[A, B], [D]]),
    ("a-revision-then-its-repo", [[A], [B]]),
    ("all-at-once", [[A, B, C, D]]),
]


@pytest.mark.parametrize("layout", ["xet", "mixed"])
@pytest.mark.parametrize("steps", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_a_payload_counts_once_and_frees_only_with_its_last_link(layout, steps, xet_cache, mixed_cache):
    cache = xet_cache if layout == "xet" else mixed_cache
    store = store_scan.scan_store(str(cache), "")
    sim = model_store.DeletionSimulator(store)
    folders = {A: ONE, B: ONE, C: TWO, D: THREE}
    for commits in steps:
        hf = scan_cache_dir(cache)
        strategy = hf.delete_revisions(*commits)
        effects = [sim.apply_revisions(f, [c for c in commits if folders[c] == f])
                   for f in sorted({folders[c] for c in commits})]
        # huggingface_hub's own expectation (a shared payload only when every link goes)
        assert sum(e.expected for e in effects) == strategy.expected_freed_size
        before = tree_usage(cache)
        strategy.execute()
        # the allocated bytes that really left (the payloads' prefix folders stay, as the library leaves them)
        assert sum(e.bytes for e in effects) == before - tree_usage(cache)
        # apparent bytes: regular files only (a link is never counted as its payload), each payload once
        payload_sizes = sum(store.shared[p].size for e in effects for p in e.payloads)
        plain = sum(store.repos[f].blobs[n].size for e, f in zip(effects, sorted({folders[c] for c in commits}))
                    for n in e.blobs if not store.repos[f].blobs[n].shared)
        assert sum(e.expected for e in effects) == payload_sizes + plain


def test_weights_shared_by_two_repos_count_once_in_the_plan(xet_cache):
    store = store_scan.scan_store(str(xet_cache), "")
    weights = str(payload_of(W1["model.safetensors"], xet_cache))
    size = len(W1["model.safetensors"])
    sim = model_store.DeletionSimulator(store)
    one = sim.apply(model_store.Item("repo", folder=ONE))
    assert weights not in one.payloads and one.size < size        # org/three still links them
    three = sim.apply(model_store.Item("repo", folder=THREE))
    assert weights in three.payloads and three.size >= size and one.size + three.size < 2 * size
    # disk_plan's candidates: the cumulative bytes are the bytes of the whole cache once
    fs = {"available": 0}
    plan = disk_plan.make_plan(store, fs, needed_bytes=10 ** 12, headroom_bytes=0,
                               candidates=[model_store.Item("repo", folder=f) for f in (ONE, TWO, THREE)])
    before = tree_usage(xet_cache)
    scan_cache_dir(xet_cache).delete_revisions(A, B, C, D).execute()
    assert plan["candidates"][-1]["cumulative_bytes"] == before - tree_usage(xet_cache)


# ------------------------------------------------------------------------------------------ 3. purge
def plan_for(cache, items, **options):
    store = store_scan.scan_store(str(cache), "")
    state = protections.build_protections(store, models={})
    plan = model_purge.plan_purge(store, state, roots=[str(cache)], items=items, **options)
    return store, plan


def purge(cache, items, **options):
    store, plan = plan_for(cache, items, **options)
    result = plan.result()
    before = tree_usage(cache)
    result = model_purge.apply_purge(store, plan, result)
    return plan, result, before - tree_usage(cache)


def links_resolve(cache: Path) -> None:
    """Every repo link of the cache reads its content (no broken link); huggingface_hub agrees."""
    hf = scan_cache_dir(cache)
    assert not hf.warnings, hf.warnings
    for repo in hf.repos:
        for rev in repo.revisions:
            for f in rev.files:
                assert f.file_path.read_bytes()


def test_a_repo_purge_removes_only_payloads_no_other_link_needs(xet_cache):
    weights = payload_of(W1["model.safetensors"], xet_cache)
    store, plan = plan_for(xet_cache, ["org/one"])
    # check mode names the payloads it would remove: org/one's own (its configs and tokenizer
    # are org/three's too, but W2's config is org/one's alone), never the shared weights
    named = [row["path"] for row in plan.result()["shared_removed"]]
    assert str(payload_of(b'{"a": 2}', xet_cache)) in named and str(weights) not in named
    assert all(not row["unreferenced"] for row in plan.shared)
    plan, result, freed = purge(xet_cache, ["org/one"])
    assert not result["left"] and result["changed"]
    assert [r["path"] for r in result["shared_removed"]] == named and not result["shared_kept"]
    assert freed == result["planned_bytes"]
    assert not (xet_cache / ONE).exists()
    for path in named:
        assert not any(os.path.lexists(path + x) for x in ("", ".refs", ".lock"))
    assert weights.is_file()
    links_resolve(xet_cache)
    assert Path(str(weights) + ".refs").read_text().split() == ["%s/blobs/%s" % (THREE, W1_WEIGHTS)]
    # the last link goes with org/three: so does the payload
    plan, result, freed = purge(xet_cache, ["org/three", "org/two"])
    assert not result["left"] and str(weights) in [r["path"] for r in result["shared_removed"]]
    assert freed == result["planned_bytes"]
    assert xet_store.store_payloads(str(xet_cache)) == []
    assert sorted(p.name for p in (xet_cache / "blobs").rglob("*") if p.is_file()) == [".huggingface-shared-blobs"]


def test_a_revision_purge_unlinks_its_blob_links_and_keeps_what_the_other_revision_links(xet_cache):
    config_a = payload_of(b'{"a": 1}', xet_cache)
    assert config_a.is_file()
    plan, result, freed = purge(xet_cache, ["org/one@" + A])
    assert not result["left"]
    # W1's config is org/three's too: it stays; nothing org/one@B links was touched
    assert [r["path"] for r in result["shared_removed"]] == []
    assert config_a.is_file()
    links_resolve(xet_cache)
    assert freed == result["planned_bytes"]


def test_a_purge_that_died_between_the_links_and_the_payloads_is_finished_by_the_rerun(xet_cache):
    only_one = payload_of(b'{"a": 2}', xet_cache)
    # the purge died right after huggingface_hub deleted the repo folder, before any sweep
    shutil.rmtree(xet_cache / ONE)
    assert only_one.is_file()
    store, plan = plan_for(xet_cache, ["org/one"])
    result = plan.result()
    assert result["absent"] == ["org/one"] and result["changed"] is True
    assert [r["path"] for r in result["shared_removed"]] == [str(only_one)]
    assert result["shared_removed"][0]["unreferenced"] is True and result["planned_bytes"] > 0
    before = tree_usage(xet_cache)
    result = model_purge.apply_purge(store, plan, result)
    assert [r["path"] for r in result["shared_removed"]] == [str(only_one)]
    assert before - tree_usage(xet_cache) == result["planned_bytes"]
    assert not any(os.path.lexists(str(only_one) + x) for x in ("", ".refs", ".lock"))
    links_resolve(xet_cache)
    # clean_orphans: false leaves unreferenced payloads alone
    shutil.rmtree(xet_cache / TWO)
    _store, plan = plan_for(xet_cache, [], clean_orphans=False)
    assert plan.shared == []


def test_the_links_not_the_manifest_decide(xet_cache):
    """A lost .refs (a hint) neither keeps a payload nobody links nor frees one a link still needs."""
    only_one = payload_of(b'{"a": 2}', xet_cache)
    weights = payload_of(W1["model.safetensors"], xet_cache)
    os.unlink(str(only_one) + ".refs")
    os.unlink(str(weights) + ".refs")
    # huggingface_hub's own sweep leaks a payload without manifest: model_purge does not
    plan, result, _freed = purge(xet_cache, ["org/one"])
    assert not result["left"] and str(only_one) in [r["path"] for r in result["shared_removed"]]
    assert not only_one.exists()
    assert weights.is_file()      # org/three links it: no manifest says so, the link does
    links_resolve(xet_cache)
    # a payload the plan expected to free that a link reaches by the time of the delete is kept
    store, plan = plan_for(xet_cache, ["org/three"])
    assert str(weights) in [row["path"] for row in plan.shared]
    extra = xet_cache / TWO / "blobs" / W1_WEIGHTS
    os.symlink("../../blobs/%s/%s" % (weights.parent.name, weights.name), extra)
    result = model_purge.apply_purge(store, plan, plan.result())
    assert weights.is_file() and not result["left"]
    kept = {r["path"]: r["because"] for r in result["shared_kept"]}
    assert kept[str(weights)] == "%s still links to it" % extra


def test_a_damaged_xet_repo_goes_whole_and_its_payloads_with_it(xet_cache):
    weights = payload_of(W1["model.safetensors"], xet_cache)
    os.unlink(xet_cache / THREE / "refs" / "main")
    (xet_cache / THREE / "refs" / "main").write_text("0" * 40)    # a ref to a missing revision
    store, plan = plan_for(xet_cache, ["org/one", "org/three"])
    assert not plan.deletions[1].uses_hf
    result = model_purge.apply_purge(store, plan, plan.result())
    assert not result["left"] and str(weights) in [r["path"] for r in result["shared_removed"]]
    assert not weights.exists()


def test_deletion_stays_in_the_cache_and_never_follows_a_link(xet_cache, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "victim.bin"
    victim.write_bytes(W1["model.safetensors"])
    # a repo blob that links outside the cache, and a "payload" of the store that is a link
    link = xet_cache / TWO / "blobs" / synthetic_cache.etag_for("model.safetensors", b"X" * 20000)
    os.unlink(link)
    os.symlink(str(victim), link)
    fake = "ee" + "0" * 62
    (xet_cache / "blobs" / "ee").mkdir()
    os.symlink(str(victim), xet_cache / "blobs" / "ee" / fake)
    store = store_scan.scan_store(str(xet_cache), "")
    assert any("links outside the cache" in p for p in store.repo("org/two").problems)
    assert str(xet_cache / "blobs" / "ee" / fake) not in store.shared
    plan, result, _freed = purge(xet_cache, ["org/two"])
    assert not result["left"] and not (xet_cache / TWO).exists()
    assert victim.read_bytes() == W1["model.safetensors"]
    assert os.path.islink(xet_cache / "blobs" / "ee" / fake)
    # remove_shared_payload refuses anything but a store payload path
    for path in (str(victim), str(xet_cache / ONE / "blobs" / W1_WEIGHTS)):
        assert xet_store.remove_shared_payload(str(xet_cache), path)[1].startswith("it is not a payload path")
    assert xet_store.remove_shared_payload(str(xet_cache), str(xet_cache / "blobs" / "ee" / fake))[1] \
        == "it is not a regular file"
    assert victim.exists()
    links_resolve(xet_cache)


def test_a_payload_whose_lock_is_held_is_kept(xet_cache):
    from filelock import FileLock
    only_one = payload_of(b'{"a": 2}', xet_cache)
    shutil.rmtree(xet_cache / ONE)
    store, plan = plan_for(xet_cache, [])
    with FileLock(str(only_one) + ".lock"):
        result = model_purge.apply_purge(store, plan, plan.result())
    assert only_one.is_file() and not result["shared_removed"]
    assert "holds its lock" in result["shared_kept"][0]["because"]


def test_disk_plan_reclaims_unreferenced_payloads_with_the_orphans(xet_cache):
    only_one = payload_of(b'{"a": 2}', xet_cache)
    shutil.rmtree(xet_cache / ONE)
    store = store_scan.scan_store(str(xet_cache), "")
    device = os.stat(xet_cache).st_dev
    rows, reclaimable = disk_plan.shared_table(store, device)
    assert [r["path"] for r in rows] == [str(only_one)] and [sp.path for sp in reclaimable] == [str(only_one)]
    plan = disk_plan.make_plan(store, {"available": 0}, needed_bytes=1, headroom_bytes=0, candidates=[],
                               orphans=reclaimable)
    assert plan["orphan_bytes"] == rows[0]["bytes"] > 0 and plan["verdict"] == "fits_after_purge"


# ------------------------------------------------------------------------------- 4. verification
def entry(data: bytes, lfs: bool) -> dict:
    if lfs:
        return {"size": len(data), "blob_id": "0" * 40, "lfs_sha256": hashlib.sha256(data).hexdigest()}
    return {"size": len(data), "blob_id": synthetic_cache.git_blob_id(data)}


@pytest.mark.parametrize("layout", ["xet", "mixed"])
def test_a_xet_snapshot_verifies_through_its_links(layout, xet_cache, mixed_cache):
    cache = xet_cache if layout == "xet" else mixed_cache
    for folder, commit in ((ONE, A), (TWO, C), (THREE, D)):
        snap = cache / folder / "snapshots" / commit
        for f in sorted(p for p in snap.rglob("*") if not p.is_dir()):
            data = f.read_bytes()
            res = hf_verify.check_file(str(f), entry(data, f.name.endswith(".safetensors")), "full",
                                       cache_dir=str(cache))
            assert res["ok"], res
            assert res["hashed"] == len(data)


def _bad_blob(cache: Path, make) -> Path:
    """org/one@A's weights blob replaced by ``make(blob_path)`` (a link elsewhere)."""
    blob = cache / ONE / "blobs" / W1_WEIGHTS
    os.unlink(blob)
    make(blob)
    return cache / ONE / "snapshots" / A / "model.safetensors"


BAD_TARGETS = [
    ("absolute-path-outside", lambda cache, tmp, blob: os.symlink(str(tmp / "outside.bin"), blob),
     "not to a payload of the shared store"),
    ("relative-path-out-of-the-cache", lambda cache, tmp, blob: os.symlink("../../../outside.bin", blob),
     "not to a payload of the shared store"),
    ("a-device", lambda cache, tmp, blob: os.symlink("/dev/zero", blob), "not to a payload of the shared store"),
    ("a-fifo-in-the-store", lambda cache, tmp, blob: (os.mkfifo(cache / "blobs" / "ff" / ("ff" + "1" * 62)),
                                                      os.symlink("../../blobs/ff/" + "ff" + "1" * 62, blob)),
     "which is not a regular file"),
    ("a-store-path-through-a-symlinked-prefix", lambda cache, tmp, blob: (
        os.symlink(str(tmp), cache / "blobs" / "aa"), shutil.copy(tmp / "outside.bin", tmp / ("aa" + "2" * 62)),
        os.symlink("../../blobs/aa/" + "aa" + "2" * 62, blob)), "outside the shared store"),
    ("a-bare-hash-not-in-its-prefix", lambda cache, tmp, blob: (
        shutil.copy(tmp / "outside.bin", cache / "blobs" / "ff" / ("00" + "3" * 62)),
        os.symlink("../../blobs/ff/" + "00" + "3" * 62, blob)), "not to a payload of the shared store"),
]


@pytest.mark.parametrize("make,words", [b[1:] for b in BAD_TARGETS], ids=[b[0] for b in BAD_TARGETS])
def test_a_blob_link_that_leaves_the_store_is_refused_never_read(make, words, xet_cache, tmp_path):
    data = W1["model.safetensors"]
    (tmp_path / "outside.bin").write_bytes(data)     # the right content: still not trusted
    (xet_cache / "blobs" / "ff").mkdir(exist_ok=True)
    pointer = _bad_blob(xet_cache, lambda blob: make(xet_cache, tmp_path, blob))
    with pytest.raises(hf_verify.Untrusted, match=words):
        hf_verify.cache_target(str(pointer), str(xet_cache))
    res = hf_verify.check_file(str(pointer), entry(data, True), "full", cache_dir=str(xet_cache))
    assert not res["ok"] and res["reason"].startswith("untrusted: ") and words in res["reason"], res
    assert res["hashed"] == 0
    res = hf_verify.check_file(str(pointer), entry(data, True), "size", cache_dir=str(xet_cache))
    assert not res["ok"] and res["reason"].startswith("untrusted: ")


def test_a_snapshot_link_out_of_its_repo_and_a_fifo_are_refused(xet_cache, tmp_path):
    snap = xet_cache / TWO / "snapshots" / C
    os.symlink("../../../%s/blobs/%s" % (ONE, W1_WEIGHTS), snap / "borrowed.safetensors")
    res = hf_verify.check_file(str(snap / "borrowed.safetensors"), entry(W1["model.safetensors"], True),
                               cache_dir=str(xet_cache))
    assert not res["ok"] and "outside its repo's blobs" in res["reason"]
    os.mkfifo(snap / "pipe")
    res = hf_verify.check_file(str(snap / "pipe"), entry(b"", False), cache_dir=str(xet_cache))
    assert not res["ok"] and res["reason"].startswith("untrusted: ")
    # without a cache (a local_dir), a FIFO is still never read
    res = hf_verify.check_file(str(snap / "pipe"), entry(b"", False))
    assert not res["ok"] and "not a regular file" in res["reason"]


def test_the_plain_layout_verifies_as_before(tmp_path):
    cache = tmp_path / "hub"
    synthetic_cache.add_two_repos(cache)
    cache = Path(os.path.realpath(cache))
    snap = cache / ONE / "snapshots" / B
    for f in sorted(p for p in snap.rglob("*") if not p.is_dir()):
        data = f.read_bytes()
        assert hf_verify.check_file(str(f), entry(data, f.name.endswith(".safetensors")),
                                    cache_dir=str(cache))["ok"]


# ------------------------------------------------------------------------- 5. pre-staging
def test_page_cache_warm_reads_a_xet_snapshot_through_its_links(xet_cache):
    snap = xet_cache / ONE / "snapshots" / A
    files = page_cache_warm.snapshot_files(str(snap))
    assert sorted(os.path.relpath(p, snap) for p, _unused in files) == sorted(W1)
    assert sum(size for _unused, size in files) == sum(len(v) for v in W1.values())
    out = page_cache_warm.warm(files)
    assert out["complete"] and out["bytes_read"] == sum(len(v) for v in W1.values())
    # two snapshot entries that share one payload are read once
    os.symlink("model.safetensors", snap / "again.safetensors")
    assert len(page_cache_warm.snapshot_files(str(snap))) == len(W1)
