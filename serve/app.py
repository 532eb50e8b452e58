"""The FastAPI app: SGLang-style and OpenAI-style endpoints over one :class:`dllm_jax.Engine`, and the playground.

The engine runs its scheduler in one background thread (``engine.start()``); handlers only validate, enqueue
(``engine.submit``) and await the request's events, which the engine's thread hands to the event loop with
``loop.call_soon_threadsafe``. Nothing here blocks the event loop on the engine.

The server by concern (imports point down this list, and only ``serve`` imports ``dllm_jax``)::

    app              create_app: lifespan, error handlers, the routers, the gate
    routes/          sglang (/generate), openai (/v1/...; frames in openai_stream), admin (info, metrics,
                     cache, profiler, aborts), playground (the page at /)
    streaming        SSE response and frames
    limits           API key, body size, response accounting (one ASGI middleware)
    state            Server (input checks, capacity, submission), Batch (one HTTP request's engine requests)
    features         fields the engine may not implement yet (logprobs, penalties): pass or 400
    logprobs         log probabilities in OpenAI's shapes
    schemas/         request bodies; errors, settings, metrics

Validation failures are 400 with ``{"error": {"message", "type", "param", "code"}}`` where ``param`` names the
field; they never reach the engine's loop. A client that disconnects aborts its requests (their KV pages come
back at the engine's next round). See serve/README.md for the endpoints.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve.errors import ApiError, error_from_validation
from serve.limits import Gate
from serve.routes import admin, openai, playground, sglang
from serve.settings import ServerSettings
from serve.state import Server

__all__ = ["create_app", "ServerSettings"]

logger = logging.getLogger("dllm_jax.serve")


def create_app(engine=None, settings: ServerSettings | None = None, *,
               engine_factory: Callable[[], Any] | None = None, own_engine: bool = True) -> FastAPI:
    """The FastAPI app over ``engine`` (or over the engine ``engine_factory()`` builds at startup; with neither,
    the one described by the ``DLLM_JAX_SERVE_ARGS`` environment variable, in ``dllm-jax serve`` syntax, so
    ``uvicorn --factory serve:create_app`` works). The app starts the engine's loop at startup and, if it owns
    the engine, shuts it down at exit."""
    if engine is None and engine_factory is None:
        from serve.cli import engine_and_settings_from_env

        engine_factory, env_settings = engine_and_settings_from_env()
        settings = settings or env_settings
    settings = settings or ServerSettings()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        eng = engine if engine is not None else await run_in_threadpool(engine_factory)
        server = Server(eng, settings)
        app.state.server = server
        eng.start()
        server.ready = True
        logger.debug("serving %s (block %d, mask id %d, %s)", eng.model_path, eng.block_size, eng.mask_token_id,
                     eng.algorithm_name)
        try:
            yield
        finally:
            server.ready = False
            if own_engine or engine is None:
                await run_in_threadpool(eng.shutdown)

    app = FastAPI(title="dllm-jax", description="Block-diffusion LM server (SGLang- and OpenAI-style endpoints)",
                  lifespan=lifespan)
    app.state.server = None
    app.state.settings = settings

    def reject(exc: ApiError) -> JSONResponse:
        server = app.state.server
        if server is not None and exc.reason is not None:
            server.metrics.rejected.labels(exc.reason).inc()
        return exc.response()

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return reject(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return reject(error_from_validation(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if isinstance(exc.__cause__, ApiError):  # e.g. the body-size limit hit while FastAPI read the body
            return reject(exc.__cause__)
        return ApiError(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        logger.exception("internal error on %s", request.url.path)
        return ApiError(500, f"internal error: {type(exc).__name__}: {exc}").response()

    routers = [m.router for m in (admin, sglang, openai) + ((playground,) if settings.playground else ())]
    for router in routers:
        app.include_router(router)
    # the routers' own paths (newer FastAPI includes routers lazily: app.routes does not list their routes)
    routes = {r.path for rt in [app, *routers] for r in rt.routes if hasattr(r, "path")}
    app.add_middleware(Gate, server_ref=lambda: app.state.server, settings=settings, routes=routes)
    return app
