"""Load a model directory (Hugging Face safetensors or our Orbax layout) into a parameter pytree.

Every failure names the file or tensor at fault: a user with a broken checkpoint should not have to
read a stack trace to find which shard is truncated.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.config import DEFAULT_SDAR_BLOCK_SIZE, ConfigError, ModelConfig
from dllm_jax.model.qwen3 import Params, param_shapes

ORBAX_PARAMS_DIR = "params"
ORBAX_MARKER = "dllm_jax_checkpoint.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json", "vocab.json", "merges.txt")
MASK_TOKEN_NAMES = ("<|MASK|>", "<|mask|>", "[MASK]", "<mask>")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file or tensor."""


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    params: Params
    tokenizer: Any  # a transformers tokenizer, or None when the directory has none
    model_path: str


# ----------------------------------------------------------------------------------------------
# HF names <-> our pytree
# ----------------------------------------------------------------------------------------------

_LAYER_NAMES = {
    "input_layernorm.weight": ("attn_norm", False),
    "self_attn.q_proj.weight": ("q", True),
    "self_attn.k_proj.weight": ("k", True),
    "self_attn.v_proj.weight": ("v", True),
    "self_attn.o_proj.weight": ("o", True),
    "self_attn.q_proj.bias": ("q_bias", False),
    "self_attn.k_proj.bias": ("k_bias", False),
    "self_attn.v_proj.bias": ("v_bias", False),
    "self_attn.q_norm.weight": ("q_norm", False),
    "self_attn.k_norm.weight": ("k_norm", False),
    "post_attention_layernorm.weight": ("mlp_norm", False),
    "mlp.gate_proj.weight": ("gate", True),
    "mlp.up_proj.weight": ("up", True),
    "mlp.down_proj.weight": ("down", True),
}
_TOP_NAMES = {
    "model.embed_tokens.weight": ("embed", False),
    "model.norm.weight": ("final_norm", False),
    "lm_head.weight": ("lm_head", True),
}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def hf_to_param_path(name: str):
    """HF tensor name -> (layer index or None, our key, transpose?) or None if not a model weight."""
    if name in _TOP_NAMES:
        key, t = _TOP_NAMES[name]
        return None, key, t
    m = _LAYER_RE.match(name)
    if m and m.group(2) in _LAYER_NAMES:
        key, t = _LAYER_NAMES[m.group(2)]
        return int(m.group(1)), key, t
    return None


def params_to_hf(params: Params) -> dict[str, np.ndarray]:
    """Our pytree -> HF Qwen3 state dict (numpy, ``[out, in]`` matrices)."""
    out = {}
    for name, (key, t) in _TOP_NAMES.items():
        if key in params:
            a = np.asarray(params[key])
            out[name] = np.ascontiguousarray(a.T if t else a)
    for i, layer in enumerate(params["layers"]):
        for suffix, (key, t) in _LAYER_NAMES.items():
            if key in layer:
                a = np.asarray(layer[key])
                out[f"model.layers.{i}.{suffix}"] = np.ascontiguousarray(a.T if t else a)
    return out


# ----------------------------------------------------------------------------------------------
# Safetensors
# ----------------------------------------------------------------------------------------------

def _safetensor_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from e
        files = sorted(set(weight_map.values()))
        for fn in files:
            if not os.path.isfile(os.path.join(model_dir, fn)):
                raise CheckpointError(f"{os.path.join(model_dir, fn)}: shard named in {index} is missing")
        return [os.path.join(model_dir, fn) for fn in files]
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    found = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if found:
        return [os.path.join(model_dir, f) for f in found]
    raise CheckpointError(f"{model_dir}: no model.safetensors, safetensors index or Orbax '{ORBAX_PARAMS_DIR}/' found")


def load_safetensors_params(model_dir: str, cfg: ModelConfig, dtype) -> Params:
    from safetensors import safe_open

    shapes = param_shapes(cfg)
    params: Params = {"layers": [dict() for _ in range(cfg.num_layers)]}
    for path in _safetensor_files(model_dir):
        try:
            f = safe_open(path, framework="np")
        except Exception as e:  # safetensors raises its own error types for truncated/corrupt files
            raise CheckpointError(f"{path}: cannot read safetensors file ({e})") from e
        with f:
            for name in f.keys():
                mapped = hf_to_param_path(name)
                if mapped is None:
                    continue
                layer_idx, key, transpose = mapped
                try:
                    arr = f.get_tensor(name)
                except Exception as e:
                    raise CheckpointError(f"{path}: tensor '{name}' cannot be read ({e})") from e
                if transpose:
                    arr = arr.T
                if layer_idx is None:
                    if key == "lm_head" and cfg.tie_word_embeddings:
                        continue
                    expected = shapes.get(key)
                    target = params
                else:
                    if layer_idx >= cfg.num_layers:
                        raise CheckpointError(f"{path}: tensor '{name}' is for layer {layer_idx} but the config has "
                                              f"{cfg.num_layers} layers")
                    expected = shapes["layers"][layer_idx].get(key)
                    target = params["layers"][layer_idx]
                if expected is None:
                    continue
                if tuple(arr.shape) != tuple(expected):
                    hf_shape = tuple(reversed(expected)) if transpose else tuple(expected)
                    raise CheckpointError(f"{path}: tensor '{name}' has shape {tuple(f.get_slice(name).get_shape())}, "
                                          f"expected {hf_shape} from config.json")
                target[key] = jnp.asarray(np.asarray(arr, dtype=np.float32) if arr.dtype != dtype else arr, dtype=dtype)
    _check_complete(params, shapes, model_dir)
    return params


def _check_complete(params: Params, shapes: Params, model_dir: str) -> None:
    missing = [k for k in shapes if k != "layers" and k not in params]
    for i, layer in enumerate(shapes["layers"]):
        missing += [f"layers.{i}.{k}" for k in layer if k not in params["layers"][i]]
    if missing:
        inv = {v[0]: k for k, v in {**_TOP_NAMES}.items()}
        names = []
        for m in missing[:8]:
            if m.startswith("layers."):
                _, i, key = m.split(".", 2)
                suffix = next(s for s, (k, _) in _LAYER_NAMES.items() if k == key)
                names.append(f"model.layers.{i}.{suffix}")
            else:
                names.append(inv.get(m, m))
        raise CheckpointError(f"{model_dir}: checkpoint is missing tensors: {', '.join(names)}"
                              + (" ..." if len(missing) > 8 else ""))


# ----------------------------------------------------------------------------------------------
# Orbax layout
# ----------------------------------------------------------------------------------------------

def is_orbax_dir(model_dir: str) -> bool:
    return os.path.isfile(os.path.join(model_dir, ORBAX_MARKER))


def save_orbax(model_dir: str, params: Params, out_dir: str) -> None:
    """Write ``out_dir`` with the converted parameters (Orbax) plus config and tokenizer files."""
    import orbax.checkpoint as ocp

    out_dir = os.path.abspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    for fn in ("config.json",) + TOKENIZER_FILES:
        src = os.path.join(model_dir, fn)
        if os.path.isfile(src):
            shutil.copy(src, os.path.join(out_dir, fn))
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(os.path.join(out_dir, ORBAX_PARAMS_DIR), params, force=True)
    ckpt.wait_until_finished()
    ckpt.close()
    dtypes = sorted({str(x.dtype) for x in jax.tree.leaves(params)})
    with open(os.path.join(out_dir, ORBAX_MARKER), "w") as f:
        json.dump({"format": "orbax-standard", "dtypes": dtypes, "source": os.path.abspath(model_dir)}, f)


def load_orbax_params(model_dir: str, cfg: ModelConfig, dtype) -> Params:
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.path.join(model_dir, ORBAX_PARAMS_DIR))
    with open(os.path.join(model_dir, ORBAX_MARKER)) as f:
        stored = json.load(f).get("dtypes", ["float32"])
    stored_dtype = jnp.dtype(stored[0]) if len(stored) == 1 else jnp.float32
    shapes = param_shapes(cfg)
    abstract = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, stored_dtype), shapes,
                            is_leaf=lambda x: isinstance(x, tuple))
    ckpt = ocp.StandardCheckpointer()
    try:
        params = ckpt.restore(path, abstract)
    except Exception as e:
        raise CheckpointError(f"{path}: cannot restore Orbax checkpoint ({e})") from e
    finally:
        ckpt.close()
    return jax.tree.map(lambda x: jnp.asarray(x, dtype), params)


# ----------------------------------------------------------------------------------------------
# Tokenizer, mask id, block size
# ----------------------------------------------------------------------------------------------

def load_tokenizer(model_dir: str):
    if not (os.path.isfile(os.path.join(model_dir, "tokenizer.json"))
            or os.path.isfile(os.path.join(model_dir, "tokenizer_config.json"))):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except Exception as e:
        raise CheckpointError(f"{model_dir}: cannot load tokenizer (tokenizer.json / tokenizer_config.json): {e}") from e


def _tokenizer_mask_id(tokenizer) -> int | None:
    if tokenizer is None:
        return None
    if getattr(tokenizer, "mask_token_id", None) is not None:
        return int(tokenizer.mask_token_id)
    vocab = tokenizer.get_vocab()
    for name in MASK_TOKEN_NAMES:
        if name in vocab:
            return int(vocab[name])
    return None


def _generation_eos(model_dir: str) -> tuple[int, ...]:
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return ()
    try:
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e
    if eos is None:
        return ()
    return tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))


def resolve_config(model_dir: str, tokenizer, *, block_size=None, mask_token_id=None) -> ModelConfig:
    cfg = ModelConfig.from_model_dir(model_dir)
    mask = mask_token_id if mask_token_id is not None else (
        cfg.mask_token_id if cfg.mask_token_id is not None else _tokenizer_mask_id(tokenizer))
    if mask is None:
        raise ConfigError(f"{model_dir}: no mask token id: config.json has no 'mask_token_id', the tokenizer has no "
                          f"mask token ({' / '.join(MASK_TOKEN_NAMES)}), and none was given (mask_token_id=...)")
    if not 0 <= int(mask) < cfg.vocab_size:
        raise ConfigError(f"{model_dir}: mask_token_id {mask} is outside the vocabulary (size {cfg.vocab_size})")
    block = block_size if block_size is not None else (cfg.block_size or DEFAULT_SDAR_BLOCK_SIZE)
    if int(block) < 1:
        raise ConfigError(f"block_size must be >= 1, got {block}")
    eos = _generation_eos(model_dir) or cfg.eos_token_ids
    if not eos and tokenizer is not None and tokenizer.eos_token_id is not None:
        eos = (int(tokenizer.eos_token_id),)
    return cfg.replace(mask_token_id=int(mask), block_size=int(block), eos_token_ids=tuple(eos))


def load_model(model_dir: str, *, dtype="float32", block_size=None, mask_token_id=None) -> LoadedModel:
    model_dir = os.fspath(model_dir)
    if not os.path.isdir(model_dir):
        raise CheckpointError(f"{model_dir}: model directory not found")
    tokenizer = load_tokenizer(model_dir)
    cfg = resolve_config(model_dir, tokenizer, block_size=block_size, mask_token_id=mask_token_id)
    jdtype = jnp.dtype(dtype)
    if jdtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    if is_orbax_dir(model_dir):
        params = load_orbax_params(model_dir, cfg, jdtype)
    else:
        params = load_safetensors_params(model_dir, cfg, jdtype)
    return LoadedModel(config=cfg, params=params, tokenizer=tokenizer, model_path=os.path.abspath(model_dir))


def convert_to_orbax(hf_dir: str, out_dir: str, *, dtype="float32") -> None:
    """``dllm-jax convert``: HF safetensors directory -> Orbax directory that loads faster."""
    cfg = ModelConfig.from_model_dir(hf_dir)
    params = load_safetensors_params(hf_dir, cfg, jnp.dtype(dtype))
    save_orbax(hf_dir, params, out_dir)


def save_hf(params: Params, cfg: ModelConfig, out_dir: str) -> None:
    """Write params as a HF model directory (config.json + model.safetensors)."""
    from safetensors.numpy import save_file

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg.to_hf_dict(), f, indent=2)
    tensors = {k: np.asarray(v, dtype=np.float32) if v.dtype != np.float32 else v
               for k, v in params_to_hf(params).items()}
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
