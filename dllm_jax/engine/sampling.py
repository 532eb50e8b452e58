"""Per-request sampling parameters (SGLang's names), validated on the way in.

Bad values are a ``ValueError`` naming the field, raised before the request reaches the scheduler, so one bad
request never disturbs the others.

Log probabilities and penalties (issue 18) are per-request fields here; the device applies them only in the step
variants compiled for them (:mod:`dllm_jax.decode.penalties`, :mod:`dllm_jax.decode.logprobs`), so a batch that
uses neither runs the plain step.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

# the fixed widths of the device's logit-bias and min-new-tokens stop tables (OpenAI's limit of 300 biases)
from dllm_jax.decode.rows import MAX_LOGIT_BIAS, MAX_MIN_NEW_STOP_IDS, MAX_TOP_LOGPROBS, is_sampled  # noqa: F401

GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf")
MAX_GRAMMAR_CHARS = 1 << 20  # a schema / regex / grammar's text
MAX_NEW_TOKENS_LIMIT = 1 << 20  # anything larger is a mistake, not a request
MAX_STOP_STRINGS = 16  # host-side stop strings per request (each commit searches the text for every one)
MAX_STOP_TOKEN_IDS = 1024  # stop token ids per request
INT32_MAX = 2 ** 31 - 1  # top_k, token ids and counts travel to the device as int32
# Logits are divided by the temperature in float32 (XLA may multiply by its reciprocal, which must stay a normal
# float32: past ~8.5e37 it flushes to zero and a masked -inf logit becomes NaN). Beyond 1e6 a draw is uniform to
# within float32 rounding anyway, so larger values are refused rather than silently equal to it.
MAX_TEMPERATURE = 1e6
# A repetition penalty divides positive logits: below this, float32 logits overflow to inf (NaN probabilities).
MIN_REPETITION_PENALTY = 1e-6
# SGLang's rule: a temperature below this samples as greedy (dividing logits by it would overflow float32)
SAMPLING_EPS = 1e-6
# top_p travels as float32; a smaller p keeps only the most likely token exactly as any p <= 1 / vocab does, so
# it is raised to this (which float32 holds) rather than rounding to 0, which would keep no token at all
MIN_TOP_P = 1e-9


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    seed: int | None = None
    # Log probabilities of the output tokens (meta_info.output_token_logprobs / output_top_logprobs).
    return_logprob: bool = False
    top_logprobs_num: int = 0
    # Penalties and biases, applied to the logits on the device (dllm_jax.decode.penalties has the formulas).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), sorted by id
    # Structured output (SGLang's names, one at a time): the answer is valid by construction (engine/grammar.py).
    json_schema: str | None = None  # a JSON schema, as JSON text
    regex: str | None = None
    ebnf: str | None = None

    @property
    def greedy(self) -> bool:
        return not is_sampled(self.temperature, self.top_k)

    @property
    def penalized(self) -> bool:
        """Whether any penalty or bias differs from its neutral value (the row then needs the penalty variant)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.min_new_tokens or self.logit_bias)

    @property
    def grammar(self) -> tuple[str, str] | None:
        """(field name, text) of the request's grammar, or None."""
        for name in GRAMMAR_FIELDS:
            if getattr(self, name) is not None:
                return name, getattr(self, name)
        return None

    @property
    def logprobs(self) -> int:
        """-1: no log probabilities; 0: the output tokens' only; k > 0: also the top k alternatives."""
        return self.top_logprobs_num if self.return_logprob else -1

    @classmethod
    def from_dict(cls, params: dict[str, Any] | None, *, vocab_size: int | None = None,
                  field_prefix: str = "sampling_params") -> "SamplingParams":
        if params is None:
            return cls()
        if isinstance(params, SamplingParams):
            return params
        if not isinstance(params, dict):
            raise ValueError(f"{field_prefix}: expected an object, got {type(params).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(params) - names)
        if unknown:
            raise ValueError(f"{field_prefix}: unknown key(s) {unknown}; valid: {sorted(names)}")

        def field(name):
            return f"{field_prefix}.{name}"

        values: dict[str, Any] = {}
        for name, value in params.items():
            if value is None and name != "seed":
                continue  # an explicit null means "default", as in OpenAI clients
            values[name] = value
        out = {}
        if "max_new_tokens" in values:
            v = values["max_new_tokens"]
            if not _is_int(v) or v < 1:
                raise ValueError(f"{field('max_new_tokens')}: must be an integer >= 1, got {v!r}")
            if v > MAX_NEW_TOKENS_LIMIT:
                raise ValueError(f"{field('max_new_tokens')}: {v} is absurdly large (limit {MAX_NEW_TOKENS_LIMIT})")
            out["max_new_tokens"] = int(v)
        if "temperature" in values:
            v = values["temperature"]
            if not _is_number(v) or not 0 <= v <= MAX_TEMPERATURE:
                raise ValueError(f"{field('temperature')}: must be a number in [0, {MAX_TEMPERATURE:g}], got {v!r}")
            out["temperature"] = float(v) if v >= SAMPLING_EPS else 0.0
        if "top_p" in values:
            v = values["top_p"]
            if not _is_number(v) or not 0 < v <= 1:
                raise ValueError(f"{field('top_p')}: must be in (0, 1], got {v!r}")
            out["top_p"] = max(float(v), MIN_TOP_P)
        if "top_k" in values:
            v = values["top_k"]
            if not _is_int(v) or (v < 1 and v not in (-1, 0)) or v > INT32_MAX:
                raise ValueError(f"{field('top_k')}: must be -1 / 0 (off) or an integer from 1 to {INT32_MAX} "
                                 f"(a k at or above the vocabulary size keeps every token), got {v!r}")
            out["top_k"] = int(v)
        if "stop" in values:
            v = values["stop"]
            v = [v] if isinstance(v, str) else v
            if not isinstance(v, (list, tuple)) or not all(isinstance(s, str) and s for s in v):
                raise ValueError(f"{field('stop')}: must be a non-empty string or a list of them, got {v!r}")
            if len(v) > MAX_STOP_STRINGS:
                raise ValueError(f"{field('stop')}: at most {MAX_STOP_STRINGS} stop strings, got {len(v)}")
            for i, s in enumerate(v):
                check_text(s, f"{field('stop')}[{i}]")
            out["stop"] = tuple(v)
        if "stop_token_ids" in values:
            v = values["stop_token_ids"]
            if not isinstance(v, (list, tuple)) or not all(_is_int(t) for t in v):
                raise ValueError(f"{field('stop_token_ids')}: must be a list of integers, got {v!r}")
            if len(v) > MAX_STOP_TOKEN_IDS:
                raise ValueError(f"{field('stop_token_ids')}: at most {MAX_STOP_TOKEN_IDS} ids, got {len(v)}")
            for t in v:
                if t < 0 or (vocab_size is not None and t >= vocab_size):
                    raise ValueError(f"{field('stop_token_ids')}: token id {t} is outside the vocabulary")
            out["stop_token_ids"] = tuple(int(t) for t in v)
        for name in ("ignore_eos", "skip_special_tokens"):
            if name in values:
                if not isinstance(values[name], bool):
                    raise ValueError(f"{field(name)}: must be true or false, got {values[name]!r}")
                out[name] = values[name]
        if "seed" in values and values["seed"] is not None:
            v = values["seed"]
            if not _is_int(v) or v < 0 or v >= 2 ** 32:
                raise ValueError(f"{field('seed')}: must be an integer in [0, 2^32), got {v!r}")
            out["seed"] = int(v)
        _logprob_fields(values, out, field)
        _grammar_fields(values, out, field)
        _penalty_fields(values, out, field, vocab_size)
        if out.get("min_new_tokens", 0) > out.get("max_new_tokens", cls.max_new_tokens):
            raise ValueError(f"{field('min_new_tokens')}: {out['min_new_tokens']} exceeds max_new_tokens "
                             f"{out.get('max_new_tokens', cls.max_new_tokens)}")
        return cls(**out)


def _grammar_fields(values: dict, out: dict, field) -> None:
    """``json_schema`` (a string of JSON, or the schema object itself), ``regex``, ``ebnf``: at most one; compiled
    (and refused with the grammar engine's reason) when the request is made."""
    given = [name for name in GRAMMAR_FIELDS if name in values]
    for name in given:
        v = values[name]
        if name == "json_schema" and isinstance(v, (dict, bool)):
            v = json.dumps(v)
        if not isinstance(v, str) or not v.strip():
            raise ValueError(f"{field(name)}: must be a non-empty string, got {v!r}")
        if len(v) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"{field(name)}: at most {MAX_GRAMMAR_CHARS} characters, got {len(v)}")
        out[name] = check_text(v, field(name))
    if len(given) > 1:
        raise ValueError(f"{field(given[1])}: only one of json_schema, regex and ebnf may be given, got {given}")
    if given and values.get("ignore_eos"):
        raise ValueError(f"{field('ignore_eos')}: cannot be combined with {given[0]} (a constrained answer ends "
                         f"where its grammar accepts)")


def _logprob_fields(values: dict, out: dict, field) -> None:
    if "return_logprob" in values:
        if not isinstance(values["return_logprob"], bool):
            raise ValueError(f"{field('return_logprob')}: must be true or false, got {values['return_logprob']!r}")
        out["return_logprob"] = values["return_logprob"]
    if "top_logprobs_num" in values:
        v = values["top_logprobs_num"]
        if not _is_int(v) or not 0 <= v <= MAX_TOP_LOGPROBS:
            raise ValueError(f"{field('top_logprobs_num')}: must be an integer in [0, {MAX_TOP_LOGPROBS}], got {v!r}")
        out["top_logprobs_num"] = int(v)


def _penalty_fields(values: dict, out: dict, field, vocab_size: int | None) -> None:
    """Ranges as OpenAI / SGLang document them: presence and frequency in [-2, 2], repetition in (0, 2], a bias in
    [-100, 100] for at most 300 token ids, min_new_tokens >= 0 (and <= max_new_tokens, checked by the caller)."""
    for name in ("presence_penalty", "frequency_penalty"):
        if name in values:
            v = values[name]
            if not _is_number(v) or not -2 <= v <= 2:
                raise ValueError(f"{field(name)}: must be a number in [-2, 2], got {v!r}")
            out[name] = float(v)
    if "repetition_penalty" in values:
        v = values["repetition_penalty"]
        if not _is_number(v) or not MIN_REPETITION_PENALTY <= v <= 2:
            raise ValueError(f"{field('repetition_penalty')}: must be a number in (0, 2] (at least "
                             f"{MIN_REPETITION_PENALTY:g}: smaller ones overflow float32 logits), got {v!r}")
        out["repetition_penalty"] = float(v)
    if "min_new_tokens" in values:
        v = values["min_new_tokens"]
        if not _is_int(v) or not 0 <= v <= MAX_NEW_TOKENS_LIMIT:
            raise ValueError(f"{field('min_new_tokens')}: must be an integer >= 0, got {v!r}")
        out["min_new_tokens"] = int(v)
    if "logit_bias" in values:
        out["logit_bias"] = _logit_bias(values["logit_bias"], field("logit_bias"), vocab_size)
    if out.get("min_new_tokens"):
        stops = set(out.get("stop_token_ids", ()))
        if len(stops) > MAX_MIN_NEW_STOP_IDS - 8:  # room for the model's EOS ids
            raise ValueError(f"{field('stop_token_ids')}: at most {MAX_MIN_NEW_STOP_IDS - 8} stop token ids with "
                             f"min_new_tokens, got {len(stops)}")


def _logit_bias(v, name: str, vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    """``{token id: bias}`` (keys ints or decimal strings, as JSON sends them) -> sorted ``((id, bias), ...)``."""
    if isinstance(v, (list, tuple)):
        try:
            v = dict(v)
        except (TypeError, ValueError):
            raise ValueError(f"{name}: must be an object {{token id: bias}}") from None
    if not isinstance(v, dict):
        raise ValueError(f"{name}: must be an object {{token id: bias}}, got {type(v).__name__}")
    if len(v) > MAX_LOGIT_BIAS:
        raise ValueError(f"{name}: at most {MAX_LOGIT_BIAS} entries, got {len(v)}")
    out: dict[int, float] = {}
    for key, bias in v.items():
        if _is_int(key):
            tid = int(key)
        elif isinstance(key, str) and key.isdecimal() and len(key) <= 9:
            tid = int(key)
        else:
            raise ValueError(f"{name}: keys must be token ids, got {key!r}")
        if vocab_size is not None and not 0 <= tid < vocab_size:
            raise ValueError(f"{name}.{key}: token id {tid} is outside the vocabulary [0, {vocab_size})")
        if tid < 0:
            raise ValueError(f"{name}.{key}: token id {tid} is negative")
        if not _is_number(bias) or not -100 <= bias <= 100:
            raise ValueError(f"{name}.{key}: a bias must be a number in [-100, 100], got {bias!r}")
        if tid in out:
            raise ValueError(f"{name}.{key}: token id {tid} appears twice")
        out[tid] = float(bias)
    return tuple(sorted(out.items()))


def check_text(text: str, field: str, *, allow_nul: bool = False) -> str:
    """``text`` if it can travel as UTF-8 (to the tokenizer, into JSON): a lone surrogate (``"\\ud800"``, which
    JSON can spell) is a ValueError naming the field, not a crash later in the tokenizer or the response; so is a
    NUL unless ``allow_nul`` (a prompt may hold one; an id or a stop string has no use for it)."""
    if not allow_nul and "\x00" in text:
        raise ValueError(f"{field}: contains a NUL character")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{field}: not valid Unicode text ({e.reason} at character {e.start})") from None
    return text


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
