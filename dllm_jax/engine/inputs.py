"""What a request may be, checked on the way in: token ids, sampling params over the model's defaults, text, ids,
and the :class:`Request` built from them (``Engine.make_request``). Bad input is a ``ValueError`` naming the field,
raised before the request reaches the scheduler.

:class:`RequestInputs` is a part of :class:`dllm_jax.Engine` (it reads the engine's model config, tokenizer,
defaults and seed generator).
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from typing import Callable

import numpy as np

from dllm_jax.engine.config import SAMPLING_DEFAULTS
from dllm_jax.engine.request import Request
from dllm_jax.engine.sampling import SamplingParams, check_text

MAX_RID_CHARS = 256


class RequestInputs:
    images = None  # the family's image reader (dllm_jax/engine/images.py), None: text only

    def make_request(self, input_ids: list[int], sampling_params: dict | SamplingParams | None = None, *,
                     rid: str | None = None, on_event: Callable | None = None,
                     field: str = "input_ids", provisional: bool = False, stream: bool = False,
                     image_data=None, image_field: str = "image_data") -> Request:
        """Validate one request (ValueError naming the field on bad input) and build it; does not enqueue.
        ``image_data``: the prompt's images (one or a list; :mod:`dllm_jax.engine.images`), each where the prompt
        has an image token."""
        params = self._sampling_params(sampling_params)
        for name, neutral in self.capabilities.refused_params:  # what this family's decoding cannot apply
            if getattr(params, name) != neutral:
                raise ValueError(f"{name}: {self.capabilities.refusal_reason}")
        # (The checks run at C speed over the ids first, as a prompt may hold thousands; the slow path names the
        # offending one.)
        if not isinstance(input_ids, (list, tuple)) or (
                set(map(type, input_ids)) - {int} and not all(_is_int(t) for t in input_ids)):
            raise ValueError(f"{field}: must be a list of integer token ids")
        vocab = self.config.vocab_size
        if input_ids and not (min(input_ids) >= 0 and max(input_ids) < vocab):
            i, t = next((i, t) for i, t in enumerate(input_ids) if not 0 <= t < vocab)
            raise ValueError(f"{field}[{i}]: token id {t} is outside the vocabulary [0, {vocab})")
        images, spans, keys = (), (), None
        if image_data is not None and not (isinstance(image_data, (list, tuple)) and not image_data):
            reader = getattr(self, "images", None)
            if reader is None:
                raise ValueError(f"{image_field}: this model reads text only (no vision tower: "
                                 f"{self.config.architecture})")
            from dllm_jax.engine.images import cache_keys

            images = tuple(reader.prepare(image_data, image_field))
            input_ids, spans = reader.expand(list(map(int, input_ids)), list(images), image_field)
            keys = cache_keys(input_ids, images, spans)
        first_block_end = (len(input_ids) // self.block_size + 1) * self.block_size
        if first_block_end > self.context_length:
            raise ValueError(f"{field}: the prompt has {len(input_ids)} tokens; with a block of {self.block_size} it "
                             f"does not fit the context length {self.context_length}")
        if params.stop and self.tokenizer is None:
            raise ValueError("sampling_params.stop: stop strings need a tokenizer; this model has none")
        if rid is not None:
            if not isinstance(rid, str) or not rid or len(rid) > MAX_RID_CHARS:
                raise ValueError(f"rid: must be a non-empty string of at most {MAX_RID_CHARS} characters")
            check_text(rid, "rid")
        grammar = self.compile_grammar(params) if params.grammar is not None else None
        seed = params.seed if params.seed is not None else int(self._rng.integers(0, 2 ** 32))
        return Request(rid=rid or uuid.uuid4().hex, prompt_ids=list(map(int, input_ids)), params=params,
                       seed=seed, on_event=on_event, provisional=provisional, stream=stream or provisional,
                       grammar=grammar, images=images, image_spans=spans, prompt_keys=keys)

    def compile_grammar(self, params: SamplingParams, field_prefix: str = "sampling_params"):
        """The request's grammar state (:mod:`dllm_jax.engine.grammar`); a ValueError naming the field with the
        grammar engine's reason when it cannot be used. The compiler (the tokenizer as llguidance reads it) is
        built at the first constrained request."""
        from dllm_jax.engine.grammar import GrammarCompiler, GrammarSpec

        name, text = params.grammar
        if self.tokenizer is None:
            raise ValueError(f"{field_prefix}.{name}: structured output needs a tokenizer; this model has none")
        compiler = getattr(self, "_grammar_compiler", None)
        if compiler is None:
            compiler = self._grammar_compiler = GrammarCompiler(
                self.tokenizer, vocab_size=self.config.vocab_size, eos_token_ids=tuple(self.config.eos_token_ids),
                mask_id=self.config.mask_token_id,
                forced=getattr(getattr(self, "engine_config", None), "grammar_frontier", "forced") == "forced")
        return compiler.compile(GrammarSpec(name, text, f"{field_prefix}.{name}"))

    def _sampling_params(self, sampling_params) -> SamplingParams:
        """Validated params over the model's defaults. Requests often share their params (a client's fixed
        settings): those of scalar values are validated once and kept, keyed with each value's type (``True``
        equals ``1`` but is not a valid ``max_new_tokens``)."""
        merged = self._with_defaults(sampling_params)
        key = None
        if isinstance(merged, dict) and all(isinstance(k, str) and isinstance(v, _SCALARS) for k, v in merged.items()):
            key = tuple(sorted((k, type(v), v) for k, v in merged.items()))
            params = self._params_cache.get(key)
            if params is not None:
                return params
        params = SamplingParams.from_dict(merged, vocab_size=self.config.vocab_size)
        if key is not None and len(self._params_cache) < 4096:
            self._params_cache[key] = params
        return params

    def _with_defaults(self, params):
        """A request's sampling params over the model's defaults (generation_config.json): a key the request leaves
        out, or sets to null, takes the default. A ready-made SamplingParams is used as given."""
        if not self.default_sampling_params or not (params is None or isinstance(params, dict)):
            return params
        merged = dict(self.default_sampling_params)
        merged.update({k: v for k, v in (params or {}).items() if v is not None or k not in merged})
        return merged

    def tokenize(self, text: str, field: str = "text") -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"{field}: must be a string, got {type(text).__name__}")
        check_text(text, field, allow_nul=True)
        if self.tokenizer is None:
            raise ValueError(f"{field}: this model has no tokenizer; pass input_ids")
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def apply_chat_template(self, messages: list[dict] | str) -> str:
        """The tokenizer's chat template with the generation prompt (a string is one user message)."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("messages: this model's tokenizer has no chat template")
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def _inputs(self, prompt, input_ids):
        if (prompt is None) == (input_ids is None):
            raise ValueError("prompt / input_ids: give exactly one of them")
        if prompt is not None:
            if isinstance(prompt, str):
                return [self.tokenize(prompt, "prompt")], True
            if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
                return [self.tokenize(p, f"prompt[{i}]") for i, p in enumerate(prompt)], False
            raise ValueError("prompt: must be a string or a non-empty list of strings")
        if isinstance(input_ids, list) and input_ids and all(isinstance(x, list) for x in input_ids):
            return input_ids, False
        if isinstance(input_ids, list):
            return [input_ids], True
        raise ValueError("input_ids: must be a list of token ids or a list of such lists")


def sampling_defaults(model_path: str, mode: str, vocab_size: int) -> dict:
    """The defaults a request's unset sampling params take: ``generation_config.json``'s (``"model"``; see
    :func:`dllm_jax.model.generation.generation_defaults`) or none (``"none"``: SamplingParams' own, i.e. greedy)."""
    from dllm_jax.model.generation import generation_defaults

    if mode not in SAMPLING_DEFAULTS:
        raise ValueError(f"sampling_defaults: must be one of {SAMPLING_DEFAULTS}, got {mode!r}")
    if mode == "none":
        return {}
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    defaults = {k: v for k, v in generation_defaults(model_path).items() if k in names}
    try:
        SamplingParams.from_dict(defaults, vocab_size=vocab_size, field_prefix="generation_config.json")
    except ValueError as e:
        raise ValueError(f"{os.path.join(model_path, 'generation_config.json')}: {e} (sampling_defaults='none' "
                         f"ignores the file)") from None
    return defaults


_SCALARS = (str, int, float, bool, type(None))


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def with_fields(params, extra: dict):
    """Sampling params (a dict, a SamplingParams or None) with ``extra`` fields set."""

    if isinstance(params, SamplingParams):
        return SamplingParams.from_dict({**{f.name: getattr(params, f.name) for f in dataclasses.fields(params)},
                                         **extra})
    if params is not None and not isinstance(params, dict):
        return params  # SamplingParams.from_dict names the field's error
    return {**(params or {}), **extra}
