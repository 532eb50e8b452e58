"""Pallas kernels vs the XLA path at SDAR-1.7B shapes: ``python -m bench.kernels [--smoke]``.

For each case it times the Pallas kernel and the plain-JAX reference (the engine's XLA path), checks
that they agree, and reports achieved HBM bandwidth and FLOP rate as fractions of the H200 peaks
(4.8 TB/s, ~990 TFLOP/s dense bf16). Both paths are charged the same minimal traffic (what must be
read and written at least once), so the fractions compare like with like.

* attention: one layer of a denoise step (a block of B=32 per row) for batch 1, 8, 64 and prefixes
  of 1k and 4k tokens, plus one multi-block prefill chunk; bytes = prefix K/V + the chunk's
  q/k/v/out, FLOPs = 4 x q tokens x heads x D x visible keys.
* confidence: the fused LM head + (argmax, p_max, lse) over the 151,936-token vocab for N = 32 x
  batch positions; bytes = LM head + hidden, FLOPs = 2 N H V. The kernel runs on the [H, V] head
  and on the tied embedding as stored ([V, H], ``vocab_major=True``).

Writes ``bench_out/kernels.json``. Timings need a GPU: on a CPU machine the script says so and runs
``--smoke`` instead (tiny shapes, kernels in interpret mode: a check that the script works, not a
measurement). Needs only jax and numpy (runs under the GPU machine's preinstalled jax).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import warnings

import numpy as np

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated", category=DeprecationWarning)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels.confidence import confidence_stats, confidence_stats_reference  # noqa: E402
from pallas_kernels.paged_block_attention import (  # noqa: E402
    attention_tiles,
    paged_block_attention,
    paged_block_attention_reference,
)

H200_HBM_BYTES_PER_S = 4.8e12
H200_BF16_FLOPS = 990e12

SDAR_1_7B = dict(q_heads=16, kv_heads=8, head_dim=128, hidden=2048, vocab=151936, block=32)
SMOKE = dict(q_heads=4, kv_heads=2, head_dim=32, hidden=64, vocab=1000, block=4)


def _time(fn, args, iters, repeats):
    """Seconds per call: the best of ``repeats`` back-to-back loops of ``iters`` calls."""
    jax.block_until_ready(fn(*args))  # compile + warm up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = None
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t0) / iters)
    return best


def _rates(seconds, nbytes, flops):
    return dict(time_us=seconds * 1e6, hbm_frac=nbytes / seconds / H200_HBM_BYTES_PER_S,
                flop_frac=flops / seconds / H200_BF16_FLOPS)


def attention_case(shape, rows, prefix, chunk_blocks, *, dtype, interpret, iters, repeats, key):
    blk, hq, hkv, d = shape["block"], shape["q_heads"], shape["kv_heads"], shape["head_dim"]
    t = chunk_blocks * blk
    width = prefix // blk
    num_pages = rows * width + 1  # page 0 is the trash page
    ks = jax.random.split(key, 6)
    q = jax.random.normal(ks[0], (rows, t, hq, d), dtype)
    k_new = jax.random.normal(ks[1], (rows, t, hkv, d), dtype)
    v_new = jax.random.normal(ks[2], (rows, t, hkv, d), dtype)
    k_pages = jax.random.normal(ks[3], (hkv, num_pages, blk, d), dtype)
    v_pages = jax.random.normal(ks[4], (hkv, num_pages, blk, d), dtype)
    # Each row owns `width` distinct pages scattered over the pool, as after a while of serving.
    table = (jax.random.permutation(ks[5], num_pages - 1) + 1)[: rows * width].reshape(rows, width).astype(jnp.int32)
    plen = jnp.full((rows,), prefix, jnp.int32)
    args = (q, k_new, v_new, k_pages, v_pages, table, plen)

    kernel = jax.jit(lambda *a: paged_block_attention(*a, block_size=blk, interpret=interpret))
    xla = jax.jit(lambda *a: paged_block_attention_reference(*a, block_size=blk))
    err = float(jnp.max(jnp.abs(kernel(*args).astype(jnp.float32) - xla(*args).astype(jnp.float32))))

    itemsize = jnp.dtype(dtype).itemsize
    nbytes = itemsize * (2 * rows * prefix * hkv * d + 2 * rows * t * hq * d + 2 * rows * t * hkv * d)
    visible = prefix + (chunk_blocks + 1) / 2 * blk  # mean keys per query (block-causal chunk)
    flops = 4 * rows * t * hq * d * visible
    tiles = attention_tiles(rows, t, hq, hkv, d, width, block_size=blk)
    res = dict(kernel="attention", rows=rows, prefix=prefix, chunk_tokens=t, max_abs_err=err,
               bytes=nbytes, flops=flops, tiles=tiles)
    res["pallas"] = _rates(_time(kernel, args, iters, repeats), nbytes, flops)
    res["xla"] = _rates(_time(xla, args, iters, repeats), nbytes, flops)
    return res


def confidence_case(shape, positions, *, dtype, interpret, iters, repeats, key, exclude):
    h, v = shape["hidden"], shape["vocab"]
    k1, k2 = jax.random.split(key)
    hidden = jax.random.normal(k1, (positions, h), dtype)
    embed = (jax.random.normal(k2, (v, h), jnp.float32) * h ** -0.5).astype(dtype)  # tied head, as stored
    head = embed.T  # an [H, V] copy (eager), for the untied layout

    kernel = jax.jit(lambda a, w: confidence_stats(a, w, exclude_token_id=exclude, interpret=interpret))
    kernel_vm = jax.jit(lambda a, e: confidence_stats(a, e, exclude_token_id=exclude, interpret=interpret,
                                                      vocab_major=True))
    xla = jax.jit(lambda a, e: confidence_stats_reference(a, e.T, exclude_token_id=exclude))
    ref = xla(hidden, embed)
    errs = []
    for out in (kernel(hidden, head), kernel_vm(hidden, embed)):
        errs.append(dict(argmax_mismatch=int(jnp.sum(out[0] != ref[0])),
                         p_max_err=float(jnp.max(jnp.abs(out[1] - ref[1]))),
                         lse_err=float(jnp.max(jnp.abs(out[2] - ref[2])))))

    itemsize = jnp.dtype(dtype).itemsize
    nbytes = itemsize * (h * v + positions * h) + 12 * positions
    flops = 2 * positions * h * v
    res = dict(kernel="confidence", positions=positions, vocab=v, hidden=h, check_hv=errs[0], check_vh=errs[1],
               bytes=nbytes, flops=flops)
    res["pallas"] = _rates(_time(kernel, (hidden, head), iters, repeats), nbytes, flops)
    res["pallas_vocab_major"] = _rates(_time(kernel_vm, (hidden, embed), iters, repeats), nbytes, flops)
    res["xla"] = _rates(_time(xla, (hidden, embed), iters, repeats), nbytes, flops)
    return res


def _fmt(r):
    p, x = r["pallas"], r["xla"]
    extra = ""
    if "pallas_vocab_major" in r:
        extra = f"  pallas[V,H] {r['pallas_vocab_major']['time_us']:9.1f} us"
    return (f"pallas {p['time_us']:9.1f} us ({p['hbm_frac']:6.1%} HBM, {p['flop_frac']:6.1%} FLOP)   "
            f"xla {x['time_us']:9.1f} us ({x['hbm_frac']:6.1%} HBM, {x['flop_frac']:6.1%} FLOP)"
            f"   speedup {x['time_us'] / p['time_us']:5.2f}x{extra}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode (works on CPU)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--prefixes", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="bench_out/kernels.json")
    args = ap.parse_args(argv)

    on_gpu = jax.default_backend() == "gpu"
    if not on_gpu and not args.smoke:
        print("bench.kernels: no GPU here, so kernel timings would mean nothing (the Pallas kernels only run "
              "in interpret mode on CPU). Running --smoke instead: tiny shapes, checks that the script works. "
              "Run on a GPU machine for the real numbers.")
        args.smoke = True
    if args.smoke:
        shape, interpret, dtype = SMOKE, not on_gpu, jnp.float32
        batches, prefixes, iters, repeats = [1, 2], [8, 16], 2, 1
    else:
        shape, interpret, dtype = SDAR_1_7B, False, jnp.bfloat16
        batches, prefixes, iters, repeats = args.batches, args.prefixes, args.iters, args.repeats

    key = jax.random.PRNGKey(0)
    results = []
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind} ({jax.default_backend()}); "
          f"{'smoke, interpret mode' if interpret else 'compiled'}; {jnp.dtype(dtype).name}; shapes {shape}")
    print("-- paged block attention (one layer) --")
    cases = [(b, p, 1) for b in batches for p in prefixes] + [(max(1, batches[0]), prefixes[0], 8 if not args.smoke else 2)]
    for rows, prefix, chunk_blocks in cases:
        key, sub = jax.random.split(key)
        r = attention_case(shape, rows, prefix, chunk_blocks, dtype=dtype, interpret=interpret, iters=iters,
                           repeats=repeats, key=sub)
        results.append(r)
        what = "denoise" if chunk_blocks == 1 else f"prefill {r['chunk_tokens']:4d} tok"
        print(f"batch {rows:3d} prefix {prefix:5d} {what:16s} err {r['max_abs_err']:.1e}  {_fmt(r)}")
    print("-- confidence (LM head + argmax / p_max / lse) --")
    for b in batches:
        key, sub = jax.random.split(key)
        r = confidence_case(shape, b * shape["block"], dtype=dtype, interpret=interpret, iters=iters,
                            repeats=repeats, key=sub, exclude=shape["vocab"] - 3)
        results.append(r)
        c = r["check_hv"]
        print(f"batch {b:3d} ({r['positions']:5d} positions)  argmax mismatches {c['argmax_mismatch']} "
              f"p_max err {c['p_max_err']:.1e}  {_fmt(r)}")

    out = dict(device=jax.devices()[0].device_kind, backend=jax.default_backend(), jax=jax.__version__,
               python=platform.python_version(), smoke=bool(args.smoke), interpret=bool(interpret),
               dtype=jnp.dtype(dtype).name, shapes=shape,
               peaks=dict(hbm_bytes_per_s=H200_HBM_BYTES_PER_S, bf16_flops=H200_BF16_FLOPS), results=results)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")
    if args.smoke:
        print("(smoke run: the times above are interpret-mode CPU times, not kernel performance)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
