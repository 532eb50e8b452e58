"""Fused leaves: q|k|v as one ``qkv`` leaf and gate|up as one ``gate_up`` leaf, so the forward runs one matmul where
it ran three / two, and the layout that keeps that correct under tensor parallelism.

A fused leaf stacks its segments (:class:`~dllm_jax.model.params.Segment`: the checkpoint tensors ``q_proj``,
``k_proj``, ``v_proj``; ``gate_proj``, ``up_proj``) along its out axis. TP splits the out axis into ``g`` equal
row blocks, one per shard, so a plain concatenation ``[q; k; v]`` would hand shard 0 all of q and nothing of v.
The rows are therefore **shard-major**: block ``s`` is ``[q_s; k_s; v_s]`` (``[gate_s; up_s]``), the ``s``-th
``1/g`` of each segment, with ``g = cfg.tp_shards`` (the engine's tensor-parallel degree, fixed before loading)
when every shard gets whole heads (equal MLP halves), else 1. With ``g = 1`` the leaf is the plain concatenation:
LLaDA2's ``query_key_value`` and transformers 5's ``gate_up_proj`` are then the leaf itself. The forward reshapes
the product to ``[..., g, rows/g]`` and splits each block the same way (:func:`dllm_jax.model.qwen3._qkv`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.config import ModelConfig
from dllm_jax.model.params import (DIMS, FAMILIES, MOE, Leaf, Params, get_leaf, key_path, param_table, set_leaf)


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


def segment_alias(cfg: ModelConfig, path: tuple) -> tuple[tuple, int] | None:
    """``(fused leaf path, segment)`` for a path in the unfused naming (``("layers", 0, "q")``), else None."""
    if cfg.family not in FAMILIES or len(path) not in (3, 4) or path[0] != "layers":
        return None
    i, moe = path[1], len(path) == 4
    if not isinstance(i, int) or not 0 <= i < cfg.num_layers or moe and path[2] != "moe":
        return None
    for leaf in param_table(cfg).layer_leaves(cfg, i):
        for j, seg in enumerate(leaf.segments):
            if seg.key == path[-1] and (leaf.where == MOE) == moe:
                return path[:-1] + (leaf.key,), j
    return None


def unfused_rows(cfg: ModelConfig) -> Params:
    """The pytree in the unfused naming (``q``, ``k``, ``v``, ``gate``, ``up``: format-2 directories, the leaves
    before fusion) with ``(row, segment or None)`` at each leaf."""
    table = param_table(cfg)
    out = table.empty(cfg)
    for path, leaf in table.paths(cfg):
        if not leaf.segments:
            set_leaf(out, path, (leaf, None))
        for j, seg in enumerate(leaf.segments):
            set_leaf(out, path[:-1] + (seg.key,), (leaf, j))
    return out


def split_fused(cfg: ModelConfig, params: Params) -> Params:
    """``params`` in the unfused naming: each fused leaf as its segments (the checkpoint's tensors)."""
    return _map_rows(cfg, lambda path, leaf, j: get_leaf(params, path) if j is None
                     else segment_of(cfg, leaf, get_leaf(params, path), j))


def join_fused(cfg: ModelConfig, unfused: Params) -> Params:
    """The inverse of :func:`split_fused`: segments fused into their leaves."""
    table = param_table(cfg)
    out = table.empty(cfg)
    for path, leaf in table.paths(cfg):
        if not leaf.segments:
            set_leaf(out, path, get_leaf(unfused, path))
        else:
            set_leaf(out, path, fuse_segments(cfg, leaf, [get_leaf(unfused, path[:-1] + (seg.key,))
                                                          for seg in leaf.segments]))
    return out


def _map_rows(cfg: ModelConfig, fn) -> Params:
    """The unfused-naming pytree with ``fn(fused leaf path, row, segment)`` at each leaf."""
    rows = unfused_rows(cfg)
    flat, treedef = jax.tree_util.tree_flatten_with_path(rows, is_leaf=lambda x: isinstance(x, tuple))
    out = []
    for tree_path, (leaf, j) in flat:
        path = key_path(tree_path)
        out.append(fn(path if j is None else path[:-1] + (leaf.key,), leaf, j))
    return jax.tree.unflatten(treedef, out)
