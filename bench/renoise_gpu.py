"""One Gemma4Renoise denoising step at the DiffusionGemma-26B-A4B shape, beside its memory and compute floors.

    python -m bench.renoise_gpu [--layers 6] [--out renoise_gpu.json]   # a GPU (bf16, random weights)
    python -m bench.renoise_gpu --smoke                                  # anywhere: tiny shapes

The model is the published shape (hidden 2,816, 16 q heads, sliding layers 8 KV heads x 256 and window 1,024, full
layers 2 KV heads x 512, 128 experts of 704 with top 8, dense MLP 2,112, vocabulary 262,144, canvas 256), cut to
``--layers`` layers in the published 5:1 pattern (the default 6 fits any card next to the head; the step of the
whole model is ``(step - head part) * 30 / layers + head part``, reported). Rows of one canvas each, over a prefix
of ``--prefix`` tokens encoded by the encoder first. Per batch and backend (``pallas``: the Pallas fused
vocabulary pass; ``xla``: the streaming loop), the step time (each step waited for) and its floors:

* memory: bytes a step must read at least -- the layers' weights it touches (attention, dense MLP, the experts the
  rows' tokens route to: all 128 once a batch has enough tokens), the prefix K/V of its rows, the LM head and the
  embedding (read once each by the fused pass) -- over the card's measured copy bandwidth;
* compute: the step's matmul FLOPs (projections, attention, MLP, the routed experts, the LM head and the soft
  embedding, 2 x N x V x H each) over the card's measured bf16 matmul rate.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

PUBLISHED_TEXT = dict(vocab_size=262144, hidden_size=2816, intermediate_size=2112, num_attention_heads=16,
                      num_key_value_heads=8, head_dim=256, global_head_dim=512, num_global_key_value_heads=2,
                      sliding_window=1024, num_experts=128, top_k_experts=8, moe_intermediate_size=704)
SMOKE_TEXT = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, global_head_dim=32, num_global_key_value_heads=1, sliding_window=16, num_experts=8,
                  top_k_experts=2, moe_intermediate_size=32)


def config(text: dict, layers: int, canvas: int):
    from dllm_jax.config import ModelConfig

    types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(layers)]
    types[-1] = "full_attention"
    return ModelConfig.from_hf_dict({"architectures": ["DiffusionGemmaForBlockDiffusion"], "canvas_length": canvas,
                                     "tie_word_embeddings": True,
                                     "text_config": dict(text, num_hidden_layers=layers, layer_types=types)})


def floors(cfg, rows: int, prefix: int, itemsize: int = 2) -> dict:
    """(bytes, flops) a step needs at least: see the module docstring."""
    C, H, V = cfg.block_size, cfg.hidden_size, cfg.vocab_size
    n = rows * C
    weight_bytes = kv_bytes = flops = 0
    for i in range(cfg.num_layers):
        D, kv = cfg.layer_head_dim(i), cfg.layer_kv_heads(i)
        q, k = cfg.num_heads * D, kv * D
        v = k if cfg.is_sliding_layer(i) else 0
        attn = H * (q + k + v) + q * H
        dense = 3 * H * cfg.intermediate_size
        touched = min(cfg.num_experts, n * cfg.num_experts_per_tok)
        experts = touched * 3 * H * cfg.moe_intermediate_size
        weight_bytes += (attn + dense + experts + H * cfg.num_experts) * itemsize
        keys = min(prefix, cfg.sliding_window - 1) if cfg.is_sliding_layer(i) else prefix
        kv_bytes += rows * keys * (k + v if v else k) * itemsize
        flops += 2 * n * (attn + dense + cfg.num_experts_per_tok * 3 * H * cfg.moe_intermediate_size + H * cfg.num_experts)
        flops += 2 * 2 * n * (keys + C) * q  # scores and values
    head_bytes = 2 * V * H * itemsize  # the head (tied: the embedding) read by the logits and by the soft embedding
    head_flops = 2 * 2 * n * V * H
    return dict(bytes=weight_bytes + kv_bytes + head_bytes, flops=flops + head_flops, head_bytes=head_bytes,
                head_flops=head_flops)


def run(*, smoke: bool, layers: int, prefix: int, batches, backends, iters: int) -> dict:
    from bench.roofline import ceilings
    from dllm_jax.decode import renoise
    from dllm_jax.model import gemma
    from dllm_jax.model.params import init_params

    text = SMOKE_TEXT if smoke else PUBLISHED_TEXT
    canvas = 16 if smoke else 256
    cfg = config(text, layers, canvas)
    dtype = jnp.float32 if smoke else jnp.bfloat16
    params = init_params(cfg, jax.random.PRNGKey(0), dtype)
    rcfg = renoise.RenoiseConfig(max_denoising_steps=48)
    ceil = ceilings(dtype) if jax.default_backend() == "gpu" else None
    rows_out = []
    page = 16
    for rows in batches:
        width = -(-prefix // page)
        tables = {k: jnp.asarray(1 + np.arange(rows * width, dtype=np.int32).reshape(rows, width))
                  for k in (gemma.SLIDING_KIND, gemma.FULL_KIND)}
        pool = gemma.init_kv_pages(cfg, {gemma.SLIDING_KIND: rows * width + 1, gemma.FULL_KIND: rows * width + 1},
                                   page, dtype)
        tokens = jax.random.randint(jax.random.PRNGKey(1), (rows, prefix), 0, cfg.vocab_size)
        pool = jax.jit(gemma.encode_chunk, static_argnums=1)(params, cfg, tokens, jnp.zeros(rows, jnp.int32),
                                                             jnp.full((rows,), prefix, jnp.int32), pool, tables)
        seeds = jnp.arange(rows, dtype=jnp.uint32)
        for backend in backends:
            state = renoise.initial_state(cfg, rcfg, seeds, jnp.zeros(rows, jnp.int32), dtype)
            step = jax.jit(lambda st, pool, backend=backend: renoise.denoise_step(
                params, cfg, rcfg, st, seeds, jnp.zeros(rows, jnp.int32), jnp.full((rows,), prefix, jnp.int32),
                pool, tables, backend=backend))
            try:
                t0 = time.perf_counter()
                jax.block_until_ready(step(state, pool))
                compile_s = time.perf_counter() - t0
                times = []
                for _ in range(iters):
                    t0 = time.perf_counter()
                    jax.block_until_ready(step(state, pool))
                    times.append(time.perf_counter() - t0)
            except Exception as e:  # a backend this platform cannot run (pallas off a GPU): say so, go on
                rows_out.append(dict(rows=rows, backend=backend, error=f"{type(e).__name__}: {e}"[:300]))
                continue
            f = floors(cfg, rows, prefix, jnp.dtype(dtype).itemsize)
            row = dict(rows=rows, backend=backend, layers=layers, prefix=prefix, step_ms=1e3 * statistics.median(times),
                       compile_s=compile_s, floor_bytes=f["bytes"], floor_flops=f["flops"])
            if ceil is not None:
                mem_ms = 1e3 * f["bytes"] / ceil["copy_bytes_per_s"]  # (the copy rate counts bytes read + written)
                cmp_ms = 1e3 * f["flops"] / ceil["matmul_flops"]
                row.update(memory_floor_ms=mem_ms, compute_floor_ms=cmp_ms,
                           wall_over_floor=row["step_ms"] / max(mem_ms, cmp_ms))
            rows_out.append(row)
            print(json.dumps(row), flush=True)
    return dict(config={k: getattr(cfg, k) for k in ("hidden_size", "vocab_size", "num_layers", "block_size")},
                ceilings=ceil, rows=rows_out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--prefix", type=int, default=None)
    p.add_argument("--batches", default=None, help="rows (canvases) per step, comma separated (default 1,8)")
    p.add_argument("--backends", default="pallas,xla")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", default="renoise_gpu.json")
    a = p.parse_args(argv)
    batches = [int(x) for x in (a.batches or ("1,2" if a.smoke else "1,8")).split(",")]
    prefix = a.prefix or (64 if a.smoke else 4096)
    result = run(smoke=a.smoke, layers=2 if a.smoke else a.layers, prefix=prefix, batches=batches,
                 backends=a.backends.split(","), iters=2 if a.smoke else a.iters)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2)
    for r in result["rows"]:
        if "error" in r:
            print(f"rows {r['rows']} {r['backend']}: {r['error']}")
        else:
            floor = f", wall/floor {r['wall_over_floor']:.2f}" if "wall_over_floor" in r else ""
            print(f"rows {r['rows']:3d} {r['backend']:6s} step {r['step_ms']:9.2f} ms ({r['layers']} layers){floor}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
