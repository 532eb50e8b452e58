"""SGLang's ``POST /generate``.

Body: ``text`` or ``input_ids`` (one prompt or a list), ``sampling_params`` (one object or one per prompt;
``n`` > 1 is SGLang's parallel sampling: n answers per prompt, prompt-major, choice j seeded ``seed + j``),
``stream``, ``stream_provisional``, ``rid`` (one per answer). Answer ``{"text", "output_ids", "meta_info"}``, a
list for a batch or n > 1. Streaming: SSE ``data: {...}`` per committed block (cumulative ``text`` /
``output_ids`` as SGLang, or only the new part with ``--incremental-streaming-output``; ``index`` in batches),
then ``data: [DONE]``. ``return_logprob`` with ``logprob_start_len >= 0`` adds the prompt's ``input_token_logprobs``
(and ``input_top_logprobs``) from that position on, under the chain estimator (not streamed). With ``stream_provisional`` the frames between carry ``meta_info.provisional: true`` and
``meta_info.block`` (the block being denoised) and unchanged committed ``text`` / ``output_ids``; committed frames
then carry ``meta_info.provisional: false``.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from serve import features, logprobs
from serve.body import JSONBodyRoute
from serve.errors import ApiError, model_not_found
from serve.schemas import GenerateRequest
from serve.schemas.router_fields import UNKNOWN_MODEL, log_ignored, present
from serve.state import Batch, Server, expand_choices, finished_results, get_server
from serve.streaming import SSE_DONE, SSEResponse, sse

router = APIRouter(route_class=JSONBodyRoute)

LOGPROB_FIELDS = {"sampling_params.return_logprob": "return_logprob",
                  "sampling_params.top_logprobs_num": "top_logprobs_num"}


@router.post("/generate")
async def generate(body: GenerateRequest, request: Request, server: Server = Depends(get_server)):
    _router_fields(body, server)
    n = body.n
    batch_mode = body.is_batch or n > 1
    prompts = len(body.text if body.text is not None else body.input_ids) if body.is_batch else 1
    # everything that can be checked without the ids first: a batch that can never be admitted, or whose other
    # fields are wrong, is refused before any of it is tokenized
    server.check_batch_size(prompts * n, "sampling_params.n" if n > 1 else "text" if body.text is not None
                            else "input_ids")
    params = body.sampling_params
    if isinstance(params, list):
        if len(params) != prompts:
            raise ApiError(400, f"sampling_params: {len(params)} entries for {prompts} prompts", "sampling_params")
        params_list = [p.engine_dict() for p in params]
        prefixes = [f"sampling_params[{i}]" for i in range(prompts)]
    else:
        params_list = [params.engine_dict() if params is not None else {}] * prompts
        prefixes = ["sampling_params"] * prompts
    wanted = {"return_logprob": body.return_logprob, "top_logprobs_num": body.top_logprobs_num}
    params_list = [features.gate({**p, **{k: v for k, v in wanted.items() if v is not None}},
                                 LOGPROB_FIELDS, prefix) for p, prefix in zip(params_list, prefixes)]
    rids = body.rid
    if rids is not None:
        rids = rids if isinstance(rids, list) else [rids]
        if len(rids) != prompts * n:
            what = f"{prompts} prompts" + (f" x n = {n}" if n > 1 else "")
            raise ApiError(400, f"rid: {len(rids)} ids for {what}", "rid")
    if body.text is not None:
        texts = body.text if body.is_batch else [body.text]
        fields = [f"text[{i}]" for i in range(len(texts))] if body.is_batch else ["text"]
        ids_list = await server.tokenize_all(texts, fields)
    else:
        ids_list = body.input_ids if body.is_batch else [body.input_ids]
        fields = [f"input_ids[{i}]" for i in range(len(ids_list))] if body.is_batch else ["input_ids"]
    images, image_fields = _images(body, prompts)
    images = await server.prepare_images(images, image_fields)
    start = body.prompt_logprobs_from
    scored = await _prompt_logprobs(server, ids_list, fields, start, body.top_logprobs_num or 0) \
        if start is not None else None
    ids_list, params_list, fields = expand_choices(ids_list, params_list, fields, n)
    batch = server.start_batch(ids_list, params_list, fields, stream=body.stream, rids=rids,
                               provisional=body.stream_provisional,
                               batch_field="sampling_params.n" if n > 1 else None,
                               params_fields=[p for p in prefixes for _ in range(n)],
                               images=[i for i in images for _ in range(n)],
                               image_fields=[f for f in image_fields for _ in range(n)])
    text_in_logprobs = bool(body.return_text_in_logprobs)
    if body.stream:
        return SSEResponse(_stream(server, batch, batch_mode, body.stream_provisional, text_in_logprobs),
                           lambda gone: batch.close(gone))
    results = await finished_results(batch, request)
    if results is None:
        return Response(status_code=499)
    if scored is not None:
        results = [{**r, "meta_info": {**r["meta_info"], **scored[i // n]}} for i, r in enumerate(results)]
    if text_in_logprobs:
        tok = server.engine.tokenizer
        results = [{**r, "meta_info": logprobs.with_text(r["meta_info"], tok)} for r in results]
    return results if batch_mode else results[0]


def _images(body: GenerateRequest, prompts: int) -> tuple[list, list[str]]:
    """``image_data`` per prompt (SGLang's shape: a single prompt's images, or a list with an entry per prompt of a
    batch) and the field naming each."""
    data = body.image_data
    if not body.is_batch:
        return [data], ["image_data"]
    if data is None:
        return [None] * prompts, ["image_data"] * prompts
    if not isinstance(data, list) or len(data) != prompts:
        raise ApiError(400, f"image_data: for a batch of {prompts} prompts, a list with one entry per prompt "
                            f"(null: no image)", "image_data")
    return list(data), [f"image_data[{i}]" for i in range(prompts)]


def _router_fields(body: GenerateRequest, server: Server) -> None:
    """SGLang's router's fields: ``model`` null, ``"unknown"`` or a served name (else 404, as on ``/v1``); the
    others accepted and dropped (:mod:`serve.schemas.router_fields`), each logged once."""
    if body.model is not None and body.model != UNKNOWN_MODEL and body.model not in server.model_names:
        raise model_not_found(body.model, server.model_names)
    names = present(body, "generate")
    params = body.sampling_params
    for i, p in enumerate(params if isinstance(params, list) else [params] if params is not None else []):
        names += present(p, "sampling", f"sampling_params[{i}]." if isinstance(params, list) else "sampling_params.")
    log_ignored(names)


async def _prompt_logprobs(server: Server, ids_list: list[list[int]], fields: list[str], start: int,
                           top_k: int) -> list[dict]:
    """SGLang's ``input_token_logprobs`` (and ``input_top_logprobs``) from prompt position ``start`` on: the chain
    estimator (:meth:`dllm_jax.Engine.prompt_logprobs`; the prompt's first token has none), as
    ``[logprob, token_id, None]`` triples, scored in a worker thread (:meth:`serve.state.Server.prompt_logprobs`)."""

    def check(ids: list[int], field: str) -> None:
        if start >= len(ids):
            raise ApiError(400, f"logprob_start_len: {start} is not a position of {field} ({len(ids)} tokens)",
                           "logprob_start_len")

    scored = await server.prompt_logprobs(ids_list, fields, top_k, option="logprob_start_len", check=check)
    out = []
    for s in scored:
        meta = {"input_token_logprobs": [[lp, tid, None] for lp, tid in s["input_token_logprobs"][start:]]}
        if top_k:
            meta["input_top_logprobs"] = [None if top is None else [[lp, tid, None] for lp, tid in top]
                                          for top in s["input_top_logprobs"][start:]]
        out.append(meta)
    return out


async def _stream(server: Server, batch: Batch, batch_mode: bool, provisional: bool, text_in_logprobs: bool):
    incremental = server.settings.incremental_streaming_output
    tok = server.engine.tokenizer
    text = [""] * len(batch.reqs)
    ids: list[list[int]] = [[] for _ in batch.reqs]
    async for index, chunk, delta in batch.deltas():
        meta = chunk["meta_info"]
        if text_in_logprobs:
            meta = logprobs.with_text(meta, tok)
        if chunk.get("provisional"):
            meta = {**meta, "provisional": True, "block": chunk["block"]}
            out = {"text": "", "output_ids": []} if incremental else {"text": text[index],
                                                                       "output_ids": list(ids[index])}
            out["meta_info"] = meta
        elif incremental:
            out = {"text": delta, "output_ids": chunk["output_ids"], "meta_info": meta}
        elif chunk["finished"]:  # the whole answer, exactly as the non-streaming one
            out = {**server.engine.result(batch.reqs[index]), "meta_info": meta}
        else:
            text[index] += chunk["text"]
            ids[index] += chunk["output_ids"]
            out = {"text": text[index], "output_ids": list(ids[index]), "meta_info": meta}
        if provisional and not chunk.get("provisional"):
            out["meta_info"] = {**out["meta_info"], "provisional": False}
        if batch_mode:
            out["index"] = index
        yield sse(out)
    yield SSE_DONE
