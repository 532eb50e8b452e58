"""Small models on XLA:CPU: the layer matrices transposed to ``[in, out]`` once per device call.

Every matrix is stored ``[out, in]`` as the checkpoint stores it and contracted on its last axis
(:func:`dllm_jax.model.moe.contract`): at the SDAR-1.7B shape XLA:CPU's dots run as fast or faster that way, and
loading is a copy. At a small model's shapes they do not: the shipped model's projections (32 rows, hidden 128; eight
forwards in a device loop, the two orders interleaved in one process, min of 30) took 5.30 ms against 3.98 ms for the
same dots over ``[in, out]`` matrices (+33%), which was most of the one-request slowdown after the layout change
(bench/RESULTS.md). So a denoise call of such a model transposes its layer matrices once, before its device loop
(an optimization barrier keeps XLA from folding the transpose back into the dots), and its forwards contract the
``[in, out]`` copies. The copy costs one read and write of those matrices a call; hence only below
:data:`MAX_BYTES`, in float32, on one CPU device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

MAX_BYTES = 16 << 20  # layer matrices up to this size are transposed per call (the shipped model: 2.1 MiB)
LAYER_MATRICES = ("qkv", "o", "gate_up", "down")  # the dense layer leaves contracted only by ``contract``


@jax.tree_util.register_pytree_node_class
class InOut:
    """A matrix held ``[in, out]`` (``t``) for :func:`~dllm_jax.model.moe.contract`, which reads it as the
    ``[out, in]`` matrix it stands for (``shape`` is that matrix's)."""

    def __init__(self, t):
        self.t = t

    @property
    def shape(self):
        return (self.t.shape[1], self.t.shape[0])

    @property
    def dtype(self):
        return self.t.dtype

    def tree_flatten(self):
        return (self.t,), None

    @classmethod
    def tree_unflatten(cls, _, children):
        return cls(*children)


def wanted(params, *, backend: str, mesh) -> bool:
    """Whether a runner's denoise calls should transpose its layer matrices (see the module docstring)."""
    if backend != "cpu" or mesh is not None:
        return False
    mats = [w for layer in params.get("layers", ()) for name, w in layer.items()
            if name in LAYER_MATRICES and getattr(w, "ndim", 0) == 2]
    return bool(mats) and all(w.dtype == jnp.float32 for w in mats) and \
        sum(int(np.prod(w.shape)) * w.dtype.itemsize for w in mats) <= MAX_BYTES


def transposed(params):
    """``params`` with each layer's dense matrices as :class:`InOut` copies (inside a jitted call, before its loop)."""
    layers = [{name: (InOut(jax.lax.optimization_barrier(jnp.transpose(w)))
                      if name in LAYER_MATRICES and w.ndim == 2 else w) for name, w in layer.items()}
              for layer in params["layers"]]
    return {**params, "layers": layers}
