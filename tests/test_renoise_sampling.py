"""DiffusionGemma's sampling options through the engine: penalties, logit_bias, min_new_tokens, stop_token_ids and
top logprobs, applied inside the fused vocabulary pass (tests/test_renoise_kernel.py holds the pass to float64 numpy
of the same draws; here: the tables' semantics against a dense formula, and the engine against the static batch
loop given the same options), and no compile after a warm-up of the variants."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")

import dllm_jax  # noqa: E402
from dllm_jax.decode import renoise, renoise_tables  # noqa: E402
from dllm_jax.decode.renoise_loop import RenoiseLoop  # noqa: E402
from dllm_jax.model.loader import load_model  # noqa: E402
from dllm_jax.testing.diffusion_gemma import FULL, SLIDING, write_tiny_diffusion_gemma  # noqa: E402
from dllm_jax.testing.tokenizer_files import write_gemma_tokenizer  # noqa: E402
from pallas_kernels import renoise_adjust  # noqa: E402

STEPS = 5
PROMPTS = [[5, 17, 3, 88, 41, 9, 60, 2, 33, 71, 12], [7, 7, 30, 4, 11], [9, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]


def test_tables_match_the_dense_formula():
    """A canvas's entries applied to random logits equal the dense formula of dllm_jax/decode/penalties.py (float64):
    repetition over prompt + committed outputs, presence / frequency over the committed outputs only, the bias,
    and the stop ids at -inf for the positions whose output index is below min_new_tokens."""
    rng = np.random.default_rng(0)
    V, C = 50, 8
    prompt = rng.integers(0, V, 12).tolist()
    outputs = rng.integers(0, V, 16).tolist()  # two canvases committed before this one
    opts = dict(presence=0.7, frequency=0.4, repetition=1.6, bias=((3, 2.5), (prompt[0], -1.0), (49, 100.0)),
                stop_ids=(1, 2), min_new=21)
    ids, rep, add, until = renoise_tables.canvas_entries(history=prompt + outputs, prompt_len=len(prompt),
                                                         canvas_len=C, **opts)
    assert (np.diff(ids) > 0).all()
    z = rng.normal(0, 3, (C, V))
    want = z.copy()
    for v in range(V):
        c_gen, c_all = outputs.count(v), (prompt + outputs).count(v)
        x = want[:, v]
        x = np.where(c_all > 0, np.where(x > 0, x / 1.6, x * 1.6), x)
        x = x - 0.7 * (c_gen > 0) - 0.4 * c_gen + dict(opts["bias"]).get(v, 0.0)
        early = len(outputs) + np.arange(C) < 21  # output index below min_new_tokens
        want[:, v] = np.where(early & (v in (1, 2)), -np.inf, x)
    got = z.copy()
    for t, f, d, u in zip(ids, rep.astype(np.float64), add.astype(np.float64), until):
        x = got[:, t]
        got[:, t] = np.where(np.arange(C) < u, -np.inf, np.where(x > 0, x / f, x * f) + d)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert np.isinf(got[:5, 1]).all() and np.isfinite(got[5:, 1]).all()  # outputs 16..20 masked, 21.. free
    # with no committed output, presence and frequency touch nothing (the first canvas)
    first = renoise_tables.canvas_entries(history=prompt, prompt_len=len(prompt), canvas_len=C, presence=2.0,
                                          frequency=2.0)
    assert len(first[0]) == 0
    tables = renoise_tables.empty_tables(2, 4)
    with pytest.raises(ValueError, match="overflow"):
        renoise_tables.put_row(tables, 0, (np.arange(5),) * 4)
    assert (tables["ids"] == renoise_adjust.PAD_ID).all()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("dgs")
    ids = write_gemma_tokenizer(str(path))
    write_tiny_diffusion_gemma(path, canvas_length=4, sliding_window=6, tie=False, num_hidden_layers=2,
                               layer_types=[SLIDING, FULL], vocab_size=405,
                               eos_token_id=[ids["<eos>"], ids["<end_of_turn>"]])
    return str(path)


@pytest.fixture(scope="module")
def loop(model_dir):
    loaded = load_model(model_dir)
    return RenoiseLoop(loaded.params, loaded.config, renoise.RenoiseConfig(max_denoising_steps=STEPS))


@pytest.fixture(scope="module")
def engine(model_dir):
    eng = dllm_jax.Engine(model_path=model_dir, warmup=False, algorithm_config={"max_denoising_steps": STEPS},
                          max_running_requests=2, context_length=64)
    yield eng
    eng.shutdown()


def test_options_equal_the_loop(engine, loop):
    """Three requests (two slots: they share calls, one waits) with penalties + biases + top logprobs, min_new_tokens
    against a favoured EOS, and none (riding in the penalty variant): each equals the loop given the same options."""
    eos = sorted(engine.eos_token_ids)
    plain = loop.generate([PROMPTS[0]], [12], [40], ignore_eos=[True])[0].output_ids
    cases = [
        ({"presence_penalty": 1.5, "frequency_penalty": 1.0, "repetition_penalty": 1.3,
          "logit_bias": {str(plain[0]): -100, "7": 3.0}, "top_logprobs_num": 5},
         dict(presence=1.5, frequency=1.0, repetition=1.3, bias=((7, 3.0), (plain[0], -100.0))), True),
        ({"min_new_tokens": 6, "logit_bias": {str(eos[0]): 100}},
         dict(bias=((eos[0], 100.0),), stop_ids=tuple(eos), min_new=6), False),
        ({}, {}, True),
    ]
    params = [dict(p, max_new_tokens=12, seed=40 + i, ignore_eos=ig, return_logprob=True)
              for i, (p, _, ig) in enumerate(cases)]
    outs = engine.generate(input_ids=PROMPTS, sampling_params=params)
    for i, (p, opts, ig) in enumerate(cases):
        want = loop.generate([PROMPTS[i]], [12], [40 + i], ignore_eos=[ig], eos_token_ids=eos,
                             options=[opts], top_k=5)[0]
        out = outs[i]
        assert out["output_ids"] == want.output_ids, i
        lps = out["meta_info"]["output_token_logprobs"]
        np.testing.assert_allclose([lp for lp, _, _ in lps], want.logprobs, rtol=1e-5, atol=1e-6)
        if p.get("top_logprobs_num"):
            tops = out["meta_info"]["output_top_logprobs"]
            assert len(tops) == len(out["output_ids"]) and all(len(t) == 5 for t in tops)
            for tok, (lp, _, _), top, ref in zip(out["output_ids"], lps, tops, want.top):
                assert top[0][1] == tok and top[0][0] == pytest.approx(lp, abs=1e-6)  # the committed argmax
                assert [t for _, t, _ in top] == [t for _, t in ref]
                np.testing.assert_allclose([v for v, _, _ in top], [v for v, _ in ref], rtol=1e-5, atol=1e-6)
                assert all(a[0] >= b[0] for a, b in zip(top, top[1:]))
    assert plain[0] not in outs[0]["output_ids"]  # biased to -100
    # min_new_tokens: EOS (favoured by +100) masked for outputs 0..5, so it is the 7th output
    assert len(outs[1]["output_ids"]) == 7 and outs[1]["output_ids"][-1] == eos[0]
    assert eos[0] not in outs[1]["output_ids"][:6] and outs[1]["meta_info"]["finish_reason"]["type"] == "stop"
    engine.scheduler.check_pages()


def test_generated_tokens_are_the_committed_outputs(engine):
    """Presence / frequency count the committed outputs before a canvas: the first canvas (none yet) is the
    plain answer's; logit_bias and repetition apply from the first canvas."""
    base = {"max_new_tokens": 12, "seed": 3, "ignore_eos": True}
    plain = engine.generate(input_ids=PROMPTS[1], sampling_params=base)["output_ids"]
    pen = engine.generate(input_ids=PROMPTS[1], sampling_params=dict(base, presence_penalty=2.0,
                                                                     frequency_penalty=2.0))["output_ids"]
    assert pen[:4] == plain[:4]
    banned = {str(t): -100 for t in set(plain)}
    biased = engine.generate(input_ids=PROMPTS[1], sampling_params=dict(base, logit_bias=banned))["output_ids"]
    assert not set(biased) & set(plain) and len(biased) == 12
    engine.scheduler.check_pages()


def test_stop_token_ids_and_min_new_tokens(engine):
    """stop_token_ids end the answer at the first one (with it), as the same seeded answer without them had it;
    with min_new_tokens a favoured stop id waits until that many tokens are out (EOS ignored)."""
    base = {"max_new_tokens": 12, "seed": 5, "ignore_eos": True}
    plain = engine.generate(input_ids=PROMPTS[2], sampling_params=base)["output_ids"]
    tok = plain[5]
    cut = engine.generate(input_ids=PROMPTS[2], sampling_params=dict(base, stop_token_ids=[tok]))
    first = plain.index(tok)
    assert cut["output_ids"] == plain[:first + 1]
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": tok}
    forced = engine.generate(input_ids=PROMPTS[2], sampling_params=dict(
        base, stop_token_ids=[11], logit_bias={"11": 100}, min_new_tokens=5))
    assert forced["output_ids"][-1] == 11 and len(forced["output_ids"]) == 6 and 11 not in forced["output_ids"][:5]
    with pytest.raises(ValueError, match="top_logprobs_num"):
        engine.generate(input_ids=PROMPTS[2], sampling_params=dict(base, top_logprobs_num=21, return_logprob=True))
    engine.scheduler.check_pages()


# slow: warm-up compiles every variant at each denoise row bucket (1, 2 here), about 50 s on 2 busy cores; the
# main suite's no-compile check over the row buckets is test_renoise_engine's warm-up test (the plain step)
@pytest.mark.slow
def test_variants_warm_up_and_compile_nothing_after(model_dir):
    from dllm_jax.engine.compilation import compiled_executables

    eng = dllm_jax.Engine(model_path=model_dir, warmup=False, algorithm_config={"max_denoising_steps": STEPS},
                          max_running_requests=2, context_length=32, max_prefill_tokens=16)
    try:
        n = eng.warmup(penalties=True, logprobs=True)
        assert n == eng.runner.num_buckets(penalties=True, logprobs=True) == len(set(eng.runner.buckets(
            penalties=True, logprobs=True))) > eng.runner.num_buckets()
        before = compiled_executables()
        mixes = [{}, {"presence_penalty": 0.5}, {"return_logprob": True, "top_logprobs_num": 3},
                 {"repetition_penalty": 1.2, "return_logprob": True, "top_logprobs_num": 2}]
        for i, extra in enumerate(mixes):
            eng.generate(input_ids=[PROMPTS[1], PROMPTS[i % 3]], sampling_params=[
                {"max_new_tokens": 6, "seed": i, "ignore_eos": True}, dict(extra, max_new_tokens=9, seed=i + 1,
                                                                           ignore_eos=True)])
        eng.generate(input_ids=PROMPTS[2], sampling_params=dict(mixes[3], max_new_tokens=4, seed=9))  # one row
        assert compiled_executables() == before
        eng.scheduler.check_pages()
    finally:
        eng.shutdown()
