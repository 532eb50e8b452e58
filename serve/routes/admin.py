"""Health, information, metrics, and the admin endpoints: ``GET /health`` (no API key needed),
``GET /get_model_info``, ``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /metrics`` (Prometheus),
``GET /internal/load``, ``POST /flush_cache`` (GET too, as SGLang), ``POST /start_profile`` /
``POST /stop_profile``, ``POST /abort_request``.

``/start_profile`` writes only under the profile root chosen at start (``--profile-dir``, default a per-user cache
directory): a relative ``output_dir`` is taken under it, and one that resolves outside it (``..``, another absolute
path, a symbolic link out) is a 403, so that the endpoint cannot be used to write files anywhere else."""

from __future__ import annotations

import os

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from serve.body import JSONBodyRoute
from serve.errors import ApiError, model_not_found
from serve.schemas import AbortRequest, ProfileRequest
from serve.state import Server, get_server

router = APIRouter(route_class=JSONBodyRoute)


@router.get("/health")
async def health(request: Request):
    """200 ``ok`` while admitting; else 503 with ``starting`` (the engine loads or warms up), ``shutting_down``
    (draining) or ``failed`` (and the error)."""
    state = request.app.state
    server = getattr(state, "server", None)
    error = getattr(state, "startup_error", None)
    if error is None and server is not None:
        error = getattr(server.engine, "failure", None)  # a multi-process group lost a process
    if error is not None:
        return JSONResponse({"status": "failed", "error": error}, status_code=503)
    if server is not None and server.ready:
        return {"status": "ok"}
    status = server.status if server is not None else "shutting_down" if state.draining else "starting"
    return JSONResponse({"status": status}, status_code=503,
                        headers={"Retry-After": str(state.settings.retry_after_s)})


@router.get("/get_model_info")
async def get_model_info(server: Server = Depends(get_server)):
    info = dict(server.engine.get_model_info())
    info.update(served_model_name=server.model_name, tokenizer_path=server.engine.model_path,
                is_generation=True, max_prompt_tokens=server.max_prompt_tokens)
    return info


def _model_card(server: Server, name: str) -> dict:
    eng = server.engine
    return {"id": name, "object": "model", "created": server.created, "owned_by": "dllm-jax",
            "root": eng.model_path, "max_model_len": eng.context_length}


@router.get("/v1/models")
async def list_models(server: Server = Depends(get_server)):
    """Every served name (the primary first, then its aliases), as vLLM lists them."""
    return {"object": "list", "data": [_model_card(server, name) for name in server.model_names]}


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, server: Server = Depends(get_server)):
    """OpenAI's ``models.retrieve``: a served name (an id may hold ``/``), else 404 ``model_not_found``."""
    if model_id not in server.model_names:
        raise model_not_found(model_id, server.model_names, param="model")
    return _model_card(server, model_id)


@router.get("/metrics")
async def metrics(server: Server = Depends(get_server)):
    from prometheus_client import CONTENT_TYPE_LATEST

    return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/internal/load")
async def internal_load(server: Server = Depends(get_server)):
    return {**server.load_snapshot(), "server_inflight": server.inflight, "server_capacity": server.capacity}


@router.get("/flush_cache")  # (two routes: one operation id each)
@router.post("/flush_cache")
async def flush_cache(server: Server = Depends(get_server)):
    refusal = server.engine.flush_refusal()  # requests paused in place (pause_generation)
    if refusal is not None:
        return JSONResponse({"success": False, "message": f"Cache not flushed: {refusal}."}, status_code=400)
    ok = server.inflight == 0 and await run_in_threadpool(server.engine.flush_cache)
    if ok:
        return {"success": True, "message": "Cache flushed."}
    return JSONResponse({"success": False, "message": "Cache not flushed: requests are running or queued."},
                        status_code=400)


@router.post("/start_profile")
async def start_profile(body: ProfileRequest | None = None, server: Server = Depends(get_server)):
    body = body or ProfileRequest()
    root = server.settings.profile_root
    directory = profile_path(root, body.output_dir)
    try:
        os.makedirs(root, mode=0o700, exist_ok=True)  # the traces may show prompts: the owner's only
        out = await run_in_threadpool(server.engine.start_profile, directory,
                                      0 if body.num_steps is None else body.num_steps)
    except RuntimeError as e:
        raise ApiError(400, f"start_profile: {e}") from None
    except OSError as e:  # (its text holds the resolved path: only the reason is told)
        raise ApiError(400, f"output_dir: cannot write the profile there ({e.strerror or type(e).__name__})",
                       "output_dir") from None
    return {"success": True, "output_dir": out}


def profile_path(root: str, output_dir: str | None) -> str:
    """``output_dir`` (default: the root itself) resolved under ``root`` (absolute, symbolic links resolved), or
    a 403 when it resolves anywhere else. The refusal names neither the resolved path nor the root (the server's
    own paths: a client learns nothing of the file system from it)."""
    try:
        target = os.path.realpath(os.path.join(root, output_dir or ""))
    except ValueError:  # e.g. an embedded NUL (the body's text check refuses those first)
        raise ApiError(400, "output_dir: not a valid path", "output_dir") from None
    if os.path.commonpath([root, target]) != root:
        raise ApiError(403, "output_dir: resolves outside the profile directory (a relative path is taken under it; "
                            "'..', another absolute path or a symbolic link out of it are refused; see "
                            "--profile-dir)", "output_dir")
    return target


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
