"""Bad inputs of the serving side (vllm_service, its filters, the catalog rules preflight shares),
one row each: what was tried, the error it gets, and that nothing changed.

- PURE_ROWS run the pure functions the role's validate step calls (plugins/module_utils/serving/vllm_unit.py,
  cache_layout, snapshot_check): they raise or return the problem, and write nothing.
- ROLE_ROWS are the same refusals through the role on a lab host that serves a model:
  tests/integration/test_vllm_routes_lab.py runs each one and checks that the run failed in the
  validate step with this message, that the unit, its environment files and the deployment
  record are byte for byte the same, that the same vLLM process still serves, and that a marker
  key put in extra_args appears in no output.
"""
from __future__ import annotations

import pytest

from ansible_collections.modelswap.vllm.plugins.filter.catalog import FilterModule as CatalogFilters
from ansible_collections.modelswap.vllm.plugins.filter.vllm_service import FilterModule
from ansible_collections.modelswap.vllm.plugins.module_utils.common import catalog
from ansible_collections.modelswap.vllm.plugins.module_utils.store import cache_layout, snapshot_check
from ansible_collections.modelswap.vllm.plugins.module_utils.common import vllm_args as vllm_args_rules
from ansible_collections.modelswap.vllm.plugins.module_utils.serving import vllm_unit

pytestmark = pytest.mark.unit

MARKER = "msk-marker-in-extra-args-0b1f"
INJECT = "\nExecStartPre=/bin/touch /tmp/modelswap-injected"
CPU = {"dtype": "float32", "max_model_len": 512, "enforce_eager": True}
GOOD = {"repo_id": "lab/tiny-a", "revision": "a" * 40, "served_model_name": "tiny-a",
        "vllm_args": dict(CPU)}
SAFE_UNIT = {"unit": "vllm.service", "replaces": [], "user": "vllm", "group": "vllm",
             "home": "/var/lib/vllm", "config_dir": "/etc/modelswap", "host": "0.0.0.0",
             "hardening": {"ProtectSystem": "strict", "CapabilityBoundingSet": ""},
             "env": {"HF_HUB_OFFLINE": "1"}, "guard": True, "guard_dir": "/opt/modelswap/lib/python",
             "open_routes": ["/health", "/ping", "/metrics", "/version"]}
FILTERS = dict(FilterModule().filters(), **CatalogFilters().filters())


def extra(*words):
    return dict(GOOD, vllm_args=dict(CPU, extra_args=list(words)))


def args(**kw):
    return dict(GOOD, vllm_args=dict(CPU, **kw))


def entry_problems(entry, name="tiny-a"):
    return "; ".join(catalog.entry_problems(name, entry))


def unit_problems(**change):
    return "; ".join(vllm_unit.unit_problems(dict(SAFE_UNIT, **change)))


def raises(func, *a):
    try:
        func(*a)
    except (vllm_unit.ArgsError, cache_layout.StoreError) as exc:
        return str(exc)
    return ""


# (row, what was tried, the error it must give)
PURE_ROWS = [
    # --- issue 14 item 5: reserved flags in extra_args, in every spelling vLLM's parser accepts
    ("extra --api-key K", lambda: entry_problems(extra("--api-key", MARKER)), "sets --api-key, which the role owns"),
    ("extra --api-key=K", lambda: entry_problems(extra("--api-key=" + MARKER)), "sets --api-key"),
    ("extra --api_key K", lambda: entry_problems(extra("--api_key", MARKER)), "sets --api-key"),
    ("extra --api-k K (abbreviation)", lambda: entry_problems(extra("--api-k", MARKER)),
     "vLLM reads --api-k as --api-key"),
    ("extra --api-key.x K (dotted)", lambda: entry_problems(extra("--api-key.x", MARKER)), "sets --api-key"),
    ("extra --host 0.0.0.0", lambda: entry_problems(extra("--host", "0.0.0.0")), "use vllm_service_host"),
    ("extra --host=::", lambda: entry_problems(extra("--host=::")), "sets --host"),
    ("extra --hos=:: (abbreviation)", lambda: entry_problems(extra("--hos=::")), "vLLM reads --hos as --host"),
    ("extra --port 9000", lambda: entry_problems(extra("--port", "9000")), "use vllm_service_port"),
    ("extra --port=9000", lambda: entry_problems(extra("--port=9000")), "sets --port"),
    ("extra --model /other", lambda: entry_problems(extra("--model", "/other")), "sets --model"),
    ("extra --model=/other", lambda: entry_problems(extra("--model=/other")), "sets --model"),
    ("extra --served-model-name x", lambda: entry_problems(extra("--served-model-name", "x")),
     "sets --served-model-name"),
    ("extra --served_model_name=x", lambda: entry_problems(extra("--served_model_name=x")),
     "sets --served-model-name"),
    ("extra --config f.yaml", lambda: entry_problems(extra("--config", "/etc/x.yaml")), "sets --config"),
    ("extra --uds sock", lambda: entry_problems(extra("--uds", "/run/v.sock")), "sets --uds"),
    ("extra --middleware m.M", lambda: entry_problems(extra("--middleware", "m.M")), "sets --middleware"),
    ("extra --headless", lambda: entry_problems(extra("--headless")), "sets --headless"),
    ("extra --grpc", lambda: entry_problems(extra("--grpc")), "sets --grpc"),
    ("extra --revision main", lambda: entry_problems(extra("--revision", "main")), "sets --revision"),
    ("extra --download-dir=/tmp", lambda: entry_problems(extra("--download-dir=/tmp")), "sets --download-dir"),
    ("extra flag in a value's place", lambda: entry_problems(extra("--tool-call-parser", "--api-key")),
     "extra_args[1] sets --api-key"),
    ("extra word with a newline", lambda: entry_problems(extra("--enforce-eager" + INJECT)),
     "extra_args[0] contains a newline"),
    ("vllm_args api_key", lambda: entry_problems(args(api_key=MARKER)), "vllm_args.api_key is not allowed"),
    ("vllm_args hos (abbreviation)", lambda: entry_problems(args(hos="h")), "vLLM reads --hos as --host"),
    ("vllm_args config", lambda: entry_problems(args(config="/x.yaml")), "vllm_args.config is not allowed"),
    ("vllm_args key with a newline", lambda: entry_problems(args(**{"dtype\n": "x"})),
     "is not a vLLM argument name"),
    # --- issue 14 item 9: names and values that reach the unit file
    ("catalog name with a newline", lambda: entry_problems(GOOD, "tiny-a" + INJECT), "the catalog name"),
    ("catalog name, trailing newline", lambda: entry_problems(GOOD, "tiny-a\n"), "the catalog name"),
    ("catalog name with a space", lambda: entry_problems(GOOD, "tiny a"), "the catalog name"),
    ("catalog name with a % specifier", lambda: entry_problems(GOOD, "tiny-%n"), "the catalog name"),
    ("served name with a newline", lambda: entry_problems(dict(GOOD, served_model_name="tiny-a" + INJECT)),
     "served_model_name"),
    ("served name with a quote", lambda: entry_problems(dict(GOOD, served_model_name='a"b')), "served_model_name"),
    ("served name with a % specifier", lambda: entry_problems(dict(GOOD, served_model_name="a%i")),
     "served_model_name"),
    ("repo_id, trailing newline", lambda: entry_problems(dict(GOOD, repo_id="lab/tiny-a\n")), "is malformed"),
    ("repo_id with a space", lambda: entry_problems(dict(GOOD, repo_id="lab/tiny a")), "is malformed"),
    ("repo_id with three parts", lambda: entry_problems(dict(GOOD, repo_id="a/b/c")), "is malformed"),
    ("repo_id missing", lambda: entry_problems(dict(GOOD, repo_id=None)), "not a non-empty string"),
    ("revision, trailing newline", lambda: entry_problems(dict(GOOD, revision="main\n")), "revision"),
    ("revision with ..", lambda: entry_problems(dict(GOOD, revision="a/../b")), "no '..'"),
    ("entry not a mapping", lambda: entry_problems(["lab/tiny-a"]), "must be a mapping"),
    ("unit name, trailing newline", lambda: unit_problems(unit="vllm.service\n"), "vllm_service_unit"),
    ("replaced unit with a newline", lambda: unit_problems(replaces=["old.service" + INJECT]),
     "vllm_service_replaces entry"),
    ("user with a newline", lambda: unit_problems(user="vllm" + INJECT), "vllm_service_user"),
    ("group with a space", lambda: unit_problems(group="vllm users"), "vllm_service_group"),
    ("home with a newline", lambda: unit_problems(home="/var/lib/vllm" + INJECT), "vllm_service_home"),
    ("config_dir relative", lambda: unit_problems(config_dir="etc/modelswap"), "vllm_service_config_dir"),
    ("config_dir with a space", lambda: unit_problems(config_dir="/etc/model swap"), "vllm_service_config_dir"),
    ("host with a newline", lambda: unit_problems(host="0.0.0.0" + INJECT), "vllm_service_host"),
    ("hardening value with a newline",
     lambda: unit_problems(hardening={"ProtectSystem": "strict" + INJECT}), "vllm_service_hardening.ProtectSystem"),
    ("hardening value, trailing backslash", lambda: unit_problems(hardening={"UMask": "0027\\"}),
     "trailing backslash"),
    ("hardening option with a newline", lambda: unit_problems(hardening={"Protect" + INJECT: "yes"}),
     "is not a systemd option name"),
    ("env name, trailing newline", lambda: unit_problems(env={"FOO\n": "1"}), "environment variable name"),
    ("env value with a newline", lambda: unit_problems(env={"FOO": "1" + INJECT}), "contains a newline"),
    ("env value with a carriage return", lambda: unit_problems(env={"FOO": "1\rX=2"}), "contains a newline"),
    ("API key in the environment", lambda: unit_problems(env={"VLLM_API_KEY": MARKER}),
     "the key has a 0600 file of its own"),
    ("API key with a newline", lambda: raises(vllm_unit.env_lines, {"VLLM_API_KEY": "k" + INJECT}), "contains a newline"),
    # --- issue 14 item 4: the route guard's settings
    ("Rust front end with the guard", lambda: unit_problems(env={"VLLM_USE_RUST_FRONTEND": "1"}),
     "does not run the route guard"),
    ("open route that runs inference", lambda: unit_problems(open_routes=["/health", "/invocations"]),
     "may name only the probes"),
    ("open routes without /health", lambda: unit_problems(open_routes=["/metrics"]), "must keep /health"),
    # --- issue 29: vLLM's drain must fit inside the unit's stop
    ("drain longer than the stop", lambda: unit_problems(shutdown_timeout=100, stop_timeout=120),
     "vllm_service_stop_timeout (120 s) must be at least vllm_service_shutdown_timeout (100 s) + 30 s"),
    ("drain negative", lambda: unit_problems(shutdown_timeout=-1, stop_timeout=120), "whole seconds >= 0"),
    ("drain not a number", lambda: unit_problems(shutdown_timeout="1m", stop_timeout=120), "whole seconds >= 0"),
    ("drain a boolean", lambda: unit_problems(shutdown_timeout=True, stop_timeout=120), "whole seconds >= 0"),
    ("stop timeout not a number", lambda: unit_problems(shutdown_timeout=0, stop_timeout="2m"),
     "vllm_service_stop_timeout must be whole seconds"),
    ("drain set in the catalog", lambda: raises(vllm_args_rules.vllm_args_argv, {"shutdown_timeout": 5}),
     "use vllm_service_shutdown_timeout"),
    ("drain abbreviated in extra_args", lambda: raises(vllm_args_rules.vllm_args_argv,
                                                       {"extra_args": ["--shutdown-t=5"]}),
     "use vllm_service_shutdown_timeout"),
    # --- the shared identifier rules ($ accepted a trailing newline)
    ("cache_layout repo id, trailing newline", lambda: raises(cache_layout.validate_repo_id, "org/name\n"),
     "is malformed"),
    ("snapshot_check repo id, trailing newline",
     lambda: snapshot_check.check("m", "org/name\n", "a" * 40, cache_dir="/nonexistent")["reason"], "is malformed"),
    ("cache_layout commit, trailing newline",
     lambda: "" if cache_layout.COMMIT_RE.match("a" * 40 + "\n") else "not a commit", "not a commit"),
    ("snapshot_check commit, trailing newline",
     lambda: "" if snapshot_check.COMMIT_RE.match("a" * 40 + "\n") else "not a commit", "not a commit"),
]


@pytest.mark.parametrize("row, tried, message", PURE_ROWS, ids=[r[0] for r in PURE_ROWS])
def test_bad_input_is_refused_with_a_clear_error(row, tried, message):
    problem = tried()
    assert message in problem, (row, problem)
    assert MARKER not in problem                 # a refused key is never repeated in an error


def test_the_filters_refuse_what_the_functions_refuse():
    """The role calls these through its filters; a refused value fails the filter, before any file."""
    from ansible.errors import AnsibleFilterError
    assert FILTERS["catalog_problems"]({"tiny-a": extra("--port=1")}, "tiny-a")
    assert FILTERS["vllm_unit_problems"](dict(SAFE_UNIT, unit="x.service\n"))
    with pytest.raises(AnsibleFilterError, match="sets --api-key"):
        FILTERS["vllm_serve_argv"](dict(CPU, extra_args=["--api_key=" + MARKER]), "/v/bin/vllm", "/m", "m", "h", 1)
    with pytest.raises(AnsibleFilterError, match="VLLM_USE_RUST_FRONTEND"):
        FILTERS["vllm_guard_env"]({"VLLM_USE_RUST_FRONTEND": "true"}, "/opt/g", ["/health"])


# What stays valid: the rules must not refuse real names.
@pytest.mark.parametrize("name, entry", [
    ("tiny-a", GOOD),
    ("kimi-k2.5-int4", dict(GOOD, repo_id="moonshotai/Kimi-K2.5", served_model_name="kimi-k2.5")),
    ("gpt2", dict(GOOD, repo_id="gpt2", revision="main", served_model_name="")),
    ("m", dict(GOOD, repo_id="Org_1.x/Model-7B.v1_2", revision="refs/pr/1",
               served_model_name="org/Model-7B:v1@x+y")),
    ("minimax-m2.5", dict(GOOD, vllm_args={"tensor_parallel_size": 8, "extra_args": [
        "--tool-call-parser", "minimax_m2", "--model-impl", "vllm", "--hf-overrides.rope_scaling.factor", "4",
        "--no-enable-prefix-caching", "--config-format", "hf", "--grpc-port", "0", "--root-path", "/api",
        "--kv-transfer-config", '{"host": "10.0.0.1", "port": 1}']})),
])
def test_valid_entries_stay_valid(name, entry):
    assert catalog.entry_problems(name, entry) == []


def test_valid_unit_settings_stay_valid():
    assert vllm_unit.unit_problems(SAFE_UNIT) == []
    assert vllm_unit.unit_problems(dict(SAFE_UNIT, host="::", replaces=["vllm-minimax.service", "a@b.service"],
                                        user="_vllm-1", home="/srv/vllm_home/a.b", guard=False,
                                        open_routes=["/nope"], env={"VLLM_USE_RUST_FRONTEND": "1"})) == []


@pytest.mark.parametrize("word, name", [
    ("--api-key", "api-key"), ("--api_key=x", "api-key"), ("--hf-overrides.rope_scaling.factor", "hf-overrides"),
    ("--x=a.b", "x"), ("-tp", None), ("value", None), ("--", None), ("--a_b.c_d=e_f", "a-b"),
])
def test_flag_name_reads_words_as_vllms_parser_does(word, name):
    assert vllm_args_rules.flag_name(word) == name


# The rows run through the role on a lab host (tests/integration/test_vllm_routes_lab.py).
# entry: changes to the served catalog entry; name: the catalog key served instead of tiny-a;
# vars: role variables; the message the failed validate task must give.
ROLE_ROWS = [
    ("extra_args --api-key K", {"entry": {"vllm_args": dict(CPU, extra_args=["--api-key", MARKER])}},
     "sets --api-key, which the role owns"),
    ("extra_args --port=9000", {"entry": {"vllm_args": dict(CPU, extra_args=["--port=9000"])}},
     "sets --port"),
    ("extra_args --served_model_name x", {"entry": {"vllm_args": dict(CPU, extra_args=["--served_model_name", "x"])}},
     "sets --served-model-name"),
    ("vllm_args hos (abbreviation)", {"entry": {"vllm_args": dict(CPU, hos="0.0.0.0")}},
     "vLLM reads --hos as --host"),
    ("catalog name with a newline", {"name": "tiny-a" + INJECT}, "the catalog name"),
    ("served name with a newline", {"entry": {"served_model_name": "tiny-a" + INJECT}}, "served_model_name"),
    ("repo_id, trailing newline", {"entry": {"repo_id": "lab/tiny-a\n"}}, "is malformed"),
    ("unit name, trailing newline", {"vars": {"vllm_service_unit": "vllm.service\n"}},
     "vllm_service_unit a *.service name"),
    ("env value with a newline", {"vars": {"vllm_service_env": {"VLLM_HOST_IP": "127.0.0.1" + INJECT}}},
     "contains a newline"),
    ("hardening value with a newline", {"vars": {"vllm_service_hardening": {"ProtectSystem": "strict" + INJECT}}},
     "vllm_service_hardening.ProtectSystem"),
    ("Rust front end with the guard", {"vars": {"vllm_service_env": {"VLLM_USE_RUST_FRONTEND": "1"}}},
     "does not run the route guard"),
    ("API key in the environment", {"vars": {"vllm_service_env": {"VLLM_API_KEY": MARKER}}},
     "the key has a 0600 file of its own"),
    ("open route that runs inference", {"vars": {"vllm_service_open_routes": ["/health", "/invocations"]}},
     "vllm_service_open_routes"),
]


@pytest.mark.parametrize("row, change, message", ROLE_ROWS, ids=[r[0] for r in ROLE_ROWS])
def test_role_rows_are_refused_by_the_same_functions(row, change, message):
    """Each role row's refusal comes from a rule tested here (the argument spec's choices for the
    open routes; the first assert's full-string rule for the unit name)."""
    entry = dict(GOOD, **change.get("entry", {}))
    name = change.get("name", "tiny-a")
    settings = dict(SAFE_UNIT)
    env_change = change.get("vars", {}).get("vllm_service_env")
    if env_change:
        settings["env"] = dict(settings["env"], **env_change)
    for var in ("vllm_service_hardening", "vllm_service_open_routes", "vllm_service_unit"):
        if var in change.get("vars", {}):
            settings[var.replace("vllm_service_", "")] = change["vars"][var]
    found = "; ".join(catalog.entry_problems(name, entry) + vllm_unit.unit_problems(settings))
    assert found, row
    assert MARKER not in found


@pytest.mark.repo
def test_the_example_catalog_passes_the_rules():
    """The rules refuse nothing a real catalog holds (inventory/example's models)."""
    import yaml
    from pathlib import Path
    path = Path(__file__).resolve().parents[3] / "inventory/example/group_vars/all/models.yml"
    models = yaml.safe_load(path.read_text())["modelswap_models"]
    assert len(models) >= 3
    for name, entry in models.items():
        assert catalog.entry_problems(name, entry) == [], name
