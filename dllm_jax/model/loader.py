"""Load a model directory into a parameter pytree: Hugging Face safetensors (sharded or not, in the SDAR / Qwen3 /
Qwen3-MoE / LLaDA2 layouts), or a ``dllm-jax convert`` output (our layout in safetensors; older ones in Orbax).

Weights stream from the memory-mapped shards one tensor at a time into device arrays of the target dtype (see
:func:`load_safetensors_params`); the tokenizer is loaded without ``AutoTokenizer`` and nothing from the model
directory's own Python files is ever imported (:func:`tokenizer_class`).

Every failure names the file or tensor at fault: a user with a broken checkpoint should not have to
read a stack trace to find which shard is truncated.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import mmap
import os
import re
import shutil
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.config import DEFAULT_SDAR_BLOCK_SIZE, ConfigError, ModelConfig  # noqa: F401 (re-exported)
from dllm_jax.model.qwen3 import Params, param_dtypes, param_shapes
from dllm_jax.model.templates import default_chat_template

ORBAX_PARAMS_DIR = "params"
ORBAX_MARKER = "dllm_jax_checkpoint.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json", "vocab.json", "merges.txt", "added_tokens.json")
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
    convert: tuple  # a conversion spec (see _convert): hashable, so one jitted function serves every tensor


class _Unsupported(Exception):
    """A tensor this config cannot hold; the message completes "tensor 'NAME' ..."."""


# Conversion specs, applied on the device (jnp) or to numpy arrays alike:
#   ("id",)               as stored
#   ("T",)                [out, in] -> [in, out]
#   ("T3",)               [E, out, in] -> [E, in, out]
#   ("rows", lo, hi, t)   rows lo:hi of a fused tensor (LLaDA2 query_key_value), transposed if t
#   ("mid", lo, hi)       a[:, lo:hi] of a fused 3D expert tensor, then [E, in, out]
_ID, _T, _T3 = ("id",), ("T",), ("T3",)
# Specs that act row by row along axis 0, so a large tensor can be converted in chunks of rows.
_CHUNKABLE = ("id", "T", "T3", "mid")


def _convert(spec: tuple, a):
    kind = spec[0]
    if kind == "id":
        return a
    if kind == "T":
        return a.T
    if kind == "T3":
        return a.transpose(0, 2, 1)
    if kind == "rows":
        part = a[spec[1]:spec[2]]
        return part.T if spec[3] else part
    if kind == "mid":
        return a[:, spec[1]:spec[2]].transpose(0, 2, 1)
    raise AssertionError(spec)


def _simple(path, transpose):
    return [_Part(path, None, _T if transpose else _ID)]


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
    if first.convert == _T:
        return tuple(reversed(leaf))
    if first.convert == _T3:
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
        return [_Part(base + ("moe", _PROJ_KEY[m.group(2)]), int(m.group(1)), _T)]
    # transformers >= 5 in-memory layout: experts fused as 3D parameters [E, out, in].
    if suffix in ("mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj.weight"):
        half = cfg.moe_intermediate_size
        return [_Part(base + ("moe", "gate"), None, ("mid", 0, half)),
                _Part(base + ("moe", "up"), None, ("mid", half, 2 * half))]
    if suffix in ("mlp.experts.down_proj", "mlp.experts.down_proj.weight"):
        return [_Part(base + ("moe", "down"), None, _T3)]
    return None


def _llada2_layer_parts(cfg: ModelConfig, i: int, suffix: str) -> list[_Part] | None:
    base = ("layers", i)
    q, kv = cfg.q_size, cfg.kv_size
    if suffix == "attention.query_key_value.weight":
        return [_Part(base + ("q",), None, ("rows", 0, q, True)),
                _Part(base + ("k",), None, ("rows", q, q + kv, True)),
                _Part(base + ("v",), None, ("rows", q + kv, q + 2 * kv, True))]
    if suffix == "attention.query_key_value.bias":
        return [_Part(base + ("q_bias",), None, ("rows", 0, q, False)),
                _Part(base + ("k_bias",), None, ("rows", q, q + kv, False)),
                _Part(base + ("v_bias",), None, ("rows", q + kv, q + 2 * kv, False))]
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
        return [_Part(base + ("moe", _PROJ_KEY[m.group(2)]), int(m.group(1)), _T)]
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
    raise CheckpointError(f"{model_dir}: no model.safetensors or safetensors index found (nor a converted "
                          f"'{ORBAX_PARAMS_DIR}/' with its {ORBAX_MARKER})")


# Source dtypes a checkpoint may store (little-endian, as the format prescribes).
_ST_DTYPES = {"BF16": np.dtype(jnp.bfloat16), "F16": np.dtype(np.float16), "F32": np.dtype(np.float32),
              "F64": np.dtype(np.float64)}
# A tensor that needs a conversion (transpose, split, cast) larger than this is converted in chunks of rows
# written into a donated output, so the conversion's temporary memory stays about this small.
CHUNK_BYTES = 64 << 20
# Conversions dispatched to the device before the loader waits for the oldest one: enough to keep the device
# busy while Python prepares the next tensor, few enough that the inputs in flight stay small.
MAX_IN_FLIGHT = 2


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    dtype: np.dtype
    shape: tuple
    offset: int  # absolute byte offset of the data in the file
    nbytes: int


class SafetensorsFile:
    """One ``.safetensors`` file, memory-mapped read-only and read tensor by tensor.

    The format is 8 bytes of little-endian header length, a JSON header (name -> dtype, shape, byte range), then
    the raw data. :meth:`view` is a NumPy array on the mapped bytes (no copy: the page cache's pages are the
    array); :meth:`release` unmaps a consumed range from this process (``MADV_DONTNEED``: the data stay in the
    page cache, the process's resident set drops them), so at any time only the tensors being converted count in
    the loader's RSS, not the whole shard. :meth:`prefetch` starts the kernel's read-ahead of a range.
    """

    def __init__(self, path: str):
        self.path = path
        self._map = None
        try:
            self._fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise CheckpointError(f"{path}: cannot open safetensors file ({e})") from e
        try:
            self.tensors = self._parse_header()
        except BaseException:
            os.close(self._fd)
            raise

    def _parse_header(self) -> dict[str, TensorInfo]:
        path = self.path
        size = os.fstat(self._fd).st_size
        head = os.pread(self._fd, 8, 0)
        if len(head) < 8:
            raise CheckpointError(f"{path}: cannot read safetensors file (truncated: {size} bytes, no header)")
        n = int.from_bytes(head, "little")
        if n <= 0 or 8 + n > size:
            raise CheckpointError(f"{path}: cannot read safetensors file (header of {n} bytes does not fit the "
                                  f"file's {size} bytes: truncated or not a safetensors file)")
        try:
            header = json.loads(os.pread(self._fd, n, 8))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: cannot read safetensors file (header is not valid JSON: {e})") from e
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: cannot read safetensors file (header is not a JSON object)")
        tensors = {}
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype_name, shape, (begin, end) = meta["dtype"], tuple(int(s) for s in meta["shape"]), \
                    meta["data_offsets"]
            except (KeyError, TypeError, ValueError) as e:
                raise CheckpointError(f"{path}: tensor '{name}' has a malformed header entry ({e})") from e
            if dtype_name not in _ST_DTYPES:
                raise CheckpointError(f"{path}: tensor '{name}' has dtype {dtype_name}; supported: "
                                      f"{', '.join(_ST_DTYPES)}")
            dtype = _ST_DTYPES[dtype_name]
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            if int(end) - int(begin) != nbytes or begin < 0:
                raise CheckpointError(f"{path}: tensor '{name}' has byte range [{begin}, {end}) but shape {shape} "
                                      f"of {dtype_name} needs {nbytes} bytes")
            if 8 + n + int(end) > size:
                raise CheckpointError(f"{path}: tensor '{name}' ends past the end of the file (truncated?)")
            tensors[name] = TensorInfo(dtype, shape, 8 + n + int(begin), nbytes)
        return dict(sorted(tensors.items(), key=lambda kv: kv[1].offset))  # file order: sequential reads

    def _mapping(self) -> mmap.mmap:
        if self._map is None:
            try:
                self._map = mmap.mmap(self._fd, 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError) as e:
                raise CheckpointError(f"{self.path}: cannot map safetensors file ({e})") from e
            with contextlib.suppress(AttributeError, OSError):
                self._map.madvise(mmap.MADV_SEQUENTIAL)
        return self._map

    def _range(self, name: str, first_row: int = 0, rows: int | None = None) -> tuple[int, int, tuple]:
        info = self.tensors[name]
        if not info.shape:
            return info.offset, info.nbytes, ()
        row_bytes = info.nbytes // info.shape[0] if info.shape[0] else 0
        rows = info.shape[0] - first_row if rows is None else rows
        return info.offset + first_row * row_bytes, rows * row_bytes, (rows,) + info.shape[1:]

    def view(self, name: str, first_row: int = 0, rows: int | None = None) -> np.ndarray:
        """The tensor (rows ``first_row : first_row + rows`` of axis 0) as a read-only array on the mapping."""
        offset, nbytes, shape = self._range(name, first_row, rows)
        dtype = self.tensors[name].dtype
        return np.frombuffer(self._mapping(), dtype, nbytes // dtype.itemsize, offset).reshape(shape)

    def _advise(self, advice, name: str, first_row: int, rows: int | None, *, inner: bool) -> None:
        offset, nbytes, _ = self._range(name, first_row, rows)
        page = mmap.PAGESIZE
        lo = -(-offset // page) * page if inner else offset // page * page
        hi = (offset + nbytes) // page * page if inner else -(-(offset + nbytes) // page) * page
        hi = min(hi, len(self._mapping()))
        if hi > lo:
            with contextlib.suppress(AttributeError, OSError, ValueError):
                self._mapping().madvise(advice, lo, hi - lo)

    def prefetch(self, name: str, first_row: int = 0, rows: int | None = None) -> None:
        """Start reading the range from disk in the background (``MADV_WILLNEED``)."""
        self._advise(getattr(mmap, "MADV_WILLNEED", None), name, first_row, rows, inner=False)

    def release(self, name: str, first_row: int = 0, rows: int | None = None) -> None:
        """Drop the range's pages from this process (they stay cached); only whole pages inside the range, so a
        neighbouring tensor still being read keeps its pages."""
        self._advise(getattr(mmap, "MADV_DONTNEED", None), name, first_row, rows, inner=True)

    def read_into(self, name: str, out: np.ndarray, first_row: int = 0) -> None:
        """Fill ``out`` (a byte buffer) with the tensor's bytes from row ``first_row`` of axis 0 on (``pread``)."""
        info = self.tensors[name]
        row_bytes = info.nbytes // info.shape[0] if info.shape and info.shape[0] else info.nbytes
        offset, view, done = info.offset + first_row * row_bytes, memoryview(out).cast("B"), 0
        while done < len(view):
            got = os.preadv(self._fd, [view[done:]], offset + done)
            if got <= 0:
                raise CheckpointError(f"{self.path}: tensor '{name}' cannot be read (file ended early)")
            done += got

    def close(self) -> None:
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # an array still refers to the mapping: it goes when that array does
                pass
            self._map = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _owned(view: np.ndarray) -> np.ndarray:
    """What to hand XLA:CPU for an array on the mapped file so that the device array is a copy, made once.

    XLA:CPU adopts a 64-byte aligned host array as is (``device_put``'s ``may_alias=False`` does not stop it) and
    copies any other. An unaligned view is therefore passed as it is (XLA copies it); an aligned one is first copied
    into page-aligned anonymous memory, which XLA then adopts. Either way: one copy, none of the file aliased."""
    if view.ctypes.data % 64:
        return view
    m = mmap.mmap(-1, max(view.nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    out = np.frombuffer(m, view.dtype, view.size).reshape(view.shape)
    np.copyto(out, view)
    return out


@functools.lru_cache(maxsize=None)
def _convert_fn(spec: tuple, dtype):
    """The jitted conversion ``spec`` then cast (one function per spec; jit caches per shape)."""
    return jax.jit(lambda a: _convert(spec, a).astype(dtype))


@functools.lru_cache(maxsize=None)
def _update_fn(spec: tuple):
    """Write converted rows ``r0:`` of a chunked tensor into ``out`` in place (donated)."""
    def update(out, chunk, r0):
        value = _convert(spec, chunk).astype(out.dtype)
        starts = [jnp.zeros((), jnp.int32)] * out.ndim
        starts[1 if spec[0] == "T" else 0] = r0
        return jax.lax.dynamic_update_slice(out, value, starts)
    return jax.jit(update, donate_argnums=0)


@functools.lru_cache(maxsize=None)
def _set_expert_fn(spec: tuple):
    """Write one expert's converted matrix into row ``e`` of its stacked leaf in place (donated)."""
    return jax.jit(lambda stack, a, e: stack.at[e].set(_convert(spec, a).astype(stack.dtype)), donate_argnums=0)


@functools.lru_cache(maxsize=None)
def _zeros_fn(shape: tuple, dtype, sharding):
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


@functools.partial(jax.jit, static_argnums=1)
def _normalize_head_device(lm_head, dtype):
    """:func:`normalize_head` on the device: float32 in, ``dtype`` out."""
    a = lm_head.astype(jnp.float32)
    return (a / jnp.maximum(jnp.linalg.norm(a, axis=1, keepdims=True), NORM_HEAD_EPS)).astype(dtype)


@dataclasses.dataclass
class _Job:
    """One read: a whole tensor, or rows ``first_row : first_row + rows`` of it (a chunk of a large conversion)."""
    st: SafetensorsFile
    name: str
    info: TensorInfo
    parts: list  # the _Parts this tensor fills
    targets: list  # their storage dtypes
    mode: str  # "whole" (used as stored: copied) | "convert" | "chunk" | "expert" (converted on the device)
    first_row: int = 0
    rows: int | None = None  # None: all of it
    last: bool = True  # the tensor's last chunk

    @property
    def shape(self) -> tuple:
        return self.info.shape if self.rows is None else (self.rows,) + self.info.shape[1:]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.info.dtype.itemsize

    def view(self) -> np.ndarray:
        return self.st.view(self.name, self.first_row, self.rows)

    def prefetch(self) -> None:
        self.st.prefetch(self.name, self.first_row, self.rows)

    def release(self) -> None:
        self.st.release(self.name, self.first_row, self.rows)


class _Placer:
    """Turns jobs' mapped host arrays into device arrays of the target dtype (and sharding).

    * A tensor stored as the model uses it (same layout and dtype) is copied from the mapping into its device
      buffer, never aliasing the file (XLA:CPU would adopt a 64-byte aligned mapping as is): a checkpoint rewritten
      while the engine runs must not change or crash it.
    * A tensor that needs a conversion (transpose ``[out, in] -> [in, out]``, a split of a fused tensor, a dtype
      cast) is converted on the device by a jitted function reading the mapping; above ``CHUNK_BYTES`` it goes in
      chunks of rows written into a donated output, so the extra memory is a chunk.
    * Expert matrices are written into their stacked ``[E, ...]`` leaf in place (donated updates).
    Each job's mapped range is released from the process once its device work is done, so peak memory is the
    model plus the few tensors in flight.
    """

    def __init__(self, cfg: ModelConfig, mesh=None):
        self.cfg = cfg
        self.mesh = mesh
        self.pending: dict[tuple, Any] = {}  # (chunked tensor, leaf) -> its output being filled
        self.stacks: dict[tuple, Any] = {}  # stacked expert leaf path -> device array being filled
        self.filled: dict[tuple, set] = {}  # ... -> experts written so far
        self.in_flight: list[tuple[_Job, list]] = []  # dispatched jobs and the device arrays to wait for
        device = mesh.devices.flat[0] if mesh is not None else jax.devices()[0]
        self.host_platform = device.platform == "cpu"  # device arrays live in host memory

    def sharding(self, path: tuple, shape: tuple):
        if self.mesh is None:
            return None
        from jax.sharding import NamedSharding

        from dllm_jax.sharding import PARAM_AXES, spec_for

        key = path[-1] if "moe" not in path else "moe." + path[-1]
        return NamedSharding(self.mesh, spec_for(PARAM_AXES[key], shape, self.cfg, self.mesh))

    def place(self, job: _Job, shapes: Params, params: Params) -> None:
        host = job.view()
        outputs = []
        if job.mode == "whole":
            part = job.parts[0]
            sharding = self.sharding(part.path, job.info.shape)
            if self.host_platform:  # one copy out of the mapped file, never an alias of it
                out = jax.device_put(_owned(host))
                out = out if sharding is None else jax.device_put(out, sharding)
            else:
                out = jax.device_put(host, sharding)
            _set(params, part.path, out)
            outputs.append(out)
        for part, target in zip(job.parts, job.targets) if job.mode != "whole" else ():
            leaf_shape = _get(shapes, part.path)
            if job.mode == "expert":
                if part.path not in self.stacks:
                    self.stacks[part.path] = _zeros_fn(leaf_shape, target, self.sharding(part.path, leaf_shape))()
                    self.filled[part.path] = set()
                out = _set_expert_fn(part.convert)(self.stacks[part.path], host, jnp.int32(part.expert))
                self.stacks[part.path] = out
                self.filled[part.path].add(part.expert)
            elif job.mode == "chunk":
                out = self.pending.pop((job.name, part.path), None)
                if out is None:
                    out = _zeros_fn(leaf_shape, target, self.sharding(part.path, leaf_shape))()
                out = _update_fn(part.convert)(out, host, jnp.int32(job.first_row))
                if job.last:
                    _set(params, part.path, out)
                else:
                    self.pending[(job.name, part.path)] = out
            else:
                out = _convert_fn(part.convert, target)(host)
                sharding = self.sharding(part.path, leaf_shape)
                if sharding is not None:
                    out = jax.device_put(out, sharding)
                _set(params, part.path, out)
            outputs.append(out)
        del host
        self.in_flight.append((job, outputs))
        while len(self.in_flight) > MAX_IN_FLIGHT:
            self.retire()

    def retire(self) -> None:
        """Wait for the oldest dispatched job, then drop its mapped pages from the process."""
        job, outputs = self.in_flight.pop(0)
        for out in outputs:
            with contextlib.suppress(RuntimeError):  # donated away by a later update: that one is waited for
                out.block_until_ready()
        job.release()

    def finish(self) -> None:
        while self.in_flight:
            self.retire()


def load_safetensors_params(model_dir: str, cfg: ModelConfig, dtype, *, progress: bool = False,
                            mesh=None, ours: bool = False) -> Params:
    """Stream the checkpoint's tensors into device arrays of ``dtype`` (routing leaves: see ``leaf_dtype``).

    Shards are memory-mapped and read one tensor at a time (see :class:`_Placer`): no float32 host copy, no second
    copy of the model; the process's peak memory is the model plus a few tensors. With ``mesh`` each leaf is
    placed with its :mod:`dllm_jax.sharding` layout as it is loaded. ``progress`` shows a bar (bytes read).
    ``ours``: the shards of a converted directory (:func:`convert_checkpoint`), named and laid out as our pytree.
    """
    from tqdm import tqdm

    shapes = param_shapes(cfg)
    dtypes = param_dtypes(cfg, dtype)
    params: Params = {"layers": [dict() for _ in range(cfg.num_layers)]}
    placer = _Placer(cfg, mesh)
    files = [SafetensorsFile(path) for path in _safetensor_files(model_dir)]  # every header first: fail early
    try:
        plan = _plan_ours if ours else _plan
        jobs = [job for st in files for name, info in st.tensors.items()
                for job in plan(st, name, info, cfg, shapes, dtypes)]
        total = sum(info.nbytes for st in files for info in st.tensors.values())
        with tqdm(total=total, desc="loading weights", unit="B", unit_scale=True, disable=not progress,
                  leave=False) as bar:
            for k, job in enumerate(jobs):
                if k + 1 < len(jobs):
                    jobs[k + 1].prefetch()
                placer.place(job, shapes, params)
                bar.update(job.nbytes)
            placer.finish()
            bar.update(total - bar.n)  # tensors the model does not use (rotary buffers, a tied lm_head)
    finally:
        placer.in_flight.clear()
        for st in files:
            st.close()
    for leaf_path, stack in placer.stacks.items():
        if len(placer.filled[leaf_path]) == _get(shapes, leaf_path)[0]:
            _set(params, leaf_path, stack)
    if cfg.norm_head and "lm_head" in params and not ours:  # a converted head is stored normalised
        params["lm_head"] = _normalize_head_device(params["lm_head"], jnp.dtype(_get(dtypes, ("lm_head",))))
    _check_complete(params, shapes, cfg, model_dir, placer.filled, ours=ours)
    return params


def _plan(st: SafetensorsFile, name: str, info: TensorInfo, cfg: ModelConfig, shapes: Params,
          dtypes: Params) -> list[_Job]:
    """The reads that load tensor ``name`` (none if the model does not use it); shape errors surface here."""
    path = st.path
    try:
        parts = hf_tensor_parts(cfg, name)
    except _Unsupported as e:
        raise CheckpointError(f"{path}: tensor '{name}' {e}") from None
    parts = [p for p in parts or () if _has(shapes, p.path)]
    if not parts:  # not a weight (rotary buffers), a tied lm_head, or biases the config does not use
        return []
    expected = _expected_hf_shape(cfg, shapes, parts)
    if info.shape != expected:
        raise CheckpointError(f"{path}: tensor '{name}' has shape {info.shape}, expected {expected} "
                              f"from config.json")
    targets = []
    for part in parts:
        target = jnp.dtype(_get(dtypes, part.path))
        if part.path == ("lm_head",) and cfg.norm_head:
            target = jnp.dtype(jnp.float32)  # normalised in float32 after loading, then cast
        if part.expert is not None and part.expert >= _get(shapes, part.path)[0]:
            raise CheckpointError(f"{path}: tensor '{name}' is for expert {part.expert} but the config has "
                                  f"num_experts={_get(shapes, part.path)[0]}")
        targets.append(target)
    if parts[0].expert is not None:
        return [_Job(st, name, info, parts, targets, "expert")]
    if len(parts) == 1 and parts[0].convert == _ID and info.dtype == targets[0]:
        return [_Job(st, name, info, parts, targets, "whole")]
    rows = info.shape[0] if info.shape else 1
    if info.nbytes <= CHUNK_BYTES or rows < 2 or any(p.convert[0] not in _CHUNKABLE for p in parts):
        return [_Job(st, name, info, parts, targets, "convert")]
    per_chunk = max(1, CHUNK_BYTES // (info.nbytes // rows))
    return [_Job(st, name, info, parts, targets, "chunk", r0, min(per_chunk, rows - r0), r0 + per_chunk >= rows)
            for r0 in range(0, rows, per_chunk)]


def _plan_ours(st: SafetensorsFile, name: str, info: TensorInfo, cfg: ModelConfig, shapes: Params,
               dtypes: Params) -> list[_Job]:
    """Jobs for a tensor of a converted directory: named by its pytree path (``layers.3.moe.gate``), stored in our
    layout, so it is used as stored (a dtype cast at most)."""
    path = tuple(int(p) if p.isdigit() else p for p in name.split("."))
    if not _has(shapes, path) or not isinstance(_get(shapes, path), tuple):
        raise CheckpointError(f"{st.path}: tensor '{name}' is not a parameter of the model config.json describes")
    expected = tuple(_get(shapes, path))
    if info.shape != expected:
        raise CheckpointError(f"{st.path}: tensor '{name}' has shape {info.shape}, expected {expected} from "
                              f"config.json")
    target = jnp.dtype(_get(dtypes, path))
    parts = [_Part(path, None, _ID)]
    if info.dtype == target:
        return [_Job(st, name, info, parts, [target], "whole")]
    rows = info.shape[0] if info.shape else 1
    if info.nbytes <= CHUNK_BYTES or rows < 2:
        return [_Job(st, name, info, parts, [target], "convert")]
    per_chunk = max(1, CHUNK_BYTES // (info.nbytes // rows))
    return [_Job(st, name, info, parts, [target], "chunk", r0, min(per_chunk, rows - r0), r0 + per_chunk >= rows)
            for r0 in range(0, rows, per_chunk)]


def _has(shapes, path) -> bool:
    try:
        _get(shapes, path)
        return True
    except (KeyError, IndexError):
        return False


def _check_complete(params: Params, shapes: Params, cfg: ModelConfig, model_dir: str,
                    expert_rows: dict | None = None, ours: bool = False) -> None:
    flat, _ = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))
    names: list[str] = []
    for key_path, shape in flat:
        path = tuple(getattr(k, "key", getattr(k, "idx", None)) for k in key_path)
        if _has(params, path):
            continue
        if ours:
            names.append(".".join(str(p) for p in path))
        elif path[-2:-1] == ("moe",) and path[-1] in ("gate", "up", "down"):
            seen = (expert_rows or {}).get(path, ())
            names += [hf_name_for(cfg, path, e) for e in range(shape[0]) if e not in seen]
        else:
            names.append(hf_name_for(cfg, path))
    names = list(dict.fromkeys(names))  # fused q/k/v name once
    if names:
        raise CheckpointError(f"{model_dir}: checkpoint is missing tensors: {', '.join(names[:8])}"
                              + (" ..." if len(names) > 8 else ""))


# ----------------------------------------------------------------------------------------------
# Converted directories (dllm-jax convert): our layout in safetensors; older ones in Orbax
# ----------------------------------------------------------------------------------------------

CONVERTED_FORMAT = "dllm-jax-safetensors"
ORBAX_FORMAT = "orbax-standard"
CONVERTED_SHARD_BYTES = 2 << 30


def converted_format(model_dir: str) -> str | None:
    """The format a ``dllm-jax convert`` output is in (``"dllm-jax-safetensors"``, ``"orbax-standard"``), or None
    for any other directory."""
    path = os.path.join(model_dir, ORBAX_MARKER)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            return json.load(f).get("format", ORBAX_FORMAT)
    except (json.JSONDecodeError, AttributeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e


def is_orbax_dir(model_dir: str) -> bool:
    return converted_format(model_dir) == ORBAX_FORMAT


def save_converted(model_dir: str, params: Params, out_dir: str, *, max_shard_bytes: int = CONVERTED_SHARD_BYTES,
                   progress: bool = False) -> None:
    """Write ``out_dir``: config and tokenizer files (never the directory's ``.py`` files) plus ``params/``, our
    pytree in sharded safetensors named by path (``layers.3.q``), in our layout (``[in, out]`` matrices, fused
    tensors split, a ``norm_head`` head normalised) and dtype. Written one tensor at a time from the device arrays
    (a host copy of one tensor at a time on an accelerator, none on CPU)."""
    from tqdm import tqdm

    from dllm_jax.model.layouts import write_sharded

    out_dir = os.path.abspath(out_dir)
    os.makedirs(os.path.join(out_dir, ORBAX_PARAMS_DIR), exist_ok=True)
    for fn in ("config.json",) + TOKENIZER_FILES:
        src = os.path.join(model_dir, fn)
        if os.path.isfile(src):
            shutil.copy(src, os.path.join(out_dir, fn))
    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    leaves = {".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in key_path): leaf
              for key_path, leaf in flat}
    specs = [(name, tuple(leaf.shape), np.dtype(leaf.dtype)) for name, leaf in leaves.items()]
    total = sum(leaf.nbytes for leaf in leaves.values())
    with tqdm(total=total, desc="writing", unit="B", unit_scale=True, disable=not progress, leave=False) as bar:
        def fill(name):
            bar.update(leaves[name].nbytes)
            return np.asarray(leaves[name])

        write_sharded(os.path.join(out_dir, ORBAX_PARAMS_DIR), specs, fill, max_shard_bytes=max_shard_bytes)
    dtypes = sorted({str(x.dtype) for x in leaves.values()})
    with open(os.path.join(out_dir, ORBAX_MARKER), "w") as f:
        json.dump({"format": CONVERTED_FORMAT, "version": 1, "dtypes": dtypes, "source": os.path.abspath(model_dir)},
                  f)


def save_orbax(model_dir: str, params: Params, out_dir: str) -> None:
    """Write ``out_dir`` with the parameters as Orbax plus config and tokenizer files (the former ``convert``
    output; :func:`save_converted` replaced it, and directories written by this still load)."""
    import orbax.checkpoint as ocp

    out_dir = os.path.abspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    for fn in ("config.json",) + TOKENIZER_FILES:
        src = os.path.join(model_dir, fn)
        if os.path.isfile(src):
            shutil.copy(src, os.path.join(out_dir, fn))
    # Uncompressed (bf16 / f32 weights hardly compress, and decompressing slows every load), and at most about
    # 1 GB of host copies in flight, so the save adds a bounded amount to the converted model's memory.
    ckpt = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(save_concurrent_gb=1, restore_concurrent_gb=1,
                                                        use_compression=False))
    try:
        ckpt.save(os.path.join(out_dir, ORBAX_PARAMS_DIR), args=ocp.args.PyTreeSave(params), force=True)
    finally:
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
    ckpt = ocp.StandardCheckpointer(restore_concurrent_gb=1)  # host copies in flight: ~1 GB, not the model
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

def tokenizer_class(model_dir: str):
    """The transformers class that reads this directory's tokenizer, chosen WITHOUT ``AutoTokenizer``.

    ``AutoTokenizer`` follows a ``tokenizer_config.json`` / ``config.json`` ``auto_map`` into the directory's own
    Python files (and asks "Do you wish to run the custom code?" when ``trust_remote_code`` is unset). We never run
    a checkpoint's code, so the class is picked here: ``tokenizer_class`` from ``tokenizer_config.json`` when it
    names a tokenizer class that transformers itself ships (``Qwen2Tokenizer``, ``Qwen2TokenizerFast``, ...; a
    ``...Fast`` name that transformers no longer has is tried without the suffix); otherwise the generic
    ``tokenizer.json`` reader (``PreTrainedTokenizerFast``) when the directory has a ``tokenizer.json``, and
    ``Qwen2Tokenizer`` for a Qwen-family directory given as ``vocab.json`` + ``merges.txt``.
    Returns ``(class, reason)``; raises :class:`CheckpointError` when nothing fits.
    """
    if "transformers" not in sys.modules:  # its "PyTorch was not found" banner means nothing to a JAX engine
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    import transformers
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    name = None
    path = os.path.join(model_dir, "tokenizer_config.json")
    if os.path.isfile(path):
        try:
            with open(path) as f:
                name = json.load(f).get("tokenizer_class")
        except (json.JSONDecodeError, AttributeError) as e:
            raise CheckpointError(f"{path}: not a valid tokenizer config ({e})") from e
    if isinstance(name, str) and name.isidentifier():
        for candidate in (name, name[:-len("Fast")] if name.endswith("Fast") else None):
            if not candidate:
                continue
            try:
                cls = getattr(transformers, candidate)  # transformers' own modules only, never the directory's
            except (AttributeError, ImportError):
                continue
            if isinstance(cls, type) and issubclass(cls, PreTrainedTokenizerBase):
                return cls
    if os.path.isfile(os.path.join(model_dir, "tokenizer.json")):
        return transformers.PreTrainedTokenizerFast
    if all(os.path.isfile(os.path.join(model_dir, f)) for f in ("vocab.json", "merges.txt")):
        return transformers.Qwen2Tokenizer
    raise CheckpointError(f"{model_dir}: cannot load tokenizer: tokenizer_config.json names "
                          f"{name!r}, which is not a tokenizer class of transformers, and there is no tokenizer.json "
                          f"(nor vocab.json + merges.txt) to read instead")


def load_tokenizer(model_dir: str):
    """The directory's tokenizer (None if it has none), loaded with :func:`tokenizer_class`: never through
    ``AutoTokenizer`` and never from the directory's Python files, so loading asks nothing and runs no remote code.
    A ``chat_template.jinja`` beside it is the chat template (transformers reads it)."""
    if not (os.path.isfile(os.path.join(model_dir, "tokenizer.json"))
            or os.path.isfile(os.path.join(model_dir, "tokenizer_config.json"))):
        return None
    cls = tokenizer_class(model_dir)
    try:
        return cls.from_pretrained(model_dir, local_files_only=True, trust_remote_code=False)
    except Exception as e:
        raise CheckpointError(f"{model_dir}: cannot load tokenizer ({cls.__name__}; tokenizer.json / "
                              f"tokenizer_config.json / vocab.json + merges.txt): {e}") from e


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


# generation_config.json keys that become a request's defaults (SGLang's ``--sampling-defaults model`` set).
GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                           "frequency_penalty")


def generation_defaults(model_dir: str) -> dict:
    """The sampling defaults ``generation_config.json`` gives (``{}`` without one).

    ``temperature``, ``top_p``, ``top_k`` (and ``min_p`` / the penalties, for an engine whose requests take them)
    as written; ``do_sample: false`` means greedy (temperature 0), as in transformers. ``max_new_tokens`` and
    ``max_length`` are not taken: a request's length is the caller's choice. The EOS list is read separately
    (:func:`resolve_config`)."""
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            gen = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(gen, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    if gen.get("do_sample") is False:
        return {"temperature": 0.0}
    return {k: gen[k] for k in GENERATION_DEFAULT_KEYS if gen.get(k) is not None}


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
    fmt = converted_format(model_dir)
    if fmt == CONVERTED_FORMAT:
        params = load_safetensors_params(os.path.join(model_dir, ORBAX_PARAMS_DIR), cfg, jdtype, progress=progress,
                                         ours=True)
    elif fmt is not None:
        params = load_orbax_params(model_dir, cfg, jdtype)
    else:
        params = load_safetensors_params(model_dir, cfg, jdtype, progress=progress)
    return LoadedModel(config=cfg, params=params, tokenizer=tokenizer, model_path=os.path.abspath(model_dir))


def convert_checkpoint(hf_dir: str, out_dir: str, *, dtype="float32", progress: bool = False) -> None:
    """``dllm-jax convert``: HF safetensors directory -> a directory in our layout (matrices already ``[in, out]``,
    fused tensors split, in ``dtype``; see :func:`save_converted`), which loads with no conversion at all: every
    tensor is copied as stored, so a load costs about a read of its bytes. Both halves stream one tensor at a time
    (memory-mapped in, written out), so peak memory is about the model's size in ``dtype``."""
    cfg = ModelConfig.from_model_dir(hf_dir)
    params = load_safetensors_params(hf_dir, cfg, jnp.dtype(dtype), progress=progress)
    save_converted(hf_dir, params, out_dir, progress=progress)


convert_to_orbax = convert_checkpoint  # the former name (converted directories were Orbax; they still load)


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
