# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0
"""modelswap's route guard for vLLM: the API key on every route but a few probes.

vLLM's own ``--api-key`` / ``VLLM_API_KEY`` check (vllm/entrypoints/serve/middleware/
authenticate.py in 0.32) guards only the path prefixes ``/v1``, ``/v2``, ``/inference`` and
``/cohere``. Everything else answers without a key, inference included: ``/invocations``
(SageMaker: the same completions as /v1), ``/tokenize``, ``/detokenize``, ``/pooling``,
``/classify``, ``/score``, ``/rerank``, and the routes that change the server's state
(``/pause``, ``/sleep``, ``/reset_prefix_cache``, ...). vLLM has no option that widens its check.

The vllm_service role installs this file on the host, puts its folder on the service's
PYTHONPATH and starts vLLM with ``--middleware modelswap_vllm_guard.RequireApiKey``. vLLM adds
it after its own middleware, so it runs first, on every HTTP request and WebSocket handshake:

- a request to one of the open routes (``MODELSWAP_VLLM_OPEN_ROUTES``, comma-separated exact
  paths, by default ``/health,/ping,/metrics,/version``) with method GET or HEAD passes;
- a CORS preflight (OPTIONS with ``Origin`` and ``Access-Control-Request-Method``) passes to
  vLLM's CORS middleware, which answers it itself (a browser never sends a key there);
- everything else needs ``Authorization: Bearer <VLLM_API_KEY>``; without it the answer is
  401 ``{"error": "Unauthorized"}`` (the body vLLM's own check sends), or a refused handshake.

Without VLLM_API_KEY it refuses to start (fail closed): the role adds the guard only when it
has a key. Paths are compared the way Starlette routes them (``root_path`` removed), so a path
that reaches a route reaches this check with the same name. Standard library only.
"""
from __future__ import annotations

import hashlib
import os
import secrets

DEFAULT_OPEN_ROUTES = ("/health", "/ping", "/metrics", "/version")
OPEN_METHODS = ("GET", "HEAD")
UNAUTHORIZED = b'{"error":"Unauthorized"}'


def open_routes(text) -> frozenset:
    """The exact paths MODELSWAP_VLLM_OPEN_ROUTES names (unset: the default probes)."""
    if text is None:
        return frozenset(DEFAULT_OPEN_ROUTES)
    return frozenset(p.strip() for p in text.split(",") if p.strip())


def route_path(scope) -> str:
    """The path the router matches (Starlette's get_route_path): root_path removed."""
    path = scope.get("path", "")
    root = scope.get("root_path", "")
    if not root or not path.startswith(root):
        return path
    if path == root:
        return ""
    if path[len(root)] == "/":
        return path[len(root):]
    return path


def _headers(scope) -> dict:
    out = {}
    for name, value in scope.get("headers") or ():
        out.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))
    return out


class RequireApiKey:
    """Pure ASGI middleware: the key on every route but GET/HEAD of the open routes."""

    def __init__(self, app, api_key=None, routes=None):
        self.app = app
        key = os.environ.get("VLLM_API_KEY", "") if api_key is None else api_key
        if not key:
            raise RuntimeError(
                "modelswap_vllm_guard: VLLM_API_KEY is empty; refusing to serve without an API "
                "key (set vllm_service_api_key, or remove the guard for a deliberately open "
                "server)")
        self._digest = hashlib.sha256(key.encode("utf-8")).digest()
        self.open_routes = (open_routes(os.environ.get("MODELSWAP_VLLM_OPEN_ROUTES"))
                            if routes is None else frozenset(routes))

    def authorized(self, headers) -> bool:
        scheme, _unused, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        return secrets.compare_digest(hashlib.sha256(token.encode("utf-8")).digest(), self._digest)

    def allows(self, scope) -> bool:
        """Whether the request may reach vLLM."""
        headers = _headers(scope)
        if scope["type"] == "http":
            method = scope.get("method", "")
            if method in OPEN_METHODS and route_path(scope) in self.open_routes:
                return True
            if method == "OPTIONS" and "origin" in headers \
                    and "access-control-request-method" in headers:
                return True
        return self.authorized(headers)

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or self.allows(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            # Closing before accepting refuses the handshake (HTTP 403).
            await send({"type": "websocket.close", "code": 1008})
            return
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(UNAUTHORIZED)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": UNAUTHORIZED})
