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
