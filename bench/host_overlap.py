"""The engine's host work hidden behind the device vs exposed, with and without ``host_overlap`` (issue 39 item 6).

    python -m bench.host_overlap                       # the shipped model, 24 streamed requests, both modes twice
    python -m bench.host_overlap --model-path DIR --requests 64 --concurrency 16

A serving workload as the HTTP server sees it: the engine loop runs on its own thread (``Engine.start``), requests
arrive from another thread while others decode (at most ``--concurrency`` in flight), and each is streamed
(:class:`~dllm_jax.engine.output.ChunkSink`: every committed chunk built and detokenized on the engine's thread).
The same workload runs with ``host_overlap`` off and on, alternating, under :class:`bench.roofline.OverlapProbe`,
which splits the runner's timeline per denoise call into

* **hidden**: host work between a denoise call's dispatch and the read of its results (the device runs the call
  meanwhile): with overlap, the previous round's events, taking in, admitting and prefilling new requests;
* **exposed**: host work between reading one call's results and dispatching the next (committing, scheduling,
  padding the batch, unpacking; without overlap also the events and admission), when the device has nothing
  queued but a prefill.

Both modes must produce the same tokens (greedy). Prints a table, writes ``bench_out/host_overlap.json``.
"""

from __future__ import annotations

import argparse
import threading
import time


def run_workload(engine, prompts: list[list[int]], params: dict, concurrency: int) -> dict:
    """Stream every prompt through the started ``engine``, at most ``concurrency`` at a time; returns outputs and
    the probe's figures."""
    from bench.roofline import OverlapProbe
    from dllm_jax.engine.output import ChunkSink

    slots = threading.Semaphore(concurrency)
    reqs, done = [], threading.Semaphore(0)

    def on_done(req, event, sink):
        sink(req, event)
        if req.finished:  # its last chunk is queued
            slots.release()
            done.release()

    def submit_all():
        for ids in prompts:
            slots.acquire()
            sink = ChunkSink(engine)
            req = engine.make_request(list(ids), params, stream=True,
                                      on_event=lambda r, e, s=sink: on_done(r, e, s))
            reqs.append((req, sink))
            engine.submit(req)

    with OverlapProbe(engine.runner) as probe:
        t0 = time.perf_counter()
        producer = threading.Thread(target=submit_all)
        producer.start()
        producer.join()
        for _ in prompts:
            done.acquire()
        wall = time.perf_counter() - t0
    texts = []
    for req, sink in reqs:
        chunks = []
        while not sink.chunks.empty():
            chunks.append(sink.chunks.get_nowait())
        assert chunks and chunks[-1]["finished"], f"request {req.rid}: its stream did not finish"
        texts.append("".join(c["text"] for c in chunks))
    summary = probe.summary()
    b = summary["breakdown_ms_per_call"]
    tokens = sum(len(req.output_ids) for req, _ in reqs)
    return dict(wall_s=wall, tokens=tokens, tokens_per_s=tokens / wall, outputs=[r.output_ids for r, _ in reqs],
                streamed_texts=texts, probe=summary,
                hidden_ms=b["post"], exposed_ms=b["outside"] + b["prep"] + b["unpack"], wait_ms=b["wait"])


def main(argv=None) -> int:
    from bench.common import chat_prompts, fmt, shipped_model_path, table, write_json
    from dllm_jax import Engine

    p = argparse.ArgumentParser(prog="python -m bench.host_overlap", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="model directory (default: the shipped model)")
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="runs per mode, alternating off / on")
    p.add_argument("--out", default="bench_out/host_overlap.json")
    a = p.parse_args(argv)

    engine = Engine(shipped_model_path(a.model_path), max_running_requests=a.concurrency, progress=False)
    prompts = chat_prompts(engine.tokenizer, a.requests)
    params = {"max_new_tokens": a.max_new_tokens, "temperature": 0.0}
    engine.start()
    try:
        run_workload(engine, prompts[:a.concurrency], params, a.concurrency)  # compiles every shape it meets
        runs = {False: [], True: []}
        for _ in range(a.repeats):
            for mode in (False, True):
                engine.host_overlap = mode  # read by each round (dllm_jax/engine/rounds.py)
                runs[mode].append(run_workload(engine, prompts, params, a.concurrency))
    finally:
        engine.shutdown()
    reference = runs[False][0]
    rows, result = [], {}
    for mode, label in ((False, "off"), (True, "on")):
        best = min(runs[mode], key=lambda r: r["wall_s"])
        identical = all(r["outputs"] == reference["outputs"] and r["streamed_texts"] == reference["streamed_texts"]
                        for r in runs[mode])
        host = best["hidden_ms"] + best["exposed_ms"]
        rows.append([label, fmt(best["wall_s"]), fmt(best["tokens_per_s"]), best["probe"]["calls"],
                     fmt(best["exposed_ms"]), fmt(best["hidden_ms"]), fmt(best["wait_ms"]),
                     f"{100 * best['hidden_ms'] / host:.0f}%" if host else "-", "yes" if identical else "NO"])
        result[label] = dict(best={k: v for k, v in best.items() if k not in ("outputs", "streamed_texts")},
                             walls_s=[r["wall_s"] for r in runs[mode]], identical_to_off=identical)
    print(table(f"host overlap: {a.requests} streamed requests, {a.concurrency} in flight, {a.max_new_tokens} "
                f"tokens each (best of {a.repeats}; ms per denoise call)",
                ["host_overlap", "wall s", "tok/s", "calls", "exposed host", "hidden host", "device wait",
                 "hidden share", "same tokens"], rows))
    print("wrote", write_json(a.out, dict(args=vars(a), **result)))
    return 0 if all(result[k]["identical_to_off"] for k in result) else 1


if __name__ == "__main__":
    raise SystemExit(main())
