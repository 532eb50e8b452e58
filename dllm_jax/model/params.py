"""The parameter pytree of a model, derived from its family's parameter table.

A model family (:mod:`dllm_jax.model.family`) carries its table (:class:`~dllm_jax.model.table.ParamTable`:
:data:`~dllm_jax.model.decoder_params.DECODER` for SDAR / Qwen3, SDAR-MoE and LLaDA2,
:data:`~dllm_jax.model.gemma_params.GEMMA` for DiffusionGemma); :func:`param_table` finds it from a config, and
everything here derives from its rows: :func:`param_shapes`, :func:`param_dtypes`, :func:`init_params` and
:func:`abstract_params` (what ``jax.eval_shape`` of the initialiser gives, without tracing it) and
:func:`param_axes` (the logical axes :mod:`dllm_jax.sharding` maps to mesh axes).

The table's own names (rows, dimension symbols, pytree path helpers: :mod:`dllm_jax.model.table`; the decoder's
rows and :data:`PARAM_AXES`: :mod:`dllm_jax.model.decoder_params`) are importable from here too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dllm_jax.config import ModelConfig
from dllm_jax.model.decoder_params import DECODER, DECODER_LEAVES, FAMILIES, PARAM_AXES  # noqa: F401 (re-exported)
from dllm_jax.model.family import param_table
from dllm_jax.model.fused import join_fused, segment_rows, unfused_rows
from dllm_jax.model.table import (DENSE, DIMS, LAYER, MOE, TOP, Leaf, ParamTable, Params,  # noqa: F401 (re-exported)
                                  Segment, axes_key, get_leaf, has_leaf, key_path, name_path, path_name, set_leaf)


def param_axes(cfg: ModelConfig, path: tuple) -> tuple[str, ...]:
    """The logical axes of leaf ``path`` of ``cfg``'s model (its table row's)."""
    return param_table(cfg).leaf(path, cfg).axes


# ----------------------------------------------------------------------------------------------
# Derived: shapes, dtypes, initial values
# ----------------------------------------------------------------------------------------------

def param_shapes(cfg: ModelConfig) -> Params:
    """Shapes of every parameter, in the pytree layout the model uses: ``embed``, ``final_norm``, ``lm_head``
    (untied) and ``layers``, a list of dicts; a dense layer holds ``gate/up/down``, a sparse one an ``moe`` dict
    (router, experts stacked ``[E, ...]``, optional expert bias and shared experts)."""
    return param_table(cfg).tree(cfg, lambda leaf: leaf.shape_for(cfg))


def param_dtypes(cfg: ModelConfig, dtype) -> Params:
    """The pytree of :func:`param_shapes` with each leaf's storage dtype: ``dtype``, except routing leaves kept
    float32 (the expert bias; the router of an fp32-router checkpoint)."""
    return param_table(cfg).tree(cfg, lambda leaf: leaf.dtype_for(cfg, dtype))


def abstract_params(cfg: ModelConfig, dtype) -> Params:
    """The parameter tree as ``jax.ShapeDtypeStruct`` leaves (what ``jax.eval_shape(init_params)`` gives)."""
    return param_table(cfg).tree(cfg, lambda leaf: jax.ShapeDtypeStruct(leaf.shape_for(cfg),
                                                                        jnp.dtype(leaf.dtype_for(cfg, dtype))))


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32, std: float = 0.02) -> Params:
    """Random parameters (norm weights one, biases zero, matrices N(0, std)); one key per leaf of the unfused
    naming, in its pytree order, fused afterwards. Matrices are drawn in the ``[in, out]`` orientation and
    transposed, so a seed gives the same model as before matrices were stored ``[out, in]`` and before q|k|v and
    gate|up were fused."""
    def shape_of(leaf, j):
        shape = leaf.shape_for(cfg)
        if j is None:
            return shape
        return shape[:leaf.row_axis] + (segment_rows(cfg, leaf, j),) + shape[leaf.row_axis + 1:]

    rows = unfused_rows(cfg)
    flat, treedef = jax.tree_util.tree_flatten(rows, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(key, len(flat))
    out = []
    for (leaf, j), k in zip(flat, keys):
        shape, leaf_type = shape_of(leaf, j), leaf.dtype_for(cfg, dtype)
        if leaf.init == "ones":
            out.append(jnp.ones(shape, leaf_type))
        elif leaf.init == "zeros":
            out.append(jnp.zeros(shape, leaf_type))
        elif leaf.matrix:  # drawn [in, out] and transposed: a seed gives the model it gave before the layout change
            drawn = jax.random.normal(k, shape[:-2] + (shape[-1], shape[-2]), jnp.float32)
            out.append((std * jnp.swapaxes(drawn, -1, -2)).astype(leaf_type))
        else:
            out.append((std * jax.random.normal(k, shape, jnp.float32)).astype(leaf_type))
    return join_fused(cfg, jax.tree.unflatten(treedef, out))
