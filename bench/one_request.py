"""One request at a time on the shipped model, against the transformers loop (issue 50): ``python
bench/one_request.py engine LABEL | transformers | ab`` prints one JSON line.

Greedy LowConfidence (threshold 0.95, B = 32), 64 new tokens with ``ignore_eos``, the 32 held-out chat prompts of
``bench.common.chat_prompts``:

* ``engine LABEL [passes] [passes16]``: ``Engine(max_running_requests=16)``; one request at a time (submit, step
  until finished, result), ``passes`` passes after two warm ones. ``tps_summin``: output tokens over the sum, over
  prompts, of each prompt's fastest pass (a loaded machine delays some requests of every pass; a prompt's fastest
  is the one nothing preempted); ``tps_best``: the fastest whole pass; ``cpu_ms_min``: the process's CPU time a
  request in its cheapest pass. Then ``bench.common.run_requests`` at 16 in flight, best of ``passes16``. Uses only
  ``Engine.submit / make_request / step / result``, so the same file runs any tree on ``PYTHONPATH`` (9b1a13a too:
  ``PYTHONPATH=<tree> python bench/one_request.py engine old``).
* ``transformers [passes]``: :class:`bench.hf_baseline.HFBlockDiffusion` (float32, SDPA, its calibrated thread
  count), one prompt at a time, the same statistics.
* ``ab [passes]``: two engines of this tree in one process, one computing over the ``[in, out]`` compute copies
  (:mod:`dllm_jax.model.compute_layout`) and one over the stored ``[out, in]`` matrices, every request run on both
  in alternating order: the copies' effect with everything else equal.

Compare engines only in alternating processes on one machine, and say the load average.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time

import numpy as np

PARAMS = {"max_new_tokens": 64, "ignore_eos": True, "temperature": 0.0}


def _engine():
    from dllm_jax import Engine

    return Engine(algorithm_config={"threshold": 0.95}, block_size=32, max_running_requests=16)


def _request(engine, ids):
    t0, c0 = time.perf_counter(), time.process_time()
    req = engine.submit(engine.make_request(list(ids), PARAMS))
    while not req.finished:
        engine.step()
    out = engine.result(req)["output_ids"]
    return time.perf_counter() - t0, time.process_time() - c0, tuple(out)


def _stats(walls: np.ndarray, tokens: int) -> dict:
    """walls ``[passes, prompts]``."""
    fastest = walls.min(axis=0).sum()
    return dict(tps_summin=round(tokens / fastest, 1), tps_best=round(tokens / walls.sum(axis=1).min(), 1),
                ms_req_summin=round(1e3 * fastest / walls.shape[1], 3))


def engine_side(label: str, passes: int = 8, passes16: int = 5) -> dict:
    from bench.common import chat_prompts, run_requests

    engine = _engine()
    prompts = chat_prompts(engine.tokenizer, 32)
    walls, cpus = np.zeros((passes + 2, len(prompts))), []
    for p in range(passes + 2):  # the first two warm (compiles)
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        outs = []
        for i, ids in enumerate(prompts):
            walls[p, i], _, out = _request(engine, ids)
            outs.append(out)
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        cpus.append((r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) / len(prompts) * 1e3)
    tokens = sum(len(o) for o in outs)
    result = {"label": label, "load": os.getloadavg()[0],
              "c1": dict(_stats(walls[2:], tokens), cpu_ms_min=round(min(cpus[2:]), 2),
                         digest=hash(tuple(outs)) & 0xFFFFFFFF)}
    if passes16:
        run_requests(engine, prompts, PARAMS, 16)
        result["c16"] = dict(tps=round(max(run_requests(engine, prompts, PARAMS, 16)["tokens_per_s"]
                                           for _ in range(passes16)), 1))
    engine.shutdown()
    return result


def transformers_side(passes: int = 4) -> dict:
    from bench.common import chat_prompts
    from bench.hf_baseline import HFBlockDiffusion
    from dllm_jax.assets import __file__ as assets

    hf = HFBlockDiffusion(os.path.join(os.path.dirname(assets), "sdar-tiny"), threshold=0.95, dtype="float32",
                          attn_implementation="sdpa")
    threads = hf.calibrate_threads()
    prompts = chat_prompts(hf.tokenizer, 32)
    hf.generate(prompts[0], 32, ignore_eos=True)
    walls = np.zeros((passes, len(prompts)))
    for p in range(passes):
        outs = []
        for i, ids in enumerate(prompts):
            t0 = time.perf_counter()
            outs.append(tuple(hf.generate(ids, PARAMS["max_new_tokens"], ignore_eos=True)["output_ids"]))
            walls[p, i] = time.perf_counter() - t0
    return {"label": "transformers", "load": os.getloadavg()[0], "threads": threads,
            "c1": dict(_stats(walls, sum(len(o) for o in outs)), digest=hash(tuple(outs)) & 0xFFFFFFFF)}


def ab(passes: int = 10) -> dict:
    from bench.common import chat_prompts
    from dllm_jax.model.compute_layout import ComputeCopies

    engines = {"copies": _engine(), "stored": _engine()}
    engines["stored"].runner.compute = ComputeCopies(False)
    prompts = chat_prompts(engines["copies"].tokenizer, 32)
    for e in engines.values():
        for ids in prompts[:4]:
            _request(e, ids)
    walls = {k: np.zeros((passes, len(prompts))) for k in engines}
    cpu = {k: np.zeros((passes, len(prompts))) for k in engines}
    outs = {k: [None] * len(prompts) for k in engines}
    for p in range(passes):
        for i, ids in enumerate(prompts):
            for k in (("copies", "stored") if (p + i) % 2 == 0 else ("stored", "copies")):
                walls[k][p, i], cpu[k][p, i], outs[k][i] = _request(engines[k], ids)
    tokens = sum(len(o) for o in outs["copies"])
    out = {"load": os.getloadavg()[0], "same_tokens": outs["copies"] == outs["stored"]}
    for k in engines:
        out[k] = dict(_stats(walls[k], tokens), cpu_ms_summin=round(1e3 * cpu[k].min(axis=0).sum() / len(prompts), 3),
                      ms_req_median=round(1e3 * float(np.median(walls[k].sum(axis=1))) / len(prompts), 3))
        engines[k].shutdown()
    return out


def main(argv: list[str]) -> int:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    mode, rest = argv[0], [int(a) if a.isdigit() else a for a in argv[1:]]
    fn = {"engine": engine_side, "transformers": transformers_side, "ab": ab}[mode]
    print(json.dumps(fn(*rest)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
