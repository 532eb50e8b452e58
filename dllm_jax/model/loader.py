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
import sys
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.config import DEFAULT_SDAR_BLOCK_SIZE, ConfigError, ModelConfig  # noqa: F401 (re-exported)
from dllm_jax.model.qwen3 import Params, param_dtypes, param_shapes
from dllm_jax.model.templates import default_chat_template

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
#
# A checkpoint tensor maps to one or more *parts*: a leaf of our pytree (``path``), optionally one expert
# row of a stacked ``[E, ...]`` leaf, and the conversion from the HF array (``[out, in]`` matrices are
# transposed once here; LLaDA2's fused ``query_key_value`` is split into q/k/v).

# Dense Qwen3 / SDAR names (kept for callers of hf_to_param_path).
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
# LLaDA2 / Bailing names that map one-to-one (the fused QKV and the MoE names are handled in code).
_LLADA2_LAYER_NAMES = {
    "input_layernorm.weight": ("attn_norm", False),
    "attention.query_layernorm.weight": ("q_norm", False),
    "attention.key_layernorm.weight": ("k_norm", False),
    "attention.dense.weight": ("o", True),
    "attention.dense.bias": ("o_bias", False),
    "post_attention_layernorm.weight": ("mlp_norm", False),
    "mlp.gate_proj.weight": ("gate", True),
    "mlp.up_proj.weight": ("up", True),
    "mlp.down_proj.weight": ("down", True),
}
_LLADA2_TOP_NAMES = {
    "model.word_embeddings.weight": ("embed", False),
    "model.norm.weight": ("final_norm", False),
    "lm_head.weight": ("lm_head", True),
}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_SHARED_RE = re.compile(r"^mlp\.shared_experts\.(gate_proj|up_proj|down_proj)\.weight$")
_DENSE_MLP_KEYS = ("gate", "up", "down")
_PROJ_KEY = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
NORM_HEAD_EPS = 1e-7


def hf_to_param_path(name: str):
    """Dense Qwen3 HF tensor name -> (layer index or None, our key, transpose?) or None if not a model weight."""
    if name in _TOP_NAMES:
        key, t = _TOP_NAMES[name]
        return None, key, t
    m = _LAYER_RE.match(name)
    if m and m.group(2) in _LAYER_NAMES:
        key, t = _LAYER_NAMES[m.group(2)]
        return int(m.group(1)), key, t
    return None


@dataclasses.dataclass(frozen=True)
class _Part:
    path: tuple  # ("embed",), ("layers", i, "q"), ("layers", i, "moe", "gate")
    expert: int | None  # None: the whole leaf; e: row e of a stacked [E, ...] leaf
    convert: Callable[[np.ndarray], np.ndarray]


class _Unsupported(Exception):
    """A tensor this config cannot hold; the message completes "tensor 'NAME' ..."."""


def _ident(a):
    return a


def _transpose(a):
    return a.T


def _transpose_stacked(a):
    return a.transpose(0, 2, 1)


def _simple(path, transpose):
    return [_Part(path, None, _transpose if transpose else _ident)]


def _expected_hf_shape(cfg: ModelConfig, shapes: Params, parts: list[_Part]) -> tuple:
    """The shape the HF tensor must have for ``parts`` (from config.json), for the mismatch message."""
    first = parts[0]
    leaf = _get(shapes, first.path)
    if len(parts) > 1:  # fused q/k/v (rows concatenated) or fused gate_up (dim 1 concatenated)
        if first.path[-1] == "q":
            return (cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size)
        if first.path[-1] == "q_bias":
            return (cfg.q_size + 2 * cfg.kv_size,)
        e, h, m = leaf
        return (e, 2 * m, h)
    if first.expert is not None:
        leaf = leaf[1:]
    if first.convert is _transpose:
        return tuple(reversed(leaf))
    if first.convert is _transpose_stacked:
        return (leaf[0], leaf[2], leaf[1])
    return tuple(leaf)


def _qwen3_layer_parts(cfg: ModelConfig, i: int, suffix: str) -> list[_Part] | None:
    base = ("layers", i)
    if suffix in _LAYER_NAMES:
        key, t = _LAYER_NAMES[suffix]
        if key in _DENSE_MLP_KEYS and cfg.is_moe_layer(i):
            raise _Unsupported(f"is a dense MLP weight but config.json makes layer {i} a sparse (MoE) layer")
        return _simple(base + (key,), t)
    moe_names = suffix == "mlp.gate.weight" or suffix.startswith("mlp.experts.")
    if moe_names and not cfg.is_moe_layer(i):
        raise _Unsupported(f"is an expert/router weight but config.json makes layer {i} a dense layer "
                           f"(check num_experts, mlp_only_layers, decoder_sparse_step)")
    if suffix == "mlp.gate.weight":
        return _simple(base + ("moe", "router"), True)
    m = _EXPERT_RE.match(suffix)
    if m:
        return [_Part(base + ("moe", _PROJ_KEY[m.group(2)]), int(m.group(1)), _transpose)]
    # transformers >= 5 in-memory layout: experts fused as 3D parameters [E, out, in].
    if suffix in ("mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj.weight"):
        half = cfg.moe_intermediate_size
        return [_Part(base + ("moe", "gate"), None, lambda a: a[:, :half].transpose(0, 2, 1)),
                _Part(base + ("moe", "up"), None, lambda a: a[:, half:].transpose(0, 2, 1))]
    if suffix in ("mlp.experts.down_proj", "mlp.experts.down_proj.weight"):
        return [_Part(base + ("moe", "down"), None, _transpose_stacked)]
    return None


def _llada2_layer_parts(cfg: ModelConfig, i: int, suffix: str) -> list[_Part] | None:
    base = ("layers", i)
    q, kv = cfg.q_size, cfg.kv_size
    if suffix == "attention.query_key_value.weight":
        return [_Part(base + ("q",), None, lambda a: a[:q].T),
                _Part(base + ("k",), None, lambda a: a[q:q + kv].T),
                _Part(base + ("v",), None, lambda a: a[q + kv:].T)]
    if suffix == "attention.query_key_value.bias":
        return [_Part(base + ("q_bias",), None, lambda a: a[:q]),
                _Part(base + ("k_bias",), None, lambda a: a[q:q + kv]),
                _Part(base + ("v_bias",), None, lambda a: a[q + kv:])]
    if suffix.startswith("mlp.") and suffix.endswith(".bias"):
        raise _Unsupported("is an MLP bias; MLP biases are not supported (LLaDA2 checkpoints have none)")
    if suffix in _LLADA2_LAYER_NAMES:
        key, t = _LLADA2_LAYER_NAMES[suffix]
        if key in _DENSE_MLP_KEYS and cfg.is_moe_layer(i):
            raise _Unsupported(f"is a dense MLP weight but config.json makes layer {i} a sparse (MoE) layer "
                               f"(first_k_dense_replace={min(cfg.moe_layers)})")
        return _simple(base + (key,), t)
    moe_names = suffix.startswith("mlp.gate.") or suffix.startswith("mlp.experts.") or \
        suffix.startswith("mlp.shared_experts.")
    if moe_names and not cfg.is_moe_layer(i):
        raise _Unsupported(f"is an expert/router weight but config.json makes layer {i} a dense layer "
                           f"(check num_experts, first_k_dense_replace)")
    if suffix == "mlp.gate.weight":
        return _simple(base + ("moe", "router"), True)
    if suffix == "mlp.gate.expert_bias":
        return _simple(base + ("moe", "expert_bias"), False)
    m = _EXPERT_RE.match(suffix)
    if m:
        return [_Part(base + ("moe", _PROJ_KEY[m.group(2)]), int(m.group(1)), _transpose)]
    m = _SHARED_RE.match(suffix)
    if m:
        return _simple(base + ("moe", "shared_" + _PROJ_KEY[m.group(1)]), True)
    return None


def hf_tensor_parts(cfg: ModelConfig, name: str) -> list[_Part] | None:
    """Where HF tensor ``name`` goes in our pytree (None: not a model weight, e.g. rotary buffers).

    Raises ``_Unsupported`` for a tensor that contradicts config.json (e.g. expert weights in a dense layer).
    """
    top = _LLADA2_TOP_NAMES if cfg.family == "llada2" else _TOP_NAMES
    if name in top:
        key, t = top[name]
        return _simple((key,), t)
    m = _LAYER_RE.match(name)
    if not m:
        return None
    layer, suffix = int(m.group(1)), m.group(2)
    if layer >= cfg.num_layers:
        raise _Unsupported(f"is for layer {layer} but the config has {cfg.num_layers} layers")
    if cfg.family == "llada2":
        return _llada2_layer_parts(cfg, layer, suffix)
    return _qwen3_layer_parts(cfg, layer, suffix)


def hf_name_for(cfg: ModelConfig, path: tuple, expert: int | None = None) -> str:
    """The HF tensor name that fills our leaf ``path`` (row ``expert`` of a stacked leaf): for messages."""
    llada2 = cfg.family == "llada2"
    if len(path) == 1:
        top = _LLADA2_TOP_NAMES if llada2 else _TOP_NAMES
        return next(n for n, (k, _) in top.items() if k == path[0])
    i, key = path[1], path[-1]
    prefix = f"model.layers.{i}."
    if path[2] == "moe":
        proj = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
        if key == "router":
            return prefix + "mlp.gate.weight"
        if key == "expert_bias":
            return prefix + "mlp.gate.expert_bias"
        if key.startswith("shared_"):
            return prefix + f"mlp.shared_experts.{proj[key[len('shared_'):]]}.weight"
        return prefix + f"mlp.experts.{expert if expert is not None else '*'}.{proj[key]}.weight"
    if llada2:
        if key in ("q", "k", "v"):
            return prefix + "attention.query_key_value.weight"
        if key in ("q_bias", "k_bias", "v_bias"):
            return prefix + "attention.query_key_value.bias"
        return prefix + next(n for n, (k, _) in _LLADA2_LAYER_NAMES.items() if k == key)
    return prefix + next(n for n, (k, _) in _LAYER_NAMES.items() if k == key)


def params_to_hf(params: Params, cfg: ModelConfig | None = None) -> dict[str, np.ndarray]:
    """Our pytree -> HF state dict (numpy, ``[out, in]`` matrices) in the layout of ``cfg``'s family.

    Without ``cfg`` the dense Qwen3 layout is written. MoE experts are written one tensor per expert (what
    transformers' ``save_pretrained`` writes); LLaDA2's q/k/v are fused back into ``query_key_value``.
    """
    def np_(a):
        return np.asarray(a)

    llada2 = cfg is not None and cfg.family == "llada2"
    out = {}
    for name, (key, t) in (_LLADA2_TOP_NAMES if llada2 else _TOP_NAMES).items():
        if key in params:
            a = np_(params[key])
            out[name] = np.ascontiguousarray(a.T if t else a)
    names = _LLADA2_LAYER_NAMES if llada2 else _LAYER_NAMES
    for i, layer in enumerate(params["layers"]):
        prefix = f"model.layers.{i}."
        for suffix, (key, t) in names.items():
            if key in layer:
                a = np_(layer[key])
                out[prefix + suffix] = np.ascontiguousarray(a.T if t else a)
        if llada2:
            out[prefix + "attention.query_key_value.weight"] = np.ascontiguousarray(
                np.concatenate([np_(layer[k]) for k in ("q", "k", "v")], axis=1).T)
            if "q_bias" in layer:
                out[prefix + "attention.query_key_value.bias"] = np.concatenate(
                    [np_(layer[k]) for k in ("q_bias", "k_bias", "v_bias")])
        moe = layer.get("moe")
        if moe is None:
            continue
        out[prefix + "mlp.gate.weight"] = np.ascontiguousarray(np_(moe["router"]).T)
        if "expert_bias" in moe:
            out[prefix + "mlp.gate.expert_bias"] = np_(moe["expert_bias"])
        for key, proj in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
            stacked = np_(moe[key])
            for e in range(stacked.shape[0]):
                out[prefix + f"mlp.experts.{e}.{proj}.weight"] = np.ascontiguousarray(stacked[e].T)
            if "shared_" + key in moe:
                out[prefix + f"mlp.shared_experts.{proj}.weight"] = np.ascontiguousarray(np_(moe["shared_" + key]).T)
    return out


def normalize_head(lm_head: np.ndarray) -> np.ndarray:
    """``norm_head``: our ``[H, V]`` head with each hidden unit's vocabulary vector L2-normalised.

    That is HF's ``F.normalize(lm_head.weight [V, H], dim=0, eps=1e-7)`` (SGLang / Bailing apply it at load).
    """
    a = np.asarray(lm_head, np.float32)
    return a / np.maximum(np.linalg.norm(a, axis=1, keepdims=True), NORM_HEAD_EPS)


def _get(tree, path):
    for p in path:
        tree = tree[p]
    return tree


def _set(tree, path, value):
    for p in path[:-1]:
        tree = tree.setdefault(p, {}) if isinstance(tree, dict) else tree[p]
    tree[path[-1]] = value


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


def load_safetensors_params(model_dir: str, cfg: ModelConfig, dtype, *, progress: bool = False) -> Params:
    from safetensors import safe_open
    from tqdm import tqdm

    shapes = param_shapes(cfg)
    dtypes = param_dtypes(cfg, dtype)
    params: Params = {"layers": [dict() for _ in range(cfg.num_layers)]}
    expert_rows: dict[tuple, dict[int, np.ndarray]] = {}  # stacked leaf path -> expert -> [in, out]
    files = _safetensor_files(model_dir)
    bar = tqdm(total=sum(os.path.getsize(p) for p in files), desc="loading weights", unit="B", unit_scale=True,
               disable=not progress, leave=False)
    for path in files:
        try:
            f = safe_open(path, framework="np")
        except Exception as e:  # safetensors raises its own error types for truncated/corrupt files
            raise CheckpointError(f"{path}: cannot read safetensors file ({e})") from e
        with f:
            for name in f.keys():
                try:
                    parts = hf_tensor_parts(cfg, name)
                except _Unsupported as e:
                    raise CheckpointError(f"{path}: tensor '{name}' {e}") from None
                if not parts:
                    continue
                parts = [p for p in parts if _has(shapes, p.path)]
                if not parts:  # e.g. a tied lm_head, or biases the config does not use
                    continue
                hf_shape = tuple(f.get_slice(name).get_shape())
                expected = _expected_hf_shape(cfg, shapes, parts)
                if hf_shape != expected:
                    raise CheckpointError(f"{path}: tensor '{name}' has shape {hf_shape}, expected {expected} "
                                          f"from config.json")
                try:
                    arr = f.get_tensor(name)
                except Exception as e:
                    raise CheckpointError(f"{path}: tensor '{name}' cannot be read ({e})") from e
                for part in parts:
                    value = part.convert(arr)
                    if part.expert is not None:
                        num = _get(shapes, part.path)[0]
                        if part.expert >= num:
                            raise CheckpointError(f"{path}: tensor '{name}' is for expert {part.expert} but the "
                                                  f"config has num_experts={num}")
                        expert_rows.setdefault(part.path, {})[part.expert] = value
                        continue
                    if part.path == ("lm_head",) and cfg.norm_head:
                        value = normalize_head(value)
                    _set(params, part.path, _to_jnp(value, _get(dtypes, part.path)))
                bar.update(arr.nbytes)
    bar.close()
    for leaf_path, rows in expert_rows.items():
        num = _get(shapes, leaf_path)[0]
        if len(rows) == num:
            _set(params, leaf_path, _to_jnp(np.stack([rows[e] for e in range(num)]), _get(dtypes, leaf_path)))
    _check_complete(params, shapes, cfg, model_dir, expert_rows)
    return params


def _to_jnp(arr: np.ndarray, dtype):
    return jnp.asarray(np.asarray(arr, dtype=np.float32) if arr.dtype != dtype else arr, dtype=dtype)


def _has(shapes, path) -> bool:
    try:
        _get(shapes, path)
        return True
    except (KeyError, IndexError):
        return False


def _check_complete(params: Params, shapes: Params, cfg: ModelConfig, model_dir: str,
                    expert_rows: dict | None = None) -> None:
    flat, _ = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))
    names: list[str] = []
    for key_path, shape in flat:
        path = tuple(getattr(k, "key", getattr(k, "idx", None)) for k in key_path)
        if _has(params, path):
            continue
        if path[-2:-1] == ("moe",) and path[-1] in ("gate", "up", "down"):
            seen = (expert_rows or {}).get(path, {})
            names += [hf_name_for(cfg, path, e) for e in range(shape[0]) if e not in seen]
        else:
            names.append(hf_name_for(cfg, path))
    names = list(dict.fromkeys(names))  # fused q/k/v name once
    if names:
        raise CheckpointError(f"{model_dir}: checkpoint is missing tensors: {', '.join(names[:8])}"
                              + (" ..." if len(names) > 8 else ""))


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
    # Routing leaves are always float32 (leaf_dtype); the others share one stored dtype.
    stored_dtype = jnp.bfloat16 if "bfloat16" in stored else jnp.dtype(stored[0]) if len(stored) == 1 else jnp.float32
    shapes = param_shapes(cfg)
    abstract = jax.tree.map(lambda s, d: jax.ShapeDtypeStruct(s, d), shapes, param_dtypes(cfg, stored_dtype),
                            is_leaf=lambda x: isinstance(x, tuple))
    ckpt = ocp.StandardCheckpointer()
    try:
        params = ckpt.restore(path, abstract)
    except Exception as e:
        raise CheckpointError(f"{path}: cannot restore Orbax checkpoint ({e})") from e
    finally:
        ckpt.close()
    return jax.tree.map(lambda x, d: jnp.asarray(x, d), params, param_dtypes(cfg, dtype))


# ----------------------------------------------------------------------------------------------
# Tokenizer, mask id, block size
# ----------------------------------------------------------------------------------------------

def load_tokenizer(model_dir: str):
    if not (os.path.isfile(os.path.join(model_dir, "tokenizer.json"))
            or os.path.isfile(os.path.join(model_dir, "tokenizer_config.json"))):
        return None
    if "transformers" not in sys.modules:  # its "PyTorch was not found" banner means nothing to a JAX engine
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
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
    block = block_size if block_size is not None else (cfg.block_size or cfg.default_block_size)
    if int(block) < 1:
        raise ConfigError(f"block_size must be >= 1, got {block}")
    eos = _generation_eos(model_dir) or cfg.eos_token_ids
    if not eos and tokenizer is not None and tokenizer.eos_token_id is not None:
        eos = (int(tokenizer.eos_token_id),)
    return cfg.replace(mask_token_id=int(mask), block_size=int(block), eos_token_ids=tuple(eos))


def load_model(model_dir: str, *, dtype="float32", block_size=None, mask_token_id=None,
               progress: bool = False) -> LoadedModel:
    model_dir = os.fspath(model_dir)
    if not os.path.isdir(model_dir):
        raise CheckpointError(f"{model_dir}: model directory not found")
    tokenizer = load_tokenizer(model_dir)
    cfg = resolve_config(model_dir, tokenizer, block_size=block_size, mask_token_id=mask_token_id)
    if tokenizer is not None and not getattr(tokenizer, "chat_template", None):
        template = default_chat_template(cfg)
        if template is not None:  # e.g. LLaDA2 checkpoints whose tokenizer ships no template
            tokenizer.chat_template = template
    jdtype = jnp.dtype(dtype)
    if jdtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    if is_orbax_dir(model_dir):
        params = load_orbax_params(model_dir, cfg, jdtype)
    else:
        params = load_safetensors_params(model_dir, cfg, jdtype, progress=progress)
    return LoadedModel(config=cfg, params=params, tokenizer=tokenizer, model_path=os.path.abspath(model_dir))


def convert_to_orbax(hf_dir: str, out_dir: str, *, dtype="float32") -> None:
    """``dllm-jax convert``: HF safetensors directory -> Orbax directory that loads faster."""
    cfg = ModelConfig.from_model_dir(hf_dir)
    params = load_safetensors_params(hf_dir, cfg, jnp.dtype(dtype))
    save_orbax(hf_dir, params, out_dir)


def save_hf(params: Params, cfg: ModelConfig, out_dir: str) -> None:
    """Write params as a HF model directory (config.json + model.safetensors) in ``cfg``'s family layout.

    A ``norm_head`` model's head is written as stored (already normalised; normalising again at load is a no-op).
    """
    from safetensors.numpy import save_file

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg.to_hf_dict(), f, indent=2)
    tensors = {k: np.asarray(v, dtype=np.float32) if v.dtype != np.float32 else v
               for k, v in params_to_hf(params, cfg).items()}
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
