"""Page allocator: reserved trash page, refcounts, validate-before-apply frees, deterministic order."""

import numpy as np
import pytest

from dllm_jax.cache.pages import TRASH_PAGE, OutOfPages, PageAllocator, PageError, pad_page_table


def test_trash_page_is_reserved_and_sizes():
    alloc = PageAllocator(5)
    assert TRASH_PAGE == 0
    assert alloc.capacity == 4 and alloc.num_free == 4 and alloc.num_used == 0
    pages = alloc.alloc(4)
    assert pages == [1, 2, 3, 4]  # lowest ids first, never page 0
    assert alloc.num_free == 0 and alloc.num_used == 4
    assert all(alloc.refcount(p) == 1 for p in pages)


@pytest.mark.parametrize("num_pages", [0, 1, -3])
def test_too_few_pages_is_rejected(num_pages):
    with pytest.raises(ValueError):
        PageAllocator(num_pages)


def test_minimal_pool_has_one_page():
    alloc = PageAllocator(2)
    assert alloc.alloc(1) == [1]
    assert not alloc.can_alloc(1)


def test_alloc_zero_and_negative():
    alloc = PageAllocator(3)
    assert alloc.alloc(0) == []
    assert alloc.can_alloc(0) and alloc.can_alloc(2) and not alloc.can_alloc(3)
    with pytest.raises(ValueError):
        alloc.alloc(-1)


def test_alloc_failure_leaves_state_intact():
    alloc = PageAllocator(6)
    held = alloc.alloc(3)
    before = (alloc.num_free, alloc.free_pages(), [alloc.refcount(p) for p in range(1, 6)])
    with pytest.raises(OutOfPages):
        alloc.alloc(3)
    assert (alloc.num_free, alloc.free_pages(), [alloc.refcount(p) for p in range(1, 6)]) == before
    assert alloc.alloc(2) == [4, 5]
    assert held == [1, 2, 3]
    alloc.check_invariants()


def test_out_of_pages_is_a_runtime_error():
    assert issubclass(OutOfPages, RuntimeError) and issubclass(PageError, RuntimeError)


def test_free_returns_pages_and_reuses_lowest_first():
    alloc = PageAllocator(6)
    a = alloc.alloc(5)
    alloc.free([a[3], a[1]])
    assert alloc.num_free == 2
    assert alloc.alloc(2) == [2, 4]
    alloc.check_invariants()


def test_incref_keeps_page_until_last_holder_frees():
    alloc = PageAllocator(4)
    (page,) = alloc.alloc(1)
    alloc.incref([page])
    assert alloc.refcount(page) == 2
    alloc.free([page])
    assert alloc.refcount(page) == 1 and alloc.num_free == 2
    alloc.free([page])
    assert alloc.refcount(page) == 0 and alloc.num_free == 3


def test_repeated_page_in_one_call_counts_twice():
    alloc = PageAllocator(4)
    (page,) = alloc.alloc(1)
    alloc.incref([page, page])
    assert alloc.refcount(page) == 3
    alloc.free([page, page, page])
    assert alloc.refcount(page) == 0
    alloc.check_invariants()


def test_double_free_raises_and_names_the_page():
    alloc = PageAllocator(4)
    pages = alloc.alloc(2)
    alloc.free([pages[0]])
    with pytest.raises(PageError, match=str(pages[0])):
        alloc.free([pages[0]])


def test_bad_free_is_not_partially_applied():
    alloc = PageAllocator(5)
    a, b, c = alloc.alloc(3)
    alloc.free([c])
    # b is valid, c is already free: nothing may happen to b.
    with pytest.raises(PageError, match=str(c)):
        alloc.free([b, c])
    assert alloc.refcount(b) == 1 and alloc.num_free == 2
    # Freeing a page more times than it is held is also refused as a whole.
    with pytest.raises(PageError):
        alloc.free([a, b, b])
    assert alloc.refcount(a) == 1 and alloc.refcount(b) == 1
    alloc.check_invariants()


def test_trash_and_out_of_range_pages_are_misuse():
    alloc = PageAllocator(4)
    alloc.alloc(3)
    with pytest.raises(PageError, match="trash"):
        alloc.free([TRASH_PAGE])
    with pytest.raises(PageError):
        alloc.free([4])
    with pytest.raises(PageError):
        alloc.incref([TRASH_PAGE])
    with pytest.raises(PageError):
        alloc.refcount(-1)
    assert alloc.num_used == 3


def test_incref_of_free_page_raises_without_partial_apply():
    alloc = PageAllocator(4)
    (a,) = alloc.alloc(1)
    with pytest.raises(PageError):
        alloc.incref([a, 3])
    assert alloc.refcount(a) == 1


def test_pad_page_table():
    table = pad_page_table([[3, 1], [], [2, 5, 7]], 4)
    assert table.dtype == np.int32 and table.shape == (3, 4)
    assert table.tolist() == [[3, 1, 0, 0], [0, 0, 0, 0], [2, 5, 7, 0]]
    assert pad_page_table([], 3).shape == (0, 3)
    with pytest.raises(ValueError):
        pad_page_table([[1, 2, 3]], 2)
