"""MoE models (SDAR-MoE, LLaDA2) through the engine: greedy outputs identical across batch sizes, schedules and
with the experts split over 4 CPU devices (expert parallelism)."""

import jax
import pytest

from dllm_jax.config import ModelConfig
from dllm_jax.model.loader import save_hf
from dllm_jax.model.qwen3 import init_params

MASK = 63
COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
              head_dim=8, max_position_embeddings=256, mask_token_id=MASK, block_size=4, eos_token_ids=(1,),
              num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, moe_layers=(1,))
CONFIGS = {
    "sdar_moe": dict(architecture="SDARMoeForCausalLM", model_type="sdar_moe", norm_topk_prob=True),
    "llada2": dict(architecture="LLaDA2MoeModelLM", model_type="llada2_moe", moe_score_func="sigmoid",
                   moe_expert_bias=True, moe_n_group=4, moe_topk_group=2, routed_scaling_factor=2.0,
                   num_shared_experts=1, shared_expert_intermediate_size=16, partial_rotary_factor=0.5,
                   attention_bias=True, norm_topk_prob=True, delete_token_id=61, split_token_id=62),
}
PROMPTS = [[5, 6, 7, 8, 9, 10], [3, 4], [MASK, 2, MASK, 3], [11, 12, 13, 14, 15, 16, 17, 18, 19]]
PARAMS = {"max_new_tokens": 9, "ignore_eos": True}


@pytest.fixture(scope="module", params=["llada2", pytest.param("sdar_moe", marks=pytest.mark.slow)])
def moe_model(request, tmp_path_factory):
    cfg = ModelConfig(**COMMON, **CONFIGS[request.param])
    params = init_params(cfg, jax.random.PRNGKey(3), std=0.5)
    path = tmp_path_factory.mktemp(request.param) / "model"
    save_hf(params, cfg, str(path))
    return request.param, str(path)


def test_moe_outputs_identical_across_batching_schedules_and_expert_split(moe_model, make_engine):
    name, path = moe_model
    ref_engine = make_engine(path, max_running_requests=4, schedule="fdfo")
    reference = [o["output_ids"] for o in ref_engine.generate(input_ids=PROMPTS, sampling_params=PARAMS)]
    # One request at a time (batch 1), the synchronous schedule, and experts over 4 devices (EP = 4).
    single = make_engine(path, max_running_requests=1, schedule="sync")
    assert [single.generate(input_ids=p, sampling_params=PARAMS)["output_ids"] for p in PROMPTS] == reference
    ep = make_engine(path, max_running_requests=4, expert_parallel_size=4)
    gate = ep.runner.params["layers"][1]["moe"]["gate"]
    assert gate.sharding.spec[0] == "expert" and max(s.data.nbytes for s in gate.addressable_shards) * 4 == gate.nbytes
    assert [o["output_ids"] for o in ep.generate(input_ids=PROMPTS, sampling_params=PARAMS)] == reference
    assert all(MASK not in o for o in reference)


def test_llada2_indel_through_engine(tmp_path, make_engine):
    """LLaDA2 InDel checkpoints carry their delete / split ids in config.json: JointThresholdInDel picks them up."""
    cfg = ModelConfig(**COMMON, **CONFIGS["llada2"])
    save_hf(init_params(cfg, jax.random.PRNGKey(4), std=0.5), cfg, str(tmp_path / "m"))
    engine = make_engine(str(tmp_path / "m"), algorithm="JointThresholdInDel")
    assert engine.algorithm.config.delete_token_id == 61 and engine.algorithm.config.split_token_id == 62
    outs = engine.generate(input_ids=PROMPTS, sampling_params=PARAMS)
    for o in outs:
        assert len(o["output_ids"]) == 9 and not {MASK, 61, 62} & set(o["output_ids"])
