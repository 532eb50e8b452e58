"""``Engine``: the public Python interface (see DESIGN.md, "Public interfaces").

The engine owns a :class:`~dllm_jax.engine.scheduler.Scheduler` and drives it either from the caller's thread
(``generate`` on a plain engine) or from one background thread (``start()``; the HTTP server does this), in
which case ``generate`` and :meth:`Engine.submit` only enqueue and wait. Requests and aborts from other threads
go through an inbox that the loop drains between rounds, so the scheduler itself is single-threaded.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Iterator

import jax
import numpy as np

from dllm_jax import compile_cache
from dllm_jax.engine.compilation import ProgressLines
from dllm_jax.engine.config import EngineConfig, engine_config
from dllm_jax.engine.families import SERVING
from dllm_jax.engine.request import Request
from dllm_jax.engine.info import EngineInfo
from dllm_jax.engine.inputs import RequestInputs, sampling_defaults, with_fields
from dllm_jax.engine.output import ChunkSink, FinishWatcher
from dllm_jax.engine.occupation import MemoryOccupation
from dllm_jax.engine.pause import PauseGeneration
from dllm_jax.engine.profiling import Profiling
from dllm_jax.engine.rounds import Rounds
from dllm_jax.engine.scoring import Scoring
from dllm_jax.engine.sampling import SamplingParams
from dllm_jax.engine.weights import WeightUpdates
from dllm_jax.model.family import family_of

log = logging.getLogger("dllm_jax")



def default_model_path() -> str:
    from dllm_jax.assets import DEFAULT_MODEL_PATH

    return DEFAULT_MODEL_PATH


class Engine(Rounds, RequestInputs, EngineInfo, Profiling, WeightUpdates, PauseGeneration, MemoryOccupation,
             Scoring):
    """A block-diffusion LM server in a Python object.

    Options: see :class:`~dllm_jax.engine.config.EngineConfig` (``dllm_jax.EngineConfig``,
    dllm_jax/engine/config.py: one field per option, with its default, what ``None`` / ``"auto"`` resolve to, and
    its checks). ``Engine(EngineConfig(...))``, ``Engine(**options)``, ``Engine(model_path, **options)`` and
    ``Engine(config=cfg, **overrides)`` build the same engine; ``engine.engine_config`` is its config with the
    derived defaults filled in. ``channel`` is no option: the multi-process channel (:mod:`dllm_jax.distributed`;
    default: the process group's, if any).
    """

    def __init__(self, model_path: str | os.PathLike | EngineConfig | None = None, *,
                 config: EngineConfig | None = None, channel=None, **options):
        import dataclasses

        from dllm_jax.model.loader import load_model

        # Cheap checks first (EngineConfig's, then a backend the platform cannot run): before any weight is read.
        o = engine_config(model_path, config, options).resolved()
        self.attention_backend = o.attention_backend
        self.confidence_backend = o.confidence_backend
        self.progress = o.progress
        self.compilation_cache = compile_cache.enable(o.compilation_cache)

        self.model_path = os.path.abspath(o.model_path) if o.model_path is not None else default_model_path()
        self.engine_config = o = dataclasses.replace(o, model_path=self.model_path)
        log.info("loading %s on %s (%d device%s), %s", self.model_path, jax.default_backend(), jax.device_count(),
                 "" if jax.device_count() == 1 else "s", o.dtype)
        loaded = load_model(self.model_path, dtype=o.dtype, block_size=o.block_size, mask_token_id=o.mask_token_id,
                            progress=self.progress, tp_shards=o.tensor_parallel_size)
        self.config = cfg = loaded.config
        self.tokenizer = loaded.tokenizer
        self.default_sampling_params = sampling_defaults(self.model_path, o.sampling_defaults, cfg.vocab_size)
        self.block_size = B = cfg.block_size
        self.mask_token_id = cfg.mask_token_id
        self.eos_token_ids = tuple(cfg.eos_token_ids)
        self.schedule = o.schedule
        self.dtype = o.dtype
        self.context_length = int(o.context_length or cfg.max_position_embeddings)
        if self.context_length < B:
            raise ValueError(f"context_length: must be at least one block ({B}), got {self.context_length}")
        if o.max_prefill_tokens < B:
            raise ValueError(f"max_prefill_tokens: must be at least one block ({B}), got {o.max_prefill_tokens}")
        self.max_running_requests = o.max_running_requests
        self.enable_prefix_cache = o.enable_prefix_cache
        # the family's runner, pools, cache and block policy under the one scheduler (dllm_jax/engine/families.py)
        channel = SERVING[family_of(cfg).serving](self, loaded, o, channel)
        self.host_overlap = o.host_overlap
        self._rng = np.random.default_rng(o.seed)
        self._params_cache: dict[tuple, SamplingParams] = {}  # see _sampling_params
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._requests: dict[str, Request] = {}
        self._lock = threading.RLock()  # one driver of the scheduler at a time
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wakeup = threading.Event()
        self._steps = 0
        self._held_aborts: list = []  # aborts taken in while a call ran (rounds.py)
        self._profile_dir = o.profile_dir
        self._profile_steps = o.profile_steps
        self._profiling = False
        self._profile_lock = threading.Lock()
        self._shutdown = False
        self.weight_version = o.weight_version  # meta_info["weight_version"] (dllm_jax/engine/weights.py)
        self.failure: str | None = None  # multi-process: why the process group failed (the engine is then dead)
        if channel is not None and hasattr(channel, "barrier"):
            channel.barrier("engine")  # every process loaded: the first collective will not wait on a slow load
        if o.warmup and self.is_leader:  # followers compile as they follow the leader's warm-up calls
            self.warmup()
        if o.profile_dir is not None:
            self.start_profile(o.profile_dir)

    # ------------------------------------------------------------------------------------------
    # Warm-up and requests
    # ------------------------------------------------------------------------------------------
    def warmup(self, sampling: bool = False, *, logprobs: bool = False, penalties: bool = False,
               grammar: bool = False, background: bool = False) -> int:
        """Compile every shape bucket now, so no request waits on a compile later (a progress bar shows it when
        ``progress`` is on; cached executables load from the persistent compilation cache). Returns the count
        compiled now. ``sampling`` / ``logprobs`` / ``penalties`` / ``grammar`` also compile the step variants for
        such requests (each multiplies the denoise buckets; without them a first such request compiles its variant
        on the fly).
        ``background`` (a staged warm-up, ``dllm-jax serve``'s): compile now only what a short chat needs (the
        one-request denoise step at the widest table, a short prompt's prefill) and the rest on a background
        thread, smaller buckets first; meanwhile a call runs in a larger compiled bucket, or waits for its own,
        whose compile then goes first (SDAR / LLaDA2; a DiffusionGemma engine compiles everything now).
        Without a progress bar (stderr is not a terminal: a service's log) the progress is logged as lines,
        ``compiled 17/45 shape buckets``, one per tenth of the buckets or per 5 s, whichever comes first."""
        from tqdm import tqdm

        variants = dict(sampling=sampling, logprobs=logprobs, penalties=penalties)
        if grammar:
            variants["grammar"] = True
        total = self.runner.num_buckets(background, **variants)  # compiled now
        start = time.perf_counter()
        with self._lock, tqdm(total=total, desc="compiling", unit="bucket", disable=not self.progress,
                              leave=False) as bar:
            on_bucket = (lambda: bar.update(1)) if self.progress else ProgressLines(total, log)
            count = self.runner.warmup(**variants, on_bucket=on_bucket, background=background)
        log.info("compiled %d shape buckets in %.1f s (compilation cache: %s)%s", count, time.perf_counter() - start,
                 self.compilation_cache or "off",
                 f"; {self.runner.compiler.pending_keys()} more compile in the background" if background else "")
        return count

    # ------------------------------------------------------------------------------------------
    # Requests in (their checks: dllm_jax/engine/inputs.py)
    # ------------------------------------------------------------------------------------------
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
        """Drop the prefix cache. Refused (False) while requests are running or queued; a RuntimeError while
        requests are paused in place (``pause_generation``)."""
        with self._lock:
            self._check_flush()
            if self.scheduler.has_work() or not self._inbox.empty():
                return False
            self.scheduler.policy.reset_cache()
            return True

    # ------------------------------------------------------------------------------------------
    # The loop
    # ------------------------------------------------------------------------------------------
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
        self.runner.compiler.close()
        self._shutdown = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    # ------------------------------------------------------------------------------------------
    # generate()
    # ------------------------------------------------------------------------------------------
    def generate(self, prompt: str | list[str] | None = None, sampling_params: dict | list[dict] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None, stream: bool = False, *,
                 rid: str | list[str] | None = None, stream_provisional: bool = False,
                 return_logprob: bool | None = None, top_logprobs_num: int | None = None, image_data=None):
        """Generate for one prompt (dict result), a batch (list of dicts) or, with ``stream=True``, one prompt
        as an iterator of committed-block chunks (``text`` / ``output_ids`` are the new part; the last chunk has
        ``finished: True`` and the full ``meta_info``). With ``stream_provisional=True`` the stream also carries,
        after every denoise step that leaves the block unfinished, a chunk with ``provisional: True`` and the
        block's current state (:meth:`provisional_chunk`); those chunks add no ``text`` / ``output_ids``, and
        the committed chunk that follows supersedes them.

        ``return_logprob`` / ``top_logprobs_num`` (SGLang's arguments; the same as the sampling params of those
        names) add ``meta_info["output_token_logprobs"]`` (``[logprob, token_id, None]`` per output token) and
        ``meta_info["output_top_logprobs"]`` (per output token, the k most likely such triples); see
        :meth:`meta_info`.

        ``image_data`` (a model with a vision tower: DiffusionGemma): the images of a prompt, each image bytes, a
        path, base64 text or a data URL, one image or a list of them; for a batch, a list with one such entry per
        prompt (None: no image). The prompt holds one image token per image, where it goes (the chat template
        writes it for an image part); see :mod:`dllm_jax.engine.images`."""
        ids_list, single = self._inputs(prompt, input_ids)
        images_list = _per_prompt_images(image_data, len(ids_list), single)
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(ids_list):
                raise ValueError(f"sampling_params: {len(sampling_params)} entries for {len(ids_list)} prompts")
            params_list = sampling_params
        else:
            params_list = [sampling_params] * len(ids_list)
        extra = {k: v for k, v in (("return_logprob", return_logprob), ("top_logprobs_num", top_logprobs_num))
                 if v is not None}
        if extra:
            params_list = [with_fields(p, extra) for p in params_list]
        rids = rid if isinstance(rid, list) else [rid] * len(ids_list)
        if stream:
            if not single:
                raise ValueError("stream: streaming takes a single prompt")
            return self._stream(ids_list[0], params_list[0], rids[0], stream_provisional, images_list[0])
        reqs = []
        for i, (ids, params) in enumerate(zip(ids_list, params_list)):
            field = "input_ids" if single else f"input_ids[{i}]"
            w = FinishWatcher()
            reqs.append(self.make_request(ids, params, rid=rids[i], on_event=w, field=field,
                                          image_data=images_list[i],
                                          image_field="image_data" if single else f"image_data[{i}]"))
        for req in reqs:
            self.submit(req)
        self._wait(reqs)
        outs = [self.result(req) for req in reqs]
        return outs[0] if single else outs

    def _wait(self, reqs: list[Request]) -> None:
        if self._thread is not None:
            for req in reqs:
                req.on_event.done.wait()
            return
        while not all(r.finished for r in reqs):
            self.step() or time.sleep(0.002)  # False while paused

    def _stream(self, ids, params, rid, provisional: bool = False, image_data=None) -> Iterator[dict]:
        sink = ChunkSink(self)
        req = self.make_request(ids, params, rid=rid, on_event=sink, provisional=provisional, stream=True,
                                image_data=image_data)
        self.submit(req)
        try:
            while True:
                try:
                    chunk = sink.chunks.get_nowait()
                except queue.Empty:
                    if self._thread is None:
                        self.step() or time.sleep(0.002)  # False while paused
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
    # Outputs (dllm_jax/engine/output.py renders them)
    # ------------------------------------------------------------------------------------------
    def meta_info(self, req: Request) -> dict:
        return self.output.meta_info(req)

    def result(self, req: Request) -> dict:
        return self.output.result(req)

    def chunk(self, req: Request) -> dict | None:
        return self.output.chunk(req)

    def provisional_chunk(self, req: Request) -> dict:
        return self.output.provisional_chunk(req)


def _per_prompt_images(image_data, count: int, single: bool) -> list:
    """``image_data`` per prompt: a single prompt's is its own (one image or a list); a batch's is a list with an
    entry per prompt."""
    if image_data is None:
        return [None] * count
    if single:
        return [image_data]
    if not isinstance(image_data, (list, tuple)) or len(image_data) != count:
        raise ValueError(f"image_data: for a batch of {count} prompts, a list with one entry per prompt (None: no "
                         f"image)")
    return list(image_data)


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
