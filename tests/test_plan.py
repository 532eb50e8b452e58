"""``dllm-jax plan``: the per-device figures it computes on a virtual mesh, without allocating, are the bytes the
engine really holds per device when it shards a small model over 4 CPU devices (dense, heads that do not divide,
MoE with experts split); the presets plan at real size; the CLI prints the table."""

import collections
import jax
import numpy as np
import pytest

from dllm_jax import plan
from dllm_jax.config import ModelConfig
from dllm_jax.decode.algorithms import make_algorithm
from dllm_jax.engine.runner import ModelRunner
from dllm_jax.model.params import param_dtypes, param_shapes
from dllm_jax.sharding import make_mesh
from test_llada2 import BAILING

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
            head_dim=8, mask_token_id=63, block_size=4, eos_token_ids=(1,))
CONFIGS = {
    "even": ModelConfig(**TINY),  # heads divide TP 2; only the q heads divide TP 4
    "odd": ModelConfig(**dict(TINY, hidden_size=48, intermediate_size=72, num_heads=6, num_kv_heads=3,
                              tie_word_embeddings=True)),  # KV heads never divide; q heads divide 2 only
    "llada2": ModelConfig.from_hf_dict(BAILING),  # experts, shared experts, fp32 router and expert bias
}
NUM_PAGES = 6


def _max_device_bytes(tree) -> int:
    per_device = collections.Counter()
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            per_device[shard.device] += shard.data.nbytes
    return max(per_device.values())


@pytest.mark.parametrize("kind,tp,ep", [("even", 2, 1), ("even", 4, 1), ("odd", 4, 1), ("llada2", 2, 2),
                                        ("llada2", 1, 4)])
def test_plan_matches_the_engines_per_device_bytes(kind, tp, ep):
    """The engine's device side (ModelRunner: parameters and KV pool sharded as the engine does) on 4 CPU
    devices holds, per device, what the plan computed on a virtual mesh."""
    cfg = CONFIGS[kind]
    params = jax.tree.map(lambda shape, dtype: np.zeros(shape, dtype), param_shapes(cfg), param_dtypes(cfg, np.float32),
                          is_leaf=lambda x: isinstance(x, tuple))
    runner = ModelRunner(params, cfg, block_size=cfg.block_size or 4, mask_id=63, num_pages=NUM_PAGES, max_rows=1,
                         algorithm=make_algorithm("LowConfidence", {}, model_config=cfg), max_pages_per_row=8,
                         max_prefill_blocks=1, loop=False, mesh=make_mesh(tp, ep))
    p = plan.make_plan(kind, cfg, tp=tp, ep=ep, dtype="float32", block_size=runner.block_size)
    assert p.param_bytes_per_device == _max_device_bytes(runner.params)
    assert p.kv_page_bytes_per_device * NUM_PAGES == _max_device_bytes(runner.kv_pages)
    assert p.total_param_bytes == sum(x.nbytes for x in jax.tree.leaves(runner.params))


def test_page_arithmetic():
    p = plan.Plan(name="x", tp=1, ep=1, dtype="bfloat16", block_size=4, total_param_bytes=0,
                  param_bytes_per_device=10_000, kv_page_bytes_per_device=100, reserve_bytes=1_000)
    assert p.pages(11_000 + 10 * 100 + 99) == 10 and p.tokens(11_000 + 10 * 100) == 9 * 4
    assert p.pages(10_500) == 0 and p.tokens(10_500) == 0


def test_presets_at_real_size():
    """Published shapes: parameter counts, and the splits the RULES table gives them."""
    plans = {(name, q.tp, q.ep): q for name in plan.PRESETS for q in plan.plan_grid(*plan.load_config(name))}
    params = {name: plans[(name, 1, 1)].total_param_bytes / 2 for name in plan.PRESETS}  # bf16
    assert 1.70e9 < params["sdar-1.7b"] < 1.75e9 and 8.1e9 < params["sdar-8b"] < 8.3e9
    assert 30.4e9 < params["sdar-30b-a3b"] < 30.6e9 and 16.2e9 < params["llada2-mini"] < 16.3e9
    # SDAR-8B: 8 KV heads split up to TP 8; SDAR-30B-A3B: 4 KV heads replicate at TP 8
    assert plans[("sdar-8b", 8, 1)].kv_page_bytes_per_device * 8 == plans[("sdar-8b", 1, 1)].kv_page_bytes_per_device
    assert plans[("sdar-30b-a3b", 8, 1)].kv_page_bytes_per_device == \
        plans[("sdar-30b-a3b", 1, 1)].kv_page_bytes_per_device
    assert plans[("sdar-30b-a3b", 1, 8)].param_bytes_per_device < plans[("sdar-30b-a3b", 1, 1)].total_param_bytes / 4
    assert plans[("sdar-30b-a3b", 1, 1)].pages(80 * plan.GB) > 0  # 57 GiB fits one 80 GB device
    assert plans[("llada2-mini", 1, 1)].block_size == 32


def test_cli_prints_the_table(tmp_path, capsys):
    """``dllm-jax plan`` on a preset and on a bare config.json (no weights)."""
    import json

    from dllm_jax.cli import main

    config = tmp_path / "config.json"
    config.write_text(json.dumps(CONFIGS["even"].to_hf_dict()))
    assert main(["plan", "--preset", "sdar-8b", "--model-path", str(config), "--tp", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["model", "mesh", "params/dev"] and "reserve 4 GiB" in lines[-1]
    assert [line.split()[:2] for line in lines[1:3]] == [[tmp_path.name, "tp2"], ["sdar-8b", "tp2"]]

@pytest.mark.parametrize("tp,ep", [(2, 1), (4, 1), (2, 2), (1, 4)])
def test_plan_matches_diffusiongemma_per_device_bytes(tp, ep):
    """The same for DiffusionGemma's runner (a tied tiny config: 4 q heads, sliding layers 2 KV heads, full layers
    1, 4 experts): its parameters and both pools, per device, are what the plan computed."""
    from dllm_jax.decode.renoise import RenoiseConfig
    from dllm_jax.engine.renoise_runner import RenoiseRunner
    from dllm_jax.testing.diffusion_gemma import tiny_text_config

    cfg = ModelConfig.from_hf_dict(dict(architectures=["DiffusionGemmaForBlockDiffusion"],
                                        model_type="diffusion_gemma", canvas_length=4, tie_word_embeddings=True,
                                        text_config=tiny_text_config()))
    params = jax.tree.map(lambda shape, dtype: np.zeros(shape, dtype), param_shapes(cfg), param_dtypes(cfg, np.float32),
                          is_leaf=lambda x: isinstance(x, tuple))
    runner = RenoiseRunner(params, cfg, RenoiseConfig(), num_pages={"full": NUM_PAGES, "sliding": NUM_PAGES},
                           page_size=16, max_rows=1, max_pages_per_row=4, max_chunk=16, mesh=make_mesh(tp, ep))
    p = plan.make_plan("dg", cfg, tp=tp, ep=ep, dtype="float32", block_size=16)
    assert p.param_bytes_per_device == _max_device_bytes(runner.params)
    assert p.kv_page_bytes_per_device * NUM_PAGES == _max_device_bytes(runner.pool)
    assert p.total_param_bytes == sum(x.nbytes for x in jax.tree.leaves(runner.params))


def test_diffusiongemma_preset_and_its_window_kv():
    """DiffusionGemma-26B-A4B at real size: 25.2B parameters; KV per token of context, per device: full layers the
    raw k alone (2 heads x 512, 5 layers: 10 KiB in bf16), sliding layers bounded per request by their window."""
    name, cfg = plan.load_config("diffusiongemma-26b-a4b")
    p = plan.make_plan(name, cfg)
    assert 25.1e9 < p.total_param_bytes / 2 < 25.3e9
    w = plan.window_plan(p, cfg)
    assert w.full_token_bytes == 5 * 2 * 512 * 2 and w.per_layer_token_bytes == 25 * 2 * 8 * 256 * 2 + 5 * 2 * 2 * 512 * 2
    assert w.uniform_token_bytes == 30 * 2 * 8 * 512 * 2
    assert w.sliding_request_bytes == (-(-(1023 + 256) // 256) + 1) * 256 * 25 * 2 * 8 * 256 * 2
    assert w.requests(80) > 5 * w.requests(80, ours=False) and w.canvases(141) > 40 * w.canvases(141, ours=False)
    # TP 2 splits the full layers' 2 KV heads; TP 4 cannot, so they replicate (as the engine's sharding would)
    w2, w4 = (plan.window_plan(plan.make_plan(name, cfg, tp=n), cfg) for n in (2, 4))
    assert w2.full_token_bytes * 2 == w.full_token_bytes == w4.full_token_bytes
