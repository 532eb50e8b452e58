"""The FastAPI app: SGLang-style and OpenAI-style endpoints over one :class:`dllm_jax.Engine`, and the playground.

The engine runs its scheduler in one background thread (``engine.start()``); handlers only validate, enqueue
(``engine.submit``) and await the request's events, which the engine's thread hands to the event loop with
``loop.call_soon_threadsafe``. Nothing here blocks the event loop on the engine.

The server by concern (imports point down this list, and only ``serve`` imports ``dllm_jax``)::

    app              create_app: lifespan, error handlers, the routers, the gate
    routes/          sglang (/generate), openai (/v1/...; frames in openai_stream), admin (info, metrics,
                     cache, profiler, aborts), worker (what SGLang's router polls), rl (weight updates, pause /
                     continue), playground (the page at /)
    streaming        SSE response and frames
    limits           API key, body size, Host / Origin (state-changing endpoints: this server's own origin only),
                     response accounting (one ASGI middleware)
    body             JSON bodies parsed and validated in a worker thread, within limits on keys, items, nesting
    openapi          /openapi.json as the server answers (400s and its error body, content types, operation ids)
    state            Server (input checks, capacity, submission), Batch (one HTTP request's engine requests)
    features         fields the engine may not implement yet (logprobs, penalties): pass or 400
    logprobs         log probabilities in OpenAI's shapes
    schemas/         request bodies; errors, settings, metrics

Lifecycle: with ``engine_factory`` the engine is built (and warmed up) in a background thread while the server
already answers: ``/health`` is 503 ``{"status": "starting"}``, requests 503 with ``Retry-After``, until it is
ready. :func:`drain` is a graceful shutdown's first half (``dllm-jax serve`` runs it on SIGTERM / SIGINT, before
uvicorn closes the connections): new requests get 503 at once, running ones may finish for a while, then every
open stream ends with an error frame and ``[DONE]`` and every waiting request with a 503.

Validation failures are 400 with ``{"error": {"message", "type", "param", "code"}}`` where ``param`` names the field
(``code``: a string or null, as OpenAI's); they never reach the engine's loop, nor hold up the event loop. A client
that disconnects aborts its requests (their KV pages come back at the engine's next round). See serve/README.md for
the endpoints.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve.errors import ApiError, error_from_validation
from serve import openapi
from serve.limits import Gate
from serve.routes import admin, openai, playground, rl, sglang, worker
from serve.settings import ServerSettings
from serve.state import SHUTDOWN_MESSAGE, Server

__all__ = ["create_app", "ServerSettings", "drain"]

logger = logging.getLogger("dllm_jax.serve")

FINAL_FRAMES_S = 5.0  # after a shutdown ended the open requests: how long their handlers may take to answer


def create_app(engine=None, settings: ServerSettings | None = None, *,
               engine_factory: Callable[[], Any] | None = None, own_engine: bool = True) -> FastAPI:
    """The FastAPI app over ``engine`` (or over the engine ``engine_factory()`` builds in a background thread
    once the app starts, answering 503 ``starting`` meanwhile; with neither, the one described by the
    ``DLLM_JAX_SERVE_ARGS`` environment variable, in ``dllm-jax serve`` syntax, so ``uvicorn --factory
    serve:create_app`` works). The app starts the engine's loop once it has the engine and, if it owns the
    engine, shuts it down at exit."""
    if engine is None and engine_factory is None:
        from serve.args import engine_and_settings_from_env

        engine_factory, env_settings = engine_and_settings_from_env()
        settings = settings or env_settings
    settings = settings or ServerSettings()

    def serve_engine(eng) -> None:
        """On the event loop, once the engine exists (and is warm): start its loop and admit requests."""
        if app.state.closing:  # stopped while the engine was being built: never start it
            return
        server = Server(eng, settings)
        app.state.server = server
        eng.start()
        server.status = "shutting_down" if app.state.draining else "ok"
        logger.debug("serving %s (block %d, mask id %d, %s)", eng.model_path, eng.block_size, eng.mask_token_id,
                     eng.algorithm_name)

    def startup_failed(error: str) -> None:
        app.state.startup_error = error

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        loop = asyncio.get_running_loop()
        starter = None
        if engine is not None:
            serve_engine(engine)
        else:
            def build() -> None:  # the factory in a thread, so that uvicorn binds and answers meanwhile
                try:
                    eng = engine_factory()
                except Exception as e:
                    logger.error("the engine failed to start: %s", e, exc_info=not isinstance(e, ValueError))
                    _call_soon(loop, startup_failed, f"{type(e).__name__}: {e}")
                    return
                _call_soon(loop, serve_engine, eng)

            starter = threading.Thread(target=build, name="dllm-serve-start", daemon=True)
            starter.start()
        try:
            yield
        finally:
            app.state.closing = True
            server = app.state.server
            if server is not None:
                server.status = "shutting_down"
            if starter is not None and starter.is_alive():
                # the engine is still being built or warmed up (its lock held by the compile): nothing to shut down
                # yet, and waiting would take as long as the compile; the process exits without it
                app.state.abandoned_start = True
                logger.info("stopped before the engine was ready")
            elif server is not None and (own_engine or engine is None):
                await run_in_threadpool(server.engine.shutdown)

    app = FastAPI(title="dllm-jax", description="Block-diffusion LM server (SGLang- and OpenAI-style endpoints)",
                  lifespan=lifespan)
    app.state.server = None
    app.state.settings = settings
    app.state.startup_error = None  # why the engine factory failed
    app.state.draining = False  # a shutdown began (see drain)
    app.state.closing = False  # the app's lifespan is over
    app.state.abandoned_start = False  # it ended while the engine was still being built

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
        # the exception's text may quote server paths or data: the log has it, the client gets its kind
        return ApiError(500, f"internal error ({type(exc).__name__}); the server's log has the details").response()

    routers = [m.router for m in (admin, worker, sglang, openai, rl) + ((playground,) if settings.playground else ())]
    for router in routers:
        app.include_router(router)
    # the routers' own paths (newer FastAPI includes routers lazily: app.routes does not list their routes)
    routes = {r.path for rt in [app, *routers] for r in rt.routes if hasattr(r, "path")}
    app.add_middleware(Gate, server_ref=lambda: app.state.server, settings=settings, routes=routes)
    openapi.install(app, api_key=bool(settings.api_key))
    return app


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the event loop is gone: the server stopped meanwhile
        pass


async def drain(app: FastAPI, timeout: float, hurry: Callable[[], bool] = lambda: False) -> None:
    """A graceful shutdown, before the connections close: stop admitting at once (503; ``/health`` says
    ``shutting_down``), let the requests in flight finish for up to ``timeout`` seconds (less once ``hurry()``
    is true: a second signal), then end the rest (:meth:`serve.state.Server.end_open`: a final abort frame and
    ``[DONE]`` on streams, 503 for waiting requests) and give their handlers a moment to send that."""
    app.state.draining = True
    server = app.state.server
    if server is None:  # the engine is still being built: nothing runs
        return
    server.status = "shutting_down"
    if server.inflight and timeout > 0:
        logger.info("shutting down: %d request(s) in flight may finish within %g s", server.inflight, timeout)
    await _until_idle(server, timeout, hurry)
    if server.inflight:
        ended = server.end_open(SHUTDOWN_MESSAGE)
        logger.info("shutting down: ended %d unfinished request(s)", ended)
        await _until_idle(server, FINAL_FRAMES_S, lambda: False)
        if server.inflight:
            logger.warning("shutting down: %d request(s) still unanswered", server.inflight)


async def _until_idle(server: Server, seconds: float, hurry: Callable[[], bool]) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while server.inflight and loop.time() < deadline and not hurry():
        await asyncio.sleep(0.02)
