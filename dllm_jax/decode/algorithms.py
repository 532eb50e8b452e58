"""Decoding algorithms: pure functions from (block ids, candidates, state) to (new ids, done, state).

Each algorithm is a small frozen object (hashable, so it is a static argument of the jitted step) holding its
config. ``step`` works on a whole padded batch at once:

* ``ids [R, B]``: the current block of every row;
* ``immutable [R, B]``: True at prompt tokens and committed outputs (whatever their value, even the mask id);
  these are never rewritten and never counted as positions to decode;
* ``cand``: :class:`Candidates` -- per position the candidate token and its confidence, both computed with the
  mask id excluded from the vocabulary (the mask id is never a candidate, so every step makes progress);
* ``state``: a dict of ``[R, ...]`` arrays (the algorithm's per-row state, carried across FDFO rounds).

Decisions compare the float32 scores exactly, as SGLang's algorithms and SDAR's ``generate.py`` do: threshold
tests are strict comparisons of the confidence (or entropy) with the threshold, the at-least-one pick is the
exact argmax of the confidence, orderings (EBSampling, JointThresholdInDel's ranks) sort the exact values. Exact
ties (equal floats) go to the lowest position. Nothing is rounded or bucketed to make runs agree: where the
forward itself is not bitwise identical across batch shapes (XLA:CPU matmuls pick kernels by row count), two
runs can decide differently only where the two best candidates of a decision lie within float rounding of each
other (see README, "Exactness").

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


def entropy(logits, eps: float = 0.0):
    """Entropy (nats) of softmax(``logits``) over the last axis: ``-sum p log p``, or with ``eps > 0`` the
    reference's ``-sum p log(p + eps)`` (SGLang's EntropyThreshold uses 1e-8)."""
    lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    probs = jnp.exp(logits - lse)
    if eps:
        return -jnp.sum(probs * jnp.log(probs + eps), axis=-1)
    return -jnp.sum(jnp.where(probs > 0, probs * (logits - lse), 0.0), axis=-1)


def greedy_candidates(logits, mask_id, *, with_logits: bool = True, entropy_eps: float = 0.0) -> Candidates:
    """Candidates straight from ``[R, B, V]`` logits (mask id excluded): the XLA path's figures, and what the
    unit tests feed the algorithms."""
    logits = logits.astype(jnp.float32).at[..., mask_id].set(-jnp.inf)
    lse = jax.nn.logsumexp(logits, axis=-1)
    return Candidates(tokens=jnp.argmax(logits, axis=-1).astype(jnp.int32),
                      confidence=jnp.exp(jnp.max(logits, axis=-1) - lse), entropy=entropy(logits, entropy_eps),
                      logits=logits if with_logits else None)


def positions_to_decode(ids, immutable, mask_id):
    return (ids == mask_id) & ~immutable


def _first_true(mask):
    """One-hot of the first True per row (all False if none)."""
    idx = jnp.argmax(mask, axis=-1)
    return jax.nn.one_hot(idx, mask.shape[-1], dtype=jnp.bool_) & jnp.any(mask, axis=-1, keepdims=True)


def _at_least_one(selected, masked, score):
    """``selected``, plus the single highest-``score`` masked position in rows where nothing was selected (the
    exact argmax; equal scores go to the lowest position)."""
    selected = selected & masked
    scored = jnp.where(masked, score, NEG_INF)
    best = jax.nn.one_hot(jnp.argmax(scored, axis=-1), masked.shape[-1], dtype=jnp.bool_)
    need = ~jnp.any(selected, axis=-1, keepdims=True) & jnp.any(masked, axis=-1, keepdims=True)
    return (selected | (need & best)) & masked


class Algorithm:
    """Base: subclasses set ``name``, ``Config`` and implement ``step``."""

    name: ClassVar[str]
    Config: ClassVar[type]
    needs_logits: ClassVar[bool] = False
    needs_entropy: ClassVar[bool] = False
    entropy_eps: ClassVar[float] = 0.0  # the reference's epsilon inside log(p + eps), when it has one
    # True when "done" means "the input of this step had nothing left to decode": the step that fills the last
    # mask is then followed by a forward whose only use is writing the block's exact KV, and the engine can fold
    # that forward into the next block's first step (see StepSpec.fold_commit).
    foldable: ClassVar[bool] = False

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

    def init_state(self, num_rows: int, block_size: int) -> State:
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
    foldable = True

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

    def init_state(self, num_rows, block_size):
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
    foldable = True

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
    """Commit the lowest-entropy masked position and every other with entropy below ``threshold`` (nats).

    The entropy is the reference's ``-sum p log(p + 1e-8)`` (SGLang's EntropyThreshold, from d3LLM), whose
    epsilon lowers it by about 1e-8 per vocabulary entry with p >> 1e-8: enough to move a decision near the
    threshold on a large vocabulary, so it is kept exactly."""

    name = "EntropyThreshold"
    Config = EntropyThresholdConfig
    needs_entropy = True
    entropy_eps = 1e-8
    foldable = True

    def step(self, ids, immutable, cand, state, mask_id):
        masked = positions_to_decode(ids, immutable, mask_id)
        done = ~jnp.any(masked, axis=-1)
        commit = _at_least_one(cand.entropy < self.config.threshold, masked, -cand.entropy)
        return jnp.where(commit, cand.tokens, ids), done, state


# ----------------------------------------------------------------------------------------------
# JointThresholdInDel (LLaDA2.2 InDel: JointThreshold plus delete / split edit tokens)
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class JointThresholdInDelConfig:
    threshold: float = 0.5
    edit_threshold: float = 0.0
    max_post_edit_steps: int = 16
    delete_token_id: int | None = None
    split_token_id: int | None = None


_HASH_MULT = 0x9E3779B1


def _block_hash(ids):
    """A 32-bit polynomial hash per row: "has this exact block been the input before?" (anti-loop)."""
    powers = jnp.cumprod(jnp.full((ids.shape[-1],), _HASH_MULT, jnp.uint32))
    return jnp.sum(ids.astype(jnp.uint32) * powers, axis=-1, dtype=jnp.uint32)


def apply_edit_operations(old, selected, immutable, is_orig, *, mask_id, delete_id, split_id):
    """Rebuild blocks after structural edits: per generated position, DELETE drops it, SPLIT becomes
    ``[MASK, old token]`` (the new mask is not an original one), anything else is kept; immutable positions are
    copied unchanged; the result is cut or right-padded with masks to the block size. Returns (ids, is_orig)."""
    rows, block = old.shape
    sel = jnp.where(immutable, old, selected)
    width = jnp.where(immutable, 1, jnp.where(sel == delete_id, 0, jnp.where(sel == split_id, 2, 1)))
    start = jnp.cumsum(width, axis=-1) - width
    sink = 2 * block  # scatter target for dropped writes
    r = jnp.arange(rows)[:, None]
    first_idx = jnp.where(width > 0, start, sink)
    first_val = jnp.where(width == 2, mask_id, sel)
    first_flag = jnp.where(width == 2, False, is_orig)
    second_idx = jnp.where(width == 2, start + 1, sink)
    ids = jnp.full((rows, sink + 1), mask_id, old.dtype)
    flags = jnp.zeros((rows, sink + 1), jnp.bool_)
    ids = ids.at[r, first_idx].set(first_val).at[r, second_idx].set(old)
    flags = flags.at[r, first_idx].set(first_flag).at[r, second_idx].set(is_orig)
    ids = ids.at[:, sink].set(mask_id)
    return ids[:, :block], flags[:, :block]


class JointThresholdInDel(Algorithm):
    """JointThreshold for models trained with insertion / deletion (SGLang's PR #31773, section 2.4 of the
    reference): a selected DELETE token removes its position, SPLIT inserts a mask before the old token. Original
    masks are resolved at least one per step (``1 + introduced`` transfers while original masks remain), a
    final cleanup replaces any selected MASK / DELETE / SPLIT by the best other token, and an anti-loop rule
    re-draws one changing position (excluding every token already written there) when an input block repeats.
    The prompt is taken from the explicit ``immutable`` mask, never guessed from the block's contents.
    """

    name = "JointThresholdInDel"
    Config = JointThresholdInDelConfig
    needs_logits = True

    @classmethod
    def from_model_config(cls, config: dict, model_config) -> dict:
        config = dict(config)
        for key in ("delete_token_id", "split_token_id"):
            if config.get(key) is None and model_config is not None:
                config[key] = getattr(model_config, key, None)
            value = config.get(key)
            if value is None:
                raise ValueError(f"algorithm_config.{key}: JointThresholdInDel requires delete_token_id and "
                                 f"split_token_id (in the model's config.json or the algorithm config)")
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"algorithm_config.{key}: must be a token id, got {value!r}")
        return config

    def max_regular_update_steps(self, block_size):
        return block_size + self.config.max_post_edit_steps

    def max_steps(self, block_size):
        return block_size + self.config.max_post_edit_steps + 2

    def init_state(self, num_rows, block_size):
        history = self.max_steps(block_size) + 1
        return {"num_update_steps": jnp.zeros((num_rows,), jnp.int32),
                "post_edit_steps": jnp.zeros((num_rows,), jnp.int32),
                "finished": jnp.zeros((num_rows,), jnp.bool_),
                "is_orig_mask": jnp.zeros((num_rows, block_size), jnp.bool_),
                "seen": jnp.zeros((num_rows, history), jnp.uint32),
                "written": jnp.full((num_rows, block_size, history), -1, jnp.int32)}

    def step(self, ids, immutable, cand, state, mask_id):
        cfg = self.config
        rows, block = ids.shape
        logits = cand.logits  # mask id already at -inf
        first = state["num_update_steps"] == 0
        masked = positions_to_decode(ids, immutable, mask_id)
        is_orig = jnp.where(first[:, None], masked, state["is_orig_mask"])
        x, p = cand.tokens, cand.confidence
        n_masked = masked.sum(-1)
        n_orig = (is_orig & masked).sum(-1)
        introduced = n_masked - n_orig
        was_finished = state["finished"]
        active = ~was_finished
        num_update = state["num_update_steps"] + active
        post = state["post_edit_steps"] + (active & (n_orig == 0))
        mpes = cfg.max_post_edit_steps
        if mpes > 0:
            cleanup = post >= mpes
        else:
            cleanup = n_orig == 0
        cleanup |= num_update > self.max_regular_update_steps(block)

        # M2T: cleanup -> every mask; original masks left -> at least 1 + introduced; else every mask.
        above = masked & (p > cfg.threshold)
        need = jnp.minimum(1 + introduced, n_masked)
        rank = jnp.argsort(jnp.argsort(-jnp.where(masked, p, NEG_INF), axis=-1, stable=True), axis=-1)
        top_need = masked & (rank < need[:, None])
        regular = jnp.where((above.sum(-1) >= need)[:, None], above, top_need)
        m2t = jnp.where((cleanup | (n_orig == 0))[:, None], masked, regular)
        if mpes == 0:
            covers = ~jnp.any(is_orig & masked & ~m2t, axis=-1)
            cleanup |= covers & (n_orig > 0)
        t2t = ~masked & ~immutable & (p > cfg.edit_threshold) & (ids != x)
        if cand.sampled is not None:
            t2t &= ~cand.sampled[:, None]
        write = (m2t | t2t) & active[:, None]
        nothing = ~jnp.any(write, axis=-1)

        # Cleanup: never write MASK / DELETE / SPLIT.
        structural = (x == cfg.delete_token_id) | (x == cfg.split_token_id) | (x == mask_id)
        clean_logits = logits.at[..., cfg.delete_token_id].set(-jnp.inf).at[..., cfg.split_token_id].set(-jnp.inf)
        x_clean = jnp.argmax(clean_logits, axis=-1).astype(jnp.int32)
        tokens = jnp.where(cleanup[:, None] & structural, x_clean, x)

        # Anti-loop: this exact input block was seen before -> re-draw the least confident changing position,
        # excluding every token already written there.
        h = _block_hash(ids)
        seen_before = jnp.any((state["seen"] == h[:, None]) & (jnp.arange(state["seen"].shape[1]) <
                                                               (num_update - 1)[:, None]), axis=-1)
        changing = write & (tokens != ids)
        loop_fix = seen_before & ~cleanup & jnp.any(changing, axis=-1)
        j = jnp.argmin(jnp.where(changing, p, jnp.inf), axis=-1)
        row_logits = jnp.take_along_axis(logits, j[:, None, None], axis=1)[:, 0]  # [R, V]
        hist = jnp.take_along_axis(state["written"], j[:, None, None], axis=1)[:, 0]  # [R, H]
        excluded = jnp.zeros(row_logits.shape, jnp.bool_).at[jnp.arange(rows)[:, None],
                                                             jnp.where(hist >= 0, hist, 0)].max(hist >= 0)
        redraw = jnp.argmax(jnp.where(excluded, -jnp.inf, row_logits), axis=-1).astype(jnp.int32)
        onehot_j = jax.nn.one_hot(j, block, dtype=jnp.bool_) & loop_fix[:, None]
        tokens = jnp.where(onehot_j, redraw[:, None], tokens)

        selected = jnp.where(write, tokens, ids)
        has_structural = jnp.any(write & ((tokens == cfg.delete_token_id) | (tokens == cfg.split_token_id)), -1)
        edited, edited_orig = apply_edit_operations(ids, selected, immutable, is_orig, mask_id=mask_id,
                                                    delete_id=cfg.delete_token_id, split_id=cfg.split_token_id)
        new_ids = jnp.where(has_structural[:, None], edited, selected)
        new_orig = jnp.where(has_structural[:, None], edited_orig, is_orig)
        new_ids = jnp.where(active[:, None], new_ids, ids)
        changed = jnp.any(new_ids != ids, axis=-1)

        # Done: nothing to write (this forward saw the final tokens); a cleanup that changed nothing; or the
        # forward that follows a cleanup which changed something (it ran on the final tokens).
        finished = was_finished | nothing | cleanup
        done = was_finished | (active & nothing) | (active & cleanup & ~changed)

        step_idx = jnp.clip(num_update - 1, 0, state["seen"].shape[1] - 1)
        seen = state["seen"].at[jnp.arange(rows), step_idx].set(jnp.where(active, h, state["seen"][jnp.arange(rows),
                                                                                                    step_idx]))
        written = state["written"].at[jnp.arange(rows), :, step_idx].set(
            jnp.where(active[:, None] & write, tokens, state["written"][jnp.arange(rows), :, step_idx]))
        new_state = {"num_update_steps": num_update, "post_edit_steps": post, "finished": finished,
                     "is_orig_mask": new_orig, "seen": seen, "written": written}
        return new_ids, done, new_state


ALGORITHMS: dict[str, type[Algorithm]] = {
    cls.name: cls for cls in (LowConfidence, JointThreshold, JointThresholdInDel, EBSampling, EntropyThreshold)
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
    if default is None:
        return value
    if isinstance(default, int):
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
