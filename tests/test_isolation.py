"""One bad request must never hurt another (issue 34, items 1 and 4), on the tiny random model.

* A value that gets past the checks and breaks its own row (here: a ready-made ``SamplingParams``, used as
  given, whose ``top_k`` does not fit the device's int32), or a consumer whose ``on_event`` raises, fails that
  request alone: the requests running beside it finish token for token as they do alone, every page comes back.
* Generated extreme values for every sampling field, thrown at the engine while long requests run: each is a
  ``ValueError`` naming its field or a request that finishes normally; the long requests are untouched.
* A step variant that warm-up did not compile builds on a background thread: plain requests keep being served
  while it compiles, and only the requests that need it wait.
"""

from __future__ import annotations

import math
import threading
import time

import numpy as np
import pytest

from conftest import ENGINE_KW, assert_pages_back

LONG = {"max_new_tokens": 40, "ignore_eos": True}
LONG_PROMPTS = [[5, 6, 7, 8, 9, 10], list(range(2, 30)), [11, 12, 13]]


def _submit(engine, ids, params, on_event=None):
    from dllm_jax.engine.output import FinishWatcher

    watcher = FinishWatcher()

    def event(req, ev):
        if on_event is not None:
            on_event(req, ev)
        watcher(req, ev)

    req = engine.make_request(list(ids), params, on_event=event)
    engine.submit(req)
    return req, watcher


def _wait(pairs, timeout=120.0):
    deadline = time.monotonic() + timeout
    for req, watcher in pairs:
        assert watcher.done.wait(max(0.0, deadline - time.monotonic())), f"request {req.rid} did not finish"


@pytest.fixture
def long_reference(tiny_model, make_engine):
    """The long requests' outputs, each run alone."""
    engine = make_engine(tiny_model, **ENGINE_KW)
    return [engine.generate(input_ids=p, sampling_params=LONG)["output_ids"] for p in LONG_PROMPTS]


@pytest.mark.parametrize("schedule", ["fdfo", "sync"])
def test_a_value_its_row_cannot_hold_fails_only_that_request(tiny_model, make_engine, long_reference, schedule):
    from dllm_jax.engine.sampling import SamplingParams

    engine = make_engine(tiny_model, schedule=schedule, **ENGINE_KW)
    engine.start()
    long = [_submit(engine, p, LONG) for p in LONG_PROMPTS]
    bad = _submit(engine, [4, 5, 6], SamplingParams(top_k=2 ** 31, max_new_tokens=20))  # used as given
    _wait(long + [bad])
    reason = bad[0].finish_reason
    assert reason["type"] == "abort" and "OverflowError" in reason["message"], reason
    assert [r.output_ids for r, _ in long] == long_reference
    assert all(r.finish_reason["type"] == "length" for r, _ in long)
    # the loop serves on
    assert engine.generate(input_ids=LONG_PROMPTS[0], sampling_params=LONG)["output_ids"] == long_reference[0]
    engine.shutdown()
    assert_pages_back(engine)


def test_a_failing_consumer_fails_only_its_request(tiny_model, make_engine, long_reference):
    engine = make_engine(tiny_model, **ENGINE_KW)
    engine.start()
    long = [_submit(engine, p, LONG) for p in LONG_PROMPTS]

    def broken(req, event):
        if not req.finished:
            raise UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed")

    bad = _submit(engine, [4, 5, 6], {"max_new_tokens": 20, "ignore_eos": True}, on_event=broken)
    _wait(long + [bad])
    assert bad[0].finish_reason["type"] == "abort" and "UnicodeEncodeError" in bad[0].finish_reason["message"]
    assert [r.output_ids for r, _ in long] == long_reference
    engine.shutdown()
    assert_pages_back(engine)


# ----------------------------------------------------------------------------------------------
# Generated extreme values for every sampling field
# ----------------------------------------------------------------------------------------------
INTS = [-2 ** 63, -2 ** 32, -2 ** 31 - 1, -2 ** 31, -2, -1, 0, 1, 2, 63, 64, 2 ** 20, 2 ** 20 + 1, 2 ** 31 - 1,
        2 ** 31, 2 ** 32 - 1, 2 ** 32, 2 ** 63, 10 ** 30]
FLOATS = [math.nan, math.inf, -math.inf, -0.0, 0.0, 5e-324, 1e-320, 1e-45, 1e-40, 1e-7, 1e-6, 0.5, 1.0,
          1.0000001, 2.0, 2.0000001, 100.0, 100.5, 3.4e38, 3.5e38, 1e300, -1e-300, -2.0, -100.0, -100.5]
OTHERS = [None, True, False, "1", "", "\ud800", "a\x00b", [], [1], {}, {"1": 1}, [2 ** 31], ["\ud800"]]
# Valid values at the edges of each field's range (the generator mixes them with the extremes above).
EDGES = {"max_new_tokens": [1, 2, 2 ** 20], "temperature": [0.0, 1e-7, 1e-6, 0.5, 2.0, 100.0, 3.4e38],
         "top_p": [5e-324, 1e-300, 1e-9, 0.5, 1.0], "top_k": [-1, 0, 1, 2, 63, 64, 2 ** 31 - 1],
         "stop": ["x", "\u00e9\u00e9", ["a", "\U0001f600"]], "stop_token_ids": [[], [0], [63], [1] * 1024],
         "ignore_eos": [True, False], "skip_special_tokens": [True, False], "seed": [0, 1, 2 ** 32 - 1],
         "return_logprob": [True], "top_logprobs_num": [0, 1, 20], "presence_penalty": [-2.0, 2.0],
         "frequency_penalty": [-2, 2], "repetition_penalty": [1e-300, 0.01, 2.0], "min_new_tokens": [0, 1],
         "logit_bias": [{"0": 100}, {"63": 100.0}, {"2": -100, "3": 100}, {str(i): 1.5 for i in range(64)}]}
FIELDS = ["max_new_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids", "ignore_eos",
          "skip_special_tokens", "seed", "return_logprob", "top_logprobs_num", "presence_penalty",
          "frequency_penalty", "repetition_penalty", "min_new_tokens", "logit_bias"]


def generated_params(rng: np.random.Generator, count: int) -> list[dict]:
    """``count`` sampling-param dicts, each with one to three fields set to an extreme value of some kind (also
    lists and bias tables built from them), the rest default."""
    def value(field):
        if rng.random() < 0.5:
            edges = EDGES[field]
            return edges[rng.integers(0, len(edges))]
        kind = rng.integers(0, 4)
        pool = INTS if kind == 0 else FLOATS if kind == 1 else OTHERS
        v = pool[rng.integers(0, len(pool))]
        if field in ("stop_token_ids",) and rng.random() < 0.5:
            return [INTS[i] for i in rng.integers(0, len(INTS), size=rng.integers(1, 4))]
        if field == "logit_bias" and rng.random() < 0.6:
            key = str(INTS[rng.integers(0, len(INTS))]) if rng.random() < 0.5 else str(rng.integers(0, 64))
            return {key: FLOATS[rng.integers(0, len(FLOATS))]}
        if field == "stop" and rng.random() < 0.4:
            return ["x" * int(rng.integers(1, 5))] * int(rng.integers(1, 40))
        return v

    out = []
    for _ in range(count):
        fields = rng.choice(FIELDS, size=rng.integers(1, 4), replace=False)
        params = {str(f): value(str(f)) for f in fields}
        params.setdefault("max_new_tokens", 8)
        out.append(params)
    return out


def test_generated_extreme_values_hurt_nobody(tiny_model, make_engine, long_reference):
    """320 generated sampling-param dicts against a running engine: each is refused naming one of its own
    fields, or accepted and finished normally (never aborted, never a NaN / masked / out-of-vocabulary token);
    the long requests in flight finish token for token as alone; every page comes back."""
    engine = make_engine(tiny_model, **ENGINE_KW)
    vocab = engine.config.vocab_size
    engine.start()
    long = [_submit(engine, p, LONG) for p in LONG_PROMPTS]
    refused, accepted = 0, []
    for params in generated_params(np.random.default_rng(0), 320):
        try:
            accepted.append((params, _submit(engine, [4, 5, 6], params)))
        except ValueError as e:
            field = str(e).split(":")[0]
            assert field.startswith("sampling_params"), (params, e)
            named = field.split(".")[1].split("[")[0] if "." in field else None
            assert named is None or named in params or named == "min_new_tokens", (params, e)
            refused += 1
    _wait(long + [pair for _, pair in accepted], timeout=300)
    for params, (req, _) in accepted:
        assert req.finish_reason["type"] in ("length", "stop"), (params, req.finish_reason)
        assert all(0 <= t < vocab and t != engine.mask_token_id for t in req.output_ids), (params, req.output_ids)
    assert [r.output_ids for r, _ in long] == long_reference
    assert refused > 100 and len(accepted) > 50, (refused, len(accepted))
    engine.shutdown()
    assert_pages_back(engine)


# ----------------------------------------------------------------------------------------------
# Step variants compile off the scheduler's thread
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("schedule", ["fdfo", "sync"])
def test_plain_requests_are_served_while_a_variant_compiles(tiny_model, make_engine, long_reference, schedule):
    from dllm_jax.engine.compilation import compiled_executables

    logprob_params = {**LONG, "return_logprob": True}
    engine = make_engine(tiny_model, schedule=schedule, **ENGINE_KW)
    engine.warmup()  # the plain step only
    compiler = engine.runner.compiler
    release, started = threading.Event(), threading.Event()
    compile_key = compiler._compile

    compiled_after_background = []

    def held_compile(key):  # the variant's compile waits until the plain requests are done
        started.set()
        assert release.wait(120)
        compile_key(key)
        compiled_after_background.append(compiled_executables())

    compiler._compile = held_compile
    engine.start()
    variant = _submit(engine, [4, 5, 6], logprob_params)
    assert started.wait(60)
    long = [_submit(engine, p, LONG) for p in LONG_PROMPTS]
    _wait(long)  # served while the variant is still compiling
    assert not variant[0].finished and variant[0].output_ids == []
    assert [r.output_ids for r, _ in long] == long_reference
    release.set()
    _wait([variant])
    assert compiled_executables() == compiled_after_background[0]  # the call found the executable
    result = engine.result(variant[0])
    reference = make_engine(tiny_model, schedule=schedule, **ENGINE_KW).generate(
        input_ids=[4, 5, 6], sampling_params=logprob_params)
    assert result["output_ids"] == reference["output_ids"]
    assert result["meta_info"]["output_token_logprobs"] == reference["meta_info"]["output_token_logprobs"]
    engine.shutdown()
    assert_pages_back(engine)


def test_an_engine_without_warmup_compiles_in_line(tiny_model, make_engine):
    """No warm-up: nothing is compiled ahead, so nothing runs in the background either (the behaviour of a
    lazily compiled engine, e.g. ``--no-warmup``)."""
    engine = make_engine(tiny_model, **ENGINE_KW)
    engine.generate(input_ids=[4, 5, 6], sampling_params={**LONG, "return_logprob": True})
    assert engine.runner.compiler._thread is None


def test_a_call_that_loses_the_kv_pool_fails_the_running_requests_only(tiny_model, make_engine, monkeypatch,
                                                                       long_reference):
    """A device call that fails after it took the (donated) KV pool: every running request lost its KV and
    fails, the prefix index is emptied, a fresh pool replaces the lost one and the engine serves on."""
    import jax

    from dllm_jax.engine import runner

    engine = make_engine(tiny_model, **ENGINE_KW)
    real, calls = runner.denoise_packed, []

    def failing_call(params, kv_pages, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            for x in jax.tree.leaves(kv_pages):
                x.delete()
            raise RuntimeError("device lost mid-call")
        return real(params, kv_pages, *args, **kwargs)

    monkeypatch.setattr(runner, "denoise_packed", failing_call)
    engine.start()
    failed = [_submit(engine, p, LONG) for p in LONG_PROMPTS]
    _wait(failed)
    assert all(r.finish_reason["type"] == "abort" for r, _ in failed)
    with engine._lock:
        assert engine.radix.total == 0 and engine.allocator.num_free == engine.allocator.capacity
    assert engine.generate(input_ids=LONG_PROMPTS[1], sampling_params=LONG)["output_ids"] == long_reference[1]
    engine.shutdown()
    assert_pages_back(engine)
