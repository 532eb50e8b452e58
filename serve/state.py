"""The server's state over one engine: input checks, capacity, and the engine requests of each HTTP request.

:class:`Server` validates prompts, checks capacity and submits a request's engine requests (all or none);
:class:`Batch` receives their events on the event loop. The engine's thread builds each chunk (where the
request's state is consistent) and hands it over with ``loop.call_soon_threadsafe``; nothing here blocks the
event loop on the engine.

Provisional chunks (``stream_provisional``: the block being denoised, after every step) are coalesced: while one
waits unsent, a newer one for the same request replaces it, and a committed chunk drops it. A slow client then
gets the latest state of each block, never a backlog, and committed chunks always arrive in order.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
import uuid
from typing import Any, AsyncIterator, Callable

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from serve import features
from serve.errors import ApiError, bad_request, qualify
from serve.metrics import ServerMetrics, snapshot
from serve.settings import ServerSettings

logger = logging.getLogger("dllm_jax.serve")

SHUTDOWN_MESSAGE = "server shutting down"  # the abort message of the requests a shutdown ends


class Server:
    """``status``: ``starting`` (the engine warms up), ``ok`` (admitting), ``shutting_down`` (draining: running
    requests may finish, new ones get 503)."""

    def __init__(self, engine, settings: ServerSettings):
        self.engine = engine
        self.settings = settings
        # the names a request's "model" may use, the primary (reported in answers) first
        self.model_names = settings.served_model_names or [os.path.basename(os.path.normpath(engine.model_path))]
        self.model_name = self.model_names[0]
        self.inflight = 0  # engine requests submitted and not yet released (event-loop thread only)
        self.live: dict[str, Any] = {}  # rid -> Request, for duplicate ids and /abort_request
        self.batches: set[Batch] = set()  # open batches, which a shutdown ends
        self.status = "starting"
        self.created = int(time.time())
        self.metrics = ServerMetrics(self.load_snapshot, lambda: self.inflight)

    @property
    def ready(self) -> bool:
        return self.status == "ok"

    def unavailable(self) -> ApiError:
        """The 503 of a request that arrives while the server is not admitting."""
        what = "shutting down" if self.status == "shutting_down" else "starting (the engine is warming up)"
        return ApiError(503, f"the server is {what}; retry later",
                        headers={"Retry-After": str(self.settings.retry_after_s)})

    def end_open(self, message: str) -> int:
        """End every unfinished request of every open batch now (see :meth:`Batch.end`). Returns how many."""
        return sum(batch.end(message) for batch in list(self.batches))

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
    def check_batch_size(self, n: int, field: str) -> None:
        """Before anything is tokenized: a batch (prompts x n) that could never be admitted is a 400 at once."""
        if n > self.capacity:
            raise ApiError(400, f"{field}: a batch of {n} requests exceeds the server's capacity of {self.capacity} "
                                f"requests", field)

    def check_text(self, text: str, field: str) -> None:
        """Before anything is tokenized: an empty prompt, or one far too long whatever the tokenizer makes of it."""
        if not text:
            raise ApiError(400, f"{field}: the prompt is empty", field)
        self.check_chars(len(text), field)

    def check_chars(self, chars: int, field: str) -> None:
        limit = self.max_prompt_tokens
        if chars > 32 * limit + 1024:  # no tokenizer makes that few tokens of it: not worth tokenizing
            raise ApiError(400, f"{field}: the prompt has {chars} characters; the limit is {limit} tokens", field)

    async def tokenize_all(self, texts: list[str], fields: list[str]) -> list[list[int]]:
        """Every prompt's ids: the lengths are checked first, then the texts are tokenized in a worker thread (a
        batch of thousands of prompts takes seconds, which must not freeze the event loop: other requests,
        ``/health`` included, are answered meanwhile), stopping at the first prompt over the token limit."""
        for text, field in zip(texts, fields):
            self.check_text(text, field)
        return await run_in_threadpool(self._tokenize_all, list(texts), list(fields))

    def _tokenize_all(self, texts: list[str], fields: list[str]) -> list[list[int]]:
        out = []
        for text, field in zip(texts, fields):
            if "\x00" in text and not self.tokenizer_keeps_nul:
                raise ApiError(400, f"{field}: contains a NUL character, which this model's tokenizer does not "
                                    f"keep", field)
            try:
                ids = self.engine.tokenize(text, field)
            except ValueError as e:
                raise bad_request(str(e)) from None
            self.check_ids(ids, field)
            out.append(ids)
        return out

    async def prepare_images(self, items: list, fields: list[str]) -> list:
        """Each prompt's images (``image_data`` per prompt, None: none) decoded and preprocessed in a worker thread
        (:mod:`dllm_jax.engine.images`; local paths refused: the server reads no file for a client). A 400 names
        the field: a model without a vision tower, not an image, too large, too many."""
        if all(item is None for item in items):
            return items
        reader = self.engine.images
        if reader is None:
            field = next(f for f, item in zip(fields, items) if item is not None)
            raise ApiError(400, f"{field}: this model reads text only (no vision tower: "
                                f"{self.engine.config.architecture})", field)

        def prepare():
            try:
                return [None if item is None else reader.prepare(item, field, allow_paths=False)
                        for item, field in zip(items, fields)]
            except ValueError as e:
                raise bad_request(str(e)) from None

        return await run_in_threadpool(prepare)

    @functools.cached_property
    def tokenizer_keeps_nul(self) -> bool:
        """Whether a NUL in a prompt survives the tokenizer (byte-level BPE keeps it; others may drop or replace
        it, which would answer a different prompt than the one sent)."""
        tok = self.engine.tokenizer
        if tok is None:
            return True  # no text prompts at all
        try:
            return "\x00" in tok.decode(tok.encode("a\x00b", add_special_tokens=False))
        except Exception:
            return False

    def check_ids(self, ids: list[int], field: str) -> None:
        if not ids:
            raise ApiError(400, f"{field}: the prompt is empty", field)
        limit = self.max_prompt_tokens
        if len(ids) > limit:
            raise ApiError(400, f"{field}: the prompt has {len(ids)} tokens; the limit is {limit}", field)

    # -- scoring --------------------------------------------------------------------------------
    async def prompt_logprobs(self, ids_list: list[list[int]], fields: list[str], top_k: int, *, option: str,
                              check: Callable[[list[int], str], None] | None = None,
                              renames: dict | None = None) -> list[dict]:
        """Each prompt's token log-probabilities (:meth:`dllm_jax.Engine.prompt_logprobs`, ``top_k``
        alternatives), scored in a worker thread: a forward per prompt token, which must not hold up the event
        loop. ``option`` names the request's field that asked for them (in the 400 of a model that cannot score
        prompts); ``check(ids, field)`` is a route's own check of each prompt, after :meth:`check_ids`;
        ``renames`` maps an engine error's field to the body's (see :func:`serve.errors.bad_request`). Each
        route shapes the answers itself."""
        if not self.ready:
            raise self.unavailable()
        eng = self.engine
        try:
            eng.check_prompt_logprobs(option)
        except ValueError as e:
            raise bad_request(str(e)) from None
        for ids, field in zip(ids_list, fields):
            self.check_ids(ids, field)
            if check is not None:
                check(ids, field)

        def run():
            return [eng.prompt_logprobs(ids, top_k, field=field) for ids, field in zip(ids_list, fields)]

        try:
            return await run_in_threadpool(run)
        except ValueError as e:
            raise bad_request(str(e), renames) from None

    # -- submission -----------------------------------------------------------------------------
    def start_batch(self, ids_list: list[list[int]], params_list: list[dict], fields: list[str], *,
                    stream: bool, rids: list[str | None] | None = None, renames: dict | None = None,
                    provisional: bool = False, batch_field: str | None = None,
                    params_fields: list[str] | None = None, images: list | None = None,
                    image_fields: list[str] | None = None) -> "Batch":
        """Validate every engine request, check capacity, then submit them all (or none). ``fields`` name each
        request's prompt in errors, ``params_fields`` its sampling params (default ``sampling_params``; an engine
        error naming a bare parameter is put under it, then ``renames`` apply); ``batch_field`` names what made the
        batch too large (default: the prompt). ``images``: each request's prepared images (:meth:`prepare_images`;
        None: none), named ``image_fields`` in errors."""
        if not self.ready:
            raise self.unavailable()
        n = len(ids_list)
        self.check_batch_size(n, batch_field or fields[0].split('[')[0])
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
                                                     on_event=batch.on_event_for(i), field=field,
                                                     provisional=provisional, stream=stream,
                                                     image_data=images[i] if images else None,
                                                     image_field=image_fields[i] if image_fields else "image_data"))
            except ValueError as e:
                prefix = params_fields[i] if params_fields else "sampling_params"
                raise bad_request(qualify(str(e), prefix, features.engine_sampling_fields()), renames) from None
        if self.inflight + n > self.capacity:
            raise ApiError(503, f"server busy: {self.inflight} requests in flight, capacity {self.capacity}; "
                                f"retry later", headers={"Retry-After": str(self.settings.retry_after_s)},
                           reason="queue_full")
        batch.reqs = reqs
        self.inflight += n
        batch.reserved = n
        for req in reqs:
            self.live[req.rid] = req
        self.batches.add(batch)
        try:
            for req in reqs:
                self.engine.submit(req)
        except RuntimeError as e:  # the engine is shutting down, or its process group failed
            batch.close()
            raise ApiError(503, f"the engine takes no requests: {e}") from None
        return batch


def get_server(request: Request) -> Server:
    """The app's :class:`Server` (a FastAPI dependency of every route that needs the engine)."""
    state = request.app.state
    server = getattr(state, "server", None)
    if server is None:  # the engine is still being built (``create_app(engine_factory=...)``), or failed
        if getattr(state, "startup_error", None) is not None:
            raise ApiError(503, f"the engine failed to start: {state.startup_error}")
        what = ("shutting down" if getattr(state, "draining", False)
                else "starting (the engine is loading or warming up)")
        raise ApiError(503, f"the server is {what}; retry later",
                       headers={"Retry-After": str(state.settings.retry_after_s)})
    return server


class ClientGone(Exception):
    pass


class Batch:
    """The engine requests of one HTTP request; their events arrive on one asyncio queue as (index, item): a
    chunk, None meaning "finished" for non-streaming requests, or a provisional slot (see the module's doc)."""

    def __init__(self, server: Server, stream: bool):
        self.server = server
        self.stream = stream
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.reqs: list = []
        self.reserved = 0
        self.closed = False
        self.ended: str | None = None  # why the server ended the unfinished requests (see end())
        self._slots: dict[int, list] = {}  # index -> [the provisional chunk waiting to be sent]
        self._done: set[int] = set()  # indices whose final event was delivered

    def _post(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self._deliver, item)
        except RuntimeError:  # the event loop is gone (server shutting down)
            pass

    def _deliver(self, item) -> None:
        """On the event loop: queue a chunk, or coalesce a provisional one. Nothing comes after a request's final
        event (the engine's own end of a request that :meth:`end` ended already is dropped)."""
        index, chunk = item
        if index in self._done:
            return
        if chunk is None or chunk["finished"]:
            self._done.add(index)
        if chunk is not None and chunk.get("provisional"):
            slot = self._slots.get(index)
            if slot is not None:  # an older provisional chunk still waits: replace it
                slot[0] = chunk
                return
            slot = self._slots[index] = [chunk]
            self.queue.put_nowait((index, slot))
            return
        slot = self._slots.pop(index, None)
        if slot is not None:  # superseded by this committed chunk
            slot[0] = None
        self.queue.put_nowait(item)

    def on_event_for(self, index: int) -> Callable:
        """The request's ``on_event`` (runs on the engine's thread)."""
        from dllm_jax.engine.output import ChunkSink

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

    def end(self, message: str) -> int:
        """End the unfinished requests now (a shutdown): each is aborted in the engine and gets its final event at
        once, without waiting for the engine's thread, which may be inside a long device call or a compile. A
        stream's final chunk carries ``finish_reason {"type": "abort", "message": message}`` (its handler writes
        its error frame and ``[DONE]``); a waiting non-streamed request is answered 503. Returns how many it ended
        (a request the engine has just finished keeps its own final event, already on its way)."""
        count = 0
        for index, req in enumerate(self.reqs):
            if index in self._done or req.finished:
                continue
            self.ended = message
            self.server.engine.abort(req)
            chunk = None
            if self.stream:
                meta = {**self.server.engine.meta_info(req), "finish_reason": {"type": "abort", "message": message}}
                chunk = {"text": "", "output_ids": [], "finished": True, "ended": True, "meta_info": meta}
            self._deliver((index, chunk))
            count += 1
        return count

    async def wait(self, request: Request) -> None:
        """Wait until every request finished; abort them if the client disconnects meanwhile."""
        pending = len(self.reqs)
        getter = None
        poll = self.server.settings.disconnect_poll_s
        loop = asyncio.get_running_loop()
        next_check = loop.time() + poll
        try:
            while pending:
                if getter is None:
                    getter = asyncio.ensure_future(self.queue.get())
                done, _ = await asyncio.wait({getter}, timeout=max(0.0, next_check - loop.time()))
                # checked every poll interval even while requests keep finishing (a batch of many)
                if loop.time() >= next_check:
                    if await request.is_disconnected():
                        raise ClientGone()
                    next_check = loop.time() + poll
                if not done:
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
            index, item = await self.queue.get()
            if isinstance(item, list):  # a provisional slot
                if self._slots.get(index) is item:
                    del self._slots[index]
                chunk = item[0]
                if chunk is None:  # superseded before it could be sent
                    continue
                yield index, chunk
                continue
            yield index, item
            if item["finished"]:
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
        self.server.batches.discard(self)
        self.server.inflight -= self.reserved
        self.reserved = 0

    def results(self) -> list[dict]:
        return [self.server.engine.result(r) for r in self.reqs]

    def deltas(self) -> AsyncIterator[tuple[int, dict, str]]:
        """``events()`` with each chunk's new text, the last one computed from the finished answer: streamed
        deltas then add up to the non-streaming text (a stop string found across a block boundary cuts text that
        an earlier chunk already carried; that text cannot be taken back, but it is never sent twice).
        Provisional chunks come through with an empty delta."""
        return self._deltas()

    async def _deltas(self):
        sent = [""] * len(self.reqs)
        async for index, chunk in self.events():
            if chunk.get("provisional"):
                yield index, chunk, ""
                continue
            delta = chunk["text"]
            if chunk["finished"] and not chunk.get("ended"):
                full = self.server.engine.result(self.reqs[index])["text"]
                delta = full[len(sent[index]):] if full.startswith(sent[index]) else ""
            sent[index] += delta
            yield index, chunk, delta


def partial_abort(reason: dict) -> bool:
    """A request ended by ``pause_generation("abort")`` or an update's ``abort_all_requests``: answered with its
    partial output and ``finish_reason`` abort (as SGLang), not as an error."""
    from dllm_jax.engine.pause import PAUSE_ABORT_MESSAGE
    from dllm_jax.engine.weights import UPDATE_ABORT_MESSAGE

    return reason.get("type") == "abort" and reason.get("message") in (PAUSE_ABORT_MESSAGE, UPDATE_ABORT_MESSAGE)


def abort_error(results: list[dict]) -> ApiError | None:
    for res in results:
        reason = res["meta_info"].get("finish_reason") or {}
        if reason.get("type") == "abort" and not partial_abort(reason):
            message = str(reason.get("message", "aborted"))
            status = 400 if "KV pages" in message else 500
            return ApiError(status, f"request aborted: {message}")
    return None


async def finished_results(batch: Batch, request: Request) -> list[dict] | None:
    """Wait for a non-streamed batch: its results, ``None`` when the client went away (the batch is then
    aborted), or an :class:`ApiError` raised for an aborted request."""
    try:
        await batch.wait(request)
    except ClientGone:
        batch.close(client_gone=True)
        return None
    finally:
        batch.close()
    if batch.ended is not None:
        raise ApiError(503, f"request aborted: {batch.ended}",
                       headers={"Retry-After": str(batch.server.settings.retry_after_s)})
    results = batch.results()
    err = abort_error(results)
    if err is not None:
        raise err
    return results


def expand_choices(ids_list: list, params_list: list[dict], fields: list[str], n: int):
    """Each prompt ``n`` times, prompt-major (engine request ``k * n + j`` is prompt k's choice j), choice j with
    seed ``seed + j`` when a seed is given (else the engine draws a distinct one per request). The choices of a
    prompt arrive together, so the scheduler prefills the prompt's complete blocks once and the others match them
    from the prefix cache (``meta_info.cached_tokens``)."""
    if n == 1:
        return ids_list, params_list, fields
    ids_out, params_out, fields_out = [], [], []
    for ids, params, field in zip(ids_list, params_list, fields):
        for j in range(n):
            p = dict(params)
            if p.get("seed") is not None:
                p["seed"] = (p["seed"] + j) % 2 ** 32
            ids_out.append(ids)
            params_out.append(p)
            fields_out.append(field)
    return ids_out, params_out, fields_out
