"""The commit forward: when no row of a call has a position left to decode, a foldable algorithm's step writes the
blocks' K/V and skips the rest of the forward (dllm_jax/decode/step.py::_one_step, a ``lax.cond``). Its result is
the full update's (nothing changes, every row done with fresh K/V), and the K/V it writes are the ones the same call
writes when it decodes: they are computed before the branch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ENGINE_KW

from dllm_jax.decode.algorithms import make_algorithm
from dllm_jax.decode.step import DenoiseBatch, StepSpec, denoise, init_kv_pages
from dllm_jax.model.loader import load_model


def _settled_batch(cfg, block, mask_id, pages, rng):
    """Three rows after a prefix of 2 pages each: a finished block (no mask, nothing immutable but the first
    positions, one committed token equal to the mask id's neighbour), a block of all-immutable prompt, a padding
    row (all immutable, trash page)."""
    rows, width = 3, 4
    tokens = rng.integers(0, cfg.vocab_size, (rows, block)).astype(np.int32)
    tokens[tokens == mask_id] = (mask_id + 1) % cfg.vocab_size
    immutable = np.zeros((rows, block), bool)
    immutable[0, :2] = True
    immutable[1:] = True
    tokens[2, 3] = mask_id  # a padding row's literal mask id is immutable: nothing to decode
    table = np.zeros((rows, width), np.int32)
    table[0, :2], table[1, :2] = (1, 2), (3, 4)
    prefix = np.asarray([2 * block, 2 * block, 0], np.int32)
    zeros = np.zeros(rows, np.int32)
    return DenoiseBatch(tokens=jnp.asarray(tokens), immutable=jnp.asarray(immutable), page_table=jnp.asarray(table),
                        prefix_len=jnp.asarray(prefix), write_page=jnp.asarray([5, 6, 0], jnp.int32),
                        steps_taken=jnp.asarray([3, 0, 0], jnp.int32), temperature=jnp.zeros(rows, jnp.float32),
                        top_k=jnp.asarray(zeros), top_p=jnp.ones(rows, jnp.float32),
                        seed=jnp.zeros(rows, jnp.uint32), rng_step=jnp.asarray(zeros))


def _random_pool(cfg, block, pages, rng):
    return [tuple(jnp.asarray(rng.standard_normal(p.shape).astype(np.float32)) for p in layer)
            for layer in init_kv_pages(cfg, pages, block)]


@pytest.mark.parametrize("model,algorithm", [("shipped", "LowConfidence"), ("tiny", "EntropyThreshold")])
def test_commit_forward_keeps_the_block_and_writes_the_same_kv(model, algorithm, tiny_model):
    loaded = load_model(tiny_model if model == "tiny" else _shipped_path())
    cfg, params = loaded.config, loaded.params
    block, mask_id = cfg.block_size, cfg.mask_token_id
    algo = make_algorithm(algorithm, {})
    assert algo.foldable
    spec = StepSpec(model=cfg, block_size=block, mask_id=mask_id, algorithm=algo)
    rng = np.random.default_rng(0)
    settled = _settled_batch(cfg, block, mask_id, 8, rng)
    pool = _random_pool(cfg, block, 8, rng)
    state = algo.init_state(3, block)
    # the same call with one position of row 0 still masked: it decodes
    unsettled = DenoiseBatch(**{**vars(settled), "tokens": settled.tokens.at[0, block - 1].set(mask_id)})

    kv_settled, got = jax.tree.map(np.asarray, denoise(params, _copy(pool), settled, state, spec=spec))
    kv_open, opened = jax.tree.map(np.asarray, denoise(params, _copy(pool), unsettled, state, spec=spec))

    np.testing.assert_array_equal(got.tokens, np.asarray(settled.tokens))
    assert got.done.all() and got.fresh_kv.all() and (got.steps == 1).all()
    jax.tree.map(np.testing.assert_array_equal, got.state, jax.tree.map(np.asarray, state))
    assert not opened.done[0] and opened.tokens[0, block - 1] != mask_id

    # rows 1 and 2 hold the same tokens in both calls: their pages (6, and the trash page 0) are bit-equal whichever
    # branch ran; row 0's page differs (a mask in one call); pages no row writes are untouched
    untouched = [1, 2, 3, 4, 7]
    for (ks, vs), (ko, vo), (kp, vp) in zip(kv_settled, kv_open, pool):
        for settled_pool, open_pool, before in ((ks, ko, kp), (vs, vo, vp)):
            np.testing.assert_array_equal(settled_pool[:, [6, 0]], open_pool[:, [6, 0]])
            assert not np.array_equal(settled_pool[:, 5], open_pool[:, 5])
            np.testing.assert_array_equal(settled_pool[:, untouched], np.asarray(before)[:, untouched])
            np.testing.assert_array_equal(open_pool[:, untouched], np.asarray(before)[:, untouched])


def _copy(pool):
    return jax.tree.map(jnp.copy, pool)  # the step donates its pool


def _shipped_path():
    from dllm_jax.assets import DEFAULT_MODEL_PATH

    return DEFAULT_MODEL_PATH


@pytest.mark.parametrize("schedule", ["fdfo", "sync"])
def test_one_request_ends_every_block_with_a_kv_only_forward(schedule, tiny_model, make_engine):
    """At one request every block's last forward is its commit forward, and the engine reports each as K/V-only
    (the efficiency bench charges those as such). The forwards add up to the request's count."""
    engine = make_engine(tiny_model, **dict(ENGINE_KW, schedule=schedule))  # the engine tests' shared programs
    engine.runner.call_log = calls = []
    prompt, max_new = [5, 6, 7, 8, 9, 10], 13
    out = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": max_new, "temperature": 0})
    engine.runner.call_log = None
    block = engine.block_size
    blocks = -(-(len(prompt) + max_new) // block) - len(prompt) // block
    denoise_calls = [c for c in calls if c.kind == "denoise"]
    assert len(out["output_ids"]) == max_new
    assert sum(c.kv_only for c in denoise_calls) == blocks
    assert sum(c.iterations for c in calls) == out["meta_info"]["forward_passes"]
