"""Log probabilities in OpenAI's shapes, from the engine's SGLang-style lists.

The engine (:meth:`dllm_jax.Engine.meta_info`, with ``return_logprob``) puts in ``meta_info``
``output_token_logprobs``: one ``[logprob, token_id, text | None]`` per output token, and with
``top_logprobs_num = k``, ``output_top_logprobs``: per output token a list of k such triples, most likely first.
The lists grow with ``output_ids``, so a streamed chunk's entries are the slice of its new tokens.
``/generate`` returns them as they are (with ``return_text_in_logprobs`` the texts filled in); the OpenAI
endpoints reshape them here. Without those keys every function returns ``None`` (OpenAI's ``logprobs: null``).

A prompt's log-probabilities (:meth:`dllm_jax.Engine.prompt_logprobs`: ``input_token_logprobs``, one
``[logprob | None, token_id]`` per prompt token, and with k alternatives ``input_top_logprobs``) become the head of
an echoed completion's ``logprobs`` (:func:`prompt_completion`, :func:`join`): the first token's ``token_logprobs``
and ``top_logprobs`` entries are null, every other ``top_logprobs`` dict holds the k most likely tokens and the
prompt's own token (k + 1 entries when it is not among them, as OpenAI's echo answers).
"""

from __future__ import annotations


def _texts(tokenizer, triples) -> list[str]:
    out = []
    for _, tid, text in triples:
        if text is None:
            text = tokenizer.decode([tid], skip_special_tokens=False) if tokenizer is not None else ""
        out.append(text)
    return out


def _lists(meta: dict, start: int, end: int | None):
    lps = meta.get("output_token_logprobs")
    if lps is None:
        return None, None
    lps = lps[start:end]
    tops = meta.get("output_top_logprobs")
    tops = tops[start:end] if tops is not None else [[] for _ in lps]
    return lps, tops


def with_text(meta: dict, tokenizer) -> dict:
    """``meta_info`` with the texts of its logprob triples filled in (``return_text_in_logprobs``)."""
    out = dict(meta)
    for side in ("input", "output"):  # the prompt's (``logprob_start_len``) and the answer's
        lps, tops = meta.get(f"{side}_token_logprobs"), meta.get(f"{side}_top_logprobs")
        if lps is not None:
            out[f"{side}_token_logprobs"] = [[lp, tid, t] for (lp, tid, _), t in zip(lps, _texts(tokenizer, lps))]
        if tops is not None:
            out[f"{side}_top_logprobs"] = [None if top is None else
                                           [[lp, tid, t] for (lp, tid, _), t in zip(top, _texts(tokenizer, top))]
                                           for top in tops]
    return out


def chat(meta: dict, tokenizer, start: int = 0, end: int | None = None) -> dict | None:
    """OpenAI chat's ``logprobs``: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``."""
    lps, tops = _lists(meta, start, end)
    if lps is None:
        return None

    def entry(text, lp):
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    content = []
    for (lp, _, _), text, top in zip(lps, _texts(tokenizer, lps), tops):
        item = entry(text, lp)
        item["top_logprobs"] = [entry(t, tlp) for (tlp, _, _), t in zip(top, _texts(tokenizer, top))]
        content.append(item)
    return {"content": content}


def completion(meta: dict, tokenizer, start: int = 0, end: int | None = None,
               text_offset: int = 0) -> dict | None:
    """OpenAI completions' ``logprobs``: ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``
    (``top_logprobs`` one ``{token: logprob}`` per token; ``text_offset`` from ``text_offset`` on)."""
    lps, tops = _lists(meta, start, end)
    if lps is None:
        return None
    tokens = _texts(tokenizer, lps)
    offsets = []
    for text in tokens:
        offsets.append(text_offset)
        text_offset += len(text)
    top_dicts = [_top_dict(top, tokenizer) for top in tops]
    return {"tokens": tokens, "token_logprobs": [lp for lp, _, _ in lps],
            "top_logprobs": top_dicts if meta.get("output_top_logprobs") is not None else None,
            "text_offset": offsets}


def _top_dict(top, tokenizer) -> dict:
    """``{text: logprob}`` of ``[logprob, token_id, text | None]`` entries, most likely first: tokens that decode
    to the same text keep the most likely one's figure (so the top entry is always the maximum)."""
    out: dict = {}
    for (lp, _, _), text in zip(top, _texts(tokenizer, top)):
        out.setdefault(text, lp)
    return out


def prompt_completion(scored: dict, tokenizer) -> dict:
    """OpenAI completions' ``logprobs`` of a prompt's tokens (``scored``: :meth:`dllm_jax.Engine.prompt_logprobs`),
    ``text_offset`` counting from 0 over the echoed text."""
    entries = [[lp, tid, None] for lp, tid in scored["input_token_logprobs"]]
    tokens = _texts(tokenizer, entries)
    offsets, at = [], 0
    for text in tokens:
        offsets.append(at)
        at += len(text)
    tops = scored.get("input_top_logprobs")
    top_dicts = None
    if tops is not None:
        top_dicts = []
        for (lp, _, _), text, top in zip(entries, tokens, tops):
            if top is None:
                top_dicts.append(None)
                continue
            d = _top_dict([[tlp, tid, None] for tlp, tid in top], tokenizer)
            d.setdefault(text, lp)
            top_dicts.append(d)
    return {"tokens": tokens, "token_logprobs": [lp for lp, _, _ in entries], "top_logprobs": top_dicts,
            "text_offset": offsets}


def join(head: dict, tail: dict | None) -> dict:
    """Two ``logprobs`` objects of consecutive tokens as one (``top_logprobs`` null only when both are)."""
    if tail is None:
        return head
    a, b = head["top_logprobs"], tail["top_logprobs"]
    if a is not None or b is not None:
        a, b = a or [None] * len(head["tokens"]), b or [None] * len(tail["tokens"])
    return {"tokens": head["tokens"] + tail["tokens"],
            "token_logprobs": head["token_logprobs"] + tail["token_logprobs"],
            "top_logprobs": None if a is None else a + b, "text_offset": head["text_offset"] + tail["text_offset"]}
