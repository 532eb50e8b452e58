"""A staged warm-up (``dllm-jax serve``'s): the buckets a short chat needs compile before the engine is ready, the
rest on one background thread; a call whose bucket is not compiled yet runs in a larger compiled one, or waits for
its own, whose compile then goes first.

The compiler's ordering and the bucket fitting are checked with fake lowerings (no XLA); one tiny engine checks
that a staged engine answers as one without warm-up does, and compiles nothing in line."""

import threading

import pytest

from conftest import ENGINE_KW, assert_pages_back
from dllm_jax.engine.compilation import (Compiler, DenoiseKey, PrefillKey, ShapeBuckets, fit_key, prefill_fit,
                                         staged_keys)


class _Held:
    """A fake ``lower(key)``: its ``compile()`` records the key; a key of ``hold`` waits for ``gate`` first."""

    def __init__(self, hold=()):
        self.order: list = []
        self.hold = set(hold)
        self.gate = threading.Event()

    def __call__(self, key):
        held = self

        class Lowered:
            def compile(self):
                if key in held.hold:
                    assert held.gate.wait(30)
                held.order.append(key)

        return Lowered()


def _keys(buckets: ShapeBuckets, width: int):
    from dllm_jax.engine.compilation import bucket_keys

    return bucket_keys(buckets, width)


def test_staged_keys_fit_and_order():
    buckets = ShapeBuckets.build(max_rows=4, max_pages_per_row=8, max_prefill_blocks=8, fold_commit=False)
    keys = _keys(buckets, 8)
    first, rest = staged_keys(keys, denoise_rows=1, block_size=8)
    # one request's denoise step at the widest table, and a short prompt's prefill (64 tokens: 8 blocks of 8)
    assert first == [DenoiseKey("denoise", 1, 8, False, 0), PrefillKey("prefill", 1, 8, 8)]
    assert sorted(first + rest) == sorted(keys) and len(set(rest)) == len(rest)
    assert [k.rows for k in rest] == sorted(k.rows for k in rest)  # fewer rows first

    lower = _Held(hold=rest)  # the background thread holds at its first compile
    compiler = Compiler(lower)
    compiler.warmup(first, later=rest)
    assert set(first) <= compiler.compiled and compiler.pending_keys() == len(rest)
    narrow = DenoiseKey("denoise", 1, 1, False, 0)
    assert compiler.compiles_in_background(narrow)
    # a narrow one-row call runs in the compiled wide bucket meanwhile, and its own bucket is asked for first
    assert fit_key(compiler, narrow, lambda: buckets.larger(narrow)) == first[0]
    # a call of 3 rows: no compiled bucket holds it, it waits
    three = DenoiseKey("denoise", 4, 2, False, 0)
    assert fit_key(compiler, three, lambda: buckets.larger(three)) is None
    # a 2-block prompt prefills in the compiled 8-block bucket; 2 rows of 4 blocks: nothing compiled holds them
    assert prefill_fit(compiler, buckets, 2, 1, 8) == (2, 1)
    assert prefill_fit(compiler, buckets, 4, 2, 8) is None
    lower.gate.set()
    while compiler.pending_keys():
        compiler.wait(1)
    asked = {narrow, three, PrefillKey("prefill", 1, 2, 8), PrefillKey("prefill", 2, 4, 8)}
    done = lower.order[len(first):]
    assert asked <= set(done[:len(asked) + 1])  # before the rest (but the one the thread held when asked)
    assert sorted(done) == sorted(rest) and not compiler.compiles_in_background(three)
    compiler.close()


def test_close_drops_the_queue():
    later = [DenoiseKey("denoise", r, 1, False, 0) for r in (2, 4, 8)]
    lower = _Held(hold=later)
    compiler = Compiler(lower)
    compiler.warmup([DenoiseKey("denoise", 1, 1, False, 0)], later=later)
    threading.Timer(0.2, lower.gate.set).start()
    compiler.close()  # waits for the one compiling, drops the rest
    assert len(lower.order) == 2 and compiler.pending_keys() == 0
    assert all(compiler.compiles_in_background(k) for k in later[1:])  # never compiled in line
    assert fit_key(compiler, later[1], lambda: []) is None and compiler.pending_keys() == 0


@pytest.mark.slow  # ~4 compiles of a tiny engine (2 shared with the suite's ENGINE_KW engines)
def test_a_staged_engine_answers_as_a_plain_one(tiny_model, make_engine, schedule="fdfo"):
    from dllm_jax.engine.compilation import compiled_executables

    kw = dict(ENGINE_KW, shape_buckets=dict(rows=(1, 16), pages=(16,), prefill_rows=(1,), prefill_blocks=(1, 4)))
    prompts = [[4, 5, 6], [7, 8, 9, 10, 11, 12, 13], [3, 4]]
    params = {"max_new_tokens": 10, "ignore_eos": True}
    engine = make_engine(tiny_model, schedule=schedule, **kw)
    compiler = engine.runner.compiler
    compile_key = compiler._compile
    release = threading.Event()

    def held(key):  # the background compiles wait until the first answers are in
        assert release.wait(120)
        compile_key(key)

    compiler._compile = held
    assert engine.warmup(background=True) == 2  # of 4: one-row denoise, 4-block prefill
    before = compiled_executables()
    first = engine.generate(input_ids=prompts[0], sampling_params=params)  # runs in the staged buckets
    assert compiled_executables() == before  # nothing compiled in line
    release.set()
    many = engine.generate(input_ids=prompts, sampling_params=params)  # 3 rows: one at a time, or the 16-row bucket
    while compiler.pending_keys():
        compiler.wait(1)
    assert compiled_executables() - before == 2  # the two left to the background, nothing in line
    plain = make_engine(tiny_model, schedule=schedule, **kw).generate(input_ids=prompts, sampling_params=params)
    assert [first["output_ids"]] + [r["output_ids"] for r in many] == [plain[0]["output_ids"]] + \
        [r["output_ids"] for r in plain]
    engine.shutdown()
    assert_pages_back(engine)
