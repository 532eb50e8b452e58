"""What SGLang's router (``sglang-router``) asks of a worker beside the requests it forwards: ``GET /server_info``
and ``GET /model_info`` when it registers the worker (the older ``/get_server_info`` and ``/get_model_info``
answer the same), ``GET /get_load`` (its load monitor, for the ``power_of_two`` policy: a list with one entry per
data-parallel rank, whose ``num_tokens`` it sums), ``GET /health`` (:mod:`serve.routes.admin`) and
``GET /health_generate`` (a real one-block generation).

``/get_load``: ``num_tokens`` is the KV tokens held by running requests (pages in use that the prefix cache could
not give back) plus a page per queued request; ``num_reqs`` the running and queued engine requests (the server's
in-flight count when larger: admitted, not yet handed to the engine), ``num_waiting_reqs`` the queued ones.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from serve.routes.admin import get_model_info, health
from serve.state import Server, finished_results, get_server

router = APIRouter()

HEALTH_GENERATE_TIMEOUT_S = 20.0
HEALTH_PROMPT = "ok"


def _version() -> str:
    from dllm_jax import __version__

    return __version__


@router.get("/server_info")
@router.get("/get_server_info")
async def server_info(server: Server = Depends(get_server)):
    """SGLang's server information, in the names its router reads: the model, its served name, the parallel sizes
    (one engine: ``dp_size`` 1), the request and token capacities, and the engine's settings and load."""
    info = await get_model_info(server)
    eng = server.engine
    return {**info, "model_path": eng.model_path, "served_model_name": server.model_name,
            "tokenizer_path": eng.model_path, "tp_size": int(info.get("tensor_parallel_size") or 1), "dp_size": 1,
            "max_running_requests": eng.max_running_requests, "max_total_tokens": info.get("kv_pool_tokens"),
            "context_length": eng.context_length, "max_queued_requests": server.settings.max_queued_requests,
            "version": _version(), "internal_states": [load_entry(server)]}


@router.get("/model_info")
async def model_info(server: Server = Depends(get_server)):
    """``/get_model_info`` under the name SGLang's router tries first."""
    return await get_model_info(server)


def load_entry(server: Server) -> dict:
    load = server.load_snapshot()
    info = server.engine.get_model_info()
    page = int(info.get("kv_page_size") or info.get("block_size") or 1)
    cached_free = max(0, load.get("kv_pages_cached", 0) - load.get("kv_pages_locked", 0))
    active_pages = max(0, load.get("kv_pages_used", 0) - cached_free)
    queued = int(load.get("queued_requests", 0))
    running = int(load.get("running_requests", 0))
    return {"dp_rank": 0, "num_reqs": max(running + queued, server.inflight), "num_waiting_reqs": queued,
            "num_tokens": (active_pages + queued) * page}


@router.get("/get_load")
async def get_load(server: Server = Depends(get_server)):
    """SGLang's load report: one entry per data-parallel rank (one here)."""
    return [load_entry(server)]


@router.get("/health_generate")
async def health_generate(request: Request):
    """200 ``ok`` once a one-block generation went through the engine (as SGLang's: the model, not only the
    process, answers); 503 as ``/health`` while not admitting, or when the generation fails or takes over
    :data:`HEALTH_GENERATE_TIMEOUT_S`."""
    status = await health(request)
    if isinstance(status, JSONResponse):  # starting, shutting down or failed
        return status
    server: Server = request.app.state.server
    try:
        ids = (await server.tokenize_all([HEALTH_PROMPT], ["text"]))[0]
        batch = server.start_batch([ids], [{"max_new_tokens": 1}], ["text"], stream=False)
        await asyncio.wait_for(finished_results(batch, request), HEALTH_GENERATE_TIMEOUT_S)
    except Exception as e:  # ApiError (busy, aborted), timeout, ...
        return JSONResponse({"status": "failed", "error": f"{type(e).__name__}: {e}"}, status_code=503)
    return {"status": "ok"}
