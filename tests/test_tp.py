"""Tensor parallelism over 4 virtual CPU devices: same tokens as one device, really sharded, no full logits."""

import re

import jax
import numpy as np
import pytest

from conftest import ENGINE_KW, build_tiny_model
from oracle import Oracle

PROMPTS = [[5, 6, 7, 8, 9, 10], [3, 4], [11, 12, 13, 14, 15, 16, 17, 18], [63, 2, 63, 3]]
PARAMS = {"max_new_tokens": 10, "ignore_eos": True}
VOCAB = 96  # distinct from every other dimension of the model, so HLO shapes with it are logits


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    return {
        # heads divide TP 2 (4 q / 2 kv), and only the q heads divide TP 4 (KV stays replicated there)
        "even": build_tiny_model(root / "even", vocab=VOCAB),
        # 6 q heads / 3 kv heads: KV never divides 2 or 4; q divides 2 only; tied embeddings
        "odd": _odd_model(root / "odd"),
    }


def _odd_model(path):
    from dllm_jax.config import ModelConfig
    from dllm_jax.model.converted import save_hf
    from dllm_jax.model.params import init_params

    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=72, num_layers=2, num_heads=6,
                      num_kv_heads=3, head_dim=8, max_position_embeddings=256, mask_token_id=63, block_size=4,
                      eos_token_ids=(1,), tie_word_embeddings=True)
    save_hf(init_params(cfg, jax.random.PRNGKey(1), std=0.5), cfg, str(path))
    return str(path)


@pytest.mark.parametrize("kind,schedule", [
    ("even", "fdfo"), ("odd", "sync"),
    pytest.param("even", "sync", marks=pytest.mark.slow), pytest.param("odd", "fdfo", marks=pytest.mark.slow)])
def test_tp_decides_as_the_reference(models, make_engine, kind, schedule):
    """TP 2 / 4 decide as the float64 reference (TP 1 is every other engine test), so a sharded run may differ
    from a single-device one only after a near-tie (a sharded reduction rounds differently)."""
    assert len(jax.devices()) >= 4, "conftest sets four CPU devices"
    oracle = Oracle(models[kind])
    for tp in (2, 4):
        engine = make_engine(models[kind], tensor_parallel_size=tp, schedule=schedule, **ENGINE_KW)
        outs = [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=PARAMS)]
        oracle.verify_all(PROMPTS, outs, PARAMS["max_new_tokens"])


def _per_device_bytes(x):
    return max(s.data.nbytes for s in x.addressable_shards)


def test_parameters_and_kv_pages_are_sharded(models, make_engine):
    engine = make_engine(models["even"], tensor_parallel_size=2, **ENGINE_KW)
    params = engine.runner.params
    layer = params["layers"][0]
    assert engine.config.tp_shards == 2  # the fused leaves are laid out for it: shard s holds [q_s; k_s; v_s]
    for name in ("qkv", "gate_up"):  # [out, in]: split on out (by shard block: whole heads, MLP halves)
        assert _per_device_bytes(layer[name]) * 2 == layer[name].nbytes, name
        assert layer[name].sharding.spec[0] == "tp", name
    for name in ("o", "down"):  # [out, in]: split on in
        assert layer[name].sharding.spec[1] == "tp", name
    assert _per_device_bytes(params["embed"]) * 2 == params["embed"].nbytes
    assert _per_device_bytes(params["lm_head"]) * 2 == params["lm_head"].nbytes
    k_pool = engine.runner.kv_pages[0][0]
    assert k_pool.sharding.spec[0] == "tp" and _per_device_bytes(k_pool) * 2 == k_pool.nbytes
    engine.generate(input_ids=PROMPTS, sampling_params=PARAMS)
    k_pool = engine.runner.kv_pages[0][0]  # still sharded after donated steps
    assert k_pool.sharding.spec[0] == "tp" and _per_device_bytes(k_pool) * 2 == k_pool.nbytes


def test_replicated_when_heads_do_not_divide(models, make_engine):
    engine = make_engine(models["odd"], tensor_parallel_size=4, **ENGINE_KW)
    layer = engine.runner.params["layers"][0]
    # 3 KV heads over 4 devices: q|k|v is laid out on one block and replicated
    assert layer["qkv"].sharding.spec == jax.sharding.PartitionSpec(None, None)
    assert layer["gate_up"].sharding.spec[0] == "tp"  # the MLP still splits (72 / 4)


def test_full_logits_never_materialised(models, make_engine):
    """Compile a TP=4 denoise step and check its HLO holds no [positions, full vocab] buffer."""
    from dllm_jax.engine.calls import DecodeRow

    engine = make_engine(models["even"], tensor_parallel_size=4, **ENGINE_KW)
    runner = engine.runner
    rows = runner.row_buckets[0]
    captured = {}
    B = runner.block_size
    import dllm_jax.engine.runner as runner_mod

    real = runner_mod.denoise_packed

    def spy(params, kv_pages, packed, *, spec, layout):
        captured["hlo"] = real.lower(params, kv_pages, packed, spec=spec, layout=layout).compile().as_text()
        return real(params, kv_pages, packed, spec=spec, layout=layout)

    runner_mod.denoise_packed = spy
    try:
        runner.denoise([DecodeRow(tokens=np.full(B, 63, np.int32), immutable=np.zeros(B, bool), prefix_pages=[],
                                  write_page=0, steps_taken=0, temperature=0.0, top_k=-1, top_p=1.0, seed=0,
                                  rng_step=0, algo_state=None)] * rows)
    finally:
        runner_mod.denoise_packed = real
    hlo = captured["hlo"]
    positions = rows * B
    assert re.search(rf"f32\[{positions},{VOCAB // 4}\]", hlo), "expected per-shard logits [N, V/4]"
    assert not re.search(rf"\[{positions},{VOCAB}\]", hlo), "a full [N, V] buffer exists on one device"
