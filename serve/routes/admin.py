"""Health, information, metrics, and the admin endpoints: ``GET /health`` (no API key needed),
``GET /get_model_info``, ``GET /v1/models``, ``GET /metrics`` (Prometheus), ``GET /internal/load``,
``POST /flush_cache`` (GET too, as SGLang), ``POST /start_profile`` / ``POST /stop_profile``,
``POST /abort_request``."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from serve.errors import ApiError
from serve.schemas import AbortRequest, ProfileRequest
from serve.state import Server, get_server

router = APIRouter()


@router.get("/health")
async def health(request: Request):
    server = getattr(request.app.state, "server", None)
    if server is None or not server.ready:
        return JSONResponse({"status": "unavailable"}, status_code=503)
    if getattr(server.engine, "failure", None) is not None:  # a multi-process group lost a process
        return JSONResponse({"status": "failed", "error": server.engine.failure}, status_code=503)
    return {"status": "ok"}


@router.get("/get_model_info")
async def get_model_info(server: Server = Depends(get_server)):
    info = dict(server.engine.get_model_info())
    info.update(served_model_name=server.model_name, tokenizer_path=server.engine.model_path,
                is_generation=True, max_prompt_tokens=server.max_prompt_tokens)
    return info


@router.get("/v1/models")
async def list_models(server: Server = Depends(get_server)):
    eng = server.engine
    return {"object": "list", "data": [{
        "id": server.model_name, "object": "model", "created": server.created, "owned_by": "dllm-jax",
        "root": eng.model_path, "max_model_len": eng.context_length}]}


@router.get("/metrics")
async def metrics(server: Server = Depends(get_server)):
    from prometheus_client import CONTENT_TYPE_LATEST

    return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/internal/load")
async def internal_load(server: Server = Depends(get_server)):
    return {**server.load_snapshot(), "server_inflight": server.inflight, "server_capacity": server.capacity}


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(server: Server = Depends(get_server)):
    ok = server.inflight == 0 and await run_in_threadpool(server.engine.flush_cache)
    if ok:
        return {"success": True, "message": "Cache flushed."}
    return JSONResponse({"success": False, "message": "Cache not flushed: requests are running or queued."},
                        status_code=400)


@router.post("/start_profile")
async def start_profile(body: ProfileRequest | None = None, server: Server = Depends(get_server)):
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


@router.post("/stop_profile")
async def stop_profile(server: Server = Depends(get_server)):
    out = await run_in_threadpool(server.engine.stop_profile)
    if out is None:
        raise ApiError(400, "stop_profile: no profile is being recorded")
    return {"success": True, "output_dir": out}


@router.post("/abort_request")
async def abort_request(body: AbortRequest, server: Server = Depends(get_server)):
    if not body.abort_all and not body.rid:
        raise ApiError(400, "rid: give a request id or abort_all: true", "rid")
    rids = [rid for rid in server.live if body.abort_all or rid == body.rid]
    for rid in rids:
        server.engine.abort(server.live[rid])
    return {"aborted": rids}
