"""Model configuration read from a Hugging Face ``config.json`` (the reading itself, field by field and family by
family, is :mod:`dllm_jax.hf_config`, whose names this module re-exports).

The config is a frozen dataclass so it can be a static argument of ``jax.jit``: two engines on the
same architecture share compiled executables.

Three families share one config (and one forward implementation, switched by these fields):

* ``qwen3`` -- dense SDAR / Qwen3 (``Qwen3ForCausalLM``, ``SDARForCausalLM``).
* ``qwen3`` with experts -- SDAR-MoE / Qwen3-MoE (``Qwen3MoeForCausalLM``, ``SDARMoeForCausalLM``):
  softmax router, top-k, optional ``norm_topk_prob``; dense layers from ``mlp_only_layers`` /
  ``decoder_sparse_step``.
* ``llada2`` -- LLaDA2.x (``LLaDA2MoeModelLM``, BailingMoE-v2 style): fused QKV, partial RoPE, dense
  layers before ``first_k_dense_replace``, sigmoid/softmax router with selection-only expert bias,
  group-limited top-k, routed scaling, shared experts, ``norm_head``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from dllm_jax.hf_config import (DEFAULT_LLADA2_BLOCK_SIZE, DEFAULT_SDAR_BLOCK_SIZE,  # noqa: F401 (re-exported)
                                DIFFUSION_GEMMA_ARCHITECTURES, DIFFUSION_GEMMA_MODEL_TYPES, FULL,
                                GEMMA_ROPE_TYPES, LLADA2_ARCHITECTURES, LLADA2_MODEL_TYPES, QWEN3_ARCHITECTURES,
                                QWEN3_MODEL_TYPES, SCORE_FUNCTIONS, SLIDING, SUPPORTED_ARCHITECTURES,
                                SUPPORTED_MODEL_TYPES, SUPPORTED_ROPE_TYPES, ConfigError, model_fields)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense MLP width (dense layers of a MoE model too; 0 if there are none)
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling_factor: float = 1.0  # linear RoPE scaling: positions are divided by this
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projection biases
    max_position_embeddings: int = 32768
    architecture: str = "Qwen3ForCausalLM"
    model_type: str = "qwen3"
    # Diffusion fields: None when the config does not say (the loader fills them from elsewhere).
    mask_token_id: int | None = None
    block_size: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Attention variants (LLaDA2 / Bailing).
    partial_rotary_factor: float = 1.0  # RoPE rotates the first head_dim * factor dims only
    use_qk_norm: bool = True  # per-head RMSNorm on q and k
    o_bias: bool = False  # output projection bias (Bailing ``use_bias``)
    norm_head: bool = False  # LM head columns L2-normalised over the vocabulary at load
    # Mixture of experts: layers listed in ``moe_layers`` have a sparse MLP, the others a dense one.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_layers: tuple[int, ...] = ()
    norm_topk_prob: bool = False  # renormalise the k selected weights to sum to one
    moe_score_func: str = "softmax"  # "softmax" | "sigmoid" over the router logits
    moe_expert_bias: bool = False  # per-expert bias added to the scores for SELECTION only
    moe_n_group: int = 1  # experts split into this many groups ...
    moe_topk_group: int = 1  # ... and a token chooses its experts inside its best this-many groups
    routed_scaling_factor: float = 1.0  # multiplies the routed (not the shared) output
    num_shared_experts: int = 0
    shared_expert_intermediate_size: int = 0  # per shared expert; they run fused as one dense MLP
    router_fp32: bool = False  # router weights kept and router logits computed in float32
    # Structural edit tokens of LLaDA2.2 InDel checkpoints (JointThresholdInDel); None = not an InDel model.
    delete_token_id: int | None = None
    split_token_id: int | None = None
    # DiffusionGemma (Gemma 4 text, encoder + decoder): a layer is sliding or full attention; full layers have
    # their own head dim / KV heads and RoPE, and no v_proj (values: the k projection through the v norm).
    layer_types: tuple[str, ...] = ()  # per layer, SLIDING / FULL; () = every layer alike (the other families)
    sliding_window: int | None = None  # a sliding layer's query at q sees keys k with q - k < window
    global_head_dim: int = 0  # full layers' head dim (0: head_dim)
    num_global_kv_heads: int = 0  # full layers' KV heads (0: num_kv_heads)
    # RoPE per layer kind: (rope_type, theta, partial_rotary_factor, factor); "proportional" rotates the first
    # partial * D/2 frequency pairs (over the whole head dim) and leaves the others still.
    rope_sliding: tuple = ()
    rope_full: tuple = ()
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    hidden_act: str = "silu"  # "silu" (SwiGLU) | "gelu_pytorch_tanh" (Gemma's gated GELU)
    # The tensor-parallel degree the fused q|k|v and gate|up leaves are laid out for (shard-major rows,
    # dllm_jax/model/fused.py); set by the engine before loading, never read from or written to config.json.
    tp_shards: int = 1

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def family(self) -> str:
        """``"llada2"``, ``"diffusion_gemma"`` or ``"qwen3"`` (dense or MoE): which checkpoint naming and defaults
        apply."""
        if self.architecture in DIFFUSION_GEMMA_ARCHITECTURES:
            return "diffusion_gemma"
        return "llada2" if self.architecture in LLADA2_ARCHITECTURES else "qwen3"

    def is_sliding_layer(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == SLIDING

    def layer_head_dim(self, layer: int) -> int:
        return self.global_head_dim if self.layer_types and not self.is_sliding_layer(layer) else self.head_dim

    def layer_kv_heads(self, layer: int) -> int:
        return self.num_global_kv_heads if self.layer_types and not self.is_sliding_layer(layer) \
            else self.num_kv_heads

    @property
    def is_moe(self) -> bool:
        return bool(self.moe_layers)

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers

    @property
    def shared_intermediate_total(self) -> int:
        return self.num_shared_experts * self.shared_expert_intermediate_size

    @property
    def default_block_size(self) -> int:
        return DEFAULT_LLADA2_BLOCK_SIZE if self.family == "llada2" else DEFAULT_SDAR_BLOCK_SIZE

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------------------------------
    # config.json -> ModelConfig
    # ------------------------------------------------------------------------------------------

    @classmethod
    def from_hf_dict(cls, hf: dict, source: str = "config.json") -> "ModelConfig":
        """The config of a ``config.json`` dict (:func:`dllm_jax.hf_config.model_fields`), validated: errors
        (:class:`ConfigError`) name ``source`` and the field."""
        cfg = cls(**model_fields(hf, source))
        _validate(cfg, source)
        return cfg

    @classmethod
    def from_model_dir(cls, model_dir: str) -> "ModelConfig":
        path = os.path.join(model_dir, "config.json")
        if not os.path.isfile(path):
            raise ConfigError(f"{path}: file not found (is '{model_dir}' a Hugging Face model directory?)")
        try:
            with open(path) as f:
                hf = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from e
        return cls.from_hf_dict(hf, source=path)

    # ------------------------------------------------------------------------------------------
    # ModelConfig -> config.json
    # ------------------------------------------------------------------------------------------

    def to_hf_dict(self) -> dict:
        """A config.json for this model (transformers-loadable for the Qwen3 family), plus the diffusion fields."""
        d = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
        }
        if self.rope_scaling_factor != 1.0:
            d["rope_scaling"] = {"rope_type": "linear", "factor": self.rope_scaling_factor}
        if self.family == "llada2":
            d.update(self._llada2_hf_fields())
        else:
            d["attention_bias"] = self.attention_bias
            if self.num_experts:
                d.update({
                    "num_experts": self.num_experts,
                    "num_experts_per_tok": self.num_experts_per_tok,
                    "moe_intermediate_size": self.moe_intermediate_size,
                    "norm_topk_prob": self.norm_topk_prob,
                    "decoder_sparse_step": 1,
                    "mlp_only_layers": [i for i in range(self.num_layers) if i not in self.moe_layers],
                })
        for key in ("mask_token_id", "block_size", "delete_token_id", "split_token_id"):
            if getattr(self, key) is not None:
                d[key] = getattr(self, key)
        if self.eos_token_ids:
            d["eos_token_id"] = list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else self.eos_token_ids[0]
        return d

    def _llada2_hf_fields(self) -> dict:
        first_dense = min(self.moe_layers) if self.moe_layers else self.num_layers
        if tuple(range(first_dense, self.num_layers)) != self.moe_layers:
            raise ConfigError("LLaDA2 configs need the sparse layers to be a suffix (first_k_dense_replace)")
        return {
            "use_qkv_bias": self.attention_bias,
            "use_bias": self.o_bias,
            "use_qk_norm": self.use_qk_norm,
            "use_rmsnorm": True,
            "norm_head": self.norm_head,
            "partial_rotary_factor": self.partial_rotary_factor,
            "num_experts": self.num_experts or None,
            "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size,
            "first_k_dense_replace": first_dense,
            "norm_topk_prob": self.norm_topk_prob,
            "score_function": self.moe_score_func,
            "moe_router_enable_expert_bias": self.moe_expert_bias,
            "n_group": self.moe_n_group,
            "topk_group": self.moe_topk_group,
            "routed_scaling_factor": self.routed_scaling_factor,
            "num_shared_experts": self.num_shared_experts,
            "moe_shared_expert_intermediate_size": self.shared_expert_intermediate_size,
            "router_dtype": "fp32" if self.router_fp32 else None,
        }


def _validate(cfg: ModelConfig, source: str) -> None:
    if cfg.layer_types:
        if cfg.attention_bias:
            raise ConfigError(f"{source}: text_config.attention_bias is not supported for DiffusionGemma")
        for what, kv, dim in (("num_key_value_heads", cfg.num_kv_heads, cfg.head_dim),
                              ("the full layers' num_key_value_heads", cfg.num_global_kv_heads,
                               cfg.global_head_dim)):
            if kv <= 0 or cfg.num_heads % kv or dim <= 0 or dim % 2:
                raise ConfigError(f"{source}: num_attention_heads ({cfg.num_heads}) must be a multiple of {what} "
                                  f"({kv}) and head dims ({dim}) even")
        if SLIDING in cfg.layer_types and (cfg.sliding_window is None or cfg.sliding_window < 2):
            raise ConfigError(f"{source}: text_config.sliding_window must be >= 2, got {cfg.sliding_window}")
    if cfg.num_heads % cfg.num_kv_heads:
        raise ConfigError(
            f"{source}: num_attention_heads ({cfg.num_heads}) must be a multiple of "
            f"num_key_value_heads ({cfg.num_kv_heads})"
        )
    if len(cfg.moe_layers) < cfg.num_layers and cfg.intermediate_size <= 0:
        raise ConfigError(f"{source}: missing required field 'intermediate_size' (the model has dense MLP layers)")
    if cfg.rotary_dim % 2 or not 0 < cfg.rotary_dim <= cfg.head_dim:
        raise ConfigError(f"{source}: partial_rotary_factor {cfg.partial_rotary_factor} gives rotary dim "
                          f"{cfg.rotary_dim}; it must be even and in (0, head_dim={cfg.head_dim}]")
    if not cfg.moe_layers:
        return
    if cfg.moe_intermediate_size <= 0:
        raise ConfigError(f"{source}: missing required field 'moe_intermediate_size'")
    if not 0 < cfg.num_experts_per_tok <= cfg.num_experts:
        raise ConfigError(f"{source}: num_experts_per_tok ({cfg.num_experts_per_tok}) must be in "
                          f"[1, num_experts={cfg.num_experts}]")
    if cfg.num_experts % cfg.moe_n_group or not 0 < cfg.moe_topk_group <= cfg.moe_n_group:
        raise ConfigError(f"{source}: n_group ({cfg.moe_n_group}) must divide num_experts ({cfg.num_experts}) and "
                          f"topk_group ({cfg.moe_topk_group}) must be in [1, n_group]")
    per_group = cfg.num_experts // cfg.moe_n_group
    if cfg.num_experts_per_tok > cfg.moe_topk_group * per_group:
        raise ConfigError(f"{source}: num_experts_per_tok ({cfg.num_experts_per_tok}) exceeds the experts in the "
                          f"topk_group={cfg.moe_topk_group} selected groups ({cfg.moe_topk_group * per_group})")
    if cfg.moe_n_group > 1 and cfg.moe_expert_bias and per_group < 2:
        raise ConfigError(f"{source}: group scores sum each group's top two experts; groups need >= 2 experts")
