"""Committing a mask-block call's result (the second half of :class:`dllm_jax.engine.mask_blocks.MaskBlocks`).

Prefilled blocks enter the radix index; a denoised block that is done is committed: its new tokens appended to
the outputs (the scheduler's ``append_outputs``: ``max_new_tokens``, the first stop id, a stop string), its log
probabilities recorded, its page kept (and cached once its K/V is exact); a block not done carries its tokens and
algorithm state to the next call; blocks a row chained past on the device are committed the same way (the pages
for those blocks are reserved here too, when the call is planned). Every request's commit is its own: an error
fails that request alone.
"""

from __future__ import annotations

import jax
import numpy as np

from dllm_jax.decode.rows import CHAIN_STOP_IDS
from dllm_jax.engine.calls import DecodeOutput, DenoiseCall, PrefillCall
from dllm_jax.engine.events import PROVISIONAL
from dllm_jax.engine.request import Request


class MaskCommit:
    def commit(self, call, result) -> None:
        if isinstance(call, PrefillCall):
            self._commit_prefill(call)
        else:
            self._commit_denoise(call, result)

    def _commit_prefill(self, call: PrefillCall) -> None:
        self.s.stats["prefill_forwards"] += 1
        for req, pages in zip(call.reqs, call.pages):
            try:
                req.pages.extend(pages)
                req.forward_passes += 1
                self._insert(req)
                self.classify(req)
            except Exception as e:
                self.s.fail(req, e)


    def _commit_denoise(self, call: DenoiseCall, out: DecodeOutput) -> None:
        refresh, reqs, chain_pages = call.refresh, call.reqs, call.chain_pages
        self.s.stats["denoise_calls"] += 1
        self.s.stats["denoise_forwards"] += int(out.forwards.max())
        self.s.stats["refresh_rows"] += len(refresh)
        with jax.profiler.TraceAnnotation("commit"):
            for req in refresh:
                try:
                    req.stale_tokens = None
                    self._insert(req)
                except Exception as e:
                    self.s.fail(req, e)
            for i, req in enumerate(reqs, start=len(refresh)):
                pages = chain_pages.get(id(req), [])
                try:
                    self._commit_row(req, out, i, pages)
                except Exception as e:
                    self.fail_with_pages(req, e, pages)


    def _commit_row(self, req: Request, out: DecodeOutput, i: int, pages: list[int]) -> None:
        """Take row ``i`` of a denoise call's result: its figures, its chained blocks (``pages`` were reserved
        for them; those it did not start are freed), then its block: committed if done, else carried on."""
        if req.params.logprobs >= 0:
            self._record_logprobs(req, out, i)
        chained = int(out.chain_blocks[i]) if pages else 0
        self.s.stats["chained_blocks"] += chained
        if pages[chained:]:  # reserved for blocks the call did not start
            self.allocator.free(pages[chained:])
        if chained and not self._commit_chained(req, out.chain_tokens[i, :chained],
                                                out.chain_steps[i, :chained], pages[:chained]):
            return
        steps = int(out.steps[i])
        req.forward_passes += steps
        req.block_steps += steps
        tokens, done, state = out.tokens[i], bool(out.done[i]), out.states[i]
        fresh_kv = bool(out.fresh_kv[i])
        if req.grammar is not None:  # what the grammar does not allow goes back to masks (engine/grammar.py)
            tokens, taken_back = req.grammar.check_block(tokens, req.block_immutable, self.mask_id)
            if req.grammar.stopped:  # it took an EOS: the answer ends in this block, whatever follows the EOS
                done, fresh_kv = True, done and fresh_kv
            elif taken_back:
                done, state = False, None  # (the algorithm starts over on the block's remaining masks)
        if done:
            self._commit_block(req, tokens, fresh_kv=fresh_kv)
        else:
            req.block_tokens, req.algo_state = tokens, state
            if req.provisional:
                self.s.emit(req, PROVISIONAL)


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
        before = len(req.output_ids)
        if req.grammar is not None:
            req.grammar.block_committed()
        finish = self.s.append_outputs(req, new)
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
            self.s.finish(req, finish, keep=True)
        else:
            self.s.emit(req)
            if not req.finished:  # (its consumer may have failed it)
                self.classify(req)

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

    # ------------------------------------------------------------------------------------------
    # Block chaining (FDFO): a request that nothing else waits on writes several blocks per device call
    # ------------------------------------------------------------------------------------------
    def _chain_budget(self, req: Request) -> int:
        """How many blocks after the current one the request may start on the device in this call: none when the
        host must see each block (streaming, stop strings, log probabilities, penalties, which read the growing
        history) or when its stop ids do not fit the device's table; else as many as ``max_new_tokens`` and the
        context length leave room for, at most the runner's chain width."""
        p = req.params
        if (req.stream or req.provisional or p.stop or p.logprobs >= 0 or p.penalized or req.grammar is not None
                or req.block_immutable is None or len(self.s.stop_set(req)) > CHAIN_STOP_IDS):
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
