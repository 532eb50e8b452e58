"""The engine's XLA attention (query tiles, live prefix tiles, online softmax) equals the reference on long chunks
(prefill) and short ones (denoise), and never reads a prefix tile past the batch's longest real prefix."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dllm_jax.decode.xla_attention import attention_tiles, paged_block_attention_xla
from pallas_kernels.paged_block_attention import paged_block_attention_reference

reference = jax.jit(paged_block_attention_reference, static_argnames="block_size")  # one compile, not op by op


def _inputs(block, chunk_blocks, rows=2, pages=12, width=4, seed=0):
    rng = np.random.default_rng(seed)
    hq, hkv, d = 4, 2, 8
    t = chunk_blocks * block
    q, k, v = (jnp.asarray(rng.standard_normal((rows, t, h, d)), jnp.float32) for h in (hq, hkv, hkv))
    kp = rng.standard_normal((hkv, pages, block, d)).astype(np.float32)
    vp = rng.standard_normal((hkv, pages, block, d)).astype(np.float32)
    return q, k, v, kp, vp


@pytest.mark.parametrize("block,chunk_blocks,q_tile,k_tile", [
    (4, 24, 16, 4),  # 6 query tiles, one page per prefix tile
    (32, 5, 64, 64),  # a ragged last query tile, two pages per prefix tile
    (8, 3, 64, None),  # the chunk in one tile (a denoise-sized call), default key tile
    (4, 1, None, 12),  # a denoise step, the key tile not a divisor of the table width (padded table)
])
def test_equals_reference(block, chunk_blocks, q_tile, k_tile):
    q, k, v, kp, vp = _inputs(block, chunk_blocks)
    table = jnp.asarray([[7, 3, 9, 0], [2, 0, 0, 0]], jnp.int32)
    prefix = jnp.asarray([3 * block, block], jnp.int32)
    ref = reference(q, k, v, kp, vp, table, prefix, block_size=block)
    fn = jax.jit(lambda *a: paged_block_attention_xla(*a, block_size=block, q_tile=q_tile, k_tile=k_tile))
    out = fn(q, k, v, kp, vp, table, prefix)
    assert np.max(np.abs(np.asarray(out) - np.asarray(ref))) <= 2e-5


def test_reads_only_live_prefix_tiles():
    """Pages past the batch's longest prefix (a bucketed table's padding) are never read: NaN there changes
    nothing. Rows without a prefix (padding rows, fresh prompts) see their chunk only."""
    block = 4
    q, k, v, kp, vp = _inputs(block, 2, rows=3, width=8)
    table = np.asarray([[5, 6, 7, 8, 9, 10, 11, 1], [2, 3, 0, 0, 0, 0, 0, 0], [0] * 8], np.int32)
    prefix = jnp.asarray([3 * block, 2 * block, 0], jnp.int32)
    # read the reference before the pools change: a jitted call may alias NumPy buffers and run asynchronously
    ref = np.asarray(reference(q, k, v, kp, vp, jnp.asarray(table), prefix, block_size=block))
    dead = [8, 9, 10, 11, 1]  # row 0's table beyond its 3 live pages
    kp[:, dead], vp[:, dead] = np.nan, np.nan
    fn = jax.jit(lambda *a: paged_block_attention_xla(*a, block_size=block, k_tile=block))
    out = np.asarray(fn(q, k, v, jnp.asarray(kp), jnp.asarray(vp), jnp.asarray(table), prefix))
    assert np.isfinite(out).all()
    assert np.max(np.abs(out - ref)) <= 2e-5


def test_tile_sizes():
    # ~1k query rows per tile, multiples of B, at most the chunk; key tiles of 256-512 keys, at most the table
    assert attention_tiles(1, 2048, 4, 64, 32) == (256, 512)
    assert attention_tiles(1, 2048, 8, 64, 32) == (128, 512)
    assert attention_tiles(32, 32, 8, 64, 32) == (32, 256)
    assert attention_tiles(1, 32, 4, 2, 32) == (32, 64)
    assert attention_tiles(1, 100 * 4, 4, 8, 4, q_tile=6, k_tile=6) == (4, 4)
