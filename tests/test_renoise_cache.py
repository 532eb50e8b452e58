"""DiffusionGemma's prefix cache is exact: every answer of a cache-on engine is token-identical to the cache-off
engine's, over several canvases, in batches mixing cache hits and misses of different lengths, with chunked
prompts whose sliding pages go back while other requests reuse theirs, sliding pages evicted from the index, under
forced retraction, in both schedules; pages are exact after every run.

The regime: near-zero temperature and an accept-all entropy bound. There a token is the argmax of logits whose
top two are far apart compared with float32 rounding, so an answer is a function of the K/V it reads: a page
reused with wrong contents, a sliding window read from a page given back, an encode that starts at the wrong
position -- any of these changes tokens. In the default sampling regime on a random checkpoint (near-uniform
distributions, every draw close to a boundary) the forward's float32 rounding, which differs with the chunk a
position was encoded in and with the batch's shape, is itself enough to flip draws, with or without the cache;
``python -m bench renoise_invariance`` measures that and classifies it (README, "Exactness").
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")

import dllm_jax  # noqa: E402
from dllm_jax.testing.diffusion_gemma import write_tiny_diffusion_gemma  # noqa: E402
from dllm_jax.testing.tokenizer_files import write_gemma_tokenizer  # noqa: E402

# near-argmax sampling, every position accepted each step (the deterministic regime)
EXACT = {"t_min": 0.0, "t_max": 1e-3, "entropy_bound": 1e9, "max_denoising_steps": 6}
_rng = np.random.default_rng(5)
BASE = _rng.integers(5, 400, 40).tolist()  # two complete pages of 16 and a partial one
PROMPTS = {
    "base": BASE,
    "short_hit": BASE[:34] + _rng.integers(5, 400, 3).tolist(),  # shares two pages with base
    "long_hit": BASE + _rng.integers(5, 400, 31).tolist(),  # 71 tokens: base's pages, then four more
    "miss": _rng.integers(5, 400, 21).tolist(),
    "one_page": BASE[:16] + _rng.integers(5, 400, 9).tolist(),  # shares one page
}
SEEDS = {name: 100 + i for i, name in enumerate(PROMPTS)}


def _params(name, max_new_tokens=24):
    return {"max_new_tokens": max_new_tokens, "seed": SEEDS[name], "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("dg_cache")
    ids = write_gemma_tokenizer(str(path))
    # the published layout: tied embeddings, canvas 8, 4 layers of sliding (window 6) and full attention
    write_tiny_diffusion_gemma(path, canvas_length=8, tie=True, vocab_size=405, sliding_window=6,
                               eos_token_id=[ids["<eos>"], ids["<end_of_turn>"]])
    return str(path)


def _engine(model_dir, **kw):
    # max_prefill_tokens 16: prompts encode in chunks of one page, so a long prompt's sliding pages go back between
    # its own chunks; the small sliding pool this sizes makes the index evict sliding pages of cached prefixes
    kw = {"max_running_requests": 3, "max_prefill_tokens": 16, **kw}
    return dllm_jax.Engine(model_path=model_dir, warmup=False, algorithm_config=EXACT, **kw)


# the synchronous schedule's half of the matrix runs with the slow tests (-m slow): about a minute on 2 cores
@pytest.fixture(scope="module", params=["fdfo", pytest.param("sync", marks=pytest.mark.slow)])
def engines(request, model_dir):
    off = _engine(model_dir, schedule=request.param, enable_prefix_cache=False)
    on = _engine(model_dir, schedule=request.param)
    want = {name: off.generate(input_ids=p, sampling_params=_params(name))["output_ids"]
            for name, p in PROMPTS.items()}
    off.scheduler.check_pages()
    yield request.param, off, on, want
    off.shutdown()
    on.shutdown()


@pytest.mark.slow  # ~10 s on 2 cores: the reference's own check (the other tests compare with it alone)
def test_cache_off_is_batch_independent(engines):
    """The reference itself: in this regime the cache-off engine answers alike alone and batched (a denoise call
    of one row and of every slot: a row's tokens do not depend on the rows computed with it)."""
    _, off, _, want = engines
    outs = off.generate(input_ids=list(PROMPTS.values()), sampling_params=[_params(n) for n in PROMPTS])
    assert [o["output_ids"] for o in outs] == list(want.values())
    assert {1, off.runner.max_rows} <= {k.rows for k in off.runner.compiler.compiled if k.kind == "canvas"}
    assert len({tuple(w) for w in want.values()}) == len(want)  # the answers depend on their prompts


def test_repeated_request_over_several_canvases(engines):
    _, _, on, want = engines
    on.flush_cache()
    outs = []
    for _ in range(3):
        outs.append(on.generate(input_ids=BASE, sampling_params=_params("base", 40)))  # five canvases
        on.scheduler.check_pages()
    assert [o["meta_info"]["cached_tokens"] for o in outs] == [0, 32, 32]
    assert outs[0]["output_ids"][:24] == want["base"]
    assert outs[1]["output_ids"] == outs[0]["output_ids"] == outs[2]["output_ids"]


def test_batches_mixing_hits_and_misses(engines):
    _, _, on, want = engines
    on.flush_cache()
    on.generate(input_ids=BASE, sampling_params=_params("base"))  # base's pages (and its answer's) cached
    names = ["long_hit", "miss", "short_hit", "one_page", "base"]
    outs = on.generate(input_ids=[PROMPTS[n] for n in names], sampling_params=[_params(n) for n in names])
    on.scheduler.check_pages()
    for name, out in zip(names, outs):
        assert out["output_ids"] == want[name], name
    cached = {n: o["meta_info"]["cached_tokens"] for n, o in zip(names, outs)}
    assert cached["long_hit"] >= 32 and cached["short_hit"] == 32 and cached["one_page"] == 16
    assert cached["miss"] == 0
    # a follow-up turn: its prompt is base + base's answer + more, cached through the answer's canvases
    follow = BASE + want["base"] + [7, 8, 9]
    off = engines[1]
    ref = off.generate(input_ids=follow, sampling_params=_params("base"))["output_ids"]
    out = on.generate(input_ids=follow, sampling_params=_params("base"))
    assert out["meta_info"]["cached_tokens"] == 48 and out["output_ids"] == ref
    on.scheduler.check_pages()


def test_sliding_pages_evicted_and_given_back(engines):
    """Many distinct cached prefixes overflow the small sliding pool: the index gives back sliding pages of cached
    prefixes (their full pages stay) while running requests reuse others'; answers stay exact."""
    _, _, on, want = engines
    on.flush_cache()
    rng = np.random.default_rng(9)
    others = [rng.integers(5, 400, 37).tolist() for _ in range(12)]
    for i, p in enumerate(others):
        on.generate(input_ids=p, sampling_params={"max_new_tokens": 8, "seed": i, "ignore_eos": True})
        on.scheduler.check_pages()
    index = on.scheduler.policy.index
    full, sliding = index.held()
    assert len(sliding) < len(full)  # some cached nodes lost their sliding page
    names = ["base", "long_hit", "short_hit"]
    outs = on.generate(input_ids=[PROMPTS[n] for n in names], sampling_params=[_params(n) for n in names])
    for name, out in zip(names, outs):
        assert out["output_ids"] == want[name], name
    on.scheduler.check_pages()


@pytest.mark.slow  # ~18 s on 2 cores (a third engine compiles its own pool's calls); the main suite's retraction
# of DiffusionGemma requests: tests/test_renoise_engine.py::test_retraction_keeps_the_answers
def test_forced_retraction_with_the_cache(model_dir, engines):
    schedule, _, _, want = engines
    small = _engine(model_dir, schedule=schedule, num_kv_pages=8)
    try:
        small.generate(input_ids=BASE, sampling_params=_params("base"))
        names = ["long_hit", "short_hit", "base"]
        outs = small.generate(input_ids=[PROMPTS[n] for n in names], sampling_params=[_params(n) for n in names])
        assert small.scheduler.stats["retractions"] > 0
        for name, out in zip(names, outs):
            assert out["output_ids"] == want[name], name
        small.scheduler.check_pages()
    finally:
        small.shutdown()
