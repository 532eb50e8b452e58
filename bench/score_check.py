"""``Engine.score`` ranks the correct answer first (issue 38 item 4), at a larger sample than the suite's test.

    python -m bench.score_check                      # 60 held-out prompts (10 per task), 3 near misses each
    python -m bench.score_check --prompts 120 --wrong 5 --samples 16

For held-out prompts of the shipped model's task family (:mod:`dllm_jax.train.tasks`, never trained on), the
correct answer and ``--wrong`` near misses (:func:`dllm_jax.train.tasks.near_misses`: one number moved by 1 or 2,
or one word swapped) are scored under both estimators (``chain``; ``elbo`` with ``--samples`` seeded draws); a
prompt counts when the correct answer has the highest log-probability. Prints the wins per task and estimator and
writes ``bench_out/score_check.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=None, help="default: the shipped model")
    ap.add_argument("--prompts", type=int, default=60)
    ap.add_argument("--wrong", type=int, default=3)
    ap.add_argument("--samples", type=int, default=8, help="ELBO draws per completion")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench_out/score_check.json")
    args = ap.parse_args(argv)

    import numpy as np

    import dllm_jax
    from bench.common import table
    from dllm_jax.train import tasks

    engine = dllm_jax.Engine(args.model_path)
    examples = tasks.heldout_set(args.prompts)[:args.prompts]
    rng = np.random.default_rng(args.seed)
    choices = [[ex.answer] + tasks.near_misses(ex.answer, rng, args.wrong) for ex in examples]
    result, rows = {"prompts": len(examples), "wrong": args.wrong, "samples": args.samples, "estimators": {}}, []
    try:
        for estimator in ("chain", "elbo"):
            wins: dict[str, list[int]] = {}
            t0 = time.perf_counter()
            for ex, answers in zip(examples, choices):
                scores = engine.score(engine.apply_chat_template(ex.prompt), answers, estimator=estimator,
                                      num_samples=args.samples, seed=1)
                won = int(np.argmax([s["logprob"] for s in scores]) == 0)
                wins.setdefault(ex.task, [0, 0])
                wins[ex.task][0] += won
                wins[ex.task][1] += 1
            total = sum(w for w, _ in wins.values())
            result["estimators"][estimator] = {"wins": total, "per_task": wins, "seconds": time.perf_counter() - t0}
            rows.append([estimator, f"{total}/{len(examples)}"] + [f"{w}/{n}" for w, n in wins.values()]
                        + [result["estimators"][estimator]["seconds"]])
    finally:
        engine.shutdown()
    print(table(f"score_check: the correct answer ranked first among {args.wrong + 1} ({len(examples)} held-out "
                f"prompts)", ["estimator", "all"] + list(wins) + ["seconds"], rows))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
