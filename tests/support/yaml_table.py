"""Table tests in YAML, in the style of community.general: a ``test_<name>.yaml`` beside the
``test_<name>.py`` holds the cases, each an ``id``, its input and what the output must hold.

A case's expectations, all optional:

- ``output``: the whole output, compared with ==;
- ``expect``: {path: value}, each compared with ==;
- ``approx``: {path: number}, compared within a relative 1e-9;
- ``contains``: {path: fragment or [fragments]}: each a substring of a text, or an item of a list;
- ``absent``: [path], each missing from the output;
- ``order``: {path: [names]}: the list at path, each item named by its "step" (or "name").

A path is dotted: ``steps.fetch.text`` reads the output's "steps", then the item of that list
whose "step" (or "name") is "fetch", then its "text"; a number indexes a list (``steps.0.text``).
Tags: ``!GiB 547`` is 547 * 1024**3; ``!sha1 "text"`` the text's SHA-1 (hex), as a read reports it.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import yaml

MISSING, ABSENT = object(), object()


class _Loader(yaml.SafeLoader):
    """SafeLoader with the tables' tags."""


_Loader.add_constructor("!GiB", lambda loader, node: int(float(loader.construct_scalar(node)) * 1024 ** 3))
_Loader.add_constructor("!MiB", lambda loader, node: int(float(loader.construct_scalar(node)) * 1024 ** 2))
_Loader.add_constructor("!sha1", lambda loader, node: hashlib.sha1(
    loader.construct_scalar(node).encode("utf-8")).hexdigest())


def load(test_file: str) -> dict:
    """The YAML table beside ``test_file`` (its .py swapped for .yaml)."""
    with open(Path(test_file).with_suffix(".yaml"), encoding="utf-8") as fh:
        return yaml.load(fh, Loader=_Loader)    # a SafeLoader with two tags


def cases(test_file: str, key: str = "cases") -> list:
    """The table's ``key`` list as pytest params, each with its ``id``."""
    table = load(test_file)[key]
    ids = [case["id"] for case in table]
    assert len(ids) == len(set(ids)), "duplicate ids in %s: %s" % (key, ids)
    return [pytest.param(case, id=case["id"]) for case in table]


def at(data, path: str, default=MISSING):
    """The value at a dotted ``path`` of ``data`` (see the module's docstring); ``default`` or a
    KeyError where it is missing."""
    for part in str(path).split(".") if path != "" else []:
        if isinstance(data, dict) and part in data:
            data = data[part]
        elif isinstance(data, list) and part.lstrip("-").isdigit() and -len(data) <= int(part) < len(data):
            data = data[int(part)]
        elif isinstance(data, list) and any(isinstance(i, dict) and part in (i.get("step"), i.get("name")) for i in data):
            data = next(i for i in data if isinstance(i, dict) and part in (i.get("step"), i.get("name")))
        elif default is not MISSING:
            return default
        else:
            raise KeyError("%s: no %r in %r" % (path, part, data))
    return data


def check(output, case: dict) -> None:
    """Assert every expectation of ``case`` on ``output``."""
    if "output" in case:
        assert output == case["output"]
    for path, want in (case.get("expect") or {}).items():
        got = at(output, path)
        assert got == want, "%s: %r != %r" % (path, got, want)
    for path, want in (case.get("approx") or {}).items():
        assert at(output, path) == pytest.approx(want, rel=1e-9), path
    for path, fragments in (case.get("contains") or {}).items():
        got = at(output, path)
        for fragment in fragments if isinstance(fragments, list) else [fragments]:
            assert fragment in got, "%s: %r not in %r" % (path, fragment, got)
    for path, names in (case.get("order") or {}).items():
        got = [i.get("step", i.get("name")) if isinstance(i, dict) else i for i in at(output, path)]
        assert got == names, "%s: %r != %r" % (path, got, names)
    for path in case.get("absent") or []:
        assert at(output, path, ABSENT) is ABSENT, "%s: present (%r)" % (path, at(output, path))
