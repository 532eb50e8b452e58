"""OpenAI's ``POST /v1/completions`` and ``POST /v1/chat/completions`` (``GET /v1/models`` is in
:mod:`serve.routes.admin`).

``n`` answers per prompt share the prompt's prefill (:func:`serve.state.expand_choices`); each is its own
choice, seeded ``seed + j`` when a seed is given. Streams and their extensions: :mod:`.openai_stream`.
"""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from serve import features, logprobs
from serve.errors import ApiError, bad_request
from serve.routes.openai_stream import chat_stream, completion_stream, finish, matched, usage
from serve.schemas import CHAT_FIELD_NAMES, OPENAI_FIELD_NAMES, ChatCompletionRequest, CompletionRequest
from serve.state import Server, expand_choices, finished_results, get_server
from serve.streaming import SSEResponse

router = APIRouter()


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, server: Server = Depends(get_server)):
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
    n = body.num_choices
    params = features.gate(body.sampling_dict(body.max_tokens), OPENAI_FIELD_NAMES, prefix="")
    ids_list, params_list, fields = expand_choices(ids_list, [params] * len(ids_list), fields, n)
    echoes = [e for e in echoes for _ in range(n)]
    batch = server.start_batch(ids_list, params_list, fields, stream=body.stream, renames=OPENAI_FIELD_NAMES,
                               provisional=body.stream_provisional, batch_field="n" if n > 1 else None)
    cid = f"cmpl-{uuid.uuid4().hex}"
    if body.stream:
        return SSEResponse(completion_stream(server, batch, body, cid, echoes), lambda gone: batch.close(gone))
    results = await finished_results(batch, request)
    if results is None:
        return Response(status_code=499)
    tok = server.engine.tokenizer
    choices = [{"index": i, "text": echoes[i] + res["text"],
                "logprobs": logprobs.completion(res["meta_info"], tok, text_offset=len(echoes[i])),
                "finish_reason": finish(res["meta_info"]), "matched_stop": matched(res["meta_info"])}
               for i, res in enumerate(results)]
    return {"id": cid, "object": "text_completion", "created": int(time.time()), "model": server.model_name,
            "choices": choices, "usage": usage([r["meta_info"] for r in results], n)}


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, server: Server = Depends(get_server)):
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
    renames = dict(CHAT_FIELD_NAMES)
    renames["sampling_params.max_new_tokens"] = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    renames["input_ids"] = "messages"
    n = body.num_choices
    params = features.gate(body.sampling_dict(max_new), renames, prefix="")
    ids_list, params_list, fields = expand_choices([ids], [params], ["messages"], n)
    batch = server.start_batch(ids_list, params_list, fields, stream=body.stream, renames=renames,
                               provisional=body.stream_provisional, batch_field="n" if n > 1 else None)
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
