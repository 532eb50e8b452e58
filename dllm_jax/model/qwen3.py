"""SDAR / Qwen3 decoder (dense or mixture-of-experts) and LLaDA2.x, as pure functions over a parameter pytree.

One implementation serves all three families; :class:`ModelConfig` fields switch the variants (partial RoPE,
q/k norm on or off, output-projection bias) and a layer whose pytree has an ``moe`` sub-dict runs the sparse
MLP of :mod:`dllm_jax.model.moe` instead of the dense SwiGLU.

Parameters are a plain dict pytree described by :mod:`dllm_jax.model.params` (one table: shapes, sharding axes,
dtypes, checkpoint names); matrices are stored ``[out, in]`` as the checkpoints store them (the LM head ``[V, H]``
like the embedding) and contracted on their last axis (:func:`dllm_jax.model.moe.linear`), so loading copies them.
Layers are a list of dicts so that each layer's weights and KV pages are separate buffers (clean donation, simple
sharding).

Two entry points:

* :func:`forward_full` -- a whole sequence under an arbitrary boolean attention mask (tests, training).
* :func:`forward_chunk` -- the engine's path: a chunk of ``C`` blocks per row against that row's paged
  prefix KV, writing the chunk's K/V into its pages. A denoise step is a chunk of one block. It runs in two
  parts, :func:`forward_chunk_kv` (everything that writes K/V) and :func:`forward_chunk_rest`.

Logits at position ``i`` predict token ``i`` (no shift): that is how SDAR is trained.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.config import ModelConfig
from dllm_jax.model.compute_layout import HEAD_KEY
from dllm_jax.model.fused_layout import fused_axis_groups
from dllm_jax.model.moe import contract, linear, moe_mlp, swiglu
from dllm_jax.model.table import Params


# ----------------------------------------------------------------------------------------------
# Building blocks
# ----------------------------------------------------------------------------------------------

def rms_norm(x, weight, eps):
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def rope(x, positions, cfg: ModelConfig):
    """Rotary embedding (rotate-half layout, as Qwen3 / Bailing). x: [..., T, heads, D].

    With ``partial_rotary_factor < 1`` only the first ``rotary_dim`` dims rotate (frequencies computed over
    ``rotary_dim``); the rest pass through unchanged.
    """
    d = x.shape[-1]
    rd = cfg.rotary_dim if cfg.rotary_dim else d
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, rd, 2, dtype=np.float32) / rd))
    pos = positions.astype(jnp.float32) / cfg.rope_scaling_factor
    angles = pos[..., None] * inv_freq  # [..., T, rd/2]
    cos = jnp.cos(angles)[..., None, :]
    sin = jnp.sin(angles)[..., None, :]
    cos = jnp.concatenate([cos, cos], axis=-1)
    sin = jnp.concatenate([sin, sin], axis=-1)
    xr = x[..., :rd]
    x1, x2 = xr[..., : rd // 2], xr[..., rd // 2:]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    out = (xr.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin).astype(x.dtype)
    if rd == d:
        return out
    return jnp.concatenate([out, x[..., rd:]], axis=-1)


def _qkv(layer, x, positions, cfg: ModelConfig):
    """Project (one matmul over the fused ``qkv`` leaf), q/k-normalise and rotate. Returns q [.., T, Hq, D], k/v
    [.., T, Hkv, D]. The fused rows are shard-major (:mod:`dllm_jax.model.fused`): the product is split as
    ``[..., g, q_s | k_s | v_s]``, so under TP each shard splits its own block."""
    qkv = linear(x, layer["qkv"])
    if cfg.attention_bias:
        qkv = qkv + layer["qkv_bias"]
    lead = x.shape[:-1]
    g = fused_axis_groups(cfg, "qkv", qkv.shape[-1])
    qkv = qkv.reshape(*lead, g, -1)
    qs, ks = cfg.q_size // g, cfg.kv_size // g
    q = qkv[..., :qs].reshape(*lead, cfg.num_heads, cfg.head_dim)
    k = qkv[..., qs:qs + ks].reshape(*lead, cfg.num_kv_heads, cfg.head_dim)
    v = qkv[..., qs + ks:].reshape(*lead, cfg.num_kv_heads, cfg.head_dim)
    if cfg.use_qk_norm:
        q = rms_norm(q, layer["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, layer["k_norm"], cfg.rms_norm_eps)
    return rope(q, positions, cfg), rope(k, positions, cfg), v


def _out_proj(layer, attn):
    """Attention output projection ``attn [..., Hq*D] -> [..., H]`` (with the Bailing ``dense`` bias if any)."""
    out = linear(attn, layer["o"])
    if "o_bias" in layer:
        out = out + layer["o_bias"]
    return out


def _mlp(layer, x, cfg: ModelConfig):
    """Post-attention norm then the layer's MLP: sparse when the layer has an ``moe`` sub-dict, else SwiGLU."""
    h = rms_norm(x, layer["mlp_norm"], cfg.rms_norm_eps)
    if "moe" in layer:
        return moe_mlp(layer["moe"], h, cfg)
    return swiglu(h, layer["gate_up"], layer["down"], cfg)


def lm_head(params: Params):
    """The LM head ``[V, H]``: the untied head as the checkpoint stores it, or the tied embedding."""
    return params["lm_head"] if "lm_head" in params else params["embed"]


def embed_tokens(embed, tokens):
    """The embedding rows of ``tokens``. XLA:CPU gathers from a bfloat16 table through a float32 conversion of the
    table; inside the device loop of a denoise call it hoisted that loop-invariant conversion out of the loop, a
    float32 copy of the whole embedding made on every call (1.16 GiB at the SDAR-1.7B shape, and its time). Passing
    the table through an optimization barrier together with the (loop-varying) tokens makes it loop-varying to XLA,
    so the conversion stays fused into the gather (the rows only). The barrier is free: it moves no data."""
    table, tokens = jax.lax.optimization_barrier((embed, tokens))
    return table[tokens]


def logits_from_hidden(params: Params, hidden):
    """float32 logits ``[..., V]``: the ``[V, H]`` head contracted as stored (writing ``embed.T`` makes XLA:CPU copy
    the embedding in bf16 on every call, measured 13x slower at the 1.7B shape), or its ``[H, V]`` compute copy where
    the runner made one (:mod:`dllm_jax.model.compute_layout`)."""
    head = params.get(HEAD_KEY)
    return contract(hidden, lm_head(params) if head is None else head)


# ----------------------------------------------------------------------------------------------
# Full-sequence forward (tests, training)
# ----------------------------------------------------------------------------------------------

def forward_full(params: Params, cfg: ModelConfig, tokens, positions, attn_mask, *, return_hidden=False):
    """tokens/positions ``[N, S]``, attn_mask ``[N, S, S]`` bool (True = query may see key)."""
    x = params["embed"][tokens]
    scale = cfg.head_dim ** -0.5
    group = cfg.num_heads // cfg.num_kv_heads
    n, s = tokens.shape
    for layer in params["layers"]:
        with jax.named_scope("attention"):
            h = rms_norm(x, layer["attn_norm"], cfg.rms_norm_eps)
            q, k, v = _qkv(layer, h, positions, cfg)
            qg = q.reshape(n, s, cfg.num_kv_heads, group, cfg.head_dim)
            scores = jnp.einsum("ntkgd,nskd->nkgts", qg, k, preferred_element_type=jnp.float32) * scale
            scores = jnp.where(attn_mask[:, None, None], scores, -jnp.inf)
            probs = jax.nn.softmax(scores, axis=-1)
            probs = jnp.where(jnp.isnan(probs), 0.0, probs)  # fully masked query rows
            attn = jnp.einsum("nkgts,nskd->ntkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
            x = x + _out_proj(layer, attn.reshape(n, s, cfg.q_size).astype(x.dtype))
        with jax.named_scope("mlp"):
            x = x + _mlp(layer, x, cfg)
    hidden = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    if return_hidden:
        return hidden
    return logits_from_hidden(params, hidden)


def block_causal_mask(seq_len: int, block_size: int) -> np.ndarray:
    """``visible(q, k) = k // B <= q // B``: bidirectional in a block, causal across blocks."""
    blk = np.arange(seq_len) // block_size
    return blk[None, :] <= blk[:, None]


# ----------------------------------------------------------------------------------------------
# Paged chunk forward (the engine's path)
# ----------------------------------------------------------------------------------------------

# ----------------------------------------------------------------------------------------------
# KV pool storage
# ----------------------------------------------------------------------------------------------
#
# A bfloat16 pool on XLA:CPU is kept as its bit pattern (uint16): XLA:CPU has no in-place bf16 scatter, so writing
# a block's K/V into a bf16 pool copies the whole pool (measured: 79 ms per layer and tensor for a 64 MB pool,
# growing with the pool), while a uint16 scatter is in place (0.04 ms). Attention reads the pool through a free
# bitcast view, so the values and the arithmetic are exactly those of a bf16 pool.
KV_BITS_DTYPE = np.dtype(np.uint16)


def kv_storage_dtype(dtype, platform: str | None = None):
    """The pool's storage dtype for K/V values of ``dtype`` on ``platform`` (default: JAX's default backend)."""
    dtype = jnp.dtype(dtype)
    platform = platform or jax.default_backend()
    return KV_BITS_DTYPE if dtype == jnp.bfloat16 and platform == "cpu" else dtype


def kv_values(pool):
    """The pool as K/V values (a bitcast view of a bits-stored bf16 pool; the pool itself otherwise)."""
    if pool.dtype == KV_BITS_DTYPE:
        return jax.lax.bitcast_convert_type(pool, jnp.bfloat16)
    return pool


def kv_to_storage(x, pool_dtype):
    """K/V values -> the pool's storage dtype (bf16 then its bits, for a bits-stored pool)."""
    if pool_dtype == KV_BITS_DTYPE:
        return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), KV_BITS_DTYPE)
    return x.astype(pool_dtype)


def forward_chunk(params: Params, cfg: ModelConfig, tokens, kv_pages, page_table, prefix_len, write_pages,
                  *, block_size: int, attention_fn):
    """Run a chunk of ``C`` blocks per row against the paged prefix and write its K/V.

    tokens ``[R, C*B]``; the chunk of row ``r`` starts at absolute position ``prefix_len[r]``.
    kv_pages: list over layers of ``(k, v)``, each ``[Hkv, P, B, D]`` (values, or bf16 bits: see
    :func:`kv_storage_dtype`). page_table ``[R, W]``.
    write_pages ``[R, C]``: the page each chunk block's K/V goes to (page 0 is the trash page used by
    padding). ``attention_fn`` has the signature of
    :func:`pallas_kernels.paged_block_attention.paged_block_attention_reference`.
    Returns (final hidden states ``[R, C*B, H]``, new kv_pages).

    It is :func:`forward_chunk_kv` then :func:`forward_chunk_rest`; a caller that may not need the hidden states
    (the engine's commit forward) calls the two itself.
    """
    kv_pages, last = forward_chunk_kv(params, cfg, tokens, kv_pages, page_table, prefix_len, write_pages,
                                      block_size=block_size, attention_fn=attention_fn)
    hidden = forward_chunk_rest(params, cfg, last, kv_pages, page_table, prefix_len, block_size=block_size,
                                attention_fn=attention_fn)
    return hidden, kv_pages


def forward_chunk_kv(params: Params, cfg: ModelConfig, tokens, kv_pages, page_table, prefix_len, write_pages,
                     *, block_size: int, attention_fn):
    """The part of :func:`forward_chunk` that writes K/V: every layer but the last runs whole; the last one
    projects, normalises and rotates its q/k/v and writes its K/V. Returns (new kv_pages, ``last``: that layer's
    input and q/k/v, for :func:`forward_chunk_rest`). A forward whose hidden states turn out not to be needed
    stops here, having written exactly the K/V of the full forward (the same computation)."""
    num_rows, chunk_len = tokens.shape
    positions = prefix_len[:, None] + jnp.arange(chunk_len, dtype=prefix_len.dtype)[None, :]
    x = embed_tokens(params["embed"], tokens)
    flat_pages = write_pages.reshape(-1)
    kv_fn, rest_fn = _layer_fns(cfg, num_rows, chunk_len, block_size, attention_fn)
    new_pages = []
    layers = params["layers"]
    for i, (layer, (k_pool, v_pool)) in enumerate(zip(layers, kv_pages)):
        q, k, v, k_pool, v_pool = kv_fn(layer, x, k_pool, v_pool, positions, flat_pages)
        new_pages.append((k_pool, v_pool))
        if i == len(layers) - 1:
            return new_pages, (x, q, k, v)
        x = rest_fn(layer, x, q, k, v, k_pool, v_pool, page_table, prefix_len)


def forward_chunk_rest(params: Params, cfg: ModelConfig, last, kv_pages, page_table, prefix_len, *,
                       block_size: int, attention_fn):
    """The rest of :func:`forward_chunk` after :func:`forward_chunk_kv`: the last layer's attention and MLP, then
    the final norm. Returns the final hidden states ``[R, C*B, H]``."""
    x, q, k, v = last
    num_rows, chunk_len = x.shape[:2]
    _, rest_fn = _layer_fns(cfg, num_rows, chunk_len, block_size, attention_fn)
    k_pool, v_pool = kv_pages[-1]
    x = rest_fn(params["layers"][-1], x, q, k, v, k_pool, v_pool, page_table, prefix_len)
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps)


@functools.lru_cache(maxsize=64)
def _layer_fns(cfg: ModelConfig, num_rows: int, chunk_len: int, block_size: int, attention_fn):
    """A layer as two jitted halves, (q/k/v + K/V write, attention + MLP), each called once per layer: layers of
    the same shape trace and lower once per call shape instead of once per layer (a 16-layer model's start spent
    most of its warm-cache time tracing), and XLA inlines the calls, so the compiled program is the same as with
    the layers written out."""
    num_blocks = chunk_len // block_size

    @jax.jit
    def kv_fn(layer, x, k_pool, v_pool, positions, flat_pages):
        h = rms_norm(x, layer["attn_norm"], cfg.rms_norm_eps)
        q, k, v = _qkv(layer, h, positions, cfg)
        with jax.named_scope("kv_write"):
            # Written BEFORE attention: rows may be blocks of one request (multi-block prefill as one block per
            # row), and a row's prefix pages can be pages other rows write in this very call. A row never reads
            # its own write pages (its own K/V come in as k_new), so denoise steps are unaffected.
            # [R, C*B, Hkv, D] -> [Hkv, R*C, B, D], scattered into the chunk's pages.
            def to_pages(t):
                t = t.reshape(num_rows * num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
                return kv_to_storage(t.transpose(2, 0, 1, 3), k_pool.dtype)
            k_pool = k_pool.at[:, flat_pages].set(to_pages(k))
            v_pool = v_pool.at[:, flat_pages].set(to_pages(v))
        return q, k, v, k_pool, v_pool

    @jax.jit
    def rest_fn(layer, x, q, k, v, k_pool, v_pool, page_table, prefix_len):
        with jax.named_scope("attention"):
            attn = attention_fn(q, k, v, kv_values(k_pool), kv_values(v_pool), page_table, prefix_len,
                                block_size=block_size)
            x = x + _out_proj(layer, attn.reshape(num_rows, chunk_len, cfg.q_size))
        with jax.named_scope("mlp"):
            x = x + _mlp(layer, x, cfg)
        return x

    return kv_fn, rest_fn

