"""Denoise-step roofline at the SDAR-1.7B shape: ``python -m bench.roofline [--smoke]``.

Builds the SDAR-1.7B shape (28 layers, hidden 2048, 16 q heads, 8 KV heads, head dim 128, MLP 6144, vocab
151,936, tied embedding; random bf16 weights and random bf16 KV pages), and times the engine's jitted denoise
step (:func:`dllm_jax.decode.step.denoise`, one FDFO step of greedy LowConfidence, block 32) for batch 1, 8, 64
at prefixes of 1k and 4k tokens, with the Pallas and the XLA attention / confidence backends. Each time is printed
beside the step's two floors (section 4 of ``reference/anchors.md``):

* memory: every weight read once (bf16, LM head in full) + the prefix K/V of every row + the block's K/V write,
  over 4.8 TB/s (H200 datasheet);
* compute: ``2 x params`` FLOPs per query token + attention ``4 x heads x head_dim x (prefix + B)`` per query
  token and layer, over 990 TFLOP/s (dense bf16, datasheet);

and as a percentage of the roofline (the larger floor over the measured time). It also measures the card's
copy bandwidth and bf16 matmul rate (the practical ceilings), the host overhead of the runner's ``denoise``
call (padding, dispatch, the device_get) over the device step, and the host overhead of whole scheduler rounds
(the engine's ``Scheduler`` + ``ModelRunner``, built without a model directory) with 32 requests in flight.

Needs only jax and numpy (the GPU machine's preinstalled jax). ``--smoke`` runs tiny shapes on any backend
(XLA only) to check the script; without a GPU and without ``--smoke`` it says so and exits.
"""

from __future__ import annotations

import argparse
import dataclasses
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
import numpy as np  # noqa: E402

HBM_BYTES_PER_S = 4.8e12  # H200 datasheet
BF16_FLOPS = 990e12  # H200 dense bf16, datasheet
BLOCK = 32

SDAR_1_7B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=28, num_heads=16,
                 num_kv_heads=8, head_dim=128, tie_word_embeddings=True, max_position_embeddings=40960)
SMOKE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
             head_dim=16, tie_word_embeddings=True, max_position_embeddings=4096)

# Targets of issue #8 (judged on the Pallas backend, the engine's GPU default).
TARGET_B1_MEMORY = 1.5  # batch 1, 1k prefix: step <= 1.5 x memory floor
TARGET_B64_COMPUTE = 2.0  # batch 64, 1k prefix: step <= 2 x compute floor


def model_config(shape: dict):
    from dllm_jax.config import ModelConfig

    return ModelConfig(mask_token_id=shape["vocab_size"] - 2, block_size=BLOCK, eos_token_ids=(0,), **shape)


def count_params(cfg) -> int:
    from dllm_jax.model.params import param_shapes

    shapes = jax.tree.leaves(param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    return int(sum(int(np.prod(s)) for s in shapes))


def floors(cfg, batch: int, prefix: int, *, block: int = BLOCK, itemsize: int = 2,
           hbm: float = HBM_BYTES_PER_S, peak: float = BF16_FLOPS) -> dict:
    """The step's minimal bytes and FLOPs, and the time floors they set (anchors.md section 4.2)."""
    params = count_params(cfg)
    if not cfg.tie_word_embeddings:
        params -= cfg.vocab_size * cfg.hidden_size  # the input embedding is a lookup: only T rows are read
    t = batch * block
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize
    nbytes = params * itemsize + batch * prefix * kv_per_token + t * kv_per_token
    flops = 2 * t * params + 4 * t * cfg.num_heads * cfg.head_dim * (prefix + block) * cfg.num_layers
    t_mem, t_cmp = nbytes / hbm, flops / peak
    return dict(params=params, bytes=nbytes, flops=flops, memory_floor_ms=1e3 * t_mem, compute_floor_ms=1e3 * t_cmp,
                floor_ms=1e3 * max(t_mem, t_cmp), bound="memory" if t_mem >= t_cmp else "compute",
                intensity=flops / nbytes)


# ----------------------------------------------------------------------------------------------
# Measurement
# ----------------------------------------------------------------------------------------------

def _random_pool(cfg, num_pages: int, dtype, key):
    shape = (cfg.num_kv_heads, num_pages, BLOCK, cfg.head_dim)
    pool = []
    for _ in range(cfg.num_layers):
        key, k1, k2 = jax.random.split(key, 3)
        pool.append((jax.random.normal(k1, shape, dtype), jax.random.normal(k2, shape, dtype)))
    return pool


def _batch(cfg, batch: int, prefix: int, width: int, rng: np.random.Generator, num_pages: int):
    from dllm_jax.decode.step import DenoiseBatch

    pages = rng.permutation(np.arange(1, num_pages))  # rows own scattered pages, as after a while of serving
    need = prefix // BLOCK
    table = np.zeros((batch, width), np.int32)
    table[:, :need] = pages[: batch * need].reshape(batch, need)
    write = pages[batch * need: batch * need + batch].astype(np.int32)
    tokens = np.full((batch, BLOCK), cfg.mask_token_id, np.int32)
    return DenoiseBatch(
        tokens=jnp.asarray(tokens), immutable=jnp.zeros((batch, BLOCK), bool), page_table=jnp.asarray(table),
        prefix_len=jnp.full((batch,), prefix, jnp.int32), write_page=jnp.asarray(write),
        steps_taken=jnp.zeros((batch,), jnp.int32), temperature=jnp.zeros((batch,), jnp.float32),
        top_k=jnp.full((batch,), -1, jnp.int32), top_p=jnp.ones((batch,), jnp.float32),
        seed=jnp.zeros((batch,), jnp.uint32), rng_step=jnp.zeros((batch,), jnp.int32))


def _init_state(algo, rows: int):
    try:
        return algo.init_state(rows, BLOCK)
    except TypeError:  # older signature: init_state(num_rows)
        return algo.init_state(rows)


class StepBench:
    """Holds the parameters and one KV pool big enough for the largest case; times denoise steps."""

    def __init__(self, cfg, *, max_batch: int, max_prefix: int, dtype, seed: int = 0):
        from dllm_jax.model.params import init_params

        self.cfg = cfg
        self.dtype = dtype
        key = jax.random.PRNGKey(seed)
        k1, k2 = jax.random.split(key)
        self.params = init_params(cfg, k1, dtype=dtype, std=0.02)
        self.num_pages = max_batch * (max_prefix // BLOCK + 1) + 1
        self.pool = _random_pool(cfg, self.num_pages, dtype, k2)
        jax.block_until_ready((self.params, self.pool))
        self.rng = np.random.default_rng(seed)

    def spec(self, backend: str):
        from dllm_jax.decode.algorithms import make_algorithm
        from dllm_jax.decode.step import StepSpec

        algo = make_algorithm("LowConfidence", {}, model_config=self.cfg)
        return StepSpec(model=self.cfg, block_size=BLOCK, mask_id=self.cfg.mask_token_id, algorithm=algo,
                        attention_backend=backend, confidence_backend=backend, loop=False)

    def time_step(self, batch: int, prefix: int, backend: str, *, iters: int = 20) -> dict:
        from dllm_jax.decode.algorithms import make_algorithm
        from dllm_jax.decode.step import denoise

        spec = self.spec(backend)
        b = _batch(self.cfg, batch, prefix, max(1, prefix // BLOCK), self.rng, self.num_pages)
        state = _init_state(make_algorithm("LowConfidence", {}, model_config=self.cfg), batch)
        t0 = time.perf_counter()
        self.pool, out = denoise(self.params, self.pool, b, state, spec=spec)
        jax.block_until_ready(out)
        compile_s = time.perf_counter() - t0
        self.pool, out = denoise(self.params, self.pool, b, state, spec=spec)
        jax.block_until_ready(out)
        synced = []
        for _ in range(iters):  # each step waited for, as the engine's FDFO loop does
            t0 = time.perf_counter()
            self.pool, out = denoise(self.params, self.pool, b, state, spec=spec)
            jax.block_until_ready(out)
            synced.append(time.perf_counter() - t0)
        t0 = time.perf_counter()  # back to back: the device time with dispatch hidden
        for _ in range(iters):
            self.pool, out = denoise(self.params, self.pool, b, state, spec=spec)
        jax.block_until_ready((self.pool, out))
        pipelined = (time.perf_counter() - t0) / iters
        return dict(step_ms=1e3 * statistics.median(synced), step_ms_min=1e3 * min(synced),
                    pipelined_ms=1e3 * pipelined, compile_s=compile_s)


def runner_overhead(cfg, params, batch: int, prefix: int, backend: str, *, iters: int = 10) -> dict:
    """The engine runner's ``denoise(rows)`` (host padding + dispatch + wait + device_get + unpacking) against
    the time it waits on the device (call -> result ready): the host overhead of one FDFO step."""
    from bench.common import device_timer
    from dllm_jax.decode.algorithms import make_algorithm
    from dllm_jax.engine.calls import DecodeRow
    from dllm_jax.engine.runner import ModelRunner

    algo = make_algorithm("LowConfidence", {}, model_config=cfg)
    pages_per_row = prefix // BLOCK + 2
    runner = ModelRunner(params, cfg, block_size=BLOCK, mask_id=cfg.mask_token_id, algorithm=algo,
                         num_pages=batch * pages_per_row + 1, max_rows=batch, max_pages_per_row=pages_per_row,
                         max_prefill_blocks=1, loop=False, attention_backend=backend, confidence_backend=backend,
                         kv_dtype=jnp.bfloat16)
    need = prefix // BLOCK
    rows = [DecodeRow(tokens=np.full(BLOCK, cfg.mask_token_id, np.int32), immutable=np.zeros(BLOCK, bool),
                      prefix_pages=list(range(1 + r * pages_per_row, 1 + r * pages_per_row + need)),
                      write_page=1 + r * pages_per_row + need, steps_taken=0, temperature=0.0, top_k=-1, top_p=1.0,
                      seed=0, rng_step=0, algo_state=None) for r in range(batch)]
    runner.denoise(rows)
    runner.denoise(rows)
    walls, waits = [], []
    with device_timer() as log:
        for _ in range(iters):
            n = len(log)
            t0 = time.perf_counter()
            runner.denoise(rows)
            walls.append(time.perf_counter() - t0)
            waits.append(sum(c[3] - c[1] for c in log[n:]))
    wall, wait = statistics.median(walls), statistics.median(waits)
    del runner
    return dict(batch=batch, prefix=prefix, backend=backend, call_ms=1e3 * wall, device_wait_ms=1e3 * wait,
                host_ms=1e3 * (wall - wait), host_frac=(wall - wait) / wall)


def scheduler_overhead(cfg, params, *, requests: int = 32, prompt_blocks: int = 32, max_new: int = 32,
                       backend: str = "pallas", dtype=jnp.bfloat16, seed: int = 0) -> dict:
    """The engine's scheduler + runner on the GPU without an ``Engine`` (no model directory needed): ``requests``
    random prompts of ``prompt_blocks`` complete blocks, ``max_new`` tokens each (EOS ignored), all in flight.
    The workload runs twice (the first pass compiles); for the second, per round: wall time vs the time spent
    waiting on device calls. Host overhead = the rest (scheduling, padding, commit, Python)."""
    import inspect

    from bench.common import device_timer
    from dllm_jax.cache.pages import PageAllocator
    from dllm_jax.cache.radix import BlockRadixIndex
    from dllm_jax.decode.algorithms import make_algorithm
    from dllm_jax.engine.request import Request
    from dllm_jax.engine.runner import ModelRunner
    from dllm_jax.engine.sampling import SamplingParams
    from dllm_jax.engine.scheduler import Scheduler

    algo = make_algorithm("LowConfidence", {}, model_config=cfg)
    pages_per_row = prompt_blocks + max_new // BLOCK + 3
    num_pages = requests * pages_per_row + 1
    kwargs = dict(block_size=BLOCK, mask_id=cfg.mask_token_id, algorithm=algo, num_pages=num_pages,
                  max_rows=requests, max_pages_per_row=pages_per_row, max_prefill_blocks=64, loop=False,
                  attention_backend=backend, confidence_backend=backend, kv_dtype=dtype)
    if "fold_commit" in inspect.signature(ModelRunner.__init__).parameters:
        kwargs["fold_commit"] = True  # the engine's default
    runner = ModelRunner(params, cfg, **kwargs)
    allocator = PageAllocator(num_pages)
    radix = BlockRadixIndex(BLOCK, allocator, enabled=False)
    sched = Scheduler(runner, allocator, radix, block_size=BLOCK, mask_id=cfg.mask_token_id, eos_token_ids=(0,),
                      max_running_requests=requests, context_length=pages_per_row * BLOCK,
                      max_prefill_blocks=runner.max_prefill_blocks)
    rng = np.random.default_rng(seed)
    params_ = SamplingParams(max_new_tokens=max_new, ignore_eos=True)

    def one_pass():
        for i in range(requests):
            ids = [int(t) for t in rng.integers(10, cfg.vocab_size - 10, prompt_blocks * BLOCK)]
            sched.add(Request(rid=str(i), prompt_ids=ids, params=params_, seed=0))
        walls, waits, kinds = [], [], []
        with device_timer() as log:
            t_start = time.perf_counter()
            while sched.has_work():
                n = len(log)
                t0 = time.perf_counter()
                for call in sched.schedule():
                    sched.process(call, runner.run(call))
                walls.append(time.perf_counter() - t0)
                calls = log[n:]
                waits.append(sum(c[3] - c[1] for c in calls))
                kinds.append({c[0] for c in calls})
            total = time.perf_counter() - t_start
        return walls, waits, kinds, total

    t0 = time.perf_counter()
    one_pass()
    warm_s = time.perf_counter() - t0
    walls, waits, kinds, total = one_pass()
    dec = [i for i, k in enumerate(kinds) if k == {"denoise"}]
    wall, wait = sum(walls), sum(waits)
    dwall, dwait = sum(walls[i] for i in dec), sum(waits[i] for i in dec)
    del runner
    return dict(requests=requests, prompt_tokens=prompt_blocks * BLOCK, max_new_tokens=max_new, backend=backend,
                rounds=len(walls), decode_rounds=len(dec), pass_s=total, warmup_s=warm_s,
                host_frac=(wall - wait) / wall, host_ms_per_round=1e3 * (wall - wait) / len(walls),
                decode_round_ms=1e3 * dwall / max(len(dec), 1),
                decode_host_frac=(dwall - dwait) / dwall if dwall else float("nan"),
                decode_host_ms_per_round=1e3 * (dwall - dwait) / max(len(dec), 1),
                output_tokens_per_s=requests * max_new / total)


def ceilings(dtype) -> dict:
    """The card's practical ceilings: a 2 GiB copy (bytes read + written) and an 8192^3 matmul."""
    n = (1 << 30) // jnp.dtype(dtype).itemsize
    x = jax.random.normal(jax.random.PRNGKey(1), (n,), dtype)
    f = jax.jit(lambda a: a + jnp.asarray(1, dtype))
    jax.block_until_ready(f(x))
    reps = 10
    t0 = time.perf_counter()
    for _ in range(reps):
        y = f(x)
    jax.block_until_ready(y)
    copy_bps = 2 * x.nbytes * reps / (time.perf_counter() - t0)
    del x, y
    m = 8192
    a = jax.random.normal(jax.random.PRNGKey(2), (m, m), dtype)
    b = jax.random.normal(jax.random.PRNGKey(3), (m, m), dtype)
    g = jax.jit(lambda p, q: p @ q)
    jax.block_until_ready(g(a, b))
    t0 = time.perf_counter()
    for _ in range(reps):
        c = g(a, b)
    jax.block_until_ready(c)
    mm = 2 * m ** 3 * reps / (time.perf_counter() - t0)
    return dict(copy_bytes_per_s=copy_bps, matmul_flops=mm)


# ----------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------

def format_rows(rows: list[dict]) -> str:
    from bench.common import table

    cols = ["backend", "batch", "prefix", "step ms", "min ms", "pipelined ms", "mem floor", "cmp floor", "bound",
            "% roofline", "x mem floor", "x cmp floor", "compile s"]
    body = [[r["backend"], r["batch"], r["prefix"], r["step_ms"], r["step_ms_min"], r["pipelined_ms"],
             r["memory_floor_ms"], r["compute_floor_ms"], r["bound"], f"{100 * r['floor_ms'] / r['step_ms']:.1f}%",
             r["step_ms"] / r["memory_floor_ms"], r["step_ms"] / r["compute_floor_ms"], r["compile_s"]]
            for r in rows]
    return table("denoise step vs roofline (ms; floors at 4.8 TB/s and 990 TFLOP/s)", cols, body)


def judge(rows: list[dict]) -> list[dict]:
    """The issue's two GPU targets, on the Pallas backend with a 1k prefix."""
    out = []
    for batch, floor_key, limit, what in ((1, "memory_floor_ms", TARGET_B1_MEMORY, "memory"),
                                          (64, "compute_floor_ms", TARGET_B64_COMPUTE, "compute")):
        hit = [r for r in rows if r["backend"] == "pallas" and r["batch"] == batch and r["prefix"] == 1024]
        value = hit[0]["step_ms"] / hit[0][floor_key] if hit else None
        out.append(dict(name=f"GPU: batch-{batch} denoise step (1k prefix, Pallas) / {what} floor", value=value,
                        target=limit, comparison="<=", met=None if value is None else value <= limit, unit="x",
                        step_ms=hit[0]["step_ms"] if hit else None, floor_ms=hit[0][floor_key] if hit else None))
    return out


def run(*, smoke: bool = False, batches=(1, 8, 64), prefixes=(1024, 4096), backends=("pallas", "xla"),
        iters: int = 20, budget_s: float = 330.0, runner_check: bool = True, measure_ceilings: bool = True,
        scheduler_check: bool = True, out_path: str | None = None, log=print) -> dict:
    """Measure (see the module docstring). With ``out_path`` the JSON is rewritten after every case, so a run cut
    short by a time limit still leaves its figures."""
    result: dict = {}

    def save():
        if out_path:
            from bench.common import write_json

            write_json(out_path, result)

    t_start = time.perf_counter()
    on_gpu = jax.default_backend() == "gpu"
    if smoke:
        shape, dtype = SMOKE, jnp.float32
        batches, prefixes, backends, iters = (1, 2), (32, 64), ("xla",), 2
    else:
        shape, dtype = SDAR_1_7B, jnp.bfloat16
    cfg = model_config(shape)
    result.update(device=jax.devices()[0].device_kind, backend=jax.default_backend(), jax=jax.__version__,
                python=platform.python_version(), smoke=smoke, dtype=jnp.dtype(dtype).name,
                shape=shape, peaks=dict(hbm_bytes_per_s=HBM_BYTES_PER_S, bf16_flops=BF16_FLOPS), complete=False)
    rows, skipped, overhead = [], [], []
    result.update(rows=rows, skipped=skipped, runner_overhead=overhead, scheduler_overhead=None, targets=[])
    log(f"roofline: jax {jax.__version__} on {result['device']} ({result['backend']}); {result['dtype']}; "
        f"{count_params(cfg) / 1e9:.3f}B params")
    if measure_ceilings and on_gpu and not smoke:
        try:
            result["ceilings"] = ceilings(dtype)
        except Exception as e:
            log(f"ceilings: FAILED {type(e).__name__}: {str(e)[:300]}")
            result["ceilings"] = {}
        c = result["ceilings"] or {"copy_bytes_per_s": float("nan"), "matmul_flops": float("nan")}
        log(f"measured ceilings: copy {c['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul "
            f"{c['matmul_flops'] / 1e12:.0f} TFLOP/s")
    bench = StepBench(cfg, max_batch=max(batches), max_prefix=max(prefixes), dtype=dtype)
    log(f"params and a {bench.num_pages}-page KV pool ready ({time.perf_counter() - t_start:.0f} s)")
    save()
    # Most important first: the Pallas path (the engine's GPU default), the target cases first.
    order = sorted(((b, p) for b in batches for p in prefixes),
                   key=lambda bp: (bp[1] != min(prefixes), bp[0] not in (1, max(batches)), bp))
    for backend in backends:
        for batch, prefix in order:
            if time.perf_counter() - t_start > budget_s:
                skipped.append(dict(backend=backend, batch=batch, prefix=prefix))
                continue
            try:
                m = bench.time_step(batch, prefix, backend, iters=iters)
            except Exception as e:  # report and go on: one failing backend must not hide the rest
                log(f"  {backend} batch {batch} prefix {prefix}: FAILED {type(e).__name__}: {str(e)[:300]}")
                rows.append(dict(backend=backend, batch=batch, prefix=prefix, error=f"{type(e).__name__}: {e}"))
                continue
            row = dict(backend=backend, batch=batch, prefix=prefix, **m, **floors(cfg, batch, prefix))
            rows.append(row)
            result["targets"] = judge([r for r in rows if "error" not in r]) if not smoke else []
            save()
            log(f"  {backend:6s} batch {batch:3d} prefix {prefix:5d}: {row['step_ms']:8.3f} ms "
                f"(floor {row['floor_ms']:.3f} ms {row['bound']}, {100 * row['floor_ms'] / row['step_ms']:.1f}% "
                f"of roofline; compile {row['compile_s']:.1f} s)")
    if runner_check and not smoke:
        for batch in (1, max(batches)):
            if time.perf_counter() - t_start > budget_s:
                skipped.append(dict(runner_overhead=batch))
                continue
            try:
                o = runner_overhead(cfg, bench.params, batch, min(prefixes), backends[0])
            except Exception as e:
                log(f"  runner overhead batch {batch}: FAILED {type(e).__name__}: {str(e)[:300]}")
                continue
            overhead.append(o)
            save()
            log(f"  runner.denoise batch {batch:3d}: call {o['call_ms']:.3f} ms, device wait {o['device_wait_ms']:.3f}"
                f" ms, host {o['host_ms']:.3f} ms ({100 * o['host_frac']:.1f}%)")
    if scheduler_check and not smoke:
        if time.perf_counter() - t_start > budget_s + 30:
            skipped.append(dict(scheduler_overhead=32))
        else:
            try:
                s = scheduler_overhead(cfg, bench.params, backend=backends[0], dtype=dtype)
                result["scheduler_overhead"] = s
                log(f"  scheduler, {s['requests']} requests of {s['prompt_tokens']} tokens + {s['max_new_tokens']}: "
                    f"host {100 * s['host_frac']:.1f}% of all rounds ({s['host_ms_per_round']:.3f} ms/round); "
                    f"decode rounds {s['decode_round_ms']:.2f} ms, host {100 * s['decode_host_frac']:.1f}%; "
                    f"{s['output_tokens_per_s']:.0f} output tok/s (random weights: ~1 token per step)")
            except Exception as e:
                log(f"  scheduler overhead: FAILED {type(e).__name__}: {str(e)[:300]}")
    good = [r for r in rows if "error" not in r]
    result.update(targets=judge(good) if not smoke else [], elapsed_s=time.perf_counter() - t_start, complete=True)
    save()
    if good:
        log(format_rows(good))
    if skipped:
        log(f"skipped for the time budget ({budget_s:.0f} s): {skipped}")
    for t in result["targets"]:
        v = "-" if t["value"] is None else f"{t['value']:.2f}x"
        log(f"TARGET {t['name']}: {v} (target <= {t['target']}x) -> "
            f"{'MET' if t['met'] else 'not met' if t['met'] is not None else 'not measured'}")
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on any backend (checks the script)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--prefixes", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--backends", nargs="+", default=["pallas", "xla"])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--budget-s", type=float, default=330.0, help="skip the remaining cases past this many seconds")
    ap.add_argument("--no-runner-check", action="store_true")
    ap.add_argument("--no-scheduler-check", action="store_true")
    ap.add_argument("--out", default=None, help="JSON path (default: $OUT/roofline.json or bench_out/roofline.json)")
    args = ap.parse_args(argv)
    if jax.default_backend() != "gpu" and not args.smoke:
        print("bench.roofline: no GPU here; the roofline needs one (use --smoke to check the script on CPU).")
        return 0
    out = args.out or os.path.join(os.environ.get("OUT") or "bench_out", "roofline.json")
    run(smoke=args.smoke, batches=tuple(args.batches), prefixes=tuple(args.prefixes), backends=tuple(args.backends),
        iters=args.iters, budget_s=args.budget_s, runner_check=not args.no_runner_check,
        scheduler_check=not args.no_scheduler_check, out_path=out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
