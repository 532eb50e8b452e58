"""What an engine reports about itself: the model and settings (``get_model_info``) and its load (``get_load``).

A mixin of :class:`dllm_jax.engine.engine.Engine` (the attributes it reads are the engine's).
"""

from __future__ import annotations



class EngineInfo:
    def get_model_info(self) -> dict:
        cfg = self.config
        if hasattr(self, "rcfg"):  # Gemma4Renoise (renoise_engine.py)
            return {"model_path": self.model_path, "architecture": cfg.architecture, "block_size": self.block_size,
                    "eos_token_ids": list(self.eos_token_ids), "vocab_size": cfg.vocab_size, "dtype": self.dtype,
                    "algorithm": self.algorithm_name, "schedule": self.schedule,
                    "max_running_requests": self.max_running_requests, "num_kv_pages": self.num_kv_pages,
                    "kv_pool_tokens": self.kv_budget.tokens, "context_length": self.context_length,
                    "enable_prefix_cache": self.enable_prefix_cache, "confidence_backend": self.confidence_backend,
                    "default_sampling_params": dict(self.default_sampling_params), **self._renoise_info()}
        return {
            "model_path": self.model_path,
            "architecture": cfg.architecture,
            "block_size": self.block_size,
            "mask_token_id": self.mask_token_id,
            "eos_token_ids": list(self.eos_token_ids),
            "vocab_size": cfg.vocab_size,
            "algorithm": self.algorithm_name,
            "algorithm_config": dict(vars(self.algorithm.config)),
            "schedule": self.schedule,
            "fold_commit_forward": self.runner.greedy_spec.fold_commit,
            "chain_blocks": self.runner.chain,
            "enable_prefix_cache": self.enable_prefix_cache,
            "max_running_requests": self.max_running_requests,
            "num_kv_pages": self.num_kv_pages,
            "kv_pool_tokens": self.kv_budget.tokens,
            "kv_pool_bytes": self.kv_budget.pool_bytes,
            "default_sampling_params": dict(self.default_sampling_params),
            "context_length": self.context_length,
            "dtype": self.dtype,
            "attention_backend": self.attention_backend,
            "confidence_backend": self.confidence_backend,
            "tensor_parallel_size": self.tensor_parallel_size,
            "expert_parallel_size": self.expert_parallel_size,
        }

    def get_load(self) -> dict:
        """Counters for /metrics and tests (a snapshot; safe to read from other threads: the counter keys are
        fixed at start, so copying never races with the engine thread adding one)."""
        s = self.scheduler
        return {
            "running_requests": len(s.running),
            "queued_requests": len(s.waiting) + self._inbox.qsize(),
            "kv_pages_total": self.allocator.capacity,
            "kv_pages_free": self.allocator.num_free,
            "kv_pages_used": self.allocator.capacity - self.allocator.num_free,
            "kv_pages_cached": self.radix.total,
            "kv_pages_locked": self.radix.protected,
            **dict(s.stats),
        }
