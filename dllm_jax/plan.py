"""Sharding plans at real size, without allocating: what one device holds for a model on a TP x EP mesh.

``dllm-jax plan --preset sdar-8b`` (or ``--model-path DIR`` / a bare ``config.json``) answers, before anyone buys
hardware: how many parameter bytes each device holds, how many bytes one KV page (one block of ``B`` tokens, all
layers, K and V) costs each device, and how many pages -- hence tokens of context across all running requests --
fit in an 80 GB and a 141 GB device once the weights and a stated activation reserve are taken out.

Why it can be trusted: nothing here re-derives the layout. The parameter tree comes from the parameter table the
model, the loader and the sharding all derive from (:func:`dllm_jax.model.params.abstract_params`: shapes and
storage dtypes, no memory), and each leaf's split comes from :mod:`dllm_jax.sharding` (the same ``RULES`` table and
divisibility fallback the engine shards with), applied on a virtual mesh (:class:`jax.sharding.AbstractMesh`: any
size, no devices needed). A test checks these numbers against the per-device bytes of a small model the engine
really shards over 4 CPU devices.

Memory arithmetic: ``pages = floor((device - params_per_device - reserve) / kv_page_bytes_per_device)``; the
engine reserves page 0 as its trash page, so ``tokens = (pages - 1) * B``. Device sizes are decimal GB (80e9 and
141e9 bytes: an H100 reports a little more, 85.0e9, and an H200 150.7e9, so the figures are conservative).
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from dllm_jax.config import ModelConfig

# JAX is imported inside the functions: `dllm-jax --help` builds this command's parser without loading it.

GB = 10 ** 9
GIB = 1 << 30
DEVICE_SIZES_GB = (80, 141)
DEFAULT_RESERVE_GIB = 4.0  # compiled-step temporaries (logits of a full denoise batch, MoE dispatch), runtime
PLAN_DEGREES = (1, 2, 4, 8)

# config.json dicts of the published checkpoints (the keys the plan reads; shapes as published).
_QWEN3_TOKENS = dict(vocab_size=151936, max_position_embeddings=40960, mask_token_id=151669, block_size=4,
                     eos_token_id=151643, rope_theta=1000000, rms_norm_eps=1e-6, hidden_act="silu", head_dim=128)
PRESETS: dict[str, dict] = {
    # SDAR-1.7B-Chat: the Qwen3-1.7B shape, tied embeddings
    "sdar-1.7b": dict(architectures=["SDARForCausalLM"], model_type="sdar", hidden_size=2048,
                      intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                      tie_word_embeddings=True, **_QWEN3_TOKENS),
    # SDAR-8B-Chat: the Qwen3-8B shape
    "sdar-8b": dict(architectures=["SDARForCausalLM"], model_type="sdar", hidden_size=4096, intermediate_size=12288,
                    num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False,
                    **_QWEN3_TOKENS),
    # SDAR-30B-A3B-Chat: the Qwen3-30B-A3B shape (128 experts, 8 per token, every layer sparse)
    "sdar-30b-a3b": dict(architectures=["SDARMoeForCausalLM"], model_type="sdar_moe", hidden_size=2048,
                         intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                         num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                         decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False, **_QWEN3_TOKENS),
    # LLaDA2.0-mini (16B total, 1.4B active): 256 experts + 1 shared, first layer dense, fp32 router
    "llada2-mini": dict(architectures=["LLaDA2MoeModelLM"], model_type="llada2_moe", vocab_size=157184,
                        hidden_size=2048, intermediate_size=5120, num_hidden_layers=20, num_attention_heads=16,
                        num_key_value_heads=4, head_dim=128, num_experts=256, num_experts_per_tok=8,
                        num_shared_experts=1, moe_intermediate_size=512, moe_shared_expert_intermediate_size=512,
                        first_k_dense_replace=1, n_group=8, topk_group=4, routed_scaling_factor=2.5,
                        score_function="sigmoid", moe_router_enable_expert_bias=True, router_dtype="fp32",
                        norm_topk_prob=True, use_bias=False, use_qkv_bias=False, use_qk_norm=True,
                        partial_rotary_factor=0.5, rope_theta=600000, rms_norm_eps=1e-6,
                        max_position_embeddings=16384, tie_word_embeddings=False, eos_token_id=156892,
                        hidden_act="silu"),
}


@dataclasses.dataclass(frozen=True)
class Plan:
    """One model on one ``ep x tp`` mesh. Byte counts are for the most loaded device (all are equal when every
    split divides; a replicated leaf counts in full on every device)."""

    name: str
    tp: int
    ep: int
    dtype: str
    block_size: int
    total_param_bytes: int  # the whole model, once
    param_bytes_per_device: int
    kv_page_bytes_per_device: int
    reserve_bytes: int

    def pages(self, device_bytes: int) -> int:
        """KV pages that fit one device of ``device_bytes`` (0 when the weights and the reserve do not fit)."""
        free = device_bytes - self.param_bytes_per_device - self.reserve_bytes
        return max(0, free // self.kv_page_bytes_per_device)

    def tokens(self, device_bytes: int) -> int:
        """Tokens of KV those pages hold (page 0 is the engine's trash page)."""
        return max(0, self.pages(device_bytes) - 1) * self.block_size


def load_config(source: str) -> tuple[str, ModelConfig]:
    """A preset name, a model directory, or a bare ``config.json`` path -> (display name, config)."""
    if source in PRESETS:
        return source, ModelConfig.from_hf_dict(PRESETS[source], source=f"preset {source}")
    if os.path.isdir(source):
        return os.path.basename(os.path.normpath(source)), ModelConfig.from_model_dir(source)
    if os.path.isfile(source):
        with open(source) as f:
            hf = json.load(f)
        name = os.path.basename(os.path.dirname(os.path.abspath(source))) or source
        return name, ModelConfig.from_hf_dict(hf, source=source)
    raise ValueError(f"{source}: not a preset ({', '.join(PRESETS)}), a model directory or a config.json file")


def virtual_mesh(tp: int, ep: int = 1):
    """The engine's ``("expert", "tp")`` mesh, virtual (an ``AbstractMesh``): shapes only, so any size plans
    without devices."""
    from jax.sharding import AbstractMesh

    from dllm_jax.sharding import MESH_AXES

    return AbstractMesh((ep, tp), MESH_AXES)


def abstract_params(cfg: ModelConfig, dtype) -> dict:
    """The parameter tree as ``ShapeDtypeStruct`` leaves, from the parameter table of the model's family
    (:func:`dllm_jax.model.params.param_table`; nothing allocated)."""
    from dllm_jax.model.params import abstract_params

    return abstract_params(cfg, dtype)


def _dtype(dtype):
    import jax.numpy as jnp

    return jnp.dtype(dtype)  # knows "bfloat16"


def _shard_bytes(shape, dtype, spec, mesh) -> int:
    from jax.sharding import NamedSharding

    shard = NamedSharding(mesh, spec).shard_shape(tuple(shape))
    return int(np.prod(shard, dtype=np.int64)) * _dtype(dtype).itemsize


def param_bytes_per_device(params, cfg: ModelConfig, mesh) -> int:
    """Bytes of ``params`` (arrays or ShapeDtypeStructs) one device holds when sharded by dllm_jax.sharding."""
    import jax

    from dllm_jax.sharding import param_specs

    specs = param_specs(params, cfg, mesh)
    leaves = jax.tree.leaves(jax.tree.map(lambda x, s: _shard_bytes(x.shape, x.dtype, s, mesh), params, specs))
    return int(sum(leaves))


def kv_page_bytes_per_device(cfg: ModelConfig, block_size: int, dtype, mesh) -> int:
    """One KV page (K and V of every layer for one block) on one device, from the model family's KV layout per
    layer: the pool's spec splits KV heads over ``tp`` when they divide, else every device holds all of them."""
    from dllm_jax.model.family import family_of
    from dllm_jax.sharding import kv_pool_spec

    spec = kv_pool_spec(cfg, mesh, 1, block_size)
    return sum(2 * _shard_bytes((layer.kv_heads, 1, block_size, layer.head_dim),
                                dtype if layer.dtype is None else layer.dtype, spec, mesh)
               for layer in family_of(cfg).kv_layout(cfg))


def make_plan(name: str, cfg: ModelConfig, *, tp: int = 1, ep: int = 1, dtype: str = "bfloat16",
              block_size: int | None = None, reserve_gib: float = DEFAULT_RESERVE_GIB, params=None) -> Plan:
    import jax

    if tp < 1 or ep < 1:
        raise ValueError(f"tp / ep: must be >= 1, got tp={tp} ep={ep}")
    if ep > 1 and not cfg.is_moe:
        raise ValueError(f"ep: {name} has no experts; expert parallelism needs a MoE model")
    B = block_size or cfg.block_size or cfg.default_block_size
    jdtype = _dtype(dtype)
    params = abstract_params(cfg, jdtype) if params is None else params
    mesh = virtual_mesh(tp, ep)
    total = int(sum(int(np.prod(x.shape, dtype=np.int64)) * x.dtype.itemsize
                    for x in jax.tree.leaves(params)))
    return Plan(name=name, tp=tp, ep=ep, dtype=jdtype.name, block_size=B, total_param_bytes=total,
                param_bytes_per_device=param_bytes_per_device(params, cfg, mesh),
                kv_page_bytes_per_device=kv_page_bytes_per_device(cfg, B, jdtype, mesh),
                reserve_bytes=int(reserve_gib * GIB))


def plan_grid(name: str, cfg: ModelConfig, *, degrees=PLAN_DEGREES, **kwargs) -> list[Plan]:
    """TP 1, 2, 4, 8 (EP 1); for a MoE model also EP 2, 4, 8 (TP 1)."""
    params = abstract_params(cfg, _dtype(kwargs.get("dtype", "bfloat16")))
    plans = [make_plan(name, cfg, tp=n, params=params, **kwargs) for n in degrees]
    if cfg.is_moe:
        plans += [make_plan(name, cfg, ep=n, params=params, **kwargs) for n in degrees if n > 1]
    return plans


def _size(n: int) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"


def format_table(plans: list[Plan], device_sizes_gb=DEVICE_SIZES_GB) -> str:
    if not plans:
        return ""
    p0 = plans[0]
    head = ["model", "mesh", "params/dev", "KV/page/dev", "B"]
    for gb in device_sizes_gb:
        head += [f"pages@{gb}GB", f"tokens@{gb}GB"]
    rows = []
    for p in plans:
        mesh = f"tp{p.tp}" + (f" ep{p.ep}" if p.ep > 1 else "")
        row = [p.name, mesh, _size(p.param_bytes_per_device), _size(p.kv_page_bytes_per_device), str(p.block_size)]
        for gb in device_sizes_gb:
            pages = p.pages(gb * GB)
            row += [f"{pages:,}" if pages else "does not fit", f"{p.tokens(gb * GB):,}"]
        rows.append(row)
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    line = lambda r: "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    notes = (f"{p0.dtype} weights and KV; reserve {p0.reserve_bytes / GIB:g} GiB per device for activations; "
             f"devices of {' / '.join(f'{g}e9' for g in device_sizes_gb)} bytes; tokens = (pages - 1) x B")
    return "\n".join([line(head), *(line(r) for r in rows), notes])


# ----------------------------------------------------------------------------------------------
def add_arguments(p) -> None:
    p.add_argument("source", nargs="*", metavar="PRESET|DIR|config.json",
                   help=f"what to plan: a preset ({', '.join(PRESETS)}), a model directory or a config.json "
                        f"(default with no --model-path: every preset)")
    p.add_argument("--model-path", default=None, help="model directory or config.json")
    p.add_argument("--preset", action="append", default=[], choices=sorted(PRESETS), help="a built-in config")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default: 1, 2, 4, 8)")
    p.add_argument("--ep", type=int, default=None, help="expert-parallel size, MoE models (default: 1; the grid "
                                                        "adds EP 2, 4, 8)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--block-size", type=int, default=None, help="page size in tokens (default: the model's)")
    p.add_argument("--reserve-gib", type=float, default=DEFAULT_RESERVE_GIB,
                   help=f"per-device activation reserve (default {DEFAULT_RESERVE_GIB:g} GiB)")
    p.add_argument("--device-gb", default=",".join(map(str, DEVICE_SIZES_GB)),
                   help="device sizes in decimal GB, comma separated (default 80,141)")


def run(args) -> int:
    sources = list(args.source) + ([args.model_path] if args.model_path else []) + list(args.preset)
    sources = sources or list(PRESETS)
    sizes = tuple(int(x) for x in str(args.device_gb).replace(",", " ").split())
    kwargs = dict(dtype=args.dtype, block_size=args.block_size, reserve_gib=args.reserve_gib)
    plans = []
    for source in sources:
        name, cfg = load_config(source)
        if args.tp is None and args.ep is None:
            plans += plan_grid(name, cfg, **kwargs)
        else:
            plans.append(make_plan(name, cfg, tp=args.tp or 1, ep=args.ep or 1, **kwargs))
    print(format_table(plans, sizes))
    return 0
