"""The row layout of one fused leaf (q|k|v as ``qkv``, gate|up as ``gate_up``): how many shard blocks it is laid out
in, where each segment's rows live, and fusing / splitting one leaf's arrays. Plain arithmetic on a table row
(:class:`~dllm_jax.model.table.Leaf`) and the config: the model code (:mod:`dllm_jax.model.qwen3`,
:mod:`dllm_jax.model.moe`) reads it, and :mod:`dllm_jax.model.fused` (the whole pytree, fused and unfused) builds on
it. The layout itself is described there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.config import ModelConfig
from dllm_jax.model.table import DIMS, Leaf


FUSED_AXES = ("qkv", "gate_up", "expert_gate_up")  # the logical out axes of fused leaves


def fused_axis_groups(cfg: ModelConfig, axis: str, size: int) -> int:
    """How many shard blocks a fused out axis of ``size`` rows is laid out in: ``cfg.tp_shards`` when each shard
    can hold whole heads (q|k|v: q and KV heads both divide) or equal MLP halves (gate|up), else 1 (replicated)."""
    t = cfg.tp_shards
    if axis == "qkv":
        ok = cfg.num_heads % t == 0 and cfg.num_kv_heads % t == 0
    else:
        ok = (size // 2) % t == 0
    return t if t > 1 and ok else 1


def fused_groups(cfg: ModelConfig, leaf: Leaf) -> int:
    return fused_axis_groups(cfg, leaf.axes[leaf.row_axis], leaf.shape_for(cfg)[leaf.row_axis])


def segment_rows(cfg: ModelConfig, leaf: Leaf, i: int) -> int:
    return DIMS[leaf.segments[i].rows](cfg)


def segment_blocks(cfg: ModelConfig, leaf: Leaf, i: int) -> tuple[tuple[int, int, int], ...]:
    """Where segment ``i``'s rows live in the fused leaf: ``(leaf row, segment row, count)`` per shard block
    (shard ``s`` holds rows ``s*n/g : (s+1)*n/g`` of every segment, in segment order)."""
    g = fused_groups(cfg, leaf)
    sizes = [segment_rows(cfg, leaf, j) for j in range(len(leaf.segments))]
    per, off, n = sum(sizes) // g, sum(sizes[:i]) // g, sizes[i] // g
    return tuple((s * per + off, s * n, n) for s in range(g))


def _rows(a, axis: int, lo: int, hi: int):
    return a[(slice(None),) * axis + (slice(lo, hi),)]


def fuse_segments(cfg: ModelConfig, leaf: Leaf, arrays, axis: int | None = None):
    """The fused leaf from its segments' arrays (each in the checkpoint's rows), numpy or JAX; ``axis``: the out
    axis of the arrays given (default the leaf's)."""
    axis = leaf.row_axis if axis is None else axis
    xp = jnp if any(isinstance(a, jax.Array) for a in arrays) else np
    blocks = [segment_blocks(cfg, leaf, i) for i in range(len(arrays))]
    pieces = [_rows(a, axis, b[s][1], b[s][1] + b[s][2]) for s in range(fused_groups(cfg, leaf))
              for a, b in zip(arrays, blocks)]
    return xp.concatenate(pieces, axis)


def segment_of(cfg: ModelConfig, leaf: Leaf, a, i: int, axis: int | None = None):
    """Segment ``i``'s rows (the checkpoint tensor's) out of fused array ``a``."""
    axis = leaf.row_axis if axis is None else axis
    pieces = [_rows(a, axis, dst, dst + n) for dst, _, n in segment_blocks(cfg, leaf, i)]
    xp = jnp if isinstance(a, jax.Array) else np
    return pieces[0] if len(pieces) == 1 else xp.concatenate(pieces, axis)
