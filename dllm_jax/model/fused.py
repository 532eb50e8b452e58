"""Fused leaves: q|k|v as one ``qkv`` leaf and gate|up as one ``gate_up`` leaf, so the forward runs one matmul where
it ran three / two, and the layout that keeps that correct under tensor parallelism.

A fused leaf stacks its segments (:class:`~dllm_jax.model.table.Segment`: the checkpoint tensors ``q_proj``,
``k_proj``, ``v_proj``; ``gate_proj``, ``up_proj``) along its out axis. TP splits the out axis into ``g`` equal
row blocks, one per shard, so a plain concatenation ``[q; k; v]`` would hand shard 0 all of q and nothing of v.
The rows are therefore **shard-major**: block ``s`` is ``[q_s; k_s; v_s]`` (``[gate_s; up_s]``), the ``s``-th
``1/g`` of each segment, with ``g = cfg.tp_shards`` (the engine's tensor-parallel degree, fixed before loading)
when every shard gets whole heads (equal MLP halves), else 1. With ``g = 1`` the leaf is the plain concatenation:
LLaDA2's ``query_key_value`` and transformers 5's ``gate_up_proj`` are then the leaf itself. The forward reshapes
the product to ``[..., g, rows/g]`` and splits each block the same way (:func:`dllm_jax.model.qwen3._qkv`).

One leaf's layout (its shard blocks, where a segment's rows live, fusing and splitting its arrays) is
:mod:`dllm_jax.model.fused_layout`, below the model code; this module re-exports it and adds the whole pytree:
the unfused naming (:func:`unfused_rows`, :func:`segment_alias`) and :func:`split_fused` / :func:`join_fused`,
over the table of ``cfg``'s family.
"""

from __future__ import annotations

import jax

from dllm_jax.config import ModelConfig
from dllm_jax.model.decoder_params import FAMILIES
from dllm_jax.model.family import param_table
from dllm_jax.model.fused_layout import (FUSED_AXES, fuse_segments, fused_axis_groups,  # noqa: F401 (re-exported)
                                         fused_groups, segment_blocks, segment_of, segment_rows)
from dllm_jax.model.table import MOE, Params, get_leaf, key_path, set_leaf


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
