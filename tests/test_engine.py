"""The engine end to end on a tiny random model (CPU, float32): every way of running it decides as the float64
reference does (tests/oracle.py), differing only after a near-tie, and gives every page back.

Most engines here share ``ENGINE_KW``'s fixed shapes, so each (algorithm, schedule) compiles one denoise and one
prefill step for the whole module; the tests about buckets and batch shapes set their own.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ENGINE_KW, TINY_MASK_ID, assert_pages_back

M = TINY_MASK_ID
PROMPTS = [
    [5, 6, 7, 8, 9, 10],
    [3, 4],
    [],
    [M, 2, M, 3],
    list(range(2, 30)),
    [M, 2],
    [7] * 9,
    [11, 12, 13, 14, 15, 16, 17, 18],
]
GREEDY = {"max_new_tokens": 14, "ignore_eos": True}
RETRACT_KW = {**ENGINE_KW, "num_kv_pages": 12}  # small enough that 8 requests must retract


def _outs(engine, prompts=PROMPTS, params=GREEDY):
    return [o["output_ids"] for o in engine.generate(input_ids=[list(p) for p in prompts], sampling_params=params)]


def _verified(oracle, outs, prompts=PROMPTS, max_new=14, algorithm="LowConfidence", config=None):
    """Every output decided as the float64 reference does (near-ties excepted); returns the verdicts."""
    return oracle.verify_all(prompts, outs, max_new, algorithm, config)


@pytest.fixture(scope="module")
def reference_outputs(tiny_oracle):
    """The oracle's own outputs (exact decisions everywhere): what a run without near-ties must produce."""
    return [tiny_oracle.generate(p, 14) for p in PROMPTS]


def test_oracle_rejects_a_wrong_decision(tiny_oracle, reference_outputs):
    """The reference check can fail: change one committed token of a correct output and it is refused."""
    from oracle import DecisionError

    out = list(reference_outputs[0])
    out[5] = (out[5] + 1) % 60 + 2
    with pytest.raises(DecisionError, match="block"):
        tiny_oracle.verify(PROMPTS[0], out, 14)
    tiny_oracle.verify(PROMPTS[0], reference_outputs[0], 14)


@pytest.mark.parametrize("schedule", ["fdfo", "sync"])
def test_batch_decides_as_the_float64_reference(tiny_model, make_engine, tiny_oracle, schedule):
    engine = make_engine(tiny_model, schedule=schedule, **ENGINE_KW)
    _verified(tiny_oracle, _outs(engine))


@pytest.mark.parametrize("kwargs", [
    dict(ENGINE_KW, enable_prefix_cache=False, max_running_requests=1),
    dict(ENGINE_KW, fold_commit_forward=True),  # the default on an accelerator (on CPU: SGLang's forward count)
    dict(ENGINE_KW, schedule="sync", max_prefill_tokens=4,  # one block per prefill forward
         shape_buckets=dict(ENGINE_KW["shape_buckets"], prefill_blocks=(1,))),
    dict(RETRACT_KW),  # forces retraction
    dict(RETRACT_KW, schedule="sync"),
], ids=["no-cache-1-row", "fold", "sync-1-block-prefill", "fdfo-retract", "sync-retract"])
def test_every_configuration_decides_as_the_reference(tiny_model, make_engine, tiny_oracle, kwargs):
    engine = make_engine(tiny_model, **kwargs)
    first = _outs(engine)
    _verified(tiny_oracle, first)
    if kwargs.get("num_kv_pages") == 12:
        assert engine.get_load()["retractions"] > 0, "the small pool was meant to force retraction"
    # A second pass hits the prefix cache (when on) and retracts differently: still the reference's decisions.
    _verified(tiny_oracle, _outs(engine))


def test_batch_shapes_differ_only_at_near_ties(tiny_model, make_engine, tiny_oracle):
    """Default (power-of-two) row buckets: one request at a time vs all eight together; each run is checked
    against the reference, and where the two runs differ it must be after a near-tie (the forward is not bitwise
    batch-invariant on XLA:CPU: its matmuls pick kernels by row count)."""
    kw = dict(ENGINE_KW, shape_buckets=dict(ENGINE_KW["shape_buckets"], rows=None))  # default rows 1, 2, 4, ...
    single = make_engine(tiny_model, **dict(kw, max_running_requests=1))
    batched = make_engine(tiny_model, **kw)
    a = [single.generate(input_ids=list(p), sampling_params=GREEDY)["output_ids"] for p in PROMPTS]
    b = _outs(batched)
    verdicts = _verified(tiny_oracle, a) + _verified(tiny_oracle, b)
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            assert verdicts[i].near_tie_blocks or verdicts[len(PROMPTS) + i].near_tie_blocks, PROMPTS[i]


@pytest.mark.parametrize("schedule", ["fdfo", "sync"])
def test_folding_the_commit_forward_saves_a_forward_per_block(tiny_model, make_engine, tiny_oracle, schedule):
    folded = make_engine(tiny_model, schedule=schedule, fold_commit_forward=True, **ENGINE_KW)
    plain = make_engine(tiny_model, schedule=schedule, fold_commit_forward=False, **ENGINE_KW)
    prompt = PROMPTS[4]  # 28 tokens: 7 prompt blocks, then 4 blocks of output
    a = folded.generate(input_ids=prompt, sampling_params=GREEDY)
    b = plain.generate(input_ids=prompt, sampling_params=GREEDY)
    _verified(tiny_oracle, [a["output_ids"], b["output_ids"]], [prompt, prompt])
    blocks = -(-14 // 4)
    assert b["meta_info"]["forward_passes"] - a["meta_info"]["forward_passes"] == blocks
    # The folded blocks are cached after their refresh: a second run hits all complete blocks but the last.
    again = folded.generate(input_ids=prompt + a["output_ids"][:12], sampling_params=GREEDY)
    assert again["meta_info"]["cached_tokens"] == 40


def test_fdfo_call_runs_steps_until_its_first_row_is_done(tiny_model, make_engine, tiny_oracle):
    """FDFO loops on the device until the first row with something to decode is done: one request takes one
    denoise call per block; a batch takes fewer calls than steps; the decisions are the reference's either way
    and the forwards the same as one step per call (``max_steps_per_call=1``)."""
    looped = make_engine(tiny_model, chain_blocks=0, **ENGINE_KW)
    stepped = make_engine(tiny_model, max_steps_per_call=1, **ENGINE_KW)
    prompt = PROMPTS[0]  # 6 tokens: the prompt's tail block, then whole blocks
    a = looped.generate(input_ids=prompt, sampling_params=GREEDY)
    b = stepped.generate(input_ids=prompt, sampling_params=GREEDY)
    _verified(tiny_oracle, [a["output_ids"], b["output_ids"]], [prompt, prompt])
    assert a["meta_info"]["forward_passes"] == b["meta_info"]["forward_passes"]
    blocks = -(-(len(prompt) + 14) // 4) - len(prompt) // 4
    assert looped.scheduler.stats["denoise_calls"] == blocks
    assert stepped.scheduler.stats["denoise_calls"] == stepped.scheduler.stats["denoise_forwards"] > blocks
    calls = looped.scheduler.stats["denoise_calls"]
    _verified(tiny_oracle, _outs(looped))
    assert looped.scheduler.stats["denoise_calls"] - calls < looped.scheduler.stats["denoise_forwards"] - blocks


@pytest.mark.parametrize("fold,schedule", [(False, "fdfo"), (False, "sync"),
                                           pytest.param(True, "fdfo", marks=pytest.mark.slow)])
def test_chained_blocks_are_the_blocks_of_one_call_each(tiny_model, make_engine, tiny_oracle, fold, schedule):
    """Block chaining: a request that nothing waits on goes on into its next blocks inside one device call (FDFO;
    the synchronous schedule when the request runs alone). Same tokens and forwards as one block per call (greedy,
    seeded sampling, EOS and stop ids mid-block, max_new_tokens mid-block, the context length), fewer calls; a
    chain longer than its width resumes in the next call; every page comes back (the pages reserved for blocks a
    call did not start included)."""
    kw = dict(ENGINE_KW, fold_commit_forward=fold, schedule=schedule)
    chained = make_engine(tiny_model, chain_blocks=4, **kw)  # the default without folding: shared executables
    plain = make_engine(tiny_model, chain_blocks=0, **kw)
    sampled = {"max_new_tokens": 14, "ignore_eos": True, "temperature": 1.3, "seed": 11}
    ref = [e.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)["output_ids"] for e in (chained, plain)][1]
    cases = [(p, GREEDY) for p in PROMPTS[:3]] + [
        (PROMPTS[4], sampled), (PROMPTS[0], {"max_new_tokens": 9, "ignore_eos": True}),
        (PROMPTS[0], {"max_new_tokens": 14, "stop_token_ids": [ref[9]]}),
        (PROMPTS[4], {"max_new_tokens": 60, "ignore_eos": True})]  # the context length (64): 9 blocks, 2+ calls
    for prompt, params in cases:
        calls = [e.scheduler.stats["denoise_calls"] for e in (chained, plain)]
        links = chained.scheduler.stats["chained_blocks"]
        a = chained.generate(input_ids=prompt, sampling_params=params)
        b = plain.generate(input_ids=prompt, sampling_params=params)
        assert a["output_ids"] == b["output_ids"], params
        assert a["meta_info"]["finish_reason"] == b["meta_info"]["finish_reason"]
        chained_calls = chained.scheduler.stats["denoise_calls"] - calls[0]
        plain_calls = plain.scheduler.stats["denoise_calls"] - calls[1]
        # With folding, a block the request goes on from takes the exact-KV forward that folding would save.
        links = chained.scheduler.stats["chained_blocks"] - links
        assert plain.scheduler.stats["chained_blocks"] == 0 and (links > 0) == (chained_calls < plain_calls)
        extra = links if fold else 0
        assert a["meta_info"]["forward_passes"] == b["meta_info"]["forward_passes"] + extra, params
        if len(b["output_ids"]) > 8:  # three blocks or more: at least one chained
            assert chained_calls < plain_calls, params
        assert links <= 4 * chained_calls  # at most 4 blocks further per call
        chained.scheduler.check_pages()
    assert a["meta_info"]["finish_reason"]["type"] == "length" and len(a["output_ids"]) == 64 - 28
    _verified(tiny_oracle, [o["output_ids"] for o in chained.generate(input_ids=[PROMPTS[0]] * 2,
                                                                       sampling_params=GREEDY)],
              [PROMPTS[0]] * 2)


def test_streamed_requests_do_not_chain(tiny_model, make_engine):
    """A streamed request gets each block as it is committed, so it runs one block per call; a plain request of
    the same prompt chains."""
    engine = make_engine(tiny_model, **ENGINE_KW)
    calls = engine.scheduler.stats["denoise_calls"]
    chunks = list(engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, stream=True))
    streamed = engine.scheduler.stats["denoise_calls"] - calls
    assert streamed == len(chunks)
    engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
    assert engine.scheduler.stats["denoise_calls"] - calls - streamed < streamed


def test_cached_tokens_first_match_and_never_negative(tiny_model, make_engine):
    engine = make_engine(tiny_model, **ENGINE_KW)
    prompt = list(range(2, 20))  # 18 tokens: 4 complete blocks of 4
    cold = engine.generate(input_ids=prompt, sampling_params=GREEDY)
    assert cold["meta_info"]["cached_tokens"] == 0
    hot = engine.generate(input_ids=prompt, sampling_params=GREEDY)
    assert hot["meta_info"]["cached_tokens"] == 16
    assert hot["output_ids"] == cold["output_ids"]
    assert hot["meta_info"]["forward_passes"] < cold["meta_info"]["forward_passes"]


def test_choices_of_one_prompt_prefill_it_once(tiny_model, make_engine):
    """n samples of a prompt (RL rollouts, OpenAI n): the prompt's complete blocks are encoded once; the other
    requests wait a round and match them from the index."""
    engine = make_engine(tiny_model, **ENGINE_KW)
    prompt = list(range(2, 30))  # 7 complete blocks
    params = [{"max_new_tokens": 8, "ignore_eos": True, "temperature": 1.0, "seed": 5 + i} for i in range(4)]
    outs = engine.generate(input_ids=[prompt] * 4, sampling_params=params)
    assert sorted(o["meta_info"]["cached_tokens"] for o in outs) == [0, 28, 28, 28]
    assert engine.get_load()["prefill_forwards"] == 2  # 7 blocks in chunks of 4, for the first request only
    assert len({tuple(o["output_ids"]) for o in outs}) > 1  # own seeds, own samples


def test_cache_collision_with_literal_masks(tiny_model_b32, make_engine):
    """33-token prompt + 31 literal mask ids cached; the 33-token prompt alone matches exactly one block and its
    33rd token is decoded as prompt, not skipped."""
    prompt = [(7 * i) % 60 + 2 for i in range(33)]
    kw = dict(ENGINE_KW, context_length=128)
    engine = make_engine(tiny_model_b32, **kw)
    cold = make_engine(tiny_model_b32, enable_prefix_cache=False, **kw)
    expected = cold.generate(input_ids=prompt, sampling_params=GREEDY)
    engine.generate(input_ids=prompt + [M] * 31, sampling_params=GREEDY)
    out = engine.generate(input_ids=prompt, sampling_params=GREEDY)
    assert out["meta_info"]["cached_tokens"] == 32
    assert out["output_ids"] == expected["output_ids"]
    assert M not in out["output_ids"]


def test_literal_mask_prompts_keep_prompt_and_emit_no_mask(tiny_model, make_engine):
    engine = make_engine(tiny_model, **ENGINE_KW)
    for prompt in ([], [M, 2], [M, 2, M, 3], [M] * 7):
        out = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 6, "ignore_eos": True})
        assert len(out["output_ids"]) == 6 and M not in out["output_ids"]


def test_stop_conditions(tiny_model, make_engine):
    engine = make_engine(tiny_model, **ENGINE_KW)
    ref = engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)["output_ids"]
    # max_new_tokens inside a block: excess tokens of the block are dropped.
    out = engine.generate(input_ids=PROMPTS[0], sampling_params={"max_new_tokens": 5, "ignore_eos": True})
    assert out["output_ids"] == ref[:5] and out["meta_info"]["finish_reason"]["type"] == "length"
    # A stop token inside a block: tokens after it are dropped, the stop token is kept.
    stop = ref[6]
    out = engine.generate(input_ids=PROMPTS[0], sampling_params={"max_new_tokens": 14, "stop_token_ids": [stop]})
    cut = ref.index(stop)
    assert out["output_ids"] == ref[:cut + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    # A stop token that is also the last token max_new_tokens allows: a stop; one token too far: the length.
    stop = next(t for t in ref[2:] if ref.index(t) >= 2)
    cut = ref.index(stop)
    out = engine.generate(input_ids=PROMPTS[0], sampling_params={"max_new_tokens": cut + 1, "stop_token_ids": [stop]})
    assert out["output_ids"] == ref[:cut + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    out = engine.generate(input_ids=PROMPTS[0], sampling_params={"max_new_tokens": cut, "stop_token_ids": [stop]})
    assert out["output_ids"] == ref[:cut] and out["meta_info"]["finish_reason"]["type"] == "length"


def test_eos_stops_unless_ignored(tmp_path, make_engine, reference_outputs):
    from conftest import build_tiny_model

    eos = reference_outputs[0][6]  # a token the model writes mid-block for this prompt (same seed: same weights)
    model = build_tiny_model(tmp_path / "eos_model", eos=eos)
    engine = make_engine(model, **ENGINE_KW)
    ref = engine.generate(input_ids=PROMPTS[0], sampling_params={"max_new_tokens": 14, "ignore_eos": True})
    ref = ref["output_ids"]
    assert eos in ref
    out = engine.generate(input_ids=PROMPTS[0], sampling_params={"max_new_tokens": 14})
    assert out["output_ids"] == ref[:ref.index(eos) + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}


def test_abort_queued_and_running(tiny_model, make_engine):
    engine = make_engine(tiny_model, **dict(ENGINE_KW, max_running_requests=1))
    # long enough to be still running after two rounds although each call chains up to 4 blocks further
    reqs = [engine.make_request(list(p), {"max_new_tokens": 50, "ignore_eos": True}) for p in PROMPTS[:3]]
    for r in reqs:
        engine.submit(r)
    engine.step()
    engine.step()
    assert reqs[0].phase.value in ("prefill", "decode") and reqs[2].phase.value == "waiting"
    engine.abort(reqs[0].rid)  # running
    engine.abort(reqs[2].rid)  # queued
    engine.abort(reqs[2].rid)  # twice: no-op
    while engine.step():
        pass
    assert reqs[0].finish_reason["type"] == "abort" and reqs[2].finish_reason["type"] == "abort"
    assert reqs[1].finish_reason["type"] == "length" and len(reqs[1].output_ids) == 50


def test_streaming_chunks_are_committed_blocks(tiny_model, make_engine):
    engine = make_engine(tiny_model, **ENGINE_KW)
    full = engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
    chunks = list(engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, stream=True))
    assert sum((c["output_ids"] for c in chunks), []) == full["output_ids"]
    assert chunks[-1]["finished"] and not any(c["finished"] for c in chunks[:-1])
    assert all(0 < len(c["output_ids"]) <= 4 for c in chunks)


def test_provisional_stream_shows_the_block_and_adds_nothing(tiny_model, make_engine):
    """stream_provisional: after each step that leaves the block unfinished, a frame with the block's state
    (masks still in place where undecided); the committed chunks are the plain stream's, unchanged. (Provisional
    rows run one step per device call: the FDFO loop gives them back after every step.)"""
    engine = make_engine(tiny_model, **ENGINE_KW)
    plain = list(engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, stream=True))
    frames = list(engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, stream=True,
                                  stream_provisional=True))
    provisional = [f for f in frames if f.get("provisional")]
    committed = [f for f in frames if not f.get("provisional")]
    assert [c["output_ids"] for c in committed] == [c["output_ids"] for c in plain]
    assert provisional and all(f["output_ids"] == [] and f["text"] == "" for f in provisional)
    # a frame may show a block with nothing left masked: decided, before the forward that writes its exact KV
    assert any(any(f["block"]["masked"]) for f in provisional)
    for f in provisional:
        block = f["block"]
        assert len(block["tokens"]) == 4 and block["step"] >= 1
        assert all((t == M) for t, m in zip(block["tokens"], block["masked"]) if m)
        assert block["offset"] % 4 == 0


def test_stream_consumer_leaving_early_aborts(tiny_model, make_engine):
    engine = make_engine(tiny_model, **ENGINE_KW)
    stream = engine.generate(input_ids=PROMPTS[0], sampling_params={"max_new_tokens": 40, "ignore_eos": True},
                             stream=True)
    next(stream)
    stream.close()
    assert not engine.scheduler.running


def test_sampling_is_seeded_and_greedy_rows_unaffected(tiny_model, make_engine):
    engine = make_engine(tiny_model, **ENGINE_KW)
    sampled = {"max_new_tokens": 14, "ignore_eos": True, "temperature": 1.5, "seed": 7}
    a = engine.generate(input_ids=PROMPTS[4], sampling_params=sampled)["output_ids"]
    b = engine.generate(input_ids=PROMPTS[4], sampling_params=sampled)["output_ids"]
    c = engine.generate(input_ids=PROMPTS[4], sampling_params={**sampled, "seed": 8})["output_ids"]
    assert a == b and a != c
    greedy = _outs(engine)
    mixed = engine.generate(input_ids=[list(p) for p in PROMPTS],
                            sampling_params=[sampled if i % 2 else GREEDY for i in range(len(PROMPTS))])
    # Same shapes (one bucket), so a greedy row is bit-identical whatever shares its batch.
    for i, o in enumerate(mixed):
        if i % 2 == 0:
            assert o["output_ids"] == greedy[i]
    assert mixed[1]["output_ids"] != greedy[1] or mixed[3]["output_ids"] != greedy[3]
    assert all(M not in o["output_ids"] for o in mixed)


@pytest.mark.parametrize("bad, field", [
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"max_new_tokens": 10 ** 9}, "max_new_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -5}, "top_k"),
    ({"frequency": 1}, "frequency"),
    ({"stop_token_ids": [10 ** 6]}, "stop_token_ids"),
    ({"seed": "x"}, "seed"),
])
def test_bad_sampling_params(tiny_model, make_engine, bad, field):
    engine = make_engine(tiny_model, **ENGINE_KW)
    with pytest.raises(ValueError, match=field):
        engine.generate(input_ids=[2, 3], sampling_params=bad)
    assert engine.generate(input_ids=[2, 3], sampling_params=GREEDY)["output_ids"]  # still serving


def test_validated_params_are_kept_by_value_and_type(tiny_model, make_engine):
    """make_request validates a scalar params dict once and reuses it, but never for a value of another type
    that compares equal (True == 1, 1.0 == 1)."""
    engine = make_engine(tiny_model, **ENGINE_KW)
    a = engine.make_request([2, 3], {"max_new_tokens": 1, "top_k": 1})
    assert engine.make_request([2, 3], {"top_k": 1, "max_new_tokens": 1}).params is a.params
    for bad, field in (({"max_new_tokens": True, "top_k": 1}, "max_new_tokens"),
                       ({"max_new_tokens": 1, "top_k": 1.0}, "top_k")):
        with pytest.raises(ValueError, match=field):
            engine.make_request([2, 3], bad)
    stops = engine.make_request([2, 3], {"stop_token_ids": [5]})  # (lists are validated every time)
    assert stops.params.stop_token_ids == (5,) and stops.params is not a.params


@pytest.mark.parametrize("schedule", ["fdfo", "sync"])
def test_a_failed_device_call_fails_its_requests_and_keeps_every_page(tiny_model, make_engine, monkeypatch, schedule):
    """A device call that raises (a lost device, a runtime error) fails the requests in flight; the loop goes on
    serving and every page comes back, those reserved for blocks the failed call would have chained included."""
    from dllm_jax.engine import runner

    engine = make_engine(tiny_model, schedule=schedule, **ENGINE_KW)
    params = {"max_new_tokens": 40, "ignore_eos": True}
    ref = engine.generate(input_ids=PROMPTS[0], sampling_params=params)["output_ids"]
    real, calls = runner.denoise_packed, []

    def failing_second_call(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("device lost")
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "denoise_packed", failing_second_call)
    engine.start()
    failed = engine.generate(input_ids=PROMPTS[0], sampling_params=params)
    assert failed["meta_info"]["finish_reason"]["type"] == "abort"
    assert "device lost" in failed["meta_info"]["finish_reason"]["message"]
    assert engine.generate(input_ids=PROMPTS[0], sampling_params=params)["output_ids"] == ref
    engine.shutdown()
    engine.scheduler.check_pages()


def test_bad_inputs(tiny_model, make_engine):
    engine = make_engine(tiny_model, **dict(ENGINE_KW, context_length=32))
    with pytest.raises(ValueError, match=r"input_ids\[1\]"):
        engine.generate(input_ids=[2, 64])
    with pytest.raises(ValueError, match=r"input_ids\[0\]"):
        engine.generate(input_ids=[-1, 2])
    with pytest.raises(ValueError, match=r"input_ids\[1\]\[0\]"):
        engine.generate(input_ids=[[2], [99]])
    with pytest.raises(ValueError, match="context length"):
        engine.generate(input_ids=list(range(2, 40)))
    with pytest.raises(ValueError, match="prompt / input_ids"):
        engine.generate()
    with pytest.raises(ValueError, match="tokenizer"):
        engine.generate(prompt="hello")  # this model has no tokenizer
    # The context limit ends a long generation cleanly.
    out = engine.generate(input_ids=[2, 3], sampling_params={"max_new_tokens": 100, "ignore_eos": True})
    assert out["meta_info"]["finish_reason"]["type"] == "length" and len(out["output_ids"]) == 30


def test_bad_engine_options(tiny_model):
    from dllm_jax import Engine

    for kwargs, field in [({"algorithm": "Nope"}, "algorithm"), ({"algorithm_config": {"thresh": 1}}, "thresh"),
                          ({"schedule": "eager"}, "schedule"), ({"attention_backend": "cuda"}, "attention_backend"),
                          ({"num_kv_pages": 1}, "num_kv_pages"), ({"max_running_requests": 0}, "max_running"),
                          ({"shape_buckets": {"rows": (4,)}}, r"shape_buckets\.rows"),
                          ({"shape_buckets": {"width": (4,)}}, "shape_buckets"),
                          ({"shape_buckets": {"prefill_rows": (2, 4)}}, r"shape_buckets\.prefill_rows"),
                          ({"shape_buckets": {"pages": (2,)}}, r"shape_buckets\.pages")]:
        with pytest.raises(ValueError, match=field):
            Engine(tiny_model, **kwargs)


@pytest.mark.parametrize("field", ["attention_backend", "confidence_backend"])
def test_pallas_without_a_gpu_is_refused_at_construction(tiny_model, field):
    """Compiled Pallas kernels need a GPU: on CPU the engine refuses at construction, naming the field and the
    choices that work here, before reading any weight."""
    from dllm_jax import Engine

    with pytest.raises(ValueError, match=rf"{field}: 'pallas' needs a GPU .* auto, xla, pallas_interpret"):
        Engine(tiny_model, **{field: "pallas"})
    with pytest.raises(ValueError, match=field):
        Engine("/nonexistent/model/dir", **{field: "pallas"})  # refused before the (missing) model is read


def _random_traffic(engine, rng, batches, max_prompt):
    for batch in batches:
        prompts = [list(rng.integers(2, 60, size=rng.integers(0, max_prompt))) for _ in range(batch)]
        engine.generate(input_ids=[[int(t) for t in p] for p in prompts],
                        sampling_params={"max_new_tokens": int(rng.integers(1, 12)), "ignore_eos": True})


@pytest.mark.parametrize("kw, batches, max_prompt", [
    (dict(max_running_requests=2, context_length=32, max_prefill_tokens=8), (1, 3, 2, 4), 22),
    pytest.param(dict(max_running_requests=4, context_length=64, max_prefill_tokens=16), (1, 3, 4, 2, 7), 30,
                 marks=pytest.mark.slow),
], ids=["small", "wide"])
def test_no_recompilation_after_warmup(tiny_model, make_engine, kw, batches, max_prompt):
    """The default buckets: warm-up compiles every shape mixed traffic can reach, nothing compiles after it."""
    from dllm_jax.engine.compilation import compiled_executables

    engine = make_engine(tiny_model, **kw)
    engine.warmup()
    before = compiled_executables()
    _random_traffic(engine, np.random.default_rng(0), batches, max_prompt)
    assert compiled_executables() == before


def test_custom_buckets_compile_only_themselves(tiny_model, make_engine):
    engine = make_engine(tiny_model, **ENGINE_KW)
    assert engine.runner.num_buckets() == 2  # one denoise shape, one prefill shape
    assert engine.warmup() == 2


def test_pages_checked_after_mixed_run(tiny_model, make_engine):
    engine = make_engine(tiny_model, **dict(RETRACT_KW, max_running_requests=3))
    engine.generate(input_ids=[list(p) for p in PROMPTS], sampling_params=GREEDY)
    assert_pages_back(engine)


REFERENCE_ALGOS = [("LowConfidence", {}), ("JointThreshold", {}), ("JointThreshold", {"penalty_lambda": 1.0}),
                   ("EBSampling", {}), ("EntropyThreshold", {})]
ALGO_PROMPTS = [[M, 2], [M, 2, M, 3], [5, 6, 7, 8, 9, 10], [3, 4]]
ALGO_PARAMS = {"max_new_tokens": 10, "ignore_eos": True}


# In the default suite: the algorithms no other default test runs through the engine against the float64 reference
# (tests/test_reference_decisions.py has JointThreshold and EntropyThreshold); all of them with -m slow
SLOW_ALGOS = {("JointThreshold", False), ("EntropyThreshold", False)}


@pytest.mark.parametrize("name,config", [
    pytest.param(a, c, id=f"{a}{'+' if c else ''}", marks=pytest.mark.slow if (a, bool(c)) in SLOW_ALGOS else ())
    for a, c in REFERENCE_ALGOS])
def test_every_algorithm_decides_as_the_reference_in_both_schedules(tiny_model, make_engine, tiny_oracle, name,
                                                                     config):
    for schedule in ("fdfo", "sync"):
        engine = make_engine(tiny_model, algorithm=name, algorithm_config=config, schedule=schedule, **ENGINE_KW)
        outs = _outs(engine, ALGO_PROMPTS, ALGO_PARAMS)
        _verified(tiny_oracle, outs, ALGO_PROMPTS, 10, name, config)
        assert all(len(o) == 10 and M not in o for o in outs)


def test_joint_threshold_indel_same_in_both_schedules(tiny_model, make_engine):
    """No float64 reference exists for the InDel rule here, so the two schedules are compared with each other on
    prompts with a real prefix (an all-mask block without one is an exact tie, decided by rounding)."""
    config = {"delete_token_id": 61, "split_token_id": 62, "max_post_edit_steps": 3}
    prompts = [[M, 2, M, 3], [5, 6, 7, 8, 9, 10], [3, 4]]
    outs = []
    for schedule in ("fdfo", "sync"):
        engine = make_engine(tiny_model, algorithm="JointThresholdInDel", algorithm_config=config,
                             schedule=schedule, **ENGINE_KW)
        outs.append(_outs(engine, prompts, ALGO_PARAMS))
    assert outs[0] == outs[1]
    for o in outs[0]:
        assert len(o) == 10 and M not in o and not {61, 62} & set(o)


def test_sampled_joint_threshold_ignores_post_edit_budget(tiny_model, make_engine):
    params = {"max_new_tokens": 12, "ignore_eos": True, "temperature": 1.0, "seed": 3}
    outs = []
    for budget in (16, 64):
        engine = make_engine(tiny_model, algorithm="JointThreshold", algorithm_config={"max_post_edit_steps": budget},
                             **ENGINE_KW)
        outs.append(engine.generate(input_ids=PROMPTS[0], sampling_params=params)["output_ids"])
    assert outs[0] == outs[1]


def test_top_k_one_is_greedy(tiny_model, make_engine):
    engine = make_engine(tiny_model, **ENGINE_KW)
    greedy = engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)["output_ids"]
    out = engine.generate(input_ids=PROMPTS[0], sampling_params={**GREEDY, "temperature": 2.0, "top_k": 1})
    assert out["output_ids"] == greedy


def test_top_k_one_is_greedy_beside_a_sampled_row(tiny_model, make_engine):
    """A top-k 1 row is greedy (decode.rows.is_sampled) on the device too: batched beside a sampled row it still
    edits like a greedy row (JointThreshold's T2T edits skip sampled rows only), so its tokens are its own."""
    engine = make_engine(tiny_model, algorithm="JointThreshold", algorithm_config={"threshold": 0.9},
                         **ENGINE_KW)
    params = {**ALGO_PARAMS, "temperature": 2.0, "top_k": 1}
    alone = [engine.generate(input_ids=p, sampling_params=params)["output_ids"] for p in ALGO_PROMPTS[:2]]
    sampled = {**ALGO_PARAMS, "temperature": 1.0, "seed": 3}
    outs = engine.generate(input_ids=[ALGO_PROMPTS[0], ALGO_PROMPTS[2], ALGO_PROMPTS[1]],
                           sampling_params=[params, sampled, params])
    assert [outs[0]["output_ids"], outs[2]["output_ids"]] == alone


def _nucleus_reference(row_logits, k, p):
    """The kept set of one position's logits under top-k / top-p, from the sorted order (NumPy, float64)."""
    order = np.argsort(-row_logits, kind="stable")
    vocab = len(row_logits)
    k = vocab if k <= 0 else min(k, vocab)
    if k >= vocab and p >= 1:
        return np.ones(vocab, bool)
    top = row_logits[order[:k]]
    probs = np.exp(top - top.max())
    probs /= probs.sum()
    before = np.cumsum(probs) - probs
    cutoff = top[before < p].min()
    return row_logits >= cutoff


def test_top_k_top_p_filter_per_row_and_skipped_when_no_row_filters():
    """Each sampled row keeps its own top-k / nucleus whatever shares its call; rows with k off and p = 1, and greedy
    rows (their draw is not used), keep everything, and a call where no sampled row filters returns the logits
    untouched (the sort is skipped on the device)."""
    from dllm_jax.decode.step import _filter_top_k_top_p

    rng = np.random.default_rng(0)
    logits = rng.standard_normal((6, 3, 40)).astype(np.float32) * 3
    logits[2, 1, :10] = logits[2, 1, 0]  # ties at the top
    temperature = np.array([1.0, 1.0, 1.0, 1.0, 1.0, 0.0], np.float32)
    top_k = np.array([0, 5, 0, 40, 3, 2], np.int32)
    top_p = np.array([1.0, 1.0, 0.5, 1.0, 0.8, 0.5], np.float32)
    filt = jax.jit(_filter_top_k_top_p)
    args = [jnp.asarray(a) for a in (logits, temperature, top_k, top_p)]
    out = np.asarray(filt(*args))
    for r in range(6):
        alone = np.asarray(filt(*[a[r:r + 1] for a in args]))
        np.testing.assert_array_equal(out[r], alone[0])  # the same kept set in any batch
        for t in range(3):
            kept = np.isfinite(out[r, t])
            k, p = (top_k[r], top_p[r]) if temperature[r] > 0 else (0, 1.0)
            np.testing.assert_array_equal(kept, _nucleus_reference(logits[r, t].astype(np.float64), k, p))
            np.testing.assert_array_equal(out[r, t][kept], logits[r, t][kept])
    assert np.isfinite(out[[0, 3, 5]]).all()
    for off in ([np.ones(6, np.float32), np.zeros(6, np.int32), np.ones(6, np.float32)],  # sampled, filters off
                [np.zeros(6, np.float32), top_k, top_p]):  # greedy rows with filters set
        np.testing.assert_array_equal(np.asarray(filt(jnp.asarray(logits), *map(jnp.asarray, off))), logits)


@pytest.mark.parametrize("tie", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_pallas_backends_decide_as_the_reference_in_interpret_mode(tmp_path, make_engine, tie):
    """The Pallas kernels (interpret mode on CPU) through the whole engine decide as the float64 reference."""
    from conftest import build_tiny_model
    from oracle import Oracle

    model = build_tiny_model(tmp_path / "m", tie=tie)
    prompts = [list(p) for p in PROMPTS[:5]]
    params = {"max_new_tokens": 8, "ignore_eos": True}
    kw = dict(ENGINE_KW, max_running_requests=4, shape_buckets=dict(ENGINE_KW["shape_buckets"], rows=(8,)))
    pallas = make_engine(model, attention_backend="pallas_interpret", confidence_backend="pallas_interpret", **kw)
    Oracle(model).verify_all(prompts, _outs(pallas, prompts, params), 8)


def test_kv_pool_is_updated_in_place(tiny_model, make_engine):
    """The page pool is donated to every step: the same device buffers come back, the old handles are dead."""
    import warnings

    engine = make_engine(tiny_model, **ENGINE_KW)
    engine.generate(input_ids=PROMPTS[0], sampling_params={"max_new_tokens": 4, "ignore_eos": True})  # compile
    before = engine.runner.kv_pages
    pointers = [(k.unsafe_buffer_pointer(), v.unsafe_buffer_pointer()) for k, v in before]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Some donated buffers were not usable" would mean a copy per step
        engine.generate(input_ids=PROMPTS[4], sampling_params={"max_new_tokens": 8, "ignore_eos": True})
    after = engine.runner.kv_pages
    assert [(k.unsafe_buffer_pointer(), v.unsafe_buffer_pointer()) for k, v in after] == pointers
    assert all(k.is_deleted() and v.is_deleted() for k, v in before)
