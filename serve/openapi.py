"""``/openapi.json`` as the server answers (issue 49): FastAPI's document, corrected where it describes another
server than this one.

* **Errors**: validation failures are 400 with this server's error body (``{"error": {"message", "type", "param",
  "code"}}``), never FastAPI's 422; every status the server's gate can answer (401 with an API key, 403 for a
  foreign origin, 408 / 413 / 415 for a body, 421 for a foreign Host, 503 while starting or shutting down, 500) is
  documented with that body, as are 404 (an unknown model) and the endpoints' own refusals.
* **Content types**: ``/metrics`` is Prometheus text (``text/plain``); ``/generate``, ``/v1/completions`` and
  ``/v1/chat/completions`` answer ``text/event-stream`` when streaming; ``/health`` answers its own status
  object, 503 included; ``/flush_cache``'s refusal is its own ``{"success": false, "message"}``.
* **Operation ids**: unique, ``<method>_<path>`` (a route serving GET and POST had one id for both).
* **Authentication**: with an API key, a bearer scheme required everywhere but ``/health`` and the playground.
"""

from __future__ import annotations

import re
from typing import Any

from fastapi import FastAPI

from serve.limits import is_open

ERROR_SCHEMA = {
    "type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
ERROR_REF = {"$ref": "#/components/schemas/Error"}
HEALTH_SCHEMA = {"type": "object", "required": ["status"],
                 "properties": {"status": {"type": "string", "enum": ["ok", "starting", "shutting_down", "failed"]},
                                "error": {"type": "string"}}}
FLUSH_SCHEMA = {"type": "object", "required": ["success", "message"],
                "properties": {"success": {"type": "boolean"}, "message": {"type": "string"}}}
STREAMING = ("/generate", "/v1/completions", "/v1/chat/completions")
DESCRIPTIONS = {400: "Invalid request: param names the field", 401: "Missing or invalid API key",
                403: "Refused: a foreign Origin (or a path outside the profile root)", 404: "Not found",
                408: "The body did not arrive in time", 413: "The body is too large or too complex",
                415: "The body is not JSON", 421: "The Host is not a name of this server",
                500: "Internal error", 503: "Starting, shutting down or at capacity (Retry-After)"}


def install(app: FastAPI, api_key: bool) -> None:
    """Serve the corrected document (built once, on the first request for it)."""

    fastapi_openapi = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = correct(fastapi_openapi(), api_key)
        return app.openapi_schema

    app.openapi = openapi


def _json(schema: dict) -> dict:
    return {"application/json": {"schema": schema}}


def _response(status: int, schema: dict = ERROR_REF) -> dict:
    return {"description": DESCRIPTIONS.get(status, "Error"), "content": _json(schema)}


def operation_id(method: str, path: str) -> str:
    """``get_v1_models_model_id``: unique per method and path."""
    return f"{method}_" + "_".join(p for p in re.split(r"[^A-Za-z0-9]+", path) if p)


def correct(schema: dict, api_key: bool) -> dict:
    components = schema.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    schemas.pop("HTTPValidationError", None)
    schemas.pop("ValidationError", None)
    schemas["Error"] = ERROR_SCHEMA
    if api_key:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, ops in schema.get("paths", {}).items():
        for method, op in ops.items():
            _correct_operation(path, method, op, api_key)
    return schema


def _correct_operation(path: str, method: str, op: dict[str, Any], api_key: bool) -> None:
    op["operationId"] = operation_id(method, path)
    responses = op.setdefault("responses", {})
    responses.pop("422", None)
    ok = responses.setdefault("200", {"description": "Successful Response"})
    statuses = [400, 403, 408, 413, 421, 500, 503]
    if method == "post":
        statuses.append(415)
    if api_key and not is_open(path):
        statuses.append(401)
        op["security"] = [{"bearer": []}]
    elif api_key:
        op["security"] = []
    if path.startswith("/v1/models/"):
        statuses.append(404)
    for status in sorted(statuses):
        responses.setdefault(str(status), _response(status))
    if path == "/health":
        ok["content"] = _json(HEALTH_SCHEMA)
        responses["503"] = {"description": "Not admitting requests (starting, shutting_down, failed)",
                            "content": _json({"anyOf": [HEALTH_SCHEMA, ERROR_REF]})}
    elif path == "/metrics":
        ok["content"] = {"text/plain": {"schema": {"type": "string"}}}
    elif path == "/flush_cache":
        ok["content"] = _json(FLUSH_SCHEMA)
        responses["400"] = {"description": "Not flushed: requests are running, queued or paused in place",
                            "content": _json({"anyOf": [FLUSH_SCHEMA, ERROR_REF]})}
    elif path in STREAMING:
        ok.setdefault("content", _json({}))["text/event-stream"] = {"schema": {"type": "string"}}
