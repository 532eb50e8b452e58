"""OpenAI's ``/v1/completions`` and ``/v1/chat/completions`` bodies.

Features the engine does not implement yet (log probabilities, penalties, ``logit_bias``) are checked for type and
range here and turned into the engine's names by :meth:`OpenAICommon.sampling_dict`; :mod:`serve.features` then
passes them on or answers 400 naming the body's field. Extensions (SGLang / vLLM names): ``top_k``,
``ignore_eos``, ``stop_token_ids``, ``skip_special_tokens``, ``repetition_penalty``, ``min_tokens``, and this
server's ``stream_provisional``.

Fields that clients send routinely and that cannot change an answer (``metadata``, ``user``, ``store``,
``service_tier``, ``parallel_tool_calls``) are accepted and ignored (:data:`IGNORED_FIELDS`); those that would
change its meaning and are not implemented (``tools``, ``tool_choice``, ``functions``, ``function_call``,
non-text content parts, a streamed ``echo`` with ``logprobs``) are a 400 naming the field, never silently dropped.

Structured output: ``response_format`` ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema":
{"name", "schema", "strict"}}``, or SGLang's ``json_schema`` / ``regex`` / ``ebnf`` (one of them); the engine makes
the answer valid by construction and a schema it cannot compile is a 400 naming the field and the reason.

``echo`` with ``logprobs`` on ``/v1/completions`` returns the prompt tokens' log-probabilities first (the first
token's null), then the generated tokens' (lm-eval's loglikelihood and multiple-choice tasks read them), and
``max_tokens: 0`` with ``echo`` scores the prompt without generating (OpenAI's legacy scoring call).
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from serve.schemas.common import (MAX_N, MAX_NEW_TOKENS_LIMIT, MAX_TOP_LOGPROBS, Body, PenaltyFields, StopFields,
                                  _Strict, check_token_list, first_error, neutral_only)
from serve.schemas.router_fields import ChatRouterFields, CompletionRouterFields, present

# Accepted for compatibility, no effect here (the routes log each once per process)
IGNORED_FIELDS = ("metadata", "user", "store", "service_tier", "parallel_tool_calls")


class StreamOptions(_Strict):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class OpenAICommon(StopFields, PenaltyFields, Body):
    """Fields both OpenAI endpoints share."""

    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(None, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = Field(None, ge=0, lt=2 ** 32)
    # accepted and ignored (IGNORED_FIELDS)
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # SGLang / vLLM extensions
    top_k: int | None = Field(None, ge=-1)
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    min_tokens: int | None = Field(None, ge=0, le=MAX_NEW_TOKENS_LIMIT)
    # this server's extension: the block being denoised, after every step (see serve/README.md)
    stream_provisional: bool = False
    # structured output: OpenAI's response_format, or SGLang's names (one of them in all)
    response_format: Any = None
    json_schema: Any = None
    regex: str | None = None
    ebnf: str | None = None

    @model_validator(mode="after")
    def _provisional_needs_stream(self):
        if self.stream_provisional and not self.stream:
            raise ValueError("stream_provisional: needs stream: true")
        return self

    @model_validator(mode="after")
    def _one_grammar(self):
        given = [name for name in ("response_format", "json_schema", "regex", "ebnf")
                 if getattr(self, name) is not None and not (name == "response_format" and self.grammar()[0] is None)]
        if len(given) > 1:
            raise ValueError(f"{given[1]}: only one of response_format, json_schema, regex and ebnf may be given")
        return self

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, v):
        response_format_grammar(v)  # (a ValueError naming the field)
        return v

    def grammar(self) -> tuple[str | None, Any, str]:
        """(the engine's grammar field or None, its value, the body field that gave it)."""
        kind, value, field = response_format_grammar(self.response_format)
        if kind is not None:
            return kind, value, field
        for name in ("json_schema", "regex", "ebnf"):
            if getattr(self, name) is not None:
                return name, getattr(self, name), name
        return None, None, ""

    def grammar_renames(self) -> dict[str, str]:
        """Engine field name -> body field name of the request's grammar (errors name what the client sent)."""
        kind, _, field = self.grammar()
        return {f"sampling_params.{kind}": field} if kind else {}

    router_kind: ClassVar[str] = ""  # its SGLang router fields (serve.schemas.router_fields): chat, completion

    def ignored_fields(self) -> list[str]:
        """The ignored fields this request set (to anything but null), SGLang's router's included."""
        return [name for name in IGNORED_FIELDS if getattr(self, name, None) is not None] + \
            (present(self, self.router_kind) if self.router_kind else [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    @property
    def num_choices(self) -> int:
        return self.n or 1

    def logprob_request(self) -> tuple[bool | None, int | None]:
        """(return_logprob, top_logprobs_num) in the engine's terms."""
        return None, None

    def sampling_dict(self, max_new_tokens: int | None) -> dict:
        """The engine's sampling params (its names), gated fields included as given."""
        # an unset temperature / top_p / top_k is left to the engine: the model's generation_config.json, else
        # greedy (as vLLM and SGLang serve a model's own defaults, not OpenAI's temperature 1)
        out: dict[str, Any] = {}
        if max_new_tokens is not None:
            out["max_new_tokens"] = max_new_tokens
        for name in ("temperature", "top_p", "top_k", "stop", "seed", "ignore_eos", "skip_special_tokens",
                     "stop_token_ids", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        if self.min_tokens is not None:
            out["min_new_tokens"] = self.min_tokens
        if out.get("seed") is None and getattr(self, "sampling_seed", None) is not None:
            out["seed"] = self.sampling_seed  # SGLang's router's name of the seed
        ret, top = self.logprob_request()
        if ret is not None:
            out["return_logprob"] = ret
        if top is not None:
            out["top_logprobs_num"] = top
        kind, value, _ = self.grammar()
        if kind is not None:
            out[kind] = value
        return out


def response_format_grammar(v: Any) -> tuple[str | None, Any, str]:
    """OpenAI's ``response_format`` -> (the engine's grammar field or None, its value, the body field naming it):
    ``text`` none, ``json_object`` any JSON object, ``json_schema`` its ``schema`` (any JSON value without one).
    Anything else is a ValueError naming the field."""
    if v is None:
        return None, None, ""
    if not isinstance(v, dict) or not isinstance(v.get("type"), str):
        raise ValueError('response_format: must be an object with a "type" (text, json_object or json_schema)')
    kind = v["type"]
    extra = sorted(set(v) - {"type", "json_schema"})
    if extra or (kind != "json_schema" and "json_schema" in v):
        raise ValueError(f"response_format: unknown key(s) {extra or ['json_schema']} for type {kind!r}")
    if kind == "text":
        return None, None, ""
    if kind == "json_object":
        return "json_schema", json.dumps({"type": "object"}), "response_format"
    if kind != "json_schema":
        raise ValueError(f"response_format.type: must be text, json_object or json_schema, got {kind!r}")
    spec = v.get("json_schema")
    if not isinstance(spec, dict):
        raise ValueError('response_format.json_schema: must be an object {"name", "schema", "strict"}')
    unknown = sorted(set(spec) - {"name", "schema", "strict", "description"})
    if unknown:
        raise ValueError(f"response_format.json_schema: unknown key(s) {unknown}")
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise ValueError("response_format.json_schema.name: must be a non-empty string")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise ValueError("response_format.json_schema.strict: must be true or false")
    schema = spec.get("schema", {})
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"response_format.json_schema.schema: must be a JSON schema object, got "
                         f"{type(schema).__name__}")
    return "json_schema", json.dumps(schema), "response_format.json_schema.schema"


# Engine field names -> OpenAI body field names (for errors the engine raises on OpenAI requests).
# Every other sampling parameter has the same name in the body (``sampling_params.logit_bias.5000`` is
# ``logit_bias.5000``): the empty name drops the prefix (serve.errors.bad_request).
OPENAI_FIELD_NAMES = {"sampling_params.max_new_tokens": "max_tokens", "sampling_params.min_new_tokens": "min_tokens",
                      "sampling_params.return_logprob": "logprobs", "sampling_params.top_logprobs_num": "logprobs",
                      "sampling_params": ""}
CHAT_FIELD_NAMES = {**OPENAI_FIELD_NAMES, "sampling_params.top_logprobs_num": "top_logprobs"}


class CompletionRequest(CompletionRouterFields, OpenAICommon):
    router_kind: ClassVar[str] = "completion"
    prompt_text = (("prompt",), ("prompt", int))

    prompt: Any
    max_tokens: int | None = Field(16, ge=0, le=MAX_NEW_TOKENS_LIMIT)  # 0: only with echo (score the prompt)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("best_of", "suffix")
    @classmethod
    def _unsupported(cls, v, info):
        return neutral_only(v, info.field_name)

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, str):
            return v
        if isinstance(v, list) and v:
            if all(isinstance(p, str) for p in v):
                return v
            if all(isinstance(p, list) for p in v):
                return [check_token_list(p, f"prompt[{i}]") for i, p in enumerate(v)]
            return check_token_list(v, "prompt")
        raise ValueError("prompt: must be a string, a list of strings, a list of token ids or a list of such lists")

    @model_validator(mode="after")
    def _echo_logprobs(self):
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 generates nothing; it is only accepted with echo: true (scoring the "
                             "prompt, with logprobs for its log-probabilities)")
        if self.stream and self.echo and (self.logprobs is not None or self.max_tokens == 0):
            raise ValueError("stream: echo with logprobs or with max_tokens 0 (prompt scoring) is not streamed; send "
                             "it with stream: false")
        return self

    @property
    def prompt_logprobs(self) -> bool:
        """Whether each choice's ``logprobs`` starts with the prompt tokens' (``echo`` with ``logprobs``)."""
        return self.echo and self.logprobs is not None

    def logprob_request(self):
        # OpenAI's completions: logprobs = k returns the chosen token's and the k most likely tokens' logprobs
        return (None, None) if self.logprobs is None else (True, self.logprobs)

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


class ImageURL(_Strict):
    url: str
    detail: Literal["auto", "low", "high"] | None = None  # accepted; an image is read at the processor's budget

    @field_validator("url")
    @classmethod
    def _data_url(cls, v):
        if v[:8].lower().startswith(("http://", "https://")):
            raise ValueError("http(s) URLs are not fetched (the server fetches nothing); send the image as a data "
                             "URL (data:image/png;base64,...)")
        if not v[:11].lower().startswith("data:image/"):
            raise ValueError("must be a data URL (data:image/<type>;base64,<data>)")
        return v


class ImagePart(_Strict):
    """An ``image_url`` part: a data URL (``data:image/png;base64,...``); http(s) URLs are refused, the server
    fetches nothing. The chat template sees the model's image token in its place."""

    type: Literal["image_url"]
    image_url: ImageURL


def _content_part(part: Any, i: int):
    kind = part.get("type") if isinstance(part, dict) else None
    if isinstance(kind, str) and kind not in ("text", "image_url"):
        raise ValueError(f"content[{i}].type: {kind!r} parts are not supported (text and image_url parts are: "
                         f"{{\"type\": \"text\", \"text\": ...}}, {{\"type\": \"image_url\", \"image_url\": "
                         f"{{\"url\": \"data:image/...\"}}}})")
    try:
        if kind == "image_url":
            return ImagePart.model_validate(part)
        return ContentPart.model_validate(part).text
    except ValidationError as e:
        raise ValueError(first_error(e, f"content[{i}]").lstrip(".")) from None


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
            parts = [_content_part(part, i) for i, part in enumerate(v)]
            # text only: one string; with images: the parts (rendered by ChatCompletionRequest.chat_messages)
            return parts if any(isinstance(p, ImagePart) for p in parts) else "".join(parts)
        raise ValueError("content: must be a string or a list of text parts")


class ChatCompletionRequest(ChatRouterFields, OpenAICommon):
    router_kind: ClassVar[str] = "chat"
    prompt_text = (("messages", int, "content"), ("messages", int, "content", int, "text"))

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS_LIMIT)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS_LIMIT)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # not implemented: only the values that mean "none of it" (else a 400 naming the field)
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None  # accepted and ignored: there are no tools

    @field_validator("tools", "functions")
    @classmethod
    def _no_tools(cls, v, info):
        if v is None or (isinstance(v, list) and not v):
            return v
        raise ValueError(f"{info.field_name}: tool and function calling is not supported by this server (only [] or "
                         f"null)")

    @field_validator("tool_choice", "function_call")
    @classmethod
    def _no_tool_choice(cls, v, info):
        if v is None or v == "none":
            return v
        raise ValueError(f"{info.field_name}: tool and function calling is not supported by this server (only "
                         f"\"none\" or null)")

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs: true")
        return self

    def logprob_request(self):
        if not self.logprobs:
            return (None, None) if self.logprobs is None else (False, None)
        return True, self.top_logprobs or 0

    def chat_messages(self, image_token: str | None = None) -> list[dict]:
        """The messages for the chat template, each ``image_url`` part as ``image_token`` (the model's image token's
        text) in its place."""
        out = []
        for m in self.messages:
            content = m.content
            if isinstance(content, list):
                content = "".join(p if isinstance(p, str) else image_token for p in content)
            out.append({"role": "system" if m.role == "developer" else m.role, "content": content})
        return out

    def image_urls(self) -> list[tuple[str, str]]:
        """``(field, data URL)`` of every ``image_url`` part, in order."""
        return [(f"messages[{k}].content[{i}].image_url", p.image_url.url) for k, m in enumerate(self.messages)
                if isinstance(m.content, list) for i, p in enumerate(m.content) if isinstance(p, ImagePart)]
