"""``load`` and ``bf16`` scenarios (issue 17): a checkpoint in the published SDAR layout at the SDAR-1.7B shape.

``load``: a random checkpoint with the SDAR-1.7B shape (Qwen3-1.7B: 28 layers, hidden 2048, 16 q / 8 KV heads,
head dim 128, MLP 6144, vocab 151,936, tied; 3.2 GiB of bf16 in sharded safetensors, written by
:func:`dllm_jax.testing.published.write_published`), loaded in fresh processes, alternating, ``--load-repeats`` times:

* ``engine``: ``Engine(path, dtype="bfloat16", max_running_requests=1, num_kv_pages=64, context_length=256)``
  (tokenizer, config, weights, KV pool; no compile), with ``load_model`` (tokenizer, config, weights) and the
  weights alone timed inside it, and the process's peak RSS (``VmHWM``) against the checkpoint's bytes; like the
  transformers probe it imports transformers before its timer starts;
* ``transformers``: ``Qwen3ForCausalLM.from_pretrained(path, dtype=torch.bfloat16)``, then one forward of a
  block (transformers maps the safetensors and reads the weights lazily, at the first forward: both times are
  given);
* ``floor``: every byte copied from the mapped files into fresh memory (what any loader that materialises the
  weights pays; the engine's path for tensors used as stored), read with ``pread`` into fresh arrays, and read into
  one reused buffer (the page cache's copy speed);
* ``convert``: ``dllm-jax convert --dtype bfloat16`` (time, peak RSS) and loading the converted directory;
* ``first_generate`` (once): ``Engine(path, dtype="bfloat16", warmup=True)``, a fresh (cold) compilation cache and
  fixed buckets, then one greedy request of 16 tokens: peak RSS through load, warm-up and first generate.

The page cache is warmed first. Targets (issues 17, 39): engine peak RSS <= 1.3x the checkpoint; engine load time
<= transformers ``from_pretrained`` + its first forward; weights' time <= 1.1x the copy floor (matrices are kept
``[out, in]`` as stored, so loading is a copy); peak RSS of load + warm-up + first generate <= 1.3x checkpoint + 1 GiB.

``bf16``: the same shape (``--bf16-layers``, default 28; a random checkpoint of its own with larger init scales,
so predictions are peaked enough for agreement to mean something) decoded in float32 and in bfloat16: token
agreement over ``--bf16-prompts`` chat prompts (one greedy LowConfidence answer of ``--bf16-tokens`` tokens each),
the same agreement for transformers' block-diffusion loop (:mod:`bench.hf_baseline`) on the first
``--bf16-hf-prompts`` of them (what to expect of bf16 on this model), and the engine's denoise step time at 1 and
8 rows against that loop's forward (batch 1) on the same weights in the same dtype.

Checkpoints go to ``--load-dir`` (kept) or a temporary directory (deleted at the end).
"""

from __future__ import annotations

import gc
import json
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from bench.common import Ctx, chat_prompts, fmt, run_requests, table

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = float(1 << 30)
SHARD_BYTES = 1 << 30  # 4 shards at the 1.7B shape, as the published SDAR-1.7B-Chat


# ----------------------------------------------------------------------------------------------
# Checkpoints
# ----------------------------------------------------------------------------------------------

def checkpoint(ctx: Ctx, name: str, layers: int, *, std: float = 0.02, embed_std: float = 0.02) -> tuple[str, bool]:
    """A published-layout SDAR checkpoint at the 1.7B shape with ``layers`` layers; (path, created here)."""
    from dllm_jax.testing import published

    root = ctx.overrides.get("load_dir")
    owned = root is None
    if owned:
        root = ctx._memo.setdefault("load_tmp", tempfile.mkdtemp(prefix="dllm-jax-bench-load-"))
    path = os.path.join(root, f"{name}-L{layers}-std{std:g}-{embed_std:g}")
    marker = os.path.join(path, "BENCH_COMPLETE")
    if not os.path.isfile(marker):
        shutil.rmtree(path, ignore_errors=True)
        ctx.log(f"writing a {layers}-layer SDAR-1.7B-shaped checkpoint to {path}")
        t0 = time.perf_counter()
        published.write_published(path, "sdar", dims=dict(published.SDAR_1P7B_SHAPE, num_hidden_layers=layers),
                                std=std, embed_std=embed_std, max_shard_bytes=SHARD_BYTES)
        open(marker, "w").close()
        ctx.log(f"wrote {published.checkpoint_bytes(path) / GIB:.2f} GiB in {time.perf_counter() - t0:.0f} s")
    return path, owned


def cleanup(ctx: Ctx) -> None:
    tmp = ctx._memo.pop("load_tmp", None)
    if tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)


def warm_page_cache(path: str) -> float:
    t0 = time.perf_counter()
    buf = bytearray(64 << 20)
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            with open(os.path.join(path, f), "rb", buffering=0) as fh:
                while fh.readinto(buf):
                    pass
    return time.perf_counter() - t0


# ----------------------------------------------------------------------------------------------
# Probes: each runs in a fresh process and prints one JSON line
# ----------------------------------------------------------------------------------------------

def _status() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line.split(":")[0]] = int(line.split()[1]) * 1024
    return out


def _import_like_transformers_probe() -> None:
    """Import what the transformers probe imports before its timer starts (the engine reads tokenizers through
    transformers: ~1 s of imports that would otherwise count on the engine's side only)."""
    import jax
    import transformers  # noqa: F401

    jax.devices()


def _probe_engine(path: str) -> dict:
    import jax

    _import_like_transformers_probe()
    from dllm_jax.model import loader

    base = _status()["VmRSS"]
    timings = {}
    original, original_weights = loader.load_model, loader.load_safetensors_params

    def timed_load(*args, **kwargs):
        t = time.perf_counter()
        out = original(*args, **kwargs)
        jax.block_until_ready(out.params)
        timings["load_model_s"] = time.perf_counter() - t
        return out

    def timed_weights(*args, **kwargs):
        t = time.perf_counter()
        out = jax.block_until_ready(original_weights(*args, **kwargs))
        timings["weights_s"] = time.perf_counter() - t
        return out

    loader.load_model, loader.load_safetensors_params = timed_load, timed_weights
    from dllm_jax import Engine

    t0 = time.perf_counter()
    engine = Engine(path, dtype="bfloat16", max_running_requests=1, num_kv_pages=64, context_length=256,
                    compilation_cache="off")
    jax.block_until_ready(engine.runner.params)
    total = time.perf_counter() - t0
    st = _status()
    return dict(timings, engine_init_s=total, base_rss=base, peak_rss=st["VmHWM"], rss=st["VmRSS"])


def _probe_transformers(path: str) -> dict:
    import torch
    import transformers

    base = _status()["VmRSS"]
    t0 = time.perf_counter()
    model = transformers.Qwen3ForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    t1 = time.perf_counter()
    rss_after_load = _status()["VmRSS"]
    with torch.inference_mode():
        model(input_ids=torch.tensor([[1, 2, 3, 4]]), use_cache=False)
        t2 = time.perf_counter()
        model(input_ids=torch.tensor([[1, 2, 3, 4]]), use_cache=False)
        t3 = time.perf_counter()
    st = _status()
    return dict(from_pretrained_s=t1 - t0, first_forward_s=t2 - t1, second_forward_s=t3 - t2, base_rss=base,
                rss_after_load=rss_after_load, peak_rss=st["VmHWM"])


def _probe_floor(path: str) -> dict:
    from dllm_jax.model.safetensors_io import SafetensorsFile, safetensor_files

    files = [SafetensorsFile(p) for p in safetensor_files(path)]
    infos = [(st, name, info) for st in files for name, info in st.tensors.items()]
    t0 = time.perf_counter()
    buf = np.empty(max(i.nbytes for _, _, i in infos), np.uint8)
    for st, name, info in infos:
        st.read_into(name, buf[:info.nbytes])
    reused = time.perf_counter() - t0
    del buf
    t0 = time.perf_counter()
    keep = []
    for st, name, info in infos:  # what the loader does for a tensor used as stored, minus handing it to XLA
        buf = mmap.mmap(-1, max(info.nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        out = np.frombuffer(buf, np.uint8, info.nbytes)
        np.copyto(out, st.view(name).reshape(-1).view(np.uint8))
        st.release(name)
        keep.append(out)
    copied = time.perf_counter() - t0
    del keep
    t0 = time.perf_counter()
    keep = []
    for st, name, info in infos:
        b = np.empty(info.nbytes, np.uint8)
        st.read_into(name, b)
        keep.append(b)
    fresh = time.perf_counter() - t0
    return dict(read_reused_s=reused, copy_fresh_s=copied, read_fresh_s=fresh, peak_rss=_status()["VmHWM"])


def _probe_convert(path: str, out: str) -> dict:
    import jax

    jax.devices()
    from dllm_jax.model.loader import convert_checkpoint

    base = _status()["VmRSS"]
    t0 = time.perf_counter()
    convert_checkpoint(path, out, dtype="bfloat16")
    return dict(convert_s=time.perf_counter() - t0, base_rss=base, peak_rss=_status()["VmHWM"])


def _probe_load_converted(path: str) -> dict:
    import jax

    _import_like_transformers_probe()
    from dllm_jax.model.loader import load_model

    base = _status()["VmRSS"]
    t0 = time.perf_counter()
    m = load_model(path, dtype="bfloat16")
    jax.block_until_ready(m.params)
    return dict(load_s=time.perf_counter() - t0, base_rss=base, peak_rss=_status()["VmHWM"])


def _probe_first_generate(path: str) -> dict:
    import jax

    _import_like_transformers_probe()
    from dllm_jax import Engine

    cache = tempfile.mkdtemp(prefix="dllm-jax-bench-cold-cache-")
    base = _status()["VmRSS"]
    try:
        t0 = time.perf_counter()
        engine = Engine(path, dtype="bfloat16", max_running_requests=8, context_length=64, num_kv_pages=64,
                        block_size=4, warmup=True, compilation_cache=cache,
                        shape_buckets=dict(rows=(2, 8), pages=(16,), prefill_rows=(1,), prefill_blocks=(16,)))
        jax.block_until_ready(engine.runner.params)
        warm = _status()
        t1 = time.perf_counter()
        engine.generate(input_ids=list(range(1000, 1013)),
                        sampling_params={"max_new_tokens": 16, "temperature": 0, "ignore_eos": True})
        t2 = time.perf_counter()
        engine.shutdown()
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    return dict(init_s=t1 - t0, generate_s=t2 - t1, base_rss=base, warmup_peak_rss=warm["VmHWM"],
                peak_rss=_status()["VmHWM"])


FIRST_ANSWER_ROWS, FIRST_ANSWER_CONTEXT = 4, 1024  # the first_answer probe's engine (default buckets for them)


def _probe_first_answer(path: str, cache: str) -> dict:
    """Time to a first answer, split: imports, tokenizer (and config), weights, KV pool (the rest of
    ``Engine(...)``), the executables a short chat needs (a staged warm-up: compiled, or loaded from the cache), and
    the first call (one greedy request of 4 tokens). ``cache``: a compilation cache directory (reused: warm) or
    ``cold`` (a fresh one). Every XLA compile in the process is listed by phase (what compiles while loading)."""
    t_start = time.perf_counter()
    import jax

    compiles: list = []
    phase = ["imports"]

    def on_event(event: str, duration: float, **kw) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append((phase[0], kw.get("fun_name"), round(duration, 3)))

    jax.monitoring.register_event_duration_secs_listener(on_event)
    _import_like_transformers_probe()
    from dllm_jax import Engine
    from dllm_jax.model import loader

    imports_s = time.perf_counter() - t_start
    timings = {}
    original_tok, original_weights = loader.load_tokenizer, loader.load_safetensors_params

    def timed_tokenizer(*args, **kwargs):
        t = time.perf_counter()
        out = original_tok(*args, **kwargs)
        timings["tokenizer_s"] = time.perf_counter() - t
        return out

    def timed_weights(*args, **kwargs):
        phase[0] = "weights"
        t = time.perf_counter()
        out = jax.block_until_ready(original_weights(*args, **kwargs))
        timings["weights_s"] = time.perf_counter() - t
        phase[0] = "pool"
        return out

    loader.load_tokenizer, loader.load_safetensors_params = timed_tokenizer, timed_weights
    cold = cache == "cold"
    cache_dir = tempfile.mkdtemp(prefix="dllm-jax-bench-cold-cache-") if cold else cache
    try:
        phase[0] = "tokenizer"
        t0 = time.perf_counter()
        engine = Engine(path, dtype="bfloat16", compilation_cache=cache_dir, progress=False,
                        max_running_requests=FIRST_ANSWER_ROWS, context_length=FIRST_ANSWER_CONTEXT)
        jax.block_until_ready(engine.runner.kv_pages)
        t1 = time.perf_counter()
        phase[0] = "executables"
        # the background thread would start on the rest beside the first call: not what a first answer needs
        engine.runner.compiler._start = lambda: None
        keys = engine.warmup(background=True)
        t2 = time.perf_counter()
        phase[0] = "first call"
        t3 = time.perf_counter()
        out = engine.generate(input_ids=list(range(100, 113)),
                              sampling_params={"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})
        t4 = time.perf_counter()
        engine.shutdown()
    finally:
        if cold:
            shutil.rmtree(cache_dir, ignore_errors=True)
    init_s = t1 - t0
    pool_s = init_s - timings.get("tokenizer_s", 0.0) - timings.get("weights_s", 0.0)
    return dict(cache=cache, imports_s=imports_s, tokenizer_s=timings.get("tokenizer_s"),
                weights_s=timings.get("weights_s"), pool_s=pool_s, engine_init_s=init_s, executables_s=t2 - t1,
                executables=keys, first_call_s=t4 - t3, answer_tokens=len(out["output_ids"]),
                first_answer_s=init_s + (t2 - t1) + (t4 - t3), compiles=compiles, peak_rss=_status()["VmHWM"])


PROBES = {"first_answer": _probe_first_answer, "first_generate": _probe_first_generate, "engine": _probe_engine,
          "transformers": _probe_transformers, "floor": _probe_floor, "convert": _probe_convert,
          "load_converted": _probe_load_converted}


def probe(kind: str, *args: str) -> dict:
    """Run probe ``kind`` in a fresh Python process; its JSON result."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TRANSFORMERS_NO_ADVISORY_WARNINGS="1")
    proc = subprocess.run([sys.executable, "-m", "bench.load", kind, *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=3600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"probe {kind} failed (rc {proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(lines[-1])


# ----------------------------------------------------------------------------------------------
# Scenarios
# ----------------------------------------------------------------------------------------------

def _median(runs: list[dict], key: str) -> float:
    return float(np.median([r[key] for r in runs]))


def load(ctx: Ctx) -> dict:
    from bench.scenarios import finish
    from dllm_jax.testing.published import checkpoint_bytes

    layers = ctx.size("load_layers", 28, 4)
    repeats = ctx.size("load_repeats", 3, 1)
    path, _ = checkpoint(ctx, "sdar-1.7b", layers)
    ckpt = checkpoint_bytes(path)
    try:
        warm = warm_page_cache(path)
        ctx.log(f"load: page cache warmed ({warm:.1f} s); {repeats} rounds of engine / transformers / floor")
        runs: dict[str, list] = {"engine": [], "transformers": [], "floor": []}
        for r in range(repeats):
            for kind in runs:
                runs[kind].append(probe(kind, path))
                ctx.log(f"load round {r + 1}: {kind} {runs[kind][-1]}")
        conv = {}
        if ctx.overrides.get("load_convert", not ctx.quick):
            out = path + "-converted"
            shutil.rmtree(out, ignore_errors=True)
            try:
                conv["convert"] = probe("convert", path, out)
                conv["load_converted"] = probe("load_converted", out)
            finally:
                shutil.rmtree(out, ignore_errors=True)
        first = probe("first_generate", path)
        ctx.log(f"load: first generate {first}")
        answers = first_answers(ctx, path, repeats)
    finally:
        if not ctx.overrides.get("load_keep"):
            cleanup(ctx)
    eng, hf, floor = runs["engine"], runs["transformers"], runs["floor"]
    result = {
        "layers": layers, "checkpoint_bytes": ckpt, "page_cache_warm_s": warm, "runs": runs, "convert": conv,
        "engine_load_model_s": _median(eng, "load_model_s"), "engine_init_s": _median(eng, "engine_init_s"),
        "engine_weights_s": _median(eng, "weights_s"),
        "engine_peak_rss": _median(eng, "peak_rss"), "engine_base_rss": _median(eng, "base_rss"),
        "hf_from_pretrained_s": _median(hf, "from_pretrained_s"),
        "hf_first_forward_s": _median(hf, "first_forward_s"), "hf_peak_rss": _median(hf, "peak_rss"),
        "hf_rss_after_load": _median(hf, "rss_after_load"),
        "floor_copy_fresh_s": _median(floor, "copy_fresh_s"), "floor_read_fresh_s": _median(floor, "read_fresh_s"),
        "floor_read_reused_s": _median(floor, "read_reused_s"),
    }
    result["engine_peak_rss_over_checkpoint"] = result["engine_peak_rss"] / ckpt
    result["engine_load_over_hf"] = result["engine_load_model_s"] / result["hf_from_pretrained_s"]
    hf_read = result["hf_from_pretrained_s"] + result["hf_first_forward_s"]
    result["engine_load_over_hf_first_forward"] = result["engine_load_model_s"] / hf_read
    result["engine_weights_over_copy_floor"] = result["engine_weights_s"] / result["floor_copy_fresh_s"]
    result["first_generate"] = first
    result["first_generate_peak_over_budget"] = first["peak_rss"] / (1.3 * ckpt + GIB)
    rows = [
        ["engine: Engine(...) (tokenizer, config, weights, KV pool)", result["engine_init_s"],
         result["engine_peak_rss"] / GIB, result["engine_peak_rss"] / ckpt],
        ["engine: of which load_model (tokenizer, config, weights)", result["engine_load_model_s"], "", ""],
        ["engine: of which the weights on the device", result["engine_weights_s"], "", ""],
        ["transformers: from_pretrained (weights mapped, not read)", result["hf_from_pretrained_s"],
         result["hf_rss_after_load"] / GIB, result["hf_rss_after_load"] / ckpt],
        ["transformers: + first forward (weights read)", result["hf_from_pretrained_s"] + result["hf_first_forward_s"],
         result["hf_peak_rss"] / GIB, result["hf_peak_rss"] / ckpt],
        ["floor: copy every byte from the mapped files into fresh memory", result["floor_copy_fresh_s"], "", ""],
        ["floor: pread every byte into fresh numpy arrays", result["floor_read_fresh_s"], "", ""],
        ["floor: pread every byte into one reused buffer (page cache speed)", result["floor_read_reused_s"], "",
         ""],
        ["Engine(warmup=True), cold compile cache: load + warm-up (then peak RSS)", first["init_s"],
         first["warmup_peak_rss"] / GIB, first["warmup_peak_rss"] / ckpt],
        ["... + first generate (16 tokens): peak RSS", first["generate_s"], first["peak_rss"] / GIB,
         first["peak_rss"] / ckpt],
    ]
    if conv:
        rows.append(["dllm-jax convert --dtype bfloat16", conv["convert"]["convert_s"],
                     conv["convert"]["peak_rss"] / GIB, conv["convert"]["peak_rss"] / ckpt])
        rows.append(["load_model of the converted directory (no conversions)", conv["load_converted"]["load_s"],
                     conv["load_converted"]["peak_rss"] / GIB, conv["load_converted"]["peak_rss"] / ckpt])
    text = table(f"load: {layers}-layer SDAR-1.7B-shaped checkpoint, {ckpt / GIB:.2f} GiB bf16 in sharded "
                 f"safetensors (median of {repeats} fresh processes, page cache warm)",
                 ["what", "seconds", "peak RSS GiB", "RSS / checkpoint"], rows)
    command = "python -m bench load" + (" --quick" if ctx.quick else "")
    result["first_answer"] = answers
    text += "\n" + first_answer_table(ctx, answers, result, command)
    ctx.target("load: engine peak RSS / checkpoint bytes", result["engine_peak_rss_over_checkpoint"], 1.3,
               higher_is_better=False, command=command,
               note=f"{layers} layers; includes the process's {result['engine_base_rss'] / GIB:.2f} GiB before loading")
    ctx.target("load: engine load_model time / (transformers from_pretrained + first forward)",
               result["engine_load_over_hf_first_forward"], 1.0, higher_is_better=False, command=command,
               note=f"from_pretrained maps the files and reads nothing ({result['hf_rss_after_load'] / GIB:.2f} GiB "
                    f"RSS after it; {fmt(result['engine_load_over_hf'])}x of it alone), its first forward reads them")
    ctx.target("load: engine weights time / copy floor (every byte copied into fresh memory)",
               result["engine_weights_over_copy_floor"], 1.1, higher_is_better=False, command=command,
               note=f"weights {fmt(result['engine_weights_s'])} s, floor {fmt(result['floor_copy_fresh_s'])} s "
                    f"(pread into one buffer {fmt(result['floor_read_reused_s'])} s); medians, page cache warm")
    ctx.target("load: peak RSS of load + warm-up + first generate (cold compile cache) / (1.3x checkpoint + 1 GiB)",
               result["first_generate_peak_over_budget"], 1.0, higher_is_better=False, command=command,
               note=f"{first['peak_rss'] / GIB:.2f} GiB for a {ckpt / GIB:.2f} GiB checkpoint; warm-up peak "
                    f"{first['warmup_peak_rss'] / GIB:.2f} GiB")
    return finish(ctx, "load", result, text)


def first_answers(ctx: Ctx, path: str, repeats: int) -> dict:
    """The first_answer probe with a cold compilation cache (a fresh directory), then ``repeats`` times with that
    directory warm (fastest kept)."""
    cache = tempfile.mkdtemp(prefix="dllm-jax-bench-cache-")
    try:
        cold = probe("first_answer", path, cache)
        ctx.log(f"load: first answer, cold cache: {cold}")
        warm = min((probe("first_answer", path, cache) for _ in range(repeats)), key=lambda r: r["first_answer_s"])
        ctx.log(f"load: first answer, warm cache: {warm}")
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    return {"cold": cold, "warm": warm}


SPLIT = [("imports (jax, transformers, dllm_jax)", "imports_s"), ("tokenizer and config", "tokenizer_s"),
         ("weights on the device", "weights_s"), ("KV pool and the rest of Engine(...)", "pool_s"),
         ("executables a short chat needs (compiled / loaded)", "executables_s"), ("first call (4 tokens)",
                                                                                  "first_call_s"),
         ("load + first answer (imports excluded)", "first_answer_s")]


def first_answer_table(ctx: Ctx, answers: dict, result: dict, command: str) -> str:
    """The split of a first answer, warm and cold cache, against transformers' from_pretrained + one forward."""
    warm, cold = answers["warm"], answers["cold"]
    hf = result["hf_from_pretrained_s"] + result["hf_first_forward_s"]
    rows = [[what, warm[key], cold[key]] for what, key in SPLIT]
    rows.append(["transformers: from_pretrained + one forward (median)", hf, hf])
    rows.append(["first answer / transformers", warm["first_answer_s"] / hf, cold["first_answer_s"] / hf])
    ctx.target("load: Engine + staged warm-up + first answer, warm compilation cache / transformers load + forward",
               warm["first_answer_s"] / hf, 1.0, higher_is_better=False, command=command,
               note=f"{warm['executables']} executables loaded from the cache; compiles while loading: "
                    f"{sum(1 for c in warm['compiles'] if c[0] in ('tokenizer', 'weights', 'pool'))}")
    ctx.target("load: the same, cold compilation cache / transformers load + forward", cold["first_answer_s"] / hf,
               2.0, higher_is_better=False, command=command,
               note=f"compiles while loading: {[c for c in cold['compiles'] if c[0] in ('weights', 'pool')]}")
    return table(f"load: time to a first answer (Engine(dtype=bfloat16, max_running_requests={FIRST_ANSWER_ROWS}, "
                 f"context_length={FIRST_ANSWER_CONTEXT}), warmup(background=True), one 4-token greedy answer; "
                 f"fresh processes)", ["phase", "s, warm cache", "s, cold cache"], rows)


def _denoise_ms(engine, prompts, params, concurrency: int) -> list[float]:
    """Run the prompts; the duration of every denoise call (ms), each waited for (bench.common.device_timer)."""
    from bench.common import device_timer

    with device_timer() as log:
        run_requests(engine, prompts, params, concurrency)
    return [1e3 * (c[3] - c[1]) for c in log if c[0] == "denoise"]


def _stats(ms: list[float]) -> dict:
    return {"min": float(min(ms)), "median": float(np.median(ms)), "n": len(ms)}


def _engine_run(path: str, dtype: str, prompts, max_new: int, block: int, rounds: int) -> dict:
    from dllm_jax import Engine

    context = int(np.ceil((max(len(p) for p in prompts) + max_new + 2 * block) / block) * block)
    pages = int(np.ceil(context / block))
    # One denoise step per device call, so a call's time is a step's.
    engine = Engine(path, dtype=dtype, max_running_requests=8, context_length=context, num_kv_pages=8 * pages + 1,
                    enable_prefix_cache=False, max_steps_per_call=1,
                    shape_buckets=dict(rows=(2, 16), pages=(pages,), prefill_rows=(1,), prefill_blocks=(pages,)))
    params = {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}
    one, eight = [], []
    try:
        run_requests(engine, prompts[:1], params, 1)  # compile
        run_requests(engine, prompts[:8], params, 8)
        batched = run_requests(engine, prompts, params, 8)
        for _ in range(rounds):  # alternating, so a busy spell of the shared machine hits both
            one += _denoise_ms(engine, prompts[:1], params, 1)
            eight += _denoise_ms(engine, prompts[:8], params, 8)
    finally:
        engine.shutdown()
    return {"outputs": batched["outputs"], "step_ms_1": _stats(one), "step_ms_8": _stats(eight),
            "recompiles": batched["recompiles"]}


def _hf_run(path: str, dtype: str, prompts, max_new: int) -> dict:
    from bench.hf_baseline import HFBlockDiffusion

    hf = HFBlockDiffusion(path, dtype=dtype, threshold=0.95)
    hf.generate(prompts[0], max_new, ignore_eos=True)  # warm-up
    forward, times = hf._forward, []

    def timed(*args, keep_logits, **kwargs):
        t0 = time.perf_counter()
        out = forward(*args, keep_logits=keep_logits, **kwargs)
        if keep_logits:  # a denoising forward over one block (the prefill and the storing forwards are not timed)
            times.append(1e3 * (time.perf_counter() - t0))
        return out

    hf._forward = timed
    outs = [hf.generate(p, max_new, ignore_eos=True)["output_ids"] for p in prompts]
    del hf
    gc.collect()
    return {"forward_ms": _stats(times), "outputs": outs}


def bf16(ctx: Ctx) -> dict:
    from bench.common import identical_fraction
    from bench.scenarios import finish
    from dllm_jax.model.tokenizer import load_tokenizer

    layers = ctx.size("bf16_layers", 28, 4)
    n_prompts = ctx.size("bf16_prompts", 20, 8)
    max_new = ctx.size("bf16_tokens", 8, 4)
    # Larger init scales than a trained model's 0.02: the logits of a random 2048-wide model are otherwise nearly
    # uniform, and agreement between dtypes would measure ties, not precision.
    path, _ = checkpoint(ctx, "sdar-1.7b-peaked", layers, std=0.04, embed_std=1.0)
    try:
        tok = load_tokenizer(path)
        prompts = chat_prompts(tok, n_prompts)
        res = {}
        for dtype in ("float32", "bfloat16"):
            ctx.log(f"bf16: engine {dtype}")
            res[dtype] = _engine_run(path, dtype, prompts, max_new, 4, rounds=ctx.size("bf16_rounds", 3, 1))
            gc.collect()
        hf = {}
        hf_prompts = prompts[:ctx.size("bf16_hf_prompts", 4, 2)]
        for dtype in ("float32", "bfloat16"):
            ctx.log(f"bf16: transformers loop {dtype} ({len(hf_prompts)} prompts)")
            hf[dtype] = _hf_run(path, dtype, hf_prompts, max_new)
    finally:
        if not ctx.overrides.get("load_keep"):
            cleanup(ctx)
    same, agree = identical_fraction(res["float32"]["outputs"], res["bfloat16"]["outputs"])
    k = len(hf["float32"]["outputs"])
    pairs = {  # (identical answers, agreeing tokens) over the prompts both stacks ran
        "engine bf16 vs engine f32": identical_fraction(res["float32"]["outputs"][:k], res["bfloat16"]["outputs"][:k]),
        "transformers bf16 vs transformers f32": identical_fraction(hf["float32"]["outputs"], hf["bfloat16"]["outputs"]),
        "engine f32 vs transformers f32": identical_fraction(res["float32"]["outputs"][:k], hf["float32"]["outputs"]),
        "engine bf16 vs transformers bf16": identical_fraction(res["bfloat16"]["outputs"][:k],
                                                               hf["bfloat16"]["outputs"]),
    }
    result = {"layers": layers, "prompts": n_prompts, "max_new_tokens": max_new, "identical_outputs": same,
              "token_agreement": agree, "engine": {d: {k: v for k, v in r.items() if k != "outputs"}
                                                   for d, r in res.items()},
              "transformers": {d: {"forward_ms": r["forward_ms"]} for d, r in hf.items()},
              "timing_note": "min over every denoise call / forward: the uncontended cost on a shared machine",
              "agreement_on_transformers_prompts": {name: {"identical": v[0], "tokens": v[1]}
                                                    for name, v in pairs.items()},
              "outputs": {d: r["outputs"] for d, r in res.items()},
              "transformers_outputs": {d: r["outputs"] for d, r in hf.items()}}
    rows = []
    for dtype in ("float32", "bfloat16"):
        e1, e8, h = res[dtype]["step_ms_1"]["min"], res[dtype]["step_ms_8"]["min"], hf[dtype]["forward_ms"]["min"]
        rows.append([dtype, e1, e8, e8 / 8, h, h / e1, 8 * h / e8, res[dtype]["step_ms_1"]["median"],
                     res[dtype]["step_ms_8"]["median"], hf[dtype]["forward_ms"]["median"]])
    text = table(f"bf16: {layers}-layer SDAR-1.7B-shaped random model, B = 4; {n_prompts} prompts x {max_new} "
                 f"greedy tokens: bf16 = f32 on {same:.0%} of the answers, {agree:.1%} of the tokens. Times: min "
                 f"(the uncontended cost on a shared machine) and median of every call",
                 ["dtype", "engine step ms (1 row)", "(8 rows)", "per row (8)", "transformers fwd ms (1 row)",
                  "speedup 1 row", "speedup 8 rows (vs 8 fwd)", "median: 1 row", "8 rows", "transformers"], rows)
    text += "\n" + table(f"bf16: agreement on the {k} prompts the transformers loop also ran (transformers' own "
                         f"bf16-vs-f32 figure is the agreement to expect)", ["pair", "identical answers", "tokens"],
                         [[name, v[0], v[1]] for name, v in pairs.items()])
    command = "python -m bench bf16" + (" --quick" if ctx.quick else "")
    ctx.target("bf16: engine step (1 row) vs transformers bf16 forward", hf["bfloat16"]["forward_ms"]["min"] /
               res["bfloat16"]["step_ms_1"]["min"], 1.0, command=command,
               note="speedup (min times), >1 = engine faster; the engine's step is 2 rows (the fold-commit row)")
    return finish(ctx, "bf16", result, text)


if __name__ == "__main__":
    kind, *rest = sys.argv[1:]
    print(json.dumps(PROBES[kind](*rest)), flush=True)
