"""Confidence selection: per position argmax token, its probability and the log-sum-exp.

Semantics (the reference below defines them; the Pallas kernel must match it):

* ``hidden``: ``[N, H]`` final hidden states (after the final norm) of the positions to score.
* ``lm_head``: ``[H, V]`` the LM head matrix.
* ``exclude_token_id``: a token id whose logit is treated as ``-inf`` (the mask id: it is never a
  candidate), or ``None``.

Returns ``(argmax [N] int32, p_max [N] float32, lse [N] float32)`` where ``lse`` is the log-sum-exp of
the logits without the excluded token and ``p_max = exp(max - lse)``. Ties break to the lowest index,
as ``jnp.argmax`` does.

:func:`confidence_stats` is the Pallas (Triton) kernel with the same results: the LM-head matmul is
fused with an online (max, sum-exp, argmax) triple so the logits never reach memory.
:func:`merge_confidence_triples` combines triples of vocab slices (kernel splits, or tensor-parallel
shards); ``get_confidence_fn`` picks the implementation by backend name.

``auto`` on a GPU picks per shape: :func:`choose_confidence_backend` looks the shape (positions, hidden, vocab) up
in a table measured on each device kind (``confidence_crossover.json`` beside this file, rewritten by
``python -m bench.kernels --write-crossover`` on a GPU), because neither implementation wins everywhere: the
fused kernel is ahead where the step is memory-bound (few positions: it never writes the ``[N, V]`` logits) and
XLA's GEMM where it is compute-bound (thousands of positions). A device or shape the table does not cover keeps
the default, the kernel.
"""

from __future__ import annotations

import functools
import json
import math
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import DEFAULT_NUM_SMS, cdiv, compiler_params, next_pow2, pltriton, resolve_backend


def confidence_stats_reference(hidden, lm_head, *, exclude_token_id=None):
    """Plain-JAX definition: materialises the full ``[N, V]`` logits (the XLA path)."""
    logits = jnp.dot(hidden, lm_head, preferred_element_type=jnp.float32)
    return confidence_stats_from_logits(logits, exclude_token_id=exclude_token_id)


def confidence_stats_from_logits(logits, *, exclude_token_id=None):
    logits = logits.astype(jnp.float32)
    vocab = lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    if exclude_token_id is not None:
        logits = jnp.where(vocab == exclude_token_id, -jnp.inf, logits)
    top = jnp.max(logits, axis=-1)
    arg = first_index_of_max(logits, top, vocab)
    lse = top + jnp.log(jnp.sum(jnp.exp(logits - top[..., None]), axis=-1))
    return arg, jnp.exp(top - lse), lse


def first_index_of_max(logits, top, vocab):
    """``jnp.argmax(logits, -1)`` given ``top = max(logits, -1)``: the lowest index attaining the max (in a row
    with a NaN, the first NaN, as in ``jnp.argmax``). Plain reductions instead of argmax's (value, index) pair
    reduction, which XLA:CPU runs several times slower (~60 us of a ~0.6 ms step of the shipped model, whose
    32 x 768 logits it scans)."""
    nan = jnp.isnan(logits)
    is_top = jnp.where(jnp.any(nan, axis=-1, keepdims=True), nan, logits == top[..., None])
    return jnp.min(jnp.where(is_top, vocab, logits.shape[-1]), axis=-1).astype(jnp.int32)


# ----------------------------------------------------------------------------------------------
# Online triples: what the kernel computes per vocab slice, and how slices merge
# ----------------------------------------------------------------------------------------------
#
# A triple summarises logits x over a slice of the vocab: m = max x, s = sum exp(x - m), and
# a = the lowest index attaining m. Two triples merge associatively: m = max(m1, m2),
# s = s1 exp(m1 - m) + s2 exp(m2 - m), a = the lowest index among those attaining m. So vocab tiles
# (inside the kernel), vocab splits (the grid axis) and tensor-parallel vocab shards (across
# devices) all reduce with one rule, and lse = m + log s, p_max = exp(m - lse) = 1 / s.

_INT_MAX = jnp.iinfo(jnp.int32).max


def merge_confidence_triples(maxes, sumexps, argmaxes, *, axis=0):
    """Merge triples ``(max, sum-exp relative to max, argmax)`` along ``axis``.

    ``argmaxes`` must already be global token ids (a vocab shard adds its offset). Ties resolve to
    the lowest id whatever the order of the slices, as ``jnp.argmax`` over the whole vocab does.
    Returns the merged ``(max, sumexp, argmax)`` with ``axis`` removed.
    """
    m = jnp.max(maxes, axis=axis)
    m = lax.optimization_barrier(m)
    m_b = jnp.expand_dims(m, axis)
    m_safe = jnp.where(m_b == -jnp.inf, 0.0, m_b)
    s = jnp.sum(sumexps * jnp.exp(maxes - m_safe), axis=axis)
    a = jnp.min(jnp.where(maxes == m_b, argmaxes, _INT_MAX), axis=axis).astype(jnp.int32)
    return m, s, a


def finalize_confidence_triple(m, s, a):
    """``(max, sumexp, argmax)`` -> ``(argmax int32, p_max f32, lse f32)`` as the reference returns."""
    lse = m + jnp.log(s)
    return a.astype(jnp.int32), jnp.exp(m - lse), lse


# ----------------------------------------------------------------------------------------------
# Pallas (Triton) kernel: LM head fused with the online triple
# ----------------------------------------------------------------------------------------------
#
# Why a kernel: the XLA path writes [N, V] float32 logits (V = 151,936: 0.6 MB per position) and
# reads them back three times. Here each program computes a [block_n, block_v] logit tile in
# registers (hidden tile x LM-head tile, accumulated over the hidden dim in block_h steps), folds it
# into its running triple and moves on: only 3 x N numbers per vocab split ever reach memory.
# Grid (row tiles, vocab splits); the vocab tail is a masked load, the excluded token a -inf.


def _confidence_kernel(excl_ref, h_ref, w_ref, m_ref, s_ref, a_ref, *, vocab, hidden_dim, block_n,
                       block_v, block_h, vocab_splits, vocab_major, upcast_dots):
    j = pl.program_id(1)
    excl = excl_ref[0]
    n_vt = (vocab + block_v - 1) // block_v
    tiles_per_split = (n_vt + vocab_splits - 1) // vocab_splits
    t_lo = j * tiles_per_split
    t_hi = jnp.minimum(n_vt, t_lo + tiles_per_split)
    n_h = (hidden_dim + block_h - 1) // block_h
    h_tail = hidden_dim % block_h != 0

    def dot(a, b):
        if upcast_dots:  # interpret mode: XLA:CPU has no bf16 x bf16 -> f32 dot (products are exact in f32)
            a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        return jnp.dot(a, b, preferred_element_type=jnp.float32)

    def vocab_body(t, carry):
        m_prev, s_prev, a_prev = carry
        v0 = t * block_v
        cols = v0 + jnp.arange(block_v, dtype=jnp.int32)
        col_ok = cols < vocab

        def h_body(k, acc):
            k0 = k * block_h
            hcols = k0 + jnp.arange(block_h, dtype=jnp.int32)
            if h_tail:
                hmask = hcols < hidden_dim
                x = pltriton.load(h_ref.at[:, pl.ds(k0, block_h)],
                                  mask=lax.broadcast_in_dim(hmask, (block_n, block_h), (1,)), other=0)
            else:
                hmask = None
                x = h_ref[:, pl.ds(k0, block_h)]
            if vocab_major:  # w_ref is [V, H] (an embedding used as a tied head)
                wmask = lax.broadcast_in_dim(col_ok, (block_v, block_h), (0,))
                if h_tail:
                    wmask = wmask & lax.broadcast_in_dim(hmask, (block_v, block_h), (1,))
                w = pltriton.load(w_ref.at[pl.ds(v0, block_v), pl.ds(k0, block_h)], mask=wmask, other=0)
                return acc + dot(x, w.T)
            wmask = lax.broadcast_in_dim(col_ok, (block_h, block_v), (1,))
            if h_tail:
                wmask = wmask & lax.broadcast_in_dim(hmask, (block_h, block_v), (0,))
            w = pltriton.load(w_ref.at[pl.ds(k0, block_h), pl.ds(v0, block_v)], mask=wmask, other=0)
            return acc + dot(x, w)

        logits = lax.fori_loop(0, n_h, h_body, jnp.zeros((block_n, block_v), jnp.float32))
        keep = col_ok & (cols != excl)
        logits = jnp.where(lax.broadcast_in_dim(keep, (block_n, block_v), (1,)), logits, -jnp.inf)

        t_max = jnp.max(logits, axis=1)
        cols_b = lax.broadcast_in_dim(cols, (block_n, block_v), (1,))
        t_arg = jnp.min(jnp.where(logits == t_max[:, None], cols_b, _INT_MAX), axis=1)
        m_new = jnp.maximum(m_prev, t_max)
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        s_new = s_prev * jnp.exp(m_prev - m_safe) + jnp.sum(jnp.exp(logits - m_safe[:, None]), axis=1)
        a_new = jnp.where(t_max > m_prev, t_arg, a_prev)  # strict: an earlier tile wins a tie
        return m_new, s_new, a_new

    init = (jnp.full((block_n,), -jnp.inf, jnp.float32), jnp.zeros((block_n,), jnp.float32),
            jnp.zeros((block_n,), jnp.int32))
    m, s, a = lax.fori_loop(t_lo, t_hi, vocab_body, init)
    m_ref[...] = m
    s_ref[...] = s
    a_ref[...] = a


def confidence_tiles(num_positions, hidden_dim, vocab, *, block_n=None, block_v=None, block_h=None,
                     vocab_splits=None, num_warps=None, num_stages=None, num_sms=DEFAULT_NUM_SMS):
    """The tile sizes the kernel will use (defaults documented in :func:`confidence_triples`)."""
    if block_n is None:  # big batches are a real GEMM: larger tiles re-read the head fewer times
        block_n = min(128 if num_positions >= 1024 else 64, next_pow2(num_positions))
    block_n = max(16, next_pow2(block_n))
    block_v = max(16, next_pow2(block_v or 128))
    block_h = max(16, min(next_pow2(block_h or 64), next_pow2(hidden_dim)))
    if num_warps is None:
        num_warps = 8 if block_n * block_v >= 128 * 128 else 4
    n_row_tiles = cdiv(num_positions, block_n)
    n_vt = cdiv(vocab, block_v)
    if vocab_splits is None:
        vocab_splits = max(1, min(cdiv(2 * num_sms, n_row_tiles), n_vt // 4))
    vocab_splits = max(1, min(int(vocab_splits), n_vt))
    return dict(block_n=block_n, block_v=block_v, block_h=block_h, n_row_tiles=n_row_tiles,
                vocab_splits=vocab_splits, num_warps=num_warps, num_stages=num_stages or 3)


@functools.partial(jax.jit, static_argnames=("vocab_major", "interpret", "block_n", "block_v", "block_h",
                                             "vocab_splits", "num_warps", "num_stages"))
def confidence_triples(hidden, lm_head, exclude_token_id=None, *, vocab_major=False, interpret=False,
                       block_n=None, block_v=None, block_h=None, vocab_splits=None, num_warps=None,
                       num_stages=None):
    """Fused LM head + online triple over the vocab: ``(max [N], sumexp [N], argmax [N])``.

    The building block for tensor parallelism: a shard passes its vocab slice of the head and
    ``exclude_token_id - offset`` (an id outside ``[0, V)`` excludes nothing; it may be traced),
    adds ``offset`` to the argmax, gathers the triples and merges them with
    :func:`merge_confidence_triples`, then :func:`finalize_confidence_triple`.

    * ``lm_head``: ``[H, V]``, or ``[V, H]`` with ``vocab_major=True`` (pass a tied embedding as
      is: transposing it in the jit would copy 0.6 GB per step).
    * ``block_n`` positions per program (default ``min(64, N)``, 128 from N >= 1024; at least 16),
      ``block_v`` vocab columns per tile (128), ``block_h`` hidden-dim step of the fused matmul (64).
    * ``vocab_splits``: the second grid axis; default aims at ~2 programs per SM (132 SMs) and
      at least 4 vocab tiles per split. ``num_warps`` 8 for 128x128 logit tiles, else 4;
      ``num_stages`` 3.
    """
    num_positions, hidden_dim = hidden.shape
    vocab = lm_head.shape[0] if vocab_major else lm_head.shape[1]
    if (lm_head.shape[1] if vocab_major else lm_head.shape[0]) != hidden_dim:
        raise ValueError(f"lm_head {lm_head.shape} does not match hidden {hidden.shape} ({vocab_major=})")
    cfg = confidence_tiles(num_positions, hidden_dim, vocab, block_n=block_n, block_v=block_v,
                           block_h=block_h, vocab_splits=vocab_splits, num_warps=num_warps,
                           num_stages=num_stages)
    bn, nt, vs = cfg["block_n"], cfg["n_row_tiles"], cfg["vocab_splits"]
    n_pad = nt * bn
    hidden_p = jnp.pad(hidden, ((0, n_pad - num_positions), (0, 0)))
    excl = jnp.full((1,), -1 if exclude_token_id is None else exclude_token_id, jnp.int32)

    kernel = functools.partial(
        _confidence_kernel, vocab=vocab, hidden_dim=hidden_dim, block_n=bn, block_v=cfg["block_v"],
        block_h=cfg["block_h"], vocab_splits=vs, vocab_major=vocab_major,
        upcast_dots=bool(interpret) and (hidden.dtype != jnp.float32 or lm_head.dtype != jnp.float32))
    part = jax.ShapeDtypeStruct((vs, n_pad), jnp.float32)
    part_spec = pl.BlockSpec((None, bn), lambda i, j: (j, i))
    m, s, a = pl.pallas_call(
        kernel,
        grid=(nt, vs),
        in_specs=[pl.BlockSpec((1,), lambda i, j: (0,)),
                  pl.BlockSpec((bn, hidden_dim), lambda i, j: (i, 0)),
                  pl.BlockSpec(lm_head.shape, lambda i, j: (0, 0))],  # whole head: a pointer in Triton
        out_specs=[part_spec, part_spec, part_spec],
        out_shape=[part, part, jax.ShapeDtypeStruct((vs, n_pad), jnp.int32)],
        compiler_params=compiler_params(cfg["num_warps"], cfg["num_stages"]),
        interpret=interpret,
        name=f"confidence_n{bn}_v{cfg['block_v']}_h{cfg['block_h']}_s{vs}",
    )(excl, hidden_p, lm_head)
    if vs > 1:
        m, s, a = merge_confidence_triples(m, s, a, axis=0)
    else:
        m, s, a = m[0], s[0], a[0]
    return m[:num_positions], s[:num_positions], a[:num_positions]


def confidence_stats(hidden, lm_head, *, exclude_token_id=None, interpret=False, **tiles):
    """Pallas confidence selection: same signature and results as :func:`confidence_stats_reference`
    (``(argmax int32, p_max f32, lse f32)``) without ever materialising the ``[N, V]`` logits.
    ``tiles`` (and ``vocab_major``) go to :func:`confidence_triples`."""
    m, s, a = confidence_triples(hidden, lm_head, exclude_token_id, interpret=interpret, **tiles)
    return finalize_confidence_triple(m, s, a)


def get_confidence_fn(backend: str = "auto", **tiles):
    """A callable with the reference's signature ``(hidden, lm_head, *, exclude_token_id=None)`` for
    ``backend`` in ``pallas | pallas_interpret | xla | auto``. ``auto``: on a GPU the implementation the crossover
    table picks for each call's shape (:func:`confidence_stats_auto`), elsewhere XLA. ``tiles`` (and
    ``vocab_major``) go to the kernel."""
    if resolve_confidence_backend(backend) == "auto":
        return functools.partial(confidence_stats_auto, **tiles)
    backend = resolve_backend(backend)
    if backend == "xla":
        if tiles.get("vocab_major"):
            return _reference_vocab_major
        return confidence_stats_reference
    return functools.partial(confidence_stats, interpret=(backend == "pallas_interpret"), **tiles)


def _reference_vocab_major(hidden, embed, *, exclude_token_id=None):
    """The reference on a ``[V, H]`` head contracted as stored (no transposed copy)."""
    logits = lax.dot_general(hidden, embed, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return confidence_stats_from_logits(logits, exclude_token_id=exclude_token_id)


# ----------------------------------------------------------------------------------------------
# ``auto``: Pallas or XLA per shape, from a table measured per device kind
# ----------------------------------------------------------------------------------------------
#
# The table (JSON): {"devices": {device_kind: [entry, ...]}, "sources": {device_kind: "where it was measured"}},
# an entry {"positions": N, "hidden": H, "vocab": V, "vocab_major": bool, "pallas_us": t, "xla_us": t,
# "winner": "pallas" | "xla"}. A lookup takes the device's entries of the same (hidden, vocab), of the same head
# layout if the table has that layout (else the other: one layout measured stands in for the other), and the
# winner of the entry nearest in log2(positions) (a tie goes to the larger N). No entry for the device kind or the
# (hidden, vocab): the default (the kernel, what ``auto`` always picked before the table).

CROSSOVER_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "confidence_crossover.json")
CROSSOVER_DEFAULT = "pallas"


@functools.lru_cache(maxsize=8)
def _read_table(path: str, mtime: float) -> dict:
    with open(path) as f:
        return json.load(f)


def crossover_table(path: str | None = None) -> dict:
    """The crossover table at ``path`` (default: ``$DLLM_JAX_CONFIDENCE_CROSSOVER`` or the file beside this
    module); an empty table if it is missing or unreadable (``auto`` then keeps its default)."""
    path = path or os.environ.get("DLLM_JAX_CONFIDENCE_CROSSOVER") or CROSSOVER_PATH
    try:
        return _read_table(path, os.path.getmtime(path))
    except (OSError, ValueError):
        return {"devices": {}}


def choose_confidence_backend(positions: int, hidden_dim: int, vocab: int, *, vocab_major: bool = False,
                              device_kind: str | None = None, table: dict | None = None,
                              default: str = CROSSOVER_DEFAULT) -> str:
    """``"pallas"`` or ``"xla"``: the measured winner for ``positions`` x ``hidden_dim`` against a ``vocab``-wide
    head on ``device_kind`` (default: JAX's first device), by the rule above; ``default`` where the table has
    nothing for that device or (hidden, vocab)."""
    if device_kind is None:
        device_kind = jax.devices()[0].device_kind
    table = crossover_table() if table is None else table
    entries = [e for e in (table.get("devices") or {}).get(device_kind, ())
               if int(e["hidden"]) == int(hidden_dim) and int(e["vocab"]) == int(vocab)
               and e.get("winner") in ("pallas", "xla")]
    same_layout = [e for e in entries if bool(e.get("vocab_major", False)) == bool(vocab_major)]
    entries = same_layout or entries
    if not entries:
        return default
    want = math.log2(max(1, int(positions)))
    best = min(entries, key=lambda e: (abs(math.log2(max(1, int(e["positions"]))) - want), -int(e["positions"])))
    return best["winner"]


def confidence_stats_auto(hidden, lm_head, *, exclude_token_id=None, vocab_major=False, interpret=False, **tiles):
    """:func:`confidence_stats_reference`'s results from the implementation the crossover table picks for this
    shape (decided when the caller is traced: the shape is static)."""
    num_positions, hidden_dim = hidden.shape
    vocab = lm_head.shape[0] if vocab_major else lm_head.shape[1]
    if choose_confidence_backend(num_positions, hidden_dim, vocab, vocab_major=vocab_major) == "xla":
        if vocab_major:
            return _reference_vocab_major(hidden, lm_head, exclude_token_id=exclude_token_id)
        return confidence_stats_reference(hidden, lm_head, exclude_token_id=exclude_token_id)
    return confidence_stats(hidden, lm_head, exclude_token_id=exclude_token_id, interpret=interpret,
                            vocab_major=vocab_major, **tiles)


def resolve_confidence_backend(name: str, field: str = "confidence_backend") -> str:
    """:func:`resolve_backend` for the confidence selection, except that ``auto`` on a GPU stays ``"auto"``: the
    choice is made per shape when the step is traced (:func:`choose_confidence_backend`)."""
    resolved = resolve_backend(name, field)
    return "auto" if name == "auto" and resolved == "pallas" else resolved


def write_crossover(device_kind: str, entries: list[dict], *, path: str | None = None, source: str = "") -> str:
    """Merge measured ``entries`` for ``device_kind`` into the table at ``path`` (default: the file beside this
    module): an entry replaces the one of the same (positions, hidden, vocab, vocab_major); other devices and
    shapes are kept. Returns the path."""
    path = path or CROSSOVER_PATH
    try:
        with open(path) as f:
            table = json.load(f)
    except (OSError, ValueError):
        table = {}
    table.setdefault("devices", {})
    table.setdefault("sources", {})

    def key(e):
        return int(e["positions"]), int(e["hidden"]), int(e["vocab"]), bool(e.get("vocab_major", False))

    merged = {key(e): e for e in table["devices"].get(device_kind, [])}
    for e in entries:
        merged[key(e)] = dict(e, vocab_major=bool(e.get("vocab_major", False)))
    table["devices"][device_kind] = [merged[k] for k in sorted(merged)]
    if source:
        table["sources"][device_kind] = source
    tmp = path + ".tmp"
    with open(tmp, "w") as f:  # one entry a line
        rest = {k: v for k, v in table.items() if k != "devices"}
        f.write((json.dumps(rest, indent=1)[:-2] + ",\n" if rest else "{\n") + ' "devices": {\n')
        kinds = list(table["devices"])
        for i, kind in enumerate(kinds):
            rows = ",\n".join("   " + json.dumps(e) for e in table["devices"][kind])
            f.write(f"  {json.dumps(kind)}: [\n{rows}\n  ]{',' if i < len(kinds) - 1 else ''}\n")
        f.write(" }\n}\n")
    os.replace(tmp, path)
    return path
