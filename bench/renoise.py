"""DiffusionGemma (Gemma4Renoise): the engine beside transformers' ``generate`` at the real vocabulary (262,144)
and canvas (256) on CPU, its peak memory as requests grow, and the fused vocabulary pass's memory at the published
shape.

    python -m bench.renoise [--out bench_out]            # about 30 minutes on 2 busy cores
    python -m bench.renoise --smoke                      # tiny vocabulary and canvas: checks the script

* ``speed``: a random checkpoint written by transformers (real vocabulary and canvas; a small decoder: ``--hidden``,
  ``--layers``), ``--levels`` requests of ``--prompt-len`` tokens, one canvas each (``max_new_tokens`` = canvas,
  ``ignore_eos``), ``--steps`` denoising steps (a random model never stops a canvas early: both sides run every
  step; their own forward counts are reported). Each side runs in a process of its own (``bench.renoise_side``):
  the engine (``max_running_requests`` = the requests; the row ``1 request, N slots`` serves one request with the
  slots of the most requests) and transformers (one ``generate`` call per request, torch on every core; batched,
  its ``[canvas x vocab]`` arrays multiply by the batch). Each process warms up on its own shapes, then times
  ``--reps`` repetitions; the sides alternate, ``--rounds`` times, and each figure is the fastest repetition of all
  (the machine is shared: the fastest is the least disturbed). Peak RSS is each process's ``VmHWM``: over its
  whole life (loading, compiling, serving) and over the timed repetitions alone.
* ``growth``: the engine's resident memory while serving 1, 2, 4, ... requests (a process per level, each with
  that many slots and a KV pool of exactly the pages they use), beside what it should be: the process after its
  imports + the weights + both KV pools + the per-slot state (``[canvas x hidden]``) + the denoise executable's
  scratch (XLA's ``memory_analysis``) + a fixed remainder (runtime, compiled code: the first level's difference,
  carried to the others). Growth beyond that model is flagged, as is any array of the denoise executable with a
  vocabulary and a canvas dimension (its HLO read back).
* ``fused``: XLA's accounting (``compile().memory_analysis()``, CPU, nothing run) of one step's vocabulary pass at
  the published shape (vocabulary 262,144, hidden 2,816, canvas 256, bf16), materialised (logits, probabilities:
  what transformers computes) vs streaming, and how many canvases an 80 GB device holds after the weights.

Prints the tables and writes ``renoise.json`` (``bench.common.write_json``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from bench.common import table, write_json

GB, GIB, MIB = 10 ** 9, 1 << 30, 1 << 20
PUBLISHED = dict(vocab=262144, hidden=2816, canvas=256)
WEIGHTS_BYTES = 47 * GIB  # dllm-jax plan --preset diffusiongemma-26b-a4b, TP 1, bf16
RESERVE = 4 * GIB
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE = dict(vocab=512, canvas=16, hidden=32, layers=2, window=16, levels=[1, 2], growth=[1, 2], rounds=1,
             steps=2, engine_reps=2, hf_reps=1, prompt_len=8, slots_row=False)


def memory(rows=(1, 8)) -> dict:
    """The ``fused`` part (module doc)."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels import renoise as R

    V, H, C = PUBLISHED["vocab"], PUBLISHED["hidden"], PUBLISHED["canvas"]
    out = {}
    for r in rows:
        n = r * C
        args = (jax.ShapeDtypeStruct((n, H), jnp.bfloat16), jax.ShapeDtypeStruct((V, H), jnp.bfloat16),
                jax.ShapeDtypeStruct((V, H), jnp.bfloat16), jax.ShapeDtypeStruct((n,), jnp.float32),
                jax.ShapeDtypeStruct((n,), jnp.uint32))
        for name, fn in (("materialised", R.renoise_stats_reference), ("streaming", R.renoise_stats_streaming)):
            f = jax.jit(lambda *a, fn=fn: fn(*a, softcap=30.0, vocab_major=True, embed_scale=H ** 0.5))
            stats = f.lower(*args).compile().memory_analysis()
            out.setdefault(name, {})[r] = int(stats.temp_size_in_bytes + stats.output_size_in_bytes)
    # per running row: the growth from the fewest to the most rows (the rest is fixed per process: on XLA:CPU the
    # float32 copies of the bf16 head / embedding it hoists out of the loop, which a GPU's bf16 matmuls do not make)
    lo, hi = min(rows), max(rows)
    per_row = {k: (v[hi] - v[lo]) / (hi - lo) for k, v in out.items()}
    fixed = {k: v[lo] - lo * per_row[k] for k, v in out.items()}
    # between steps: transformers keeps the processed logits (bf16 [C, V]); ours the soft embedding (bf16 [C, H])
    state = {"materialised": C * V * 2, "streaming": C * H * 2}
    free = 80 * GB - WEIGHTS_BYTES - RESERVE
    fits = {k: int(free // (per_row[k] + state[k])) for k in per_row}
    return {"step_bytes": out, "step_bytes_per_row": per_row, "step_bytes_fixed": fixed, "state_bytes_per_row": state,
            "canvases_at_80GB": fits, "free_bytes_for_rows": free}


def side(a, kind: str, requests: int, *, slots: int | None = None, reps: int) -> dict:
    """One ``bench.renoise_side`` process; its RESULT line."""
    cmd = [sys.executable, "-m", "bench.renoise_side", "--side", kind, "--model", a.model, "--requests",
           str(requests), "--vocab", str(a.vocab), "--canvas", str(a.canvas), "--prompt-len", str(a.prompt_len),
           "--steps", str(a.steps), "--reps", str(reps)]
    cmd += ["--slots", str(slots)] if slots else []
    cmd += ["--hf-batch", str(a.hf_batch)] if kind == "hf" else []
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=a.timeout)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        raise RuntimeError(f"{' '.join(cmd[2:])} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    out = json.loads(line[len("RESULT "):])
    out["process_s"] = time.perf_counter() - t0
    print(f"  {kind:6s} {requests:2d} requests{f' ({slots} slots)' if slots else ''}: fastest "
          f"{min(out['walls']):.2f} s of {len(out['walls'])}, serving peak "
          f"{(out['serving_peak_rss'] or 0) / GIB:.2f} GiB, process {out['process_s']:.0f} s", flush=True)
    return out


def speed(a) -> dict:
    runs: dict = {}
    top = max(a.levels)
    for r in range(a.rounds):
        for n in a.levels:
            order = ("engine", "hf") if (r + n) % 2 == 0 else ("hf", "engine")  # alternate who goes first
            for kind in order:
                reps = a.engine_reps if kind == "engine" else a.hf_reps
                runs.setdefault((kind, n, None), []).append(side(a, kind, n, reps=reps))
        if top > 1 and a.slots_row:
            runs.setdefault(("engine", 1, top), []).append(side(a, "engine", 1, slots=top, reps=a.engine_reps))
    rows = []
    for (kind, n, slots), procs in runs.items():
        walls = [w for p in procs for w in p["walls"]]
        best = min(walls)
        p = procs[0]
        rows.append(dict(side=kind, requests=n, slots=slots, fastest_s=best, walls=walls, tokens=p["tokens"],
                         tok_s=p["tokens"] / best, forwards=p["forwards"], steps_per_canvas=p["forwards"] / n,
                         ms_per_canvas_step=1e3 * best / max(p["forwards"], 1),
                         peak_rss=max(q["peak_rss"] for q in procs),
                         serving_peak_rss=max(q["serving_peak_rss"] or q["peak_rss"] for q in procs),
                         imports_rss=min(q["imports_rss"] for q in procs), processes=len(procs)))
    by = {(r["side"], r["requests"], r["slots"]): r for r in rows}
    for n in a.levels:
        e, h = by.get(("engine", n, None)), by.get(("hf", n, None))
        if e and h:
            e["speedup"] = e["tok_s"] / h["tok_s"]
            e["rss_ratio"] = h["peak_rss"] / e["peak_rss"]
    return {"rows": rows, "processes": {f"{k}|{n}|{s}": v for (k, n, s), v in runs.items()}}


def growth(a, reuse: dict) -> dict:
    levels = []
    for n in a.growth:
        procs = reuse.get(f"engine|{n}|None")
        levels.append(procs[0] if procs else side(a, "engine", n, reps=1))
    first = levels[0]

    def modeled(p):
        m = p["model"]
        return p["imports_rss"] + m["weights"] + m["kv_pools"] + m["state"] + m["denoise_scratch"]

    fixed = first["serving_peak_rss"] - modeled(first)
    rows = []
    for p in levels:
        expect = modeled(p) + fixed
        excess = p["serving_peak_rss"] - expect
        grown = modeled(p) - modeled(first)
        tolerance = max(48 * MIB, 0.1 * grown)
        rows.append(dict(requests=p["requests"], serving_peak_rss=p["serving_peak_rss"], peak_rss=p["peak_rss"],
                         model_rss=expect, excess=excess, flagged=bool(excess > tolerance),
                         canvas_vocab_arrays=p["canvas_vocab_arrays"], **{k: v for k, v in p["model"].items()},
                         imports_rss=p["imports_rss"]))
    span = levels[-1]["requests"] - first["requests"]
    per_row = (levels[-1]["serving_peak_rss"] - first["serving_peak_rss"]) / span if span else 0.0
    per_row_model = (modeled(levels[-1]) - modeled(first)) / span if span else 0.0
    return {"rows": rows, "fixed_remainder": fixed, "per_request_measured": per_row,
            "per_request_model": per_row_model, "canvas_x_vocab_f32_bytes": a.canvas * a.vocab * 4}


def report(result: dict) -> str:
    cfg = result["config"]
    out = []
    if "speed" in result:
        rows = []
        for r in result["speed"]["rows"]:
            label = f"{r['requests']}" + (f" ({r['slots']} slots)" if r["slots"] else "")
            rows.append([label, r["side"], r["tok_s"], r["ms_per_canvas_step"], r["steps_per_canvas"],
                         r["serving_peak_rss"] / GIB, r["peak_rss"] / GIB, r.get("speedup"), r.get("rss_ratio"),
                         len(r["walls"])])
        out.append(table(f"engine vs transformers generate: vocabulary {cfg['vocab']:,}, canvas {cfg['canvas']}, "
                         f"hidden {cfg['hidden']}, {cfg['layers']} layers, {cfg['steps']} steps, CPU (fastest of N, "
                         "sides alternated, a process each)",
                         ["requests", "side", "tok/s", "ms/canvas-step", "steps/canvas", "serving GiB", "peak GiB",
                          "speedup", "peak ratio", "N"], rows))
    if "growth" in result:
        g = result["growth"]
        rows = [[r["requests"], r["serving_peak_rss"] / GIB, r["model_rss"] / GIB, r["excess"] / MIB,
                 r["kv_pools"] / MIB, r["state"] / MIB, r["denoise_scratch"] / MIB,
                 "FLAG" if r["flagged"] else "ok", ", ".join(r["canvas_vocab_arrays"]) or "none"]
                for r in g["rows"]]
        out.append(table(f"engine peak RSS as requests grow (serving; model = imports + weights "
                         f"{g['rows'][0]['weights'] / MIB:.1f} MiB + KV pools + state + denoise scratch + fixed "
                         f"{g['fixed_remainder'] / MIB:.0f} MiB)",
                         ["requests", "measured GiB", "model GiB", "excess MiB", "KV MiB", "state MiB",
                          "scratch MiB", "growth", "[canvas x vocab] arrays"], rows))
        out.append(f"per request: measured {g['per_request_measured'] / MIB:.1f} MiB, model "
                   f"{g['per_request_model'] / MIB:.1f} MiB (one [canvas x vocab] float32 array: "
                   f"{g['canvas_x_vocab_f32_bytes'] / MIB:.0f} MiB)")
    if "fused" in result:
        m = result["fused"]
        for k in ("materialised", "streaming"):
            out.append(f"fused pass, published shape, {k:13s}: step {m['step_bytes_per_row'][k] / MIB:9.1f} MiB/row, "
                       f"state {m['state_bytes_per_row'][k] / MIB:7.1f} MiB/row -> {m['canvases_at_80GB'][k]:,} "
                       "canvases on 80 GB")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench_out")
    p.add_argument("--smoke", action="store_true", help="tiny sizes (vocabulary 512, canvas 16): checks the script")
    p.add_argument("--model", default=None, help="a DiffusionGemma directory (default: written, random)")
    p.add_argument("--vocab", type=int, default=262144)
    p.add_argument("--canvas", type=int, default=256)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=2, help="max_denoising_steps, both sides")
    p.add_argument("--levels", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    p.add_argument("--growth", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8, 16])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--engine-reps", type=int, default=3)
    p.add_argument("--hf-reps", type=int, default=1)
    p.add_argument("--hf-batch", type=int, default=1, help="transformers: prompts per generate call")
    p.add_argument("--no-slots-row", dest="slots_row", action="store_false")
    p.add_argument("--parts", default="speed,growth,fused")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per side process")
    a = p.parse_args(argv)
    if a.smoke:
        for k, v in SMOKE.items():
            setattr(a, k, v)
        a.parts = ",".join(x for x in a.parts.split(",") if x != "fused")
    parts = a.parts.split(",")
    tmp = None
    if a.model is None:
        tmp = tempfile.TemporaryDirectory(prefix="renoise_bench_")
        a.model = tmp.name
        from bench.renoise_side import write_model

        write_model(a.model, vocab=a.vocab, canvas=a.canvas, hidden=a.hidden, layers=a.layers, window=a.window)
    result = {"config": dict(vocab=a.vocab, canvas=a.canvas, hidden=a.hidden, layers=a.layers, window=a.window,
                             prompt_len=a.prompt_len, steps=a.steps, rounds=a.rounds, engine_reps=a.engine_reps,
                             hf_reps=a.hf_reps, hf_batch=a.hf_batch, cpus=os.cpu_count(), smoke=a.smoke)}
    try:
        if "speed" in parts:
            result["speed"] = speed(a)
        if "growth" in parts:
            result["growth"] = growth(a, result.get("speed", {}).get("processes", {}))
        if "fused" in parts:
            result["fused"] = memory()
    finally:
        if tmp is not None:
            tmp.cleanup()
    print(report(result))
    path = write_json(os.path.join(a.out, "renoise.json"), result)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
