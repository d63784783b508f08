"""Real huggingface_hub 2.4 + hf_xet 1.8 downloading over Xet from the lab's local Hub (no fakes).

Every download runs in a process of its own (hf_xet reads its config from the environment once per
process and huggingface_hub caches xet tokens per process), with a private HF_HOME and HF_XET_CACHE.
What hf_xet does, as seen here (and in xet-core's cas_client): it asks for v2 reconstructions
(v1 when forced, or when v2 answers 404/501), sends the file's full byte range as Range, fetches
each xorb range without Authorization (signed URL) and retries a 5xx or a range that decodes short
(exponential backoff, HF_XET_CLIENT_RETRY_MAX_ATTEMPTS retries after the first try); it checks each term's unpacked
length, never the content, so a chunk with wrong bytes of the right length is stored as it came
(which is why modelswap checks sha256 itself). It refreshes a token that expires within 30 s
before using it, and never refreshes on a 401.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.lab.hub.fixtures import LocalHub
from tests.lab.hub.xet import CHUNK_HEADER_SIZE, CHUNK_SIZE, CHUNKS_PER_XORB, parse_chunks

pytestmark = pytest.mark.hub

MiB = 1024 * 1024
RETRIES = 3
NO_PROXY_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def payload(size: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(size)


FILES = {
    "config.json": b'{"architectures": ["LlamaForCausalLM"], "hidden_size": 128}\n',
    "model.safetensors": payload(3 * MiB + 123, 1),                       # incompressible: chunks stored as-is
    "tokenizer.model": (b"the quick brown fox " * 80_000)[:1_500_000],   # compressible: LZ4 chunks
}
LFS = ("model.safetensors", "tokenizer.model")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def repo(request) -> str:
    name = re.sub(r"-+", "-", re.sub(r"[^A-Za-z0-9._-]", "-", request.node.name)).strip("-.")
    return f"xet/{name[:90]}"


@pytest.fixture
def xet_env(hf_xet_env) -> dict[str, str]:
    assert hf_xet_env["HF_XET_CLIENT_RETRY_MAX_ATTEMPTS"] == str(RETRIES)
    return hf_xet_env


CLIENT = r"""
import json, sys
import huggingface_hub as h
args = json.loads(sys.argv[1])
try:
    if args.get("filename"):
        path = h.hf_hub_download(args["repo"], args["filename"], revision=args.get("revision"),
                                 token=args.get("token") or False)
    else:
        path = h.snapshot_download(args["repo"], revision=args.get("revision"), token=args.get("token") or False)
    print(json.dumps({"path": path}))
except Exception as e:
    print(json.dumps({"error": type(e).__name__, "message": str(e)}))
"""


def download(env: dict, repo: str, filename: str | None = None, **kw) -> dict:
    """Run huggingface_hub in a fresh process; {"path": ...} or {"error": <exception class>, "message": ...}."""
    proc = subprocess.run([sys.executable, "-c", CLIENT, json.dumps({"repo": repo, "filename": filename, **kw})],
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def settled(hub):
    return hub.settled()


def requests_by_endpoint(hub, endpoint: str, **match) -> list[dict]:
    return settled(hub).requests(endpoint=endpoint, **match)


def payload_gets(hub) -> list[dict]:
    """resolve GETs of LFS files: what a Xet download must never do."""
    return [e for e in settled(hub).requests(method="GET", endpoint="resolve") if e["file"] in LFS]


def call(url: str, method: str = "GET", headers: dict | None = None) -> tuple[int, dict, bytes]:
    req = urllib.request.Request(url, method=method, headers=headers or {})
    try:
        with NO_PROXY_OPENER.open(req, timeout=30) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def cas_token(hub, repo: str, revision: str = "main", headers: dict | None = None) -> dict:
    status, _, body = call(f"{hub.url}/api/models/{repo}/xet-read-token/{revision}", headers=headers)
    assert status == 200, body
    return json.loads(body)


# --------------------------------------------------------------------------- downloads

def test_snapshot_over_xet_is_byte_identical_with_shared_blobs(local_hub, xet_env, repo):
    commit = local_hub.publish(repo, FILES)
    got = download(xet_env, repo)
    snap = Path(got["path"])
    assert snap.name == commit
    for name, data in FILES.items():
        assert sha256((snap / name).read_bytes()) == sha256(data), name

    cache = Path(xet_env["HF_HUB_CACHE"])
    shared = cache / "blobs"
    assert (shared / ".huggingface-shared-blobs").is_file()
    tree = {e["path"]: e for e in json.loads(call(f"{local_hub.url}/api/models/{repo}/tree/{commit}")[2])}
    for name in LFS:
        xet_hash = tree[name]["xetHash"]
        store_file = shared / xet_hash[:2] / xet_hash
        assert store_file.is_file() and not store_file.is_symlink()
        repo_blob = cache / f"models--{repo.replace('/', '--')}" / "blobs" / sha256(FILES[name])
        assert repo_blob.is_symlink() and repo_blob.resolve() == store_file.resolve()
    assert "xetHash" not in tree["config.json"]

    # the tree listing gave the xet hashes, so no HEAD and no GET of the weights on resolve
    assert payload_gets(local_hub) == [] and local_hub.requests(method="HEAD", endpoint="resolve", file=LFS[0]) == []
    assert len(requests_by_endpoint(local_hub, "xet-read-token")) == 1
    recons = requests_by_endpoint(local_hub, "xet-reconstruction")
    assert sorted(e["file"] for e in recons) == sorted(LFS)
    assert all(e["path"].startswith("/cas/v2/reconstructions/") and e["status"] == 200 and e["auth"]
               for e in recons)
    assert {e["range"] for e in recons} == {f"bytes=0-{len(FILES[n]) - 1}" for n in LFS}
    xorbs = requests_by_endpoint(local_hub, "xet-xorb")
    assert sorted(e["file"] for e in xorbs) == sorted(LFS)
    assert all(e["status"] == 206 and e["range"].startswith("bytes=0-") and not e["auth"] for e in xorbs)
    packed = next(e for e in xorbs if e["file"] == "tokenizer.model")
    assert packed["bytes_sent"] < len(FILES["tokenizer.model"]) // 10  # LZ4 chunks on the wire


def test_single_file_learns_xet_from_the_head_answer(local_hub, xet_env, repo):
    local_hub.publish(repo, FILES)
    got = download(xet_env, repo, "model.safetensors")
    assert Path(got["path"]).read_bytes() == FILES["model.safetensors"]
    heads = settled(local_hub).requests(method="HEAD", endpoint="resolve")
    assert [e["file"] for e in heads] == ["model.safetensors"] and payload_gets(local_hub) == []
    assert [e["file"] for e in requests_by_endpoint(local_hub, "xet-reconstruction")] == ["model.safetensors"]


def test_a_multi_xorb_file_is_fetched_xorb_by_xorb(local_hub, xet_env, repo):
    big = payload(CHUNKS_PER_XORB * CHUNK_SIZE + 3 * CHUNK_SIZE + 5, 7)  # two xorbs
    local_hub.publish(repo, {"big.safetensors": big})
    got = download(xet_env, repo, "big.safetensors")
    assert sha256(Path(got["path"]).read_bytes()) == sha256(big)
    xorbs = requests_by_endpoint(local_hub, "xet-xorb")
    assert len({e["path"] for e in xorbs}) == 2 and payload_gets(local_hub) == []


def test_forced_v1_reconstruction(local_hub, xet_env, repo):
    local_hub.publish(repo, FILES)
    got = download({**xet_env, "HF_XET_CLIENT_RECONSTRUCTION_API_VERSION": "1"}, repo, "tokenizer.model")
    assert Path(got["path"]).read_bytes() == FILES["tokenizer.model"]
    recons = requests_by_endpoint(local_hub, "xet-reconstruction")
    assert [e["path"].split("/")[2] for e in recons] == ["v1"]


def test_disable_xet_downloads_over_plain_resolve(local_hub, xet_env, repo):
    local_hub.publish(repo, FILES)
    got = download({**xet_env, "HF_HUB_DISABLE_XET": "1"}, repo)
    for name, data in FILES.items():
        assert (Path(got["path"]) / name).read_bytes() == data
    assert sorted(e["file"] for e in payload_gets(local_hub)) == sorted(LFS)
    assert not [e for e in settled(local_hub).requests() if e["endpoint"] and e["endpoint"].startswith("xet-")]
    assert not (Path(xet_env["HF_HUB_CACHE"]) / "blobs").exists()


def test_gated_repo_needs_the_hub_token_for_a_xet_token(local_hub, xet_env, repo):
    local_hub.publish(repo, FILES, gated=True)
    denied = download(xet_env, repo, "model.safetensors")
    assert denied["error"] == "GatedRepoError"
    assert requests_by_endpoint(local_hub, "xet-reconstruction") == []
    status, headers, _ = call(f"{local_hub.url}/api/models/{repo}/xet-read-token/main")
    assert (status, headers["X-Error-Code"]) == (401, "GatedRepo")
    got = download(xet_env, repo, "model.safetensors", token=local_hub.token)
    assert Path(got["path"]).read_bytes() == FILES["model.safetensors"]
    tokens = requests_by_endpoint(local_hub, "xet-read-token", status=200)
    assert tokens and all(e["auth"] and e["user"] == "lab" for e in tokens)


# --------------------------------------------------------------------------- faults

def test_truncated_term_is_retried_and_the_download_succeeds(local_hub, xet_env, repo):
    local_hub.publish(repo, FILES)
    local_hub.fault("xet_truncated_term", repo=repo, file="model.safetensors")
    got = download(xet_env, repo, "model.safetensors")
    assert sha256(Path(got["path"]).read_bytes()) == sha256(FILES["model.safetensors"])
    xorbs = requests_by_endpoint(local_hub, "xet-xorb")
    assert [bool(e["faults"]) for e in xorbs] == [True, False]
    last_chunk = len(FILES["model.safetensors"]) % CHUNK_SIZE  # the whole last chunk, header included, is missing
    assert xorbs[1]["bytes_sent"] - xorbs[0]["bytes_sent"] == last_chunk + CHUNK_HEADER_SIZE


def test_a_term_truncated_every_time_fails_after_the_retries(local_hub, xet_env, repo):
    local_hub.publish(repo, FILES)
    local_hub.fault("xet_truncated_term", repo=repo, file="model.safetensors", count=None)
    got = download(xet_env, repo, "model.safetensors")
    assert got["error"] == "RuntimeError" and "expected" in got["message"]
    assert len(requests_by_endpoint(local_hub, "xet-xorb")) == 1 + RETRIES
    cache = Path(xet_env["HF_HUB_CACHE"])
    assert not list(cache.rglob(sha256(FILES["model.safetensors"])))


def test_5xx_on_a_xorb_range_is_retried(local_hub, xet_env, repo):
    local_hub.publish(repo, FILES)
    local_hub.fault("http_error", status=503, endpoint="xet-xorb", repo=repo, count=2)
    got = download(xet_env, repo, "model.safetensors")
    assert Path(got["path"]).read_bytes() == FILES["model.safetensors"]
    assert [e["status"] for e in requests_by_endpoint(local_hub, "xet-xorb")] == [503, 503, 206]


def test_5xx_on_every_xorb_range_fails_after_the_retries(local_hub, xet_env, repo):
    local_hub.publish(repo, FILES)
    local_hub.fault("http_error", status=500, endpoint="xet-xorb", repo=repo, count=None)
    got = download(xet_env, repo, "model.safetensors")
    assert got["error"] == "RuntimeError" and "500" in got["message"]
    assert [e["status"] for e in requests_by_endpoint(local_hub, "xet-xorb")] == [500] * (1 + RETRIES)


@pytest.mark.parametrize("name", LFS)
def test_wrong_bytes_of_the_right_length_are_accepted(local_hub, xet_env, repo, name):
    """hf_xet checks lengths only: the file lands with the published size and the wrong sha256
    (modelswap's own sha256 check is what catches this)."""
    local_hub.publish(repo, FILES)
    local_hub.fault("xet_bad_chunk", repo=repo, file=name, chunk=1)
    got = download(xet_env, repo, name)
    data = Path(got["path"]).read_bytes()
    assert len(data) == len(FILES[name]) and sha256(data) != sha256(FILES[name])
    diff = [i for i, (a, b) in enumerate(zip(data, FILES[name])) if a != b]
    assert diff == [CHUNK_SIZE + CHUNK_SIZE // 2]
    assert len(requests_by_endpoint(local_hub, "xet-xorb")) == 1
    # and it is published to the shared store under the file's xet hash, for other repos to reuse
    shared = Path(got["path"]).resolve()
    assert shared.parent.parent == Path(xet_env["HF_HUB_CACHE"]) / "blobs" and shared.read_bytes() == data


def test_an_expired_token_is_refreshed_before_use(local_hub, xet_env, repo):
    local_hub.publish(repo, FILES)
    local_hub.fault("xet_token_expired", repo=repo)
    got = download(xet_env, repo, "model.safetensors")
    assert Path(got["path"]).read_bytes() == FILES["model.safetensors"]
    tokens = requests_by_endpoint(local_hub, "xet-read-token")
    assert [bool(e["faults"]) for e in tokens] == [True, False]
    assert [e["status"] for e in requests_by_endpoint(local_hub, "xet-reconstruction")] == [200]


def test_a_401_from_the_cas_is_not_refreshed(local_hub, xet_env, repo):
    local_hub.publish(repo, FILES)
    local_hub.fault("http_error", status=401, endpoint="xet-reconstruction", repo=repo)
    got = download(xet_env, repo, "model.safetensors")
    assert got["error"] == "RuntimeError" and "401" in got["message"]
    assert [e["status"] for e in requests_by_endpoint(local_hub, "xet-reconstruction")] == [401]
    assert len(requests_by_endpoint(local_hub, "xet-read-token")) == 1


# --------------------------------------------------------------------------- the wire

def test_wire_xet_headers_token_and_cas_checks(local_hub, repo):
    commit = local_hub.publish(repo, FILES)
    status, h, _ = call(f"{local_hub.url}/{repo}/resolve/main/model.safetensors", "HEAD")
    xet_hash, refresh = h["X-Xet-Hash"], h["X-Xet-Refresh-Route"]
    assert status == 200 and re.fullmatch(r"[0-9a-f]{64}", xet_hash)
    assert refresh == f"{local_hub.url}/api/models/{repo}/xet-read-token/{commit}"
    assert f'<{refresh}>; rel="xet-auth"' in h["Link"] and 'rel="xet-reconstruction-info"' in h["Link"]
    assert "X-Xet-Hash" not in call(f"{local_hub.url}/{repo}/resolve/main/config.json", "HEAD")[1]
    req = urllib.request.Request(f"{local_hub.url}/api/models/{repo}/paths-info/main", method="POST",
                                 data=json.dumps({"paths": list(FILES)}).encode(),
                                 headers={"Content-Type": "application/json"})
    with NO_PROXY_OPENER.open(req, timeout=30) as r:
        info = {e["path"]: e for e in json.loads(r.read())}
    assert info["model.safetensors"]["xetHash"] == xet_hash and "xetHash" not in info["config.json"]

    status, h, body = call(refresh)
    token = json.loads(body)
    assert status == 200 and token["casUrl"] == f"{local_hub.url}/cas"
    assert (h["X-Xet-Access-Token"], int(h["X-Xet-Token-Expiration"]), h["X-Xet-Cas-Url"]) == (
        token["accessToken"], token["exp"], token["casUrl"])
    recon_url = f"{token['casUrl']}/v2/reconstructions/{xet_hash}"
    auth = {"Authorization": f"Bearer {token['accessToken']}"}

    assert call(recon_url)[0] == 401
    assert call(recon_url, headers={"Authorization": "Bearer xet_lab.forged.0000"})[0] == 401
    assert call(f"{token['casUrl']}/v2/reconstructions/{'0' * 64}", headers=auth)[0] == 404
    size = len(FILES["model.safetensors"])
    assert call(recon_url, headers={**auth, "Range": f"bytes={size}-"})[0] == 416

    status, _, body = call(recon_url, headers={**auth, "Range": f"bytes={CHUNK_SIZE + 10}-{2 * CHUNK_SIZE + 9}"})
    part = json.loads(body)
    assert status == 200 and part["offset_into_first_range"] == 10
    [term] = part["terms"]
    assert term["range"] == {"start": 1, "end": 3} and term["unpacked_length"] == 2 * CHUNK_SIZE
    [fetch] = part["xorbs"][term["hash"]]
    [rng] = fetch["ranges"]
    first, last = rng["bytes"]["start"], rng["bytes"]["end"]
    status, h, raw = call(fetch["url"], headers={"Range": f"bytes={first}-{last}"})
    assert status == 206 and h["Content-Range"].startswith(f"bytes {first}-{last}/")
    chunks = parse_chunks(raw)
    assert b"".join(c.data() for c in chunks) == FILES["model.safetensors"][CHUNK_SIZE:3 * CHUNK_SIZE]
    assert call(fetch["url"])[0] == 403                                            # no Range
    assert call(fetch["url"], headers={"Range": f"bytes={first}-{last + 1}"})[0] == 403   # beyond the signature
    assert call(fetch["url"].replace("Signature=", "Signature=0"), headers={"Range": f"bytes={first}-{last}"})[0] == 403

    status, _, body = call(recon_url.replace("/v2/", "/v1/"), headers=auth)
    v1 = json.loads(body)
    assert status == 200 and set(v1) == {"offset_into_first_range", "terms", "fetch_info"}
    assert [e["status"] for e in settled(local_hub).requests(endpoint="xet-reconstruction")] == [401, 401, 404, 416, 200, 200]


def test_token_of_another_repository_does_not_open_a_file(local_hub, repo):
    local_hub.publish(repo, FILES)
    other = local_hub.publish(repo + "-other", {"w.safetensors": payload(100_000, 9)})
    assert other
    xet_hash = call(f"{local_hub.url}/{repo}/resolve/main/model.safetensors", "HEAD")[1]["X-Xet-Hash"]
    token = cas_token(local_hub, repo + "-other")
    status, _, _ = call(f"{token['casUrl']}/v2/reconstructions/{xet_hash}",
                        headers={"Authorization": f"Bearer {token['accessToken']}"})
    assert status == 404


def test_expired_token_is_refused_by_the_cas(local_hub, repo):
    local_hub.publish(repo, FILES)
    xet_hash = call(f"{local_hub.url}/{repo}/resolve/main/model.safetensors", "HEAD")[1]["X-Xet-Hash"]
    local_hub.fault("xet_token_expired", repo=repo)
    token = cas_token(local_hub, repo)
    status, _, body = call(f"{token['casUrl']}/v2/reconstructions/{xet_hash}",
                           headers={"Authorization": f"Bearer {token['accessToken']}"})
    assert status == 401 and b"expired" in body


def test_no_xet_server_speaks_plain_lfs_only(tmp_path, hf_env, repo):
    hub = LocalHub(tmp_path / "store", tmp_path, ("--no-xet",))
    try:
        commit = hub.publish(repo, FILES)
        h = call(f"{hub.url}/{repo}/resolve/main/model.safetensors", "HEAD")[1]
        assert not any(k.lower().startswith("x-xet") for k in h) and "Link" not in h
        assert b"xet" not in call(f"{hub.url}/api/models/{repo}/tree/{commit}")[2].lower()
        assert call(f"{hub.url}/api/models/{repo}/xet-read-token/main")[0] == 404
        env = {k: v for k, v in hf_env.items() if k != "HF_HUB_DISABLE_XET"}
        hub.clear_log()
        got = download({**env, "HF_ENDPOINT": hub.url, "HF_XET_CACHE": str(tmp_path / "xc")}, repo,
                       "model.safetensors")
        assert Path(got["path"]).read_bytes() == FILES["model.safetensors"]
        assert [e["method"] for e in settled(hub).requests(endpoint="resolve")] == ["HEAD", "GET"]
    finally:
        hub.stop()
