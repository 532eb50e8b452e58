"""What an engine reports about itself: the model and settings (``get_model_info``) and its load (``get_load``).

A mixin of :class:`dllm_jax.engine.engine.Engine` (the attributes it reads are the engine's).
"""

from __future__ import annotations



class EngineInfo:
    def get_model_info(self) -> dict:
        cfg = self.config
        return {"model_path": self.model_path, "architecture": cfg.architecture, "block_size": self.block_size,
                "eos_token_ids": list(self.eos_token_ids), "vocab_size": cfg.vocab_size,
                "algorithm": self.algorithm_name, "schedule": self.schedule,
                "enable_prefix_cache": self.enable_prefix_cache, "max_running_requests": self.max_running_requests,
                "num_kv_pages": self.num_kv_pages, "kv_pool_tokens": self.kv_budget.tokens,
                "default_sampling_params": dict(self.default_sampling_params), "context_length": self.context_length,
                "dtype": self.dtype, "confidence_backend": self.confidence_backend,
                **self.family_info()}  # the family's own (dllm_jax/engine/families.py)

    def get_load(self) -> dict:
        """Counters for /metrics and tests (a snapshot; safe to read from other threads: the counter keys are
        fixed at start, so copying never races with the engine thread adding one)."""
        s = self.scheduler
        return {
            "running_requests": len(s.running),
            "queued_requests": len(s.waiting) + self._inbox.qsize(),
            **s.policy.cache_load(),
            **dict(s.stats),
        }
