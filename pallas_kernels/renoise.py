"""Gemma4Renoise's per-step statistics in one pass over the vocabulary: argmax, entropy, a sample and the
self-conditioning embedding of every canvas position, without ``[positions x vocab]`` logits in memory.

Semantics (:func:`renoise_stats_reference` defines them; the others must match it):

* ``hidden`` ``[N, H]``: the decoder's final hidden states; ``head``: the LM head, ``[V, H]`` (a tied embedding,
  ``vocab_major=True``) or ``[H, V]``; ``embed`` ``[V, H]``: the decoder embedding the soft embedding averages.
* processed logits ``z = cap * tanh(hidden @ head / cap) / T`` (``cap``: the final soft cap, None: none; ``T``:
  the row's temperature ``temperature [N]``, > 0), in float32.
* ``argmax``: the lowest index of ``max z``; ``logprob``: its log-probability ``max z - logsumexp z``;
  ``entropy``: ``logsumexp z - sum softmax(z) z`` (nats);
* ``sample``: ``argmax(z + g)`` with ``g`` Gumbel noise from a counter-based hash of the position's ``key``
  (uint32) and the token id: a draw from ``softmax(z)`` that depends on the key and nothing else (batch, order,
  tiling, device);
* ``soft``: ``softmax(z) @ embed * embed_scale`` ``[N, H]`` float32 (transformers casts the probabilities to the
  embedding dtype first: the difference is bf16 rounding).

Three implementations: :func:`renoise_stats_reference` (materialises the logits: the definition),
:func:`renoise_stats_streaming` (plain JAX, a loop over vocabulary tiles with running max / sum-exp /
exp-weighted logit sum / Gumbel winner / rescaled embedding accumulator: the XLA path, ``[N, H]`` state only) and
:func:`renoise_stats_pallas` (the same loop as a Triton kernel; grid ``(row tiles, hidden tiles)``: each program
keeps a ``[block_n, block_h]`` slice of the embedding accumulator on chip and recomputes the logits tile for
its slice). Partial results of vocabulary shards merge with :func:`merge_renoise_partials` (tensor parallelism:
each shard streams its slice of the head and the embedding).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import renoise_adjust as adjust_lib
from pallas_kernels._common import cdiv, compiler_params, next_pow2, pltriton, resolve_backend
from pallas_kernels.renoise_adjust import Adjust

_INT_MAX = jnp.iinfo(jnp.int32).max
GOLDEN = 0x9E3779B9


class RenoiseStats(NamedTuple):
    argmax: jax.Array  # [N] int32
    sample: jax.Array  # [N] int32
    entropy: jax.Array  # [N] float32
    logprob: jax.Array  # [N] float32: the argmax token's
    soft: jax.Array  # [N, H] float32
    top_logprob: jax.Array  # [N, K] float32: the K most likely tokens' log-probabilities (K = top_k; 0: none)
    top_ids: jax.Array  # [N, K] int32


# ----------------------------------------------------------------------------------------------
# Counter-based randomness: uint32 hashes, the same arithmetic in JAX and in the kernel
# ----------------------------------------------------------------------------------------------

def mix32(x):
    """A uint32 -> uint32 bijective hash (the "lowbias32" finaliser): consecutive inputs give independent bits."""
    x = x.astype(jnp.uint32)
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def draw_key(seed, canvas, step, position, stream: int = 0):
    """The uint32 key of one draw: request ``seed``, its canvas index, denoising step, position in the canvas and
    a stream (0: the step's sample, 1: re-noise tokens, 2: the initial canvas). Broadcasts."""
    x = mix32(jnp.asarray(seed).astype(jnp.uint32) ^ jnp.uint32(0x5BD1E995 * (stream + 1) & 0xFFFFFFFF))
    for part in (canvas, step, position):
        x = mix32(x ^ mix32(jnp.asarray(part).astype(jnp.uint32) + jnp.uint32(GOLDEN)))
    return x


def uniform01(bits):
    """uint32 bits -> a float32 uniform in (0, 1) (24 bits, never 0 or 1)."""
    return ((bits >> 8).astype(jnp.float32) + 0.5) * (1.0 / (1 << 24))


def uniform_tokens(keys, vocab: int):
    """A uniform token id in ``[0, vocab)`` per key (the initial canvas and re-noise draws)."""
    return jnp.minimum((uniform01(mix32(keys)) * vocab).astype(jnp.int32), vocab - 1)


def gumbel(keys, cols):
    """Gumbel noise ``[N, T]`` for positions' ``keys [N]`` and token ids ``cols [T]``."""
    bits = mix32(keys[:, None].astype(jnp.uint32) ^ mix32(cols[None, :].astype(jnp.uint32) * jnp.uint32(GOLDEN)))
    return -jnp.log(-jnp.log(uniform01(bits)))


def softcap_logits(raw, softcap):
    z = raw.astype(jnp.float32)
    if softcap is not None:
        z = softcap * jnp.tanh(z / softcap)
    return z


def process_logits(raw, temperature, softcap, adjust=None, v0=0, row_len: int = 1):
    """Soft cap, then the rows' adjustments (``adjust``: :class:`~pallas_kernels.renoise_adjust.Adjust`, for
    token ids from ``v0``), then the temperature."""
    z = softcap_logits(raw, softcap)
    if adjust is not None:
        z = adjust_lib.apply_tile(z, adjust, v0, row_len)
    return z / temperature[:, None]


# ----------------------------------------------------------------------------------------------
# Reference: the logits materialised
# ----------------------------------------------------------------------------------------------

def _logits(hidden, head, vocab_major):
    if vocab_major:
        return lax.dot_general(hidden, head, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return jnp.dot(hidden, head, preferred_element_type=jnp.float32)


def renoise_stats_reference(hidden, head, embed, temperature, keys, *, softcap=None, vocab_major=True,
                            embed_scale=1.0, adjust: Adjust | None = None, row_len: int = 1,
                            top_k: int = 0) -> RenoiseStats:
    """The definition (module doc). ``adjust``: per-row tables (``row_len`` positions per row;
    :mod:`pallas_kernels.renoise_adjust`) applied between the soft cap and the temperature; ``top_k``: also the
    ``top_k`` most likely tokens per position (values descending, ties: the lowest id)."""
    z = process_logits(_logits(hidden, head, vocab_major), temperature, softcap, adjust, 0, row_len)
    cols = jnp.arange(z.shape[-1], dtype=jnp.int32)
    top = jnp.max(z, axis=-1)
    argmax = jnp.min(jnp.where(z == top[:, None], cols, _INT_MAX), axis=-1).astype(jnp.int32)
    lse = top + jnp.log(jnp.sum(jnp.exp(z - top[:, None]), axis=-1))
    p = jnp.exp(z - lse[:, None])
    scores = z + gumbel(keys, cols)
    best = jnp.max(scores, axis=-1)
    sample = jnp.min(jnp.where(scores == best[:, None], cols, _INT_MAX), axis=-1).astype(jnp.int32)
    soft = jnp.dot(p, embed.astype(jnp.float32), preferred_element_type=jnp.float32) * embed_scale
    top_v, top_i = lax.top_k(z, top_k) if top_k else adjust_lib.topk_init(z.shape[0], 0)
    entropy = lse - jnp.sum(jnp.where(p > 0, p * z, 0.0), axis=-1)
    return RenoiseStats(argmax, sample, entropy, top - lse, soft, top_v - lse[:, None], top_i.astype(jnp.int32))


# ----------------------------------------------------------------------------------------------
# Partials: what a pass over a vocabulary slice leaves, and how slices merge
# ----------------------------------------------------------------------------------------------
#
# Over a slice: m = max z, s = sum e^(z - m), w = sum e^(z - m) z, a = lowest index of m, b = max (z + g),
# k = lowest index of b, acc = sum e^(z - m) E_v. Two slices merge with m = max(m1, m2), every e^-weighted
# sum rescaled by e^(m_i - m) and added, a / k the lowest index among the slices attaining m / b. Then
# lse = m + log s, entropy = lse - w / s, soft = acc / s.

class Partials(NamedTuple):
    m: jax.Array
    s: jax.Array
    w: jax.Array
    a: jax.Array
    b: jax.Array
    k: jax.Array
    acc: jax.Array
    tv: jax.Array  # [N, K]: the running top-k values (processed logits), descending
    ti: jax.Array  # [N, K]: their token ids


def merge_renoise_partials(parts: Partials, axis: int = 0) -> Partials:
    """Merge partials stacked along ``axis`` (vocabulary splits or shards; indices already global)."""
    m = jnp.max(parts.m, axis=axis)
    m_b = jnp.expand_dims(m, axis)
    scale = jnp.exp(parts.m - jnp.where(m_b == -jnp.inf, 0.0, m_b))
    b = jnp.max(parts.b, axis=axis)
    tv, ti = (adjust_lib.topk_merge_shards(parts.tv, parts.ti, axis) if parts.tv.shape[-1]
              else (jnp.take(parts.tv, 0, axis), jnp.take(parts.ti, 0, axis)))
    return Partials(
        m, jnp.sum(parts.s * scale, axis=axis), jnp.sum(parts.w * scale, axis=axis),
        jnp.min(jnp.where(parts.m == m_b, parts.a, _INT_MAX), axis=axis).astype(jnp.int32),
        b, jnp.min(jnp.where(parts.b == jnp.expand_dims(b, axis), parts.k, _INT_MAX), axis=axis).astype(jnp.int32),
        jnp.sum(parts.acc * jnp.expand_dims(scale, -1), axis=axis), tv, ti)


def finalize(parts: Partials, embed_scale=1.0) -> RenoiseStats:
    lse = parts.m + jnp.log(parts.s)
    return RenoiseStats(parts.a, parts.k, lse - parts.w / parts.s, parts.m - lse,
                        parts.acc / parts.s[:, None] * embed_scale, parts.tv - lse[:, None], parts.ti)


def _fold(carry: Partials, z, g, cols, e_tile, topk=adjust_lib.topk_merge):
    """Fold a logits tile ``z [N, T]`` (-inf where no token), its noise ``g`` and the embedding rows
    ``e_tile [T, H']`` into the running partials (``topk``: how the running top-k list takes the tile)."""
    t_max = jnp.max(z, axis=1)
    m = jnp.maximum(carry.m, t_max)
    m_safe = jnp.where(m == -jnp.inf, 0.0, m)
    alpha = jnp.exp(carry.m - m_safe)
    e = jnp.exp(z - m_safe[:, None])
    z_finite = jnp.where(e > 0, z, 0.0)
    t_arg = jnp.min(jnp.where(z == t_max[:, None], cols[None, :], _INT_MAX), axis=1)
    scores = z + g
    t_best = jnp.max(scores, axis=1)
    t_k = jnp.min(jnp.where(scores == t_best[:, None], cols[None, :], _INT_MAX), axis=1)
    tv, ti = topk(carry.tv, carry.ti, z, cols) if carry.tv.shape[1] else (carry.tv, carry.ti)
    return Partials(
        m, carry.s * alpha + jnp.sum(e, axis=1), carry.w * alpha + jnp.sum(e * z_finite, axis=1),
        jnp.where(t_max > carry.m, t_arg, carry.a), jnp.maximum(carry.b, t_best),
        jnp.where(t_best > carry.b, t_k, carry.k),
        carry.acc * alpha[:, None] + jnp.dot(e, e_tile, preferred_element_type=jnp.float32), tv, ti)


def _init(n: int, h: int, top_k: int = 0) -> Partials:
    ninf = jnp.full((n,), -jnp.inf, jnp.float32)
    zero = jnp.zeros((n,), jnp.float32)
    izero = jnp.zeros((n,), jnp.int32)
    return Partials(ninf, zero, zero, izero, ninf, izero, jnp.zeros((n, h), jnp.float32),
                    *adjust_lib.topk_init(n, top_k))


# ----------------------------------------------------------------------------------------------
# Streaming (plain JAX): the XLA path
# ----------------------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("softcap", "vocab_major", "block_v", "partials", "row_len", "top_k"))
def renoise_stats_streaming(hidden, head, embed, temperature, keys, *, softcap=None, vocab_major=True,
                            embed_scale=1.0, block_v: int = 2048, partials: bool = False, vocab_offset=0,
                            adjust: Adjust | None = None, row_len: int = 1, top_k: int = 0):
    """The reference's results, one vocabulary tile of ``block_v`` tokens at a time (state ``[N, H]``; with
    ``top_k``, ``[N, top_k]`` more; ``adjust``: each row's table scattered into its ``[rows, block_v]`` slice).
    ``partials=True`` returns the unfinalised :class:`Partials` (a shard's, for :func:`merge_renoise_partials`);
    a vocabulary shard passes its slices of ``head`` / ``embed`` and their first token id ``vocab_offset`` (its
    noise and indices are then the global ones)."""
    n, h = hidden.shape
    vocab = embed.shape[0]
    block_v = min(block_v, vocab)
    n_tiles = cdiv(vocab, block_v)
    pad = n_tiles * block_v - vocab
    head_p = jnp.pad(head, ((0, pad), (0, 0)) if vocab_major else ((0, 0), (0, pad)))
    embed_p = jnp.pad(embed, ((0, pad), (0, 0)))

    def body(t, carry):
        v0 = t * block_v
        cols = v0 + jnp.arange(block_v, dtype=jnp.int32)
        if vocab_major:
            w = lax.dynamic_slice_in_dim(head_p, v0, block_v, axis=0)
        else:
            w = lax.dynamic_slice_in_dim(head_p, v0, block_v, axis=1)
        z = process_logits(_logits(hidden, w, vocab_major), temperature, softcap, adjust, v0 + vocab_offset,
                           row_len)
        z = jnp.where((cols < vocab)[None, :], z, -jnp.inf)
        e_tile = lax.dynamic_slice_in_dim(embed_p, v0, block_v, axis=0).astype(jnp.float32)
        ids = cols + vocab_offset
        return _fold(carry, z, gumbel(keys, ids), ids, e_tile)

    out = lax.fori_loop(0, n_tiles, body, _init(n, h, top_k))
    return out if partials else finalize(out, embed_scale)


# ----------------------------------------------------------------------------------------------
# Pallas (Triton) kernel
# ----------------------------------------------------------------------------------------------

def _renoise_kernel(*refs, vocab, hidden_dim, block_n, block_v, block_k, block_h, vocab_major, softcap,
                    upcast_dots, adjusted, row_len, top_k, top_width):
    n_in = 11 if adjusted else 6
    key_ref, temp_ref, h_ref, w_ref, e_ref, off_ref = refs[:6]
    m_ref, s_ref, w_out, a_ref, b_ref, k_ref, acc_ref = refs[n_in:n_in + 7]
    ri, hi = pl.program_id(0), pl.program_id(1)
    keys = key_ref[...]
    temps = temp_ref[...]
    offset = jnp.min(off_ref[...])  # the first token id of this vocabulary shard (0: the whole vocabulary)
    n_k = cdiv(hidden_dim, block_k)
    k_tail = hidden_dim % block_k != 0
    h0 = hi * block_h
    hcols_out = h0 + jnp.arange(block_h, dtype=jnp.int32)
    hout_ok = hcols_out < hidden_dim
    topk = functools.partial(adjust_lib.topk_merge_iter, rounds=top_k)

    def dot(a, b):
        if upcast_dots:  # interpret mode: XLA:CPU has no bf16 x bf16 -> f32 dot
            a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        return jnp.dot(a, b, preferred_element_type=jnp.float32)

    def adjust(z, t, cols):
        """This tile's entries of the rows whose positions the program holds (one row, or several short ones)."""
        ids_ref, rep_ref, add_ref, until_ref, bounds_ref = refs[6:11]
        gpos = ri * block_n + jnp.arange(block_n, dtype=jnp.int32)
        pos, prow = gpos % row_len, gpos // row_len
        row0 = (ri * block_n) // row_len
        for q in range(max(1, block_n // row_len)):
            row = row0 + q

            def load(j, row=row):
                return ids_ref[row, j], rep_ref[row, j], add_ref[row, j], until_ref[row, j]

            z = adjust_lib.apply_entries(z, cols, pos, prow == row, bounds_ref[row, t], bounds_ref[row, t + 1], load)
        return z

    def vocab_body(t, carry):
        v0 = t * block_v
        cols = v0 + jnp.arange(block_v, dtype=jnp.int32)
        col_ok = cols < vocab

        def k_body(kk, acc):
            k0 = kk * block_k
            kcols = k0 + jnp.arange(block_k, dtype=jnp.int32)
            kmask = kcols < hidden_dim
            x = pltriton.load(h_ref.at[:, pl.ds(k0, block_k)],
                              mask=lax.broadcast_in_dim(kmask, (block_n, block_k), (1,)), other=0) if k_tail \
                else h_ref[:, pl.ds(k0, block_k)]
            if vocab_major:
                wmask = lax.broadcast_in_dim(col_ok, (block_v, block_k), (0,)) & \
                    lax.broadcast_in_dim(kmask, (block_v, block_k), (1,))
                w = pltriton.load(w_ref.at[pl.ds(v0, block_v), pl.ds(k0, block_k)], mask=wmask, other=0)
                return acc + dot(x, w.T)
            wmask = lax.broadcast_in_dim(col_ok, (block_k, block_v), (1,)) & \
                lax.broadcast_in_dim(kmask, (block_k, block_v), (0,))
            w = pltriton.load(w_ref.at[pl.ds(k0, block_k), pl.ds(v0, block_v)], mask=wmask, other=0)
            return acc + dot(x, w)

        raw = lax.fori_loop(0, n_k, k_body, jnp.zeros((block_n, block_v), jnp.float32))
        z = raw
        if softcap is not None:
            z = softcap * jnp.tanh(z / softcap)
        ids = cols + offset  # global token ids: the noise, the indices and the tables use them
        if adjusted:
            z = adjust(z, t, ids)
        z = z / temps[:, None]
        z = jnp.where(lax.broadcast_in_dim(col_ok, (block_n, block_v), (1,)), z, -jnp.inf)
        emask = lax.broadcast_in_dim(col_ok, (block_v, block_h), (0,)) & \
            lax.broadcast_in_dim(hout_ok, (block_v, block_h), (1,))
        e_tile = pltriton.load(e_ref.at[pl.ds(v0, block_v), pl.ds(h0, block_h)], mask=emask, other=0)
        return _fold(carry, z, gumbel(keys, ids), ids, e_tile.astype(jnp.float32), topk)

    out = lax.fori_loop(0, cdiv(vocab, block_v), vocab_body, _init(block_n, block_h, top_width))
    m_ref[...], s_ref[...], w_out[...] = out.m, out.s, out.w
    a_ref[...], b_ref[...], k_ref[...] = out.a, out.b, out.k
    acc_ref[...] = out.acc
    if top_k:
        tv_ref, ti_ref = refs[n_in + 7:n_in + 9]
        tv_ref[...], ti_ref[...] = out.tv, out.ti


def _canvas_layout(n: int, row_len: int, block_n: int) -> int:
    """The padded row length of the kernel's layout with tables: a program's positions lie in one row
    (``row_len`` a multiple of ``block_n``) or in whole rows (a power of two dividing ``block_n``)."""
    if n % row_len:
        raise ValueError(f"{n} positions are not whole rows of {row_len}")
    return cdiv(row_len, block_n) * block_n if row_len >= block_n else next_pow2(row_len)


def _relayout(x, rows: int, row_len: int, padded: int, fill=0):
    """``[rows * row_len, ...]`` -> ``[rows * padded, ...]`` (each row padded at its end)."""
    if padded == row_len:
        return x
    x = x.reshape((rows, row_len) + x.shape[1:])
    x = jnp.pad(x, ((0, 0), (0, padded - row_len)) + ((0, 0),) * (x.ndim - 2), constant_values=fill)
    return x.reshape((rows * padded,) + x.shape[2:])


def _unlayout(x, rows: int, row_len: int, padded: int):
    if padded == row_len:
        return x[:rows * row_len]
    return x[:rows * padded].reshape((rows, padded) + x.shape[1:])[:, :row_len].reshape((rows * row_len,) + x.shape[1:])


@functools.partial(jax.jit, static_argnames=("softcap", "vocab_major", "interpret", "block_n", "block_v",
                                             "block_k", "block_h", "num_warps", "num_stages", "partials", "row_len",
                                             "top_k"))
def renoise_stats_pallas(hidden, head, embed, temperature, keys, *, softcap=None, vocab_major=True, embed_scale=1.0,
                         interpret=False, block_n=16, block_v=64, block_k=64, block_h=None, num_warps=4,
                         num_stages=2, partials: bool = False, vocab_offset=0, adjust: Adjust | None = None,
                         row_len: int = 1, top_k: int = 0):
    """The fused pass as a Triton kernel (``interpret=True``: the same body as XLA ops, any platform).

    Grid ``(row tiles of block_n, hidden tiles of block_h)``: a program loops over the whole vocabulary, computes
    each ``[block_n, block_v]`` logits tile (the head contracted in ``block_k`` steps), folds it into its running
    partials and its ``[block_n, block_h]`` slice of the embedding accumulator. ``block_h`` defaults to the hidden
    size's next power of two up to 1024 (fewer hidden tiles, fewer logits recomputed).

    ``adjust`` (rows of ``row_len`` positions): positions are laid out so that a program holds one row's positions
    or whole rows (:func:`_canvas_layout`); per tile, it walks the entries of its rows' sorted tables that fall in
    the tile (bounds from a ``searchsorted`` before the kernel). ``top_k``: a running list per position, merged
    with each tile by max-extraction (:func:`~pallas_kernels.renoise_adjust.topk_merge_iter`). ``vocab_offset``
    (``partials=True``, a vocabulary shard under ``shard_map``): the first token id of this shard's slices of
    ``head`` / ``embed``; its noise, indices and tables are then the global ones."""
    n, h = hidden.shape
    vocab = embed.shape[0]
    block_n = max(16, next_pow2(min(block_n, max(n, 1))))
    rows = padded = 0
    if adjust is not None:
        rows, padded = n // row_len, _canvas_layout(n, row_len, block_n)
        hidden = _relayout(hidden, rows, row_len, padded)
        temperature = _relayout(temperature, rows, row_len, padded, 1.0)
        keys = _relayout(keys, rows, row_len, padded)
    n_in = hidden.shape[0]
    block_h = block_h or min(1024, next_pow2(h))
    n_rt, n_ht = cdiv(n_in, block_n), cdiv(h, block_h)
    n_pad = n_rt * block_n
    pad = n_pad - n_in
    hidden_p = jnp.pad(hidden, ((0, pad), (0, 0)))
    temps = jnp.pad(temperature.astype(jnp.float32), (0, pad), constant_values=1.0)
    keys_p = jnp.pad(keys.astype(jnp.uint32), (0, pad))
    top_width = next_pow2(top_k) if top_k else 0
    kernel = functools.partial(
        _renoise_kernel, vocab=vocab, hidden_dim=h, block_n=block_n, block_v=block_v, block_k=block_k,
        block_h=block_h, vocab_major=vocab_major, softcap=softcap,
        upcast_dots=bool(interpret) and (hidden.dtype != jnp.float32 or head.dtype != jnp.float32),
        adjusted=adjust is not None, row_len=padded or 1, top_k=top_k, top_width=top_width)
    whole = lambda a: pl.BlockSpec(a.shape, lambda i, j: (0,) * a.ndim)  # noqa: E731
    offsets = jnp.full((n_pad,), vocab_offset, jnp.int32)  # per row tile, like the keys (no scalar operand)
    operands = [keys_p, temps, hidden_p, head, embed, offsets]
    in_specs = [pl.BlockSpec((block_n,), lambda i, j: (i,)), pl.BlockSpec((block_n,), lambda i, j: (i,)),
                pl.BlockSpec((block_n, h), lambda i, j: (i, 0)), whole(head), whole(embed),
                pl.BlockSpec((block_n,), lambda i, j: (i,))]
    if adjust is not None:
        table_rows = n_pad // padded if padded <= block_n else rows
        extra = table_rows - adjust.ids.shape[0]
        padded_adj = adjust_lib.Adjust(*(jnp.pad(x, ((0, extra), (0, 0)), constant_values=fill) for x, fill in zip(
            adjust, (adjust_lib.PAD_ID, 1.0, 0.0, 0))))
        bounds = adjust_lib.tile_bounds(padded_adj.ids, cdiv(vocab, block_v), block_v, vocab_offset)
        operands += [*padded_adj, bounds]
        in_specs += [whole(x) for x in (*padded_adj, bounds)]
    row = pl.BlockSpec((None, block_n), lambda i, j: (j, i))
    vec = jax.ShapeDtypeStruct((n_ht, n_pad), jnp.float32)
    ivec = jax.ShapeDtypeStruct((n_ht, n_pad), jnp.int32)
    out_specs = [row, row, row, row, row, row, pl.BlockSpec((block_n, block_h), lambda i, j: (i, j))]
    out_shape = [vec, vec, vec, ivec, vec, ivec, jax.ShapeDtypeStruct((n_pad, n_ht * block_h), jnp.float32)]
    if top_k:
        top = pl.BlockSpec((None, block_n, top_width), lambda i, j: (j, i, 0))
        out_specs += [top, top]
        out_shape += [jax.ShapeDtypeStruct((n_ht, n_pad, top_width), dt) for dt in (jnp.float32, jnp.int32)]
    res = pl.pallas_call(
        kernel,
        grid=(n_rt, n_ht),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=compiler_params(num_warps, num_stages),
        interpret=interpret,
        name=f"renoise_n{block_n}_v{block_v}_k{block_k}_h{block_h}" + ("_adj" if adjust is not None else "")
        + (f"_top{top_k}" if top_k else ""),
    )(*operands)
    m, s, w, a, b, k, acc = res[:7]
    tv, ti = (res[7][0, :, :top_k], res[8][0, :, :top_k]) if top_k else adjust_lib.topk_init(n_pad, 0)
    # every hidden tile saw the whole vocabulary: its scalars are the same; take tile 0's
    out = Partials(m[0], s[0], w[0], a[0], b[0], k[0], acc[:, :h], tv, ti)
    if adjust is not None:
        out = Partials(*(_unlayout(x, rows, row_len, padded) for x in out))
    else:
        out = Partials(*(x[:n] for x in out))
    return out if partials else finalize(out, embed_scale)


def get_renoise_fn(backend: str = "auto", **tiles):
    """``(hidden, head, embed, temperature, keys, *, softcap, vocab_major, embed_scale) -> RenoiseStats`` for
    ``backend`` (``xla``: the streaming loop; ``pallas`` / ``pallas_interpret``: the kernel)."""
    backend = resolve_backend(backend)
    if backend == "xla":
        return functools.partial(renoise_stats_streaming, **tiles)
    return functools.partial(renoise_stats_pallas, interpret=(backend == "pallas_interpret"), **tiles)
