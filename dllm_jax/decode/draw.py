"""Drawing a token per position for the sampled rows of a denoise step (temperature, per-row top-k / top-p, a key
per row and step), and the draw's relative confidence. Split from :mod:`dllm_jax.decode.step`, which calls it."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _filter_top_k_top_p(scaled, temperature, top_k, top_p):
    """Set to -inf every logit outside the row's top-k / nucleus (per-row k and p; k <= 0 or k >= V, and p >= 1
    are off: such a row keeps its whole vocabulary, as SGLang samples it without a top-k / top-p pass; so does a
    greedy row, whose draw is not used). The sort over the vocabulary runs only when some sampled row of the call
    filters (a device-side ``lax.cond``): without filters a sampled step of the shipped model costs a third of what
    it did with the sort (``python -m bench.features``, bench/RESULTS.md)."""
    vocab = scaled.shape[-1]
    filters = (temperature > 0) & (((top_k > 0) & (top_k < vocab)) | (top_p < 1))
    return jax.lax.cond(jnp.any(filters), _top_k_top_p, lambda s, *_: s, scaled, top_k, top_p, filters)


def _top_k_top_p(scaled, top_k, top_p, filters):
    vocab = scaled.shape[-1]
    sorted_desc = -jnp.sort(-scaled, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)[:, None, None]
    kth = jnp.take_along_axis(sorted_desc, k - 1, axis=-1)
    sorted_desc = jnp.where(jnp.arange(vocab) < k, sorted_desc, -jnp.inf)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    keep = before < top_p[:, None, None]
    smallest_kept = jnp.min(jnp.where(keep, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    cutoff = jnp.maximum(kth, smallest_kept)
    # a row that does not filter keeps everything whatever its neighbours do (a cumulative sum that rounds up
    # to p = 1 before the last token must not drop it in one batch and keep it in another)
    return jnp.where((scaled >= cutoff) | ~filters[:, None, None], scaled, -jnp.inf)


def _sample(logits, batch):
    """Draw a token per position for every row; returns (tokens, relative confidence). Greedy rows ignore it."""
    temperature = jnp.where(batch.temperature > 0, batch.temperature, 1.0)
    scaled = logits / temperature[:, None, None]
    filtered = _filter_top_k_top_p(scaled, batch.temperature, batch.top_k, batch.top_p)
    keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.PRNGKey(s), c))(batch.seed, batch.rng_step)
    drawn = jax.vmap(lambda k, z: jax.random.categorical(k, z, axis=-1))(keys, filtered).astype(jnp.int32)
    top = jnp.max(logits, axis=-1)
    drawn_logit = jnp.take_along_axis(logits, drawn[..., None], axis=-1)[..., 0]
    relative = jnp.exp((drawn_logit - top) / temperature[:, None])
    return drawn, relative
