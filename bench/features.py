"""``python -m bench.features``: what log probabilities, penalties and sampling cost per denoise step (issue 18).

One FDFO denoise call of ``--rows`` rows (default 32; each an all-mask block of B positions after ``--prefix-pages``
pages of prefix) through ``ModelRunner.denoise`` (host packing, the jitted step, the host sync), timed for the plain
step and for every variant a request can select:

* ``plain``: no row wants logprobs or has a penalty (the step every other batch runs, unchanged);
* ``logprobs``: some row wants the written tokens' log probabilities (fused path: one LM-head column gather);
* ``logprobs+top20``: and alternatives (an extra pass over the LM head in vocabulary tiles);
* ``penalties``: some row has a penalty / bias (the logits are materialised and penalised);
* ``penalties+logprobs+top20``;
* ``sampled``: every row samples at temperature 0.8 with top-k and top-p off (the logits are materialised, no sort);
* ``sampled+top_p0.95`` / ``sampled+top_k50``: and filters (the sort over the vocabulary runs).

Each variant compiles first; then the variants are timed round-robin (a busy machine slows them alike) and the
median of ``--reps`` calls is reported with its ratio to ``plain``. Greedy rows but in the sampled variants; the
shipped model by default.

    python -m bench.features [--model-path DIR] [--rows 32] [--prefix-pages 4] [--reps 30] [--out bench_out/features.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

VARIANTS = {  # name -> (logprobs per row: -1 none / 0 tokens / k alternatives, penalised, temperature, top_k, top_p)
    "plain": (-1, False, 0.0, -1, 1.0),
    "logprobs": (0, False, 0.0, -1, 1.0),
    "logprobs+top20": (20, False, 0.0, -1, 1.0),
    "penalties": (-1, True, 0.0, -1, 1.0),
    "penalties+logprobs+top20": (20, True, 0.0, -1, 1.0),
    "sampled": (-1, False, 0.8, -1, 1.0),
    "sampled+top_p0.95": (-1, False, 0.8, -1, 0.95),
    "sampled+top_k50": (-1, False, 0.8, 50, 1.0),
}


def measure(model_path: str | None = None, rows: int = 32, prefix_pages: int = 4, reps: int = 30) -> dict:
    import jax

    from dllm_jax import Engine
    from dllm_jax.engine.calls import DecodeRow, PenaltyRow

    engine = Engine(model_path, max_running_requests=rows, context_length=(prefix_pages + 1) * 32,
                    fold_commit_forward=False, block_size=32, num_kv_pages=rows * (prefix_pages + 1) + 1,
                    shape_buckets={"rows": [rows], "pages": [prefix_pages + 1], "prefill_rows": [1],
                                   "prefill_blocks": [1]})
    runner, B = engine.runner, engine.block_size
    rng = np.random.default_rng(0)
    history = [int(t) for t in rng.integers(4, engine.config.vocab_size, prefix_pages * B)]
    penalty = PenaltyRow(history=history, prompt_len=len(history) // 2, presence=0.5, frequency=0.3,
                         repetition=1.2, bias=((5, 2.0), (7, -1.0)))

    def batch(logprobs: int, penalised: bool, temperature: float, top_k: int, top_p: float) -> list:
        return [DecodeRow(tokens=np.full(B, engine.mask_token_id, np.int32), immutable=np.zeros(B, np.bool_),
                          prefix_pages=list(range(1 + i * prefix_pages, 1 + (i + 1) * prefix_pages)),
                          write_page=1 + rows * prefix_pages, steps_taken=0, temperature=temperature, top_k=top_k,
                          top_p=top_p, seed=i, rng_step=0, algo_state=None, logprobs=logprobs,
                          penalty=penalty if penalised else None) for i in range(rows)]

    batches = {name: batch(*v) for name, v in VARIANTS.items()}
    compile_s = {}
    for name, rows_ in batches.items():
        t0 = time.perf_counter()
        runner.denoise(rows_)
        compile_s[name] = time.perf_counter() - t0
        runner.denoise(rows_)
    times = {name: [] for name in batches}
    for _ in range(reps):
        for name, rows_ in batches.items():
            t0 = time.perf_counter()
            runner.denoise(rows_)
            times[name].append(time.perf_counter() - t0)
    engine.shutdown()
    plain = statistics.median(times["plain"])
    results = {name: {"median_ms": 1e3 * statistics.median(t), "min_ms": 1e3 * min(t),
                      "vs_plain": statistics.median(t) / plain, "first_call_s": compile_s[name]}
               for name, t in times.items()}
    return {"model_path": engine.model_path, "platform": jax.default_backend(), "rows": rows, "block_size": B,
            "prefix_pages": prefix_pages, "reps": reps, "results": results}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--prefix-pages", type=int, default=4)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default="bench_out/features.json")
    args = ap.parse_args(argv)
    report = measure(args.model_path, args.rows, args.prefix_pages, args.reps)
    print(f"denoise step, {report['rows']} rows x B={report['block_size']}, prefix {report['prefix_pages']} pages, "
          f"{report['platform']}, median of {report['reps']} (round-robin)")
    print(f"{'variant':<26} {'median ms':>10} {'min ms':>8} {'x plain':>8} {'1st call s':>10}")
    for name, r in report["results"].items():
        print(f"{name:<26} {r['median_ms']:>10.2f} {r['min_ms']:>8.2f} {r['vs_plain']:>8.3f} {r['first_call_s']:>10.2f}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
