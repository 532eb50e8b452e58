"""Shared pieces of the benchmark suite: the run context, the models, the prompts, the engine driver with its
device-time instrumentation, tables, JSON and trace summaries.

Models (built once per output directory and reused):

* ``shipped`` -- the small trained model (``dllm_jax/assets/sdar-tiny``, or ``--model-path``). Until it exists, a
  *stand-in*: a random model of the same shape with the training tokenizer (labelled so in every output).
* ``random50m`` -- a random Qwen3 of about 50M parameters (hidden 512, 16 layers, GQA 8/4, MLP 1536) with the
  shipped model's tokenizer and vocabulary, saved as a HF directory so that ``transformers`` and the engine load
  the very same weights.
* ``tiny`` -- a 2-layer random model (tests and ``--smoke``).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import glob
import gzip
import json
import math
import os
import statistics
import time
from typing import Any, Callable

import numpy as np

BLOCK_SIZE = 32
RANDOM50M_SHAPE = dict(hidden_size=512, intermediate_size=1536, num_layers=16, num_heads=8, num_kv_heads=4,
                       head_dim=64)
SHIPPED_SHAPE = dict(hidden_size=256, intermediate_size=768, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64)
TINY_SHAPE = dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
# Random models: the init scale decides how peaked their predictions are (so how many tokens a step commits).
RANDOM_STD = {"random50m": 0.06, "shipped": 0.06, "tiny": 0.5}


# ----------------------------------------------------------------------------------------------
# Run context
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass
class ModelInfo:
    name: str
    path: str
    label: str
    random: bool  # random weights: generation ignores EOS and runs to max_new_tokens
    num_params: int
    tokenizer: Any = None

    @property
    def gen_params(self) -> dict:
        return {"ignore_eos": True} if self.random else {}


@dataclasses.dataclass
class Ctx:
    out_dir: str = "bench_out"
    quick: bool = False
    seed: int = 0
    threshold: float = 0.95
    model_path: str | None = None  # overrides the shipped model
    models: tuple[str, ...] = ("shipped", "random50m")
    plots: bool = True
    profile_dir: str | None = None
    profile_steps: int = 32
    overrides: dict = dataclasses.field(default_factory=dict)  # scenario size knobs from the command line
    targets: list = dataclasses.field(default_factory=list)
    command: str = "python -m bench"
    _models: dict = dataclasses.field(default_factory=dict)
    _memo: dict = dataclasses.field(default_factory=dict)

    def size(self, name: str, full, quick):
        """A scenario size knob: the command-line override, else the quick or the full default."""
        v = self.overrides.get(name)
        if v is not None:
            return v
        return quick if self.quick else full

    def log(self, msg: str) -> None:
        print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    def target(self, name: str, value: float | None, target: float, *, unit: str = "x", higher_is_better=True,
               note: str = "", command: str | None = None) -> dict:
        met = None if value is None or (isinstance(value, float) and math.isnan(value)) else (
            value >= target if higher_is_better else value <= target)
        row = {"name": name, "value": value, "target": target, "unit": unit,
               "comparison": ">=" if higher_is_better else "<=", "met": met, "note": note,
               "command": command or self.command}
        self.targets.append(row)
        return row

    # ------------------------------------------------------------------------------------------
    def cpu_ceiling(self) -> float | None:
        """The float32 matmul rate of this machine (GFLOP/s; measured once; None on an accelerator)."""
        import jax

        if jax.default_backend() != "cpu":
            return None
        if "matmul_gflops" not in self._memo:
            self._memo["matmul_gflops"] = matmul_gflops()
        return self._memo["matmul_gflops"]

    def model(self, name: str) -> ModelInfo:
        if name not in self._models:
            self._models[name] = _build_model(self, name)
        return self._models[name]


# ----------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------

def shipped_model_path(override: str | None = None) -> str | None:
    if override:
        return override
    from dllm_jax.assets import DEFAULT_MODEL_PATH

    return DEFAULT_MODEL_PATH if os.path.isfile(os.path.join(DEFAULT_MODEL_PATH, "config.json")) else None


def _tokenizer_source(ctx: Ctx):
    """The shipped model's tokenizer, else the one the training code builds (cached under the output dir)."""
    from dllm_jax.model.tokenizer import load_tokenizer

    path = shipped_model_path(ctx.model_path)
    if path is not None:
        tok = load_tokenizer(path)
        if tok is not None:
            return tok
    cache = os.path.join(ctx.out_dir, "models", "tokenizer")
    if os.path.isfile(os.path.join(cache, "tokenizer.json")):
        tok = load_tokenizer(cache)
        if tok is not None:
            return tok
    from dllm_jax.train.tokenizer import save_tokenizer, train_tokenizer

    tok = train_tokenizer()
    save_tokenizer(tok, cache)
    return tok


def build_random_model(out_dir: str, tokenizer, *, shape: dict, seed: int = 0, std: float = 0.06,
                       max_pos: int = 8192, block_size: int = BLOCK_SIZE, tie: bool = True) -> str:
    """A random Qwen3 saved as a HF directory (config, safetensors, tokenizer) that both stacks load."""
    import jax

    from dllm_jax.config import ModelConfig
    from dllm_jax.model.converted import save_hf
    from dllm_jax.model.params import init_params
    from dllm_jax.train import tokenizer as tok_lib

    ids = tok_lib.special_ids(tokenizer)
    vocab = int(math.ceil(len(tokenizer) / 64) * 64)
    cfg = ModelConfig(vocab_size=vocab, max_position_embeddings=max_pos, tie_word_embeddings=tie,
                      mask_token_id=ids[tok_lib.MASK], block_size=block_size,
                      eos_token_ids=(ids[tok_lib.IM_END], ids[tok_lib.ENDOFTEXT]), **shape)
    params = init_params(cfg, jax.random.PRNGKey(seed), std=std)
    save_hf(params, cfg, out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def _count_params(path: str) -> int:
    from safetensors import safe_open

    total = 0
    for f in glob.glob(os.path.join(path, "*.safetensors")):
        with safe_open(f, "np") as st:
            for k in st.keys():
                total += int(np.prod(st.get_slice(k).get_shape()))
    return total


def _build_model(ctx: Ctx, name: str) -> ModelInfo:
    from dllm_jax.model.tokenizer import load_tokenizer

    if name == "shipped":
        path = shipped_model_path(ctx.model_path)
        if path is not None:
            return ModelInfo(name, path, f"shipped model ({os.path.basename(path.rstrip('/'))})", False,
                             _count_params(path), load_tokenizer(path))
    if name not in ("shipped", "random50m", "tiny"):
        raise ValueError(f"--models: unknown model {name!r}; valid: shipped, random50m, tiny")
    shape = {"shipped": SHIPPED_SHAPE, "random50m": RANDOM50M_SHAPE, "tiny": TINY_SHAPE}[name]
    std = RANDOM_STD[name]
    label = {"shipped": "sdar-tiny stand-in (random weights: the shipped model was not found)",
             "random50m": "random Qwen3 ~50M", "tiny": "tiny random Qwen3"}[name]
    return random_model(ctx, name, f"{name}-v1-std{std}", label, shape, std=std,
                        max_pos=512 if name == "shipped" else 8192)


def random_model(ctx: Ctx, name: str, key: str, label: str, shape: dict, **build_kwargs) -> ModelInfo:
    """A random model with the project's tokenizer, built once under ``<out>/models/<key>-vocab<V>``."""
    from dllm_jax.model.tokenizer import load_tokenizer

    tok = _tokenizer_source(ctx)
    path = os.path.join(os.path.abspath(ctx.out_dir), "models", f"{key}-vocab{len(tok)}")
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        ctx.log(f"building random model {name} in {path}")
        build_random_model(path, tok, shape=shape, seed=ctx.seed, **build_kwargs)
    return ModelInfo(name, path, label, True, _count_params(path), load_tokenizer(path))


# ----------------------------------------------------------------------------------------------
# Prompts
# ----------------------------------------------------------------------------------------------

def chat_prompts(tokenizer, n: int, start: int = 0) -> list[list[int]]:
    """``n`` held-out task prompts in the chat template, as token ids."""
    from dllm_jax.evaluate import prompt_ids
    from dllm_jax.train import tasks

    return prompt_ids(tokenizer, tasks.heldout_set(start + n)[start:])


def word_ids(tokenizer, n_tokens: int, seed: int) -> list[int]:
    """``n_tokens`` ids of random task words (a long 'document' or system prompt)."""
    from dllm_jax.train import tasks

    rng = np.random.default_rng(seed)
    ids: list[int] = []
    while len(ids) < n_tokens:
        words = " ".join(tasks.WORDS[i] for i in rng.integers(0, len(tasks.WORDS), 256))
        ids += tokenizer.encode(" " + words, add_special_tokens=False)
    return ids[:n_tokens]


def hard_prompts(tokenizer, n: int, seed: int) -> list[list[int]]:
    """Prompts outside the training tasks (an instruction the model never saw, over random words): low
    confidence, so few tokens per step."""
    from dllm_jax.train import tasks

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        words = " ".join(tasks.WORDS[i] for i in rng.integers(0, len(tasks.WORDS), int(rng.integers(20, 40))))
        text = tokenizer.apply_chat_template([{"role": "user", "content": f"Tell a story about {words}"}],
                                             tokenize=False, add_generation_prompt=True)
        out.append(list(tokenizer.encode(text, add_special_tokens=False)))
    return out


# ----------------------------------------------------------------------------------------------
# Device-time instrumentation and the engine driver
# ----------------------------------------------------------------------------------------------

class _Timed:
    """Wraps a jitted step function; records (start, dispatched, ready) per call (``block`` waits for it)."""

    def __init__(self, fn, log, kind, block):
        self._fn, self._log, self._kind, self._block = fn, log, kind, block

    def __call__(self, *args, **kwargs):
        import jax

        t0 = time.perf_counter()
        out = self._fn(*args, **kwargs)
        t1 = time.perf_counter()
        if self._block:
            jax.block_until_ready(out)
        t2 = time.perf_counter()
        self._log.append((self._kind, t0, t1, t2))
        return out

    def __getattr__(self, name):  # _cache_size() etc.
        return getattr(self._fn, name)


@contextlib.contextmanager
def device_timer():
    """Time the engine's device calls: patches ``dllm_jax.engine.runner``'s ``denoise_packed`` (waited for, as the
    runner waits right after anyway) and ``prefill`` (not waited for: its work finishes inside the next
    waited call, as in normal running). Yields the list of (kind, start, dispatched, ready)."""
    from dllm_jax.engine import runner

    log: list = []
    saved = runner.denoise_packed, runner.prefill
    runner.denoise_packed = _Timed(saved[0], log, "denoise", True)
    runner.prefill = _Timed(saved[1], log, "prefill", False)
    try:
        yield log
    finally:
        runner.denoise_packed, runner.prefill = saved


def percentile(values, q):
    if not values:
        return float("nan")
    return float(np.percentile(np.asarray(values, np.float64), q))


def run_requests(engine, prompts: list[list[int]], params: dict, concurrency: int) -> dict:
    """Closed loop: keep ``concurrency`` requests in flight until every prompt is served; drive the engine from
    this thread (``engine.step``) and time every round and every device call. Returns the figures."""
    from dllm_jax.engine.compilation import compiled_executables

    pending = collections.deque(enumerate(prompts))
    inflight: dict[int, Any] = {}
    results: list = [None] * len(prompts)
    step_walls, step_device, step_dispatch = [], [], []
    compiled0 = compiled_executables()
    calls0 = engine.runner.device_calls
    stats0 = dict(engine.get_load())
    with device_timer() as log:
        t_start = time.perf_counter()
        while pending or inflight:
            while pending and len(inflight) < concurrency:
                i, ids = pending.popleft()
                inflight[i] = engine.submit(engine.make_request(list(ids), params))
            n0 = len(log)
            t0 = time.perf_counter()
            engine.step()
            t1 = time.perf_counter()
            calls = log[n0:]
            step_walls.append(t1 - t0)
            step_device.append(sum(c[3] - c[1] for c in calls))
            step_dispatch.append(sum(c[2] - c[1] for c in calls))
            for i, req in list(inflight.items()):
                if req.finished:
                    results[i] = engine.result(req)
                    del inflight[i]
        wall = time.perf_counter() - t_start
    stats1 = engine.get_load()
    tokens = sum(len(r["output_ids"]) for r in results)
    forwards = sum(r["meta_info"]["forward_passes"] for r in results)
    lat = [r["meta_info"]["e2e_latency"] for r in results]
    ttfb = [r["meta_info"]["time_to_first_block"] for r in results if r["meta_info"]["time_to_first_block"]]
    total_step = sum(step_walls)
    device = sum(step_device)
    dispatch = sum(step_dispatch)
    return {
        "requests": len(prompts),
        "concurrency": concurrency,
        "wall_s": wall,
        "output_tokens": tokens,
        "tokens_per_s": tokens / wall if wall > 0 else float("nan"),
        "forward_passes": forwards,
        "tpf": forwards / max(tokens, 1),  # forwards per generated token, per request (prefill included)
        "device_calls": engine.runner.device_calls - calls0,
        "device_calls_per_token": (engine.runner.device_calls - calls0) / max(tokens, 1),
        "denoise_calls": stats1.get("denoise_calls", 0) - stats0.get("denoise_calls", 0),
        "prefill_forwards": stats1.get("prefill_forwards", 0) - stats0.get("prefill_forwards", 0),
        "cached_tokens": sum(r["meta_info"]["cached_tokens"] for r in results),
        "latency_p50_s": percentile(lat, 50),
        "latency_p99_s": percentile(lat, 99),
        "latency_mean_s": float(np.mean(lat)) if lat else float("nan"),
        "latencies": lat,
        "ttfb_p50_s": percentile(ttfb, 50),
        "ttfb_p99_s": percentile(ttfb, 99),
        "ttfb_mean_s": float(np.mean(ttfb)) if ttfb else float("nan"),
        "steps": len(step_walls),
        "step_ms_mean": 1e3 * total_step / max(len(step_walls), 1),
        "device_ms_mean": 1e3 * device / max(len(step_walls), 1),
        # Host overhead = round time outside the device calls (a call counts from the jitted function's call to
        # its result being ready, so it includes the jit dispatch; on CPU the dispatch runs the computation inline,
        # so the two cannot be told apart without a trace). "dispatch" is the part of the calls before they
        # returned (on GPU: launch only; on CPU: most of the computation too).
        "host_overhead_frac": (total_step - device) / total_step if total_step else float("nan"),
        "dispatch_ms_mean": 1e3 * dispatch / max(len(step_walls), 1),
        "host_ms_per_step": 1e3 * (total_step - device) / max(len(step_walls), 1),
        "recompiles": compiled_executables() - compiled0,
        "outputs": [r["output_ids"] for r in results],
    }


def make_engine(model: ModelInfo, ctx: Ctx, **kwargs):
    """An Engine on ``model`` with the bench's defaults (greedy LowConfidence at ``ctx.threshold``, B = 32)."""
    from dllm_jax import Engine

    kwargs.setdefault("algorithm_config", {"threshold": ctx.threshold})
    kwargs.setdefault("block_size", BLOCK_SIZE)
    return Engine(model.path, **kwargs)


def scratch_pool(runner):
    """A zeroed KV pool of the engine's shape and sharding, for bare-forward timings to donate (the engine's own
    pool stays untouched)."""
    import jax
    import jax.numpy as jnp

    pool = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), runner.kv_pages)
    if runner.mesh is not None:
        pool = jax.tree.map(lambda x, ref: jax.device_put(x, ref.sharding), pool, runner.kv_pages)
    return pool


def bare_forward(spec):
    """The device work of one call and nothing else, on the engine's own model code: ``(params, kv, tokens, table,
    prefix, write, select) -> (kv, out)``; ``out`` is the hidden states, or with ``select`` the confidence
    selection's ``(argmax, p_max)`` per position (no algorithm, no sampling); ``select=None``: a commit forward,
    which writes the K/V and stops (``out`` None). Trace it inside a jit."""
    from dllm_jax.decode.backends import confidence_stats
    from dllm_jax.decode.step import _model_forward, _model_forward_kv

    def forward(params, kv, tokens, table, prefix, write, select):
        if select is None:
            return _model_forward_kv(params, kv, tokens, table, prefix, write, spec)[0], None
        hidden, kv = _model_forward(params, kv, tokens, table, prefix, write, spec)
        if not select:
            return kv, hidden
        rows, length, dim = hidden.shape
        arg, p, _ = confidence_stats(spec.confidence_backend, params, hidden.reshape(rows * length, dim),
                                     exclude_token_id=spec.mask_id, mesh=spec.mesh, cfg=spec.model)
        return kv, (arg.reshape(rows, length), p.reshape(rows, length))

    return forward


def kv_pages_for(prompts: list[list[int]], max_new_tokens: int, concurrency: int, extra: int = 8) -> int:
    """A page pool that holds ``concurrency`` of the longest requests (plus a little room for the cache)."""
    longest = max(len(p) for p in prompts) + max_new_tokens + 2 * BLOCK_SIZE
    return concurrency * math.ceil(longest / BLOCK_SIZE) + extra + 1


def context_for(prompts: list[list[int]], max_new_tokens: int) -> int:
    longest = max(len(p) for p in prompts) + max_new_tokens + 2 * BLOCK_SIZE
    return int(math.ceil(longest / BLOCK_SIZE) * BLOCK_SIZE)


def identical_fraction(a: list[list[int]], b: list[list[int]]) -> tuple[float, float]:
    """(fraction of requests with identical outputs, fraction of positions agreeing up to the shorter length)."""
    if not a:
        return float("nan"), float("nan")
    same = sum(x == y for x, y in zip(a, b))
    agree = total = 0
    for x, y in zip(a, b):
        n = max(len(x), len(y))
        total += n
        agree += sum(1 for i in range(min(len(x), len(y))) if x[i] == y[i])
    return same / len(a), agree / max(total, 1)


# ----------------------------------------------------------------------------------------------
# Output: tables, JSON, traces
# ----------------------------------------------------------------------------------------------

def fmt(v, spec=".3g") -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, (int, np.integer)):
        return str(int(v))
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        return format(v, spec)
    return str(v)


def table(title: str, columns: list[str], rows: list[list]) -> str:
    cells = [[fmt(c) for c in row] for row in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in cells)) if cells else len(str(h)) for i, h in enumerate(columns)]
    lines = [title, "  ".join(str(h).rjust(w) for h, w in zip(columns, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join(lines)


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        x = float(x)
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    if isinstance(x, np.ndarray):
        return _jsonable(x.tolist())
    return x


def write_json(path: str, data) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(_jsonable(data), f, indent=1)
    return path


class GpuScript:
    """The command line of a standalone GPU benchmark, ``python -m bench.<name> [--smoke]`` (side_by_side,
    step_profile): the doc's first line, ``--smoke`` and ``--batches``, the script's own options (added to
    :attr:`parser` in between), then ``--out`` (:meth:`parse`): the JSON result, by default ``$OUT/<name>.json``
    or ``bench_out/<name>.json``. Without a GPU only ``--smoke`` runs (:meth:`no_gpu`)."""

    def __init__(self, name: str, doc: str, *, what: str, smoke_help: str, batches: list[int]):
        self.name, self.what, self.out = name, what, None
        self.parser = argparse.ArgumentParser(description=doc.split("\n")[0])
        self.parser.add_argument("--smoke", action="store_true", help=smoke_help)
        self.parser.add_argument("--batches", type=int, nargs="+", default=batches)

    def parse(self, argv=None) -> argparse.Namespace:
        """Add ``--out`` and parse; ``args.out`` (and :attr:`out`) is then the result's path."""
        self.parser.add_argument("--out", default=None,
                                 help=f"JSON (default: $OUT/{self.name}.json or bench_out/{self.name}.json)")
        args = self.parser.parse_args(argv)
        args.out = self.out = args.out or os.path.join(os.environ.get("OUT") or "bench_out", f"{self.name}.json")
        return args

    def no_gpu(self, smoke: bool) -> bool:
        """No GPU here and no ``--smoke``: says so (the script then exits 0: there is nothing to measure)."""
        import jax

        if jax.default_backend() == "gpu" or smoke:
            return False
        print(f"bench.{self.name}: no GPU here; the {self.what} needs one (use --smoke to check the script on CPU).")
        return True

    def write(self, result) -> None:
        """The JSON result at :attr:`out` (written again as it grows)."""
        write_json(self.out, result)

    def wrote(self) -> int:
        """The script's last line (and its exit status)."""
        print(f"wrote {self.out}")
        return 0


def strip_outputs(run: dict) -> dict:
    return {k: v for k, v in run.items() if k != "outputs"}


def find_trace(profile_dir: str) -> str | None:
    files = sorted(glob.glob(os.path.join(profile_dir, "plugins", "profile", "*", "perfetto_trace.json.gz")),
                   key=os.path.getmtime)
    return files[-1] if files else None


def summarize_trace(path: str, names: tuple[str, ...] | None = None) -> list[tuple[str, int, float]]:
    """Sum the durations of the trace's complete events by name: [(name, count, total ms)], largest first."""
    with gzip.open(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    totals: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        name = e.get("name", "")
        if names is not None and name not in names:
            continue
        totals[name][0] += 1
        totals[name][1] += float(e["dur"]) / 1e3
    return sorted(((n, c, t) for n, (c, t) in totals.items()), key=lambda r: -r[2])


ENGINE_ANNOTATIONS = ("engine_step", "schedule", "radix.match", "radix.insert", "radix.evict", "prefill",
                      "denoise_step", "commit")


def matmul_gflops(n: int = 2048, reps: int = 3) -> float:
    """The machine's float32 matmul rate through JAX (GFLOP/s): the arithmetic ceiling of the CPU runs."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.PRNGKey(1), (n, n), jnp.float32)
    f = jax.jit(lambda x, y: x @ y)
    jax.block_until_ready(f(a, b))
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(a, b))
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best / 1e9


def gflops(forwards: int, num_params: int, seconds: float, block: int = BLOCK_SIZE) -> float:
    """Approximate achieved GFLOP/s of the linear layers: each forward runs ``block`` positions through every
    weight (2 FLOPs per weight per position); attention and the prefill's extra blocks are left out."""
    return forwards * 2 * num_params * block / seconds / 1e9 if seconds > 0 else float("nan")


def stats(values) -> dict:
    values = list(values)
    return {"mean": statistics.fmean(values) if values else float("nan"),
            "min": min(values) if values else float("nan"), "max": max(values) if values else float("nan")}


def timed(fn: Callable, *args, **kwargs):
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0
