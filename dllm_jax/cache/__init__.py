"""KV cache bookkeeping: the host page allocator and the block radix index (plain Python, no JAX)."""

from dllm_jax.cache.pages import TRASH_PAGE, OutOfPages, PageAllocator, PageError, pad_page_table
from dllm_jax.cache.radix import BlockRadixIndex, MatchResult, Node

__all__ = [
    "TRASH_PAGE",
    "OutOfPages",
    "PageError",
    "PageAllocator",
    "pad_page_table",
    "BlockRadixIndex",
    "MatchResult",
    "Node",
]
