"""Pallas GPU kernels (Triton backend), each beside its plain-JAX reference.

* :mod:`pallas_kernels.paged_block_attention`: the chunk of blocks against its paged prefix plus
  itself (block-causal). ``get_attention_fn(backend)`` gives a drop-in ``attention_fn``.
* :mod:`pallas_kernels.confidence`: LM head fused with per-position (argmax, p_max, lse) over the
  vocabulary. ``get_confidence_fn(backend)``; ``merge_confidence_triples`` for vocab shards.

Backends: ``"pallas"`` (GPU), ``"pallas_interpret"`` (the kernel bodies as plain XLA: CPU tests),
``"xla"`` (the reference), ``"auto"`` (Pallas on GPU, XLA elsewhere); :func:`resolve_backend` is the one resolver
(the engine's ``attention_backend`` / ``confidence_backend`` options use it too). For the confidence selection
``auto`` on a GPU picks per shape from a measured table (``confidence_crossover.json``;
:func:`choose_confidence_backend`, :func:`resolve_confidence_backend`).
"""

from pallas_kernels._common import BACKENDS, backends_for_platform, next_pow2, prev_pow2, resolve_backend
from pallas_kernels.confidence import (
    choose_confidence_backend,
    confidence_stats,
    confidence_stats_auto,
    confidence_stats_reference,
    confidence_triples,
    finalize_confidence_triple,
    get_confidence_fn,
    merge_confidence_triples,
    resolve_confidence_backend,
)
from pallas_kernels.paged_block_attention import (
    get_attention_fn,
    paged_block_attention,
    paged_block_attention_reference,
)

__all__ = [
    "BACKENDS",
    "backends_for_platform",
    "next_pow2",
    "prev_pow2",
    "resolve_backend",
    "resolve_confidence_backend",
    "choose_confidence_backend",
    "confidence_stats_auto",
    "confidence_stats",
    "confidence_stats_reference",
    "confidence_triples",
    "finalize_confidence_triple",
    "get_attention_fn",
    "get_confidence_fn",
    "merge_confidence_triples",
    "paged_block_attention",
    "paged_block_attention_reference",
]
