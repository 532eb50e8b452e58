"""``python -m bench weight_update``: how long an in-place weight update takes, and what memory it adds (issue 38).

Through the engine's own methods (``update_weights_from_disk`` / ``update_weights_from_tensor``: checks, placement,
the cache flush), on two models:

* **shipped**: an engine that has served requests; from disk (its HF directory, and a ``dllm-jax convert`` output),
  from tensors (host numpy arrays named as in the checkpoint, and device arrays named by our paths, as an RL trainer
  in the same process holds them); the compile counter around every update (expected: 0);
* **sdar-1.7b**: a random checkpoint in the published layout at the SDAR-1.7B shape (``--weight-update-layers``
  layers, default 28; bfloat16 as on an accelerator), the same four updates on an engine that loaded it (no request
  served: an update needs no compiled step).

Each figure is the median of ``--weight-update-repeats`` updates (the page cache warm). The extra memory is the
process's peak RSS during the update (``VmHWM``, reset before it) minus its RSS before: on CPU the device arrays are
host memory, so this counts the new leaves in flight and any host copy, against the largest tensor's bytes;
from disk it also counts the checkpoint's mapped pages in flight (file-backed, released job by job).

After the updates each engine releases its memory (``release_memory_occupation(["weights", "kv_cache"])``) and
resumes it: the device's bytes in use (the allocator's count, or the live JAX arrays where it keeps none, as on CPU),
the live arrays and the process's RSS before, after the release and after the resume, and the compiles around both.
On CPU the released weights are kept as a host copy, so the RSS does not fall by their size: the device count does.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time

from bench.common import Ctx, table

MIB = 1 << 20


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) * 1024
    return out


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux)
    except OSError:
        pass


def _measure(update, repeats: int) -> dict:
    from dllm_jax.engine.compilation import compiled_executables

    seconds, extra = [], []
    compiles = compiled_executables()
    for _ in range(repeats):
        before = _status()["VmRSS"]
        _reset_peak()
        t0 = time.perf_counter()
        update()
        seconds.append(time.perf_counter() - t0)
        extra.append(_status()["VmHWM"] - before)
    return {"median_s": statistics.median(seconds), "min_s": min(seconds), "extra_peak_bytes": max(extra),
            "compiles": compiled_executables() - compiles}


def _updates(engine, hf_dir: str, converted_dir: str | None, repeats: int) -> dict:
    """The four updates (each back to the same weights, so the engine's answers do not change)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from dllm_jax.model.checkpoint_names import params_to_hf
    from dllm_jax.model.params import key_path, path_name

    out = {"disk (HF layout)": _measure(lambda: engine.update_weights_from_disk(hf_dir), repeats)}
    if converted_dir is not None:
        out["disk (converted)"] = _measure(lambda: engine.update_weights_from_disk(converted_dir), repeats)
    # copies of their own (a view of a live leaf would keep the old buffer alive past the update)
    host = {name: np.array(a) for name, a in params_to_hf(engine.runner.params, engine.config).items()}
    out["tensors (numpy, HF names)"] = _measure(lambda: engine.update_weights_from_tensor(host), repeats)
    del host
    device = jax.block_until_ready({path_name(key_path(p)): jnp.copy(x)
                                    for p, x in jax.tree_util.tree_flatten_with_path(engine.runner.params)[0]})
    out["tensors (JAX arrays, our names)"] = _measure(lambda: engine.update_weights_from_tensor(device), repeats)
    return out


def weight_update(ctx: Ctx) -> dict:
    import dllm_jax
    from bench import load as load_bench
    from bench.scenarios import finish
    from dllm_jax.model.loader import convert_checkpoint
    from dllm_jax.testing.published import checkpoint_bytes

    repeats = ctx.size("weight_update_repeats", 5, 3)
    result, rows = {"repeats": repeats, "models": {}}, []
    tmp = tempfile.mkdtemp(prefix="dllm-bench-weights-")
    try:
        m = ctx.model("shipped")
        engine = dllm_jax.Engine(m.path, max_running_requests=4, context_length=256, num_kv_pages=32)
        engine.generate(["Count up 5 steps from 3.", "Repeat 2 times: red"], {"max_new_tokens": 32})
        converted = os.path.join(tmp, "shipped-converted")
        convert_checkpoint(m.path, converted)
        largest = max(x.nbytes for x in _leaves(engine))
        result["models"]["shipped"] = {"bytes": checkpoint_bytes(m.path), "largest_tensor_bytes": largest,
                                       "updates": _updates(engine, m.path, converted, repeats),
                                       "occupation": _occupation(engine)}
        engine.shutdown()
        layers = ctx.size("weight_update_layers", 28, 4)
        if layers:
            path, _ = load_bench.checkpoint(ctx, "sdar-1.7b", layers)
            ctx.log(f"weight_update: engine on the {layers}-layer SDAR-1.7B shape (bfloat16)")
            engine = dllm_jax.Engine(path, dtype="bfloat16", max_running_requests=1, context_length=512,
                                     num_kv_pages=16)
            largest = max(x.nbytes for x in _leaves(engine))
            result["models"][f"sdar-1.7b ({layers} layers, bf16)"] = {
                "bytes": checkpoint_bytes(path), "largest_tensor_bytes": largest,
                "updates": _updates(engine, path, None, repeats), "occupation": _occupation(engine)}
            engine.shutdown()
            if not ctx.overrides.get("load_keep"):
                load_bench.cleanup(ctx)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for name, res in result["models"].items():
        for kind, r in res["updates"].items():
            rows.append([name, f"{res['bytes'] / MIB:.1f}", kind, r["median_s"] * 1e3, r["min_s"] * 1e3,
                         f"{r['extra_peak_bytes'] / MIB:.1f}", f"{res['largest_tensor_bytes'] / MIB:.1f}",
                         r["compiles"]])
    text = table("weight_update: in-place updates through the engine (median of repeats; memory: peak RSS during "
                 "the update minus RSS before)",
                 ["model", "MiB", "update", "median ms", "min ms", "extra peak MiB", "largest tensor MiB",
                  "compiles"], rows)
    occ_rows = [[name, stage] + [f"{res['occupation'][stage][k] / MIB:.1f}" for k in _MEMORY_KEYS]
                + [res["occupation"]["compiles"]]
                for name, res in result["models"].items() for stage in _STAGES]
    text += "\n" + table("release / resume memory occupation (weights and KV pool; MiB)",
                         ["model", "when", "device in use", "live arrays", "host RSS", "compiles"], occ_rows)
    return finish(ctx, "weight_update", result, text)


_STAGES = ("before", "after release", "after resume")
_MEMORY_KEYS = ("device_bytes_in_use", "live_array_bytes", "host_rss_bytes")


def _occupation(engine) -> dict:
    """Release both tags and resume them: the memory at each stage and the compiles around both."""
    from dllm_jax.engine.compilation import compiled_executables

    compiles = compiled_executables()
    released = engine.release_memory_occupation(["weights", "kv_cache"])
    resumed = engine.resume_memory_occupation(["weights", "kv_cache"])
    return {"before": released["memory_before"], "after release": released["memory_after"],
            "after resume": resumed["memory_after"], "compiles": compiled_executables() - compiles}


def _leaves(engine):
    import jax

    return jax.tree.leaves(engine.runner.params)
