"""``python -m bench invariance``: how often a greedy output depends on the batch it ran in, and why.

Each prompt runs twice through engines that differ only in how many requests share a denoise step: alone
(``max_running_requests=1``) and eight at a time (``max_running_requests=8``, default power-of-two row buckets).
Decisions compare exact float32 scores (no coarsening), so two runs can differ only where the forward itself is
not bitwise batch-invariant. Reported on:

* random 2-layer Qwen3 checkpoints (the shipped model's width: hidden 128, MLP 384, whose matmuls are not
  row-invariant on XLA:CPU; vocab 512, weights scaled so logits are far from flat), B = 4 and B = 32,
  100 prompts of random tokens (a third with literal mask ids); with a source checkout, every differing output is
  classified by the float64 oracle of ``tests/oracle.py`` (allowed only after a near-tie, relative margin < 1e-5);
* the shipped model on held-out prompts (its own chat template), B = 32, threshold 0.9.

And the op that makes the forward batch-dependent on XLA:CPU: a float32 matmul ``[M, K] x [K, N]`` whose row 0
changes with ``M`` (the CPU GEMM picks its blocking by shape), beside the batch-invariant formulation that
computes fixed tiles of ``T`` rows as a batched matmul against a broadcast weight, and what it costs.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

import numpy as np

from bench.common import Ctx, chat_prompts, table

RANDOM_MASK_ID = 63
RANDOM_VOCAB = 512


def _random_checkpoint(out_dir: str, block: int, seed: int) -> str:
    import jax

    from dllm_jax.config import ModelConfig
    from dllm_jax.model.converted import save_hf
    from dllm_jax.model.params import init_params

    cfg = ModelConfig(vocab_size=RANDOM_VOCAB, hidden_size=128, intermediate_size=384, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=32, max_position_embeddings=512, mask_token_id=RANDOM_MASK_ID,
                      block_size=block, eos_token_ids=(1,))
    save_hf(init_params(cfg, jax.random.PRNGKey(seed), std=0.5), cfg, out_dir)
    return out_dir


def _random_prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p = [int(t) for t in rng.integers(2, RANDOM_VOCAB, size=int(rng.integers(1, 41)))]
        p = [t if t != RANDOM_MASK_ID else t + 1 for t in p]
        if i % 3 == 0:
            for j in rng.choice(len(p), size=1 + len(p) // 6, replace=False):
                p[j] = RANDOM_MASK_ID
        out.append(p)
    return out


def _outputs(path: str, prompts, params: dict, rows: int, **kw) -> list[list[int]]:
    from dllm_jax import Engine

    engine = Engine(path, max_running_requests=rows, **kw)
    try:
        if rows == 1:
            return [engine.generate(input_ids=p, sampling_params=params)["output_ids"] for p in prompts]
        return [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
    finally:
        engine.shutdown()


def _oracle(path: str):
    """tests/oracle.py's float64 reference, when this is a source checkout (None otherwise)."""
    tests = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
    if not os.path.isfile(os.path.join(tests, "oracle.py")):
        return None
    sys.path.insert(0, tests)
    try:
        from oracle import Oracle
    finally:
        sys.path.remove(tests)
    return Oracle(path)


def matmul_probe(shapes=((128, 384), (128, 768), (512, 1536)), tile: int = 32, reps: int = 20) -> list[dict]:
    """Row 0 of ``x[:M] @ W`` vs ``M`` for plain and tiled matmuls, and their time at M = 512 and 32."""
    import jax
    import jax.numpy as jnp

    def tiled(a, w):
        m, k = a.shape
        return jnp.einsum("btk,bkn->btn", a.reshape(m // tile, tile, k),
                          jnp.broadcast_to(w, (m // tile,) + w.shape)).reshape(m, -1)

    def timed(f, *args) -> float:
        f(*args).block_until_ready()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            f(*args).block_until_ready()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts) * 1e3

    rng = np.random.default_rng(0)
    rows = []
    for k, n in shapes:
        w = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)
        x = rng.standard_normal((1024, k)).astype(np.float32)
        for name, fn in (("plain", lambda a, b: a @ b), ("tiled", tiled)):
            f = jax.jit(fn)
            ref = np.asarray(f(jnp.asarray(x[:tile]), w))[0]
            differ = [m for m in (64, 128, 256, 512, 1024)
                      if not np.array_equal(np.asarray(f(jnp.asarray(x[:m]), w))[0], ref)]
            rows.append({"K": k, "N": n, "formulation": name, "row0_differs_at_M": differ,
                         "ms_M512": timed(f, jnp.asarray(x[:512]), w), "ms_M32": timed(f, jnp.asarray(x[:tile]), w)})
    return rows


def invariance(ctx: Ctx) -> dict:
    n_random = 20 if ctx.quick else 50
    results, rows = [], []
    greedy = {"temperature": 0, "ignore_eos": True}
    with tempfile.TemporaryDirectory(prefix="dllm-bench-inv-") as tmp:
        for block in (4, 32):
            path = _random_checkpoint(os.path.join(tmp, f"b{block}"), block, seed=block)
            prompts = _random_prompts(n_random, seed=block)
            params = dict(greedy, max_new_tokens=3 * block if block == 4 else 40)
            kw = dict(context_length=128 if block == 32 else 64, algorithm_config={"threshold": 0.9})
            alone, batched = _outputs(path, prompts, params, 1, **kw), _outputs(path, prompts, params, 8, **kw)
            differ = [i for i, (a, b) in enumerate(zip(alone, batched)) if a != b]
            oracle = _oracle(path) if differ else None
            classified = "n/a (no difference)" if not differ else "oracle not available"
            if oracle is not None:
                near = 0
                for i in differ:  # raises on a difference that is not after a near-tie
                    va = oracle.verify(prompts[i], alone[i], params["max_new_tokens"], config={"threshold": 0.9})
                    vb = oracle.verify(prompts[i], batched[i], params["max_new_tokens"], config={"threshold": 0.9})
                    near += bool(va.near_tie_blocks or vb.near_tie_blocks)
                classified = f"{near}/{len(differ)} after a near-tie"
            results.append({"model": f"random B={block}", "prompts": len(prompts), "differ": len(differ),
                            "differing_prompts": differ, "classified": classified})
            rows.append([f"random 2-layer, B={block}", len(prompts), len(differ), len(differ) / len(prompts),
                         classified])
        m = ctx.model("shipped")
        prompts = chat_prompts(m.tokenizer, 40 if ctx.quick else 100)
        params = {"temperature": 0, "max_new_tokens": 128}
        kw = dict(context_length=256, algorithm_config={"threshold": 0.9})
        alone, batched = _outputs(m.path, prompts, params, 1, **kw), _outputs(m.path, prompts, params, 8, **kw)
        differ = [i for i, (a, b) in enumerate(zip(alone, batched)) if a != b]
        results.append({"model": "shipped", "prompts": len(prompts), "differ": len(differ),
                        "differing_prompts": differ})
        rows.append([m.label + " (held-out)", len(prompts), len(differ), len(differ) / len(prompts), "-"])
    probe = matmul_probe()
    text = table("invariance: greedy outputs alone vs 8 per step (LowConfidence 0.9)",
                 ["model", "prompts", "differ", "rate", "classified (float64 oracle)"], rows)
    text += "\n" + table("XLA:CPU f32 matmul: row 0 of x[:M] @ W changes with M? (tiles of 32 rows)",
                         ["K", "N", "formulation", "row 0 differs at M", "ms M=512", "ms M=32"],
                         [[r["K"], r["N"], r["formulation"], str(r["row0_differs_at_M"]), r["ms_M512"], r["ms_M32"]]
                          for r in probe])
    from bench.scenarios import finish

    return finish(ctx, "invariance", {"runs": results, "matmul_probe": probe}, text)
