"""The engine end to end on a tiny random model (CPU, float32): token identity across every way of running."""

import numpy as np
import pytest

from conftest import TINY_MASK_ID, assert_pages_back
from naive_reference import NaiveDecoder

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


@pytest.fixture(scope="module")
def naive_outputs(tiny_model):
    dec = NaiveDecoder(tiny_model)
    return [dec.generate(p, 14)[0] for p in PROMPTS]


def _outs(engine, prompts=PROMPTS, params=GREEDY):
    return [o["output_ids"] for o in engine.generate(input_ids=[list(p) for p in prompts], sampling_params=params)]


@pytest.mark.parametrize("schedule", ["fdfo", "sync"])
def test_batch_equals_naive_reference(tiny_model, make_engine, naive_outputs, schedule):
    engine = make_engine(tiny_model, schedule=schedule, max_running_requests=8)
    assert _outs(engine) == naive_outputs


@pytest.mark.parametrize("kwargs", [
    dict(schedule="fdfo", enable_prefix_cache=False, max_running_requests=1),
    dict(schedule="fdfo", max_running_requests=8, fold_commit_forward=False),  # SGLang's forward count
    dict(schedule="sync", max_running_requests=2, max_prefill_tokens=4),  # one block per prefill forward
    dict(schedule="fdfo", max_running_requests=8, num_kv_pages=12),  # forces retraction
    dict(schedule="sync", max_running_requests=8, num_kv_pages=12),
])
def test_token_identity_across_configurations(tiny_model, make_engine, naive_outputs, kwargs):
    engine = make_engine(tiny_model, **kwargs)
    assert _outs(engine) == naive_outputs
    if kwargs.get("num_kv_pages"):
        assert engine.get_load()["retractions"] > 0, "the small pool was meant to force retraction"
    # A second pass hits the prefix cache (when on) and must not change a token.
    assert _outs(engine) == naive_outputs


@pytest.mark.parametrize("schedule", ["fdfo", "sync"])
def test_folding_the_commit_forward_saves_a_forward_per_block(tiny_model, make_engine, naive_outputs, schedule):
    folded = make_engine(tiny_model, schedule=schedule, max_running_requests=1)
    plain = make_engine(tiny_model, schedule=schedule, max_running_requests=1, fold_commit_forward=False)
    prompt = PROMPTS[4]  # 28 tokens: 7 prompt blocks, then 4 blocks of output
    a = folded.generate(input_ids=prompt, sampling_params=GREEDY)
    b = plain.generate(input_ids=prompt, sampling_params=GREEDY)
    assert a["output_ids"] == b["output_ids"] == naive_outputs[4]
    blocks = -(-14 // 4)
    assert b["meta_info"]["forward_passes"] - a["meta_info"]["forward_passes"] == blocks
    # The folded blocks are cached after their refresh: a second run hits all complete blocks but the last.
    again = folded.generate(input_ids=prompt + a["output_ids"][:12], sampling_params=GREEDY)
    assert again["meta_info"]["cached_tokens"] == 40


def test_cached_tokens_first_match_and_never_negative(tiny_model, make_engine):
    engine = make_engine(tiny_model, max_running_requests=4)
    prompt = list(range(2, 20))  # 18 tokens: 4 complete blocks of 4
    cold = engine.generate(input_ids=prompt, sampling_params=GREEDY)
    assert cold["meta_info"]["cached_tokens"] == 0
    hot = engine.generate(input_ids=prompt, sampling_params=GREEDY)
    assert hot["meta_info"]["cached_tokens"] == 16
    assert hot["output_ids"] == cold["output_ids"]
    assert hot["meta_info"]["forward_passes"] < cold["meta_info"]["forward_passes"]


def test_cache_collision_with_literal_masks(tiny_model_b32, make_engine):
    """33-token prompt + 31 literal mask ids cached; the 33-token prompt alone matches exactly one block and its
    33rd token is decoded as prompt, not skipped."""
    prompt = [(7 * i) % 60 + 2 for i in range(33)]
    engine = make_engine(tiny_model_b32, max_running_requests=2)
    cold = make_engine(tiny_model_b32, max_running_requests=2, enable_prefix_cache=False)
    expected = cold.generate(input_ids=prompt, sampling_params=GREEDY)
    engine.generate(input_ids=prompt + [M] * 31, sampling_params=GREEDY)
    out = engine.generate(input_ids=prompt, sampling_params=GREEDY)
    assert out["meta_info"]["cached_tokens"] == 32
    assert out["output_ids"] == expected["output_ids"]
    assert M not in out["output_ids"]


def test_literal_mask_prompts_keep_prompt_and_emit_no_mask(tiny_model, make_engine):
    engine = make_engine(tiny_model)
    for prompt in ([], [M, 2], [M, 2, M, 3], [M] * 7):
        out = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 6, "ignore_eos": True})
        assert len(out["output_ids"]) == 6 and M not in out["output_ids"]


def test_stop_conditions(tiny_model, make_engine, naive_outputs):
    engine = make_engine(tiny_model)
    ref = naive_outputs[0]
    # max_new_tokens inside a block: excess tokens of the block are dropped.
    out = engine.generate(input_ids=PROMPTS[0], sampling_params={"max_new_tokens": 5, "ignore_eos": True})
    assert out["output_ids"] == ref[:5] and out["meta_info"]["finish_reason"]["type"] == "length"
    # A stop token inside a block: tokens after it are dropped, the stop token is kept.
    stop = ref[6]
    out = engine.generate(input_ids=PROMPTS[0], sampling_params={"max_new_tokens": 14, "stop_token_ids": [stop]})
    cut = ref.index(stop)
    assert out["output_ids"] == ref[:cut + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_eos_stops_unless_ignored(tmp_path, make_engine, naive_outputs):
    from conftest import build_tiny_model

    eos = naive_outputs[0][6]  # a token the model writes mid-block for this prompt
    model = build_tiny_model(tmp_path / "eos_model", eos=eos)
    engine = make_engine(model)
    out = engine.generate(input_ids=PROMPTS[0], sampling_params={"max_new_tokens": 14})
    assert out["output_ids"] == naive_outputs[0][:naive_outputs[0].index(eos) + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
    ignored = engine.generate(input_ids=PROMPTS[0], sampling_params={"max_new_tokens": 14, "ignore_eos": True})
    assert ignored["output_ids"] == naive_outputs[0]


def test_abort_queued_and_running(tiny_model, make_engine):
    engine = make_engine(tiny_model, max_running_requests=1)
    reqs = [engine.make_request(list(p), {"max_new_tokens": 30, "ignore_eos": True}) for p in PROMPTS[:3]]
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
    assert reqs[1].finish_reason["type"] == "length" and len(reqs[1].output_ids) == 30


def test_streaming_chunks_are_committed_blocks(tiny_model, make_engine):
    engine = make_engine(tiny_model)
    full = engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
    chunks = list(engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, stream=True))
    assert sum((c["output_ids"] for c in chunks), []) == full["output_ids"]
    assert chunks[-1]["finished"] and not any(c["finished"] for c in chunks[:-1])
    assert all(0 < len(c["output_ids"]) <= 4 for c in chunks)


def test_stream_consumer_leaving_early_aborts(tiny_model, make_engine):
    engine = make_engine(tiny_model)
    stream = engine.generate(input_ids=PROMPTS[0], sampling_params={"max_new_tokens": 40, "ignore_eos": True},
                             stream=True)
    next(stream)
    stream.close()
    assert not engine.scheduler.running


def test_sampling_is_seeded_and_greedy_rows_unaffected(tiny_model, make_engine, naive_outputs):
    engine = make_engine(tiny_model, max_running_requests=8)
    sampled = {"max_new_tokens": 14, "ignore_eos": True, "temperature": 1.5, "seed": 7}
    a = engine.generate(input_ids=PROMPTS[4], sampling_params=sampled)["output_ids"]
    b = engine.generate(input_ids=PROMPTS[4], sampling_params=sampled)["output_ids"]
    c = engine.generate(input_ids=PROMPTS[4], sampling_params={**sampled, "seed": 8})["output_ids"]
    assert a == b and a != c
    mixed = engine.generate(input_ids=[list(p) for p in PROMPTS],
                            sampling_params=[sampled if i % 2 else GREEDY for i in range(len(PROMPTS))])
    for i, o in enumerate(mixed):
        if i % 2 == 0:
            assert o["output_ids"] == naive_outputs[i]
    assert mixed[1]["output_ids"] != naive_outputs[1] or mixed[3]["output_ids"] != naive_outputs[3]
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
    engine = make_engine(tiny_model)
    with pytest.raises(ValueError, match=field):
        engine.generate(input_ids=[2, 3], sampling_params=bad)
    assert engine.generate(input_ids=[2, 3], sampling_params=GREEDY)["output_ids"]  # still serving


def test_bad_inputs(tiny_model, make_engine):
    engine = make_engine(tiny_model, context_length=32)
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
                          ({"num_kv_pages": 1}, "num_kv_pages"), ({"max_running_requests": 0}, "max_running")]:
        with pytest.raises(ValueError, match=field):
            Engine(tiny_model, **kwargs)


def test_no_recompilation_after_warmup(tiny_model, make_engine):
    from dllm_jax.engine.runner import ModelRunner

    engine = make_engine(tiny_model, max_running_requests=4, context_length=64, max_prefill_tokens=16)
    engine.warmup()
    before = ModelRunner.compiled_executables()
    rng = np.random.default_rng(0)
    for batch in (1, 3, 4, 2, 7):
        prompts = [list(rng.integers(2, 60, size=rng.integers(0, 30))) for _ in range(batch)]
        engine.generate(input_ids=[[int(t) for t in p] for p in prompts],
                        sampling_params={"max_new_tokens": int(rng.integers(1, 20)), "ignore_eos": True})
    assert ModelRunner.compiled_executables() == before


def test_pages_checked_after_mixed_run(tiny_model, make_engine):
    engine = make_engine(tiny_model, max_running_requests=3, num_kv_pages=10)
    engine.generate(input_ids=[list(p) for p in PROMPTS], sampling_params=GREEDY)
    assert_pages_back(engine)


ALGOS = [("LowConfidence", {}), ("JointThreshold", {}), ("JointThreshold", {"penalty_lambda": 1.0}),
         ("EBSampling", {}), ("EntropyThreshold", {}),
         ("JointThresholdInDel", {"delete_token_id": 61, "split_token_id": 62, "max_post_edit_steps": 3})]


@pytest.mark.parametrize("name,config", ALGOS, ids=[f"{a}{'+' if c else ''}" for a, c in ALGOS])
def test_every_algorithm_same_in_both_schedules(tiny_model, make_engine, name, config):
    prompts = [[M, 2], [M, 2, M, 3], [5, 6, 7, 8, 9, 10], [3, 4]]
    params = {"max_new_tokens": 10, "ignore_eos": True}
    fdfo = make_engine(tiny_model, algorithm=name, algorithm_config=config, schedule="fdfo")
    sync = make_engine(tiny_model, algorithm=name, algorithm_config=config, schedule="sync")
    a = fdfo.generate(input_ids=prompts, sampling_params=params)
    b = sync.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in a] == [o["output_ids"] for o in b]
    for o in a:
        assert len(o["output_ids"]) == 10 and M not in o["output_ids"]
        if name == "JointThresholdInDel":
            assert not {61, 62} & set(o["output_ids"])


def test_sampled_joint_threshold_ignores_post_edit_budget(tiny_model, make_engine):
    params = {"max_new_tokens": 12, "ignore_eos": True, "temperature": 1.0, "seed": 3}
    outs = []
    for budget in (16, 64):
        engine = make_engine(tiny_model, algorithm="JointThreshold", algorithm_config={"max_post_edit_steps": budget})
        outs.append(engine.generate(input_ids=PROMPTS[0], sampling_params=params)["output_ids"])
    assert outs[0] == outs[1]


def test_top_k_one_is_greedy(tiny_model, make_engine, naive_outputs):
    engine = make_engine(tiny_model)
    out = engine.generate(input_ids=PROMPTS[0], sampling_params={**GREEDY, "temperature": 2.0, "top_k": 1})
    assert out["output_ids"] == naive_outputs[0]


@pytest.mark.parametrize("tie", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_pallas_backends_token_identical_in_interpret_mode(tmp_path, make_engine, tie):
    """The Pallas kernels (interpret mode on CPU) give the XLA path's tokens through the whole engine."""
    from conftest import build_tiny_model

    model = build_tiny_model(tmp_path / "m", tie=tie)
    prompts = [list(p) for p in PROMPTS[:5]]
    params = {"max_new_tokens": 8, "ignore_eos": True}
    xla = make_engine(model, attention_backend="xla", confidence_backend="xla", max_running_requests=4)
    pallas = make_engine(model, attention_backend="pallas_interpret", confidence_backend="pallas_interpret",
                         max_running_requests=4)
    assert [o["output_ids"] for o in pallas.generate(input_ids=prompts, sampling_params=params)] == \
        [o["output_ids"] for o in xla.generate(input_ids=prompts, sampling_params=params)]


def test_kv_pool_is_updated_in_place(tiny_model, make_engine):
    """The page pool is donated to every step: the same device buffers come back, the old handles are dead."""
    import warnings

    engine = make_engine(tiny_model, max_running_requests=2)
    engine.generate(input_ids=PROMPTS[0], sampling_params={"max_new_tokens": 4, "ignore_eos": True})  # compile
    before = engine.runner.kv_pages
    pointers = [(k.unsafe_buffer_pointer(), v.unsafe_buffer_pointer()) for k, v in before]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Some donated buffers were not usable" would mean a copy per step
        engine.generate(input_ids=PROMPTS[4], sampling_params={"max_new_tokens": 8, "ignore_eos": True})
    after = engine.runner.kv_pages
    assert [(k.unsafe_buffer_pointer(), v.unsafe_buffer_pointer()) for k, v in after] == pointers
    assert all(k.is_deleted() and v.is_deleted() for k, v in before)
