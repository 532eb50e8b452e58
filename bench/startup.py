"""``python -m bench startup``: how long ``dllm-jax serve`` takes to answer, cold and with a warm compilation cache.

For each model, two starts of the same command (same model, same flags) against one fresh compilation-cache
directory: the first compiles every shape bucket and stores the executables, the second loads them. Measured
from process start to the first ``200`` from ``/health`` (the server answers only after its warm-up), each
start in its own process. Beside it, the bare process start (``python -c "import jax, dllm_jax"``) as the
floor no cache can remove. Target: the second start at most 1/3 of the first.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time

from bench import plots
from bench.common import Ctx, table

TARGET_RATIO = 1 / 3


def _env(cache_dir: str) -> dict:
    env = dict(os.environ, DLLM_JAX_COMPILATION_CACHE=cache_dir, TOKENIZERS_PARALLELISM="false")
    env.pop("XLA_FLAGS", None)
    return env


def time_to_health(model_path: str, cache_dir: str, extra: list[str], timeout: float = 900) -> dict:
    """Seconds from starting ``python -m serve`` to its first healthy answer; the lines of ours it printed."""
    from serve.launch import ServerProcess

    server = ServerProcess(["--model-path", model_path, "--log-level", "info", "--no-access-log", *extra],
                           env=_env(cache_dir), startup_timeout=timeout).start()
    try:
        seconds = server.wait_healthy()
    finally:
        server.stop()
    lines = [line for line in server.output().splitlines() if line.startswith("dllm-jax: ")]
    return {"seconds": seconds, "lines": lines}


def bare_start() -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import jax, dllm_jax; jax.devices()"], check=True, env=_env("off"))
    return time.perf_counter() - t0


def startup(ctx: Ctx) -> dict:
    names = [n for n in (("shipped",) if ctx.quick else ("shipped", "random50m")) if n in ctx.models]
    floor = bare_start()
    rows, runs = [], []
    for name in names:
        m = ctx.model(name)
        extra = ["--max-running-requests", "8"] if ctx.quick else []
        cache_dir = tempfile.mkdtemp(prefix="dllm-bench-startup-")
        try:
            first = time_to_health(m.path, cache_dir, extra)
            second = time_to_health(m.path, cache_dir, extra)
        finally:
            shutil.rmtree(cache_dir, ignore_errors=True)
        ratio = second["seconds"] / first["seconds"]
        runs.append({"model": name, "label": m.label, "first_s": first["seconds"], "second_s": second["seconds"],
                     "ratio": ratio, "first_lines": first["lines"], "second_lines": second["lines"],
                     "flags": extra})
        rows.append([m.label, first["seconds"], second["seconds"], ratio, second["seconds"] / floor])
        ctx.target(f"startup [{name}]: second start / first start (time to first /health)", ratio, TARGET_RATIO,
                   higher_is_better=False, note=f"{first['seconds']:.1f} s cold, {second['seconds']:.1f} s warm; "
                                                f"bare process start {floor:.1f} s")
    text = table(f"startup: process start to first /health (bare `import jax, dllm_jax`: {floor:.2f} s)",
                 ["model", "first s", "second s", "second/first", "second/bare"], rows)
    result = {"bare_start_s": floor, "runs": runs}

    def plot(path):
        return plots.bars(path, "dllm-jax serve: process start to first /health",
                          [(f"{r['label']}: seconds", ["cold", "warm cache", "bare start"], [r["first_s"], r["second_s"], floor])
                           for r in runs])

    from bench.scenarios import finish

    return finish(ctx, "startup", result, text, plot)
