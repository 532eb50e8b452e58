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


# ----------------------------------------------------------------------------------------------
# auto: Pallas or XLA per shape, from the measured crossover table
# ----------------------------------------------------------------------------------------------

def _table(kind="Test GPU"):
    e = lambda n, w, vm=False: dict(positions=n, hidden=2048, vocab=151936, vocab_major=vm, winner=w)  # noqa: E731
    return {"devices": {kind: [e(32, "pallas"), e(256, "pallas"), e(1024, "xla"), e(4096, "xla"),
                               e(32, "xla", True)]}}


def test_crossover_lookup():
    """The winner of the entry nearest in log2(positions), of the same (hidden, vocab) and head layout (the other
    layout when only that one was measured); the default where the device or shape has no entry."""
    from pallas_kernels.confidence import CROSSOVER_DEFAULT, choose_confidence_backend

    t = _table()

    def pick(n, h=2048, v=151936, vm=False, kind="Test GPU"):
        return choose_confidence_backend(n, h, v, vocab_major=vm, device_kind=kind, table=t)

    assert [pick(n) for n in (1, 32, 64, 128, 256, 511, 512, 513, 2048, 1 << 20)] == \
        ["pallas", "pallas", "pallas", "pallas", "pallas", "pallas", "xla", "xla", "xla", "xla"]  # 512: tie -> 1024
    assert pick(2048, vm=True) == "xla" and pick(32, vm=True) == "xla"  # its own layout's entries only
    assert pick(32, kind="Other GPU") == CROSSOVER_DEFAULT == "pallas"  # device not in the table
    assert pick(32, h=4096) == CROSSOVER_DEFAULT and pick(32, v=1000) == CROSSOVER_DEFAULT  # shape not in it
    assert choose_confidence_backend(32, 2048, 151936, device_kind="x", table={}) == CROSSOVER_DEFAULT


def test_shipped_crossover_table_is_well_formed():
    """The table kept in the repository: every entry names its shape and a winner consistent with its times;
    on the measured H200 the 2,048-position case (3.37 vs 2.34 ms, bench/RESULTS.md) goes to XLA."""
    from pallas_kernels.confidence import choose_confidence_backend, crossover_table

    table = crossover_table()
    assert table["devices"], "pallas_kernels/confidence_crossover.json is missing or empty"
    for kind, entries in table["devices"].items():
        assert kind in table.get("sources", {}), kind
        for e in entries:
            assert {"positions", "hidden", "vocab", "winner"} <= set(e) and e["winner"] in ("pallas", "xla")
            if "pallas_us" in e and "xla_us" in e:
                assert e["winner"] == ("pallas" if e["pallas_us"] <= e["xla_us"] else "xla"), e
    h200 = dict(hidden_dim=2048, vocab=151936, device_kind="NVIDIA H200", table=table)
    assert choose_confidence_backend(2048, **h200) == "xla"
    assert choose_confidence_backend(2048, vocab_major=True, **h200) == "xla"  # the tied head (the engine's)
    assert choose_confidence_backend(32, **h200) == "pallas"


def test_write_crossover_merges(tmp_path):
    from pallas_kernels.confidence import choose_confidence_backend, crossover_table, write_crossover

    path = str(tmp_path / "table.json")
    e = lambda n, w, **kw: dict(positions=n, hidden=64, vocab=1000, winner=w, **kw)  # noqa: E731
    write_crossover("A", [e(32, "pallas"), e(256, "xla")], path=path, source="run 1")
    write_crossover("B", [e(32, "xla")], path=path, source="run 2")
    write_crossover("A", [e(256, "pallas", pallas_us=1.0, xla_us=2.0)], path=path)  # replaces A's 256
    table = crossover_table(path)
    assert table["sources"] == {"A": "run 1", "B": "run 2"}
    assert [(x["positions"], x["winner"]) for x in table["devices"]["A"]] == [(32, "pallas"), (256, "pallas")]
    assert choose_confidence_backend(256, 64, 1000, device_kind="B", table=table) == "xla"
    assert crossover_table(str(tmp_path / "missing.json")) == {"devices": {}}


def test_auto_runs_the_winner_per_shape(tmp_path, monkeypatch):
    """``confidence_stats_auto`` (what ``auto`` runs on a GPU) takes the table's winner for each traced shape and
    gives the reference's results either way (here on CPU: the kernel in interpret mode, both head layouts);
    the engine config keeps ``auto`` only on a GPU."""
    import json

    import pallas_kernels.confidence as conf
    from pallas_kernels import resolve_confidence_backend

    kind = jax.devices()[0].device_kind
    table = {"devices": {kind: [dict(positions=8, hidden=32, vocab=500, winner="pallas"),
                                dict(positions=64, hidden=32, vocab=500, winner="xla")]}}
    path = tmp_path / "table.json"
    path.write_text(json.dumps(table))
    monkeypatch.setenv("DLLM_JAX_CONFIDENCE_CROSSOVER", str(path))
    calls = []
    real_kernel = conf.confidence_stats
    monkeypatch.setattr(conf, "confidence_stats", lambda *a, **k: calls.append("pallas") or real_kernel(*a, **k))
    for n, want in ((8, ["pallas", "pallas"]), (64, [])):
        hidden, head = _data(n, 32, 500, seed=n)
        ref = reference(hidden, head, exclude_token_id=3)
        calls.clear()
        _check(conf.confidence_stats_auto(hidden, head, exclude_token_id=3, interpret=True), ref)
        _check(conf.confidence_stats_auto(hidden, head.T, exclude_token_id=3, interpret=True, vocab_major=True), ref)
        assert calls == want
    assert resolve_confidence_backend("auto") == "xla"  # CPU
    assert resolve_confidence_backend("pallas_interpret") == "pallas_interpret"
    with pytest.raises(ValueError):
        resolve_confidence_backend("pallas")  # needs a GPU
