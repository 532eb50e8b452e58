"""Cross-lower both Pallas kernels for CUDA on the CPU at SDAR-1.7B shapes.

Interpret mode runs the kernel bodies as plain XLA and skips the Triton rules (power-of-two sizes,
supported primitives, dot shapes). Lowering for CUDA runs the whole Pallas -> Triton IR step, so
a kernel that would only fail on the GPU fails here. jax >= 0.11 needs an abstract GPU device to
lower for CUDA without one; 0.10.2 does not, but accepts it.
"""

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.confidence import confidence_stats
from pallas_kernels.paged_block_attention import paged_block_attention

pytestmark = pytest.mark.lowering

S = jax.ShapeDtypeStruct
HQ, HKV, D, HIDDEN, VOCAB, PAGES, WIDTH = 16, 8, 128, 2048, 151936, 4096, 128  # SDAR-1.7B


def _lower_for_cuda(fn, *args):
    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=dev)):
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text.lower() and "mosaic" not in text.lower()  # the Triton backend, not Mosaic GPU
    return text


@pytest.mark.parametrize("rows,blocks,block,kv_splits", [
    (1, 1, 32, None),   # denoise, batch 1: split-K
    (64, 1, 32, None),  # denoise, batch 64: one split, normalised in the kernel
    (2, 8, 32, None),   # prefill of 8 blocks
    (8, 1, 4, 3),       # B = 4 (a tile of 32 pages), explicit splits
])
def test_attention_lowers_for_cuda(rows, blocks, block, kv_splits):
    t = blocks * block
    args = (S((rows, t, HQ, D), jnp.bfloat16), S((rows, t, HKV, D), jnp.bfloat16), S((rows, t, HKV, D), jnp.bfloat16),
            S((HKV, PAGES, block, D), jnp.bfloat16), S((HKV, PAGES, block, D), jnp.bfloat16),
            S((rows, WIDTH), jnp.int32), S((rows,), jnp.int32))
    _lower_for_cuda(lambda *a: paged_block_attention(*a, block_size=block, kv_splits=kv_splits), *args)


def test_attention_lowers_gqa8_and_f32():
    """SDAR-30B-A3B's grouping (32 q heads over 4 kv heads) and a float32 pool."""
    args = (S((4, 32, 32, D), jnp.float32), S((4, 32, 4, D), jnp.float32), S((4, 32, 4, D), jnp.float32),
            S((4, 256, 32, D), jnp.float32), S((4, 256, 32, D), jnp.float32), S((4, 16), jnp.int32), S((4,), jnp.int32))
    _lower_for_cuda(lambda *a: paged_block_attention(*a, block_size=32), *args)


@pytest.mark.parametrize("positions,vocab_major", [(32, False), (2048, False), (256, True)])
def test_confidence_lowers_for_cuda(positions, vocab_major):
    head = S((VOCAB, HIDDEN) if vocab_major else (HIDDEN, VOCAB), jnp.bfloat16)
    _lower_for_cuda(lambda h, w: confidence_stats(h, w, exclude_token_id=151669, vocab_major=vocab_major),
                    S((positions, HIDDEN), jnp.bfloat16), head)


def test_confidence_lowers_with_ragged_hidden():
    """A hidden size that is not a multiple of the hidden step takes the masked-load path."""
    _lower_for_cuda(lambda h, w: confidence_stats(h, w), S((7, 40), jnp.float32), S((40, 1000), jnp.float32))


@pytest.mark.parametrize("variant", ["plain", "top", "adjust", "adjust_top"])
def test_renoise_lowers_for_cuda(variant):
    """DiffusionGemma's fused pass at its real vocabulary, hidden size and canvas: plain, with top-k, with the
    per-row adjustment tables (scalar loads at traced indices, loops with traced bounds), both."""
    from pallas_kernels import renoise as R
    from pallas_kernels.renoise_adjust import Adjust

    V, H, C, rows, W = 262144, 2304, 256, 2, 1024
    n = rows * C
    args = [S((n, H), jnp.bfloat16), S((V, H), jnp.bfloat16), S((V, H), jnp.bfloat16), S((n,), jnp.float32),
            S((n,), jnp.uint32)]
    if "adjust" in variant:
        args.append(Adjust(S((rows, W), jnp.int32), S((rows, W), jnp.float32), S((rows, W), jnp.float32),
                           S((rows, W), jnp.int32)))
    top_k = 20 if "top" in variant else 0
    _lower_for_cuda(lambda h, w, e, t, k, *a: R.renoise_stats_pallas(
        h, w, e, t, k, softcap=30.0, adjust=a[0] if a else None, row_len=C, top_k=top_k), *args)


def test_renoise_lowers_with_short_rows():
    """Canvas rows shorter than the kernel's row tile: a program walks several rows' tables."""
    from pallas_kernels import renoise as R
    from pallas_kernels.renoise_adjust import Adjust

    adj = Adjust(S((8, 512), jnp.int32), S((8, 512), jnp.float32), S((8, 512), jnp.float32), S((8, 512), jnp.int32))
    _lower_for_cuda(lambda h, w, t, k, a: R.renoise_stats_pallas(h, w, w, t, k, adjust=a, row_len=4, top_k=5),
                    S((32, 64), jnp.float32), S((1000, 64), jnp.float32), S((32,), jnp.float32),
                    S((32,), jnp.uint32), adj)
