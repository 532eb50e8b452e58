"""The decoder's parameter table: every leaf of the SDAR / Qwen3 / LLaDA2 parameter pytree, described once.

SDAR / Qwen3 dense, SDAR-MoE (a Qwen3-MoE backbone) and LLaDA2 run one decoder (:mod:`dllm_jax.model.qwen3`), so
they share one pytree and one table, :data:`DECODER` (its families carry it: :mod:`dllm_jax.model.family`). A row
(:class:`~dllm_jax.model.table.Leaf`) says, for one leaf:

* where it lives: top level, every layer, a dense layer's MLP, or a sparse layer's ``moe`` dict;
* its **shape rule**: dimension symbols (:data:`~dllm_jax.model.table.DIMS`) read from the ``ModelConfig``, and
  the config switch that makes it exist at all (q/k norms, biases, an untied head, expert bias, shared experts);
* its **logical axes**, the names :data:`dllm_jax.sharding.RULES` maps to mesh axes;
* its **dtype rule** (routing inputs stay float32 whatever the model's dtype) and how
  :func:`~dllm_jax.model.params.init_params` fills it;
* its **checkpoint names** in each family's published layout: ``"qwen3"`` (SDAR, SDAR-MoE, Qwen3(-MoE)) and
  ``"llada2"`` (LLaDA2 / Bailing). Layer names are relative to ``model.layers.{i}.``; ``{e}`` is an expert index
  (one tensor per expert, stacked here on the leading axis). The first name is the one written; the others are
  also read.

**Fused leaves.** q|k|v is one leaf per layer, ``qkv [Q + 2*KV, H]`` (and ``qkv_bias``), and gate|up one,
``gate_up [2*I, H]`` (the shared experts' ``shared_gate_up [2*S, H]``, the routed experts' ``gate_up [E, 2*M, H]``),
so the forward runs one matmul where it ran three / two. Such a row lists its **segments**
(:class:`~dllm_jax.model.table.Segment`), one per checkpoint tensor (``q_proj``, ``k_proj``, ``v_proj``;
``gate_proj``, ``up_proj``) with its rows and names; each checkpoint tensor is copied into its segment's rows.
Segments that share a name are one fused checkpoint tensor (LLaDA2's ``query_key_value``, transformers 5's
``gate_up_proj``): on one shard block that tensor IS the leaf (one copy). The rows are laid out **shard-major** for
tensor parallelism: with ``g`` blocks (``ModelConfig.tp_shards``, the engine's TP degree, when every shard gets
whole q and KV heads / equal MLP halves; else 1), block ``s`` is ``[q_s; k_s; v_s]`` (``[gate_s; up_s]``), so
splitting the out axis over ``g`` shards gives each shard its own heads (a plain ``[q; k; v]`` split over shards
would not). :mod:`dllm_jax.model.fused_layout` holds that layout; the unfused names (``layers.0.q``: the leaves
before fusion) still name their segments.

Projection matrices (``matrix=True``) are stored as the checkpoints store them, ``[out, in]`` (stacked experts
``[E, out, in]``; the LM head ``[V, H]`` like the embedding), and the forward contracts their last axis
(:func:`dllm_jax.model.moe.linear`): XLA:GPU / cuBLAS and XLA:CPU take that operand order without a copy, so
loading a checkpoint is a copy of each tensor, never a transpose. A checkpoint tensor goes to its rows of a fused
leaf (its shard blocks), a copy too. (XLA:CPU runs small matrices faster ``[in, out]``: a small model's runner
computes over ``[in, out]`` copies made beside the stored leaves, :mod:`dllm_jax.model.compute_layout`.)

Everything else derives from these rows: shapes, dtypes, initial values (:mod:`dllm_jax.model.params`), the
sharding axes (:data:`PARAM_AXES`, read by :mod:`dllm_jax.sharding`) and the checkpoint name maps both ways
(:mod:`dllm_jax.model.checkpoint_names`).
"""

from __future__ import annotations

from dllm_jax.model.table import DENSE, LAYER, MOE, TOP, Leaf, ParamTable, row, segment

FAMILIES = ("qwen3", "llada2")  # checkpoint layouts of the decoder table (ModelConfig.family)


def _leaf(key, where, shape, axes, init, names, **kw) -> Leaf:
    """A row; ``names``: one name for both layouts, or ``{layout: name or (names...)}``."""
    return row(key, where, shape, axes, init, names, layouts=FAMILIES, **kw)


def _seg(key, rows, names):
    return segment(key, rows, names, layouts=FAMILIES)


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


DECODER = ParamTable(DECODER_LEAVES)

# logical axes of every decoder parameter, by :meth:`Leaf.axes_key`: what dllm_jax.sharding maps to mesh axes
# (other families' rows carry theirs: :func:`dllm_jax.model.params.param_axes`).
PARAM_AXES: dict[str, tuple[str, ...]] = {leaf.axes_key: leaf.axes for leaf in DECODER_LEAVES}
