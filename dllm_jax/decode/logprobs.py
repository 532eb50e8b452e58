"""Log probabilities of the tokens a denoise step writes, and the top-k alternatives, on the device.

The distribution is the one the algorithm used at that forward: the mask id excluded, penalties applied, divided
by the row's temperature when the row samples (greedy rows: temperature 1). Top-k / top-p filtering is not
applied (SGLang reports the tempered, unfiltered distribution too).

Two sources, whichever the step already has:

* **materialised logits** (sampling, penalties, or an algorithm that needs them): ``log_softmax`` of those;
* **the fused confidence path** (greedy, no penalties; the Pallas kernel never writes the logits): the
  log-sum-exp that path already returns, and the written token's logit as one ``H``-long dot product per
  position (a gather of LM-head columns). The top-k alternatives are then the one extra cost: a pass over the
  LM head in vocabulary tiles, each tile reduced to its top k before the next (a ``[N, tile]`` buffer, never
  ``[N, V]``), only in the variant compiled for requests that ask for alternatives.

Under tensor parallelism every vocabulary shard reduces its slice: the token logit is summed over shards (one
shard owns it), and each shard's top k is gathered (``k x shards`` numbers per position) and merged; full logits
never exist on one device.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

TILE = 16384  # vocabulary columns per tile of the fused top-k pass


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LogprobRecord:
    """Per position: the figures of the forward that last wrote it (``recorded``), in one call."""

    logprob: jax.Array  # [R, B] f32
    top_logprob: jax.Array | None  # [R, B, K] f32, most likely first
    top_ids: jax.Array | None  # [R, B, K] int32
    recorded: jax.Array  # [R, B] bool: written by a step of this call


def merge(old: LogprobRecord, new: LogprobRecord, keep) -> LogprobRecord:
    """``new`` where it recorded something and ``keep`` is False, else ``old`` (the synchronous loop's carry)."""
    take = new.recorded & ~keep

    def pick(a, b):
        if a is None:
            return None
        return jnp.where(take.reshape(take.shape + (1,) * (a.ndim - 2)), b, a)

    return LogprobRecord(logprob=pick(old.logprob, new.logprob), top_logprob=pick(old.top_logprob, new.top_logprob),
                         top_ids=pick(old.top_ids, new.top_ids), recorded=old.recorded | take)


def empty_record(rows: int, block: int, k: int) -> LogprobRecord:
    return LogprobRecord(logprob=jnp.zeros((rows, block), jnp.float32),
                         top_logprob=jnp.zeros((rows, block, k), jnp.float32) if k else None,
                         top_ids=jnp.zeros((rows, block, k), jnp.int32) if k else None,
                         recorded=jnp.zeros((rows, block), jnp.bool_))


# ----------------------------------------------------------------------------------------------
# From materialised logits
# ----------------------------------------------------------------------------------------------

def from_logits(z, tokens, k: int, mesh=None, vocab_shards: int = 1):
    """``z [R, B, V]`` (already tempered; -inf excluded) -> (logprob of ``tokens`` [R, B], top values, top ids)."""
    lse = jax.nn.logsumexp(z, axis=-1)
    chosen = jnp.take_along_axis(z, tokens[..., None], axis=-1)[..., 0] - lse
    if not k:
        return chosen, None, None
    vals, ids = top_k_last_axis(z, k, mesh, vocab_shards)
    return chosen, vals - lse[..., None], ids


def _top_k(x, k: int):
    """``lax.top_k`` over the last axis, padded with ``-inf`` when the axis is shorter than ``k``."""
    vals, ids = jax.lax.top_k(x, min(k, x.shape[-1]))
    ids = ids.astype(jnp.int32)
    if vals.shape[-1] < k:
        pad = [(0, 0)] * (x.ndim - 1) + [(0, k - vals.shape[-1])]
        vals, ids = jnp.pad(vals, pad, constant_values=-jnp.inf), jnp.pad(ids, pad)
    return vals, ids


def top_k_last_axis(z, k: int, mesh=None, vocab_shards: int = 1):
    """``lax.top_k`` over the last axis; with a vocabulary-sharded mesh, per shard then merged."""
    if vocab_shards <= 1:
        return _top_k(z, k)
    from dllm_jax.sharding import RULES

    axis = RULES["vocab"]
    spec = P(*([None] * (z.ndim - 1)), axis)

    def local(x):
        vals, ids = _top_k(x, k)
        ids = ids + jax.lax.axis_index(axis) * x.shape[-1]
        return _merge_gathered(vals, ids, axis, k)

    return jax.shard_map(local, mesh=mesh, in_specs=(spec,), out_specs=(P(), P()), check_vma=False)(z)


def _merge_gathered(vals, ids, axis, k):
    """All-gather per-shard top-k (``[..., k]``) and keep the best k; shards in id order, so equal values keep
    the lowest id first (``lax.top_k`` is stable)."""
    g_vals = jnp.moveaxis(jax.lax.all_gather(vals, axis), 0, -2)  # [..., shards, k]
    g_ids = jnp.moveaxis(jax.lax.all_gather(ids, axis), 0, -2)
    flat_vals = g_vals.reshape(g_vals.shape[:-2] + (-1,))
    flat_ids = g_ids.reshape(g_ids.shape[:-2] + (-1,))
    best, where = jax.lax.top_k(flat_vals, k)
    return best, jnp.take_along_axis(flat_ids, where, axis=-1)


# ----------------------------------------------------------------------------------------------
# From the fused path: hidden states and the LM head, never the logits
# ----------------------------------------------------------------------------------------------

def _head(params):
    """(head, vocab_major): the stored ``[V, H]`` LM head or tied embedding, never transposed."""
    return (params["lm_head"] if "lm_head" in params else params["embed"]), True


def _token_logits_local(h, w, tokens, offset, vocab_major):
    """Logits of ``tokens [N]`` for the vocabulary slice ``w`` starting at ``offset`` (0 outside the slice)."""
    v_local = w.shape[0] if vocab_major else w.shape[1]
    local = tokens - offset
    inside = (local >= 0) & (local < v_local)
    safe = jnp.where(inside, local, 0)
    cols = jnp.take(w, safe, axis=0) if vocab_major else jnp.take(w, safe, axis=1).T  # [N, H]
    dots = jnp.sum(h.astype(jnp.float32) * cols.astype(jnp.float32), axis=-1)
    return jnp.where(inside, dots, 0.0)


def _top_k_local(h, w, k, excluded, vocab_major, tile=TILE):
    """Top-k logits of ``h [N, H]`` against the slice ``w`` (``excluded``: a local id at -inf), tile by tile."""
    v = w.shape[0] if vocab_major else w.shape[1]
    tile = min(tile, v)
    n_tiles = -(-v // tile)

    def tile_logits(t):
        start = jnp.minimum(t * tile, v - tile)  # the last tile is shifted back; columns seen before are -inf
        if vocab_major:
            wt = jax.lax.dynamic_slice_in_dim(w, start, tile, axis=0)
            logits = jnp.dot(h, wt.T, preferred_element_type=jnp.float32)
        else:
            wt = jax.lax.dynamic_slice_in_dim(w, start, tile, axis=1)
            logits = jnp.dot(h, wt, preferred_element_type=jnp.float32)
        cols = start + jnp.arange(tile)
        logits = jnp.where((cols < t * tile)[None, :] | (cols == excluded)[None, :], -jnp.inf, logits)
        vals, idx = _top_k(logits, k)
        return vals, idx + start

    if n_tiles == 1:
        vals, ids = tile_logits(0)
    else:
        def body(t, carry):
            vals, ids = carry
            tv, ti = tile_logits(t)
            best, where = jax.lax.top_k(jnp.concatenate([vals, tv], -1), k)
            return best, jnp.take_along_axis(jnp.concatenate([ids, ti], -1), where, axis=-1)

        vals, ids = tile_logits(0)
        vals, ids = jax.lax.fori_loop(1, n_tiles, body, (vals, ids))
    return vals, ids


def from_hidden(params, hidden, tokens, lse, k: int, *, mask_id: int, mesh=None, vocab_shards: int = 1):
    """``hidden [N, H]``, written ``tokens [N]``, the confidence path's ``lse [N]`` -> (logprob [N], top values
    [N, k] or None, top ids or None)."""
    w, vocab_major = _head(params)
    if vocab_shards <= 1:
        chosen = _token_logits_local(hidden, w, tokens, 0, vocab_major)
        top = _top_k_local(hidden, w, k, mask_id, vocab_major) if k else None
    else:
        chosen, top = _sharded_from_hidden(hidden, w, tokens, k, mask_id, mesh, vocab_major)
    chosen = jnp.minimum(chosen - lse, 0.0)  # the dot may round a hair above the lse's own max
    if top is None:
        return chosen, None, None
    top_logprob = jnp.minimum(top[0] - lse[:, None], 0.0)
    # The written token's logit came from a dot of its own, the alternatives' from the tiled matmul: they may
    # differ in the last bits. A token that is among the alternatives reports that entry's figure, so a
    # response's logprob and its own top_logprobs entry are the same number.
    hit = top[1] == tokens[:, None]
    chosen = jnp.where(hit.any(-1), jnp.max(jnp.where(hit, top_logprob, -jnp.inf), axis=-1), chosen)
    return chosen, top_logprob, top[1]


def _sharded_from_hidden(hidden, w, tokens, k, mask_id, mesh, vocab_major):
    from dllm_jax.sharding import RULES

    axis = RULES["vocab"]
    head_spec = P(axis, None) if vocab_major else P(None, axis)

    def local(h, w_local, toks):
        v_local = w_local.shape[0] if vocab_major else w_local.shape[1]
        offset = jax.lax.axis_index(axis) * v_local
        chosen = jax.lax.psum(_token_logits_local(h, w_local, toks, offset, vocab_major), axis)
        if not k:
            return chosen, None
        vals, ids = _top_k_local(h, w_local, k, mask_id - offset, vocab_major)
        return chosen, _merge_gathered(vals, ids + offset, axis, k)

    out_specs = (P(), (P(), P()) if k else None)
    return jax.shard_map(local, mesh=mesh, in_specs=(P(), head_spec, P()), out_specs=out_specs,
                         check_vma=False)(hidden, w, tokens)
