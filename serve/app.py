"""The FastAPI app: SGLang-style and OpenAI-style endpoints over one :class:`dllm_jax.Engine`.

The engine runs its scheduler in one background thread (``engine.start()``); handlers only validate, enqueue
(``engine.submit``) and await the request's events, which the engine's thread hands to the event loop with
``loop.call_soon_threadsafe``. Nothing here blocks the event loop on the engine.

Endpoints
---------
* ``POST /generate`` -- SGLang's body (``text`` or ``input_ids``, single or batch; ``sampling_params``; ``stream``;
  ``rid``). Answer ``{"text", "output_ids", "meta_info"}`` (a list for a batch). Streaming: SSE ``data: {...}``
  events, one per committed block, then ``data: [DONE]``; like SGLang, ``text`` and ``output_ids`` are cumulative
  unless the server runs with ``--incremental-streaming-output``; batch chunks carry ``index``.
* ``POST /v1/completions``, ``POST /v1/chat/completions`` (the tokenizer's chat template), ``GET /v1/models``:
  OpenAI's bodies and answers, ``stream: true`` as ``chat.completion.chunk`` / ``text_completion`` chunks,
  ``stream_options.include_usage`` for a final usage chunk; ``usage.prompt_tokens_details.cached_tokens``.
* ``GET /health``, ``GET /get_model_info``, ``GET /metrics`` (Prometheus), ``POST /flush_cache``,
  ``POST /start_profile`` / ``POST /stop_profile`` (JAX profiler trace), ``POST /abort_request``,
  ``GET /internal/load`` (the engine's load snapshot plus the server's in-flight count).

Limits: a request's engine requests count against ``max_running_requests + max_queued_requests``; past that the
answer is 503 with ``Retry-After``. With an API key every endpoint but ``/health`` needs ``Authorization: Bearer
KEY`` (401 otherwise). Bodies larger than ``max_request_bytes`` are 413. Validation failures are 400 with
``{"error": {"message", "type", "param", "code"}}`` where ``param`` names the field; they never reach the
engine's loop. A client that disconnects aborts its requests (their KV pages come back at the engine's next round).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import re
import secrets
import time
import uuid
from typing import Any, AsyncIterator, Callable

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve.metrics import ServerMetrics, snapshot
from serve.schemas import (OPENAI_FIELD_NAMES, AbortRequest, ChatCompletionRequest, CompletionRequest,
                           GenerateRequest, ProfileRequest, format_loc)

logger = logging.getLogger("dllm_jax.serve")

OPEN_PATHS = frozenset({"/health"})
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclasses.dataclass
class ServerSettings:
    served_model_name: str | None = None  # default: the model directory's name
    api_key: str | None = None
    max_queued_requests: int = 256  # engine requests waiting beyond max_running_requests
    max_prompt_tokens: int | None = None  # default: what fits the engine's context
    max_request_bytes: int = 8 << 20
    incremental_streaming_output: bool = False
    profile_dir: str | None = None
    disconnect_poll_s: float = 0.25
    retry_after_s: int = 1

    def __post_init__(self):
        if self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests: must be >= 0, got {self.max_queued_requests}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens: must be >= 1, got {self.max_prompt_tokens}")
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes: must be >= 1024, got {self.max_request_bytes}")


# ----------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------
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
            hint = " (is the Content-Type application/json?)" if isinstance(e.get("input"), bytes) else ""
            return ApiError(400, f"body: must be a JSON object{hint}", "body")
        return ApiError(400, f"body: {msg}", "body")
    if kind == "extra_forbidden":
        msg = "unknown field"
    elif kind == "missing":
        msg = "required field is missing"
    return ApiError(400, f"{path}: {msg}", path)


# ----------------------------------------------------------------------------------------------
# The server's state
# ----------------------------------------------------------------------------------------------
class Server:
    def __init__(self, engine, settings: ServerSettings):
        self.engine = engine
        self.settings = settings
        self.model_name = settings.served_model_name or os.path.basename(os.path.normpath(engine.model_path))
        self.inflight = 0  # engine requests submitted and not yet released (event-loop thread only)
        self.live: dict[str, Any] = {}  # rid -> Request, for duplicate ids and /abort_request
        self.ready = False
        self.created = int(time.time())
        self.metrics = ServerMetrics(self.load_snapshot, lambda: self.inflight)

    @property
    def capacity(self) -> int:
        return self.engine.max_running_requests + self.settings.max_queued_requests

    def load_snapshot(self) -> dict:
        return snapshot(self.engine.get_load)

    @property
    def max_prompt_tokens(self) -> int:
        e = self.engine
        fits = (e.context_length // e.block_size) * e.block_size - 1  # the prompt's tail block must fit
        limit = self.settings.max_prompt_tokens
        return fits if limit is None else min(limit, fits)

    # -- inputs ---------------------------------------------------------------------------------
    def tokenize(self, text: str, field: str) -> list[int]:
        if not text:
            raise ApiError(400, f"{field}: the prompt is empty", field)
        limit = self.max_prompt_tokens
        if len(text) > 32 * limit + 1024:  # far too long whatever the tokenizer does; do not even tokenize
            raise ApiError(400, f"{field}: the prompt has {len(text)} characters; the limit is {limit} tokens",
                           field)
        try:
            return self.engine.tokenize(text, field)
        except ValueError as e:
            raise bad_request(str(e)) from None

    def check_ids(self, ids: list[int], field: str) -> None:
        if not ids:
            raise ApiError(400, f"{field}: the prompt is empty", field)
        limit = self.max_prompt_tokens
        if len(ids) > limit:
            raise ApiError(400, f"{field}: the prompt has {len(ids)} tokens; the limit is {limit}", field)

    # -- submission -----------------------------------------------------------------------------
    def start_batch(self, ids_list: list[list[int]], params_list: list[dict], fields: list[str], *,
                    stream: bool, rids: list[str | None] | None = None,
                    renames: dict | None = None) -> "Batch":
        """Validate every prompt, check capacity, then submit them all (or none)."""
        if not self.ready:
            raise ApiError(503, "the server is not ready (starting or shutting down)",
                           headers={"Retry-After": str(self.settings.retry_after_s)})
        n = len(ids_list)
        if n > self.capacity:
            raise ApiError(400, f"{fields[0].split('[')[0]}: a batch of {n} prompts exceeds the server's capacity "
                                f"of {self.capacity} requests", fields[0].split('[')[0])
        for ids, field in zip(ids_list, fields):
            self.check_ids(ids, field)
        rids = rids or [None] * n
        seen = set()
        for rid in rids:
            if rid is not None and (rid in self.live or rid in seen):
                raise ApiError(400, f"rid: a request with id {rid!r} is already in flight", "rid")
            seen.add(rid)
        batch = Batch(self, stream)
        reqs = []
        for i, (ids, params, field, rid) in enumerate(zip(ids_list, params_list, fields, rids)):
            try:
                reqs.append(self.engine.make_request(ids, params, rid=rid or uuid.uuid4().hex,
                                                     on_event=batch.on_event_for(i), field=field))
            except ValueError as e:
                raise bad_request(str(e), renames) from None
        if self.inflight + n > self.capacity:
            raise ApiError(503, f"server busy: {self.inflight} requests in flight, capacity {self.capacity}; "
                                f"retry later", headers={"Retry-After": str(self.settings.retry_after_s)},
                           reason="queue_full")
        batch.reqs = reqs
        self.inflight += n
        batch.reserved = n
        for req in reqs:
            self.live[req.rid] = req
        try:
            for req in reqs:
                self.engine.submit(req)
        except RuntimeError as e:  # the engine is shutting down
            batch.close()
            raise ApiError(503, f"the server is shutting down: {e}") from None
        return batch


class ClientGone(Exception):
    pass


class Batch:
    """The engine requests of one HTTP request; their events arrive on one asyncio queue as (index, chunk),
    chunk None meaning "finished" for non-streaming requests."""

    def __init__(self, server: Server, stream: bool):
        self.server = server
        self.stream = stream
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.reqs: list = []
        self.reserved = 0
        self.closed = False

    def _post(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is gone (server shutting down)
            pass

    def on_event_for(self, index: int) -> Callable:
        """The request's ``on_event`` (runs on the engine's thread)."""
        from dllm_jax.engine.engine import ChunkSink

        engine, metrics = self.server.engine, self.server.metrics
        sink = ChunkSink(engine, put=lambda chunk: self._post((index, chunk))) if self.stream else None

        def on_event(req, event):
            if req.finished:
                try:
                    metrics.observe_finish(engine.meta_info(req))
                except Exception:  # metrics must never break the engine loop
                    logger.exception("metrics update failed")
            if sink is not None:
                sink(req, event)
            elif req.finished:
                self._post((index, None))

        return on_event

    async def wait(self, request: Request) -> None:
        """Wait until every request finished; abort them if the client disconnects meanwhile."""
        pending = len(self.reqs)
        getter = None
        try:
            while pending:
                if getter is None:
                    getter = asyncio.ensure_future(self.queue.get())
                done, _ = await asyncio.wait({getter}, timeout=self.server.settings.disconnect_poll_s)
                if not done:
                    if await request.is_disconnected():
                        raise ClientGone()
                    continue
                _, chunk = getter.result()
                getter = None
                if chunk is None or chunk["finished"]:
                    pending -= 1
        finally:
            if getter is not None:
                getter.cancel()

    async def events(self) -> AsyncIterator[tuple[int, dict]]:
        pending = len(self.reqs)
        while pending:
            index, chunk = await self.queue.get()
            yield index, chunk
            if chunk["finished"]:
                pending -= 1

    def close(self, client_gone: bool = False) -> None:
        """Abort what is unfinished and give the capacity back (idempotent; event-loop thread)."""
        if self.closed:
            return
        self.closed = True
        unfinished = [r for r in self.reqs if not r.finished]
        for req in unfinished:
            self.server.engine.abort(req)
        if unfinished and client_gone:
            self.server.metrics.client_aborts.inc(len(unfinished))
            logger.info("client disconnected: aborted %d request(s)", len(unfinished))
        for req in self.reqs:
            self.server.live.pop(req.rid, None)
        self.server.inflight -= self.reserved
        self.reserved = 0

    def results(self) -> list[dict]:
        return [self.server.engine.result(r) for r in self.reqs]

    def deltas(self) -> AsyncIterator[tuple[int, dict, str]]:
        """``events()`` with each chunk's new text, the last one computed from the finished answer: streamed
        deltas then add up to the non-streaming text (a stop string found across a block boundary cuts text that
        an earlier chunk already carried; that text cannot be taken back, but it is never sent twice)."""
        return self._deltas()

    async def _deltas(self):
        sent = [""] * len(self.reqs)
        async for index, chunk in self.events():
            delta = chunk["text"]
            if chunk["finished"]:
                full = self.server.engine.result(self.reqs[index])["text"]
                delta = full[len(sent[index]):] if full.startswith(sent[index]) else ""
            sent[index] += delta
            yield index, chunk, delta


def _abort_error(results: list[dict]) -> ApiError | None:
    for res in results:
        reason = res["meta_info"].get("finish_reason") or {}
        if reason.get("type") == "abort":
            message = str(reason.get("message", "aborted"))
            status = 400 if "KV pages" in message else 500
            return ApiError(status, f"request aborted: {message}")
    return None


async def _finished_results(batch, request: Request) -> list[dict] | None:
    """Wait for a non-streamed batch: its results, ``None`` when the client went away (the batch is then
    aborted), or an :class:`ApiError` raised for an aborted request."""
    try:
        await batch.wait(request)
    except ClientGone:
        batch.close(client_gone=True)
        return None
    finally:
        batch.close()
    results = batch.results()
    err = _abort_error(results)
    if err is not None:
        raise err
    return results


class SSEResponse(StreamingResponse):
    """Server-sent events that watch for the client going away (and then cancel the stream) and always run
    ``on_close(client_gone)`` at the end, even if the stream never started."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[bool], None]):
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        gone = False
        finished = False
        try:
            async with anyio.create_task_group() as tg:
                async def run_stream():
                    nonlocal gone, finished
                    try:
                        await self.stream_response(send)
                        finished = True
                    except OSError:
                        gone = True
                    tg.cancel_scope.cancel()

                async def watch():
                    nonlocal gone
                    await self.listen_for_disconnect(receive)
                    gone = not finished
                    tg.cancel_scope.cancel()

                tg.start_soon(run_stream)
                tg.start_soon(watch)
        finally:
            with anyio.CancelScope(shield=True):
                with contextlib.suppress(Exception):
                    await self.body_iterator.aclose()
                self._on_close(gone or not finished)


def sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


# ----------------------------------------------------------------------------------------------
# ASGI gate: API key, body size, response accounting
# ----------------------------------------------------------------------------------------------
class _BodyTooLarge(Exception):
    pass


class Gate:
    def __init__(self, app, server_ref: Callable[[], Server | None], settings: ServerSettings, routes: set[str]):
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

        if self.settings.api_key and path not in OPEN_PATHS and not self._authorized(scope):
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


def _header(scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


# ----------------------------------------------------------------------------------------------
# The app
# ----------------------------------------------------------------------------------------------
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
    holder: dict[str, Server | None] = {"server": None}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        eng = engine if engine is not None else await run_in_threadpool(engine_factory)
        server = Server(eng, settings)
        holder["server"] = server
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

    def S() -> Server:
        server = holder["server"]
        if server is None:
            raise ApiError(503, "the server is starting")
        return server

    # -- errors ---------------------------------------------------------------------------------
    def reject(exc: ApiError) -> JSONResponse:
        server = holder["server"]
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

    # -- info -----------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        server = holder["server"]
        if server is None or not server.ready:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return {"status": "ok"}

    @app.get("/get_model_info")
    async def get_model_info():
        server = S()
        info = dict(server.engine.get_model_info())
        info.update(served_model_name=server.model_name, tokenizer_path=server.engine.model_path,
                    is_generation=True, max_prompt_tokens=server.max_prompt_tokens)
        return info

    @app.get("/v1/models")
    async def list_models():
        server = S()
        eng = server.engine
        return {"object": "list", "data": [{
            "id": server.model_name, "object": "model", "created": server.created, "owned_by": "dllm-jax",
            "root": eng.model_path, "max_model_len": eng.context_length}]}

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(S().metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/internal/load")
    async def internal_load():
        server = S()
        return {**server.load_snapshot(), "server_inflight": server.inflight, "server_capacity": server.capacity}

    # -- admin ----------------------------------------------------------------------------------
    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        server = S()
        ok = server.inflight == 0 and await run_in_threadpool(server.engine.flush_cache)
        if ok:
            return {"success": True, "message": "Cache flushed."}
        return JSONResponse({"success": False, "message": "Cache not flushed: requests are running or queued."},
                            status_code=400)

    @app.post("/start_profile")
    async def start_profile(body: ProfileRequest | None = None):
        server = S()
        body = body or ProfileRequest()
        directory = body.output_dir or server.settings.profile_dir
        try:
            out = await run_in_threadpool(server.engine.start_profile, directory,
                                          0 if body.num_steps is None else body.num_steps)
        except RuntimeError as e:
            raise ApiError(400, f"start_profile: {e}") from None
        except OSError as e:
            raise ApiError(400, f"output_dir: {e}", "output_dir") from None
        return {"success": True, "output_dir": out}

    @app.post("/stop_profile")
    async def stop_profile():
        server = S()
        out = await run_in_threadpool(server.engine.stop_profile)
        if out is None:
            raise ApiError(400, "stop_profile: no profile is being recorded")
        return {"success": True, "output_dir": out}

    @app.post("/abort_request")
    async def abort_request(body: AbortRequest):
        server = S()
        if not body.abort_all and not body.rid:
            raise ApiError(400, "rid: give a request id or abort_all: true", "rid")
        rids = [rid for rid in server.live if body.abort_all or rid == body.rid]
        for rid in rids:
            server.engine.abort(server.live[rid])
        return {"aborted": rids}

    # -- SGLang ---------------------------------------------------------------------------------
    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request):
        server = S()
        batch_mode = body.is_batch
        if body.text is not None:
            texts = body.text if batch_mode else [body.text]
            fields = [f"text[{i}]" for i in range(len(texts))] if batch_mode else ["text"]
            ids_list = [server.tokenize(t, f) for t, f in zip(texts, fields)]
        else:
            ids_list = body.input_ids if batch_mode else [body.input_ids]
            fields = [f"input_ids[{i}]" for i in range(len(ids_list))] if batch_mode else ["input_ids"]
        n = len(ids_list)
        params = body.sampling_params
        if isinstance(params, list):
            if len(params) != n:
                raise ApiError(400, f"sampling_params: {len(params)} entries for {n} prompts", "sampling_params")
            params_list = [p.engine_dict() for p in params]
        else:
            params_list = [params.engine_dict() if params is not None else {}] * n
        rids = body.rid
        if rids is not None:
            rids = rids if isinstance(rids, list) else [rids]
            if len(rids) != n:
                raise ApiError(400, f"rid: {len(rids)} ids for {n} prompts", "rid")
        batch = server.start_batch(ids_list, params_list, fields, stream=body.stream, rids=rids)
        if body.stream:
            return SSEResponse(_generate_stream(server, batch, batch_mode), lambda gone: batch.close(gone))
        results = await _finished_results(batch, request)
        if results is None:
            return Response(status_code=499)
        return results if batch_mode else results[0]

    # -- OpenAI ---------------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        server = S()
        prompts, batch_mode = body.prompts()
        fields = [f"prompt[{i}]" for i in range(len(prompts))] if batch_mode else ["prompt"]
        ids_list, echoes = [], []
        for p, field in zip(prompts, fields):
            if isinstance(p, str):
                ids_list.append(server.tokenize(p, field))
                echoes.append(p)
            else:
                ids_list.append(p)
                echoes.append(None)
        if body.echo:  # a token-id prompt is echoed with its special tokens (the mask token included)
            tok = server.engine.tokenizer
            echoes = [e if e is not None else (tok.decode(ids, skip_special_tokens=False) if tok else "")
                      for e, ids in zip(echoes, ids_list)]
        else:
            echoes = [""] * len(ids_list)
        params = body.sampling_dict(body.max_tokens)
        batch = server.start_batch(ids_list, [params] * len(ids_list), fields, stream=body.stream,
                                   renames=OPENAI_FIELD_NAMES)
        cid = f"cmpl-{uuid.uuid4().hex}"
        if body.stream:
            return SSEResponse(_completion_stream(server, batch, body, cid, echoes), lambda gone: batch.close(gone))
        results = await _finished_results(batch, request)
        if results is None:
            return Response(status_code=499)
        choices = [{"index": i, "text": echoes[i] + res["text"], "logprobs": None,
                    "finish_reason": _openai_finish(res["meta_info"]),
                    "matched_stop": _matched(res["meta_info"])} for i, res in enumerate(results)]
        return {"id": cid, "object": "text_completion", "created": int(time.time()), "model": server.model_name,
                "choices": choices, "usage": _usage([r["meta_info"] for r in results])}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        server = S()
        eng = server.engine
        try:
            text = eng.apply_chat_template(body.chat_messages())
        except ValueError as e:
            raise bad_request(str(e)) from None
        except Exception as e:  # a template error (e.g. unsupported role order)
            raise ApiError(400, f"messages: the chat template failed: {e}", "messages") from None
        ids = server.tokenize(text, "messages")
        max_new = body.max_completion_tokens or body.max_tokens
        if max_new is None:
            max_new = max(1, eng.context_length - len(ids))
        renames = dict(OPENAI_FIELD_NAMES)
        renames["sampling_params.max_new_tokens"] = ("max_completion_tokens" if body.max_completion_tokens
                                                     else "max_tokens")
        renames["input_ids"] = "messages"
        batch = server.start_batch([ids], [body.sampling_dict(max_new)], ["messages"], stream=body.stream,
                                   renames=renames)
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        if body.stream:
            return SSEResponse(_chat_stream(server, batch, body, cid), lambda gone: batch.close(gone))
        results = await _finished_results(batch, request)
        if results is None:
            return Response(status_code=499)
        res = results[0]
        return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": server.model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": res["text"]},
                             "logprobs": None, "finish_reason": _openai_finish(res["meta_info"]),
                             "matched_stop": _matched(res["meta_info"])}],
                "usage": _usage([res["meta_info"]])}

    routes = {r.path for r in app.routes if hasattr(r, "path")}
    app.add_middleware(Gate, server_ref=lambda: holder["server"], settings=settings, routes=routes)
    app.state.settings = settings
    return app


# ----------------------------------------------------------------------------------------------
# Streams
# ----------------------------------------------------------------------------------------------
async def _generate_stream(server: Server, batch: Batch, batch_mode: bool):
    incremental = server.settings.incremental_streaming_output
    text = [""] * len(batch.reqs)
    ids: list[list[int]] = [[] for _ in batch.reqs]
    async for index, chunk, delta in batch.deltas():
        if incremental:
            out = {"text": delta, "output_ids": chunk["output_ids"], "meta_info": chunk["meta_info"]}
        elif chunk["finished"]:  # the whole answer, exactly as the non-streaming one
            out = {**server.engine.result(batch.reqs[index]), "meta_info": chunk["meta_info"]}
        else:
            text[index] += chunk["text"]
            ids[index] += chunk["output_ids"]
            out = {"text": text[index], "output_ids": list(ids[index]), "meta_info": chunk["meta_info"]}
        if batch_mode:
            out["index"] = index
        yield sse(out)
    yield SSE_DONE


def _openai_finish(meta: dict) -> str | None:
    reason = meta.get("finish_reason")
    if not reason:
        return None
    return {"stop": "stop", "length": "length"}.get(reason.get("type"), reason.get("type"))


def _matched(meta: dict):
    reason = meta.get("finish_reason") or {}
    return reason.get("matched") if reason.get("type") == "stop" else None


def _usage(metas: list[dict]) -> dict:
    prompt = sum(m["prompt_tokens"] for m in metas)
    completion = sum(m["completion_tokens"] for m in metas)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(m["cached_tokens"] for m in metas)}}


def _stream_error(meta: dict) -> dict | None:
    reason = meta.get("finish_reason") or {}
    if reason.get("type") != "abort":
        return None
    return error_body(500, f"request aborted: {reason.get('message', 'aborted')}")


async def _completion_stream(server: Server, batch: Batch, body: CompletionRequest, cid: str, echoes: list[str]):
    created = int(time.time())
    metas: dict[int, dict] = {}

    def frame(choices, usage=None):
        out = {"id": cid, "object": "text_completion", "created": created, "model": server.model_name,
               "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return sse(out)

    continuous = bool(body.stream_options and body.stream_options.continuous_usage_stats)
    for i, echo in enumerate(echoes):
        if echo:
            yield frame([{"index": i, "text": echo, "logprobs": None, "finish_reason": None}])
    async for index, chunk, delta in batch.deltas():
        meta = chunk["meta_info"]
        metas[index] = meta
        error = _stream_error(meta) if chunk["finished"] else None
        if error is not None:
            yield sse(error)
            continue
        finish = _openai_finish(meta) if chunk["finished"] else None
        if delta or finish:
            choice = {"index": index, "text": delta, "logprobs": None, "finish_reason": finish}
            if finish:
                choice["matched_stop"] = _matched(meta)
            yield frame([choice], _usage(list(metas.values())) if continuous else None)
    if body.include_usage:
        yield frame([], _usage(list(metas.values())))
    yield SSE_DONE


async def _chat_stream(server: Server, batch: Batch, body: ChatCompletionRequest, cid: str):
    created = int(time.time())
    metas: dict[int, dict] = {}

    def frame(choices, usage=None):
        out = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": server.model_name,
               "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return sse(out)

    continuous = bool(body.stream_options and body.stream_options.continuous_usage_stats)
    for i in range(len(batch.reqs)):
        yield frame([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None}])
    async for index, chunk, delta in batch.deltas():
        meta = chunk["meta_info"]
        metas[index] = meta
        usage = _usage(list(metas.values())) if continuous else None
        error = _stream_error(meta) if chunk["finished"] else None
        if error is not None:
            yield sse(error)
            continue
        if delta:
            yield frame([{"index": index, "delta": {"content": delta}, "logprobs": None,
                          "finish_reason": None}], usage)
        if chunk["finished"]:
            yield frame([{"index": index, "delta": {}, "logprobs": None, "finish_reason": _openai_finish(meta),
                          "matched_stop": _matched(meta)}], usage)
    if body.include_usage:
        yield frame([], _usage(list(metas.values())))
    yield SSE_DONE
