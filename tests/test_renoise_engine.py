"""DiffusionGemma through the engine: the renoise scheduler's answers equal the batch loop's (which replays
transformers exactly, tests/test_renoise.py), whatever the schedule, the batch, retractions; pages are exact after
every run; options that do not apply (or out of range) are refused naming them."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

import dllm_jax  # noqa: E402
from dllm_jax.decode import renoise  # noqa: E402
from dllm_jax.decode.renoise_loop import RenoiseLoop  # noqa: E402
from dllm_jax.model.loader import load_model  # noqa: E402
from dllm_jax.testing.diffusion_gemma import FULL, SLIDING, write_tiny_diffusion_gemma  # noqa: E402
from dllm_jax.testing.tokenizer_files import write_gemma_tokenizer  # noqa: E402

STEPS = 5
PROMPTS = [[5, 17, 3, 88, 41, 9, 60, 2, 33, 71, 12], [7, 7, 30, 4, 11], [9, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,
                                                                         13, 14, 15, 16, 17, 18, 19, 20, 21]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("dg")
    # window 6 < prompts: the sliding pool gives pages back as the context grows
    # a Gemma-style tokenizer (its chat template; vocabulary 405, EOS <eos> / <end_of_turn>)
    ids = write_gemma_tokenizer(str(path))
    write_tiny_diffusion_gemma(path, canvas_length=4, sliding_window=6, tie=False, num_hidden_layers=2,
                               layer_types=[SLIDING, FULL], vocab_size=405,  # two layers: half the compile time
                               eos_token_id=[ids["<eos>"], ids["<end_of_turn>"]])
    return str(path)


@pytest.fixture(scope="module")
def reference(model_dir):
    loaded = load_model(model_dir)
    loop = RenoiseLoop(loaded.params, loaded.config, renoise.RenoiseConfig(max_denoising_steps=STEPS))
    return {i: loop.generate([p], [10], [40 + i])[0] for i, p in enumerate(PROMPTS)}


def _engine(model_dir, **kw):
    return dllm_jax.Engine(model_path=model_dir, warmup=False, algorithm_config={"max_denoising_steps": STEPS}, **kw)


@pytest.fixture(scope="module")
def fdfo(model_dir):
    engine = _engine(model_dir, max_running_requests=2)
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("schedule", ["fdfo", "sync"])
def test_engine_answers_equal_the_loop(model_dir, reference, schedule, fdfo):
    engine = fdfo if schedule == "fdfo" else _engine(model_dir, schedule=schedule, max_running_requests=2)
    try:
        outs = engine.generate(input_ids=PROMPTS, sampling_params=[
            {"max_new_tokens": 10, "seed": 40 + i, "ignore_eos": True} for i in range(len(PROMPTS))])
        for i, out in enumerate(outs):
            assert out["output_ids"] == reference[i].output_ids  # 10 tokens: the third canvas cut at 2
            assert out["meta_info"]["finish_reason"]["type"] == "length"
        engine.scheduler.check_pages()
        held_full, held_sliding = engine.scheduler.policy.index.held()  # what the prefix cache keeps; the rest is free
        assert engine.scheduler.policy.full.num_free + len(held_full) == engine.scheduler.policy.full.capacity
        assert engine.scheduler.policy.sliding.num_free + len(held_sliding) == engine.scheduler.policy.sliding.capacity
        info = engine.get_model_info()
        assert info["algorithm"] == "Gemma4Renoise" and info["canvas_length"] == 4
        assert info["algorithm_config"]["max_denoising_steps"] == STEPS
    finally:
        if engine is not fdfo:
            engine.shutdown()


def test_host_overlap_encodes_arrivals_while_a_canvas_runs(reference, fdfo):
    """Host overlap as for every family (engine/rounds.py): requests that arrive while a denoise call runs are
    admitted and encoded before that call is read (``Scheduler.schedule_ahead``), with the loop's answers."""
    engine, scheduler = fdfo, fdfo.scheduler
    assert engine.host_overlap
    plan, planned, late = scheduler.schedule_ahead, [], []

    def schedule_ahead():
        call = plan()
        planned.extend([len(r.real_ids) for r in call.reqs] if call is not None else [])
        return call

    def params(i):
        return {"max_new_tokens": 10, "seed": 40 + i, "ignore_eos": True}

    def on_event(req, event):  # FIRST's first event: delivered while its next denoise call runs
        if not late:
            late.extend(engine.submit(engine.make_request(PROMPTS[i], params(i))) for i in (1, 2))

    scheduler.schedule_ahead = schedule_ahead
    try:
        first = engine.submit(engine.make_request(PROMPTS[0], params(0), on_event=on_event, provisional=True))
        for _ in range(2000):
            if not engine.step():
                break
    finally:
        del scheduler.schedule_ahead
    assert planned and planned[0] == len(PROMPTS[1])  # one slot was free: the first arrival encoded meanwhile
    assert [r.output_ids for r in [first, *late]] == [reference[i].output_ids for i in range(3)]
    engine.scheduler.check_pages()


@pytest.mark.parametrize("lost", ["state", "pool"])
def test_a_call_that_loses_its_buffers_fails_its_requests_and_the_engine_serves_on(model_dir, reference, fdfo,
                                                                                  monkeypatch, lost):
    """A denoise call that raises after it took the donated per-slot state, or an encode after it took the KV
    pool: the running requests fail, the prefix index is emptied, fresh buffers replace the lost ones (as the
    mask runner's pool) and the next requests get the loop's answers."""
    import jax

    engine, runner = fdfo, fdfo.runner
    engine.generate(input_ids=PROMPTS[2], sampling_params={"max_new_tokens": 4, "seed": 1})  # a page cached
    name, arg = ("_denoise", 1) if lost == "state" else ("_encode", "kv_pages")
    real = getattr(runner, name)

    def failing(*args, **kwargs):
        for x in jax.tree.leaves(args[arg] if isinstance(arg, int) else kwargs[arg]):
            x.delete()
        raise RuntimeError("device lost mid-call")

    monkeypatch.setattr(runner, name, failing)
    params = [{"max_new_tokens": 10, "seed": 40 + i, "ignore_eos": True} for i in range(3)]
    failed = engine.generate(input_ids=[PROMPTS[0], PROMPTS[1]], sampling_params=params[:2])
    assert all(o["meta_info"]["finish_reason"]["type"] == "abort" for o in failed)
    assert engine.scheduler.policy.index.held() == ([], [])
    engine.scheduler.check_pages()
    monkeypatch.setattr(runner, name, real)
    outs = engine.generate(input_ids=PROMPTS, sampling_params=params)
    assert [o["output_ids"] for o in outs] == [reference[i].output_ids for i in range(3)]
    engine.scheduler.check_pages()


def test_retraction_keeps_the_answers(model_dir, fdfo):
    """A full-layer pool of 3 usable pages (16 tokens each) cannot hold two requests growing to 35 and 29 tokens:
    the newer one is retracted, re-admitted later, and both answers are those of an engine with room."""
    params = [{"max_new_tokens": 24, "seed": 7 + i, "ignore_eos": True} for i in range(2)]
    want = [o["output_ids"] for o in fdfo.generate(input_ids=PROMPTS[:2], sampling_params=params)]
    engine = _engine(model_dir, max_running_requests=2, num_kv_pages=4)
    try:
        outs = engine.generate(input_ids=PROMPTS[:2], sampling_params=params)
        assert [o["output_ids"] for o in outs] == want and all(len(w) == 24 for w in want)
        assert engine.scheduler.stats["retractions"] > 0
        engine.scheduler.check_pages()
    finally:
        engine.shutdown()


def test_stream_logprobs_and_refusals(model_dir, reference, fdfo):
    engine = fdfo
    try:
        chunks = list(engine.generate(input_ids=PROMPTS[0], stream=True, return_logprob=True,
                                      sampling_params={"max_new_tokens": 10, "seed": 40, "ignore_eos": True}))
        assert [len(c["output_ids"]) for c in chunks if c["output_ids"]] == [4, 4, 2]  # one chunk per canvas
        assert sum((c["output_ids"] for c in chunks), []) == reference[0].output_ids
        lps = chunks[-1]["meta_info"]["output_token_logprobs"]
        assert [t for _, t, _ in lps] == reference[0].output_ids
        assert all(lp <= 0 for lp, _, _ in lps)
        for bad in ({"presence_penalty": 2.5}, {"min_new_tokens": 5}, {"logit_bias": {"3": 101.0}},
                    {"top_logprobs_num": 21}):  # out of range (the options themselves: tests/test_renoise_sampling.py)
            with pytest.raises(ValueError, match=next(iter(bad))):
                engine.generate(input_ids=PROMPTS[0], sampling_params=dict(bad, max_new_tokens=4))
        engine.scheduler.check_pages()
        # the RL calls are the SDAR / LLaDA2 engine's: refused by name, nothing changed
        for name, call in (("update_weights_from_tensor", lambda: engine.update_weights_from_tensor({})),
                           ("update_weights_from_disk", lambda: engine.update_weights_from_disk(str(model_dir))),
                           ("pause_generation", lambda: engine.pause_generation("retract")),
                           ("release_memory_occupation", lambda: engine.release_memory_occupation()),
                           ("score", lambda: engine.score(input_ids=PROMPTS[0], completions=[[5, 6]]))):
            with pytest.raises(NotImplementedError, match=name):
                call()
        assert engine.generate(input_ids=PROMPTS[0], sampling_params={"max_new_tokens": 10, "seed": 40,
                                                                       "ignore_eos": True})["output_ids"] \
            == reference[0].output_ids
    finally:
        pass
    with pytest.raises(ValueError, match="algorithm.*Gemma4Renoise"):
        dllm_jax.Engine(model_path=model_dir, warmup=False, algorithm="LowConfidence")
    with pytest.raises(ValueError, match="sampler_config.entropy_bound"):
        dllm_jax.Engine(model_path=model_dir, warmup=False, algorithm_config={"sampler_config": {"entropy_bound": -1}})


def _sse(text: str) -> list:
    import json

    return [e if e == "[DONE]" else json.loads(e) for line in text.splitlines() if line.startswith("data: ")
            for e in [line[len("data: "):]]]


def test_served_over_http(fdfo):
    """``dllm-jax serve`` on a DiffusionGemma directory: /generate (text, the tokenizer's), OpenAI chat with the
    Gemma chat template, streaming one chunk per canvas with provisional frames (the argmax canvas after each
    step) between them, get_model_info with the family and the algorithm's settings."""
    from fastapi.testclient import TestClient

    from serve import ServerSettings, create_app

    app = create_app(fdfo, ServerSettings(), own_engine=False)
    with TestClient(app, base_url="http://localhost") as client:
        info = client.get("/get_model_info").json()
        assert info["family"] == "diffusion_gemma" and info["canvas_length"] == 4
        assert info["algorithm"] == "Gemma4Renoise" and info["algorithm_config"]["stopping_config"] == {
            "confidence_threshold": 0.005, "stability_threshold": 1}
        body = {"text": "hello world", "sampling_params": {"max_new_tokens": 8, "seed": 3, "ignore_eos": True}}
        whole = client.post("/generate", json=body).json()
        assert len(whole["output_ids"]) == 8 and isinstance(whole["text"], str)
        events = _sse(client.post("/generate", json={**body, "stream": True, "stream_provisional": True}).text)
        assert events[-1] == "[DONE]"
        committed = [e["output_ids"] for e in events[:-1] if not e["meta_info"]["provisional"]]
        provisional = [e["meta_info"]["block"] for e in events[:-1] if e["meta_info"]["provisional"]]
        # (SGLang's streaming: each chunk carries the output so far) one chunk per finished canvas
        assert committed[-1] == whole["output_ids"] and [len(c) for c in committed if c] == [4, 8]
        assert provisional and all(len(b["tokens"]) == 4 and not any(b["masked"]) for b in provisional)
        prompt = whole["meta_info"]["prompt_tokens"]
        assert {b["offset"] for b in provisional} == {prompt, prompt + 4}  # the canvases' first positions
        chat = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "tell me a story"}], "max_tokens": 8, "seed": 5})
        assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] <= 8
        bad = client.post("/generate", json={"text": "hi", "sampling_params": {"frequency_penalty": 3.0}})
        assert bad.status_code == 400 and "frequency_penalty" in bad.text
        # errors name the client's field (issue 49: top_logprobs_num for top_logprobs), the engine's own checks
        # (min_new_tokens against max_new_tokens) as the schema's; this family takes these options now
        chat = [{"role": "user", "content": "hi"}]
        for path, body, param in (
                ("/generate", {"text": "hi", "sampling_params": {"frequency_penalty": 3.0}},
                 "sampling_params.frequency_penalty"),
                ("/generate", {"text": ["hi", "yo"], "sampling_params": [{}, {"min_new_tokens": 3,
                                                                            "max_new_tokens": 2}]},
                 "sampling_params[1].min_new_tokens"),
                ("/v1/chat/completions", {"messages": chat, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                ("/v1/chat/completions", {"messages": chat, "min_tokens": 5, "max_tokens": 2}, "min_tokens"),
                ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs")):
            r = client.post(path, json=body)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == param and err["message"].startswith(param + ":"), (path, err)
    fdfo.scheduler.check_pages()


def test_prefix_reuse_is_exact(model_dir, fdfo):
    """A prompt whose first page(s) another request encoded reuses them (the encoder is causal: the same K/V) and
    answers exactly as with the cache off; a follow-up turn reuses the first turn's prompt and answer."""
    prompt = PROMPTS[2]  # 22 tokens: one complete page of 16
    params = {"max_new_tokens": 8, "seed": 9, "ignore_eos": True}
    fdfo.flush_cache()
    first = fdfo.generate(input_ids=prompt, sampling_params=params)
    second = fdfo.generate(input_ids=prompt, sampling_params=params)
    assert first["meta_info"]["cached_tokens"] == 0 and second["meta_info"]["cached_tokens"] == 16
    assert second["output_ids"] == first["output_ids"]
    follow = prompt + first["output_ids"] + [3, 1, 4, 1, 5]  # 35 tokens: pages 0 and 1 were encoded before
    turn = fdfo.generate(input_ids=follow, sampling_params=params)
    assert turn["meta_info"]["cached_tokens"] == 16
    cold = _engine(model_dir, max_running_requests=2, enable_prefix_cache=False)
    try:
        assert cold.generate(input_ids=follow, sampling_params=params)["output_ids"] == turn["output_ids"]
        assert cold.generate(input_ids=prompt, sampling_params=params)["output_ids"] == first["output_ids"]
    finally:
        cold.shutdown()
    fdfo.scheduler.check_pages()
    assert fdfo.get_load()["kv_pages_cached"] > 0


def test_abort_and_stop_strings(fdfo):
    """An aborted stream ends with finish_reason abort and gives its pages back; a stop string cuts the answer
    where the same seeded answer without it had that text."""
    params = {"max_new_tokens": 40, "seed": 11, "ignore_eos": True}
    stream = fdfo.generate(input_ids=PROMPTS[1], stream=True, rid="renoise-abort", sampling_params=params)
    next(stream)
    fdfo.abort("renoise-abort")
    last = list(stream)[-1]
    assert last["finished"] and last["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(last["output_ids"]) < 40
    whole = fdfo.generate(input_ids=PROMPTS[1], sampling_params=dict(params, max_new_tokens=12))
    text = whole["text"]
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip()
    cut = fdfo.generate(input_ids=PROMPTS[1], sampling_params=dict(params, max_new_tokens=12, stop=[stop]))
    assert cut["meta_info"]["finish_reason"]["type"] == "stop" and stop not in cut["text"]
    assert text.startswith(cut["text"]) and len(cut["text"]) <= text.index(stop)
    fdfo.scheduler.check_pages()


def test_warmup_compiles_every_bucket_traffic_needs(model_dir, reference):
    """DiffusionGemma's shape buckets: warm-up compiles them (denoise at every row count and page-table width,
    encodes of one row at every chunk, of several canvases at once), and mixed traffic then compiles nothing in
    line; an encode of several prompts, a shape warm-up leaves out, compiles on the background thread while the
    prompts encode one at a time, with the same answers."""
    from dllm_jax.engine.compilation import compiled_executables

    # two slots (denoise rows 1 and 2: each row bucket multiplies the denoise compiles), up to four requests
    engine = _engine(model_dir, max_running_requests=2, context_length=64, max_prefill_tokens=32)
    try:
        assert engine.warmup() == engine.runner.num_buckets() == len(set(engine.runner.buckets())) > 0
        assert {k.rows for k in engine.runner.buckets() if k.kind == "canvas"} == {1, 2}
        ran, record = [], engine.runner.compiler.ran
        engine.runner.compiler.ran = lambda key: (ran.append(key), record(key))
        before = compiled_executables()
        rng = __import__("numpy").random.default_rng(0)
        for _ in range(3):  # canvases finishing alone and together, chunked prompts, cache hits
            k = int(rng.integers(1, 5))
            prompts = [PROMPTS[int(i)] for i in rng.integers(0, len(PROMPTS), k)]
            engine.generate(input_ids=prompts, sampling_params=[{"max_new_tokens": int(rng.integers(1, 20)), "seed": i,
                                                                 "ignore_eos": True} for i in range(k)])
            engine.scheduler.check_pages()
        assert compiled_executables() == before
        assert len({k.rows for k in ran if k.kind == "canvas"}) > 1  # calls of fewer rows than slots ran too
        engine.flush_cache()
        outs = engine.generate(input_ids=[PROMPTS[0], PROMPTS[2]], sampling_params=[  # prompt rows of 11, 22 tokens
            {"max_new_tokens": 10, "seed": 40 + i, "ignore_eos": True} for i in (0, 2)])
        assert [o["output_ids"] for o in outs] == [reference[0].output_ids, reference[2].output_ids]
        key = engine.runner.encode_key(2, 22, 2)
        assert key not in engine.runner.buckets()
        for _ in range(200):
            if key in engine.runner.compiler.compiled:
                break
            engine.runner.compiler.wait(0.1)
        assert key in engine.runner.compiler.compiled  # compiled aside, for the next such call
        engine.scheduler.check_pages()
    finally:
        engine.shutdown()
