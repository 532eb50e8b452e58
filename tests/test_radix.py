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
