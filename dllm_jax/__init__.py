"""dllm-jax: a serving engine for block-diffusion language models (SDAR / LLaDA2) in JAX."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["Engine", "EngineConfig", "generate", "__version__"]


def __getattr__(name):
    # Lazy: `import dllm_jax` must stay cheap (no JAX compile, no tokenizer load) and must not need fastapi.
    if name == "Engine":
        from dllm_jax.engine import Engine

        return Engine
    if name == "EngineConfig":
        from dllm_jax.engine.config import EngineConfig

        return EngineConfig
    if name == "generate":
        from dllm_jax.engine import generate

        return generate
    raise AttributeError(f"module 'dllm_jax' has no attribute {name!r}")
