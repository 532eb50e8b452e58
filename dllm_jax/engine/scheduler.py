"""The host-side scheduler: admission with prefix reuse, multi-block prefill, FDFO / synchronous denoise rounds,
retraction under memory pressure, abort, stop conditions.

One call of :meth:`Scheduler.step` is one round:

1. admit waiting requests (radix match first, then classification: prefill if a complete block of real tokens
   is not yet encoded, else decode) while rows and pages allow;
2. a prefill forward over the complete prompt (or re-encoded output) blocks of admitted requests, as many blocks
   per row as the prefill budget allows (block-causal inside the chunk);
3. a denoise call over every decoding row: one step (FDFO: rows whose block resolves leave, others carry their
   partial block and algorithm state to the next round, new rows may join) or the whole block loop on the device
   (sync);
4. commit resolved blocks: outputs, stop conditions, radix insertion of the complete real blocks.

Invariant kept at every step boundary: each KV page is free, owned by exactly one request (``own_pages``), or held
by the radix index (kept alive for a request by the lock on its ``node``).

Isolation: an error that belongs to one request (a value its row cannot hold, a failing commit or ``on_event``
callback) fails that request alone, with the error in its ``finish_reason``; a device call that raises fails the
requests of that call. The others, running or waiting, are served on (:meth:`Scheduler._fail`). With several
processes a failed device call is the group's failure instead (the engine's, see ``Engine._group_failed``).
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Iterator

import jax
import numpy as np

from dllm_jax.cache.pages import OutOfPages, PageAllocator
from dllm_jax.cache.radix import BlockRadixIndex
from dllm_jax.engine.output import Output
from dllm_jax.engine.request import Phase, Request
from dllm_jax.decode.step import RNG_STEPS_PER_BLOCK
from dllm_jax.engine.commit import CommitMixin
from dllm_jax.engine.calls import (DecodeOutput, DecodeRow, DenoiseCall, Failed, PenaltyRow, PrefillCall, PrefillRow,
                                   RowError)
from dllm_jax.engine.runner import CHAIN_MAX_ROWS, ModelRunner

log = logging.getLogger("dllm_jax")


STAT_KEYS = ("requests", "prompt_tokens", "cached_tokens", "generation_tokens", "finished", "retractions",
             "prefill_forwards", "denoise_calls", "denoise_forwards", "refresh_rows", "chained_blocks")


class Scheduler(CommitMixin):
    def __init__(self, runner: ModelRunner, allocator: PageAllocator, radix: BlockRadixIndex, *, block_size: int,
                 mask_id: int, eos_token_ids: tuple[int, ...], max_running_requests: int, context_length: int,
                 max_prefill_blocks: int, output: Output | None = None,
                 max_steps_per_call: int = 1 << 30):
        self.runner = runner
        self.allocator = allocator
        self.radix = radix
        self.B = block_size
        self.mask_id = mask_id
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_running = max_running_requests
        self.context_length = context_length
        self.max_prefill_blocks = max_prefill_blocks
        self.output = output  # where stop strings are found (dllm_jax/engine/output.py)
        self.max_steps_per_call = max_steps_per_call
        self._stop_sets: dict[tuple, frozenset[int]] = {}  # see _stop_set
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        # Fixed keys (other threads copy this while the loop runs: the dict must never change size).
        self.stats = collections.Counter({k: 0 for k in STAT_KEYS})
        self.deferred_events, self.consumer_failures = [], []  # host overlap (CommitMixin.deliver_events)

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
        self._finish(req, {"type": "abort", "message": message}, insert=False)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Iterator[PrefillCall | DenoiseCall]:
        """One round's device calls, planned one at a time (each after the previous one was processed): admission,
        then a prefill call over the complete blocks admitted requests still have to encode, then a denoise call
        over the decoding requests. The caller runs each (``runner.run``) and hands its result to :meth:`process`.
        When nothing could run because every decoding row waits for a background compile, the round waits a
        moment for it instead of spinning."""
        with jax.profiler.TraceAnnotation("schedule"):
            self._admit()
        prefill_reqs = [r for r in self.running if r.phase is Phase.PREFILL]
        call = self._plan_prefill(prefill_reqs) if prefill_reqs else None
        if call is not None:
            yield call
        decode_reqs = [r for r in self.running if r.phase is Phase.DECODE]
        denoise = self._plan_denoise(decode_reqs) if decode_reqs else None
        if denoise is not None:
            yield denoise
        elif decode_reqs and call is None:
            self.runner.compiler.wait(0.05)

    def schedule_ahead(self) -> PrefillCall | None:
        """While a denoise call runs (the engine's host overlap): admit waiting requests and plan a prefill over
        the ones just admitted, never taking pages from a running request (the call in flight may be reading and
        writing them: no retraction; only free pages and evictable cache). The caller runs it right away; the
        device queues it behind the call in flight, and the next round's denoise call takes those requests in.
        Their admission, index match and prefill launch so overlap the device instead of following it."""
        before = {id(r) for r in self.running}
        with jax.profiler.TraceAnnotation("schedule_ahead"):
            self._admit()
        admitted = [r for r in self.running if id(r) not in before and r.phase is Phase.PREFILL]
        return self._plan_prefill(admitted, retract=False) if admitted else None

    def process(self, call: PrefillCall | DenoiseCall, result: DecodeOutput | Failed | None) -> None:
        """Commit a call's result: prefilled blocks enter the index, denoised blocks are committed or carried on.
        A :class:`Failed` result fails that call's requests (see :meth:`_fail_call`)."""
        if isinstance(result, Failed):
            for pages in getattr(call, "chain_pages", {}).values():  # reserved, owned by no request yet
                self.allocator.free(pages)
            if not isinstance(result.error, Exception):
                raise result.error
            self._fail_call(call.reqs if isinstance(call, PrefillCall) else call.all_reqs, result.error)
        elif isinstance(call, PrefillCall):
            self._commit_prefill(call)
        else:
            self._commit_denoise(call, result)

    # ------------------------------------------------------------------------------------------
    # Admission
    # ------------------------------------------------------------------------------------------
    def _admit(self) -> None:
        B = self.B
        # A request whose first block another running request is prefilling right now waits for that prefill:
        # admitted a round later, it matches those blocks from the index instead of encoding them again (n
        # choices of one prompt, a shared system prompt). Only with the cache on, and only while that prefill runs.
        being_prefilled = {tuple(r.real_ids[:B]) for r in self.running
                           if r.phase is Phase.PREFILL} if self.radix.enabled else set()
        i = 0
        while i < len(self.waiting) and len(self.running) < self.max_running:
            req = self.waiting[i]
            try:
                admitted = self._admit_one(req, i, being_prefilled)
            except Exception as e:
                self._fail(req, e)
                continue
            if admitted is None:
                break
            if not admitted:
                i += 1

    def _admit_one(self, req: Request, i: int, being_prefilled: set) -> bool | None:
        """Admit ``waiting[i]``: True if it left the queue (admitted or refused), False to skip it for now, None to
        stop admitting this round (not enough pages while others run)."""
        B = self.B
        real = req.real_ids
        if len(real) >= B and tuple(real[:B]) in being_prefilled:
            return False
        with jax.profiler.TraceAnnotation("radix.match"):
            match = self.radix.match(real, len(real))
        self.radix.lock(match.node)
        # Pages this request needs before its first denoise step: the uncached complete blocks plus one.
        need = len(real) // B - len(match.pages) + 1
        available = self.allocator.num_free + self.radix.evictable
        if need > available and self.running:
            self.radix.unlock(match.node)
            return None  # wait until running requests release pages
        del self.waiting[i]
        if need > self.allocator.capacity:
            self.radix.unlock(match.node)
            self._finish(req, {"type": "abort", "message": f"the request needs {need} KV pages but the pool "
                                                           f"holds {self.allocator.capacity}; raise num_kv_pages"},
                         insert=False)
            return True
        req.node = match.node
        req.pages = list(match.pages)
        req.own_pages = set()
        if req.cached_tokens is None:
            req.cached_tokens = match.matched_len
            self.stats["cached_tokens"] += match.matched_len
        self.running.append(req)
        self._classify(req)
        if req.phase is Phase.PREFILL and self.radix.enabled:
            being_prefilled.add(tuple(real[:B]))
        return True

    def _classify(self, req: Request) -> None:
        """Prefill iff the next block consists only of real tokens (whatever their values); after the match."""
        req.phase = Phase.PREFILL if req.prefix_len(self.B) + self.B <= req.real_len else Phase.DECODE

    # ------------------------------------------------------------------------------------------
    # Pages
    # ------------------------------------------------------------------------------------------
    def _alloc(self, n: int, requester: Request, *, retract: bool = True) -> list[int] | None:
        """n pages: free ones, then evicted cache, then (``retract``) retracted requests (newest first). None if
        the requester itself had to be retracted, nothing else can give way, or that would take a retraction."""
        if not self.allocator.can_alloc(n):
            with jax.profiler.TraceAnnotation("radix.evict"):
                self.radix.evict(n - self.allocator.num_free)
        if not retract and not self.allocator.can_alloc(n):
            return None
        while not self.allocator.can_alloc(n):
            victims = [r for r in self.running if r is not requester]
            if not victims:
                self._finish(requester, {"type": "abort", "message": "out of KV pages: the request does not fit "
                                                                     "in the page pool; raise num_kv_pages"},
                             insert=True)
                return None
            self._retract(victims[-1])
            self.radix.evict(n - self.allocator.num_free)
        try:
            return self.allocator.alloc(n)
        except OutOfPages:  # pragma: no cover - guarded by can_alloc above
            return None

    def _retract(self, req: Request) -> None:
        """Give a running request's pages back; it keeps its committed outputs and is re-admitted later, when its
        complete blocks are matched from the cache or re-encoded."""
        self.stats["retractions"] += 1
        req.retractions += 1
        self._release(req, insert=True)
        self.running.remove(req)
        req.phase = Phase.WAITING
        self.waiting.appendleft(req)

    def _release(self, req: Request, *, insert: bool) -> None:
        """Drop every page reference and lock the request holds (its committed complete blocks stay cached)."""
        if insert and req.pages:
            self._insert(req)
        if req.node is not None:
            self.radix.unlock(req.node)
            req.node = None
        own = set(req.own_pages)
        if req.block_page is not None:
            own.add(req.block_page)
        if own:
            self.allocator.free(sorted(own))
        req.pages, req.own_pages = [], set()
        req.block_page = req.block_tokens = req.block_immutable = req.algo_state = req.stale_tokens = None
        req.block_logprob = req.block_top_logprob = req.block_top_ids = None
        req.block_steps = 0

    def _insert(self, req: Request) -> None:
        """Cache the request's complete real blocks whose KV is exact (not a stale folded block) and move its lock
        to the deepest of them."""
        n = len(req.pages) - (1 if req.stale_tokens is not None else 0)
        with jax.profiler.TraceAnnotation("radix.insert"):
            result = self.radix.insert_and_match(req.real_ids[:n * self.B], req.pages[:n])
        if not self.radix.enabled:
            return
        req.own_pages -= set(req.pages[:n])
        req.pages[:n] = result.pages
        self.radix.lock(result.node)
        if req.node is not None:
            self.radix.unlock(req.node)
        req.node = result.node

    # ------------------------------------------------------------------------------------------
    # Prefill
    # ------------------------------------------------------------------------------------------
    def _plan_prefill(self, reqs: list[Request], *, retract: bool = True) -> PrefillCall | None:
        """Encode complete blocks of real tokens in one forward: a row per request, holding a chunk of its
        consecutive blocks (block-causal inside the chunk), as many as the prefill budget allows. ``retract``:
        whether running requests may give their pages way (see :meth:`_alloc`)."""
        B = self.B
        budget = self.max_prefill_blocks
        remaining = {id(r): r.real_len // B - len(r.pages) for r in reqs}
        reqs = sorted(reqs, key=lambda r: -remaining[id(r)])  # similar chunk lengths share a call
        chunk = self.runner.prefill_chunk(min(remaining[id(reqs[0])], budget))
        max_rows = self.runner.max_prefill_rows(chunk)
        allocated: list[tuple[Request, list[int]]] = []
        for req in reqs[:max_rows]:
            if req.phase is not Phase.PREFILL:
                continue  # retracted while pages were found for an earlier request
            pages = self._alloc(min(remaining[id(req)], chunk), req, retract=retract)
            if pages is not None:
                req.own_pages.update(pages)
                allocated.append((req, pages))
        allocated = [(req, pages) for req, pages in allocated if req.phase is Phase.PREFILL]
        if not allocated:
            return None
        rows = []
        for req, pages in allocated:
            start = req.prefix_len(B)
            rows.append(PrefillRow(tokens=req.real_ids[start:start + len(pages) * B], prefix_pages=list(req.pages),
                                   write_pages=pages))
        return PrefillCall(reqs=[req for req, _ in allocated], pages=[pages for _, pages in allocated], rows=rows)

    # ------------------------------------------------------------------------------------------
    # Denoise
    # ------------------------------------------------------------------------------------------
    def _start_block(self, req: Request, page: int | None = None) -> bool:
        """Set up the request's next block in ``page`` (a page it was given for it) or a newly allocated one."""
        B = self.B
        offset = req.prefix_len(B)
        if offset + B > self.context_length:
            if page is not None:
                self.allocator.free([page])
            self._finish(req, {"type": "length", "length": len(req.output_ids), "message": "context length reached"},
                         insert=True)
            return False
        pages = [page] if page is not None else self._alloc(1, req)
        if pages is None:
            return False
        real = req.real_ids
        n_imm = max(0, min(B, len(real) - offset))
        tokens = np.full((B,), self.mask_id, np.int32)
        tokens[:n_imm] = real[offset:offset + n_imm]
        immutable = np.zeros((B,), np.bool_)
        immutable[:n_imm] = True
        req.block_tokens, req.block_immutable, req.block_page = tokens, immutable, pages[0]
        req.block_steps, req.algo_state = 0, None
        k = req.params.logprobs
        if k >= 0:
            req.block_logprob = np.zeros((B,), np.float32)
            req.block_top_logprob = np.zeros((B, k), np.float32)
            req.block_top_ids = np.zeros((B, k), np.int32)
        return True

    def _plan_denoise(self, reqs: list[Request]) -> DenoiseCall | None:
        """One denoise call over the decoding requests that can run now; None if none can."""
        for req in reqs:
            if req.block_tokens is None and req.phase is Phase.DECODE:
                self._start_block(req)
        reqs = [r for r in reqs if r.phase is Phase.DECODE and r.block_tokens is not None]
        # Folded commits from the last round: re-encode those blocks in this same forward (the model writes K/V
        # before attending, so this round's next blocks already read the exact KV).
        refresh = [r for r in self.running if r.stale_tokens is not None]
        reqs = self._runnable(reqs, refresh)
        if not reqs and not refresh:
            return None
        B = self.B
        loop_cap = self._loop_cap(reqs, refresh)
        # FDFO chains calls of up to CHAIN_MAX_ROWS requests; the synchronous schedule a request running alone (its
        # rows stay in step: a row that goes on while another decodes would leave the batch's block behind)
        chains = (loop_cap > 1 and len(reqs) <= (1 if self.runner.loop else CHAIN_MAX_ROWS)
                  and self.runner.can_chain(len(reqs) + len(refresh)))
        chain_pages = self._reserve_chain_pages(reqs) if chains else {}
        if chain_pages and self.runner.compiler.compiles_in_background(self._call_key(reqs, refresh, chain_pages)):
            for pages in chain_pages.values():  # the wider page table chaining needs is not compiled: no chaining
                self.allocator.free(pages)
            chain_pages = {}
        rows = [DecodeRow(tokens=r.stale_tokens, immutable=np.ones((B,), np.bool_), prefix_pages=r.pages[:-1],
                          write_page=r.pages[-1], steps_taken=0, temperature=0.0, top_k=-1, top_p=1.0, seed=0,
                          rng_step=0, algo_state=None, refresh=True) for r in refresh]
        rows += [DecodeRow(tokens=r.block_tokens, immutable=r.block_immutable, prefix_pages=r.pages,
                           write_page=r.block_page, steps_taken=r.block_steps, temperature=r.params.temperature,
                           top_k=r.params.top_k, top_p=r.params.top_p, seed=r.seed,
                           rng_step=self._rng_step(r), algo_state=r.algo_state, logprobs=r.params.logprobs,
                           penalty=self._penalty_row(r), chain_pages=chain_pages.get(id(r), []),
                           stop_ids=self._stop_ids(r) if id(r) in chain_pages else ()) for r in reqs]
        return DenoiseCall(refresh=refresh, reqs=reqs, rows=rows, loop_cap=loop_cap, chain_pages=chain_pages)

    # ------------------------------------------------------------------------------------------
    # Step variants compiled off the scheduler's thread
    # ------------------------------------------------------------------------------------------
    def _runnable(self, reqs: list[Request], refresh: list[Request]) -> list[Request]:
        """The requests this round's call can serve without compiling on the scheduler's thread: all of them,
        unless their call needs a step variant warm-up did not compile (a first request with log probabilities,
        penalties or sampling). Then that call compiles on the runner's background thread, and until it is
        ready the largest group of rows whose own call is compiled runs (plain rows keep being served); the rest
        wait, their block and state kept. An engine without warm-up compiles in line, as it always did."""
        compiler = self.runner.compiler
        if not reqs or not compiler.background or not compiler.warmed_classes:
            return reqs  # an engine that compiles in line (no warm-up, or followers): nothing to wait for
        key = self._call_key(reqs, refresh)
        if not compiler.compiles_in_background(key):
            return reqs
        compiler.compile_soon(key)
        best: list[Request] = []
        for need in {self._need(r) for r in reqs}:
            group = [r for r in reqs if all(a or not b for a, b in zip(need, self._need(r)))]  # needs within
            if len(group) > len(best) and not compiler.compiles_in_background(
                    self._call_key(group, refresh)):
                best = group
        return best

    @staticmethod
    def _need(req: Request) -> tuple[bool, bool, bool, bool]:
        """What a request's row asks of the step: sampling, penalties, log probabilities, top alternatives."""
        p = req.params
        return (p.temperature > 0 and p.top_k != 1, p.penalized, p.logprobs >= 0, p.logprobs > 0)

    def _call_key(self, reqs: list[Request], refresh: list[Request], chain_pages: dict | None = None) -> tuple:
        """The runner's key for a denoise call over these rows (see ``ModelRunner.denoise_key``)."""
        needs = [self._need(r) for r in reqs]
        pages = max([len(r.pages) - 1 for r in refresh]
                    + [len(r.pages) + len((chain_pages or {}).get(id(r), ())) for r in reqs], default=1)
        return self.runner.denoise_key(len(reqs) + len(refresh), pages, sampling=any(n[0] for n in needs),
                                       penalties=any(n[1] for n in needs), logprobs=any(n[2] for n in needs),
                                       top=any(n[3] for n in needs))

    def _loop_cap(self, reqs: list[Request], refresh: list[Request]) -> int:
        """FDFO: how many steps the call may run on the device before the batch comes back (it stops anyway when
        the first row is done). One when the batch should change sooner: a waiting request could join now, a
        running one is still prefilling, a row streams its provisional block after every step, or refresh rows
        ride along (they would be recomputed at every further step)."""
        if (refresh or any(r.provisional for r in reqs)
                or (self.waiting and len(self.running) < self.max_running)
                or any(r.phase is Phase.PREFILL for r in self.running)):
            return 1
        return self.max_steps_per_call

    def _penalty_row(self, req: Request) -> PenaltyRow | None:
        """The row's penalty inputs, or None when all of its penalties are neutral (see decode.penalties)."""
        p = req.params
        if not p.penalized:
            return None
        stops: tuple[int, ...] = ()
        if p.min_new_tokens:
            ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
            stops = tuple(sorted(ids))
        return PenaltyRow(history=req.real_ids, prompt_len=len(req.prompt_ids), presence=p.presence_penalty,
                          frequency=p.frequency_penalty, repetition=p.repetition_penalty, min_new=p.min_new_tokens,
                          bias=p.logit_bias, stop_ids=stops)

    def _rng_step(self, req: Request) -> int:
        """Where this step sits in the request's generation (block index, step in block): folded into the sampling
        key, so a seeded request draws the same tokens whatever its batch, cache hits or retractions."""
        return req.prefix_len(self.B) // self.B * RNG_STEPS_PER_BLOCK + req.block_steps

    # ------------------------------------------------------------------------------------------
    # Finish
    # ------------------------------------------------------------------------------------------
    def _finish(self, req: Request, reason: dict, *, insert: bool) -> None:
        if req.finished:
            return
        if req in self.running:
            self._release(req, insert=insert)
            self.running.remove(req)
        else:
            self._release(req, insert=False)
        req.phase = Phase.FINISHED
        req.finish_reason = reason
        req.finish_time = time.perf_counter()
        self.stats["finished"] += 1
        self._emit(req)

    def _fail(self, req: Request, error: Exception, *, stray_pages: list[int] = ()) -> None:
        """Fail one request on an error of its own (see the module's doc): it finishes with ``abort`` and the
        error's message; its pages go back (its complete blocks are not cached: their KV may be what failed).
        ``stray_pages``: pages reserved for it that no request or the index holds yet (freed unless already)."""
        log.error("request %s failed: %s: %s", req.rid, type(error).__name__, error,
                  exc_info=(type(error), error, error.__traceback__))
        if req in self.waiting:
            self.waiting.remove(req)
        self._finish(req, {"type": "abort", "message": f"internal error: {type(error).__name__}: {error}"},
                     insert=False)
        held = self.radix.pages() if stray_pages and self.radix.enabled else set()
        held |= {p for r in self.running for p in (*r.own_pages, r.block_page) if p is not None}
        stray = [p for p in stray_pages if p not in held and self.allocator.refcount(p) > 0]
        if stray:
            self.allocator.free(stray)

    def _fail_call(self, reqs: list[Request], error: Exception) -> None:
        """A device call raised: its requests fail (never the others). Multi-process: the group's failure, raised
        on. If the KV pool went with the call, every running request lost its KV and the index is emptied."""
        if isinstance(error, RowError):  # raised while packing, before any process ran the call
            self._fail(reqs[error.index], error.error)
            return
        if self.runner.channel is not None:
            raise error
        for req in reqs:
            self._fail(req, error)
        if self.runner.pool_lost():
            for req in list(self.running):
                self._fail(req, RuntimeError(f"the KV pool was lost with a failed device call ({error})"))
            self.radix.reset()

    # ------------------------------------------------------------------------------------------
    # Checks (tests call this after every run)
    # ------------------------------------------------------------------------------------------
    def check_pages(self) -> None:
        """Every page is exactly one of free / owned by one request / held by the radix index."""
        holders = collections.Counter()
        for req in self.running:
            for p in req.own_pages:
                holders[p] += 1
            if req.block_page is not None:
                holders[req.block_page] += 1
        tree_pages = self.radix.pages() if self.radix.enabled else set()
        for p in tree_pages:
            holders[p] += 1
        for page in range(1, self.allocator.capacity + 1):
            ref = self.allocator.refcount(page)
            assert ref == holders[page], f"page {page}: refcount {ref} but {holders[page]} holder(s)"
        self.radix.check_invariants()
        assert self.radix.evictable + self.radix.protected == self.radix.total == len(tree_pages)
