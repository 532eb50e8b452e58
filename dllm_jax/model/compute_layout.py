"""The layout the forward computes with where it differs from the stored one: ``[in, out]`` copies of the dense
projection matrices (and the LM head) for small models on XLA:CPU.

Matrices are stored ``[out, in]`` as checkpoints store them (:mod:`dllm_jax.model.params`), so loading a
checkpoint is a copy. XLA:CPU's dot (a YNNPACK fusion) runs slower over that operand, contracted on its last axis,
than over an ``[in, out]`` one at the row counts of one or a few requests (32-64 token rows: the shipped model's
projections 5.3 vs 3.9 ms for 8 forwards; bench/RESULTS.md, issue 50). A small model can afford an ``[in, out]``
copy of each such matrix made once per weight version (a transpose of a few MiB on the host); a big one keeps
computing over the stored arrays, so it neither doubles its weights' memory nor loads slower than a copy.

:class:`InOut` marks such a copy inside the parameter pytree that a jitted forward receives;
:func:`dllm_jax.model.moe.contract` contracts it on its first axis. :class:`ComputeCopies` (one per runner) makes
the copies and keeps them while the stored leaves they came from are the runner's current ones: every path that
writes weights (``update_weights_*``, release / resume) replaces stored leaves, and the next call sees a different
leaf and copies it anew, so the copies can never serve stale weights. Readers (``get_weights_by_name``, scoring,
the checkpoint writers) see only the stored pytree.
"""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np

# The dense matrices of a layer that the forward contracts through moe.linear (fused q|k|v, the output projection,
# fused gate|up and down); an MoE layer's experts and router stay as stored.
LAYER_MATRICES = ("qkv", "o", "gate_up", "down")
HEAD_KEY = "head_in_out"  # the compute pytree's [H, V] copy of the LM head (tied: of the embedding)

# Copies are made only while the matrices to copy hold at most this many bytes: the shipped model's hold 1.1 MiB,
# a 50M-parameter float32 model's ~200 MiB. Above it the copies' memory (and their host transpose at every weight
# update) is not worth a gain measured only at small shapes.
MAX_COPY_BYTES = 64 << 20


@jax.tree_util.register_pytree_node_class
class InOut:
    """A matrix stored ``[out, in]``, held for computing as its ``[in, out]`` transpose ``t``."""

    def __init__(self, t):
        self.t = t

    @property
    def shape(self):  # the stored matrix's shape, [out, in]
        return self.t.shape[::-1]

    @property
    def dtype(self):
        return self.t.dtype

    def tree_flatten(self):
        return (self.t,), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)


def _sources(params) -> list[tuple[tuple, object]]:
    """``(path, stored leaf)`` of every matrix that gets a copy: the dense layer matrices and the LM head."""
    out = [(("layers", i, k), layer[k]) for i, layer in enumerate(params.get("layers", ()))
           for k in LAYER_MATRICES if k in layer and getattr(layer[k], "ndim", 0) == 2]
    head = params.get("lm_head", params.get("embed"))
    if head is not None:
        out.append(((HEAD_KEY,), head))
    return out


def copy_bytes(params) -> int:
    return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for _, a in _sources(params))


def wanted(params, *, mesh=None, multi_process: bool = False) -> bool:
    """Whether a runner over ``params`` computes over ``[in, out]`` copies: XLA:CPU, one device (no mesh to
    shard the copies over, no followers), and a small model (:data:`MAX_COPY_BYTES`)."""
    return (jax.default_backend() == "cpu" and mesh is None and not multi_process
            and 0 < copy_bytes(params) <= MAX_COPY_BYTES)


def _with(params, copies: dict):
    """``params`` with each copied matrix replaced by its :class:`InOut` (the head's added under
    :data:`HEAD_KEY`); the stored tree itself is not modified."""
    out = dict(params)
    layers = [dict(layer) for layer in params.get("layers", ())]
    for path, copy in copies.items():
        if path[0] == "layers":
            layers[path[1]][path[2]] = copy
        else:
            out[HEAD_KEY] = copy
    if "layers" in params:
        out["layers"] = layers
    return out


def abstract(params):
    """The compute pytree's shapes for a tree of stored shapes (``jax.ShapeDtypeStruct`` leaves): what a call is
    lowered for, without touching any buffer."""
    return _with(params, {path: InOut(jax.ShapeDtypeStruct(a.shape[::-1], a.dtype)) for path, a in _sources(params)})


def _transposed(a):
    """``a.T`` as a new device array on ``a``'s device, transposed on the host (no XLA program: nothing compiles)."""
    t = np.ascontiguousarray(np.asarray(a).T)
    return jax.device_put(t, a.sharding) if getattr(a, "_committed", False) else jnp.asarray(t)


class ComputeCopies:
    """A runner's ``[in, out]`` copies, each kept with the stored leaf it was made from (see the module
    docstring). ``enabled=False``: :meth:`view` is the stored pytree itself."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._lock = threading.Lock()
        self._made: dict[tuple, tuple[object, InOut]] = {}  # path -> (stored leaf, its copy)
        self._tree: tuple[list, dict] | None = None  # (the stored leaves it was built from, the compute pytree)

    def view(self, params):
        """The pytree a forward computes with: ``params`` with :class:`InOut` copies of its matrices."""
        if not self.enabled:
            return params
        leaves = jax.tree.leaves(params)
        with self._lock:
            tree = self._tree
            if tree is not None and len(tree[0]) == len(leaves) and all(a is b for a, b in zip(tree[0], leaves)):
                return tree[1]
            copies = {}
            for path, a in _sources(params):
                made = self._made.get(path)
                copies[path] = made[1] if made is not None and made[0] is a else InOut(_transposed(a))
                self._made[path] = (a, copies[path])
            view = _with(params, copies)
            self._tree = (leaves, view)
            return view

    @classmethod
    def for_runner(cls, params, *, mesh=None, multi_process: bool = False) -> "ComputeCopies":
        return cls(wanted(params, mesh=mesh, multi_process=multi_process))

    def abstract(self, params):
        """:func:`abstract` when enabled, else ``params`` as given."""
        return abstract(params) if self.enabled else params

    def drop(self) -> None:
        """Free the copies (release_memory_occupation of the weights); the next :meth:`view` makes them anew."""
        with self._lock:
            for _, copy in self._made.values():
                copy.t.delete()
            self._made.clear()
            self._tree = None
