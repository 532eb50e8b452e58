"""Request bodies (pydantic), validated before anything reaches the engine.

Every model is strict (no silent coercion: ``"1"`` is not a number, ``1`` is not ``true``), rejects NaN and
infinities, and forbids unknown keys, so a typo (``max_token``) or a feature this server does not implement
(``logprobs``, ``n > 1``, penalties) is a 400 naming the field instead of a silently different answer.

Fields that take several shapes (``text``: a string or a list of them; ``prompt``; ``stop``;
``sampling_params``: one object or one per prompt) are checked by validators whose messages start with the
field's path (``sampling_params[1].top_p: ...``), which :func:`serve.app.error_from_validation` turns into the
error's ``param``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

MAX_NEW_TOKENS_LIMIT = 1 << 20
MAX_STOP_STRINGS = 16


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


def _first_error(err: ValidationError, prefix: str) -> str:
    e = err.errors(include_url=False)[0]
    path = prefix + format_loc(e["loc"])
    return f"{path}: {_clean_msg(e['msg'])}"


def _clean_msg(msg: str) -> str:
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    if msg == "Extra inputs are not permitted":
        msg = "unknown field"
    return msg


def format_loc(loc) -> str:
    """``('sampling_params', 0, 'top_p')`` -> ``.sampling_params[0].top_p`` (leading dot when non-empty)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}"
    return out


def _check_stop(v: Any, field: str):
    if v is None:
        return None
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise ValueError(f"{field}: must be a non-empty string or a list of non-empty strings")
    if len(items) > MAX_STOP_STRINGS:
        raise ValueError(f"{field}: at most {MAX_STOP_STRINGS} stop strings")
    return v


# The neutral values of OpenAI features this server does not implement: anything else is a 400.
_NEUTRAL = {"presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "logit_bias": ({},), "n": (1,),
            "logprobs": (False,), "best_of": (1,), "suffix": ("",), "top_logprobs": (0,), "tools": ([],)}


def _neutral_only(v, name: str):
    if v is None:
        return v
    if not any(v == ok and type(v) is type(ok) for ok in _NEUTRAL[name]):
        raise ValueError(f"{name}: not supported by this server (only {_NEUTRAL[name][0]!r} or null)")
    return v


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_token_list(v, field: str) -> list[int]:
    if not isinstance(v, list) or not all(_is_int(t) for t in v):
        raise ValueError(f"{field}: must be a list of integer token ids")
    for i, t in enumerate(v):
        if t < 0:
            raise ValueError(f"{field}[{i}]: token id {t} is negative")
    return v


# ----------------------------------------------------------------------------------------------
# SGLang: POST /generate
# ----------------------------------------------------------------------------------------------
class _StopFields(_Strict):
    """Stop strings and stop token ids, validated the same way on every endpoint."""

    stop: Any = None
    stop_token_ids: list[int] | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        return _check_stop(v, "stop")

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v):
        return None if v is None else _check_token_list(v, "stop_token_ids")


class SamplingParamsBody(_StopFields):
    """SGLang's sampling parameters that the engine implements (see ``dllm_jax.engine.sampling``)."""

    max_new_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS_LIMIT)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    seed: int | None = Field(None, ge=0, lt=2 ** 32)

    def engine_dict(self) -> dict:
        return {k: v for k, v in self.model_dump(exclude_none=True).items()}


def _sampling_params(v: Any, field: str = "sampling_params"):
    if v is None:
        return None
    if isinstance(v, list):
        out = []
        for i, item in enumerate(v):
            out.append(_one_sampling_params(item, f"{field}[{i}]"))
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
        msg = _clean_msg(e0["msg"])
        # messages raised by our own validators already start with the key's name
        key = format_loc(e0["loc"])
        if msg.startswith(key.lstrip(".") + ":"):
            msg = msg.split(":", 1)[1].strip()
        raise ValueError(f"{field}{key}: {msg}") from None


class GenerateRequest(_Strict):
    """SGLang's ``GenerateReqInput`` (the parts a text-only block-diffusion server implements)."""

    text: Any = None
    input_ids: Any = None
    sampling_params: Any = None
    stream: bool = False
    rid: Any = None
    return_logprob: bool | None = None

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
            return [_check_token_list(x, f"input_ids[{i}]") for i, x in enumerate(v)]
        return _check_token_list(v, "input_ids")

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

    @field_validator("return_logprob")
    @classmethod
    def _logprob(cls, v):
        if v:
            raise ValueError("return_logprob: log probabilities are not supported by this server")
        return v

    @model_validator(mode="after")
    def _one_input(self):
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("text: give exactly one of text and input_ids")
        return self

    @property
    def is_batch(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, list)
        return bool(self.input_ids) and isinstance(self.input_ids[0], list)


# ----------------------------------------------------------------------------------------------
# OpenAI: /v1/completions and /v1/chat/completions
# ----------------------------------------------------------------------------------------------
class StreamOptions(_Strict):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class _OpenAICommon(_StopFields):
    """Fields both OpenAI endpoints share. Features the engine lacks accept only their neutral value."""

    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = Field(None, ge=0, lt=2 ** 32)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # SGLang / vLLM extensions the engine implements
    top_k: int | None = Field(None, ge=-1)
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None

    @field_validator("presence_penalty", "frequency_penalty", "logit_bias", "n", check_fields=False)
    @classmethod
    def _neutral(cls, v, info):
        return _neutral_only(v, info.field_name)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_dict(self, max_new_tokens: int | None) -> dict:
        out: dict[str, Any] = {"temperature": 1.0 if self.temperature is None else self.temperature}
        if max_new_tokens is not None:
            out["max_new_tokens"] = max_new_tokens
        for name in ("top_p", "top_k", "stop", "seed", "ignore_eos", "skip_special_tokens", "stop_token_ids"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out


# Engine field names -> OpenAI body field names (for errors the engine raises on OpenAI requests).
OPENAI_FIELD_NAMES = {"sampling_params.max_new_tokens": "max_tokens"}


class CompletionRequest(_OpenAICommon):
    prompt: Any
    max_tokens: int | None = Field(16, ge=1, le=MAX_NEW_TOKENS_LIMIT)
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("logprobs", "best_of", "suffix")
    @classmethod
    def _unsupported(cls, v, info):
        return _neutral_only(v, info.field_name)

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, str):
            return v
        if isinstance(v, list) and v:
            if all(isinstance(p, str) for p in v):
                return v
            if all(isinstance(p, list) for p in v):
                return [_check_token_list(p, f"prompt[{i}]") for i, p in enumerate(v)]
            return _check_token_list(v, "prompt")
        raise ValueError("prompt: must be a string, a list of strings, a list of token ids or a list of such lists")

    def prompts(self) -> tuple[list, bool]:
        """(the prompts, each a str or a list of ids; whether the request is a batch)."""
        p = self.prompt
        if isinstance(p, str):
            return [p], False
        if all(isinstance(x, str) for x in p) or all(isinstance(x, list) for x in p):
            return list(p), True
        return [p], False


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Any
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _content(cls, v):
        if isinstance(v, str):
            return v
        if isinstance(v, list):
            parts = []
            for i, part in enumerate(v):
                try:
                    parts.append(ContentPart.model_validate(part).text)
                except ValidationError as e:
                    raise ValueError(_first_error(e, f"content[{i}]").lstrip(".")) from None
            return "".join(parts)
        raise ValueError("content: must be a string or a list of text parts")


class ResponseFormat(_Strict):
    type: Literal["text"]


class ChatCompletionRequest(_OpenAICommon):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS_LIMIT)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS_LIMIT)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict] | None = None
    tool_choice: Literal["none"] | None = None
    parallel_tool_calls: bool | None = None

    @field_validator("logprobs", "top_logprobs", "tools")
    @classmethod
    def _unsupported(cls, v, info):
        return _neutral_only(v, info.field_name)

    def chat_messages(self) -> list[dict]:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.content} for m in self.messages]


# ----------------------------------------------------------------------------------------------
# Admin
# ----------------------------------------------------------------------------------------------
class ProfileRequest(_Strict):
    output_dir: str | None = None
    num_steps: int | None = Field(None, ge=0)


class AbortRequest(_Strict):
    rid: str = ""
    abort_all: bool = False
