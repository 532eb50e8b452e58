"""The RL endpoints (SGLang's names): ``POST /update_weights_from_disk``, ``POST /update_weights_from_tensor``,
``GET|POST /get_weights_by_name``, ``GET /get_weight_version``, ``POST /update_weight_version``,
``POST /pause_generation``, ``POST /continue_generation``, ``POST /release_memory_occupation``,
``POST /resume_memory_occupation`` (``{"tags": ["weights", "kv_cache"]}``, both when absent), ``POST /score``
(``{"text" | "input_ids", "completions": [...], "estimator": "chain" | "elbo", "num_samples", "seed"}``: per
completion ``{"tokens", "token_logprobs", "logprob", "num_tokens"}``; a list of texts or of id lists is a batch,
answered with one such list per prompt; errors name the body's fields, ``text`` where the engine says ``prompt``).

Every endpoint here but ``/score`` and ``/get_weights_by_name`` changes the server's state: it takes requests from
this server's own pages only (:data:`serve.limits.STATE_CHANGING`). A malformed tensor blob is a 400 naming the
field and the header entry, quoting none of its bytes.

Each calls the engine's method of the same name in a worker thread (an update waits for the engine's round
boundary, or with ``flush_cache`` for running requests to finish: never on the event loop). A refused update (an
unknown name, a wrong shape or dtype, a directory of another model) is a 400 naming the tensor, the engine keeping
its weights. Tensors travel as base64 safetensors (:func:`dllm_jax.model.weight_update.encode_tensors`), never
as pickle; a body over ``--max-request-bytes`` is a 413, so large updates go in several requests or from disk.
"""

from __future__ import annotations

import re

from fastapi import APIRouter, Depends
from starlette.concurrency import run_in_threadpool

from serve.body import JSONBodyRoute
from serve.errors import ApiError, bad_request
from serve.schemas.rl import (GetWeightsByNameRequest, MemoryOccupationRequest, PauseGenerationRequest, ScoreRequest, UpdateWeightsFromDiskRequest,
                              UpdateWeightsFromTensorRequest, UpdateWeightVersionRequest)
from serve.state import Server, get_server

router = APIRouter(route_class=JSONBodyRoute)
_FIELD = re.compile(r"^[A-Za-z_][\w.\[\]-]*:\s")  # a message that starts by naming its field


async def _call(field: str, fn, *args, renames: dict | None = None, **kwargs):
    """Run an engine method off the event loop; its ``ValueError`` (or a refusal in its state) is a 400 naming the
    field (``renames``: the engine's names for the body's fields, :func:`serve.errors.bad_request`)."""
    try:
        return await run_in_threadpool(fn, *args, **kwargs)
    except ValueError as e:
        message = str(e)
        raise bad_request(message if _FIELD.match(message) else f"{field}: {message}", renames) from None
    except RuntimeError as e:  # NotImplementedError included: a multi-process engine, a shut-down engine
        raise ApiError(400, f"{field}: {e}") from None


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(body: UpdateWeightsFromDiskRequest, server: Server = Depends(get_server)):
    return await _call("model_path", server.engine.update_weights_from_disk, body.model_path,
                       weight_version=body.weight_version, flush_cache=body.flush_cache,
                       abort_all_requests=body.abort_all_requests)


@router.post("/update_weights_from_tensor")
async def update_weights_from_tensor(body: UpdateWeightsFromTensorRequest, server: Server = Depends(get_server)):
    from dllm_jax.model.weight_update import decode_tensors

    blobs = body.serialized_named_tensors
    fields = (["serialized_named_tensors"] if isinstance(blobs, str) else
              [f"serialized_named_tensors[{i}]" for i in range(len(blobs))])

    def update():  # decoding a large blob takes a while: in the worker thread too
        named: list = []
        for blob, field in zip([blobs] if isinstance(blobs, str) else blobs, fields):
            try:
                named += list(decode_tensors(blob, field).items())
            except ValueError as e:
                raise ApiError(400, str(e) if str(e).startswith(field) else f"{field}: {e}", field) from None
            except Exception as e:  # whatever else a client's bytes can do to the decoder is the client's fault
                raise ApiError(400, f"{field}: not a valid safetensors blob ({type(e).__name__})", field) from None
        return server.engine.update_weights_from_tensor(named, weight_version=body.weight_version,
                                                        flush_cache=body.flush_cache,
                                                        abort_all_requests=body.abort_all_requests)

    return await _call("serialized_named_tensors", update)


@router.get("/get_weights_by_name")  # (two routes: one operation id each)
@router.post("/get_weights_by_name")
async def get_weights_by_name(body: GetWeightsByNameRequest, server: Server = Depends(get_server)):
    values = await _call("name", server.engine.get_weights_by_name, body.name, body.truncate_size)
    return values.tolist()


@router.get("/get_weight_version")
async def get_weight_version(server: Server = Depends(get_server)):
    return {"weight_version": server.engine.get_weight_version()}


@router.post("/update_weight_version")
async def update_weight_version(body: UpdateWeightVersionRequest, server: Server = Depends(get_server)):
    return await _call("new_version", server.engine.update_weight_version, body.new_version,
                       abort_all_requests=body.abort_all_requests)


@router.post("/pause_generation")
async def pause_generation(body: PauseGenerationRequest | None = None, server: Server = Depends(get_server)):
    body = body or PauseGenerationRequest()
    out = await _call("mode", server.engine.pause_generation, body.mode)
    return {"success": True, **out}


@router.post("/continue_generation")
async def continue_generation(server: Server = Depends(get_server)):
    out = await _call("continue_generation", server.engine.continue_generation)
    return {"success": True, **out}


@router.post("/release_memory_occupation")
async def release_memory_occupation(body: MemoryOccupationRequest, server: Server = Depends(get_server)):
    return await _call("tags", server.engine.release_memory_occupation, body.tags)


@router.post("/resume_memory_occupation")
async def resume_memory_occupation(body: MemoryOccupationRequest, server: Server = Depends(get_server)):
    return await _call("tags", server.engine.resume_memory_occupation, body.tags)


@router.post("/score")
async def score(body: ScoreRequest, server: Server = Depends(get_server)):
    return await _call("completions", server.engine.score, body.text, body.completions, input_ids=body.input_ids,
                       estimator=body.estimator, num_samples=body.num_samples, seed=body.seed,
                       renames={"prompt": "text"})  # the engine's argument is the body's text
