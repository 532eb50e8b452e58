"""Small helpers shared by the Pallas kernels (Triton backend)."""

from __future__ import annotations

import warnings

# jax >= 0.11 warns at every lowering that the Pallas Triton backend is deprecated. We chose it on
# purpose (the only GPU backend with exact, cheap interpret mode on CPU; see DESIGN.md), so silence
# exactly that warning and nothing else.
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated", category=DeprecationWarning)

from jax.experimental.pallas import triton as pltriton  # noqa: E402

LOG2E = 1.4426950408889634

BACKENDS = ("pallas", "pallas_interpret", "xla", "auto")

# H200 SXM: 132 SMs. Used only to size the split-K / vocab-split grid axes; a wrong guess costs
# speed, never correctness.
DEFAULT_NUM_SMS = 132


def next_pow2(n: int) -> int:
    n = int(n)
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-int(a) // int(b))


def compiler_params(num_warps: int, num_stages: int):
    """Always explicit Triton params: a bare ``pallas_call`` lowers to Mosaic GPU on jax 0.10.2."""
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def resolve_backend(backend: str) -> str:
    """``auto`` means Pallas on GPU and XLA elsewhere (CPU tests use ``pallas_interpret`` explicitly)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; expected one of {BACKENDS}")
    if backend == "auto":
        import jax

        return "pallas" if jax.default_backend() == "gpu" else "xla"
    return backend
