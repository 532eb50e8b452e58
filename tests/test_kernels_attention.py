"""The Pallas paged block attention kernel (interpret mode on CPU) against its plain-JAX reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_block_attention import (
    attention_tiles,
    get_attention_fn,
    paged_block_attention,
    paged_block_attention_reference,
)

NUM_PAGES = 24
reference = jax.jit(paged_block_attention_reference, static_argnames="block_size")  # one compile, not op by op


def _inputs(*, block, chunk_blocks, q_heads, kv_heads, head_dim, dtype=jnp.float32, seed=0):
    """Four rows: prefix 0, exactly one page, three pages, five pages (ragged). Page tables are out of
    order and rows 2 and 3 share their first three pages; unused table slots point at random pages."""
    rng = np.random.default_rng(seed)
    rows, width, t = 4, 6, chunk_blocks * block
    prefix = np.array([0, block, 3 * block, 5 * block], np.int32)
    perm = rng.permutation(np.arange(1, NUM_PAGES))
    table = np.stack([perm[0:6], perm[6:12], perm[12:18], perm[18:23].tolist() + [perm[0]]]).astype(np.int32)
    table[3, :3] = table[2, :3]  # shared prefix pages (as the radix cache hands out)
    assert len(set(table[3, :5])) == 5

    def randn(*shape):
        return jnp.asarray(rng.standard_normal(shape), dtype)

    return (randn(rows, t, q_heads, head_dim), randn(rows, t, kv_heads, head_dim), randn(rows, t, kv_heads, head_dim),
            randn(kv_heads, NUM_PAGES, block, head_dim), randn(kv_heads, NUM_PAGES, block, head_dim),
            jnp.asarray(table), jnp.asarray(prefix))


def _check(args, *, block, tol, **tiles):
    ref = reference(*args, block_size=block)
    out = paged_block_attention(*args, block_size=block, interpret=True, **tiles)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
    assert err <= tol, err
    return err


# (block, chunk blocks, q heads, kv heads, head dim, tile overrides). block_k=16 with B=4 makes
# several prefix tiles per row; explicit kv_splits exercise split-K (the auto value is 1 at these
# sizes) including more splits than a row has tiles; block_q=8 with B=32 puts several query
# tiles in one block.
CASES = [
    (4, 1, 2, 2, 16, dict(block_k=16)),                    # GQA 1, denoise, several prefix tiles
    (4, 3, 4, 2, 16, dict(block_k=16, kv_splits=2)),       # GQA 2, prefill of 3 blocks, split-K
    (4, 1, 8, 1, 16, dict(block_k=16, kv_splits=3)),       # GQA 8, more splits than short rows have tiles
    (32, 1, 4, 2, 32, dict()),                             # GQA 2, denoise, default tiles
    (32, 2, 16, 2, 16, dict(kv_splits=2)),                 # GQA 8, prefill, split-K
    (32, 3, 4, 2, 16, dict(block_q=8, block_k=32)),        # GQA 2, query tiles smaller than a block
]
@pytest.mark.parametrize("block,chunk_blocks,q_heads,kv_heads,head_dim,tiles", CASES)
def test_matches_reference_f32(block, chunk_blocks, q_heads, kv_heads, head_dim, tiles):
    args = _inputs(block=block, chunk_blocks=chunk_blocks, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim)
    _check(args, block=block, tol=2e-5, **tiles)


def _ragged_mid_page_inputs(*, block, chunk_blocks, prefix, width, seed, q_heads=4, kv_heads=2, head_dim=16):
    """Rows of different lengths whose prefixes end inside a page (and one empty row); tables out of order."""
    rng = np.random.default_rng(seed)
    rows, t = len(prefix), chunk_blocks * block
    table = np.stack([rng.permutation(np.arange(1, NUM_PAGES))[:width] for _ in range(rows)]).astype(np.int32)

    def randn(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32)

    return [randn(rows, t, q_heads, head_dim), randn(rows, t, kv_heads, head_dim), randn(rows, t, kv_heads, head_dim),
            randn(kv_heads, NUM_PAGES, block, head_dim), randn(kv_heads, NUM_PAGES, block, head_dim),
            jnp.asarray(table), jnp.asarray(np.asarray(prefix, np.int32))]


# Page = key tile = 16 tokens and a 6-page table: a row has up to 6 prefix tiles, so the split counts run from one
# split per row through one tile per split to more splits than tiles (empty splits). Prefixes 0, 5, 25, 83: rows of
# four lengths, three of them ending mid-page (83 = 5 pages + 3 tokens: the 6th page holds 3 keys).
MID_PAGE_PREFIX = (0, 5, 25, 83)


@pytest.mark.parametrize("kv_splits", [1, 2, 3, 4, 6, 8])
def test_every_split_count_ragged_mid_page(kv_splits):
    args = _ragged_mid_page_inputs(block=16, chunk_blocks=1, prefix=MID_PAGE_PREFIX, width=6, seed=kv_splits)
    assert attention_tiles(4, 16, 4, 2, 16, 6, block_size=16, block_k=16)["pages_per_tile"] == 1
    _check(args, block=16, tol=2e-5, block_k=16, kv_splits=kv_splits)


@pytest.mark.parametrize("kv_splits", [1, 2, 4])
def test_split_counts_multi_block_chunk_two_pages_per_tile(kv_splits):
    """A 3-block chunk (block-causal inside it) over mid-page prefixes, two pages per key tile (a tile can hold
    the row's last, partial page and a page past its prefix)."""
    args = _ragged_mid_page_inputs(block=8, chunk_blocks=3, prefix=(13, 0, 40, 19), width=6, seed=10 + kv_splits)
    _check(args, block=8, tol=2e-5, block_k=16, kv_splits=kv_splits)


def test_keys_past_a_mid_page_prefix_are_never_read():
    """The pages after a row's prefix may hold anything, NaN included (the kernel redirects them to the trash page);
    the slots of its last, partial page past the prefix anything finite (read, then given zero weight: a NaN
    there would reach the output through 0 x NaN, in the reference too; live pages never hold one)."""
    block, prefix = 16, MID_PAGE_PREFIX
    args = _ragged_mid_page_inputs(block=block, chunk_blocks=1, prefix=prefix, width=6, seed=7)
    base = paged_block_attention(*args, block_size=block, interpret=True, block_k=16, kv_splits=2)
    table = np.asarray(args[5])
    k_pages, v_pages = np.array(args[3]), np.array(args[4])
    for r, plen in enumerate(prefix):
        full, tail = divmod(plen, block)
        for j in range(full + (tail > 0), 6):  # whole pages past the prefix
            if table[r, j] not in {int(table[o, i]) for o, p in enumerate(prefix) for i in range(-(-p // block))}:
                k_pages[:, table[r, j]] = np.nan
                v_pages[:, table[r, j]] = np.nan
        if tail and all(int(table[r, full]) != int(table[o, i]) for o, p in enumerate(prefix) if o != r
                        for i in range(-(-p // block))):
            k_pages[:, table[r, full], tail:] = 1e4  # the partial page's slots after the prefix: huge scores
            v_pages[:, table[r, full], tail:] = -1e4
    args[3], args[4] = jnp.asarray(k_pages), jnp.asarray(v_pages)
    out = paged_block_attention(*args, block_size=block, interpret=True, block_k=16, kv_splits=2)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(base))


def test_odd_head_dim_and_group_are_padded():
    """Head dim 24 and 3 q heads per kv head are not powers of two: the wrapper pads them."""
    args = _inputs(block=4, chunk_blocks=2, q_heads=6, kv_heads=2, head_dim=24, seed=3)
    _check(args, block=4, tol=2e-5, block_k=16, kv_splits=2)


def test_bf16():
    args = _inputs(block=32, chunk_blocks=1, q_heads=4, kv_heads=2, head_dim=32, dtype=jnp.bfloat16, seed=1)
    _check(args, block=32, tol=3e-2, kv_splits=2)


def test_prefix_is_read_through_the_page_table_and_backends():
    """Changing a page no row references changes nothing; changing a referenced one changes only the
    rows that reference it. Also: the backend helper returns drop-in callables."""
    block = 4
    args = list(_inputs(block=block, chunk_blocks=1, q_heads=2, kv_heads=1, head_dim=16, seed=2))
    fn = get_attention_fn("pallas_interpret", block_k=16)
    base = fn(*args, block_size=block)
    np.testing.assert_allclose(np.asarray(base), np.asarray(reference(*args, block_size=block)), atol=2e-5)
    table, prefix = np.asarray(args[5]), np.asarray(args[6])
    used = {int(p) for r in range(4) for p in table[r, : prefix[r] // block]}
    unused = sorted(set(range(NUM_PAGES)) - used)[0]
    k_pages = args[3]
    args[3] = k_pages.at[:, unused].set(100.0)
    np.testing.assert_array_equal(np.asarray(fn(*args, block_size=block)), np.asarray(base))
    args[3] = k_pages.at[:, int(table[3, 4])].set(100.0)  # row 3's fifth page
    changed = np.any(np.asarray(fn(*args, block_size=block)) != np.asarray(base), axis=(1, 2, 3))
    assert changed.tolist() == [False, False, False, True]

    # Table slots past a row's prefix are never read: garbage ids there (even out of range) change nothing.
    args[3] = k_pages
    garbage = table.copy()
    for r in range(4):
        garbage[r, prefix[r] // block:] = [-7, 10 ** 6, NUM_PAGES][r % 3]
    args[5] = jnp.asarray(garbage)
    np.testing.assert_array_equal(np.asarray(fn(*args, block_size=block)), np.asarray(base))

    assert get_attention_fn("xla") is paged_block_attention_reference
    assert get_attention_fn("auto") is paged_block_attention_reference  # CPU: auto means XLA
    with pytest.raises(ValueError):
        get_attention_fn("cuda")


def test_default_tiles_at_sdar_shapes():
    """Documented defaults: one program per (row, kv head) holding the block x GQA group."""
    t = attention_tiles(1, 32, 16, 8, 128, 128, block_size=32)
    assert (t["block_q"], t["group_p"], t["pages_per_tile"], t["num_q_tiles"]) == (32, 2, 4, 1)
    assert t["kv_splits"] == 16  # batch 1 splits its 4k-token page table over 16 programs per head
    assert attention_tiles(64, 32, 16, 8, 128, 128, block_size=32)["kv_splits"] == 1
    t = attention_tiles(1, 32, 32, 4, 128, 128, block_size=32)  # GQA 8: two q tiles of 16 tokens
    assert (t["block_q"] * t["group_p"], t["num_q_tiles"]) == (128, 2)


@pytest.mark.slow
def test_bench_smoke(tmp_path):
    """``python -m bench.kernels --smoke`` runs on CPU and writes its JSON (about 30 s)."""
    import json

    from bench.kernels import main

    out = tmp_path / "kernels.json"
    assert main(["--smoke", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["smoke"] and {r["kernel"] for r in data["results"]} == {"attention", "confidence"}
    assert all(r["max_abs_err"] < 1e-4 for r in data["results"] if r["kernel"] == "attention")


def test_drop_in_attention_fn_for_the_model():
    """The kernel in ``forward_chunk``'s ``attention_fn`` slot (a 2-block chunk over ragged prefixes)
    gives the hidden states of the XLA path."""
    from dllm_jax.config import ModelConfig
    from dllm_jax.model.params import param_shapes
    from dllm_jax.model.qwen3 import forward_chunk

    cfg = ModelConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=16, tie_word_embeddings=True)
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda shape: jnp.asarray(0.2 * rng.standard_normal(shape), jnp.float32),
                          param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    pools = [tuple(jnp.asarray(rng.standard_normal((2, 16, 4, 16)), jnp.float32) for _ in range(2)) for _ in range(1)]
    tokens = jnp.asarray(rng.integers(0, 300, (2, 8)))
    table = jnp.asarray([[3, 5, 7, 0], [9, 2, 0, 0]], jnp.int32)
    prefix = jnp.asarray([8, 4], jnp.int32)
    write = jnp.asarray([[11, 12], [13, 14]], jnp.int32)
    hidden = {}
    for backend in ("xla", "pallas_interpret"):
        fn = get_attention_fn(backend, block_k=16)
        hidden[backend] = jax.jit(lambda p, t, kv: forward_chunk(p, cfg, t, kv, table, prefix, write, block_size=4,
                                                                 attention_fn=fn)[0])(params, tokens, pools)
    np.testing.assert_allclose(np.asarray(hidden["pallas_interpret"]), np.asarray(hidden["xla"]), atol=2e-5)


@pytest.mark.lowering
@pytest.mark.parametrize("rows,width,kv_splits,block_k", [(1, 32, 1, 64), (1, 32, 32, 128), (8, 128, 4, 64)])
def test_sweep_configs_lower_for_cuda_in_a_device_loop(rows, width, kv_splits, block_k):
    """bench/kernels.py times the kernel inside a jitted fori_loop (an optimization barrier per iteration, a page
    table offset per iteration) over split counts x key tiles: that program lowers for CUDA (Triton) on the CPU."""
    from jax import lax

    S = jax.ShapeDtypeStruct
    hq, hkv, d = 16, 8, 128

    def run(q, kn, vn, kp, vp, table, plen):
        def body(i, c):
            x, acc = c
            out = paged_block_attention(x, kn, vn, kp, vp, table + (i % 3) * 7, plen, block_size=32,
                                        kv_splits=kv_splits, block_k=block_k)
            x, out = lax.optimization_barrier((x, out))
            return x, acc + out.reshape(-1)[0].astype(jnp.float32)

        return lax.fori_loop(0, 4, body, (q, jnp.float32(0)))[1]

    args = (S((rows, 32, hq, d), jnp.bfloat16), S((rows, 32, hkv, d), jnp.bfloat16),
            S((rows, 32, hkv, d), jnp.bfloat16), S((hkv, 4096, 32, d), jnp.bfloat16),
            S((hkv, 4096, 32, d), jnp.bfloat16), S((rows, width), jnp.int32), S((rows,), jnp.int32))
    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=dev)):
        text = jax.jit(run).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text.lower() and "while" in text
