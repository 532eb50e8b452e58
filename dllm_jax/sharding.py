"""Tensor and expert parallelism over a JAX device mesh: one table from logical axis names to mesh axes.

Every parameter (its row of the parameter table, :mod:`dllm_jax.model.params`) and the KV page pool name their
dimensions with logical axes; :data:`RULES` maps each logical axis to a mesh axis (or None: replicated). Changing
the layout is editing that table. A logical axis is only sharded when its size divides evenly (heads are split by
whole heads; a model with 4 KV heads on TP = 8 keeps K/V replicated while q heads and the MLP still split), so any
model runs on any mesh, correctly.

The mesh has two axes, ``("expert", "tp")``: dense models use only ``tp``; MoE models split their experts over
``expert`` and each expert's intermediate dimension over ``tp``. XLA's SPMD partitioner (GSPMD) inserts the
collectives from these annotations; the Pallas kernels run per shard under ``shard_map``, and the confidence
selection reduces each shard's vocabulary slice to a (max, sum-exp, argmax) triple before combining, so full
logits never exist on one device (DiffusionGemma's renoise pass likewise merges per-shard partials:
:func:`dllm_jax.decode.renoise.vocab_parallel_stats`; its layers' pools differ in KV heads: :func:`layer_pool_spec`).

Multi-host: call :func:`dllm_jax.distributed.initialize` on every host first; ``jax.devices()`` then spans all
hosts and the same mesh code shards over them.
"""

from __future__ import annotations

import numpy as np
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dllm_jax.config import ModelConfig
from dllm_jax.model.fused import FUSED_AXES, fused_axis_groups
from dllm_jax.model.params import PARAM_AXES, key_path, param_axes  # noqa: F401 (PARAM_AXES: public)

MESH_AXES = ("expert", "tp")

# logical axis -> mesh axis. The layout of the whole model, in one place.
RULES: dict[str, str | None] = {
    "vocab": "tp",  # embedding rows / LM-head columns: vocab-parallel head, confidence triples per shard
    "q_heads": "tp",  # attention: q by head, o by input head
    "kv_heads": "tp",  # k / v projections and the KV page pool by KV head (replicated if it does not divide)
    "global_kv_heads": "tp",  # DiffusionGemma's full-attention layers' k projection (their own KV heads)
    "mlp": "tp",  # dense SwiGLU intermediate (and the MoE shared experts)
    # fused out axes (dllm_jax.model.fused): rows shard-major, so each shard's block holds its own q/k/v heads
    # (gate/up halves); split only when laid out for this degree (ModelConfig.tp_shards), else replicated
    "qkv": "tp",
    "gate_up": "tp",
    "expert_gate_up": "tp",
    "experts": "expert",  # stacked expert weights
    "expert_mlp": "tp",  # each expert's intermediate dimension
    "hidden": None,
    "head_dim": None,
    "router": None,
}

# The logical axes of every parameter come from the parameter table (dllm_jax.model.params), keyed by leaf name
# (``moe.``-prefixed inside a sparse layer's ``moe`` dict); only the pool's are here.
KV_POOL_AXES = ("kv_heads", None, None, None)  # [Hkv, pages, B, D]


def make_mesh(tensor_parallel_size: int = 1, expert_parallel_size: int = 1, devices=None) -> Mesh:
    devices = list(devices if devices is not None else jax.devices())
    need = tensor_parallel_size * expert_parallel_size
    if need > len(devices):
        raise ValueError(f"tensor_parallel_size: {tensor_parallel_size} x expert_parallel_size "
                         f"{expert_parallel_size} needs {need} devices, only {len(devices)} are visible")
    grid = np.array(devices[:need]).reshape(expert_parallel_size, tensor_parallel_size)
    return Mesh(grid, MESH_AXES)  # Auto axes: GSPMD propagates shardings through the model


def _units(cfg: ModelConfig, axis: str, size: int) -> int:
    """How many indivisible units a logical axis has (heads, not head-dim columns)."""
    if axis == "q_heads":
        return cfg.num_heads
    if axis == "kv_heads":
        return cfg.num_kv_heads
    if axis == "global_kv_heads":
        return cfg.num_global_kv_heads
    if axis in FUSED_AXES:  # its shard blocks: a mesh that does not divide them would split a block
        return fused_axis_groups(cfg, axis, size)
    return size


def spec_for(axes: tuple, shape: tuple, cfg: ModelConfig, mesh: Mesh) -> P:
    parts = []
    for axis, size in zip(axes, shape):
        mesh_axis = RULES.get(axis) if axis is not None else None
        if mesh_axis is not None and _units(cfg, axis, size) % mesh.shape[mesh_axis] != 0:
            mesh_axis = None  # does not divide: replicate (correct, just not split)
        if mesh_axis is not None and mesh.shape[mesh_axis] == 1:
            mesh_axis = None
        parts.append(mesh_axis)
    return P(*parts)


def param_specs(params, cfg: ModelConfig, mesh: Mesh):
    """A pytree of PartitionSpecs matching ``params``."""
    def spec(path, leaf):
        try:
            axes = param_axes(cfg, key_path(path))
        except KeyError:
            raise KeyError(f"no sharding rule for parameter {jax.tree_util.keystr(path)}: add it to the parameter "
                           f"table (dllm_jax.model.params)") from None
        return spec_for(axes, leaf.shape, cfg, mesh)
    return jax.tree_util.tree_map_with_path(spec, params)


def shard_params(params, cfg: ModelConfig, mesh: Mesh):
    specs = param_specs(params, cfg, mesh)
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs)


def kv_pool_spec(cfg: ModelConfig, mesh: Mesh, num_pages: int, block_size: int) -> P:
    return spec_for(KV_POOL_AXES, (cfg.num_kv_heads, num_pages, block_size, cfg.head_dim), cfg, mesh)


def shard_kv_pages(kv_pages, cfg: ModelConfig, mesh: Mesh):
    k0 = kv_pages[0][0]
    sharding = NamedSharding(mesh, kv_pool_spec(cfg, mesh, k0.shape[1], k0.shape[2]))
    return [(jax.device_put(k, sharding), jax.device_put(v, sharding)) for k, v in kv_pages]


def layer_pool_spec(kv_heads: int, mesh: Mesh) -> P:
    """One layer's pool ``[Hkv, pages, S, D]`` where layers differ in KV heads (DiffusionGemma: sliding layers
    ``num_kv_heads``, full layers ``num_global_kv_heads``, as their k projections' ``kv_heads`` /
    ``global_kv_heads`` rows split): by whole heads when they divide, else replicated."""
    axis = RULES["kv_heads"]
    n = mesh.shape[axis]
    return P(axis if n > 1 and kv_heads % n == 0 else None, None, None, None)


def layer_pool_shardings(pools, mesh: Mesh):
    """The :class:`NamedSharding` of every array of per-layer pools (tuples of ``[Hkv, pages, S, D]`` arrays)."""
    return [tuple(NamedSharding(mesh, layer_pool_spec(a.shape[0], mesh)) for a in layer) for layer in pools]


def vocab_shards(cfg: ModelConfig, mesh: Mesh | None) -> int:
    """Number of vocabulary shards the LM head has on this mesh (1 = replicated)."""
    if mesh is None:
        return 1
    n = mesh.shape[RULES["vocab"]]
    return n if n > 1 and cfg.vocab_size % n == 0 else 1


def heads_shardable(cfg: ModelConfig, mesh: Mesh | None) -> bool:
    if mesh is None:
        return False
    n = mesh.shape["tp"]
    return n > 1 and cfg.num_heads % n == 0 and cfg.num_kv_heads % n == 0
