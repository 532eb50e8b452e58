"""The fused LM-head confidence kernel (interpret mode on CPU) against its plain-JAX reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.confidence import (
    confidence_stats,
    confidence_stats_reference,
    confidence_tiles,
    confidence_triples,
    finalize_confidence_triple,
    get_confidence_fn,
    merge_confidence_triples,
)

reference = jax.jit(confidence_stats_reference, static_argnames="exclude_token_id")


def _data(n, h, v, *, seed=0, dtype=jnp.float32, ints=False):
    rng = np.random.default_rng(seed)
    if ints:  # small integers: logits are exact whatever the summation order, and the max is tied
        hidden, head = rng.integers(-1, 2, (n, h)), rng.integers(-1, 2, (h, v))
    else:
        hidden, head = rng.standard_normal((n, h)), rng.standard_normal((h, v)) * 0.3
    return jnp.asarray(hidden, dtype), jnp.asarray(head, dtype)


def _check(out, ref, tol=2e-5):
    np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(ref[0]))
    assert out[0].dtype == jnp.int32 and out[1].dtype == jnp.float32 and out[2].dtype == jnp.float32
    assert float(jnp.max(jnp.abs(out[1] - ref[1]))) <= tol
    assert float(jnp.max(jnp.abs(out[2] - ref[2]))) <= tol


@pytest.mark.parametrize("n,h,v,tiles", [
    (5, 48, 1000, dict()),  # defaults: vocab tail (1000 = 7 x 128 + 104), hidden tail (48 < 64), 2 splits
    (40, 64, 777, dict(block_n=16, block_v=64, block_h=32, vocab_splits=5, vocab_major=True)),  # [V, H] head
])
def test_matches_reference_f32(n, h, v, tiles):
    hidden, head = _data(n, h, v)
    ref = reference(hidden, head)
    if tiles.get("vocab_major"):
        head = head.T
    _check(confidence_stats(hidden, head, interpret=True, **tiles), ref)


def test_excluded_argmax_and_ties_break_low():
    """Integer data: the max logit is shared by several tokens in different tiles and splits, so the
    lowest id must win; excluding it must hand the win to the next tied id, never to itself."""
    hidden, head = _data(16, 4, 600, seed=1, ints=True)
    fn = get_confidence_fn("pallas_interpret", block_v=32, vocab_splits=4)
    logits = np.asarray(hidden @ head)
    ties = (logits == logits.max(axis=1, keepdims=True)).sum(axis=1)
    assert (ties > 1).all()
    ref = reference(hidden, head)
    _check(fn(hidden, head), ref)
    excl = int(ref[0][0])
    ref_x = reference(hidden, head, exclude_token_id=excl)
    out_x = fn(hidden, head, exclude_token_id=excl)
    _check(out_x, ref_x)
    assert int(out_x[0][0]) != excl and not np.any(np.asarray(out_x[0]) == excl)


def test_reference_argmax_is_jnp_argmax():
    """The reference finds the argmax with two plain reductions (faster on XLA:CPU than argmax's pair reduction):
    it must be ``jnp.argmax`` exactly: ties to the lowest id, an all -inf row, a NaN anywhere, the excluded id."""
    from pallas_kernels.confidence import confidence_stats_from_logits

    rng = np.random.default_rng(3)
    logits = rng.integers(-2, 3, (64, 300)).astype(np.float32)  # many tied maxima
    logits[1] = -np.inf
    logits[2, [5, 200]] = np.nan
    logits[3, 7] = np.nan
    logits[4, :] = 2.0
    logits[5, 0] = np.inf
    logits[6, [3, 9]] = np.inf
    for exclude in (None, 0, 3, 299):
        arg, _, _ = jax.jit(confidence_stats_from_logits, static_argnames="exclude_token_id")(
            jnp.asarray(logits), exclude_token_id=exclude)
        masked = logits.copy()
        if exclude is not None:
            masked[:, exclude] = -np.inf
        np.testing.assert_array_equal(np.asarray(arg), np.asarray(jnp.argmax(jnp.asarray(masked), axis=-1)))


def test_bf16():
    hidden, head = _data(8, 32, 500, seed=2, dtype=jnp.bfloat16)
    out = confidence_stats(hidden, head, exclude_token_id=7, interpret=True, vocab_splits=2)
    _check(out, reference(hidden, head, exclude_token_id=7), tol=1e-3)


def test_vocab_shards_merge_like_tensor_parallel():
    """What the TP code does: each shard scores its vocab slice with the exclusion shifted into its
    local ids (traced; out of range = nothing excluded), offsets its argmax, then one merge."""
    hidden, head = _data(6, 32, 999, seed=3)
    excl = 500  # in the middle shard
    shard = 333
    triples = []
    for lo in range(0, 999, shard):
        m, s, a = confidence_triples(hidden, head[:, lo:lo + shard], jnp.int32(excl - lo), interpret=True)
        triples.append((m, s, a + lo))
    m, s, a = (jnp.stack(x) for x in zip(*triples))
    out = finalize_confidence_triple(*merge_confidence_triples(m, s, a, axis=0))
    _check(out, reference(hidden, head, exclude_token_id=excl))


def test_merge_is_order_independent_on_ties():
    m = jnp.array([[1.0, 3.0], [3.0, 3.0], [2.0, -jnp.inf]])
    s = jnp.array([[1.0, 1.0], [2.0, 1.0], [1.0, 0.0]])
    a = jnp.array([[4, 9], [7, 2], [0, 5]], jnp.int32)
    for perm in ([0, 1, 2], [2, 1, 0], [1, 0, 2]):
        mm, ss, aa = merge_confidence_triples(m[jnp.array(perm)], s[jnp.array(perm)], a[jnp.array(perm)], axis=0)
        np.testing.assert_array_equal(np.asarray(aa), [7, 2])
        np.testing.assert_allclose(np.asarray(mm), [3.0, 3.0])
        np.testing.assert_allclose(np.asarray(ss), [2.0 + np.exp(-2) + np.exp(-1), 2.0], rtol=1e-6)


def test_backends_and_tiles():
    assert get_confidence_fn("xla") is confidence_stats_reference
    assert get_confidence_fn("auto") is confidence_stats_reference  # CPU: auto means XLA
    with pytest.raises(ValueError):
        get_confidence_fn("triton")
    t = confidence_tiles(32, 2048, 151936)  # SDAR-1.7B denoise step at batch 1
    assert (t["block_n"], t["block_v"], t["n_row_tiles"], t["vocab_splits"]) == (32, 128, 1, 264)
    t = confidence_tiles(2048, 2048, 151936)  # batch 64
    assert (t["block_n"], t["n_row_tiles"], t["vocab_splits"], t["num_warps"]) == (128, 16, 17, 8)
