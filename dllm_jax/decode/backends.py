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
    from pallas_kernels import get_attention_fn

    return get_attention_fn(backend)


def confidence_function(backend: str):
    if backend == "xla":
        return confidence_stats_reference
    from pallas_kernels import get_confidence_fn

    return get_confidence_fn(backend)


def confidence_stats(backend: str, params, hidden, *, exclude_token_id):
    """(argmax, p_max, lse) of ``hidden [N, H]`` against the LM head. A tied head goes to the Pallas kernel as
    the stored ``[V, H]`` embedding (``vocab_major``): passing ``embed.T`` would make XLA copy it every step."""
    if backend != "xla" and "lm_head" not in params:
        from pallas_kernels import get_confidence_fn

        fn = get_confidence_fn(backend, vocab_major=True)
        return fn(hidden, params["embed"], exclude_token_id=exclude_token_id)
    head = params["lm_head"] if "lm_head" in params else params["embed"].T
    return confidence_function(backend)(hidden, head, exclude_token_id=exclude_token_id)
