"""LLaDA2.x (LLaDA2MoeModelLM, BailingMoE-v2 style) against an independent NumPy implementation of the layer
equations (reference section 5.2), on small random checkpoints written in the HF layout; plus focused tests of
each routing detail, where the wrong variant gives a different answer."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from dllm_jax.config import ConfigError, ModelConfig
from dllm_jax.model.converted import save_hf
from dllm_jax.model.family import default_chat_template
from dllm_jax.model.loader import CheckpointError, convert_checkpoint, load_model
from dllm_jax.model.moe import moe_mlp, route, swiglu
from dllm_jax.model.qwen3 import block_causal_mask, forward_full, rope
from dllm_jax.model.templates import LLADA2_CHAT_TEMPLATE, render_llada2_chat

VOCAB = 120
MASK_ID = 119

# Two configs between them switch every variant: sigmoid + selection bias + group limit + shared experts +
# untied normalised head + biases + partial RoPE + fp32 router, and softmax + no grouping + tied head + no q/k
# norm + full RoPE (given as rotary_dim).
BAILING = dict(
    architectures=["LLaDA2MoeModelLM"], model_type="llada2_moe", vocab_size=VOCAB, hidden_size=48,
    intermediate_size=80, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    hidden_act="silu", rms_norm_eps=1e-6, rope_theta=600000.0, max_position_embeddings=512,
    partial_rotary_factor=0.5, use_qkv_bias=True, use_bias=True, use_qk_norm=True, use_rmsnorm=True,
    num_experts=8, num_experts_per_tok=3, moe_intermediate_size=24, first_k_dense_replace=1,
    n_group=4, topk_group=2, score_function="sigmoid", moe_router_enable_expert_bias=True, norm_topk_prob=True,
    routed_scaling_factor=2.5, num_shared_experts=1, moe_shared_expert_intermediate_size=20, router_dtype="fp32",
    tie_word_embeddings=False, norm_head=True, mask_token_id=MASK_ID, delete_token_id=117, split_token_id=118,
)
SOFTMAX_TIED = dict(
    BAILING, partial_rotary_factor=None, rotary_dim=16, use_qkv_bias=False, use_bias=False, use_qk_norm=False,
    n_group=1, topk_group=1, score_function="softmax", moe_router_enable_expert_bias=False, norm_topk_prob=False,
    routed_scaling_factor=1.0, num_shared_experts=0, router_dtype=None, tie_word_embeddings=True,
    norm_head=False, num_experts_per_tok=2, first_k_dense_replace=2, delete_token_id=None, split_token_id=None,
)


def _random_checkpoint(hf, seed=0):
    """HF-layout tensors (names of the LLaDA2 checkpoints; [out, in] matrices) for config dict ``hf``."""
    rng = np.random.default_rng(seed)
    h, d = hf["hidden_size"], hf["head_dim"]
    nq, nkv = hf["num_attention_heads"], hf["num_key_value_heads"]
    e, m = hf["num_experts"], hf["moe_intermediate_size"]

    def mat(*shape, std=0.1):
        return (std * rng.standard_normal(shape)).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    t = {"model.word_embeddings.weight": mat(hf["vocab_size"], h, std=0.5), "model.norm.weight": norm(h)}
    if not hf["tie_word_embeddings"]:
        t["lm_head.weight"] = mat(hf["vocab_size"], h, std=0.5)
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = norm(h)
        t[p + "post_attention_layernorm.weight"] = norm(h)
        t[p + "attention.query_key_value.weight"] = mat((nq + 2 * nkv) * d, h, std=0.3)
        if hf["use_qkv_bias"] or hf["use_bias"]:
            t[p + "attention.query_key_value.bias"] = mat((nq + 2 * nkv) * d, std=0.1)
        if hf["use_qk_norm"]:
            t[p + "attention.query_layernorm.weight"] = norm(d)
            t[p + "attention.key_layernorm.weight"] = norm(d)
        t[p + "attention.dense.weight"] = mat(h, nq * d, std=0.2)
        if hf["use_bias"]:
            t[p + "attention.dense.bias"] = mat(h, std=0.1)
        if i < hf["first_k_dense_replace"]:
            t[p + "mlp.gate_proj.weight"] = mat(hf["intermediate_size"], h, std=0.2)
            t[p + "mlp.up_proj.weight"] = mat(hf["intermediate_size"], h, std=0.2)
            t[p + "mlp.down_proj.weight"] = mat(h, hf["intermediate_size"], std=0.2)
            continue
        t[p + "mlp.gate.weight"] = mat(e, h, std=0.4)  # logits of order one: decisive routing
        if hf["moe_router_enable_expert_bias"]:
            t[p + "mlp.gate.expert_bias"] = mat(e, std=0.2)
        for x in range(e):
            t[p + f"mlp.experts.{x}.gate_proj.weight"] = mat(m, h, std=0.2)
            t[p + f"mlp.experts.{x}.up_proj.weight"] = mat(m, h, std=0.2)
            t[p + f"mlp.experts.{x}.down_proj.weight"] = mat(h, m, std=0.2)
        if hf["num_shared_experts"]:
            s = hf["moe_shared_expert_intermediate_size"] * hf["num_shared_experts"]
            t[p + "mlp.shared_experts.gate_proj.weight"] = mat(s, h, std=0.2)
            t[p + "mlp.shared_experts.up_proj.weight"] = mat(s, h, std=0.2)
            t[p + "mlp.shared_experts.down_proj.weight"] = mat(h, s, std=0.2)
    return t


def _write(path, hf, tensors):
    path.mkdir(parents=True, exist_ok=True)
    with open(path / "config.json", "w") as f:
        json.dump({k: v for k, v in hf.items() if v is not None}, f)
    save_file(tensors, path / "model.safetensors")
    return path


# ----------------------------------------------------------------------------------------------
# Independent NumPy reference (float64, loops; clarity first)
# ----------------------------------------------------------------------------------------------

def _np_rms(x, w, eps):
    return w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def _np_silu(x):
    return x / (1.0 + np.exp(-x))


def _np_rope(x, pos, rotary_dim, theta):
    """x [heads, D] at position pos: rotate-half RoPE on the first rotary_dim dims only."""
    out = x.copy()
    half = rotary_dim // 2
    for j in range(half):
        freq = 1.0 / theta ** (2 * j / rotary_dim)
        c, s = np.cos(pos * freq), np.sin(pos * freq)
        a, b = x[:, j], x[:, j + half]
        out[:, j] = a * c - b * s
        out[:, j + half] = b * c + a * s
    return out


def _np_route(h, router, bias, hf):
    """One token: (chosen experts, their weights), exactly as section 5.2 describes."""
    logits = router @ h  # [E]
    if hf["score_function"] == "sigmoid":
        scores = 1.0 / (1.0 + np.exp(-logits))
    else:
        scores = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
    choice = scores + (bias if bias is not None else 0.0)  # bias: selection only
    e, n_group, topk_group = len(scores), hf["n_group"], hf["topk_group"]
    eligible = np.ones(e, bool)
    if n_group > 1 and topk_group < n_group:
        size = e // n_group
        group_scores = []
        for g in range(n_group):
            members = sorted(choice[g * size:(g + 1) * size], reverse=True)
            group_scores.append(members[0] + members[1] if bias is not None else members[0])
        kept = sorted(range(n_group), key=lambda g: -group_scores[g])[:topk_group]
        eligible = np.array([x // size in kept for x in range(e)])
    candidates = [x for x in range(e) if eligible[x]]
    chosen = sorted(candidates, key=lambda x: -choice[x])[: hf["num_experts_per_tok"]]
    weights = np.array([scores[x] for x in chosen])  # unbiased scores
    if hf["norm_topk_prob"]:
        weights = weights / weights.sum()
    return chosen, weights * hf["routed_scaling_factor"]


def _np_forward(t, hf, tokens, block):
    t = {k: v.astype(np.float64) for k, v in t.items()}
    eps, d = hf["rms_norm_eps"], hf["head_dim"]
    nq, nkv = hf["num_attention_heads"], hf["num_key_value_heads"]
    rotary_dim = int(d * hf["partial_rotary_factor"]) if hf.get("partial_rotary_factor") else hf["rotary_dim"]
    seq = len(tokens)
    x = t["model.word_embeddings.weight"][tokens]
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = _np_rms(x, t[p + "input_layernorm.weight"], eps)
        qkv = h @ t[p + "attention.query_key_value.weight"].T
        if p + "attention.query_key_value.bias" in t:
            qkv = qkv + t[p + "attention.query_key_value.bias"]
        qkv = qkv.reshape(seq, nq + 2 * nkv, d)
        q, k, v = qkv[:, :nq], qkv[:, nq:nq + nkv], qkv[:, nq + nkv:]
        if hf["use_qk_norm"]:
            q = _np_rms(q, t[p + "attention.query_layernorm.weight"], eps)
            k = _np_rms(k, t[p + "attention.key_layernorm.weight"], eps)
        q = np.stack([_np_rope(q[s], s, rotary_dim, hf["rope_theta"]) for s in range(seq)])
        k = np.stack([_np_rope(k[s], s, rotary_dim, hf["rope_theta"]) for s in range(seq)])
        attn = np.zeros((seq, nq, d))
        for head in range(nq):
            kv_head = head // (nq // nkv)
            for s in range(seq):
                visible = [j for j in range(seq) if j // block <= s // block]
                logits = np.array([q[s, head] @ k[j, kv_head] for j in visible]) / np.sqrt(d)
                probs = np.exp(logits - logits.max())
                probs /= probs.sum()
                attn[s, head] = sum(pr * v[j, kv_head] for pr, j in zip(probs, visible))
        out = attn.reshape(seq, nq * d) @ t[p + "attention.dense.weight"].T
        if p + "attention.dense.bias" in t:
            out = out + t[p + "attention.dense.bias"]
        x = x + out
        h = _np_rms(x, t[p + "post_attention_layernorm.weight"], eps)
        if i < hf["first_k_dense_replace"]:
            mlp = (_np_silu(h @ t[p + "mlp.gate_proj.weight"].T) * (h @ t[p + "mlp.up_proj.weight"].T)) \
                @ t[p + "mlp.down_proj.weight"].T
        else:
            mlp = np.zeros_like(h)
            for s in range(seq):
                chosen, weights = _np_route(h[s], t[p + "mlp.gate.weight"], t.get(p + "mlp.gate.expert_bias"), hf)
                for x_id, w in zip(chosen, weights):
                    e = f"{p}mlp.experts.{x_id}."
                    y = (_np_silu(t[e + "gate_proj.weight"] @ h[s]) * (t[e + "up_proj.weight"] @ h[s]))
                    mlp[s] += w * (t[e + "down_proj.weight"] @ y)
                if hf["num_shared_experts"]:
                    e = p + "mlp.shared_experts."
                    y = (_np_silu(t[e + "gate_proj.weight"] @ h[s]) * (t[e + "up_proj.weight"] @ h[s]))
                    mlp[s] += t[e + "down_proj.weight"] @ y
        x = x + mlp
    x = _np_rms(x, t["model.norm.weight"], eps)
    if hf["tie_word_embeddings"]:
        head = t["model.word_embeddings.weight"]
    else:
        head = t["lm_head.weight"]  # [V, H]
        if hf["norm_head"]:  # F.normalize(weight, dim=0): each hidden unit's column over the vocabulary
            head = head / np.maximum(np.linalg.norm(head, axis=0, keepdims=True), 1e-7)
    return x @ head.T


_forward_full = jax.jit(forward_full, static_argnums=1, static_argnames="return_hidden")


def _ours(loaded, tokens, block):
    s = len(tokens)
    return np.asarray(_forward_full(loaded.params, loaded.config, jnp.asarray(tokens)[None], jnp.arange(s)[None],
                                    jnp.asarray(block_causal_mask(s, block))[None]))[0]


# ----------------------------------------------------------------------------------------------
# Whole model
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,hf,block,seq_len", [("bailing", BAILING, 32, 40), ("softmax_tied", SOFTMAX_TIED, 4, 11)])
def test_logits_match_numpy_reference(tmp_path, name, hf, block, seq_len):
    tensors = _random_checkpoint(hf)
    loaded = load_model(_write(tmp_path / name, hf, tensors), block_size=block)
    tokens = np.random.default_rng(5).integers(0, VOCAB, size=seq_len)
    ref = _np_forward(tensors, hf, tokens, block)
    ours = _ours(loaded, tokens, block)
    assert np.max(np.abs(ours - ref)) <= 1e-4, np.max(np.abs(ours - ref))


def test_config_fields_and_param_layout(tmp_path):
    loaded = load_model(_write(tmp_path / "m", BAILING, _random_checkpoint(BAILING)))
    cfg = loaded.config
    assert cfg.family == "llada2" and cfg.block_size == 32  # LLaDA2 default block
    assert cfg.mask_token_id == MASK_ID and (cfg.delete_token_id, cfg.split_token_id) == (117, 118)
    assert cfg.moe_layers == (1, 2) and cfg.rotary_dim == 8 and cfg.router_fp32
    assert (cfg.moe_score_func, cfg.moe_expert_bias, cfg.moe_n_group, cfg.moe_topk_group) == ("sigmoid", True, 4, 2)
    assert cfg.attention_bias and cfg.o_bias and cfg.norm_head and cfg.shared_intermediate_total == 20
    layers = loaded.params["layers"]
    assert set(layers[0]) >= {"qkv", "o", "o_bias", "qkv_bias", "gate_up", "down"} and "moe" not in layers[0]
    moe = layers[1]["moe"]
    # matrices [out, in] ([E, out, in]) as the checkpoint stores them, gate|up fused along out
    assert moe["gate_up"].shape == (8, 48, 48) and moe["down"].shape == (8, 48, 24) and moe["router"].shape == (8, 48)
    assert moe["shared_gate_up"].shape == (40, 48) and moe["expert_bias"].shape == (8,)
    soft = load_model(_write(tmp_path / "s", SOFTMAX_TIED, _random_checkpoint(SOFTMAX_TIED)))
    assert soft.config.delete_token_id is None and soft.config.split_token_id is None
    assert soft.config.rotary_dim == 16 and not soft.config.use_qk_norm and "lm_head" not in soft.params


def test_save_hf_round_trip_and_bf16_orbax(tmp_path):
    """save_hf writes the LLaDA2 layout back (fused QKV, per-expert tensors); Orbax keeps routing leaves fp32."""
    path = _write(tmp_path / "m", BAILING, _random_checkpoint(BAILING))
    a = load_model(path)
    save_hf(a.params, a.config, tmp_path / "resaved")
    b = load_model(tmp_path / "resaved")
    assert a.config == b.config
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)  # head re-normalised
    convert_checkpoint(str(path), str(tmp_path / "orbax"), dtype="bfloat16")
    c, d = load_model(tmp_path / "orbax", dtype="bfloat16"), load_model(path, dtype="bfloat16")
    assert c.params["layers"][1]["moe"]["router"].dtype == jnp.float32
    assert c.params["layers"][1]["moe"]["expert_bias"].dtype == jnp.float32
    assert c.params["layers"][1]["moe"]["gate_up"].dtype == jnp.bfloat16
    for x, y in zip(jax.tree.leaves(c.params), jax.tree.leaves(d.params)):
        assert x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y))


# ----------------------------------------------------------------------------------------------
# Focused routing / head / rotary tests: each would fail under the wrong variant
# ----------------------------------------------------------------------------------------------

def _cfg(**kw):
    base = dict(vocab_size=10, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=1, num_kv_heads=1,
                head_dim=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=4, moe_layers=(0,),
                architecture="LLaDA2MoeModelLM", model_type="llada2_moe")
    base.update(kw)
    return ModelConfig(**base)


def _route(logits, cfg, bias=None):
    ids, w = route(jnp.asarray([logits], jnp.float32), cfg, None if bias is None else jnp.asarray(bias, jnp.float32))
    order = np.argsort(np.asarray(ids[0]))
    return list(np.asarray(ids[0])[order]), np.asarray(w[0])[order]


def test_group_limit_excludes_a_strong_expert_in_a_weak_group():
    # Groups of two: {0,1} {2,3} {4,5} {6,7}. Expert 2 is the 2nd best overall, but its group loses to {0,1}
    # ({0,1} has the best member, and the best pair): with topk_group=1 the token takes experts 0 and 1.
    logits = [3.0, 1.0, 2.5, -3.0, -2.0, -2.0, -2.0, -2.0]
    for bias in (None, np.zeros(8)):  # "max" (no bias) and "sum of top two" (with bias) group scores
        cfg = _cfg(moe_n_group=4, moe_topk_group=1, moe_expert_bias=bias is not None, moe_score_func="sigmoid")
        assert _route(logits, cfg, bias)[0] == [0, 1]
        assert _route(logits, cfg.replace(moe_n_group=1, moe_topk_group=1), bias)[0] == [0, 2]  # no limit


def test_group_score_is_top_two_sum_with_bias_and_max_without():
    # Group {0,1}: best single expert (2.0) but a weak pair; group {2,3}: strong pair (1.8 + 1.7).
    logits = [2.0, -4.0, 1.8, 1.7, -5.0, -5.0, -5.0, -5.0]
    cfg = _cfg(moe_n_group=4, moe_topk_group=1, moe_score_func="sigmoid")
    assert _route(logits, cfg)[0] == [0, 1]  # max: group {0,1}
    assert _route(logits, cfg.replace(moe_expert_bias=True), np.zeros(8))[0] == [2, 3]  # sum of top two: {2,3}


def test_expert_bias_selects_but_does_not_weight():
    logits = np.array([2.0, 1.5, 0.0, -1.0, -1.0, -1.0, -1.0, -1.0])
    bias = np.zeros(8)
    bias[3] = 1.0  # sigmoid(-1) + 1 = 1.27 > sigmoid(1.5) = 0.82: expert 3 replaces expert 1
    cfg = _cfg(moe_score_func="sigmoid", moe_expert_bias=True, norm_topk_prob=False)
    ids, w = _route(logits, cfg, bias)
    assert ids == [0, 3]
    sig = 1 / (1 + np.exp(-logits))
    np.testing.assert_allclose(w, [sig[0], sig[3]], rtol=1e-6)  # unbiased scores, not sig[3] + 1


def test_routed_scaling_factor_and_renormalisation():
    logits = np.array([2.0, 1.0, 0.5, -1.0, -1.0, -1.0, -1.0, -1.0])
    sig = 1 / (1 + np.exp(-logits))
    cfg = _cfg(moe_score_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5)
    ids, w = _route(logits, cfg)
    assert ids == [0, 1]
    np.testing.assert_allclose(w, 2.5 * sig[:2] / sig[:2].sum(), rtol=1e-6)
    np.testing.assert_allclose(w.sum(), 2.5, rtol=1e-6)
    _, w_raw = _route(logits, cfg.replace(norm_topk_prob=False))
    np.testing.assert_allclose(w_raw, 2.5 * sig[:2], rtol=1e-6)


def test_sigmoid_versus_softmax_scores():
    logits = np.array([2.0, 1.0, 0.5, -1.0, -1.0, -1.0, -1.0, -1.0])
    soft = np.exp(logits) / np.exp(logits).sum()
    sig = 1 / (1 + np.exp(-logits))
    _, w_soft = _route(logits, _cfg(moe_score_func="softmax"))
    _, w_sig = _route(logits, _cfg(moe_score_func="sigmoid"))
    np.testing.assert_allclose(w_soft, soft[:2], rtol=1e-6)
    np.testing.assert_allclose(w_sig, sig[:2], rtol=1e-6)


def test_shared_experts_added_unscaled_to_scaled_routed_output():
    cfg = _cfg(moe_score_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5, num_shared_experts=2,
               shared_expert_intermediate_size=3)
    keys = jax.random.split(jax.random.key(0), 7)
    moe = {"router": jax.random.normal(keys[0], (8, 8)),  # gate|up fused along out: [gate; up]
           "gate_up": 0.5 * jnp.concatenate([jax.random.normal(keys[1], (8, 4, 8)),
                                             jax.random.normal(keys[2], (8, 4, 8))], axis=1),
           "down": 0.5 * jax.random.normal(keys[3], (8, 8, 4)),
           "shared_gate_up": 0.5 * jnp.concatenate([jax.random.normal(keys[4], (6, 8)),
                                                    jax.random.normal(keys[5], (6, 8))]),
           "shared_down": 0.5 * jax.random.normal(keys[6], (8, 6))}
    x = jax.random.normal(jax.random.key(1), (5, 8))
    routed_only = {k: v for k, v in moe.items() if not k.startswith("shared_")}
    shared = swiglu(x, moe["shared_gate_up"], moe["shared_down"], cfg)
    mlp = jax.jit(moe_mlp, static_argnums=2)
    full = mlp(moe, x, cfg)
    np.testing.assert_allclose(np.asarray(full), np.asarray(mlp(routed_only, x, cfg) + shared), atol=1e-5)
    # The scale applies to the routed part only: halving it halves (full - shared).
    half = mlp(moe, x, cfg.replace(routed_scaling_factor=1.25))
    np.testing.assert_allclose(np.asarray(half - shared), 0.5 * np.asarray(full - shared), atol=1e-5)
    assert np.max(np.abs(np.asarray(shared))) > 0.1  # the shared part is not negligible


def test_norm_head_normalises_each_hidden_unit_over_the_vocabulary(tmp_path):
    tensors = _random_checkpoint(BAILING)
    head = tensors["lm_head.weight"].astype(np.float64)  # [V, H]
    on = load_model(_write(tmp_path / "on", BAILING, tensors))
    off = load_model(_write(tmp_path / "off", dict(BAILING, norm_head=False), tensors))
    np.testing.assert_allclose(np.asarray(off.params["lm_head"]), head, rtol=1e-6)  # [V, H], as stored
    expected = head / np.linalg.norm(head, axis=0, keepdims=True)
    np.testing.assert_allclose(np.asarray(on.params["lm_head"]), expected, rtol=1e-5, atol=1e-7)
    # Not rows: each vocabulary row is NOT unit length, each hidden column is.
    np.testing.assert_allclose(np.linalg.norm(np.asarray(on.params["lm_head"]), axis=0), 1.0, rtol=1e-5)
    # Tied + norm_head: SGLang skips the (absent) lm_head tensor, so nothing is normalised.
    tied = dict(BAILING, tie_word_embeddings=True)
    t2 = {k: v for k, v in tensors.items() if k != "lm_head.weight"}
    m = load_model(_write(tmp_path / "tied", tied, t2))
    assert "lm_head" not in m.params
    np.testing.assert_array_equal(np.asarray(m.params["embed"]), t2["model.word_embeddings.weight"])


def test_partial_rotary_rotates_only_the_first_dims_with_their_own_frequencies():
    cfg = _cfg(head_dim=16, partial_rotary_factor=0.5, rope_theta=10000.0)
    x = np.asarray(jax.random.normal(jax.random.key(3), (1, 5, 2, 16)))
    pos = np.arange(5)[None] + 3
    ours = np.asarray(rope(jnp.asarray(x), jnp.asarray(pos), cfg))
    ref = np.stack([_np_rope(x[0, s].astype(np.float64), pos[0, s], 8, 10000.0) for s in range(5)])
    np.testing.assert_allclose(ours[0], ref, atol=1e-5)
    np.testing.assert_array_equal(ours[..., 8:], x[..., 8:])  # pass-through half untouched
    full = np.asarray(rope(jnp.asarray(x), jnp.asarray(pos), cfg.replace(partial_rotary_factor=1.0)))
    assert np.max(np.abs(full[..., :8] - ours[..., :8])) > 1e-2  # frequencies over 8 dims, not 16


# ----------------------------------------------------------------------------------------------
# Loader details
# ----------------------------------------------------------------------------------------------

def test_chat_template_used_when_tokenizer_has_none(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["hello", "world", "<role>", "</role>", "<|role_end|>", "<|mask|>", "<|endoftext|>"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words + ["[UNK]"])}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, mask_token="<|mask|>", eos_token="<|endoftext|>",
                                   unk_token="[UNK]")
    hf = {k: v for k, v in BAILING.items() if k != "mask_token_id"}
    path = _write(tmp_path / "tok", hf, _random_checkpoint(BAILING))
    fast.save_pretrained(path)
    m = load_model(path)
    assert m.config.mask_token_id == words.index("<|mask|>")  # mask id from the tokenizer
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"},
                {"role": "user", "content": "hi"}]
    text = m.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<role>SYSTEM</role>detailed thinking off<|role_end|><role>HUMAN</role>hello<|role_end|>"
                    "<role>ASSISTANT</role>world<|role_end|><role>HUMAN</role>hi<|role_end|><role>ASSISTANT</role>")
    assert text == render_llada2_chat(messages)
    with_system = [{"role": "system", "content": "be brief"}] + messages[:1]
    assert m.tokenizer.apply_chat_template(with_system, tokenize=False, add_generation_prompt=True) == \
        "<role>SYSTEM</role>be brief<|role_end|><role>HUMAN</role>hello<|role_end|><role>ASSISTANT</role>"
    assert default_chat_template(m.config) == LLADA2_CHAT_TEMPLATE


def test_bailing_model_types_and_errors(tmp_path):
    tensors = _random_checkpoint(BAILING)
    for model_type in ("bailing_moe", "bailing_moe_v2"):
        cfg = load_model(_write(tmp_path / model_type, dict(BAILING, model_type=model_type), tensors)).config
        assert cfg.family == "llada2"
    with pytest.raises(ConfigError, match="score_function"):
        load_model(_write(tmp_path / "bad_score", dict(BAILING, score_function="relu"), tensors))
    with pytest.raises(ConfigError, match="n_group"):
        load_model(_write(tmp_path / "bad_group", dict(BAILING, n_group=3), tensors))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.(gate|up|down)_proj\.weight"):  # layer 0 now sparse
        load_model(_write(tmp_path / "bad_dense", dict(BAILING, first_k_dense_replace=0), tensors))
    broken = dict(tensors)
    broken.pop("model.layers.2.mlp.experts.6.down_proj.weight")
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.mlp\.experts\.6\.down_proj\.weight"):
        load_model(_write(tmp_path / "missing", BAILING, broken))
    bad_qkv = dict(tensors)
    bad_qkv["model.layers.1.attention.query_key_value.weight"] = np.zeros((10, 48), np.float32)
    with pytest.raises(CheckpointError, match=r"query_key_value\.weight.*\(128, 48\)"):
        load_model(_write(tmp_path / "bad_qkv", BAILING, bad_qkv))
    mlp_bias = dict(tensors)
    mlp_bias["model.layers.0.mlp.down_proj.bias"] = np.zeros(48, np.float32)
    with pytest.raises(CheckpointError, match="MLP bias"):
        load_model(_write(tmp_path / "mlp_bias", BAILING, mlp_bias))
