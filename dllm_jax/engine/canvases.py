"""The block policy of DiffusionGemma (Gemma4Renoise): a request's answer is written one canvas at a time, each
canvas starting as uniform noise on the device right after the real tokens; its K/V pages (``page_size`` tokens,
finer than a canvas) live in two pools, cached in the window-aware index (:mod:`dllm_jax.cache.window_radix`).

A request's path: admitted into a free slot with pages for its real tokens (prompt, plus the outputs it kept if it
was retracted; a cached prefix first) -> those tokens encoded (the prefill call: an :class:`EncodeCall`, several
requests per call, a long prompt in chunks) -> its canvas denoised in :class:`DenoiseCall` s together with the
other running rows -> when its canvas finishes, the argmax canvas is committed (the scheduler's
``append_outputs``; streamed as one chunk) -> unless the request is done, the canvas is encoded (the next round's
prefill call) and the next canvas starts. FDFO: a denoise call runs until the first live row finishes its canvas;
sync: until every live row has (the runner's ``first_finish``).

Pages: full-attention layers keep every page of the context; sliding-window layers have their own pool and give
back a page as soon as it lies wholly before the window of the next forward (positions ``< prefix_len - (window -
1)``), so a request holds at most about ``(window + canvas) / page_size`` of them whatever its length. When pages
run out the cache gives back sliding pages, then whole leaves, then the newest other running request is retracted
(its outputs kept; re-admitted, it re-encodes its real tokens and continues with the same canvas index, hence the
same draws). Prefix reuse: complete pages of encoded real tokens enter the index as they are encoded (and when a
request finishes or is retracted); an admitted request starts from the longest cached prefix whose window is
cached too, and encodes only the rest.

Images (:mod:`dllm_jax.engine.images`): the index keys an image's tokens by its image's digest, and a chunk never
cuts an image (its tokens may attend to each other both ways): it stops before the image, or runs to its end.
"""

from __future__ import annotations

import collections

import numpy as np

from dllm_jax.cache.pages import TRASH_PAGE, OutOfPages, PageAllocator
from dllm_jax.cache.window_radix import WindowPrefixIndex
from dllm_jax.decode import renoise_tables
from dllm_jax.engine.events import PROVISIONAL
from dllm_jax.engine.policy import Admission, Refuse
from dllm_jax.engine.renoise_runner import DenoiseCall, DenoiseResult, EncodeCall, RenoiseRunner
from dllm_jax.engine.request import Phase, Request
from dllm_jax.model.gemma import FULL_KIND, SLIDING_KIND
from pallas_kernels import next_pow2


class Canvases:
    def __init__(self, runner: RenoiseRunner, *, canvas: int, window: int | None, max_running_requests: int,
                 max_steps_per_call: int = 1 << 30, max_prefill_tokens: int = 4096, enable_prefix_cache: bool = True):
        self.runner = runner
        self.C, self.S = canvas, runner.page_size
        self.window = window
        self.max_steps_per_call = max_steps_per_call
        self.chunk = max_prefill_tokens  # tokens per encode row: a long prompt goes in chunks (its window's pages
        # are given back between them)
        self.full = PageAllocator(runner.num_pages[FULL_KIND])
        self.sliding = PageAllocator(runner.num_pages[SLIDING_KIND])
        self.index = WindowPrefixIndex(self.S, window, self.full, self.sliding, enabled=enable_prefix_cache)
        self.slots = max_running_requests
        self._slot: dict[Request, int] = {}
        self._sliding_pages: dict[Request, list[int]] = {}  # per page of context; TRASH_PAGE once released
        self._kv_len: dict[Request, int] = {}  # tokens whose K/V are in the pools
        self._starting: set[Request] = set()  # canvas to start in the next denoise call
        self._entries: dict[Request, tuple[int, tuple]] = {}  # (canvas index, its adjustment entries)
        self.s = None  # the scheduler (attach)

    def attach(self, scheduler) -> None:
        self.s = scheduler

    # ------------------------------------------------------------------------------------------
    # Admission and pages
    # ------------------------------------------------------------------------------------------
    def start_admission(self) -> None:
        return None

    def admit(self, req: Request):
        """A slot (the lowest free: live slots stay low, so a denoise call's rows stay few), the longest cached
        prefix (its pages, our own references), pages for the first chunk."""
        self._slot[req] = min(set(range(self.slots)) - set(self._slot.values()))
        full, sliding = self._match(req)
        self.index.take(full, sliding)
        self._kv_len[req] = len(full) * self.S
        self._sliding_pages[req] = sliding
        req.pages, req.own_pages = list(full), set(full)
        if not self._pages_for(req, self._chunk_end(req), retract=False):
            self.release(req, keep=False)
            # alone and still too long: it can never run
            return Refuse("the request does not fit the KV pool") if not self.s.running else Admission.WAIT
        req.phase = Phase.PREFILL
        if self._kv_len[req] == req.real_len:  # all of it cached: its canvas starts now
            req.phase = Phase.DECODE
            self._starting.add(req)
        return Admission.ADMIT

    def _match(self, req: Request) -> tuple[list[int], list[int]]:
        """The longest cached prefix (keyed by :attr:`Request.cache_keys`: an image's tokens by its digest). It may
        end inside an image (the next chunk then holds the image's rest), except where an image's tokens attend
        to each other both ways and the image is as long as the window: its rest would read its first tokens
        through sliding layers beyond the window, which the sliding pool does not keep; such a match stops
        before the image."""
        keys = req.cache_keys
        vision = self.runner.vision
        if vision is None or not vision[1].bidirectional or self.window is None:
            return self.index.match(keys)
        while True:
            full, sliding = self.index.match(keys)
            end = len(full) * self.S
            cut = next((start for start, count, _ in req.image_spans
                        if start < end < start + count and count >= self.window), None)
            if cut is None:
                return full, sliding
            keys = keys[:cut]

    def _chunk_end(self, req: Request) -> int:
        """Where the request's next encode chunk ends: ``max_prefill_tokens`` on, moved back to the start of an
        image it would cut (or on to the image's end, when the chunk starts at or inside the image): an image's
        tokens are encoded together (they may attend to each other both ways)."""
        start = self._kv_len.get(req, 0)
        end = min(req.real_len, start + self.chunk)
        for first, count, _ in req.image_spans:
            if first < end < first + count:
                end = first if first > start else first + count
        return end

    def cached_len(self, req: Request) -> int:
        return self._kv_len[req]

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
                victim = next((r for r in reversed(self.s.running) if r is not req), None) if retract else None
                if victim is None:
                    return False
                self.s.retract(victim)
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

    def release(self, req: Request, *, keep: bool) -> None:
        """Give back both pools' pages (``keep``: its complete pages of encoded real tokens stay cached)."""
        if keep and req in self._kv_len:
            self._cache(req)
        if req.own_pages:
            self.full.free(sorted(req.own_pages))
        live = [p for p in self._sliding_pages.pop(req, []) if p != TRASH_PAGE]
        if live:
            self.sliding.free(live)
        req.pages, req.own_pages = [], set()
        self._slot.pop(req, None)
        self._kv_len.pop(req, None)
        self._starting.discard(req)
        self._entries.pop(req, None)

    def _cache(self, req: Request) -> None:
        """Offer the request's complete pages of encoded real tokens to the prefix index."""
        kv_len = self._kv_len.get(req, 0)
        if kv_len >= self.S:
            self.index.insert(req.cache_keys[:kv_len], req.pages, self._sliding_pages.get(req, []))

    def _tables(self, reqs: list[Request], *, by_slot: int = 0) -> dict:
        """Page tables: row = slot (a denoise call: its first ``by_slot`` slots) or the request's index in ``reqs``
        (an encode call)."""
        rows = by_slot or len(reqs)
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
    def plan_prefill(self, reqs: list[Request], *, retract: bool) -> EncodeCall | None:
        """Encode the real tokens admitted requests still have to (a chunk each; finished canvases too)."""
        ready = []
        for req in reqs:
            end = self._chunk_end(req)
            if req in self.s.running and self._pages_for(req, end, retract=retract):
                ready.append(req)
            elif req in self.s.running and retract:
                self.s.fail(req, RuntimeError("the request's context does not fit the KV pool"))
        ready = [r for r in ready if r in self.s.running]  # (a later allocation may have retracted an earlier one)
        if not ready:
            return None
        tokens = [r.real_ids[self._kv_len[r]:self._chunk_end(r)] for r in ready]
        tables = self._tables(ready)
        compiler = self.runner.compiler
        if compiler.warmed and compiler.background and len(ready) > 1:  # (followers: compiled in line, in step)
            key = self.runner.encode_key(len(ready), max(map(len, tokens)), tables[FULL_KIND].shape[1])
            if key not in compiler.compiled:  # a shape warm-up did not cover: compiled aside, one row meanwhile
                compiler.compile_soon(key)
                ready, tokens = ready[:1], tokens[:1]
                tables = self._tables(ready)
        images = [self._chunk_images(r, len(t)) for r, t in zip(ready, tokens)]
        return EncodeCall(ready, tokens, [self._kv_len[r] for r in ready], tables,
                          images if any(images) else None)

    def _chunk_images(self, req: Request, length: int) -> list:
        """The images whose tokens the request's next chunk (``length`` tokens) holds (an image's rest, after a
        cached prefix that ends inside it): (image, offset in the chunk, first soft token, count)."""
        start = self._kv_len[req]
        return [(req.images[k], max(0, first - start), max(0, start - first), first + count - max(first, start))
                for first, count, k in req.image_spans if first + count > start and first < start + length]

    def _commit_encode(self, call: EncodeCall) -> None:
        self.s.stats["prefill_forwards"] += 1
        for req, tokens in zip(call.reqs, call.tokens):
            if req not in self.s.running:
                continue
            self._kv_len[req] += len(tokens)
            self._cache(req)
            self._release_window(req)
            if self._kv_len[req] == req.real_len:
                req.phase = Phase.DECODE
                self._starting.add(req)

    def plan_denoise(self, reqs: list[Request]) -> DenoiseCall:
        R = self.runner.denoise_rows(1 + max(self._slot[r] for r in reqs))  # the first R slots hold every live one
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
        tables = self._tables(reqs, by_slot=R)
        adjust = None
        if any(r.params.penalized for r in reqs):  # the penalty variant: every row's table (neutral: empty)
            adjust = renoise_tables.empty_tables(R, self.runner.adjust_width(tables[FULL_KIND].shape[1]))
            for req in reqs:
                if req.params.penalized:
                    slot = self._slot[req]
                    try:
                        renoise_tables.put_row(adjust, slot, self._canvas_entries(req))
                    except Exception as e:  # (a table that does not fit) that request's failure alone
                        self.s.fail(req, e)
                        live[slot] = False
            reqs = [r for r in reqs if r in self.s.running]
            if not reqs:
                return None
        # (a constrained row reads each position's recorded alternatives where its canvas breaks the grammar)
        top = any(r.params.logprobs > 0 or r.grammar is not None for r in reqs)
        return DenoiseCall(list(reqs), starting, seeds, canvas_index, prefix, tables, live, steps, adjust, top)

    def _canvas_entries(self, req: Request) -> tuple:
        """The request's adjustment entries for its current canvas (built once per canvas: the committed outputs
        before it are the generated tokens; :mod:`dllm_jax.decode.renoise_tables`)."""
        index = len(req.output_ids) // self.C
        cached = self._entries.get(req)
        if cached is not None and cached[0] == index:
            return cached[1]
        p = req.params
        entries = renoise_tables.canvas_entries(
            history=req.prompt_ids + req.output_ids, prompt_len=len(req.prompt_ids), canvas_len=self.C,
            presence=p.presence_penalty, frequency=p.frequency_penalty, repetition=p.repetition_penalty,
            bias=p.logit_bias, stop_ids=sorted(self.s.stop_set(req)), min_new=p.min_new_tokens)
        self._entries[req] = (index, entries)
        return entries

    def _commit_denoise(self, call: DenoiseCall, out: DenoiseResult) -> None:
        self.s.stats["denoise_calls"] += 1
        self.s.stats["denoise_forwards"] += int(out.steps.max(initial=0))
        for req in call.reqs:
            if req.finished or req not in self.s.running:
                continue
            s = self._slot[req]
            req.forward_passes += int(out.steps[s])
            req.block_steps += int(out.steps[s])
            req.block_tokens = out.argmax[s]
            req.block_immutable = np.zeros(self.C, bool)
            req.block_offset = self._kv_len[req]
            if not out.finished[s]:
                if req.provisional:
                    self.s.emit(req, PROVISIONAL)
                continue
            try:
                top = None if out.top_ids is None else (out.top_logprob[s], out.top_ids[s])
                canvas = out.argmax[s]
                if req.grammar is not None:  # the valid prefix, and an allowed token where it broke
                    canvas = np.asarray(req.grammar.accept_canvas(canvas.tolist(), top and top[1]), np.int32)
                self._commit_canvas(req, canvas, out.logprob[s], top)
            except Exception as e:  # one request's commit failing is its own
                self.s.fail(req, e)

    def _commit_canvas(self, req: Request, canvas: np.ndarray, logprob: np.ndarray, top=None) -> None:
        before = len(req.output_ids)
        finish = self.s.append_outputs(req, canvas.tolist())
        self._entries.pop(req, None)
        if req.params.return_logprob:  # under the canvas's last step (-inf reported as -9999.0, JSON-safe)
            count = len(req.output_ids) - before
            lps = np.maximum(logprob[:count], -9999.0).tolist()
            req.output_token_logprobs.extend([lp, t, None] for lp, t in zip(lps, req.output_ids[before:]))
            k = req.params.top_logprobs_num
            if k:
                vals = np.maximum(top[0][:count, :k], -9999.0).tolist()
                ids = top[1][:count, :k].tolist()
                req.output_top_logprobs.extend([[v, t, None] for v, t in zip(vs, ts)] for vs, ts in zip(vals, ids))
        req.block_tokens = req.block_immutable = req.block_offset = None
        req.block_steps = 0
        if finish is not None:
            self.s.finish(req, finish, keep=True)
            return
        self.s.emit(req)
        if not req.finished:
            req.phase = Phase.PREFILL  # its canvas goes through the encoder next round

    # ------------------------------------------------------------------------------------------
    # Failures, cache, checks
    # ------------------------------------------------------------------------------------------
    def idle(self) -> None:
        return None

    def commit(self, call, result) -> None:
        if isinstance(call, EncodeCall):
            self._commit_encode(call)
        else:
            self._commit_denoise(call, result)

    @staticmethod
    def call_requests(call) -> list[Request]:
        return list(call.reqs)

    def drop_call(self, call) -> None:
        return None  # a call reserves no page beyond its requests'

    def pool_lost(self) -> bool:
        return self.runner.pool_lost()

    def reset_cache(self) -> None:
        self.index.reset()

    def cache_load(self) -> dict:
        full, sliding = self.index.held()
        return {"kv_pages_total": self.full.capacity, "kv_pages_free": self.full.num_free,
                "kv_pages_used": self.full.capacity - self.full.num_free, "kv_pages_cached": len(full),
                "kv_pages_locked": 0, "sliding_pages_total": self.sliding.capacity,
                "sliding_pages_free": self.sliding.num_free, "sliding_pages_cached": len(sliding)}

    def check_pages(self) -> None:
        """Every page of both pools is free or held: a reference per running request using it, one per index node."""
        running = self.s.running
        index_full, index_sliding = self.index.held()
        assert self.index.total == len(index_full), f"prefix index counts {self.index.total} nodes, holds {len(index_full)}"
        for allocator, held in ((self.full, [p for r in running for p in r.own_pages] + index_full),
                                (self.sliding, [p for r in running for p in self._sliding_pages.get(r, [])
                                                if p != TRASH_PAGE] + index_sliding)):
            holders = collections.Counter(held)
            for page in range(1, allocator.capacity + 1):
                assert allocator.refcount(page) == holders[page], \
                    f"page {page}: refcount {allocator.refcount(page)} but {holders[page]} holder(s)"
        if self.window is not None:
            bound = -(-(self.window - 1 + self.C) // self.S) + 2
            for r in running:
                live = sum(p != TRASH_PAGE for p in self._sliding_pages.get(r, []))
                assert live <= bound, f"request {r.rid} holds {live} sliding pages (window bound {bound})"
        assert set(self._slot) == set(running), "a slot is held by a request that is not running"
