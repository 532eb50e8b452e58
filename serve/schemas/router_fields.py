"""The fields SGLang's router (``sglang-router``, SGLang Model Gateway 0.3.x) forwards, accepted by the bodies.

The router parses each request into its own typed structs and sends them on re-serialized, defaults included: a
``/generate`` it forwards carries ``model: null``, ``log_metrics: true``, ``return_hidden_states: false``, ...;
a chat request carries ``model: "unknown"`` when the client gave none, ``no_stop_trim``, ``separate_reasoning``,
``continue_final_message``, ...; and any field a client sets that the router knows (``rid``, ``lora_path``,
``bootstrap_host``, ``sampling_seed``, ...) is passed through. The lists below are those structs' fields
(``src/protocols/{generate,chat,completion,sampling_params}.rs``) beyond what the bodies already accept, and
``tests/test_router_compat.py`` sends every one of them.

Each field is one of:

* **ignored** (:data:`IGNORED`): meaningless here whatever its value (metrics and logging switches, routing hints,
  prefill/decode disaggregation's bootstrap address, a data-parallel rank: one engine serves each worker);
  accepted and dropped, logged once per field name (at info), as the harmless OpenAI fields are.
* **neutral only** (:data:`NEUTRAL`): a feature this server does not have (hidden states, LoRA, constrained
  decoding, ``no_stop_trim: true``, ...): accepted at the value that means "none of it" (``false``, ``0``, null:
  what the router fills in) and dropped like the ignored ones; any other value is a 400 naming the field, never
  silently dropped.
* **mapped**: ``sampling_seed`` (the router's name of the sampling seed; SGLang's too) is ``seed``; ``model:
  "unknown"`` (the router's value when the client named no model) is no model; ``rid`` on the OpenAI endpoints
  names the engine requests, so that ``/abort_request`` reaches them.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import create_model, model_validator

from serve.schemas.common import _Strict, is_int

logger = logging.getLogger("dllm_jax.serve")

UNKNOWN_MODEL = "unknown"  # the router's model id for a request that named none

# Meaningless here whatever the value: accepted, dropped, logged once.
IGNORED = {
    "generate": ("log_metrics", "no_logs", "custom_labels", "priority", "routing_key", "extra_key", "conversation_id",
                 "modalities", "max_dynamic_patch", "min_dynamic_patch", "bootstrap_host", "bootstrap_port",
                 "bootstrap_room", "bootstrap_pair_key", "routed_dp_rank", "disagg_prefill_dp_rank",
                 "data_parallel_rank"),
    "chat": ("separate_reasoning", "stream_reasoning", "reasoning_effort", "verbosity", "prompt_cache_key",
             "safety_identifier", "modalities", "return_cached_tokens_details", "extra_key", "cache_salt", "priority",
             "max_dynamic_patch", "min_dynamic_patch", "bootstrap_host", "bootstrap_port", "bootstrap_room",
             "routed_dp_rank", "disagg_prefill_dp_rank", "data_parallel_rank"),
    "completion": ("extra_key", "cache_salt", "priority", "bootstrap_host", "bootstrap_port", "bootstrap_room",
                   "routed_dp_rank", "disagg_prefill_dp_rank", "data_parallel_rank"),
    "sampling": (),
}

_FALSE, _ZERO, _NULL = (False,), (0,), ()
_UNSUPPORTED_GENERATION = {"no_stop_trim": _FALSE, "return_hidden_states": _FALSE, "return_routed_experts": _FALSE,
                           "routed_experts_start_len": _ZERO, "return_prompt_token_ids": _FALSE,
                           "lora_path": _NULL, "session_params": _NULL, "custom_logit_processor": _NULL,
                           "min_p": _ZERO}
# Features this server does not have: accepted at these values (or null) and dropped; anything else is a 400.
NEUTRAL: dict[str, dict[str, tuple]] = {
    "generate": {"return_hidden_states": _FALSE, "return_routed_experts": _FALSE, "routed_experts_start_len": _ZERO,
                 "return_prompt_token_ids": _FALSE, "require_reasoning": _FALSE, "return_bytes": _FALSE,
                 "return_entropy": _FALSE, "background": _FALSE, "return_sampling_mask": _NULL,
                 "input_embeds": _NULL, "video_data": _NULL, "audio_data": _NULL,
                 "lora_path": _NULL, "lora_id": _NULL, "custom_logit_processor": _NULL, "token_ids_logprob": _NULL,
                 "session_params": _NULL},
    "chat": {**_UNSUPPORTED_GENERATION, "continue_final_message": _FALSE, "return_meta_info": _FALSE,
             "chat_template_kwargs": ({},), "input_ids": _NULL, "stop_regex": _NULL, "custom_params": _NULL},
    "completion": {**_UNSUPPORTED_GENERATION},
    "sampling": {"no_stop_trim": _FALSE, "min_p": _ZERO},
}

WHAT = {"no_stop_trim": "the matched stop string is always trimmed", "lora_path": "LoRA adapters are not served",
        "lora_id": "LoRA adapters are not served", "min_p": "min-p sampling is not implemented",
        "continue_final_message": "the chat template always "
        "starts a new assistant turn", "video_data":
        "this server's models read text only", "audio_data": "this server's models read text only"}


def router_field_names(kind: str) -> tuple[str, ...]:
    """Every router field a body of ``kind`` (generate, chat, completion, sampling) accepts and drops."""
    return tuple(IGNORED[kind]) + tuple(NEUTRAL[kind])


def _is_neutral(value: Any, allowed: tuple) -> bool:
    if value is None:
        return True
    for ok in allowed:
        if ok is False or ok == {}:
            if value == ok and type(value) is type(ok):
                return True
        elif ok == 0 and (is_int(value) or isinstance(value, float)) and value == 0:
            return True
    return False


def check_neutral(body: _Strict, kind: str) -> None:
    """A 400 (``ValueError`` naming the field) for a router field set to a feature this server does not have."""
    for name, allowed in NEUTRAL[kind].items():
        value = getattr(body, name, None)
        if not _is_neutral(value, allowed):
            shown = " or ".join(repr(v).lower() if isinstance(v, bool) else repr(v) for v in allowed)
            why = WHAT.get(name)
            raise ValueError(f"{name}: not supported by this server (only {shown + ' or ' if shown else ''}null"
                             + (f": {why}" if why else "") + ")")


def present(body: _Strict, kind: str, prefix: str = "") -> list[str]:
    """The router fields ``body`` set (to anything but null): accepted, and dropped."""
    return [prefix + name for name in router_field_names(kind) if getattr(body, name, None) is not None]


_logged: set[str] = set()


def log_ignored(names: list[str]) -> None:
    """One info line the first time each field name is ignored in this process."""
    new = [name for name in names if name not in _logged]
    if new:
        _logged.update(new)
        logger.info("field(s) %s accepted and ignored (sent by SGLang's router or clients; they do not change an "
                    "answer here; each logged once)", ", ".join(repr(n) for n in new))


def _fields_of(kind: str, base: type = _Strict) -> type:
    """A strict model with every router field of ``kind``, each ``Any`` defaulting to null."""
    return create_model(f"_{kind.capitalize()}Fields", __base__=base,
                        **{name: (Any, None) for name in router_field_names(kind)})


def _check_seed(value, field: str):
    if value is not None and not (is_int(value) and 0 <= value < 2 ** 32):
        raise ValueError(f"{field}: must be an integer in [0, 2^32)")
    return value


class GenerateRouterFields(_fields_of("generate")):
    """The router's ``/generate`` fields (mixed into :class:`serve.schemas.sglang.GenerateRequest`); ``model`` is
    checked by the route (a served name, ``"unknown"`` or null)."""

    model: str | None = None

    @model_validator(mode="after")
    def _router_generate(self):
        check_neutral(self, "generate")
        return self


class SamplingRouterFields(_fields_of("sampling")):
    """The router's sampling parameters beyond SGLang's older set: ``sampling_seed`` (the seed), and neutral-only
    ``no_stop_trim``, ``min_p`` (``json_schema``, ``regex``, ``ebnf`` are real fields of the body)."""

    sampling_seed: Any = None

    @model_validator(mode="after")
    def _router_sampling(self):
        check_neutral(self, "sampling")
        _check_seed(self.sampling_seed, "sampling_seed")
        seed = getattr(self, "seed", None)
        if self.sampling_seed is not None and seed is not None and seed != self.sampling_seed:
            raise ValueError(f"sampling_seed: {self.sampling_seed} differs from seed {seed} (give one of them)")
        return self


class OpenAIRouterFields(_Strict):
    """What chat and completion bodies share: ``sampling_seed`` and ``rid`` (one id, or one per choice)."""

    sampling_seed: Any = None
    rid: Any = None

    @model_validator(mode="after")
    def _router_openai(self):
        _check_seed(self.sampling_seed, "sampling_seed")
        seed = getattr(self, "seed", None)
        if self.sampling_seed is not None and seed is not None and seed != self.sampling_seed:
            raise ValueError(f"sampling_seed: {self.sampling_seed} differs from seed {seed} (give one of them)")
        rid = self.rid
        if not (rid is None or (isinstance(rid, str) and rid)
                or (isinstance(rid, list) and rid and all(isinstance(r, str) and r for r in rid))):
            raise ValueError("rid: must be a non-empty string or a list of them (one per choice)")
        return self

    def engine_rids(self, count: int) -> list[str] | None:
        """The engine request ids of ``count`` choices: a list as given (one per choice), or one id for a single
        choice; several choices of one id are ``rid-0``, ``rid-1``, ..."""
        rid = self.rid
        if rid is None:
            return None
        if isinstance(rid, list):
            if len(rid) != count:
                raise ValueError(f"rid: {len(rid)} ids for {count} choices")
            return list(rid)
        return [rid] if count == 1 else [f"{rid}-{i}" for i in range(count)]


class ChatRouterFields(_fields_of("chat", OpenAIRouterFields)):

    @model_validator(mode="after")
    def _router_chat(self):
        check_neutral(self, "chat")
        return self


class CompletionRouterFields(_fields_of("completion", OpenAIRouterFields)):

    @model_validator(mode="after")
    def _router_completion(self):
        check_neutral(self, "completion")
        return self
