"""The XLA attention path for long prefill chunks: the reference, tiled over the chunk's queries.

:func:`pallas_kernels.paged_block_attention.paged_block_attention_reference` materialises the whole
``[T, prefix + T]`` score matrix of a chunk. For a denoise step (``T = B``) that is tiny, but a 2k-token prefill
chunk makes it hundreds of megabytes per layer, and on a CPU the softmax over it costs more than the matmuls.
Here the chunk's queries go in tiles of ``tile`` tokens (a multiple of B); a tile attends to the prefix and to
the chunk's keys up to its own end only (block-causal: nothing later is visible), so the scores of a tile stay
small and the masked upper triangle is never computed. Same function, same results (one softmax per query row).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.paged_block_attention import einsum_f32, gather_prefix, paged_block_attention_reference

DEFAULT_TILE = 256


def paged_block_attention_tiled(q, k_new, v_new, k_pages, v_pages, page_table, prefix_len, *, block_size,
                                tile: int = DEFAULT_TILE):
    num_rows, chunk_len, num_q_heads, head_dim = q.shape
    tile = max(block_size, tile // block_size * block_size)
    if chunk_len <= tile:
        return paged_block_attention_reference(q, k_new, v_new, k_pages, v_pages, page_table, prefix_len,
                                               block_size=block_size)
    num_kv_heads = k_new.shape[2]
    group = num_q_heads // num_kv_heads
    width = page_table.shape[1] * block_size
    scale = head_dim ** -0.5
    k_prefix, v_prefix = gather_prefix(k_pages, v_pages, page_table)
    prefix_visible = jnp.arange(width)[None, :] < prefix_len[:, None]  # [R, W*B]
    k_chunk, v_chunk = k_new.transpose(0, 2, 1, 3), v_new.transpose(0, 2, 1, 3)  # [R, Hkv, T, D]
    qg = q.reshape(num_rows, chunk_len, num_kv_heads, group, head_dim)
    outs = []
    for start in range(0, chunk_len, tile):  # static: one small attention per tile
        end = min(start + tile, chunk_len)
        qt = qg[:, start:end]
        s_prefix = einsum_f32("rtkgd,rksd->rkgts", qt, k_prefix) * scale
        s_chunk = einsum_f32("rtkgd,rksd->rkgts", qt, k_chunk[:, :, :end]) * scale
        q_block = jnp.arange(start, end) // block_size
        k_block = jnp.arange(end) // block_size
        s_prefix = jnp.where(prefix_visible[:, None, None, None, :], s_prefix, -jnp.inf)
        s_chunk = jnp.where((k_block[None, :] <= q_block[:, None])[None, None, None], s_chunk, -jnp.inf)
        probs = jax.nn.softmax(jnp.concatenate([s_prefix, s_chunk], axis=-1), axis=-1)
        out = einsum_f32("rkgts,rksd->rtkgd", probs[..., :width], v_prefix) + \
            einsum_f32("rkgts,rksd->rtkgd", probs[..., width:], v_chunk[:, :, :end])
        outs.append(out)
    out = jnp.concatenate(outs, axis=1)
    return out.reshape(num_rows, chunk_len, num_q_heads, head_dim).astype(q.dtype)
