"""Denoise-step roofline at the SDAR-1.7B shape: ``python -m bench.roofline [--smoke]``.

Builds the SDAR-1.7B shape (28 layers, hidden 2048, 16 q heads, 8 KV heads, head dim 128, MLP 6144, vocab
151,936, tied embedding; random bf16 weights and random bf16 KV pages), and times the engine's jitted denoise
step (:func:`dllm_jax.decode.step.denoise`, one FDFO step of greedy LowConfidence, block 32) for batch 1, 8, 64
at prefixes of 1k and 4k tokens, with the Pallas and the XLA attention / confidence backends (``pallas`` rows run
the engine's GPU defaults: Pallas attention, ``auto`` confidence, i.e. Pallas or XLA per shape from
``pallas_kernels/confidence_crossover.json``). Each time is printed beside the step's two floors (section 4 of
``reference/anchors.md``), at the datasheet peaks and at the card's measured ceilings:

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

# Targets of issue #8 (judged on the Pallas backend, the engine's GPU default), against the datasheet floors.
TARGET_B1_MEMORY = 1.5  # batch 1, 1k prefix: step <= 1.5 x memory floor
TARGET_B64_COMPUTE = 2.0  # batch 64, 1k prefix: step <= 2 x compute floor
# Issue 39: against the floors at the card's measured ceilings (copy bandwidth, bf16 matmul rate).
TARGET_MEASURED = 1.6


def confidence_for(backend: str) -> str:
    """The confidence backend of a ``backend`` row: ``pallas`` rows run what the engine runs on a GPU by default
    (``confidence_backend="auto"``: Pallas or XLA per shape from pallas_kernels/confidence_crossover.json)."""
    import jax

    return "auto" if backend == "pallas" and jax.default_backend() == "gpu" else backend


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
                        attention_backend=backend, confidence_backend=confidence_for(backend), loop=False)

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


class OverlapProbe:
    """Host time hidden behind the device vs exposed, per device call of a :class:`ModelRunner` (issue 39 item 6).

    While active it wraps the runner module's jitted ``denoise_packed`` / ``prefill`` (recording when each call was
    dispatched and when its dispatch returned, and handing each denoise result to a watcher thread that records
    when it became ready, without making the caller wait) and sets ``runner.timeline`` (the runner's own host
    timestamps: entered, dispatched, sync started, sync ended, returned). :meth:`summary` then splits the host's
    work per denoise call into

    * **exposed**: done while the device had nothing to run: from the previous result being ready to the next
      dispatch (unpacking, committing, scheduling, padding the next batch), and work after a result was ready but
      before the host read it;
    * **dispatch**: the jitted calls themselves (on a GPU the first kernels run while later ones are launched, so
      this is partly hidden there; on XLA:CPU it is mostly exposed);
    * **hidden**: done while a call ran: between a denoise dispatch and the host's read of its result, and between
      a prefill's dispatch and the next dispatch of the round (the prefill runs meanwhile).

    The device time per call is taken as the round's first dispatch -> ready (a prefill before it included)."""

    def __init__(self, runner):
        self.runner = runner
        self.calls: list[list] = []  # [kind, dispatch start, dispatch end, ready or None]

    def __enter__(self):
        import queue
        import threading

        from dllm_jax.engine import runner as runner_mod

        self._mod = runner_mod
        self._saved = runner_mod.denoise_packed, runner_mod.prefill
        self._queue = queue.Queue()
        self._switch = sys.getswitchinterval()
        sys.setswitchinterval(1e-4)  # the watcher's timestamp must not wait 5 ms for the GIL

        def watch():
            while True:
                item = self._queue.get()
                if item is None:
                    return
                rec, arr = item
                try:
                    arr.block_until_ready()
                except Exception:  # noqa: BLE001 -- a failed call: no ready time
                    continue
                rec[3] = time.perf_counter()

        self._thread = threading.Thread(target=watch, daemon=True)
        self._thread.start()

        def wrap(fn, kind):
            def call(*args, **kwargs):
                t0 = time.perf_counter()
                out = fn(*args, **kwargs)
                rec = [kind, t0, time.perf_counter(), None]
                self.calls.append(rec)
                if kind == "denoise":  # (a prefill's output, the pool, is donated to the next call at once)
                    self._queue.put((rec, out[1]))
                return out

            call.__wrapped__ = fn
            return call

        runner_mod.denoise_packed = wrap(self._saved[0], "denoise")
        runner_mod.prefill = wrap(self._saved[1], "prefill")
        self.runner.timeline = []
        self.t_start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.t_end = time.perf_counter()
        self._queue.put(None)
        self._thread.join(timeout=60)
        self._mod.denoise_packed, self._mod.prefill = self._saved
        sys.setswitchinterval(self._switch)
        self.timeline, self.runner.timeline = self.runner.timeline, None
        return False

    def summary(self) -> dict:
        """Per denoise call (ms): host work exposed / hidden, dispatch, device; and over the whole window."""
        denoise = [c for c in self.calls if c[0] == "denoise"]
        if len(denoise) != len(self.timeline) or not denoise:
            return dict(calls=len(denoise), error="calls and runner timeline disagree" if denoise else "no calls")
        exposed = hidden = dispatch = device = late = 0.0
        prev_ready = self.t_start
        i_call = 0
        for rec, (_, t_disp, t_sync, t_synced, _) in zip(denoise, self.timeline):
            round_calls = []
            while i_call < len(self.calls) and self.calls[i_call] is not rec:
                round_calls.append(self.calls[i_call])
                i_call += 1
            round_calls.append(rec)
            i_call += 1
            first = round_calls[0]
            ready = rec[3] if rec[3] is not None else t_synced
            ready = min(ready, t_synced)
            exposed += max(0.0, first[1] - prev_ready)  # the device idle, waiting for the host
            for a, b in zip(round_calls, round_calls[1:]):  # a prefill running while the host plans the denoise
                hidden += max(0.0, b[1] - a[2])
            dispatch += sum(c[2] - c[1] for c in round_calls)
            hidden += max(0.0, min(ready, t_sync) - t_disp)  # work between the dispatch and the read, device busy
            late += max(0.0, t_sync - ready)  # work after the result was ready, before the read
            device += ready - first[1]
            prev_ready = ready
        exposed_total = exposed + late
        wall = self.t_end - self.t_start
        n = len(denoise)
        # Where the runner's own time goes (ms per call): building the padded batch, the jitted call, the work after
        # it before the read, the read's wait, unpacking; and the host outside the runner (scheduling, committing).
        tl = self.timeline
        parts = dict(prep=sum(rec[1] - t[0] for rec, t in zip(denoise, tl)), post=sum(t[2] - t[1] for t in tl),
                     wait=sum(t[3] - t[2] for t in tl), unpack=sum(t[4] - t[3] for t in tl),
                     outside=sum(b[0] - a[4] for a, b in zip(tl, tl[1:])) + (self.t_end - tl[-1][4])
                     + (tl[0][0] - self.t_start))
        host = exposed_total + dispatch + hidden
        return dict(calls=n, prefill_calls=sum(c[0] == "prefill" for c in self.calls), wall_ms=1e3 * wall,
                    breakdown_ms_per_call={k: 1e3 * v / n for k, v in parts.items()},
                    host_ms_per_call=1e3 * host / n, exposed_ms_per_call=1e3 * exposed_total / n,
                    hidden_ms_per_call=1e3 * hidden / n, dispatch_ms_per_call=1e3 * dispatch / n,
                    device_ms_per_call=1e3 * device / n, hidden_frac=hidden / host if host else float("nan"),
                    exposed_frac_of_wall=exposed_total / wall if wall else float("nan"))


def format_overlap(name: str, o: dict) -> str:
    if "error" in o:
        return f"{name}: host overlap not measured ({o['error']})"
    b = o["breakdown_ms_per_call"]
    return (f"{name}: per denoise call host {o['host_ms_per_call']:.3f} ms = exposed {o['exposed_ms_per_call']:.3f} "
            f"+ dispatch {o['dispatch_ms_per_call']:.3f} + hidden {o['hidden_ms_per_call']:.3f} "
            f"({100 * o['hidden_frac']:.0f}% hidden); device {o['device_ms_per_call']:.3f} ms; exposed host "
            f"{100 * o['exposed_frac_of_wall']:.1f}% of the wall ({o['calls']} calls, {o['prefill_calls']} prefills); "
            f"runner: pad {b['prep']:.3f}, after dispatch {b['post']:.3f}, wait {b['wait']:.3f}, unpack "
            f"{b['unpack']:.3f}; outside the runner {b['outside']:.3f} ms")


def runner_overhead(cfg, params, batch: int, prefix: int, backend: str, *, iters: int = 10,
                    dtype=jnp.bfloat16) -> dict:
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
                         max_prefill_blocks=1, loop=False, attention_backend=backend,
                         confidence_backend=confidence_for(backend), kv_dtype=dtype)
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
    overlap = {}
    for read_async in dict.fromkeys((False, runner.read_async)):  # before / after the results' early copy (GPU)
        runner.read_async = read_async
        runner.denoise(rows)
        with OverlapProbe(runner) as probe:  # the same calls back to back, nothing waited for but the runner's read
            for _ in range(iters):
                runner.denoise(rows)
        overlap["read_async" if read_async else "read_sync"] = probe.summary()
    del runner
    return dict(batch=batch, prefix=prefix, backend=backend, call_ms=1e3 * wall, device_wait_ms=1e3 * wait,
                host_ms=1e3 * (wall - wait), host_frac=(wall - wait) / wall,
                overlap=overlap.get("read_async", overlap["read_sync"]), overlap_modes=overlap)


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
    from dllm_jax.engine.mask_blocks import MaskBlocks
    from dllm_jax.engine.scheduler import Scheduler

    algo = make_algorithm("LowConfidence", {}, model_config=cfg)
    pages_per_row = prompt_blocks + max_new // BLOCK + 3
    num_pages = requests * pages_per_row + 1
    kwargs = dict(block_size=BLOCK, mask_id=cfg.mask_token_id, algorithm=algo, num_pages=num_pages,
                  max_rows=requests, max_pages_per_row=pages_per_row, max_prefill_blocks=64, loop=False,
                  attention_backend=backend, confidence_backend=confidence_for(backend), kv_dtype=dtype)
    if "fold_commit" in inspect.signature(ModelRunner.__init__).parameters:
        kwargs["fold_commit"] = True  # the engine's default
    runner = ModelRunner(params, cfg, **kwargs)
    allocator = PageAllocator(num_pages)
    radix = BlockRadixIndex(BLOCK, allocator, enabled=False)
    policy = MaskBlocks(runner, allocator, radix, block_size=BLOCK, mask_id=cfg.mask_token_id,
                        context_length=pages_per_row * BLOCK, max_prefill_blocks=runner.max_prefill_blocks)
    sched = Scheduler(policy, eos_token_ids=(0,), max_running_requests=requests)
    rng = np.random.default_rng(seed)
    params_ = SamplingParams(max_new_tokens=max_new, ignore_eos=True)

    def overlap_pass():
        for i in range(requests):
            ids = [int(t) for t in rng.integers(10, cfg.vocab_size - 10, prompt_blocks * BLOCK)]
            sched.add(Request(rid=str(i), prompt_ids=ids, params=params_, seed=0))
        with OverlapProbe(runner) as probe:
            while sched.has_work():
                for call in sched.schedule():
                    sched.process(call, runner.run(call))
        return probe.summary()

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
    overlap = overlap_pass()
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
                output_tokens_per_s=requests * max_new / total, overlap=overlap)


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

    measured = all("memory_floor_ms_measured" in r for r in rows) and rows
    cols = ["backend", "batch", "prefix", "step ms", "min ms", "pipelined ms", "mem floor", "cmp floor", "bound",
            "% roofline", "x mem floor", "x cmp floor"]
    cols += ["x mem (meas.)", "x cmp (meas.)"] if measured else []
    cols += ["compile s"]
    body = []
    for r in rows:
        line = [r["backend"], r["batch"], r["prefix"], r["step_ms"], r["step_ms_min"], r["pipelined_ms"],
                r["memory_floor_ms"], r["compute_floor_ms"], r["bound"], f"{100 * r['floor_ms'] / r['step_ms']:.1f}%",
                r["step_ms"] / r["memory_floor_ms"], r["step_ms"] / r["compute_floor_ms"]]
        if measured:
            line += [r["step_ms"] / r["memory_floor_ms_measured"], r["step_ms"] / r["compute_floor_ms_measured"]]
        body.append(line + [r["compile_s"]])
    title = "denoise step vs roofline (ms; floors at 4.8 TB/s and 990 TFLOP/s"
    title += "; (meas.): at the measured copy / matmul ceilings)" if measured else ")"
    return table(title, cols, body)


def at_measured_ceilings(row: dict, ceilings: dict | None) -> dict:
    """The row's floors at the card's measured ceilings (``ceilings()``), added as ``*_measured`` fields."""
    if not ceilings or not ceilings.get("copy_bytes_per_s") or not ceilings.get("matmul_flops"):
        return row
    t_mem = 1e3 * row["bytes"] / ceilings["copy_bytes_per_s"]
    t_cmp = 1e3 * row["flops"] / ceilings["matmul_flops"]
    return dict(row, memory_floor_ms_measured=t_mem, compute_floor_ms_measured=t_cmp)


def judge(rows: list[dict]) -> list[dict]:
    """The GPU targets, on the Pallas backend with a 1k prefix: issue 8's against the datasheet floors, issue 39's
    (1.6x) against the floors at the measured ceilings (when the run measured them)."""
    out = []
    for batch, floor_key, what in ((1, "memory_floor_ms_measured", "memory"),
                                   (64, "compute_floor_ms_measured", "compute")):
        hit = [r for r in rows if r["backend"] == "pallas" and r["batch"] == batch and r["prefix"] == 1024
               and floor_key in r]
        value = hit[0]["step_ms"] / hit[0][floor_key] if hit else None
        out.append(dict(name=f"GPU: batch-{batch} denoise step (1k prefix, Pallas) / {what} floor at the measured "
                             f"{'copy bandwidth' if what == 'memory' else 'matmul rate'}", value=value,
                        target=TARGET_MEASURED, comparison="<=",
                        met=None if value is None else value <= TARGET_MEASURED,
                        unit="x", step_ms=hit[0]["step_ms"] if hit else None,
                        floor_ms=hit[0][floor_key] if hit else None))
    for batch, floor_key, limit, what in ((1, "memory_floor_ms", TARGET_B1_MEMORY, "memory"),
                                          (64, "compute_floor_ms", TARGET_B64_COMPUTE, "compute")):
        hit = [r for r in rows if r["backend"] == "pallas" and r["batch"] == batch and r["prefix"] == 1024]
        value = hit[0]["step_ms"] / hit[0][floor_key] if hit else None
        out.append(dict(name=f"GPU: batch-{batch} denoise step (1k prefix, Pallas) / {what} floor", value=value,
                        target=limit, comparison="<=", met=None if value is None else value <= limit, unit="x",
                        step_ms=hit[0]["step_ms"] if hit else None, floor_ms=hit[0][floor_key] if hit else None))
    return out


def run(*, smoke: bool = False, batches=(1, 8, 64), prefixes=(1024, 4096), backends=("pallas", "xla"),
        iters: int = 20, budget_s: float = 330.0, overhead_budget_s: float = 60.0, runner_check: bool = True,
        measure_ceilings: bool = True,
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
        batches, prefixes, backends, iters = (1, 2), (32,), ("xla",), 2
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
            row = at_measured_ceilings(dict(backend=backend, batch=batch, prefix=prefix, **m,
                                            **floors(cfg, batch, prefix)), result.get("ceilings"))
            rows.append(row)
            result["targets"] = judge([r for r in rows if "error" not in r]) if not smoke else []
            save()
            log(f"  {backend:6s} batch {batch:3d} prefix {prefix:5d}: {row['step_ms']:8.3f} ms "
                f"(floor {row['floor_ms']:.3f} ms {row['bound']}, {100 * row['floor_ms'] / row['step_ms']:.1f}% "
                f"of roofline; compile {row['compile_s']:.1f} s)")
    if runner_check:  # the host-overhead checks have their own allowance after the cases' budget
        for batch in (1, max(batches)):
            if time.perf_counter() - t_start > budget_s + overhead_budget_s / 2:
                skipped.append(dict(runner_overhead=batch))
                continue
            try:
                o = runner_overhead(cfg, bench.params, batch, min(prefixes), backends[0], dtype=dtype)
            except Exception as e:
                log(f"  runner overhead batch {batch}: FAILED {type(e).__name__}: {str(e)[:300]}")
                continue
            overhead.append(o)
            save()
            log(f"  runner.denoise batch {batch:3d}: call {o['call_ms']:.3f} ms, device wait {o['device_wait_ms']:.3f}"
                f" ms, host {o['host_ms']:.3f} ms ({100 * o['host_frac']:.1f}%)")
            for mode, ov in o["overlap_modes"].items():
                log("  " + format_overlap(f"runner.denoise batch {batch}, back to back, {mode}", ov))
    if scheduler_check:
        if time.perf_counter() - t_start > budget_s + overhead_budget_s:
            skipped.append(dict(scheduler_overhead=32))
        else:
            try:
                kw = dict(requests=4, prompt_blocks=2, max_new=2 * BLOCK) if smoke else {}
                s = scheduler_overhead(cfg, bench.params, backend=backends[0], dtype=dtype, **kw)
                result["scheduler_overhead"] = s
                log(f"  scheduler, {s['requests']} requests of {s['prompt_tokens']} tokens + {s['max_new_tokens']}: "
                    f"host {100 * s['host_frac']:.1f}% of all rounds ({s['host_ms_per_round']:.3f} ms/round); "
                    f"decode rounds {s['decode_round_ms']:.2f} ms, host {100 * s['decode_host_frac']:.1f}%; "
                    f"{s['output_tokens_per_s']:.0f} output tok/s (random weights: ~1 token per step)")
                log("  " + format_overlap(f"scheduler, {s['requests']} requests", s["overlap"]))
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
    ap.add_argument("--overhead-budget-s", type=float, default=60.0,
                    help="after the cases' budget: this much more for the runner and scheduler host-overhead checks")
    ap.add_argument("--no-runner-check", action="store_true")
    ap.add_argument("--no-scheduler-check", action="store_true")
    ap.add_argument("--out", default=None, help="JSON path (default: $OUT/roofline.json or bench_out/roofline.json)")
    args = ap.parse_args(argv)
    if jax.default_backend() != "gpu" and not args.smoke:
        print("bench.roofline: no GPU here; the roofline needs one (use --smoke to check the script on CPU).")
        return 0
    out = args.out or os.path.join(os.environ.get("OUT") or "bench_out", "roofline.json")
    run(smoke=args.smoke, batches=tuple(args.batches), prefixes=tuple(args.prefixes), backends=tuple(args.backends),
        iters=args.iters, budget_s=args.budget_s, overhead_budget_s=args.overhead_budget_s,
        runner_check=not args.no_runner_check,
        scheduler_check=not args.no_scheduler_check, out_path=out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
