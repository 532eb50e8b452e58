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
    # DiffusionGemma-26B-A4B: the Gemma 4 26B-A4B text shape (30 layers, 5 sliding : 1 full, window 1024; sliding
    # layers 8 KV heads x 256, full layers 2 KV heads x 512; 128 experts of 704, top 8; dense MLP 2112; hidden 2816;
    # vocab 262,144 -- as its GGUF metadata and transformers' EP-plan note give it), canvas 256, tied.
    "diffusiongemma-26b-a4b": dict(
        architectures=["DiffusionGemmaForBlockDiffusion"], model_type="diffusion_gemma", canvas_length=256,
        tie_word_embeddings=True,
        text_config=dict(vocab_size=262144, hidden_size=2816, intermediate_size=2112, num_hidden_layers=30,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=256, global_head_dim=512,
                         num_global_key_value_heads=2, sliding_window=1024, num_experts=128, top_k_experts=8,
                         moe_intermediate_size=704, max_position_embeddings=262144, eos_token_id=[1, 106])),
}
WINDOW_CONTEXT = 4096  # the per-request context the window table sizes requests at


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


def _layer_page_bytes(layer, block_size: int, dtype, mesh, tensors: int | None = None) -> int:
    """One page of one layer on one device: its KV heads split over ``tp`` when they divide (whole heads)."""
    tp = mesh.shape["tp"]
    heads = layer.kv_heads // tp if tp > 1 and layer.kv_heads % tp == 0 else layer.kv_heads
    itemsize = _dtype(dtype if layer.dtype is None else layer.dtype).itemsize
    return (layer.tensors if tensors is None else tensors) * heads * block_size * layer.head_dim * itemsize


def kv_page_bytes_per_device(cfg: ModelConfig, block_size: int, dtype, mesh, *, sliding: bool | None = None) -> int:
    """One KV page (what every layer keeps for one block: K and V, or K alone) on one device, from the model
    family's KV layout per layer. ``sliding``: only the sliding-window layers' share (True) or the others' (False)."""
    from dllm_jax.model.family import family_of

    return sum(_layer_page_bytes(layer, block_size, dtype, mesh) for layer in family_of(cfg).kv_layout(cfg)
               if sliding is None or (layer.window is not None) == sliding)


@dataclasses.dataclass(frozen=True)
class WindowPlan:
    """KV of a model with sliding-window layers (DiffusionGemma), per token of context on one device: a uniform
    pool (every layer K and V in one shape, the largest), per-layer shapes with K and V and no window, and ours
    (full layers the raw k alone; sliding layers at most the pages their window reaches, per request)."""

    name: str
    tp: int
    ep: int
    page_size: int
    canvas: int
    uniform_token_bytes: int
    per_layer_token_bytes: int
    full_token_bytes: int  # ours: the full layers' share, per token of context
    sliding_request_bytes: int  # ours: the sliding layers' pages one request holds at most
    free_bytes: dict  # device GB -> bytes left for KV after the weights and the reserve

    def request_bytes(self, context: int, *, ours: bool = True) -> int:
        pages = -(-context // self.page_size)
        if not ours:
            return pages * self.page_size * self.uniform_token_bytes
        return pages * self.page_size * self.full_token_bytes + min(
            pages * self.page_size * (self.per_layer_token_bytes - self._full_kv_token_bytes),
            self.sliding_request_bytes)

    _full_kv_token_bytes: int = 0  # the full layers' K and V per token (the per-layer figure's share)

    def requests(self, gb: int, context: int = WINDOW_CONTEXT, *, ours: bool = True) -> int:
        return max(0, self.free_bytes[gb] // self.request_bytes(context, ours=ours))

    def canvases(self, gb: int, *, ours: bool = True) -> int:
        """Canvases of context (``canvas`` tokens each) one request can hold in the KV that fits."""
        free = self.free_bytes[gb]
        if not ours:
            return max(0, free // (self.uniform_token_bytes * self.canvas))
        return max(0, (free - self.sliding_request_bytes) // (self.full_token_bytes * self.canvas))


def window_plan(p: "Plan", cfg: ModelConfig, device_sizes_gb=DEVICE_SIZES_GB) -> WindowPlan:
    """The :class:`WindowPlan` of plan ``p`` (its mesh, dtype and page size)."""
    from dllm_jax.model.family import LayerKV, family_of

    mesh = virtual_mesh(p.tp, p.ep)
    layers = family_of(cfg).kv_layout(cfg)
    uniform = LayerKV(max(layer.kv_heads for layer in layers), max(layer.head_dim for layer in layers))
    per_token = lambda layer, tensors=None: _layer_page_bytes(layer, 1, p.dtype, mesh, tensors)  # noqa: E731
    sliding_pages = -(-(cfg.sliding_window - 1 + p.block_size) // p.block_size) + 1
    return WindowPlan(
        name=p.name, tp=p.tp, ep=p.ep, page_size=p.block_size, canvas=cfg.block_size or p.block_size,
        uniform_token_bytes=len(layers) * per_token(uniform),
        per_layer_token_bytes=sum(per_token(layer, 2) for layer in layers),
        full_token_bytes=sum(per_token(layer) for layer in layers if layer.window is None),
        sliding_request_bytes=sliding_pages * p.block_size * sum(per_token(layer) for layer in layers
                                                                  if layer.window is not None),
        free_bytes={gb: max(0, gb * GB - p.param_bytes_per_device - p.reserve_bytes) for gb in device_sizes_gb},
        _full_kv_token_bytes=sum(per_token(layer, 2) for layer in layers if layer.window is None))


def format_window_table(wplans: list[WindowPlan], device_sizes_gb=DEVICE_SIZES_GB) -> str:
    head = ["model", "mesh", "KV/token uniform", "per-layer K+V", "ours full", "ours sliding/req"]
    for gb in device_sizes_gb:
        head += [f"req@{WINDOW_CONTEXT}@{gb}GB uniform/ours", f"canvases@{gb}GB uniform/ours"]
    rows = []
    for w in wplans:
        row = [w.name, f"tp{w.tp}" + (f" ep{w.ep}" if w.ep > 1 else ""), _size(w.uniform_token_bytes),
               _size(w.per_layer_token_bytes), _size(w.full_token_bytes), _size(w.sliding_request_bytes)]
        for gb in device_sizes_gb:
            row += [f"{w.requests(gb, ours=False):,} / {w.requests(gb):,}",
                    f"{w.canvases(gb, ours=False):,} / {w.canvases(gb):,}"]
        rows.append(row)
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    line = lambda r: "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    notes = ("sliding-window KV: uniform = every layer K and V in the largest layer shape, no window; per-layer = "
             "each layer's own shape, K and V, no window; ours = full layers the raw k alone per token, sliding "
             f"layers at most (window - 1 + page) / page + 1 pages per request; req = requests of {WINDOW_CONTEXT} "
             "tokens of context; canvases = one request's context in canvases")
    return "\n".join([line(head), *(line(r) for r in rows), notes])


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
    plans, plan_configs = [], []
    for source in sources:
        name, cfg = load_config(source)
        if args.tp is None and args.ep is None:
            new = plan_grid(name, cfg, **kwargs)
        else:
            new = [make_plan(name, cfg, tp=args.tp or 1, ep=args.ep or 1, **kwargs)]
        plans += new
        plan_configs += [cfg] * len(new)
    print(format_table(plans, sizes))
    windowed = [window_plan(p, cfg, sizes) for p, cfg in zip(plans, plan_configs) if cfg.sliding_window]
    if windowed:
        print()
        print(format_window_table(windowed, sizes))
    return 0
