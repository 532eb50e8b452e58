"""The fused renoise pass (pallas_kernels/renoise.py): the streaming XLA loop and the Pallas kernel (interpret
mode) against the materialised reference; vocabulary shards merged; samples follow the softmax."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import renoise as R


def _case(n=6, h=24, v=300, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    hidden = jnp.asarray(rng.normal(0, 1, (n, h)), dtype)
    embed = jnp.asarray(rng.normal(0, 0.5, (v, h)), dtype)
    temps = jnp.asarray(rng.uniform(0.4, 0.8, n), jnp.float32)
    keys = R.draw_key(7, 1, jnp.arange(n) % 3, jnp.arange(n))
    return hidden, embed, temps, keys


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _check(got, want, tol=1e-5):
    np.testing.assert_array_equal(np.asarray(got.argmax), np.asarray(want.argmax))
    np.testing.assert_array_equal(np.asarray(got.sample), np.asarray(want.sample))
    for field in ("entropy", "logprob", "soft"):
        assert _rel(getattr(got, field), getattr(want, field)) < tol, field


@pytest.mark.parametrize("vocab_major", [True, False])
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_streaming_and_kernel_equal_the_reference(vocab_major, softcap):
    hidden, embed, temps, keys = _case()
    head = embed if vocab_major else jnp.asarray(np.random.default_rng(3).normal(0, 0.5, embed.shape[::-1]),
                                                 jnp.float32)
    kw = dict(softcap=softcap, vocab_major=vocab_major, embed_scale=24 ** 0.5)
    want = R.renoise_stats_reference(hidden, head, embed, temps, keys, **kw)
    _check(R.renoise_stats_streaming(hidden, head, embed, temps, keys, block_v=64, **kw), want)
    _check(R.renoise_stats_pallas(hidden, head, embed, temps, keys, interpret=True, block_v=64, block_k=16,
                                  block_h=16, **kw), want)


def test_bfloat16_weights_and_a_materialised_softmax():
    """bf16 hidden / embedding: the kernel's soft embedding equals softmax(z) @ E computed from materialised
    probabilities (float32) within 1e-5; entropy from the log-sum-exp identity equals -sum p log p."""
    hidden, embed, temps, keys = _case(dtype=jnp.bfloat16, seed=1)
    got = R.renoise_stats_pallas(hidden, embed, embed, temps, keys, softcap=30.0, interpret=True, block_v=32,
                                 block_k=16, block_h=32)
    z = R.process_logits(jnp.dot(hidden.astype(jnp.float32), embed.astype(jnp.float32).T), temps, 30.0)
    p = jax.nn.softmax(z, axis=-1)
    assert _rel(got.soft, p @ embed.astype(jnp.float32)) < 1e-5
    assert _rel(got.entropy, -jnp.sum(p * jnp.log(p), axis=-1)) < 1e-5
    np.testing.assert_array_equal(np.asarray(got.argmax), np.asarray(jnp.argmax(z, -1)))


def test_vocabulary_shards_merge_to_the_whole():
    hidden, embed, temps, keys = _case(v=301)
    want = R.renoise_stats_reference(hidden, embed, embed, temps, keys, softcap=30.0)
    cuts = [0, 120, 301]
    parts = [R.renoise_stats_streaming(hidden, embed[a:b], embed[a:b], temps, keys, softcap=30.0, block_v=32,
                                       partials=True, vocab_offset=a) for a, b in zip(cuts, cuts[1:])]
    merged = R.merge_renoise_partials(R.Partials(*[jnp.stack(x) for x in zip(*parts)]))
    _check(R.finalize(merged), want)


def test_samples_follow_the_softmax():
    """4000 positions with the same logits and their own keys: the sample counts pass a chi-square test against
    softmax(z) (p > 0.001), and the draws depend on the key alone (the same key, another batch: the same draw)."""
    from scipy.stats import chisquare

    v, n = 8, 4000
    rng = np.random.default_rng(5)
    embed = jnp.asarray(rng.normal(0, 1, (v, 4)), jnp.float32)
    hidden = jnp.broadcast_to(jnp.asarray(rng.normal(0, 1, (1, 4)), jnp.float32), (n, 4))
    temps = jnp.full((n,), 0.7, jnp.float32)
    keys = R.draw_key(11, 0, 0, jnp.arange(n))
    stats = R.renoise_stats_streaming(hidden, embed, embed, temps, keys, block_v=4)
    p = np.asarray(jax.nn.softmax(R.process_logits(hidden[:1] @ embed.T, temps[:1], None), -1))[0]
    p = p.astype(np.float64) / p.astype(np.float64).sum()
    counts = np.bincount(np.asarray(stats.sample), minlength=v)
    assert chisquare(counts, p * n).pvalue > 1e-3
    again = R.renoise_stats_streaming(hidden[::-1][:7], embed, embed, temps[:7], keys[::-1][:7], block_v=8)
    np.testing.assert_array_equal(np.asarray(again.sample), np.asarray(stats.sample[::-1][:7]))


def test_uniform_tokens_are_uniform():
    from scipy.stats import chisquare

    tokens = np.asarray(R.uniform_tokens(R.draw_key(3, 2, 1, jnp.arange(20000), stream=1), 50))
    assert tokens.min() >= 0 and tokens.max() < 50
    assert chisquare(np.bincount(tokens, minlength=50)).pvalue > 1e-3
