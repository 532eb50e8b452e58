"""Errors: every refusal is ``{"error": {"message", "type", "param", "code"}}``, ``param`` naming the field.

A ``ValueError`` from the engine or a validator starts with the field's path (``sampling_params[1].top_p: ...``);
:func:`bad_request` and :func:`error_from_validation` turn such messages into an :class:`ApiError` whose ``param``
is that path (renamed to the body's own names on the OpenAI endpoints).
"""

from __future__ import annotations

import re

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from serve.schemas import format_loc


class ApiError(Exception):
    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             405: "invalid_request_error", 413: "invalid_request_error", 500: "server_error",
             503: "server_busy"}

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None,
                 reason: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers
        self.reason = reason or {400: "invalid", 401: "unauthorized", 413: "too_large", 503: "unavailable"}.get(status)

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.status, self.message, self.param), status_code=self.status,
                            headers=self.headers)


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": ApiError.TYPES.get(status, "error"), "param": param,
                      "code": status}}


_FIELD_RE = re.compile(r"^([A-Za-z_][\w.\[\]]*):\s")


def _param_of(message: str) -> str | None:
    m = _FIELD_RE.match(message)
    return m.group(1) if m else None


def bad_request(message: str, renames: dict | None = None) -> ApiError:
    """A 400 from a ``ValueError`` whose message starts with the field's path (the engine's convention)."""
    param = _param_of(message)
    if param and renames:
        for old, new in renames.items():
            if param == old or param.startswith(old + "."):
                message = new + message[len(old):]
                param = new + param[len(old):]
                break
    return ApiError(400, message, param)


def error_from_validation(exc: RequestValidationError) -> ApiError:
    errors = exc.errors()
    if not errors:
        return ApiError(400, "body: invalid request", "body")
    e = errors[0]
    loc = list(e.get("loc", ()))
    if loc and loc[0] == "body":
        loc = loc[1:]
    kind = e.get("type", "")
    msg = str(e.get("msg", "invalid"))
    if kind == "json_invalid":
        detail = (e.get("ctx") or {}).get("error", "")
        where = f" at position {loc[0]}" if loc and isinstance(loc[0], int) else ""
        return ApiError(400, f"body: malformed JSON{where}" + (f": {detail}" if detail else ""), "body")
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    path = format_loc(loc).lstrip(".")
    param = _param_of(msg)
    if param is not None:  # our validators name the field themselves, relative to the model they sit in
        if loc and isinstance(loc[-1], str) and re.split(r"[.\[]", param)[0] == loc[-1]:
            parent = format_loc(loc[:-1]).lstrip(".")
            if parent:
                msg, param = f"{parent}.{msg}", f"{parent}.{param}"
        return ApiError(400, msg, param)
    if not path:
        if kind == "missing":
            return ApiError(400, "body: a JSON object is required", "body")
        if kind in ("model_type", "model_attributes_type", "dict_type"):
            return ApiError(400, "body: must be a JSON object", "body")
        return ApiError(400, f"body: {msg}", "body")
    if kind == "extra_forbidden":
        msg = "unknown field"
    elif kind == "missing":
        msg = "required field is missing"
    return ApiError(400, f"{path}: {msg}", path)
