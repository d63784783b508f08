"""The lab Hub's Xet side (tests/lab/hub/xet.py): hashes against the spec's and xet-core's reference
vectors and the real hf_xet, xorbs parsed back per the spec, reconstructions, signed tokens and URLs."""
from __future__ import annotations

import hashlib
import random

import hf_xet
import pytest
from blake3 import blake3

from tests.lab.hub import xet
from tests.lab.hub.faults import FaultError, parse_fault
from tests.lab.hub.xet import (
    CHUNK_HEADER_SIZE, CHUNK_SIZE, DATA_KEY, SCHEME_LZ4, SCHEME_NONE, Signer, XetStore, chunk_hash, encode_chunk,
    file_hash, hash_from_hex, hash_hex, parse_chunks, xorb_hash,
)

pytestmark = pytest.mark.unit

# (hash, length) lists with their xorb hash and file hash (zero key), from xet-core's reference
# test of the aggregation (xet_core_structures/src/merklehash/aggregated_hashes.rs, test_correctness),
# published there "as a reference to ensure that other implementations produce the correct hashes".
A = "cfc5d07f6f03c29bbf424132963fe08d19a37d5757aaf520bf08119f05cd56d6"
B = "c3e67584b5c4fc2a89837ec39e40f2c8a6bb0b2987ac94cd4b31e5fbdd210a72"
C = "0d2beb91b9196929a5ddec9f6e306924ddf4a24268e3e59fd8464738d525af37"
D = "adf8773496a9b7319b2e50dc98093f344053b17d8ad37100b9c07d9805988784"
ZERO = "0" * 64
REFERENCE = [
    ([], ZERO, ZERO),
    ([(ZERO, 0)], ZERO, "638a6bc391964a85939d48f008e8bdbae6a7975e7ca2d87a3ce2492f4e4d8a4c"),
    ([(A, 100)], A, "8e16257caa3fe079d484d872a8975264b2ff683b0d6db9028cc7c0f968a45661"),
    ([(A, 100), (B, 200), (C, 300)],
     "71ec1275fca074724e2dd666921b3277c7cee603e4d025bcab2d4050015be2bc",
     "54e55dccc6653c612bdb5576c5d3cb34bb31bc4e100248abccf4c908b3ef7715"),
    ([(A, 100)] * 4,
     "89f2ada89ff8c96763c6b25010e6dd76a4c05b1466207633ea559acf2093211b",
     "2cdba690d0e09563596e0cda626d43eb4c96ef1e994fe72d9b2f5a83cfcd36dd"),
    ([(A, 100), (B, 200)] * 2,
     "90f8313ef12df385d237a067aded02562c35ded12116e32eba401dbc86c38031",
     "284ea045e5a579e99c21ec597c20de1fc0c09e7168162aac00db8f61b3d82dbb"),
    ([(A, 100), (B, 200), (A, 100), (B, 200), (C, 300), (D, 400)],
     "52c826f99507aa05d0b45e9837fa1709e0485425cfbcb1e80db3905cf98b3ee9",
     "91d21684db364c8883ab8209fa5eb2e781cf07f37e1fa43e731c30839afe422f"),
]


def entries(pairs):
    return [(hash_from_hex(h), n) for h, n in pairs]


def test_hash_strings_are_little_endian_u64_groups():
    """api.md, "Converting Hashes to Strings": the example hash [0, 1, ..., 31] (the spec prints the
    string without its "10" byte, 62 digits: a typo), and xet-core's endianness test vector."""
    raw = bytes(range(32))
    text = "07060504030201000f0e0d0c0b0a090817161514131211101f1e1d1c1b1a1918"
    assert hash_hex(raw) == text and hash_from_hex(text) == raw
    raw = bytes([22, 175, 58, 132, 4, 75, 131, 214, 190, 153, 138, 66, 226, 3, 153, 242,
                 204, 86, 80, 234, 249, 153, 80, 99, 159, 80, 65, 138, 236, 231, 149, 78])
    assert hash_hex(raw) == "d6834b04843aaf16f29903e2428a99be635099f9ea5056cc4e95e7ec8a41509f"
    with pytest.raises(ValueError):
        hash_from_hex("ab" * 31)


@pytest.mark.parametrize("pairs,xorb,file", REFERENCE, ids=lambda v: str(len(v)) if isinstance(v, list) else None)
def test_aggregated_hashes_match_the_reference_vectors(pairs, xorb, file):
    assert hash_hex(xorb_hash(entries(pairs))) == xorb
    assert hash_hex(file_hash(entries(pairs))) == file


def test_file_hash_with_a_salt_matches_the_reference_vector():
    salt = hash_from_hex("fceabc1f6c6aaaa176bc53b2d6899a3ab99eaebd13b5f0cf36080e6f894bbbf5")
    six = entries(REFERENCE[-1][0])
    assert hash_hex(file_hash(six, salt)) == "b70b051189a20b58d0c832111e0470396094518b6af8bd8c813c9ccb764ab602"


def test_chunk_hash_is_blake3_keyed_with_the_data_key():
    assert chunk_hash(b"abc") == blake3(b"abc", key=DATA_KEY).digest() != blake3(b"abc").digest()


def test_file_hash_agrees_with_hf_xet_on_content_it_chunks_alike(tmp_path):
    """hf_xet chunks by content; here each 128 KiB block is a counter then zeros, so its gear hash
    settles to a constant that never meets the mask and it cuts at the 128 KiB maximum: the same
    chunks as ours at that size. 40 chunks make a 3-level tree, exercising the group cuts."""
    block = 128 * 1024
    data = b"".join(i.to_bytes(8, "little") + bytes(block - 8) for i in range(40))
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    [info] = hf_xet.hash_files([str(path)])
    ours = [(chunk_hash(data[i:i + block]), block) for i in range(0, len(data), block)]
    assert hash_hex(file_hash(ours)) == info.hash


# --------------------------------------------------------------------------- xorbs

def test_a_chunk_is_lz4_only_when_that_is_smaller():
    text, noise = b"weights " * 8000, random.Random(1).randbytes(CHUNK_SIZE)
    for data, scheme in ((text, SCHEME_LZ4), (noise, SCHEME_NONE)):
        encoded = encode_chunk(data)
        [chunk] = parse_chunks(encoded)
        assert encoded[0] == 0 and encoded[4] == chunk.scheme == scheme
        assert int.from_bytes(encoded[1:4], "little") == len(encoded) - CHUNK_HEADER_SIZE
        assert int.from_bytes(encoded[5:8], "little") == chunk.size == len(data) and chunk.data() == data
    assert len(encode_chunk(text)) < len(text) // 10
    with pytest.raises(ValueError):
        encode_chunk(bytes(128 * 1024 + 1))


def test_a_corrupted_chunk_keeps_its_unpacked_length():
    for data in (b"weights " * 8000, random.Random(2).randbytes(CHUNK_SIZE)):
        [chunk] = parse_chunks(encode_chunk(data))
        [bad] = parse_chunks(chunk.corrupted(0x01))
        assert bad.size == len(bad.data()) == len(data) and bad.data() != data
        assert [i for i in range(len(data)) if bad.data()[i] != data[i]] == [len(data) // 2]
    [raw] = parse_chunks(encode_chunk(random.Random(3).randbytes(1000)))
    assert len(raw.corrupted(0xFF)) == len(raw.raw())  # stored as-is: not even the stored length changes


def test_parse_rejects_a_range_cut_mid_chunk():
    encoded = encode_chunk(random.Random(4).randbytes(5000))
    with pytest.raises(ValueError):
        parse_chunks(encoded[:-1])
    with pytest.raises(ValueError):
        parse_chunks(b"\x01" + encoded[1:])


@pytest.fixture
def small_xorbs(monkeypatch):
    monkeypatch.setattr(xet, "CHUNKS_PER_XORB", 4)


@pytest.fixture
def content() -> bytes:
    """10.5 chunks, alternating compressible and incompressible ones (3 xorbs of at most 4 chunks)."""
    rnd = random.Random(5)
    parts = [(b"layer.%d " % i * 10000)[:CHUNK_SIZE] if i % 2 else rnd.randbytes(CHUNK_SIZE) for i in range(10)]
    return b"".join(parts) + rnd.randbytes(CHUNK_SIZE // 2)


@pytest.fixture
def sha(content) -> str:
    return hashlib.sha256(content).hexdigest()


@pytest.fixture
def store(tmp_path, content, sha):
    (tmp_path / "objects").mkdir()
    (tmp_path / "objects" / sha).write_bytes(content)
    return XetStore(tmp_path, lambda sha256: tmp_path / "objects" / sha256)


def test_index_and_xorbs_parse_back_to_the_file(small_xorbs, store, content, sha):
    index = store.index(sha)
    assert index.size == len(content) and [x.n_chunks for x in index.xorbs] == [4, 4, 3]
    pieces = [content[i:i + CHUNK_SIZE] for i in range(0, len(content), CHUNK_SIZE)]
    assert index.file_hash == hash_hex(file_hash([(chunk_hash(p), len(p)) for p in pieces]))
    rebuilt = b""
    for ref in index.xorbs:
        layout = store.xorb_layout(index, ref)
        chunks = parse_chunks(store.xorb_path(ref.hash).read_bytes())
        assert [[c.offset, c.end, c.size] for c in chunks] == layout
        assert {c.scheme for c in chunks} == {SCHEME_NONE, SCHEME_LZ4}
        datas = [c.data() for c in chunks]
        assert hash_hex(xorb_hash([(chunk_hash(d), len(d)) for d in datas])) == ref.hash
        rebuilt += b"".join(datas)
    assert rebuilt == content
    assert store.index_by_hash(index.file_hash) == index and store.index_by_hash("f" * 64) is None
    assert store.index_by_hash(index.file_hash.upper()) is None and store.index_by_hash("../" * 21 + "x") is None
    again = XetStore(store.base.parent, store.object_path)           # a restarted server reads it back
    assert again.index(sha) == index and again.signer.token({"a": 1}) == store.signer.token({"a": 1})


def reassemble(store, answer: dict, version: int) -> bytes:
    """download-protocol.md stage 3, from the xorb files instead of the URLs."""
    fetch = answer["xorbs" if version == 2 else "fetch_info"]
    out = b""
    for term in answer["terms"]:
        lo, hi = term["range"]["start"], term["range"]["end"]
        [entry] = fetch[term["hash"]]
        rng = entry["ranges"][0] if version == 2 else {"chunks": entry["range"], "bytes": entry["url_range"]}
        assert rng["chunks"] == {"start": lo, "end": hi}
        raw = store.xorb_path(term["hash"]).read_bytes()[rng["bytes"]["start"]:rng["bytes"]["end"] + 1]
        data = b"".join(c.data() for c in parse_chunks(raw))
        assert len(data) == term["unpacked_length"]
        out += data
    return out[answer["offset_into_first_range"]:]


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("first,last", [(0, None), (CHUNK_SIZE * 3 + 7, CHUNK_SIZE * 5 + 1), (100, 200)])
def test_reconstruction_covers_the_range(small_xorbs, store, content, sha, version, first, last):
    index = store.index(sha)
    last = len(content) - 1 if last is None else last
    answer = store.reconstruction(index, first, last, version, lambda x, a, b: f"http://cas/{x}?{a}-{b}")
    assert reassemble(store, answer, version)[:last - first + 1] == content[first:last + 1]
    assert answer["offset_into_first_range"] == first % CHUNK_SIZE
    touched = {ref.hash for ref in index.xorbs if ref.start <= last and first < ref.start + ref.length}
    assert [t["hash"] for t in answer["terms"]] == [r.hash for r in index.xorbs if r.hash in touched]


# --------------------------------------------------------------------------- tokens, URLs, faults

def test_tokens_are_signed_and_tamper_evident():
    signer = Signer(b"k" * 32)
    token = signer.token({"repo": "a/b", "exp": 5})
    assert signer.claims(token) == {"repo": "a/b", "exp": 5}
    body = token.split(".")[1]
    assert signer.claims(token.replace(body, body[:-2] + "AA")) is None
    assert Signer(b"j" * 32).claims(token) is None and signer.claims("hf_abc") is None


def test_xorb_urls_are_signed_for_their_range_and_expire(monkeypatch):
    from urllib.parse import parse_qs
    signer = Signer(b"k" * 32)
    params = parse_qs(signer.xorb_query("x" * 64, 10, 99, "a/b", "w.bin"))
    assert signer.check_xorb_query("x" * 64, params) == (10, 99)
    assert signer.check_xorb_query("y" * 64, params) == "bad signature"
    assert signer.check_xorb_query("x" * 64, dict(params, file=["other"])) == "bad signature"
    assert signer.check_xorb_query("x" * 64, {}) == "unsigned xorb URL"
    monkeypatch.setattr(xet, "URL_TTL_S", -1)
    assert signer.check_xorb_query("x" * 64, parse_qs(signer.xorb_query("x" * 64, 0, 1, "a/b", "f"))) == \
        "the URL has expired"


def test_xet_faults_parse_like_the_others():
    assert parse_fault({"kind": "xet_bad_chunk", "endpoint": "xet-xorb", "repo": "a/*"}, 1).params == \
        {"chunk": 0, "xor": 0xFF}
    assert parse_fault({"kind": "xet_truncated_term", "count": None}, 2).remaining is None
    assert parse_fault({"kind": "xet_token_expired", "endpoint": "xet-read-token"}, 3).kind == "xet_token_expired"
    for bad in ({"kind": "xet_bad_chunk", "xor": 0}, {"kind": "xet_bad_chunk", "chunk": -1},
                {"kind": "xet_truncated_term", "chunks": 0}, {"kind": "xet_token_expired", "seconds": 1},
                {"kind": "http_error", "endpoint": "cas"}):
        with pytest.raises(FaultError):
            parse_fault(bad, 9)
