"""Pallas kernels vs the XLA path at SDAR-1.7B shapes, in device time: ``python -m bench.kernels [--smoke]``.

**How a kernel is timed.** Not one jitted call per iteration from Python (a small kernel then reads as the dispatch
cost: 57 us for a 4 MiB K/V read in the first GPU run), but ``n`` calls inside one jitted ``lax.fori_loop``
(:func:`device_seconds`): each iteration's small input (the queries, the hidden states) passes through an
``optimization_barrier`` together with the previous iteration's whole output, so XLA can neither hoist the call out
of the loop nor compute only part of its output, and the loop's fixed cost (one dispatch and one sync, measured
on an empty loop) is subtracted. ``n`` is sized so one loop runs ~``--loop-ms``. Big inputs are not carried: the
K/V pool and the LM head are loop invariants read every iteration. So that the attention loop reads HBM and not
the 50-60 MB L2 (a batch-1 layer reads 4 MiB), the pool holds several copies of the case's pages and each
iteration reads the next copy (page-table offset), >= 256 MiB in all. Each figure is also given as the old
Python-dispatched time per call (``call us``), to show what the dispatch hid.

Bandwidth and FLOP rates are given against the card's measured ceilings (a device copy and an 8192^3 bf16
matmul, timed the same way) and against the H200 datasheet (4.8 TB/s, ~990 TFLOP/s). Both implementations are
charged the same minimal traffic (what must be read and written at least once).

* attention: one layer of a denoise step (a block of B=32 per row) for batch 1, 8, 64 and prefixes of 1k and 4k
  tokens, plus one multi-block prefill chunk; bytes = prefix K/V + the chunk's q/k/v/out, FLOPs = 4 x q tokens x
  heads x D x visible keys. XLA = the engine's XLA path (:mod:`dllm_jax.decode.xla_attention`).
* attention sweep (``--sweep``, default on a GPU): at batch 1 and 8 (where one (row, kv head) program per SM
  does not fill the card), the kernel over split counts x key tiles: the best configuration beside the default
  one, each in device us and fraction of the copy ceiling.
* confidence: the fused LM head + (argmax, p_max, lse) over the 151,936-token vocab for N positions, the kernel
  on an [H, V] head and on the tied embedding as stored ([V, H]), against XLA's matmul + reductions (the engine's
  path for each layout); bytes = LM head + hidden, FLOPs = 2 N H V. Over the crossover grid (``--crossover``,
  default on a GPU: 32 ... 4096 positions) the winner per shape; ``--write-crossover [PATH]`` merges them into
  the table ``auto`` reads (``pallas_kernels/confidence_crossover.json``).

Writes ``bench_out/kernels.json``. Timings need a GPU: on a CPU machine the script says so and runs ``--smoke``
instead (tiny shapes, kernels in interpret mode: a check that the script works, not a measurement). Needs only
jax and numpy (runs under the GPU machine's preinstalled jax).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import sys
import time
import warnings

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated", category=DeprecationWarning)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

from pallas_kernels.confidence import confidence_stats_reference  # noqa: E402
from pallas_kernels.paged_block_attention import (  # noqa: E402
    attention_tiles,
    paged_block_attention,
    paged_block_attention_reference,
)

H200_HBM_BYTES_PER_S = 4.8e12
H200_BF16_FLOPS = 990e12

SDAR_1_7B = dict(q_heads=16, kv_heads=8, head_dim=128, hidden=2048, vocab=151936, block=32)
SMOKE = dict(q_heads=4, kv_heads=2, head_dim=32, hidden=64, vocab=1000, block=4)
CROSSOVER_POSITIONS = (32, 64, 128, 256, 512, 1024, 2048, 4096)
ROTATE_BYTES = 256 << 20  # the attention loop cycles through this much K/V (several times the L2)


# ----------------------------------------------------------------------------------------------
# Device time
# ----------------------------------------------------------------------------------------------

def _wall(fn, args, repeats):
    """Median seconds of ``fn(*args)`` waited for (after one warm-up call)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


_FIXED: dict = {}


def loop_fixed_seconds(repeats: int = 20) -> float:
    """What one jitted loop costs beyond its iterations: dispatch, launch, sync (an empty 1-iteration loop)."""
    if "s" not in _FIXED:
        f = jax.jit(lambda x: lax.fori_loop(0, 1, lambda i, c: c + 1.0, x))
        _FIXED["s"] = _wall(f, (jnp.float32(0),), repeats)
    return _FIXED["s"]


def device_seconds(step, carry, invariants=(), *, n: int, repeats: int = 5) -> float:
    """Seconds per call of ``step(carry, invariants, i) -> out`` on the device: one jitted call runs it ``n`` times in
    a ``fori_loop``; the small ``carry`` goes through an ``optimization_barrier`` with each iteration's whole output
    (no hoisting, no partial evaluation), the large ``invariants`` are read in place. Median of ``repeats`` loops,
    minus the fixed cost of a loop, over ``n``."""

    def run(carry, invariants):
        def body(i, c):
            x, acc = c
            out = step(x, invariants, i)
            x, out = lax.optimization_barrier((x, out))
            leaf = jax.tree.leaves(out)[0]
            return x, acc + leaf.reshape(-1)[0].astype(jnp.float32)

        return lax.fori_loop(0, n, body, (carry, jnp.float32(0)))[1]

    total = _wall(jax.jit(run), (carry, invariants), repeats)
    return max(total - loop_fixed_seconds(), 0.0) / n


def loop_length(seconds_per_call: float, target_s: float, *, lo: int = 4, hi: int = 512) -> int:
    return int(min(hi, max(lo, round(target_s / max(seconds_per_call, 1e-7)))))


def measure_ceilings(dtype, *, target_s: float = 0.05, smoke: bool = False) -> dict:
    """The card's practical ceilings, timed like the kernels: a copy (``x + 1`` over 1 GiB: bytes read + written)
    and an 8192^3 matmul."""
    n_elems = (1 << 14 if smoke else 1 << 30) // jnp.dtype(dtype).itemsize
    x = jax.random.normal(jax.random.PRNGKey(1), (n_elems,), dtype)
    one = jnp.asarray(1, dtype)
    t_copy = device_seconds(lambda c, inv, i: c + one, x, n=4 if smoke else 32)
    m = 64 if smoke else 8192
    a = jax.random.normal(jax.random.PRNGKey(2), (m, m), dtype)
    b = jax.random.normal(jax.random.PRNGKey(3), (m, m), dtype)
    t_mm = device_seconds(lambda c, inv, i: jnp.dot(c, inv), a, b, n=4 if smoke else 16)
    del x, a, b
    return dict(copy_bytes_per_s=2 * n_elems * jnp.dtype(dtype).itemsize / t_copy, matmul_flops=2 * m ** 3 / t_mm,
                copy_bytes=2 * n_elems * jnp.dtype(dtype).itemsize, matmul_n=m)


def _rates(seconds, nbytes, flops, ceilings, call_seconds=None):
    out = dict(time_us=seconds * 1e6, gb_per_s=nbytes / seconds / 1e9 if seconds else float("nan"),
               hbm_frac=nbytes / seconds / H200_HBM_BYTES_PER_S if seconds else float("nan"),
               flop_frac=flops / seconds / H200_BF16_FLOPS if seconds else float("nan"))
    if ceilings:
        out["copy_frac"] = nbytes / seconds / ceilings["copy_bytes_per_s"] if seconds else float("nan")
        out["matmul_frac"] = flops / seconds / ceilings["matmul_flops"] if seconds else float("nan")
    if call_seconds is not None:
        out["call_us"] = call_seconds * 1e6
    return out


# ----------------------------------------------------------------------------------------------
# Attention
# ----------------------------------------------------------------------------------------------

class AttentionCase:
    """One layer's paged block attention at (rows, prefix, chunk) with ``sets`` copies of its pages in the pool."""

    def __init__(self, shape, rows, prefix, chunk_blocks, *, dtype, key, rotate_bytes=ROTATE_BYTES):
        blk, hq, hkv, d = shape["block"], shape["q_heads"], shape["kv_heads"], shape["head_dim"]
        self.shape, self.rows, self.prefix, self.blk = shape, rows, prefix, blk
        self.t = chunk_blocks * blk
        self.width = max(1, -(-prefix // blk))
        itemsize = jnp.dtype(dtype).itemsize
        per_set = 2 * hkv * rows * self.width * blk * d * itemsize
        self.sets = max(1, min(64, -(-rotate_bytes // per_set)))
        self.stride = rows * self.width
        num_pages = self.sets * self.stride + 1  # page 0 is the trash page
        ks = jax.random.split(key, 6)
        self.q = jax.random.normal(ks[0], (rows, self.t, hq, d), dtype)
        self.k_new = jax.random.normal(ks[1], (rows, self.t, hkv, d), dtype)
        self.v_new = jax.random.normal(ks[2], (rows, self.t, hkv, d), dtype)
        self.k_pages = jax.random.normal(ks[3], (hkv, num_pages, blk, d), dtype)
        self.v_pages = jax.random.normal(ks[4], (hkv, num_pages, blk, d), dtype)
        # Each row owns `width` distinct pages scattered over its copy, as after a while of serving.
        perm = jax.random.permutation(ks[5], self.stride) + 1
        self.table = perm.reshape(rows, self.width).astype(jnp.int32)
        self.plen = jnp.full((rows,), prefix, jnp.int32)
        self.nbytes = itemsize * (2 * rows * prefix * hkv * d + 2 * rows * self.t * hq * d
                                  + 2 * rows * self.t * hkv * d)
        visible = prefix + (chunk_blocks + 1) / 2 * blk  # mean keys per query (block-causal chunk)
        self.flops = 4 * rows * self.t * hq * d * visible

    def args(self):
        return (self.q, self.k_new, self.v_new, self.k_pages, self.v_pages, self.table, self.plen)

    def fn(self, impl, **tiles):
        blk = self.blk
        if impl == "xla":
            from dllm_jax.decode.xla_attention import paged_block_attention_xla

            return lambda *a: paged_block_attention_xla(*a, block_size=blk)
        if impl == "reference":
            return lambda *a: paged_block_attention_reference(*a, block_size=blk)
        interpret = impl == "pallas_interpret"
        return lambda *a: paged_block_attention(*a, block_size=blk, interpret=interpret, **tiles)

    def device_seconds(self, fn, *, n, repeats):
        sets, stride = self.sets, self.stride

        def step(q, inv, i):
            k_new, v_new, k_pages, v_pages, table, plen = inv
            return fn(q, k_new, v_new, k_pages, v_pages, table + (i % sets) * stride, plen)

        return device_seconds(step, self.q, (self.k_new, self.v_new, self.k_pages, self.v_pages, self.table,
                                             self.plen), n=n, repeats=repeats)


def attention_case(shape, rows, prefix, chunk_blocks, *, dtype, interpret, repeats, key, ceilings, loop_s):
    case = AttentionCase(shape, rows, prefix, chunk_blocks, dtype=dtype, key=key)
    kernel = jax.jit(case.fn("pallas_interpret" if interpret else "pallas"))
    xla = jax.jit(case.fn("xla"))
    ref = jax.jit(case.fn("reference"))(*case.args()).astype(jnp.float32)
    err = float(jnp.max(jnp.abs(kernel(*case.args()).astype(jnp.float32) - ref)))
    err_xla = float(jnp.max(jnp.abs(xla(*case.args()).astype(jnp.float32) - ref)))
    tiles = attention_tiles(rows, case.t, shape["q_heads"], shape["kv_heads"], shape["head_dim"], case.width,
                            block_size=case.blk)
    res = dict(kernel="attention", rows=rows, prefix=prefix, chunk_tokens=case.t, max_abs_err=err,
               xla_max_abs_err=err_xla, bytes=case.nbytes, flops=case.flops, tiles=tiles, page_sets=case.sets)
    for name, fn in (("pallas", kernel), ("xla", xla)):
        call_s = _wall(fn, case.args(), repeats)
        n = loop_length(call_s, loop_s)
        res[name] = _rates(case.device_seconds(fn, n=n, repeats=repeats), case.nbytes, case.flops, ceilings,
                           call_s)
        res[name]["loop_n"] = n
    return res


def attention_sweep(shape, cases, *, dtype, interpret, repeats, key, ceilings, loop_s, budget_s, log=print):
    """The kernel over split counts x key tiles at each (rows, prefix) of ``cases``: every configuration's device
    time, the best one and the default one. Each case gets an equal share of ``budget_s`` (what an earlier case
    left unused goes to the later ones)."""
    t0 = time.perf_counter()
    out = []
    for rows, prefix in cases:
        key, sub = jax.random.split(key)
        case = AttentionCase(shape, rows, prefix, 1, dtype=dtype, key=sub)
        default = attention_tiles(rows, case.t, shape["q_heads"], shape["kv_heads"], shape["head_dim"],
                                  case.width, block_size=case.blk)
        ref = jax.jit(case.fn("reference"))(*case.args()).astype(jnp.float32)
        configs = [dict()]  # the default first
        max_splits = max(1, case.width)
        for splits, block_k in itertools.product((1, 2, 4, 8, 16, 32), (64, 128)):
            if splits <= max_splits and block_k >= case.blk:
                configs.append(dict(kv_splits=splits, block_k=block_k))
        if interpret:  # smoke: a few, to check the plumbing
            configs = configs[:2]
        results = []
        case_t0 = time.perf_counter()
        share = (budget_s - (case_t0 - t0)) / (len(cases) - len(out))  # every case gets its share of what is left
        for tiles in configs:
            if time.perf_counter() - case_t0 > share:
                break
            try:
                fn = jax.jit(case.fn("pallas_interpret" if interpret else "pallas", **tiles))
                err = float(jnp.max(jnp.abs(fn(*case.args()).astype(jnp.float32) - ref)))
                call_s = _wall(fn, case.args(), max(2, repeats // 2))
                n = loop_length(call_s, loop_s)
                r = _rates(case.device_seconds(fn, n=n, repeats=repeats), case.nbytes, case.flops, ceilings, call_s)
            except Exception as e:  # a configuration the compiler refuses (registers, shared memory) is skipped
                results.append(dict(tiles=tiles, error=f"{type(e).__name__}: {str(e)[:200]}"))
                continue
            results.append(dict(tiles=tiles or {k: default[k] for k in ("kv_splits", "num_warps")}, default=not tiles,
                                max_abs_err=err, **r))
        good = [r for r in results if "error" not in r]
        best = min(good, key=lambda r: r["time_us"]) if good else None
        dflt = next((r for r in good if r.get("default")), None)
        entry = dict(rows=rows, prefix=prefix, bytes=case.nbytes, default_tiles=default, configs=results,
                     best=best, default=dflt, complete=len(results) == len(configs))
        out.append(entry)
        if best and dflt:
            log(f"sweep batch {rows:3d} prefix {prefix:5d}: default {dflt['time_us']:8.1f} us "
                f"({_frac(dflt)})  best {best['time_us']:8.1f} us ({_frac(best)}) with {best['tiles']}"
                f"  [{len(good)} configs{'' if entry['complete'] else ', cut by the time budget'}]")
    return out


def _frac(r):
    return f"{r['copy_frac']:.0%} of copy" if "copy_frac" in r else f"{r['hbm_frac']:.0%} of 4.8 TB/s"


# ----------------------------------------------------------------------------------------------
# Confidence
# ----------------------------------------------------------------------------------------------

def _confidence_fns(interpret, exclude):
    """The implementations as the engine runs them (dllm_jax/decode/backends.py): the kernel on an [H, V] head and
    on a head stored [V, H] (the tied embedding), and XLA's matmul + reductions on each layout (the [V, H] head
    contracted as stored)."""
    from pallas_kernels.confidence import _reference_vocab_major, confidence_stats

    def kernel(vocab_major):
        return lambda h, w: confidence_stats(h, w, exclude_token_id=exclude, interpret=interpret,
                                             vocab_major=vocab_major)

    return {"pallas": (kernel(False), False), "pallas_vocab_major": (kernel(True), True),
            "xla": (lambda h, w: confidence_stats_reference(h, w, exclude_token_id=exclude), False),
            "xla_vocab_major": (lambda h, w: _reference_vocab_major(h, w, exclude_token_id=exclude), True)}


def confidence_case(shape, positions, *, dtype, interpret, repeats, key, exclude, ceilings, loop_s,
                    variants=("pallas", "pallas_vocab_major", "xla", "xla_vocab_major"), embed=None):
    h, v = shape["hidden"], shape["vocab"]
    k1, k2 = jax.random.split(key)
    hidden = jax.random.normal(k1, (positions, h), dtype)
    if embed is None:
        embed = (jax.random.normal(k2, (v, h), jnp.float32) * h ** -0.5).astype(dtype)  # tied head, as stored
    head = None
    fns = _confidence_fns(interpret, exclude)
    ref = jax.jit(lambda a, e: confidence_stats_reference(a, e.T, exclude_token_id=exclude))(hidden, embed)
    itemsize = jnp.dtype(dtype).itemsize
    nbytes = itemsize * (h * v + positions * h) + 12 * positions
    flops = 2 * positions * h * v
    res = dict(kernel="confidence", positions=positions, vocab=v, hidden=h, bytes=nbytes, flops=flops)
    for name in variants:
        fn, vocab_major = fns[name]
        if not vocab_major and head is None:
            head = jnp.asarray(embed.T)  # an [H, V] copy, for the untied layout
        w = embed if vocab_major else head
        jfn = jax.jit(fn)
        out = jfn(hidden, w)
        check = dict(argmax_mismatch=int(jnp.sum(out[0] != ref[0])),
                     p_max_err=float(jnp.max(jnp.abs(out[1] - ref[1]))),
                     lse_err=float(jnp.max(jnp.abs(out[2] - ref[2]))))
        call_s = _wall(jfn, (hidden, w), repeats)
        n = loop_length(call_s, loop_s)
        t = device_seconds(lambda x, inv, i: fn(x, inv), hidden, w, n=n, repeats=repeats)
        res[name] = dict(_rates(t, nbytes, flops, ceilings, call_s), loop_n=n, check=check)
    if "pallas" in res:
        res["check_hv"] = res["pallas"]["check"]
    if "pallas_vocab_major" in res:
        res["check_vh"] = res["pallas_vocab_major"]["check"]
    del head
    return res


def crossover_entries(results: list[dict]) -> list[dict]:
    """Table entries (see pallas_kernels/confidence.py) from confidence results: per layout, the faster of the
    kernel and XLA in device time."""
    out = []
    for r in results:
        for vocab_major, (p, x) in ((False, ("pallas", "xla")), (True, ("pallas_vocab_major", "xla_vocab_major"))):
            if p in r and x in r:
                tp, tx = r[p]["time_us"], r[x]["time_us"]
                out.append(dict(positions=r["positions"], hidden=r["hidden"], vocab=r["vocab"],
                                vocab_major=vocab_major, pallas_us=round(tp, 2), xla_us=round(tx, 2),
                                winner="pallas" if tp <= tx else "xla"))
    return out


def _fmt(r):
    p, x = r["pallas"], r["xla"]
    extra = ""
    if "pallas_vocab_major" in r:
        extra = f"  [V,H]: pallas {r['pallas_vocab_major']['time_us']:9.1f} xla {r['xla_vocab_major']['time_us']:9.1f}"
    return (f"pallas {p['time_us']:9.1f} us ({_frac(p)}, call {p['call_us']:8.1f})   "
            f"xla {x['time_us']:9.1f} us ({_frac(x)}, call {x['call_us']:8.1f})"
            f"   speedup {x['time_us'] / p['time_us']:5.2f}x{extra}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode (works on CPU)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--prefixes", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--loop-ms", type=float, default=20.0, help="each timing loop runs about this long")
    ap.add_argument("--sweep", dest="sweep", action="store_true", default=None,
                    help="the attention tile sweep (default: on a GPU)")
    ap.add_argument("--no-sweep", dest="sweep", action="store_false")
    ap.add_argument("--sweep-budget-s", type=float, default=90.0)
    ap.add_argument("--crossover", dest="crossover", action="store_true", default=None,
                    help="confidence over the crossover grid of positions (default: on a GPU)")
    ap.add_argument("--no-crossover", dest="crossover", action="store_false")
    ap.add_argument("--crossover-positions", type=int, nargs="+", default=list(CROSSOVER_POSITIONS))
    ap.add_argument("--write-crossover", nargs="?", const="", default=None, metavar="PATH",
                    help="merge the measured winners into the crossover table (default path: the one `auto` reads, "
                         "pallas_kernels/confidence_crossover.json)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no new case past this many seconds (the JSON keeps what was measured)")
    ap.add_argument("--out", default="bench_out/kernels.json")
    args = ap.parse_args(argv)

    on_gpu = jax.default_backend() == "gpu"
    if not on_gpu and not args.smoke:
        print("bench.kernels: no GPU here, so kernel timings would mean nothing (the Pallas kernels only run "
              "in interpret mode on CPU). Running --smoke instead: tiny shapes, checks that the script works. "
              "Run on a GPU machine for the real numbers.")
        args.smoke = True
    sweep = on_gpu if args.sweep is None else args.sweep
    crossover = on_gpu if args.crossover is None else args.crossover
    if args.write_crossover is not None:
        crossover = True
    if args.smoke:
        shape, interpret, dtype = SMOKE, not on_gpu, jnp.float32
        batches, prefixes, repeats, loop_s = [2], [8], 1, 1e-3  # each case compiles several interpreted loops
        positions = [8]
        sweep_cases = [(1, 16)]
    else:
        shape, interpret, dtype = SDAR_1_7B, False, jnp.bfloat16
        batches, prefixes, repeats, loop_s = args.batches, args.prefixes, args.repeats, args.loop_ms / 1e3
        positions = args.crossover_positions
        sweep_cases = [(b, p) for b in batches if b <= 8 for p in prefixes]

    key = jax.random.PRNGKey(0)
    t_start = time.perf_counter()
    device_kind = jax.devices()[0].device_kind
    print(f"jax {jax.__version__} on {device_kind} ({jax.default_backend()}); "
          f"{'smoke, interpret mode' if interpret else 'compiled'}; {jnp.dtype(dtype).name}; shapes {shape}")
    ceilings = measure_ceilings(dtype, smoke=args.smoke)
    print(f"ceilings (device loops): copy {ceilings['copy_bytes_per_s'] / 1e12:.3f} TB/s, matmul "
          f"{ceilings['matmul_flops'] / 1e12:.1f} TFLOP/s; a loop's fixed cost {1e6 * loop_fixed_seconds():.1f} us")
    out = dict(device=device_kind, backend=jax.default_backend(), jax=jax.__version__,
               python=platform.python_version(), smoke=bool(args.smoke), interpret=bool(interpret),
               dtype=jnp.dtype(dtype).name, shapes=shape, timing="device loop (see bench/kernels.py)",
               ceilings=ceilings, loop_fixed_us=1e6 * loop_fixed_seconds(),
               peaks=dict(hbm_bytes_per_s=H200_HBM_BYTES_PER_S, bf16_flops=H200_BF16_FLOPS), results=[])
    results = out["results"]

    def save():
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)

    def over_budget():
        return args.budget_s is not None and time.perf_counter() - t_start > args.budget_s

    print("-- paged block attention (one layer), device us per call --")
    cases = [(b, p, 1) for b in batches for p in prefixes]
    if not args.smoke:  # one multi-block prefill chunk
        cases.append((max(1, batches[0]), prefixes[0], 8))
    for rows, prefix, chunk_blocks in cases:
        if over_budget():
            out.setdefault("skipped", []).append(dict(kernel="attention", rows=rows, prefix=prefix))
            continue
        key, sub = jax.random.split(key)
        try:
            r = attention_case(shape, rows, prefix, chunk_blocks, dtype=dtype, interpret=interpret, repeats=repeats,
                               key=sub, ceilings=ceilings, loop_s=loop_s)
        except Exception as e:  # noqa: BLE001 -- report and go on
            print(f"batch {rows:3d} prefix {prefix:5d}: FAILED {type(e).__name__}: {str(e)[:300]}")
            results.append(dict(kernel="attention", rows=rows, prefix=prefix, error=f"{type(e).__name__}: {e}"))
            continue
        results.append(r)
        save()
        what = "denoise" if chunk_blocks == 1 else f"prefill {r['chunk_tokens']:4d} tok"
        print(f"batch {rows:3d} prefix {prefix:5d} {what:16s} err {r['max_abs_err']:.1e}  {_fmt(r)}")
    # The confidence grid before the sweep: the crossover table is what the engine reads.
    print("-- confidence (LM head + argmax / p_max / lse), device us per call --")
    grid = sorted(set([b * shape["block"] for b in batches] + (positions if crossover else [])))
    embed = None
    conf = []
    for n in grid:
        if over_budget():
            out.setdefault("skipped", []).append(dict(kernel="confidence", positions=n))
            continue
        key, sub = jax.random.split(key)
        if embed is None:
            embed = (jax.random.normal(sub, (shape["vocab"], shape["hidden"]), jnp.float32)
                     * shape["hidden"] ** -0.5).astype(dtype)
        try:
            r = confidence_case(shape, n, dtype=dtype, interpret=interpret, repeats=repeats, key=sub,
                                exclude=shape["vocab"] - 3, ceilings=ceilings, loop_s=loop_s, embed=embed)
        except Exception as e:  # noqa: BLE001
            print(f"{n:5d} positions: FAILED {type(e).__name__}: {str(e)[:300]}")
            results.append(dict(kernel="confidence", positions=n, error=f"{type(e).__name__}: {e}"))
            continue
        results.append(r)
        conf.append(r)
        save()
        c = r["check_hv"]
        print(f"{r['positions']:5d} positions  argmax mismatches {c['argmax_mismatch']}/"
              f"{r['check_vh']['argmax_mismatch']} "
              f"p_max err {c['p_max_err']:.1e}  {_fmt(r)}")
    entries = crossover_entries(conf)
    out["crossover"] = entries
    if entries:
        print("-- confidence crossover (device time; the winner is what `auto` runs for the shape) --")
        for e in entries:
            print(f"  {e['positions']:5d} positions, head {'[V, H]' if e['vocab_major'] else '[H, V]'}: pallas "
                  f"{e['pallas_us']:9.1f} us, xla {e['xla_us']:9.1f} us -> {e['winner']}")
    if args.write_crossover is not None and entries:
        from pallas_kernels.confidence import write_crossover

        if interpret or args.smoke:
            print("(smoke / interpret mode: the crossover table `auto` reads is not rewritten from CPU timings)")
            if args.write_crossover:  # an explicit path (tests, the smoke run): written there, marked as such
                write_crossover(device_kind, entries, path=args.write_crossover,
                                source="smoke run (interpret mode on CPU: not a measurement)")
                print(f"wrote smoke table {args.write_crossover}")
        else:
            path = write_crossover(device_kind, entries, path=args.write_crossover or None,
                                   source=f"python -m bench.kernels --write-crossover, {time.strftime('%Y-%m-%d')}, "
                                          f"jax {jax.__version__}, device-loop timing")
            out["crossover_written"] = path
            print(f"crossover table for {device_kind!r} written to {path}")
        save()
    if sweep:
        budget = args.sweep_budget_s
        if args.budget_s is not None:
            budget = min(budget, args.budget_s - (time.perf_counter() - t_start))
        if budget > 0:
            print(f"-- attention sweep: split counts x key tiles (budget {budget:.0f} s) --")
            key, sub = jax.random.split(key)
            out["sweep"] = attention_sweep(shape, sweep_cases, dtype=dtype, interpret=interpret, repeats=repeats,
                                           key=sub, ceilings=ceilings, loop_s=loop_s, budget_s=budget)
            save()
        else:
            print("-- attention sweep: no time left in the budget --")
    out["elapsed_s"] = time.perf_counter() - t_start
    save()
    print(f"wrote {args.out}")
    if args.smoke:
        print("(smoke run: the times above are interpret-mode CPU times, not kernel performance)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
