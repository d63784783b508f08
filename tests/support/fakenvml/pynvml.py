"""`pynvml` for module runs in tests: the real binding's names over a scenario (no GPU needed).

Put this folder first on PYTHONPATH and the scenario's JSON path in MODELSWAP_FAKE_NVML; a module
that does `import pynvml` then gets the FakeNvml of tests/support/fake_pynvml.py, whose constants,
exceptions and structures come from the real nvidia-ml-py (loaded under the name `_real_pynvml`).
"""
import importlib.machinery
import importlib.util
import json
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _load(name, path=None, search=None):
    if path is None:
        found = importlib.machinery.PathFinder.find_spec("pynvml", search)
        if found is None or not found.origin:
            raise ImportError("the real pynvml (nvidia-ml-py) is not installed")
        path = found.origin
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


_real = _load("_real_pynvml", search=[p for p in sys.path if os.path.abspath(p or ".") != _HERE])
_fake_mod = _load("_fake_pynvml_impl", os.path.join(os.path.dirname(_HERE), "fake_pynvml.py"))
with open(os.environ["MODELSWAP_FAKE_NVML"], encoding="utf-8") as _fh:
    FAKE = _fake_mod.FakeNvml(json.load(_fh), real=_real)

for _name in dir(FAKE):
    if _name.startswith(("nvml", "NVML", "c_nvml")):
        globals()[_name] = getattr(FAKE, _name)
