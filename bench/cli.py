"""``dllm-jax bench`` / ``python -m bench``: run benchmark scenarios, print tables, write JSON and PNG plots.

    python -m bench                         # every CPU scenario (+ the roofline on a GPU), ~15 min on 2 cores
    python -m bench --quick                 # smaller sizes, a few minutes
    python -m bench baseline engine         # chosen scenarios
    python -m bench --profile-dir prof/     # also record a JAX profiler trace of a window of engine steps

Scenarios: baseline, concurrency, prefix, prefill, long, schedules, engine, roofline (GPU), kernels, radix, load, bf16,
weight_update (and the others of bench/scenarios.py's SCENARIOS).
Outputs (default ``bench_out/``): ``<scenario>.json``, ``<scenario>.png``, ``summary.json`` (every target figure,
met or not) and ``summary.txt``. See ``bench/README.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.replace(",", " ").split()]


def _names(s: str) -> list[str]:
    return [x for x in s.replace(",", " ").split() if x]


def add_arguments(p: argparse.ArgumentParser) -> None:
    from bench.scenarios import DEFAULT_SCENARIOS, SCENARIOS

    p.add_argument("scenarios", nargs="*", metavar="SCENARIO",
                   help=f"scenarios to run (default: {' '.join(DEFAULT_SCENARIOS)}); any of: {' '.join(SCENARIOS)}")
    p.add_argument("--out", default="bench_out", help="output directory (JSON, PNG, summary)")
    p.add_argument("--quick", action="store_true", help="small sizes (a few minutes on CPU)")
    p.add_argument("--models", type=_names, default=["shipped", "random50m"],
                   help="models the suite may use (shipped, random50m, tiny); the baseline runs on all of them, the "
                        "other scenarios on their defaults among them (see --<scenario>-models)")
    p.add_argument("--model-path", default=None, help="the 'shipped' model directory (default: the shipped model)")
    p.add_argument("--threshold", type=float, default=0.95, help="LowConfidence threshold (both stacks)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=None, help="override every scenario's max_new_tokens")
    p.add_argument("--baseline-prompts", type=int, default=None, help="prompts of the baseline (shipped model)")
    p.add_argument("--concurrency", type=_ints, default=None, help="levels of the concurrency scenario (1,4,16,64)")
    p.add_argument("--concurrency-models", type=_names, default=None, help="models of the concurrency scenario (shipped)")
    p.add_argument("--engine-concurrency", type=_ints, default=None, help="levels of the engine scenario (1,8,32)")
    p.add_argument("--engine-models", type=_names, default=None,
                   help="models of the engine scenario (shipped,random50m)")
    p.add_argument("--prefix-tokens", type=int, default=None, help="shared prompt length (1024)")
    p.add_argument("--prefix-requests", type=int, default=None, help="requests sharing it (16)")
    p.add_argument("--prefix-models", type=_names, default=None,
                   help="models of the prefix scenario (shipped,random50m; --quick: shipped)")
    p.add_argument("--long-tokens", type=_ints, default=None, help="prompt lengths of the long scenario (2048,4096)")
    p.add_argument("--long-models", type=_names, default=None,
                   help="models of the long scenario (shipped,random50m; --quick: shipped; random50m stops at 2048 "
                        "tokens unless --long-tokens is given)")
    p.add_argument("--prefill-tokens", type=_ints, default=None,
                   help="prompt lengths of the prefill scenario (128,256,512,1024,1056,2048,3072,4096)")
    p.add_argument("--prefill-models", type=_names, default=None,
                   help="models of the prefill scenario (shipped,random50m; --quick: shipped)")
    p.add_argument("--prefill-repeats", type=int, default=None,
                   help="measured passes of the prefill scenario, best kept (3; --quick: 2)")
    p.add_argument("--schedule-requests", type=int, default=None, help="requests of the schedules scenario (32)")
    p.add_argument("--schedule-models", type=_names, default=None, help="models of the schedules scenario (shipped)")
    p.add_argument("--efficiency-concurrency", type=_ints, default=None,
                   help="levels of the efficiency scenario (1,16,64)")
    p.add_argument("--efficiency-models", type=_names, default=None,
                   help="models of the efficiency scenario (shipped,random50m; --quick: shipped)")
    p.add_argument("--load-dir", default=None,
                   help="load / bf16 scenarios: where their 1.7B-shaped checkpoints go and are reused (kept; default: "
                        "a temporary directory, deleted at the end)")
    p.add_argument("--load-keep", action="store_true", help="keep the temporary checkpoints of load / bf16")
    p.add_argument("--load-layers", type=int, default=None, help="layers of the load checkpoint (28; --quick: 4)")
    p.add_argument("--load-repeats", type=int, default=None, help="fresh-process rounds of the load scenario (3)")
    p.add_argument("--load-convert", action=argparse.BooleanOptionalAction, default=None,
                   help="also time dllm-jax convert and loading its output (default: on unless --quick)")
    p.add_argument("--bf16-layers", type=int, default=None, help="layers of the bf16 scenario's model (28; --quick: 4)")
    p.add_argument("--bf16-prompts", type=int, default=None, help="prompts of the bf16 agreement (20; --quick: 8)")
    p.add_argument("--bf16-tokens", type=int, default=None, help="greedy tokens per prompt in the bf16 scenario (8)")
    p.add_argument("--bf16-rounds", type=int, default=None,
                   help="alternating timing rounds (1 row, 8 rows) per dtype in the bf16 scenario (3; --quick: 1)")
    p.add_argument("--bf16-hf-prompts", type=int, default=None,
                   help="prompts the transformers loop runs in the bf16 scenario (4; --quick: 2)")
    p.add_argument("--weight-update-layers", type=int, default=None,
                   help="layers of the weight_update scenario's SDAR-1.7B-shaped model (28; --quick: 4; 0: none)")
    p.add_argument("--weight-update-repeats", type=int, default=None,
                   help="updates timed per kind in the weight_update scenario (5; --quick: 3)")
    p.add_argument("--hf-threads", type=int, default=None,
                   help="torch threads for the transformers loop (default: the faster of 1 and all, measured)")
    p.add_argument("--profile-dir", default=None,
                   help="also record a JAX profiler (perfetto) trace of a window of engine steps here")
    p.add_argument("--profile-steps", type=int, default=32, help="engine steps in the profiled window")
    p.add_argument("--no-plots", action="store_true")


def ctx_from_args(args: argparse.Namespace):
    from bench.common import Ctx

    overrides = {
        "max_new_tokens": args.max_new_tokens, "baseline_prompts": args.baseline_prompts,
        "concurrency": args.concurrency, "engine_concurrency": args.engine_concurrency,
        "concurrency_models": args.concurrency_models, "engine_models": args.engine_models,
        "prefix_tokens": args.prefix_tokens, "prefix_requests": args.prefix_requests,
        "prefix_models": args.prefix_models, "long_tokens": args.long_tokens, "long_models": args.long_models,
        "prefill_tokens": args.prefill_tokens, "prefill_models": args.prefill_models,
        "prefill_repeats": args.prefill_repeats,
        "schedule_requests": args.schedule_requests, "schedule_models": args.schedule_models,
        "hf_threads": args.hf_threads, "efficiency_concurrency": args.efficiency_concurrency,
        "efficiency_models": args.efficiency_models,
        "load_dir": args.load_dir, "load_keep": args.load_keep or None, "load_layers": args.load_layers,
        "load_repeats": args.load_repeats, "load_convert": args.load_convert, "bf16_layers": args.bf16_layers,
        "bf16_prompts": args.bf16_prompts, "bf16_tokens": args.bf16_tokens, "bf16_hf_prompts": args.bf16_hf_prompts,
        "bf16_rounds": args.bf16_rounds, "weight_update_layers": args.weight_update_layers,
        "weight_update_repeats": args.weight_update_repeats,
    }
    command = "python -m bench" + (" --quick" if args.quick else "")
    return Ctx(out_dir=args.out, quick=args.quick, seed=args.seed, threshold=args.threshold,
               model_path=args.model_path, models=tuple(args.models), plots=not args.no_plots,
               profile_dir=args.profile_dir, profile_steps=args.profile_steps,
               overrides={k: v for k, v in overrides.items() if v is not None}, command=command)


def profile_window(ctx) -> dict:
    """Record a trace of ``ctx.profile_steps`` engine rounds (8 requests in flight on the first model) and print
    where the time went, summed by annotation."""
    from bench.common import (ENGINE_ANNOTATIONS, chat_prompts, find_trace, make_engine, run_requests,
                              summarize_trace, table)
    from bench.scenarios import SHORT_CONTEXT, max_new_tokens, sampling

    m = ctx.model(ctx.models[0])
    prompts = chat_prompts(m.tokenizer, 8)
    params = sampling(m, max_new_tokens(ctx, m, heavy=True))
    engine = make_engine(m, ctx, enable_prefix_cache=True, max_running_requests=8, context_length=SHORT_CONTEXT)
    try:
        run_requests(engine, prompts, params, 8)  # compile first: the window shows steady-state steps
        engine.flush_cache()
        directory = engine.start_profile(os.path.abspath(ctx.profile_dir), ctx.profile_steps)
        run_requests(engine, prompts, params, 8)
        engine.stop_profile()
    finally:
        engine.shutdown()
    trace = find_trace(directory)
    out = {"profile_dir": directory, "trace": trace, "model": m.label, "steps": ctx.profile_steps}
    if trace is None:
        ctx.log(f"profile: no perfetto trace found under {directory}")
        return out
    annotated = summarize_trace(trace, ENGINE_ANNOTATIONS)
    everything = summarize_trace(trace)[:25]
    out["annotations"] = [dict(name=n, count=c, total_ms=t) for n, c, t in annotated]
    out["top_events"] = [dict(name=n, count=c, total_ms=t) for n, c, t in everything]
    print(table(f"profile: engine annotations over {ctx.profile_steps} steps ({m.label})",
                ["annotation", "count", "total ms", "ms each"], [[n, c, t, t / max(c, 1)] for n, c, t in annotated]))
    print(table("profile: largest events (Python functions, XLA thunks, annotations)",
                ["event", "count", "total ms"], [[n[:70], c, t] for n, c, t in everything]))
    print(f"trace: {trace}\n  open it at https://ui.perfetto.dev (Open trace file) or chrome://tracing; "
          f"or `xprof --logdir {directory}` for the xplane.pb")
    return out


def format_targets(targets: list[dict]) -> str:
    from bench.common import fmt, table

    rows = []
    for t in targets:
        met = {True: "MET", False: "not met", None: "not measured"}[t["met"]]
        value = "-" if t["value"] is None else f"{fmt(t['value'])}{'' if t['unit'] == 'x' else ' '}{t['unit']}"
        rows.append([t["name"], value, f"{t['comparison']} {fmt(t['target'])}{t['unit']}", met, t["note"]])
    return table("targets (every figure, met or not)", ["figure", "value", "target", "result", "note"], rows)


BENCH_NEEDS = ("torch", "matplotlib")  # the transformers baseline loop and the plots: the 'bench' extra


def register(subparsers) -> None:
    """Add ``bench`` to the ``dllm-jax`` command (entry point ``dllm_jax.commands``)."""
    b = subparsers.add_parser("bench", help="benchmarks (tables, JSON and PNG plots; needs the 'bench' extra)")
    add_arguments(b)
    b.set_defaults(fn=main)


def missing_dependencies() -> list[str]:
    import importlib.util

    return [m for m in BENCH_NEEDS if importlib.util.find_spec(m) is None]


def main(args: argparse.Namespace) -> int:
    missing = missing_dependencies()
    if missing:
        print(f"dllm-jax bench: needs {', '.join(missing)}: install the bench extra: pip install 'dllm-jax[bench]'",
              file=sys.stderr)
        return 2
    from bench.common import write_json
    from bench.scenarios import DEFAULT_SCENARIOS, SCENARIOS

    names = list(args.scenarios or DEFAULT_SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        print(f"dllm-jax bench: unknown scenario(s) {unknown}; valid: {' '.join(SCENARIOS)}", file=sys.stderr)
        return 2
    ctx = ctx_from_args(args)
    os.makedirs(ctx.out_dir, exist_ok=True)
    import jax

    ctx.log(f"scenarios {names}; models {list(ctx.models)}; jax {jax.__version__} on {jax.default_backend()} "
            f"({os.cpu_count()} CPUs); out {os.path.abspath(ctx.out_dir)}")
    t0 = time.perf_counter()
    failures = {}
    timings = {}
    for name in names:
        ts = time.perf_counter()
        try:
            SCENARIOS[name](ctx)
        except Exception as e:  # one failing scenario must not hide the others
            traceback.print_exc()
            failures[name] = f"{type(e).__name__}: {e}"
        timings[name] = time.perf_counter() - ts
        ctx.log(f"{name}: {timings[name]:.0f} s")
    profile = None
    if ctx.profile_dir:
        try:
            profile = profile_window(ctx)
        except Exception as e:
            traceback.print_exc()
            failures["profile"] = f"{type(e).__name__}: {e}"
    text = format_targets(ctx.targets)
    print(text)
    models = {n: {"label": m.label, "path": m.path, "params": m.num_params, "random": m.random}
              for n, m in ctx._models.items()}
    summary = {"scenarios": names, "seconds": timings, "total_s": time.perf_counter() - t0, "failures": failures,
               "models": models, "targets": ctx.targets, "profile": profile, "quick": ctx.quick,
               "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "jax": jax.__version__,
                           "backend": jax.default_backend(), "device": jax.devices()[0].device_kind},
               "argv": sys.argv}
    write_json(os.path.join(ctx.out_dir, "summary.json"), summary)
    with open(os.path.join(ctx.out_dir, "summary.txt"), "w") as f:
        f.write(text + "\n")
    ctx.log(f"wrote {os.path.join(ctx.out_dir, 'summary.json')} ({summary['total_s']:.0f} s in all)")
    if failures:
        print(f"failed scenarios: {json.dumps(failures, indent=1)}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return p


def run(argv=None) -> int:
    return main(build_parser().parse_args(argv))
