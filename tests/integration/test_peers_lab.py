"""One download per site (model_fetch with peers) and a shared store, on lab hosts over SSH.

A lab of its own (tests/lab/peerlab.py): gpu1..gpu4 of one site, gpu5 and gpu6 mounting one
folder of the lab machine as their model store. The local Hub's request log says what crossed
the "uplink": each file body once per site. Only the hosts that download from the Hub get
huggingface_hub (gpu1, gpu5); the others receive copies with rsync and verify them with Python's
standard library. Each test works in its own cache folder (the shared store is emptied by the
lab's reset), so the tests do not depend on each other.
"""
from __future__ import annotations

import json
import secrets
import shlex

import pytest

from tests.lab import peerlab

pytestmark = pytest.mark.lab

SITE = ["gpu1", "gpu2", "gpu3", "gpu4"]
STORE_HOSTS = list(peerlab.SHARED)
COPY = "Copy the snapshot from the host the plan names, and verify every file"
FINAL = "Check the target here, one stat per file, and record it"
SHOW = "Show where each host's bytes come from"
OUTCOME = "Show where the bytes came from"
STORE_PATH = "/var/lib/modelswap/hf/hub"
# What each host serves to the others with the peer key (labctl.peer_authorized_key: rrsync -ro this
# folder): the store and the tests' caches (workdir) are under it.
SERVE_ROOT = peerlab.labctl.PEER_SERVE_ROOT_IN_HOST


@pytest.fixture(scope="module")
def plab():
    try:
        with peerlab.peer_lab(hosts=6) as lab:
            for host in ("gpu1", "gpu5"):
                peerlab.ensure_hf_python(lab, host)
            yield lab
    except peerlab.PeerLabError as exc:
        pytest.skip(str(exc))


@pytest.fixture
def workdir(plab):
    name = "%s/test-peers-%s" % (SERVE_ROOT, secrets.token_hex(4))
    yield name
    for host in plab.hosts:
        plab.ssh(host, "rm -rf %s" % shlex.quote(name), check=False)


def catalog(lab) -> dict:
    return {name: {"repo_id": m["repo_id"], "revision": m["commit"]} for name, m in lab.models.items()}


def fetch_vars(lab, workdir, serve="tiny-b", cache=None, **more) -> dict:
    out = {"modelswap_models": catalog(lab), "modelswap_serve": serve, "model_fetch_peers": True,
           "model_fetch_endpoint": lab.hub_url, "model_fetch_use_xet": False,
           "model_fetch_python": peerlab.HF_VENV + "/bin/python",
           "model_fetch_cache_dir": cache or workdir + "/hub", "model_fetch_progress_dir": workdir + "/progress",
           "model_fetch_record": workdir + "/deployment.json", "model_fetch_poll_interval": 1,
           "model_fetch_peer_serve_root": SERVE_ROOT}
    out.update(more)
    return out


def mark(lab) -> int:
    return max((e["id"] for e in lab.hub.requests()), default=0)


def bodies(lab, since, repo):
    """GETs of file contents (the bytes that cross the uplink), per client address."""
    return [e for e in lab.hub.requests(since=since)
            if e["method"] == "GET" and "/resolve/" in e["path"] and repo in e["path"]]


def debug_msgs(run, task, host=None):
    return [e["event_data"]["res"].get("msg") for e in run.events
            if e.get("event") == "runner_on_ok" and e["event_data"].get("task") == task
            and (host is None or e["event_data"].get("host") == host)]


def done(run, task, host):
    """The results of ``task`` on ``host`` that ran (not skipped), in order."""
    found = [r for r in run.task_results(task, host) if r.get("_event") != "runner_on_skipped"]
    assert found, "no result for %r on %s (rc=%s):\n%s" % (task, host, run.rc, run.stdout[-4000:])
    return found


def manifest_of(lab, host, cache, commit, repo="lab/tiny-b"):
    folder = "models--" + repo.replace("/", "--")
    return json.loads(lab.ssh(host, "cat %s/%s/modelswap/%s.json" % (cache, folder, commit)).stdout)


def content_digests(lab, host, snapshot) -> dict:
    """sha256 of every file as it is on the host (through the snapshot's links)."""
    out = lab.ssh(host, "cd %s && find . -type l -o -type f | sort | xargs sha256sum" % snapshot).stdout
    return {line.split()[1][2:]: line.split()[0] for line in out.splitlines()}


def flip_a_byte(lab, host, path):
    """Silent rot: one byte changed, size and mtime as before (the manifest's stat still matches)."""
    lab.ssh(host, "python3 - %s <<'EOF'\nimport os, sys\np = os.path.realpath(sys.argv[1])\nst = os.stat(p)\n"
                  "with open(p, 'r+b') as f:\n    f.seek(1000); b = f.read(1); f.seek(1000); f.write(bytes([b[0] ^ 255]))\n"
                  "os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))\nEOF" % shlex.quote(path))


def uplink(lab, since, repo):
    """Every request that carried file bytes from the Hub (resolve GETs and, over Xet, the CAS's
    xorb ranges), per client address."""
    return [e for e in lab.hub.requests(since=since)
            if e["method"] == "GET" and repo in (e.get("repo") or e["path"])
            and (("/resolve/" in e["path"] and repo in e["path"]) or e.get("endpoint") == "xet-xorb")]


# make test samples Xet (what large repos use); the HTTP variant is the campaign's
@pytest.mark.parametrize("use_xet", [pytest.param(False, id="http", marks=pytest.mark.campaign), pytest.param(True, id="xet")])
def test_four_hosts_of_a_site_take_one_download_from_the_hub(plab, workdir, use_xet):
    """Over Xet the first host's repo blobs are links into its cache-wide store; the peers that copy
    from it get the bytes as regular files (never the links), verified before they are published,
    then moved into their own cache-wide store as hf_xet would have put them."""
    lab, commit = plab, plab.models["tiny-b"]["commit"]
    ev = fetch_vars(lab, workdir, model_fetch_use_xet=use_xet)
    limit = ",".join(SITE)
    since = mark(lab)
    preview = lab.playbook("playbooks/fetch.yml", ev, check=True, limit=limit)
    assert preview.rc == 0, preview.stdout[-4000:]
    lines = {h: debug_msgs(preview, SHOW, h)[0] for h in SITE}
    assert lines["gpu1"].startswith("gpu1: tiny-b from the Hub: 6.8 MiB (round 1)")
    assert lines["gpu2"] == "gpu2: tiny-b from gpu1: 6.8 MiB (round 2)"
    assert {lines["gpu3"], lines["gpu4"]} == {
        "gpu3: tiny-b from gpu1: 6.8 MiB (round 3)", "gpu4: tiny-b from gpu2: 6.8 MiB (round 3)"}
    assert bodies(lab, since, "lab/tiny-b") == []
    for host in SITE:
        assert lab.ssh(host, "test -e %s || echo absent" % workdir).stdout.strip() == "absent"

    since = mark(lab)
    run = lab.playbook("playbooks/fetch.yml", ev, limit=limit)
    assert run.rc == 0, run.stdout[-6000:]
    files = manifest_of(lab, "gpu1", workdir + "/hub", commit)["files"]
    assert {e["client"] for e in uplink(lab, since, "lab/tiny-b")} == {lab.address("gpu1")}
    if use_xet:      # the weights came as xorb ranges, only the small files through resolve
        assert [e for e in uplink(lab, since, "lab/tiny-b") if e.get("endpoint") == "xet-xorb"]
        assert lab.ssh("gpu1", "readlink %s/hub/models--lab--tiny-b/blobs/%s" % (
            workdir, files["model.safetensors"]["digest"])).stdout.startswith("../../blobs/")
    else:
        got = bodies(lab, since, "lab/tiny-b")
        assert sorted(e["path"].split("/resolve/%s/" % commit)[1] for e in got) == sorted(files)   # each body once
        assert sum(e["bytes_sent"] for e in got) == sum(f["size"] for f in files.values()) == 7116181
    outcome = debug_msgs(run, OUTCOME)[0]
    assert outcome[-1] == "in all: 6.8 MiB from the Hub, 20.4 MiB between hosts"
    assert outcome[:4] == ["gpu1: from the Hub, 6.8 MiB (round 1)", "gpu2: from gpu1, 6.8 MiB (round 2)",
                           "gpu3: from gpu1, 6.8 MiB (round 3)", "gpu4: from gpu2, 6.8 MiB (round 3)"]
    snapshot = "%s/hub/models--lab--tiny-b/snapshots/%s" % (workdir, commit)
    digests = content_digests(lab, "gpu1", snapshot)
    for host in SITE:
        final = done(run, FINAL, host)[-1]
        assert final["verified"] is True and final["verification"]["mode"] == "manifest"
        man = manifest_of(lab, host, workdir + "/hub", commit)
        assert {p: r["digest"] for p, r in man["files"].items()} == {p: r["digest"] for p, r in files.items()}
        assert content_digests(lab, host, snapshot) == digests
        record = json.loads(lab.ssh(host, "cat %s/deployment.json" % workdir).stdout)
        assert record["fetched"]["tiny-b"]["commit"] == commit and record["fetched"]["tiny-b"]["verified"] == "full"
        assert lab.ssh(host, "readlink %s/config.json" % snapshot).stdout.strip().startswith("../../blobs/")
    copied = done(run, COPY, "gpu4")[-1]
    assert copied["copied"]["from"] == "gpu2" and copied["verification"]["files"] == len(files)
    weights = "%s/hub/models--lab--tiny-b/blobs/%s" % (workdir, files["model.safetensors"]["digest"])
    payload = lab.ssh("gpu1", "readlink %s || true" % weights).stdout.strip()
    for host in SITE[1:]:
        # copies are bytes (no link, no special file came from the peer); over Xet the weights are
        # then put into the host's own shared store under the Hub's xet hash, as hf_xet would
        kinds = lab.ssh(host, "find %s/hub/models--lab--tiny-b/blobs -mindepth 1 ! -path %s -printf '%%y\\n' "
                        "| sort -u" % (workdir, weights)).stdout.split()
        assert kinds == ["f"], (host, kinds)
        if use_xet:
            assert lab.ssh(host, "readlink %s" % weights).stdout.strip() == payload, host
            store = lab.ssh(host, "cd %s/hub && cat blobs/.huggingface-shared-blobs && stat -c %%F %s && "
                            "cat %s.refs" % (workdir, payload[len("../../"):], payload[len("../../"):])).stdout
            assert store.splitlines() == ["1", "regular file", "models--lab--tiny-b/blobs/%s"
                                          % files["model.safetensors"]["digest"]], (host, store)
            assert done(run, COPY, host)[-1]["shared_store"] == {"published": 1, "kept": []}
        else:
            assert lab.ssh(host, "stat -c %%F %s" % weights).stdout.strip() == "regular file", host

    since = mark(lab)
    again = lab.playbook("playbooks/fetch.yml", ev, limit=limit)
    assert again.rc == 0 and all(again.changed(h) == 0 for h in SITE), again.stdout[-4000:]
    assert uplink(lab, since, "lab/tiny-b") == []


def link_with_the_right_bytes(lab, host, path, cache, commit):
    """A compromised peer: its blob becomes an absolute symlink to a file of the same bytes (which
    the receiver has too, at the same path), and its manifest vouches for it. rsync --archive
    would have copied the link, and the hash read through it would have matched."""
    lab.ssh(host, "python3 - %s %s %s <<'EOF'\nimport json, os, shutil, sys\n"
                  "path, cache, commit = sys.argv[1:]\nblob = os.path.realpath(path)\n"
                  "shutil.copyfile(blob, '/var/tmp/lure'); os.unlink(blob); os.symlink('/var/tmp/lure', blob)\n"
                  "m = os.path.join(cache, 'models--lab--tiny-b', 'modelswap', commit + '.json')\n"
                  "doc = json.load(open(m)); st = os.stat(path)\n"
                  "doc['files']['model.safetensors'].update(size=st.st_size, ino=st.st_ino, dev=st.st_dev, "
                  "mtime_ns=st.st_mtime_ns)\njson.dump(doc, open(m, 'w'))\nEOF"
            % (shlex.quote(path), shlex.quote(cache), commit))


@pytest.mark.parametrize("attack", ["flipped_byte", pytest.param("symlink", marks=pytest.mark.campaign)])
def test_a_corrupt_source_is_caught_its_copy_discarded_and_taken_from_another(plab, workdir, attack):
    lab, commit = plab, plab.models["tiny-b"]["commit"]
    ev = fetch_vars(lab, workdir)
    first = lab.playbook("playbooks/fetch.yml", ev, limit="gpu1,gpu2")
    assert first.rc == 0, first.stdout[-4000:]
    snapshot = "%s/hub/models--lab--tiny-b/snapshots/%s" % (workdir, commit)
    good = content_digests(lab, "gpu1", snapshot)
    if attack == "flipped_byte":
        flip_a_byte(lab, "gpu2", snapshot + "/model.safetensors")     # gpu2 still claims it, by one stat
    else:
        # the lure exists on the receiver too, with the right bytes
        lab.ssh("gpu4", "curl -sf -o /var/tmp/lure %s/lab/tiny-b/resolve/%s/model.safetensors" % (lab.hub_url, commit))
        link_with_the_right_bytes(lab, "gpu2", snapshot + "/model.safetensors", workdir + "/hub", commit)
    since = mark(lab)
    run = lab.playbook("playbooks/fetch.yml", ev, limit=",".join(SITE))
    assert run.rc == 0, run.stdout[-6000:]
    bad = done(run, COPY, "gpu4")[0]
    assert bad["cause"] == "bad_copy" and bad["copied"]["from"] == "gpu2", bad
    assert "model.safetensors" in bad["msg"] and bad["removed"] == []
    if attack == "flipped_byte":
        # checked before it was published: nothing of the bad copy reached gpu4's store
        assert "copied from gpu2 do not match" in bad["msg"] and "nothing of the copy was published" in bad["msg"]
        assert bad["verification"]["failures"][0]["path"] == "model.safetensors"
    else:
        # seen in the listing, before any byte moved: a link is never copied nor followed
        assert "not regular files there" in bad["msg"] and "nothing was copied or published" in bad["msg"], bad["msg"]
        assert lab.ssh("gpu4", "find %s/hub -lname '/var/tmp/*' | wc -l" % workdir).stdout.strip() == "0"
        for host in ("gpu2", "gpu4"):
            lab.ssh(host, "rm -f /var/tmp/lure", check=False)
    retried = done(run, COPY, "gpu4")[-1]
    assert retried["verified"] is True and retried["copied"]["from"] in ("gpu1", "gpu3")
    outcome = debug_msgs(run, OUTCOME)[0]
    assert any(line.startswith("gpu4: from gpu") and "after 1 failed copy (round 1 from gpu2" in line for line in outcome)
    assert any(line.startswith("gpu2: from gpu") for line in outcome)            # healed from a good source
    for host in SITE:
        assert content_digests(lab, host, snapshot) == good, host
        assert done(run, FINAL, host)[-1]["verified"] is True
    assert bodies(lab, since, "lab/tiny-b") == []                                # the Hub was not needed


def test_two_hosts_of_a_shared_store_download_once_and_a_purge_spares_what_the_other_serves(plab, workdir):
    lab, commit = plab, plab.models["tiny-b"]["commit"]
    ev = fetch_vars(lab, workdir, cache=STORE_PATH)
    limit = ",".join(STORE_HOSTS)
    since = mark(lab)
    run = lab.playbook("playbooks/fetch.yml", ev, limit=limit)
    assert run.rc == 0, run.stdout[-6000:]
    got = bodies(lab, since, "lab/tiny-b")
    assert {e["client"] for e in got} == {lab.address("gpu5")} and sum(e["bytes_sent"] for e in got) == 7116181
    assert debug_msgs(run, OUTCOME)[0][:2] == ["gpu5: from the Hub, 6.8 MiB (round 1)",
                                               "gpu6: in the shared store %s-shared" % lab._lab.name]
    man = manifest_of(lab, "gpu6", STORE_PATH, commit)
    assert man["store"] == "%s-shared" % lab._lab.name
    for host in STORE_HOSTS:
        record = json.loads(lab.ssh(host, "cat %s/deployment.json" % workdir).stdout)
        assert record["fetched"]["tiny-b"]["path"] == "%s/models--lab--tiny-b/snapshots/%s" % (STORE_PATH, commit)
    preview = lab.playbook("playbooks/fetch.yml", ev, check=True, limit=limit)
    assert [debug_msgs(preview, SHOW, h)[0] for h in STORE_HOSTS] == [
        "gpu5: tiny-b already in the shared store %s-shared" % lab._lab.name,
        "gpu6: tiny-b already in the shared store %s-shared" % lab._lab.name]

    # gpu6 serves tiny-b (its deployment record says so); gpu5 is asked to purge it
    snapshot = "%s/models--lab--tiny-b/snapshots/%s" % (STORE_PATH, commit)
    lab.ssh("gpu6", "python3 - <<'EOF'\nimport json\np = %r\nd = json.load(open(p))\n"
                    "d.update(model='tiny-b', repo_id='lab/tiny-b', commit=%r, path=%r)\njson.dump(d, open(p, 'w'))\nEOF"
            % (workdir + "/deployment.json", commit, snapshot))
    purge = {"modelswap_models": catalog(lab), "modelswap_serve": "tiny-a", "model_purge_all_listed": True,
             "modelswap_hf_python": peerlab.HF_VENV + "/bin/python", "modelswap_hub_endpoint": lab.hub_url,
             "modelswap_deployment_record": workdir + "/deployment.json"}
    refused = lab.playbook("playbooks/purge.yml", dict(purge, model_purge_items=["tiny-b"]), limit="gpu5")
    assert refused.rc != 0
    assert "refusing to purge tiny-b from the shared store" in refused.stdout and "served by gpu6" in refused.stdout
    by_repo = lab.playbook("playbooks/purge.yml", dict(purge, model_purge_items=["lab/tiny-b"]), limit="gpu5")
    assert by_repo.rc != 0 and "is protected" in by_repo.stdout and snapshot in by_repo.stdout
    for host in STORE_HOSTS:
        assert lab.ssh(host, "test -e %s/config.json && echo kept" % snapshot).stdout.strip() == "kept"


def test_the_migrations_preview_says_where_each_hosts_bytes_come_from(plab, workdir, tmp_path):
    """migrate.yml --check with peers: per host, the plan's download step names its source (the
    Hub, a peer of its site, the shared store another host fills) and the bytes it takes itself;
    the site and the store are each counted once, and nothing is downloaded."""
    from pathlib import Path
    from ansible_collections.modelswap.vllm.plugins.plugin_utils import runner
    lab = plab
    inv = tmp_path / "inventory"
    inv.mkdir()
    (inv / "hosts.yml").write_text(Path(lab.inventory).read_text())
    (inv / "group_vars").symlink_to(peerlab.labctl.REPO / "inventory" / "lab" / "group_vars")
    since = mark(lab)
    for host in SITE:        # the site's hosts plan a store of their own that does not hold tiny-b yet
        lab.ssh(host, "rm -rf /var/lib/modelswap/hf/hub/models--lab--tiny-b", check=False)
    out = runner.preview(str(inv / "hosts.yml"), serve="tiny-b", extra_vars={
        "modelswap_models": catalog(lab), "model_fetch_peers": True, "model_fetch_peer_serve_root": SERVE_ROOT,
        "modelswap_results_dir": str(tmp_path / "results")})
    assert out["ok"], out["run"]["failures"]
    fetch = {h: {s["step"]: s for s in out["plan"][h]["steps"]}["fetch"] for h in lab.hosts}
    assert all(fetch[h]["bytes"] == 7116181 for h in SITE), fetch         # each takes a whole copy
    if all(fetch[h]["text"] == "already downloaded and verified" for h in STORE_HOSTS):
        # an earlier test of this module filled the shared store: its hosts are the site's first
        # sources and nobody takes the Hub
        assert {fetch[h]["source"] for h in SITE} == {"peer"}, fetch
        first = fetch["gpu1"]["source_host"]
        assert first in STORE_HOSTS and f"from {first}" in fetch["gpu1"]["text"]
    else:
        assert fetch["gpu1"]["source"] == "hub" and "from the Hub" in fetch["gpu1"]["text"]
        assert {fetch[h]["source"] for h in SITE[1:]} == {"peer"}
        assert fetch["gpu2"]["source_host"] == "gpu1" and "from gpu1" in fetch["gpu2"]["text"]
        # the store's two hosts: one fills it (from the Hub or a peer), the other takes nothing itself
        store = sorted(STORE_HOSTS, key=lambda h: fetch[h]["bytes"])
        assert fetch[store[0]]["source"] == "store" and fetch[store[0]]["bytes"] == 0
        assert "in the shared store" in fetch[store[0]]["text"] and fetch[store[1]]["bytes"] == 7116181
    assert bodies(lab, since, "lab/tiny-b") == []


def store_inventory(lab, tmp_path, unreachable=None):
    """The peer lab's inventory with the lab's catalog and settings (inventory/lab's group_vars)
    beside it, and ``unreachable``: one more host of the shared store at an address nobody has."""
    import yaml
    from tests.lab.fixtures import REPO
    inv = yaml.safe_load(lab.inventory.read_text())
    hosts = inv["all"]["children"]["gpu_hosts"]["hosts"]
    if unreachable:
        hosts[unreachable] = {"ansible_host": lab.address("gpu1").rsplit(".", 1)[0] + ".250",
                              "modelswap_store": "%s-shared" % lab._lab.name,
                              "ansible_ssh_common_args": "-o ConnectTimeout=3 -o StrictHostKeyChecking=no"}
    folder = tmp_path / "inventory"
    folder.mkdir(parents=True)
    (folder / "hosts.yml").write_text(yaml.safe_dump(inv))
    (folder / "group_vars").symlink_to(REPO / "inventory" / "lab" / "group_vars")
    return folder / "hosts.yml"


def test_a_migration_limited_to_one_host_of_a_store_does_not_purge_what_another_serves(plab, workdir, tmp_path):
    """Issue 27, item 4: gpu6 serves tiny-b from the store gpu5 and gpu6 share; a migration of gpu5
    alone (--limit) that would purge tiny-b reads gpu6 and refuses; with a third host of the store
    unreachable, the purge refuses as well, since what that host serves is unknown. Nothing is deleted."""
    lab, commit = plab, plab.models["tiny-b"]["commit"]
    fill = lab.playbook("playbooks/fetch.yml", fetch_vars(lab, workdir, cache=STORE_PATH), limit="gpu5")
    assert fill.rc == 0, fill.stdout[-4000:]
    snapshot = "%s/models--lab--tiny-b/snapshots/%s" % (STORE_PATH, commit)
    record = "/var/lib/modelswap/deployment.json"
    lab.ssh("gpu6", "mkdir -p /var/lib/modelswap && echo %s > %s" % (shlex.quote(json.dumps(
        {"model": "tiny-b", "repo_id": "lab/tiny-b", "commit": commit, "path": snapshot})), record))
    ev = {"modelswap_serve": "tiny-a", "preflight_purge_candidates": ["tiny-b"], "model_purge_all_listed": True,
          "lb_pool_type": "none", "migrate_benchmark": False, "modelswap_results_dir": str(tmp_path / "results")}
    try:
        preview = lab.playbook("playbooks/migrate.yml", ev, check=True, limit="gpu5",
                               inventory=store_inventory(lab, tmp_path))
        assert preview.rc != 0, preview.stdout[-4000:]
        assert ("is in the shared store %s-shared, where gpu6 serves it (tiny-b)" % lab._lab.name) in preview.stdout

        lab.ssh("gpu6", "rm -f %s" % record)      # gpu6 serves nothing now: only gpu9 is in the way
        inventory = store_inventory(lab, tmp_path / "unreachable", unreachable="gpu9")
        run = lab.playbook("playbooks/migrate.yml", ev, limit="gpu5", inventory=inventory)
        assert run.rc != 0, run.stdout[-4000:]
        assert ("the shared store %s-shared is also mounted by gpu9 (unreachable" % lab._lab.name) in run.stdout, run.stdout[-5000:]
        assert "nothing is purged from the store" in run.stdout
        for host in STORE_HOSTS:
            assert lab.ssh(host, "test -e %s/config.json && echo kept" % snapshot).stdout.strip() == "kept"
    finally:
        lab.ssh("gpu6", "rm -f %s" % record, check=False)
