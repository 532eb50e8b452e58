"""What a model directory's ``generation_config.json`` gives: its EOS ids and a request's sampling defaults."""

from __future__ import annotations

import json
import os

from dllm_jax.model.errors import CheckpointError


def generation_eos(model_dir: str) -> tuple[int, ...]:
    """The EOS ids ``generation_config.json`` lists (``()`` without one)."""
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return ()
    try:
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e
    if eos is None:
        return ()
    return tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))


# generation_config.json keys that become a request's defaults (SGLang's ``--sampling-defaults model`` set).
GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                           "frequency_penalty")


def generation_defaults(model_dir: str) -> dict:
    """The sampling defaults ``generation_config.json`` gives (``{}`` without one).

    ``temperature``, ``top_p``, ``top_k`` (and ``min_p`` / the penalties, for an engine whose requests take them)
    as written; ``do_sample: false`` means greedy (temperature 0), as in transformers. ``max_new_tokens`` and
    ``max_length`` are not taken: a request's length is the caller's choice. The EOS list is read separately
    (:func:`dllm_jax.model.loader.resolve_config`)."""
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            gen = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(gen, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    if gen.get("do_sample") is False:
        return {"temperature": 0.0}
    return {k: gen[k] for k in GENERATION_DEFAULT_KEYS if gen.get(k) is not None}
