"""Structured output (json_schema / regex / ebnf): every answer valid by construction on the shipped model, which
knows no JSON (validity comes from the constraint alone); an unconstrained neighbour unchanged; bad grammars refused
naming the field; prefix cache, retraction, n > 1, sampling and streaming (slow)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from dllm_jax.engine.sampling import SamplingParams
from tests.conftest import assert_pages_back

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
    "age": {"type": "integer", "minimum": 18, "maximum": 99},
    "role": {"enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}, "minItems": 1,
             "maxItems": 2},
    "address": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                                                 "city": {"type": "string", "maxLength": 10}},
                "required": ["zip"], "additionalProperties": False},
    "nickname": {"type": "string", "maxLength": 6}},
    "required": ["name", "age", "role", "tags", "address"], "additionalProperties": False}
DATE = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
WORDS = r"(alpha|beta|gamma|delta)( (alpha|beta|gamma|delta)){0,2}"
PHONE = r"\+1 \([2-9][0-9]{2}\) [0-9]{3}-[0-9]{4}"
ARITHMETIC = 'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= factor (("*" | "/") factor)*\n' \
             'factor ::= [0-9]{1,3} | "(" expr ")"'
ARITHMETIC_RE = re.compile(r"[0-9+\-*/()]+")

BUCKETS = dict(rows=(16,), pages=(16,), prefill_rows=(1,), prefill_blocks=(4,))
CASES = [("json_schema", json.dumps(PERSON)), ("regex", DATE), ("regex", WORDS), ("regex", PHONE),
         ("ebnf", ARITHMETIC), ("json_schema", json.dumps({"type": "array", "items": {"type": "integer"},
                                                            "minItems": 2, "maxItems": 4}))]
PROMPTS = ["Describe a person: ", "Today is ", "Say words: ", "Call ", "Compute: ", "A list: "]


def check(kind: str, text: str, out: dict, engine) -> None:
    """The answer matches the grammar if it ended by EOS / stop; a length-cut answer is a valid prefix."""
    ids = out["output_ids"]
    assert engine.mask_token_id not in ids
    reason = out["meta_info"]["finish_reason"]["type"]
    if reason == "stop":
        if kind == "json_schema":
            jsonschema.validate(json.loads(out["text"]), json.loads(text))
        elif kind == "regex":
            assert re.fullmatch(text, out["text"]), out["text"]
        else:
            assert ARITHMETIC_RE.fullmatch(out["text"]), out["text"]
            eval(out["text"].replace("/", "*"))  # a well-formed expression (no division by zero)
    else:
        assert reason == "length"
        grammar = engine.compile_grammar(SamplingParams.from_dict({kind: text}))
        assert grammar.matcher.validate_tokens(ids) == len(ids), out["text"]


@pytest.fixture(scope="module")
def engine():
    from dllm_jax import Engine

    # one bucket per call kind: the plain and the grammar step compile once each (warm-up)
    eng = Engine(None, max_running_requests=8, warmup=False, shape_buckets=BUCKETS)
    eng.warmup(grammar=True)
    yield eng
    eng.shutdown()
    assert_pages_back(eng)


def test_every_grammar_holds_and_an_unconstrained_neighbour_is_unchanged(engine):
    """One batch: six constrained rows (nested objects, bounded arrays, enums, bounded integers, patterned and
    optional fields; a date, an enum of words, a phone number; arithmetic) beside an unconstrained greedy row,
    whose tokens equal those of the same batch with every neighbour unconstrained; nothing compiles after the
    warm-up (grammar=True)."""
    from dllm_jax.engine.compilation import compiled_executables

    params = [{"max_new_tokens": 96, kind: text} for kind, text in CASES] + [{"max_new_tokens": 64}]
    prompts = PROMPTS + ["What is 12 + 7?"]
    before = compiled_executables()
    outs = engine.generate(prompts, sampling_params=params)
    for (kind, text), out in zip(CASES, outs):
        check(kind, text, out, engine)
    assert sum(o["meta_info"]["finish_reason"]["type"] == "stop" for o in outs[:-1]) >= 5
    plain = engine.generate(prompts, sampling_params=[{"max_new_tokens": 96}] * len(CASES) + [{"max_new_tokens": 64}])
    assert outs[-1]["output_ids"] == plain[-1]["output_ids"]
    assert any(o["output_ids"] != p["output_ids"] for o, p in zip(outs, plain))
    assert compiled_executables() == before  # the grammar variant was compiled at warm-up: nothing since


@pytest.mark.slow
def test_the_model_frontier_keeps_the_device_loop_and_every_grammar(make_engine):
    """grammar_frontier "model": the algorithm decides a constrained frontier by its confidence under the mask, so
    a constrained request's calls run more than one forward on average (the loop goes on until the row decides
    its frontier); every grammar still holds; an unconstrained neighbour is unchanged."""
    eng = make_engine(None, warmup=False, shape_buckets=BUCKETS, grammar_frontier="model", max_running_requests=8)
    stats = eng.scheduler.stats
    calls, forwards = stats["denoise_calls"], stats["denoise_forwards"]
    out = eng.generate("What is 12 + 7?", sampling_params={"max_new_tokens": 48, "regex": "[^\\x00]*"})
    assert stats["denoise_calls"] - calls < stats["denoise_forwards"] - forwards
    assert eng.mask_token_id not in out["output_ids"]
    params = [{"max_new_tokens": 96, kind: text} for kind, text in CASES] + [{"max_new_tokens": 64}]
    outs = eng.generate(PROMPTS + ["What is 12 + 7?"], sampling_params=params)
    for (kind, text), o in zip(CASES, outs):
        check(kind, text, o, eng)
    plain = eng.generate(PROMPTS + ["What is 12 + 7?"], sampling_params=[{"max_new_tokens": 96}] * len(CASES)
                         + [{"max_new_tokens": 64}])
    assert outs[-1]["output_ids"] == plain[-1]["output_ids"]


@pytest.mark.parametrize("params, field, reason", [
    ({"json_schema": "{not json"}, "sampling_params.json_schema", "not valid JSON"),
    ({"json_schema": '{"type": "object", "properties": {"a": {"$ref": "#/nope"}}}'}, "sampling_params.json_schema",
     "nope"),
    ({"regex": "(unclosed"}, "sampling_params.regex", "unclosed"),
    ({"ebnf": "root ::= missing"}, "sampling_params.ebnf", "missing"),
    ({"regex": "a", "ebnf": "root ::= \"a\""}, "sampling_params.ebnf", "only one"),
    ({"regex": "a", "ignore_eos": True}, "sampling_params.ignore_eos", "cannot be combined"),
    ({"regex": ""}, "sampling_params.regex", "non-empty"),
])
def test_a_grammar_that_cannot_compile_is_a_value_error_naming_the_field(engine, params, field, reason):
    with pytest.raises(ValueError, match=re.escape(field) + ".*" + re.escape(reason)):
        engine.generate("x", sampling_params={"max_new_tokens": 4, **params})


@pytest.mark.slow
def test_sampling_n_choices_streaming_and_the_prefix_cache(engine):
    """Sampled rows (n choices of one prompt, seeded) stay valid; a second identical request hits the prefix
    cache and is still valid; a streamed answer's chunks join to a valid answer."""
    prompt = "Describe a person in detail, with every field filled: " * 4
    outs = engine.generate([prompt] * 4, sampling_params=[{"max_new_tokens": 96, "temperature": 1.0, "seed": s,
                                                           "json_schema": json.dumps(PERSON)} for s in range(4)])
    for out in outs:
        check("json_schema", json.dumps(PERSON), out, engine)
    assert len({tuple(o["output_ids"]) for o in outs}) > 1
    again = engine.generate(prompt, sampling_params={"max_new_tokens": 96, "temperature": 1.0, "seed": 0,
                                                     "json_schema": json.dumps(PERSON)})
    assert again["meta_info"]["cached_tokens"] > 0 and again["output_ids"] == outs[0]["output_ids"]
    chunks = list(engine.generate("Today is ", sampling_params={"max_new_tokens": 40, "regex": DATE}, stream=True))
    text = "".join(c["text"] for c in chunks)
    assert re.fullmatch(DATE, text), text


@pytest.mark.slow
def test_retraction_and_the_sync_schedule_keep_answers_valid(make_engine):
    """A pool too small for every request forces retractions mid-answer (the grammar forgets the dropped block and
    the re-admitted request goes on from its committed tokens); the synchronous schedule (its device loop stops
    after the step in which a constrained row decides its frontier) too."""
    for kw in ({"num_kv_pages": 6, "max_running_requests": 6}, {"schedule": "sync", "max_running_requests": 6}):
        eng = make_engine(None, warmup=False, shape_buckets=BUCKETS, **kw)
        params = [{"max_new_tokens": 120, kind: text} for kind, text in CASES]
        outs = eng.generate(PROMPTS, sampling_params=params)
        for (kind, text), out in zip(CASES, outs):
            check(kind, text, out, eng)
        if "num_kv_pages" in kw:
            assert eng.scheduler.stats["retractions"] > 0


@pytest.mark.slow
def test_json_threshold_edits_stay_valid(make_engine):
    """JointThreshold rewrites decided tokens (token-to-token edits): an edit the grammar rejects is taken back."""
    eng = make_engine(None, warmup=False, shape_buckets=BUCKETS, algorithm="JointThreshold", max_running_requests=6)
    outs = eng.generate(PROMPTS, sampling_params=[{"max_new_tokens": 96, kind: text} for kind, text in CASES])
    for (kind, text), out in zip(CASES, outs):
        check(kind, text, out, eng)


@pytest.fixture(scope="module")
def client(engine):
    from fastapi.testclient import TestClient

    from serve import ServerSettings, create_app

    with TestClient(create_app(engine, ServerSettings(served_model_name="sdar-tiny")),
                    base_url="http://localhost") as c:
        yield c


def test_the_http_fields(client, engine):
    """SGLang's sampling parameters on /generate, SGLang's names and OpenAI's response_format on /v1/completions
    and /v1/chat/completions: valid answers; a schema that cannot compile is a 400 naming the body's field."""
    r = client.post("/generate", json={"text": "Today is ", "sampling_params": {"max_new_tokens": 32, "regex": DATE}})
    assert r.status_code == 200, r.text
    assert re.fullmatch(DATE, r.json()["text"])
    r = client.post("/v1/completions", json={"prompt": "Call ", "max_tokens": 32, "regex": PHONE, "n": 2,
                                             "temperature": 1.0})
    assert [bool(re.fullmatch(PHONE, c["text"])) for c in r.json()["choices"]] == [True, True], r.text
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 1,
                                                                                 "maximum": 9}},
              "required": ["ok", "n"], "additionalProperties": False}
    for fmt in ({"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}},
                {"type": "json_object"}):
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Answer in JSON"}],
                                                      "max_tokens": 48, "response_format": fmt})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        ids = engine.tokenizer.encode(choice["message"]["content"], add_special_tokens=False)
        out = {"output_ids": ids, "text": choice["message"]["content"],
               "meta_info": {"finish_reason": {"type": choice["finish_reason"]}}}
        check("json_schema", json.dumps(schema if fmt["type"] == "json_schema" else {"type": "object"}), out, engine)
    bad = [("/generate", {"text": "x", "sampling_params": {"json_schema": "{oops"}}, "sampling_params.json_schema"),
           ("/generate", {"text": "x", "sampling_params": {"regex": "("}}, "sampling_params.regex"),
           ("/v1/completions", {"prompt": "x", "ebnf": "root ::= nothing"}, "ebnf"),
           ("/v1/completions", {"prompt": "x", "regex": "a", "json_schema": "{}"}, "regex"),
           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {
               "type": "json_schema", "json_schema": {"name": "a", "schema": {"$ref": "#/nowhere"}}}},
            "response_format.json_schema.schema"),
           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {
               "type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema.name"),
           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {
               "type": "yaml"}}, "response_format.type")]
    for path, body, field in bad:
        r = client.post(path, json=body)
        assert r.status_code == 400, (path, body, r.text)
        assert r.json()["error"]["message"].startswith(field + ":"), (field, r.text)


@pytest.fixture(scope="module")
def dg_engine(tmp_path_factory):
    """A random tiny DiffusionGemma (canvas of 8, a Gemma-style tokenizer)."""
    pytest.importorskip("torch")
    import dllm_jax
    from dllm_jax.testing.diffusion_gemma import FULL, SLIDING, write_tiny_diffusion_gemma
    from dllm_jax.testing.tokenizer_files import write_gemma_tokenizer

    path = tmp_path_factory.mktemp("dg_structured")
    ids = write_gemma_tokenizer(str(path))
    write_tiny_diffusion_gemma(path, canvas_length=8, sliding_window=6, tie=False, num_hidden_layers=2,
                               layer_types=[SLIDING, FULL], vocab_size=405,
                               eos_token_id=[ids["<eos>"], ids["<end_of_turn>"]])
    eng = dllm_jax.Engine(model_path=str(path), warmup=False, algorithm_config={"max_denoising_steps": 4},
                          max_running_requests=4)
    yield eng
    eng.shutdown()


@pytest.mark.slow
def test_diffusion_gemma_canvases_are_constrained(dg_engine):
    """A random DiffusionGemma knows nothing: every committed canvas is its valid prefix plus an allowed token."""
    cases = [("json_schema", json.dumps({"type": "object", "properties": {"n": {"type": "integer", "minimum": 1,
                                                                              "maximum": 9},
                                                                        "c": {"enum": ["red", "blue"]}},
                                         "required": ["n", "c"], "additionalProperties": False})),
             ("regex", DATE), ("ebnf", ARITHMETIC), ("regex", WORDS)]
    prompt = [[5, 17, 3, 88, 41, 9, 60]] * len(cases) + [[7, 7, 30, 4, 11]]
    outs = dg_engine.generate(input_ids=prompt, sampling_params=[{"max_new_tokens": 48, kind: text}
                                                                 for kind, text in cases] + [{"max_new_tokens": 16, "seed": 7}])
    for (kind, text), out in zip(cases, outs):
        check(kind, text, out, dg_engine)
    plain = dg_engine.generate(input_ids=prompt, sampling_params=[{"max_new_tokens": 48}] * len(cases)
                               + [{"max_new_tokens": 16, "seed": 7}])
    assert outs[-1]["output_ids"] == plain[-1]["output_ids"]


def test_the_device_functions_of_the_grammar_variant():
    """The packed bitmask unpacks as llguidance packs it; the frontier takes the best allowed token (never the mask
    id) with its confidence / entropy under the masked distribution; decided tokens are not rewritten; inactive
    rows are untouched; the loop's stop predicate fires once an active row decides its frontier."""
    import jax.numpy as jnp
    import numpy as np

    from dllm_jax.decode import grammar_mask as gm

    V, mask_id = 70, 3
    allowed = np.zeros((2, V), bool)
    allowed[0, [mask_id, 10, 40, 69]] = True
    allowed[1, :] = True
    words = np.packbits(np.pad(allowed, ((0, 0), (0, 96 - V))), axis=1, bitorder="little").view("<i4")
    assert (np.asarray(gm.unpack_bitmask(jnp.asarray(words), V)) == allowed).all()
    logits = np.zeros((2, V), np.float32)
    logits[0, [mask_id, 5, 40]] = [9.0, 8.0, 1.0]
    token = gm.pick_allowed(jnp.asarray(logits), jnp.asarray(allowed), mask_id=mask_id)
    assert int(token[0]) == 40  # the mask id and the disallowed 5 are out
    block = jnp.asarray([[1, 7, mask_id, mask_id], [1, mask_id, mask_id, mask_id]])
    immutable = jnp.asarray([[True, False, False, False], [True, False, False, False]])
    active = jnp.asarray([True, False])
    cand = jnp.asarray([[2, 8, 9, 9], [2, 8, 9, 9]])
    conf = jnp.full((2, 4), 0.5)
    z = gm.allowed_logits(jnp.asarray(logits), jnp.asarray(allowed), mask_id=mask_id)
    conf_f, ent_f = gm.masked_figures(z, jnp.asarray([40, 40]))
    p = np.exp([0.0, 1.0, 0.0]) / np.exp([0.0, 1.0, 0.0]).sum()  # allowed 10, 40, 69 (the mask id is not)
    assert np.isclose(float(conf_f[0]), p[1]) and np.isclose(float(ent_f[0]), -(p * np.log(p)).sum())
    tokens, confidence, entropy = gm.constrain_frontier(cand, conf, jnp.ones((2, 4)), block, immutable, active,
                                                        jnp.asarray([40, 41]), conf_f, ent_f, mask_id=mask_id)
    assert np.asarray(tokens).tolist() == [[2, 8, 40, 9], [2, 8, 9, 9]]
    assert float(confidence[0, 2]) == float(conf_f[0]) and float(entropy[0, 2]) == float(ent_f[0])
    assert float(confidence[1, 1]) == 0.5
    new = jnp.asarray([[1, 8, 40, 9], [1, 8, 9, mask_id]])
    kept = gm.keep_run(block, new, immutable, active, mask_id=mask_id)
    assert np.asarray(kept).tolist() == [[1, 7, 40, 9], [1, 8, 9, mask_id]]
    # a frontier the row ran BEHIND_LIMIT decided positions past is decided in the next step
    ahead = jnp.asarray([[1, mask_id, 5, 6, 7, mask_id], [1, 4, mask_id, 6, mask_id, 7]])
    assert np.asarray(gm.behind(ahead, jnp.zeros((2, 6), bool).at[:, 0].set(True), mask_id)).tolist() == [3, 2]
    # the device loop goes on while no active row decided its frontier (its mask still holds)
    assert not bool(gm.frontier_decided(block, block.at[0, 3].set(9), immutable, active, mask_id))
    assert bool(gm.frontier_decided(block, kept, immutable, active, mask_id))
    assert not bool(gm.frontier_decided(block, kept, immutable, jnp.asarray([False, False]), mask_id))


def test_a_constrained_frontier_records_the_masked_distribution():
    """The logprob record at a constrained frontier: the token's log probability and the top k under the masked
    distribution the token was drawn from (SGLang reports logprobs after the grammar's mask too); elsewhere, and in
    inactive rows, the step's own figures."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from dllm_jax.decode import grammar_mask as gm

    z = jnp.asarray([[0.0, 1.0, -jnp.inf, 2.0], [0.0, 0.0, 0.0, 0.0]])
    logp = z - jax.nn.logsumexp(z, axis=-1, keepdims=True)
    f = gm.FrontierScores(pos=jnp.asarray([1, 0]), at=jnp.asarray([True, False]), logp=logp)
    tokens = jnp.asarray([[5, 3, 7], [1, 2, 3]])
    chosen = jnp.full((2, 3), -0.5)
    vals, ids = jnp.full((2, 3, 2), -1.0), jnp.full((2, 3, 2), 9, jnp.int32)
    c, v, i = gm.record_frontier(f, tokens, chosen, vals, ids, lambda x: jax.lax.top_k(x, 2))
    want = np.asarray(logp[0])
    assert np.isclose(float(c[0, 1]), want[3]) and float(c[0, 0]) == float(c[1, 0]) == -0.5
    assert np.asarray(i[0, 1]).tolist() == [3, 1] and np.allclose(np.asarray(v[0, 1]), want[[3, 1]])
    assert np.asarray(i[1]).tolist() == [[9, 9]] * 3 and np.asarray(i[0, 2]).tolist() == [9, 9]


@pytest.mark.slow
def test_constrained_logprobs_are_those_of_the_masked_distribution(engine):
    """An answer of one digit: its token is always decided at the frontier, so its logprob and alternatives are
    the masked distribution's (only digits, summing to one), not the model's unconstrained ones."""
    import numpy as np

    digits = {engine.tokenizer.encode(str(d), add_special_tokens=False)[0] for d in range(10)}
    out = engine.generate("What is 12 + 7? ", sampling_params={"max_new_tokens": 8, "regex": "[0-9]",
                                                               "return_logprob": True, "top_logprobs_num": 12})
    (lp, tid, _), top = out["meta_info"]["output_token_logprobs"][0], out["meta_info"]["output_top_logprobs"][0]
    assert tid in digits
    allowed = [(v, t) for v, t, _ in top if v > -9999.0]
    assert {t for _, t in allowed} <= digits and np.isclose(sum(np.exp(v) for v, _ in allowed), 1.0, atol=1e-4)
    assert np.isclose(lp, dict((t, v) for v, t in allowed)[tid], atol=1e-5)
