"""The engine: requests, the scheduler, the device runner and the public ``Engine``."""

from dllm_jax.engine.engine import Engine, generate
from dllm_jax.engine.sampling import SamplingParams

__all__ = ["Engine", "generate", "SamplingParams"]
