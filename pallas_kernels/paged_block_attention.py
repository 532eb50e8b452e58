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

:func:`paged_block_attention` is the Pallas (Triton) kernel with the same signature, so one
``attention_fn`` slot serves denoise steps (``C = 1``) and multi-block prefill; ``get_attention_fn``
picks the implementation by backend name.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import DEFAULT_NUM_SMS, LOG2E, cdiv, compiler_params, next_pow2, resolve_backend


def paged_block_attention_reference(q, k_new, v_new, k_pages, v_pages, page_table, prefix_len, *, block_size):
    """Plain-JAX definition of paged block attention (also the engine's XLA path)."""
    num_rows, chunk_len, num_q_heads, head_dim = q.shape
    num_kv_heads = k_new.shape[2]
    group = num_q_heads // num_kv_heads
    width = page_table.shape[1]
    scale = head_dim ** -0.5

    k_prefix, v_prefix = gather_prefix(k_pages, v_pages, page_table)
    k_all = jnp.concatenate([k_prefix.astype(q.dtype), k_new.transpose(0, 2, 1, 3)], axis=2)
    v_all = jnp.concatenate([v_prefix.astype(q.dtype), v_new.transpose(0, 2, 1, 3)], axis=2)

    qg = q.reshape(num_rows, chunk_len, num_kv_heads, group, head_dim)
    scores = einsum_f32("rtkgd,rksd->rkgts", qg, k_all) * scale

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
    out = einsum_f32("rkgts,rksd->rtkgd", probs.astype(v_all.dtype), v_all)
    return out.reshape(num_rows, chunk_len, num_q_heads, head_dim).astype(q.dtype)


def gather_prefix(k_pages, v_pages, page_table):
    """Each row's prefix K and V through its page table: pages ``[Hkv, P, B, D]`` -> ``[R, Hkv, W*B, D]``."""
    num_rows, width = page_table.shape
    num_kv_heads, _, block_size, head_dim = k_pages.shape

    def gather(pages):
        return pages[:, page_table].transpose(1, 0, 2, 3, 4).reshape(num_rows, num_kv_heads, width * block_size,
                                                                      head_dim)

    return gather(k_pages), gather(v_pages)


def einsum_f32(spec, a, b):
    """einsum accumulating in float32. XLA:CPU cannot run a batched bf16 x bf16 -> f32 dot
    ("Unsupported element type for DotThunk"), so on CPU low-precision operands are upcast first
    (bf16 products are exact in f32, so the result is the same); GPUs keep the bf16 operands."""
    if jax.default_backend() == "cpu" and (a.dtype != jnp.float32 or b.dtype != jnp.float32):
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


# ----------------------------------------------------------------------------------------------
# Pallas (Triton) kernel
# ----------------------------------------------------------------------------------------------
#
# Why a kernel: the reference gathers every row's whole page table (width W, not the real prefix)
# into a dense [R, Hkv, W*B, D] copy and materialises [R, Hq, T, W*B+T] scores. The kernel reads
# only the pages a row really has, straight from the pool, once per GQA group, and never writes
# scores to memory.
#
# Layout of the work. One program per (row x query tile, kv head, kv split):
#   * Query rows are (token, head-in-group) pairs: the q tile is ``q[r, t0:t0+bq, h*G:(h+1)*G, :]``
#     viewed as ``[bq*G, D]``, so each K/V tile feeds all G heads of its group (GQA folding).
#   * The prefix is walked ``pages_per_tile`` pages at a time, gathered through a vector of page
#     ids (``k_pages_ref[ids]``). Pages past the row's prefix are redirected to page 0 (the trash
#     page, always valid memory) and their keys masked, so ragged rows never read out of bounds.
#   * The row's prefix tiles are split evenly over the ``kv_splits`` programs of the third grid
#     axis (per row, from its real length), and the last split also attends to the chunk's own
#     K/V with the block-causal mask ``key_block <= query_block``. Partial (o, m, l) of the splits
#     are merged in plain JAX (flash-decoding); with one split the kernel normalises in place.
#   * Online softmax in float32 with exp2 (scores pre-multiplied by log2(e)).


def _attention_kernel(plen_ref, pt_ref, q_ref, kn_ref, vn_ref, kp_ref, vp_ref, *out_refs,
                      block_size, block_q, group, pages_per_tile, block_kc, kv_splits, chunk_len,
                      num_q_tiles, width, qk_scale, upcast_dots):
    split_out = kv_splits > 1
    qi = pl.program_id(0) % num_q_tiles
    s = pl.program_id(2)
    rows = block_q * group
    head_dim = q_ref.shape[-1]
    block_k = pages_per_tile * block_size

    q = q_ref[...].reshape(rows, head_dim)
    plen = plen_ref[0]

    def dot(a, b):
        if upcast_dots:  # interpret mode: XLA:CPU has no bf16 x bf16 -> f32 dot (products are exact in f32)
            a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        return jnp.dot(a, b, preferred_element_type=jnp.float32)

    def update(carry, k, v, mask):
        m_prev, l_prev, acc = carry
        sc = dot(q, k.T) * qk_scale
        sc = jnp.where(mask, sc, -jnp.inf)
        m_new = jnp.maximum(m_prev, jnp.max(sc, axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows that have seen no key yet
        alpha = jnp.exp2(m_prev - m_safe)
        p = jnp.exp2(sc - m_safe[:, None])
        l_new = l_prev * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + dot(p.astype(v.dtype), v)
        return m_new, l_new, acc

    carry = (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32),
             jnp.zeros((rows, head_dim), jnp.float32))

    # --- the paged prefix: this split's share of the row's real tiles (an empty loop if none) ---
    n_pages = jnp.minimum((plen + block_size - 1) // block_size, width)
    n_tiles = (n_pages + pages_per_tile - 1) // pages_per_tile
    tiles_per_split = (n_tiles + kv_splits - 1) // kv_splits
    t_lo = s * tiles_per_split
    t_hi = jnp.minimum(n_tiles, t_lo + tiles_per_split)

    def prefix_body(t, carry):
        page_no = t * pages_per_tile + jnp.arange(pages_per_tile, dtype=jnp.int32)
        ids = pt_ref[pl.ds(t * pages_per_tile, pages_per_tile)]
        ids = jnp.where(page_no < n_pages, ids, 0)
        k = kp_ref[ids].reshape(block_k, head_dim).astype(q.dtype)
        v = vp_ref[ids].reshape(block_k, head_dim).astype(q.dtype)
        key_pos = t * block_k + jnp.arange(block_k, dtype=jnp.int32)
        mask = lax.broadcast_in_dim(key_pos < plen, (rows, block_k), (1,))
        return update(carry, k, v, mask)

    carry = lax.fori_loop(t_lo, t_hi, prefix_body, carry)

    # --- the chunk itself, block-causal (only the last split) ---
    def chunk_part(carry):
        q_tok0 = qi * block_q
        last_tok = jnp.minimum(q_tok0 + block_q, chunk_len) - 1
        kv_end = jnp.minimum(chunk_len, (last_tok // block_size + 1) * block_size)
        n_kc = (kv_end + block_kc - 1) // block_kc
        q_blk = (q_tok0 + jnp.arange(rows, dtype=jnp.int32) // group) // block_size

        def body(j, carry):
            k = kn_ref[pl.ds(j * block_kc, block_kc), :]
            v = vn_ref[pl.ds(j * block_kc, block_kc), :]
            k_blk = (j * block_kc + jnp.arange(block_kc, dtype=jnp.int32)) // block_size
            mask = (lax.broadcast_in_dim(k_blk, (rows, block_kc), (1,))
                    <= lax.broadcast_in_dim(q_blk, (rows, block_kc), (0,)))
            return update(carry, k, v, mask)

        return lax.fori_loop(0, n_kc, body, carry)

    if kv_splits == 1:
        carry = chunk_part(carry)
    else:
        carry = lax.cond(s == kv_splits - 1, chunk_part, lambda c: c, carry)

    m, l, acc = carry
    if split_out:
        o_ref, m_ref, l_ref = out_refs
        # Normalised partials in the output dtype (half the bytes of f32 in bf16); an empty split
        # (l = 0) writes zeros and gets zero weight in the merge.
        o = jnp.where(lax.broadcast_in_dim(l > 0, (rows, head_dim), (0,)), acc / l[:, None], 0.0)
        o_ref[...] = o.reshape(block_q, group, head_dim).astype(o_ref.dtype)
        m_ref[...] = m.reshape(block_q, group)
        l_ref[...] = l.reshape(block_q, group)
    else:
        (o_ref,) = out_refs
        o_ref[...] = (acc / l[:, None]).reshape(block_q, group, head_dim).astype(o_ref.dtype)


def attention_tiles(num_rows, chunk_len, num_q_heads, num_kv_heads, head_dim, width, *, block_size,
                    block_q=None, block_k=None, kv_splits=None, num_warps=None, num_stages=None,
                    num_sms=DEFAULT_NUM_SMS):
    """The tile sizes the kernel will use (defaults documented in :func:`paged_block_attention`)."""
    group_p = next_pow2(num_q_heads // num_kv_heads)
    head_dim_p = next_pow2(max(head_dim, 16))
    if block_q is None:
        max_rows = 128 if head_dim_p <= 128 else 64
        block_q = max(1, min(next_pow2(chunk_len), max_rows // group_p))
    block_q = max(next_pow2(block_q), cdiv(16, group_p))  # >= 16 rows: tl.dot's minimum
    rows = block_q * group_p
    if block_k is None:
        block_k = 128 if rows <= 64 else 64
    block_k = max(next_pow2(block_k), 16)
    pages_per_tile = max(1, block_k // block_size)
    block_kc = max(16, min(block_k, next_pow2(chunk_len)))
    num_q_tiles = cdiv(chunk_len, block_q)
    if kv_splits is None:
        base = num_rows * num_q_tiles * num_kv_heads
        max_tiles = cdiv(width, pages_per_tile)
        kv_splits = 1
        if base < num_sms:  # small batch: split the prefix so ~2 programs per SM run
            kv_splits = max(1, min(next_pow2(cdiv(2 * num_sms, base)), max_tiles // 2))
    if num_warps is None:
        num_warps = 4 if rows <= 64 else 8
    if num_stages is None:
        num_stages = 2
    return dict(block_q=block_q, group_p=group_p, head_dim_p=head_dim_p, pages_per_tile=pages_per_tile,
                block_kc=block_kc, num_q_tiles=num_q_tiles, kv_splits=int(kv_splits),
                num_warps=num_warps, num_stages=num_stages)


@functools.partial(jax.jit, static_argnames=("block_size", "interpret", "block_q", "block_k", "kv_splits",
                                             "num_warps", "num_stages"))
def paged_block_attention(q, k_new, v_new, k_pages, v_pages, page_table, prefix_len, *, block_size,
                          interpret=False, block_q=None, block_k=None, kv_splits=None, num_warps=None,
                          num_stages=None):
    """Pallas (Triton) paged block attention; same signature and semantics as the reference.

    Tile parameters (all static; ``None`` = the default):

    * ``block_q``: chunk tokens per program. Default: ``128 // G`` rows-worth (``64 // G`` for head
      dim > 128), at least 16 rows, at most the chunk. With SDAR-1.7B (G=2) and B=32 a denoise
      step is one program per (row, kv head) holding 64 query rows.
    * ``block_k``: keys per inner step (a whole number of pages; ``>= 16``). Default 128 when the
      program holds <= 64 query rows, else 64 (register pressure of the [rows, keys] score tile).
    * ``kv_splits``: programs sharing one row's prefix (split-K). Default: 1 when
      ``rows x q tiles x kv heads`` already fills the 132 SMs, else enough for ~2 programs per SM,
      keeping at least two key tiles per split (of the page-table width).
    * ``num_warps`` (4 for <= 64 rows, else 8), ``num_stages`` (2).

    Head dims that are not a power of two are padded with zeros (the pool too: a full copy, so
    keep head dims a power of two on the GPU; every Qwen3/SDAR model has 128).
    """
    num_rows, chunk_len, num_q_heads, head_dim = q.shape
    num_kv_heads = k_new.shape[2]
    group = num_q_heads // num_kv_heads
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads=} is not a multiple of {num_kv_heads=}")
    if chunk_len % block_size:
        raise ValueError(f"chunk length {chunk_len} is not a multiple of block_size {block_size}")
    if k_pages.shape[2] != block_size:
        raise ValueError(f"page size {k_pages.shape[2]} != block_size {block_size}")
    width = page_table.shape[1]
    cfg = attention_tiles(num_rows, chunk_len, num_q_heads, num_kv_heads, head_dim, width,
                          block_size=block_size, block_q=block_q, block_k=block_k, kv_splits=kv_splits,
                          num_warps=num_warps, num_stages=num_stages)
    bq, gp, dp = cfg["block_q"], cfg["group_p"], cfg["head_dim_p"]
    ppt, bkc, nq, ks = cfg["pages_per_tile"], cfg["block_kc"], cfg["num_q_tiles"], cfg["kv_splits"]

    # Pad to the kernel's power-of-two shapes (q and the chunk are small; the pool only if D is odd).
    q_len = nq * bq
    k_len = cdiv(chunk_len, bkc) * bkc
    qp = q.reshape(num_rows, chunk_len, num_kv_heads, group, head_dim)
    qp = jnp.pad(qp, ((0, 0), (0, q_len - chunk_len), (0, 0), (0, gp - group), (0, dp - head_dim)))
    kn = jnp.pad(k_new.astype(q.dtype), ((0, 0), (0, k_len - chunk_len), (0, 0), (0, dp - head_dim)))
    vn = jnp.pad(v_new.astype(q.dtype), ((0, 0), (0, k_len - chunk_len), (0, 0), (0, dp - head_dim)))
    if dp != head_dim:
        pad4 = ((0, 0), (0, 0), (0, 0), (0, dp - head_dim))
        k_pages, v_pages = jnp.pad(k_pages, pad4), jnp.pad(v_pages, pad4)
    w_pad = cdiv(width, ppt) * ppt
    pt = jnp.pad(page_table.astype(jnp.int32), ((0, 0), (0, w_pad - width)))
    plen = prefix_len.astype(jnp.int32)
    num_pages = k_pages.shape[1]

    kernel = functools.partial(
        _attention_kernel, block_size=block_size, block_q=bq, group=gp, pages_per_tile=ppt, block_kc=bkc,
        kv_splits=ks, chunk_len=chunk_len, num_q_tiles=nq, width=width, qk_scale=float(head_dim ** -0.5 * LOG2E),
        upcast_dots=bool(interpret) and q.dtype != jnp.float32)

    in_specs = [
        pl.BlockSpec((1,), lambda i, h, s: (i // nq,)),                                   # prefix_len
        pl.BlockSpec((None, w_pad), lambda i, h, s: (i // nq, 0)),                        # page table
        pl.BlockSpec((None, bq, None, gp, dp), lambda i, h, s: (i // nq, i % nq, h, 0, 0)),  # q tile
        pl.BlockSpec((None, k_len, None, dp), lambda i, h, s: (i // nq, 0, h, 0)),        # chunk K
        pl.BlockSpec((None, k_len, None, dp), lambda i, h, s: (i // nq, 0, h, 0)),        # chunk V
        pl.BlockSpec((None, num_pages, block_size, dp), lambda i, h, s: (h, 0, 0, 0)),    # K pool (pointer)
        pl.BlockSpec((None, num_pages, block_size, dp), lambda i, h, s: (h, 0, 0, 0)),    # V pool (pointer)
    ]
    o_shape = (num_rows, q_len, num_kv_heads, gp, dp)
    if ks == 1:
        out_shape = jax.ShapeDtypeStruct(o_shape, q.dtype)
        out_specs = pl.BlockSpec((None, bq, None, gp, dp), lambda i, h, s: (i // nq, i % nq, h, 0, 0))
    else:
        out_shape = [jax.ShapeDtypeStruct((ks, *o_shape), q.dtype),
                     jax.ShapeDtypeStruct((ks, *o_shape[:-1]), jnp.float32),
                     jax.ShapeDtypeStruct((ks, *o_shape[:-1]), jnp.float32)]
        out_specs = [pl.BlockSpec((None, None, bq, None, gp, dp), lambda i, h, s: (s, i // nq, i % nq, h, 0, 0)),
                     pl.BlockSpec((None, None, bq, None, gp), lambda i, h, s: (s, i // nq, i % nq, h, 0)),
                     pl.BlockSpec((None, None, bq, None, gp), lambda i, h, s: (s, i // nq, i % nq, h, 0))]

    out = pl.pallas_call(
        kernel,
        grid=(num_rows * nq, num_kv_heads, ks),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=compiler_params(cfg["num_warps"], cfg["num_stages"]),
        interpret=interpret,
        name=f"paged_block_attention_B{block_size}_q{bq}x{gp}_k{ppt * block_size}_s{ks}",
    )(plen, pt, qp, kn, vn, k_pages, v_pages)

    if ks == 1:
        o = out
    else:
        o = merge_attention_splits(*out).astype(q.dtype)
    return o[:, :chunk_len, :, :group, :head_dim].reshape(num_rows, chunk_len, num_q_heads, head_dim)


def merge_attention_splits(o, m, l):
    """Combine split-K partials: ``o [S, ..., D]`` normalised per split, ``m, l [S, ...]`` (running
    max in log2 units and sum of ``exp2(score - m)``). Returns float32 ``[..., D]``."""
    m_max = jnp.max(m, axis=0)
    # As jax's decode_attention: without the barrier XLA may fuse the combine into NaNs on the GPU.
    m_max = lax.optimization_barrier(m_max)
    m_safe = jnp.where(m_max == -jnp.inf, 0.0, m_max)
    w = jnp.exp2(m - m_safe[None]) * l  # each split's share of the total softmax mass
    return jnp.sum(w[..., None] * o.astype(jnp.float32), axis=0) / jnp.sum(w, axis=0)[..., None]


def get_attention_fn(backend: str = "auto", **tiles):
    """An ``attention_fn`` with the reference's signature for ``backend`` in
    ``pallas | pallas_interpret | xla | auto`` (auto: Pallas on GPU, XLA elsewhere).
    ``tiles`` are passed to :func:`paged_block_attention` (ignored by ``xla``)."""
    backend = resolve_backend(backend)
    if backend == "xla":
        return paged_block_attention_reference
    return functools.partial(paged_block_attention, interpret=(backend == "pallas_interpret"), **tiles)
