"""Fused q|k|v and gate|up leaves (dllm_jax/model/fused.py): the same model as the separate projections, on one
shard block and laid out for several (shard-major rows), and sharded over a TP mesh each shard computes its own
heads / MLP halves (a plain ``[q; k; v]`` concatenation split over shards would not)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dllm_jax.config import ModelConfig
from dllm_jax.model import qwen3
from dllm_jax.model.fused import fuse_segments, join_fused, segment_blocks, segment_of, split_fused
from dllm_jax.model.moe import grouped_experts, linear, route, router_logits
from dllm_jax.model.params import init_params, param_table

DENSE = ModelConfig(vocab_size=80, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=8, attention_bias=True, tie_word_embeddings=False)
MOE = DENSE.replace(num_layers=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, moe_layers=(1,),
                    num_shared_experts=1, shared_expert_intermediate_size=8, norm_topk_prob=True)


def _swiglu(x, gate, up, down):
    return linear(jax.nn.silu(linear(x, gate)) * linear(x, up), down)


def _reference(u, cfg, tokens, positions, mask):
    """The decoder written over the separate tensors (``split_fused``'s q / k / v, gate / up), as before fusion."""
    x = u["embed"][tokens]
    n, s = tokens.shape
    group = cfg.num_heads // cfg.num_kv_heads
    for layer in u["layers"]:
        h = qwen3.rms_norm(x, layer["attn_norm"], cfg.rms_norm_eps)
        q = linear(h, layer["q"]) + layer["q_bias"]
        k = linear(h, layer["k"]) + layer["k_bias"]
        v = (linear(h, layer["v"]) + layer["v_bias"]).reshape(n, s, cfg.num_kv_heads, cfg.head_dim)
        q = qwen3.rms_norm(q.reshape(n, s, cfg.num_heads, cfg.head_dim), layer["q_norm"], cfg.rms_norm_eps)
        k = qwen3.rms_norm(k.reshape(n, s, cfg.num_kv_heads, cfg.head_dim), layer["k_norm"], cfg.rms_norm_eps)
        q, k = qwen3.rope(q, positions, cfg), qwen3.rope(k, positions, cfg)
        qg = q.reshape(n, s, cfg.num_kv_heads, group, cfg.head_dim)
        scores = jnp.einsum("ntkgd,nskd->nkgts", qg, k) * cfg.head_dim ** -0.5
        probs = jax.nn.softmax(jnp.where(mask[:, None, None], scores, -jnp.inf), axis=-1)
        attn = jnp.einsum("nkgts,nskd->ntkgd", probs, v).reshape(n, s, cfg.q_size)
        x = x + linear(attn, layer["o"])
        h = qwen3.rms_norm(x, layer["mlp_norm"], cfg.rms_norm_eps)
        if "moe" not in layer:
            x = x + _swiglu(h, layer["gate"], layer["up"], layer["down"])
            continue
        moe, flat = layer["moe"], h.reshape(-1, cfg.hidden_size)
        ids, w = route(router_logits(moe, flat, cfg), cfg, moe.get("expert_bias"))
        per = grouped_experts({"gate": moe["gate"], "up": moe["up"], "down": moe["down"]}, flat, ids)
        out = jnp.einsum("nkh,nk->nh", per, w) + _swiglu(flat, moe["shared_gate"], moe["shared_up"],
                                                         moe["shared_down"])
        x = x + out.reshape(x.shape)
    return qwen3.logits_from_hidden(u, qwen3.rms_norm(x, u["final_norm"], cfg.rms_norm_eps))


def _inputs(cfg, n=2, s=8):
    tokens = jax.random.randint(jax.random.key(3), (n, s), 0, cfg.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(s), (n, s))
    mask = jnp.broadcast_to(jnp.asarray(qwen3.block_causal_mask(s, 4)), (n, s, s))
    return tokens, positions, mask


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("cfg", [DENSE, MOE], ids=["dense", "moe"])
def test_fused_logits_equal_the_separate_projections(cfg, tp):
    """float32: one matmul over the fused leaf gives the logits of three / two over the separate tensors (the same
    dot products), whatever the shard blocks the rows are laid out in."""
    cfg = cfg.replace(tp_shards=tp)
    params = init_params(cfg, jax.random.key(0), std=0.2)
    params["layers"][0]["qkv_bias"] = 0.1 * jax.random.normal(jax.random.key(1), params["layers"][0]["qkv_bias"].shape)
    tokens, positions, mask = _inputs(cfg)
    ours = jax.jit(qwen3.forward_full, static_argnums=1)(params, cfg, tokens, positions, mask)
    ref = jax.jit(_reference, static_argnums=1)(split_fused(cfg, params), cfg, tokens, positions, mask)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(ref), rtol=1e-5, atol=1e-5)
    assert float(jnp.std(ref)) > 0.1  # logits that are not all alike


def test_rows_are_shard_major():
    """Laid out for ``t`` shards, block ``s`` of the fused rows is ``[q_s; k_s; v_s]`` (``[gate_s; up_s]``)."""
    cfg = DENSE.replace(tp_shards=2)
    table = param_table(cfg)
    qkv, gate_up = table.leaf(("layers", 0, "qkv")), table.leaf(("layers", 0, "gate_up"))
    Q, KV, I = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    assert segment_blocks(cfg, qkv, 0) == ((0, 0, Q // 2), ((Q + 2 * KV) // 2, Q // 2, Q // 2))
    assert segment_blocks(cfg, qkv, 2) == ((Q // 2 + KV // 2, 0, KV // 2), ((Q + 2 * KV) // 2 + Q // 2 + KV // 2,
                                                                            KV // 2, KV // 2))
    q, k, v = (np.full((n, 3), c, np.float32) + np.arange(n)[:, None] for n, c in ((Q, 0), (KV, 100), (KV, 200)))
    fused = fuse_segments(cfg, qkv, [q, k, v])
    half = fused.shape[0] // 2
    for s in range(2):
        block = fused[s * half:(s + 1) * half]
        np.testing.assert_array_equal(block, np.concatenate([q[s * Q // 2:(s + 1) * Q // 2],
                                                             k[s * KV // 2:(s + 1) * KV // 2],
                                                             v[s * KV // 2:(s + 1) * KV // 2]]))
    for j, a in enumerate((q, k, v)):
        np.testing.assert_array_equal(segment_of(cfg, qkv, fused, j), a)
    g, u = np.zeros((I, 3)), np.ones((I, 3))
    np.testing.assert_array_equal(fuse_segments(cfg, gate_up, [g, u])[:I // 2], g[:I // 2])
    # one block (TP 1, or heads that do not divide): the plain concatenation, the published fused layout
    one = DENSE.replace(tp_shards=4)  # 2 KV heads over 4: q|k|v on one block
    np.testing.assert_array_equal(fuse_segments(one, qkv, [q, k, v]), np.concatenate([q, k, v]))


@pytest.mark.parametrize("cfg", [DENSE, MOE], ids=["dense", "moe"])
def test_sharded_fused_leaves_compute_the_same_logits(cfg):
    """Over a TP 2 mesh (the fused leaves split on their out axis, each shard one block): the logits of one device.
    The same rows in the plain concatenation's order would give shard 0 all of q and none of v: a different model."""
    from dllm_jax.sharding import make_mesh, shard_params

    assert len(jax.devices()) >= 2
    cfg2 = cfg.replace(tp_shards=2)
    params = init_params(cfg, jax.random.key(0), std=0.2)
    tokens, positions, mask = _inputs(cfg)
    want = jax.jit(qwen3.forward_full, static_argnums=1)(params, cfg, tokens, positions, mask)
    mesh = make_mesh(2)
    sharded = shard_params(join_fused(cfg2, split_fused(cfg, params)), cfg2, mesh)
    layer = sharded["layers"][0]
    assert layer["qkv"].sharding.spec[0] == "tp" and layer["gate_up"].sharding.spec[0] == "tp"
    assert max(s.data.shape[0] for s in layer["qkv"].addressable_shards) * 2 == layer["qkv"].shape[0]
    got = jax.jit(qwen3.forward_full, static_argnums=1)(sharded, cfg2, tokens, positions, mask)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    # the plain order read as shard-major is another model (what a naive fused layout would compute)
    wrong = jax.jit(qwen3.forward_full, static_argnums=1)(params, cfg2, tokens, positions, mask)
    assert not np.allclose(np.asarray(wrong), np.asarray(want), atol=1e-3)


def test_tp_engine_reads_and_updates_fused_rows_by_checkpoint_name(tmp_path):
    """LLaDA2 on TP 2 (q|k|v and gate|up in two shard blocks): ``query_key_value`` and one expert's ``up_proj`` read
    back as the checkpoint's tensors, are written into their rows by name (the other rows and every sharding kept),
    and the fused path reads the leaf in one block's order; TP 2 decodes as TP 1."""
    import dllm_jax
    from dllm_jax.testing import published

    pub = published.write_published(str(tmp_path / "m"), "llada2", std=0.5, embed_std=0.5, keep_tensors=True)
    qkv, up, gate = ("model.layers.0.attention.query_key_value.weight",
                     "model.layers.1.mlp.experts.3.up_proj.weight", "model.layers.1.mlp.experts.3.gate_proj.weight")
    prompts, sp = [[5, 6, 7, 8, 9], [11, 12]], {"max_new_tokens": 8, "ignore_eos": True, "temperature": 0}
    outs = {}
    for tp in (1, 2):
        engine = dllm_jax.Engine(pub.path, tensor_parallel_size=tp, max_running_requests=4, context_length=128,
                                 warmup=False)
        try:
            outs[tp] = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=sp)]
            if tp == 1:
                continue
            assert engine.runner.params["layers"][0]["qkv"].sharding.spec[0] == "tp"
            np.testing.assert_array_equal(engine.get_weights_by_name(qkv, None), pub.tensors[qkv].astype(np.float32))
            shardings = [x.sharding for x in jax.tree.leaves(engine.runner.params)]
            new = np.random.default_rng(0).standard_normal(pub.tensors[qkv].shape).astype(np.float32)
            engine.update_weights_from_tensor({qkv: new, up: np.ones(pub.tensors[up].shape, np.float32)})
            assert [x.sharding for x in jax.tree.leaves(engine.runner.params)] == shardings
            np.testing.assert_array_equal(engine.get_weights_by_name(qkv, None), new)
            np.testing.assert_array_equal(engine.get_weights_by_name("layers.0.qkv", None), new)
            assert np.all(engine.get_weights_by_name(up, None) == 1)
            np.testing.assert_array_equal(engine.get_weights_by_name(gate, None), pub.tensors[gate].astype(np.float32))
        finally:
            engine.shutdown()
    assert outs[1] == outs[2]
