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


# DiffusionGemma's denoising defaults (transformers' DiffusionGemmaGenerationConfig._get_default_generation_params,
# the same as SGLang's Gemma4Renoise defaults), used where generation_config.json leaves a key unset or null.
RENOISE_DEFAULTS = {"max_denoising_steps": 48, "entropy_bound": 0.1, "t_min": 0.4, "t_max": 0.8,
                    "stability_threshold": 1, "confidence_threshold": 0.005}


def renoise_defaults(model_dir: str) -> dict:
    """DiffusionGemma's denoising settings from ``generation_config.json`` (flat keys; the entropy bound in
    ``sampler_config``, as transformers serialises its dataclass), the defaults where unset, validated as
    transformers does (a CheckpointError naming the file and key)."""
    path = os.path.join(model_dir, "generation_config.json")
    gen: dict = {}
    if os.path.isfile(path):
        try:
            with open(path) as f:
                gen = json.load(f)
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path}: not valid JSON ({e})") from e
    sampler = gen.get("sampler_config") or {}
    if not isinstance(sampler, dict):
        raise CheckpointError(f"{path}: sampler_config must be an object, got {sampler!r}")
    given = {k: gen.get(k) for k in RENOISE_DEFAULTS if k != "entropy_bound"}
    given["entropy_bound"] = sampler.get("entropy_bound")
    out = {k: RENOISE_DEFAULTS[k] if given[k] is None else given[k] for k in RENOISE_DEFAULTS}

    def bad(key, rule):
        raise CheckpointError(f"{path}: {'sampler_config.' if key == 'entropy_bound' else ''}{key} must be {rule}, "
                              f"got {out[key]!r}")

    integer = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
    if not integer(out["max_denoising_steps"]) or out["max_denoising_steps"] < 1:
        bad("max_denoising_steps", "a positive integer")
    if not number(out["entropy_bound"]) or out["entropy_bound"] <= 0:
        bad("entropy_bound", "a number > 0")
    for key in ("t_min", "t_max", "confidence_threshold"):
        if not number(out[key]) or out[key] < 0:
            bad(key, "a number >= 0")
    if out["t_max"] <= out["t_min"]:
        bad("t_max", f"greater than t_min ({out['t_min']})")
    if not integer(out["stability_threshold"]) or out["stability_threshold"] < 0:
        bad("stability_threshold", "an integer >= 0")
    return out
