"""The route guard vLLM loads with --middleware (roles/vllm_service/files/modelswap_vllm_guard.py),
driven as the ASGI server drives it: the key on every route but GET/HEAD of the open probes.

The lab test tests/integration/test_vllm_routes_lab.py checks the same against real vLLM 0.32."""
from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import pytest

from ansible_collections.modelswap.vllm.plugins.module_utils.serving import vllm_unit

pytestmark = pytest.mark.unit

PATH = Path(__file__).resolve().parents[3] / "roles/vllm_service/files/modelswap_vllm_guard.py"
KEY = "msk-unit-test-key"


def load_guard():
    spec = importlib.util.spec_from_file_location("modelswap_vllm_guard", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


guard = load_guard()


class App:
    """The inner application (vLLM): records what reached it."""

    def __init__(self):
        self.seen = []

    async def __call__(self, scope, receive, send):
        self.seen.append((scope["type"], scope.get("method"), scope.get("path")))
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})


def call(mw, scope):
    sent = []

    async def receive():
        return {"type": "http.request", "body": b""}

    async def send(message):
        sent.append(message)
    asyncio.run(mw(scope, receive, send))
    return sent


def http(method, path, key=None, headers=(), root_path=""):
    hdrs = [(b"host", b"h")] + [(k.encode(), v.encode()) for k, v in headers]
    if key is not None:
        hdrs.append((b"authorization", ("Bearer " + key).encode()))
    return {"type": "http", "method": method, "path": path, "root_path": root_path, "headers": hdrs}


@pytest.fixture
def mw(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    monkeypatch.delenv("MODELSWAP_VLLM_OPEN_ROUTES", raising=False)
    return guard.RequireApiKey(App())


INFERENCE = [("POST", p) for p in (
    "/invocations", "/tokenize", "/detokenize", "/pooling", "/classify", "/score", "/rerank",
    "/generative_scoring", "/v1/completions", "/v1/chat/completions", "/v2/rerank",
    "/inference/v1/generate", "/scale_elastic_ep", "/pause", "/sleep", "/reset_prefix_cache",
    "/ping")] + [("GET", p) for p in (
        "/openapi.json", "/docs", "/load", "/server_info", "/is_sleeping", "/v1/models",
        "/health/", "/metrics/", "//health", "/HEALTH", "/health/../invocations")]


@pytest.mark.parametrize("method, path", INFERENCE, ids=["%s %s" % mp for mp in INFERENCE])
def test_every_other_route_needs_the_key(mw, method, path):
    sent = call(mw, http(method, path))
    assert sent[0]["status"] == 401 and sent[1]["body"] == b'{"error":"Unauthorized"}'
    assert (b"www-authenticate", b"Bearer") in sent[0]["headers"]
    assert mw.app.seen == []                                  # vLLM never saw it
    for bad in ("wrong", "", KEY + "x", KEY[:-1]):
        assert call(mw, http(method, path, key=bad))[0]["status"] == 401
    assert call(mw, http(method, path, key=KEY))[0]["status"] == 200
    assert mw.app.seen == [("http", method, path)]


@pytest.mark.parametrize("header", ["Basic " + KEY, "Bearer  " + KEY, "Token " + KEY, KEY])
def test_only_a_bearer_token_counts(mw, header):
    sent = call(mw, http("POST", "/invocations", headers=[("authorization", header)]))
    assert sent[0]["status"] == 401


def test_the_scheme_is_case_insensitive_like_vllms(mw):
    sent = call(mw, http("POST", "/tokenize", headers=[("Authorization", "bearer " + KEY)]))
    assert sent[0]["status"] == 200


@pytest.mark.parametrize("path", ["/health", "/ping", "/metrics", "/version"])
@pytest.mark.parametrize("method", ["GET", "HEAD"])
def test_the_open_probes_answer_without_the_key(mw, method, path):
    assert call(mw, http(method, path))[0]["status"] == 200


def test_open_routes_come_from_the_environment_and_root_path_is_removed(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    monkeypatch.setenv("MODELSWAP_VLLM_OPEN_ROUTES", "/health")
    mw = guard.RequireApiKey(App())
    assert call(mw, http("GET", "/health"))[0]["status"] == 200
    assert call(mw, http("GET", "/metrics"))[0]["status"] == 401
    # behind a proxy (--root-path /api): the router matches /health, and so does the guard
    assert call(mw, http("GET", "/api/health", root_path="/api"))[0]["status"] == 200
    assert call(mw, http("GET", "/apihealth", root_path="/api"))[0]["status"] == 401
    assert call(mw, http("POST", "/api/invocations", root_path="/api"))[0]["status"] == 401


def test_a_cors_preflight_passes_other_options_do_not(mw):
    pre = http("OPTIONS", "/v1/completions", headers=[("origin", "https://ui.example"),
                                                      ("access-control-request-method", "POST")])
    assert call(mw, pre)[0]["status"] == 200
    assert call(mw, http("OPTIONS", "/invocations"))[0]["status"] == 401


def test_a_websocket_handshake_without_the_key_is_refused(mw):
    scope = {"type": "websocket", "path": "/v1/realtime", "headers": []}
    assert call(mw, scope) == [{"type": "websocket.close", "code": 1008}]
    scope["headers"] = [(b"authorization", ("Bearer " + KEY).encode())]
    call(mw, scope)
    assert mw.app.seen == [("websocket", None, "/v1/realtime")]


def test_lifespan_passes_through(mw):
    call(mw, {"type": "lifespan"})
    assert mw.app.seen == [("lifespan", None, None)]


def test_it_refuses_to_start_without_a_key(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with pytest.raises(RuntimeError, match="VLLM_API_KEY is empty"):
        guard.RequireApiKey(App())
    monkeypatch.setenv("VLLM_API_KEY", "")
    with pytest.raises(RuntimeError, match="refusing to serve without an API key"):
        guard.RequireApiKey(App())


def test_the_role_and_the_guard_agree_on_names():
    """The middleware path the role passes to vLLM names this file's class; the role's default
    open routes are the guard's own defaults."""
    module, cls = vllm_unit.GUARD_MIDDLEWARE.rsplit(".", 1)
    assert PATH.stem == module and hasattr(guard, cls)
    assert set(guard.DEFAULT_OPEN_ROUTES) <= set(vllm_unit.OPEN_ROUTE_CHOICES)
    env = vllm_unit.guard_env({"PYTHONPATH": "/x"}, "/opt/modelswap/lib/python", list(guard.DEFAULT_OPEN_ROUTES))
    assert env["PYTHONPATH"] == "/opt/modelswap/lib/python:/x"
    assert guard.open_routes(env["MODELSWAP_VLLM_OPEN_ROUTES"]) == frozenset(guard.DEFAULT_OPEN_ROUTES)


def test_the_role_defaults_and_spec_match_the_guard():
    import yaml
    role = PATH.parents[1]
    defaults = yaml.safe_load((role / "defaults/main.yml").read_text())
    spec = yaml.safe_load((role / "meta/argument_specs.yml").read_text())["argument_specs"]["main"]["options"]
    assert defaults["vllm_service_open_routes"] == list(guard.DEFAULT_OPEN_ROUTES)
    assert spec["vllm_service_open_routes"]["default"] == list(guard.DEFAULT_OPEN_ROUTES)
    assert spec["vllm_service_open_routes"]["choices"] == list(vllm_unit.OPEN_ROUTE_CHOICES)
    assert defaults["vllm_service_guard_routes"] is True
