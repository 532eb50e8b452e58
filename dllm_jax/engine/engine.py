"""``Engine``: the public Python interface (see DESIGN.md, "Public interfaces").

The engine owns a :class:`~dllm_jax.engine.scheduler.Scheduler` and drives it either from the caller's thread
(``generate`` on a plain engine) or from one background thread (``start()``; the HTTP server does this), in
which case ``generate`` and :meth:`Engine.submit` only enqueue and wait. Requests and aborts from other threads
go through an inbox that the loop drains between rounds, so the scheduler itself is single-threaded.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import math
import os
import queue
import threading
import time
import uuid
from typing import Any, Callable, Iterator

import jax
import numpy as np

from dllm_jax import compile_cache
from dllm_jax.cache.pages import PageAllocator
from dllm_jax.cache.radix import BlockRadixIndex
from dllm_jax.decode.algorithms import make_algorithm
from dllm_jax.decode.backends import resolve_backend
from dllm_jax.decode.step import kv_bytes_per_page
from dllm_jax.engine.request import Phase, Request
from dllm_jax.engine.runner import ModelRunner
from dllm_jax.engine.memory import plan_kv_pool
from dllm_jax.engine.sampling import SamplingParams, check_text
from dllm_jax.engine.scheduler import Scheduler
from dllm_jax.model.qwen3 import kv_storage_dtype

log = logging.getLogger("dllm_jax")

SCHEDULES = ("fdfo", "sync")
DEFAULT_MAX_RUNNING_REQUESTS = 32
MAX_RID_CHARS = 256
DEFAULT_CHAIN_BLOCKS = 4  # FDFO: blocks a request may go on into inside one device call (see Engine)


def default_model_path() -> str:
    from dllm_jax.assets import DEFAULT_MODEL_PATH

    return DEFAULT_MODEL_PATH


class Engine:
    """A block-diffusion LM server in a Python object.

    Options (all keyword): ``model_path`` (None: the shipped small model), ``block_size`` (None: the model's
    default), ``algorithm`` / ``algorithm_config`` (SGLang names; the config may be a dict or a YAML path whose
    ``block_size`` key overrides the model's), ``schedule`` (``"fdfo"``: first done, first out: rows join and
    leave between steps, and a device call runs steps only until its first row is done; ``"sync"``: each round
    runs whole blocks on the device), ``enable_prefix_cache``,
    ``max_running_requests`` (rows per denoise step; default 32), ``num_kv_pages`` (page pool size; small
    values force retraction; default: chosen by ``mem_fraction``), ``mem_fraction`` (share of the memory free
    once the weights are placed that the KV pool takes: of the device's free memory on GPU, default 0.85, of the
    available host memory on CPU, default 0.25; too little for one request at ``context_length`` is a
    ValueError; see :mod:`dllm_jax.engine.memory`), ``sampling_defaults`` (``"model"``, the default: a request's
    unset ``temperature`` / ``top_p`` / ``top_k`` take the values of the model's ``generation_config.json``,
    ``do_sample: false`` meaning greedy; ``"none"``: SamplingParams' own defaults, greedy), ``dtype``
    (``"auto"``: bfloat16 on GPU, float32 on CPU; ``"bfloat16"`` works on CPU too: weights, KV pool and
    activations in bf16, with float32 norms, softmaxes, logits and decisions), ``attention_backend`` /
    ``confidence_backend`` (``auto | pallas | xla | pallas_interpret``; ``pallas`` needs a GPU, refused otherwise),
    ``tensor_parallel_size`` / ``expert_parallel_size`` (a
    device mesh; see :mod:`dllm_jax.sharding`), ``profile_dir``, ``seed``,
    ``context_length`` (default: the model's), ``max_prefill_tokens`` (tokens per prefill forward; default
    2048), ``mask_token_id`` (override), ``warmup`` (compile every shape bucket at start),
    ``fold_commit_forward`` (True: the forward that only writes a resolved block's exact KV rides in the next
    block's first step instead of running alone; same tokens, one sequential forward fewer per block, but one
    more row in that step; False reproduces SGLang's forward count; default None: True on an accelerator, where
    a small step is memory-bound and the extra row nearly free, False on CPU, where a step is compute-bound and
    the extra row measured slower at 1, 16 and 64 requests, see bench/RESULTS.md), ``compilation_cache``
    (directory of the persistent compilation
    cache, ``"off"`` to disable; default ``$DLLM_JAX_COMPILATION_CACHE`` or ``~/.cache/dllm-jax/xla``, see
    :mod:`dllm_jax.compile_cache`), ``progress`` (progress bars while weights load and buckets compile; default:
    when stderr is a terminal), ``shape_buckets`` (replace the padded shapes of the device calls: a dict with
    any of ``rows``, ``pages``, ``prefill_rows``, ``prefill_blocks``; see
    :class:`dllm_jax.engine.runner.ShapeBuckets`), ``max_steps_per_call`` (FDFO: the most denoise steps one
    device call runs while its batch stays the same; the call ends anyway when the first row is done, and runs a
    single step whenever a request could join, one is still prefilling or a row streams provisional blocks;
    default None: no further limit; 1: one step per round, as SGLang), ``chain_blocks`` (when no request waits to
    join, a request whose block is done goes on into its next block inside the same device call, up to this many
    blocks further, as long as no stop token ended it; fewer host round trips per request, the same tokens;
    FDFO chains calls of up to two requests, the synchronous schedule a request running alone; streamed requests
    and those with stop strings, log probabilities or penalties never chain, since the host must see each of
    their blocks; default None: 4 where the commit forward is not folded, 0 where it is, since a block a request
    goes on from needs the exact-KV forward that folding saves; 0: off).
    """

    def __init__(self, model_path: str | None = None, *, block_size: int | None = None,
                 algorithm: str = "LowConfidence", algorithm_config: dict | str | None = None,
                 schedule: str = "fdfo", enable_prefix_cache: bool = True,
                 max_running_requests: int = DEFAULT_MAX_RUNNING_REQUESTS, num_kv_pages: int | None = None,
                 dtype: str = "auto", attention_backend: str = "auto", confidence_backend: str = "auto",
                 tensor_parallel_size: int = 1, expert_parallel_size: int = 1, profile_dir: str | None = None,
                 profile_steps: int = 64,
                 seed: int = 0, context_length: int | None = None, max_prefill_tokens: int = 2048,
                 mask_token_id: int | None = None, warmup: bool = False, mem_fraction: float | None = None,
                 sampling_defaults: str = "model",
                 fold_commit_forward: bool | None = None, channel=None, compilation_cache: str | None = None,
                 progress: bool | None = None, shape_buckets: dict | None = None,
                 max_steps_per_call: int | None = None, chain_blocks: int | None = None):
        from dllm_jax.model.loader import load_model

        if schedule not in SCHEDULES:
            raise ValueError(f"schedule: must be one of {SCHEDULES}, got {schedule!r}")
        if not isinstance(max_running_requests, int) or max_running_requests < 1:
            raise ValueError(f"max_running_requests: must be an integer >= 1, got {max_running_requests!r}")
        if max_steps_per_call is not None and (not isinstance(max_steps_per_call, int) or max_steps_per_call < 1):
            raise ValueError(f"max_steps_per_call: must be an integer >= 1 or None, got {max_steps_per_call!r}")
        if chain_blocks is not None and (not isinstance(chain_blocks, int) or isinstance(chain_blocks, bool)
                                         or not 0 <= chain_blocks <= 64):
            raise ValueError(f"chain_blocks: must be an integer from 0 to 64 or None, got {chain_blocks!r}")
        for name, value in (("tensor_parallel_size", tensor_parallel_size),
                            ("expert_parallel_size", expert_parallel_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")
        algorithm_config = _load_algorithm_config(algorithm_config)
        if block_size is None and "block_size" in algorithm_config:
            block_size = algorithm_config["block_size"]
        if block_size is not None and (not isinstance(block_size, int) or block_size < 1):
            raise ValueError(f"block_size: must be an integer >= 1, got {block_size!r}")
        # Cheap checks first: a backend the platform cannot run fails before any weight is read.
        self.attention_backend = resolve_backend(attention_backend, "attention_backend")
        self.confidence_backend = resolve_backend(confidence_backend, "confidence_backend")
        on_gpu = jax.default_backend() == "gpu"
        if dtype == "auto":
            dtype = "bfloat16" if on_gpu else "float32"
        self.progress = _show_progress(progress)
        self.compilation_cache = compile_cache.enable(compilation_cache)

        self.model_path = os.path.abspath(model_path) if model_path is not None else default_model_path()
        log.info("loading %s on %s (%d device%s), %s", self.model_path, jax.default_backend(), jax.device_count(),
                 "" if jax.device_count() == 1 else "s", dtype)
        loaded = load_model(self.model_path, dtype=dtype, block_size=block_size, mask_token_id=mask_token_id,
                            progress=self.progress)
        self.config = cfg = loaded.config
        self.tokenizer = loaded.tokenizer
        self.default_sampling_params = _sampling_defaults(self.model_path, sampling_defaults, cfg.vocab_size)
        self.block_size = B = cfg.block_size
        self.mask_token_id = cfg.mask_token_id
        self.eos_token_ids = tuple(cfg.eos_token_ids)
        self.algorithm = make_algorithm(algorithm, algorithm_config, model_config=cfg)
        self.algorithm_name = algorithm
        self.schedule = schedule
        self.dtype = dtype
        self.context_length = int(context_length or cfg.max_position_embeddings)
        if self.context_length < B:
            raise ValueError(f"context_length: must be at least one block ({B}), got {self.context_length}")
        if max_prefill_tokens < B:
            raise ValueError(f"max_prefill_tokens: must be at least one block ({B}), got {max_prefill_tokens}")
        pages_per_row = math.ceil(self.context_length / B)
        # The KV pool: a share of the memory left now that the weights are placed (dllm_jax.engine.memory).
        self.kv_budget = plan_kv_pool(
            page_bytes=kv_bytes_per_page(cfg, B, dtype), block_size=B, context_length=self.context_length,
            max_running_requests=max_running_requests, mem_fraction=mem_fraction, device=jax.devices()[0],
            num_kv_pages=num_kv_pages,
            remember=compile_cache.beside(self.compilation_cache, "kv_pool.json"))
        self.num_kv_pages = num_kv_pages = self.kv_budget.num_pages
        log.info("%s", self.kv_budget.describe(self.context_length))
        self.max_running_requests = max_running_requests
        self.enable_prefix_cache = enable_prefix_cache

        self.tensor_parallel_size = tensor_parallel_size
        self.expert_parallel_size = expert_parallel_size
        mesh = None
        if tensor_parallel_size * expert_parallel_size > 1:
            from dllm_jax.sharding import make_mesh

            mesh = make_mesh(tensor_parallel_size, expert_parallel_size)
        self.mesh = mesh
        if channel is None:
            from dllm_jax.distributed import default_channel

            channel = default_channel()
        fold = jax.default_backend() != "cpu" if fold_commit_forward is None else bool(fold_commit_forward)
        self.runner = ModelRunner(
            loaded.params, cfg, block_size=B, mask_id=self.mask_token_id, algorithm=self.algorithm,
            num_pages=num_kv_pages, max_rows=max_running_requests, max_pages_per_row=pages_per_row,
            max_prefill_blocks=max(1, min(max_prefill_tokens // B, pages_per_row)), loop=schedule == "sync",
            attention_backend=self.attention_backend, confidence_backend=self.confidence_backend,
            kv_dtype=kv_storage_dtype(dtype), mesh=mesh, channel=channel,
            fold_commit=fold, shape_buckets=shape_buckets,
            chain_blocks=(0 if fold else DEFAULT_CHAIN_BLOCKS) if chain_blocks is None else chain_blocks)
        self.allocator = PageAllocator(num_kv_pages)
        self.radix = BlockRadixIndex(B, self.allocator, enabled=enable_prefix_cache)
        self.scheduler = Scheduler(
            self.runner, self.allocator, self.radix, block_size=B, mask_id=self.mask_token_id,
            eos_token_ids=self.eos_token_ids, max_running_requests=max_running_requests,
            context_length=self.context_length, max_prefill_blocks=self.runner.max_prefill_blocks,
            decode_text=self._decode if self.tokenizer is not None else None,
            max_steps_per_call=max_steps_per_call or 1 << 30)
        self._rng = np.random.default_rng(seed)
        self._params_cache: dict[tuple, SamplingParams] = {}  # see _sampling_params
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._requests: dict[str, Request] = {}
        self._lock = threading.RLock()  # one driver of the scheduler at a time
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wakeup = threading.Event()
        self._steps = 0
        self._profile_dir = profile_dir
        self._profile_steps = profile_steps
        self._profiling = False
        self._profile_lock = threading.Lock()
        self._shutdown = False
        self.failure: str | None = None  # multi-process: why the process group failed (the engine is then dead)
        if channel is not None and hasattr(channel, "barrier"):
            channel.barrier("engine")  # every process loaded: the first collective will not wait on a slow load
        if warmup and self.is_leader:  # followers compile as they follow the leader's warm-up calls
            self.warmup()
        if profile_dir is not None:
            self.start_profile(profile_dir)

    # ------------------------------------------------------------------------------------------
    # Info
    # ------------------------------------------------------------------------------------------
    def get_model_info(self) -> dict:
        cfg = self.config
        return {
            "model_path": self.model_path,
            "architecture": cfg.architecture,
            "block_size": self.block_size,
            "mask_token_id": self.mask_token_id,
            "eos_token_ids": list(self.eos_token_ids),
            "vocab_size": cfg.vocab_size,
            "algorithm": self.algorithm_name,
            "algorithm_config": dict(vars(self.algorithm.config)),
            "schedule": self.schedule,
            "fold_commit_forward": self.runner.greedy_spec.fold_commit,
            "chain_blocks": self.runner.chain,
            "enable_prefix_cache": self.enable_prefix_cache,
            "max_running_requests": self.max_running_requests,
            "num_kv_pages": self.num_kv_pages,
            "kv_pool_tokens": self.kv_budget.tokens,
            "kv_pool_bytes": self.kv_budget.pool_bytes,
            "default_sampling_params": dict(self.default_sampling_params),
            "context_length": self.context_length,
            "dtype": self.dtype,
            "attention_backend": self.attention_backend,
            "confidence_backend": self.confidence_backend,
            "tensor_parallel_size": self.tensor_parallel_size,
            "expert_parallel_size": self.expert_parallel_size,
        }

    def get_load(self) -> dict:
        """Counters for /metrics and tests (a snapshot; safe to read from other threads: the counter keys are
        fixed at start, so copying never races with the engine thread adding one)."""
        s = self.scheduler
        return {
            "running_requests": len(s.running),
            "queued_requests": len(s.waiting) + self._inbox.qsize(),
            "kv_pages_total": self.allocator.capacity,
            "kv_pages_free": self.allocator.num_free,
            "kv_pages_used": self.allocator.capacity - self.allocator.num_free,
            "kv_pages_cached": self.radix.total,
            "kv_pages_locked": self.radix.protected,
            **dict(s.stats),
        }

    def warmup(self, sampling: bool = False, *, logprobs: bool = False, penalties: bool = False) -> int:
        """Compile every shape bucket now, so no request waits on a compile later (a progress bar shows it when
        ``progress`` is on; cached executables load from the persistent compilation cache). Returns the count.
        ``sampling`` / ``logprobs`` / ``penalties`` also compile the step variants for such requests (each
        multiplies the denoise buckets; without them a first such request compiles its variant on the fly).
        Without a progress bar (stderr is not a terminal: a service's log) the progress is logged as lines,
        ``compiled 17/45 shape buckets``, one per tenth of the buckets or per 5 s, whichever comes first."""
        from tqdm import tqdm

        variants = dict(sampling=sampling, logprobs=logprobs, penalties=penalties)
        total = self.runner.num_buckets(**variants)
        start = time.perf_counter()
        shown = {"done": 0, "logged": 0, "at": start}
        shown_lock = threading.Lock()  # buckets complete on the compile pool's threads

        def log_progress():
            with shown_lock:
                shown["done"] += 1
                done, now = shown["done"], time.perf_counter()
                if done < total and (done - shown["logged"] >= max(1, total // 10) or now - shown["at"] >= 5):
                    shown.update(logged=done, at=now)
                    log.info("compiled %d/%d shape buckets", done, total)

        with self._lock, tqdm(total=total, desc="compiling", unit="bucket", disable=not self.progress,
                              leave=False) as bar:
            count = self.runner.warmup(**variants, on_bucket=(lambda: bar.update(1)) if self.progress else log_progress)
        log.info("compiled %d shape buckets in %.1f s (compilation cache: %s)", count, time.perf_counter() - start,
                 self.compilation_cache or "off")
        return count

    # ------------------------------------------------------------------------------------------
    # Requests
    # ------------------------------------------------------------------------------------------
    def make_request(self, input_ids: list[int], sampling_params: dict | SamplingParams | None = None, *,
                     rid: str | None = None, on_event: Callable | None = None,
                     field: str = "input_ids", provisional: bool = False, stream: bool = False) -> Request:
        """Validate one request (ValueError naming the field on bad input) and build it; does not enqueue."""
        params = self._sampling_params(sampling_params)
        # (The checks run at C speed over the ids first, as a prompt may hold thousands; the slow path names the
        # offending one.)
        if not isinstance(input_ids, (list, tuple)) or (
                set(map(type, input_ids)) - {int} and not all(_is_int(t) for t in input_ids)):
            raise ValueError(f"{field}: must be a list of integer token ids")
        vocab = self.config.vocab_size
        if input_ids and not (min(input_ids) >= 0 and max(input_ids) < vocab):
            i, t = next((i, t) for i, t in enumerate(input_ids) if not 0 <= t < vocab)
            raise ValueError(f"{field}[{i}]: token id {t} is outside the vocabulary [0, {vocab})")
        first_block_end = (len(input_ids) // self.block_size + 1) * self.block_size
        if first_block_end > self.context_length:
            raise ValueError(f"{field}: the prompt has {len(input_ids)} tokens; with a block of {self.block_size} it "
                             f"does not fit the context length {self.context_length}")
        if params.stop and self.tokenizer is None:
            raise ValueError("sampling_params.stop: stop strings need a tokenizer; this model has none")
        if rid is not None:
            if not isinstance(rid, str) or not rid or len(rid) > MAX_RID_CHARS:
                raise ValueError(f"rid: must be a non-empty string of at most {MAX_RID_CHARS} characters")
            check_text(rid, "rid")
        seed = params.seed if params.seed is not None else int(self._rng.integers(0, 2 ** 32))
        return Request(rid=rid or uuid.uuid4().hex, prompt_ids=list(map(int, input_ids)), params=params,
                       seed=seed, on_event=on_event, provisional=provisional, stream=stream or provisional)

    def _sampling_params(self, sampling_params) -> SamplingParams:
        """Validated params over the model's defaults. Requests often share their params (a client's fixed
        settings): those of scalar values are validated once and kept, keyed with each value's type (``True``
        equals ``1`` but is not a valid ``max_new_tokens``)."""
        merged = self._with_defaults(sampling_params)
        key = None
        if isinstance(merged, dict) and all(isinstance(k, str) and isinstance(v, _SCALARS) for k, v in merged.items()):
            key = tuple(sorted((k, type(v), v) for k, v in merged.items()))
            params = self._params_cache.get(key)
            if params is not None:
                return params
        params = SamplingParams.from_dict(merged, vocab_size=self.config.vocab_size)
        if key is not None and len(self._params_cache) < 4096:
            self._params_cache[key] = params
        return params

    def _with_defaults(self, params):
        """A request's sampling params over the model's defaults (generation_config.json): a key the request leaves
        out, or sets to null, takes the default. A ready-made SamplingParams is used as given."""
        if not self.default_sampling_params or not (params is None or isinstance(params, dict)):
            return params
        merged = dict(self.default_sampling_params)
        merged.update({k: v for k, v in (params or {}).items() if v is not None or k not in merged})
        return merged

    def tokenize(self, text: str, field: str = "text") -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"{field}: must be a string, got {type(text).__name__}")
        check_text(text, field, allow_nul=True)
        if self.tokenizer is None:
            raise ValueError(f"{field}: this model has no tokenizer; pass input_ids")
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def apply_chat_template(self, messages: list[dict] | str) -> str:
        """The tokenizer's chat template with the generation prompt (a string is one user message)."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("messages: this model's tokenizer has no chat template")
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def submit(self, req: Request) -> Request:
        """Enqueue a validated request (thread-safe)."""
        if self._shutdown:
            raise RuntimeError("the engine is shut down")
        if self.failure is not None:
            raise RuntimeError(self.failure)
        self._inbox.put(("add", req))
        self._wakeup.set()
        return req

    def abort(self, rid: str | Request) -> None:
        """Abort a request by id (thread-safe); its pages come back at the next round."""
        self._inbox.put(("abort", rid))
        self._wakeup.set()

    def flush_cache(self) -> bool:
        """Drop the prefix cache. Refused (False) while requests are running or queued."""
        with self._lock:
            if self.scheduler.has_work() or not self._inbox.empty():
                return False
            self.radix.reset()
            return True

    # ------------------------------------------------------------------------------------------
    # The loop
    # ------------------------------------------------------------------------------------------
    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._requests[item.rid] = item
                self.scheduler.add(item)
            else:
                req = item if isinstance(item, Request) else self._requests.get(item)
                if req is not None:
                    self.scheduler.abort(req)

    def step(self) -> bool:
        """One scheduler round (drains the inbox first). Returns whether there is more work."""
        with self._lock:
            self._drain_inbox()
            if self.failure is not None:
                self._fail_all(RuntimeError(self.failure))
            elif self.scheduler.has_work():
                with jax.profiler.StepTraceAnnotation("engine_step", step_num=self._steps):
                    try:
                        self.scheduler.step()
                    except Exception as e:
                        if self.runner.channel is None:
                            raise
                        raise self._group_failed(e) from e
                self._steps += 1
                if self._profiling and self._profile_steps and self._steps >= self._profile_stop_at:
                    self.stop_profile()
            for rid in [rid for rid, r in self._requests.items() if r.finished]:
                del self._requests[rid]
            return self.scheduler.has_work() or not self._inbox.empty()

    def start(self) -> None:
        """Run the scheduler in a background thread (the server's mode)."""
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="dllm-engine-loop", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                busy = self.step()
            except Exception as e:  # the loop never dies. Errors of one request or one device call fail only
                # those (the scheduler's isolation); what reaches here is a fault of the scheduler itself, after
                # which no request's state can be trusted: fail the in-flight ones, keep serving
                log.exception("engine loop: %s", e)
                self._fail_all(e)
                busy = False
            if not busy:
                self._keepalive()
                self._wakeup.wait(0.05)
                self._wakeup.clear()

    def _fail_all(self, error: Exception) -> None:
        message = str(error) if self.failure is not None else f"internal error: {type(error).__name__}: {error}"
        with self._lock:
            for req in list(self.scheduler.running) + list(self.scheduler.waiting):
                self.scheduler.abort(req, message=message)

    def _keepalive(self) -> None:
        """Multi-process leader, idle: keep the followers' wait under the collective timeout (and notice a dead
        follower while no request runs)."""
        keepalive = getattr(self.runner.channel, "keepalive", None)
        if keepalive is None or self.failure is not None:
            return
        try:
            with self._lock:
                keepalive()
        except Exception as e:
            self._group_failed(e)

    def _group_failed(self, error: Exception) -> RuntimeError:
        """A device call or a broadcast failed in a multi-process engine: the mesh cannot be trusted any more
        (a process is gone, or the processes may have diverged). Fail every request with one clear message and
        refuse new ones; returns the error to raise."""
        from dllm_jax.distributed import GroupFailure, lost_reason

        if self.failure is None:
            cause = str(error) if isinstance(error, GroupFailure) else \
                f"a device call failed ({lost_reason()}?): {type(error).__name__}: {error}"
            self.failure = f"multi-process engine failed: {cause}; every process of the group must be restarted"
            log.error("%s", self.failure)
        self._fail_all(RuntimeError(self.failure))
        return GroupFailure(self.failure)

    @property
    def is_leader(self) -> bool:
        """Multi-host: only process 0 schedules; the others call :meth:`follow`."""
        return jax.process_index() == 0

    def follow(self) -> int:
        """Follower hosts: run the leader's device calls until it shuts down (see dllm_jax.distributed)."""
        from dllm_jax.distributed import GroupFailure, lost_reason

        if self.runner.channel is None:
            raise RuntimeError("follow() needs a multi-host channel (several processes)")
        try:
            return self.runner.follow()
        except GroupFailure:
            raise
        except Exception as e:  # a collective inside a replayed step: the leader or another follower is gone
            raise GroupFailure(f"a replayed device call failed ({lost_reason()}?): {type(e).__name__}: {e}") from e

    def shutdown(self) -> None:
        if self._shutdown:
            return
        if self._thread is not None:
            self._stop.set()
            self._wakeup.set()
            self._thread.join()
            self._thread = None
        with self._lock:
            self._drain_inbox()
            for req in list(self.scheduler.running) + list(self.scheduler.waiting):
                self.scheduler.abort(req, message="engine shut down")
        if self._profiling:
            self.stop_profile()
        if self.is_leader and self.failure is None:
            self.runner.stop_followers()
        self._shutdown = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    # ------------------------------------------------------------------------------------------
    # Profiling
    # ------------------------------------------------------------------------------------------
    def start_profile(self, profile_dir: str | None = None, num_steps: int | None = None) -> str:
        """Start a JAX profiler trace (perfetto) into ``profile_dir``; it stops after ``num_steps`` rounds
        (default: the engine's ``profile_steps``; 0 = until :meth:`stop_profile`)."""
        directory = os.path.abspath(profile_dir or self._profile_dir or "dllm_profile")
        with self._profile_lock:
            if self._profiling:
                raise RuntimeError("a profile is already being recorded")
            os.makedirs(directory, exist_ok=True)
            jax.profiler.start_trace(directory, create_perfetto_trace=True)
            self._profiling = True
            self._profile_current = directory
            steps = self._profile_steps if num_steps is None else num_steps
            self._profile_steps = steps
            self._profile_stop_at = self._steps + steps
            return directory

    def stop_profile(self) -> str | None:
        with self._profile_lock:  # the loop's automatic stop and an explicit one may race
            if not self._profiling:
                return None
            jax.profiler.stop_trace()
            self._profiling = False
            return self._profile_current

    # ------------------------------------------------------------------------------------------
    # generate()
    # ------------------------------------------------------------------------------------------
    def generate(self, prompt: str | list[str] | None = None, sampling_params: dict | list[dict] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None, stream: bool = False, *,
                 rid: str | list[str] | None = None, stream_provisional: bool = False,
                 return_logprob: bool | None = None, top_logprobs_num: int | None = None):
        """Generate for one prompt (dict result), a batch (list of dicts) or, with ``stream=True``, one prompt
        as an iterator of committed-block chunks (``text`` / ``output_ids`` are the new part; the last chunk has
        ``finished: True`` and the full ``meta_info``). With ``stream_provisional=True`` the stream also carries,
        after every denoise step that leaves the block unfinished, a chunk with ``provisional: True`` and the
        block's current state (:meth:`provisional_chunk`); those chunks add no ``text`` / ``output_ids``, and
        the committed chunk that follows supersedes them.

        ``return_logprob`` / ``top_logprobs_num`` (SGLang's arguments; the same as the sampling params of those
        names) add ``meta_info["output_token_logprobs"]`` (``[logprob, token_id, None]`` per output token) and
        ``meta_info["output_top_logprobs"]`` (per output token, the k most likely such triples); see
        :meth:`meta_info`."""
        ids_list, single = self._inputs(prompt, input_ids)
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(ids_list):
                raise ValueError(f"sampling_params: {len(sampling_params)} entries for {len(ids_list)} prompts")
            params_list = sampling_params
        else:
            params_list = [sampling_params] * len(ids_list)
        extra = {k: v for k, v in (("return_logprob", return_logprob), ("top_logprobs_num", top_logprobs_num))
                 if v is not None}
        if extra:
            params_list = [_with_fields(p, extra) for p in params_list]
        rids = rid if isinstance(rid, list) else [rid] * len(ids_list)
        if stream:
            if not single:
                raise ValueError("stream: streaming takes a single prompt")
            return self._stream(ids_list[0], params_list[0], rids[0], stream_provisional)
        watchers = []
        reqs = []
        for i, (ids, params) in enumerate(zip(ids_list, params_list)):
            field = "input_ids" if single else f"input_ids[{i}]"
            w = _Watcher()
            reqs.append(self.make_request(ids, params, rid=rids[i], on_event=w, field=field))
            watchers.append(w)
        for req in reqs:
            self.submit(req)
        self._wait(reqs)
        outs = [self.result(req) for req in reqs]
        return outs[0] if single else outs

    def _inputs(self, prompt, input_ids):
        if (prompt is None) == (input_ids is None):
            raise ValueError("prompt / input_ids: give exactly one of them")
        if prompt is not None:
            if isinstance(prompt, str):
                return [self.tokenize(prompt, "prompt")], True
            if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
                return [self.tokenize(p, f"prompt[{i}]") for i, p in enumerate(prompt)], False
            raise ValueError("prompt: must be a string or a non-empty list of strings")
        if isinstance(input_ids, list) and input_ids and all(isinstance(x, list) for x in input_ids):
            return input_ids, False
        if isinstance(input_ids, list):
            return [input_ids], True
        raise ValueError("input_ids: must be a list of token ids or a list of such lists")

    def _wait(self, reqs: list[Request]) -> None:
        if self._thread is not None:
            for req in reqs:
                req.on_event.done.wait()
            return
        while not all(r.finished for r in reqs):
            self.step()

    def _stream(self, ids, params, rid, provisional: bool = False) -> Iterator[dict]:
        sink = ChunkSink(self)
        req = self.make_request(ids, params, rid=rid, on_event=sink, provisional=provisional, stream=True)
        self.submit(req)
        try:
            while True:
                try:
                    chunk = sink.chunks.get_nowait()
                except queue.Empty:
                    if self._thread is None:
                        self.step()
                        continue
                    try:
                        chunk = sink.chunks.get(timeout=0.1)
                    except queue.Empty:
                        continue
                yield chunk
                if chunk["finished"]:
                    return
        finally:
            if not req.finished:  # the consumer stopped early: abort, so its pages come back
                self.abort(req)
                if self._thread is None:
                    self.step()

    # ------------------------------------------------------------------------------------------
    # Outputs
    # ------------------------------------------------------------------------------------------
    def _decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        # A fast tokenizer's own decoding: transformers' public ``decode`` first walks every id in Python looking
        # for tensors to convert, half the time of detokenizing an answer. Our ids are a list of ints already.
        tokenizer = self.tokenizer
        if getattr(tokenizer, "is_fast", False) and hasattr(tokenizer, "_decode"):
            return tokenizer._decode(ids, skip_special_tokens=skip_special_tokens)
        return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def _text(self, req: Request) -> str:
        if self.tokenizer is None:
            return ""
        text = self._decode(req.output_ids, req.params.skip_special_tokens)
        reason = req.finish_reason or {}
        if reason.get("type") == "stop" and isinstance(reason.get("matched"), str):
            cut = text.find(reason["matched"])
            if cut >= 0:
                text = text[:cut]
        return text

    def meta_info(self, req: Request) -> dict:
        end = req.finish_time or time.perf_counter()
        return {
            "id": req.rid,
            "prompt_tokens": len(req.prompt_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": req.cached_tokens or 0,
            "forward_passes": req.forward_passes,
            "finish_reason": req.finish_reason,
            "e2e_latency": end - req.arrival_time,
            "time_to_first_block": None if req.first_block_time is None else req.first_block_time - req.arrival_time,
            "retractions": req.retractions,
            **self._logprob_meta(req),
        }

    @staticmethod
    def _logprob_meta(req: Request) -> dict:
        """SGLang's logprob fields: for each output token so far, ``[logprob, token_id, None]`` under the forward
        that wrote it (the distribution the algorithm used: mask id excluded, penalties applied, the row's
        temperature; top-k / top-p filtering not applied), and with ``top_logprobs_num = k`` that forward's k most
        likely tokens, most likely first. The lists grow with ``output_ids`` (a streamed chunk's entries are the
        slice of its new tokens); a token at ``-inf`` (masked by a penalty) reads -9999.0."""
        k = req.params.logprobs
        if k < 0:
            return {}
        out = {"output_token_logprobs": list(req.output_token_logprobs)}
        if k > 0:
            out["output_top_logprobs"] = list(req.output_top_logprobs)
        return out

    def result(self, req: Request) -> dict:
        return {"text": self._text(req), "output_ids": list(req.output_ids), "meta_info": self.meta_info(req)}

    def chunk(self, req: Request) -> dict | None:
        """The part of the output committed since the last chunk of this request (None if nothing new).

        Text is never sent twice: an incomplete UTF-8 sequence at the end waits for the rest, and while the
        request runs, a tail that could be the start of a stop string is held back (the final text is cut where
        a stop string begins, which may be inside text committed by an earlier block)."""
        finished = req.finished
        text = self._text(req)
        if not finished:
            text = text.rstrip("\ufffd")
            hold = max((len(s) - 1 for s in req.params.stop), default=0)
            if hold:
                text = text[:max(len(req.emitted_text), len(text) - hold)]
        new_ids = req.output_ids[req.emitted_tokens:]
        new_text = text[len(req.emitted_text):] if text.startswith(req.emitted_text) else ""
        if not new_ids and not new_text and not finished:
            return None
        req.emitted_tokens = len(req.output_ids)
        if text.startswith(req.emitted_text):
            req.emitted_text = text
        return {"text": new_text, "output_ids": new_ids, "finished": finished, "meta_info": self.meta_info(req)}


    def provisional_chunk(self, req: Request) -> dict:
        """The block being denoised, after a step that left it unfinished: ``tokens`` (the mask id where still
        masked), ``masked`` (positions still to decode), ``immutable`` (prompt / committed positions),
        ``pieces`` (each position's token text, None where masked; only with a tokenizer), ``offset`` (absolute
        position of the block's first token), ``step`` (forwards so far in this block). Adds no text."""
        tokens = [int(t) for t in req.block_tokens]
        immutable = [bool(x) for x in req.block_immutable]
        masked = [t == self.mask_token_id and not imm for t, imm in zip(tokens, immutable)]
        pieces = None
        if self.tokenizer is not None:
            pieces = [None if m else self._decode([t], req.params.skip_special_tokens) for t, m in zip(tokens, masked)]
        block = {"offset": req.prefix_len(self.block_size), "step": req.block_steps, "tokens": tokens,
                 "masked": masked, "immutable": immutable, "pieces": pieces}
        return {"text": "", "output_ids": [], "finished": False, "provisional": True, "block": block,
                "meta_info": self.meta_info(req)}


class _Watcher:
    """Per-request event sink for blocking generate(): wakes the waiter when the request finishes."""

    def __init__(self):
        self.done = threading.Event()

    def __call__(self, req: Request, event: dict) -> None:
        if req.finished:
            self.done.set()


class ChunkSink:
    """Per-request event sink for streaming: builds each chunk on the engine's thread, where the request's state
    is consistent, and queues it for the consumer (``put`` may be replaced, e.g. by an asyncio hand-off)."""

    def __init__(self, engine: "Engine", put: Callable[[dict], None] | None = None):
        self.engine = engine
        self.chunks: queue.SimpleQueue = queue.SimpleQueue()
        self.put = put or self.chunks.put

    def __call__(self, req: Request, event: dict) -> None:
        if event.get("provisional"):
            self.put(self.engine.provisional_chunk(req))
            return
        chunk = self.engine.chunk(req)
        if chunk is not None:
            self.put(chunk)


SAMPLING_DEFAULTS = ("model", "none")


def _sampling_defaults(model_path: str, mode: str, vocab_size: int) -> dict:
    """The defaults a request's unset sampling params take: ``generation_config.json``'s (``"model"``; see
    :func:`dllm_jax.model.loader.generation_defaults`) or none (``"none"``: SamplingParams' own, i.e. greedy)."""
    import dataclasses

    from dllm_jax.model.loader import generation_defaults

    if mode not in SAMPLING_DEFAULTS:
        raise ValueError(f"sampling_defaults: must be one of {SAMPLING_DEFAULTS}, got {mode!r}")
    if mode == "none":
        return {}
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    defaults = {k: v for k, v in generation_defaults(model_path).items() if k in names}
    try:
        SamplingParams.from_dict(defaults, vocab_size=vocab_size, field_prefix="generation_config.json")
    except ValueError as e:
        raise ValueError(f"{os.path.join(model_path, 'generation_config.json')}: {e} (sampling_defaults='none' "
                         f"ignores the file)") from None
    return defaults


_SCALARS = (str, int, float, bool, type(None))


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _with_fields(params, extra: dict):
    """Sampling params (a dict, a SamplingParams or None) with ``extra`` fields set."""
    import dataclasses

    if isinstance(params, SamplingParams):
        return SamplingParams.from_dict({**{f.name: getattr(params, f.name) for f in dataclasses.fields(params)},
                                         **extra})
    if params is not None and not isinstance(params, dict):
        return params  # SamplingParams.from_dict names the field's error
    return {**(params or {}), **extra}


def _show_progress(progress: bool | None) -> bool:
    """Progress bars (weights, warm-up): on when asked, or by default when stderr is a terminal."""
    if progress is not None:
        return bool(progress)
    import sys

    return sys.stderr.isatty()


def _load_algorithm_config(config) -> dict:
    if config is None:
        return {}
    if isinstance(config, dict):
        return dict(config)
    if isinstance(config, (str, os.PathLike)):
        import yaml

        try:
            with open(config) as f:
                data = yaml.safe_load(f) or {}
        except OSError as e:
            raise ValueError(f"algorithm_config: cannot read {config}: {e}") from e
        if not isinstance(data, dict):
            raise ValueError(f"algorithm_config: {config} must hold a mapping")
        return data
    raise ValueError(f"algorithm_config: expected a dict or a YAML path, got {type(config).__name__}")


_default_engine: Engine | None = None
_default_lock = threading.Lock()


def generate(prompt: str | list[str], *, chat: bool = True, **sampling_params):
    """One call on the shipped model: ``dllm_jax.generate("prompt", max_new_tokens=32)``.

    ``chat=True`` wraps the prompt in the model's chat template (the shipped model is a chat model).
    """
    global _default_engine
    with _default_lock:
        if _default_engine is None:
            _default_engine = Engine()
    engine = _default_engine
    if chat:
        prompt = engine.apply_chat_template(prompt) if isinstance(prompt, str) else [
            engine.apply_chat_template(p) for p in prompt]
    return engine.generate(prompt=prompt, sampling_params=sampling_params or None)
