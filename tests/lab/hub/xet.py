"""Xet storage for the lab's Hub: the server side of the Xet protocol, written from the spec.

The spec is https://huggingface.co/docs/xet (hub-docs: docs/xet/*.md; hashing, xorb, api,
download-protocol, auth). The tree shape of the hash aggregation is not in the spec's text; it is
described below and checked against the reference vectors of xet-core and hf_xet.hash_files.

Hashes (all 32 bytes, blake3):
  chunk hash   blake3 keyed with DATA_KEY over the chunk's bytes
  xorb hash    the aggregated hash of the xorb's (chunk hash, chunk length) list
  file hash    blake3 keyed with 32 zero bytes over the aggregated hash of all the file's chunks
  The aggregated hash collapses the list level by level until one entry is left: each level is cut
  into groups read left to right; a group takes 3 to 9 entries and ends after the first entry (from
  the third on) whose hash, read as the little-endian u64 of its bytes 24..31, is divisible by 4
  (a list of 1 or 2 left entries is one group). A group becomes one entry: blake3 keyed with
  INTERNAL_NODE_KEY over the lines "<hash hex> : <length>\\n", with the sum of the lengths.
  A hash is written in hex as 4 little-endian u64s, each as 16 hex digits (api.md "Converting
  Hashes to Strings"): the bytes of each 8-byte group reversed. That string names files and xorbs.

Chunking: fixed CHUNK_SIZE (64 KiB) pieces, not the spec's content-defined chunking (gearhash):
the client only reconstructs, so any chunking that obeys the limits (<= 128 KiB) downloads alike;
file hashes therefore differ from huggingface.co's for files over one chunk. Pure-Python gearhash
would also cost minutes per GB. Chunks are grouped CHUNKS_PER_XORB to a xorb (< 64 MiB serialized).

Xorb bytes (xorb.md): per chunk an 8-byte header (version 0, compressed length: 3 bytes LE,
scheme: 0 none / 1 LZ4 frame, uncompressed length: 3 bytes LE) then the payload. A chunk is stored
LZ4-compressed only when that is smaller. Xorbs carry no footer: downloads fetch chunk ranges only.

On disk, under <hub root>/xet/ (every file written to tmp/ and renamed, so readers never see half):
  files/<aa>/<sha256>.json      the file's index: file hash, and per xorb its hash, chunks, offset
  by-hash/<aa>/<file hash>      the sha256 whose index it is (the reconstruction API knows only the hash)
  xorbs/<aa>/<xorb hash>        serialized xorb
  xorbs/<aa>/<xorb hash>.json   its chunk byte ranges: [[start, end), unpacked length] per chunk
  signing.key                   HMAC key of xet access tokens and xorb URLs (0600)
A file is indexed (one streaming read: hashing only) the first time its hash is needed, and its
xorbs are built the first time a reconstruction needs them; both are kept, keyed by content, so a
file is converted once whatever repository or revision serves it. Nothing holds a whole file in
memory. `python -m tests.lab.hub.xet --root DIR` converts every stored object ahead of time (worth
it for multi-GB files: the first HEAD of a file waits for its index).
"""
from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import hmac
import json
import os
import secrets
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator
from urllib.parse import urlencode

import lz4.frame
from blake3 import blake3

from tests.lab.hub.store import Store

DATA_KEY = bytes([
    102, 151, 245, 119, 91, 149, 80, 222, 49, 53, 203, 172, 165, 151, 24, 28,
    157, 228, 33, 16, 155, 235, 43, 88, 180, 208, 176, 75, 147, 173, 242, 41])
INTERNAL_NODE_KEY = bytes([
    1, 126, 197, 199, 165, 71, 41, 150, 253, 148, 102, 102, 180, 138, 2, 230,
    93, 221, 83, 111, 55, 199, 109, 210, 248, 99, 82, 230, 74, 83, 113, 63])
ZERO_KEY = bytes(32)

CHUNK_SIZE = 64 * 1024
MAX_CHUNK_SIZE = 128 * 1024
CHUNKS_PER_XORB = 1000            # 1000 x (64 KiB + 8) stays under the spec's 64 MiB per xorb
CHUNK_HEADER_SIZE = 8
CHUNK_VERSION = 0
SCHEME_NONE, SCHEME_LZ4 = 0, 1
MEAN_BRANCHING = 4
MAX_GROUP = 2 * MEAN_BRANCHING + 1
READ_BLOCK = 16 * CHUNK_SIZE
INDEX_FORMAT = 1
URL_TTL_S = 3600


# --------------------------------------------------------------------------- hashes

def chunk_hash(data: bytes) -> bytes:
    return blake3(data, key=DATA_KEY).digest()


def hash_hex(h: bytes) -> str:
    """The spec's string form: each 8-byte group as a little-endian u64 in 16 hex digits."""
    return "".join(h[i:i + 8][::-1].hex() for i in range(0, 32, 8))


def is_hash_hex(text: str) -> bool:
    """A hash string as the API puts one in a path: 64 lowercase hex digits (and nothing a path could abuse)."""
    return len(text) == 64 and all(c in "0123456789abcdef" for c in text)


def hash_from_hex(text: str) -> bytes:
    raw = bytes.fromhex(text)
    if len(raw) != 32:
        raise ValueError(f"a xet hash is 64 hex digits, not {text!r}")
    return b"".join(raw[i:i + 8][::-1] for i in range(0, 32, 8))


def _ends_group(h: bytes) -> bool:
    return int.from_bytes(h[24:32], "little") % MEAN_BRANCHING == 0


def _group_end(entries: list[tuple[bytes, int]], start: int) -> int:
    left = len(entries) - start
    if left <= 2:
        return len(entries)
    last = start + min(MAX_GROUP, left)
    for i in range(start + 2, last):
        if _ends_group(entries[i][0]):
            return i + 1
    return last


def _merge(group: list[tuple[bytes, int]]) -> tuple[bytes, int]:
    text = "".join(f"{hash_hex(h)} : {n}\n" for h, n in group)
    return blake3(text.encode(), key=INTERNAL_NODE_KEY).digest(), sum(n for _, n in group)


def aggregated_hash(entries: list[tuple[bytes, int]]) -> bytes:
    """The root of the aggregation tree over (hash, length) entries (zero hash when empty)."""
    if not entries:
        return bytes(32)
    level = list(entries)
    while len(level) > 1:
        merged, start = [], 0
        while start < len(level):
            end = _group_end(level, start)
            merged.append(_merge(level[start:end]))
            start = end
        level = merged
    return level[0][0]


def xorb_hash(entries: list[tuple[bytes, int]]) -> bytes:
    return aggregated_hash(entries)


def file_hash(entries: list[tuple[bytes, int]], salt: bytes = ZERO_KEY) -> bytes:
    if not entries:
        return bytes(32)
    return blake3(aggregated_hash(entries), key=salt).digest()


# --------------------------------------------------------------------------- xorb format

def encode_chunk(data: bytes) -> bytes:
    """Header + payload; LZ4 (frame format, as xet-core reads it) only when it saves bytes."""
    if len(data) > MAX_CHUNK_SIZE:
        raise ValueError(f"a chunk is at most {MAX_CHUNK_SIZE} bytes, not {len(data)}")
    packed = lz4.frame.compress(data)
    scheme, payload = (SCHEME_LZ4, packed) if len(packed) < len(data) else (SCHEME_NONE, data)
    return chunk_header(len(payload), scheme, len(data)) + payload


def chunk_header(compressed: int, scheme: int, uncompressed: int) -> bytes:
    return (bytes([CHUNK_VERSION]) + compressed.to_bytes(3, "little") + bytes([scheme])
            + uncompressed.to_bytes(3, "little"))


@dataclass(frozen=True)
class Chunk:
    """One chunk as it sits in xorb bytes."""
    offset: int         # of its header in the bytes parsed
    scheme: int
    payload: bytes
    size: int           # uncompressed

    @property
    def end(self) -> int:
        return self.offset + CHUNK_HEADER_SIZE + len(self.payload)

    def raw(self) -> bytes:
        """The chunk as stored: header and payload."""
        return chunk_header(len(self.payload), self.scheme, self.size) + self.payload

    def corrupted(self, xor: int) -> bytes:
        """The chunk with the middle byte of its data XORed: same unpacked length, wrong content.

        An uncompressed chunk keeps its stored length too; a compressed one is stored uncompressed
        (the one way to change its content and still decode), so its stored length changes."""
        data = bytearray(self.data())
        data[len(data) // 2] ^= xor
        return chunk_header(len(data), SCHEME_NONE, len(data)) + bytes(data)

    def data(self) -> bytes:
        if self.scheme == SCHEME_NONE:
            return self.payload
        if self.scheme == SCHEME_LZ4:
            return lz4.frame.decompress(self.payload)
        raise ValueError(f"compression scheme {self.scheme} is not one the lab writes")


def parse_chunks(buf: bytes) -> list[Chunk]:
    """Split xorb bytes (a whole xorb or a fetched range of whole chunks) into chunks."""
    out, pos = [], 0
    while pos < len(buf):
        header = buf[pos:pos + CHUNK_HEADER_SIZE]
        if len(header) < CHUNK_HEADER_SIZE or header[0] != CHUNK_VERSION:
            raise ValueError(f"no chunk header at offset {pos}")
        compressed = int.from_bytes(header[1:4], "little")
        payload = buf[pos + CHUNK_HEADER_SIZE:pos + CHUNK_HEADER_SIZE + compressed]
        if len(payload) != compressed:
            raise ValueError(f"chunk at offset {pos} is cut short")
        out.append(Chunk(pos, header[4], payload, int.from_bytes(header[5:8], "little")))
        pos += CHUNK_HEADER_SIZE + compressed
    return out


# --------------------------------------------------------------------------- index of a file

@dataclass(frozen=True)
class XorbRef:
    """A xorb of a file: chunks [first_chunk, first_chunk + n_chunks) = file bytes [start, start + length)."""
    hash: str
    first_chunk: int
    n_chunks: int
    start: int
    length: int

    def chunk_sizes(self) -> list[int]:
        sizes = [CHUNK_SIZE] * self.n_chunks
        sizes[-1] = self.length - CHUNK_SIZE * (self.n_chunks - 1)
        return sizes


@dataclass(frozen=True)
class FileIndex:
    sha256: str
    size: int
    file_hash: str
    xorbs: tuple[XorbRef, ...]

    def to_json(self) -> dict:
        return {"format": INDEX_FORMAT, "sha256": self.sha256, "size": self.size, "chunk_size": CHUNK_SIZE,
                "file_hash": self.file_hash, "xorbs": [x.__dict__ for x in self.xorbs]}

    @classmethod
    def from_json(cls, d: dict) -> "FileIndex":
        if d.get("format") != INDEX_FORMAT or d.get("chunk_size") != CHUNK_SIZE:
            raise ValueError("index of another format")
        return cls(d["sha256"], d["size"], d["file_hash"], tuple(XorbRef(**x) for x in d["xorbs"]))


def read_chunks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while block := f.read(READ_BLOCK):
            for i in range(0, len(block), CHUNK_SIZE):
                yield block[i:i + CHUNK_SIZE]


def index_file(path: Path, sha256: str) -> FileIndex:
    """Chunk, hash and group a file in one streaming read (only the hashes are kept)."""
    all_entries: list[tuple[bytes, int]] = []
    xorbs: list[XorbRef] = []
    start = 0

    def close_xorb(entries):
        nonlocal start
        length = sum(n for _, n in entries)
        xorbs.append(XorbRef(hash_hex(xorb_hash(entries)), len(all_entries) - len(entries), len(entries),
                             start, length))
        start += length

    current: list[tuple[bytes, int]] = []
    for data in read_chunks(path):
        entry = (chunk_hash(data), len(data))
        all_entries.append(entry)
        current.append(entry)
        if len(current) == CHUNKS_PER_XORB:
            close_xorb(current)
            current = []
    if current:
        close_xorb(current)
    return FileIndex(sha256, start, hash_hex(file_hash(all_entries)), tuple(xorbs))


# --------------------------------------------------------------------------- tokens and signed URLs

class Signer:
    """HMAC-signed xet access tokens and xorb URLs (stateless: they survive a server restart)."""

    def __init__(self, key: bytes):
        self._key = key

    def _mac(self, text: str) -> str:
        return hmac.new(self._key, text.encode(), hashlib.sha256).hexdigest()

    def token(self, claims: dict) -> str:
        body = base64.urlsafe_b64encode(json.dumps(claims, sort_keys=True).encode()).decode().rstrip("=")
        return f"xet_lab.{body}.{self._mac(body)}"

    def claims(self, token: str) -> dict | None:
        """The token's claims, or None for a token this server did not sign (expiry unchecked)."""
        prefix, _, rest = token.partition(".")
        body, _, mac = rest.partition(".")
        if prefix != "xet_lab" or not hmac.compare_digest(mac.encode(), self._mac(body).encode()):
            return None
        try:
            return json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
        except ValueError:
            return None

    def _url_fields(self, xorb: str, signed_range: str, expires: int, repo: str, file: str) -> str:
        return "\n".join([xorb, signed_range, str(expires), repo, file])

    def xorb_query(self, xorb: str, first: int, last: int, repo: str, file: str) -> str:
        signed_range = f"bytes={first}-{last}"
        expires = int(time.time()) + URL_TTL_S
        mac = self._mac(self._url_fields(xorb, signed_range, expires, repo, file))
        return urlencode({"X-Xet-Signed-Range": signed_range, "Expires": expires, "repo": repo, "file": file,
                          "Signature": mac})

    def check_xorb_query(self, xorb: str, params: dict) -> tuple[int, int] | str:
        """The signed (first, last) byte range, or why the URL is refused."""
        def one(name):
            return params.get(name, [""])[-1]

        try:
            expires = int(one("Expires"))
        except ValueError:
            return "unsigned xorb URL"
        fields = self._url_fields(xorb, one("X-Xet-Signed-Range"), expires, one("repo"), one("file"))
        if not hmac.compare_digest(one("Signature").encode(), self._mac(fields).encode()):
            return "bad signature"
        if expires < time.time():
            return "the URL has expired"
        first, _, last = one("X-Xet-Signed-Range").removeprefix("bytes=").partition("-")
        return int(first), int(last)


# --------------------------------------------------------------------------- the store

class XetStore:
    """Xet indexes and xorbs of a Hub store's objects, built lazily and kept under <root>/xet."""

    def __init__(self, root: str | os.PathLike, object_path: Callable[[str], Path]):
        self.base = Path(root) / "xet"
        self.object_path = object_path
        self._guard = threading.Lock()
        self._locks: dict[str, threading.Lock] = {}
        self._indexes: dict[str, FileIndex] = {}
        self.signer = Signer(self._signing_key())

    # ----------------------------------------------------------------- files on disk
    def _tmp(self, name: str) -> Path:
        tmp = self.base / "tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        return tmp / f"{name}.{os.getpid()}.{secrets.token_hex(4)}"

    def _write(self, dest: Path, data: bytes, mode: int = 0o644) -> None:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._tmp(dest.name)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, dest)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def _signing_key(self) -> bytes:
        path = self.base / "signing.key"
        if not path.exists():
            tmp = self._tmp("signing.key")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
            with contextlib.suppress(FileExistsError):
                os.link(tmp, path)  # the first writer wins, so every process signs alike
            os.unlink(tmp)
        return bytes.fromhex(path.read_text().strip())

    def _index_path(self, sha256: str) -> Path:
        return self.base / "files" / sha256[:2] / f"{sha256}.json"

    def _by_hash_path(self, xet_hash: str) -> Path:
        return self.base / "by-hash" / xet_hash[:2] / xet_hash

    def xorb_path(self, xorb: str) -> Path:
        return self.base / "xorbs" / xorb[:2] / xorb

    @contextlib.contextmanager
    def _once(self, key: str) -> Iterator[None]:
        """Serialise the building of one thing (an index, a xorb) across the server's threads."""
        with self._guard:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            yield

    # ----------------------------------------------------------------- indexes
    def index(self, sha256: str) -> FileIndex:
        """The index of the stored object `sha256`, built on first use."""
        cached = self._indexes.get(sha256)
        if cached is not None:
            return cached
        with self._once("index:" + sha256):
            found = self._load_index(sha256)
            if found is None:
                found = index_file(self.object_path(sha256), sha256)
                self._write(self._index_path(sha256), json.dumps(found.to_json()).encode())
            self._write_if_changed(self._by_hash_path(found.file_hash), sha256.encode())
            self._indexes[sha256] = found
            return found

    def _write_if_changed(self, path: Path, data: bytes) -> None:
        with contextlib.suppress(FileNotFoundError):
            if path.read_bytes() == data:
                return
        self._write(path, data)

    def _load_index(self, sha256: str) -> FileIndex | None:
        try:
            return FileIndex.from_json(json.loads(self._index_path(sha256).read_text()))
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            return None

    def index_by_hash(self, xet_hash: str) -> FileIndex | None:
        """The index of the file whose xet hash this is, if this store has indexed it."""
        if not is_hash_hex(xet_hash):
            return None
        try:
            sha256 = self._by_hash_path(xet_hash).read_text().strip()
        except OSError:
            return None
        return self.index(sha256) if is_hash_hex(sha256) and self.object_path(sha256).exists() else None

    # ----------------------------------------------------------------- xorbs
    def xorb_layout(self, index: FileIndex, ref: XorbRef) -> list[list[int]]:
        """[[start, end), unpacked] of each chunk in the xorb's bytes; the xorb is built on first use."""
        sidecar = self.xorb_path(ref.hash).with_suffix(".json")
        with contextlib.suppress(FileNotFoundError, ValueError):
            return json.loads(sidecar.read_text())
        with self._once("xorb:" + ref.hash):
            with contextlib.suppress(FileNotFoundError, ValueError):
                return json.loads(sidecar.read_text())
            layout = self._build_xorb(index, ref)
            self._write(sidecar, json.dumps(layout).encode())
            return layout

    def chunks_in_range(self, xorb: str, start: int, end: int) -> int:
        """How many whole chunks of a built xorb lie in its bytes [start, end]."""
        try:
            layout = json.loads(self.xorb_path(xorb).with_suffix(".json").read_text())
        except (FileNotFoundError, ValueError):
            return 0
        return sum(1 for first, stop, _ in layout if first >= start and stop <= end + 1)

    def _build_xorb(self, index: FileIndex, ref: XorbRef) -> list[list[int]]:
        dest = self.xorb_path(ref.hash)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._tmp(ref.hash)
        layout, pos = [], 0
        try:
            with open(self.object_path(index.sha256), "rb") as src, open(tmp, "wb") as out:
                src.seek(ref.start)
                for size in ref.chunk_sizes():
                    data = src.read(size)
                    if len(data) != size:
                        raise OSError(f"object {index.sha256} is shorter than its index says")
                    encoded = encode_chunk(data)
                    out.write(encoded)
                    layout.append([pos, pos + len(encoded), size])
                    pos += len(encoded)
            os.replace(tmp, dest)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        return layout

    # ----------------------------------------------------------------- reconstruction
    def reconstruction(self, index: FileIndex, first: int, last: int, version: int,
                       xorb_url: Callable[[str, int, int], str]) -> dict:
        """The reconstruction of file bytes [first, last] (inclusive) in the v1 or v2 response shape.

        One term per xorb touched (its chunk range covering the bytes), and one fetch range per term:
        the chunks' bytes in the xorb. `xorb_url(xorb, first_byte, last_byte)` signs a fetch URL.
        """
        terms, fetch = [], {}
        offset = None
        for ref in index.xorbs:
            if ref.start + ref.length <= first or ref.start > last:
                continue
            lo = (max(first, ref.start) - ref.start) // CHUNK_SIZE
            hi = (min(last, ref.start + ref.length - 1) - ref.start) // CHUNK_SIZE + 1
            if offset is None:
                offset = first - (ref.start + lo * CHUNK_SIZE)
            layout = self.xorb_layout(index, ref)
            unpacked = sum(size for _, _, size in layout[lo:hi])
            terms.append({"hash": ref.hash, "unpacked_length": unpacked, "range": {"start": lo, "end": hi}})
            byte_first, byte_last = layout[lo][0], layout[hi - 1][1] - 1
            entry = _fetch_entry(version, lo, hi, byte_first, byte_last, xorb_url(ref.hash, byte_first, byte_last))
            if entry not in fetch.setdefault(ref.hash, []):
                fetch[ref.hash].append(entry)
        key = "xorbs" if version == 2 else "fetch_info"
        return {"offset_into_first_range": offset or 0, "terms": terms, key: fetch}

    # ----------------------------------------------------------------- ahead of time
    def convert(self, sha256: str) -> FileIndex:
        """Index a stored object and build all its xorbs now."""
        index = self.index(sha256)
        for ref in index.xorbs:
            self.xorb_layout(index, ref)
        return index


def _fetch_entry(version: int, lo: int, hi: int, byte_first: int, byte_last: int, url: str) -> dict:
    chunks, byte_range = {"start": lo, "end": hi}, {"start": byte_first, "end": byte_last}
    if version == 2:
        return {"url": url, "ranges": [{"chunks": chunks, "bytes": byte_range}]}
    return {"range": chunks, "url": url, "url_range": byte_range}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.lab.hub.xet",
                                 description="Convert a lab Hub store's objects to Xet ahead of time.")
    ap.add_argument("--root", required=True, help="the Hub's store folder")
    args = ap.parse_args(argv)
    hub_store = Store(args.root)
    store = XetStore(hub_store.root, hub_store.object_path)
    for path in sorted((hub_store.root / "objects").glob("*/*")):
        if path.is_file() and path.stat().st_size > 0:
            t0 = time.monotonic()
            index = store.convert(path.name)
            print(f"{path.name} {index.file_hash} {index.size} bytes, {len(index.xorbs)} xorbs, "
                  f"{time.monotonic() - t0:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
