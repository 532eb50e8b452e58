"""Multi-host serving: one scheduler, every host's devices in one mesh.

How it runs (the same command on every host):

1. ``dllm_jax.distributed.initialize(coordinator_address="host0:1234", num_processes=N, process_id=i)`` on every
   host before anything else touches JAX (wraps ``jax.distributed.initialize``). ``jax.devices()`` then lists
   every host's devices, and :func:`dllm_jax.sharding.make_mesh` builds the mesh over all of them.
2. Every host builds the same ``Engine(..., tensor_parallel_size=total_devices)``; parameters and the KV pool are
   sharded over the global mesh.
3. Process 0 (the leader) runs the scheduler, the radix index and the server. Before each device call it
   broadcasts the call's padded inputs (a small header, then the arrays) with
   ``jax.experimental.multihost_utils.broadcast_one_to_all``; every other process runs ``engine.follow()``,
   which receives those inputs and runs the same jitted call, so all processes execute one SPMD program on the
   same data. ``engine.shutdown()`` on the leader sends a stop message.

The channel is an object with ``send(header, arrays)`` / ``recv(template_fn) -> (header, arrays)``:
:class:`BroadcastChannel` is the multi-host one; tests use an in-process queue with the same interface.
"""

from __future__ import annotations

import jax
import numpy as np


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, **kwargs) -> None:
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id, **kwargs)


def is_leader() -> bool:
    return jax.process_index() == 0


class BroadcastChannel:
    """Leader -> followers over JAX's own collectives (no extra transport)."""

    HEADER = 4

    def __init__(self):
        from jax.experimental import multihost_utils

        self._broadcast = multihost_utils.broadcast_one_to_all

    def send(self, header: np.ndarray, arrays: dict[str, np.ndarray]) -> None:
        self._broadcast(np.asarray(header, np.int32))
        if arrays:
            self._broadcast(arrays)

    def recv(self, template_fn):
        header = np.asarray(self._broadcast(np.zeros((self.HEADER,), np.int32)))
        if int(header[0]) == 0:
            return header, {}
        arrays = self._broadcast(template_fn(header))
        return header, {k: np.asarray(v) for k, v in arrays.items()}


def default_channel():
    """The broadcast channel when several processes share the mesh, else None."""
    return BroadcastChannel() if jax.process_count() > 1 else None
