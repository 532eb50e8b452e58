"""Small helpers shared by the Pallas kernels (Triton backend)."""

from __future__ import annotations

import warnings

# jax >= 0.11 warns at every lowering that the Pallas Triton backend is deprecated. We chose it on
# purpose (the only GPU backend with exact, cheap interpret mode on CPU; see DESIGN.md), so silence
# exactly that warning and nothing else.
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated", category=DeprecationWarning)

from jax.experimental.pallas import triton as pltriton  # noqa: E402

LOG2E = 1.4426950408889634

# Implementation names, the one resolver (:func:`resolve_backend`) for the kernels here and the engine's options
# (``attention_backend`` / ``confidence_backend``): ``"pallas"`` (the compiled Triton kernels: GPU only),
# ``"pallas_interpret"`` (the same kernel bodies run as plain XLA: any platform, CPU tests), ``"xla"`` (no Pallas:
# the caller's plain-JAX implementation -- here the reference; the engine's attention uses its live-prefix tiled
# version of the same function, :mod:`dllm_jax.decode.xla_attention`), ``"auto"`` (``pallas`` on a GPU, else ``xla``).
BACKENDS = ("auto", "pallas", "xla", "pallas_interpret")

# H200 SXM: 132 SMs. Used only to size the split-K / vocab-split grid axes; a wrong guess costs
# speed, never correctness.
DEFAULT_NUM_SMS = 132


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``)."""
    n = int(n)
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def prev_pow2(n: int) -> int:
    """The largest power of two <= ``n`` (1 for ``n <= 1``)."""
    return 1 << (max(1, int(n)).bit_length() - 1)


def cdiv(a: int, b: int) -> int:
    return -(-int(a) // int(b))


def compiler_params(num_warps: int, num_stages: int):
    """Always explicit Triton params: a bare ``pallas_call`` lowers to Mosaic GPU on jax 0.10.2."""
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def backends_for_platform(platform: str | None = None) -> tuple[str, ...]:
    """The backend names that can run on ``platform`` (default: JAX's default backend)."""
    import jax

    platform = platform or jax.default_backend()
    return BACKENDS if platform == "gpu" else tuple(b for b in BACKENDS if b != "pallas")


def resolve_backend(name: str, field: str = "backend") -> str:
    """``name`` (one of :data:`BACKENDS`) -> the implementation to run: ``"pallas"``, ``"pallas_interpret"`` or
    ``"xla"``; ``auto`` is ``pallas`` on a GPU, ``xla`` elsewhere. A backend the platform cannot run (the compiled
    kernels are Triton, GPU only) is a ValueError naming ``field`` here, at construction, not deep inside the first
    step."""
    import jax

    if name not in BACKENDS:
        raise ValueError(f"{field}: unknown backend {name!r}; valid: {', '.join(BACKENDS)}")
    platform = jax.default_backend()
    if name not in backends_for_platform(platform):
        raise ValueError(f"{field}: {name!r} needs a GPU (the compiled Pallas kernels run on CUDA) but JAX runs on "
                         f"{platform}; choose one of: {', '.join(backends_for_platform(platform))}")
    if name == "auto":
        return "pallas" if platform == "gpu" else "xla"
    return name
