"""Choice of attention / confidence implementation: Pallas kernels on GPU, plain XLA elsewhere.

``auto`` resolves to ``pallas`` on a GPU backend and ``xla`` otherwise; ``pallas_interpret`` runs the Pallas
kernels in interpret mode (CPU tests of the wiring). The XLA versions are the kernels' references.
"""

from __future__ import annotations

import jax

from pallas_kernels.confidence import confidence_stats_reference
from pallas_kernels.paged_block_attention import paged_block_attention_reference

BACKENDS = ("auto", "pallas", "xla", "pallas_interpret")


def resolve_backend(name: str, field: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"{field}: unknown backend {name!r}; valid: {', '.join(BACKENDS)}")
    if name == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    return name


def attention_function(backend: str):
    if backend == "xla":
        return paged_block_attention_reference
    from pallas_kernels import paged_block_attention as kernels

    return kernels.get_attention_fn(backend)


def confidence_function(backend: str):
    if backend == "xla":
        return confidence_stats_reference
    from pallas_kernels import confidence as kernels

    return kernels.get_confidence_fn(backend)
