"""Reading a Hugging Face ``config.json``: the architectures and model types each family claims, and the
:class:`~dllm_jax.config.ModelConfig` fields a config dict gives (:func:`model_fields`: the fields every family
shares, then the family's own: :func:`_qwen3_fields`, :func:`_llada2_fields`, :func:`_diffusion_gemma_fields`).

:mod:`dllm_jax.config` builds and validates the config from these fields (and re-exports the names here); the
model families (:mod:`dllm_jax.model.family`) name their parsers.
"""

from __future__ import annotations

QWEN3_ARCHITECTURES = ("Qwen3ForCausalLM", "SDARForCausalLM", "Qwen3MoeForCausalLM", "SDARMoeForCausalLM")
LLADA2_ARCHITECTURES = ("LLaDA2MoeModelLM",)
DIFFUSION_GEMMA_ARCHITECTURES = ("DiffusionGemmaForBlockDiffusion",)
SUPPORTED_ARCHITECTURES = QWEN3_ARCHITECTURES + LLADA2_ARCHITECTURES + DIFFUSION_GEMMA_ARCHITECTURES
QWEN3_MODEL_TYPES = ("qwen3", "sdar", "qwen3_moe", "sdar_moe")
LLADA2_MODEL_TYPES = ("llada2_moe", "bailing_moe", "bailing_moe_v2")
DIFFUSION_GEMMA_MODEL_TYPES = ("diffusion_gemma",)
SUPPORTED_MODEL_TYPES = QWEN3_MODEL_TYPES + LLADA2_MODEL_TYPES + DIFFUSION_GEMMA_MODEL_TYPES
SLIDING, FULL = "sliding_attention", "full_attention"  # DiffusionGemma layer types
GEMMA_ROPE_TYPES = ("default", "proportional")
SUPPORTED_ROPE_TYPES = ("default", "linear")
SCORE_FUNCTIONS = ("softmax", "sigmoid")
DEFAULT_SDAR_BLOCK_SIZE = 4
DEFAULT_LLADA2_BLOCK_SIZE = 32

# Architecture written when a config names only its model_type.
_ARCH_FOR_MODEL_TYPE = {
    "qwen3": "Qwen3ForCausalLM", "sdar": "SDARForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
    "sdar_moe": "SDARMoeForCausalLM", "llada2_moe": "LLaDA2MoeModelLM", "bailing_moe": "LLaDA2MoeModelLM",
    "bailing_moe_v2": "LLaDA2MoeModelLM", "diffusion_gemma": "DiffusionGemmaForBlockDiffusion",
}


class ConfigError(ValueError):
    """A model directory whose config cannot be served; the message names the file and field."""


def model_fields(hf: dict, source: str = "config.json") -> dict:
    """The :class:`~dllm_jax.config.ModelConfig` fields of a ``config.json`` dict (not yet validated: see
    :meth:`ModelConfig.from_hf_dict`); an unsupported or incomplete config is a :class:`ConfigError` naming
    ``source`` and the field."""
    def need(key: str):
        if hf.get(key) is None:
            raise ConfigError(f"{source}: missing required field '{key}'")
        return hf[key]

    archs = hf.get("architectures") or []
    model_type = hf.get("model_type")
    arch = archs[0] if archs else None
    if arch in DIFFUSION_GEMMA_ARCHITECTURES or (arch is None and model_type in DIFFUSION_GEMMA_MODEL_TYPES):
        return _diffusion_gemma_fields(hf, source)
    if arch is not None and arch not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(
            f"{source}: unknown architecture '{arch}'; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"{source}: unknown model_type '{model_type}'; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if arch is None:
        arch = _ARCH_FOR_MODEL_TYPE[model_type]
    if (arch in LLADA2_ARCHITECTURES) != (model_type in LLADA2_MODEL_TYPES):
        raise ConfigError(f"{source}: architecture '{arch}' does not match model_type '{model_type}'")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{source}: unsupported hidden_act '{act}'; only 'silu' (SwiGLU) is supported")

    # transformers 5 writes rope_parameters; older configs write rope_theta + rope_scaling.
    rope = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    rope_theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"{source}: unsupported rope scaling type '{rope_type}'; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    factor = float(rope.get("factor", scaling.get("factor", 1.0))) if rope_type == "linear" else 1.0

    hidden = int(need("hidden_size"))
    heads = int(need("num_attention_heads"))
    num_layers = int(need("num_hidden_layers"))
    head_dim = int(hf.get("head_dim") or hidden // heads)
    eos = hf.get("eos_token_id")
    eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else []))
    block = hf.get("block_size", hf.get("dllm_block_size"))
    mask = hf.get("mask_token_id")

    def opt_int(key):
        return None if hf.get(key) is None else int(hf[key])

    common = dict(
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rope_theta=rope_theta,
        rope_scaling_factor=factor,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        architecture=arch,
        model_type=model_type,
        mask_token_id=None if mask is None else int(mask),
        block_size=None if block is None else int(block),
        eos_token_ids=eos_ids,
        delete_token_id=opt_int("delete_token_id"),
        split_token_id=opt_int("split_token_id"),
    )
    if arch in LLADA2_ARCHITECTURES:
        fields = _llada2_fields(hf, num_layers, head_dim, source)
    else:
        fields = _qwen3_fields(hf, num_layers, source)
    return {**common, **fields}


def _qwen3_fields(hf: dict, num_layers: int, source: str) -> dict:
    """Qwen3 / SDAR dense and Qwen3-MoE / SDAR-MoE fields (transformers' ``Qwen3MoeConfig`` semantics)."""
    num_experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
    moe_layers: tuple[int, ...] = ()
    if num_experts and hf.get("model_type") in ("qwen3_moe", "sdar_moe"):
        step = int(hf.get("decoder_sparse_step") or 1)
        mlp_only = set(int(i) for i in (hf.get("mlp_only_layers") or []))
        moe_layers = tuple(i for i in range(num_layers) if i not in mlp_only and (i + 1) % step == 0)
    fields = dict(
        intermediate_size=int(hf.get("intermediate_size") or 0),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        attention_bias=bool(hf.get("attention_bias", False)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
    )
    if moe_layers:
        fields.update(
            num_experts=num_experts,
            num_experts_per_tok=_need(hf, "num_experts_per_tok", source),
            moe_intermediate_size=_need(hf, "moe_intermediate_size", source),
            moe_layers=moe_layers,
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        )
    return fields


def _llada2_fields(hf: dict, num_layers: int, head_dim: int, source: str) -> dict:
    """LLaDA2.x fields. Defaults are those of the checkpoints' own ``LLaDA2MoeConfig`` class, which is what
    SGLang (trust_remote_code) sees when a key is absent from config.json. As in SGLang's ``llada2.py`` the q/k
    norms are RMSNorm whatever ``use_rmsnorm`` says."""
    num_experts = int(hf.get("num_experts", 16) or 0)
    first_dense = int(hf.get("first_k_dense_replace", 0) or 0)
    moe_layers = tuple(range(first_dense, num_layers)) if num_experts else ()
    if "partial_rotary_factor" in hf and hf["partial_rotary_factor"] is not None:
        partial = float(hf["partial_rotary_factor"])
    elif hf.get("rotary_dim"):
        partial = float(hf["rotary_dim"]) / head_dim
    else:
        partial = 0.5
    use_bias = bool(hf.get("use_bias", True))
    n_group = int(hf.get("n_group", 8) or 0)
    topk_group = int(hf.get("topk_group", 4) or 0)
    if n_group <= 0 or topk_group <= 0:  # SGLang: grouping off unless both are positive
        n_group = topk_group = 1
    moe_size = int(hf.get("moe_intermediate_size") or 0)
    num_shared = int(hf.get("num_shared_experts") or 0)
    router_dtype = hf.get("router_dtype")
    fields = dict(
        intermediate_size=int(hf.get("intermediate_size") or 0),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        attention_bias=use_bias or bool(hf.get("use_qkv_bias", False)),
        o_bias=use_bias,
        use_qk_norm=bool(hf.get("use_qk_norm", True)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 16384)),
        partial_rotary_factor=partial,
        norm_head=bool(hf.get("norm_head", False)),
    )
    if moe_layers:
        score = hf.get("score_function") or "softmax"
        if score not in SCORE_FUNCTIONS:
            raise ConfigError(f"{source}: unknown score_function '{score}'; supported: {', '.join(SCORE_FUNCTIONS)}")
        fields.update(
            num_experts=num_experts,
            num_experts_per_tok=int(hf.get("num_experts_per_tok", 2)),
            moe_intermediate_size=moe_size,
            moe_layers=moe_layers,
            norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
            moe_score_func=score,
            moe_expert_bias=bool(hf.get("moe_router_enable_expert_bias", False)),
            moe_n_group=n_group,
            moe_topk_group=topk_group,
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 2.5)),
            num_shared_experts=num_shared,
            shared_expert_intermediate_size=int(hf.get("moe_shared_expert_intermediate_size") or moe_size)
            if num_shared else 0,
            router_fp32=router_dtype in ("fp32", "float32"),
        )
    return fields


def _diffusion_gemma_fields(hf: dict, source: str) -> dict:
    """DiffusionGemma (``DiffusionGemmaConfig``): the text model's fields from ``text_config`` with
    transformers' defaults (``DiffusionGemmaTextConfig.__post_init__``: layer types 5:1 with the last full,
    per-layer head dim / KV heads of full layers, RoPE per layer type), the canvas as the block size."""
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"{source}: missing required field 'text_config' (a DiffusionGemma config nests the text "
                          f"model's fields there)")
    where = f"{source}: text_config"

    def need(key: str):
        if text.get(key) is None:
            raise ConfigError(f"{where}: missing required field '{key}'")
        return text[key]

    num_layers = int(need("num_hidden_layers"))
    layer_types = list(text.get("layer_types") or
                       [SLIDING if (i + 1) % 6 else FULL for i in range(num_layers)])
    if len(layer_types) != num_layers or any(t not in (SLIDING, FULL) for t in layer_types):
        raise ConfigError(f"{where}.layer_types must list '{SLIDING}' or '{FULL}' for each of the "
                          f"{num_layers} layers")
    layer_types[-1] = FULL  # transformers forces the last layer full (with a warning)
    bidirectional = text.get("use_bidirectional_attention")
    if bidirectional not in (None, "vision"):
        raise ConfigError(f"{where}.use_bidirectional_attention={bidirectional!r}: an encoder that attends "
                          f"bidirectionally over text cannot keep a causal prefix cache; supported: null, 'vision'")
    heads = int(need("num_attention_heads"))
    hidden = int(need("hidden_size"))
    head_dim = int(text.get("head_dim") or hidden // heads)
    kv_heads = int(text.get("num_key_value_heads") or heads)
    # Full layers' overrides: transformers 5.24 serialises them as per_layer_config {index: {...}}; a published
    # config may carry global_head_dim / num_global_key_value_heads instead.
    per_layer = text.get("per_layer_config")
    if per_layer is not None:  # (empty: the full layers are like the others)
        overrides = {int(k): v for k, v in per_layer.items()}
        bad = [i for i in overrides if not 0 <= i < num_layers or layer_types[i] != FULL]
        full = [overrides.get(i, {}) for i in range(num_layers) if layer_types[i] == FULL]
        if bad or any(o != full[0] for o in full):
            raise ConfigError(f"{where}.per_layer_config must override the full-attention layers alike "
                              f"(and only them)")
        global_head_dim = int(full[0].get("head_dim", head_dim))
        global_kv = int(full[0].get("num_key_value_heads", kv_heads))
    else:
        global_head_dim = int(text.get("global_head_dim") or 512)
        global_kv = int(text.get("num_global_key_value_heads") or kv_heads)
        if text.get("attention_k_eq_v") is False:  # transformers then overrides the head dim only
            global_kv = kv_heads
    rope = text.get("rope_parameters") or {}
    defaults = {SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}

    def rope_spec(kind: str) -> tuple:
        spec = rope.get(kind) or defaults[kind]
        kind_type = spec.get("rope_type", "default")
        if kind_type not in GEMMA_ROPE_TYPES:
            raise ConfigError(f"{where}.rope_parameters.{kind}.rope_type '{kind_type}' is not supported; "
                              f"supported: {', '.join(GEMMA_ROPE_TYPES)}")
        partial = float(spec.get("partial_rotary_factor", 1.0))
        if kind_type == "default" and partial != 1.0:
            raise ConfigError(f"{where}.rope_parameters.{kind}: partial_rotary_factor {partial} with the default "
                              f"rope_type (transformers applies it only with 'proportional')")
        return (kind_type, float(spec.get("rope_theta", defaults[kind]["rope_theta"])), partial,
                float(spec.get("factor", 1.0)))

    num_experts = int(text.get("num_experts") or 0)
    if num_experts <= 0:
        raise ConfigError(f"{where}: missing required field 'num_experts' (every DiffusionGemma layer has experts)")
    act = text.get("hidden_activation", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ConfigError(f"{where}: unsupported hidden_activation '{act}'; only 'gelu_pytorch_tanh'")
    eos = text.get("eos_token_id", 1)
    eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else []))
    canvas = hf.get("canvas_length", 256)
    tie = hf.get("tie_word_embeddings", text.get("tie_word_embeddings", True))
    window = text.get("sliding_window", 512)
    return dict(
        vocab_size=int(need("vocab_size")), hidden_size=hidden, intermediate_size=int(need("intermediate_size")),
        num_layers=num_layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(tie), attention_bias=bool(text.get("attention_bias", False)),
        max_position_embeddings=int(text.get("max_position_embeddings", 131_072)),
        architecture=DIFFUSION_GEMMA_ARCHITECTURES[0], model_type="diffusion_gemma",
        block_size=None if canvas is None else int(canvas), eos_token_ids=eos_ids,
        num_experts=num_experts, num_experts_per_tok=int(need("top_k_experts")),
        moe_intermediate_size=int(need("moe_intermediate_size")), moe_layers=tuple(range(num_layers)),
        norm_topk_prob=True,
        layer_types=tuple(layer_types), sliding_window=None if window is None else int(window),
        global_head_dim=global_head_dim, num_global_kv_heads=global_kv,
        rope_sliding=rope_spec(SLIDING), rope_full=rope_spec(FULL),
        final_logit_softcapping=None if text.get("final_logit_softcapping", 30.0) is None
        else float(text.get("final_logit_softcapping", 30.0)),
        hidden_act="gelu_pytorch_tanh",
    )


def _need(hf: dict, key: str, source: str) -> int:
    if hf.get(key) is None:
        raise ConfigError(f"{source}: missing required field '{key}'")
    return int(hf[key])
