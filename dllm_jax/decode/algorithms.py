"""Decoding algorithms: pure functions from (block ids, candidates, state) to (new ids, done, state).

Each algorithm is a small frozen object (hashable, so it is a static argument of the jitted step) holding its
config. ``step`` works on a whole padded batch at once:

* ``ids [R, B]``: the current block of every row;
* ``immutable [R, B]``: True at prompt tokens and committed outputs (whatever their value, even the mask id);
  these are never rewritten and never counted as positions to decode;
* ``cand``: :class:`Candidates` -- per position the candidate token and its confidence, both computed with the
  mask id excluded from the vocabulary (the mask id is never a candidate, so every step makes progress);
* ``state``: a dict of ``[R, ...]`` arrays (the algorithm's per-row state, carried across FDFO rounds).

The contract every algorithm keeps (SGLang's, see ``reference/sglang-dllm-engine.md`` section 1.6): a row is
reported done only when the forward that produced ``cand`` already ran on the row's final tokens, so the KV that
forward wrote is exact. A row whose positions are all immutable changes nothing and is done at once.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar

import jax
import jax.numpy as jnp

State = dict[str, jax.Array]
NEG_INF = -jnp.inf


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Candidates:
    """Per-position figures the algorithms choose from (mask id already excluded)."""

    tokens: jax.Array  # [R, B] int32: argmax, or the sampled token for sampled rows
    confidence: jax.Array  # [R, B] f32: p(argmax), or the relative confidence of the sampled token
    entropy: jax.Array | None = None  # [R, B] f32 (nats), when the algorithm asks for it
    logits: jax.Array | None = None  # [R, B, V] f32 with the mask id at -inf, when the algorithm asks for it
    sampled: jax.Array | None = None  # [R] bool: rows whose tokens were drawn rather than argmax


def positions_to_decode(ids, immutable, mask_id):
    return (ids == mask_id) & ~immutable


def _first_true(mask):
    """One-hot of the first True per row (all False if none)."""
    idx = jnp.argmax(mask, axis=-1)
    return jax.nn.one_hot(idx, mask.shape[-1], dtype=jnp.bool_) & jnp.any(mask, axis=-1, keepdims=True)


TIE_RESOLUTION = 2.0 ** -16


def _at_least_one(selected, masked, score):
    """``selected``, plus the single highest-``score`` masked position in rows where nothing was selected.

    Scores are compared on a 2^-16 grid, ties going to the lowest position: positions of an all-mask block with
    no prefix have mathematically identical logits, and without the grid float rounding (which differs between
    batch shapes) would pick the winner.
    """
    selected = selected & masked
    scored = jnp.where(masked, jnp.floor(score / TIE_RESOLUTION), NEG_INF)
    best = jax.nn.one_hot(jnp.argmax(scored, axis=-1), masked.shape[-1], dtype=jnp.bool_)
    need = ~jnp.any(selected, axis=-1, keepdims=True) & jnp.any(masked, axis=-1, keepdims=True)
    return (selected | (need & best)) & masked


class Algorithm:
    """Base: subclasses set ``name``, ``Config`` and implement ``step``."""

    name: ClassVar[str]
    Config: ClassVar[type]
    needs_logits: ClassVar[bool] = False
    needs_entropy: ClassVar[bool] = False

    def __init__(self, config):
        self.config = config

    def __eq__(self, other):
        return type(self) is type(other) and self.config == other.config

    def __hash__(self):
        return hash((type(self).__name__, self.config))

    def __repr__(self):
        return f"{self.name}({self.config})"

    def max_steps(self, block_size: int) -> int:
        """Forwards a block may take before the step function forces it to finish (a safety net only)."""
        return block_size + 1

    def init_state(self, num_rows: int) -> State:
        return {}

    def step(self, ids, immutable, cand: Candidates, state: State, mask_id: int):
        raise NotImplementedError


# ----------------------------------------------------------------------------------------------
# LowConfidence (SGLang's default)
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class LowConfidenceConfig:
    threshold: float = 0.95


class LowConfidence(Algorithm):
    """Commit every masked position whose confidence is strictly above ``threshold``, at least the best one.

    ``done`` is decided before the update: a row is done when its input to this forward had nothing left to
    decode, so the block's KV was computed on its final tokens.
    """

    name = "LowConfidence"
    Config = LowConfidenceConfig

    def step(self, ids, immutable, cand, state, mask_id):
        masked = positions_to_decode(ids, immutable, mask_id)
        done = ~jnp.any(masked, axis=-1)
        commit = _at_least_one(cand.confidence > self.config.threshold, masked, cand.confidence)
        return jnp.where(commit, cand.tokens, ids), done, state


# ----------------------------------------------------------------------------------------------
# JointThreshold (LLaDA2.1: mask-to-token plus token-to-token edits)
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class JointThresholdConfig:
    threshold: float = 0.5
    edit_threshold: float = 0.0
    max_post_edit_steps: int = 16
    penalty_lambda: float = 0.0


class JointThreshold(Algorithm):
    """M2T unmasking above ``threshold`` (at least one) plus T2T edits of generated tokens whose argmax changed
    with probability above ``edit_threshold``; done at a fixed point (a step that changes nothing) or once
    ``max_post_edit_steps`` steps ran without masks. Sampled rows never edit (an edit would revert the draw to
    the argmax and the block would never reach a fixed point).
    """

    name = "JointThreshold"
    Config = JointThresholdConfig

    @property
    def needs_logits(self):  # the repetition penalty rewrites logits before the argmax
        return self.config.penalty_lambda > 0

    def max_steps(self, block_size):
        return block_size + self.config.max_post_edit_steps + 1

    def init_state(self, num_rows):
        return {"post_edit_steps": jnp.zeros((num_rows,), jnp.int32), "finished": jnp.zeros((num_rows,), jnp.bool_)}

    def step(self, ids, immutable, cand, state, mask_id):
        cfg = self.config
        tokens, conf = cand.tokens, cand.confidence
        if cfg.penalty_lambda > 0:
            logits = cand.logits
            prev = jax.nn.one_hot(ids[:, :-1], logits.shape[-1], dtype=logits.dtype)
            logits = logits.at[:, 1:].add(-cfg.penalty_lambda * prev)
            lse = jax.nn.logsumexp(logits, axis=-1)
            greedy_tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            greedy_conf = jnp.exp(jnp.max(logits, axis=-1) - lse)
            sampled = cand.sampled[:, None] if cand.sampled is not None else False
            tokens = jnp.where(sampled, tokens, greedy_tokens)
            conf = jnp.where(sampled, conf, greedy_conf)
        masked = positions_to_decode(ids, immutable, mask_id)
        has_mask = jnp.any(masked, axis=-1)
        was_finished = state["finished"]
        m2t = _at_least_one(conf > cfg.threshold, masked, conf)
        post = state["post_edit_steps"] + (~has_mask & ~was_finished).astype(jnp.int32)
        exhausted = ~has_mask & (post > cfg.max_post_edit_steps)
        can_edit = ~exhausted
        if cand.sampled is not None:
            can_edit &= ~cand.sampled
        t2t = ~masked & ~immutable & (ids != tokens) & (conf > cfg.edit_threshold) & can_edit[:, None]
        transfer = (m2t | t2t) & ~was_finished[:, None]
        finished = was_finished | exhausted | ~jnp.any(transfer, axis=-1)
        new_ids = jnp.where(transfer, tokens, ids)
        return new_ids, finished, {"post_edit_steps": post, "finished": finished}


# ----------------------------------------------------------------------------------------------
# Entropy-based algorithms
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class EBSamplingConfig:
    gamma: float = 0.15


class EBSampling(Algorithm):
    """Entropy-bounded: reveal masked positions in ascending entropy while the entropy of the ones already
    revealed this step sums to at most ``gamma`` (the lowest-entropy one always)."""

    name = "EBSampling"
    Config = EBSamplingConfig
    needs_entropy = True

    def step(self, ids, immutable, cand, state, mask_id):
        masked = positions_to_decode(ids, immutable, mask_id)
        done = ~jnp.any(masked, axis=-1)
        ent = jnp.where(masked, cand.entropy, jnp.inf)
        order = jnp.argsort(ent, axis=-1, stable=True)
        sorted_ent = jnp.take_along_axis(ent, order, axis=-1)
        sorted_masked = jnp.take_along_axis(masked, order, axis=-1)
        before = jnp.cumsum(jnp.where(sorted_masked, sorted_ent, 0.0), axis=-1) - jnp.where(sorted_masked, sorted_ent, 0.0)
        first = jnp.arange(ids.shape[-1])[None, :] == 0
        reveal_sorted = sorted_masked & (first | (before <= self.config.gamma))
        reveal = jnp.zeros_like(masked).at[jnp.arange(ids.shape[0])[:, None], order].set(reveal_sorted)
        return jnp.where(reveal & masked, cand.tokens, ids), done, state


@dataclasses.dataclass(frozen=True)
class EntropyThresholdConfig:
    threshold: float = 0.95


class EntropyThreshold(Algorithm):
    """Commit the lowest-entropy masked position and every other with entropy below ``threshold`` (nats)."""

    name = "EntropyThreshold"
    Config = EntropyThresholdConfig
    needs_entropy = True

    def step(self, ids, immutable, cand, state, mask_id):
        masked = positions_to_decode(ids, immutable, mask_id)
        done = ~jnp.any(masked, axis=-1)
        commit = _at_least_one(cand.entropy < self.config.threshold, masked, -cand.entropy)
        return jnp.where(commit, cand.tokens, ids), done, state


ALGORITHMS: dict[str, type[Algorithm]] = {
    cls.name: cls for cls in (LowConfidence, JointThreshold, EBSampling, EntropyThreshold)
}


def register_algorithm(cls: type[Algorithm]) -> type[Algorithm]:
    ALGORITHMS[cls.name] = cls
    return cls


def make_algorithm(name: str, config: dict[str, Any] | None = None, *, model_config=None) -> Algorithm:
    """Build an algorithm by SGLang's name; unknown names or config keys are a ValueError listing valid ones."""
    if name not in ALGORITHMS:
        raise ValueError(f"algorithm: unknown decoding algorithm {name!r}; valid: {', '.join(sorted(ALGORITHMS))}")
    cls = ALGORITHMS[name]
    config = dict(config or {})
    config.pop("block_size", None)  # SGLang's YAML may carry the block size; the engine reads it separately
    fields = {f.name: f for f in dataclasses.fields(cls.Config)}
    unknown = sorted(set(config) - set(fields))
    if unknown:
        raise ValueError(f"algorithm_config: unknown key(s) {unknown} for {name}; valid: {sorted(fields)}")
    if hasattr(cls, "from_model_config"):
        config = cls.from_model_config(config, model_config)
    values = {}
    for key, value in config.items():
        default = fields[key].default
        values[key] = _coerce(f"algorithm_config.{key}", value, default)
    return cls(cls.Config(**values))


def _coerce(field: str, value, default):
    """Type-check a config value against its default's type (bool is not an int here)."""
    if isinstance(default, bool) or isinstance(value, bool):
        if not isinstance(value, bool) or not isinstance(default, bool):
            raise ValueError(f"{field}: expected {type(default).__name__}, got {value!r}")
        return value
    if isinstance(default, int) and default is not None:
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"{field}: expected a non-negative integer, got {value!r}")
        return value
    if isinstance(default, float):
        if not isinstance(value, (int, float)) or value != value:
            raise ValueError(f"{field}: expected a number, got {value!r}")
        if value < 0:
            raise ValueError(f"{field}: must be >= 0, got {value!r}")
        return float(value)
    return value


StepFn = Callable[..., Any]
