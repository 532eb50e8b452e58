"""Gemma4Renoise benchmarks: the fused vocabulary pass's memory at the published shape, and the engine against
transformers' ``generate`` on a tiny DiffusionGemma-shaped checkpoint (CPU).

    python -m bench.renoise [--out bench_out] [--quick]

* ``memory``: XLA's own accounting (``jit(...).lower(...).compile().memory_analysis()``, compiled for the CPU at the
  published shape: vocabulary 262,144, hidden 2,816, canvas 256, bf16; nothing is run) of one step's statistics
  per row -- the materialised formulation (logits, probabilities, soft embedding from them: what transformers and
  SGLang compute) vs the streaming pass -- and how many concurrent canvases an 80 GB device holds after the weights
  (the plan's 47 GiB) and a 4 GiB reserve, counting each formulation's per-row step memory and the per-row state
  between steps (transformers keeps the processed logits; ours the ``[C, H]`` soft embedding).
* ``speed``: 1 and 16 concurrent requests, the engine (FDFO) vs transformers' ``generate`` (one call per request,
  as its batch would pad them alike), each timed after a warm-up run of the same shapes: tokens per second,
  denoising steps per canvas and tokens per forward (a random tiny model never stops a canvas early: every canvas
  takes all ``max_denoising_steps``).

Writes ``renoise.json`` and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

GB, GIB = 10 ** 9, 1 << 30
PUBLISHED = dict(vocab=262144, hidden=2816, canvas=256)
WEIGHTS_BYTES = 47 * GIB  # dllm-jax plan --preset diffusiongemma-26b-a4b, TP 1, bf16
RESERVE = 4 * GIB


def memory(rows=(1, 8)) -> dict:
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


def speed(levels=(1, 16), max_new=16, steps=8) -> dict:
    import numpy as np
    import torch

    import dllm_jax
    from dllm_jax.testing.diffusion_gemma import write_tiny_diffusion_gemma

    path = tempfile.mkdtemp(prefix="renoise_bench_")
    model = write_tiny_diffusion_gemma(path, canvas_length=8, sliding_window=16, hidden_size=64,
                                       intermediate_size=128, vocab_size=512, num_hidden_layers=6,
                                       layer_types=["sliding_attention"] * 5 + ["full_attention"], num_experts=8)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 500, int(rng.integers(8, 40))).tolist() for _ in range(max(levels))]
    engine = dllm_jax.Engine(model_path=path, warmup=False, max_running_requests=max(levels),
                             algorithm_config={"max_denoising_steps": steps})
    rows = []
    try:
        engine.generate(input_ids=prompts[:2], sampling_params={"max_new_tokens": max_new, "ignore_eos": True})
        for n in levels:
            params = [{"max_new_tokens": max_new, "seed": i, "ignore_eos": True} for i in range(n)]
            engine.generate(input_ids=prompts[:n], sampling_params=params)  # compiles this level's shapes
            t0 = time.perf_counter()
            outs = engine.generate(input_ids=prompts[:n], sampling_params=params)
            wall = time.perf_counter() - t0
            tokens = sum(len(o["output_ids"]) for o in outs)
            passes = sum(o["meta_info"]["forward_passes"] for o in outs)
            with torch.no_grad():  # (transformers' first call pays its own warm-up)
                model.generate(torch.tensor([prompts[0]]), max_new_tokens=max_new, max_denoising_steps=steps)
            t0 = time.perf_counter()
            hf_tokens = hf_passes = 0
            for p in prompts[:n]:
                with torch.no_grad():
                    res = model.generate(torch.tensor([p]), max_new_tokens=max_new, max_denoising_steps=steps)
                new_tokens = res.sequences.shape[1] - len(p)
                hf_tokens += new_tokens
                hf_passes += new_tokens / float(res.tokens_per_forward[0])  # its own count of decoder passes
            hf_wall = time.perf_counter() - t0
            rows.append({"concurrency": n, "engine_tok_s": tokens / wall, "hf_tok_s": hf_tokens / hf_wall,
                         "speedup": (tokens / wall) / (hf_tokens / hf_wall),
                         "engine_tokens_per_forward": tokens / max(passes, 1),
                         "hf_tokens_per_forward": hf_tokens / max(hf_passes, 1e-9),
                         "steps_per_canvas": passes / max(1, tokens / 8)})
    finally:
        engine.shutdown()
    return {"rows": rows, "max_new_tokens": max_new, "max_denoising_steps": steps}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench_out")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    result = {"memory": memory(), "speed": speed(levels=(1, 4) if args.quick else (1, 16))}
    m = result["memory"]
    print("fused pass, published shape (V 262144, H 2816, canvas 256, bf16), per row:")
    for k in ("materialised", "streaming"):
        print(f"  {k:13s} step {m['step_bytes_per_row'][k] / 2 ** 20:9.1f} MiB  state {m['state_bytes_per_row'][k] / 2 ** 20:7.1f}"
              f" MiB  -> {m['canvases_at_80GB'][k]:,} concurrent canvases on 80 GB")
    print("engine vs transformers generate (tiny DiffusionGemma, CPU):")
    for r in result["speed"]["rows"]:
        print(f"  {r['concurrency']:3d} requests: engine {r['engine_tok_s']:8.1f} tok/s  transformers "
              f"{r['hf_tok_s']:8.1f} tok/s  x{r['speedup']:.2f}  tokens/forward {r['engine_tokens_per_forward']:.2f} "
              f"(transformers {r['hf_tokens_per_forward']:.2f})  "
              f"steps/canvas {r['steps_per_canvas']:.1f}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "renoise.json"), "w") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
