"""What every request body shares: strict models, field paths in messages, stop fields, sampling extensions.

Every model is strict (no silent coercion: ``"1"`` is not a number, ``1`` is not ``true``), rejects NaN and
infinities and forbids unknown keys, so a typo (``max_token``) is a 400 naming the field instead of a silently
different answer. Every request body (:class:`Body`) first checks all of its text, keys included, once: a lone
surrogate (which JSON can spell, ``"\\ud800"``, but UTF-8 cannot carry to the tokenizer or back into a response)
is a 400 naming the field, and so is a NUL anywhere but in prompt text. Validators that check a field themselves
start their message with the field's path (``sampling_params[1].top_p: ...``);
:func:`serve.errors.error_from_validation` turns that into the error's ``param``.
"""

from __future__ import annotations

import collections
import re
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

MAX_NEW_TOKENS_LIMIT = 1 << 20
MAX_STOP_STRINGS = 16
MAX_N = 128  # choices per prompt (OpenAI's limit); the server's capacity bounds prompts x n as well
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # entries (OpenAI's limit)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


# A loc pattern of prompt text: keys and list positions (``int`` matches any position).
TextPath = tuple


class Body(_Strict):
    """A request body: its text is checked before its fields (:func:`check_body_text`). ``prompt_text`` lists
    where a NUL is prompt content (the tokenizer's business: :meth:`serve.state.Server.tokenize_all`)."""

    prompt_text: ClassVar[tuple[TextPath, ...]] = ()

    @model_validator(mode="before")
    @classmethod
    def _body_text(cls, data):  # (a name no body's own validator uses: it would replace this one)
        check_body_text(data, cls.prompt_text)
        return data


_NO_TEXT = frozenset({int, float, bool, type(None)})  # JSON scalars other than strings
_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_OR_NUL = re.compile("[\x00\ud800-\udfff]")


def check_body_text(data: Any, prompt_text: tuple[TextPath, ...] = ()) -> None:
    """Every string of a parsed JSON body, keys included, can travel as UTF-8 and holds no NUL (except at the
    ``prompt_text`` paths); else a validation error whose ``param`` is the field's path. Iterative: a body nested
    as deep as the JSON parser allows cannot exhaust the stack here."""
    if not isinstance(data, dict):
        return  # not an object: the model refuses it as such
    todo: collections.deque[tuple[Any, tuple]] = collections.deque([(data, ())])  # in the body's order
    while todo:
        value, loc = todo.popleft()
        if isinstance(value, str):
            if value.isascii() and "\x00" not in value:  # the common case, at C speed
                continue
            bad = _SURROGATE if _matches(loc, prompt_text) else _SURROGATE_OR_NUL
            m = bad.search(value)
            if m is not None:
                _refuse(loc, m, "text")
        elif isinstance(value, dict):
            for key, item in value.items():
                m = _SURROGATE_OR_NUL.search(key)
                if m is not None:
                    _refuse(loc + (key,), m, "key")
                todo.append((item, loc + (key,)))
        elif isinstance(value, list) and not _NO_TEXT.issuperset(map(type, value)):  # (token ids: at C speed)
            todo.extend((item, loc + (i,)) for i, item in enumerate(value))


def _matches(loc: tuple, patterns: tuple[TextPath, ...]) -> bool:
    return any(len(loc) == len(p) and all(part == want or (want is int and isinstance(part, int))
                                          for part, want in zip(loc, p)) for p in patterns)


def _refuse(loc: tuple, m: re.Match, what: str) -> None:
    if m.group() == "\x00":
        reason = f"the {what} contains a NUL character (at {m.start()})"
    else:
        reason = f"the {what} is not valid Unicode: a lone surrogate U+{ord(m.group()):04X} at {m.start()}"
    raise PydanticCustomError("invalid_text", "{param}: {reason}", {"param": text_path(loc), "reason": reason})


def text_path(loc: tuple) -> str:
    """``format_loc`` for client-chosen keys, a NUL or a lone surrogate in one shown as ``\\uXXXX``."""
    return format_loc(_SURROGATE_OR_NUL.sub(lambda m: f"\\u{ord(m.group()):04x}", k) if isinstance(k, str) else k
                      for k in loc).lstrip(".")


def first_error(err: ValidationError, prefix: str) -> str:
    e = err.errors(include_url=False)[0]
    path = prefix + format_loc(e["loc"])
    return f"{path}: {clean_msg(e['msg'])}"


def clean_msg(msg: str) -> str:
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


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_token_list(v, field: str) -> list[int]:
    if not isinstance(v, list) or not all(is_int(t) for t in v):
        raise ValueError(f"{field}: must be a list of integer token ids")
    for i, t in enumerate(v):
        if t < 0:
            raise ValueError(f"{field}[{i}]: token id {t} is negative")
    return v


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
_NEUTRAL = {"best_of": (1,), "suffix": ("",)}


def neutral_only(v, name: str):
    if v is None:
        return v
    if not any(v == ok and type(v) is type(ok) for ok in _NEUTRAL[name]):
        raise ValueError(f"{name}: not supported by this server (only {_NEUTRAL[name][0]!r} or null)")
    return v


def check_logit_bias(v, field: str = "logit_bias"):
    """``{"token id": bias}``, bias in [-100, 100] (OpenAI's form; the vocabulary is checked by the engine)."""
    if v is None:
        return v
    if len(v) > MAX_LOGIT_BIAS:
        raise ValueError(f"{field}: at most {MAX_LOGIT_BIAS} entries, got {len(v)}")
    for key, bias in v.items():
        if not re.fullmatch(r"\d{1,9}", key):
            raise ValueError(f"{field}.{key}: keys must be token ids (decimal strings)")
        if not -100 <= bias <= 100:
            raise ValueError(f"{field}.{key}: a bias must be in [-100, 100], got {bias}")
    return v


class StopFields(_Strict):
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
        return None if v is None else check_token_list(v, "stop_token_ids")


class PenaltyFields(_Strict):
    """Penalties and biases, with their usual ranges. The engine applies them once it implements them
    (:mod:`serve.features`); until then a value other than the neutral one is a 400 naming the field."""

    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=2)
    logit_bias: dict[str, float] | None = None

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        return check_logit_bias(v)
