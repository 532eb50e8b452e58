"""``python -m bench efficiency``: every engine run set against the bare forwards it needed.

For each run (model x schedule x concurrency) the engine's runner logs every device call's bucket (rows x
page-table width, blocks per row) and how much of it was real work. The *floor* of the run is the sum, over its
calls, of the bare time of that call's bucket: a jitted forward (K/V write included) plus the confidence
selection, nothing else, measured separately in the same process on the same shapes, every row after the call's
longest real prefix (rounded up to the attention's key tile: the table's padding beyond it is never read, so
charging the bucket's whole width would inflate the floor). A call that looped ``n``
forwards on the device (the FDFO loop, the synchronous schedule) is charged what a bare call looping ``n``
forwards costs: ``fixed + n * per_forward``, both fitted per bucket from bare calls of 1 and of 8 forwards (3
when one forward takes over 50 ms) in a ``fori_loop`` (on a GPU the launch and sync of a small model's call cost
more than its forward: charging ``n`` separate calls would put the floor above the engine). Each forward of that
loop is a whole one: its inputs pass an optimization barrier with the K/V every iteration, so XLA cannot hoist the
part that depends only on the (repeated) tokens out of the loop; it did, until 2026-12-06, and the floor then
charged the first layer's projections once a call instead of once a forward (16 rows: 5.3-5.7 ms a forward
against the 6.7 ms of a single one). The call's commit
forwards that stopped after writing the K/V (the engine reports how many) are charged as bare K/V-only forwards,
so the floor is the work the engine needed, not more. ``wall / floor`` is
what the engine adds on top of the forwards it chose to run: host work between calls, the algorithm and sampling
on the device, the host sync. How good the choice of forwards was is reported beside it: padding rows and padded
page-table width (as fractions of rows and of the FLOPs of the calls), refresh rows, prefill calls, tokens per
forward. The difference itself is split in two: ``device / floor`` (the engine's device calls, timed from the
jitted call to its result, against the floor) and the host time per request, beside the same host work run alone
(the run played back with every device call answered from a recording: what the engine's Python costs when no
forward runs between its pieces) and the part of it that is the request's own API work measured bare (validating
and building the request, detokenizing its answer). ``device alone / floor``: the run's own device calls replayed
back to back with nothing between them; ``alone / floor``: host alone plus device alone. On a CPU the engine's
Python and XLA's forwards share the cores and their caches, and each slows the other (host work runs 2-3x slower
between forwards than alone); the two "alone" figures measure what the run costs without that interplay, which
a GPU (separate memory, its own processor) does not have.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time

import numpy as np

from bench import plots
from bench.common import (Ctx, ModelInfo, chat_prompts, device_timer, hard_prompts, kv_pages_for, make_engine,
                          table)

TARGET_CONCURRENT = 1.15  # wall <= 1.15 x floor at 16 and 64 concurrent requests
TARGET_SINGLE = 1.3  # and <= 1.3 x at one request


# ----------------------------------------------------------------------------------------------
# The bare forward of a bucket
# ----------------------------------------------------------------------------------------------

class BareForward:
    """Times the bare device work of a bucket on one engine's model: forward (+ K/V write) and, for a denoise
    bucket, the confidence selection. Memoised per bucket."""

    def __init__(self, engine):
        import jax

        from bench.common import bare_forward, scratch_pool

        runner = engine.runner
        self.runner = runner
        self.B = runner.block_size
        self.pool = scratch_pool(runner)
        forward = bare_forward(runner.greedy_spec)

        def once(params, kv, tokens, table, prefix, write, select):
            kv, out = forward(params, kv, tokens, table, prefix, write, select)
            return kv, (out[1][:, 0] + out[0][:, 0] if select else out[:, 0, 0])

        @functools.partial(jax.jit, donate_argnums=(1,), static_argnames=("select",))
        def bare(params, kv, tokens, table, prefix, write, loops, kv_loops=0, *, select):
            """``loops`` forwards back to back, then ``kv_loops`` commit forwards (K/V only, as the engine's step
            runs them); traced counts: one executable per bucket serves every count.

            Every forward of the loops is a whole one (the optimization barrier: see the module docstring)."""
            kv, out = once(params, kv, tokens, table, prefix, write, select)

            def body(_, carry):  # each forward reads the K/V the previous one wrote, and its inputs anew
                kv, acc, inputs = carry
                kv, inputs = jax.lax.optimization_barrier((kv, inputs))
                kv, out = once(params, kv, *inputs, select)
                return kv, acc + out, inputs

            def kv_body(_, carry):
                kv, acc, inputs = carry
                kv, inputs = jax.lax.optimization_barrier((kv, inputs))
                kv, _ = forward(params, kv, *inputs, None)
                return kv, acc, inputs

            carry = jax.lax.fori_loop(1, loops, body, (kv, out, (tokens, table, prefix, write)))
            kv, out, _ = jax.lax.fori_loop(0, kv_loops, kv_body, carry)
            return kv, out

        self._bare = bare
        self._memo: dict[tuple, float] = {}

    LOOPS = 8  # forwards of the looped bare call that the per-forward cost is fitted from

    def live_pages(self, rows: int, width: int, blocks: int, prefix_pages: int) -> int:
        """The prefix pages a call's attention really walks: its longest real prefix, rounded up to the XLA
        attention's key tile (the bucket's padding beyond it is never read)."""
        from dllm_jax.decode.xla_attention import attention_tiles

        cfg = self.runner.cfg
        _, k_tile = attention_tiles(rows, blocks * self.B, cfg.num_heads, width, self.B)
        tile = k_tile // self.B
        return min(width, -(-prefix_pages // tile) * tile)

    def seconds(self, kind: str, rows: int, width: int, blocks: int, iterations: int = 1,
                prefix_pages: int | None = None, kv_only: int = 0) -> float:
        """The bare time of one call of this bucket that runs ``iterations`` forwards on the device, ``kv_only``
        of them commit forwards (K/V only), every row after ``prefix_pages`` pages of prefix (default: the whole
        width)."""
        live = width if prefix_pages is None else self.live_pages(rows, width, blocks, prefix_pages)
        key = (kind, rows, width, blocks, live)
        if key not in self._memo:
            one = self._measure(kind, rows, width, blocks, 1, live)
            loops = self.LOOPS if one < 0.05 else 3  # a slow forward: its call's fixed cost is lost in it anyway
            many = self._measure(kind, rows, width, blocks, loops, live)
            per_forward = max((many - one) / (loops - 1), 0.0)
            self._memo[key] = (max(one - per_forward, 0.0), per_forward)
        fixed, per_forward = self._memo[key]
        if not kv_only:
            return fixed + iterations * per_forward
        if key + ("kv",) not in self._memo:
            loops = self.LOOPS if fixed + per_forward < 0.05 else 3
            with_kv = self._measure(kind, rows, width, blocks, 1, live, kv_loops=loops)
            self._memo[key + ("kv",)] = max((with_kv - fixed - per_forward) / loops, 0.0)
        return fixed + (iterations - kv_only) * per_forward + kv_only * self._memo[key + ("kv",)]

    def _inputs(self, rows, width, blocks, live):
        """A bare call's inputs: random tokens, a table of distinct real pages, ``live`` pages of prefix per row,
        K/V written to the trash page."""
        B = self.B
        pages = self.pool[0][0].shape[1]
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, self.runner.cfg.vocab_size, (rows, blocks * B)).astype(np.int32)
        table = (np.arange(rows * width).reshape(rows, width) % max(pages - 1, 1) + 1).astype(np.int32)
        prefix = np.full((rows,), live * B, np.int32)
        write = np.zeros((rows, blocks), np.int32)  # the trash page
        return tokens, table, prefix, write

    def replay(self, calls):
        """The floor measured as the wall is: returns a function that runs the run's calls as bare calls, in the
        run's order, each waited for (as the engine waits for each denoise call), and returns the seconds it took.
        Inputs are placed on the device beforehand (a bare call transfers nothing), every shape is compiled here.
        Timed in passes alternating with the engine's (:func:`run_once`), fastest kept on both sides: the same
        statistic as the wall. The per-bucket floor (:meth:`seconds`, summed) adds up each bucket's fastest
        timing, a sum no real pass of many calls reaches on a machine whose timings spread."""
        import jax

        plan = []
        for c in calls:
            live = self.live_pages(c.rows, c.width, c.blocks, c.max_prefix_pages)
            run = functools.partial(self._bare, select=c.kind == "denoise")
            full = max(1, c.iterations - c.kv_only)  # a bare call runs at least one full forward
            args = (*self._inputs(c.rows, c.width, c.blocks, live), np.int32(full),
                    np.int32(c.iterations - full))
            plan.append((run, jax.device_put(args)))

        def one_pass() -> float:
            t0 = time.perf_counter()
            for run, args in plan:
                self.pool, out = run(self.runner.compute.view(self.runner.params), self.pool, *args)
                jax.block_until_ready(out)
            return time.perf_counter() - t0

        one_pass()  # compiles
        return one_pass

    def _measure(self, kind, rows, width, blocks, loops, live, min_time: float = 0.25, max_reps: int = 50,
                 kv_loops: int = 0):
        import jax

        tokens, table, prefix, write = self._inputs(rows, width, blocks, live)
        select = kind == "denoise"
        run = functools.partial(self._bare, loops=np.int32(loops), kv_loops=np.int32(kv_loops), select=select)
        self.pool, out = run(self.runner.compute.view(self.runner.params), self.pool, tokens, table, prefix, write)
        jax.block_until_ready(out)  # compile + first run
        t0 = time.perf_counter()
        self.pool, out = run(self.runner.compute.view(self.runner.params), self.pool, tokens, table, prefix, write)
        jax.block_until_ready(out)
        first = time.perf_counter() - t0
        min_reps = 5 if first < 0.05 else 3  # a call of a big bucket: three timings suffice
        times = [first]
        start = time.perf_counter()
        while len(times) < max_reps and (len(times) < min_reps or time.perf_counter() - start < min_time):
            t0 = time.perf_counter()
            self.pool, out = run(self.runner.compute.view(self.runner.params), self.pool, tokens, table, prefix, write)
            jax.block_until_ready(out)
            times.append(time.perf_counter() - t0)
        return min(times)  # the least contended timing, as the wall is the fastest of its passes


# ----------------------------------------------------------------------------------------------
# One run
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Workload:
    prompts: list[list[int]]
    params: dict
    concurrency: int


def _flops_fraction(calls, cfg, B) -> tuple[float, float]:
    """(padding share of the calls' FLOPs, page-table padding share of their attention FLOPs): per token the
    linear layers cost 2 x params, attention 4 x layers x q_size x (keys seen); the bucket pays for every row and
    every page of its width, the real work only for real rows and their real prefix."""
    linear = 2 * (cfg.num_layers * (cfg.hidden_size * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * cfg.hidden_size
                                    + 3 * cfg.hidden_size * max(cfg.intermediate_size, cfg.moe_intermediate_size))
                  + cfg.hidden_size * cfg.vocab_size)
    attn_per_key = 4 * cfg.num_layers * cfg.q_size
    paid = real = paid_attn = real_attn = 0.0
    for c in calls:
        tokens = c.blocks * B
        own = tokens  # keys of the chunk itself
        paid_c = c.rows * tokens * (linear + attn_per_key * (c.width * B + own))
        real_tokens = c.real_blocks * B if c.kind == "prefill" else c.real_rows * B
        real_c = real_tokens * linear + attn_per_key * tokens * (c.real_prefix_pages * B + c.real_rows * own)
        paid += c.iterations * paid_c
        real += c.iterations * real_c
        paid_attn += c.iterations * c.rows * tokens * attn_per_key * c.width * B
        real_attn += c.iterations * tokens * attn_per_key * c.real_prefix_pages * B
    return (1 - real / paid if paid else 0.0), (1 - real_attn / paid_attn if paid_attn else 0.0)


class _DevicePlayback:
    """Stands in for the runner's jitted functions (``denoise_packed``, ``prefill``): while recording it passes each
    call through and keeps its results; while playing back it answers the calls with them in order and computes
    nothing (the K/V pool passes through). A played-back run schedules exactly as the recorded one did (same
    requests, same outputs, an empty cache both times), so its wall is the host work of that run alone: the
    scheduler, the runner's packing and unpacking, the requests' API work, with no device call between them to
    evict the caches that work runs in."""

    def __init__(self):
        from dllm_jax.engine import runner

        self._runner = runner
        self._real = {"denoise_packed": runner.denoise_packed, "prefill": runner.prefill}
        self.calls: list[tuple[str, tuple, object]] = []  # (function, input shape, results)
        self._inputs: list = []  # each call's inputs as compared by `playing(verify=True)`
        self._args: list = []  # each call's own inputs, for device_seconds
        self._next = 0

    def device_seconds(self, runner, verify: bool = False) -> float:
        """The recorded run's device calls alone: each again, in order, on the runner's K/V pool, back to back (a
        denoise call waited for, as the engine waits for it; a prefill not), with no host work between them. The
        calls rewrite the pool as the run did (its cache was empty), so they compute what they computed then;
        ``verify`` checks that every denoise call's results are the recorded ones."""
        import jax

        kv = runner.kv_pages
        t0 = time.perf_counter()
        for i, ((name, _, recorded), (args, kwargs)) in enumerate(zip(self.calls, self._args)):
            out = self._real[name](runner.compute.view(runner.params), kv, *args, **kwargs)
            if name == "prefill":
                kv = out
                continue
            kv, results = out[0], out[1:]
            jax.block_until_ready(results)
            if verify and not all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
                                  zip(jax.tree.leaves(results), jax.tree.leaves(recorded))):
                raise RuntimeError(f"device replay: call {i} computed other results than the recorded run's")
        jax.block_until_ready(kv)
        seconds = time.perf_counter() - t0
        runner.kv_pages = kv
        return seconds

    @contextlib.contextmanager
    def recording(self):
        def make(name):
            def call(params, kv, *args, **kwargs):
                out = self._real[name](params, kv, *args, **kwargs)
                self.calls.append((name, args[0].shape, None if name == "prefill" else out[1:]))
                self._inputs.append(_comparable(args, kwargs))
                self._args.append((args, kwargs))
                return out
            return call
        with self._patched(make):
            yield

    @contextlib.contextmanager
    def playing(self, verify: bool):
        def make(name):
            def call(params, kv, *args, **kwargs):
                i, self._next = self._next, self._next + 1
                recorded, shape, out = self.calls[i] if i < len(self.calls) else (None, None, None)
                if recorded != name or args[0].shape != shape or (verify and not all(
                        np.array_equal(a, b) for a, b in zip(_comparable(args, kwargs), self._inputs[i]))):
                    # (the engine fails the call's requests and serves on; the run is refused when it ends)
                    mismatch.append(f"host replay: call {i} ({name}) is not the recorded run's")
                    raise RuntimeError(mismatch[-1])
                return kv if name == "prefill" else (kv, *out)
            return call
        self._next = 0
        mismatch: list[str] = []
        with self._patched(make):
            yield
        if mismatch:
            raise RuntimeError(mismatch[0])
        if self._next != len(self.calls):
            raise RuntimeError(f"host replay: {self._next} calls, the recorded run made {len(self.calls)}")

    @contextlib.contextmanager
    def _patched(self, make):
        for name in self._real:
            setattr(self._runner, name, make(name))
        try:
            yield
        finally:
            for name, fn in self._real.items():
                setattr(self._runner, name, fn)


def _comparable(args, kwargs) -> list[np.ndarray]:
    """A call's inputs as host arrays, a denoise call's sampling seeds blanked: a request draws its seed when it is
    made, and a greedy run (the bench's) never reads it."""
    out = [np.array(a) for a in args]
    if "layout" in kwargs:
        kwargs["layout"].view(out[0], "seed")[:] = 0
    return out


def _alone_seconds(engine, work: Workload, passes: int = 5) -> tuple[float, float]:
    """The run's host work alone and its device calls alone (see :class:`_DevicePlayback`): a recorded run, then
    ``passes`` of each, alternating (the first of each checks the replay against the recording), the fastest of
    each kept. Returns (host seconds, device seconds)."""
    from bench.common import run_requests

    playback = _DevicePlayback()
    engine.flush_cache()
    with playback.recording():
        run_requests(engine, work.prompts, work.params, work.concurrency)
    host, device = float("inf"), float("inf")
    for i in range(passes + 1):
        engine.flush_cache()
        with playback.playing(verify=i == 0):
            run = run_requests(engine, work.prompts, work.params, work.concurrency)
        seconds = playback.device_seconds(engine.runner, verify=i == 0)
        if i:
            host, device = min(host, run["wall_s"]), min(device, seconds)
    return host, device


def _api_seconds(engine, work: Workload, outputs: list[list[int]], passes: int = 5) -> float:
    """The run's per-request API work measured bare (fastest of ``passes``): validating and building each request
    (``make_request``) and detokenizing its answer, the Python any caller of the engine pays per request whatever
    the scheduler does. Part of the run's host time; what is left of it is the scheduler's and the runner's."""
    best = float("inf")
    for _ in range(passes):
        t0 = time.perf_counter()
        for ids in work.prompts:
            engine.make_request(list(ids), work.params)
        if engine.tokenizer is not None:
            for out in outputs:
                engine.output.decode(out)
        best = min(best, time.perf_counter() - t0)
    return best


def run_once(engine, work: Workload, bare: BareForward, repeats: int = 1) -> dict:
    """A warm-up pass (compiles every shape the measured pass uses), then ``repeats`` measured passes from the
    same state, each followed by a replay of its calls as bare calls (:meth:`BareForward.replay`); the fastest of
    each kept (a run of a few tens of milliseconds moves with the machine's load: alternating the two exposes both
    to the same drift)."""
    from bench.common import run_requests

    run_requests(engine, work.prompts, work.params, work.concurrency)
    best, replay_s, replay = None, float("inf"), None
    for _ in range(max(1, repeats)):
        engine.flush_cache()
        engine.runner.call_log = log = []
        with device_timer() as timings:
            run = run_requests(engine, work.prompts, work.params, work.concurrency)
        engine.runner.call_log = None
        if best is None or run["wall_s"] < best[0]["wall_s"]:
            best = run, log, timings
        replay = replay or bare.replay(log)  # the calls are the same in every pass (same requests, empty cache)
        replay_s = min(replay_s, replay())
    r, calls, dlog = best
    api_s = _api_seconds(engine, work, r["outputs"])
    host_alone_s, device_alone_s = _alone_seconds(engine, work, passes=5 if repeats > 1 else 1)
    B = engine.block_size
    floor = sum(bare.seconds(c.kind, c.rows, c.width, c.blocks, c.iterations, c.max_prefix_pages, c.kv_only)
                for c in calls)
    device = sum(t2 - t0 for _, t0, _, t2 in dlog)
    prefill_calls = [c for c in calls if c.kind == "prefill"]
    denoise_calls = [c for c in calls if c.kind == "denoise"]
    prefill_floor = sum(bare.seconds(c.kind, c.rows, c.width, c.blocks, 1, c.max_prefix_pages)
                        for c in prefill_calls)
    rows_paid = sum(c.iterations * c.rows for c in denoise_calls)
    rows_real = sum(c.iterations * c.real_rows for c in denoise_calls)
    refresh = sum(c.refresh_rows for c in denoise_calls)
    width_paid = sum(c.iterations * c.rows * c.width for c in denoise_calls)
    width_real = sum(c.iterations * c.real_prefix_pages for c in denoise_calls)
    flops_pad, attn_pad = _flops_fraction(calls, engine.runner.cfg, B)
    wall = r["wall_s"]
    return {
        "requests": r["requests"], "concurrency": work.concurrency, "wall_s": wall, "floor_s": floor,
        "wall_over_floor": wall / floor if floor else float("nan"),
        "replay_floor_s": replay_s, "wall_over_replay": wall / replay_s if replay_s else float("nan"),
        "host_s": wall - device, "host_frac": (wall - device) / wall,
        "host_ms_per_request": 1e3 * (wall - device) / r["requests"],
        "api_ms_per_request": 1e3 * api_s / r["requests"],
        "host_alone_ms_per_request": 1e3 * host_alone_s / r["requests"],
        "device_alone_s": device_alone_s, "device_alone_over_floor": device_alone_s / floor if floor else float("nan"),
        "alone_over_floor": (host_alone_s + device_alone_s) / floor if floor else float("nan"),
        "device_s": device, "device_over_floor_s": device - floor,
        "device_over_floor": device / floor if floor else float("nan"),
        "prefill_calls": len(prefill_calls), "prefill_floor_s": prefill_floor,
        "denoise_calls": len(denoise_calls), "forwards": sum(c.iterations for c in calls),
        "kv_only_forwards": sum(c.kv_only for c in calls),
        "padding_rows_frac": 1 - rows_real / rows_paid if rows_paid else 0.0,
        "padding_width_frac": 1 - width_real / width_paid if width_paid else 0.0,
        "padding_flops_frac": flops_pad, "padding_attention_flops_frac": attn_pad,
        "refresh_rows": refresh, "refresh_rows_frac": refresh / rows_real if rows_real else 0.0,
        "output_tokens": r["output_tokens"], "tokens_per_s": r["tokens_per_s"],
        "tokens_per_forward": r["output_tokens"] / max(r["forward_passes"], 1),
        "tokens_per_call": r["output_tokens"] / max(len(calls), 1),
        "buckets": sorted({(c.kind, c.rows, c.width, c.blocks) for c in calls}),
        "recompiles": r["recompiles"],
    }


# ----------------------------------------------------------------------------------------------
# The scenario
# ----------------------------------------------------------------------------------------------

def _workload(ctx: Ctx, m: ModelInfo, concurrency: int) -> Workload:
    n = max(2 * concurrency, 8) if not ctx.quick else max(concurrency, 4)
    if not m.random and not ctx.quick:
        n *= 2  # the trained model's runs last tens of milliseconds: twice the requests steady them
    if m.random:
        prompts = hard_prompts(m.tokenizer, n, ctx.seed)
        max_new = ctx.overrides.get("max_new_tokens") or (32 if m.name == "random50m" else 64)
    else:
        prompts = chat_prompts(m.tokenizer, n)
        max_new = ctx.overrides.get("max_new_tokens") or 128
    return Workload(prompts, {"max_new_tokens": max_new, "temperature": 0.0, **m.gen_params}, concurrency)


def efficiency(ctx: Ctx) -> dict:
    from bench.scenarios import _models, finish

    levels = ctx.overrides.get("efficiency_concurrency") or ([1, 16] if ctx.quick else [1, 16, 64])
    schedules = ("fdfo", "sync")
    out, rows = {"models": {}}, []
    for name in _models(ctx, "efficiency_models", ["shipped", "random50m"], ["shipped"]):
        m = ctx.model(name)
        res = out["models"][name] = {"model": m.label, "runs": {}}
        for schedule in schedules:
            for level in levels:
                work = _workload(ctx, m, level)
                longest = max(len(p) for p in work.prompts) + work.params["max_new_tokens"] + 64
                engine = make_engine(m, ctx, schedule=schedule, max_running_requests=level,
                                     context_length=int(-(-longest // 32) * 32),
                                     num_kv_pages=kv_pages_for(work.prompts, work.params["max_new_tokens"], level))
                try:
                    bare = BareForward(engine)
                    r = run_once(engine, work, bare, repeats=1 if m.random else 9)
                finally:
                    engine.shutdown()
                res["runs"][f"{schedule}/{level}"] = r
                rows.append([name, schedule, level, r["wall_s"], r["floor_s"], r["wall_over_floor"],
                             r["replay_floor_s"], r["wall_over_replay"],
                             100 * r["host_frac"], r["host_ms_per_request"], r["host_alone_ms_per_request"],
                             r["api_ms_per_request"],
                             r["device_over_floor"], r["device_alone_over_floor"], r["alone_over_floor"],
                             r["device_over_floor_s"], r["prefill_calls"],
                             100 * r["padding_rows_frac"], 100 * r["padding_flops_frac"],
                             100 * r["padding_width_frac"], 100 * r["refresh_rows_frac"],
                             100 * r["kv_only_forwards"] / max(r["forwards"], 1), r["tokens_per_forward"],
                             r["tokens_per_s"]])
                ctx.log(f"efficiency {name} {schedule} x{level}: wall {r['wall_s']:.2f} s, floor {r['floor_s']:.2f} s "
                        f"({r['wall_over_floor']:.2f}x)")
                target = TARGET_SINGLE if level == 1 else TARGET_CONCURRENT
                ctx.target(f"efficiency [{name}, {schedule}, {level} concurrent]: wall / floor",
                           r["wall_over_floor"], target, higher_is_better=False,
                           note=f"device / floor {r['device_over_floor']:.2f}, host {100 * r['host_frac']:.0f}% "
                                f"({r['host_ms_per_request']:.2f} ms a request; alone "
                                f"{r['host_alone_ms_per_request']:.2f}), host + device alone / floor "
                                f"{r['alone_over_floor']:.2f}, padding rows "
                                f"{100 * r['padding_rows_frac']:.0f}%",
                           command=f"{ctx.command} efficiency")
    text = table("efficiency: wall vs the bare forwards of the same calls (floor); where the rest goes",
                 ["model", "schedule", "requests", "wall s", "floor s", "wall/floor", "replay s", "wall/replay",
                  "host %", "host ms/req", "host alone ms/req", "api ms/req", "device/floor",
                  "device alone/floor", "alone/floor", "algo+sync s",
                  "prefill calls", "pad rows %", "pad FLOPs %", "pad width %", "refresh %", "K/V-only fwd %",
                  "tok/fwd", "tok/s"],
                 rows)

    def plot(path):
        panels = []
        for name, res in out["models"].items():
            labels = list(res["runs"])
            panels.append((f"{name}: wall / floor", labels, [res["runs"][k]["wall_over_floor"] for k in labels]))
            panels.append((f"{name}: padding FLOPs %", labels,
                           [100 * res["runs"][k]["padding_flops_frac"] for k in labels]))
        return plots.bars(path, "efficiency", panels)

    return finish(ctx, "efficiency", out, text, plot)
