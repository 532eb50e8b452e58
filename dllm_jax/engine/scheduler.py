"""The one host-side scheduler, for every model family: the queue, admission, the running set, retraction under
memory pressure, abort, failures, stop conditions, events and statistics.

What differs by family is its **block policy** (:mod:`dllm_jax.engine.policy`): how a request's pages are matched,
taken and given back, how a row starts, which device calls a round needs, what a result commits. A round
(:meth:`Scheduler.schedule` then :meth:`Scheduler.process` per call):

1. admit waiting requests in order while rows allow (the policy matches the prefix cache, takes pages and sets the
   phase: prefill if real tokens remain to encode, else decode);
2. a prefill call over the requests with real tokens to encode;
3. a denoise call over the decoding requests (FDFO: until the first row's block is done; sync: all of them);
4. each call's result committed (outputs, stop conditions, cache insertion), or, if the call failed, its
   requests failed.

Invariant at every step boundary: each KV page is free, held by a running request, or held by the family's cache
(:meth:`check_pages`). Isolation: an error that belongs to one request (a value its row cannot hold, a failing
commit or ``on_event`` callback) fails that request alone, with the error in its ``finish_reason``; a device call
that raises fails the requests of that call; the others are served on. With several processes a failed device
call is the group's failure instead (the engine's, see ``Engine._group_failed``).
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Iterator

import jax

from dllm_jax.engine.calls import Failed, RowError
from dllm_jax.engine.events import Events
from dllm_jax.engine.output import Output
from dllm_jax.engine.policy import Admission, Refuse
from dllm_jax.engine.request import Phase, Request

log = logging.getLogger("dllm_jax")

STAT_KEYS = ("requests", "prompt_tokens", "cached_tokens", "generation_tokens", "finished", "retractions",
             "prefill_forwards", "denoise_calls", "denoise_forwards", "refresh_rows", "chained_blocks")


class Scheduler(Events):
    def __init__(self, policy, *, eos_token_ids: tuple[int, ...], max_running_requests: int,
                 output: Output | None = None):
        self.policy = policy
        self.runner = policy.runner
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_running = max_running_requests
        self.output = output  # where stop strings are found (dllm_jax/engine/output.py)
        self._stop_sets: dict[tuple, frozenset[int]] = {}  # see stop_set
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        # Fixed keys (other threads copy this while the loop runs: the dict must never change size).
        self.stats = collections.Counter({k: 0 for k in STAT_KEYS})
        self.deferred_events, self.consumer_failures = [], []  # host overlap (events.py)
        policy.attach(self)

    # ------------------------------------------------------------------------------------------
    # Public
    # ------------------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)
        self.stats["requests"] += 1
        self.stats["prompt_tokens"] += len(req.prompt_ids)

    def abort(self, req: Request, message: str = "aborted") -> None:
        """Abort a queued or running request; its pages are released exactly once. No-op once finished."""
        if req.finished:
            return
        if req in self.waiting:
            self.waiting.remove(req)
        self.finish(req, {"type": "abort", "message": message}, keep=False)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Iterator:
        """One round's device calls, planned one at a time (each after the previous one was processed): admission,
        then a prefill call, then a denoise call. The caller runs each and hands its result to :meth:`process`.
        When nothing could run because every decoding row waits for a background compile, the policy waits a
        moment for it instead of spinning."""
        with jax.profiler.TraceAnnotation("schedule"):
            self._admit()
        prefill_reqs = [r for r in self.running if r.phase is Phase.PREFILL]
        call = self.policy.plan_prefill(prefill_reqs, retract=True) if prefill_reqs else None
        if call is not None:
            yield call
        decode_reqs = [r for r in self.running if r.phase is Phase.DECODE]
        denoise = self.policy.plan_denoise(decode_reqs) if decode_reqs else None
        if denoise is not None:
            yield denoise
        elif call is None and (decode_reqs or prefill_reqs):
            self.policy.idle()

    def schedule_ahead(self):
        """While a denoise call runs (the engine's host overlap): admit waiting requests and plan a prefill over
        the ones just admitted, never taking pages from a running request (the call in flight may be reading and
        writing them: no retraction; only free pages and evictable cache). The caller runs it right away; the
        device queues it behind the call in flight."""
        before = {id(r) for r in self.running}
        with jax.profiler.TraceAnnotation("schedule_ahead"):
            self._admit()
        admitted = [r for r in self.running if id(r) not in before and r.phase is Phase.PREFILL]
        return self.policy.plan_prefill(admitted, retract=False) if admitted else None

    def process(self, call, result) -> None:
        """Commit a call's result; a :class:`Failed` result fails that call's requests (:meth:`_fail_call`)."""
        if isinstance(result, Failed):
            self.policy.drop_call(call)
            if not isinstance(result.error, Exception):
                raise result.error
            self._fail_call(self.policy.call_requests(call), result.error)
        else:
            self.policy.commit(call, result)

    # ------------------------------------------------------------------------------------------
    # Life cycle (the policy calls these)
    # ------------------------------------------------------------------------------------------
    def _admit(self) -> None:
        self.policy.start_admission()
        i = 0
        while i < len(self.waiting) and len(self.running) < self.max_running:
            req = self.waiting[i]
            try:
                verdict = self.policy.admit(req)
            except Exception as e:
                self.fail(req, e)
                continue
            if verdict is Admission.WAIT:
                break
            if verdict is Admission.SKIP:
                i += 1
                continue
            del self.waiting[i]
            if isinstance(verdict, Refuse):
                self.finish(req, {"type": "abort", "message": verdict.message}, keep=False)
                continue
            self.running.append(req)
            if req.cached_tokens is None:
                req.cached_tokens = self.policy.cached_len(req)
                self.stats["cached_tokens"] += req.cached_tokens

    def retract(self, req: Request) -> None:
        """Give a running request's pages back; it keeps its committed outputs and is re-admitted later, when its
        encoded tokens are matched from the cache or re-encoded (the same tokens as an uninterrupted run)."""
        log.info("retracting request %s (KV pages ran out); it keeps %d output tokens", req.rid, len(req.output_ids))
        self.stats["retractions"] += 1
        req.retractions += 1
        self.policy.release(req, keep=True)
        self.running.remove(req)
        req.phase = Phase.WAITING
        self.waiting.appendleft(req)

    def finish(self, req: Request, reason: dict, *, keep: bool) -> None:
        """End a request: its pages go back (``keep``: its complete encoded pages stay cached), the finish event."""
        if req.finished:
            return
        if req in self.running:
            self.policy.release(req, keep=keep)
            self.running.remove(req)
        else:
            self.policy.release(req, keep=False)
        req.phase = Phase.FINISHED
        req.finish_reason = reason
        req.finish_time = time.perf_counter()
        self.stats["finished"] += 1
        self.emit(req)

    def fail(self, req: Request, error: Exception) -> None:
        """Fail one request on an error of its own: it finishes with ``abort`` and the error's message; its pages
        go back uncached (their KV may be what failed)."""
        log.error("request %s failed: %s: %s", req.rid, type(error).__name__, error,
                  exc_info=(type(error), error, error.__traceback__))
        if req in self.waiting:
            self.waiting.remove(req)
        self.finish(req, {"type": "abort", "message": f"internal error: {type(error).__name__}: {error}"},
                    keep=False)

    def _fail_call(self, reqs: list[Request], error: Exception) -> None:
        """A device call raised: its requests fail (never the others). Multi-process: the group's failure, raised
        on. If the KV pool went with the call, every running request lost its KV and the cache is emptied."""
        if isinstance(error, RowError):  # raised while packing, before any process ran the call
            self.fail(reqs[error.index], error.error)
            return
        if self.runner.channel is not None:
            raise error
        for req in reqs:
            self.fail(req, error)
        if self.policy.pool_lost():
            for req in list(self.running):
                self.fail(req, RuntimeError(f"the KV pool was lost with a failed device call ({error})"))
            self.policy.reset_cache()

    # ------------------------------------------------------------------------------------------
    # Outputs: what a committed block or canvas appends
    # ------------------------------------------------------------------------------------------
    def stop_set(self, req: Request) -> frozenset[int]:
        """The token ids that end the request's outputs (its stop ids, and EOS unless ignored); one set per distinct
        choice, kept (a commit reads it for every block)."""
        stop_token_ids, ignore_eos = key = (req.params.stop_token_ids, req.params.ignore_eos)
        ids = self._stop_sets.get(key)
        if ids is None:
            ids = frozenset(stop_token_ids) if ignore_eos else frozenset(stop_token_ids) | self.eos_token_ids
            if len(self._stop_sets) < 1024:
                self._stop_sets[key] = ids
        return ids

    def append_outputs(self, req: Request, new: list[int]) -> dict | None:
        """Append a committed block's new tokens; apply max_new_tokens, EOS / stop ids and stop strings. Returns
        the finish reason, if one applies."""
        params = req.params
        stop_ids = self.stop_set(req)
        finish = None
        start = len(req.output_ids)
        if req.first_block_time is None:
            req.first_block_time = time.perf_counter()
        # The first stop id ends the outputs (with it); else max_new_tokens does (a stop id at that very token wins).
        room = max(1, params.max_new_tokens - start)
        stop_at = None
        if not stop_ids.isdisjoint(new):  # (a check at C speed: most blocks hold no stop id)
            stop_at = next(j for j, tok in enumerate(new) if tok in stop_ids)
        if stop_at is not None and stop_at < room:
            new = new[:stop_at + 1]
            finish = {"type": "stop", "matched": new[-1]}
        elif len(new) >= room:
            new = new[:room]
            finish = {"type": "length", "length": params.max_new_tokens}
        req.output_ids.extend(new)
        if params.stop and self.output is not None:
            hit = self.output.find_stop_string(req, start)
            if hit is not None:
                finish = hit
        self.stats["generation_tokens"] += len(req.output_ids) - start  # after any stop-string cut
        return finish

    # ------------------------------------------------------------------------------------------
    # Checks (tests call this after every run)
    # ------------------------------------------------------------------------------------------
    def check_pages(self) -> None:
        """Every page is exactly one of free / held by running requests / held by the cache."""
        self.policy.check_pages()
