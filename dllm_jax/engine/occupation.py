"""Giving device memory back for colocated training (SGLang's ``release_memory_occupation`` /
``resume_memory_occupation``): a trainer and the rollout engine share one device, taking turns.

A mixin of :class:`dllm_jax.engine.engine.Engine`. ``tags``: ``"weights"`` (the parameters: a host copy is kept, so
resuming restores the last weights loaded or updated; an ``update_weights_from_*`` while released is refused) and
``"kv_cache"`` (the page pool: dropped with the prefix cache, which indexes it; recreated empty). Both keep every
array's shape, dtype and placement, so the compiled steps take the new buffers: nothing recompiles. On a
multi-process engine the leader sends the release / resume down the device-call channel and every process frees
and restores its own shards (:mod:`dllm_jax.engine.weight_sync`).

No request may hold KV while the pool is released: releasing pauses an engine that is not paused (mode
``retract``: running requests go back to the queue with their committed tokens) and resuming both tags continues
it; requests that arrive meanwhile queue. An engine paused ``in_place`` cannot release its pool (its requests hold
pages in it).
"""

from __future__ import annotations

import gc
import os

import jax

from dllm_jax.engine import weight_sync as ws

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


def memory_snapshot() -> dict:
    """Bytes held now: on the device (its allocator's count where it keeps one, else the live JAX arrays) and by
    this process (resident set). Unreachable Python objects are collected first, so buffers that earlier garbage
    still holds (an engine dropped without ``close``) neither count here nor fall away between two snapshots."""
    gc.collect()
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
    _auto_paused = False

    @property
    def _released(self) -> frozenset:
        return frozenset(self.runner.released)

    def release_memory_occupation(self, tags=None) -> dict:
        """Free the device memory of ``tags`` (default both). Returns the memory before and after."""
        tags = _tags(tags)
        self._require_scheduler("release_memory_occupation")
        with self._lock:
            before = memory_snapshot()
            if "kv_cache" in tags and self.pause_mode == "in_place" and self.scheduler.running:
                raise RuntimeError("release_memory_occupation: requests paused in place hold KV pages; pause with "
                                   "mode 'retract' or 'abort' first")
            if self.pause_mode is None:
                self.pause_generation("retract")
                self._auto_paused = True
            if "kv_cache" in tags and "kv_cache" not in self._released:
                self.scheduler.policy.reset_cache()  # its pages index the pool being dropped
            ws.occupation_everywhere(self.runner, "release", tags)
            return {"released": sorted(self._released), "memory_before": before, "memory_after": memory_snapshot()}

    def resume_memory_occupation(self, tags=None) -> dict:
        """Bring ``tags`` back (default both): the weights as they were when released, an empty pool."""
        tags = _tags(tags)
        self._require_scheduler("resume_memory_occupation")
        with self._lock:
            before = memory_snapshot()
            ws.occupation_everywhere(self.runner, "resume", tags)
            if not self._released and self._auto_paused:
                self._auto_paused = False
                self.continue_generation()
            return {"released": sorted(self._released), "memory_before": before, "memory_after": memory_snapshot()}

    def _check_occupied(self, what: str) -> None:
        if self._released:
            raise RuntimeError(f"{what}: {' and '.join(sorted(self._released))} released "
                               f"(release_memory_occupation); resume_memory_occupation() first")
