"""What a released runner keeps (``release_memory_occupation``): per leaf its host value or only its layout, and its
placement, and the two operations on a runner that the engine (:mod:`dllm_jax.engine.occupation`) and, on a
multi-process engine, every follower (:mod:`dllm_jax.engine.weight_sync`) run alike, each on its own shards."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.model.placement import _zeros_fn


class _Kept:
    """A released leaf: its host value (weights: this process's shards of it) or only its layout (pool), and its
    placement, so that it comes back with the same shape, dtype and sharding."""

    def __init__(self, array, keep_value: bool):
        self.shape, self.dtype = array.shape, array.dtype
        self.local = not array.is_fully_addressable  # sharded over other processes' devices too (always committed)
        # an uncommitted array (placed by default, not pinned) comes back uncommitted: the jit cache keys on it
        self.sharding = array.sharding if array._committed or self.local else None
        self.value = None
        if keep_value:
            self.value = ([(s.device, np.asarray(s.data)) for s in array.addressable_shards] if self.local
                          else np.asarray(jax.device_get(array)))

    def restore(self):
        if self.local:  # each process puts back its own shards
            return jax.make_array_from_single_device_arrays(
                self.shape, self.sharding, [jax.device_put(v, d) for d, v in self.value])
        return jax.device_put(self.value, self.sharding) if self.sharding is not None else jnp.asarray(self.value)

    def zeros(self):
        if self.local:  # one program on every process (each makes its shards); compiled once per layout
            return _zeros_fn(self.shape, self.dtype, self.sharding)()
        value = jnp.zeros(self.shape, self.dtype)
        return jax.device_put(value, self.sharding) if self.sharding is not None else value


def _is_kept(x) -> bool:
    return isinstance(x, _Kept)


def release_runner(runner, tags) -> None:
    """Free ``runner``'s device memory of ``tags``: the weights (a host copy kept) and / or the page pool (its layout
    kept). Runs on the leader and, sent down the channel, on every follower (each frees its own shards).

    ``runner.released`` is what another thread polls (a follower applies this from its channel thread), so a tag
    appears there only once its arrays are deleted, and leaves it only once the restored arrays are in place."""
    kept = runner.released
    if "weights" in tags and "weights" not in kept:
        host = jax.tree.map(lambda a: _Kept(a, keep_value=True), runner.params)
        for a in jax.tree.leaves(runner.params):
            a.delete()
        runner.compute.drop()  # the forwards' [in, out] copies, if any (made anew from the restored weights)
        kept["weights"] = host
    if "kv_cache" in tags and "kv_cache" not in kept:
        layout = jax.tree.map(lambda a: _Kept(a, keep_value=False), runner.kv_pages)
        for a in jax.tree.leaves(runner.kv_pages):
            a.delete()
        kept["kv_cache"] = layout


def resume_runner(runner, tags) -> None:
    """Bring ``tags`` back on ``runner``: the weights as released, an empty pool (published before the tag leaves
    ``runner.released``; see :func:`release_runner`)."""
    kept = runner.released
    if "weights" in tags and "weights" in kept:
        runner.params = jax.tree.map(_Kept.restore, kept["weights"], is_leaf=_is_kept)
        runner.compute.view(runner.params)  # the [in, out] copies back too: resume restores what release freed
        del kept["weights"]
    if "kv_cache" in tags and "kv_cache" in kept:
        runner.kv_pages = jax.tree.map(_Kept.zeros, kept["kv_cache"], is_leaf=_is_kept)
        del kept["kv_cache"]
