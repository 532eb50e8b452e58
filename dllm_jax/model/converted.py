"""Directories this package writes: ``dllm-jax convert`` outputs (our pytree in sharded safetensors; older ones in
Orbax, still read) and Hugging Face directories in a family's published layout (:func:`save_hf`).

A converted directory holds config and tokenizer files (never the source directory's ``.py`` files), ``params/``
with one tensor per leaf named by its pytree path (``layers.3.moe.gate_up``) in our layout (matrices ``[out, in]`` as
in the checkpoints, q|k|v and gate|up fused in one shard block's row order, a ``norm_head`` head normalised) and
dtype, and the marker file naming the format and its version. Version 2 stored q / k / v and gate / up as separate
leaves (``layers.3.q``), version 1 (and the Orbax format) also stored matrices ``[in, out]``; they still load, each
segment copied into its fused leaf, version-1 matrices transposed on the way in.
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.config import ModelConfig
from dllm_jax.model.checkpoint_names import params_to_hf
from dllm_jax.model.errors import CheckpointError
from dllm_jax.model.fused import join_fused, split_fused, unfused_rows
from dllm_jax.model.params import Params, abstract_params, get_leaf, key_path, param_dtypes, path_name
from dllm_jax.model.safetensors_io import write_sharded
from dllm_jax.model.tokenizer import TOKENIZER_FILES

ORBAX_PARAMS_DIR = "params"  # (the name dates from the Orbax format; the safetensors one keeps it)
ORBAX_MARKER = "dllm_jax_checkpoint.json"
CONVERTED_FORMAT = "dllm-jax-safetensors"
CONVERTED_VERSION = 3  # 3: q|k|v, gate|up fused; 2: matrices [out, in] (the parameter table's layout); 1: [in, out]
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


def converted_version(model_dir: str) -> int:
    """The layout version of a converted directory's tensors (1: matrices ``[in, out]``, the Orbax format too)."""
    with open(os.path.join(model_dir, ORBAX_MARKER)) as f:
        return int(json.load(f).get("version", 1))


def transpose_v1_matrices(params: Params, cfg: ModelConfig) -> Params:
    """A version-1 pytree (unfused naming, matrices ``[in, out]``) with each matrix leaf's last two axes swapped
    (its own inverse)."""
    rows = unfused_rows(cfg)

    def swap(path, x):
        if not get_leaf(rows, key_path(path))[0].matrix:
            return x
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape[:-2] + (x.shape[-1], x.shape[-2]), x.dtype)
        return jnp.swapaxes(x, -1, -2)
    return jax.tree_util.tree_map_with_path(swap, params)


def save_converted(model_dir: str, params: Params, out_dir: str, *, max_shard_bytes: int = CONVERTED_SHARD_BYTES,
                   progress: bool = False, cfg: ModelConfig | None = None) -> None:
    """Write ``out_dir``: config and tokenizer files (never the directory's ``.py`` files) plus ``params/``, our
    pytree in sharded safetensors named by path (``layers.3.qkv``), in our layout (``[out, in]`` matrices, fused
    tensors split, a ``norm_head`` head normalised) and dtype. Written one tensor at a time from the device arrays
    (a host copy of one tensor at a time on an accelerator, none on CPU). Fused leaves are written in one shard
    block's row order: ``cfg`` (the params' config) when they were laid out for more shards."""
    from tqdm import tqdm

    if cfg is not None and cfg.tp_shards > 1:
        params = join_fused(cfg.replace(tp_shards=1), split_fused(cfg, params))

    out_dir = os.path.abspath(out_dir)
    os.makedirs(os.path.join(out_dir, ORBAX_PARAMS_DIR), exist_ok=True)
    for fn in ("config.json",) + TOKENIZER_FILES:
        src = os.path.join(model_dir, fn)
        if os.path.isfile(src):
            shutil.copy(src, os.path.join(out_dir, fn))
    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    leaves = {path_name(key_path(tree_path)): leaf for tree_path, leaf in flat}
    specs = [(name, tuple(leaf.shape), np.dtype(leaf.dtype)) for name, leaf in leaves.items()]
    total = sum(leaf.nbytes for leaf in leaves.values())
    with tqdm(total=total, desc="writing", unit="B", unit_scale=True, disable=not progress, leave=False) as bar:
        def fill(name):
            bar.update(leaves[name].nbytes)
            return np.asarray(leaves[name])

        write_sharded(os.path.join(out_dir, ORBAX_PARAMS_DIR), specs, fill, max_shard_bytes=max_shard_bytes)
    dtypes = sorted({str(x.dtype) for x in leaves.values()})
    with open(os.path.join(out_dir, ORBAX_MARKER), "w") as f:
        json.dump({"format": CONVERTED_FORMAT, "version": CONVERTED_VERSION, "dtypes": dtypes,
                   "source": os.path.abspath(model_dir)}, f)


def save_orbax(model_dir: str, params: Params, out_dir: str) -> None:
    """Write ``out_dir`` with the parameters as Orbax plus config and tokenizer files (the former ``convert``
    output; :func:`save_converted` replaced it, and directories written by this still load). Matrices are written
    ``[in, out]``, as that format always stored them."""
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
    cfg = ModelConfig.from_model_dir(model_dir)
    params = transpose_v1_matrices(split_fused(cfg, params), cfg)  # the format's naming and orientation
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
    # Routing leaves are always float32 (the table's dtype rule); the others share one stored dtype.
    stored_dtype = jnp.bfloat16 if "bfloat16" in stored else jnp.dtype(stored[0]) if len(stored) == 1 else jnp.float32
    unfused = jax.eval_shape(lambda p: split_fused(cfg, p), abstract_params(cfg, stored_dtype))
    abstract = transpose_v1_matrices(unfused, cfg)  # unfused, [in, out] as stored
    ckpt = ocp.StandardCheckpointer(restore_concurrent_gb=1)  # host copies in flight: ~1 GB, not the model
    try:
        params = ckpt.restore(path, abstract)
    except Exception as e:
        raise CheckpointError(f"{path}: cannot restore Orbax checkpoint ({e})") from e
    finally:
        ckpt.close()
    params = join_fused(cfg, transpose_v1_matrices(params, cfg))
    return jax.tree.map(lambda x, d: jnp.asarray(x, d), params, param_dtypes(cfg, dtype))


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
