"""``python -m bench cpu_matmul``: XLA:CPU's float32 matmul at the row counts a denoise step has (32-64 rows),
against torch on the same cores, under each XLA:CPU option jaxlib offers, and with the projections fused.

Each configuration runs in its own process (``XLA_FLAGS`` is read once per process); each process times
``[M, K] x [K, N]`` for the shapes of a step (the random 50M model: hidden 512, MLP 1536, q/k/v 512/256/256) and
the fused formulations (q|k|v as one ``[K, 1024]`` matmul, gate|up as one ``[K, 3072]``) against the separate
ones. torch's rate on the same shapes is the yardstick. The table says which options are faster; the engine
adopts only what measures faster here (see bench/RESULTS.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from bench.common import Ctx, table

# (label, XLA_FLAGS): the options of jaxlib 0.10.2's CPU backend that change how a dot runs
CONFIGS = [
    ("default", ""),
    ("no thunk runtime", "--xla_cpu_use_thunk_runtime=false"),
    ("oneDNN", "--xla_cpu_use_onednn=true"),
    ("XNNPACK", "--xla_cpu_use_xnnpack=true"),
    ("XNN graph fusion", "--xla_cpu_experimental_xnn_graph_fusion_mode=XNN_GRAPH_FUSION_MODE_GREEDY"),
    # jaxlib 0.10.2 runs dots through YNNPACK by default; an empty fusion-type list hands every dot to Eigen
    ("YNNPACK off (Eigen dots)", "--xla_cpu_experimental_ynn_fusion_type="),
    ("no multi-thread Eigen", "--xla_cpu_multi_thread_eigen=false"),
]
SHAPES = [(32, 512, 1536), (64, 512, 1536), (32, 512, 512), (1024, 512, 1536)]

_CHILD = r"""
import json, os, statistics, sys, time
import numpy as np
import jax, jax.numpy as jnp
jax.config.update("jax_default_matmul_precision", "highest")
shapes, reps = json.loads(sys.argv[1]), int(sys.argv[2])
rng = np.random.default_rng(0)

def rate(f, args, flops):
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter(); jax.block_until_ready(f(*args)); ts.append(time.perf_counter() - t0)
    return flops / statistics.median(ts) / 1e9

out = {"plain": {}, "fused": {}}
for m, k, n in shapes:
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)
    out["plain"][f"{m}x{k}x{n}"] = rate(jax.jit(lambda a, b: a @ b), (x, w), 2 * m * k * n)
# a layer's projections at 32 rows: separate vs fused
m, h, q, kv, f = 32, 512, 512, 256, 1536
x = jnp.asarray(rng.standard_normal((m, h)), jnp.float32)
ws = [jnp.asarray(rng.standard_normal((h, n)), jnp.float32) for n in (q, kv, kv, f, f)]
fused_qkv, fused_gu = jnp.concatenate(ws[:3], 1), jnp.concatenate(ws[3:], 1)
flops = 2 * m * h * (q + 2 * kv + 2 * f)
out["fused"]["separate"] = rate(jax.jit(lambda a, *w: [a @ wi for wi in w]), (x, *ws), flops)
out["fused"]["fused"] = rate(jax.jit(lambda a, w1, w2: (a @ w1, a @ w2)), (x, fused_qkv, fused_gu), flops)
print("RESULT " + json.dumps(out))
"""


_TORCH_CHILD = r"""
import json, statistics, sys, time
import torch
shapes, reps = json.loads(sys.argv[1]), int(sys.argv[2])
out = {}
for m, k, n in shapes:
    x, w = torch.randn(m, k), torch.randn(k, n)
    for _ in range(10):
        x @ w
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter(); x @ w; ts.append(time.perf_counter() - t0)
    out[f"{m}x{k}x{n}"] = 2 * m * k * n / statistics.median(ts) / 1e9
print("RESULT " + json.dumps(out))
"""


def _child(code: str, flags: str, reps: int) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags)
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(SHAPES), str(reps)], env=env, capture_output=True,
                          text=True, timeout=600)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(line[0][7:]) if line else {"error": proc.stderr.strip().splitlines()[-1:]}


def cpu_matmul(ctx: Ctx) -> dict:
    reps = 50 if ctx.quick else 200
    results = {}
    for label, flags in CONFIGS:
        results[label] = _child(_CHILD, flags, reps)
    torch_rates = _child(_TORCH_CHILD, "", reps)
    keys = [f"{m}x{k}x{n}" for m, k, n in SHAPES]
    rows = [["torch", *[torch_rates[k] for k in keys], "-", "-"]]
    for label, r in results.items():
        if "error" in r:
            rows.append([label, *["error"] * len(keys), str(r["error"])[:40], "-"])
            continue
        rows.append([label, *[r["plain"][k] for k in keys], r["fused"]["separate"], r["fused"]["fused"]])
    text = table("cpu_matmul: float32 GFLOP/s per shape (M x K x N), XLA:CPU options vs torch; a layer's "
                 "projections at 32 rows separate vs fused (q|k|v, gate|up)",
                 ["config", *keys, "separate", "fused"], rows)
    from bench.scenarios import finish

    return finish(ctx, "cpu_matmul", {"xla": results, "torch": torch_rates, "configs": CONFIGS}, text)
