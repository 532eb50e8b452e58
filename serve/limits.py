"""Limits, authentication and the browser defences, as one ASGI middleware in front of the app.

In the order they apply (see serve/README.md, "Threat model", for why):

* **Host and Origin** (DNS rebinding, cross-site requests): a request whose ``Host`` is a name other than
  ``localhost``, the bound name or one of ``allowed_hosts`` is a 421 (an IP address always passes: a rebinding
  page sends its own name); one whose ``Origin`` (sent by browsers) is neither this server's own page nor a host of
  ours is a 403. Off with ``allowed_hosts=["*"]``, and by default when bound to a wildcard address with an API key
  (:attr:`ServerSettings.any_host`).
* **State-changing endpoints** (:data:`STATE_CHANGING`: the cache, the profiler, aborts, weight updates, pause /
  continue, memory release; every method): only this server's own pages, whatever the settings. A request whose
  ``Origin`` is not the origin of the request's own ``Host`` (another port of localhost included), or that a
  browser marks ``Sec-Fetch-Site`` ``cross-site`` / ``same-site`` (an ``<img>`` GET carries no Origin), is a 403; a
  request with neither header (curl, SDKs, RL trainers) passes.
* **API key**: with one, every path but the open ones (``/health`` and the playground's static page, which asks
  for the key itself) needs ``Authorization: Bearer KEY``: 401 with ``WWW-Authenticate: Bearer`` otherwise, before
  the body is read.
* **Size**: bodies over ``max_request_bytes`` are 413, by ``Content-Length`` or while they are read.
* **Type**: a POST body must be declared JSON (``application/json`` or ``*+json``): 415 otherwise, so that no
  HTML form or "simple" cross-site ``fetch`` (which cannot send that type without a CORS preflight, which this
  server never grants) reaches an endpoint. A POST without a body needs no type.
* **Time**: the body must arrive within ``body_timeout_s`` of the request's start: 408 and the connection closed
  otherwise (a client that announces 100 bytes and sends 12 must not hold a connection for ever).
* Every response is counted in ``dllm_http_responses_total{endpoint, status}`` (unknown paths as ``other``) and
  every refusal here in ``dllm_rejected_requests_total{reason}``.

The capacity limit (running + queued engine requests) is :meth:`serve.state.Server.start_batch`'s.
"""

from __future__ import annotations

import ipaddress
import secrets
from typing import Callable
from urllib.parse import urlsplit

import anyio

from serve.errors import ApiError
from serve.settings import WILDCARD_HOSTS, ServerSettings

OPEN_PATHS = frozenset({"/health", "/", "/favicon.ico"})
# Endpoints that change the server's state (every POST endpoint but generation and the read-only ones): only this
# server's own pages may call them (tests/test_serve_unit.py checks that no POST route is left out)
STATE_CHANGING = frozenset({"/flush_cache", "/start_profile", "/stop_profile", "/abort_request",
                            "/update_weights_from_disk", "/update_weights_from_tensor", "/update_weight_version",
                            "/pause_generation", "/continue_generation", "/release_memory_occupation",
                            "/resume_memory_occupation"})
OPEN_PREFIXES = ("/static/",)
CLOSE = {"Connection": "close"}  # a body left unread cannot be followed by another request on the connection


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

        err = self._refusal(scope, path)
        if err is not None:
            self._count(err.reason)
            return await err.response()(scope, receive, send_wrapper)
        limit = self.settings.max_request_bytes
        timeout = self.settings.body_timeout_s
        received = 0
        body_done = False
        deadline = anyio.current_time() + timeout

        async def receive_wrapper():
            nonlocal received, body_done
            if body_done:  # the body is in: what remains is the disconnect, awaited for as long as a stream runs
                return await receive()
            remaining = deadline - anyio.current_time()
            if remaining > 0:
                with anyio.move_on_after(remaining):
                    message = await receive()
                    if message["type"] == "http.request":
                        received += len(message.get("body", b""))
                        if received > limit:
                            raise ApiError(413, f"body: the request body exceeds the limit of {limit} bytes",
                                           "body", headers=CLOSE)
                        body_done = not message.get("more_body", False)
                    else:
                        body_done = True
                    return message
            raise ApiError(408, f"body: the request body did not arrive within {timeout:g} s "
                                f"({received} bytes received)", "body", headers=CLOSE)

        await self.app(scope, receive_wrapper, send_wrapper)

    def _refusal(self, scope, path: str) -> ApiError | None:
        """The answer to a request refused before the app sees it, or None."""
        settings = self.settings
        host = _header(scope, b"host")
        if not settings.any_host and host is not None and not host_allowed(host, settings):
            return ApiError(421, f"host: {host!r} is not a host name of this server (DNS rebinding "
                                 f"protection); start it with --allowed-hosts NAME to accept it", "host")
        if path in STATE_CHANGING:
            err = cross_site_refusal(scope, path, host)
            if err is not None:
                return err
        if not settings.any_host:
            origin = _header(scope, b"origin")
            if origin is not None and not origin_allowed(origin, host, settings):
                return ApiError(403, f"origin: requests from pages at {origin!r} are not accepted (only this "
                                     f"server's own pages, localhost and --allowed-hosts)", "origin")
        if settings.api_key and not is_open(path) and not self._authorized(scope):
            return ApiError(401, "authorization: missing or invalid API key (Authorization: Bearer KEY)",
                            "authorization", headers={"WWW-Authenticate": "Bearer"})
        length = _header(scope, b"content-length")
        limit = settings.max_request_bytes
        if length is not None and length.isdigit() and int(length) > limit:
            return ApiError(413, f"body: the request body has {length} bytes; the limit is {limit}", "body",
                            headers=CLOSE)
        if scope.get("method") == "POST":
            ctype = _header(scope, b"content-type")
            has_body = (length is not None and length.strip() not in ("", "0")) or \
                _header(scope, b"transfer-encoding") is not None
            if (ctype is not None or has_body) and not is_json(ctype or ""):
                shown = f"{ctype!r}" if ctype is not None else "none"
                return ApiError(415, f"content-type: a request body must be JSON (Content-Type: application/json), "
                                     f"got {shown}", "content-type", headers=CLOSE)
        return None

    def _count(self, reason: str | None) -> None:
        server = self.server_ref()
        if server is not None and reason is not None:
            server.metrics.rejected.labels(reason).inc()

    def _authorized(self, scope) -> bool:
        value = _header(scope, b"authorization") or ""
        scheme, _, token = value.partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(),
                                                                     self.settings.api_key.encode())


def is_json(content_type: str) -> bool:
    media = content_type.split(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def split_host(value: str) -> tuple[str, str | None]:
    """``Host`` header or ``--allowed-hosts`` entry -> (lower-case name without brackets or final dot, port)."""
    value = value.strip().lower()
    if value.startswith("["):  # [v6]:port
        name, _, rest = value[1:].partition("]")
        if rest and not rest.startswith(":"):
            return "", None  # malformed: no name
        port = rest[1:] or None
    elif value.count(":") == 1:
        name, port = value.split(":")
    else:  # a name, or a bare IPv6 address
        name, port = value, None
    return name.rstrip("."), port or None


def _ip(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None


def _ours(name: str, port: str | None, settings: ServerSettings) -> bool:
    """``localhost`` or a loopback address (any port), the name the server was bound to (any port), or an
    ``allowed_hosts`` entry (``name``: any port, ``name:port``: that one)."""
    ip = _ip(name)
    if name == "localhost" or (ip is not None and ip.is_loopback):
        return True
    bound = settings.host
    if bound is not None and bound.strip("[]") not in WILDCARD_HOSTS and name == split_host(bound)[0]:
        return True
    for entry in settings.allowed_hosts or ():
        if entry == "*":
            return True
        allowed_name, allowed_port = split_host(entry)
        if name == allowed_name and (allowed_port is None or allowed_port == port):
            return True
    return False


def host_allowed(host: str, settings: ServerSettings) -> bool:
    """Whether a ``Host`` value can be this server's: an IP address (a client that typed an address; a DNS-rebinding
    page cannot send one, its requests carry the attacker's name), or a name of ours (:func:`_ours`)."""
    name, port = split_host(host)
    return bool(name) and (_ip(name) is not None or _ours(name, port, settings))


def origin_allowed(origin: str, host: str | None, settings: ServerSettings) -> bool:
    """Whether a browser's ``Origin`` is a page of this server (the request's own ``Host``: the playground, however
    it was reached) or of a host of ours; ``null`` (sandboxed frames, local files) and other sites are not."""
    try:
        netloc = urlsplit(origin.strip()).netloc.rpartition("@")[2].lower()
    except ValueError:
        return False
    if not netloc:
        return False
    if host is not None and netloc == host.strip().lower():
        return True
    return _ours(*split_host(netloc), settings)


_DEFAULT_PORTS = {"http": "80", "https": "443"}


def same_origin(origin: str, host: str | None) -> bool:
    """Whether ``Origin`` is the origin of the request's own ``Host`` (scheme's default port filled in on both
    sides): a page this server served, however it was reached. ``null`` and any other origin are not."""
    if host is None:
        return False
    try:
        parts = urlsplit(origin.strip())
    except ValueError:
        return False
    netloc = parts.netloc.lower()
    if not netloc or "@" in netloc or parts.scheme.lower() not in _DEFAULT_PORTS or parts.path not in ("", "/"):
        return False
    default = _DEFAULT_PORTS[parts.scheme.lower()]
    name, port = split_host(netloc)
    host_name, host_port = split_host(host)
    return bool(name) and (name, port or default) == (host_name, host_port or default)


def cross_site_refusal(scope, path: str, host: str | None) -> ApiError | None:
    """The 403 of a state-changing request that a browser sent from a page other than this server's own."""
    origin = _header(scope, b"origin")
    if origin is not None and not same_origin(origin, host):
        return ApiError(403, f"origin: {path} changes the server's state and accepts requests from this server's own "
                             f"pages only (Origin {_short(origin)} is not the origin of Host {_short(host)}); other "
                             f"clients send no Origin", "origin")
    site = _header(scope, b"sec-fetch-site")
    if site is not None and site.strip().lower() not in ("same-origin", "none"):
        return ApiError(403, f"origin: {path} changes the server's state and accepts requests from this server's own "
                             f"pages only (the browser marked this one Sec-Fetch-Site: {_short(site)})", "origin")
    return None


def _short(text: str | None, limit: int = 80) -> str:
    """A client's header value, quoted and cut short, for a message."""
    if text is None:
        return "none"
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _header(scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None
