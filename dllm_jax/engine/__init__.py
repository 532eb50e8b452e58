"""The engine: requests, the scheduler, the device runner and the public ``Engine`` / ``EngineConfig``."""

__all__ = ["Engine", "EngineConfig", "generate", "SamplingParams"]


def __getattr__(name):
    # Lazy: the command line reads EngineConfig (dllm_jax.engine.config) to build its parser without importing JAX.
    if name in ("Engine", "generate"):
        import dllm_jax.engine.engine as module

        return getattr(module, name)
    if name == "EngineConfig":
        from dllm_jax.engine.config import EngineConfig

        return EngineConfig
    if name == "SamplingParams":
        from dllm_jax.engine.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'dllm_jax.engine' has no attribute {name!r}")
