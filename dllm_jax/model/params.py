"""The parameter table: every leaf of the decoder's parameter pytree, described once.

SDAR / Qwen3 dense, SDAR-MoE (a Qwen3-MoE backbone) and LLaDA2 run one decoder (:mod:`dllm_jax.model.qwen3`), so
they share one pytree and one table, :data:`DECODER`. A row (:class:`Leaf`) says, for one leaf:

* where it lives: top level, every layer, a dense layer's MLP, or a sparse layer's ``moe`` dict;
* its **shape rule**: dimension symbols (:data:`DIMS`) read from the :class:`ModelConfig`, and the config switch
  that makes it exist at all (q/k norms, biases, an untied head, expert bias, shared experts);
* its **logical axes**, the names :data:`dllm_jax.sharding.RULES` maps to mesh axes;
* its **dtype rule** (routing inputs stay float32 whatever the model's dtype) and how :func:`init_params` fills it;
* its **checkpoint names** in each family's published layout: ``"qwen3"`` (SDAR, SDAR-MoE, Qwen3(-MoE)) and
  ``"llada2"`` (LLaDA2 / Bailing). Layer names are relative to ``model.layers.{i}.``; ``{e}`` is an expert index
  (one tensor per expert, stacked here on the leading axis). The first name is the one written; the others are
  also read.

**Fused leaves.** q|k|v is one leaf per layer, ``qkv [Q + 2*KV, H]`` (and ``qkv_bias``), and gate|up one,
``gate_up [2*I, H]`` (the shared experts' ``shared_gate_up [2*S, H]``, the routed experts' ``gate_up [E, 2*M, H]``),
so the forward runs one matmul where it ran three / two. Such a row lists its **segments** (:class:`Segment`), one
per checkpoint tensor (``q_proj``, ``k_proj``, ``v_proj``; ``gate_proj``, ``up_proj``) with its rows and names; each
checkpoint tensor is copied into its segment's rows. Segments that share a name are one fused checkpoint tensor
(LLaDA2's ``query_key_value``, transformers 5's ``gate_up_proj``): on one shard block that tensor IS the leaf (one
copy). The rows are laid out **shard-major** for tensor parallelism: with ``g`` blocks (``ModelConfig.tp_shards``,
the engine's TP degree, when every shard gets whole q and KV heads / equal MLP halves; else 1), block ``s`` is
``[q_s; k_s; v_s]`` (``[gate_s; up_s]``), so splitting the out axis over ``g`` shards gives each shard its own heads
(a plain ``[q; k; v]`` split over shards would not). :mod:`dllm_jax.model.fused` holds that layout; the unfused
names (``layers.0.q``: the leaves before fusion) still name their segments.

Projection matrices (``matrix=True``) are stored as the checkpoints store them, ``[out, in]`` (stacked experts
``[E, out, in]``; the LM head ``[V, H]`` like the embedding), and the forward contracts their last axis
(:func:`dllm_jax.model.moe.linear`): XLA:GPU / cuBLAS and XLA:CPU take that operand order without a copy (on CPU it
measured as fast or faster than ``[in, out]``, bench/RESULTS.md), so loading a checkpoint is a copy of each tensor,
never a transpose. A checkpoint tensor goes to its rows of a fused leaf (its shard blocks), a copy too.

Everything else derives from these rows: :func:`param_shapes`, :func:`param_dtypes`, :func:`init_params` and
:func:`abstract_params` (what ``jax.eval_shape`` of the initialiser gives, without tracing it), the sharding axes
(:data:`PARAM_AXES`, read by :mod:`dllm_jax.sharding`) and the checkpoint name maps both ways
(:mod:`dllm_jax.model.checkpoint_names`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Iterator

import jax
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
FAMILIES = ("qwen3", "llada2")  # checkpoint layouts of the decoder table (ModelConfig.family)


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
        """The leaf's name in :data:`PARAM_AXES` (``moe.`` prefixed inside a sparse layer's ``moe`` dict)."""
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


def _names(names) -> dict[str, tuple[str, ...]]:
    """``names``: one name for every family, or ``{family: name or (names...)}``."""
    if isinstance(names, str):
        names = {f: names for f in FAMILIES}
    return {f: (n,) if isinstance(n, str) else tuple(n) for f, n in names.items()}


def _leaf(key, where, shape, axes, init, names, **kw) -> Leaf:
    return Leaf(key, where, tuple(shape.split()), tuple(axes), init, _names(names), **kw)


def _seg(key, rows, names) -> Segment:
    return Segment(key, rows, _names(names))


_QKV, _QKV_BIAS = "attention.query_key_value.weight", "attention.query_key_value.bias"  # LLaDA2's fused q/k/v
_EXPERT = "mlp.experts.{e}.%s_proj.weight"  # {e}: one tensor per expert
_GATE_UP, _DOWN3 = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"  # transformers >= 5: all experts in one

# Each row: geometry on its first line; then the checkpoint names, the transposition and the config rules.
DECODER_LEAVES: tuple[Leaf, ...] = (
    #     key            where  shape    logical axes                           init
    _leaf("embed",       TOP,   "V H",   ("vocab", "hidden"),                   "normal",
          {"qwen3": "model.embed_tokens.weight", "llada2": "model.word_embeddings.weight"}),
    _leaf("final_norm",  TOP,   "H",     ("hidden",),                           "ones",
          "model.norm.weight"),
    _leaf("lm_head",     TOP,   "V H",   ("vocab", "hidden"),                   "normal",
          "lm_head.weight", matrix=True,
          present=lambda c: not c.tie_word_embeddings),  # tied: the embedding serves (a stray head is ignored)
    _leaf("attn_norm",   LAYER, "H",     ("hidden",),                           "ones",
          "input_layernorm.weight"),
    _leaf("qkv",         LAYER, "QKV H", ("qkv", "hidden"),                     "normal",
          {}, matrix=True, segments=(
              _seg("q", "Q", {"qwen3": "self_attn.q_proj.weight", "llada2": _QKV}),
              _seg("k", "KV", {"qwen3": "self_attn.k_proj.weight", "llada2": _QKV}),
              _seg("v", "KV", {"qwen3": "self_attn.v_proj.weight", "llada2": _QKV}))),
    _leaf("o",           LAYER, "H Q",   ("hidden", "q_heads"),                 "normal",
          {"qwen3": "self_attn.o_proj.weight", "llada2": "attention.dense.weight"}, matrix=True),
    _leaf("qkv_bias",    LAYER, "QKV",   ("qkv",),                              "zeros",
          {}, present=lambda c: c.attention_bias, segments=(
              _seg("q_bias", "Q", {"qwen3": "self_attn.q_proj.bias", "llada2": _QKV_BIAS}),
              _seg("k_bias", "KV", {"qwen3": "self_attn.k_proj.bias", "llada2": _QKV_BIAS}),
              _seg("v_bias", "KV", {"qwen3": "self_attn.v_proj.bias", "llada2": _QKV_BIAS}))),
    _leaf("o_bias",      LAYER, "H",     ("hidden",),                           "zeros",
          {"llada2": "attention.dense.bias"},  # Bailing's ``use_bias``; Qwen3 has none
          present=lambda c: c.o_bias),
    _leaf("q_norm",      LAYER, "D",     ("head_dim",),                         "ones",
          {"qwen3": "self_attn.q_norm.weight", "llada2": "attention.query_layernorm.weight"},
          present=lambda c: c.use_qk_norm),
    _leaf("k_norm",      LAYER, "D",     ("head_dim",),                         "ones",
          {"qwen3": "self_attn.k_norm.weight", "llada2": "attention.key_layernorm.weight"},
          present=lambda c: c.use_qk_norm),
    _leaf("mlp_norm",    LAYER, "H",     ("hidden",),                           "ones",
          "post_attention_layernorm.weight"),
    _leaf("gate_up",     DENSE, "2I H",  ("gate_up", "hidden"),                 "normal",
          {}, matrix=True, segments=(_seg("gate", "I", "mlp.gate_proj.weight"),
                                     _seg("up", "I", "mlp.up_proj.weight"))),
    _leaf("down",        DENSE, "H I",   ("hidden", "mlp"),                     "normal",
          "mlp.down_proj.weight", matrix=True),
    _leaf("router",      MOE,   "E H",   ("router", "hidden"),                  "normal",
          "mlp.gate.weight", matrix=True,
          float32=lambda c: c.router_fp32),  # an fp32-router checkpoint: weights and logits in float32
    _leaf("expert_bias", MOE,   "E",     ("router",),                           "zeros",
          "mlp.gate.expert_bias",
          present=lambda c: c.moe_expert_bias,
          float32=lambda c: True),  # it decides WHICH experts: a bf16 bias would flip near ties
    # Experts stacked [E, out, in] (an ``expert`` mesh axis splits the leading axis); one tensor per expert in
    # the checkpoints (each copied into its row), or (transformers >= 5, Qwen3-MoE) 3D [E, out, in] tensors with
    # gate and up concatenated along out.
    _leaf("gate_up",     MOE,   "E 2M H", ("experts", "expert_gate_up", "hidden"), "normal",
          {}, matrix=True, segments=(
              _seg("gate", "M", {"qwen3": (_EXPERT % "gate", _GATE_UP, _GATE_UP + ".weight"),
                                      "llada2": _EXPERT % "gate"}),
              _seg("up", "M", {"qwen3": (_EXPERT % "up", _GATE_UP, _GATE_UP + ".weight"),
                                    "llada2": _EXPERT % "up"}))),
    _leaf("down",        MOE,   "E H M", ("experts", "hidden", "expert_mlp"),   "normal",
          {"qwen3": (_EXPERT % "down", _DOWN3, _DOWN3 + ".weight"), "llada2": _EXPERT % "down"},
          matrix=True),
    # Shared experts (all of them fused as one SwiGLU, added unscaled).
    _leaf("shared_gate_up", MOE, "2S H", ("gate_up", "hidden"),                 "normal",
          {}, matrix=True, present=lambda c: c.num_shared_experts > 0, segments=(
              _seg("shared_gate", "S", "mlp.shared_experts.gate_proj.weight"),
              _seg("shared_up", "S", "mlp.shared_experts.up_proj.weight"))),
    _leaf("shared_down", MOE,   "H S",   ("hidden", "mlp"),                     "normal",
          "mlp.shared_experts.down_proj.weight", matrix=True,
          present=lambda c: c.num_shared_experts > 0),
)


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
    """The :data:`PARAM_AXES` key of a pytree path (its last key, ``moe.`` prefixed under ``moe``)."""
    keys = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
    return "moe." + keys[-1] if "moe" in keys[:-1] else keys[-1]


DECODER = ParamTable(DECODER_LEAVES)
TABLES: dict[str, ParamTable] = {"qwen3": DECODER, "llada2": DECODER}  # family -> its table


def param_table(cfg: ModelConfig | None = None) -> ParamTable:
    """The table of ``cfg``'s model family (:func:`dllm_jax.model.family.family_of`; SDAR / Qwen3, SDAR-MoE and
    LLaDA2 share the decoder's; None: Qwen3's)."""
    if cfg is None:
        return TABLES["qwen3"]
    from dllm_jax.model.family import family_of  # the families import this module

    return family_of(cfg).param_table


# logical axes of every decoder parameter, by :meth:`Leaf.axes_key`: what dllm_jax.sharding maps to mesh axes
# (other families' rows carry theirs: :func:`param_axes`).
PARAM_AXES: dict[str, tuple[str, ...]] = {leaf.axes_key: leaf.axes for leaf in DECODER_LEAVES}


def register_table(layout: str, table: "ParamTable") -> None:
    """Add a family's table under its checkpoint layout name (``ModelConfig.family``)."""
    TABLES[layout] = table


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

    from dllm_jax.model.fused import join_fused, segment_rows, unfused_rows

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


from dllm_jax.model import gemma_params as _gemma_params  # noqa: E402,F401  (registers DiffusionGemma's table)
