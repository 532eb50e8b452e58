"""Committing a device call's results: the scheduler's second half (``Scheduler.process``).

Prefilled blocks enter the radix index; a denoised block that is done is committed: its new tokens appended to
the outputs (cut at ``max_new_tokens``, the first stop id, or a stop string found by
:mod:`dllm_jax.engine.output`), its log probabilities recorded, its page kept (and cached once its K/V is exact);
a block not done carries its tokens and algorithm state to the next call; blocks a row chained past on the device
are committed the same way (the pages for those blocks are reserved here too, when the call is planned). Every
request's commit is its own: an error fails that request alone.

:class:`CommitMixin` is a part of :class:`dllm_jax.engine.scheduler.Scheduler` (it reads the scheduler's pages,
index and statistics); it lives here so that each half reads on its own.
"""

from __future__ import annotations

import logging
import time

import jax
import numpy as np

from dllm_jax.decode.rows import CHAIN_STOP_IDS
from dllm_jax.engine.calls import DecodeOutput, DenoiseCall, PrefillCall
from dllm_jax.engine.request import Request


log = logging.getLogger("dllm_jax")
PROVISIONAL = {"provisional": True}  # the event of a denoise step that left the block unfinished


class CommitMixin:
    # Host overlap (the engine's ``host_overlap``): while ``deferring``, events wait in ``deferred_events`` and
    # the engine hands them over while the next device call runs (:meth:`deliver_events`).
    deferring: bool = False
    deferred_events: list | tuple = ()  # a list per scheduler that defers (Scheduler.__init__)
    consumer_failures: list | tuple = ()

    def _emit(self, req: Request, event: dict | None = None) -> None:
        """Hand the request's consumer an event (a committed chunk, the finish, a provisional step): now, after
        the events still waiting (their order is kept), or, while ``deferring``, later."""
        if req.on_event is None:
            return
        if req.finished and self.deferred_events:  # its finish event carries all its waiting ones hold
            self.deferred_events = [(r, e) for r, e in self.deferred_events if r is not req]
        if self.deferring:
            self.deferred_events.append((req, event or {}))
            return
        self.deliver_events()
        self._deliver(req, event or {}, in_flight=False)

    def deliver_events(self, *, in_flight: bool = False) -> None:
        """Hand over the events waiting (consumers read the request's state then, which no commit changed
        since; a provisional event whose block is gone, the request retracted since, is dropped).
        ``in_flight``: a device call runs, and a consumer that fails only has its failure noted
        (``consumer_failures``; the engine fails the request once that call is committed, since the call may be
        writing the request's pages)."""
        events, self.deferred_events = self.deferred_events, []
        for req, event in events:
            if event.get("provisional") and getattr(req, "block_tokens", None) is None:
                continue
            self._deliver(req, event, in_flight=in_flight)

    def _deliver(self, req: Request, event: dict, *, in_flight: bool) -> None:
        try:
            req.on_event(req, event)
        except Exception as e:  # the consumer's failure is its request's, never the loop's
            if req.finished:
                log.exception("request %s: its on_event callback failed after it finished", req.rid)
            elif in_flight:
                self.consumer_failures.append((req, e))
            else:
                self._fail(req, e)

    def fail_consumers(self) -> None:
        """Fail the requests whose consumer failed while a device call ran (see :meth:`deliver_events`)."""
        failures, self.consumer_failures = self.consumer_failures, []
        for req, error in failures:
            if not req.finished:
                self._fail(req, error)

    def _commit_prefill(self, call: PrefillCall) -> None:
        self.stats["prefill_forwards"] += 1
        for req, pages in zip(call.reqs, call.pages):
            try:
                req.pages.extend(pages)
                req.forward_passes += 1
                self._insert(req)
                self._classify(req)
            except Exception as e:
                self._fail(req, e)


    def _commit_denoise(self, call: DenoiseCall, out: DecodeOutput) -> None:
        refresh, reqs, chain_pages = call.refresh, call.reqs, call.chain_pages
        self.stats["denoise_calls"] += 1
        self.stats["denoise_forwards"] += int(out.forwards.max())
        self.stats["refresh_rows"] += len(refresh)
        with jax.profiler.TraceAnnotation("commit"):
            for req in refresh:
                try:
                    req.stale_tokens = None
                    self._insert(req)
                except Exception as e:
                    self._fail(req, e)
            for i, req in enumerate(reqs, start=len(refresh)):
                pages = chain_pages.get(id(req), [])
                try:
                    self._commit_row(req, out, i, pages)
                except Exception as e:
                    self._fail(req, e, stray_pages=pages)


    def _commit_row(self, req: Request, out: DecodeOutput, i: int, pages: list[int]) -> None:
        """Take row ``i`` of a denoise call's result: its figures, its chained blocks (``pages`` were reserved
        for them; those it did not start are freed), then its block: committed if done, else carried on."""
        if req.params.logprobs >= 0:
            self._record_logprobs(req, out, i)
        chained = int(out.chain_blocks[i]) if pages else 0
        self.stats["chained_blocks"] += chained
        if pages[chained:]:  # reserved for blocks the call did not start
            self.allocator.free(pages[chained:])
        if chained and not self._commit_chained(req, out.chain_tokens[i, :chained],
                                                out.chain_steps[i, :chained], pages[:chained]):
            return
        steps = int(out.steps[i])
        req.forward_passes += steps
        req.block_steps += steps
        if out.done[i]:
            self._commit_block(req, out.tokens[i], fresh_kv=bool(out.fresh_kv[i]))
        else:
            req.block_tokens, req.algo_state = out.tokens[i], out.states[i]
            if req.provisional:
                self._emit(req, PROVISIONAL)


    def _stop_set(self, req: Request) -> frozenset[int]:
        """The token ids that end the request's outputs (its stop ids, and EOS unless ignored); one set per distinct
        choice, kept (a commit reads it for every block)."""
        stop_token_ids, ignore_eos = key = (req.params.stop_token_ids, req.params.ignore_eos)
        ids = self._stop_sets.get(key)
        if ids is None:
            ids = frozenset(stop_token_ids) if ignore_eos else frozenset(stop_token_ids) | self.eos_token_ids
            if len(self._stop_sets) < 1024:
                self._stop_sets[key] = ids
        return ids

    def _stop_ids(self, req: Request) -> tuple[int, ...]:
        return tuple(sorted(self._stop_set(req)))

    def _commit_chained(self, req: Request, blocks: np.ndarray, steps: np.ndarray, pages: list[int]) -> bool:
        """Commit the blocks a call completed and chained past, each as a block done on the host would be, and set
        up the block after each in its reserved page. False if the request finished (then its later pages, whose
        blocks the host does not keep, are freed)."""
        for j, (tokens, n) in enumerate(zip(blocks, steps)):
            req.forward_passes += int(n)
            req.block_steps += int(n)
            self._commit_block(req, tokens, fresh_kv=True)
            if req.finished:  # the device chains only past blocks that do not end the request: a safety net
                self.allocator.free(pages[j:])
                return False
            if not self._start_block(req, pages[j]):  # (it frees pages[j])
                if pages[j + 1:]:
                    self.allocator.free(pages[j + 1:])
                return False
        return True


    @staticmethod
    def _record_logprobs(req: Request, out: DecodeOutput, i: int) -> None:
        """Keep, per position of the block, the figures of the forward that last wrote it."""
        wrote = out.recorded[i]
        req.block_logprob[wrote] = out.logprob[i][wrote]
        k = req.block_top_ids.shape[1]
        if k:
            req.block_top_logprob[wrote] = out.top_logprob[i][wrote, :k]
            req.block_top_ids[wrote] = out.top_ids[i][wrote, :k]


    def _commit_block(self, req: Request, tokens: np.ndarray, fresh_kv: bool = True) -> None:
        B = self.B
        n_imm = int(np.count_nonzero(req.block_immutable))
        new = tokens[n_imm:].tolist()
        if req.first_block_time is None:
            req.first_block_time = time.perf_counter()
        before = len(req.output_ids)
        finish = self._append_outputs(req, new)
        if req.params.logprobs >= 0:
            self._append_logprobs(req, n_imm, before)
        if req.real_len >= req.prefix_len(B) + B:  # the block is complete real tokens: keep its KV
            req.pages.append(req.block_page)
            req.own_pages.add(req.block_page)
            req.block_page = None
            if fresh_kv:
                self._insert(req)
            else:  # folded: cached once the next call's refresh row has rewritten its KV
                req.stale_tokens = np.array(tokens, np.int32)
        req.block_tokens = req.block_immutable = req.algo_state = None
        req.block_steps = 0
        if finish is not None:
            self._finish(req, finish, insert=True)
        else:
            self._emit(req)
            if not req.finished:  # (its consumer may have failed it)
                self._classify(req)

    @staticmethod
    def _append_logprobs(req: Request, n_imm: int, before: int) -> None:
        """SGLang's triples for the output tokens just committed (``-inf`` reported as -9999.0, JSON-safe)."""
        count = len(req.output_ids) - before
        pos = slice(n_imm, n_imm + count)
        ids = req.output_ids[before:]
        lps = np.maximum(req.block_logprob[pos], -9999.0).tolist()
        req.output_token_logprobs.extend([lp, tid, None] for lp, tid in zip(lps, ids))
        k = req.block_top_ids.shape[1]
        if k:
            vals = np.maximum(req.block_top_logprob[pos], -9999.0).tolist()
            tops = req.block_top_ids[pos].tolist()
            req.output_top_logprobs.extend([[v, t, None] for v, t in zip(vs, ts)] for vs, ts in zip(vals, tops))

    def _append_outputs(self, req: Request, new: list[int]) -> dict | None:
        """Append a committed block's new tokens; apply max_new_tokens, EOS / stop ids and stop strings."""
        params = req.params
        stop_ids = self._stop_set(req)
        finish = None
        start = len(req.output_ids)
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
    # Block chaining (FDFO): a request that nothing else waits on writes several blocks per device call
    # ------------------------------------------------------------------------------------------
    def _chain_budget(self, req: Request) -> int:
        """How many blocks after the current one the request may start on the device in this call: none when the
        host must see each block (streaming, stop strings, log probabilities, penalties, which read the growing
        history) or when its stop ids do not fit the device's table; else as many as ``max_new_tokens`` and the
        context length leave room for, at most the runner's chain width."""
        p = req.params
        if (req.stream or req.provisional or p.stop or p.logprobs >= 0 or p.penalized
                or req.block_immutable is None or len(self._stop_set(req)) > CHAIN_STOP_IDS):
            return 0
        B = self.B
        after = len(req.output_ids) + B - int(req.block_immutable.sum())  # outputs once the current block is in
        remaining = p.max_new_tokens - after
        room = self.context_length // B - len(req.pages) - 1  # further blocks that fit the context
        return max(0, min(self.runner.chain, -(-remaining // B), room))

    def _reserve_chain_pages(self, reqs: list[Request]) -> dict[int, list[int]]:
        """Pages for the blocks each request may chain into: free pages, then pages of the cache's least recently
        used blocks (as the next round would take for the next block), never a running request's (no retraction
        for a block that may not be needed). What a call does not use is freed after it."""
        out = {}
        for req in reqs:
            n = self._chain_budget(req)
            if n > self.allocator.num_free and self.radix.evictable:
                with jax.profiler.TraceAnnotation("radix.evict"):
                    self.radix.evict(min(n - self.allocator.num_free, self.radix.evictable))
            n = min(n, self.allocator.num_free)
            if n > 0:
                out[id(req)] = self.allocator.alloc(n)
        return out
