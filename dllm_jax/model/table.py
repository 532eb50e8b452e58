"""A parameter table: one row per leaf of a model family's parameter pytree, described once.

A row (:class:`Leaf`) says, for one leaf:

* where it lives: top level, every layer, a dense layer's MLP, or a sparse layer's ``moe`` dict (a family's own
  table may add places: DiffusionGemma's sliding and full layers);
* its **shape rule**: dimension symbols (:data:`DIMS`) read from the :class:`ModelConfig`, and the config switch
  that makes it exist at all (``present``);
* its **logical axes**, the names :data:`dllm_jax.sharding.RULES` maps to mesh axes;
* its **dtype rule** (``float32``: kept float32 whatever the model's dtype) and how the initialiser fills it;
* its **checkpoint names** in each of its family's checkpoint layouts (``ModelConfig.family``); a fused leaf lists
  its **segments** (:class:`Segment`, :mod:`dllm_jax.model.fused`), one per checkpoint tensor.

A :class:`ParamTable` is the rows of one pytree, with its structure (its paths, its per-layer lists). The tables:
:data:`dllm_jax.model.decoder_params.DECODER` (SDAR / Qwen3, SDAR-MoE, LLaDA2) and
:data:`dllm_jax.model.gemma_params.GEMMA`; each model family (:mod:`dllm_jax.model.family`) carries its own, and
:mod:`dllm_jax.model.params` derives shapes, dtypes and initial values from the family's. Also here: the pytree
path helpers every table user shares.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Iterator

import jax.numpy as jnp

from dllm_jax.config import ModelConfig

Params = dict[str, Any]

# Dimension symbols of the shape rules.
DIMS: dict[str, Callable[[ModelConfig], int]] = {
    "V": lambda c: c.vocab_size,
    "H": lambda c: c.hidden_size,
    "D": lambda c: c.head_dim,
    "Q": lambda c: c.q_size,  # q heads x head_dim
    "KV": lambda c: c.kv_size,  # KV heads x head_dim
    "I": lambda c: c.intermediate_size,  # a dense layer's SwiGLU
    "E": lambda c: c.num_experts,
    "M": lambda c: c.moe_intermediate_size,  # one expert's SwiGLU
    "S": lambda c: c.shared_intermediate_total,  # all shared experts, fused as one SwiGLU
    "QKV": lambda c: c.q_size + 2 * c.kv_size,  # fused q|k|v rows
    "2I": lambda c: 2 * c.intermediate_size,  # fused gate|up rows (dense, routed, shared)
    "2M": lambda c: 2 * c.moe_intermediate_size,
    "2S": lambda c: 2 * c.shared_intermediate_total,
    # DiffusionGemma's full-attention layers (their own head dim and KV heads)
    "GD": lambda c: c.global_head_dim,
    "GQ": lambda c: c.num_heads * c.global_head_dim,
    "GKV": lambda c: c.num_global_kv_heads * c.global_head_dim,
    "1": lambda c: 1,
}

TOP, LAYER, DENSE, MOE = "top", "layer", "dense", "moe"  # where a leaf lives (DENSE / MOE: by the layer's MLP)


@dataclasses.dataclass(frozen=True)
class Segment:
    """One checkpoint tensor's rows inside a fused leaf (``q`` of ``qkv``, ``gate`` of ``gate_up``): its key (the
    name the leaf had before fusion, still accepted as a path, ``layers.0.q``), its rows, its checkpoint names."""

    key: str
    rows: str  # DIMS symbol
    names: dict[str, tuple[str, ...]]


@dataclasses.dataclass(frozen=True)
class Leaf:
    key: str
    where: str  # TOP | LAYER | DENSE | MOE
    shape: tuple[str, ...]  # DIMS symbols
    axes: tuple[str, ...]  # logical axes (dllm_jax.sharding.RULES)
    init: str  # "ones" | "zeros" | "normal" (init_params)
    names: dict[str, tuple[str, ...]]  # family -> checkpoint names (first: the one written)
    matrix: bool = False  # a projection matrix, stored [out, in] ([E, out, in]) as the checkpoints store it
    present: Callable[[ModelConfig], bool] | None = None  # None: always
    float32: Callable[[ModelConfig], bool] | None = None  # kept float32 whatever the model dtype (None: never)
    segments: tuple[Segment, ...] = ()  # a fused leaf's parts, in canonical (single-shard) row order

    def exists(self, cfg: ModelConfig) -> bool:
        return self.present is None or bool(self.present(cfg))

    def shape_for(self, cfg: ModelConfig) -> tuple[int, ...]:
        return tuple(DIMS[d](cfg) for d in self.shape)

    def dtype_for(self, cfg: ModelConfig, dtype):
        return jnp.float32 if self.float32 is not None and self.float32(cfg) else dtype

    @property
    def axes_key(self) -> str:
        """The leaf's name in :data:`~dllm_jax.model.params.PARAM_AXES` (``moe.`` prefixed inside a sparse layer's
        ``moe`` dict)."""
        return "moe." + self.key if self.where == MOE else self.key

    def hf_names(self, family: str) -> tuple[str, ...]:
        """Its checkpoint names (a fused leaf's: its segments', each once, in order)."""
        if self.segments:
            return tuple(dict.fromkeys(n for seg in self.segments for n in seg.names.get(family, ())))
        return self.names.get(family, ())

    @property
    def row_axis(self) -> int:
        """The out axis its segments are stacked along (1 for stacked experts ``[E, out, in]``)."""
        return 1 if len(self.shape) == 3 else 0


def names_of(names, layouts: tuple[str, ...] = ()) -> dict[str, tuple[str, ...]]:
    """Checkpoint names by layout: ``names`` is one name for every layout of ``layouts``, or ``{layout: name or
    (names...)}``."""
    if isinstance(names, str):
        names = {layout: names for layout in layouts}
    return {layout: (n,) if isinstance(n, str) else tuple(n) for layout, n in names.items()}


def row(key, where, shape: str, axes, init, names, *, layouts: tuple[str, ...] = (), **kw) -> Leaf:
    """A :class:`Leaf` written compactly: ``shape`` as space-separated :data:`DIMS` symbols, ``names`` as
    :func:`names_of` takes them."""
    return Leaf(key, where, tuple(shape.split()), tuple(axes), init, names_of(names, layouts), **kw)


def segment(key, rows, names, *, layouts: tuple[str, ...] = ()) -> Segment:
    return Segment(key, rows, names_of(names, layouts))


@dataclasses.dataclass(frozen=True)
class ParamTable:
    """A model family's parameter table (the rows of one pytree)."""

    leaves: tuple[Leaf, ...]

    def leaf(self, path: tuple, cfg: ModelConfig | None = None) -> Leaf:
        """The row of pytree path ``("embed",)``, ``("layers", i, "q")`` or ``("layers", i, "moe", "gate")``
        (``cfg``: for tables whose rows depend on the layer, e.g. DiffusionGemma's)."""
        return self._by_axes_key[axes_key(path)]

    @functools.cached_property
    def _by_axes_key(self) -> dict[str, Leaf]:
        return {leaf.axes_key: leaf for leaf in self.leaves}

    def layer_leaves(self, cfg: ModelConfig, i: int) -> Iterator[Leaf]:
        """The rows present in layer ``i`` (attention, then the dense or the sparse MLP's)."""
        mlp = MOE if cfg.is_moe_layer(i) else DENSE
        for leaf in self.leaves:
            if leaf.where in (LAYER, mlp) and leaf.exists(cfg):
                yield leaf

    def paths(self, cfg: ModelConfig) -> Iterator[tuple[tuple, Leaf]]:
        """``(pytree path, row)`` of every leaf ``cfg``'s model has."""
        for leaf in self.leaves:
            if leaf.where == TOP and leaf.exists(cfg):
                yield (leaf.key,), leaf
        for i in range(cfg.num_layers):
            for leaf in self.layer_leaves(cfg, i):
                yield (("layers", i, "moe", leaf.key) if leaf.where == MOE else ("layers", i, leaf.key)), leaf

    def empty(self, cfg: ModelConfig) -> Params:
        """The pytree's skeleton: its per-layer lists, each of empty dicts."""
        return {"layers": [{} for _ in range(cfg.num_layers)]}

    def tree(self, cfg: ModelConfig, value: Callable[[Leaf], Any]) -> Params:
        """The pytree of ``cfg``'s model with ``value(row)`` at each leaf."""
        out = self.empty(cfg)
        for path, leaf in self.paths(cfg):
            set_leaf(out, path, value(leaf))
        return out


def axes_key(path: tuple) -> str:
    """The :data:`~dllm_jax.model.params.PARAM_AXES` key of a pytree path (its last key, ``moe.`` prefixed under
    ``moe``)."""
    keys = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
    return "moe." + keys[-1] if "moe" in keys[:-1] else keys[-1]


# ----------------------------------------------------------------------------------------------
# Pytree paths
# ----------------------------------------------------------------------------------------------

def get_leaf(tree, path: tuple):
    for p in path:
        tree = tree[p]
    return tree


def set_leaf(tree, path: tuple, value) -> None:
    for p in path[:-1]:
        tree = tree.setdefault(p, {}) if isinstance(tree, dict) else tree[p]
    tree[path[-1]] = value


def has_leaf(tree, path: tuple) -> bool:
    try:
        get_leaf(tree, path)
        return True
    except (KeyError, IndexError, TypeError):
        return False


def path_name(path: tuple) -> str:
    """A leaf's name in a converted directory (``layers.3.moe.gate_up``); :func:`name_path` is the inverse."""
    return ".".join(str(p) for p in path)


def name_path(name: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in name.split("."))


def key_path(tree_path) -> tuple:
    """A ``jax.tree_util`` key path as a plain tuple (``("layers", 3, "q")``)."""
    return tuple(getattr(k, "key", getattr(k, "idx", k)) for k in tree_path)
