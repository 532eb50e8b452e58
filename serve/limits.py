"""Limits and authentication, as one ASGI middleware in front of the app.

* With an API key, every path but the open ones (``/health`` and the playground's static page, which asks for the
  key itself) needs ``Authorization: Bearer KEY``: 401 with ``WWW-Authenticate: Bearer`` otherwise, before the body
  is read.
* Bodies over ``max_request_bytes`` are 413, by ``Content-Length`` or while they are read.
* A POST body is JSON whatever its ``Content-Type`` says (as SGLang, which reads ``request.json()``): ``curl -d``
  sends ``application/x-www-form-urlencoded``, and a README command must not need ``-H``. A body that is not JSON
  is a 400 naming it.
* Every response is counted in ``dllm_http_responses_total{endpoint, status}`` (unknown paths as ``other``) and
  every refusal here in ``dllm_rejected_requests_total{reason}``.

The capacity limit (running + queued engine requests) is :meth:`serve.state.Server.start_batch`'s.
"""

from __future__ import annotations

import secrets
from typing import Callable

from serve.errors import ApiError
from serve.settings import ServerSettings

OPEN_PATHS = frozenset({"/health", "/", "/favicon.ico"})
OPEN_PREFIXES = ("/static/",)


def is_open(path: str) -> bool:
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)


class Gate:
    def __init__(self, app, server_ref: Callable, settings: ServerSettings, routes: set[str]):
        self.app = app
        self.server_ref = server_ref
        self.settings = settings
        self.routes = routes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        endpoint = path if path in self.routes else "other"

        async def send_wrapper(message):
            if message["type"] == "http.response.start":  # counted before the client can see the answer
                server = self.server_ref()
                if server is not None:
                    server.metrics.http_responses.labels(endpoint, str(message["status"])).inc()
            await send(message)

        if self.settings.api_key and not is_open(path) and not self._authorized(scope):
            self._count("unauthorized")
            err = ApiError(401, "unauthorized: missing or invalid API key (Authorization: Bearer KEY)",
                           headers={"WWW-Authenticate": "Bearer"})
            return await err.response()(scope, receive, send_wrapper)
        limit = self.settings.max_request_bytes
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            self._count("too_large")
            err = ApiError(413, f"body: the request body has {length} bytes; the limit is {limit}", "body")
            return await err.response()(scope, receive, send_wrapper)
        if scope.get("method") == "POST":
            scope = as_json_body(scope)
        received = 0

        async def receive_wrapper():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise ApiError(413, f"body: the request body exceeds the limit of {limit} bytes", "body")
            return message

        await self.app(scope, receive_wrapper, send_wrapper)

    def _count(self, reason: str) -> None:
        server = self.server_ref()
        if server is not None:
            server.metrics.rejected.labels(reason).inc()

    def _authorized(self, scope) -> bool:
        value = _header(scope, b"authorization") or ""
        scheme, _, token = value.partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(),
                                                                     self.settings.api_key.encode())


def as_json_body(scope) -> dict:
    """``scope`` with its body declared JSON (the header replaced when it names another type)."""
    ctype = (_header(scope, b"content-type") or "").split(";")[0].strip().lower()
    if ctype == "application/json" or ctype.endswith("+json"):
        return scope
    headers = [(k, v) for k, v in scope.get("headers", ()) if k.lower() != b"content-type"]
    return dict(scope, headers=headers + [(b"content-type", b"application/json")])


def _header(scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None
