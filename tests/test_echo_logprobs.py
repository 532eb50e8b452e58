"""``/v1/completions`` with ``echo`` + ``logprobs``: the prompt tokens' log-probabilities (the chain estimator,
``Engine.prompt_logprobs``) ahead of the generated tokens', as lm-eval's ``local-completions`` loglikelihood requests
read them (``token_logprobs[ctxlen:-1]``, ``is_greedy`` from ``top_logprobs``); ``max_tokens: 0`` scoring; the
refusals naming their field. In-process app (``TestClient``) over the shipped model."""

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
    e = dllm_jax.Engine(None, warmup=False, **SHIPPED_KW)
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def client(engine):
    from fastapi.testclient import TestClient

    from serve import ServerSettings, create_app

    app = create_app(engine, ServerSettings(), own_engine=False)
    with TestClient(app, base_url="http://localhost") as c:
        yield c


@pytest.fixture(scope="module")
def example(engine):
    """A held-out prompt of the shipped model's tasks, chat-templated, and its correct answer (token ids)."""
    ex = tasks.heldout_set(4)[0]
    context = engine.tokenize(engine.apply_chat_template(ex.prompt))
    return context, engine.tokenize(ex.answer)


def _is_greedy(token_logprobs, top_logprobs) -> bool:
    """lm-eval's ``local-completions`` rule: every token's logprob is the maximum of its ``top_logprobs``."""
    return all(lp == max(top.values()) for lp, top in zip(token_logprobs, top_logprobs))


def test_echo_logprobs_are_the_chain_estimate(engine, client, example):
    context, answer = example
    ids = context + answer
    r = client.post("/v1/completions", json={"prompt": ids, "echo": True, "logprobs": 2, "max_tokens": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    (choice,) = body["choices"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert choice["text"] == engine.tokenizer.decode(ids, skip_special_tokens=False) == "".join(lp["tokens"])
    assert lp["text_offset"] == list(np.cumsum([0] + [len(t) for t in lp["tokens"][:-1]]))
    assert choice["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == len(ids) and body["usage"]["completion_tokens"] == 0
    # the same figures as Engine.score for the same split (whatever the split: a chain row depends on j alone)
    want = engine.score(input_ids=context, completions=[answer])[0]["token_logprobs"]
    np.testing.assert_allclose(lp["token_logprobs"][len(context):], want, rtol=0, atol=1e-5)
    want_all = engine.score(input_ids=ids[:1], completions=[ids[1:]])[0]["token_logprobs"]
    np.testing.assert_allclose(lp["token_logprobs"][1:], want_all, rtol=0, atol=1e-5)
    # each top dict: the 2 most likely tokens, plus the prompt's own token when it is not among them
    assert all(2 <= len(d) <= 3 and d[t] == v for d, t, v in zip(lp["top_logprobs"][1:], lp["tokens"][1:],
                                                                  lp["token_logprobs"][1:]))
    # the shipped model's correct answer is (nearly) its greedy continuation, token by token
    answer_lps, answer_tops = lp["token_logprobs"][len(context):], lp["top_logprobs"][len(context):]
    greedy = [v == max(d.values()) for v, d in zip(answer_lps, answer_tops)]
    assert sum(greedy) >= 0.9 * len(greedy), greedy
    # the engine's own entry point: [logprob | None, token_id] and the alternatives [logprob, id], mask id excluded
    direct = engine.prompt_logprobs(ids, top_k=3)
    assert direct["input_token_logprobs"][0] == [None, ids[0]] and direct["input_top_logprobs"][0] is None
    assert [t for _, t in direct["input_token_logprobs"]] == ids
    tops = direct["input_top_logprobs"][1:]
    assert all(len(t) == 3 and engine.mask_token_id not in [i for _, i in t] for t in tops)
    assert all(t[0][0] >= t[1][0] >= t[2][0] for t in tops)


def test_lm_eval_loglikelihood_request(engine, client, example):
    """What lm-eval 0.4's ``local-completions`` sends for a loglikelihood request (token ids, echo, logprobs 1,
    max_tokens 1) and how it reads the answer: the continuation's sum and is_greedy, for the right answer and a
    near miss."""
    context, answer = example
    wrong = engine.tokenize(tasks.heldout_set(4)[0].answer.replace(" 73 ", " 74 ", 1))
    assert wrong != answer
    results = []
    for continuation in (answer, wrong):
        payload = {"model": None, "prompt": [context + continuation], "temperature": 0, "max_tokens": 1,
                   "logprobs": 1, "seed": 1234, "echo": True}
        r = client.post("/v1/completions", json=payload)
        assert r.status_code == 200, r.text
        (choice,) = r.json()["choices"]
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(context) + len(continuation) + 1  # the prompt, one generated token
        ctxlen = len(context)
        total = sum(lp["token_logprobs"][ctxlen:-1])
        want = engine.score(input_ids=context, completions=[continuation])[0]["logprob"]
        assert abs(total - want) < 1e-4
        results.append((total, _is_greedy(lp["token_logprobs"][ctxlen:-1], lp["top_logprobs"][ctxlen:-1])))
    assert results[0][0] > results[1][0]  # the right answer scores higher
    assert results[1][1] is False  # a near miss is not the greedy continuation


def _lm_eval_encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval 0.4's ``TemplateLM._encode_pair`` (``lm_eval/api/model.py``), restated: a context's trailing
    whitespace moves to the continuation, and the continuation's ids are the whole's after the context's."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces > 0:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = tok.encode(context + continuation, add_special_tokens=False)
    context_enc = tok.encode(context, add_special_tokens=False)
    return context_enc, whole[len(context_enc):]


def test_lm_eval_task_scores_the_choices_alone(engine, client):
    """bench/lm_eval_task as lm-eval sends it (the yaml's fields, its delimiter, lm-eval's pairing): each choice's
    figure is its log-likelihood after the prompt, as ``Engine.score`` gives it, up to the shared ``Answer:``
    tokens (about 1e-5 nats here). Issue 49: with the prompt (ending in the template's newline) as the context,
    lm-eval moved that newline into every continuation and scored it too: -12 to -18 nats more on each choice."""
    import json

    import yaml

    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "lm_eval_task")
    with open(os.path.join(here, "dllm_mc.yaml")) as f:
        task = yaml.safe_load(f)
    with open(os.path.join(here, "dllm_mc.jsonl")) as f:
        docs = [json.loads(line) for line in f][:3]
    tok = engine.tokenizer
    for doc in docs:
        context = doc[task["doc_to_text"]]
        assert context == context.rstrip(), "lm-eval would move the context's trailing whitespace"
        want = [s["logprob"] for s in engine.score(doc["prompt"], doc["choices"])]
        got = []
        for choice in doc[task["doc_to_choice"]]:
            context_enc, continuation_enc = _lm_eval_encode_pair(tok, context, task["target_delimiter"] + choice)
            payload = {"model": None, "prompt": [context_enc + continuation_enc], "temperature": 0, "max_tokens": 1,
                       "logprobs": 1, "seed": 1234, "echo": True}
            r = client.post("/v1/completions", json=payload)
            assert r.status_code == 200, r.text
            got.append(sum(r.json()["choices"][0]["logprobs"]["token_logprobs"][len(context_enc):-1]))
        np.testing.assert_allclose(got, want, atol=1e-2)
        assert int(np.argmax(got)) == doc["label"]


def test_batches_n_and_text_prompts(client, example):
    context, answer = example
    prompts = [context + answer, context]
    r = client.post("/v1/completions", json={"prompt": prompts, "echo": True, "logprobs": 0, "max_tokens": 0,
                                             "n": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    for c in body["choices"]:
        p = prompts[c["index"] // 2]
        assert len(c["logprobs"]["token_logprobs"]) == len(p) and c["logprobs"]["top_logprobs"] is None
    assert body["choices"][0]["logprobs"] == body["choices"][1]["logprobs"]
    # the shorter prompt's figures are the longer one's head (each token conditioned on what precedes it)
    short = body["choices"][2]["logprobs"]["token_logprobs"]
    np.testing.assert_allclose(short[1:], body["choices"][0]["logprobs"]["token_logprobs"][1:len(context)],
                               atol=1e-5)
    assert body["usage"] == {"prompt_tokens": len(prompts[0]) + len(prompts[1]), "completion_tokens": 0,
                             "total_tokens": len(prompts[0]) + len(prompts[1]),
                             "prompt_tokens_details": {"cached_tokens": 0}}
    # n = 2 with generation: each choice is its prompt's entries, then its own generated tokens'
    r = client.post("/v1/completions", json={"prompt": context, "echo": True, "logprobs": 1, "max_tokens": 3,
                                             "n": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    for c in r.json()["choices"]:
        lp = c["logprobs"]
        gen = r.json()["usage"]["completion_tokens"] // 2
        assert len(lp["token_logprobs"]) == len(context) + gen and None not in lp["token_logprobs"][1:]
        np.testing.assert_allclose(lp["token_logprobs"][1:len(context)], short[1:], atol=1e-5)
        assert lp["text_offset"][len(context)] == len(c["text"]) - sum(len(t) for t in lp["tokens"][len(context):])
    # a text prompt is echoed as sent; echo without logprobs and max_tokens 0: the prompt alone
    r = client.post("/v1/completions", json={"prompt": "Count up 3 steps from 5.", "echo": True, "max_tokens": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "Count up 3 steps from 5." and r.json()["choices"][0]["logprobs"] is None


def test_refusals_name_the_field(client):
    def error(body):
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 400, r.text
        return r.json()["error"]

    assert error({"prompt": "hi", "max_tokens": 0})["param"] == "max_tokens"
    assert error({"prompt": "hi", "echo": True, "logprobs": 1, "stream": True})["param"] == "stream"
    assert error({"prompt": "hi", "echo": True, "max_tokens": 0, "stream": True})["param"] == "stream"
    assert error({"prompt": [5, 10 ** 6], "echo": True, "logprobs": 1, "max_tokens": 0})["param"].startswith(
        "prompt")


def test_generate_logprob_start_len(engine, client, example):
    """SGLang's ``/generate`` with ``return_logprob`` and ``logprob_start_len``: the prompt's chain log-probabilities
    from that position on (the first prompt token's null), beside the answer's; texts filled on request."""
    context, answer = example
    ids = context + answer
    want = engine.prompt_logprobs(ids, 2)
    start = len(context)
    r = client.post("/generate", json={"input_ids": ids, "return_logprob": True, "logprob_start_len": start,
                                       "top_logprobs_num": 2, "return_text_in_logprobs": True,
                                       "sampling_params": {"max_new_tokens": 4}})
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    got = meta["input_token_logprobs"]
    assert [t for _, t, _ in got] == ids[start:]
    assert np.allclose([lp for lp, _, _ in got], [lp for lp, _ in want["input_token_logprobs"][start:]], atol=1e-6)
    assert all(isinstance(text, str) for _, _, text in got)
    assert [[t for _, t, _ in top] for top in meta["input_top_logprobs"]] == \
        [[t for _, t in top] for top in want["input_top_logprobs"][start:]]
    assert len(meta["output_token_logprobs"]) == len(r.json()["output_ids"])
    r = client.post("/generate", json={"input_ids": ids, "return_logprob": True, "logprob_start_len": 0,
                                       "sampling_params": {"max_new_tokens": 1}})
    first = r.json()["meta_info"]["input_token_logprobs"][0]
    assert first[0] is None and first[1] == ids[0]
    assert "input_top_logprobs" not in r.json()["meta_info"]


def test_chain_scores_top_k_is_static_and_consistent(engine, example):
    """``chain_scores`` with and without alternatives: the same target figures; the top-1 is the maximum."""
    context, answer = example
    cfg, params = engine.config, engine.runner.params
    plain, _, _ = likelihood.chain_scores(params, cfg, context, answer)
    lps, top_lps, top_ids = likelihood.chain_scores(params, cfg, context, answer, top_k=4)
    np.testing.assert_array_equal(plain, lps)
    assert top_lps.shape == top_ids.shape == (len(answer), 4)
    assert np.all(top_lps[:, 0] >= lps) and not np.any(top_ids == cfg.mask_token_id)
    with pytest.raises(ValueError, match="top_k"):
        likelihood.chain_scores(params, cfg, context, answer, top_k=-1)


def test_families_without_a_mask_token_are_refused():
    """A uniform-noise family (DiffusionGemma) has no mask token, so no chain estimator: a ValueError naming the
    field (the check alone, on a stand-in engine of that family; the slow test below goes through a real one)."""
    from dllm_jax.config import DIFFUSION_GEMMA_ARCHITECTURES
    from dllm_jax.engine.families import capabilities_of
    from dllm_jax.engine.scoring import Scoring
    from dllm_jax.model.family import family_of

    class Stub(Scoring):  # what an engine of that family is built with (engine/families.py)
        config = {"architectures": [DIFFUSION_GEMMA_ARCHITECTURES[0]]}
        runner = object()

        @property
        def capabilities(self):
            return capabilities_of(family_of(self.config))

    with pytest.raises(ValueError, match="^echo: prompt log-probabilities .* no mask token"):
        Stub().check_prompt_logprobs("echo")
    with pytest.raises(ValueError, match="^input_ids: prompt log-probabilities"):
        Stub().prompt_logprobs([5, 17, 3])
    Stub.config = {"architectures": ["SDARForCausalLM"]}
    Stub().check_prompt_logprobs("echo")  # a mask-token family passes


@pytest.mark.slow
def test_diffusion_gemma_is_refused(tmp_path):
    """A real tiny DiffusionGemma engine (about 15 s: torch, transformers): ``prompt_logprobs`` is a ValueError,
    and over HTTP echo + logprobs a 400 naming ``echo``."""
    pytest.importorskip("torch")
    from fastapi.testclient import TestClient

    from dllm_jax.testing.diffusion_gemma import FULL, SLIDING, write_tiny_diffusion_gemma
    from dllm_jax.testing.tokenizer_files import write_gemma_tokenizer
    from serve import ServerSettings, create_app

    ids = write_gemma_tokenizer(str(tmp_path))
    write_tiny_diffusion_gemma(tmp_path, canvas_length=4, sliding_window=6, tie=False, num_hidden_layers=2,
                               layer_types=[SLIDING, FULL], vocab_size=405,
                               eos_token_id=[ids["<eos>"], ids["<end_of_turn>"]])
    eng = dllm_jax.Engine(model_path=str(tmp_path), warmup=False, max_running_requests=2)
    try:
        with pytest.raises(ValueError, match="input_ids: prompt log-probabilities .* no mask token"):
            eng.prompt_logprobs([5, 17, 3])
        app = create_app(eng, ServerSettings(), own_engine=False)
        with TestClient(app, base_url="http://localhost") as c:
            r = c.post("/v1/completions", json={"prompt": [5, 17, 3], "echo": True, "logprobs": 1, "max_tokens": 0})
            assert r.status_code == 400 and r.json()["error"]["param"] == "echo", r.text
    finally:
        eng.shutdown()
