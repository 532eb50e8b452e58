"""The host side of Gemma4Renoise serving: admission, pages, canvases, commits, retraction.

A request's life: admitted into a free slot with pages for its real tokens (prompt, plus the outputs it kept if it
was retracted) -> those tokens encoded (an :class:`EncodeCall`, several requests per call) -> its canvas
denoised in :class:`DenoiseCall` s together with the other running rows -> when its canvas finishes, the argmax
canvas is committed (cut at ``max_new_tokens``, the first EOS / stop id, a stop string; streamed as one chunk) ->
unless the request is done, the canvas is encoded (the next round's encode call) and the next canvas starts.

FDFO (the default schedule): a denoise call runs until the first live row finishes its canvas, so a finished
canvas leaves and waiting requests join between steps; sync: until every live row has finished.

Pages (``page_size`` tokens): full-attention layers keep every page of the context; sliding-window layers have
their own pool and allocator and give back a page as soon as it lies wholly before the window of the next
forward (positions ``< prefix_len - (window - 1)``), so a request holds at most about ``(window + canvas) /
page_size`` of them whatever its length. When pages run out the newest other running request is retracted (its
pages freed, its outputs kept); re-admitted, it re-encodes its real tokens and continues with the same canvas
index, hence the same draws: the same tokens as if it had never left. A request's draws depend only on its seed.
Prefix reuse (:mod:`dllm_jax.cache.window_radix`): complete pages of encoded real tokens enter the index as they
are encoded (and when a request finishes or is retracted); an admitted request starts from the longest cached
prefix whose window is cached too, and encodes only the rest. Under pressure the index gives back sliding pages
first, then whole leaves, before any running request is retracted.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Iterator

import numpy as np

from dllm_jax.cache.pages import TRASH_PAGE, OutOfPages, PageAllocator
from dllm_jax.cache.window_radix import WindowPrefixIndex
from dllm_jax.engine.calls import Failed
from dllm_jax.engine.commit import CommitMixin, PROVISIONAL
from dllm_jax.engine.renoise_runner import DenoiseCall, DenoiseResult, EncodeCall, RenoiseRunner
from dllm_jax.engine.request import Phase, Request
from dllm_jax.engine.scheduler import STAT_KEYS
from dllm_jax.model.gemma import FULL_KIND, SLIDING_KIND
from pallas_kernels import next_pow2

log = logging.getLogger(__name__)


class RenoiseScheduler(CommitMixin):
    def __init__(self, runner: RenoiseRunner, *, canvas: int, eos_token_ids: tuple[int, ...], max_running_requests: int,
                 context_length: int, window: int | None, output=None, schedule: str = "fdfo",
                 max_steps_per_call: int = 1 << 30, max_prefill_tokens: int = 4096, enable_prefix_cache: bool = True):
        self.runner = runner
        self.C, self.S = canvas, runner.page_size
        self.window = window
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_running = max_running_requests
        self.context_length = context_length
        self.output = output
        self.first_finish = schedule != "sync"
        self.max_steps_per_call = max_steps_per_call
        self.chunk = max_prefill_tokens  # tokens per encode row: a long prompt goes in chunks (its window's pages
        # are given back between them)
        self.full = PageAllocator(runner.num_pages[FULL_KIND])
        self.sliding = PageAllocator(runner.num_pages[SLIDING_KIND])
        self.index = WindowPrefixIndex(self.S, window, self.full, self.sliding, enabled=enable_prefix_cache)
        self._stop_sets: dict[tuple, frozenset[int]] = {}
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.stats = collections.Counter({k: 0 for k in STAT_KEYS})
        self._slot: dict[Request, int] = {}
        self._sliding_pages: dict[Request, list[int]] = {}  # per page of context; TRASH_PAGE once released
        self._kv_len: dict[Request, int] = {}  # tokens whose K/V are in the pools
        self._starting: set[Request] = set()  # canvas to start in the next denoise call

    # ------------------------------------------------------------------------------------------
    # Public (the engine's interface, as Scheduler's)
    # ------------------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)
        self.stats["requests"] += 1
        self.stats["prompt_tokens"] += len(req.prompt_ids)

    def abort(self, req: Request, message: str = "aborted") -> None:
        if req.finished:
            return
        if req in self.waiting:
            self.waiting.remove(req)
        self._finish(req, {"type": "abort", "message": message})

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Iterator[EncodeCall | DenoiseCall]:
        self._admit()
        encode = self._plan_encode([r for r in self.running if r.phase is Phase.PREFILL])
        if encode is not None:
            yield encode
        decoding = [r for r in self.running if r.phase is Phase.DECODE]
        if decoding:
            yield self._plan_denoise(decoding)

    def process(self, call, result) -> None:
        if isinstance(result, Failed):
            if not isinstance(result.error, Exception):
                raise result.error
            for req in list(call.reqs):
                self._fail(req, result.error)
            if self.runner.pool_lost():
                for req in list(self.running):
                    self._fail(req, RuntimeError(f"the KV pool was lost with a failed device call ({result.error})"))
            return
        if isinstance(call, EncodeCall):
            self._commit_encode(call)
        else:
            self._commit_denoise(call, result)

    # ------------------------------------------------------------------------------------------
    # Admission and pages
    # ------------------------------------------------------------------------------------------
    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_running:
            req = self.waiting[0]
            slot = min(set(range(self.max_running)) - set(self._slot.values()))
            self._slot[req] = slot
            full, sliding = self.index.match(req.real_ids)  # a cached prefix: its pages, our own references
            self.index.take(full, sliding)
            self._kv_len[req] = len(full) * self.S
            self._sliding_pages[req] = sliding
            req.pages, req.own_pages = list(full), set(full)
            if req.cached_tokens is None:
                req.cached_tokens = self._kv_len[req]
                self.stats["cached_tokens"] += req.cached_tokens
            if not self._pages_for(req, min(req.real_len, self._kv_len[req] + self.chunk), retract=False):
                self._release(req)
                if not self.running:  # alone and still too long: it can never run
                    self.waiting.popleft()
                    self._finish(req, {"type": "abort", "message": "the request does not fit the KV pool"})
                    continue
                return
            self.waiting.popleft()
            self.running.append(req)
            req.phase = Phase.PREFILL
            if self._kv_len[req] == req.real_len:  # all of it cached: its canvas starts now
                req.phase = Phase.DECODE
                self._starting.add(req)

    def _pages_for(self, req: Request, length: int, *, retract: bool = True) -> bool:
        """Hold pages for the first ``length`` positions (full and sliding); may retract other requests."""
        need = -(-length // self.S)
        while True:
            try:
                full = self.full.alloc(max(0, need - len(req.pages)))
                try:
                    sliding = self.sliding.alloc(max(0, need - len(self._sliding_pages[req])))
                except OutOfPages:
                    self.full.free(full)
                    raise
            except OutOfPages:
                short_full = need - len(req.pages) - self.full.num_free
                short_sliding = need - len(self._sliding_pages[req]) - self.sliding.num_free
                if (short_full > 0 and self.index.evict_full(short_full)) or \
                        (short_sliding > 0 and (self.index.evict_sliding(short_sliding)
                                                or self.index.evict_full(short_sliding))):
                    continue  # cached pages went back to the pools
                victim = next((r for r in reversed(self.running) if r is not req), None) if retract else None
                if victim is None:
                    return False
                self._retract(victim)
                continue
            req.pages += full
            req.own_pages.update(full)
            self._sliding_pages[req] += sliding
            return True

    def _release_window(self, req: Request) -> None:
        """Give back the sliding pages wholly before the next forward's window."""
        if self.window is None:
            return
        first_needed = max(0, self._kv_len[req] - (self.window - 1)) // self.S
        pages = self._sliding_pages[req]
        old = [p for p in pages[:first_needed] if p != TRASH_PAGE]
        if old:
            self.sliding.free(old)
            pages[:first_needed] = [TRASH_PAGE] * first_needed

    def _release(self, req: Request) -> None:
        if req.own_pages:
            self.full.free(sorted(req.own_pages))
        live = [p for p in self._sliding_pages.pop(req, []) if p != TRASH_PAGE]
        if live:
            self.sliding.free(live)
        req.pages, req.own_pages = [], set()
        self._slot.pop(req, None)
        self._kv_len.pop(req, None)
        self._starting.discard(req)

    def _retract(self, req: Request) -> None:
        log.info("retracting request %s (KV pages ran out); it keeps %d output tokens", req.rid, len(req.output_ids))
        self._cache(req)  # its encoded pages stay findable: re-admitted, it may find them still there
        self._release(req)
        self.running.remove(req)
        req.phase = Phase.WAITING
        req.retractions += 1
        self.stats["retractions"] += 1
        self.waiting.appendleft(req)

    def _cache(self, req: Request) -> None:
        """Offer the request's complete pages of encoded real tokens to the prefix index."""
        kv_len = self._kv_len.get(req, 0)
        if kv_len >= self.S:
            self.index.insert(req.real_ids[:kv_len], req.pages, self._sliding_pages.get(req, []))

    def _tables(self, reqs: list[Request], *, by_slot: bool) -> dict:
        """Page tables: row = slot (a denoise call: every slot) or the request's index in ``reqs`` (an encode call)."""
        rows = self.max_running if by_slot else len(reqs)
        width = next_pow2(max([len(r.pages) for r in reqs] + [1]))
        full = np.zeros((rows, width), np.int32)
        sliding = np.zeros((rows, width), np.int32)
        for i, r in enumerate(reqs):
            row = self._slot[r] if by_slot else i
            full[row, :len(r.pages)] = r.pages
            sliding[row, :len(self._sliding_pages[r])] = self._sliding_pages[r]
        return {FULL_KIND: full, SLIDING_KIND: sliding}

    # ------------------------------------------------------------------------------------------
    # Calls
    # ------------------------------------------------------------------------------------------
    def _plan_encode(self, reqs: list[Request]) -> EncodeCall | None:
        ready = []
        for req in reqs:
            end = min(req.real_len, self._kv_len.get(req, 0) + self.chunk)
            if req in self.running and self._pages_for(req, end):
                ready.append(req)
            elif req in self.running:
                self._fail(req, RuntimeError("the request's context does not fit the KV pool"))
        ready = [r for r in ready if r in self.running]  # (a later allocation may have retracted an earlier one)
        if not ready:
            return None
        tokens = [r.real_ids[self._kv_len[r]:self._kv_len[r] + self.chunk] for r in ready]
        tables = self._tables(ready, by_slot=False)
        compiler = self.runner.compiler
        if compiler.warmed and len(ready) > 1:
            key = self.runner.encode_key(len(ready), max(map(len, tokens)), tables[FULL_KIND].shape[1])
            if key not in compiler.compiled:  # a shape warm-up did not cover: compiled aside, one row meanwhile
                compiler.compile_soon(key)
                ready, tokens = ready[:1], tokens[:1]
                tables = self._tables(ready, by_slot=False)
        return EncodeCall(ready, tokens, [self._kv_len[r] for r in ready], tables)

    def _commit_encode(self, call: EncodeCall) -> None:
        self.stats["prefill_forwards"] += 1
        for req, tokens in zip(call.reqs, call.tokens):
            if req not in self.running:
                continue
            self._kv_len[req] += len(tokens)
            self._cache(req)
            self._release_window(req)
            if self._kv_len[req] == req.real_len:
                req.phase = Phase.DECODE
                self._starting.add(req)

    def _plan_denoise(self, reqs: list[Request]) -> DenoiseCall:
        R = self.max_running
        seeds = np.zeros(R, np.uint32)
        canvas_index = np.zeros(R, np.int32)
        prefix = np.zeros(R, np.int32)
        live = np.zeros(R, bool)
        for req in reqs:
            s = self._slot[req]
            seeds[s] = np.uint32(req.seed & 0xFFFFFFFF)
            canvas_index[s] = len(req.output_ids) // self.C
            prefix[s] = self._kv_len[req]
            live[s] = True
        starting = [self._slot[r] for r in reqs if r in self._starting]
        self._starting.clear()
        steps = self.max_steps_per_call
        if any(r.provisional for r in reqs):
            steps = 1  # the host sees every step (provisional frames)
        return DenoiseCall(list(reqs), starting, seeds, canvas_index, prefix, self._tables(reqs, by_slot=True), live,
                           steps)

    def _commit_denoise(self, call: DenoiseCall, out: DenoiseResult) -> None:
        self.stats["denoise_calls"] += 1
        self.stats["denoise_forwards"] += int(out.steps.max(initial=0))
        for req in call.reqs:
            if req.finished or req not in self.running:
                continue
            s = self._slot[req]
            req.forward_passes += int(out.steps[s])
            req.block_steps += int(out.steps[s])
            req.block_tokens = out.argmax[s]
            req.block_immutable = np.zeros(self.C, bool)
            req.block_offset = self._kv_len[req]
            if not out.finished[s]:
                if req.provisional:
                    self._emit(req, PROVISIONAL)
                continue
            try:
                self._commit_canvas(req, out.argmax[s], out.logprob[s])
            except Exception as e:  # one request's commit failing is its own
                self._fail(req, e)

    def _commit_canvas(self, req: Request, canvas: np.ndarray, logprob: np.ndarray) -> None:
        if req.first_block_time is None:
            req.first_block_time = time.perf_counter()
        before = len(req.output_ids)
        finish = self._append_outputs(req, canvas.tolist())
        if req.params.return_logprob:
            lps = logprob[:len(req.output_ids) - before].tolist()
            req.output_token_logprobs.extend([lp, t, None] for lp, t in zip(lps, req.output_ids[before:]))
        req.block_tokens = req.block_immutable = req.block_offset = None
        req.block_steps = 0
        if finish is not None:
            self._finish(req, finish)
            return
        self._emit(req)
        if not req.finished:
            req.phase = Phase.PREFILL  # its canvas goes through the encoder next round

    # ------------------------------------------------------------------------------------------
    # Finish
    # ------------------------------------------------------------------------------------------
    def _finish(self, req: Request, reason: dict, *, cache: bool = True) -> None:
        if req.finished:
            return
        if cache and req in self.running:
            self._cache(req)
        self._release(req)
        if req in self.running:
            self.running.remove(req)
        req.phase = Phase.FINISHED
        req.finish_reason = reason
        req.finish_time = time.perf_counter()
        self.stats["finished"] += 1
        self._emit(req)

    def _fail(self, req: Request, error: Exception) -> None:
        log.error("request %s failed: %s: %s", req.rid, type(error).__name__, error)
        if req in self.waiting:
            self.waiting.remove(req)
        self._finish(req, {"type": "abort", "message": f"internal error: {type(error).__name__}: {error}"},
                     cache=False)  # (its K/V may be what failed)

    def check_pages(self) -> None:
        """Every page of both pools is free or held: a reference per running request using it, one per index node."""
        index_full, index_sliding = self.index.held()
        assert self.index.total == len(index_full), f"prefix index counts {self.index.total} nodes, holds {len(index_full)}"
        for allocator, held in ((self.full, [p for r in self.running for p in r.own_pages] + index_full),
                                (self.sliding, [p for r in self.running for p in self._sliding_pages.get(r, [])
                                                if p != TRASH_PAGE] + index_sliding)):
            holders = collections.Counter(held)
            for page in range(1, allocator.capacity + 1):
                assert allocator.refcount(page) == holders[page], \
                    f"page {page}: refcount {allocator.refcount(page)} but {holders[page]} holder(s)"
        if self.window is not None:
            bound = -(-(self.window - 1 + self.C) // self.S) + 2
            for r in self.running:
                live = sum(p != TRASH_PAGE for p in self._sliding_pages.get(r, []))
                assert live <= bound, f"request {r.rid} holds {live} sliding pages (window bound {bound})"
