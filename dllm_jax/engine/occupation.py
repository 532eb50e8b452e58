"""Giving device memory back for colocated training (SGLang's ``release_memory_occupation`` /
``resume_memory_occupation``): a trainer and the rollout engine share one device, taking turns.

A mixin of :class:`dllm_jax.engine.engine.Engine`. ``tags``: ``"weights"`` (the parameters: a host copy is kept, so
resuming restores the last weights loaded or updated; an ``update_weights_from_*`` while released is refused) and
``"kv_cache"`` (the page pool: dropped with the prefix cache, which indexes it; recreated empty). Both keep every
array's shape, dtype and placement, so the compiled steps take the new buffers: nothing recompiles.

No request may hold KV while the pool is released: releasing pauses an engine that is not paused (mode
``retract``: running requests go back to the queue with their committed tokens) and resuming both tags continues
it; requests that arrive meanwhile queue. An engine paused ``in_place`` cannot release its pool (its requests hold
pages in it).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

OCCUPATION_TAGS = ("weights", "kv_cache")


def _tags(tags) -> tuple[str, ...]:
    if tags is None:
        return OCCUPATION_TAGS
    if isinstance(tags, str):
        tags = [tags]
    bad = [t for t in tags if t not in OCCUPATION_TAGS]
    if bad or not tags:
        raise ValueError(f"tags: each must be one of {', '.join(OCCUPATION_TAGS)}, got {list(tags)!r}")
    return tuple(dict.fromkeys(tags))


class _Kept:
    """A released leaf: its host value (weights) or its layout (pool), and its placement."""

    def __init__(self, value, array):
        # an uncommitted array (placed by default, not pinned) comes back uncommitted: the jit cache keys on it
        self.value, self.sharding = value, array.sharding if array._committed else None

    def place(self, value):
        return jax.device_put(value, self.sharding) if self.sharding is not None else jnp.asarray(value)


def memory_snapshot() -> dict:
    """Bytes held now: on the device (its allocator's count where it keeps one, else the live JAX arrays) and by
    this process (resident set)."""
    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    live = sum(a.nbytes for a in jax.live_arrays() if not a.is_deleted())
    rss = 0
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        pass
    return {"device_bytes_in_use": int(stats.get("bytes_in_use", live)), "live_array_bytes": int(live),
            "host_rss_bytes": rss}


class MemoryOccupation:
    _released: frozenset = frozenset()
    _auto_paused = False

    def release_memory_occupation(self, tags=None) -> dict:
        """Free the device memory of ``tags`` (default both). Returns the memory before and after."""
        tags = _tags(tags)
        self._require_scheduler("release_memory_occupation")
        if self.runner.channel is not None:  # each process would have to release and restore its own shards
            raise NotImplementedError("release_memory_occupation: not supported on a multi-process engine")
        with self._lock:
            before = memory_snapshot()
            if "kv_cache" in tags and self.pause_mode == "in_place" and self.scheduler.running:
                raise RuntimeError("release_memory_occupation: requests paused in place hold KV pages; pause with "
                                   "mode 'retract' or 'abort' first")
            if self.pause_mode is None:
                self.pause_generation("retract")
                self._auto_paused = True
            runner = self.runner
            if "weights" in tags and "weights" not in self._released:
                self._host_params = jax.tree.map(lambda a: _Kept(np.asarray(jax.device_get(a)), a),
                                                 runner.params)
                for a in jax.tree.leaves(runner.params):
                    a.delete()
            if "kv_cache" in tags and "kv_cache" not in self._released:
                self.radix.reset()  # its pages index the pool being dropped
                self._pool_layout = jax.tree.map(lambda a: _Kept(jax.ShapeDtypeStruct(a.shape, a.dtype), a),
                                                 runner.kv_pages)
                for a in jax.tree.leaves(runner.kv_pages):
                    a.delete()
            self._released = self._released | set(tags)
            return {"released": sorted(self._released), "memory_before": before, "memory_after": memory_snapshot()}

    def resume_memory_occupation(self, tags=None) -> dict:
        """Bring ``tags`` back (default both): the weights as they were when released, an empty pool."""
        tags = _tags(tags)
        self._require_scheduler("resume_memory_occupation")
        with self._lock:
            before = memory_snapshot()
            runner = self.runner
            if "weights" in tags and "weights" in self._released:
                runner.params = jax.tree.map(lambda k: k.place(k.value), self._host_params,
                                             is_leaf=lambda x: isinstance(x, _Kept))
                self._host_params = None
            if "kv_cache" in tags and "kv_cache" in self._released:
                runner.kv_pages = jax.tree.map(
                    lambda k: k.place(jnp.zeros(k.value.shape, k.value.dtype)), self._pool_layout,
                    is_leaf=lambda x: isinstance(x, _Kept))
            self._released = self._released - set(tags)
            if not self._released and self._auto_paused:
                self._auto_paused = False
                self.continue_generation()
            return {"released": sorted(self._released), "memory_before": before, "memory_after": memory_snapshot()}

    def _check_occupied(self, what: str) -> None:
        if self._released:
            raise RuntimeError(f"{what}: {' and '.join(sorted(self._released))} released "
                               f"(release_memory_occupation); resume_memory_occupation() first")
