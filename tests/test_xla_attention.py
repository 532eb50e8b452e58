"""The query-tiled XLA attention equals the reference on long chunks (prefill) and short ones (denoise)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dllm_jax.decode.xla_attention import paged_block_attention_tiled
from pallas_kernels.paged_block_attention import paged_block_attention_reference


@pytest.mark.parametrize("block,chunk_blocks,tile", [(4, 24, 16), (32, 5, 64), (8, 3, 64)])
def test_tiled_equals_reference(block, chunk_blocks, tile):
    rng = np.random.default_rng(0)
    rows, hq, hkv, d, pages, width = 2, 4, 2, 8, 12, 4
    t = chunk_blocks * block
    q = jnp.asarray(rng.standard_normal((rows, t, hq, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((rows, t, hkv, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((rows, t, hkv, d)), jnp.float32)
    kp = jnp.asarray(rng.standard_normal((hkv, pages, block, d)), jnp.float32)
    vp = jnp.asarray(rng.standard_normal((hkv, pages, block, d)), jnp.float32)
    table = jnp.asarray([[7, 3, 9, 0], [2, 0, 0, 0]], jnp.int32)
    prefix = jnp.asarray([3 * block, block], jnp.int32)
    ref = paged_block_attention_reference(q, k, v, kp, vp, table, prefix, block_size=block)
    fn = jax.jit(lambda *a: paged_block_attention_tiled(*a, block_size=block, tile=tile))
    out = fn(q, k, v, kp, vp, table, prefix)
    assert np.max(np.abs(np.asarray(out) - np.asarray(ref))) <= 2e-5
