"""Gemma4Renoise: DiffusionGemma's decoding, as SGLang's ``Gemma4Renoise`` and transformers'
``DiffusionGemmaForBlockDiffusion.generate`` define it (``shared/reference/diffusion-gemma.md``, section 3).

Per canvas (``canvas_length`` positions right after the prompt or the previous canvas): the canvas starts as
uniform random tokens; each step (``step = max_denoising_steps .. 1``, counting down) the decoder runs on it with
the previous step's self-conditioning, logits are soft-capped and divided by ``T = t_min + (t_max - t_min) *
step / max_steps``, a token is sampled per position and its entropy computed (one fused pass over the
vocabulary: :mod:`pallas_kernels.renoise`); positions are accepted in increasing entropy while the sum of the
accepted entropies minus the largest stays within ``entropy_bound``, the others re-noised; a row stops when its
argmax canvas equals each of its last ``stability_threshold`` ones and its mean entropy is below
``confidence_threshold``, or when the steps run out. The **argmax** canvas is appended.

Randomness is counter-based (:func:`pallas_kernels.renoise.draw_key`): every draw is a hash of (request seed,
canvas index, step, position, stream), so a request's tokens depend on nothing but its own seed and inputs --
not on its batch, its row, the schedule or the prefix cache.

:func:`denoise_step` is one step over a batch of canvas rows (pure, jitted by the caller); :class:`RenoiseState`
the per-row state between steps (``[C, H]`` self-conditioning input, no vocabulary-sized array);
:func:`renoise_config` parses and validates the request / server options with SGLang's keys.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from dllm_jax.config import ModelConfig
from dllm_jax.decode.rows import MAX_TOP_LOGPROBS
from dllm_jax.model import gemma
from dllm_jax.sharding import vocab_shards
from pallas_kernels.renoise import draw_key, get_renoise_fn, uniform_tokens
from pallas_kernels.renoise_adjust import Adjust

NAME = "Gemma4Renoise"
STREAM_SAMPLE, STREAM_RENOISE, STREAM_INIT = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class RenoiseConfig:
    max_denoising_steps: int = 48
    entropy_bound: float = 0.1
    t_min: float = 0.4
    t_max: float = 0.8
    stability_threshold: int = 1
    confidence_threshold: float = 0.005


_SECTIONS = {"sampler_config": ("entropy_bound",), "temperature_schedule": ("t_min", "t_max"),
             "stopping_config": ("confidence_threshold", "stability_threshold")}


def renoise_config(options: dict | None, defaults: dict | None = None, *, field: str = "algorithm_config"
                   ) -> RenoiseConfig:
    """SGLang's keys (``max_denoising_steps``; ``sampler_config.entropy_bound``; ``temperature_schedule.t_min /
    t_max``; ``stopping_config.confidence_threshold / stability_threshold``; the flat keys too) over ``defaults``
    (the model's generation_config); a ValueError naming the key for a bad value or an unknown key."""
    values = dict(dataclasses.asdict(RenoiseConfig()), **(defaults or {}))
    options = dict(options or {})
    for section, keys in _SECTIONS.items():
        if section not in options:
            continue
        sub = options.pop(section)
        if not isinstance(sub, dict):
            raise ValueError(f"{field}.{section}: must be a mapping, got {type(sub).__name__}")
        for key, value in sub.items():
            if key not in keys:
                raise ValueError(f"{field}.{section}.{key}: unknown key (valid: {', '.join(keys)})")
            values[key] = value
    options.pop("seed", None)  # a request's seed is its sampling param; accepted here as SGLang does
    for key, value in options.items():
        if key not in values:
            raise ValueError(f"{field}.{key}: unknown {NAME} key (valid: {', '.join(sorted(values))}, "
                             f"{', '.join(_SECTIONS)}, seed)")
        values[key] = value

    def where(key):
        section = next((s for s, keys in _SECTIONS.items() if key in keys), None)
        return f"{field}.{section + '.' if section else ''}{key}"

    def integer(key, low):
        v = values[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"{where(key)}: must be an integer >= {low}, got {v!r}")

    def number(key, low, strict=False):
        v = values[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or \
                (v <= low if strict else v < low):
            raise ValueError(f"{where(key)}: must be a finite number {'>' if strict else '>='} {low}, got {v!r}")

    integer("max_denoising_steps", 1)
    integer("stability_threshold", 0)
    number("entropy_bound", 0, strict=True)
    number("t_min", 0)
    number("t_max", 0)
    number("confidence_threshold", 0)
    if values["t_max"] <= values["t_min"]:
        raise ValueError(f"{where('t_max')}: must be greater than t_min ({values['t_min']}), got {values['t_max']}")
    if values["max_denoising_steps"] > 4096:
        raise ValueError(f"{where('max_denoising_steps')}: at most 4096, got {values['max_denoising_steps']}")
    return RenoiseConfig(**{k: (float(v) if isinstance(RenoiseConfig.__dataclass_fields__[k].default, float)
                                else int(v)) for k, v in values.items()})


class RenoiseState(NamedTuple):
    """Per canvas row, between steps."""

    canvas: jax.Array  # [R, C] int32: the current (noisy) canvas
    argmax: jax.Array  # [R, C] int32: the last step's argmax canvas (what is appended)
    soft: jax.Array  # [R, C, H]: the next step's self-conditioning input (zeros before the first step)
    history: jax.Array  # [R, max(1, stability_threshold), C] int32: the last argmax canvases (-1: none yet)
    step: jax.Array  # [R] int32: the next step's number, counting down from max_denoising_steps (0: out)
    finished: jax.Array  # [R] bool
    entropy: jax.Array  # [R] float32: the last step's mean entropy
    logprob: jax.Array  # [R, C] float32: each argmax token's log-probability under the last step
    top_logprob: jax.Array  # [R, C, MAX_TOP_LOGPROBS] float32: the last step's most likely tokens (only the
    top_ids: jax.Array  # [R, C, MAX_TOP_LOGPROBS] int32   steps of the top-k variant write them)


def initial_state(cfg: ModelConfig, rcfg: RenoiseConfig, seeds, canvas_index, dtype) -> RenoiseState:
    """The state of fresh canvases: uniform random tokens drawn from each row's own counter stream."""
    num_rows = seeds.shape[0]
    length = cfg.block_size
    positions = jnp.arange(length, dtype=jnp.int32)[None, :]
    keys = draw_key(seeds[:, None], canvas_index[:, None], 0, positions, stream=STREAM_INIT)
    canvas = uniform_tokens(keys, cfg.vocab_size)
    return RenoiseState(canvas, canvas, jnp.zeros((num_rows, length, cfg.hidden_size), dtype),
                        jnp.full((num_rows, max(1, rcfg.stability_threshold), length), -1, jnp.int32),
                        jnp.full((num_rows,), rcfg.max_denoising_steps, jnp.int32),
                        jnp.zeros((num_rows,), bool), jnp.zeros((num_rows,), jnp.float32),
                        jnp.zeros((num_rows, length), jnp.float32),
                        jnp.zeros((num_rows, length, MAX_TOP_LOGPROBS), jnp.float32),
                        jnp.zeros((num_rows, length, MAX_TOP_LOGPROBS), jnp.int32))


def accept(entropy, bound):
    """Entropy-bound acceptance: positions sorted by entropy ascending are accepted while the sum of the accepted
    entropies minus the largest (cumsum - itself, since sorted) is at most ``bound``. ``[R, C]`` -> bool."""
    order = jnp.argsort(entropy, axis=-1, stable=True)
    sorted_h = jnp.take_along_axis(entropy, order, axis=-1)
    keep_sorted = jnp.cumsum(sorted_h, axis=-1) - sorted_h <= bound
    rows = jnp.arange(entropy.shape[0])[:, None]
    return jnp.zeros_like(keep_sorted).at[rows, order].set(keep_sorted)


def vocab_parallel_stats(backend: str, mesh, hidden, head, embed, temperature, keys, *, adjust=None, **kw):
    """The vocabulary pass with the head and the embedding split by vocabulary over the mesh's ``tp`` axis
    (:data:`dllm_jax.sharding.RULES`): each shard streams its own slice (its noise, indices and tables by global
    token id, :func:`pallas_kernels.renoise.renoise_stats_streaming`'s ``vocab_offset``), then the shards
    exchange their partials (``[N, H]`` plus a few ``[N]`` vectors each, never logits) and every shard merges
    them alike. Its decisions are the whole pass's: a max and an argmax are exact under any split; the sums
    (entropy, the soft embedding) round differently."""
    from jax.sharding import PartitionSpec as P

    from dllm_jax.sharding import RULES
    from pallas_kernels.renoise import finalize, merge_renoise_partials

    axis, fn = RULES["vocab"], get_renoise_fn(backend)
    embed_scale = kw.pop("embed_scale", 1.0)

    def local(h, w, e, t, k, *tables):
        offset = jax.lax.axis_index(axis) * e.shape[0]
        part = fn(h, w, e, t, k, partials=True, vocab_offset=offset, vocab_major=True,
                  adjust=Adjust(*tables) if tables else None, **kw)
        return finalize(merge_renoise_partials(jax.tree.map(lambda x: jax.lax.all_gather(x, axis), part)),
                        embed_scale)

    tables = tuple(adjust) if adjust is not None else ()
    by_vocab = P(axis, None)
    return jax.shard_map(local, mesh=mesh, in_specs=(P(), by_vocab, by_vocab, P(), P()) + (P(),) * len(tables),
                         out_specs=P(), check_vma=False)(hidden, head, embed, temperature, keys, *tables)


def denoise_step(params, cfg: ModelConfig, rcfg: RenoiseConfig, state: RenoiseState, seeds, canvas_index, prefix_len,
                 kv_pages, page_tables, *, backend: str = "xla", draws: bool = False, adjust: Adjust | None = None,
                 top_k: int = 0, mesh=None):
    """One Gemma4Renoise step for every row (rows already finished keep their state). Returns the new state (and,
    with ``draws``, this step's ``(samples, renoise tokens, accepted)`` for replay checks). ``adjust``: each row's
    table of penalties / biases / masked stop ids (:mod:`dllm_jax.decode.renoise_tables`), applied inside the
    vocabulary pass; ``top_k``: also record the step's ``top_k`` most likely tokens per position (the state keeps
    ``MAX_TOP_LOGPROBS``; fewer leave the rest as they were). ``mesh``: a tensor-parallel mesh whose ``tp`` axis
    splits the vocabulary (:func:`vocab_parallel_stats`; None, or a vocabulary that does not divide: one pass)."""
    num_rows, length = state.canvas.shape
    hidden = gemma.decode_canvas(params, cfg, state.canvas, prefix_len, kv_pages, page_tables, state.soft)
    embed = gemma.decoder_weights(params, cfg)[0]
    head, vocab_major = params.get("lm_head", embed), True  # [V, H], as the checkpoint stores it
    step = state.step
    temperature = rcfg.t_min + (rcfg.t_max - rcfg.t_min) * step.astype(jnp.float32) / rcfg.max_denoising_steps
    positions = jnp.arange(length, dtype=jnp.int32)[None, :]
    keys = draw_key(seeds[:, None], canvas_index[:, None], step[:, None], positions, stream=STREAM_SAMPLE)
    args = (hidden.reshape(num_rows * length, -1), head, embed, jnp.repeat(temperature, length), keys.reshape(-1))
    kw = dict(softcap=cfg.final_logit_softcapping, embed_scale=cfg.hidden_size ** 0.5, adjust=adjust, row_len=length,
              top_k=top_k)
    if vocab_shards(cfg, mesh) > 1:
        stats = vocab_parallel_stats(backend, mesh, *args, **kw)
    else:
        stats = get_renoise_fn(backend)(*args, vocab_major=vocab_major, **kw)
    shape = (num_rows, length)
    sample, argmax = stats.sample.reshape(shape), stats.argmax.reshape(shape)
    entropy, logprob = stats.entropy.reshape(shape), stats.logprob.reshape(shape)
    accepted = accept(entropy, rcfg.entropy_bound)
    renoise_keys = draw_key(seeds[:, None], canvas_index[:, None], step[:, None], positions, stream=STREAM_RENOISE)
    noise = uniform_tokens(renoise_keys, cfg.vocab_size)
    canvas = jnp.where(accepted, sample, noise)

    if rcfg.stability_threshold:
        stable = jnp.all(state.history == argmax[:, None, :], axis=(1, 2))
        history = jnp.concatenate([state.history[:, 1:], argmax[:, None, :]], axis=1)
    else:
        stable, history = jnp.ones((num_rows,), bool), state.history
    mean_entropy = jnp.mean(entropy, axis=-1)
    done_now = (stable & (mean_entropy < rcfg.confidence_threshold)) | (step <= 1)
    live = ~state.finished
    keep = lambda new, old: jnp.where(live.reshape((-1,) + (1,) * (new.ndim - 1)), new, old)  # noqa: E731
    new = RenoiseState(keep(canvas, state.canvas), keep(argmax, state.argmax),
                       keep(stats.soft.reshape(num_rows, length, -1).astype(state.soft.dtype), state.soft),
                       keep(history, state.history), jnp.where(live, step - 1, step), state.finished | done_now,
                       keep(mean_entropy, state.entropy), keep(logprob, state.logprob), state.top_logprob,
                       state.top_ids)
    if top_k:
        k_shape = (num_rows, length, top_k)
        new = new._replace(
            top_logprob=keep(state.top_logprob.at[..., :top_k].set(stats.top_logprob.reshape(k_shape)),
                             state.top_logprob),
            top_ids=keep(state.top_ids.at[..., :top_k].set(stats.top_ids.reshape(k_shape)), state.top_ids))
    if draws:
        return new, (sample, noise, accepted)
    return new


def config_dict(rcfg: RenoiseConfig) -> dict[str, Any]:
    """The settings as ``get_model_info`` reports them (SGLang's nesting)."""
    return {"max_denoising_steps": rcfg.max_denoising_steps, "sampler_config": {"entropy_bound": rcfg.entropy_bound},
            "temperature_schedule": {"t_min": rcfg.t_min, "t_max": rcfg.t_max},
            "stopping_config": {"confidence_threshold": rcfg.confidence_threshold,
                                "stability_threshold": rcfg.stability_threshold}}
