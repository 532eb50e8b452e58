"""SDAR-MoE / Qwen3-MoE against transformers' Qwen3MoeForCausalLM, the paged path on a MoE model, the grouped
(ragged_dot) expert computation against a per-token loop, and batch-composition independence of the MoE layer."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

from dllm_jax.config import ConfigError, ModelConfig
from dllm_jax.model.converted import save_hf
from dllm_jax.model.loader import CheckpointError, load_model
from dllm_jax.model.moe import moe_mlp, route
from dllm_jax.model.params import init_params, param_shapes
from dllm_jax.model.qwen3 import block_causal_mask, forward_chunk, forward_full
from pallas_kernels.paged_block_attention import paged_block_attention_reference

MASK_ID = 95
VOCAB = 101


def _rewrite_config(path, **changes):
    with open(path / "config.json") as f:
        d = json.load(f)
    for k, v in changes.items():
        if v is None:
            d.pop(k, None)
        else:
            d[k] = v
    with open(path / "config.json", "w") as f:
        json.dump(d, f)


def _hf_moe(tmp_path, *, norm_topk_prob=True, tie=False, name="hf", layers=3, mlp_only_layers=(1,),
            decoder_sparse_step=1):
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=norm_topk_prob, mlp_only_layers=list(mlp_only_layers),
        decoder_sparse_step=decoder_sparse_step, max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=tie,
        rms_norm_eps=1e-6, attn_implementation="eager",
    )
    model = transformers.Qwen3MoeForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:  # non-trivial norms so that a missed norm fails the test
                p.add_(0.1 * torch.randn_like(p))
            elif "mlp.gate.weight" in n:  # decisive routing: no near-ties for float noise to flip
                p.normal_(0.0, 0.5)
            elif "experts" in n:  # experts large enough that a wrong weight or expert shows in the logits
                p.normal_(0.0, 0.1)
    path = tmp_path / name
    model.save_pretrained(path)
    _rewrite_config(path, mask_token_id=MASK_ID)
    return model, path


# Jitted: one compile per shape is much cheaper on CPU than dispatching the MoE's many small ops eagerly.
_forward_full = jax.jit(forward_full, static_argnums=1, static_argnames="return_hidden")
_forward_chunk = jax.jit(forward_chunk, static_argnums=1, static_argnames=("block_size", "attention_fn"))


def _additive_mask(seq_len, block):
    visible = block_causal_mask(seq_len, block)
    return torch.where(torch.from_numpy(visible), 0.0, torch.finfo(torch.float32).min)[None, None]


def _ours(loaded, tokens, block):
    n, s = tokens.shape
    positions = np.broadcast_to(np.arange(s), tokens.shape)
    mask = np.broadcast_to(block_causal_mask(s, block), (n, s, s))
    return np.asarray(_forward_full(loaded.params, loaded.config, jnp.asarray(tokens), jnp.asarray(positions),
                                    jnp.asarray(mask)))


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("block,seq_len", [(4, 11), (32, 45)])
def test_logits_match_transformers_qwen3_moe(tmp_path, norm_topk_prob, block, seq_len):
    hf, path = _hf_moe(tmp_path, norm_topk_prob=norm_topk_prob)
    loaded = load_model(path, block_size=block)
    cfg = loaded.config
    assert cfg.moe_layers == (0, 2) and cfg.num_experts == 8 and cfg.norm_topk_prob == norm_topk_prob
    assert "moe" in loaded.params["layers"][0] and "moe" not in loaded.params["layers"][1]
    tokens = np.random.default_rng(1).integers(0, VOCAB, size=(2, seq_len))
    with torch.no_grad():
        ref = hf(input_ids=torch.from_numpy(tokens), attention_mask=_additive_mask(seq_len, block)).logits.numpy()
    assert np.max(np.abs(_ours(loaded, tokens, block) - ref)) <= 1e-4


def test_sdar_moe_architecture_tied_head_and_default_block(tmp_path):
    """SDARMoeForCausalLM / sdar_moe is the same network; its default block is 4; decoder_sparse_step works."""
    hf, path = _hf_moe(tmp_path, tie=True, layers=4, mlp_only_layers=(), decoder_sparse_step=2)
    _rewrite_config(path, architectures=["SDARMoeForCausalLM"], model_type="sdar_moe")
    loaded = load_model(path)
    assert loaded.config.block_size == 4 and loaded.config.tie_word_embeddings
    assert loaded.config.moe_layers == (1, 3)  # (i + 1) % decoder_sparse_step == 0
    tokens = np.random.default_rng(2).integers(0, VOCAB, size=(1, 13))
    with torch.no_grad():
        ref = hf(input_ids=torch.from_numpy(tokens), attention_mask=_additive_mask(13, 4)).logits.numpy()
    assert np.max(np.abs(_ours(loaded, tokens, 4) - ref)) <= 1e-4


def test_fused_expert_layout_loads_identically(tmp_path):
    """transformers >= 5 keeps experts as fused 3D tensors (gate_up_proj [E, 2I, H], down_proj [E, H, I]);
    a checkpoint written that way loads to the same parameters as the per-expert one."""
    _, path = _hf_moe(tmp_path)
    tensors = load_file(path / "model.safetensors")
    fused = {}
    for name, a in tensors.items():
        if ".mlp.experts." not in name:
            fused[name] = a
    for i in (0, 2):
        p = f"model.layers.{i}.mlp.experts."
        gate = np.stack([tensors[f"{p}{e}.gate_proj.weight"] for e in range(8)])
        up = np.stack([tensors[f"{p}{e}.up_proj.weight"] for e in range(8)])
        fused[p + "gate_up_proj"] = np.ascontiguousarray(np.concatenate([gate, up], axis=1))
        fused[p + "down_proj"] = np.stack([tensors[f"{p}{e}.down_proj.weight"] for e in range(8)])
    out = tmp_path / "fused"
    out.mkdir()
    save_file(fused, out / "model.safetensors")
    (out / "config.json").write_text((path / "config.json").read_text())
    a, b = load_model(path), load_model(out)
    assert jax.tree.structure(a.params) == jax.tree.structure(b.params)
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
        assert np.array_equal(np.asarray(x), np.asarray(y))


def test_incremental_paged_path_equals_full_forward_moe(tmp_path):
    """As tests/test_model.py's dense test: two blocks prefilled in one chunk, then one block at a time."""
    block = 4
    _, path = _hf_moe(tmp_path)
    m = load_model(path, block_size=block)
    cfg, params = m.config, m.params
    num_blocks = 4
    seq_len = num_blocks * block
    tokens = np.random.default_rng(3).integers(0, VOCAB, size=(1, seq_len))
    full = _forward_full(params, cfg, jnp.asarray(tokens), jnp.arange(seq_len)[None],
                        jnp.asarray(block_causal_mask(seq_len, block))[None], return_hidden=True)
    pages = [(jnp.zeros((cfg.num_kv_heads, 8, block, cfg.head_dim)),) * 2 for _ in range(cfg.num_layers)]
    page_ids = np.array([5, 2, 7, 3])
    table = jnp.asarray(np.concatenate([page_ids, [0, 0]])[None], jnp.int32)
    hidden, pages = _forward_chunk(params, cfg, jnp.asarray(tokens[:, : 2 * block]), pages, table,
                                  jnp.zeros((1,), jnp.int32), jnp.asarray(page_ids[None, :2]),
                                  block_size=block, attention_fn=paged_block_attention_reference)
    np.testing.assert_allclose(np.asarray(hidden), np.asarray(full[:, : 2 * block]), atol=1e-4)
    for b in range(2, num_blocks):
        sl = slice(b * block, (b + 1) * block)
        hidden, pages = _forward_chunk(params, cfg, jnp.asarray(tokens[:, sl]), pages, table,
                                      jnp.asarray([b * block], jnp.int32), jnp.asarray(page_ids[None, b:b + 1]),
                                      block_size=block, attention_fn=paged_block_attention_reference)
        np.testing.assert_allclose(np.asarray(hidden), np.asarray(full[:, sl]), atol=1e-4)


def test_save_hf_round_trip_moe(tmp_path):
    _, path = _hf_moe(tmp_path)
    a = load_model(path)
    save_hf(a.params, a.config, tmp_path / "resaved")
    b = load_model(tmp_path / "resaved")
    assert a.config == b.config
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
        assert np.array_equal(np.asarray(x), np.asarray(y))


# --- the MoE layer itself -------------------------------------------------------------------------

def _moe_cfg(**kw):
    base = dict(vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=2, num_kv_heads=2,
                head_dim=16, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=24, moe_layers=(0,),
                norm_topk_prob=True)
    base.update(kw)
    return ModelConfig(**base)


def _moe_params(cfg, seed=0):
    """Outputs of order one (so 1e-6 is a few float32 ulps) and decisive routing (router logits of order one)."""
    p = init_params(cfg, jax.random.key(seed), std=0.1)["layers"][0]["moe"]
    p["router"] = p["router"] * 3.0
    if "expert_bias" in p:
        p["expert_bias"] = jax.random.normal(jax.random.key(seed + 1), p["expert_bias"].shape) * 0.3
    return p


def _loop_reference(moe, x, cfg):
    """Per token, per chosen expert, a plain dense SwiGLU (routing from :func:`route`); matrices are ``[out, in]``."""
    ids, w = jax.jit(route, static_argnums=1)(jnp.asarray(x) @ moe["router"].T, cfg, moe.get("expert_bias"))
    ids, w = np.asarray(ids), np.asarray(w)
    M = cfg.moe_intermediate_size  # gate|up fused on one shard block: [gate; up] along out
    gu, d = np.asarray(moe["gate_up"], np.float64), np.asarray(moe["down"], np.float64)
    g, u = gu[:, :M], gu[:, M:]
    out = np.zeros(x.shape, np.float64)
    for n in range(x.shape[0]):
        xn = np.asarray(x[n], np.float64)
        for slot in range(ids.shape[1]):
            e = ids[n, slot]
            a = xn @ g[e].T
            out[n] += w[n, slot] * ((a / (1 + np.exp(-a)) * (xn @ u[e].T)) @ d[e].T)
    if "shared_gate_up" in moe:
        xs = np.asarray(x, np.float64)
        S = cfg.shared_intermediate_total
        sgu = np.asarray(moe["shared_gate_up"], np.float64)
        a = xs @ sgu[:S].T
        out += (a / (1 + np.exp(-a)) * (xs @ sgu[S:].T)) @ np.asarray(moe["shared_down"], np.float64).T
    return out


MOE_VARIANTS = {
    "qwen3": dict(),
    "bailing": dict(moe_score_func="sigmoid", moe_expert_bias=True, moe_n_group=4, moe_topk_group=2,
                    routed_scaling_factor=2.5, num_shared_experts=2, shared_expert_intermediate_size=8,
                    router_fp32=True),
}


@pytest.mark.parametrize("variant", list(MOE_VARIANTS))
def test_grouped_matmul_equals_per_token_loop(variant):
    cfg = _moe_cfg(**MOE_VARIANTS[variant])
    moe = _moe_params(cfg)
    x = jax.random.normal(jax.random.key(7), (37, cfg.hidden_size))
    ours = np.asarray(jax.jit(moe_mlp, static_argnums=2)(moe, x, cfg))
    np.testing.assert_allclose(ours, _loop_reference(moe, x, cfg), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", list(MOE_VARIANTS))
def test_output_independent_of_batch_composition(variant):
    """Exact routing, no capacity: a token's output is the same alone, in a batch, and in a shuffled batch."""
    cfg = _moe_cfg(**MOE_VARIANTS[variant])
    moe = _moe_params(cfg)
    f = jax.jit(moe_mlp, static_argnums=2)
    x = jax.random.normal(jax.random.key(8), (64, cfg.hidden_size))
    batch = np.asarray(f(moe, x, cfg))
    perm = np.random.default_rng(0).permutation(64)
    shuffled = np.asarray(f(moe, x[perm], cfg))
    np.testing.assert_allclose(shuffled, batch[perm], atol=1e-6, rtol=0)
    for n in (0, 17, 63):
        alone = np.asarray(f(moe, x[n:n + 1], cfg))
        np.testing.assert_allclose(alone[0], batch[n], atol=1e-6, rtol=0)
    # A batch where every other token goes to one expert (skewed groups) changes nothing for token 5.
    crowd = jnp.concatenate([x[5:6], jnp.repeat(x[9:10], 40, axis=0)])
    np.testing.assert_allclose(np.asarray(f(moe, crowd, cfg))[0], batch[5], atol=1e-6, rtol=0)


def test_moe_param_layout_is_expert_stacked():
    cfg = _moe_cfg(**MOE_VARIANTS["bailing"])
    moe = param_shapes(cfg)["layers"][0]["moe"]
    assert moe["gate_up"] == (8, 48, 32) and moe["down"] == (8, 32, 24)  # [E, out, in], gate|up fused along out
    assert moe["router"] == (8, 32) and moe["expert_bias"] == (8,)
    assert moe["shared_gate_up"] == (32, 32) and moe["shared_down"] == (32, 16)
    p = init_params(cfg, jax.random.key(0), dtype=jnp.bfloat16)["layers"][0]["moe"]
    assert p["router"].dtype == jnp.float32 and p["expert_bias"].dtype == jnp.float32  # fp32 router
    assert p["gate_up"].dtype == jnp.bfloat16


# --- config and checkpoint errors ------------------------------------------------------------------

def test_expert_weights_in_a_dense_layer_name_the_tensor(tmp_path):
    _, path = _hf_moe(tmp_path)
    _rewrite_config(path, mlp_only_layers=[0, 1])
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.(gate|experts)"):
        load_model(path)


def test_missing_expert_names_the_tensor(tmp_path):
    _, path = _hf_moe(tmp_path)
    tensors = load_file(path / "model.safetensors")
    tensors.pop("model.layers.2.mlp.experts.5.up_proj.weight")
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight"):
        load_model(path)


def test_moe_config_errors(tmp_path):
    _, path = _hf_moe(tmp_path)
    _rewrite_config(path, num_experts_per_tok=9)
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        load_model(path)
    _rewrite_config(path, num_experts_per_tok=2, architectures=["MixtralForCausalLM"])
    with pytest.raises(ConfigError, match="MixtralForCausalLM"):
        load_model(path)
