"""The engine's XLA attention path: paged block attention that reads only the live prefix, in cache-sized tiles.

Same function as :func:`pallas_kernels.paged_block_attention.paged_block_attention_reference` (the definition:
every query sees its row's prefix ``page_table[r, :prefix_len[r] // B]`` and, inside the chunk, every key whose
block is not later than its own), computed the way a CPU (or any XLA backend) runs it fast:

* **Only live pages.** The page table is a power-of-two bucket, so a row's real prefix may fill only half of it
  (and a padded batch row none). The prefix is walked in tiles of ``k_tile`` keys by a ``lax.fori_loop`` whose
  trip count is the batch's longest *real* prefix (``max(prefix_len)``), each tile gathered from the pool
  through its slice of the page table; dead tiles are never gathered nor multiplied. (The reference gathers the
  whole ``[R, Hkv, W*B, D]`` table and scores every padded key.)
* **Query tiles, online softmax.** The chunk's queries go in static tiles of ``q_tile`` tokens (a multiple of
  B); a tile's keys are the prefix tiles, then the chunk's own keys before the tile in ``q_tile``-sized steps
  (all visible), then the tile's own keys under the block-causal mask: the masked upper triangle is never
  computed and no score tile outgrows the cache (a running max / sum-exp / accumulator, as flash attention).
* **Batched-matmul layout.** Queries are laid out ``[Hkv, R, q_tile*G, D]`` (the GQA group folded into the
  query rows, batch dims leading, the pool's head axis first), so every product is a plain batched matmul. An
  einsum with the batch dims inside (``rtkgd,rksd->rkgts``, the reference's) ran ~10x slower on XLA:CPU.

Tile sizes default to what measured fastest on a 2-core x86 CPU (``bench/RESULTS.md``, "prefill"): about 1k
query rows (tokens x q heads x rows) per tile and 512K score elements per (query, key) tile (2 MB of float32,
an L2 cache). Results equal the reference's up to float32 rounding (the softmax is accumulated tile by tile).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_kernels import prev_pow2
from pallas_kernels.paged_block_attention import einsum_f32

QUERY_ROWS = 1024  # tokens x q heads x batch rows per query tile
SCORE_ELEMENTS = 512 * 1024  # query rows x keys per score tile
UNROLL_Q_TILES = 4  # query tiles up to this many are unrolled; more run in a loop (compile time stays flat)
MIN_K_TILE, MAX_K_TILE = 256, 512  # keys per prefix tile: fewer iterations below, skipped dead pages above


def attention_tiles(num_rows: int, chunk_len: int, num_q_heads: int, width: int, block_size: int,
                    q_tile: int | None = None, k_tile: int | None = None) -> tuple[int, int]:
    """(q_tile tokens, k_tile keys) for a call: multiples of the block size, q_tile at most the chunk, k_tile at
    most the page table."""
    B = block_size
    if q_tile is None:
        q_tile = prev_pow2(max(1, QUERY_ROWS // (num_rows * num_q_heads)))
    q_tile = min(max(B, q_tile // B * B), chunk_len)
    if k_tile is None:
        k_tile = prev_pow2(max(1, SCORE_ELEMENTS // (num_rows * num_q_heads * q_tile)))
        k_tile = min(MAX_K_TILE, max(MIN_K_TILE, k_tile))
    k_tile = min(max(B, k_tile // B * B), max(1, width) * B)
    return q_tile, k_tile


def paged_block_attention_xla(q, k_new, v_new, k_pages, v_pages, page_table, prefix_len, *, block_size,
                              q_tile: int | None = None, k_tile: int | None = None):
    """Paged block attention (the reference's signature and semantics), live prefix only; see the module doc."""
    num_rows, chunk_len, num_q_heads, head_dim = q.shape
    num_kv_heads = k_new.shape[2]
    group = num_q_heads // num_kv_heads
    width = page_table.shape[1]
    B = block_size
    scale = head_dim ** -0.5
    q_tile, k_tile = attention_tiles(num_rows, chunk_len, num_q_heads, width, B, q_tile, k_tile)
    compute = q.dtype
    num_q_tiles = -(-chunk_len // q_tile)
    padded_len = num_q_tiles * q_tile  # a ragged last tile: padded queries (dropped) and keys (later blocks: masked)
    rows = q_tile * group  # query rows per tile

    # [R, T, Hkv*G, D] -> [Hkv, R, T*G, D]: query row = token * G + head-in-group.
    qh = q.reshape(num_rows, chunk_len, num_kv_heads, group, head_dim).transpose(2, 0, 1, 3, 4)
    qh = qh.reshape(num_kv_heads, num_rows, chunk_len * group, head_dim)
    kc = k_new.astype(compute).transpose(2, 0, 1, 3)  # [Hkv, R, T, D]
    vc = v_new.astype(compute).transpose(2, 0, 1, 3)
    if padded_len != chunk_len:
        pad = ((0, 0), (0, 0), (0, padded_len - chunk_len), (0, 0))
        qh = jnp.pad(qh, ((0, 0), (0, 0), (0, (padded_len - chunk_len) * group), (0, 0)))
        kc, vc = jnp.pad(kc, pad), jnp.pad(vc, pad)

    # The prefix, tile by tile: kt pages per tile, as many tiles as the batch's longest real prefix needs.
    kt = k_tile // B
    n_static = -(-width // kt)
    table = page_table.astype(jnp.int32)
    if n_static * kt != width:
        table = jnp.pad(table, ((0, 0), (0, n_static * kt - width)))  # trash page 0, masked by position
    live_pages = jnp.minimum((jnp.max(prefix_len) + B - 1) // B, width)
    n_tiles = (live_pages + kt - 1) // kt

    def gather(pages, ids):  # pages [Hkv, P, B, D], ids [R, kt] -> [Hkv, R, kt*B, D]
        return pages[:, ids].reshape(num_kv_heads, num_rows, kt * B, head_dim).astype(compute)

    def scores(qt, k):
        return einsum_f32("hrqd,hrkd->hrqk", qt, k) * scale

    def update(carry, s, v):
        m, l, acc = carry
        m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows that have seen no key yet
        alpha = jnp.exp(m - m_safe)
        p = jnp.exp(s - m_safe)
        acc = acc * alpha + einsum_f32("hrqk,hrkd->hrqd", p.astype(v.dtype), v)
        return m_new, l * alpha + jnp.sum(p, axis=-1, keepdims=True), acc

    def prefix_tile(j, carry, qt):
        ids = lax.dynamic_slice_in_dim(table, j * kt, kt, axis=1)
        key_pos = j * k_tile + jnp.arange(k_tile, dtype=jnp.int32)
        visible = (key_pos[None, :] < prefix_len[:, None])[None, :, None, :]  # [1, R, 1, k_tile]
        s = jnp.where(visible, scores(qt, gather(k_pages, ids)), -jnp.inf)
        return update(carry, s, gather(v_pages, ids))

    # A tile's own keys: block-causal (bidirectional inside a block); tiles start on block boundaries.
    own_visible = (jnp.arange(q_tile) // B)[None, :] <= (jnp.arange(rows) // group // B)[:, None]

    def query_tile(i, qt):
        """(m, l, acc) of query tile ``i`` (``qt``: its rows) over the prefix, the chunk before it, itself."""
        carry = (jnp.full((num_kv_heads, num_rows, rows, 1), -jnp.inf, jnp.float32),
                 jnp.zeros((num_kv_heads, num_rows, rows, 1), jnp.float32),
                 jnp.zeros((num_kv_heads, num_rows, rows, head_dim), jnp.float32))
        if n_static == 1:  # one prefix tile at most: no loop (an empty prefix is fully masked)
            carry = prefix_tile(0, carry, qt)
        else:
            carry = lax.fori_loop(0, n_tiles, lambda j, c: prefix_tile(j, c, qt), carry)

        def chunk_tile(j, carry):  # the chunk's keys before this tile: earlier blocks, all visible
            k = lax.dynamic_slice_in_dim(kc, j * q_tile, q_tile, axis=2)
            v = lax.dynamic_slice_in_dim(vc, j * q_tile, q_tile, axis=2)
            return update(carry, scores(qt, k), v)

        if not isinstance(i, int) or i:
            carry = lax.fori_loop(0, i, chunk_tile, carry)
        k = lax.dynamic_slice_in_dim(kc, i * q_tile, q_tile, axis=2)
        v = lax.dynamic_slice_in_dim(vc, i * q_tile, q_tile, axis=2)
        _, l, acc = update(carry, jnp.where(own_visible, scores(qt, k), -jnp.inf), v)
        return acc / l

    if num_q_tiles <= UNROLL_Q_TILES:  # a few tiles: unrolled (measured faster than a loop)
        outs = [query_tile(i, qh[:, :, i * rows:(i + 1) * rows]) for i in range(num_q_tiles)]
        out = outs[0] if num_q_tiles == 1 else jnp.concatenate(outs, axis=2)
    else:  # one loop over the query tiles (one compiled body, whatever the chunk length)
        def body(i, out):
            qt = lax.dynamic_slice_in_dim(qh, i * rows, rows, axis=2)
            return lax.dynamic_update_slice_in_dim(out, query_tile(i, qt), i * rows, axis=2)

        out = lax.fori_loop(0, num_q_tiles, body,
                            jnp.zeros((num_kv_heads, num_rows, padded_len * group, head_dim), jnp.float32))
    out = out[:, :, :chunk_len * group].reshape(num_kv_heads, num_rows, chunk_len, group, head_dim)
    return out.transpose(1, 2, 0, 3, 4).reshape(num_rows, chunk_len, num_q_heads, head_dim).astype(q.dtype)

