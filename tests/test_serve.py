"""The HTTP server against a real ``uvicorn`` process (``python -m serve``) on 127.0.0.1 and a free port.

One server per module (the shipped model when it is present, else a small random model with the project's
tokenizer), reused by every test; an in-process ``dllm_jax.Engine`` on the same model is the Python-API reference.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time

import httpx
import pytest

from dllm_jax.assets import DEFAULT_MODEL_PATH
from conftest import TEST_XLA_FLAGS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
API_KEY = "test-key-123"
MAX_RUNNING = 4  # few shape buckets: compiling them is most of this module's time on a CPU
MAX_QUEUED = 28
CONTEXT = 512
PREFILL_TOKENS = 64
# one bucket per shape (rows: 2 x MAX_RUNNING with commit folding; pages: CONTEXT / 32): each device program
# compiles once, shared by the server and the in-process reference engine through the compilation cache
SHAPE_BUCKETS = {"rows": [2 * MAX_RUNNING], "pages": [CONTEXT // 32], "prefill_rows": [1],
                 "prefill_blocks": [PREFILL_TOKENS // 32]}
SHIPPED = all(os.path.isfile(os.path.join(DEFAULT_MODEL_PATH, f)) for f in ("config.json", "model.safetensors"))
NEEDS_SHIPPED = pytest.mark.skipif(not SHIPPED, reason=f"the shipped model is not at {DEFAULT_MODEL_PATH} yet "
                                                        "(answers of a random model are not checked)")
GREEDY = {"temperature": 0}
SYSTEM = "Answer the list task below. Keep every item exactly as written."  # > 1 block with the template
MAX_NEW = 64  # the held-out answers used here are at most 50 tokens


def build_chat_model(path: str) -> str:
    """A small random SDAR model with the project's tokenizer and chat template (when the shipped one is absent)."""
    import jax

    from dllm_jax.model.params import init_params
    from dllm_jax.train import tokenizer as tok_lib
    from dllm_jax.train.train import TrainConfig, export_hf

    tok = tok_lib.train_tokenizer()
    ids = tok_lib.special_ids(tok)
    size = json.loads(os.environ.get("DLLM_TEST_SERVE_MODEL_SIZE", "{}"))  # to time the tests at other sizes
    tc = TrainConfig(**{**dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                               intermediate_size=128), **size})
    cfg = tc.model_config(int(math.ceil(len(tok) / 64) * 64), ids[tok_lib.MASK],
                          (ids[tok_lib.IM_END], ids[tok_lib.ENDOFTEXT]))
    export_hf(init_params(cfg, jax.random.key(0)), cfg, tok, path)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    if SHIPPED:
        return DEFAULT_MODEL_PATH
    return build_chat_model(str(tmp_path_factory.mktemp("serve_model") / "model"))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    import resource

    from serve.launch import ServerProcess

    log_path = tmp_path_factory.mktemp("serve_log") / "server.log"
    cache = tmp_path_factory.mktemp("serve_cache")  # the default profile root is under it
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_DEFAULT_MATMUL_PRECISION="highest", XLA_FLAGS=TEST_XLA_FLAGS,
               TOKENIZERS_PARALLELISM="false", PYTHONPATH=REPO, XDG_CACHE_HOME=str(cache))
    args = ["--model-path", model_dir, "--host", "127.0.0.1", "--max-running-requests", str(MAX_RUNNING),
            "--context-length", str(CONTEXT), "--max-prefill-tokens", str(PREFILL_TOKENS),
            "--shape-buckets", json.dumps(SHAPE_BUCKETS), "--no-warmup", "--max-queued-requests", str(MAX_QUEUED),
            "--api-key", API_KEY, "--log-level", "warning", "--no-access-log"]
    with ServerProcess(args, env=env, cwd=REPO, log_path=str(log_path)) as proc:
        yield {"base": proc.base, "proc": proc.proc, "log": log_path,
               "profile_root": os.path.realpath(cache / "dllm-jax" / "profiles")}
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"\nserver process CPU: {ru.ru_utime + ru.ru_stime:.1f} s")
    text = proc.output()
    assert "Traceback" not in text, text


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server["base"], headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def engine(model_dir):
    """The Python API on the same model and settings (driven from this thread)."""
    import dllm_jax

    eng = dllm_jax.Engine(model_dir, max_running_requests=MAX_RUNNING, context_length=CONTEXT,
                          max_prefill_tokens=PREFILL_TOKENS, shape_buckets=SHAPE_BUCKETS)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def examples(engine):
    """Held-out examples whose answers fit MAX_NEW tokens (every task is represented)."""
    from dllm_jax.train.tasks import heldout_set

    out = [ex for ex in heldout_set(120) if len(engine.tokenize(ex.answer)) <= MAX_NEW - 14]
    assert len({ex.task for ex in out}) == 6 and len(out) >= 24
    return out[:24]


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------
def sse_events(response) -> list:
    """The parsed ``data:`` events of an SSE response, ``"[DONE]"`` included as a string."""
    out = []
    for line in response.iter_lines():
        if not line.startswith("data: "):
            assert line == "", line
            continue
        data = line[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def stream_post(client, path, body) -> list:
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return sse_events(r)


def metrics(client) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    r = client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            key = s.name + (json.dumps(s.labels, sort_keys=True) if s.labels else "")
            out[key] = s.value
    return out


def load(client) -> dict:
    r = client.get("/internal/load")
    assert r.status_code == 200
    return r.json()


def wait_idle(client, timeout=60) -> dict:
    """Until nothing runs or waits, and every KV page is free or held (unlocked) by the prefix cache."""
    deadline = time.time() + timeout
    while True:
        d = load(client)
        if (d["running_requests"] == 0 and d["queued_requests"] == 0 and d["server_inflight"] == 0
                and d["kv_pages_used"] == d["kv_pages_cached"] and d["kv_pages_locked"] == 0):
            return d
        assert time.time() < deadline, f"the server did not go idle: {d}"
        time.sleep(0.1)


def flush(client):
    wait_idle(client)
    r = client.post("/flush_cache")
    assert r.status_code == 200 and r.json()["success"], r.text
    d = load(client)
    assert d["kv_pages_used"] == d["kv_pages_cached"] == 0


def chat_text(engine, user: str, system: str | None = None) -> str:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    return engine.apply_chat_template(messages)


def assert_serving(client):
    r = client.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2, **GREEDY}})
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] == 2


# ----------------------------------------------------------------------------------------------
# Info endpoints
# ----------------------------------------------------------------------------------------------
def test_info_endpoints(server, client, model_dir):
    assert httpx.get(server["base"] + "/health").json() == {"status": "ok"}  # open without the key
    info = client.get("/get_model_info").json()
    assert info["model_path"] == os.path.abspath(model_dir)
    assert info["block_size"] == 32 and isinstance(info["mask_token_id"], int)
    assert info["algorithm"] == "LowConfidence" and info["context_length"] == CONTEXT
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == os.path.basename(model_dir)
    assert models["data"][0]["max_model_len"] == CONTEXT


# ----------------------------------------------------------------------------------------------
# Every generation endpoint equals the Python API (and, on the shipped model, answers right)
# ----------------------------------------------------------------------------------------------
def test_generate_endpoints_equal_python_api(client, engine, examples):
    from dllm_jax.train.tasks import is_correct

    exs = examples[:6]
    texts = [chat_text(engine, ex.prompt) for ex in exs]
    params = {"max_new_tokens": MAX_NEW, **GREEDY}
    ref = engine.generate(prompt=texts, sampling_params=params)

    # /generate, one at a time and as a batch
    single = client.post("/generate", json={"text": texts[0], "sampling_params": params})
    assert single.status_code == 200, single.text
    one = single.json()
    assert one["text"] == ref[0]["text"] and one["output_ids"] == ref[0]["output_ids"]
    meta = one["meta_info"]
    assert meta["prompt_tokens"] == ref[0]["meta_info"]["prompt_tokens"]
    assert meta["completion_tokens"] == len(one["output_ids"])
    assert meta["forward_passes"] >= 1 and meta["e2e_latency"] > 0
    assert meta["finish_reason"]["type"] in ("stop", "length")
    assert {"prompt_tokens", "completion_tokens", "cached_tokens", "forward_passes", "finish_reason",
            "e2e_latency"} <= set(meta)
    batch = client.post("/generate", json={"text": texts, "sampling_params": params}).json()
    assert [b["output_ids"] for b in batch] == [r["output_ids"] for r in ref]
    assert [b["text"] for b in batch] == [r["text"] for r in ref]
    ids_batch = client.post("/generate", json={"input_ids": [engine.tokenize(t) for t in texts[:2]],
                                                "sampling_params": [{**params, "max_new_tokens": 9},
                                                                    {**params, "max_new_tokens": 5}]}).json()
    assert ids_batch[0]["output_ids"] == ref[0]["output_ids"][:9]  # a block is decoded whatever the limit
    assert ids_batch[1]["output_ids"] == ref[1]["output_ids"][:5]

    # /generate streaming: one event per committed block, cumulative text and ids, then [DONE]
    events = stream_post(client, "/generate", {"text": texts[1], "sampling_params": params, "stream": True})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[-1]["text"] == ref[1]["text"] and chunks[-1]["output_ids"] == ref[1]["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] == ref[1]["meta_info"]["finish_reason"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    for a, b in zip(chunks, chunks[1:]):
        assert b["output_ids"][:len(a["output_ids"])] == a["output_ids"]
    B, prompt_len = 32, chunks[0]["meta_info"]["prompt_tokens"]
    first_block = B - prompt_len % B
    assert len(chunks[0]["output_ids"]) == min(first_block, len(ref[1]["output_ids"]))
    n_out = len(ref[1]["output_ids"])
    assert len(chunks) >= math.ceil(max(0, n_out - first_block) / B)  # at least one event per block

    # a streamed batch: events carry their prompt's index
    events = stream_post(client, "/generate", {"text": texts[2:4], "sampling_params": params, "stream": True})
    finals = {c["index"]: c for c in events[:-1] if c["meta_info"]["finish_reason"] is not None}
    assert [finals[i]["output_ids"] for i in (0, 1)] == [ref[2]["output_ids"], ref[3]["output_ids"]]

    # /v1/completions on the chat-formatted prompt, plain and streamed
    body = {"prompt": texts[4], "max_tokens": MAX_NEW, "temperature": 0}
    comp = client.post("/v1/completions", json=body).json()
    assert comp["object"] == "text_completion" and comp["choices"][0]["text"] == ref[4]["text"]
    usage = comp["usage"]
    assert usage["prompt_tokens"] == ref[4]["meta_info"]["prompt_tokens"]
    assert usage["completion_tokens"] == ref[4]["meta_info"]["completion_tokens"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert comp["choices"][0]["finish_reason"] == {"stop": "stop", "length": "length"}[
        ref[4]["meta_info"]["finish_reason"]["type"]]
    events = stream_post(client, "/v1/completions", {**body, "stream": True,
                                                     "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    text = "".join(c["choices"][0]["text"] for c in events[:-2])
    assert text == ref[4]["text"]
    assert events[-3]["choices"][0]["finish_reason"] == comp["choices"][0]["finish_reason"]
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == usage["completion_tokens"]

    # /v1/chat/completions with the tokenizer's template, plain and streamed
    body = {"messages": [{"role": "user", "content": exs[5].prompt}], "max_tokens": MAX_NEW, "temperature": 0}
    chat = client.post("/v1/chat/completions", json=body).json()
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": ref[5]["text"]}
    assert chat["usage"]["prompt_tokens"] == ref[5]["meta_info"]["prompt_tokens"]
    events = stream_post(client, "/v1/chat/completions", {**body, "stream": True})
    assert events[-1] == "[DONE]" and all(e["object"] == "chat.completion.chunk" for e in events[:-1])
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1]) == ref[5]["text"]
    assert events[-2]["choices"][0]["finish_reason"] in ("stop", "length")

    if SHIPPED:
        right = [is_correct(ex, r["text"]) for ex, r in zip(exs, ref)]
        assert sum(right) >= len(exs) - 1, [(ex.prompt, ex.answer, r["text"]) for ex, r in zip(exs, ref)]


def test_stop_conditions_equal_python_api(client, engine, examples):
    text = chat_text(engine, examples[6].prompt)
    free = engine.generate(prompt=text, sampling_params={"max_new_tokens": 40, **GREEDY, "ignore_eos": True})
    out = free["output_ids"]
    assert len(out) >= 10
    stop_id = out[len(out) // 2]
    words = [w for w in (engine.tokenizer.decode([t]).strip() for t in out[3:]) if w.isalnum()]
    assert words, free["text"]
    stop_str = words[len(words) // 2]
    for params in ({"stop_token_ids": [stop_id]}, {"stop": stop_str}, {"stop": [stop_str, "zzzz"]}):
        params = {"max_new_tokens": 40, **GREEDY, "ignore_eos": True, **params}
        ref = engine.generate(prompt=text, sampling_params=params)
        assert ref["meta_info"]["finish_reason"]["type"] == "stop", ref
        got = client.post("/generate", json={"text": text, "sampling_params": params}).json()
        assert (got["text"], got["output_ids"]) == (ref["text"], ref["output_ids"])
        assert got["meta_info"]["finish_reason"] == ref["meta_info"]["finish_reason"]
        events = stream_post(client, "/generate", {"text": text, "sampling_params": params, "stream": True})
        assert (events[-2]["text"], events[-2]["output_ids"]) == (ref["text"], ref["output_ids"])
        body = {"prompt": text, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
        body.update({k: v for k, v in params.items() if k in ("stop", "stop_token_ids")})
        comp = client.post("/v1/completions", json=body).json()["choices"][0]
        assert comp["text"] == ref["text"] and comp["finish_reason"] == "stop"
        assert comp["matched_stop"] == ref["meta_info"]["finish_reason"]["matched"]
    assert stop_str not in ref["text"]


@NEEDS_SHIPPED
def test_heldout_answers_over_http(client, examples):
    """The shipped model answers held-out prompts right through every endpoint, with its own sampling defaults."""
    from dllm_jax.train.tasks import is_correct

    exs = examples[6:12]
    ok = 0
    for i, ex in enumerate(exs):
        # no temperature: the model's generation_config.json (do_sample false: greedy), not OpenAI's 1.0
        body = {"messages": [{"role": "user", "content": ex.prompt}], "max_tokens": MAX_NEW}
        if i % 2:
            text = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
        else:
            events = stream_post(client, "/v1/chat/completions", {**body, "stream": True})
            text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
        ok += is_correct(ex, text)
    assert ok >= len(exs) - 1


# ----------------------------------------------------------------------------------------------
# n > 1: choices share the prompt's prefill; each has its own seed
# ----------------------------------------------------------------------------------------------
def test_n_choices_share_the_prefill(client, engine, examples):
    text = chat_text(engine, examples[3].prompt, SYSTEM)
    prompt_len = len(engine.tokenize(text))
    full = (prompt_len // 32) * 32
    assert full >= 32
    sampled = {"max_new_tokens": 24, "temperature": 0.9, "top_p": 0.95, "seed": 11}
    refs = [engine.generate(prompt=text, sampling_params={**sampled, "seed": 11 + j}) for j in range(3)]
    assert len({tuple(r["output_ids"]) for r in refs}) > 1  # the seeds make a difference

    # one prompt alone: how many prefill forwards it takes
    flush(client)
    l0 = load(client)
    one = client.post("/generate", json={"text": text, "sampling_params": sampled}).json()
    l1 = load(client)
    assert one["output_ids"] == refs[0]["output_ids"]
    single_prefills = l1["prefill_forwards"] - l0["prefill_forwards"]
    assert single_prefills >= 1

    # SGLang's n: a list of n answers, prompt-major, choice j seeded seed + j; the prompt is prefilled once
    flush(client)
    l0 = load(client)
    got = client.post("/generate", json={"text": text, "sampling_params": {**sampled, "n": 3}})
    assert got.status_code == 200, got.text
    got = got.json()
    l1 = load(client)
    assert [g["output_ids"] for g in got] == [r["output_ids"] for r in refs]
    assert sorted(g["meta_info"]["cached_tokens"] for g in got) == [0, full, full]
    assert l1["prefill_forwards"] - l0["prefill_forwards"] == single_prefills
    assert l1["cached_tokens"] - l0["cached_tokens"] == 2 * full

    # OpenAI chat, n = 3: choices 0..2 with seeds 11, 12, 13; usage counts the prompt once and every choice
    body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": examples[3].prompt}],
            "max_tokens": 24, "temperature": 0.9, "top_p": 0.95, "seed": 11, "n": 3}
    flush(client)
    l0 = load(client)
    chat = client.post("/v1/chat/completions", json=body).json()
    l1 = load(client)
    assert [c["index"] for c in chat["choices"]] == [0, 1, 2]
    assert [c["message"]["content"] for c in chat["choices"]] == [r["text"] for r in refs]
    usage = chat["usage"]
    assert usage["prompt_tokens"] == prompt_len
    assert usage["completion_tokens"] == sum(len(r["output_ids"]) for r in refs)
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0  # the prompt was not cached before
    assert l1["prefill_forwards"] - l0["prefill_forwards"] == single_prefills
    assert l1["cached_tokens"] - l0["cached_tokens"] == 2 * full

    # streamed: every choice's frames carry its index and add up to its answer
    events = stream_post(client, "/v1/chat/completions", {**body, "stream": True,
                                                          "stream_options": {"include_usage": True}})
    texts = ["", "", ""]
    for e in events[:-2]:
        for c in e["choices"]:
            texts[c["index"]] += c["delta"].get("content", "")
    assert texts == [r["text"] for r in refs]
    assert events[-2]["usage"]["completion_tokens"] == usage["completion_tokens"]
    assert events[-2]["usage"]["prompt_tokens"] == prompt_len

    # completions: two prompts x n = 2, prompt-major; greedy choices of a prompt agree; no seed: distinct draws
    texts2 = [chat_text(engine, ex.prompt) for ex in examples[4:6]]
    comp = client.post("/v1/completions", json={"prompt": texts2, "n": 2, "max_tokens": 16,
                                                "temperature": 0}).json()
    greedy = engine.generate(prompt=texts2, sampling_params={"max_new_tokens": 16, **GREEDY})
    assert [c["index"] for c in comp["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in comp["choices"]] == [greedy[0]["text"]] * 2 + [greedy[1]["text"]] * 2
    assert comp["usage"]["prompt_tokens"] == sum(g["meta_info"]["prompt_tokens"] for g in greedy)
    unseeded = client.post("/generate", json={"text": text, "sampling_params": {
        "max_new_tokens": 24, "temperature": 1.0, "n": 4}}).json()
    assert len({tuple(u["output_ids"]) for u in unseeded}) > 1
    wait_idle(client)


# ----------------------------------------------------------------------------------------------
# Log probabilities and penalties (issue 18): every endpoint, streamed and not, equal to the Python API
# ----------------------------------------------------------------------------------------------
LP_TOL = 1e-5


def _same_logprobs(got: list, ref: list):
    """``[logprob, id, text]`` lists: the same ids, logprobs within LP_TOL."""
    assert [g[1] for g in got] == [r[1] for r in ref]
    assert all(abs(g[0] - r[0]) < LP_TOL for g, r in zip(got, ref)), (got, ref)


def _same_tops(got: list, ref: list):
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        _same_logprobs(g, r)


def test_logprobs_and_penalties_over_http(client, engine, examples):
    """SGLang's ``return_logprob`` / ``top_logprobs_num`` on /generate, OpenAI chat's ``logprobs`` +
    ``top_logprobs`` and completions' ``logprobs: k``, streamed and not, with the penalties and ``logit_bias`` (no
    more 400): every endpoint gives the tokens and log probabilities of the first /generate answer (the engine's
    figures are checked against transformers in tests/test_logprobs.py). Every request here has the same features
    (3 alternatives, penalties, temperature 0), so the server compiles one step variant for them."""
    text = chat_text(engine, examples[7].prompt)
    tok = engine.tokenizer
    params = {"max_new_tokens": 24, **GREEDY}
    plain = engine.generate(prompt=text, sampling_params=params)["output_ids"]
    pen = {"presence_penalty": 0.7, "frequency_penalty": 0.4, "repetition_penalty": 1.3,
           "logit_bias": {str(plain[0]): -100.0}}
    lp = {"return_logprob": True, "top_logprobs_num": 3}

    # /generate (SGLang's body: logprob fields at the top level), plain, with texts, streamed
    body = {"text": text, "sampling_params": {**params, **pen, "min_new_tokens": 4}, **lp}
    ref = client.post("/generate", json=body)
    assert ref.status_code == 200, ref.text
    ref = ref.json()
    assert ref["output_ids"][0] != plain[0]  # the bias and penalties apply
    lps, tops = ref["meta_info"]["output_token_logprobs"], ref["meta_info"]["output_top_logprobs"]
    assert [t for _, t, _ in lps] == ref["output_ids"] and all(len(top) == 3 for top in tops)
    assert all(top[0][1] == t for top, t in zip(tops, ref["output_ids"]))  # greedy: the (penalised) argmax
    assert all(lp_ <= 0 and t is None for lp_, _, t in lps)
    assert all([v for v, _, _ in top] == sorted((v for v, _, _ in top), reverse=True) for top in tops)
    pieces = [tok.decode([i], skip_special_tokens=False) for i in ref["output_ids"]]
    texts = client.post("/generate", json={**body, "return_text_in_logprobs": True}).json()["meta_info"]
    assert [t for _, _, t in texts["output_token_logprobs"]] == pieces
    events = stream_post(client, "/generate", {**body, "stream": True})
    for e in events[:-1]:  # cumulative, as text and output_ids are
        assert len(e["meta_info"]["output_token_logprobs"]) == len(e["output_ids"])
    _same_logprobs(events[-2]["meta_info"]["output_token_logprobs"], lps)
    _same_tops(events[-2]["meta_info"]["output_top_logprobs"], tops)

    # /v1/chat/completions: logprobs + top_logprobs
    chat_body = {"messages": [{"role": "user", "content": examples[7].prompt}], "max_tokens": 24, "temperature": 0,
                 "logprobs": True, "top_logprobs": 3, "min_tokens": 4, **pen}
    chat = client.post("/v1/chat/completions", json=chat_body).json()["choices"][0]
    assert chat["message"]["content"] == ref["text"]
    content = chat["logprobs"]["content"]
    assert [c["token"] for c in content] == pieces
    assert all(abs(c["logprob"] - r[0]) < LP_TOL for c, r in zip(content, lps))
    assert all(c["bytes"] == list(c["token"].encode()) and len(c["top_logprobs"]) == 3 for c in content)
    assert all(abs(c["top_logprobs"][0]["logprob"] - top[0][0]) < LP_TOL for c, top in zip(content, tops))
    events = stream_post(client, "/v1/chat/completions", {**chat_body, "stream": True})
    streamed = [c for e in events[:-1] for ch in e["choices"] if ch.get("logprobs")
                for c in ch["logprobs"]["content"]]
    assert streamed == content

    # /v1/completions: logprobs = k
    comp_body = {"prompt": text, "max_tokens": 24, "temperature": 0, "logprobs": 3, "min_tokens": 4, **pen}
    comp = client.post("/v1/completions", json=comp_body).json()["choices"][0]
    assert comp["text"] == ref["text"]
    clp = comp["logprobs"]
    assert clp["tokens"] == pieces
    assert all(abs(a - r[0]) < LP_TOL for a, r in zip(clp["token_logprobs"], lps)) and len(clp["tokens"]) == len(lps)
    assert all(1 <= len(d) <= 3 for d in clp["top_logprobs"])
    assert clp["text_offset"] == sorted(clp["text_offset"]) and clp["text_offset"][0] == 0
    events = stream_post(client, "/v1/completions", {**comp_body, "stream": True})
    parts = [ch["logprobs"] for e in events[:-1] for ch in e["choices"] if ch.get("logprobs")]
    assert sum((p["token_logprobs"] for p in parts), []) == clp["token_logprobs"]
    assert sum((p["text_offset"] for p in parts), []) == clp["text_offset"]
    wait_idle(client)


def test_real_openai_client(server, client, engine, examples):
    """The ``openai`` package itself, as users call it: logprobs (chat, streamed chat, completions), n = 2 with a
    seed, and penalties / logit_bias (the OpenAI fields as keywords, our extensions through ``extra_body``) get
    the answers of the same requests sent as plain JSON (which the tests above tie to the Python API)."""
    from openai import OpenAI

    oc = OpenAI(base_url=server["base"] + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    model = client.get("/v1/models").json()["data"][0]["id"]
    assert [m.id for m in oc.models.list().data] == [model]
    text = chat_text(engine, examples[7].prompt)
    first = engine.generate(prompt=text, sampling_params={"max_new_tokens": 24, **GREEDY})["output_ids"][0]
    pen = {"presence_penalty": 0.7, "frequency_penalty": 0.4, "logit_bias": {str(first): -100.0}}
    ext = {"repetition_penalty": 1.3, "min_tokens": 4}  # not OpenAI fields: extra_body
    messages = [{"role": "user", "content": examples[7].prompt}]

    # chat with logprobs + top_logprobs (the same features as the test above: one compiled step variant)
    body = {"messages": messages, "max_tokens": 24, "temperature": 0, "logprobs": True, "top_logprobs": 3,
            **pen, **ext}
    raw = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    got = oc.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0, logprobs=True,
                                     top_logprobs=3, extra_body=ext, **pen).choices[0]
    assert got.message.content == raw["message"]["content"] and got.finish_reason == raw["finish_reason"]
    assert [(c.token, c.logprob) for c in got.logprobs.content] == \
        [(c["token"], c["logprob"]) for c in raw["logprobs"]["content"]]
    assert all([t.token for t in c.top_logprobs] == [t["token"] for t in r["top_logprobs"]]
               for c, r in zip(got.logprobs.content, raw["logprobs"]["content"]))
    assert got.logprobs.content[0].token != tok_piece(engine, first)  # the bias applies

    # streamed: the deltas add up to the same text, the streamed logprobs to the same list
    pieces, streamed = [], []
    for chunk in oc.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0,
                                            logprobs=True, top_logprobs=3, extra_body=ext, stream=True, **pen):
        for ch in chunk.choices:
            pieces.append(ch.delta.content or "")
            streamed += [(c.token, c.logprob) for c in (ch.logprobs.content if ch.logprobs else None) or []]
    assert "".join(pieces) == raw["message"]["content"]
    assert streamed == [(c["token"], c["logprob"]) for c in raw["logprobs"]["content"]]

    # completions: logprobs = 3
    comp = oc.completions.create(model=model, prompt=text, max_tokens=24, temperature=0, logprobs=3,
                                 extra_body=ext, **pen).choices[0]
    assert comp.text == raw["message"]["content"]
    assert [round(v, 6) for v in comp.logprobs.token_logprobs] == \
        [round(c["logprob"], 6) for c in raw["logprobs"]["content"]]

    # n = 2 with a seed: choices 0 and 1, seeded 11 and 12, as the JSON request gives them
    sampled = {"max_tokens": 24, "temperature": 0.9, "top_p": 0.95, "seed": 11, "n": 2}
    raw = client.post("/v1/chat/completions", json={"messages": messages, **sampled}).json()
    got = oc.chat.completions.create(model=model, messages=messages, **sampled)
    assert [c.index for c in got.choices] == [0, 1]
    assert [c.message.content for c in got.choices] == [c["message"]["content"] for c in raw["choices"]]
    assert got.usage.completion_tokens == raw["usage"]["completion_tokens"]
    wait_idle(client)


def tok_piece(engine, token_id: int) -> str:
    return engine.tokenizer.decode([token_id], skip_special_tokens=False)


# ----------------------------------------------------------------------------------------------
# Provisional streaming: the block being denoised, between committed chunks
# ----------------------------------------------------------------------------------------------
def _provisional_prompt(engine, examples):
    """A held-out prompt whose greedy answer has a block that takes several denoise steps (the shipped model
    often commits a whole block in one forward)."""
    for ex in examples:
        text = chat_text(engine, ex.prompt)
        chunks = list(engine.generate(prompt=text, sampling_params={"max_new_tokens": MAX_NEW, **GREEDY},
                                      stream=True, stream_provisional=True))
        if any(c.get("provisional") and any(c["block"]["masked"]) for c in chunks):
            return ex, text
    pytest.fail("no held-out prompt needs more than one step per block")


def test_provisional_stream(client, engine, examples):
    ex, text = _provisional_prompt(engine, examples)
    params = {"max_new_tokens": MAX_NEW, **GREEDY}
    ref = engine.generate(prompt=text, sampling_params=params)
    prompt_len = ref["meta_info"]["prompt_tokens"]

    # off by default: exactly the frames of a plain stream, no extension keys
    plain = stream_post(client, "/generate", {"text": text, "sampling_params": params, "stream": True})
    assert all("provisional" not in e["meta_info"] and "block" not in e["meta_info"] for e in plain[:-1])

    events = stream_post(client, "/generate", {"text": text, "sampling_params": params, "stream": True,
                                               "stream_provisional": True})
    assert events[-1] == "[DONE]"
    frames = events[:-1]
    prov = [e for e in frames if e["meta_info"]["provisional"]]
    committed = [e for e in frames if not e["meta_info"]["provisional"]]
    assert prov and any(any(e["meta_info"]["block"]["masked"]) for e in prov)
    # committed frames are the plain stream's, frame for frame (meta_info's timings aside)
    strip = lambda e: (e["text"], e["output_ids"], e["meta_info"]["finish_reason"])  # noqa: E731
    assert [strip(e) for e in committed] == [strip(e) for e in plain[:-1]]
    assert committed[-1]["output_ids"] == ref["output_ids"] and committed[-1]["text"] == ref["text"]
    last = {"text": "", "output_ids": []}
    for e in frames:
        if not e["meta_info"]["provisional"]:
            last = e
            continue
        # a provisional frame repeats the committed state (never retracts it) and shows the block
        assert (e["text"], e["output_ids"]) == (last["text"], last["output_ids"])
        assert e["meta_info"]["finish_reason"] is None
        b = e["meta_info"]["block"]
        assert set(b) == {"offset", "step", "tokens", "masked", "immutable", "pieces"}
        assert len(b["tokens"]) == len(b["masked"]) == len(b["immutable"]) == len(b["pieces"]) == 32
        assert b["offset"] % 32 == 0 and b["step"] >= 1
        assert b["offset"] == (prompt_len + len(e["output_ids"])) // 32 * 32
        for pos, (tok, masked, imm, piece) in enumerate(zip(b["tokens"], b["masked"], b["immutable"], b["pieces"])):
            out_pos = b["offset"] + pos - prompt_len
            if masked:
                assert tok == engine.mask_token_id and piece is None
            elif not imm and 0 <= out_pos < len(ref["output_ids"]):
                # LowConfidence never revises a decided token: it is the one that commits
                assert tok == ref["output_ids"][out_pos], (pos, b)
            if imm:
                assert out_pos < len(e["output_ids"])  # prompt or committed positions only

    # OpenAI chat: the block under delta.dllm_block with empty content; committed text adds up, sent once
    body = {"messages": [{"role": "user", "content": ex.prompt}], "max_tokens": MAX_NEW, "temperature": 0,
            "stream": True, "stream_provisional": True}
    events = stream_post(client, "/v1/chat/completions", body)
    assert events[-1] == "[DONE]" and all(e["object"] == "chat.completion.chunk" for e in events[:-1])
    deltas = [e["choices"][0]["delta"] for e in events[1:-1]]
    prov = [d for d in deltas if d.get("dllm_block", {}).get("provisional")]
    assert prov and all(d["content"] == "" for d in prov)
    assert any(any(d["dllm_block"]["masked"]) for d in prov)
    assert all({"step", "tokens", "masked", "pieces", "forward_passes", "completion_tokens"} <= set(d["dllm_block"])
               for d in prov)
    assert "".join(d.get("content", "") for d in deltas) == ref["text"]
    final = events[-2]["choices"][0]
    assert final["finish_reason"] in ("stop", "length")
    blk = final["delta"]["dllm_block"]
    assert (blk["provisional"], blk["completion_tokens"], blk["forward_passes"]) == (
        False, len(ref["output_ids"]), committed[-1]["meta_info"]["forward_passes"])
    # committed frames carry the ids they committed: together, the answer
    commits = [d["dllm_block"] for d in deltas if "dllm_block" in d and not d["dllm_block"]["provisional"]]
    assert sum((c["output_ids"] for c in commits), []) == ref["output_ids"]
    assert all(len(c["pieces"]) == len(c["output_ids"]) for c in commits)

    # OpenAI completions: dllm_block on the choice, beside empty text
    events = stream_post(client, "/v1/completions", {"prompt": text, "max_tokens": MAX_NEW, "temperature": 0,
                                                     "stream": True, "stream_provisional": True})
    choices = [e["choices"][0] for e in events[:-1]]
    prov = [c for c in choices if c.get("dllm_block", {}).get("provisional")]
    assert prov and all(c["text"] == "" for c in prov)
    assert "".join(c["text"] for c in choices) == ref["text"]
    # and without the flag, no extension key anywhere
    events = stream_post(client, "/v1/chat/completions", {**body, "stream_provisional": False})
    assert not any("dllm_block" in e["choices"][0]["delta"] for e in events[:-1] if e["choices"])
    wait_idle(client)


# ----------------------------------------------------------------------------------------------
# 32 concurrent clients, mixed lengths, a shared prefix
# ----------------------------------------------------------------------------------------------
def _requests_32(engine, examples) -> list[dict]:
    lengths = (4, 12, 24, 32, 6, 17, 1)
    out = []
    for i in range(32):
        ex = examples[i % len(examples)]
        user = ex.prompt if i < len(examples) else f"{ex.prompt} ({i})"
        params = {"max_new_tokens": lengths[i % len(lengths)], **GREEDY}
        if i % 8 == 7:
            params = {"max_new_tokens": 16, "temperature": 0.8, "top_p": 0.95, "seed": 1000 + i}
        out.append({"text": chat_text(engine, user, SYSTEM), "sampling_params": params, "stream": i % 4 == 3})
    return out


async def _post_all(base: str, bodies: list[dict]) -> list[dict]:
    async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {API_KEY}"},
                                 timeout=300, limits=httpx.Limits(max_connections=64)) as c:
        async def one(body):
            if not body["stream"]:
                r = await c.post("/generate", json=body)
                assert r.status_code == 200, r.text
                return r.json()
            async with c.stream("POST", "/generate", json=body) as r:
                assert r.status_code == 200
                events = [json.loads(line[6:]) for line in [x async for x in r.aiter_lines()]
                          if line.startswith("data: ") and line != "data: [DONE]"]
                return events[-1]

        return await asyncio.gather(*(one(b) for b in bodies))


def test_32_concurrent_clients(server, client, engine, examples):
    bodies = _requests_32(engine, examples)
    shared = len(engine.tokenize(chat_text(engine, "", SYSTEM).split("<|im_start|>user")[0]))
    shared_blocks = shared // 32
    assert shared_blocks >= 1

    flush(client)
    m0 = metrics(client)
    t0 = time.time()
    results = asyncio.run(_post_all(server["base"], bodies))
    concurrent_s = time.time() - t0
    wait_idle(client)
    m1 = metrics(client)

    flush(client)
    sequential = []
    for body in bodies:
        if body["stream"]:
            sequential.append(stream_post(client, "/generate", body)[-2])
        else:
            r = client.post("/generate", json=body)
            assert r.status_code == 200, r.text
            sequential.append(r.json())

    # same outputs, concurrent or not (greedy and seeded sampling alike)
    for i, (a, b) in enumerate(zip(results, sequential)):
        assert a["output_ids"] == b["output_ids"], f"request {i}"
        assert a["text"] == b["text"]
        assert a["meta_info"]["completion_tokens"] == len(a["output_ids"])
    # the shared prefix is reused: sequentially every request after the first hits it; concurrently, those
    # admitted after the first wave do
    seq_cached = [s["meta_info"]["cached_tokens"] for s in sequential]
    assert seq_cached[0] == 0 and all(c >= shared_blocks * 32 for c in seq_cached[1:]), seq_cached
    cached = [r["meta_info"]["cached_tokens"] for r in results]
    assert sum(c >= shared_blocks * 32 for c in cached) >= 32 - MAX_RUNNING, cached
    assert all(c % 32 == 0 and c <= r["meta_info"]["prompt_tokens"] for c, r in zip(cached, results))

    # /metrics adds up over the concurrent phase
    def delta(name):
        return m1.get(name, 0) - m0.get(name, 0)

    metas = [r["meta_info"] for r in results]
    assert delta("dllm_requests_total") == 32
    assert delta("dllm_requests_finished_total") == 32
    assert delta("dllm_prompt_tokens_total") == sum(m["prompt_tokens"] for m in metas)
    assert delta("dllm_generation_tokens_total") == sum(m["completion_tokens"] for m in metas)
    assert delta("dllm_cached_tokens_total") == sum(cached)
    assert delta("dllm_request_completion_tokens_total") == sum(m["completion_tokens"] for m in metas)
    assert delta("dllm_request_forward_passes_total") == sum(m["forward_passes"] for m in metas)
    assert delta('dllm_http_responses_total{"endpoint": "/generate", "status": "200"}') == 32
    finished = sum(delta(f'dllm_server_requests_finished_total{{"reason": "{r}"}}') for r in ("stop", "length"))
    assert finished == 32
    assert m1["dllm_forward_passes_total"] == m1["dllm_prefill_forwards_total"] + m1["dllm_denoise_forwards_total"]
    assert delta("dllm_forward_passes_total") > 0 and m1["dllm_tokens_per_forward"] > 0
    assert 0 < m1["dllm_cache_hit_rate"] <= 1
    assert m1["dllm_num_running_requests"] == 0 and m1["dllm_num_queued_requests"] == 0
    assert m1["dllm_kv_pages_used"] == m1["dllm_kv_pages_cached"] > 0
    assert m1["dllm_server_inflight_requests"] == 0
    print(f"32 concurrent requests: {concurrent_s:.2f} s")


# ----------------------------------------------------------------------------------------------
# Disconnects, the bounded queue
# ----------------------------------------------------------------------------------------------
def test_disconnect_aborts_and_returns_pages(client, engine, examples):
    wait_idle(client)
    m0 = metrics(client)
    body = {"text": chat_text(engine, examples[0].prompt), "stream": True,
            "sampling_params": {"max_new_tokens": 400, "ignore_eos": True, **GREEDY}}
    with client.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                first = json.loads(line[6:])
                break
    assert first["meta_info"]["finish_reason"] is None
    wait_idle(client, timeout=30)
    m1 = metrics(client)
    assert m1["dllm_client_disconnects_total"] - m0.get("dllm_client_disconnects_total", 0) == 1
    assert m1['dllm_server_requests_finished_total{"reason": "abort"}'] - m0.get(
        'dllm_server_requests_finished_total{"reason": "abort"}', 0) == 1
    assert m1["dllm_generation_tokens_total"] - m0["dllm_generation_tokens_total"] < 400

    # non-streaming: the client times out and goes away; its unfinished requests are aborted as well. As many of
    # the longest answers the context allows as the server admits (running + queued: eight waves), so that work is
    # left long after the client's timeout plus the server's disconnect poll, however fast the machine
    m0 = m1
    longest = {"max_new_tokens": CONTEXT - 8, "ignore_eos": True, **GREEDY}
    n = MAX_RUNNING + MAX_QUEUED
    body = {"input_ids": [[5, 6, 7 + i] for i in range(n)], "sampling_params": longest}
    with pytest.raises(httpx.ReadTimeout):
        client.post("/generate", json=body, timeout=httpx.Timeout(120, read=0.2))
    wait_idle(client, timeout=30)
    m1 = metrics(client)
    aborted = m1["dllm_client_disconnects_total"] - m0["dllm_client_disconnects_total"]
    assert 1 <= aborted <= n
    # a request in its last step when the client left may finish before the abort reaches the engine
    ended_by_abort = m1['dllm_server_requests_finished_total{"reason": "abort"}'] - m0[
        'dllm_server_requests_finished_total{"reason": "abort"}']
    assert 1 <= ended_by_abort <= aborted
    assert m1["dllm_generation_tokens_total"] - m0["dllm_generation_tokens_total"] < n * (CONTEXT - 8)
    assert_serving(client)


def test_queue_full_503_then_recovers(server, client, engine, examples):
    """Fill running + queued slots with held-open streams: one more request is a 503 with Retry-After."""
    wait_idle(client)
    capacity = load(client)["server_capacity"]
    assert capacity == MAX_RUNNING + MAX_QUEUED
    text = chat_text(engine, examples[1].prompt)
    # short prompts and the longest generations the context allows: the running ones do not finish meanwhile
    long = {"input_ids": [5, 6, 7], "stream": True,
            "sampling_params": {"max_new_tokens": CONTEXT - 8, "ignore_eos": True, **GREEDY}}

    async def scenario():
        async with httpx.AsyncClient(base_url=server["base"], headers={"Authorization": f"Bearer {API_KEY}"},
                                     timeout=60, limits=httpx.Limits(max_connections=64)) as c:
            streams = [c.stream("POST", "/generate", json=long) for _ in range(capacity)]
            try:
                responses = await asyncio.gather(*(cm.__aenter__() for cm in streams))
                assert all(r.status_code == 200 for r in responses)
                inflight = (await c.get("/internal/load")).json()["server_inflight"]
                over = await c.post("/generate", json={"text": text, "sampling_params": {"max_new_tokens": 1}})
                batch = await c.post("/generate", json={"text": [text] * (capacity + 1)})
                return inflight, over, batch
            finally:
                for cm in streams:
                    await cm.__aexit__(None, None, None)

    m0 = metrics(client)
    inflight, over, batch = asyncio.run(scenario())
    assert inflight == capacity
    assert over.status_code == 503 and int(over.headers["retry-after"]) >= 1, over.text
    assert over.json()["error"]["code"] is None and over.json()["error"]["type"] == "server_busy"  # (OpenAI: str|null)
    assert batch.status_code == 400 and batch.json()["error"]["param"] == "text"
    wait_idle(client)
    m1 = metrics(client)
    assert m1['dllm_rejected_requests_total{"reason": "queue_full"}'] - m0.get(
        'dllm_rejected_requests_total{"reason": "queue_full"}', 0) == 1
    assert m1["dllm_client_disconnects_total"] - m0["dllm_client_disconnects_total"] == capacity
    assert_serving(client)


# ----------------------------------------------------------------------------------------------
# The mask token id inside a prompt
# ----------------------------------------------------------------------------------------------
def test_mask_token_in_prompt(client, engine, examples):
    mask = engine.mask_token_id
    ids = engine.tokenize(chat_text(engine, examples[2].prompt, SYSTEM))
    ids = ids[:3] + [mask] + ids[3:20] + [mask, mask] + ids[20:] + [mask]
    assert len(ids) > 40
    params = {"max_new_tokens": 40, **GREEDY}
    flush(client)
    cold = client.post("/generate", json={"input_ids": ids, "sampling_params": params})
    hot = client.post("/generate", json={"input_ids": ids, "sampling_params": params})
    assert cold.status_code == hot.status_code == 200, (cold.text, hot.text)
    cold, hot = cold.json(), hot.json()
    assert cold["meta_info"]["cached_tokens"] == 0 and hot["meta_info"]["cached_tokens"] >= 32
    assert cold["meta_info"]["prompt_tokens"] == hot["meta_info"]["prompt_tokens"] == len(ids)
    assert cold["output_ids"] == hot["output_ids"] == engine.generate(input_ids=ids,
                                                                      sampling_params=params)["output_ids"]
    assert mask not in cold["output_ids"] and len(cold["output_ids"]) >= 1

    # the prompt comes back intact (OpenAI echo of a token-id prompt), cold and hot; streamed too
    prompt_text = engine.tokenizer.decode(ids, skip_special_tokens=False)
    assert prompt_text.count("<|mask|>") == 4
    flush(client)
    for _ in range(2):
        r = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 40, "temperature": 0, "echo": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == prompt_text + cold["text"]
    events = stream_post(client, "/v1/completions", {"prompt": ids, "max_tokens": 40, "temperature": 0,
                                                     "echo": True, "stream": True})
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == prompt_text + cold["text"]
    # and as text: the literal mask token in a string prompt is the mask id
    r = client.post("/generate", json={"text": prompt_text, "sampling_params": params})
    assert r.status_code == 200 and r.json()["output_ids"] == cold["output_ids"]
    assert r.json()["meta_info"]["cached_tokens"] >= 32
    wait_idle(client)
    assert_serving(client)


# ----------------------------------------------------------------------------------------------
# Bad requests: 400 naming the field, 401, 404, 413; the server keeps serving
# ----------------------------------------------------------------------------------------------
BAD = [
    # (path, raw body or json, expected param)
    ("/generate", b'{"text": "hi", "sampling_params": {', "body"),
    ("/generate", b"[1, 2]", "body"),
    ("/generate", {"text": "hi", "sampling_param": {}}, "sampling_param"),
    ("/generate", {"text": "hi", "sampling_params": {"max_tokens": 4}}, "sampling_params.max_tokens"),
    ("/generate", {"text": "hi", "sampling_params": {"temperature": "0.5"}}, "sampling_params.temperature"),
    ("/generate", {"text": "hi", "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
    ("/generate", {"text": "hi", "sampling_params": {"temperature": float("nan")}}, "sampling_params.temperature"),
    ("/generate", {"text": "hi", "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 0}}, "sampling_params.max_new_tokens"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": True}}, "sampling_params.max_new_tokens"),
    ("/generate", {"text": "hi", "sampling_params": {"ignore_eos": 1}}, "sampling_params.ignore_eos"),
    ("/generate", {"text": "hi", "sampling_params": {"stop_token_ids": [10 ** 9]}}, "sampling_params.stop_token_ids"),
    ("/generate", {"text": ["a", "b"], "sampling_params": [{}, {"top_k": -5}]}, "sampling_params[1].top_k"),
    ("/generate", {"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params"),
    ("/generate", {"text": 5}, "text"),
    ("/generate", {"text": ""}, "text"),
    ("/generate", {"text": "hi", "input_ids": [1]}, "text"),
    ("/generate", {}, "text"),
    ("/generate", {"input_ids": [1, "2"]}, "input_ids"),
    ("/generate", {"input_ids": [1, 10 ** 9]}, "input_ids[1]"),
    ("/generate", {"input_ids": [[1], [2, -3]]}, "input_ids[1][1]"),
    ("/generate", {"input_ids": [7] * 600}, "input_ids"),
    ("/generate", {"text": "word " * 100_000}, "text"),
    ("/generate", {"text": "hi", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "hi", "n": 129}, "n"),
    ("/v1/completions", {"prompt": ["a", "b"], "n": 17}, "n"),  # 34 requests > the capacity of 32
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": True}, "n"),
    ("/generate", {"text": "hi", "sampling_params": {"n": 0}}, "sampling_params.n"),
    ("/generate", {"text": ["a", "b"], "sampling_params": [{"n": 2}, {"n": 3}]}, "sampling_params[1].n"),
    ("/generate", {"text": "hi", "sampling_params": {"n": 2}, "rid": "one-id"}, "rid"),
    ("/generate", {"text": "hi", "stream_provisional": True}, "stream_provisional"),
    ("/generate", {"text": "hi", "stream": True, "stream_provisional": 1}, "stream_provisional"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream_provisional": True},
     "stream_provisional"),
    ("/generate", {"text": "hi", "top_logprobs_num": 21}, "top_logprobs_num"),
    ("/generate", {"text": "hi", "logprob_start_len": -2}, "logprob_start_len"),
    ("/generate", {"text": "hi", "return_logprob": True, "logprob_start_len": 0, "stream": True}, "logprob_start_len"),
    ("/generate", {"input_ids": [5, 6], "return_logprob": True, "logprob_start_len": 2}, "logprob_start_len"),
    ("/generate", {"text": "hi", "sampling_params": {"repetition_penalty": 0}}, "sampling_params.repetition_penalty"),
    ("/generate", {"text": "hi", "sampling_params": {"presence_penalty": -2.5}}, "sampling_params.presence_penalty"),
    ("/generate", {"text": "hi", "sampling_params": {"min_new_tokens": 9, "max_new_tokens": 4}},
     "sampling_params.min_new_tokens"),
    ("/v1/completions", {"prompt": "hi", "frequency_penalty": 3}, "frequency_penalty"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"abc": 1}}, "logit_bias.abc"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias.5"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": 3}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "stop": 7}, "stop"),
    ("/v1/completions", {"prompt": [1, 10 ** 9]}, "prompt[1]"),
    ("/v1/completions", {"max_tokens": 4}, "prompt"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{}]}, "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * 1000}]}, "messages"),
    ("/start_profile", {"output_dir": "/tmp/x", "steps": 3}, "steps"),
]
# Valid values of features the engine does not implement yet (issue 18): 400 naming the field until it does
# (serve.features passes them on from then; each entry drops out of BAD when its feature is supported).
_CHAT = {"messages": [{"role": "user", "content": "hi"}]}
NOT_YET = [
    ("return_logprob", "/generate", {"text": "hi", "return_logprob": True}, "return_logprob"),
    ("top_logprobs_num", "/generate", {"text": "hi", "top_logprobs_num": 3}, "top_logprobs_num"),
    ("presence_penalty", "/generate", {"text": "hi", "sampling_params": {"presence_penalty": 0.5}},
     "sampling_params.presence_penalty"),
    ("min_new_tokens", "/generate", {"text": ["a", "b"], "sampling_params": [{}, {"min_new_tokens": 3}]},
     "sampling_params[1].min_new_tokens"),
    ("return_logprob", "/v1/completions", {"prompt": "hi", "logprobs": 2}, "logprobs"),
    ("presence_penalty", "/v1/completions", {"prompt": "hi", "presence_penalty": 0.5}, "presence_penalty"),
    ("frequency_penalty", "/v1/completions", {"prompt": "hi", "frequency_penalty": -0.5}, "frequency_penalty"),
    ("repetition_penalty", "/v1/completions", {"prompt": "hi", "repetition_penalty": 1.2}, "repetition_penalty"),
    ("logit_bias", "/v1/completions", {"prompt": "hi", "logit_bias": {"5": 10}}, "logit_bias"),
    ("min_new_tokens", "/v1/completions", {"prompt": "hi", "min_tokens": 2}, "min_tokens"),
    ("return_logprob", "/v1/chat/completions", {**_CHAT, "logprobs": True}, "logprobs"),
    ("return_logprob", "/v1/chat/completions", {**_CHAT, "logprobs": True, "top_logprobs": 2}, "logprobs"),
    ("presence_penalty", "/v1/chat/completions", {**_CHAT, "presence_penalty": 1}, "presence_penalty"),
]


def _bad_requests():
    from serve.features import engine_supports

    return BAD + [(path, body, param) for feature, path, body, param in NOT_YET if not engine_supports(feature)]


def test_bad_requests_get_400(client):
    bad = _bad_requests()
    m0 = metrics(client)
    for path, body, param in bad:
        if isinstance(body, bytes):
            r = client.post(path, content=body, headers={"Content-Type": "application/json"})
        else:
            r = client.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})
        assert r.status_code == 400, (path, body if len(str(body)) < 200 else str(body)[:200], r.text)
        err = r.json()["error"]
        assert err["param"] == param and err["code"] is None, (path, str(body)[:200], err)
        assert err["message"].startswith(param), err
    m1 = metrics(client)
    # none of them reached the engine; each was counted as rejected
    assert m1["dllm_requests_total"] == m0["dllm_requests_total"]
    key = 'dllm_rejected_requests_total{"reason": "invalid"}'
    assert m1[key] - m0.get(key, 0) == len(bad)
    # the neutral values of those features are accepted (and never reach the engine as parameters)
    neutral = {"presence_penalty": 0, "frequency_penalty": 0.0, "repetition_penalty": 1, "logit_bias": {},
               "min_tokens": 0, "n": 1, "max_tokens": 2, "temperature": 0}
    for path, body in (("/v1/completions", {"prompt": "hi", "logprobs": None, **neutral}),
                       ("/v1/chat/completions", {**_CHAT, "logprobs": False, "top_logprobs": 0, **neutral}),
                       ("/generate", {"text": "hi", "return_logprob": False, "top_logprobs_num": 0,
                                      "logprob_start_len": -1, "sampling_params": {
                                          "max_new_tokens": 2, "presence_penalty": 0, "min_new_tokens": 0, "n": 1}})):
        r = client.post(path, json=body)
        assert r.status_code == 200, (path, r.text)
    assert_serving(client)


def test_auth_size_and_unknown_routes(server, client):
    base = server["base"]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        for method, path in (("POST", "/generate"), ("GET", "/metrics"), ("GET", "/v1/models"),
                             ("POST", "/flush_cache"), ("GET", "/internal/load")):
            r = httpx.request(method, base + path, json={"text": "hi"}, headers=headers)
            assert r.status_code == 401, (path, headers, r.text)
            assert r.headers["www-authenticate"] == "Bearer" and r.json()["error"]["code"] == "invalid_api_key"
    # malformed JSON without the key is still a 401 (authentication comes first)
    r = httpx.post(base + "/generate", content=b"{", headers={"Content-Type": "application/json"})
    assert r.status_code == 401
    r = client.post("/generate", content=b"x" * (9 << 20), headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["param"] == "body"
    r = client.get("/no/such/route")
    assert r.status_code == 404 and r.json()["error"]["code"] is None and r.json()["error"]["param"] == "path"
    r = client.get("/generate")
    assert r.status_code == 405
    assert_serving(client)


# ----------------------------------------------------------------------------------------------
# Admin endpoints
# ----------------------------------------------------------------------------------------------
def test_flush_profile_and_abort_request(server, client):
    assert_serving(client)
    flush(client)
    assert client.get("/flush_cache").status_code == 200  # SGLang accepts GET too

    # under the default profile root (tests/test_serve_hardening.py: anywhere else is refused)
    out = os.path.join(server["profile_root"], "trace")
    r = client.post("/start_profile", json={"output_dir": "trace"})
    assert r.status_code == 200 and r.json()["output_dir"] == out
    assert client.post("/start_profile", json={"output_dir": "trace"}).status_code == 400  # already recording
    assert_serving(client)
    r = client.post("/stop_profile")
    assert r.status_code == 200 and r.json()["output_dir"] == str(out)
    files = [os.path.join(d, f) for d, _, fs in os.walk(out) for f in fs]
    assert any(f.endswith((".xplane.pb", ".trace.json.gz")) for f in files), files
    assert client.post("/stop_profile").status_code == 400

    # /abort_request by rid ends a running request with finish_reason abort
    body = {"input_ids": [5, 6, 7], "rid": "abort-me", "stream": True,
            "sampling_params": {"max_new_tokens": 400, "ignore_eos": True, **GREEDY}}
    with client.stream("POST", "/generate", json=body) as r:
        events = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 1:
                    assert client.post("/abort_request", json={"rid": "abort-me"}).json() == {"aborted": ["abort-me"]}
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    wait_idle(client)
