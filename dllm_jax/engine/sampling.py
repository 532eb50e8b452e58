"""Per-request sampling parameters (SGLang's names), validated on the way in.

Bad values are a ``ValueError`` naming the field, raised before the request reaches the scheduler, so one bad
request never disturbs the others.
"""

from __future__ import annotations

import dataclasses
from typing import Any

MAX_NEW_TOKENS_LIMIT = 1 << 20  # anything larger is a mistake, not a request


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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

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
            if not _is_number(v) or v < 0 or v != v or v == float("inf"):
                raise ValueError(f"{field('temperature')}: must be a finite number >= 0, got {v!r}")
            out["temperature"] = float(v)
        if "top_p" in values:
            v = values["top_p"]
            if not _is_number(v) or not 0 < v <= 1:
                raise ValueError(f"{field('top_p')}: must be in (0, 1], got {v!r}")
            out["top_p"] = float(v)
        if "top_k" in values:
            v = values["top_k"]
            if not _is_int(v) or (v < 1 and v not in (-1, 0)):
                raise ValueError(f"{field('top_k')}: must be -1 / 0 (off) or an integer >= 1, got {v!r}")
            out["top_k"] = int(v)
        if "stop" in values:
            v = values["stop"]
            v = [v] if isinstance(v, str) else v
            if not isinstance(v, (list, tuple)) or not all(isinstance(s, str) and s for s in v):
                raise ValueError(f"{field('stop')}: must be a non-empty string or a list of them, got {v!r}")
            out["stop"] = tuple(v)
        if "stop_token_ids" in values:
            v = values["stop_token_ids"]
            if not isinstance(v, (list, tuple)) or not all(_is_int(t) for t in v):
                raise ValueError(f"{field('stop_token_ids')}: must be a list of integers, got {v!r}")
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
        return cls(**out)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
