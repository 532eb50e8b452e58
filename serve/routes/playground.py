"""The playground: a static page at ``/`` (plain HTML + JS from package data, no build step, nothing fetched from
elsewhere) that chats through ``/v1/chat/completions`` with ``stream_provisional`` and shows the block being
denoised live. The page and its files need no API key (they hold no data); the page asks for the key once when
the API answers 401, and keeps it in ``sessionStorage``."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

from serve.body import JSONBodyRoute
from serve.errors import ApiError

STATIC = Path(__file__).resolve().parent.parent / "static"
TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
         ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff",
           "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'"}

router = APIRouter(route_class=JSONBodyRoute)


def _file(name: str) -> FileResponse:
    path = STATIC / name
    if "/" in name or name.startswith(".") or path.suffix not in TYPES or not path.is_file():
        raise ApiError(404, f"not found: /static/{name}")
    return FileResponse(path, media_type=TYPES[path.suffix], headers=HEADERS)


@router.get("/", include_in_schema=False)
async def index():
    return _file("index.html")


@router.get("/static/{name}", include_in_schema=False)
async def static(name: str):
    return _file(name)
