"""Errors: every refusal is ``{"error": {"message", "type", "param", "code"}}``, ``param`` naming the field and
``code`` a string or null, as OpenAI's (``model_not_found``, ``invalid_api_key``, ``request_too_large``,
``body_too_complex``; null for the rest, whose ``type`` and HTTP status say what they are).

A ``ValueError`` from the engine or a validator starts with the field's path (``sampling_params[1].top_p: ...``);
:func:`bad_request` and :func:`error_from_validation` turn such messages into an :class:`ApiError` whose ``param``
is that path (renamed to the body's own names on the OpenAI endpoints). A client error (4xx) always names what it
concerns: a body field, or ``body``, ``path``, ``method``, ``host``, ``origin``, ``content-type``,
``authorization``; only server-side errors (5xx) have ``param: null``.
"""

from __future__ import annotations

import re
from http import HTTPStatus

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from serve.schemas import format_loc


class ApiError(Exception):
    TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
             404: "invalid_request_error", 405: "invalid_request_error", 408: "invalid_request_error",
             413: "invalid_request_error", 415: "invalid_request_error", 421: "invalid_request_error",
             500: "server_error", 503: "server_busy"}
    REASONS = {400: "invalid", 401: "unauthorized", 403: "forbidden", 404: "not_found", 408: "body_timeout",
               413: "too_large", 415: "unsupported_media_type", 421: "misdirected", 503: "unavailable"}

    # OpenAI's ``code`` is a string or null: null for most refusals (the type and the status say what they are), a
    # machine-readable name where a client may act on it
    CODES = {401: "invalid_api_key", 413: "request_too_large"}

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None,
                 reason: str | None = None, code: str | None = None):
        super().__init__(message)
        if param is None and status < 500:
            message, param = _name_the_part(status, message, headers)
        self.status, self.message, self.param, self.headers = status, message, param, headers
        self.code = code if code is not None else self.CODES.get(status)
        self.reason = reason or self.REASONS.get(status)

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.status, self.message, self.param, self.code), status_code=self.status,
                            headers=self.headers)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": _printable(message), "type": ApiError.TYPES.get(status, "error"),
                      "param": None if param is None else _printable(param),
                      "code": code if code is not None else ApiError.CODES.get(status)}}


def _printable(text: str) -> str:
    """``text`` as UTF-8 can carry it: a message quoting the client's bad text must not fail to encode itself."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


_FIELD_RE = re.compile(r"^([A-Za-z_][\w.\[\]-]*):\s")
# The framework's own refusals (FastAPI reading the body, Starlette routing), which arrive with stock messages
_BODY_UNREADABLE = "There was an error parsing the body"


def _param_of(message: str) -> str | None:
    m = _FIELD_RE.match(message)
    return m.group(1) if m else None


def _name_the_part(status: int, message: str, headers: dict | None) -> tuple[str, str | None]:
    """(message, param) of a client error raised without a param: the field its message starts with, or for the
    framework's stock messages the part of the request they concern."""
    param = _param_of(message)
    if param is not None:
        return message, param
    if message == _BODY_UNREADABLE:  # not UTF-8, nested too deeply for the parser, ...
        return "body: malformed JSON: the body could not be decoded (not UTF-8 or nested too deeply)", "body"
    if status == 404 and message == HTTPStatus.NOT_FOUND.phrase:
        return "path: no such endpoint (see GET /docs)", "path"
    if status == 405 and message == HTTPStatus.METHOD_NOT_ALLOWED.phrase:
        allow = (headers or {}).get("Allow") or (headers or {}).get("allow")
        return "method: not allowed on this endpoint" + (f" (use {allow})" if allow else ""), "method"
    return message, None


def model_not_found(name: str, served: list[str], param: str = "model") -> ApiError:
    """OpenAI's answer to a model this server does not serve (its clients look for ``code``)."""
    return ApiError(404, f"{param}: the model {name!r} does not exist on this server (it serves "
                         f"{', '.join(map(repr, served))})", param, code="model_not_found", reason="model_not_found")


def bad_request(message: str, renames: dict | None = None) -> ApiError:
    """A 400 from a ``ValueError`` whose message starts with the field's path (the engine's convention).
    ``renames`` maps engine paths to the body's own (the longest matching prefix wins; an empty name drops the
    prefix: ``{"sampling_params": ""}`` turns ``sampling_params.logit_bias.5000`` into ``logit_bias.5000``)."""
    param = _param_of(message)
    if param and renames:
        for old in sorted(renames, key=len, reverse=True):
            if param == old or param.startswith((old + ".", old + "[")):
                new = renames[old]
                rest = param[len(old):]
                if not new:
                    if not rest.startswith("."):
                        continue  # the prefix alone is no field of the body
                    rest = rest[1:]
                message = new + rest + message[len(param):]
                param = new + rest
                break
    return ApiError(400, message, param)


def qualify(message: str, prefix: str, names) -> str:
    """An engine message whose field is a bare sampling parameter (``top_logprobs_num: ...``, as a model's own
    refusals name them) as the request's path to it (``sampling_params.top_logprobs_num: ...``), which
    :func:`bad_request`'s renames then turn into the body's name (``top_logprobs`` on chat)."""
    param = _param_of(message)
    if param is None or re.split(r"[.\[]", param)[0] not in names:
        return message
    return f"{prefix}.{message}"


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
    ctx = e.get("ctx") or {}
    if kind == "json_invalid":
        detail = ctx.get("error", "")
        where = f" at position {loc[0]}" if loc and isinstance(loc[0], int) else ""
        return ApiError(400, f"body: malformed JSON{where}" + (f": {detail}" if detail else ""), "body")
    if isinstance(ctx.get("param"), str):  # our validators that name the field outright (any text in its keys)
        return ApiError(400, msg, ctx["param"])
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
