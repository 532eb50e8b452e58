"""Load a model directory: Hugging Face safetensors (sharded or not, in the SDAR / Qwen3 / Qwen3-MoE / LLaDA2
layouts), or a ``dllm-jax convert`` output (our layout in safetensors; older ones in Orbax).

This module is the orchestration only; each concern has its module:

* :mod:`~dllm_jax.model.family` -- the model family (which parameter table, chat template, default block size);
* :mod:`~dllm_jax.model.params` -- the parameter table (shapes, sharding axes, dtypes, checkpoint names);
* :mod:`~dllm_jax.model.checkpoint_names` -- checkpoint tensor names <-> our pytree, both ways;
* :mod:`~dllm_jax.model.safetensors_io` -- the memory-mapped safetensors reader and the sharded writer;
* :mod:`~dllm_jax.model.placement` -- streaming tensors into (sharded) device arrays of the target dtype;
* :mod:`~dllm_jax.model.converted` -- ``dllm-jax convert`` outputs and Hugging Face directories we write;
* :mod:`~dllm_jax.model.tokenizer` -- the tokenizer, chosen without ``AutoTokenizer``, and its mask token;
* :mod:`~dllm_jax.model.generation` -- ``generation_config.json``: EOS ids and sampling defaults.

Every failure names the file or tensor at fault (:class:`CheckpointError`).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax.numpy as jnp

from dllm_jax.config import ConfigError, ModelConfig
from dllm_jax.model.converted import CONVERTED_FORMAT, ORBAX_PARAMS_DIR, converted_format, converted_version, \
    load_orbax_params, save_converted
from dllm_jax.model.errors import CheckpointError
from dllm_jax.model.family import family_of
from dllm_jax.model.generation import generation_eos
from dllm_jax.model.params import Params
from dllm_jax.model.placement import load_safetensors_params
from dllm_jax.model.tokenizer import MASK_TOKEN_NAMES, load_tokenizer, tokenizer_mask_id

__all__ = ["CheckpointError", "LoadedModel", "convert_checkpoint", "load_model", "resolve_config"]


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    params: Params
    tokenizer: Any  # a transformers tokenizer, or None when the directory has none
    model_path: str


def resolve_config(model_dir: str, tokenizer, *, block_size=None, mask_token_id=None) -> ModelConfig:
    cfg = ModelConfig.from_model_dir(model_dir)
    if not family_of(cfg).uses_mask_token:  # the canvas starts from noise
        return _with_block_and_eos(cfg, model_dir, tokenizer, block_size, None)
    mask = mask_token_id if mask_token_id is not None else (
        cfg.mask_token_id if cfg.mask_token_id is not None else tokenizer_mask_id(tokenizer))
    if mask is None:
        raise ConfigError(f"{model_dir}: no mask token id: config.json has no 'mask_token_id', the tokenizer has no "
                          f"mask token ({' / '.join(MASK_TOKEN_NAMES)}), and none was given (mask_token_id=...)")
    if not 0 <= int(mask) < cfg.vocab_size:
        raise ConfigError(f"{model_dir}: mask_token_id {mask} is outside the vocabulary (size {cfg.vocab_size})")
    return _with_block_and_eos(cfg, model_dir, tokenizer, block_size, int(mask))


def _with_block_and_eos(cfg: ModelConfig, model_dir: str, tokenizer, block_size, mask) -> ModelConfig:
    block = block_size if block_size is not None else (cfg.block_size or family_of(cfg).default_block_size)
    if int(block) < 1:
        raise ConfigError(f"block_size must be >= 1, got {block}")
    eos = generation_eos(model_dir) or cfg.eos_token_ids
    if not eos and tokenizer is not None and tokenizer.eos_token_id is not None:
        eos = (int(tokenizer.eos_token_id),)
    return cfg.replace(mask_token_id=mask, block_size=int(block), eos_token_ids=tuple(eos))


def load_model(model_dir: str, *, dtype="float32", block_size=None, mask_token_id=None,
               progress: bool = False, tp_shards: int = 1) -> LoadedModel:
    """``tp_shards``: the tensor-parallel degree the model will be sharded over; the fused leaves are laid out for
    it (:mod:`dllm_jax.model.fused`), and the returned config carries it."""
    model_dir = os.fspath(model_dir)
    if not os.path.isdir(model_dir):
        raise CheckpointError(f"{model_dir}: model directory not found")
    tokenizer = load_tokenizer(model_dir)
    cfg = resolve_config(model_dir, tokenizer, block_size=block_size, mask_token_id=mask_token_id)
    cfg = cfg.replace(tp_shards=max(1, int(tp_shards)))
    if tokenizer is not None and not getattr(tokenizer, "chat_template", None):
        template = family_of(cfg).chat_template
        if template is not None:  # e.g. LLaDA2 checkpoints whose tokenizer ships no template
            tokenizer.chat_template = template
    jdtype = jnp.dtype(dtype)
    if jdtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    fmt = converted_format(model_dir)
    if fmt == CONVERTED_FORMAT:
        params = load_safetensors_params(os.path.join(model_dir, ORBAX_PARAMS_DIR), cfg, jdtype, progress=progress,
                                         ours=True, ours_version=converted_version(model_dir))
    elif fmt is not None:
        params = load_orbax_params(model_dir, cfg, jdtype)
    else:
        params = load_safetensors_params(model_dir, cfg, jdtype, progress=progress)
    return LoadedModel(config=cfg, params=params, tokenizer=tokenizer, model_path=os.path.abspath(model_dir))


def convert_checkpoint(hf_dir: str, out_dir: str, *, dtype="float32", progress: bool = False) -> None:
    """``dllm-jax convert``: HF safetensors directory -> a directory in our layout (one tensor per leaf, fused
    tensors split, a ``norm_head`` head normalised, in ``dtype``; see :func:`save_converted`), which loads with no
    conversion at all: every tensor is copied as stored, so a load costs about a read of its bytes (a checkpoint already
    in ``dtype`` loads as fast: its matrices are stored as we store them). Both halves stream one tensor at a time
    (memory-mapped in, written out), so peak memory is about the model's size in ``dtype``."""
    cfg = ModelConfig.from_model_dir(hf_dir)
    params = load_safetensors_params(hf_dir, cfg, jnp.dtype(dtype), progress=progress)
    save_converted(hf_dir, params, out_dir, progress=progress)
