"""template_cache (a callback, in ansible-playbook's own process): a template compiled by one
process is loaded by the others, and what ansible renders with the cache is what it renders
without it, whatever the template's compile-time settings. Run in fresh interpreters set up as
ansible-playbook sets them up, with ansible's public Templar."""
import json
import os
import subprocess
import sys

import pytest

from tests.support.modules import COLLECTIONS, REPO

pytestmark = pytest.mark.unit


# each: the source, the Templar.template options; sources that compile the same text under
# different settings (trim_blocks, escape_backslashes) must not share a compiled template
CORPUS = [
    ["{{ name }}-{{ port | int + 1 }}", {}],
    ["{% if on %}\nyes\n{% endif %}\nend", {}],
    ["{% if on %}\nyes\n{% endif %}\nend", {"overrides": {"trim_blocks": False}}],
    ["{{ 'a\\nb' }}", {}],
    ["{{ 'a\\nb' }}", {"escape_backslashes": False}],
    ["{{ {'k': [1, 2], 'n': none} }}", {}],
    ["{{ env | modelswap.vllm.systemd_env_lines | join('|') }}", {}],
    ["{% for k, v in env | dictsort %}{{ k }}={{ v }}\n{% endfor %}", {"overrides": {"lstrip_blocks": True}}],
    ["{{ lookup('ansible.builtin.env', 'HOME') | length > 0 }}", {}],
    ["{% raw %}{{ not templated }}{% endraw %}", {}],
    ["<< name >>", {"overrides": {"variable_start_string": "<<", "variable_end_string": ">>"}}],
]
VARIABLES = {"name": "gpu1", "port": 8000, "on": True, "env": {"NCCL_DEBUG": "WARN", "B": "x y"}}

PROBE = r"""
import json, os, sys
from ansible.plugins.loader import init_plugin_loader, callback_loader
init_plugin_loader([sys.argv[1]])
from ansible.parsing.dataloader import DataLoader
from ansible.template import Templar, trust_as_template
from ansible_collections.modelswap.vllm.plugins.plugin_utils import template_cache
corpus, variables, mode = json.loads(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]

def render():
    templar = Templar(loader=DataLoader(), variables=variables)
    return [repr(templar.template(trust_as_template(source), **options)) for source, options in corpus]

out = {"plain": render()}
if mode == "cached":
    cb = callback_loader.get("modelswap.vllm.template_cache")
    folder = cb.folder
    out.update(first=render(), first_counts=[cb.cache.hits, cb.cache.misses, cb.cache.errors],
               files=len([n for n in os.listdir(folder) if not n.startswith(".")]),
               mode=oct(os.stat(folder).st_mode & 0o777), folder=folder)
    # a forked process (as ansible-playbook forks its workers) loads what this one compiled
    read, write = os.pipe()
    if os.fork() == 0:
        cb.cache.hits = cb.cache.misses = 0
        result = json.dumps({"rendered": render(), "counts": [cb.cache.hits, cb.cache.misses]})
        os.write(write, result.encode())
        os._exit(0)
    os.close(write)
    chunks = []
    while chunk := os.read(read, 65536):
        chunks.append(chunk)
    os.wait()
    out["child"] = json.loads(b"".join(chunks))
    # a cache file that cannot be read is compiled again, never used
    for name in os.listdir(folder):
        with open(os.path.join(folder, name), "wb") as handle:
            handle.write(b"not marshal")
    cb.cache.hits = cb.cache.misses = cb.cache.errors = 0
    out.update(corrupted=render(), corrupted_counts=[cb.cache.hits, cb.cache.misses, cb.cache.errors])
    cb.v2_playbook_on_stats(None)
    out["removed"] = not os.path.exists(folder)
    out["after"] = render()
if mode == "unknown":
    # an ansible-core whose templating the cache does not know is left alone
    template_cache._ansible_internals = lambda: None
    cb = callback_loader.get("modelswap.vllm.template_cache")
    out.update(folder=cb.folder, cache=cb.cache is None, again=render())
if mode == "no_folder":
    # no usable temporary folder: the run goes on without the cache
    def refuse():
        raise FileNotFoundError("no usable temporary directory found")
    template_cache.new_folder = refuse
    cb = callback_loader.get("modelswap.vllm.template_cache")
    out.update(folder=cb.folder, cache=cb.cache is None, again=render())
print(json.dumps(out))
"""


def probe(mode, tmp=None):
    proc = subprocess.run([sys.executable, "-c", PROBE, str(COLLECTIONS), json.dumps(CORPUS), json.dumps(VARIABLES),
                           mode], capture_output=True, text=True, timeout=120, check=False, cwd=REPO,
                          env=dict(os.environ, TMPDIR=str(tmp)) if tmp else None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_template_compiled_once_renders_the_same_in_every_process(tmp_path):
    # a folder a killed run left behind (its process is gone) is removed by the next run
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True).stdout.strip()
    (tmp_path / f"modelswap-templates-{gone}-left").mkdir()
    (tmp_path / f"modelswap-templates-{gone}-left" / "k").write_bytes(b"compiled")
    out = probe("cached", tmp_path)
    assert not (tmp_path / f"modelswap-templates-{gone}-left").exists()
    plain = out["plain"]
    # the settings that change the compiled code are told apart
    assert plain[1] != plain[2] and plain[3] != plain[4]
    assert out["first"] == plain and out["after"] == plain
    hits, misses, errors = out["first_counts"]
    # plain's compiles happened before the cache: the first cached render compiles each once
    assert hits == 0 and misses >= len(CORPUS) and errors == 0
    assert out["files"] == misses and out["mode"] == "0o700"
    # the forked worker compiled nothing: every template came from the parent's folder
    assert out["child"]["rendered"] == plain
    assert out["child"]["counts"][0] >= len(CORPUS) and out["child"]["counts"][1] == 0
    # unreadable files are compiled again
    assert out["corrupted"] == plain
    assert out["corrupted_counts"][0] == 0 and out["corrupted_counts"][2] == out["files"]
    assert out["removed"] and out["folder"].startswith(str(tmp_path))


@pytest.mark.parametrize("mode", ["unknown", "no_folder"])
def test_an_unknown_templating_or_no_folder_is_left_alone(mode):
    out = probe(mode)
    assert out["cache"] and out["folder"] is None and out["again"] == out["plain"]


def test_the_key_holds_what_the_compiled_code_depends_on():
    sys.path[:0] = [str(COLLECTIONS)]
    try:
        from ansible_collections.modelswap.vllm.plugins.plugin_utils import template_cache as tc
        from ansible._internal._templating._jinja_bits import AnsibleEnvironment
    finally:
        sys.path.remove(str(COLLECTIONS))
    env = AnsibleEnvironment()
    base = dict(cache_versions="v", environment=env, source="{{ x }}", name=None, filename=None, defer_init=False,
                escape_backslashes=True, embedded_templates=True)
    first = tc.key(**base)
    assert tc.key(**base) == first
    for change in ({"cache_versions": "w"}, {"source": "{{ y }}"}, {"name": "t"}, {"filename": "f.j2"},
                   {"defer_init": True}, {"escape_backslashes": False}, {"embedded_templates": False},
                   {"environment": env.overlay(trim_blocks=False)}, {"environment": env.overlay(lstrip_blocks=True)},
                   {"environment": env.overlay(variable_start_string="<<")},
                   {"environment": env.overlay(finalize=lambda value: value)}):
        assert tc.key(**dict(base, **change)) != first, change


def test_a_store_that_fails_costs_only_speed(tmp_path):
    sys.path[:0] = [str(COLLECTIONS)]
    try:
        from ansible_collections.modelswap.vllm.plugins.plugin_utils import template_cache as tc
    finally:
        sys.path.remove(str(COLLECTIONS))
    cache = tc.TemplateCache(str(tmp_path / "gone"), "v")
    cache.store("k", compile("1", "<t>", "eval"))
    assert cache.errors == 1 and cache.load("k") is None
    cache = tc.TemplateCache(str(tmp_path), "v")
    code = compile("1 + 1", "<t>", "eval")
    cache.store("k", code)
    assert eval(cache.load("k")) == 2 and not [n for n in os.listdir(tmp_path) if n.startswith(".staged")]
    (tmp_path / "k").write_bytes(b"\x00")
    assert cache.load("k") is None and cache.errors == 1


def test_a_folder_a_killed_run_left_is_found_and_a_live_runs_is_not(tmp_path):
    sys.path[:0] = [str(COLLECTIONS)]
    try:
        from ansible_collections.modelswap.vllm.plugins.plugin_utils import template_cache as tc
    finally:
        sys.path.remove(str(COLLECTIONS))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True).stdout.strip()
    dead = tmp_path / f"{tc.PREFIX}{gone}-abc"
    live = tmp_path / f"{tc.PREFIX}{os.getpid()}-def"
    other = tmp_path / f"{tc.PREFIX}x-ghi"
    for folder in (dead, live, other):
        folder.mkdir()
    (tmp_path / f"{tc.PREFIX}{gone}-link").symlink_to(live)
    assert tc.stale_folders(str(tmp_path)) == [str(dead)]
    assert tc.stale_folders(str(tmp_path / "absent")) == []
