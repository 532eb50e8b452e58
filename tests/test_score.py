"""Engine.score (dllm_jax/decode/likelihood.py): the chain estimator against a float64 run of the same rows; the
correct answer of the shipped model's tasks scores highest against near-miss wrong ones under both estimators;
HTTP /score; errors name the field."""

from __future__ import annotations

import os

import numpy as np
import pytest

import dllm_jax
from dllm_jax.assets import DEFAULT_MODEL_PATH
from dllm_jax.decode import likelihood
from dllm_jax.train import tasks

from conftest import SHIPPED_KW

pytestmark = pytest.mark.skipif(not os.path.isfile(os.path.join(DEFAULT_MODEL_PATH, "model.safetensors")),
                                reason="shipped model not exported yet")


@pytest.fixture(scope="module")
def engine():
    e = dllm_jax.Engine(None, **SHIPPED_KW)
    yield e
    e.shutdown()


def test_chain_equals_a_float64_run(engine):
    ex = tasks.heldout_set(4)[0]
    prompt = engine.tokenize(engine.apply_chat_template(ex.prompt))
    completion = engine.tokenize(ex.answer)
    got = engine.score(input_ids=prompt, completions=[completion])[0]["token_logprobs"]
    from oracle import _transformers_logits  # transformers' Qwen3 in float64 under the block-causal mask

    logits_fn, _ = _transformers_logits(DEFAULT_MODEL_PATH)
    rows, targets, at = likelihood.chain_rows(engine.config, prompt, completion)  # (the rows score() runs)
    want = []
    for row, target, j in zip(rows, targets, at):
        logits = np.asarray(logits_fn(row.tolist(), engine.config.block_size), np.float64)[j]
        logits[engine.config.mask_token_id] = -np.inf
        top = logits.max()
        want.append(logits[target] - top - np.log(np.exp(logits - top).sum()))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert np.isclose(sum(got), sum(want), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("estimator", ["chain", "elbo"])
def test_the_correct_answer_scores_highest(engine, estimator):
    rng = np.random.default_rng(0)
    examples = tasks.heldout_set(12)[:12]
    wins = 0
    for ex in examples:
        answers = [ex.answer] + tasks.near_misses(ex.answer, rng, 2)
        scores = engine.score(engine.apply_chat_template(ex.prompt), answers, estimator=estimator, num_samples=8,
                              seed=1)
        wins += int(np.argmax([s["logprob"] for s in scores]) == 0)
    assert wins >= 0.95 * len(examples), f"{wins}/{len(examples)}"


def test_errors_and_http(engine):
    with pytest.raises(ValueError, match="estimator"):
        engine.score("hi", ["x"], estimator="mc")
    with pytest.raises(ValueError, match="completions"):
        engine.score("hi", [])
    with pytest.raises(ValueError, match=r"completions\[0\]"):
        engine.score("hi", [[10 ** 9]])
    from fastapi.testclient import TestClient

    from serve import ServerSettings, create_app

    app = create_app(engine, ServerSettings(), own_engine=False)
    with TestClient(app, base_url="http://localhost") as client:
        r = client.post("/score", json={"text": "Count up 3 steps from 5.", "completions": ["Answer: 1 5", "no"]})
        assert r.status_code == 200, r.text
        body = r.json()
        assert len(body) == 2 and body[0]["num_tokens"] == len(body[0]["token_logprobs"])
        assert client.post("/score", json={"text": "x", "completions": ["a"], "estimator": "?"}).status_code == 400


def test_batch_forms_and_fields(engine):
    """The batch forms generate takes (issue 49: ``input_ids=[[...]]`` failed with "completions[0]: must be a list
    of integer token ids"): one list of results per prompt, each as the prompt alone scores; errors name the
    prompt's index, and over HTTP the body's own field (``text``, not ``prompt``)."""
    a, b = engine.tokenize("Count up 3 steps from 5."), engine.tokenize("Repeat 8 times: red owl")
    completions = ["Answer: 1 5", [5, 6, 7]]
    singles = [engine.score(input_ids=ids, completions=completions) for ids in (a, b)]
    assert engine.score(input_ids=[a, b], completions=completions) == singles
    assert engine.score(input_ids=[a], completions=completions) == singles[:1]
    assert engine.score(["Count up 3 steps from 5.", "Repeat 8 times: red owl"], completions) == singles
    with pytest.raises(ValueError, match=r"^input_ids\[1\]\[0\]: token id"):
        engine.score(input_ids=[a, [10 ** 9]], completions=completions)
    fits = [5] * (engine.context_length - engine.block_size - 1)  # alone, but not with 40 more tokens
    engine.score(input_ids=[fits], completions=[[6]])
    with pytest.raises(ValueError, match=r"^completions\[0\]: "):
        engine.score(input_ids=[a, fits], completions=[[6] * 40])
    with pytest.raises(ValueError, match=r"^prompt: must be a string"):
        engine.score([], completions)
    from fastapi.testclient import TestClient

    from serve import ServerSettings, create_app

    app = create_app(engine, ServerSettings(), own_engine=False)
    with TestClient(app, base_url="http://localhost") as client:
        r = client.post("/score", json={"input_ids": [a, b], "completions": completions})
        assert r.status_code == 200 and r.json() == singles, r.text
        r = client.post("/score", json={"completions": ["a"]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "text", r.text
        r = client.post("/score", json={"text": ["ok", ""], "completions": ["a"]})
        assert r.status_code == 200, r.text  # (an empty prompt scores the completion unconditioned)
