"""Sampling features the HTTP side accepts before the engine implements them: log probabilities, penalties and
biases (issue 18). One switch: a field is passed to the engine when ``dllm_jax``'s ``SamplingParams`` has a field
of that name; until then any value but the neutral one is a 400 naming the body's field (neutral values are
dropped, so the engine never sees them). Types and ranges are checked by the schemas either way.

The engine's names (its ``sampling_params``), their neutral values, and what they mean:

=====================  =========  ==========================================================================
``return_logprob``     false      ``meta_info.output_token_logprobs``: ``[logprob, token_id, text|null]`` per
                                  output token (the forward that committed it)
``top_logprobs_num``   0          ``meta_info.output_top_logprobs``: per output token, the k most likely
                                  ``[logprob, token_id, text|null]`` of that forward
``presence_penalty``   0          OpenAI's, over the request's generated tokens
``frequency_penalty``  0          OpenAI's, over the request's generated tokens
``repetition_penalty`` 1          SGLang / CTRL's multiplicative penalty
``min_new_tokens``     0          EOS and stop tokens are masked until this many tokens are out
``logit_bias``         {}         ``{"token id": bias}`` added to the logits
=====================  =========  ==========================================================================
"""

from __future__ import annotations

import dataclasses
import functools

NEUTRAL = {"return_logprob": False, "top_logprobs_num": 0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
           "repetition_penalty": 1.0, "min_new_tokens": 0, "logit_bias": {}}


@functools.lru_cache(maxsize=None)
def engine_sampling_fields() -> frozenset[str]:
    from dllm_jax.engine.sampling import SamplingParams

    return frozenset(f.name for f in dataclasses.fields(SamplingParams))


def engine_supports(name: str) -> bool:
    return name in engine_sampling_fields()


def gate(params: dict, field_names: dict[str, str] | None = None, prefix: str = "sampling_params") -> dict:
    """``params`` without neutral values of the gated features; an :class:`~serve.errors.ApiError` 400 for a
    non-neutral value the engine does not implement. ``field_names`` maps ``sampling_params.NAME`` to the body's
    field (OpenAI), else the error names ``PREFIX.NAME``."""
    from serve.errors import ApiError

    out = dict(params)
    for name, neutral in NEUTRAL.items():
        if name not in out:
            continue
        value = out[name]
        if value is None or value == neutral:
            del out[name]
            continue
        if engine_supports(name):
            continue
        key = f"sampling_params.{name}"
        field = (field_names or {}).get(key) or (f"{prefix}.{name}" if prefix else name)
        raise ApiError(400, f"{field}: not supported by this server yet (the engine does not implement it; only "
                            f"{_show(neutral)} or null)", field)
    return out


def _show(v) -> str:
    return "false" if v is False else repr(v)
