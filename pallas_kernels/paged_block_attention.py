"""Paged block attention: the current chunk of blocks against a paged prefix plus itself.

Semantics (the reference below defines them; the Pallas kernel must match it):

* ``q``: ``[R, T, Hq, D]``, the chunk of each row (``T = C * B`` tokens, ``C`` blocks), starting at
  absolute position ``prefix_len[r]`` (a multiple of ``B``).
* ``k_new, v_new``: ``[R, T, Hkv, D]``, the chunk's own keys/values (not yet in the pool).
* ``k_pages, v_pages``: ``[Hkv, P, B, D]``, one layer's page pool (page size = block size ``B``).
* ``page_table``: ``[R, W]`` int32; row ``r``'s prefix lives in pages ``page_table[r, :prefix_len[r] // B]``.
* ``prefix_len``: ``[R]`` int32, number of cached prefix tokens (0 allowed).

Every query sees the whole prefix and, inside the chunk, every key whose block index is not later than
its own (block-causal; bidirectional within a block). Softmax in float32. Returns ``[R, T, Hq, D]`` in
``q.dtype``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def paged_block_attention_reference(q, k_new, v_new, k_pages, v_pages, page_table, prefix_len, *, block_size):
    """Plain-JAX definition of paged block attention (also the engine's XLA path)."""
    num_rows, chunk_len, num_q_heads, head_dim = q.shape
    num_kv_heads = k_new.shape[2]
    group = num_q_heads // num_kv_heads
    width = page_table.shape[1]
    scale = head_dim ** -0.5

    # Gather each row's prefix pages: [Hkv, R, W, B, D] -> [R, Hkv, W*B, D].
    k_prefix = k_pages[:, page_table].transpose(1, 0, 2, 3, 4).reshape(num_rows, num_kv_heads, width * block_size, head_dim)
    v_prefix = v_pages[:, page_table].transpose(1, 0, 2, 3, 4).reshape(num_rows, num_kv_heads, width * block_size, head_dim)
    k_all = jnp.concatenate([k_prefix.astype(q.dtype), k_new.transpose(0, 2, 1, 3)], axis=2)
    v_all = jnp.concatenate([v_prefix.astype(q.dtype), v_new.transpose(0, 2, 1, 3)], axis=2)

    qg = q.reshape(num_rows, chunk_len, num_kv_heads, group, head_dim)
    scores = jnp.einsum("rtkgd,rksd->rkgts", qg, k_all, preferred_element_type=jnp.float32) * scale

    prefix_visible = jnp.arange(width * block_size)[None, :] < prefix_len[:, None]  # [R, W*B]
    q_block = jnp.arange(chunk_len) // block_size
    chunk_visible = q_block[None, :] <= q_block[:, None]  # [T(q), T(k)]
    visible = jnp.concatenate(
        [jnp.broadcast_to(prefix_visible[:, None, :], (num_rows, chunk_len, width * block_size)),
         jnp.broadcast_to(chunk_visible[None], (num_rows, chunk_len, chunk_len))],
        axis=-1,
    )  # [R, T, S]
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("rkgts,rksd->rtkgd", probs.astype(v_all.dtype), v_all, preferred_element_type=jnp.float32)
    return out.reshape(num_rows, chunk_len, num_q_heads, head_dim).astype(q.dtype)
