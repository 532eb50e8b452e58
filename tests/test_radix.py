"""Block radix index: match bound (no synthetic masks), ownership transfer, locks, LRU eviction."""

import numpy as np
import pytest

from dllm_jax.cache.pages import PageAllocator, PageError
from dllm_jax.cache.radix import BlockRadixIndex

M = 99  # literal mask id in token streams (B = 4 tests)


def make(block_size=4, num_pages=64, enabled=True):
    alloc = PageAllocator(num_pages)
    return alloc, BlockRadixIndex(block_size, alloc, enabled=enabled)


def cache(tree, alloc, tokens):
    """Cache the complete blocks of `tokens` with freshly allocated pages; return the tree's pages."""
    pages = alloc.alloc(len(tokens) // tree.block_size)
    return tree.insert(tokens, pages)


# -- match bound --------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt_len,expected", [(31, 0), (32, 32), (33, 32), (63, 32), (64, 64), (65, 64), (129, 128)])
def test_hit_table_block_32(prompt_len, expected):
    alloc, tree = make(block_size=32, num_pages=16)
    prompt = [(7 * i + 3) % 1000 for i in range(prompt_len)]
    cache(tree, alloc, prompt)
    hit = tree.match(prompt, len(prompt))
    assert hit.matched_len == expected
    assert len(hit.pages) == expected // 32
    tree.check_invariants()


def test_hit_table_when_longer_padded_sequence_is_cached():
    # The same table holds when the cache has far more than the prompt (here 5 full blocks).
    alloc, tree = make(block_size=32, num_pages=16)
    long_prompt = list(range(1000, 1000 + 160))
    cache(tree, alloc, long_prompt)
    for prompt_len, expected in [(31, 0), (32, 32), (33, 32), (63, 32), (64, 64), (65, 64), (129, 128)]:
        prompt = long_prompt[:prompt_len]
        # Even if token_ids carries mask padding up to the next block, real_len bounds the match.
        fill = prompt + [M] * (-prompt_len % 32)
        assert tree.match(fill, prompt_len).matched_len == expected


def test_collision_b32_prompt_then_literal_masks():
    alloc, tree = make(block_size=32, num_pages=16)
    prompt = list(range(1, 34))  # 33 tokens
    cache(tree, alloc, prompt + [M] * 31)  # someone's real 64-token prompt ending in literal masks
    assert tree.num_nodes == 2
    fill = prompt + [M] * 31  # the new request's fill: prompt + synthetic masks
    assert tree.match(fill, len(prompt)).matched_len == 32
    assert tree.match(prompt, len(prompt)).matched_len == 32
    # The 64-token real prompt itself matches fully.
    assert tree.match(fill, 64).matched_len == 64


def test_collision_b4():
    alloc, tree = make()
    cached = cache(tree, alloc, [1, 2, 3, 4, 5, M, M, M])
    hit = tree.match([1, 2, 3, 4, 5], 5)
    assert hit.matched_len == 4 and hit.pages == cached[:1]
    assert tree.match([1, 2, 3, 4, 5, M, M, M], 5).matched_len == 4


def test_blocks_with_literal_masks_are_cacheable():
    alloc, tree = make()
    tokens = [1, M, 2, M, 3, M, 4, M]
    pages = cache(tree, alloc, tokens)
    hit = tree.match(tokens, 8)
    assert hit.matched_len == 8 and hit.pages == pages
    assert tree.match([M, M, M, M], 4).matched_len == 0
    cache(tree, alloc, [M, M, M, M])
    assert tree.match([M, M, M, M, 1], 5).matched_len == 4


@pytest.mark.parametrize("start", [-1, 0, 3, 4, 5, 8, None])
@pytest.mark.parametrize("real_len", [1, 3, 4, 5, 7, 8, 9, 12])
def test_logprob_start_len_bounds_the_match(real_len, start):
    alloc, tree = make()
    tokens = list(range(1, 13))
    cache(tree, alloc, tokens)
    bound = real_len if start is None or start < 0 else min(real_len, start)
    expected = bound // 4 * 4
    assert tree.match_bound(real_len, start) == expected
    assert tree.match(tokens + [M] * 4, real_len, start).matched_len == expected


def test_match_accepts_numpy_tokens_and_stops_at_first_miss():
    alloc, tree = make()
    pages = cache(tree, alloc, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
    hit = tree.match(np.array([1, 2, 3, 4, 5, 6, 7, 0, 9, 10, 11, 12]), 12)
    assert hit.matched_len == 4 and hit.pages == pages[:1]
    assert tree.match([], 0).matched_len == 0
    assert tree.match([2, 2, 3, 4], 4).node is tree.root


def test_real_len_beyond_token_ids_is_capped():
    alloc, tree = make()
    cache(tree, alloc, [1, 2, 3, 4, 5, 6, 7, 8])
    assert tree.match([1, 2, 3, 4, 5, 6], 100).matched_len == 4


# -- insert / ownership -------------------------------------------------------------------------


def test_insert_takes_over_new_pages():
    alloc, tree = make()
    pages = alloc.alloc(3)
    canonical = tree.insert([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], pages)  # 2 complete blocks + a partial
    assert canonical == pages[:2]
    assert tree.total == tree.evictable == 2 and tree.protected == 0
    assert [alloc.refcount(p) for p in pages] == [1, 1, 1]  # tree took over; nothing incref'd
    assert tree.holds(pages[0]) and tree.holds(pages[1]) and not tree.holds(pages[2])
    tree.check_invariants()


def test_partial_block_is_never_inserted():
    alloc, tree = make()
    (page,) = alloc.alloc(1)
    assert tree.insert([1, 2, 3], [page]) == []
    assert tree.total == 0 and alloc.refcount(page) == 1
    assert tree.insert([1, 2, 3], []) == []


def test_insert_same_page_is_a_no_op():
    alloc, tree = make()
    pages = cache(tree, alloc, [1, 2, 3, 4, 5, 6, 7, 8])
    free_before = alloc.num_free
    assert tree.insert([1, 2, 3, 4, 5, 6, 7, 8], pages) == pages
    assert alloc.num_free == free_before and tree.total == 2
    assert all(alloc.refcount(p) == 1 for p in pages)


def test_duplicate_insert_frees_the_duplicate_page():
    alloc, tree = make()
    first = cache(tree, alloc, [1, 2, 3, 4, 5, 6, 7, 8])
    mine = alloc.alloc(3)  # another request computed the same two blocks plus a third
    free_before = alloc.num_free
    canonical = tree.insert([1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9], mine)
    assert canonical == first + [mine[2]]
    assert alloc.refcount(mine[0]) == 0 and alloc.refcount(mine[1]) == 0  # duplicates freed
    assert alloc.num_free == free_before + 2
    assert tree.total == 3
    tree.check_invariants()
    alloc.check_invariants()


def test_insert_extra_pages_are_ignored():
    alloc, tree = make()
    pages = alloc.alloc(3)
    assert tree.insert([1, 2, 3, 4], pages) == pages[:1]
    assert alloc.refcount(pages[2]) == 1 and not tree.holds(pages[2])


def test_insert_misuse_raises_before_any_change():
    alloc, tree = make()
    held = cache(tree, alloc, [1, 2, 3, 4])
    mine = alloc.alloc(1)
    with pytest.raises(ValueError):
        tree.insert([1, 2, 3, 4, 5, 6, 7, 8], mine)  # two blocks, one page
    with pytest.raises(PageError):  # page 50 is free: the caller does not own it
        tree.insert([1, 2, 3, 4, 5, 6, 7, 8], held + [50])
    with pytest.raises(PageError):  # the tree's own page offered for another block
        tree.insert([9, 9, 9, 9], held)
    with pytest.raises(PageError):  # one page for two new blocks
        tree.insert([5, 5, 5, 5, 6, 6, 6, 6], mine + mine)
    assert tree.total == 1 and alloc.refcount(mine[0]) == 1
    tree.check_invariants()


def test_insert_and_match_returns_the_deepest_node():
    alloc, tree = make()
    pages = alloc.alloc(2)
    result = tree.insert_and_match([1, 2, 3, 4, 5, 6, 7, 8, 9], pages)
    assert result.pages == pages and result.matched_len == 8
    assert result.node is tree.match([1, 2, 3, 4, 5, 6, 7, 8], 8).node


# -- locks --------------------------------------------------------------------------------------


def test_lock_protects_node_and_ancestors():
    alloc, tree = make()
    cache(tree, alloc, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
    cache(tree, alloc, [1, 2, 3, 4, 0, 0, 0, 0])
    hit = tree.match([1, 2, 3, 4, 5, 6, 7, 8], 8)
    tree.lock(hit.node)
    assert tree.protected == 2 and tree.evictable == 2 and tree.total == 4
    tree.lock(hit.node)
    assert tree.protected == 2
    tree.unlock(hit.node)
    assert tree.protected == 2
    tree.unlock(hit.node)
    assert tree.protected == 0 and tree.evictable == 4
    tree.check_invariants()


def test_negative_unlock_raises():
    alloc, tree = make()
    cache(tree, alloc, [1, 2, 3, 4])
    node = tree.match([1, 2, 3, 4], 4).node
    with pytest.raises(PageError):
        tree.unlock(node)
    tree.lock(node)
    tree.unlock(node)
    with pytest.raises(PageError):
        tree.unlock(node)
    tree.check_invariants()


def test_lock_root_is_a_no_op():
    alloc, tree = make()
    tree.lock(tree.root)
    tree.unlock(tree.root)
    tree.unlock(tree.root)
    assert tree.protected == 0


def test_new_child_of_locked_node_is_evictable():
    alloc, tree = make()
    cache(tree, alloc, [1, 2, 3, 4])
    node = tree.match([1, 2, 3, 4], 4).node
    tree.lock(node)
    cache(tree, alloc, [1, 2, 3, 4, 5, 6, 7, 8])
    assert tree.protected == 1 and tree.evictable == 1
    assert tree.evict(10) == 1  # the child goes; the locked parent stays
    assert tree.total == 1
    tree.check_invariants()


def test_lock_of_evicted_node_raises():
    alloc, tree = make()
    cache(tree, alloc, [1, 2, 3, 4])
    node = tree.match([1, 2, 3, 4], 4).node
    tree.evict(1)
    with pytest.raises(PageError):
        tree.lock(node)


# -- eviction / reset ---------------------------------------------------------------------------


def test_eviction_is_lru_over_unlocked_leaves():
    alloc, tree = make()
    a = cache(tree, alloc, [1, 1, 1, 1, 2, 2, 2, 2])  # chain a0 -> a1
    b = cache(tree, alloc, [3, 3, 3, 3])
    c = cache(tree, alloc, [4, 4, 4, 4])
    tree.match([1, 1, 1, 1, 2, 2, 2, 2], 8)  # a most recently used
    tree.match([3, 3, 3, 3], 4)  # then b: LRU order is now c, a, b
    free_before = alloc.num_free
    assert tree.evict(1) == 1
    assert alloc.refcount(c[0]) == 0
    # Next LRU leaf is a1 (a0 is not a leaf until a1 goes); a0 then has a's timestamp, older than b.
    assert tree.evict(2) == 2
    assert alloc.refcount(a[1]) == 0 and alloc.refcount(a[0]) == 0 and alloc.refcount(b[0]) == 1
    assert alloc.num_free == free_before + 3
    tree.check_invariants()


def test_insert_refreshes_lru():
    alloc, tree = make()
    a = cache(tree, alloc, [1, 1, 1, 1])
    b = cache(tree, alloc, [2, 2, 2, 2])
    assert tree.insert([1, 1, 1, 1], a) == a  # re-insert (a request finishing) counts as a use
    assert tree.evict(1) == 1
    assert alloc.refcount(b[0]) == 0 and alloc.refcount(a[0]) == 1


def test_eviction_skips_locked_paths_and_reports_count():
    alloc, tree = make()
    cache(tree, alloc, [1, 1, 1, 1, 2, 2, 2, 2])
    other = cache(tree, alloc, [5, 5, 5, 5])
    node = tree.match([1, 1, 1, 1, 2, 2, 2, 2], 8).node
    tree.lock(node)
    assert tree.evict(10) == 1
    assert alloc.refcount(other[0]) == 0
    assert tree.total == tree.protected == 2
    assert tree.evict(10) == 0
    tree.unlock(node)
    assert tree.evict(0) == 0
    assert tree.evict(10) == 2 and tree.total == 0
    tree.check_invariants()
    alloc.check_invariants()


def test_parent_becomes_evictable_only_after_children_go():
    alloc, tree = make()
    root_block = cache(tree, alloc, [1, 1, 1, 1, 2, 2, 2, 2])[0]
    cache(tree, alloc, [1, 1, 1, 1, 3, 3, 3, 3])
    tree.match([1, 1, 1, 1], 4)  # parent most recent, but it is not a leaf
    assert tree.evict(1) == 1
    assert alloc.refcount(root_block) == 1
    assert tree.evict(1) == 1  # the other child
    assert tree.evict(1) == 1 and alloc.refcount(root_block) == 0


def test_reset_refuses_with_locks_then_flushes():
    alloc, tree = make()
    pages = cache(tree, alloc, [1, 2, 3, 4, 5, 6, 7, 8])
    node = tree.match([1, 2, 3, 4, 5, 6, 7, 8], 8).node
    tree.lock(node)
    with pytest.raises(PageError):
        tree.reset()
    assert tree.total == 2 and all(alloc.refcount(p) == 1 for p in pages)
    tree.unlock(node)
    tree.reset()
    assert tree.total == 0 and tree.num_nodes == 0 and alloc.num_used == 0
    assert tree.match([1, 2, 3, 4], 4).matched_len == 0
    with pytest.raises(PageError):
        tree.lock(node)
    tree.check_invariants()
    alloc.check_invariants()


# -- disabled -----------------------------------------------------------------------------------


def test_disabled_cache_matches_nothing_and_takes_nothing():
    alloc, tree = make(enabled=False)
    pages = alloc.alloc(3)
    assert tree.insert([1, 2, 3, 4, 5, 6, 7, 8], pages) == pages
    assert all(alloc.refcount(p) == 1 for p in pages)
    hit = tree.match([1, 2, 3, 4, 5, 6, 7, 8], 8)
    assert (hit.pages, hit.matched_len, hit.node) == ([], 0, tree.root)
    tree.lock(hit.node)
    tree.unlock(hit.node)
    assert tree.total == 0 and tree.evict(5) == 0
    tree.reset()
    assert alloc.num_used == 3


# -- random interleavings: the scheduler's use of allocator + tree ------------------------------

from hypothesis import settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule  # noqa: E402

from dllm_jax.cache.pages import OutOfPages  # noqa: E402

SM_BLOCK = 4
SM_PAGES = 12  # 11 allocatable: small enough that admission and commits hit memory pressure
token = st.sampled_from([1, 2, M])  # tiny alphabet with literal masks
# Shared prompt prefixes and output blocks, so that requests hit, race on and duplicate blocks often.
SHARED_PREFIXES = [[1, 2, M, 1, 2, 2, M, M, 1, 1, 1, 1], [1, 2, M, 1, M, M, M, M, 2, 1, 2, 1], [M] * 4 + [1] * 4 + [2] * 4]
SHARED_BLOCKS = [[2, 2, 2, 2], [M, 1, M, 1], [M, M, M, M]]
prompts = st.builds(
    lambda prefix, cut, tail: (prefix[:cut] + tail)[:14],
    st.sampled_from(SHARED_PREFIXES),
    st.integers(0, 12),
    st.lists(token, max_size=6),
)


def output_tokens(count):
    """`count` committed output tokens: often a shared block's head, sometimes random."""
    return st.one_of(st.sampled_from(SHARED_BLOCKS).map(lambda b: b[:count]),
                     st.lists(token, min_size=count, max_size=count))


class _Req:
    """What the scheduler keeps per running request.

    tokens: real tokens (prompt + committed outputs); table: page per block (complete blocks, then
    the in-flight block if any); owned: pages the request holds a reference on (always table[depth:]);
    node: the tree node the request has locked (depth = its number of blocks).
    """

    def __init__(self, tokens, table, owned, node, depth):
        self.tokens, self.table, self.owned, self.node, self.depth = tokens, table, owned, node, depth
        self.inflight = True


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.alloc = PageAllocator(SM_PAGES)
        self.tree = BlockRadixIndex(SM_BLOCK, self.alloc)
        self.reqs: dict[int, _Req] = {}
        self.next_rid = 0

    # helpers ---------------------------------------------------------------------------------
    def _alloc_with_evict(self, n):
        """What the scheduler does under pressure: evict cache, then retry; None if still short."""
        try:
            return self.alloc.alloc(n)
        except OutOfPages:
            self.tree.evict(n - self.alloc.num_free)
            if not self.alloc.can_alloc(n):
                return None
            return self.alloc.alloc(n)

    def _pick(self, index):
        return sorted(self.reqs)[index % len(self.reqs)]

    def _cache_committed(self, req, use_insert_and_match):
        """Insert the complete real blocks; the tree now owns them; move the lock to the new node."""
        n = len(req.tokens) // SM_BLOCK
        if use_insert_and_match:
            result = self.tree.insert_and_match(req.tokens, req.table[:n])
            canonical, new_node = result.pages, result.node
        else:
            canonical = self.tree.insert(req.tokens, req.table[:n])
            hit = self.tree.match(req.tokens, len(req.tokens))
            assert hit.pages == canonical and hit.matched_len == n * SM_BLOCK
            new_node = hit.node
        assert len(canonical) == n and all(self.tree.holds(p) for p in canonical)
        assert canonical[: req.depth] == req.table[: req.depth]  # locked prefix cannot change
        given = set(req.table[:n])
        req.owned = [p for p in req.owned if p not in given]
        req.table[:n] = canonical
        self.tree.lock(new_node)
        self.tree.unlock(req.node)
        req.node, req.depth = new_node, n

    # rules -----------------------------------------------------------------------------------
    @rule(
        prompt=prompts,
        logprob_start=st.one_of(st.none(), st.integers(-1, 14)),
    )
    def admit(self, prompt, logprob_start):
        fill = prompt + [M] * (SM_BLOCK - len(prompt) % SM_BLOCK)  # prompt + synthetic masks
        hit = self.tree.match(fill, len(prompt), logprob_start)
        assert hit.matched_len % SM_BLOCK == 0
        assert hit.matched_len <= self.tree.match_bound(len(prompt), logprob_start) <= len(prompt)
        self.tree.lock(hit.node)
        need = len(prompt) // SM_BLOCK + 1 - len(hit.pages)  # unmatched prompt blocks + in-flight block
        own = self._alloc_with_evict(need)
        if own is None:
            self.tree.unlock(hit.node)  # refused: wait for a later round
            return
        self.reqs[self.next_rid] = _Req(list(prompt), hit.pages + own, list(own), hit.node, len(hit.pages))
        self.next_rid += 1

    @precondition(lambda self: any(r.inflight for r in self.reqs.values()))
    @rule(index=st.integers(0, 99), data=st.data(), use_insert_and_match=st.booleans())
    def commit_block(self, index, data, use_insert_and_match):
        decoding = sorted(rid for rid, req in self.reqs.items() if req.inflight)
        req = self.reqs[decoding[index % len(decoding)]]
        req.tokens += data.draw(output_tokens(SM_BLOCK - len(req.tokens) % SM_BLOCK))
        self._cache_committed(req, use_insert_and_match)
        assert req.owned == []
        nxt = self._alloc_with_evict(1)
        if nxt is None:
            req.inflight = False  # no page for the next block: the request can only finish or abort
        else:
            req.table += nxt
            req.owned += nxt

    @precondition(lambda self: self.reqs)
    @rule(index=st.integers(0, 99), tail=st.lists(token, max_size=SM_BLOCK - 1))
    def finish(self, index, tail):
        req = self.reqs.pop(self._pick(index))
        if req.inflight:
            req.tokens += tail[: SM_BLOCK - 1 - len(req.tokens) % SM_BLOCK]  # stop inside the last block
        n = len(req.tokens) // SM_BLOCK
        canonical = self.tree.insert(req.tokens, req.table[:n])  # a partial tail never enters
        given = set(req.table[:n])
        assert all(self.tree.holds(p) for p in canonical)
        self.tree.unlock(req.node)
        self.alloc.free([p for p in req.owned if p not in given])

    @precondition(lambda self: self.reqs)
    @rule(index=st.integers(0, 99))
    def abort(self, index):
        req = self.reqs.pop(self._pick(index))
        self.tree.unlock(req.node)
        self.alloc.free(req.owned)

    @rule(num_pages=st.integers(0, SM_PAGES))
    def evict(self, num_pages):
        evictable, free = self.tree.evictable, self.alloc.num_free
        freed = self.tree.evict(num_pages)
        assert freed == min(num_pages, evictable)  # every unlocked node is reachable by leaf eviction
        assert self.alloc.num_free == free + freed

    @rule()
    def flush(self):
        if self.tree.protected:
            with pytest.raises(PageError):
                self.tree.reset()
        else:
            self.tree.reset()
            assert self.tree.total == 0

    # invariants ------------------------------------------------------------------------------
    @invariant()
    def pages_have_exactly_their_holders(self):
        self.alloc.check_invariants()
        self.tree.check_invariants()
        holders = [0] * SM_PAGES
        tree_pages = self.tree.pages()
        for page in tree_pages:
            holders[page] += 1
        for req in self.reqs.values():
            assert req.owned == req.table[req.depth :]
            assert not tree_pages.intersection(req.owned)
            for page in req.owned:
                holders[page] += 1
        for page in range(1, SM_PAGES):
            assert self.alloc.refcount(page) == holders[page], page
        assert self.alloc.num_free == sum(1 for h in holders[1:] if h == 0)
        assert self.tree.evictable + self.tree.protected == self.tree.total == len(tree_pages)

    @invariant()
    def locked_paths_match_requests(self):
        locked = set()
        for req in self.reqs.values():
            node, depth = req.node, req.depth
            assert node.is_root or (node.attached and node.lock_ref >= 1)
            while not node.is_root:  # the locked path is exactly the request's cached prefix
                depth -= 1
                assert node.page == req.table[depth]
                assert list(node.key) == req.tokens[depth * SM_BLOCK : (depth + 1) * SM_BLOCK]
                locked.add(node)
                node = node.parent
            assert depth == 0
        assert self.tree.protected == len(locked)
        assert all(n.lock_ref >= 1 for n in locked)

    def teardown(self):
        # End every request (alternately finish and abort); then no locks remain and every page is
        # free or in the tree; a flush then returns everything.
        for i, rid in enumerate(sorted(self.reqs)):
            if i % 2:
                self.finish(0, [])
            else:
                self.abort(0)
        assert self.tree.protected == 0 and self.tree.evictable == self.tree.total
        assert self.alloc.num_used == self.tree.total
        self.tree.check_invariants()
        self.tree.reset()
        assert self.alloc.num_used == 0
        self.alloc.check_invariants()


SchedulerMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)
test_scheduler_machine = SchedulerMachine.TestCase
