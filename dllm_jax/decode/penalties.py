"""Penalties and biases on the logits, inside the denoise step (only in the step variant compiled for them).

Per row (a request) and per position of its block, every logit ``z`` of token ``v`` (the mask id stays ``-inf``)
becomes, in this order:

1. repetition (SGLang / CTRL, multiplicative): if ``v`` occurs in the prompt or the generated tokens,
   ``z / r`` when ``z > 0`` else ``z * r``;
2. presence and frequency (OpenAI): ``z - presence * (c > 0) - frequency * c`` with ``c`` the count of ``v`` in
   the generated tokens (the prompt does not count);
3. ``logit_bias``: ``z + bias[v]``;
4. ``min_new_tokens``: ``-inf`` for the EOS and stop token ids at positions whose output index (0-based, counted
   from the end of the prompt) is below ``min_new_tokens``, so such a token can be at most the
   ``min_new_tokens + 1``-th output.

Which tokens count (SGLang's choice, its penalizers): presence and frequency count only generated tokens;
repetition counts prompt and generated tokens. "Generated" means the committed outputs of earlier blocks plus the
tokens already decided in the current block, except the position's own token (a position is never penalised for
its own current value, so an edit algorithm does not rewrite a token for being itself). Every position of a block
therefore sees the block as it stands at that forward, the way an autoregressive model sees the tokens before it.

The temperature divides the penalised logits afterwards (as in SGLang). With every penalty neutral a row's logits
come out bitwise unchanged (``z / 1``, ``z - 0``, ``z + 0``), but the step only takes this path at all when some
row of the batch has a penalty (:class:`dllm_jax.decode.step.StepSpec` ``penalties``).
"""

from __future__ import annotations

import jax.numpy as jnp

from dllm_jax.decode import rows as row_schema


# One padded batch of penalty inputs: its fields are declared once, in dllm_jax/decode/rows.py (PENALTY_INPUTS).
Penalties = row_schema.Penalties


def _dense(ids, values, vocab: int, dtype):
    """Scatter-add ``values`` at ``ids`` (-1: dropped) into ``[R, V]``."""
    rows = jnp.arange(ids.shape[0])[:, None]
    safe = jnp.where(ids >= 0, ids, vocab)  # out of range: dropped by the scatter
    return jnp.zeros((ids.shape[0], vocab), dtype).at[rows, safe].add(values.astype(dtype), mode="drop")


def _penalise(z, c_gen, c_all, bias, stopped, pen: Penalties, rows_shape):
    """The formula of the module docstring, elementwise; per-row scalars broadcast over ``rows_shape``."""
    def per_row(x):
        return x.reshape(x.shape + (1,) * (len(rows_shape) - 1))

    r = per_row(pen.repetition)
    z = jnp.where(c_all > 0, jnp.where(z > 0, z / r, z * r), z)
    z = z - per_row(pen.presence) * (c_gen > 0).astype(z.dtype) - per_row(pen.frequency) * c_gen
    z = z + bias
    return jnp.where(stopped, -jnp.inf, z)


def apply_penalties(logits, tokens, immutable, prefix_len, pen: Penalties, mask_id: int):
    """``logits [R, B, V]`` (mask id at -inf) of the block ``tokens [R, B]`` at absolute offset ``prefix_len``:
    the penalised logits (rows with ``pen.active`` False come out unchanged)."""
    R, B, V = logits.shape
    decided = (tokens != mask_id) & ~immutable  # generated tokens of this block
    own = jnp.where(decided, tokens, -1)
    hist_pos = jnp.arange(pen.history.shape[1])[None, :]
    generated = jnp.where(hist_pos >= pen.prompt_len[:, None], pen.history, -1)
    ones_h = jnp.ones(pen.history.shape, jnp.float32)
    ones_b = jnp.ones(own.shape, jnp.float32)
    c_gen = _dense(generated, ones_h, V, jnp.float32) + _dense(own, ones_b, V, jnp.float32)  # [R, V]
    c_all = _dense(pen.history, ones_h, V, jnp.float32) + _dense(own, ones_b, V, jnp.float32)
    bias = _dense(pen.bias_ids, pen.bias, V, jnp.float32)
    stop = _dense(pen.stop_ids, jnp.ones(pen.stop_ids.shape, jnp.float32), V, jnp.float32) > 0
    out_index = prefix_len[:, None] + jnp.arange(B)[None, :] - pen.prompt_len[:, None]  # [R, B]
    early = out_index < pen.min_new[:, None]  # [R, B]

    z = _penalise(logits, c_gen[:, None, :], c_all[:, None, :], bias[:, None, :],
                  stop[:, None, :] & early[:, :, None], pen, (R, B, V))
    # A decided position's own token: recompute its entry with the counts minus itself.
    safe_own = jnp.where(own >= 0, own, 0)
    rows = jnp.arange(R)[:, None]
    z_own = jnp.take_along_axis(logits, safe_own[..., None], axis=-1)[..., 0]  # [R, B]
    fixed = _penalise(z_own, c_gen[rows, safe_own] - 1, c_all[rows, safe_own] - 1, bias[rows, safe_own],
                      stop[rows, safe_own] & early, pen, (R, B))
    cols = jnp.arange(B)[None, :]
    current = z[rows, cols, safe_own]
    z = z.at[rows, cols, safe_own].set(jnp.where(own >= 0, fixed, current))
    z = jnp.where(pen.active[:, None, None], z, logits)
    return z.at[..., mask_id].set(-jnp.inf)
