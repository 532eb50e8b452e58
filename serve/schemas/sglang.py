"""SGLang's ``POST /generate`` body (the parts a text-only block-diffusion server implements), and the admin
bodies."""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationError, field_validator, model_validator

from serve.schemas.common import (MAX_N, MAX_NEW_TOKENS_LIMIT, MAX_TOP_LOGPROBS, Body, PenaltyFields, StopFields,
                                  check_token_list, clean_msg, format_loc)
from serve.schemas.router_fields import GenerateRouterFields, SamplingRouterFields, router_field_names


class SamplingParamsBody(SamplingRouterFields, StopFields, PenaltyFields):
    """SGLang's sampling parameters. ``n`` is SGLang's parallel sampling (n answers per prompt); the penalty
    fields pass to the engine once it implements them (:mod:`serve.features`). ``sampling_seed`` is ``seed``
    (SGLang's router's name); the router's other fields: :mod:`serve.schemas.router_fields`."""

    max_new_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS_LIMIT)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    seed: int | None = Field(None, ge=0, lt=2 ** 32)
    n: int | None = Field(None, ge=1, le=MAX_N)
    min_new_tokens: int | None = Field(None, ge=0, le=MAX_NEW_TOKENS_LIMIT)
    # structured output (one of them; compiled by the engine, which names the field and the reason if it cannot)
    json_schema: Any = None  # a JSON schema as a string (SGLang), or the schema object
    regex: str | None = None
    ebnf: str | None = None

    @model_validator(mode="after")
    def _min_max(self):
        if (self.min_new_tokens is not None and self.max_new_tokens is not None
                and self.min_new_tokens > self.max_new_tokens):
            raise ValueError(f"min_new_tokens: {self.min_new_tokens} exceeds max_new_tokens {self.max_new_tokens}")
        return self

    def engine_dict(self) -> dict:
        """The engine's sampling params (``n`` is the server's: it makes n requests)."""
        out = self.model_dump(exclude_none=True, exclude={"n", "sampling_seed", *router_field_names("sampling")})
        if self.sampling_seed is not None:
            out["seed"] = self.sampling_seed
        return out


def _sampling_params(v: Any, field: str = "sampling_params"):
    if v is None:
        return None
    if isinstance(v, list):
        out = [_one_sampling_params(item, f"{field}[{i}]") for i, item in enumerate(v)]
        for i, p in enumerate(out):  # SGLang: one n for the whole request
            if (p.n or 1) != (out[0].n or 1):
                raise ValueError(f"{field}[{i}].n: every entry must have the same n ({out[0].n or 1})")
        return out
    return _one_sampling_params(v, field)


def _one_sampling_params(v: Any, field: str) -> SamplingParamsBody:
    if isinstance(v, SamplingParamsBody):
        return v
    if not isinstance(v, dict):
        raise ValueError(f"{field}: must be an object (or a list of objects, one per prompt)")
    try:
        return SamplingParamsBody.model_validate(v)
    except ValidationError as e:
        e0 = e.errors(include_url=False)[0]
        msg = clean_msg(e0["msg"])
        # messages raised by our own validators already start with the key's name
        key = format_loc(e0["loc"])
        if key and msg.startswith(key.lstrip(".") + ":"):
            msg = msg.split(":", 1)[1].strip()
        elif not key and ":" in msg:  # a model-level check names its field itself
            name, msg = msg.split(":", 1)
            key, msg = f".{name}", msg.strip()
        raise ValueError(f"{field}{key}: {msg}") from None


class GenerateRequest(GenerateRouterFields, Body):
    """SGLang's ``GenerateReqInput``. ``stream_provisional`` (this server's extension) adds the block being
    denoised to the stream after every step. Logprob fields are checked here and served once the engine computes
    log probabilities (:mod:`serve.features`). The fields SGLang's router adds: :mod:`.router_fields`."""

    prompt_text = (("text",), ("text", int))

    text: Any = None
    input_ids: Any = None
    sampling_params: Any = None
    stream: bool = False
    stream_provisional: bool = False
    rid: Any = None
    return_logprob: bool | None = None
    top_logprobs_num: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    logprob_start_len: int | None = None
    return_text_in_logprobs: bool | None = None
    # the prompt's images (a model with a vision tower): per prompt one image or a list (a batch: a list with an
    # entry per prompt); each a data URL or base64 (dllm_jax/engine/images.py); checked by the engine
    image_data: Any = None

    @field_validator("text")
    @classmethod
    def _text(cls, v):
        if v is None or isinstance(v, str):
            return v
        if isinstance(v, list) and v and all(isinstance(t, str) for t in v):
            return v
        raise ValueError("text: must be a string or a non-empty list of strings")

    @field_validator("input_ids")
    @classmethod
    def _input_ids(cls, v):
        if v is None:
            return v
        if isinstance(v, list) and v and all(isinstance(x, list) for x in v):
            return [check_token_list(x, f"input_ids[{i}]") for i, x in enumerate(v)]
        return check_token_list(v, "input_ids")

    @field_validator("sampling_params")
    @classmethod
    def _params(cls, v):
        return _sampling_params(v)

    @field_validator("rid")
    @classmethod
    def _rid(cls, v):
        if v is None or (isinstance(v, str) and v):
            return v
        if isinstance(v, list) and all(isinstance(r, str) and r for r in v):
            return v
        raise ValueError("rid: must be a non-empty string or a list of them")

    @field_validator("logprob_start_len")
    @classmethod
    def _start(cls, v):
        if v is not None and (isinstance(v, bool) or v < -1):
            raise ValueError("logprob_start_len: must be -1 (no prompt log-probabilities) or a prompt position >= 0")
        return v

    @model_validator(mode="after")
    def _one_input(self):
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("text: give exactly one of text and input_ids")
        if self.stream_provisional and not self.stream:
            raise ValueError("stream_provisional: needs stream: true")
        if self.prompt_logprobs_from is not None and self.stream:
            raise ValueError("logprob_start_len: prompt log-probabilities are not streamed; drop stream or set -1")
        return self

    @property
    def prompt_logprobs_from(self) -> int | None:
        """The first prompt position whose log-probability is returned (``return_logprob`` with
        ``logprob_start_len >= 0``, SGLang's rule), else None."""
        if self.return_logprob and self.logprob_start_len is not None and self.logprob_start_len >= 0:
            return self.logprob_start_len
        return None

    @property
    def is_batch(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, list)
        return bool(self.input_ids) and isinstance(self.input_ids[0], list)

    @property
    def n(self) -> int:
        p = self.sampling_params
        if isinstance(p, list):
            return (p[0].n or 1) if p else 1
        return (p.n or 1) if p is not None else 1


# ----------------------------------------------------------------------------------------------
# Admin
# ----------------------------------------------------------------------------------------------
class ProfileRequest(Body):
    """``output_dir``: relative to the server's profile root, and refused outside it (:mod:`serve.routes.admin`)."""

    output_dir: str | None = None
    num_steps: int | None = Field(None, ge=0)


class AbortRequest(Body):
    rid: str = ""
    abort_all: bool = False
