"""A request's answer as the caller sees it: detokenized text, stop strings, log probabilities, stream chunks and
``meta_info``. One module for all of it, below the scheduler: the scheduler asks it where a stop string ends the
outputs (the one place stop strings are searched), the engine and the server render results and chunks from it,
and nothing here calls back up.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable

from dllm_jax.engine.request import Request


class Output:
    """Renders requests of one model (``tokenizer`` None: no text, ids only)."""

    def __init__(self, tokenizer, *, block_size: int, mask_token_id: int):
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.mask_token_id = mask_token_id

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        # A fast tokenizer's own decoding: transformers' public ``decode`` first walks every id in Python looking
        # for tensors to convert, half the time of detokenizing an answer. Our ids are a list of ints already.
        tokenizer = self.tokenizer
        if getattr(tokenizer, "is_fast", False) and hasattr(tokenizer, "_decode"):
            return tokenizer._decode(ids, skip_special_tokens=skip_special_tokens)
        return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    # -- stop strings ---------------------------------------------------------------------------
    def find_stop_string(self, req: Request, start: int) -> dict | None:
        """After outputs were appended from index ``start``: the earliest stop string the text now holds, as a
        finish reason. The outputs are cut right after the token that completed it, and the answer's text, cut
        where the stop string begins, is kept (``req.final_text``): the text is searched once, here."""
        if self.tokenizer is None or not req.params.stop:
            return None
        skip = req.params.skip_special_tokens
        text = self.decode(req.output_ids, skip)
        best = None
        for s in req.params.stop:
            i = text.find(s)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        pos, s = best
        for n in range(max(start, 0) + 1, len(req.output_ids) + 1):
            if s in self.decode(req.output_ids[:n], skip):
                del req.output_ids[n:]
                break
        req.final_text = text[:pos]
        return {"type": "stop", "matched": s}

    # -- results --------------------------------------------------------------------------------
    def text(self, req: Request) -> str:
        if self.tokenizer is None:
            return ""
        if req.final_text is not None:
            return req.final_text
        return self.decode(req.output_ids, req.params.skip_special_tokens)

    def meta_info(self, req: Request) -> dict:
        end = req.finish_time or time.perf_counter()
        return {
            "id": req.rid,
            "prompt_tokens": len(req.prompt_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": req.cached_tokens or 0,
            "forward_passes": req.forward_passes,
            "finish_reason": req.finish_reason,
            "e2e_latency": end - req.arrival_time,
            "time_to_first_block": None if req.first_block_time is None else req.first_block_time - req.arrival_time,
            "retractions": req.retractions,
            "weight_version": req.weight_version,
            **logprob_meta(req),
        }

    def result(self, req: Request) -> dict:
        return {"text": self.text(req), "output_ids": list(req.output_ids), "meta_info": self.meta_info(req)}

    # -- streaming ------------------------------------------------------------------------------
    def chunk(self, req: Request) -> dict | None:
        """The part of the output committed since the last chunk of this request (None if nothing new).

        Text is never sent twice: an incomplete UTF-8 sequence at the end waits for the rest, and while the
        request runs, a tail that could be the start of a stop string is held back (the final text is cut where
        a stop string begins, which may be inside text committed by an earlier block)."""
        finished = req.finished
        text = self.text(req)
        if not finished:
            text = text.rstrip("\ufffd")
            hold = max((len(s) - 1 for s in req.params.stop), default=0)
            if hold:
                text = text[:max(len(req.emitted_text), len(text) - hold)]
        new_ids = req.output_ids[req.emitted_tokens:]
        new_text = text[len(req.emitted_text):] if text.startswith(req.emitted_text) else ""
        if not new_ids and not new_text and not finished:
            return None
        req.emitted_tokens = len(req.output_ids)
        if text.startswith(req.emitted_text):
            req.emitted_text = text
        return {"text": new_text, "output_ids": new_ids, "finished": finished, "meta_info": self.meta_info(req)}

    def provisional_chunk(self, req: Request) -> dict:
        """The block being denoised, after a step that left it unfinished: ``tokens`` (the mask id where still
        masked), ``masked`` (positions still to decode), ``immutable`` (prompt / committed positions),
        ``pieces`` (each position's token text, None where masked; only with a tokenizer), ``offset`` (absolute
        position of the block's first token), ``step`` (forwards so far in this block). Adds no text."""
        tokens = [int(t) for t in req.block_tokens]
        immutable = [bool(x) for x in req.block_immutable]
        masked = [t == self.mask_token_id and not imm for t, imm in zip(tokens, immutable)]
        pieces = None
        if self.tokenizer is not None:
            pieces = [None if m else self.decode([t], req.params.skip_special_tokens) for t, m in zip(tokens, masked)]
        offset = req.prefix_len(self.block_size) if req.block_offset is None else req.block_offset
        block = {"offset": offset, "step": req.block_steps, "tokens": tokens,
                 "masked": masked, "immutable": immutable, "pieces": pieces}
        return {"text": "", "output_ids": [], "finished": False, "provisional": True, "block": block,
                "meta_info": self.meta_info(req)}


def logprob_meta(req: Request) -> dict:
    """SGLang's logprob fields: for each output token so far, ``[logprob, token_id, None]`` under the forward that
    wrote it (the distribution the algorithm used: mask id excluded, penalties applied, the row's temperature;
    top-k / top-p filtering not applied), and with ``top_logprobs_num = k`` that forward's k most likely tokens,
    most likely first. The lists grow with ``output_ids`` (a streamed chunk's entries are the slice of its new
    tokens); a token at ``-inf`` (masked by a penalty) reads -9999.0."""
    k = req.params.logprobs
    if k < 0:
        return {}
    out = {"output_token_logprobs": list(req.output_token_logprobs)}
    if k > 0:
        out["output_top_logprobs"] = list(req.output_top_logprobs)
    return out


class ChunkSink:
    """Per-request event sink for streaming: builds each chunk on the engine's thread, where the request's state
    is consistent, and queues it for the consumer (``put`` may be replaced, e.g. by an asyncio hand-off).
    ``output``: an :class:`Output`, or an engine (its ``output``)."""

    def __init__(self, output, put: Callable[[dict], None] | None = None):
        self.output = getattr(output, "output", output)
        self.chunks: queue.SimpleQueue = queue.SimpleQueue()
        self.put = put or self.chunks.put

    def __call__(self, req: Request, event: dict) -> None:
        if event.get("provisional"):
            self.put(self.output.provisional_chunk(req))
            return
        chunk = self.output.chunk(req)
        if chunk is not None:
            self.put(chunk)


class FinishWatcher:
    """Per-request event sink for blocking generate(): wakes the waiter when the request finishes."""

    def __init__(self):
        self.done = threading.Event()

    def __call__(self, req: Request, event: dict) -> None:
        if req.finished:
            self.done.set()
