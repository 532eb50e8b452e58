"""Log probabilities and penalties (issue 18) on the tiny random model, checked against transformers (float32).

Every returned log probability must be the log-softmax (mask id excluded, penalties applied by a NumPy copy of the
formulas, the row's temperature) of the same token at the same position, computed by transformers from the same
sequence state: the prompt, the committed outputs, and the block as it stood at the forward that wrote the token.
The FDFO provisional stream shows the block after every step, which gives those states exactly.

Compile budget: one engine per schedule on ``ENGINE_KW``'s single bucket; each test adds one or two step
variants (logprobs with alternatives, greedy / sampled, penalties).
"""

import json
import os

import numpy as np
import pytest

from conftest import ENGINE_KW, TINY_EOS_ID, TINY_MASK_ID

M = TINY_MASK_ID
B = 4
TOL = 1e-4
PROMPTS = [[5, 6, 7, 8, 9, 10], list(range(2, 13)), [M, 2]]
K = 5


@pytest.fixture(scope="module")
def hf32(tiny_model):
    """``logits(tokens) -> [S, V]`` float32 from transformers under the block-causal mask."""
    import torch
    import transformers

    with open(os.path.join(tiny_model, "config.json")) as f:
        cfg = json.load(f)
    hf_cfg = transformers.Qwen3Config(**{k: v for k, v in cfg.items()
                                         if k not in ("architectures", "model_type", "auto_map")})
    model = transformers.Qwen3ForCausalLM.from_pretrained(tiny_model, config=hf_cfg, dtype=torch.float32,
                                                          attn_implementation="eager").eval()
    memo = {}

    def logits(tokens):
        key = tuple(tokens)
        if key not in memo:
            n = len(tokens)
            blk = torch.arange(n) // B
            visible = blk[None, :] <= blk[:, None]
            mask = torch.zeros(n, n).masked_fill(~visible, torch.finfo(torch.float32).min)
            with torch.inference_mode():
                out = model(input_ids=torch.tensor([tokens]), attention_mask=mask[None, None],
                            position_ids=torch.arange(n)[None], use_cache=False)
            memo[key] = out.logits[0].double().numpy()
        return memo[key]

    return logits


@pytest.fixture(scope="module")
def engines(tiny_model):
    from dllm_jax import Engine

    made = {}

    def get(schedule="fdfo"):
        if schedule not in made:
            made[schedule] = Engine(tiny_model, schedule=schedule, **ENGINE_KW)
        return made[schedule]

    yield get
    from conftest import assert_pages_back

    for engine in made.values():
        engine.shutdown()
        assert_pages_back(engine)


# ----------------------------------------------------------------------------------------------
# The reference: states from the provisional stream, NumPy penalties, log-softmax of transformers logits
# ----------------------------------------------------------------------------------------------

def writes(prompt, frames):
    """For every output token: (its output index, the sequence the forward that wrote it ran on, the position
    in that sequence). ``frames``: a provisional stream (LowConfidence: a written token is never rewritten)."""
    out, seq, states, result = [], list(prompt), None, []
    for f in frames:
        offset = len(seq) // B * B
        n_imm = len(seq) - offset
        if states is None:
            states = [seq[offset:] + [M] * (B - n_imm)]
        if f.get("provisional"):
            assert f["block"]["offset"] == offset
            states.append(list(f["block"]["tokens"]))
            continue
        new = f["output_ids"]
        final = seq[offset:] + new + [M] * (B - n_imm - len(new))
        states.append(final)
        for j in range(n_imm, n_imm + len(new)):
            k = next(i for i in range(1, len(states)) if states[i][j] != M)
            assert all(s[j] == final[j] for s in states[k:]), "LowConfidence never rewrites a token"
            result.append((len(out) + j - n_imm, seq[:offset] + states[k - 1], offset + j))
        out += new
        seq = list(prompt) + out
        states = None
        if f["finished"]:
            break
    return out, result


def penalised(z, seq, pos, prompt_len, p, eos_ids=(TINY_EOS_ID,)):
    """NumPy copy of dllm_jax.decode.penalties for one position: ``z`` the position's logits, ``seq`` the
    sequence the forward ran on (prompt, committed outputs, the block with masks)."""
    z = z.copy()
    z[M] = -np.inf
    if not p:
        return z
    generated = [t for i, t in enumerate(seq) if i >= prompt_len and t != M and i != pos]
    seen = set(generated) | set(seq[:prompt_len])
    r = p.get("repetition_penalty", 1.0)
    for v in seen:
        z[v] = z[v] / r if z[v] > 0 else z[v] * r
    counts = np.bincount(generated, minlength=len(z)).astype(np.float64)
    z = z - p.get("presence_penalty", 0.0) * (counts > 0) - p.get("frequency_penalty", 0.0) * counts
    for tid, bias in p.get("logit_bias", {}).items():
        z[int(tid)] += bias
    if pos - prompt_len < p.get("min_new_tokens", 0):
        for t in set(eos_ids) | set(p.get("stop_token_ids", ())):
            z[t] = -np.inf
    z[M] = -np.inf
    return z


def log_softmax(z):
    top = z[np.isfinite(z)].max()
    return z - (top + np.log(np.sum(np.exp(z - top))))


def check_logprobs(hf32, prompt, frames, params, penalties=None):
    """Every returned figure against the reference; returns the number of tokens checked."""
    out, states = writes(prompt, frames)
    meta = frames[-1]["meta_info"]
    lps, tops = meta["output_token_logprobs"], meta.get("output_top_logprobs")
    assert [t for _, t, _ in lps] == out and len(lps) == len(out)
    temperature = params.get("temperature", 0.0) or 1.0
    k = params.get("top_logprobs_num", 0)
    for index, seq, pos in states:
        z = penalised(hf32(seq)[pos], seq, pos, len(prompt), penalties)
        expected = log_softmax(z / temperature)
        lp, token, text = lps[index]
        assert text is None and token == out[index]
        assert abs(lp - expected[token]) < TOL, (index, lp, expected[token])
        if not params.get("temperature"):  # greedy: the written token is the (penalised) argmax
            assert expected[token] >= expected.max() - TOL
        if k:
            top = tops[index]
            assert len(top) == k
            values = [v for v, _, _ in top]
            assert values == sorted(values, reverse=True)
            for v, tid, _ in top:
                assert abs(v - expected[tid]) < TOL, (index, tid, v, expected[tid])
            rest = np.delete(expected, [t for _, t, _ in top])
            assert values[-1] >= rest.max() - TOL  # nothing outside the top k is more likely
            if expected[token] > values[-1] + TOL:  # the written token ranks: it is in the list
                assert token in [t for _, t, _ in top]
            for v, tid, _ in top:  # a token's own figure and its entry among the alternatives: one number
                if tid == token:
                    assert v == lp, (index, token, lp, v)
    return len(states)


def stream(engine, prompt, params):
    return list(engine.generate(input_ids=prompt, sampling_params=params, stream=True, stream_provisional=True))


def streams(engine, prompts, params_list):
    """Several provisional streams decoded together (one batch: one compiled variant serves them all)."""
    from dllm_jax.engine.output import ChunkSink

    sinks = [ChunkSink(engine) for _ in prompts]
    reqs = [engine.make_request(list(p), params, on_event=sink, provisional=True)
            for p, params, sink in zip(prompts, params_list, sinks)]
    for req in reqs:
        engine.submit(req)
    while engine.step():
        pass
    out = []
    for sink in sinks:
        frames = []
        while not sink.chunks.empty():
            frames.append(sink.chunks.get())
        out.append(frames)
    return out


# ----------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------

def test_logprobs_equal_transformers_log_softmax(engines, hf32):
    """Greedy rows take the fused path: the confidence path's log-sum-exp, one LM-head column per position, the
    tiled top-k (sampled rows, on materialised tempered logits, are checked with the penalties below)."""
    engine = engines("fdfo")
    params = {"max_new_tokens": 10, "ignore_eos": True, "return_logprob": True, "top_logprobs_num": K}
    checked = 0
    for prompt, frames in zip(PROMPTS, streams(engine, PROMPTS, [params] * len(PROMPTS))):
        checked += check_logprobs(hf32, prompt, frames, params)
    assert checked == 10 * len(PROMPTS)
    # the plain (non-streamed) answer carries the same lists
    again = engine.generate(input_ids=PROMPTS[-1], sampling_params=params)
    assert again["meta_info"]["output_token_logprobs"] == frames[-1]["meta_info"]["output_token_logprobs"]
    assert again["meta_info"]["output_top_logprobs"] == frames[-1]["meta_info"]["output_top_logprobs"]


def test_streamed_chunks_carry_their_entries(engines):
    """Each committed chunk's new tokens have their entries at the same indices of its meta_info lists."""
    engine = engines("fdfo")
    params = {"max_new_tokens": 10, "ignore_eos": True, "return_logprob": True, "top_logprobs_num": K}
    chunks = list(engine.generate(input_ids=PROMPTS[0], sampling_params=params, stream=True))
    seen = 0
    for c in chunks:
        lps = c["meta_info"]["output_token_logprobs"]
        assert len(lps) == seen + len(c["output_ids"]) == len(c["meta_info"]["output_top_logprobs"])
        assert [t for _, t, _ in lps[seen:]] == c["output_ids"]
        seen += len(c["output_ids"])


def test_sync_records_the_step_that_wrote_each_position(engines):
    """The synchronous schedule runs the block loop on the device: each position keeps the figures of the step
    that wrote it (the same as FDFO's, which are checked against transformers above). Without alternatives
    (``top_logprobs_num`` 0: the cheaper variant, no top-k pass) and through ``generate(return_logprob=...)``."""
    params = {"max_new_tokens": 10, "ignore_eos": True}
    fdfo = engines("fdfo").generate(input_ids=PROMPTS, sampling_params={**params, "return_logprob": True,
                                                                        "top_logprobs_num": K})
    sync = engines("sync").generate(input_ids=PROMPTS, sampling_params=params, return_logprob=True)
    for f, s in zip(fdfo, sync):
        a, b = f["meta_info"]["output_token_logprobs"], s["meta_info"]["output_token_logprobs"]
        assert [t for _, t, _ in a] == [t for _, t, _ in b] == s["output_ids"]
        assert np.allclose([x[0] for x in a], [x[0] for x in b], atol=1e-5)
        assert "output_top_logprobs" not in s["meta_info"]


PENALTIES = {"presence_penalty": 0.8, "frequency_penalty": 0.6, "repetition_penalty": 1.6,
             "logit_bias": {"45": 1.5, "6": -3.0, "39": 2.0}, "min_new_tokens": 6}


def test_penalties_and_temperature_change_the_distribution_as_specified(engines, hf32):
    """One batch (one compiled variant): a greedy row with penalties, a sampled row with penalties and a sampled
    row without; each figure against the NumPy formulas on transformers' logits, divided by the temperature."""
    engine = engines("fdfo")
    base = {"max_new_tokens": 12, "return_logprob": True, "top_logprobs_num": K}
    rows = [({**base, **PENALTIES}, PENALTIES), ({**base, **PENALTIES, "temperature": 0.8, "seed": 5}, PENALTIES),
            ({**base, "temperature": 0.7, "seed": 11, "ignore_eos": True}, None)]
    prompts = [PROMPTS[1], PROMPTS[0], PROMPTS[0]]
    outs = streams(engine, prompts, [params for params, _ in rows])
    for prompt, frames, (params, penalties) in zip(prompts, outs, rows):
        assert check_logprobs(hf32, prompt, frames, params, penalties) >= 7
        if penalties:
            out = [t for _, t, _ in frames[-1]["meta_info"]["output_token_logprobs"]]
            assert TINY_EOS_ID not in out[:6]  # min_new_tokens


def test_min_new_tokens_then_eos(engines):
    """EOS biased to be certain: masked until min_new_tokens are out, then the very next token."""
    engine = engines("fdfo")
    out = engine.generate(input_ids=PROMPTS[0], sampling_params={
        "max_new_tokens": 20, "min_new_tokens": 5, "logit_bias": {str(TINY_EOS_ID): 100}, "return_logprob": True,
        "top_logprobs_num": K, "temperature": 1.0, "seed": 0})  # (the variant the test above compiled)
    assert len(out["output_ids"]) == 6 and out["output_ids"][-1] == TINY_EOS_ID
    lps = out["meta_info"]["output_token_logprobs"]
    assert lps[-1][0] > -1e-3  # EOS was certain once allowed
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": TINY_EOS_ID}


def test_plain_batches_run_the_plain_step(engines):
    """Without logprobs and penalties no variant is ever built (only, where calls chain blocks, the chaining
    step); neutral values count as none."""
    engine = engines("fdfo")
    engine.runner._variants.clear()
    neutral = {"max_new_tokens": 10, "ignore_eos": True, "presence_penalty": 0, "frequency_penalty": 0.0,
               "repetition_penalty": 1, "logit_bias": {}, "min_new_tokens": 0, "return_logprob": False,
               "top_logprobs_num": 3}
    outs = engine.generate(input_ids=[list(p) for p in PROMPTS], sampling_params=neutral)
    assert all(variant == 0 for _, variant, _ in engine.runner._variants)
    assert all("output_token_logprobs" not in o["meta_info"] for o in outs)
    with_lp = engine.generate(input_ids=PROMPTS[0], sampling_params={**neutral, "return_logprob": True})
    assert with_lp["output_ids"] == outs[0]["output_ids"]  # the variant decides as the plain step does


@pytest.mark.parametrize("bad, field", [
    ({"presence_penalty": 2.5}, "sampling_params.presence_penalty"),
    ({"frequency_penalty": -3}, "sampling_params.frequency_penalty"),
    ({"frequency_penalty": "1"}, "sampling_params.frequency_penalty"),
    ({"repetition_penalty": 0}, "sampling_params.repetition_penalty"),
    ({"repetition_penalty": 2.5}, "sampling_params.repetition_penalty"),
    ({"min_new_tokens": -1}, "sampling_params.min_new_tokens"),
    ({"min_new_tokens": 9, "max_new_tokens": 4}, "sampling_params.min_new_tokens"),
    ({"logit_bias": {"64": 1}}, r"sampling_params.logit_bias.64"),
    ({"logit_bias": {"x": 1}}, "sampling_params.logit_bias"),
    ({"logit_bias": {5: 101}}, r"sampling_params.logit_bias.5"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "sampling_params.logit_bias"),
    ({"logit_bias": [1, 2]}, "sampling_params.logit_bias"),
    ({"return_logprob": 1}, "sampling_params.return_logprob"),
    ({"top_logprobs_num": 21}, "sampling_params.top_logprobs_num"),
    ({"top_logprobs_num": -1}, "sampling_params.top_logprobs_num"),
])
def test_bad_values_name_the_field(engines, bad, field):
    with pytest.raises(ValueError, match=field):
        engines("fdfo").make_request([2, 3], bad)


# ----------------------------------------------------------------------------------------------
# Tensor parallelism and the fused Pallas confidence kernel (slow: each compiles its own steps)
# ----------------------------------------------------------------------------------------------
CASES = [{"top_logprobs_num": K}, {"top_logprobs_num": 0},
         {"top_logprobs_num": K, "temperature": 0.8, "seed": 3, **PENALTIES}]


@pytest.mark.slow
@pytest.mark.parametrize("kw", [dict(tensor_parallel_size=2), dict(tensor_parallel_size=4, schedule="sync"),
                                dict(confidence_backend="pallas_interpret")], ids=["tp2", "tp4-sync", "pallas"])
def test_sharded_and_fused_paths_give_the_same_figures(engines, make_engine, tiny_model, kw):
    """Vocabulary shards merge their token logits and top-k (TP); the Pallas kernel's log-sum-exp serves the
    fused path: the same tokens and figures as one device on the XLA path."""
    engine = make_engine(tiny_model, **kw, **ENGINE_KW)
    for case in CASES:
        params = {"max_new_tokens": 10, "return_logprob": True, **case}
        ref = engines("fdfo").generate(input_ids=PROMPTS[0], sampling_params=params)
        got = engine.generate(input_ids=PROMPTS[0], sampling_params=params)
        assert got["output_ids"] == ref["output_ids"]
        a, b = got["meta_info"]["output_token_logprobs"], ref["meta_info"]["output_token_logprobs"]
        assert np.allclose([x[0] for x in a], [x[0] for x in b], atol=1e-5)
        if case["top_logprobs_num"]:
            ta, tb = got["meta_info"]["output_top_logprobs"], ref["meta_info"]["output_top_logprobs"]
            assert [[t for _, t, _ in x] for x in ta] == [[t for _, t, _ in x] for x in tb]
            assert np.allclose([[v for v, _, _ in x] for x in ta], [[v for v, _, _ in x] for x in tb], atol=1e-5)


@pytest.mark.slow
def test_sharded_logprob_steps_hold_no_full_logits(tmp_path, make_engine):
    """TP = 4: the logprob variants (greedy: fused path; penalties: materialised, penalised logits) compile with
    per-shard ``[N, V/4]`` buffers and no ``[..., V]`` one."""
    import re

    import dllm_jax.engine.runner as runner_mod
    from conftest import build_tiny_model
    from dllm_jax.engine.calls import DecodeRow, PenaltyRow

    vocab = 96  # distinct from every other dimension of the model
    engine = make_engine(build_tiny_model(tmp_path / "m96", vocab=vocab), tensor_parallel_size=4, **ENGINE_KW)
    runner = engine.runner
    rows = runner.row_buckets[0]
    real = runner_mod.denoise_packed
    for logprobs, penalty in ((K, None), (0, None), (K, PenaltyRow([3, 4, 5], 1, presence=0.5, bias=((7, 1.0),)))):
        captured = {}

        def spy(params, kv_pages, packed, *, spec, layout):
            captured["hlo"] = real.lower(params, kv_pages, packed, spec=spec, layout=layout).compile().as_text()
            return real(params, kv_pages, packed, spec=spec, layout=layout)

        runner_mod.denoise_packed = spy
        try:
            runner.denoise([DecodeRow(tokens=np.full(B, M, np.int32), immutable=np.zeros(B, bool), prefix_pages=[],
                                      write_page=0, steps_taken=0, temperature=0.0, top_k=-1, top_p=1.0, seed=0,
                                      rng_step=0, algo_state=None, logprobs=logprobs, penalty=penalty)] * rows)
        finally:
            runner_mod.denoise_packed = real
        hlo = captured["hlo"]
        assert re.search(rf"f32\[{rows * B},{vocab // 4}\]|f32\[{rows},{B},{vocab // 4}\]", hlo)
        assert not re.search(rf"\[[\d,]*\b{vocab}\]", hlo), (logprobs, penalty)


@pytest.mark.parametrize("vocab_major", [False, True], ids=["lm_head", "tied"])
def test_tiled_top_k_and_token_logits_equal_the_full_logits(vocab_major):
    """The fused path's top-k runs over vocabulary tiles (the last one shifted back, its overlap masked) and
    never forms ``[N, V]``: it must equal ``lax.top_k`` of the full logits, the mask id excluded."""
    import jax

    from dllm_jax.decode import logprobs as lp

    rng = np.random.default_rng(0)
    h = rng.standard_normal((8, 8)).astype(np.float32)
    w = rng.standard_normal((100, 8) if vocab_major else (8, 100)).astype(np.float32)
    logits = h.astype(np.float64) @ (w.T if vocab_major else w)
    tokens = rng.integers(0, 100, 8).astype(np.int32)
    (vals, ids), chosen = jax.jit(lambda h, w, t: (lp._top_k_local(h, w, 20, 37, vocab_major, tile=16),
                                                   lp._token_logits_local(h, w, t, 0, vocab_major)))(h, w, tokens)
    full = logits.copy()
    full[:, 37] = -np.inf
    want_ids = np.argsort(-full, axis=1, kind="stable")[:, :20]
    assert np.array_equal(np.asarray(ids), want_ids)
    assert np.allclose(vals, np.take_along_axis(full, want_ids, 1), atol=1e-5)
    assert np.allclose(chosen, logits[np.arange(8), tokens], atol=1e-5)


def test_followers_replay_variant_calls(tiny_model, make_engine):
    """Multi-host: the variant travels in the call's header, so a follower shapes the penalty tables itself and
    runs the same step (its KV pool ends equal to the leader's)."""
    from test_distributed import QueueChannel, start_follower

    channel = QueueChannel()
    leader = make_engine(tiny_model, channel=channel, **ENGINE_KW)
    r = leader.runner
    follower, thread, result = start_follower(leader, channel, max_rows=8)
    leader.generate(input_ids=PROMPTS[:2], sampling_params=[
        {"max_new_tokens": 8, "return_logprob": True, "top_logprobs_num": K, **PENALTIES, "temperature": 0.8,
         "seed": 5},
        {"max_new_tokens": 8, "return_logprob": True, "top_logprobs_num": K}])
    calls = r.device_calls
    leader.shutdown()
    thread.join(timeout=60)
    assert result["calls"] == calls > 0
    for (lk, lv), (fk, fv) in zip(r.kv_pages, follower.kv_pages):
        assert np.array_equal(np.asarray(lk), np.asarray(fk)) and np.array_equal(np.asarray(lv), np.asarray(fv))
