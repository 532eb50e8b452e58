"""``python -m bench compile_stall``: plain requests' latency while a step variant compiles, in line vs off the
scheduler's thread, side by side in one run.

A server-like engine (shipped model, plain buckets warmed up, the persistent compilation cache off so the variant
really compiles) serves a closed loop of plain greedy requests from ``CLIENTS`` threads; a few seconds in, one
request asks for log probabilities with alternatives, a step variant warm-up did not compile. ``inline``: the
variant compiles on the scheduler's thread, as before issue 34 (every plain request waits behind it);
``background``: it compiles on the runner's background thread while plain rows keep running. Each mode runs in a
fresh process (nothing compiled carries over). Reported: plain latency before the variant arrived and while it
compiled (median and max), the variant request's own latency, and whether every plain answer was the same.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

CLIENTS = 4
WARM_S = 3.0  # plain traffic before the variant request
AFTER_S = 2.0  # plain traffic after the variant request finished
MAX_NEW = 32


def _run_mode(mode: str, model_path: str) -> dict:
    """In this process: the engine, the clients and the variant request (see the module's doc)."""
    import numpy as np

    from dllm_jax import Engine

    # one shape bucket per kind (every call of 4 clients fits it): a short warm-up, one variant executable
    buckets = {"rows": [8], "pages": [16], "prefill_rows": [1], "prefill_blocks": [2]}
    engine = Engine(model_path, max_running_requests=8, context_length=512, compilation_cache="off", warmup=True,
                    progress=False, shape_buckets=buckets)
    if mode == "inline":
        engine.runner.compiler.warmed_classes.clear()  # the engine before issue 34: every compile on the scheduler's thread
    engine.start()
    prompts = [engine.apply_chat_template(f"Count up {4 + i % 6} steps from {10 + i}.") for i in range(64)]
    plain = {"max_new_tokens": MAX_NEW, "temperature": 0}
    records, stop = [], threading.Event()

    def client(k: int):
        i = k
        while not stop.is_set():
            t0 = time.perf_counter()
            out = engine.generate(prompt=prompts[i % len(prompts)], sampling_params=plain)
            records.append((t0, time.perf_counter(), i % len(prompts), out["output_ids"]))
            i += CLIENTS

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(CLIENTS)]
    for t in threads:
        t.start()
    time.sleep(WARM_S)
    v0 = time.perf_counter()
    engine.generate(prompt=prompts[0], sampling_params={**plain, "return_logprob": True, "top_logprobs_num": 5})
    v1 = time.perf_counter()
    time.sleep(AFTER_S)
    stop.set()
    for t in threads:
        t.join()
    engine.shutdown()
    before = [b - a for a, b, _, _ in records if b < v0]
    during = [b - a for a, b, _, _ in records if b > v0 and a < v1]  # overlapping the compile window
    answers: dict = {}
    consistent = all(answers.setdefault(i, ids) == ids for _, _, i, ids in records)
    med = lambda xs: float(np.median(xs)) if xs else float("nan")  # noqa: E731
    return {"mode": mode, "variant_s": v1 - v0, "plain_before_median_s": med(before),
            "plain_before_max_s": max(before, default=float("nan")), "plain_during_median_s": med(during),
            "plain_during_max_s": max(during, default=float("nan")), "plain_during": len(during),
            "plain_total": len(records), "answers_consistent": consistent}


def compile_stall(ctx) -> dict:
    from bench.common import table
    from bench.scenarios import finish

    m = ctx.model("shipped")
    rows = []
    for mode in ("inline", "background"):
        ctx.log(f"compile_stall: {mode}")
        out = subprocess.run([sys.executable, "-m", "bench.compile_stall", mode, m.path], capture_output=True,
                             text=True, env=dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "")))
        if out.returncode != 0:
            raise RuntimeError(f"compile_stall {mode} failed:\n{out.stderr[-3000:]}")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    text = table(f"plain requests while a step variant compiles ({m.label}, {CLIENTS} clients, {MAX_NEW} tokens)",
                 ["mode", "plain p50 before s", "plain p50 during s", "plain max during s", "variant s",
                  "plain during", "consistent"],
                 [[r["mode"], r["plain_before_median_s"], r["plain_during_median_s"], r["plain_during_max_s"],
                   r["variant_s"], r["plain_during"], r["answers_consistent"]] for r in rows])
    return finish(ctx, "compile_stall", {"model": m.label, "rows": rows}, text)


if __name__ == "__main__":
    print(json.dumps(_run_mode(sys.argv[1], sys.argv[2])), flush=True)
