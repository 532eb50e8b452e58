"""Log probabilities in OpenAI's shapes, from the engine's SGLang-style lists.

The engine (:meth:`dllm_jax.Engine.meta_info`, with ``return_logprob``) puts in ``meta_info``
``output_token_logprobs``: one ``[logprob, token_id, text | None]`` per output token, and with
``top_logprobs_num = k``, ``output_top_logprobs``: per output token a list of k such triples, most likely first.
The lists grow with ``output_ids``, so a streamed chunk's entries are the slice of its new tokens.
``/generate`` returns them as they are (with ``return_text_in_logprobs`` the texts filled in); the OpenAI
endpoints reshape them here. Without those keys every function returns ``None`` (OpenAI's ``logprobs: null``).
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
    lps, tops = _lists(meta, 0, None)
    if lps is None:
        return meta
    out = dict(meta)
    out["output_token_logprobs"] = [[lp, tid, t] for (lp, tid, _), t in zip(lps, _texts(tokenizer, lps))]
    if meta.get("output_top_logprobs") is not None:
        out["output_top_logprobs"] = [[[lp, tid, t] for (lp, tid, _), t in zip(top, _texts(tokenizer, top))]
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
    top_dicts = [{t: tlp for (tlp, _, _), t in zip(top, _texts(tokenizer, top))} for top in tops]
    return {"tokens": tokens, "token_logprobs": [lp for lp, _, _ in lps],
            "top_logprobs": top_dicts if meta.get("output_top_logprobs") is not None else None,
            "text_offset": offsets}
