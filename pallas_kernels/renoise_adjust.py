"""Per-row logit adjustments and a streamed top-k for the fused renoise pass (:mod:`pallas_kernels.renoise`).

**Adjustments** (penalties, biases, masked stop ids) are sparse: a row (a canvas; ``row_len`` consecutive positions
of the pass) has a fixed-width table of entries, one per adjusted token id, sorted by id (padding: id
:data:`PAD_ID`, never a token). An entry ``(id, rep, add, until)`` turns the soft-capped logit ``z`` of token ``id``
at position ``p`` of its row (``0 <= p < row_len``) into

    ``z' = (z / rep if z > 0 else z * rep) + add``, and ``-inf`` where ``p < until``;

tokens without an entry keep ``z`` bitwise (``rep = 1`` and ``add = 0`` do too: ``z / 1``, ``z * 1``, ``z + 0``).
The temperature divides ``z'`` afterwards. The table is applied to each vocabulary tile as the pass reaches it:
no ``[positions x vocab]`` array exists. The XLA path scatters a row's entries into its ``[rows, tile]`` slice
(:func:`apply_tile`); the kernel walks the entries that fall in the tile (its sorted range, :func:`tile_bounds`;
:func:`apply_entries`), each entry once over the whole pass.

**Top-k**: a running ``[positions, k]`` list (values descending, ties: the lowest token id first, ``-inf`` /
:data:`PAD_ID` padding), merged with each tile: :func:`topk_merge` (``lax.top_k`` of the concatenation, the XLA
path) and :func:`topk_merge_iter` (k rounds of max-extraction: elementwise ops and row reductions only, the
kernel's); both give the same list.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

PAD_ID = jnp.iinfo(jnp.int32).max  # a table's padding id (sorts last, matches no token)


class Adjust(NamedTuple):
    """One table row per canvas row, ``[R, W]`` each, sorted by ``ids``."""

    ids: jax.Array  # int32, PAD_ID padding
    rep: jax.Array  # float32, 1: none
    add: jax.Array  # float32
    until: jax.Array  # int32: positions p < until of the row see the token at -inf


def empty_adjust(rows: int, width: int) -> Adjust:
    return Adjust(jnp.full((rows, width), PAD_ID, jnp.int32), jnp.ones((rows, width), jnp.float32),
                  jnp.zeros((rows, width), jnp.float32), jnp.zeros((rows, width), jnp.int32))


def adjust_values(z, rep, add, masked):
    """The entry formula (module doc), elementwise; broadcasts."""
    z = jnp.where(z > 0, z / rep, z * rep) + add
    return jnp.where(masked, -jnp.inf, z)


def apply_tile(z, adj: Adjust, v0, row_len: int):
    """``z [R * row_len, T]`` (the logits of token ids ``v0 .. v0 + T - 1``; ``v0`` may be traced) -> adjusted.
    A scatter of each row's entries into ``[R, T]``; entries outside the tile are dropped."""
    n, t = z.shape
    rows = adj.ids.shape[0]
    local = adj.ids - v0
    inside = (adj.ids != PAD_ID) & (local >= 0) & (local < t)
    safe = jnp.where(inside, local, t)  # t: out of range, dropped
    r = jnp.arange(rows)[:, None]

    def scatter(values, fill):
        return jnp.full((rows, t), fill, values.dtype).at[r, safe].set(values, mode="drop")

    hit = scatter(inside, False)
    rep, add, until = scatter(adj.rep, 1.0), scatter(adj.add, 0.0), scatter(adj.until, 0)
    z3 = z.reshape(rows, row_len, t)
    p = jnp.arange(row_len, dtype=jnp.int32)[None, :, None]
    out = jnp.where(hit[:, None, :], adjust_values(z3, rep[:, None, :], add[:, None, :], p < until[:, None, :]), z3)
    return out.reshape(n, t)


def apply_dense(z, adj: Adjust, row_len: int):
    """The whole vocabulary at once (the materialised reference)."""
    return apply_tile(z, adj, 0, row_len)


def tile_bounds(ids, n_tiles: int, block_v: int, vocab_offset=0):
    """``[R, n_tiles + 1]`` int32: entries ``[b[t], b[t + 1])`` of a row's sorted table lie in tile ``t``."""
    starts = vocab_offset + jnp.arange(n_tiles + 1, dtype=jnp.int32) * block_v
    return jax.vmap(lambda row: jnp.searchsorted(row, starts, side="left"))(ids).astype(jnp.int32)


def apply_entries(z, cols, pos, sel, lo, hi, load):
    """The kernel's walk: entries ``lo .. hi - 1`` of one row (``load(j) -> (id, rep, add, until)`` scalars) applied
    to ``z [n, T]`` at the positions ``sel [n]`` of that row (``pos [n]``: their index in the row)."""
    def body(j, z):
        tid, rep, add, until = load(j)
        hit = (cols[None, :] == tid) & sel[:, None]
        return jnp.where(hit, adjust_values(z, rep, add, (pos < until)[:, None]), z)

    return lax.fori_loop(lo, hi, body, z)


# ----------------------------------------------------------------------------------------------
# Streamed top-k
# ----------------------------------------------------------------------------------------------

def topk_init(n: int, k: int):
    return jnp.full((n, k), -jnp.inf, jnp.float32), jnp.full((n, k), PAD_ID, jnp.int32)


def topk_merge(vals, ids, z, cols):
    """Merge a tile ``z [n, T]`` (token ids ``cols [T]``, all above the running list's) into ``(vals, ids)``."""
    k = vals.shape[1]
    all_v = jnp.concatenate([vals, z], axis=1)
    all_i = jnp.concatenate([ids, jnp.broadcast_to(cols[None, :], z.shape).astype(jnp.int32)], axis=1)
    top_v, where = lax.top_k(all_v, k)  # stable: equal values keep the lower position (the lower id)
    return top_v, jnp.take_along_axis(all_i, where, axis=1)


def topk_merge_iter(vals, ids, z, cols, rounds: int | None = None):
    """:func:`topk_merge` by k rounds of max-extraction (no sort, no gather: a kernel's ops). ``rounds``: fill only
    the first that many entries (the list may be wider, a power of two: the rest stays padding)."""
    n, k = vals.shape
    slots = jnp.arange(k, dtype=jnp.int32)[None, :]
    big = jnp.iinfo(jnp.int32).max
    ptr = jnp.zeros((n,), jnp.int32)  # the running list's next entry (it is sorted)
    taken = jnp.zeros(z.shape, bool)
    out_v, out_i = vals, ids
    for slot in range(k if rounds is None else rounds):
        at = slots == ptr[:, None]
        run_v = jnp.max(jnp.where(at, vals, -jnp.inf), axis=1)
        run_i = jnp.min(jnp.where(at, ids, big), axis=1)
        tz = jnp.where(taken, -jnp.inf, z)
        t_v = jnp.max(tz, axis=1)
        t_i = jnp.min(jnp.where((tz == t_v[:, None]) & ~taken, cols[None, :], big), axis=1)
        use_run = (run_v >= t_v) & (ptr < k)
        v = jnp.where(use_run, run_v, t_v)
        i = jnp.where(use_run, run_i, t_i)
        out_v = jnp.where(slots == slot, v[:, None], out_v)
        out_i = jnp.where(slots == slot, i[:, None], out_i)
        ptr = ptr + use_run.astype(jnp.int32)
        taken = taken | ((cols[None, :] == t_i[:, None]) & ~use_run[:, None])
    return out_v, out_i


def topk_merge_shards(vals, ids, axis: int = 0):
    """Merge per-shard lists stacked along ``axis`` (shards in id order)."""
    k = vals.shape[-1]
    v = jnp.moveaxis(vals, axis, -2)
    i = jnp.moveaxis(ids, axis, -2)
    v = v.reshape(v.shape[:-2] + (-1,))
    i = i.reshape(i.shape[:-2] + (-1,))
    top_v, where = lax.top_k(v, k)
    return top_v, jnp.take_along_axis(i, where, axis=-1)
