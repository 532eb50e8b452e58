"""Weight updates on a multi-process engine: every process updates its own shards, in step with the leader.

A multi-process engine's parameters are global arrays sharded over every process's devices
(:mod:`dllm_jax.distributed`); an update must run the same placements and in-place writes on every process, on
the same values. So the leader, holding the engine's lock between two rounds (no device call in flight), sends the
update down the channel its device calls go through, then applies it itself; each follower, in its replay loop,
receives it and applies it the same way, before the leader's next call reaches it:

* ``update_weights_from_disk``: the directory's path (every host must see the same directory, as SGLang
  requires); each process reads it from its own disk;
* ``update_weights_from_tensor``: a header listing the names, shapes and dtypes, then each tensor, one broadcast
  at a time (a follower holds one tensor in flight beyond what it places).

* ``release_memory_occupation`` / ``resume_memory_occupation``: the operation and its tags; each process frees or
  restores its own shards (:mod:`dllm_jax.engine.released`);
* ``get_weights_by_name``: the name; a leaf sharded over several processes is gathered by one program every
  process runs (each gets the whole leaf; only the leader answers).

The checks (names, shapes, dtypes, the directory's config) run on the leader before anything is sent, so a
refused update changes no process. A follower that fails to apply one (its disk lacks the directory) fails the
group, as a failed replayed call does.
"""

from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from dllm_jax.engine.released import release_runner, resume_runner
from dllm_jax.model import weight_update as wu
from dllm_jax.model.params import get_leaf

KIND_WEIGHTS = 3  # a header kind beside the runner's KIND_STOP / KIND_PREFILL / KIND_DENOISE (two bits)


def send_update(channel, meta: dict, tensors: list[np.ndarray] = ()) -> None:
    """Leader: announce an update (``meta``: ``{"source": "disk", "model_path"}`` or ``{"source": "tensors",
    "names"}``), then send its tensors one by one."""
    meta = dict(meta, tensors=[[list(t.shape), jnp.dtype(t.dtype).name] for t in tensors])
    blob = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    channel.send(np.asarray([KIND_WEIGHTS, blob.size, 0, 0], np.int32), {"meta": blob})
    for t in tensors:
        channel.send(np.asarray([KIND_WEIGHTS, 0, 0, 0], np.int32), {"tensor": np.ascontiguousarray(t)})


def update_template(header: np.ndarray) -> dict[str, np.ndarray]:
    """What a follower receives an update's announcement into (its length is in the header)."""
    return {"meta": np.zeros(int(header[1]), np.uint8)}


def apply_received(runner, arrays: dict[str, np.ndarray]) -> int:
    """Follower: receive the rest of the update ``arrays["meta"]`` announces and apply it to ``runner.params``
    as the leader does. Returns the number of leaves written."""
    meta = json.loads(bytes(np.asarray(arrays["meta"], np.uint8)).decode())
    cfg = runner.cfg
    if meta["source"] == "occupation":
        (release_runner if meta["op"] == "release" else resume_runner)(runner, meta["tags"])
        return 0
    if meta["source"] == "read":  # join the leader's gathers (only the leader answers)
        for part in wu.plan_read(cfg, meta["name"], None):
            gathered(get_leaf(runner.params, part.path))
        return 0
    if meta["source"] == "disk":
        plan = wu.plan_directory(cfg, runner.params, meta["model_path"])
        try:
            return wu.apply_directory(cfg, runner.params, plan, runner.mesh)
        finally:
            plan.close()
    named = []
    for name, (shape, dtype) in zip(meta["names"], meta["tensors"]):
        _, got = runner.channel.recv(lambda header, s=tuple(shape), d=jnp.dtype(dtype): {"tensor": np.zeros(s, d)})
        named.append((name, got["tensor"]))
    return wu.apply_tensors(cfg, runner.params, wu.plan_tensors(cfg, runner.params, named))


def apply_directory_everywhere(runner, plan, model_path: str) -> int:
    """Leader: ``update_weights_from_disk``'s apply, sent to the followers first when there are any."""
    if runner.channel is not None:
        send_update(runner.channel, {"source": "disk", "model_path": os.path.abspath(model_path)})
    return wu.apply_directory(runner.cfg, runner.params, plan, runner.mesh)


def apply_tensors_everywhere(runner, planned: list) -> int:
    """Leader: ``update_weights_from_tensor``'s apply, sent to the followers first when there are any (as numpy,
    so that every process runs the same program on the same values)."""
    if runner.channel is not None:
        for t in planned:
            t.value = np.asarray(t.value)
        send_update(runner.channel, {"source": "tensors", "names": [t.name for t in planned]},
                    [t.value for t in planned])
    return wu.apply_tensors(runner.cfg, runner.params, planned)


def occupation_everywhere(runner, op: str, tags) -> None:
    """Leader: release (``op="release"``) or resume ``tags`` of the runner, on every follower first."""
    if runner.channel is not None:
        send_update(runner.channel, {"source": "occupation", "op": op, "tags": list(tags)})
    (release_runner if op == "release" else resume_runner)(runner, tags)


@functools.lru_cache(maxsize=None)
def _replicate_fn(mesh):
    """Identity onto every device of ``mesh`` (one program per mesh; jit caches it per leaf shape)."""
    return jax.jit(lambda x: x, out_shardings=NamedSharding(mesh, PartitionSpec()))


def gathered(leaf) -> np.ndarray:
    """A leaf's whole value on this host: as is when this process holds all of it, else replicated to every device
    by one program (every process runs it, so each then holds the whole leaf)."""
    if leaf.is_fully_addressable:
        return np.asarray(leaf)
    return np.asarray(_replicate_fn(leaf.sharding.mesh)(leaf).addressable_data(0))


def read_everywhere(runner, name: str, truncate_size: int | None) -> np.ndarray:
    """Leader: ``get_weights_by_name``'s read; with followers, checked first, then sent (they join the gathers)."""
    if runner.channel is None:
        return wu.read_weight(runner.cfg, runner.params, name, truncate_size)
    wu.plan_read(runner.cfg, name, truncate_size)  # a refused read sends nothing
    send_update(runner.channel, {"source": "read", "name": name})
    return wu.read_weight(runner.cfg, runner.params, name, truncate_size, fetch=gathered)
