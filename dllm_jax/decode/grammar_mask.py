"""Structured output on the device (the grammar variant of the denoise step): a constrained row's frontier takes
its token from the grammar's bitmask, and commits stay a contiguous run behind it.

The host (``dllm_jax/engine/grammar.py``) sends, per row, the packed bitmask of the tokens its grammar allows at
the row's *frontier*, the first position of the block still to decode (every position before it is decided and
checked), and whether the row is constrained at all. Here:

1. :func:`constrain_frontier`: the frontier's candidate becomes the best allowed token (greedy rows: the argmax of
   the allowed logits; sampled rows: a draw from them, with the row's temperature, top-k and top-p), the mask id
   never among them, with its confidence and entropy under that masked distribution (:func:`masked_figures`):
   the algorithm decides the frontier when it would decide any position as sure of its token. *Forced* rows
   (confidence 1, entropy 0: decided in this step) are those the host marks (the model broke the grammar in this
   block) and those that decided :data:`BEHIND_LIMIT` positions past their frontier (:func:`behind`: the
   model's order skips it, and what it decides meanwhile is unchecked);
2. :func:`keep_run`: after the algorithm's update, an edit of a decided token is not taken. The host checks the
   decided run from the block's start and takes back the first token the grammar rejects and everything after
   it; a token decided past an undecided position stays provisional (unchecked, never committed) until the run
   reaches it;
3. :func:`frontier_decided`: the device loop (FDFO / synchronous) goes on while no active row has decided its
   frontier: until then every mask is exact (the decided prefix it was computed for does not change), so a
   constrained batch keeps the device loop; the call ends after the step that decided one (the host checks that
   row's run and computes its next mask; a row whose frontier did not move gets its mask again, not recomputed).
   Every step decides some position (the algorithms commit at least one), so a frontier is decided within the
   block's positions;
4. :func:`record_frontier`: the logprob record at a constrained frontier is that of the masked distribution.

Rows with ``active`` False are untouched (every value selected with ``jnp.where`` from the plain step's), so an
unconstrained row computes exactly what the plain step computes.
"""

from __future__ import annotations

import dataclasses

import jax
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


def allowed_logits(logits_f, allowed, *, mask_id: int):
    """``logits_f [R, V]`` at each row's frontier -> the same with every token the grammar does not allow (and the
    mask id) at -inf: the distribution the frontier's token is drawn from."""
    return jnp.where(allowed, logits_f, -jnp.inf).at[:, mask_id].set(-jnp.inf)


def pick_allowed(logits_f, allowed, *, mask_id: int, sample_fn=None):
    """``logits_f [R, V]`` at each row's frontier (mask id at -inf) -> the allowed token: the allowed argmax, or
    (``sample_fn``, for the sampled rows of a sampling step) ``sample_fn(allowed logits [R, 1, V]) -> ([R, 1]
    tokens, whether each row draws [R])``."""
    z = allowed_logits(logits_f, allowed, mask_id=mask_id)
    token = jnp.argmax(z, axis=-1).astype(jnp.int32)
    if sample_fn is not None:
        drawn, sampled = sample_fn(z[:, None, :])
        token = jnp.where(sampled, drawn[:, 0], token)
    return token


# A frontier left undecided while the row decided this many positions past it (unchecked, provisional) is decided
# in the next step: the model's order skips it, and what it decides meanwhile may all go back at the host's check.
BEHIND_LIMIT = 3


def behind(tokens, immutable, mask_id: int):
    """[R] int32: positions decided past each row's frontier (provisional: the host has not checked them)."""
    pos, _ = frontier(tokens, immutable, mask_id)
    past = jnp.arange(tokens.shape[1])[None, :] > pos[:, None]
    return jnp.sum(past & (tokens != mask_id) & ~immutable, axis=-1)


def masked_figures(z, token):
    """``z [R, V]`` allowed logits (-inf elsewhere), the frontier's ``token [R]`` -> (its probability under the
    masked distribution, that distribution's entropy): the frontier's confidence and entropy. The algorithm
    weighs the frontier as it weighs every position, by the distribution its token is actually drawn from."""
    lse = jax.nn.logsumexp(z, axis=-1, keepdims=True)
    logp = z - lse
    confidence = jnp.exp(jnp.take_along_axis(logp, token[:, None], axis=-1)[:, 0])
    entropy = -jnp.sum(jnp.where(z > -jnp.inf, jnp.exp(logp) * logp, 0.0), axis=-1)
    return confidence, entropy


def constrain_frontier(tokens, confidence, entropy, block, immutable, active, token_f, conf_f, ent_f, *,
                       mask_id: int):
    """Write ``token_f`` (the allowed token) as the candidate at each active row's frontier, with its confidence
    ``conf_f`` and entropy ``ent_f`` under the masked distribution. ``block``: the row's current tokens (to find
    the frontier)."""
    pos, has = frontier(block, immutable, mask_id)
    at = (jnp.arange(block.shape[1])[None, :] == pos[:, None]) & (active & has)[:, None]
    tokens = jnp.where(at, token_f[:, None], tokens)
    confidence = jnp.where(at, conf_f[:, None], confidence)
    if entropy is not None:
        entropy = jnp.where(at, ent_f[:, None], entropy)
    return tokens, confidence, entropy


def frontier_decided(old_tokens, new_tokens, immutable, active, mask_id: int):
    """Whether some ``active`` row decided its frontier in this step: its mask, computed by the host for the
    frontier given the decided prefix, is stale from then on (the device loop's stop predicate). Until then it
    stays exact (the prefix does not change: :func:`keep_run`), so the loop may go on."""
    pos, has = frontier(old_tokens, immutable, mask_id)
    at = jnp.take_along_axis(new_tokens, pos[:, None], axis=1)[:, 0]
    return jnp.any(active & has & (at != mask_id))


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



@jax.tree_util.register_dataclass
@dataclasses.dataclass
class FrontierScores:
    """What the logprob record reports at a constrained row's frontier: the masked distribution its token was drawn
    from (tempered as the step's figures are), not the model's unconstrained one."""

    pos: jax.Array  # [R] int32: the frontier
    at: jax.Array  # [R] bool: the row is constrained and has a frontier
    logp: jax.Array  # [R, V] f32: log-softmax of the allowed logits (-inf where the grammar forbids)


def constrain(hidden, logits, batch, cand, *, mask_id: int, head, sample=None, temperature=None):
    """``cand`` with each constrained row's frontier candidate the best token its grammar allows: from the step's
    ``logits`` when it materialised them (penalties and bias included; if they leave no allowed token a finite
    logit, the raw ones), else from the frontier's hidden state through ``head`` (``[R, 1, H] -> [R, 1, V]``).
    ``sample`` (a sampling step): ``[R, 1, V]`` logits -> ``[R, 1]`` draws, taken by rows with a temperature.
    Returns (cand, :class:`FrontierScores` when ``temperature`` ``[R]`` is given (the step records logprobs: the
    rows' scoring temperature) else None)."""
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
    zm = allowed_logits(z, allowed, mask_id=mask_id)
    conf_f, ent_f = masked_figures(zm, token_f)
    forced = g.forced | (behind(batch.tokens, batch.immutable, mask_id) >= BEHIND_LIMIT)
    conf_f, ent_f = jnp.where(forced, 1.0, conf_f), jnp.where(forced, 0.0, ent_f)
    tokens, confidence, entropy = constrain_frontier(cand.tokens, cand.confidence, cand.entropy, batch.tokens,
                                                     batch.immutable, g.active, token_f, conf_f, ent_f,
                                                     mask_id=mask_id)
    cand = dataclasses.replace(cand, tokens=tokens, confidence=confidence, entropy=entropy)
    if temperature is None:
        return cand, None
    pos, has = frontier(batch.tokens, batch.immutable, mask_id)
    zt = zm / temperature[:, None]
    return cand, FrontierScores(pos=pos, at=g.active & has, logp=zt - jax.nn.logsumexp(zt, axis=-1, keepdims=True))


def record_frontier(f: FrontierScores, tokens, chosen, vals, ids, top_k=None):
    """The logprob record's figures with each constrained frontier's replaced by the masked distribution's: the
    logprob of the token written there, and its top ``k`` (a forbidden token never among them unless fewer than
    ``k`` are allowed, then at -inf). ``top_k``: ``[R, V] -> ([R, k] values, ids)`` when the record keeps
    alternatives."""
    at = (jnp.arange(tokens.shape[1])[None, :] == f.pos[:, None]) & f.at[:, None]
    tok = jnp.take_along_axis(tokens, f.pos[:, None], axis=1)
    lp_tok = jnp.take_along_axis(f.logp, tok, axis=1)  # [R, 1]
    chosen = jnp.where(at, lp_tok, chosen)
    if top_k is not None:
        top_v, top_i = top_k(f.logp)
        vals = jnp.where(at[:, :, None], top_v[:, None, :], vals)
        ids = jnp.where(at[:, :, None], top_i[:, None, :], ids)
    return chosen, vals, ids
