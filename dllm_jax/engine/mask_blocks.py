"""The block policy of mask-based block diffusion (SDAR / Qwen3, SDAR-MoE, LLaDA2): a request's answer is written
one block of ``B`` positions at a time, each block starting as mask tokens after the real ones; pages are blocks,
cached in the block radix index (:mod:`dllm_jax.cache.radix`).

Planning here (admission's prefix match, pages, the prefill call over complete blocks of real tokens, the denoise
call over the decoding rows with their step variants and chained blocks); committing a call's result in
:mod:`dllm_jax.engine.mask_commit`. The scheduler (:mod:`dllm_jax.engine.scheduler`) owns the requests' life.

KV invariant kept at every step boundary: each page is free, owned by exactly one request (``own_pages``, or its
``block_page``), or held by the radix index (kept alive for a request by the lock on its ``node``).
"""

from __future__ import annotations

import collections

import jax
import numpy as np

from dllm_jax.cache.pages import OutOfPages, PageAllocator
from dllm_jax.cache.radix import BlockRadixIndex
from dllm_jax.decode.step import RNG_STEPS_PER_BLOCK
from dllm_jax.engine.calls import DecodeRow, DenoiseCall, PenaltyRow, PrefillCall, PrefillRow
from dllm_jax.engine.mask_commit import MaskCommit
from dllm_jax.engine.policy import Admission, Refuse
from dllm_jax.engine.request import Phase, Request
from dllm_jax.engine.runner import CHAIN_MAX_ROWS, ModelRunner


class MaskBlocks(MaskCommit):
    def __init__(self, runner: ModelRunner, allocator: PageAllocator, radix: BlockRadixIndex, *, block_size: int,
                 mask_id: int, context_length: int, max_prefill_blocks: int, max_steps_per_call: int = 1 << 30):
        self.runner = runner
        self.allocator = allocator
        self.radix = radix
        self.B = block_size
        self.mask_id = mask_id
        self.context_length = context_length
        self.max_prefill_blocks = max_prefill_blocks
        self.max_steps_per_call = max_steps_per_call
        self._being_prefilled: set = set()
        self.s = None  # the scheduler (attach)

    def attach(self, scheduler) -> None:
        self.s = scheduler

    # ------------------------------------------------------------------------------------------
    # Admission
    # ------------------------------------------------------------------------------------------
    def start_admission(self) -> None:
        # A request whose first block another running request is prefilling right now waits for that prefill:
        # admitted a round later, it matches those blocks from the index instead of encoding them again (n
        # choices of one prompt, a shared system prompt). Only with the cache on, and only while that prefill runs.
        B = self.B
        self._being_prefilled = {tuple(r.real_ids[:B]) for r in self.s.running
                                 if r.phase is Phase.PREFILL} if self.radix.enabled else set()

    def admit(self, req: Request):
        """Match the prefix, lock it, check the pages its first denoise step needs (:class:`Admission`)."""
        B = self.B
        real = req.real_ids
        if len(real) >= B and tuple(real[:B]) in self._being_prefilled:
            return Admission.SKIP
        with jax.profiler.TraceAnnotation("radix.match"):
            match = self.radix.match(real, len(real))
        self.radix.lock(match.node)
        # Pages this request needs before its first denoise step: the uncached complete blocks plus one.
        need = len(real) // B - len(match.pages) + 1
        available = self.allocator.num_free + self.radix.evictable
        if need > available and self.s.running:
            self.radix.unlock(match.node)
            return Admission.WAIT  # until running requests release pages
        if need > self.allocator.capacity:
            self.radix.unlock(match.node)
            return Refuse(f"the request needs {need} KV pages but the pool holds {self.allocator.capacity}; raise "
                          f"num_kv_pages")
        req.node = match.node
        req.pages = list(match.pages)
        req.own_pages = set()
        self.classify(req)
        if req.phase is Phase.PREFILL and self.radix.enabled:
            self._being_prefilled.add(tuple(real[:B]))
        return Admission.ADMIT

    def cached_len(self, req: Request) -> int:
        return req.prefix_len(self.B)  # (right after admission: the matched pages)

    def classify(self, req: Request) -> None:
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
            victims = [r for r in self.s.running if r is not requester]
            if not victims:
                self.s.finish(requester, {"type": "abort", "message": "out of KV pages: the request does not fit "
                                                                       "in the page pool; raise num_kv_pages"},
                              keep=True)
                return None
            self.s.retract(victims[-1])
            self.radix.evict(n - self.allocator.num_free)
        try:
            return self.allocator.alloc(n)
        except OutOfPages:  # pragma: no cover - guarded by can_alloc above
            return None

    def release(self, req: Request, *, keep: bool) -> None:
        """Drop every page reference and lock the request holds (``keep``: its committed complete blocks stay
        cached)."""
        if keep and req.pages:
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
    def plan_prefill(self, reqs: list[Request], *, retract: bool) -> PrefillCall | None:
        """Encode complete blocks of real tokens in one forward: a row per request, holding a chunk of its
        consecutive blocks (block-causal inside the chunk), as many as the prefill budget allows. ``retract``:
        whether running requests may give their pages way (see :meth:`_alloc`)."""
        B = self.B
        budget = self.max_prefill_blocks
        remaining = {id(r): r.real_len // B - len(r.pages) for r in reqs}
        reqs = sorted(reqs, key=lambda r: -remaining[id(r)])  # similar chunk lengths share a call
        chunk = self.runner.prefill_chunk(min(remaining[id(reqs[0])], budget))
        fit = self.runner.prefill_fit(chunk, min(len(reqs), self.runner.max_prefill_rows(chunk)))
        if fit is None:
            return None  # its bucket compiles (a staged warm-up): the requests wait for it
        chunk, max_rows = fit
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
            self.s.finish(req, {"type": "length", "length": len(req.output_ids), "message": "context length reached"},
                          keep=True)
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
        if req.grammar is not None:  # (a retracted request restarts its block: the grammar forgets its tokens)
            req.grammar.new_block()
            req.block_tokens, _ = req.grammar.check_block(tokens, immutable, self.mask_id)  # forced text in
        k = req.params.logprobs
        if k >= 0:
            req.block_logprob = np.zeros((B,), np.float32)
            req.block_top_logprob = np.zeros((B, k), np.float32)
            req.block_top_ids = np.zeros((B, k), np.int32)
        return True

    def plan_denoise(self, reqs: list[Request]) -> DenoiseCall | None:
        """One denoise call over the decoding requests that can run now; None if none can."""
        for req in reqs:
            if req.block_tokens is None and req.phase is Phase.DECODE:
                self._start_block(req)
        reqs = [r for r in reqs if r.phase is Phase.DECODE and r.block_tokens is not None]
        # Folded commits from the last round: re-encode those blocks in this same forward (the model writes K/V
        # before attending, so this round's next blocks already read the exact KV).
        refresh = [r for r in self.s.running if r.stale_tokens is not None]
        reqs = self._runnable(reqs, refresh)
        if not reqs and not refresh:
            return None
        loop_cap = self._loop_cap(reqs, refresh)
        # FDFO chains calls of up to CHAIN_MAX_ROWS requests; the synchronous schedule a request running alone (its
        # rows stay in step: a row that goes on while another decodes would leave the batch's block behind)
        # (not beside a constrained row: its call ends when it decides its frontier, and the grammar step with
        # chain tables is one more variant to compile)
        chains = (loop_cap > 1 and len(reqs) <= (1 if self.runner.loop else CHAIN_MAX_ROWS)
                  and self.runner.can_chain(len(reqs) + len(refresh)) and all(r.grammar is None for r in reqs))
        chain_pages = self._reserve_chain_pages(reqs) if chains else {}
        if chain_pages and self.runner.compiler.compiles_in_background(self._call_key(reqs, refresh, chain_pages)):
            for pages in chain_pages.values():  # the wider page table chaining needs is not compiled: no chaining
                self.allocator.free(pages)
            chain_pages = {}
        rows = [DecodeRow(tokens=r.stale_tokens, prefix_pages=r.pages[:-1], write_page=r.pages[-1], refresh=True)
                for r in refresh]
        rows += [DecodeRow(tokens=r.block_tokens, immutable=r.block_immutable, prefix_pages=r.pages,
                           write_page=r.block_page, steps_taken=self._steps_taken(r),
                           temperature=r.params.temperature,
                           top_k=r.params.top_k, top_p=r.params.top_p, seed=r.seed,
                           rng_step=self._rng_step(r), algo_state=r.algo_state, logprobs=r.params.logprobs,
                           penalty=self._penalty_row(r), grammar=r.grammar, chain_pages=chain_pages.get(id(r), []),
                           stop_ids=tuple(sorted(self.s.stop_set(r))) if id(r) in chain_pages else ()) for r in reqs]
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
        best: list[Request] = []
        for need in {self._need(r) for r in reqs}:
            group = [r for r in reqs if all(a or not b for a, b in zip(need, self._need(r)))]  # needs within
            while group and compiler.compiles_in_background(self._call_key(group, refresh, ask=False)):
                group = group[:len(group) // 2]  # fewer rows, in a smaller row bucket (a staged warm-up's)
            if len(group) > len(best):
                best = group
        return best

    @staticmethod
    def _need(req: Request) -> tuple[bool, bool, bool, bool, bool]:
        """What a request's row asks of the step: sampling, penalties, log probabilities, top alternatives, a
        grammar."""
        p = req.params
        return (not p.greedy, p.penalized, p.logprobs >= 0, p.logprobs > 0, req.grammar is not None)

    def _call_key(self, reqs: list[Request], refresh: list[Request], chain_pages: dict | None = None,
                  ask: bool = True) -> tuple:
        """The runner's key for a denoise call over these rows (see ``ModelRunner.denoise_key``; ``ask``: a key
        not compiled yet is asked for)."""
        needs = [self._need(r) for r in reqs]
        pages = max([len(r.pages) - 1 for r in refresh]
                    + [len(r.pages) + len((chain_pages or {}).get(id(r), ())) for r in reqs], default=1)
        return self.runner.denoise_key(len(reqs) + len(refresh), pages, sampling=any(n[0] for n in needs),
                                       penalties=any(n[1] for n in needs), logprobs=any(n[2] for n in needs),
                                       top=any(n[3] for n in needs), grammar=any(n[4] for n in needs), ask=ask)

    def _loop_cap(self, reqs: list[Request], refresh: list[Request]) -> int:
        """FDFO: how many steps the call may run on the device before the batch comes back (it stops anyway when
        the first row is done). One when the batch should change sooner: a waiting request could join now, a
        running one is still prefilling, a row streams its provisional block after every step, or refresh rows
        ride along (they would be recomputed at every further step). A constrained row does not cut it: the device
        stops after the step in which a constrained row decides its frontier (its mask holds until then)."""
        if (refresh or any(r.provisional for r in reqs)
                or (self.s.waiting and len(self.s.running) < self.s.max_running)
                or any(r.phase is Phase.PREFILL for r in self.s.running)):
            return 1
        return self.max_steps_per_call

    def _penalty_row(self, req: Request) -> PenaltyRow | None:
        """The row's penalty inputs, or None when all of its penalties are neutral (see decode.penalties)."""
        p = req.params
        if not p.penalized:
            return None
        stops: tuple[int, ...] = ()
        if p.min_new_tokens:
            ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.s.eos_token_ids))
            stops = tuple(sorted(ids))
        return PenaltyRow(history=req.real_ids, prompt_len=len(req.prompt_ids), presence=p.presence_penalty,
                          frequency=p.frequency_penalty, repetition=p.repetition_penalty, min_new=p.min_new_tokens,
                          bias=p.logit_bias, stop_ids=stops)

    def _steps_taken(self, req: Request) -> int:
        """The forwards already spent on the block, as the step's safety net counts them; for a constrained row its
        decided positions instead (the host may take tokens back, so its forwards are no measure of progress, and
        every step decides its frontier: the net never fires)."""
        if req.grammar is None:
            return req.block_steps
        return int(np.count_nonzero((req.block_tokens != self.mask_id) & ~req.block_immutable))

    def _rng_step(self, req: Request) -> int:
        """Where this step sits in the request's generation (block index, step in block): folded into the sampling
        key, so a seeded request draws the same tokens whatever its batch, cache hits or retractions."""
        return req.prefix_len(self.B) // self.B * RNG_STEPS_PER_BLOCK + req.block_steps

    # ------------------------------------------------------------------------------------------
    # Failures, cache, checks
    # ------------------------------------------------------------------------------------------
    def idle(self) -> None:
        self.runner.compiler.wait(0.05)  # every decoding row waits for a background compile

    @staticmethod
    def call_requests(call) -> list[Request]:
        return call.reqs if isinstance(call, PrefillCall) else call.all_reqs

    def drop_call(self, call) -> None:
        """A failed call: the pages it reserved for chained blocks (owned by no request yet) go back."""
        for pages in getattr(call, "chain_pages", {}).values():
            self.allocator.free(pages)

    def pool_lost(self) -> bool:
        return self.runner.pool_lost()

    def reset_cache(self) -> None:
        self.radix.reset()

    def fail_with_pages(self, req: Request, error: Exception, pages: list[int]) -> None:
        """Fail ``req`` (the scheduler's ``fail``), then free ``pages``: reserved for it, held by no request or the
        index yet (those a commit already handed over stay)."""
        self.s.fail(req, error)
        held = self.radix.pages() if pages and self.radix.enabled else set()
        held |= {p for r in self.s.running for p in (*r.own_pages, r.block_page) if p is not None}
        stray = [p for p in pages if p not in held and self.allocator.refcount(p) > 0]
        if stray:
            self.allocator.free(stray)

    def cache_load(self) -> dict:
        return {"kv_pages_total": self.allocator.capacity, "kv_pages_free": self.allocator.num_free,
                "kv_pages_used": self.allocator.capacity - self.allocator.num_free,
                "kv_pages_cached": self.radix.total, "kv_pages_locked": self.radix.protected}

    def check_pages(self) -> None:
        """Every page is exactly one of free / owned by one request / held by the radix index."""
        holders = collections.Counter()
        for req in self.s.running:
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
