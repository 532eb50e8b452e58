"""What a model family keeps in the KV page pool, per layer (:class:`LayerKV`): the family's ``kv_layout(cfg)``
(:mod:`dllm_jax.model.family`), from which the page pool and the bytes of one page derive
(:func:`dllm_jax.decode.step.init_kv_pages`, ``kv_bytes_per_page``). Below the model code, which returns it."""

from __future__ import annotations

import dataclasses
from typing import Any

from dllm_jax.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class LayerKV:
    """What one layer keeps in the KV page pool: a K and a V array ``[kv_heads, pages, B, head_dim]`` each."""

    kv_heads: int
    head_dim: int
    dtype: Any = None  # stored dtype; None: the engine's KV dtype (``kv_dtype``)
    window: int | None = None  # a sliding-window layer never reads keys older than this (None: full attention)
    tensors: int = 2  # arrays per layer: K and V, or one (DiffusionGemma's full layers keep the raw k projection)


def uniform_kv_layout(cfg: ModelConfig) -> tuple[LayerKV, ...]:
    """Every layer alike: ``num_kv_heads`` heads of ``head_dim``, full attention, the pool's dtype."""
    return (LayerKV(cfg.num_kv_heads, cfg.head_dim),) * cfg.num_layers
