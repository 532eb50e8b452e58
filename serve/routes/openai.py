"""OpenAI's ``POST /v1/completions`` and ``POST /v1/chat/completions`` (``GET /v1/models`` is in
:mod:`serve.routes.admin`).

``n`` answers per prompt share the prompt's prefill (:func:`serve.state.expand_choices`); each is its own
choice, seeded ``seed + j`` when a seed is given. Streams and their extensions: :mod:`.openai_stream`.

A request's ``model`` must be one of the served names (``--served-model-name NAME,ALIAS``) or null: another is
404 ``model_not_found``, as OpenAI answers, rather than a silent answer by a model the client did not ask for.
Every check that does not need the prompt's tokens (model, sizes, fields) comes before tokenizing, which runs in
a worker thread (:meth:`serve.state.Server.tokenize_all`).

``echo`` with ``logprobs = k``: each choice's ``logprobs`` starts with its prompt's tokens (the chain estimator,
:meth:`dllm_jax.Engine.prompt_logprobs`, scored in a worker thread before the answers are generated; the first
token's entries null), then the generated tokens'; ``max_tokens: 0`` with ``echo`` generates nothing (``finish_reason``
``length``, no completion tokens). This is what lm-eval's ``local-completions`` loglikelihood requests send
(``echo``, ``logprobs: 1``, ``max_tokens: 1``, token-id prompts). Streamed, both are a 400 naming ``stream``.
"""

from __future__ import annotations

import logging
import time
import uuid

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from serve import features, logprobs
from serve.body import JSONBodyRoute
from serve.errors import ApiError, bad_request, model_not_found
from serve.routes.openai_stream import chat_stream, completion_stream, finish, matched, usage
from serve.schemas import CHAT_FIELD_NAMES, OPENAI_FIELD_NAMES, ChatCompletionRequest, CompletionRequest, OpenAICommon
from serve.schemas.router_fields import UNKNOWN_MODEL
from serve.state import Server, expand_choices, finished_results, get_server
from serve.streaming import SSEResponse

router = APIRouter(route_class=JSONBodyRoute)
logger = logging.getLogger("dllm_jax.serve")
_ignored_logged: set[str] = set()


def _check_common(body: OpenAICommon, server: Server) -> None:
    """The model (``"unknown"``: SGLang's router's value for none), and the accepted-but-ignored fields (logged once
    per field per process)."""
    if body.model is not None and body.model != UNKNOWN_MODEL and body.model not in server.model_names:
        raise model_not_found(body.model, server.model_names)
    for name in body.ignored_fields():
        if name not in _ignored_logged:
            _ignored_logged.add(name)
            logger.info("OpenAI field %r accepted and ignored (it does not change an answer here; logged once)",
                        name)


def _rids(body: OpenAICommon, count: int) -> list[str] | None:
    """The engine request ids a body's ``rid`` names (SGLang's extension, forwarded by its router), so that
    ``/abort_request`` reaches them."""
    try:
        return body.engine_rids(count)
    except ValueError as e:
        raise ApiError(400, str(e), "rid") from None


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, server: Server = Depends(get_server)):
    _check_common(body, server)
    prompts, batch_mode = body.prompts()
    n = body.num_choices
    server.check_batch_size(len(prompts) * n, "n" if n > 1 else "prompt")
    renames = {**OPENAI_FIELD_NAMES, **body.grammar_renames()}
    params = features.gate(body.sampling_dict(body.max_tokens), renames, prefix="")
    fields = [f"prompt[{i}]" for i in range(len(prompts))] if batch_mode else ["prompt"]
    texts = [(i, p) for i, p in enumerate(prompts) if isinstance(p, str)]
    text_ids = await server.tokenize_all([p for _, p in texts], [fields[i] for i, _ in texts])
    ids_list, echoes = list(prompts), [None] * len(prompts)
    for (i, p), ids in zip(texts, text_ids):
        ids_list[i], echoes[i] = ids, p
    if body.echo:  # a token-id prompt is echoed with its special tokens (the mask token included)
        tok = server.engine.tokenizer
        echoes = [e if e is not None else (tok.decode(ids, skip_special_tokens=False) if tok else "")
                  for e, ids in zip(echoes, ids_list)]
    else:
        echoes = [""] * len(ids_list)
    scored = await server.prompt_logprobs(ids_list, fields, body.logprobs, option="echo",
                                          renames=OPENAI_FIELD_NAMES) if body.prompt_logprobs else None
    if body.max_tokens == 0:  # echo only (the schema refuses 0 without echo): nothing generated
        return _scored_only(server, ids_list, fields, echoes, scored, n)
    ids_list, params_list, fields = expand_choices(ids_list, [params] * len(ids_list), fields, n)
    echoes = [e for e in echoes for _ in range(n)]
    batch = server.start_batch(ids_list, params_list, fields, stream=body.stream, renames=renames,
                               rids=_rids(body, len(ids_list)),
                               provisional=body.stream_provisional, batch_field="n" if n > 1 else None)
    cid = f"cmpl-{uuid.uuid4().hex}"
    if body.stream:
        return SSEResponse(completion_stream(server, batch, body, cid, echoes), lambda gone: batch.close(gone))
    results = await finished_results(batch, request)
    if results is None:
        return Response(status_code=499)
    tok = server.engine.tokenizer
    choices = []
    for i, res in enumerate(results):
        lp = logprobs.completion(res["meta_info"], tok, text_offset=len(echoes[i]))
        if scored is not None:
            lp = logprobs.join(logprobs.prompt_completion(scored[i // n], tok), lp)
        choices.append({"index": i, "text": echoes[i] + res["text"], "logprobs": lp,
                        "finish_reason": finish(res["meta_info"]), "matched_stop": matched(res["meta_info"])})
    return {"id": cid, "object": "text_completion", "created": int(time.time()), "model": server.model_name,
            "choices": choices, "usage": usage([r["meta_info"] for r in results], n)}


def _scored_only(server: Server, ids_list: list[list[int]], fields: list[str], echoes: list[str],
                 scored: list[dict] | None, n: int) -> dict:
    """``max_tokens: 0`` with ``echo``: each choice is its prompt, with its log-probabilities when asked for."""
    if not server.ready:
        raise server.unavailable()
    for ids, field in zip(ids_list, fields):
        server.check_ids(ids, field)
    tok = server.engine.tokenizer
    choices, metas = [], []
    for k, (ids, echo) in enumerate(zip(ids_list, echoes)):
        lp = logprobs.prompt_completion(scored[k], tok) if scored is not None else None
        for j in range(n):
            choices.append({"index": k * n + j, "text": echo, "logprobs": lp, "finish_reason": "length",
                            "matched_stop": None})
            metas.append({"prompt_tokens": len(ids), "completion_tokens": 0, "cached_tokens": 0})
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": server.model_name, "choices": choices, "usage": usage(metas, n)}


def _image_token(engine) -> str:
    """The text of the model's image token (what the chat template sees for an ``image_url`` part)."""
    return engine.tokenizer.convert_ids_to_tokens(engine.images.vcfg.image_token_id)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, server: Server = Depends(get_server)):
    _check_common(body, server)
    eng = server.engine
    n = body.num_choices
    server.check_batch_size(n, "n")
    renames = {**CHAT_FIELD_NAMES, **body.grammar_renames()}
    renames["sampling_params.max_new_tokens"] = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    renames["input_ids"] = "messages"
    max_new = body.max_completion_tokens or body.max_tokens
    params = features.gate(body.sampling_dict(max_new), renames, prefix="")
    urls = body.image_urls()  # image_url parts: each decoded alone (an error names its part), in a worker thread
    images = [img for one in await server.prepare_images([u for _, u in urls], [f for f, _ in urls]) for img in one]
    messages = body.chat_messages(_image_token(eng) if urls else None)
    server.check_chars(sum(len(m["content"]) for m in messages), "messages")
    try:
        text = await run_in_threadpool(eng.apply_chat_template, messages)
    except ValueError as e:
        raise bad_request(str(e)) from None
    except Exception as e:  # a template error (e.g. unsupported role order)
        raise ApiError(400, f"messages: the chat template failed: {e}", "messages") from None
    ids = (await server.tokenize_all([text], ["messages"]))[0]
    if max_new is None:  # the rest of the context
        params["max_new_tokens"] = max(1, eng.context_length - len(ids))
    ids_list, params_list, fields = expand_choices([ids], [params], ["messages"], n)
    batch = server.start_batch(ids_list, params_list, fields, stream=body.stream, renames=renames,
                               rids=_rids(body, len(ids_list)),
                               provisional=body.stream_provisional, batch_field="n" if n > 1 else None,
                               images=[images or None] * len(ids_list), image_fields=["messages"] * len(ids_list))
    cid = f"chatcmpl-{uuid.uuid4().hex}"
    if body.stream:
        return SSEResponse(chat_stream(server, batch, body, cid), lambda gone: batch.close(gone))
    results = await finished_results(batch, request)
    if results is None:
        return Response(status_code=499)
    choices = [{"index": i, "message": {"role": "assistant", "content": res["text"]},
                "logprobs": logprobs.chat(res["meta_info"], eng.tokenizer),
                "finish_reason": finish(res["meta_info"]), "matched_stop": matched(res["meta_info"])}
               for i, res in enumerate(results)]
    return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": server.model_name,
            "choices": choices, "usage": usage([r["meta_info"] for r in results], n)}
