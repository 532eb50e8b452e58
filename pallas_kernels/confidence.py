"""Confidence selection: per position argmax token, its probability and the log-sum-exp.

Semantics (the reference below defines them; the Pallas kernel must match it):

* ``hidden``: ``[N, H]`` final hidden states (after the final norm) of the positions to score.
* ``lm_head``: ``[H, V]`` the LM head matrix.
* ``exclude_token_id``: a token id whose logit is treated as ``-inf`` (the mask id: it is never a
  candidate), or ``None``.

Returns ``(argmax [N] int32, p_max [N] float32, lse [N] float32)`` where ``lse`` is the log-sum-exp of
the logits without the excluded token and ``p_max = exp(max - lse)``. Ties break to the lowest index,
as ``jnp.argmax`` does.
"""

from __future__ import annotations

import jax.numpy as jnp


def confidence_stats_reference(hidden, lm_head, *, exclude_token_id=None):
    """Plain-JAX definition: materialises the full ``[N, V]`` logits (the XLA path)."""
    logits = jnp.dot(hidden, lm_head, preferred_element_type=jnp.float32)
    return confidence_stats_from_logits(logits, exclude_token_id=exclude_token_id)


def confidence_stats_from_logits(logits, *, exclude_token_id=None):
    logits = logits.astype(jnp.float32)
    if exclude_token_id is not None:
        logits = logits.at[..., exclude_token_id].set(-jnp.inf)
    top = jnp.max(logits, axis=-1)
    arg = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    lse = top + jnp.log(jnp.sum(jnp.exp(logits - top[..., None]), axis=-1))
    return arg, jnp.exp(top - lse), lse
