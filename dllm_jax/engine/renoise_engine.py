"""The engine over a Gemma4Renoise family (DiffusionGemma): its runner, scheduler, pools and request checks.

A mixin of :class:`dllm_jax.engine.engine.Engine`: ``_build_renoise`` replaces the SDAR runner / scheduler with
:class:`~dllm_jax.engine.renoise_runner.RenoiseRunner` / :class:`~dllm_jax.engine.renoise_scheduler.RenoiseScheduler`;
everything else (the inbox, the loop thread, ``generate``, streaming, abort, the server) is the engine's own.

Pools: pages of :data:`PAGE_SIZE` tokens (canvases start anywhere, so pages are finer than a canvas). The sliding
layers' pool is sized to the window bound of every running row; the full layers' pool takes the memory left
(``mem_fraction`` / ``num_kv_pages`` as for the other families).
"""

from __future__ import annotations

import logging

import jax

from dllm_jax.decode import renoise
from dllm_jax.decode.step import kv_bytes_per_page
from dllm_jax.engine.memory import KVBudget, available_memory, human, plan_kv_pool
from dllm_jax.engine.output import Output
from dllm_jax.engine.renoise_runner import RenoiseRunner
from dllm_jax.engine.renoise_scheduler import RenoiseScheduler
from dllm_jax.model.family import family_of
from dllm_jax.model.gemma import FULL_KIND, SLIDING_KIND
from dllm_jax.model.generation import renoise_defaults

log = logging.getLogger(__name__)
PAGE_SIZE = 16
# Request options a renoise request cannot take: the canvas is sampled by the renoise schedule alone (SGLang
# refuses the same ones for this model).
_REFUSED = (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0), ("min_new_tokens", 0),
            ("logit_bias", ()), ("top_logprobs_num", 0))


def uses_renoise(cfg) -> bool:
    return family_of(cfg).default_algorithm == renoise.NAME


class RenoiseServing:
    def _build_renoise(self, loaded, o) -> None:
        cfg = self.config
        if o.algorithm not in (None, renoise.NAME):
            raise ValueError(f"algorithm: {o.algorithm!r} does not decode {cfg.architecture}; it decodes with "
                             f"{renoise.NAME} (uniform-noise canvases, no mask token)")
        if o.tensor_parallel_size * o.expert_parallel_size > 1:
            raise ValueError("tensor_parallel_size / expert_parallel_size: serving DiffusionGemma on a mesh is not "
                             "built yet (its sharding rules are in the parameter table; the serving path is "
                             "single-device)")
        self.rcfg = self.algorithm = renoise.renoise_config(o.algorithm_config, renoise_defaults(self.model_path))
        self.algorithm_name = renoise.NAME
        C, S = self.block_size, PAGE_SIZE
        chunk = max(C, o.max_prefill_tokens)
        window = cfg.sliding_window if any(cfg.is_sliding_layer(i) for i in range(cfg.num_layers)) else None
        per_row = (-(-(window - 1 + chunk) // S) + 2) if window else 1
        cached_windows = -(-(window - 1) // S) + 1 if window else 0  # room for as many cached prefixes' windows
        sliding_pages = o.max_running_requests * (per_row + cached_windows) + 1
        sliding_bytes = sliding_pages * kv_bytes_per_page(cfg, S, o.dtype, sliding=True)
        full_page = kv_bytes_per_page(cfg, S, o.dtype, sliding=False)
        device = jax.devices()[0]
        free = None
        if o.num_kv_pages is None:
            free, _ = available_memory(device)
            free = max(0, free - sliding_bytes)
        budget = plan_kv_pool(page_bytes=full_page, block_size=S, context_length=self.context_length,
                              max_running_requests=o.max_running_requests, mem_fraction=o.mem_fraction, device=device,
                              num_kv_pages=o.num_kv_pages, free_bytes=free)
        self.kv_budget = KVBudget(budget.num_pages, full_page, S, budget.source + f"; sliding-window pool "
                                  f"{sliding_pages:,} pages ({human(sliding_bytes)})")
        self.num_kv_pages = budget.num_pages
        log.info("%s", self.kv_budget.describe(self.context_length))
        self.max_running_requests = o.max_running_requests
        self.enable_prefix_cache = o.enable_prefix_cache
        self.tensor_parallel_size, self.expert_parallel_size, self.mesh = 1, 1, None
        self.runner = RenoiseRunner(loaded.params, cfg, self.rcfg,
                                    num_pages={FULL_KIND: budget.num_pages, SLIDING_KIND: sliding_pages},
                                    page_size=S, max_rows=o.max_running_requests,
                                    max_pages_per_row=-(-self.context_length // S), max_chunk=chunk,
                                    first_finish=o.schedule != "sync", backend=self.confidence_backend,
                                    dtype=o.dtype)
        self.output = Output(self.tokenizer, block_size=C, mask_token_id=None)
        self.scheduler = RenoiseScheduler(
            self.runner, canvas=C, eos_token_ids=self.eos_token_ids, max_running_requests=o.max_running_requests,
            context_length=self.context_length, window=window, output=self.output, schedule=o.schedule,
            max_steps_per_call=o.max_steps_per_call or 1 << 30, max_prefill_tokens=chunk,
            enable_prefix_cache=o.enable_prefix_cache)
        self.allocator = self.scheduler.full
        self.radix = self.scheduler.index  # flush_cache / get_load read it as the SDAR engine's radix index

    def _check_renoise_request(self, params) -> None:
        """A ValueError naming the first option a renoise request cannot take."""
        for name, default in _REFUSED:
            if getattr(params, name) != default:
                raise ValueError(f"{name}: not supported with {renoise.NAME} (sampling is governed by the renoise "
                                 f"schedule: temperature, acceptance and stopping come from algorithm_config)")

    def _renoise_info(self) -> dict:
        return {"family": family_of(self.config).name, "canvas_length": self.block_size,
                "algorithm_config": renoise.config_dict(self.rcfg), "kv_page_size": PAGE_SIZE,
                "sliding_window": self.config.sliding_window,
                "num_sliding_kv_pages": self.runner.num_pages[SLIDING_KIND]}

