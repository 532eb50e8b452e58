"""What each kind of model family serves with: its runner, KV pools, block policy and what it reports, built for
the :class:`~dllm_jax.engine.engine.Engine` from the family's ``serving`` kind (:data:`SERVING`).

* ``"mask"`` (SDAR / Qwen3, SDAR-MoE, LLaDA2): :class:`~dllm_jax.engine.runner.ModelRunner` (packed rows, shape
  buckets, tensor / expert parallel, several processes), one page pool of blocks, the block radix index,
  :class:`~dllm_jax.engine.mask_blocks.MaskBlocks`;
* ``"canvas"`` (DiffusionGemma, Gemma4Renoise): :class:`~dllm_jax.engine.renoise_runner.RenoiseRunner` (per-slot
  canvas state on the device), a full-layer pool and a sliding-window pool of :data:`CANVAS_PAGE_SIZE`-token pages,
  the window-aware index, :class:`~dllm_jax.engine.canvases.Canvases`.

Either way the engine gets ``runner``, ``scheduler`` (the one :class:`~dllm_jax.engine.scheduler.Scheduler`),
``output``, ``kv_budget``, ``capabilities`` and ``family_info`` (its part of ``get_model_info``); everything else
in ``engine/`` reads only those.
"""

from __future__ import annotations

import logging
import math

import jax
import jax.numpy as jnp

from dllm_jax import compile_cache
from dllm_jax.cache.pages import PageAllocator
from dllm_jax.cache.radix import BlockRadixIndex
from dllm_jax.decode import renoise
from dllm_jax.decode.step import kv_bytes_per_page
from dllm_jax.engine.canvases import Canvases
from dllm_jax.engine.mask_blocks import MaskBlocks
from dllm_jax.engine.memory import KVBudget, available_memory, human, plan_kv_pool
from dllm_jax.engine.output import Output
from dllm_jax.engine.policy import Capabilities
from dllm_jax.engine.renoise_runner import RenoiseRunner
from dllm_jax.engine.runner import ModelRunner
from dllm_jax.engine.scheduler import Scheduler
from dllm_jax.model.family import family_of
from dllm_jax.model.gemma import FULL_KIND, SLIDING_KIND
from dllm_jax.model.generation import renoise_defaults
from dllm_jax.model.qwen3 import kv_storage_dtype

log = logging.getLogger("dllm_jax")
CANVAS_PAGE_SIZE = 16  # canvases start anywhere, so pages are finer than a canvas


def build_mask_blocks(engine, loaded, o, channel):
    """The SDAR / LLaDA2 runner, pool, radix index and policy (mask-based block diffusion). Returns the channel."""
    cfg, B = engine.config, engine.block_size
    family = family_of(cfg)
    engine.algorithm = family.make_algorithm(o.algorithm, o.algorithm_config, model_config=cfg)
    engine.algorithm_name = o.algorithm or family.default_algorithm
    pages_per_row = math.ceil(engine.context_length / B)
    # The KV pool: a share of the memory left now that the weights are placed (dllm_jax.engine.memory).
    engine.kv_budget = plan_kv_pool(
        page_bytes=kv_bytes_per_page(cfg, B, o.dtype), block_size=B, context_length=engine.context_length,
        max_running_requests=o.max_running_requests, mem_fraction=o.mem_fraction, device=jax.devices()[0],
        num_kv_pages=o.num_kv_pages, remember=compile_cache.beside(engine.compilation_cache, "kv_pool.json"))
    engine.num_kv_pages = num_kv_pages = engine.kv_budget.num_pages
    log.info("%s", engine.kv_budget.describe(engine.context_length))
    mesh = _mesh(engine, o)
    if channel is None:
        from dllm_jax.distributed import default_channel

        channel = default_channel()
    engine.runner = ModelRunner(
        loaded.params, cfg, block_size=B, mask_id=engine.mask_token_id, algorithm=engine.algorithm,
        num_pages=num_kv_pages, max_rows=o.max_running_requests, max_pages_per_row=pages_per_row,
        max_prefill_blocks=max(1, min(o.max_prefill_tokens // B, pages_per_row)), loop=o.schedule == "sync",
        attention_backend=engine.attention_backend, confidence_backend=engine.confidence_backend,
        kv_dtype=kv_storage_dtype(o.dtype), mesh=mesh, channel=channel,
        fold_commit=o.fold_commit_forward, shape_buckets=o.shape_buckets, chain_blocks=o.chain_blocks)
    engine.allocator = PageAllocator(num_kv_pages)
    engine.radix = BlockRadixIndex(B, engine.allocator, enabled=o.enable_prefix_cache)
    engine.output = Output(engine.tokenizer, block_size=B, mask_token_id=engine.mask_token_id)
    policy = MaskBlocks(engine.runner, engine.allocator, engine.radix, block_size=B, mask_id=engine.mask_token_id,
                        context_length=engine.context_length, max_prefill_blocks=engine.runner.max_prefill_blocks,
                        max_steps_per_call=o.max_steps_per_call or 1 << 30)
    engine.scheduler = Scheduler(policy, eos_token_ids=engine.eos_token_ids,
                                 max_running_requests=o.max_running_requests, output=engine.output)
    engine.capabilities = CAPABILITIES["mask"]
    engine.family_info = lambda: _mask_info(engine)
    return channel


def _mesh(engine, o):
    """The ``("expert", "tp")`` device mesh of the options (None: one device); sets the engine's degrees."""
    engine.tensor_parallel_size = o.tensor_parallel_size
    engine.expert_parallel_size = o.expert_parallel_size
    engine.mesh = None
    if o.tensor_parallel_size * o.expert_parallel_size > 1:
        from dllm_jax.sharding import make_mesh

        engine.mesh = make_mesh(o.tensor_parallel_size, o.expert_parallel_size)
    return engine.mesh


def _mask_info(engine) -> dict:
    return {"mask_token_id": engine.mask_token_id, "algorithm_config": dict(vars(engine.algorithm.config)),
            "fold_commit_forward": engine.runner.greedy_spec.fold_commit, "chain_blocks": engine.runner.chain,
            "kv_pool_bytes": engine.kv_budget.pool_bytes, "attention_backend": engine.attention_backend,
            "tensor_parallel_size": engine.tensor_parallel_size,
            "expert_parallel_size": engine.expert_parallel_size}


# Request options a renoise request cannot take (none left: penalties, logit_bias, min_new_tokens and top
# logprobs are applied inside the fused vocabulary pass, dllm_jax/decode/renoise_tables.py).
_CANVAS_REFUSED: tuple[tuple[str, object], ...] = ()


def build_canvases(engine, loaded, o, channel):
    """The DiffusionGemma runner, its two pools, the window-aware index and policy (Gemma4Renoise)."""
    cfg = engine.config
    if o.algorithm not in (None, renoise.NAME):
        raise ValueError(f"algorithm: {o.algorithm!r} does not decode {cfg.architecture}; it decodes with "
                         f"{renoise.NAME} (uniform-noise canvases, no mask token)")
    engine.rcfg = engine.algorithm = renoise.renoise_config(o.algorithm_config, renoise_defaults(engine.model_path))
    engine.algorithm_name = renoise.NAME
    mesh = _mesh(engine, o)
    C, S = engine.block_size, CANVAS_PAGE_SIZE
    chunk = max(C, o.max_prefill_tokens)
    window = cfg.sliding_window if any(cfg.is_sliding_layer(i) for i in range(cfg.num_layers)) else None
    per_row = (-(-(window - 1 + chunk) // S) + 2) if window else 1
    cached_windows = -(-(window - 1) // S) + 1 if window else 0  # room for as many cached prefixes' windows
    sliding_pages = o.max_running_requests * (per_row + cached_windows) + 1
    # what one device holds of a page (a mesh splits each layer's KV heads when they divide)
    sliding_bytes = sliding_pages * _page_bytes(cfg, S, o.dtype, mesh, sliding=True)
    full_page = _page_bytes(cfg, S, o.dtype, mesh, sliding=False)
    device = jax.devices()[0]
    free = None
    if o.num_kv_pages is None:
        free, _ = available_memory(device)
        free = max(0, free - sliding_bytes)
    budget = plan_kv_pool(page_bytes=full_page, block_size=S, context_length=engine.context_length,
                          max_running_requests=o.max_running_requests, mem_fraction=o.mem_fraction, device=device,
                          num_kv_pages=o.num_kv_pages, free_bytes=free)
    engine.kv_budget = KVBudget(budget.num_pages, full_page, S, budget.source + f"; sliding-window pool "
                                f"{sliding_pages:,} pages ({human(sliding_bytes)})")
    engine.num_kv_pages = budget.num_pages
    log.info("%s", engine.kv_budget.describe(engine.context_length))
    if channel is None:
        from dllm_jax.distributed import default_channel

        channel = default_channel()
    # (several processes: the text model only, images a 400 -- the tower's inputs do not travel to followers yet)
    vision = _load_vision(engine, cfg, o.dtype) if channel is None else None
    engine.runner = RenoiseRunner(loaded.params, cfg, engine.rcfg,
                                  num_pages={FULL_KIND: budget.num_pages, SLIDING_KIND: sliding_pages},
                                  page_size=S, max_rows=o.max_running_requests,
                                  max_pages_per_row=-(-engine.context_length // S), max_chunk=chunk,
                                  first_finish=o.schedule != "sync", backend=engine.confidence_backend,
                                  dtype=o.dtype, vision=vision,
                                  vision_patches=engine.images.max_patches if vision else 0, mesh=mesh,
                                  channel=channel)
    engine.output = Output(engine.tokenizer, block_size=C, mask_token_id=None)
    policy = Canvases(engine.runner, canvas=C, window=window, max_running_requests=o.max_running_requests,
                      max_steps_per_call=o.max_steps_per_call or 1 << 30, max_prefill_tokens=chunk,
                      enable_prefix_cache=o.enable_prefix_cache)
    engine.scheduler = Scheduler(policy, eos_token_ids=engine.eos_token_ids,
                                 max_running_requests=o.max_running_requests, output=engine.output)
    engine.capabilities = CAPABILITIES["canvas"]
    engine.family_info = lambda: {
        "family": family_of(cfg).name, "canvas_length": engine.block_size,
        "algorithm_config": renoise.config_dict(engine.rcfg), "kv_page_size": S,
        "sliding_window": cfg.sliding_window, "num_sliding_kv_pages": engine.runner.num_pages[SLIDING_KIND],
        "tensor_parallel_size": engine.tensor_parallel_size, "expert_parallel_size": engine.expert_parallel_size}
    return channel


def _page_bytes(cfg, page_size: int, dtype, mesh, *, sliding: bool) -> int:
    if mesh is None:
        return kv_bytes_per_page(cfg, page_size, dtype, sliding=sliding)
    from dllm_jax.plan import kv_page_bytes_per_device

    return kv_page_bytes_per_device(cfg, page_size, dtype, mesh, sliding=sliding)


def _load_vision(engine, cfg, dtype):
    """The vision tower and the image reader of a checkpoint that carries one (None: text only; a converted
    directory keeps the text model alone)."""
    from dllm_jax.engine.images import ImageInputs
    from dllm_jax.model.vision import VisionConfig
    from dllm_jax.model.vision_params import has_vision_tower, load_vision_params

    vcfg = VisionConfig.from_model_dir(engine.model_path)
    if vcfg is None or not has_vision_tower(engine.model_path):
        return None
    if max(vcfg.image_token_id, vcfg.boi_token_id, vcfg.eoi_token_id) >= cfg.vocab_size:
        log.warning("the image tokens are outside the vocabulary: images are not served")
        return None
    vparams = load_vision_params(engine.model_path, vcfg, cfg.hidden_size, jnp.dtype(dtype))
    engine.images = ImageInputs(engine.model_path, vcfg)
    log.info("vision tower loaded: %d layers, %d soft tokens per image at most", vcfg.num_layers,
             engine.images.soft_tokens)
    return vparams, vcfg


SERVING = {"mask": build_mask_blocks, "canvas": build_canvases}
# What each kind's engine offers beyond generating (Engine.capabilities; capabilities_of for a family)
CAPABILITIES = {
    "mask": Capabilities(),
    "canvas": Capabilities(rl=False, score=False, refused_params=_CANVAS_REFUSED, refusal_reason=(
        f"not supported with {renoise.NAME} (sampling is governed by the renoise schedule: temperature, "
        f"acceptance and stopping come from algorithm_config)")),
}


def capabilities_of(family) -> Capabilities:
    return CAPABILITIES[family.serving]
