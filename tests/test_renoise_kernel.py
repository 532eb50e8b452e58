"""The fused renoise pass (pallas_kernels/renoise.py): the streaming XLA loop and the Pallas kernel (interpret
mode) against the materialised reference; vocabulary shards merged; samples follow the softmax."""

from __future__ import annotations

import functools

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


# ----------------------------------------------------------------------------------------------
# Per-row adjustments and top-k, against float64 numpy of the same draws
# ----------------------------------------------------------------------------------------------

from pallas_kernels import renoise_adjust as A  # noqa: E402


def _tables(rows, row_len, vocab, width, rng, used=None):
    """Random sorted tables: repetition factors, additive deltas and masks (``until``) on random ids."""
    ids = np.full((rows, width), int(A.PAD_ID), np.int64)
    rep = np.ones((rows, width), np.float32)
    add = np.zeros((rows, width), np.float32)
    until = np.zeros((rows, width), np.int32)
    for r in range(rows):
        k = int(rng.integers(1, width + 1)) if used is None else used
        chosen = np.sort(rng.choice(vocab, k, replace=False))
        ids[r, :k] = chosen
        rep[r, :k] = np.where(rng.random(k) < 0.6, rng.uniform(0.3, 2.0, k), 1.0)
        add[r, :k] = np.where(rng.random(k) < 0.7, rng.uniform(-3, 3, k), 0.0)
        until[r, :k] = np.where(rng.random(k) < 0.3, rng.integers(0, row_len + 1, k), 0)
    return A.Adjust(jnp.asarray(ids.astype(np.int32)), jnp.asarray(rep), jnp.asarray(add), jnp.asarray(until))


def _float64_draws(hidden, head, temps, keys, softcap, adjust, row_len, top_k):
    """The definition in float64: logits -> soft cap -> each entry's formula -> temperature -> the same Gumbel
    keys' noise; returns argmax, sample, entropy, logprob, top values / ids and each decision's margin."""
    z = np.asarray(hidden, np.float64) @ np.asarray(head, np.float64).T
    n, v = z.shape
    if softcap is not None:
        z = softcap * np.tanh(z / softcap)
    if adjust is not None:
        ids, rep, add, until = (np.asarray(x) for x in adjust)
        for i in range(n):
            r, p = divmod(i, row_len)
            for tid, f, d, u in zip(ids[r], rep[r].astype(np.float64), add[r].astype(np.float64), until[r]):
                if tid == A.PAD_ID:
                    continue
                x = z[i, tid]
                x = (x / f if x > 0 else x * f) + d
                z[i, tid] = -np.inf if p < u else x
    z = z / np.asarray(temps, np.float64)[:, None]
    bits = np.asarray(R.mix32(jnp.asarray(keys)[:, None].astype(jnp.uint32)
                              ^ R.mix32(jnp.arange(v, dtype=jnp.uint32)[None, :] * jnp.uint32(R.GOLDEN))))
    u = ((bits >> 8).astype(np.float64) + 0.5) / (1 << 24)
    g = -np.log(-np.log(u))
    top = z.max(-1)
    lse = top + np.log(np.exp(z - top[:, None]).sum(-1))
    p = np.exp(z - lse[:, None])
    entropy = lse - np.where(p > 0, p * np.where(np.isfinite(z), z, 0), 0).sum(-1)
    order = np.argsort(-z, axis=-1, kind="stable")
    scores = z + g
    s_order = np.argsort(-scores, axis=-1, kind="stable")
    rows = np.arange(n)
    return dict(argmax=order[:, 0], sample=s_order[:, 0], entropy=entropy, logprob=top - lse,
                top_ids=order[:, :top_k], top_logprob=np.take_along_axis(z, order[:, :top_k], -1) - lse[:, None],
                margin=np.minimum(z[rows, order[:, 0]] - z[rows, order[:, 1]],
                                  scores[rows, s_order[:, 0]] - scores[rows, s_order[:, 1]]),
                top_gap=np.min(np.diff(-np.take_along_axis(z, order[:, :top_k + 1], -1), axis=-1), axis=-1)
                if top_k else np.ones(n))


def _check64(got, want, top_k, tol=2e-5):
    clear = want["margin"] > 1e-4  # decisions float32 can resolve
    assert clear.mean() > 0.9
    for f in ("argmax", "sample"):
        np.testing.assert_array_equal(np.asarray(getattr(got, f))[clear], want[f][clear], err_msg=f)
    for f in ("entropy", "logprob"):
        assert _rel(getattr(got, f), want[f]) < tol, f
    assert got.top_ids.shape == (len(want["argmax"]), top_k)
    if top_k:
        sure = want["top_gap"] > 1e-4
        assert sure.mean() > 0.8
        np.testing.assert_array_equal(np.asarray(got.top_ids)[sure], want["top_ids"][sure])
        np.testing.assert_allclose(np.asarray(got.top_logprob), want["top_logprob"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("row_len", [4, 6, 32, 20])  # shorter / longer than the kernel's 16 rows, powers or not
@pytest.mark.parametrize("top_k", [0, 5])
def test_adjustments_and_top_k_against_float64(row_len, top_k):
    rows, v, h = 3, 300, 24
    rng = np.random.default_rng(row_len * 10 + top_k)
    hidden, embed, _, _ = _case(n=rows * row_len, h=h, v=v, seed=row_len)
    temps = jnp.asarray(np.repeat(rng.uniform(0.4, 0.8, rows), row_len), jnp.float32)
    keys = R.draw_key(5, 1, jnp.arange(rows * row_len) // row_len, jnp.arange(rows * row_len) % row_len)
    adj = _tables(rows, row_len, v, 32, rng)
    kw = dict(softcap=30.0, embed_scale=h ** 0.5, adjust=adj, row_len=row_len, top_k=top_k)
    want = _float64_draws(hidden, embed, temps, keys, 30.0, adj, row_len, top_k)
    ref = R.renoise_stats_reference(hidden, embed, embed, temps, keys, **kw)
    _check64(ref, want, top_k)
    stream = R.renoise_stats_streaming(hidden, embed, embed, temps, keys, block_v=64, **kw)
    kern = R.renoise_stats_pallas(hidden, embed, embed, temps, keys, interpret=True, block_v=64, block_k=16,
                                  block_h=16, **kw)
    for got in (stream, kern):
        _check64(got, want, top_k)
        _check(got, ref)  # and the float32 reference: the same decisions, bit for bit
        if top_k:
            np.testing.assert_array_equal(np.asarray(got.top_ids), np.asarray(ref.top_ids))
            assert _rel(got.top_logprob, ref.top_logprob) < 1e-5


def test_masked_tokens_are_never_chosen_and_neutral_tables_change_nothing():
    """Entries masking a token at some positions: never the argmax / sample there (even with a huge logit), still
    possible after; a table of neutral entries (rep 1, add 0) gives the plain pass's results bit for bit."""
    rows, row_len, v, h = 2, 8, 64, 16
    hidden, embed, temps, keys = _case(n=rows * row_len, h=h, v=v, seed=4)
    plain = R.renoise_stats_streaming(hidden, embed, embed, temps, keys, block_v=16)
    favourite = np.asarray(plain.argmax).reshape(rows, row_len)[:, 0]
    ids = np.full((rows, 4), int(A.PAD_ID), np.int32)
    ids[:, 0] = favourite
    adj = A.Adjust(jnp.asarray(ids), jnp.ones((rows, 4)), jnp.full((rows, 4), 50.0), jnp.full((rows, 4), 5, jnp.int32))
    for fn in (functools.partial(R.renoise_stats_streaming, block_v=16),
               functools.partial(R.renoise_stats_pallas, interpret=True, block_v=16, block_k=16, block_h=16)):
        got = fn(hidden, embed, embed, temps, keys, adjust=adj, row_len=row_len, top_k=3)
        arg = np.asarray(got.argmax).reshape(rows, row_len)
        smp = np.asarray(got.sample).reshape(rows, row_len)
        for r in range(rows):
            assert favourite[r] not in arg[r, :5] and favourite[r] not in smp[r, :5]
            assert (arg[r, 5:] == favourite[r]).all()  # +50 after the mask: certain
            assert (np.asarray(got.top_ids).reshape(rows, row_len, 3)[r, :5] != favourite[r]).all()
        neutral = A.Adjust(jnp.asarray(ids), jnp.ones((rows, 4)), jnp.zeros((rows, 4)), jnp.zeros((rows, 4), jnp.int32))
        same = fn(hidden, embed, embed, temps, keys, adjust=neutral, row_len=row_len)
        base = fn(hidden, embed, embed, temps, keys)
        for field in ("argmax", "sample", "entropy", "logprob", "soft"):
            np.testing.assert_array_equal(np.asarray(getattr(same, field)), np.asarray(getattr(base, field)))


def test_top_k_shards_merge_to_the_whole():
    hidden, embed, temps, keys = _case(v=301)
    want = R.renoise_stats_reference(hidden, embed, embed, temps, keys, softcap=30.0, top_k=7)
    cuts = [0, 120, 301]
    parts = [R.renoise_stats_streaming(hidden, embed[a:b], embed[a:b], temps, keys, softcap=30.0, block_v=32,
                                       partials=True, vocab_offset=a, top_k=7) for a, b in zip(cuts, cuts[1:])]
    merged = R.finalize(R.merge_renoise_partials(R.Partials(*[jnp.stack(x) for x in zip(*parts)])))
    _check(merged, want)
    np.testing.assert_array_equal(np.asarray(merged.top_ids), np.asarray(want.top_ids))
    assert _rel(merged.top_logprob, want.top_logprob) < 1e-5


# the main suite runs the kernel's plain shards (the XLA loop's are the two tests above); tables and top-k are slow
@pytest.mark.parametrize("impl,extras", [("pallas_interpret", False),
                                         pytest.param("streaming", True, marks=pytest.mark.slow),
                                         pytest.param("pallas_interpret", True, marks=pytest.mark.slow)])
def test_offset_shards_merge_to_the_whole(impl, extras):
    """Tensor parallelism's split (dllm_jax.decode.renoise.vocab_parallel_stats): each shard streams its slice of
    the head and the embedding from its first token id (``vocab_offset``), its noise, indices and tables (``extras``:
    with tables and top-k) global; the merged shards take the whole pass's decisions, bit for bit."""
    rows, row_len, v, h, top_k = 2, 6, 300, 24, 5
    rng = np.random.default_rng(11)
    hidden, embed, _, _ = _case(n=rows * row_len, h=h, v=v, seed=4)
    temps = jnp.asarray(np.repeat(rng.uniform(0.4, 0.8, rows), row_len), jnp.float32)
    keys = R.draw_key(9, 2, jnp.arange(rows * row_len) // row_len, jnp.arange(rows * row_len) % row_len)
    adj = _tables(rows, row_len, v, 32, rng)
    kw = dict(softcap=30.0, adjust=adj, row_len=row_len, top_k=top_k) if extras else dict(softcap=30.0)
    want = R.renoise_stats_reference(hidden, embed, embed, temps, keys, **kw)
    fn = (functools.partial(R.renoise_stats_streaming, block_v=32) if impl == "streaming" else
          functools.partial(R.renoise_stats_pallas, interpret=True, block_v=32, block_k=16, block_h=16))
    cuts = [0, 75, 150, 225, 300]  # four shards, as TP = 4 splits a vocabulary of 300
    parts = [fn(hidden, embed[a:b], embed[a:b], temps, keys, partials=True, vocab_offset=a, **kw)
             for a, b in zip(cuts, cuts[1:])]
    merged = R.finalize(R.merge_renoise_partials(R.Partials(*[jnp.stack(x) for x in zip(*parts)])))
    _check(merged, want)
    np.testing.assert_array_equal(np.asarray(merged.top_ids), np.asarray(want.top_ids))
