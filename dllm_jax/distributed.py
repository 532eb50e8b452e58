"""Multi-host serving: one scheduler, every host's devices in one mesh.

How it runs (the same command on every host):

1. :func:`initialize` on every process before anything else touches JAX (wraps ``jax.distributed.initialize``;
   arguments default to ``$JAX_COORDINATOR_ADDRESS``, which JAX reads too, and ``$JAX_NUM_PROCESSES`` /
   ``$JAX_PROCESS_ID``, which JAX 0.10 does not: it infers those only under SLURM, Open MPI or Kubernetes).
   ``jax.devices()`` then lists every process's devices, and :func:`dllm_jax.sharding.make_mesh` builds the mesh
   over all of them.
2. Every process builds the same ``Engine(..., tensor_parallel_size=total_devices)``; parameters and the KV pool
   are sharded over the global mesh. The constructor waits at a barrier until every process has loaded.
3. Process 0 (the leader) runs the scheduler, the radix index and the server. Before each device call it
   broadcasts the call's padded inputs (a small header, then the arrays) with
   ``jax.experimental.multihost_utils.broadcast_one_to_all``; every other process runs ``engine.follow()``,
   which receives those inputs and runs the same jitted call, so all processes execute one SPMD program on the
   same data. ``engine.shutdown()`` on the leader sends a stop message; ``follow()`` then returns.

Liveness. Every collective (the broadcasts, and the all-reduces inside a sharded step) waits at most the
*collective timeout* for its peers, then fails (``collective_timeout_s``; on CPU this is XLA's
``--xla_cpu_collective_timeout_seconds``, which :func:`initialize` sets; XLA's own default is 30 minutes). A
killed peer fails the collective at once (its sockets close). Either way the error surfaces as
:class:`GroupFailure`: the leader's engine fails every request with its message and refuses new ones, and a
follower's ``follow()`` raises it, because a mesh that lost a process cannot continue (restart every process).
So that an idle follower's wait never reaches the timeout, the leader's engine loop (``engine.start()``, as the
server runs it) sends a keepalive message when no call went out for ``keepalive_s`` (a quarter of the timeout, at
most 10 s), which also notices a dead follower while idle; a leader that only calls ``generate()`` from its own
thread sends none, so its followers give up once it idles longer than the timeout. Independently, JAX's
coordination service terminates every process when one stops sending heartbeats for ``heartbeat_timeout_s``
(JAX's default: 100 s); that is the bound on GPU, where the collective timeout above does not apply.

The channel is an object with ``send(header, arrays)`` / ``recv(template_fn) -> (header, arrays)`` (optionally
``keepalive()`` and ``barrier(name)``): :class:`BroadcastChannel` is the multi-host one; tests use an in-process
queue with the same interface.
"""

from __future__ import annotations

import os
import time

import jax
import numpy as np

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"  # read by JAX itself too
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0
MAX_KEEPALIVE_S = 10.0
BARRIER_TIMEOUT_S = 1800.0  # processes may load a large checkpoint at different speeds
XLA_DEFAULT_COLLECTIVE_TIMEOUT_S = 1800.0

_collective_timeout_s = XLA_DEFAULT_COLLECTIVE_TIMEOUT_S
_barriers = 0  # barriers passed by this process (every process builds its engines in the same order)


class GroupFailure(RuntimeError):
    """A process of the group died or stopped answering: the sharded engine cannot continue (restart all)."""


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, collective_timeout_s: float | None = DEFAULT_COLLECTIVE_TIMEOUT_S,
               heartbeat_timeout_s: int | None = None, **kwargs) -> None:
    """Join the process group (``jax.distributed.initialize``) with JAX's CPU collectives (gloo), a bounded
    collective timeout (None: XLA's default) and, if given, JAX's heartbeat timeout. Unset arguments come from
    ``$JAX_COORDINATOR_ADDRESS`` / ``$JAX_NUM_PROCESSES`` / ``$JAX_PROCESS_ID``."""
    global _collective_timeout_s

    coordinator_address = coordinator_address or os.environ.get(ENV_COORDINATOR)
    num_processes = num_processes if num_processes is not None else _env_int(ENV_NUM_PROCESSES)
    process_id = process_id if process_id is not None else _env_int(ENV_PROCESS_ID)
    given = {"coordinator_address": (coordinator_address, ENV_COORDINATOR),
             "num_processes": (num_processes, ENV_NUM_PROCESSES), "process_id": (process_id, ENV_PROCESS_ID)}
    missing = [f"{name} (or ${env})" for name, (value, env) in given.items() if value is None]
    if missing:
        raise ValueError(f"a multi-process run needs {', '.join(missing)}")
    if collective_timeout_s is not None:
        if collective_timeout_s < 1:
            raise ValueError(f"collective_timeout_s: must be at least 1 (seconds), got {collective_timeout_s}")
        # read when the CPU backend starts, which jax.distributed.initialize requires has not happened yet
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_cpu_collective_timeout_seconds={int(collective_timeout_s)}".strip()
        _collective_timeout_s = float(int(collective_timeout_s))
    if heartbeat_timeout_s is not None:
        kwargs["heartbeat_timeout_seconds"] = int(heartbeat_timeout_s)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=int(num_processes),
                               process_id=int(process_id), **kwargs)


def lost_reason() -> str:
    """The likely cause of a failed collective, with the timeout this process runs with."""
    return f"a process died or did not answer within the collective timeout of {_collective_timeout_s:g} s"


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"${name}: must be an integer, got {value!r}") from None


def is_leader() -> bool:
    return jax.process_index() == 0


class BroadcastChannel:
    """Leader -> followers over JAX's own collectives (no extra transport).

    A header is four int32: ``[kind, rows, width, length]``; kind 0 stops the followers, kind ``PING`` is a
    keepalive that :meth:`recv` skips. Any failure of a broadcast is raised as :class:`GroupFailure`."""

    HEADER = 4
    PING = -1

    def __init__(self, keepalive_s: float | None = None):
        from jax.experimental import multihost_utils

        self._broadcast = multihost_utils.broadcast_one_to_all
        self.keepalive_s = keepalive_s if keepalive_s is not None else min(MAX_KEEPALIVE_S, _collective_timeout_s / 4)
        self._last_send = time.monotonic()

    def _bcast(self, tree):
        try:
            return self._broadcast(tree)
        except Exception as e:
            raise GroupFailure(f"a broadcast to the other processes failed ({lost_reason()}): "
                               f"{type(e).__name__}: {e}") from e

    def send(self, header: np.ndarray, arrays: dict[str, np.ndarray]) -> None:
        self._last_send = time.monotonic()
        self._bcast(np.asarray(header, np.int32))
        if arrays:
            self._bcast(arrays)

    def keepalive(self) -> bool:
        """Leader, between calls: send a keepalive if nothing went out for ``keepalive_s``. Returns whether it
        sent one."""
        if time.monotonic() - self._last_send < self.keepalive_s:
            return False
        self.send(np.asarray([self.PING, 0, 0, 0], np.int32), {})
        return True

    def recv(self, template_fn):
        while True:
            header = np.asarray(self._bcast(np.zeros((self.HEADER,), np.int32)))
            if int(header[0]) != self.PING:
                break
        if int(header[0]) == 0:
            return header, {}
        arrays = self._bcast(template_fn(header))
        return header, {k: np.asarray(v) for k, v in arrays.items()}

    def barrier(self, name: str = "engine", timeout_s: float = BARRIER_TIMEOUT_S) -> None:
        """Wait until every process reaches the same barrier (through the coordination service, not a
        collective: its timeout is independent of the collective timeout)."""
        from jax._src import distributed as jax_distributed

        global _barriers
        client = jax_distributed.global_state.client
        if client is None:
            return
        _barriers += 1
        try:
            client.wait_at_barrier(f"dllm_jax/{name}/{_barriers}", int(timeout_s * 1000))
        except Exception as e:
            raise GroupFailure(f"the processes did not all reach barrier {name!r} within {timeout_s:g} s: {e}") from e
        self._last_send = time.monotonic()


def run_follower(engine) -> int:
    """A follower process's life: replay the leader's calls until it shuts down (exit status 0), or until the
    group fails (the error logged, then :func:`hard_exit` with status 1)."""
    import logging

    log = logging.getLogger("dllm_jax")
    log.info("process %d of %d: following the leader's device calls", jax.process_index(), jax.process_count())
    try:
        calls = engine.follow()
    except GroupFailure as e:
        log.error("%s", e)
        hard_exit(1)
    log.info("the leader shut down after %d device calls", calls)
    return 0


def hard_exit(status: int) -> None:
    """Exit now, skipping interpreter teardown: after a group failure JAX's exit handler would wait at a shutdown
    barrier for the lost process until the heartbeat timeout, then abort."""
    import logging
    import sys

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def default_channel():
    """The broadcast channel when several processes share the mesh, else None."""
    return BroadcastChannel() if jax.process_count() > 1 else None
