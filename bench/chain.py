"""``python -m bench chain``: FDFO block chaining on and off, side by side in one run.

Two engines on the same model (``chain_blocks=0`` and the default), each driven by the closed loop at 1, 2, 4 and
16 concurrent requests, passes alternating between them so both see the same drift of the machine; the fastest pass
of each is kept (the same statistic as the efficiency scenario's wall). Chaining runs only in calls of at most
``CHAIN_MAX_ROWS`` decoding rows, so the 4- and 16-request rows also run the engine's real policy (the ``forced``
column runs chaining at every batch size, the figure that set the threshold). Reported: wall, device calls,
forwards, whether the tokens are identical.
"""

from __future__ import annotations

from bench import plots
from bench.common import Ctx, chat_prompts, kv_pages_for, make_engine, run_requests, table
from bench.scenarios import finish, max_new_tokens, sampling

LEVELS = (1, 2, 4, 16)


def chain(ctx: Ctx) -> dict:
    from dllm_jax.engine import mask_blocks  # its CHAIN_MAX_ROWS decides which calls chain

    m = ctx.model("shipped")
    passes = ctx.size("chain_passes", 7, 2)
    max_new = max_new_tokens(ctx, m)
    params = sampling(m, max_new)
    rows, out = [], {"model": m.label, "max_new_tokens": max_new, "levels": {}}
    default_max_rows = mask_blocks.CHAIN_MAX_ROWS
    for level in LEVELS:
        prompts = chat_prompts(m.tokenizer, max(level, 16))
        kw = dict(schedule="fdfo", max_running_requests=level, context_length=512,
                  num_kv_pages=kv_pages_for(prompts, max_new, level))
        engines = {"off": make_engine(m, ctx, chain_blocks=0, **kw), "on": make_engine(m, ctx, **kw),
                   "forced": make_engine(m, ctx, **kw)}
        # forced: every row bucket compiles the chaining step (the runner's default: only the buckets of calls of at
        # most CHAIN_MAX_ROWS rows); the scheduler's threshold is lifted per pass below
        forced = engines["forced"].runner
        forced.chain_rows = frozenset(forced.row_buckets)
        best: dict = {}
        try:
            for _ in range(passes + 1):  # the first pass compiles and is thrown away
                for name, engine in engines.items():
                    mask_blocks.CHAIN_MAX_ROWS = 1 << 30 if name == "forced" else default_max_rows
                    run = run_requests(engine, prompts, params, level)
                    if name in best and (best[name] is None or run["wall_s"] < best[name]["wall_s"]):
                        best[name] = run
                    best.setdefault(name, None)
        finally:
            mask_blocks.CHAIN_MAX_ROWS = default_max_rows
            for engine in engines.values():
                engine.shutdown()
        off = best["off"]
        res = {}
        for name, run in best.items():
            res[name] = {"wall_s": run["wall_s"], "device_calls": run["device_calls"],
                         "forward_passes": run["forward_passes"], "vs_off": run["wall_s"] / off["wall_s"],
                         "identical": run["outputs"] == off["outputs"]}
            rows.append([level, name, run["wall_s"], run["device_calls"], run["forward_passes"],
                         run["wall_s"] / off["wall_s"], res[name]["identical"]])
        out["levels"][level] = res
    text = table(f"chain: FDFO block chaining off / on (policy: at most {default_max_rows} rows) / forced at every "
                 f"batch size; {m.label}, fastest of {passes} alternating passes",
                 ["requests", "chaining", "wall s", "device calls", "forwards", "wall / off", "identical"], rows)

    def plot(path):
        return plots.bars(path, "chain", [("wall / off", [f"{r[0]} {r[1]}" for r in rows], [r[5] for r in rows])])

    return finish(ctx, "chain", out, text, plot)
