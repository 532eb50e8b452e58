"""Structured output on the device (the grammar variant of the denoise step): a constrained row's frontier takes
its token from the grammar's bitmask, and commits stay a contiguous run behind it.

The host (``dllm_jax/engine/grammar.py``) sends, per row, the packed bitmask of the tokens its grammar allows at
the row's *frontier*, the first position of the block still to decode (every position before it is decided and
checked), and whether the row is constrained at all. Here:

1. :func:`constrain_frontier`: the frontier's candidate becomes the best allowed token (greedy rows: the argmax of
   the allowed logits; sampled rows: a draw from them, with the row's temperature, top-k and top-p), the mask id
   never among them; its confidence becomes 1 and its entropy 0, so every algorithm commits it in this step (each
   step makes progress with a token the grammar accepts);
2. :func:`keep_run`: after the algorithm's update, an edit of a decided token is not taken. The host checks the
   decided run from the block's start and takes back the first token the grammar rejects and everything after
   it; a token decided past an undecided position stays provisional (unchecked, never committed) until the run
   reaches it.

Rows with ``active`` False are untouched (every value selected with ``jnp.where`` from the plain step's), so an
unconstrained row computes exactly what the plain step computes.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from dllm_jax.decode.rows import is_sampled


def unpack_bitmask(words, vocab: int):
    """``words [R, G] int32`` (bit ``v % 32`` of word ``v // 32``) -> ``[R, vocab]`` bool."""
    bits = (words[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    return bits.reshape(words.shape[0], -1)[:, :vocab] == 1


def frontier(tokens, immutable, mask_id: int):
    """Per row, the first position still to decode and whether there is one."""
    undecided = (tokens == mask_id) & ~immutable
    return jnp.argmax(undecided, axis=-1).astype(jnp.int32), jnp.any(undecided, axis=-1)


def pick_allowed(logits_f, allowed, *, mask_id: int, sample_fn=None):
    """``logits_f [R, V]`` at each row's frontier (mask id at -inf) -> the allowed token: the allowed argmax, or
    (``sample_fn``, for the sampled rows of a sampling step) ``sample_fn(allowed logits [R, 1, V]) -> ([R, 1]
    tokens, whether each row draws [R])``."""
    z = jnp.where(allowed, logits_f, -jnp.inf).at[:, mask_id].set(-jnp.inf)
    token = jnp.argmax(z, axis=-1).astype(jnp.int32)
    if sample_fn is not None:
        drawn, sampled = sample_fn(z[:, None, :])
        token = jnp.where(sampled, drawn[:, 0], token)
    return token


def constrain_frontier(tokens, confidence, entropy, block, immutable, active, token_f, *, mask_id: int):
    """Write ``token_f`` (the allowed token) as the candidate at each active row's frontier, with confidence 1 and
    entropy 0. ``block``: the row's current tokens (to find the frontier)."""
    pos, has = frontier(block, immutable, mask_id)
    at = (jnp.arange(block.shape[1])[None, :] == pos[:, None]) & (active & has)[:, None]
    tokens = jnp.where(at, token_f[:, None], tokens)
    confidence = jnp.where(at, jnp.float32(1.0), confidence)
    if entropy is not None:
        entropy = jnp.where(at, jnp.float32(0.0), entropy)
    return tokens, confidence, entropy


def keep_run(old_tokens, new_tokens, immutable, active, *, mask_id: int):
    """Active rows: the positions decided before the step keep their tokens (an edit algorithm's rewrite of a
    decided token is not taken: one the grammar rejects would be proposed again at every step)."""
    decided = (old_tokens != mask_id) & ~immutable & active[:, None]
    return jnp.where(decided, old_tokens, new_tokens)


def frontier_hidden(hidden, block, immutable, mask_id: int):
    """``hidden [R, B, H]`` at each row's frontier -> ``[R, 1, H]``."""
    pos, _ = frontier(block, immutable, mask_id)
    return jnp.take_along_axis(hidden, pos[:, None, None], axis=1)


def frontier_logits(logits, block, immutable, mask_id: int):
    """``logits [R, B, V]`` at each row's frontier -> ``[R, V]``."""
    pos, _ = frontier(block, immutable, mask_id)
    return jnp.take_along_axis(logits, pos[:, None, None], axis=1)[:, 0]



def constrain(hidden, logits, batch, cand, *, mask_id: int, head, sample=None):
    """``cand`` with each constrained row's frontier candidate the best token its grammar allows: from the step's
    ``logits`` when it materialised them (penalties and bias included; if they leave no allowed token a finite
    logit, the raw ones), else from the frontier's hidden state through ``head`` (``[R, 1, H] -> [R, 1, V]``).
    ``sample`` (a sampling step): ``[R, 1, V]`` logits -> ``[R, 1]`` draws, taken by rows with a temperature."""
    g = batch.grammar
    raw = head(frontier_hidden(hidden, batch.tokens, batch.immutable, mask_id))[:, 0]
    raw = raw.at[:, mask_id].set(-jnp.inf)
    allowed = unpack_bitmask(g.allowed, raw.shape[-1])
    z = raw
    if logits is not None:
        adjusted = frontier_logits(logits, batch.tokens, batch.immutable, mask_id)
        usable = jnp.any(allowed & (adjusted > -jnp.inf), axis=-1, keepdims=True)
        z = jnp.where(usable, adjusted, raw)
    sample_fn = None
    if sample is not None:
        def sample_fn(z3):
            return sample(z3), is_sampled(batch.temperature, batch.top_k)
    token_f = pick_allowed(z, allowed, mask_id=mask_id, sample_fn=sample_fn)
    tokens, confidence, entropy = constrain_frontier(cand.tokens, cand.confidence, cand.entropy, batch.tokens,
                                                     batch.immutable, g.active, token_f, mask_id=mask_id)
    return dataclasses.replace(cand, tokens=tokens, confidence=confidence, entropy=entropy)
