"""``python -m bench prefill``: time to first block of one prompt against the bare forwards it needs (issue 16,
item 3).

For each prompt length (128 ... 4k tokens, random task words; shipped model and random50m), one request of one
block (``max_new_tokens`` = the rest of the prompt's last block, or one whole block) runs alone on two engines:

* ``multi``: the default multi-block prefill (up to ``max_prefill_tokens`` = 2048 tokens per forward);
* ``single``: block by block (``max_prefill_tokens = B``: one block per prefill forward).

The **floor** is the bare device work the request needs, timed on the same model in the same process with the
engine's own jitted forward (K/V write included) at exact shapes (no bucket padding): *one* prefill forward over
the prompt's complete blocks (the whole prompt in one call, whatever the prefill budget) plus the first block's
denoise forwards (+ the confidence selection), as many as the engine ran, back to back in one call (as the
engine's device loop runs them) at the block's exact prefix.

**Prefix reuse**: a 1k-token shared prompt (random words) + a distinct user turn (a held-out chat prompt). The
shared prompt is left in the cache by an earlier request; the measured request matches it and prefills only its
uncached tail. Its floor: the bare prefill of that tail (against the cached prefix) plus the first block's
forwards. The same request on a cache-off engine gives the time to first block without reuse.

Every figure is the best of ``--prefill-repeats`` passes (more for short prompts, up to 8x within ~2 s), the
configurations alternating within each pass (a shared machine's load comes and goes), after a warm-up pass that
compiles every shape. Targets: multi <= single at every length; multi <= 1.2x its floor; with the prefix cached
<= 1.2x its floor.
"""

from __future__ import annotations

import time

import numpy as np

from bench.common import BLOCK_SIZE, Ctx, chat_prompts, make_engine, table, word_ids

TARGET_FLOOR = 1.2
DEFAULT_LENGTHS = [128, 256, 512, 1024, 1056, 2048, 3072, 4096]
QUICK_LENGTHS = [128, 512, 2048]
SHARED_TOKENS = 1024


class Floors:
    """Bare device work on one engine's model at exact shapes (no bucket padding), with the engine's own jitted
    forward (:func:`dllm_jax.decode.step._model_forward`), each in one call:

    * ``prefill``: one row of ``blocks`` blocks after ``prefix_pages`` cached pages, K/V written and returned
      (nothing else: as in the engine's prefill, XLA drops the last layer's attention output and MLP, which no
      K/V depends on);
    * ``block``: ``n`` denoise forwards + confidence selections of one block after ``prefix_pages`` pages, back
      to back on the device (a ``fori_loop``, each forward fed the previous one's tokens), as the engine's device
      loop runs a block: no host round trip, no algorithm.

    :meth:`sample` times one call and keeps the fastest."""

    def __init__(self, engine):
        import functools

        import jax
        import jax.numpy as jnp

        from bench.common import bare_forward, scratch_pool

        runner = engine.runner
        self.params = runner.params
        self.B = engine.block_size
        self.vocab = runner.cfg.vocab_size
        self.best: dict[tuple, float] = {}
        self.pool = scratch_pool(runner)
        forward = bare_forward(runner.greedy_spec)

        @functools.partial(jax.jit, donate_argnums=(1,))
        def prefill(params, kv, tokens, table, prefix, write):
            return forward(params, kv, tokens, table, prefix, write, False)[0]

        @functools.partial(jax.jit, donate_argnums=(1,))
        def block(params, kv, tokens, table, prefix, write, n):
            def body(_, carry):
                kv, tokens = carry
                kv, (arg, p) = forward(params, kv, tokens, table, prefix, write, True)
                # never true (p <= 1), but the next forward depends on this one: nothing is hoisted out
                return kv, jnp.where(p > 2.0, arg, tokens)

            return jax.lax.fori_loop(0, n, body, (kv, tokens))

        self._prefill, self._block = prefill, block

    def _args(self, blocks: int, prefix_pages: int):
        pages = self.pool[0][0].shape[1]
        rng = np.random.default_rng(blocks * 7919 + prefix_pages)
        tokens = rng.integers(0, self.vocab, (1, blocks * self.B)).astype(np.int32)
        width = max(1, prefix_pages)
        table = (np.arange(width) % max(pages - 1, 1) + 1).astype(np.int32)[None]
        prefix = np.asarray([prefix_pages * self.B], np.int32)
        # Distinct pages, as the engine writes: a scatter of many blocks into one page (the trash page) takes
        # XLA:CPU's slow path for duplicate indices.
        write = (np.arange(blocks) % max(pages - 1, 1) + 1).astype(np.int32)[None]
        return tokens, table, prefix, write

    def _call(self, kind: str, blocks: int, prefix_pages: int, n: int):
        import jax

        args = self._args(blocks, prefix_pages)
        if kind == "prefill":
            self.pool = self._prefill(self.params, self.pool, *args)
        else:
            self.pool, _ = self._block(self.params, self.pool, *args, np.int32(n))
        jax.block_until_ready(self.pool)

    def sample(self, kind: str, blocks: int, prefix_pages: int, n: int = 1) -> float:
        key = (kind, blocks, prefix_pages, n)
        if key not in self.best:  # compile and a first run
            self._call(kind, blocks, prefix_pages, n)
            self.best[key] = float("inf")
        t0 = time.perf_counter()
        self._call(kind, blocks, prefix_pages, n)
        self.best[key] = min(self.best[key], time.perf_counter() - t0)
        return self.best[key]

    def seconds(self, kind: str, blocks: int, prefix_pages: int, n: int = 1) -> float:
        return self.best[(kind, blocks, prefix_pages, n)]


def _one_request(engine, prompt: list[int], params: dict) -> dict:
    """Run one request alone; its time to first block, forwards and the prefill forwards it took."""
    prefills0 = engine.get_load().get("prefill_forwards", 0)
    req = engine.submit(engine.make_request(list(prompt), params))
    while not req.finished:
        engine.step()
    r = engine.result(req)
    meta = r["meta_info"]
    prefills = engine.get_load().get("prefill_forwards", 0) - prefills0
    return {"ttfb_s": meta["time_to_first_block"], "forwards": meta["forward_passes"], "prefill_calls": prefills,
            "cached_tokens": meta["cached_tokens"], "output_ids": r["output_ids"]}


def _block_params(m, prompt_len: int) -> dict:
    """One block: the rest of the prompt's last block (a whole block when the prompt ends on a boundary)."""
    B = BLOCK_SIZE
    return {"max_new_tokens": B - prompt_len % B, "temperature": 0.0, **m.gen_params}


def _floor(floors: Floors, prompt_len: int, cached: int, block_forwards: int, sample: bool) -> dict:
    """The bare work of one request: prefill of its uncached complete blocks after ``cached`` tokens, then
    ``block_forwards`` denoise forwards of its first block."""
    B = BLOCK_SIZE
    complete = prompt_len // B
    cached_pages = cached // B
    pre = 0.0
    if complete > cached_pages:
        fn = floors.sample if sample else floors.seconds
        pre = fn("prefill", complete - cached_pages, cached_pages)
    fn = floors.sample if sample else floors.seconds
    block = fn("block", 1, complete, block_forwards)
    return {"prefill_s": pre, "block_s": block, "total_s": pre + block}


def _lengths_for(ctx: Ctx, name: str) -> list[int]:
    return list(ctx.size("prefill_tokens", DEFAULT_LENGTHS, QUICK_LENGTHS))


def prefill(ctx: Ctx) -> dict:
    from bench.scenarios import _models, finish

    reps = ctx.size("prefill_repeats", 3, 2)
    B = BLOCK_SIZE
    out: dict = {"models": {}, "repeats": reps}
    rows, reuse_rows = [], []
    for name in _models(ctx, "prefill_models", ["shipped", "random50m"], ["shipped"]):
        m = ctx.model(name)
        lengths = _lengths_for(ctx, name)
        res = out["models"][name] = {"model": m.label, "lengths": {}}
        longest = max(max(lengths), SHARED_TOKENS + 256)
        context = int(np.ceil((longest + 3 * B) / 256) * 256)
        pages = context // B + 2 * (SHARED_TOKENS // B) + 16
        engines = {
            "multi": make_engine(m, ctx, context_length=context, enable_prefix_cache=False, max_running_requests=1,
                                 num_kv_pages=pages),
            "single": make_engine(m, ctx, context_length=context, enable_prefix_cache=False,
                                  max_running_requests=1, num_kv_pages=pages, max_prefill_tokens=B),
            "reuse": make_engine(m, ctx, context_length=context, enable_prefix_cache=True, max_running_requests=1,
                                 num_kv_pages=pages),
        }
        try:
            floors = Floors(engines["multi"])
            # ---- prompt lengths: multi vs single vs the floor ----
            for length in lengths:
                prompt = word_ids(m.tokenizer, length, seed=ctx.seed + length)
                params = _block_params(m, length)
                ctx.log(f"prefill: {m.label}: {length}-token prompt, multi-block vs block-by-block ...")
                warm = {k: _one_request(engines[k], prompt, params) for k in ("multi", "single")}
                block_forwards = warm["multi"]["forwards"] - warm["multi"]["prefill_calls"]
                _floor(floors, length, 0, block_forwards, sample=True)  # compiles the floors' shapes
                best = {k: None for k in ("multi", "single")}
                passes, t0 = 0, time.perf_counter()
                # at least ``reps`` passes; short prompts get more (up to 8x) within ~2 s: their TTFB is a few ms
                while passes < reps or (passes < 8 * reps and time.perf_counter() - t0 < 2.0):
                    passes += 1
                    for k in ("multi", "single"):
                        r = _one_request(engines[k], prompt, params)
                        if best[k] is None or r["ttfb_s"] < best[k]["ttfb_s"]:
                            best[k] = r
                    _floor(floors, length, 0, block_forwards, sample=True)
                floor = _floor(floors, length, 0, block_forwards, sample=False)
                ctx.log(f"prefill: {length} tokens: {passes} passes")
                multi, single = best["multi"], best["single"]
                entry = {
                    "multi_ttfb_s": multi["ttfb_s"], "single_ttfb_s": single["ttfb_s"],
                    "single_over_multi": single["ttfb_s"] / multi["ttfb_s"],
                    "floor_s": floor["total_s"], "floor_prefill_s": floor["prefill_s"],
                    "floor_block_s": floor["block_s"], "block_forwards": block_forwards,
                    "multi_over_floor": multi["ttfb_s"] / floor["total_s"],
                    "single_over_floor": single["ttfb_s"] / floor["total_s"],
                    "prefill_calls_multi": multi["prefill_calls"], "prefill_calls_single": single["prefill_calls"],
                    "identical": multi["output_ids"] == single["output_ids"],
                    "outputs": multi["output_ids"], "passes": passes,
                }
                res["lengths"][length] = entry
                rows.append([name, length, 1e3 * entry["multi_ttfb_s"], 1e3 * entry["single_ttfb_s"],
                             entry["single_over_multi"], 1e3 * floor["prefill_s"], block_forwards,
                             1e3 * floor["block_s"], entry["multi_over_floor"],
                             f"{multi['prefill_calls']}/{single['prefill_calls']}", entry["identical"]])
            worst_speed = min(e["single_over_multi"] for e in res["lengths"].values())
            worst_floor = max(e["multi_over_floor"] for e in res["lengths"].values())
            at = {e["single_over_multi"]: n for n, e in res["lengths"].items()}[worst_speed]
            at_floor = {e["multi_over_floor"]: n for n, e in res["lengths"].items()}[worst_floor]
            same = all(e["identical"] for e in res["lengths"].values())
            ctx.target(f"prefill [{name}, {lengths[0]}-{lengths[-1]} tokens]: TTFB block-by-block / multi-block "
                       f"(worst length)", worst_speed, 1.0,
                       note=f"{m.label}; worst at {at} tokens; outputs identical multi / single: "
                            f"{'all' if same else 'NOT all'} lengths", command=f"{ctx.command} prefill")
            ctx.target(f"prefill [{name}]: TTFB multi-block / floor (bare prefill forward + first block's forwards, "
                       f"worst length)", worst_floor, TARGET_FLOOR, higher_is_better=False,
                       note=f"{m.label}; worst at {at_floor} tokens", command=f"{ctx.command} prefill")

            # ---- prefix reuse: a 1k-token shared prompt cached, a distinct user turn ----
            shared = word_ids(m.tokenizer, SHARED_TOKENS, seed=ctx.seed + 1)
            users = chat_prompts(m.tokenizer, 2)
            primer, prompt = shared + users[0], shared + users[1]
            params = _block_params(m, len(prompt))
            ctx.log(f"prefill: {m.label}: {SHARED_TOKENS}-token shared prefix cached + a {len(users[1])}-token "
                    f"user turn ...")

            def reuse_pass():
                engine = engines["reuse"]
                if not engine.flush_cache():
                    raise RuntimeError("flush_cache refused: requests are still in the engine")
                _one_request(engine, primer, _block_params(m, len(primer)))
                return _one_request(engine, prompt, params)

            warm = reuse_pass()
            warm_off = _one_request(engines["multi"], prompt, params)
            cached = warm["cached_tokens"]
            block_forwards = warm["forwards"] - warm["prefill_calls"]
            block_forwards_off = warm_off["forwards"] - warm_off["prefill_calls"]
            for _ in range(2):
                _floor(floors, len(prompt), cached, block_forwards, sample=True)
                _floor(floors, len(prompt), 0, block_forwards_off, sample=True)
            best_on = best_off = None
            passes, t0 = 0, time.perf_counter()
            while passes < reps or (passes < 8 * reps and time.perf_counter() - t0 < 2.0):
                passes += 1
                r = reuse_pass()
                best_on = r if best_on is None or r["ttfb_s"] < best_on["ttfb_s"] else best_on
                r = _one_request(engines["multi"], prompt, params)
                best_off = r if best_off is None or r["ttfb_s"] < best_off["ttfb_s"] else best_off
                _floor(floors, len(prompt), cached, block_forwards, sample=True)
                _floor(floors, len(prompt), 0, block_forwards_off, sample=True)
            floor_on = _floor(floors, len(prompt), cached, block_forwards, sample=False)
            floor_off = _floor(floors, len(prompt), 0, block_forwards_off, sample=False)
            reuse = {
                "shared_tokens": SHARED_TOKENS, "prompt_tokens": len(prompt), "cached_tokens": cached,
                "ttfb_on_s": best_on["ttfb_s"], "ttfb_off_s": best_off["ttfb_s"],
                "ttfb_gain": best_off["ttfb_s"] / best_on["ttfb_s"],
                "floor_on_s": floor_on["total_s"], "floor_on_prefill_s": floor_on["prefill_s"],
                "floor_on_block_s": floor_on["block_s"], "floor_off_s": floor_off["total_s"],
                "on_over_floor": best_on["ttfb_s"] / floor_on["total_s"],
                "ideal_ttfb_gain": floor_off["total_s"] / floor_on["total_s"],
                "block_forwards": block_forwards, "identical": best_on["output_ids"] == best_off["output_ids"],
                "passes": passes,
            }
            res["prefix_reuse"] = reuse
            reuse_rows.append([name, len(prompt), cached, 1e3 * reuse["ttfb_on_s"], 1e3 * floor_on["prefill_s"],
                               block_forwards, 1e3 * floor_on["block_s"], reuse["on_over_floor"],
                               1e3 * reuse["ttfb_off_s"], reuse["ttfb_gain"], reuse["ideal_ttfb_gain"],
                               reuse["identical"]])
            ctx.target(f"prefill [{name}, {SHARED_TOKENS}-token prefix cached]: TTFB / floor (bare prefill of the "
                       f"uncached tail + first block's forwards)", reuse["on_over_floor"], TARGET_FLOOR,
                       higher_is_better=False,
                       note=f"{m.label}; TTFB {reuse['ttfb_gain']:.2f}x better than without the cache (ideal "
                            f"{reuse['ideal_ttfb_gain']:.2f}x); outputs identical on/off: {reuse['identical']}",
                       command=f"{ctx.command} prefill")
        finally:
            for e in engines.values():
                e.shutdown()
    text = table("prefill: time to first block of one prompt (ms; best of each); floor = the bare prefill forward "
                 "of the whole prompt + the first block's forwards (engine's jitted forward, exact shapes)",
                 ["model", "prompt tok", "multi", "block-by-block", "bbb/multi", "floor prefill", "block fwds",
                  "floor block", "multi/floor", "prefill calls m/b", "identical"], rows)
    text += "\n\n" + table(f"prefix reuse: {SHARED_TOKENS}-token shared prompt cached + a user turn (ms); floor = bare "
                           "prefill of the uncached tail + the first block's forwards",
                           ["model", "prompt tok", "cached", "TTFB", "floor prefill", "block fwds", "floor block",
                            "TTFB/floor", "TTFB no cache", "gain", "ideal gain", "identical"], reuse_rows)

    def plot(path):
        from bench import plots

        series = {}
        for name, res in out["models"].items():
            lens = sorted(res["lengths"])
            for key, label in (("multi_ttfb_s", "multi-block"), ("single_ttfb_s", "block-by-block"),
                               ("floor_s", "floor")):
                series[f"{name} {label}"] = (lens, [1e3 * res["lengths"][x][key] for x in lens])
        return plots.lines(path, "prefill: time to first block", [("prompt tokens", "ms", series)], logx=True)

    return finish(ctx, "prefill", out, text, plot)
