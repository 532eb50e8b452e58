"""``python -m dllm_jax.train.rl`` (GRPO with the engine's RL APIs): the trainer's differentiable likelihood is
``Engine.score``'s (chain and ELBO) on the same weights, and a two-step run pushes its weights into the running
engine (versions "1", "2"), writes rl.json with finite losses and leaks no KV page."""

from __future__ import annotations

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dllm_jax
from dllm_jax.assets import DEFAULT_MODEL_PATH
from dllm_jax.train import rl, rl_loss, tasks

from conftest import SHIPPED_KW

pytestmark = pytest.mark.skipif(not os.path.isfile(os.path.join(DEFAULT_MODEL_PATH, "model.safetensors")),
                                reason="shipped model not exported yet")


@pytest.fixture(scope="module")
def engine():
    e = dllm_jax.Engine(None, algorithm_config={"threshold": 0.9}, **SHIPPED_KW)
    yield e
    e.shutdown()


def _params(engine):
    from dllm_jax.model.loader import load_model

    return jax.tree.map(jnp.asarray, load_model(engine.model_path, dtype="float32").params)


def test_group_advantages():
    adv, keep = rl_loss.group_advantages(np.array([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]]))
    assert keep.tolist() == [True, False]
    np.testing.assert_allclose(adv[0], [1, -1, -1, 1], atol=1e-5)
    assert not adv[1].any()


@pytest.mark.parametrize("estimator", ["chain", "elbo"])
def test_trainer_likelihood_is_the_engines(engine, estimator):
    """Before an update the PPO ratio must be exactly 1: the trainer's estimate equals Engine.score's."""
    exs = tasks.training_examples(3, 0, 3, tasks=("times", "repeat", "count"))
    prompts = [engine.tokenize(engine.apply_chat_template(ex.prompt)) for ex in exs]
    completions = [engine.tokenize(ex.answer) + [engine.eos_token_ids[0]] for ex in exs]
    completions[1] = completions[1][:5]  # a completion ending inside the prompt's block
    want = [np.asarray(engine.score(input_ids=p, completions=[c], estimator=estimator, num_samples=3,
                                    seed=5)[0]["token_logprobs"]) for p, c in zip(prompts, completions)]
    got = rl_loss.sequence_logprobs(_params(engine), engine.config, prompts, completions, seq_len=160,
                                    rows_per_chunk=128, seqs_per_chunk=2, estimator=estimator, num_samples=3,
                                    seed=5)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)


def test_two_steps_update_the_running_engine(engine, tmp_path):
    before = engine.get_weights_by_name("layers.0.qkv", truncate_size=None)
    args = rl.parse_args(["--steps", "2", "--prompts-per-step", "2", "--group-size", "2", "--eval-prompts", "0",
                          "--ppo-epochs", "1",
                          "--max-new-tokens", "64", "--rows-per-chunk", "128", "--seqs-per-chunk", "2",
                          "--temperature", "5", "--lr", "1e-3", "--minibatches", "2", "--kl-coef", "0.05",
                          "--out", str(tmp_path)])
    # rewards 0, 1 in every group: every group carries signal (hot samples: its two rollouts differ)
    result = rl.run(args, engine=engine, reward_fn=lambda exs, texts: np.arange(len(texts)) % 2)

    steps = json.load(open(tmp_path / "rl.json"))["steps"]
    assert [s["step"] for s in steps] == [1, 2]
    assert [s["weight_version"] for s in steps] == ["default", "1"]  # what the rollouts of each step reported
    for s in steps:
        assert math.isfinite(s["loss"]) and math.isfinite(s["kl"])
        assert s["groups_kept"] == 2 and s["optimizer_steps"] == 2
        assert s["sequences_trained"] == s["rollouts_kept"] == 4
        assert all(s[k] >= 0 for k in rl.TIMINGS)
    assert steps[0]["first_max_abs_log_ratio"] < 1e-4  # the trainer's likelihood is the engine's
    assert engine.get_weight_version() == "2"
    after = engine.get_weights_by_name("layers.0.qkv", truncate_size=None)
    assert not np.allclose(before, after)
    np.testing.assert_array_equal(after, np.asarray(result["params"]["layers"][0]["qkv"]))
    out = engine.generate(input_ids=engine.tokenize(engine.apply_chat_template("Count up 10 steps from 3.")),
                          sampling_params={"max_new_tokens": 32})
    assert out["meta_info"]["weight_version"] == "2"
    assert not engine.scheduler.running and not engine.scheduler.waiting
    engine.scheduler.check_pages()
    # put the shipped weights back for the other tests of this module
    engine.update_weights_from_tensor(rl.named_params(_params(engine)), weight_version="default")


def test_paired_change_counts_flips_and_gives_the_exact_mcnemar_p_value():
    from dllm_jax.train.rl import paired_change

    assert paired_change([0, 0, 1, 1], [0, 0, 1, 1]) == {"improved": 0, "regressed": 0, "p_value": 1.0}
    d = paired_change([0] * 8 + [1] * 5, [1] * 8 + [1] * 4 + [0])  # 8 fixed, 1 broken
    assert (d["improved"], d["regressed"]) == (8, 1)
    assert abs(d["p_value"] - 2 * (1 + 9) / 2 ** 9) < 1e-12  # 2 * P(X <= 1), X ~ Bin(9, 1/2) = 0.0390625
    assert paired_change([0] * 3, [1] * 3)["p_value"] == 0.25


def test_report_pairs_the_held_out_prompts_before_and_after():
    ev = lambda step, correct, sampled: {  # noqa: E731
        "step": step, "accuracy": float(np.mean(correct)), "per_task": {"times": float(np.mean(correct))},
        "num_prompts": {"times": len(correct)}, "correct": {"times": correct},
        "target_sampled_reward": float(np.mean(sampled)), "target_sampled_per_prompt": sampled}
    result = {"wall_s": 60.0, "medians": {}, "steps": [], "config": {"tasks": ["times"], "temperature": 1.0,
                                                                      "eval_samples": 4},
              "evals": [ev(0, [0, 0, 1, 1], [0.0, 0.25, 1.0, 0.75]), ev(20, [1, 1, 1, 0], [0.5, 0.5, 1.0, 0.5])]}
    text = rl.report(result)
    assert "times, prompt by prompt: 2 fixed, 1 broken (exact McNemar p = 1)" in text
    assert "paired by prompt: +0.125 +- 0.161 (standard error over 4 prompts)" in text, text
