"""Model configuration read from a Hugging Face ``config.json``.

The config is a frozen dataclass so it can be a static argument of ``jax.jit``: two engines on the
same architecture share compiled executables.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", "SDARForCausalLM")
SUPPORTED_MODEL_TYPES = ("qwen3", "sdar")
SUPPORTED_ROPE_TYPES = ("default", "linear")
DEFAULT_SDAR_BLOCK_SIZE = 4


class ConfigError(ValueError):
    """A model directory whose config cannot be served; the message names the file and field."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling_factor: float = 1.0  # linear RoPE scaling: positions are divided by this
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 32768
    architecture: str = "Qwen3ForCausalLM"
    model_type: str = "qwen3"
    # Diffusion fields: None when the config does not say (the loader fills them from elsewhere).
    mask_token_id: int | None = None
    block_size: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf_dict(cls, hf: dict, source: str = "config.json") -> "ModelConfig":
        def need(key: str):
            if key not in hf:
                raise ConfigError(f"{source}: missing required field '{key}'")
            return hf[key]

        archs = hf.get("architectures") or []
        model_type = hf.get("model_type")
        arch = archs[0] if archs else None
        if arch is not None and arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"{source}: unknown architecture '{arch}'; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"{source}: unknown model_type '{model_type}'; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if arch is None:
            arch = "SDARForCausalLM" if model_type == "sdar" else "Qwen3ForCausalLM"

        # transformers 5 writes rope_parameters; older configs write rope_theta + rope_scaling.
        rope = hf.get("rope_parameters") or {}
        scaling = hf.get("rope_scaling") or {}
        rope_theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(
                f"{source}: unsupported rope scaling type '{rope_type}'; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        factor = float(rope.get("factor", scaling.get("factor", 1.0))) if rope_type == "linear" else 1.0

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        head_dim = int(hf.get("head_dim") or hidden // heads)
        eos = hf.get("eos_token_id")
        eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else []))
        block = hf.get("block_size", hf.get("dllm_block_size"))
        mask = hf.get("mask_token_id")
        cfg = cls(
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling_factor=factor,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", False)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
            architecture=arch,
            model_type=model_type,
            mask_token_id=None if mask is None else int(mask),
            block_size=None if block is None else int(block),
            eos_token_ids=eos_ids,
        )
        if cfg.num_heads % cfg.num_kv_heads:
            raise ConfigError(
                f"{source}: num_attention_heads ({cfg.num_heads}) must be a multiple of "
                f"num_key_value_heads ({cfg.num_kv_heads})"
            )
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

    def to_hf_dict(self) -> dict:
        """A transformers-loadable Qwen3 config (plus the diffusion fields)."""
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
            "attention_bias": self.attention_bias,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
        }
        if self.rope_scaling_factor != 1.0:
            d["rope_scaling"] = {"rope_type": "linear", "factor": self.rope_scaling_factor}
        if self.mask_token_id is not None:
            d["mask_token_id"] = self.mask_token_id
        if self.block_size is not None:
            d["block_size"] = self.block_size
        if self.eos_token_ids:
            d["eos_token_id"] = list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else self.eos_token_ids[0]
        return d
