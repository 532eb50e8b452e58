"""Prefix reuse for models with sliding-window layers (DiffusionGemma): a trie of complete pages of real tokens,
each node holding the page of the full-attention layers and, while kept, the page of the sliding-window layers.

Why two pages per node: the full layers of a continuation read every earlier position, the sliding layers only
the last ``window - 1``. So a prefix of ``L`` tokens is reusable when the full pages of all of it are cached and the
sliding pages of its last ``window - 1`` positions are (:meth:`WindowPrefixIndex.match` backs off to the longest
such prefix). Sliding pages are the scarce ones (their pool holds little more than the running requests' windows),
so they are evicted on their own (the node stays, its full page still serving longer matches' bodies), before
whole nodes are.

The encoder is causal: a prefix's K/V depends on the prefix alone, so a reused page holds exactly what
re-encoding would write. Ownership is reference counting on the two allocators: the index holds one reference on
each page it keeps; a request that reuses a page takes its own; evicting a node drops the index's reference only
(a request still using the page keeps it alive).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Iterator

from dllm_jax.cache.pages import PageAllocator


@dataclasses.dataclass(eq=False)
class _Node:
    key: tuple
    parent: "_Node | None"
    full: int | None = None
    sliding: int | None = None
    children: dict = dataclasses.field(default_factory=dict)
    last_use: int = 0


class WindowPrefixIndex:
    def __init__(self, page_size: int, window: int | None, full: PageAllocator, sliding: PageAllocator, *,
                 enabled: bool = True):
        self.S, self.window, self.full, self.sliding = page_size, window, full, sliding
        self.enabled = enabled
        self.root = _Node((), None)
        self._clock = itertools.count(1)
        self.total = 0  # nodes (get_load reads it every /metrics scrape: kept, not counted)

    # -- queries ---------------------------------------------------------------------------------
    def _walk(self, tokens: list[int]) -> list[_Node]:
        node, path = self.root, []
        for i in range(len(tokens) // self.S):
            node = node.children.get(tuple(tokens[i * self.S:(i + 1) * self.S]))
            if node is None:
                break
            path.append(node)
        return path

    def match(self, tokens: list[int]) -> tuple[list[int], list[int]]:
        """(full pages, sliding pages) of the longest reusable prefix of ``tokens`` (page-aligned, the sliding
        pages of its window present; positions before the window: ``TRASH`` 0 in the sliding list). The caller
        takes its own reference on every non-zero page it uses (:meth:`take`)."""
        if not self.enabled:
            return [], []
        path = self._walk(tokens)
        need = 0 if self.window is None else -(-(self.window - 1) // self.S)
        depth = len(path)
        while depth > 0 and any(n.sliding is None for n in path[max(0, depth - need):depth]):
            depth -= 1
        stamp = next(self._clock)
        for n in path[:depth]:
            n.last_use = stamp
        first_sliding = max(0, depth - need)
        return ([n.full for n in path[:depth]],
                [n.sliding if i >= first_sliding else 0 for i, n in enumerate(path[:depth])])

    def take(self, full: list[int], sliding: list[int]) -> None:
        self.full.incref(full)
        self.sliding.incref([p for p in sliding if p])

    # -- insertion -------------------------------------------------------------------------------
    def insert(self, tokens: list[int], full: list[int], sliding: list[int]) -> None:
        """Keep the complete pages of ``tokens`` (``full[i]`` / ``sliding[i]``: page ``i``'s; a sliding 0: given
        back). Pages already cached stay; a cached node that lost its sliding page adopts this one."""
        if not self.enabled:
            return
        node, stamp = self.root, next(self._clock)
        for i in range(min(len(tokens) // self.S, len(full))):
            key = tuple(tokens[i * self.S:(i + 1) * self.S])
            child = node.children.get(key)
            if child is None:
                child = _Node(key, node, full=full[i])
                self.full.incref([full[i]])
                node.children[key] = child
                self.total += 1
            if child.sliding is None and i < len(sliding) and sliding[i] and child.full == full[i]:
                child.sliding = sliding[i]
                self.sliding.incref([sliding[i]])
            child.last_use = stamp
            node = child

    # -- eviction --------------------------------------------------------------------------------
    def _nodes(self) -> Iterator[_Node]:
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def evict_sliding(self, count: int) -> int:
        """Drop up to ``count`` sliding pages, least recently used first (nodes stay). Returns how many were
        freed back to the pool (a page a running request also holds is not freed by this)."""
        freed = 0
        for n in sorted((n for n in self._nodes() if n.sliding is not None), key=lambda n: n.last_use):
            if freed >= count:
                break
            page, n.sliding = n.sliding, None
            freed += self.sliding.refcount(page) == 1
            self.sliding.free([page])
        return freed

    def evict_full(self, count: int) -> int:
        """Drop up to ``count`` leaf nodes (their full and sliding pages), least recently used first."""
        freed = 0
        while freed < count:  # a pass over today's leaves, oldest first (their parents become leaves for the next)
            leaves = sorted((n for n in self._nodes() if not n.children), key=lambda n: n.last_use)
            if not leaves:
                break
            for n in leaves:
                freed += self.full.refcount(n.full) == 1
                self.full.free([n.full])
                if n.sliding is not None:
                    self.sliding.free([n.sliding])
                del n.parent.children[n.key]
                self.total -= 1
                if freed >= count:
                    break
        return freed

    def reset(self) -> None:
        for n in list(self._nodes()):
            self.full.free([n.full])
            if n.sliding is not None:
                self.sliding.free([n.sliding])
        self.root = _Node((), None)
        self.total = 0

    # -- accounting ------------------------------------------------------------------------------
    def held(self) -> tuple[list[int], list[int]]:
        """The pages the index holds a reference on: (full, sliding)."""
        nodes = list(self._nodes())
        return [n.full for n in nodes], [n.sliding for n in nodes if n.sliding is not None]
