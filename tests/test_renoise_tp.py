"""DiffusionGemma on a device mesh (4 forced CPU devices): tensor parallel 2 / 4 and expert parallel give the seeded
tokens of one device in the near-argmax regime; the parameters, the pools and the vocabulary pass are really split;
in the sampled regime a sharded step's draws differ from one device's only at float64 near-ties.

The regime of tests/test_renoise_cache.py (temperature -> 0, every position accepted): a token is the argmax of
logits whose top two are far apart compared with float32 rounding, so the answers are a function of the model, not
of how its sums were split. In the default sampled regime a sharded forward rounds its row-parallel sums (attention
output, MLP down projections, the vocabulary pass's merge) in another order, and on a random checkpoint every
distribution is near uniform: a draw whose two best candidates lie within that rounding can flip. The step-level
test classifies every such flip against float64.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("torch")

import dllm_jax  # noqa: E402
from dllm_jax.testing.diffusion_gemma import FULL, SLIDING, write_tiny_diffusion_gemma  # noqa: E402
from dllm_jax.testing.tokenizer_files import write_gemma_tokenizer  # noqa: E402

EXACT = {"t_min": 0.0, "t_max": 1e-3, "entropy_bound": 1e9, "max_denoising_steps": 4}
VOCAB = 408  # divides 2, 4 and 8: the vocabulary (embedding = tied LM head) splits over tp
# two prompts over a page (each encodes in two chunks of 16): every call's page tables are 2 pages wide (context 32)
PROMPTS = [[5, 9, 33, 70, 81, 90, 120, 7, 8, 9, 10, 11, 12, 300, 301, 302, 303], list(range(20, 41))]
# the main suite's case: one canvas of 4 (two executables per engine: a one-row encode, the denoise loop); the slow
# cases: two canvases (the finished first canvases encode together: a two-row encode)
PARAMS = [{"max_new_tokens": 4, "seed": 100 + i, "ignore_eos": True} for i in range(len(PROMPTS))]
LONG = [dict(p, max_new_tokens=8) for p in PARAMS]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("dg_tp")
    ids = write_gemma_tokenizer(str(path), bpe_vocab=VOCAB - 5)
    # the published layout (tied), two layers: sliding (4 q heads, 2 KV heads) and full (1 KV head); 4 experts
    write_tiny_diffusion_gemma(path, canvas_length=4, tie=True, vocab_size=VOCAB, sliding_window=6,
                               num_hidden_layers=2, layer_types=[SLIDING, FULL],
                               eos_token_id=[ids["<eos>"], ids["<end_of_turn>"]])
    return str(path)


def _engine(model_dir, **kw):
    return dllm_jax.Engine(model_path=model_dir, warmup=False, algorithm_config=EXACT, max_running_requests=2,
                           max_prefill_tokens=16, context_length=32, **kw)


def _answers(engine, params=PARAMS):
    outs = [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=params)]
    engine.scheduler.check_pages()
    return outs


@pytest.fixture(scope="module")
def one_device(model_dir):
    engine = _engine(model_dir)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def reference(one_device):
    return _answers(one_device)


@pytest.fixture(scope="module")
def long_reference(one_device):
    return _answers(one_device, LONG)


def _per_device_bytes(x):
    return max(s.data.nbytes for s in x.addressable_shards)


def test_tp2_gives_the_tokens_of_one_device_and_is_split(model_dir, reference):
    assert len(jax.devices()) >= 4, "conftest sets four CPU devices"
    engine = _engine(model_dir, tensor_parallel_size=2)
    try:
        params, runner = engine.runner.params, engine.runner
        sliding, full = params["layers"]
        assert params["embed"].sharding.spec[0] == "tp"  # by vocabulary (also the tied LM head)
        assert _per_device_bytes(params["embed"]) * 2 == params["embed"].nbytes
        assert sliding["q"].sharding.spec[0] == "tp" and sliding["o"].sharding.spec[1] == "tp"  # by head
        assert sliding["k"].sharding.spec[0] == "tp" and sliding["v"].sharding.spec[0] == "tp"  # 2 KV heads
        assert full["k"].sharding.spec[0] is None  # the full layer's one KV head: replicated
        assert sliding["gate"].sharding.spec[0] == "tp" and sliding["down"].sharding.spec[1] == "tp"
        assert sliding["experts_up"].sharding.spec == jax.sharding.PartitionSpec(None, "tp", None)  # expert_mlp
        assert sliding["attn_norm"].sharding.spec == jax.sharding.PartitionSpec(None)
        assert _answers(engine) == reference
        for layer, split in zip(runner.pool, (True, False)):  # after donated calls, as they were placed
            for pool in layer:
                assert (pool.sharding.spec[0] == "tp") == split
                assert _per_device_bytes(pool) * (2 if split else 1) == pool.nbytes
        assert engine.get_model_info()["tensor_parallel_size"] == 2
    finally:
        engine.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("tp,ep,schedule", [(4, 1, "fdfo"), (4, 1, "sync"), (1, 4, "fdfo"), (2, 2, "sync")])
def test_tp4_and_expert_parallel_give_the_tokens_of_one_device(model_dir, long_reference, tp, ep, schedule):
    """TP 4 (the KV heads do not divide: the pools stay whole, q heads and MLPs split), experts over 4 devices,
    and 2 x 2; both schedules."""
    engine = _engine(model_dir, tensor_parallel_size=tp, expert_parallel_size=ep, schedule=schedule)
    try:
        experts = engine.runner.params["layers"][0]["experts_gate"]
        assert experts.sharding.spec[0] == ("expert" if ep > 1 else None)
        assert _per_device_bytes(experts) * ep * tp == experts.nbytes
        assert _answers(engine, LONG) == long_reference
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_penalties_and_top_logprobs_over_tp2(model_dir, one_device):
    """The penalty and top-k variants on a mesh (their tables sent as the call's inputs, applied per vocabulary
    shard by global token id, top-k merged across shards): the tokens, log-probabilities and top tokens of one
    device, and the bias really acts (a banned token never appears, a favoured one wins)."""
    options = [{"repetition_penalty": 1.3, "presence_penalty": 1.0, "logit_bias": {"7": 100.0, "300": -100.0},
                "top_logprobs_num": 3}, {"frequency_penalty": 0.5, "logit_bias": {"21": -100.0}}]
    params = [dict(p, **o, return_logprob=True) for p, o in zip(LONG, options)]

    def run(engine):
        outs = engine.generate(input_ids=PROMPTS, sampling_params=params)
        engine.scheduler.check_pages()
        return [(o["output_ids"], o["meta_info"]["output_token_logprobs"],
                 o["meta_info"].get("output_top_logprobs")) for o in outs]

    want = run(one_device)
    engine = _engine(model_dir, tensor_parallel_size=2)
    try:
        got = run(engine)
    finally:
        engine.shutdown()
    assert [g[0] for g in got] == [w[0] for w in want]
    assert 7 in want[0][0] and 300 not in want[0][0] and 21 not in want[1][0]
    for (_, lp_got, top_got), (_, lp_want, top_want) in zip(got, want):
        np.testing.assert_allclose([x[0] for x in lp_got], [x[0] for x in lp_want], rtol=1e-5, atol=1e-5)
        if top_want:
            assert [[t[1] for t in pos] for pos in top_got] == [[t[1] for t in pos] for pos in top_want]


@pytest.mark.slow
def test_sampled_regime_differences_are_float64_near_ties(model_dir):
    """One denoise step at a time, on the same inputs (the one-device step's state fed to both), in the default
    sampled regime: where the TP 2 step's sample or argmax differs from one device's, the float64 margin between
    the two best candidates (computed from the one-device hidden states) is within the float64 change of the logits
    that the sharded hidden states make, which is itself float32 rounding (relative 1e-5)."""
    from jax.sharding import NamedSharding

    from dllm_jax.decode import renoise
    from dllm_jax.model import gemma
    from dllm_jax.model.loader import load_model
    from dllm_jax.sharding import layer_pool_shardings, make_mesh, shard_params
    from pallas_kernels import renoise as R

    loaded = load_model(model_dir)
    cfg, params = loaded.config, loaded.params
    mesh = make_mesh(2)
    sharded = shard_params(params, cfg, mesh)
    rcfg = renoise.RenoiseConfig(max_denoising_steps=16)
    S, rows = 16, 2
    pool = gemma.init_kv_pages(cfg, {"full": 8, "sliding": 8}, S)
    tables = {k: np.asarray([[1, 2, 3], [4, 5, 6]], np.int32) for k in ("full", "sliding")}
    tokens = np.asarray([PROMPTS[0][:11] + [0] * 5, PROMPTS[1][:16]], np.int32)  # prefixes of 11 and 16 tokens
    prefix = np.asarray([11, 16], np.int32)
    pool = gemma.encode_chunk_jit(params, cfg, tokens, np.zeros(rows, np.int32), prefix, pool, tables)
    pool_tp = jax.tree.map(jax.device_put, pool, layer_pool_shardings(pool, mesh))
    seeds, canvas_index = np.asarray([7, 8], np.uint32), np.zeros(rows, np.int32)
    state = renoise.initial_state(cfg, rcfg, seeds, canvas_index, np.float32)

    step = jax.jit(renoise.denoise_step, static_argnums=(1, 2), static_argnames=("draws", "mesh"))
    hidden = jax.jit(gemma.decode_canvas, static_argnums=1)
    replicated = NamedSharding(mesh, jax.sharding.PartitionSpec())
    embed = np.asarray(params["embed"], np.float64)
    cap, C = cfg.final_logit_softcapping, cfg.block_size
    flips = {"argmax": 0, "sample": 0, "accepted": 0}
    draws, worst = 0, 0.0
    for _ in range(rcfg.max_denoising_steps):
        args = (seeds, canvas_index, prefix)
        one, (s1, _, a1) = step(params, cfg, rcfg, state, *args, pool, tables, draws=True)
        two, (s2, _, a2) = step(sharded, cfg, rcfg, jax.device_put(state, replicated), *args, pool_tp, tables,
                                draws=True, mesh=mesh)
        h1 = np.asarray(hidden(params, cfg, state.canvas, prefix, pool, tables, state.soft), np.float64)
        h2 = np.asarray(hidden(sharded, cfg, state.canvas, prefix, pool_tp, tables, state.soft), np.float64)
        worst = max(worst, float(np.max(np.abs(h1 - h2)) / np.max(np.abs(h1))))
        assert worst <= 1e-5  # float32 rounding, not a different model
        temperature = rcfg.t_min + (rcfg.t_max - rcfg.t_min) * np.asarray(state.step, np.float64) / \
            rcfg.max_denoising_steps
        z1, z2 = (cap * np.tanh(h @ embed.T / cap) / temperature[:, None, None] for h in (h1, h2))
        keys = R.draw_key(seeds[:, None], canvas_index[:, None], np.asarray(state.step)[:, None],
                          np.arange(C)[None, :], stream=renoise.STREAM_SAMPLE)
        ids = jnp.arange(VOCAB, dtype=jnp.uint32)
        bits = np.asarray(R.mix32(keys[..., None] ^ R.mix32(ids * jnp.uint32(R.GOLDEN))))  # as R.gumbel hashes
        gumbel = -np.log(-np.log(((bits >> 8).astype(np.float64) + 0.5) / (1 << 24)))
        # how far the sharded hidden states move each logit (float64), plus float32's own resolution of a logit
        drift = np.max(np.abs(z1 - z2), axis=-1) + 1e-6 * np.max(np.abs(z1))
        for name, z, got1, got2 in (("argmax", z1, one.argmax, two.argmax), ("sample", z1 + gumbel, s1, s2)):
            top2 = -np.sort(-z, axis=-1)[..., :2]
            differ = np.asarray(got1) != np.asarray(got2)
            flips[name] += int(differ.sum())
            assert np.all((top2[..., 0] - top2[..., 1])[differ] <= 2 * drift[differ]), name
        draws += C * rows
        # acceptance (entropy order and the bound): where it differs, float64 puts the position within the entropy
        # drift of another's entropy (the order) or of the bound (the sum of the entropies before it)
        h64 = [_entropy(z) for z in (z1, z2)]
        spread = np.max(np.abs(h64[0] - h64[1]), axis=-1, keepdims=True) + 1e-6
        ent = h64[0]
        before = np.where(ent[:, None, :] < ent[:, :, None], ent[:, None, :], 0).sum(-1)  # [rows, C]
        near_order = (np.abs(ent[:, :, None] - ent[:, None, :]) <= 2 * spread[..., None]).sum(-1) > 1
        near_bound = np.abs(before - rcfg.entropy_bound) <= C * spread
        differ = np.asarray(a1) != np.asarray(a2)
        flips["accepted"] += int(differ.sum())
        assert np.all((near_order | near_bound)[differ])
        state = one
    print(f"sampled regime, TP 2 vs one device, {draws} positions: {flips} differ, each a float64 near-tie; "
          f"hidden states differ by at most {worst:.2e} (relative)")


def _entropy(z):
    z = z - z.max(-1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(-1, keepdims=True)
    return -(p * np.log(p)).sum(-1)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["xla", "pallas_interpret"])
def test_vocabulary_pass_over_four_shards_decides_as_one(backend):
    """The sharded pass itself (under ``shard_map`` on 4 devices, penalty tables and top-k included): the decisions
    of the whole pass, bit for bit; the sums within float32 rounding."""
    from test_renoise_kernel import _case, _check, _tables

    from dllm_jax.decode.renoise import vocab_parallel_stats
    from dllm_jax.sharding import make_mesh
    from pallas_kernels import renoise as R

    rows, row_len, v, h = 2, 4, 300, 24
    rng = np.random.default_rng(3)
    hidden, embed, _, _ = _case(n=rows * row_len, h=h, v=v, seed=2)
    temps = jnp.asarray(np.repeat(rng.uniform(0.4, 0.8, rows), row_len), jnp.float32)
    keys = R.draw_key(3, 0, jnp.arange(rows * row_len) // row_len, jnp.arange(rows * row_len) % row_len)
    kw = dict(softcap=30.0, adjust=_tables(rows, row_len, v, 16, rng), row_len=row_len, top_k=3, embed_scale=h ** 0.5)
    want = R.renoise_stats_reference(hidden, embed, embed, temps, keys, **kw)
    got = vocab_parallel_stats(backend, make_mesh(4), hidden, embed, embed, temps, keys, **kw)
    _check(got, want)
    np.testing.assert_array_equal(np.asarray(got.top_ids), np.asarray(want.top_ids))
