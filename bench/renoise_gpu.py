"""One Gemma4Renoise denoising step at the DiffusionGemma-26B-A4B shape, beside its memory and compute floors.

    python -m bench.renoise_gpu [--layers 6] [--out renoise_gpu.json]   # a GPU (bf16, random weights)
    python -m bench.renoise_gpu --smoke                                  # anywhere: tiny shapes
    python -m bench.renoise_gpu --check [--smoke] [--out renoise_kernels.json]  # the kernel vs its references

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

``--check``: the fused vocabulary pass compiled for real (``pallas``; with ``--smoke`` off a GPU, interpret mode)
and the streaming XLA loop against the materialised reference (float32 logits at the highest matmul precision, the
same bf16 inputs) at the published vocabulary, hidden size and canvas (2 canvases), in each variant the engine
compiles: plain, with penalty tables, with the top-20 logprobs. A decision (argmax, sample, top-k ids) must agree
wherever the reference separates it by more than ``1e-3`` (closer ones are float32 accumulation-order ties);
entropy, logprob, the soft embedding and the top-k logprobs within ``1e-3`` relative.
"""

from __future__ import annotations

import argparse
import functools
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

CHECK_TOL = 1e-3


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


def _tables(rows: int, vocab: int, canvas: int, width: int, rng):
    """Random sorted penalty tables (repetition factors, additive deltas, masked stop ids), one per canvas."""
    from pallas_kernels.renoise_adjust import PAD_ID, Adjust

    ids = np.full((rows, width), int(PAD_ID), np.int64)
    rep, add = np.ones((rows, width), np.float32), np.zeros((rows, width), np.float32)
    until = np.zeros((rows, width), np.int32)
    for r in range(rows):
        k = width - 3 * r
        ids[r, :k] = np.sort(rng.choice(vocab, k, replace=False))
        rep[r, :k] = rng.uniform(0.5, 2.0, k)
        add[r, :k] = rng.uniform(-3, 3, k)
        until[r, :k] = np.where(rng.random(k) < 0.2, rng.integers(0, canvas + 1, k), 0)
    return Adjust(jnp.asarray(ids.astype(np.int32)), jnp.asarray(rep), jnp.asarray(add), jnp.asarray(until))


def check_kernels(*, smoke: bool) -> dict:
    """The ``--check`` comparison (module doc): per variant and implementation, the decisions that differ where
    the reference separates them clearly, the relative errors, and whether it passes."""
    from dllm_jax.decode.rows import MAX_TOP_LOGPROBS
    from pallas_kernels import renoise as R

    text = SMOKE_TEXT if smoke else PUBLISHED_TEXT
    V, H, C, rows = text["vocab_size"], text["hidden_size"], 16 if smoke else 256, 2
    n = rows * C
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.normal(0, 1, (n, H)), jnp.bfloat16)
    embed = jnp.asarray(rng.normal(0, 0.05, (V, H)), jnp.bfloat16)
    temps = jnp.asarray(np.repeat(rng.uniform(0.4, 0.8, rows), C), jnp.float32)
    keys = R.draw_key(7, jnp.arange(n) // C, 5, jnp.arange(n) % C)
    gpu = jax.default_backend() == "gpu"
    impls = {"pallas" if gpu else "pallas_interpret": functools.partial(R.renoise_stats_pallas, interpret=not gpu),
             "xla": R.renoise_stats_streaming}
    variants = {"plain": (None, 0), "penalties": (_tables(rows, V, C, 32, rng), 0), "top_k": (None, MAX_TOP_LOGPROBS)}
    out = {"shape": dict(vocab=V, hidden=H, canvas=C, rows=rows, dtype="bfloat16"), "platform": jax.default_backend(),
           "results": []}
    for vname, (adjust, top_k) in variants.items():
        kw = dict(softcap=30.0, vocab_major=True, embed_scale=H ** 0.5, adjust=adjust, row_len=C, top_k=top_k)
        with jax.default_matmul_precision("highest"):
            ref = jax.block_until_ready(R.renoise_stats_reference(hidden, embed, embed, temps, keys, **kw))
            z = R.process_logits(R._logits(hidden, embed, True), temps, 30.0, adjust, 0, C)
            scores = z + R.gumbel(keys, jnp.arange(V, dtype=jnp.int32))
            zt = jax.lax.top_k(z, max(2, top_k + 1))[0]
            margin = np.asarray(jnp.minimum(zt[:, 0] - zt[:, 1], jnp.diff(-jax.lax.top_k(scores, 2)[0], axis=1)[:, 0]))
            top_gap = np.asarray(jnp.min(-jnp.diff(zt, axis=1), axis=1)) if top_k else np.ones(n)
            del z, scores
        clear, sure = margin > CHECK_TOL, top_gap > CHECK_TOL
        for iname, fn in impls.items():
            row = dict(variant=vname, impl=iname)
            try:
                t0 = time.perf_counter()
                got = jax.block_until_ready(fn(hidden, embed, embed, temps, keys, **kw))
                row["first_call_s"] = time.perf_counter() - t0
            except Exception as e:  # the kernel failed to compile or run: the check fails, saying why
                row.update(error=f"{type(e).__name__}: {e}"[:400], passed=False)
                out["results"].append(row)
                print(json.dumps(row), flush=True)
                continue
            differ = {f: int(np.sum((np.asarray(getattr(got, f)) != np.asarray(getattr(ref, f))) & clear))
                      for f in ("argmax", "sample")}
            rel = {f: _rel_err(getattr(got, f), getattr(ref, f)) for f in ("entropy", "logprob", "soft")}
            if top_k:
                differ["top_ids"] = int(np.sum(np.any(np.asarray(got.top_ids) != np.asarray(ref.top_ids), -1) & sure))
                rel["top_logprob"] = _rel_err(got.top_logprob, ref.top_logprob)
            row.update(clear_fraction=float(clear.mean()), differ_where_clear=differ, rel_err=rel,
                       passed=bool(clear.mean() > 0.9 and not any(differ.values())
                                   and all(v < CHECK_TOL for v in rel.values())))
            out["results"].append(row)
            print(json.dumps(row), flush=True)
    out["passed"] = all(r["passed"] for r in out["results"])
    return out


def _rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    finite = np.isfinite(want)
    if not np.array_equal(finite, np.isfinite(got)):
        return float("inf")
    scale = max(np.max(np.abs(want[finite]), initial=0.0), 1e-30)
    return float(np.max(np.abs(got - want)[finite], initial=0.0) / scale)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--check", action="store_true", help="the fused pass's kernel vs its references (module doc)")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--prefix", type=int, default=None)
    p.add_argument("--batches", default=None, help="rows (canvases) per step, comma separated (default 1,8)")
    p.add_argument("--backends", default=None, help="default: pallas,xla (pallas_interpret,xla off a GPU)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", default="renoise_gpu.json")
    a = p.parse_args(argv)
    if a.check:
        result = check_kernels(smoke=a.smoke)
        with open(a.out, "w") as f:
            json.dump(result, f, indent=2)
        for r in result["results"]:
            print(f"renoise kernel check {r['variant']:9s} {r['impl']:16s}: "
                  + (r["error"] if "error" in r else f"decisions differing where clear {r['differ_where_clear']}, "
                     f"rel err {', '.join(f'{k} {v:.1e}' for k, v in r['rel_err'].items())}")
                  + f" -> {'PASS' if r['passed'] else 'FAIL'}")
        return 0 if result["passed"] else 1
    batches = [int(x) for x in (a.batches or ("1,2" if a.smoke else "1,8")).split(",")]
    prefix = a.prefix or (64 if a.smoke else 4096)
    result = run(smoke=a.smoke, layers=2 if a.smoke else a.layers, prefix=prefix, batches=batches,
                 backends=(a.backends or ("pallas,xla" if jax.default_backend() == "gpu" else "pallas_interpret,xla")
                           ).split(","), iters=2 if a.smoke else a.iters)
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
