"""MoE models (LLaDA2, SDAR-MoE) through the engine: batch sizes, schedules and experts split over 4 CPU devices
(expert parallelism) all decide as the float64 reference (tests/oracle.py) does."""

import jax
import numpy as np
import pytest

from conftest import ENGINE_KW
from dllm_jax.config import ModelConfig
from dllm_jax.model.converted import save_hf
from dllm_jax.model.params import init_params
from oracle import Oracle

PARAMS = {"max_new_tokens": 9, "ignore_eos": True}


def _llada2(root):
    """A LLaDA2 checkpoint with every routing variant on (test_llada2.BAILING), and its float64 NumPy forward."""
    from test_llada2 import BAILING, _np_forward, _random_checkpoint, _write

    hf = dict(BAILING, max_position_embeddings=256)
    tensors = _random_checkpoint(hf, seed=3)
    path = str(_write(root / "llada2", hf, tensors))
    oracle = Oracle(logits_fn=lambda tokens, block: _np_forward(tensors, hf, np.asarray(tokens), block),
                    block_size=4, mask_id=hf["mask_token_id"])
    return path, oracle, hf["mask_token_id"]


def _sdar_moe(root):
    mask = 63
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, max_position_embeddings=256, mask_token_id=mask, block_size=4,
                      eos_token_ids=(1,), num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                      moe_layers=(1,), architecture="SDARMoeForCausalLM", model_type="sdar_moe",
                      norm_topk_prob=True)
    path = str(root / "sdar_moe")
    save_hf(init_params(cfg, jax.random.PRNGKey(3), std=0.5), cfg, path)
    return path, Oracle(path), mask


@pytest.fixture(scope="module", params=["llada2", pytest.param("sdar_moe", marks=pytest.mark.slow)])
def moe_model(request, tmp_path_factory):
    return {"llada2": _llada2, "sdar_moe": _sdar_moe}[request.param](tmp_path_factory.mktemp(request.param))


def test_moe_decides_as_the_reference_batched_and_with_experts_split(moe_model, make_engine):
    path, oracle, mask = moe_model
    prompts = [[5, 6, 7, 8, 9, 10], [3, 4], [mask, 2, mask, 3], [11, 12, 13, 14, 15, 16, 17, 18, 19]]
    kw = dict(ENGINE_KW, block_size=4)
    batched = make_engine(path, schedule="fdfo", **kw)
    outs = [o["output_ids"] for o in batched.generate(input_ids=prompts, sampling_params=PARAMS)]
    oracle.verify_all(prompts, outs, 9)
    assert all(mask not in o for o in outs)
    # Experts over 4 devices (EP = 4): really split, same decisions.
    ep = make_engine(path, expert_parallel_size=4, **kw)
    moe_layer = next(layer for layer in ep.runner.params["layers"] if "moe" in layer)
    gate = moe_layer["moe"]["gate_up"]
    assert gate.sharding.spec[0] == "expert" and max(s.data.nbytes for s in gate.addressable_shards) * 4 == gate.nbytes
    oracle.verify_all(prompts, [o["output_ids"] for o in ep.generate(input_ids=prompts, sampling_params=PARAMS)], 9)


@pytest.mark.slow  # the schedule and batch size do not touch the MoE layer; the batched FDFO run above checks it
def test_moe_one_request_at_a_time_in_the_synchronous_schedule(moe_model, make_engine):
    path, oracle, _ = moe_model
    prompts = [[5, 6, 7, 8, 9, 10], [3, 4]]
    single = make_engine(path, schedule="sync", **dict(ENGINE_KW, block_size=4, max_running_requests=1))
    oracle.verify_all(prompts, [single.generate(input_ids=p, sampling_params=PARAMS)["output_ids"] for p in prompts], 9)


def test_llada2_indel_through_engine(tmp_path, make_engine):
    """LLaDA2 InDel checkpoints carry their delete / split ids in config.json: JointThresholdInDel picks them up."""
    from test_llada2 import BAILING, _random_checkpoint, _write

    hf = dict(BAILING, max_position_embeddings=256)
    path = str(_write(tmp_path / "m", hf, _random_checkpoint(hf, seed=4)))
    engine = make_engine(path, algorithm="JointThresholdInDel", block_size=4, **ENGINE_KW)
    cfg = engine.algorithm.config
    assert (cfg.delete_token_id, cfg.split_token_id) == (hf["delete_token_id"], hf["split_token_id"])
    prompts = [[5, 6, 7, 8, 9, 10], [3, 4], [11, 12, 13, 14, 15, 16, 17, 18, 19]]
    banned = {hf["mask_token_id"], hf["delete_token_id"], hf["split_token_id"]}
    for o in engine.generate(input_ids=prompts, sampling_params=PARAMS):
        assert len(o["output_ids"]) == 9 and not banned & set(o["output_ids"])
