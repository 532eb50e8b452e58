"""OpenAI answers and stream frames: choices, finish reasons, usage, and this server's ``dllm_block`` extension.

Choices are prompt-major: choice ``k * n + j`` is prompt k's j-th answer (``index`` says so). Usage counts each
prompt once (``prompt_tokens``, and ``cached_tokens`` as the least any of its choices found cached) and every
choice's completion tokens.

With ``stream_provisional``, frames between committed chunks carry the block being denoised as
``dllm_block`` (on the chat choice's ``delta`` with empty ``content``, on the completion choice beside empty
``text``): ``{"provisional": true, "offset", "step", "tokens", "masked", "immutable", "pieces",
"completion_tokens", "forward_passes"}``; committed frames of such streams carry
``{"provisional": false, "completion_tokens", "forward_passes"}`` there, so a client knows the block it showed
is superseded. Committed text is never re-sent.
"""

from __future__ import annotations

import time

from serve import logprobs
from serve.errors import error_body
from serve.schemas import ChatCompletionRequest, CompletionRequest
from serve.state import SHUTDOWN_MESSAGE, Batch, Server, partial_abort
from serve.streaming import SSE_DONE, sse


def finish(meta: dict) -> str | None:
    reason = meta.get("finish_reason")
    if not reason:
        return None
    return {"stop": "stop", "length": "length"}.get(reason.get("type"), reason.get("type"))


def matched(meta: dict):
    reason = meta.get("finish_reason") or {}
    return reason.get("matched") if reason.get("type") == "stop" else None


def usage(metas: dict[int, dict] | list[dict], n: int = 1) -> dict:
    """Usage over the choices seen so far (``metas``: choice index -> meta_info, or a list in index order)."""
    if isinstance(metas, list):
        metas = dict(enumerate(metas))
    groups: dict[int, list[dict]] = {}
    for index, meta in metas.items():
        groups.setdefault(index // n, []).append(meta)
    prompt = sum(g[0]["prompt_tokens"] for g in groups.values())
    completion = sum(m["completion_tokens"] for m in metas.values())
    cached = sum(min(m["cached_tokens"] for m in g) for g in groups.values())
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def stream_error(meta: dict) -> dict | None:
    reason = meta.get("finish_reason") or {}
    if reason.get("type") != "abort" or partial_abort(reason):
        return None
    message = reason.get("message", "aborted")
    return error_body(503 if message == SHUTDOWN_MESSAGE else 500, f"request aborted: {message}")


def dllm_block(chunk: dict, tokenizer=None) -> dict:
    """The ``dllm_block`` extension of a frame: the block's state for a provisional chunk; for a committed one the
    ids it committed and their texts (they fill the block's open positions, in order)."""
    meta = chunk["meta_info"]
    out = {"provisional": bool(chunk.get("provisional"))}
    if chunk.get("provisional"):
        out.update(chunk["block"])
    else:
        ids = chunk["output_ids"]
        out["output_ids"] = list(ids)
        out["pieces"] = [tokenizer.decode([t]) for t in ids] if tokenizer is not None else None
    out["completion_tokens"] = meta["completion_tokens"]
    out["forward_passes"] = meta["forward_passes"]
    return out


class _Frames:
    """What both stream kinds share: the frame envelope, usage bookkeeping, logprob slices."""

    def __init__(self, server: Server, batch: Batch, body, cid: str, obj: str):
        self.server, self.batch, self.body, self.cid, self.obj = server, batch, body, cid, obj
        self.created = int(time.time())
        self.metas: dict[int, dict] = {}
        self.n = body.num_choices
        self.lp_sent = [0] * len(batch.reqs)  # logprob entries sent per choice
        self.tokenizer = server.engine.tokenizer

    def frame(self, choices, usage_: dict | None = None) -> str:
        out = {"id": self.cid, "object": self.obj, "created": self.created, "model": self.server.model_name,
               "choices": choices}
        if usage_ is not None:
            out["usage"] = usage_
        return sse(out)

    def usage_now(self) -> dict | None:
        return usage(self.metas, self.n) if self.body.continuous_usage else None

    def logprob_slice(self, index: int, chunk: dict, fmt, **kw):
        start = self.lp_sent[index]
        end = start + len(chunk["output_ids"])
        self.lp_sent[index] = end
        return fmt(chunk["meta_info"], self.server.engine.tokenizer, start, end, **kw)

    def final_usage(self):
        return self.frame([], usage(self.metas, self.n)) if self.body.include_usage else None


async def completion_stream(server: Server, batch: Batch, body: CompletionRequest, cid: str, echoes: list[str]):
    f = _Frames(server, batch, body, cid, "text_completion")
    provisional = body.stream_provisional
    offsets = [len(e) for e in echoes]
    for i, echo in enumerate(echoes):
        if echo:
            yield f.frame([{"index": i, "text": echo, "logprobs": None, "finish_reason": None}])
    async for index, chunk, delta in batch.deltas():
        meta = chunk["meta_info"]
        f.metas[index] = meta
        if chunk.get("provisional"):
            yield f.frame([{"index": index, "text": "", "logprobs": None, "finish_reason": None,
                            "dllm_block": dllm_block(chunk)}], f.usage_now())
            continue
        error = stream_error(meta) if chunk["finished"] else None
        if error is not None:
            yield sse(error)
            continue
        done = finish(meta) if chunk["finished"] else None
        if delta or done or provisional or chunk["output_ids"]:
            lp = f.logprob_slice(index, chunk, logprobs.completion, text_offset=offsets[index])
            offsets[index] += len(delta)
            if not (delta or done or provisional or lp):
                continue
            choice = {"index": index, "text": delta, "logprobs": lp, "finish_reason": done}
            if done:
                choice["matched_stop"] = matched(meta)
            if provisional:
                choice["dllm_block"] = dllm_block(chunk, f.tokenizer)
            yield f.frame([choice], f.usage_now())
    last = f.final_usage()
    if last:
        yield last
    yield SSE_DONE


async def chat_stream(server: Server, batch: Batch, body: ChatCompletionRequest, cid: str):
    f = _Frames(server, batch, body, cid, "chat.completion.chunk")
    provisional = body.stream_provisional
    for i in range(len(batch.reqs)):
        yield f.frame([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None}])
    async for index, chunk, delta in batch.deltas():
        meta = chunk["meta_info"]
        f.metas[index] = meta
        if chunk.get("provisional"):
            yield f.frame([{"index": index, "delta": {"content": "", "dllm_block": dllm_block(chunk)},
                            "logprobs": None, "finish_reason": None}], f.usage_now())
            continue
        usage_ = f.usage_now()
        error = stream_error(meta) if chunk["finished"] else None
        if error is not None:
            yield sse(error)
            continue
        lp = f.logprob_slice(index, chunk, logprobs.chat) if chunk["output_ids"] else None
        block = dllm_block(chunk, f.tokenizer) if provisional else None
        if delta or lp or (provisional and not chunk["finished"]):
            d = {"content": delta}
            if block is not None:
                d["dllm_block"] = block
                block = {**block, "output_ids": [], "pieces": []}  # the finish frame does not repeat them
            yield f.frame([{"index": index, "delta": d, "logprobs": lp, "finish_reason": None}], usage_)
        if chunk["finished"]:
            d = {"dllm_block": block} if block is not None else {}
            yield f.frame([{"index": index, "delta": d, "logprobs": None, "finish_reason": finish(meta),
                            "matched_stop": matched(meta)}], usage_)
    last = f.final_usage()
    if last:
        yield last
    yield SSE_DONE
