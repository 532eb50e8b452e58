"""Request bodies, parsed and validated in a worker thread with limits on their shape (issue 49).

FastAPI parses a JSON body and validates it against the route's model on the event loop: one hostile body (8 MB
holding 700,000 keys) held every other request, ``/health`` and every stream, for 8 s, and left ~700 MB behind.
:class:`JSONBodyRoute` (the routers' ``route_class``) does both off the loop, before FastAPI's own handler runs:

* **Limits**, checked while the body is parsed (so an oversized body is never built whole, nor validated):
  at most :data:`MAX_KEYS` keys in all, :data:`MAX_OBJECT_KEYS` in one object, :data:`MAX_ARRAY_ITEMS` items in
  one array, :data:`MAX_ITEMS` values in all (413, naming the object or array), and :data:`MAX_DEPTH` levels of
  nesting (400). No body of any endpoint comes near them (the largest objects are ``logit_bias``, 300 entries;
  the longest arrays are token ids and batches, bounded by the context and the capacity).
* **Off the loop**: a body with more colons than :data:`MAX_KEYS` is first counted by a scan that returns to the
  interpreter at every key (the worker thread then gives the event loop its turns, which one long C call would
  not); within the limits, the C parser's single call is short (about 0.1 s for the largest body allowed).
* **Memory back**: the parsed dict is dropped as soon as the model is validated (the model keeps what it needs),
  and after a body over :data:`TRIM_BYTES` the C allocator is asked to return its free pages to the system
  (``malloc_trim``).

FastAPI's handler then receives the validated model (re-validating an instance of the model costs nothing), so
the routes, their OpenAPI documents and their error messages are those FastAPI would give.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import re
from typing import Any

import anyio
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.requests import Request

from serve.errors import ApiError, error_from_validation
from serve.schemas.common import text_path

MAX_DEPTH = 32  # nested objects and arrays (a chat message's content part is 5 deep)
MAX_OBJECT_KEYS = 1024  # keys of one object
MAX_KEYS = 100_000  # keys in all
MAX_ARRAY_ITEMS = 1 << 20  # items of one array
MAX_ITEMS = 1 << 22  # values in all (array items and object values)
TRIM_BYTES = 1 << 20  # after a body this large, give the allocator's free pages back

_STRING_OR_KEY = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"(\s*:)?')
_SCALARS = frozenset({int, float, bool, str, type(None)})


class _TooManyKeys(Exception):
    pass


def _count_keys(body: bytes) -> int:
    """The keys of a JSON text (strings followed by a colon), one interpreter step per string: a long count that
    lets other threads run."""
    return sum(1 for m in _STRING_OR_KEY.finditer(body) if m.group(1) is not None)


def _too_many_keys(keys: int | None) -> ApiError:
    count = f"{keys:,} keys" if keys is not None else "more keys"
    return ApiError(413, f"body: {count} in all; the limit is {MAX_KEYS:,} keys in a request body", "body",
                    reason="too_complex", code="body_too_complex")


def parse_json(body: bytes) -> Any:
    """The JSON value of ``body`` within the limits above; an :class:`ApiError` (or FastAPI's ``json_invalid``
    validation error, which names the position) otherwise."""
    if body.count(b":") > MAX_KEYS:  # colons bound the keys from above (a string may hold some): count exactly
        keys = _count_keys(body)
        if keys > MAX_KEYS:
            raise _too_many_keys(keys)
    total = 0

    def pairs(items: list) -> dict:
        nonlocal total
        total += len(items)
        if total > MAX_KEYS:
            raise _TooManyKeys()
        return dict(items)

    try:
        value = json.loads(body, object_pairs_hook=pairs)
    except json.JSONDecodeError as e:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", e.pos), "msg": "JSON decode error",
                                       "input": {}, "ctx": {"error": e.msg}}]) from None
    except _TooManyKeys:
        raise _too_many_keys(None) from None
    except RecursionError:
        raise _too_deep() from None
    except (UnicodeDecodeError, ValueError):
        raise ApiError(400, "body: malformed JSON: the body could not be decoded (not UTF-8, UTF-16 or UTF-32)",
                       "body") from None
    check_shape(value)
    return value


def _too_deep() -> ApiError:
    return ApiError(400, f"body: nested deeper than {MAX_DEPTH} levels of objects and arrays", "body",
                    code="body_too_complex")


def _too_large(loc: tuple, what: str, count: int, limit: int, unit: str) -> ApiError:
    where = text_path(loc) or "body"
    return ApiError(413, f"{where}: {what} of {count:,} {unit}; the limit is {limit:,} {unit} in one "
                         f"{what.split()[-1]}", where, reason="too_complex", code="body_too_complex")


def check_shape(value: Any) -> None:
    """Depth, keys per object, items per array and values in all, within the limits; an :class:`ApiError`
    naming the first object or array over one. Iterative (any depth the parser allows)."""
    items = 0
    todo: list[tuple[Any, int, tuple]] = [(value, 1, ())]
    while todo:
        node, depth, loc = todo.pop()
        if depth > MAX_DEPTH:
            raise _too_deep()
        if isinstance(node, dict):
            if len(node) > MAX_OBJECT_KEYS:
                raise _too_large(loc, "an object", len(node), MAX_OBJECT_KEYS, "keys")
            items += len(node)
            children = node.items()
        elif isinstance(node, list):
            if len(node) > MAX_ARRAY_ITEMS:
                raise _too_large(loc, "an array", len(node), MAX_ARRAY_ITEMS, "items")
            items += len(node)
            children = None if _SCALARS.issuperset(map(type, node)) else enumerate(node)  # ids, texts: C speed
        else:
            continue
        if items > MAX_ITEMS:
            raise ApiError(413, f"body: more than {MAX_ITEMS:,} values in all; the limit is {MAX_ITEMS:,} values in "
                                f"a request body", "body", reason="too_complex", code="body_too_complex")
        if children is None:
            continue
        todo.extend((child, depth + 1, loc + (key,)) for key, child in children
                    if isinstance(child, (dict, list)))


def _decode(field, body: bytes) -> tuple[Any, ApiError | None]:
    """(the validated model, None) or (None, the error); nothing of the parsed body outlives the call."""
    try:
        value = parse_json(body)
    except ApiError as e:
        return None, e
    except RequestValidationError as e:
        return None, error_from_validation(e)
    model, errors = field.validate(value, {}, loc=("body",))
    del value
    if errors:
        return None, error_from_validation(RequestValidationError(errors))
    return model, None


def decode_body(field, body: bytes) -> tuple[Any, ApiError | None]:
    """:func:`_decode` in a worker thread's terms, then the allocator's free pages back after a large body."""
    out = _decode(field, body)
    if len(body) >= TRIM_BYTES:
        release_free_memory()
    return out


_libc = None


def release_free_memory() -> None:
    """Return the C allocator's free pages to the system (glibc's ``malloc_trim``; a no-op elsewhere). The
    ctypes call releases the GIL while it runs."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _libc.malloc_trim  # noqa: B018 (glibc only)
        except (OSError, AttributeError):
            _libc = False
    if _libc:
        _libc.malloc_trim(0)


class _Parsed(Request):
    """The request, its body already read and its JSON already parsed and validated (FastAPI's handler reads
    ``json()`` for a JSON body)."""

    def __init__(self, request: Request, body: bytes, value: Any):
        super().__init__(request.scope, request.receive)
        self._parsed_body = body
        self._parsed_value = value

    async def body(self) -> bytes:
        return self._parsed_body

    async def json(self) -> Any:
        return self._parsed_value


class JSONBodyRoute(APIRoute):
    """A route whose JSON body is parsed and validated in a worker thread, within the limits above."""

    def get_route_handler(self):
        from serve.limits import is_json

        handler = super().get_route_handler()
        field = self.body_field
        if field is None:
            return handler

        async def route(request: Request):
            ctype = request.headers.get("content-type")
            if ctype is None or not is_json(ctype):
                return await handler(request)  # FastAPI's own answer (the Gate refuses such POST bodies first)
            body = await request.body()
            if not body:
                return await handler(request)
            value, error = await anyio.to_thread.run_sync(decode_body, field, body)
            if error is not None:
                raise error
            return await handler(_Parsed(request, body, value))

        return route
