"""The block radix index: complete blocks of real tokens -> KV pages, shared across requests.

Every edge is one whole block (a tuple of B token ids) and every non-root node holds the page of
that block. Because page size equals block size, a hit is always a whole number of blocks.

Ownership follows SGLang: the tree owns (holds exactly one allocator reference on each node's
page), requests lock. A request does not incref the pages it matched; it `lock`s the deepest
matched node, which pins that node and all its ancestors against eviction, and `unlock`s it when
it moves on or ends.

Two rules keep synthetic masks out of the cache (the bug SGLang fixed in PR #39590/#39592):
- `match` is bounded by floor(min(real_len, logprob_start_len) / B) * B, so a lookup never
  reaches into the mask padding of the in-flight block or swallows a partial prompt block, even
  if another request cached the same prompt followed by literal mask ids;
- `insert` takes only complete blocks of real tokens, so an in-flight block never enters.
Literal mask ids inside real complete blocks are ordinary tokens here: cacheable and matchable.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Optional, Sequence

from dllm_jax.cache.pages import TRASH_PAGE, PageAllocator, PageError

__all__ = ["Node", "MatchResult", "BlockRadixIndex"]

_node_ids = itertools.count()


class Node:
    """One cached block: its key (the B token ids), its page, and tree links.

    `lock_ref` counts locks on this node or any descendant (SGLang's inc_lock_ref model), so a
    node is evictable exactly when its lock_ref is 0 and it has no children.
    """

    __slots__ = ("key", "page", "parent", "children", "lock_ref", "last_access", "node_id", "attached")

    def __init__(self, key: Optional[tuple], page: int, parent: Optional["Node"]):
        self.key = key
        self.page = page
        self.parent = parent
        self.children: dict[tuple, Node] = {}
        self.lock_ref = 0
        self.last_access = 0
        self.node_id = next(_node_ids)  # tie-break for LRU, so eviction order is deterministic
        self.attached = True  # False once evicted or flushed: locking it then is a bug

    @property
    def is_root(self) -> bool:
        return self.key is None

    def depth(self) -> int:
        """Number of blocks from the root to this node (O(depth); for tests and debugging)."""
        n, node = 0, self
        while node.parent is not None:
            n, node = n + 1, node.parent
        return n

    def __repr__(self) -> str:
        if self.is_root:
            return "Node(root)"
        return f"Node(page={self.page}, lock_ref={self.lock_ref}, children={len(self.children)})"


@dataclass
class MatchResult:
    """A prefix hit: the tree's pages for the matched blocks, their length in tokens, and the
    deepest matched node (root when nothing matched) -- the node to `lock`."""

    pages: list[int] = field(default_factory=list)
    matched_len: int = 0
    node: Optional[Node] = None


class BlockRadixIndex:
    """Radix tree over whole blocks with LRU eviction of unlocked leaves.

    Sizes are in pages and kept as counters (O(1)); `check_invariants` recomputes them.
    With `enabled=False` it is a no-op cache: nothing matches and nothing is taken.
    """

    def __init__(self, block_size: int, allocator: PageAllocator, enabled: bool = True):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = int(block_size)
        self.allocator = allocator
        self.enabled = bool(enabled)
        self.root = Node(None, TRASH_PAGE, None)
        self._clock = 0  # LRU timestamp: a counter, so eviction order is reproducible
        self._evictable = 0  # pages of nodes with lock_ref == 0
        self._protected = 0  # pages of nodes with lock_ref > 0
        self._node_by_page: dict[int, Node] = {}  # every page the tree holds, to catch double ownership
        self._leaves: set[Node] = set()  # non-root nodes without children (eviction candidates)

    # -- sizes -------------------------------------------------------------------------------
    @property
    def evictable(self) -> int:
        return self._evictable

    @property
    def protected(self) -> int:
        return self._protected

    @property
    def total(self) -> int:
        return self._evictable + self._protected

    @property
    def num_nodes(self) -> int:
        """Non-root nodes (one per cached block)."""
        return len(self._node_by_page)

    def holds(self, page: int) -> bool:
        """Whether the tree holds a reference on `page`."""
        return page in self._node_by_page

    def pages(self) -> set[int]:
        """All pages the tree holds (a copy)."""
        return set(self._node_by_page)

    # -- lookup ------------------------------------------------------------------------------
    def match_bound(self, real_len: int, logprob_start_len: Optional[int] = None) -> int:
        """Longest prefix (tokens) a lookup may match: floor(min(real_len, logprob_start_len) / B) * B.

        real_len counts real tokens only (prompt + committed outputs), never the mask padding of
        the in-flight block; a negative or None logprob_start_len means "no logprobs".
        """
        bound = real_len
        if logprob_start_len is not None and logprob_start_len >= 0:
            bound = min(bound, logprob_start_len)
        if bound <= 0:
            return 0
        return bound // self.block_size * self.block_size

    def match(self, token_ids: Sequence[int], real_len: int, logprob_start_len: Optional[int] = None) -> MatchResult:
        """Longest cached prefix of whole blocks within `match_bound`; touches matched nodes (LRU).

        The caller should `lock(result.node)` before anything can evict (same scheduler step).
        """
        if not self.enabled:
            return MatchResult([], 0, self.root)
        if hasattr(token_ids, "tolist"):  # numpy / jax arrays: hash plain ints, not array scalars
            token_ids = token_ids.tolist()
        bound = min(self.match_bound(real_len, logprob_start_len), len(token_ids))
        block = self.block_size
        self._clock += 1
        now = self._clock
        node = self.root
        pages: list[int] = []
        for start in range(0, bound - block + 1, block):
            child = node.children.get(tuple(token_ids[start : start + block]))
            if child is None:
                break
            child.last_access = now
            pages.append(child.page)
            node = child
        return MatchResult(pages, len(pages) * block, node)

    # -- insertion ---------------------------------------------------------------------------
    def insert(self, real_token_ids: Sequence[int], pages: Sequence[int]) -> list[int]:
        """Cache the complete blocks of `real_token_ids`; return the tree's page for each.

        Only len // B complete blocks enter (a trailing partial block is ignored). `pages[i]` is
        the caller's page for block i. Per block: new to the tree -> the tree takes over the
        caller's reference; already cached with the same page -> nothing changes; cached with a
        different page -> the caller's page is freed and the tree's page is returned in its place.
        After the call the caller owns none of the pages of these blocks.
        Disabled: returns `pages` unchanged (as a new list) and takes nothing.
        """
        return self.insert_and_match(real_token_ids, pages).pages if self.enabled else list(pages)

    def insert_and_match(self, real_token_ids: Sequence[int], pages: Sequence[int]) -> MatchResult:
        """`insert`, also returning the deepest node of the inserted path (the node a request
        moves its lock to after committing blocks) and the inserted length in tokens.

        Disabled: MatchResult(list(pages), 0, root) and nothing is taken.
        """
        if not self.enabled:
            return MatchResult(list(pages), 0, self.root)
        if hasattr(real_token_ids, "tolist"):
            real_token_ids = real_token_ids.tolist()
        if hasattr(pages, "tolist"):
            pages = pages.tolist()
        block = self.block_size
        num_blocks = len(real_token_ids) // block
        if len(pages) < num_blocks:
            raise ValueError(f"{num_blocks} complete blocks but only {len(pages)} pages")
        keys = [tuple(real_token_ids[i * block : (i + 1) * block]) for i in range(num_blocks)]

        # Pass 1 (no mutation): walk the cached part and validate every page we will take or free,
        # so a bad call raises before anything changes.
        node = self.root
        path: list[Node] = []
        for key in keys:
            child = node.children.get(key)
            if child is None:
                break
            path.append(child)
            node = child
        num_cached = len(path)
        duplicates: list[int] = []
        for i in range(num_cached):
            page = pages[i]
            if page != path[i].page:
                self._check_caller_page(page, i)
                duplicates.append(page)
        for i in range(num_cached, num_blocks):
            self._check_caller_page(pages[i], i)
        taken_or_freed = duplicates + list(pages[num_cached:num_blocks])
        if len(set(taken_or_freed)) != len(taken_or_freed):
            raise PageError("insert: the same caller page is given for two blocks")

        # Pass 2: apply.
        self._clock += 1
        now = self._clock
        canonical = [n.page for n in path]
        for n in path:
            n.last_access = now
        for i in range(num_cached, num_blocks):
            child = Node(keys[i], pages[i], node)
            child.last_access = now
            node.children[keys[i]] = child
            self._leaves.discard(node)  # root is never in the set; discard is a no-op then
            self._leaves.add(child)
            self._node_by_page[child.page] = child
            # A new node is unlocked (lock_ref counts locks at or below it), even under a locked parent.
            self._evictable += 1
            canonical.append(child.page)
            node = child
        if duplicates:
            self.allocator.free(duplicates)
        return MatchResult(canonical, num_blocks * block, node)

    def _check_caller_page(self, page: int, block_index: int) -> None:
        """A page the tree is about to take over or free must be held by the caller, not by the tree."""
        if page in self._node_by_page:
            raise PageError(f"insert: page {page} (block {block_index}) is already held by the tree for another block")
        if self.allocator.refcount(page) < 1:  # also rejects the trash page / out of range
            raise PageError(f"insert: page {page} (block {block_index}) is not held by anyone")

    # -- locks -------------------------------------------------------------------------------
    def lock(self, node: Node) -> None:
        """Pin `node` and its ancestors against eviction (one lock; pair with `unlock`)."""
        if node.is_root:
            return
        if not node.attached:
            raise PageError(f"lock of {node}, which was evicted or flushed")
        while node.parent is not None:
            if node.lock_ref == 0:
                self._evictable -= 1
                self._protected += 1
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        """Release one lock taken by `lock(node)`; raises PageError if that would go below zero."""
        if node.is_root:
            return
        if node.lock_ref <= 0 or not node.attached:
            raise PageError(f"unlock of {node}, which is not locked")
        # Ancestors' lock_ref >= node.lock_ref (it counts locks below), so checking node suffices.
        while node.parent is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected -= 1
                self._evictable += 1
            node = node.parent

    # -- eviction ----------------------------------------------------------------------------
    def evict(self, num_pages: int) -> int:
        """Free up to num_pages pages, least recently used unlocked leaves first; return the count.

        Removing a leaf can turn its parent into an unlocked leaf, which then competes by its own
        timestamp. O(leaves + evicted * log leaves).
        """
        if num_pages <= 0 or not self._leaves:
            return 0
        heap = [(n.last_access, n.node_id, n) for n in self._leaves if n.lock_ref == 0]
        heapq.heapify(heap)
        freed: list[int] = []
        while heap and len(freed) < num_pages:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            self._detach(node)
            freed.append(node.page)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
        self.allocator.free(freed)
        return len(freed)

    def _detach(self, node: Node) -> None:
        """Unlink an unlocked leaf (its page is freed by the caller)."""
        parent = node.parent
        del parent.children[node.key]
        self._leaves.discard(node)
        if parent is not self.root and not parent.children:
            self._leaves.add(parent)
        del self._node_by_page[node.page]
        self._evictable -= 1
        node.attached = False
        node.parent = None

    def reset(self) -> None:
        """Flush everything; refused (PageError) while any node is locked (requests are running)."""
        if self._protected:
            raise PageError(f"cannot flush the prefix cache: {self._protected} pages are locked by running requests")
        pages = list(self._node_by_page)
        for node in self._node_by_page.values():
            node.attached = False
            node.parent = None
            node.children = {}
        self.root.children = {}
        self._node_by_page.clear()
        self._leaves.clear()
        self._evictable = 0
        self.allocator.free(pages)

    # -- checks ------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Recompute sizes, links, leaves and lock counts from scratch and compare (tests; O(nodes))."""

        def fail(msg: str) -> None:
            raise AssertionError(f"BlockRadixIndex invariant: {msg}")

        evictable = protected = 0
        seen_pages: dict[int, Node] = {}
        leaves: set[Node] = set()
        stack = [self.root]
        if self.root.lock_ref != 0 or self.root.parent is not None:
            fail("root has a lock or a parent")
        while stack:
            node = stack.pop()
            child_locks = 0
            for key, child in node.children.items():
                if child.parent is not node or child.key != key or not child.attached:
                    fail(f"bad link to {child}")
                if len(key) != self.block_size:
                    fail(f"key of length {len(key)} != block size {self.block_size}")
                if child.lock_ref < 0:
                    fail(f"negative lock count on {child}")
                if child.page in seen_pages:
                    fail(f"page {child.page} held by two nodes")
                seen_pages[child.page] = child
                if self.allocator.refcount(child.page) < 1:
                    fail(f"page {child.page} is in the tree but free in the allocator")
                if child.lock_ref:
                    protected += 1
                else:
                    evictable += 1
                if not child.children:
                    leaves.add(child)
                child_locks += child.lock_ref
                stack.append(child)
            if not node.is_root and node.lock_ref < child_locks:
                fail(f"{node} has fewer locks than its children together")
        if (evictable, protected) != (self._evictable, self._protected):
            fail(f"counters (evictable={self._evictable}, protected={self._protected}) != "
                 f"recomputed ({evictable}, {protected})")
        if seen_pages != self._node_by_page:
            fail("page map disagrees with the tree")
        if leaves != self._leaves:
            fail("leaf set disagrees with the tree")

    def __repr__(self) -> str:
        return (f"BlockRadixIndex(B={self.block_size}, enabled={self.enabled}, nodes={self.num_nodes}, "
                f"evictable={self._evictable}, protected={self._protected})")
