"""The scheduler alone, against a fake runner (no model, no compile): plan -> run -> commit.

The fake runner keeps a simulated KV pool (each page holds the tokens of the block written to it) and decodes a
block in one step by a fixed function of everything before each position, read through the row's page table. So
a wrong page handed out by the radix index, a page freed while still read, or a lost block changes the outputs,
and every run is checked against the same function applied to the plain sequence, with no cache. Pages are checked
after every committed call.
"""

from __future__ import annotations

import types

import numpy as np
import pytest

from dllm_jax.cache.pages import PageAllocator
from dllm_jax.cache.radix import BlockRadixIndex
from dllm_jax.engine.calls import DecodeOutput, DenoiseCall, Failed, PrefillCall
from dllm_jax.engine.request import Phase, Request
from dllm_jax.engine.sampling import SamplingParams
from dllm_jax.engine.mask_blocks import MaskBlocks
from dllm_jax.engine.scheduler import Scheduler

MASK, EOS = 63, 1


def next_token(context: list[int], position: int) -> int:
    """The fake model: a token from everything before ``position`` (never EOS or the mask id)."""
    return (sum(t * (i + 3) for i, t in enumerate(context)) * 31 + position * 7) % 57 + 2


def reference(prompt: list[int], max_new: int, B: int) -> list[int]:
    """What any schedule must produce: blocks aligned to multiples of B, each masked position decoded from the
    tokens before it (prompt tokens of the block included, undecided ones not)."""
    seq = list(prompt)
    while len(seq) - len(prompt) < max_new:
        start = len(seq) // B * B
        block = seq[start:] + [MASK] * (B - (len(seq) - start))
        for j in range(len(seq) - start, B):
            block[j] = next_token(seq[:start] + [t for t in block[:j] if t != MASK], start + j)
        seq = seq[:start] + block
    return seq[len(prompt):len(prompt) + max_new]


class FakeRunner:
    """What the scheduler asks of a runner, over a simulated KV pool (page -> the block's tokens)."""

    channel = None

    def __init__(self, B: int, *, loop: bool = False, waiting_keys=(), chain: int = 0):
        self.B, self.loop, self.chain = B, loop, chain
        self.kv: dict[int, list[int]] = {}
        self.calls: list = []
        self.waiting_keys = set(waiting_keys)  # keys "compiling in the background"
        self.compiler = types.SimpleNamespace(compiles_in_background=lambda key: key in self.waiting_keys,
                                              compile_soon=lambda key: None, wait=lambda timeout: None,
                                              background=True, warmed_classes={"plain"})

    def can_chain(self, rows: int) -> bool:
        return self.chain > 0 and rows <= 2

    def prefill_chunk(self, blocks: int) -> int:
        return max(1, min(blocks, 2))

    def max_prefill_rows(self, chunk: int) -> int:
        return 2

    def prefill_fit(self, chunk: int, rows: int):
        return chunk, rows

    def denoise_key(self, rows, pages, *, sampling, penalties, logprobs, top, grammar=False, ask=True):
        return ("denoise", sampling, penalties, logprobs, top, grammar)

    def pool_lost(self) -> bool:
        return False

    def _context(self, pages: list[int]) -> list[int]:
        return [t for p in pages for t in self.kv[p]]

    def run(self, call):
        self.calls.append(call)
        B = self.B
        if isinstance(call, PrefillCall):
            for row in call.rows:
                assert len(row.tokens) == B * len(row.write_pages)
                for j, page in enumerate(row.write_pages):
                    self.kv[page] = list(row.tokens[j * B:(j + 1) * B])
            return None
        tokens, chained = [], []
        for row in call.rows:
            context = self._context(row.prefix_pages)
            block = [int(t) for t in row.tokens]
            if not row.refresh:
                self._decode(block, row.immutable, context)
            self.kv[row.write_page] = block  # the K/V of the block's final tokens (done in one step)
            done = []
            # chaining: a done block that holds no stop id goes on into the next reserved page, in this call
            for page in row.chain_pages:
                if set(block) & set(row.stop_ids):
                    break
                done.append(block)
                context = context + block
                block = [MASK] * B
                self._decode(block, [False] * B, context)
                self.kv[page] = block
            tokens.append(block)
            chained.append(done)
        n, C = len(call.rows), max(self.chain, 1)
        out = DecodeOutput(tokens=np.asarray(tokens, np.int32), done=np.ones(n, bool), steps=np.ones(n, np.int64),
                           states=[{} for _ in range(n)], fresh_kv=np.ones(n, bool),
                           forwards=np.asarray([1 + len(c) for c in chained]),
                           logprob=np.zeros((n, B), np.float32), recorded=np.ones((n, B), bool))
        if self.chain:
            out.chain_blocks = np.asarray([len(c) for c in chained])
            out.chain_tokens = np.zeros((n, C, B), np.int32)
            out.chain_steps = np.zeros((n, C), np.int64)
            for i, c in enumerate(chained):
                if c:
                    out.chain_tokens[i, :len(c)] = c
                    out.chain_steps[i, :len(c)] = 1
        return out

    @staticmethod
    def _decode(block: list[int], immutable, context: list[int]) -> None:
        """Every position to decode, from the tokens before it (the block's undecided ones excluded)."""
        for j in range(len(block)):
            if not immutable[j]:
                prior = [t for k, t in enumerate(block[:j]) if immutable[k] or block[k] != MASK]
                block[j] = next_token(context + prior, len(context) + j)


def make(B=4, pages=64, max_running=4, context=64, cache=True, loop=False, waiting_keys=(), chain=0):
    runner = FakeRunner(B, loop=loop, waiting_keys=waiting_keys, chain=chain)
    allocator = PageAllocator(pages)
    radix = BlockRadixIndex(B, allocator, enabled=cache)
    policy = MaskBlocks(runner, allocator, radix, block_size=B, mask_id=MASK, context_length=context,
                        max_prefill_blocks=2)
    sched = Scheduler(policy, eos_token_ids=(EOS,), max_running_requests=max_running)
    return sched, runner


def request(prompt, max_new=10, rid=None, **params):
    return Request(rid=rid or f"r{id(prompt)}-{len(prompt)}", prompt_ids=list(prompt),
                   params=SamplingParams(max_new_tokens=max_new, ignore_eos=True, **params), seed=0)


def run(sched: Scheduler, limit: int = 10_000) -> None:
    """Plan -> run -> commit until idle, checking every page after each call."""
    for _ in range(limit):
        if not sched.has_work():
            return
        for call in sched.schedule():
            sched.process(call, sched.runner.run(call))
            sched.check_pages()
    raise AssertionError("the scheduler did not finish")


PROMPTS = [[5, 6, 7], [5, 6, 7, 8, 9, 10, 11, 12, 13], list(range(2, 20)), [9] * 4, [5, 6, 7, 8, 9, 10, 11], [8]]


@pytest.mark.parametrize("loop", [False, True], ids=["fdfo", "sync"])
@pytest.mark.parametrize("cache", [True, False], ids=["cache", "no-cache"])
@pytest.mark.parametrize("max_running, pages", [(4, 64), (2, 64), (4, 9)], ids=["roomy", "2-rows", "retracting"])
def test_every_schedule_gives_the_reference_outputs(loop, cache, max_running, pages):
    sched, _ = make(pages=pages, max_running=max_running, cache=cache, loop=loop)
    reqs = [request(p, max_new=10, rid=str(i)) for i, p in enumerate(PROMPTS)]
    for req in reqs:
        sched.add(req)
    run(sched)
    for p, req in zip(PROMPTS, reqs):
        assert req.output_ids == reference(p, 10, 4), req.rid
        assert req.finish_reason == {"type": "length", "length": 10}
    if pages == 9:
        assert sched.stats["retractions"] > 0
    assert not sched.running and sched.policy.radix.protected == 0


def test_a_shared_prefix_is_matched_only_up_to_complete_blocks_of_real_tokens():
    """The radix bound: a match never reaches into the prompt's partial tail block, and ``cached_tokens`` is the
    first match, whole blocks of real tokens."""
    B = 4
    sched, runner = make(B=B)
    first = request(list(range(2, 14)), max_new=4, rid="first")  # 3 complete blocks
    sched.add(first)
    run(sched)
    for length in range(1, 17):  # every boundary: inside, at and past each block of the first prompt
        sched2_req = request(list(range(2, 2 + length)), max_new=4, rid=f"p{length}")
        sched.add(sched2_req)
        run(sched)
        # the first prompt's complete blocks are cached (its outputs differ from these tokens): the match is the
        # shared complete blocks, never the partial tail block
        assert sched2_req.cached_tokens == min(length, 12) // B * B, length
        assert sched2_req.output_ids == reference(list(range(2, 2 + length)), 4, B)


def test_classification_after_the_match():
    """A request is prefill iff its next block is all real tokens (after its prefix match), else decode."""
    B = 4
    sched, runner = make(B=B)
    for length, phase in [(3, Phase.DECODE), (4, Phase.PREFILL), (7, Phase.PREFILL), (8, Phase.PREFILL)]:
        req = request(list(range(2, 2 + length)), rid=f"c{length}")
        sched.add(req)
        sched._admit()
        assert req.phase is phase, length
        sched.abort(req)
        sched.check_pages()


def test_abort_gives_every_page_back_at_any_point():
    for stop_after in range(1, 8):
        sched, runner = make()
        reqs = [request(p, max_new=12, rid=str(i)) for i, p in enumerate(PROMPTS)]
        for req in reqs:
            sched.add(req)
        calls = 0
        while sched.has_work() and calls < stop_after:
            for call in sched.schedule():
                sched.process(call, runner.run(call))
                calls += 1
        for req in reqs:
            sched.abort(req)
        sched.check_pages()
        assert not sched.running and not sched.waiting and sched.policy.radix.protected == 0
        assert sched.policy.allocator.num_free + sched.policy.radix.total == sched.policy.allocator.capacity


def test_a_failed_call_fails_only_its_requests():
    sched, runner = make(max_running=2)
    reqs = [request(p, max_new=8, rid=str(i)) for i, p in enumerate(PROMPTS[:4])]
    for req in reqs:
        sched.add(req)
    failed = None
    for call in sched.schedule():
        if isinstance(call, DenoiseCall) and failed is None:
            failed = list(call.all_reqs)
            sched.process(call, Failed(RuntimeError("device lost")))
        else:
            sched.process(call, runner.run(call))
        sched.check_pages()
    run(sched)
    assert failed
    for p, req in zip(PROMPTS, reqs):
        if req in failed:
            assert req.finish_reason["type"] == "abort" and "device lost" in req.finish_reason["message"]
        else:
            assert req.output_ids == reference(p, 8, 4)


def test_rows_waiting_for_a_compile_wait_and_the_others_run():
    """A step variant compiling in the background: the rows that need it are left out of the calls, the plain
    ones run; once it is ready, they run too, with the same outputs."""
    key = ("denoise", False, False, True, False, False)  # a call with log probabilities
    sched, runner = make(waiting_keys=[key])
    plain = [request(p, max_new=8, rid=f"plain{i}") for i, p in enumerate(PROMPTS[:3])]
    wants = request(PROMPTS[3], max_new=8, rid="logprobs", return_logprob=True)
    for req in plain + [wants]:
        sched.add(req)
    for _ in range(20):
        for call in sched.schedule():
            assert isinstance(call, PrefillCall) or wants not in call.reqs
            sched.process(call, runner.run(call))
    assert all(r.finished for r in plain) and not wants.finished and wants.output_ids == []
    runner.waiting_keys.clear()
    run(sched)
    assert wants.output_ids == reference(PROMPTS[3], 8, 4)
    assert len(wants.output_token_logprobs) == 8


@pytest.mark.parametrize("loop", [False, True], ids=["fdfo", "sync"])
def test_chaining_decisions(loop):
    """Chaining: a request running alone goes on into its next blocks inside one call (pages reserved for them,
    those not used freed); FDFO chains calls of up to two requests, sync only a request alone; a streamed request
    or one with stop strings never chains; the outputs are the reference's either way."""
    sched, runner = make(chain=2, loop=loop)
    alone = request(PROMPTS[0], max_new=20, rid="alone")
    sched.add(alone)
    run(sched)
    assert alone.output_ids == reference(PROMPTS[0], 20, 4)
    assert sched.stats["chained_blocks"] > 0
    assert max(len(c.rows[0].chain_pages) for c in runner.calls if isinstance(c, DenoiseCall)) == 2

    for n, expect in [(2, not loop), (3, False)]:  # batch size decides
        sched, runner = make(chain=2, loop=loop)
        reqs = [request(p, max_new=12, rid=f"{n}-{i}") for i, p in enumerate(PROMPTS[:n])]
        for req in reqs:
            sched.add(req)
        run(sched)
        assert [r.output_ids for r in reqs] == [reference(p, 12, 4) for p in PROMPTS[:n]]
        first_full = next(c for c in runner.calls if isinstance(c, DenoiseCall) and len(c.reqs) == n)
        assert bool(first_full.chain_pages) == expect, (n, loop)

    sched, runner = make(chain=2, loop=loop)
    streamed = request(PROMPTS[0], max_new=20, rid="streamed")
    streamed.stream = True
    stopping = request(PROMPTS[1], max_new=20, rid="stop-strings", stop=("zz",))
    for req in (streamed, stopping):
        sched.add(req)
        run(sched)
    assert sched.stats["chained_blocks"] == 0
    assert streamed.output_ids == reference(PROMPTS[0], 20, 4)
