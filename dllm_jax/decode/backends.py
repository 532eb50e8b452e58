"""Choice of attention / confidence implementation, and their tensor-parallel forms.

Names resolve with the one resolver, :func:`pallas_kernels.resolve_backend` (re-exported here): ``auto`` is
``pallas`` on a GPU backend and ``xla`` otherwise; ``pallas_interpret`` runs the Pallas kernels in interpret mode
(CPU tests of the wiring). ``xla`` means no Pallas: attention is :func:`dllm_jax.decode.xla_attention.
paged_block_attention_xla` (the kernels' reference function, computed over live prefix tiles only), confidence is
the reference :func:`pallas_kernels.confidence.confidence_stats_reference`.

With a device mesh: attention runs per KV-head shard (Pallas under ``shard_map``; the XLA path through GSPMD's
sharding propagation), and confidence selection runs per vocabulary shard, each shard reducing its slice of
the LM head to a (max, sum-exp, argmax) triple; only those ``3 x N`` numbers are gathered and merged, never the
``[N, V]`` logits.

The engine's ``confidence_backend="auto"`` stays ``"auto"`` on a GPU (:func:`pallas_kernels.
resolve_confidence_backend`): :func:`confidence_stats` then picks Pallas or XLA for each traced shape from the
measured crossover table (:func:`pallas_kernels.choose_confidence_backend`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pallas_kernels import BACKENDS, backends_for_platform, resolve_backend  # noqa: F401 (the one resolver)
from pallas_kernels.confidence import (confidence_stats_reference, finalize_confidence_triple,
                                       merge_confidence_triples)


def attention_function(backend: str, mesh=None, cfg=None):
    if backend == "xla":
        from dllm_jax.decode.xla_attention import paged_block_attention_xla

        return paged_block_attention_xla  # the reference's function: live prefix tiles only, query-tiled
    from pallas_kernels import get_attention_fn

    kernel = get_attention_fn(backend)
    from dllm_jax.sharding import heads_shardable

    if not heads_shardable(cfg, mesh):
        return kernel
    heads = P(None, None, "tp", None)
    pool = P("tp", None, None, None)

    def sharded(q, k_new, v_new, k_pages, v_pages, page_table, prefix_len, *, block_size):
        fn = functools.partial(kernel, block_size=block_size)
        return jax.shard_map(fn, mesh=mesh, in_specs=(heads, heads, heads, pool, pool, P(), P()),
                             out_specs=heads, check_vma=False)(q, k_new, v_new, k_pages, v_pages, page_table,
                                                               prefix_len)
    return sharded


def confidence_function(backend: str):
    if backend == "xla":
        return confidence_stats_reference
    from pallas_kernels import get_confidence_fn

    return get_confidence_fn(backend)


def confidence_stats(backend: str, params, hidden, *, exclude_token_id, mesh=None, cfg=None):
    """(argmax, p_max, lse) of ``hidden [N, H]`` against the LM head. The head goes to the Pallas kernel as stored,
    ``[V, H]`` (``vocab_major``): the untied head as the checkpoint stores it, or the tied embedding (passing
    ``embed.T`` would make XLA copy it every step)."""
    from dllm_jax.sharding import vocab_shards

    if backend == "auto":  # a GPU: the measured winner for this shape (pallas_kernels/confidence_crossover.json)
        from pallas_kernels.confidence import choose_confidence_backend

        head = params["lm_head"] if "lm_head" in params else params["embed"]
        vocab_major = "lm_head" not in params or head.shape[0] != hidden.shape[1]  # [V, H], as the embedding
        backend = choose_confidence_backend(hidden.shape[0], hidden.shape[1], head.shape[0 if vocab_major else 1],
                                            vocab_major=vocab_major)
    if cfg is not None and vocab_shards(cfg, mesh) > 1:
        return _vocab_parallel_confidence(backend, params, hidden, exclude_token_id, mesh)
    if backend == "xla":  # the [V, H] head contracted as stored (``embed.T`` is copied on XLA:CPU in bf16)
        from dllm_jax.model.qwen3 import logits_from_hidden
        from pallas_kernels.confidence import confidence_stats_from_logits

        return confidence_stats_from_logits(logits_from_hidden(params, hidden), exclude_token_id=exclude_token_id)
    from dllm_jax.model.qwen3 import lm_head
    from pallas_kernels import get_confidence_fn

    fn = get_confidence_fn(backend, vocab_major=True)  # the head is [V, H], tied or not (dllm_jax.model.params)
    return fn(hidden, lm_head(params), exclude_token_id=exclude_token_id)


def _vocab_parallel_confidence(backend, params, hidden, exclude_token_id, mesh):
    from dllm_jax.sharding import RULES

    from dllm_jax.model.qwen3 import lm_head

    axis = RULES["vocab"]
    vocab_major = True  # the head is [V, H], tied or not (dllm_jax.model.params)
    head = lm_head(params)
    head_spec = P(axis, None)

    def local(h, w):
        v_local = w.shape[0] if vocab_major else w.shape[1]
        offset = jax.lax.axis_index(axis) * v_local
        excluded = exclude_token_id - offset  # outside [0, v_local) on every other shard: excludes nothing
        if backend == "xla":
            logits = jnp.dot(h, w.T if vocab_major else w, preferred_element_type=jnp.float32)
            logits = jnp.where(jnp.arange(v_local) == excluded, -jnp.inf, logits)
            m = jnp.max(logits, axis=-1)
            s = jnp.sum(jnp.exp(logits - m[:, None]), axis=-1)
            a = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        else:
            from pallas_kernels import confidence_triples

            m, s, a = confidence_triples(h, w, excluded, vocab_major=vocab_major,
                                         interpret=backend == "pallas_interpret")
        triples = [jax.lax.all_gather(t, axis) for t in (m, s, a + offset)]  # [shards, N] each: 3N numbers
        return finalize_confidence_triple(*merge_confidence_triples(*triples, axis=0))

    return jax.shard_map(local, mesh=mesh, in_specs=(P(), head_spec), out_specs=(P(), P(), P()),
                         check_vma=False)(hidden, head)
