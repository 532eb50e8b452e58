"""SDAR / Qwen3 dense decoder as pure functions over a parameter pytree.

Parameters are a plain dict pytree; matrices are stored ``[in, out]`` (HF stores ``[out, in]``; the
loader transposes once). Layers are a list of dicts so that each layer's weights and KV pages are
separate buffers (clean donation, simple sharding).

Two entry points:

* :func:`forward_full` -- a whole sequence under an arbitrary boolean attention mask (tests, training).
* :func:`forward_chunk` -- the engine's path: a chunk of ``C`` blocks per row against that row's paged
  prefix KV, writing the chunk's K/V into its pages. A denoise step is a chunk of one block.

Logits at position ``i`` predict token ``i`` (no shift): that is how SDAR is trained.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.config import ModelConfig

Params = dict[str, Any]


# ----------------------------------------------------------------------------------------------
# Parameters
# ----------------------------------------------------------------------------------------------

def param_shapes(cfg: ModelConfig) -> Params:
    """Shapes of every parameter, in the pytree layout the model uses."""
    h, d = cfg.hidden_size, cfg.head_dim
    layer = {
        "attn_norm": (h,),
        "q": (h, cfg.q_size),
        "k": (h, cfg.kv_size),
        "v": (h, cfg.kv_size),
        "o": (cfg.q_size, h),
        "q_norm": (d,),
        "k_norm": (d,),
        "mlp_norm": (h,),
        "gate": (h, cfg.intermediate_size),
        "up": (h, cfg.intermediate_size),
        "down": (cfg.intermediate_size, h),
    }
    if cfg.attention_bias:
        layer.update({"q_bias": (cfg.q_size,), "k_bias": (cfg.kv_size,), "v_bias": (cfg.kv_size,)})
    shapes: Params = {
        "embed": (cfg.vocab_size, h),
        "layers": [dict(layer) for _ in range(cfg.num_layers)],
        "final_norm": (h,),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (h, cfg.vocab_size)
    return shapes


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32, std: float = 0.02) -> Params:
    """Random parameters (norm weights one, matrices N(0, std))."""
    shapes = param_shapes(cfg)
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
        shapes, is_leaf=lambda x: isinstance(x, tuple))[0]]
    keys = jax.random.split(key, len(leaves))
    out = []
    for path, shape, k in zip(paths, leaves, keys):
        if "norm" in path:
            out.append(jnp.ones(shape, dtype))
        elif "bias" in path:
            out.append(jnp.zeros(shape, dtype))
        else:
            out.append((std * jax.random.normal(k, shape, jnp.float32)).astype(dtype))
    return jax.tree.unflatten(treedef, out)


def lm_head_matrix(params: Params) -> jax.Array:
    """``[H, V]``: the untied head or the transposed embedding."""
    return params["lm_head"] if "lm_head" in params else params["embed"].T


# ----------------------------------------------------------------------------------------------
# Building blocks
# ----------------------------------------------------------------------------------------------

def rms_norm(x, weight, eps):
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def rope(x, positions, cfg: ModelConfig):
    """Rotary embedding over the full head dim (rotate-half layout, as Qwen3). x: [..., T, heads, D]."""
    d = x.shape[-1]
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float32) / d))
    pos = positions.astype(jnp.float32) / cfg.rope_scaling_factor
    angles = pos[..., None] * inv_freq  # [..., T, D/2]
    cos = jnp.cos(angles)[..., None, :]
    sin = jnp.sin(angles)[..., None, :]
    cos = jnp.concatenate([cos, cos], axis=-1)
    sin = jnp.concatenate([sin, sin], axis=-1)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin).astype(x.dtype)


def _qkv(layer, x, positions, cfg: ModelConfig):
    """Project, q/k-normalise and rotate. Returns q [.., T, Hq, D], k/v [.., T, Hkv, D]."""
    q = x @ layer["q"]
    k = x @ layer["k"]
    v = x @ layer["v"]
    if cfg.attention_bias:
        q, k, v = q + layer["q_bias"], k + layer["k_bias"], v + layer["v_bias"]
    lead = x.shape[:-1]
    q = q.reshape(*lead, cfg.num_heads, cfg.head_dim)
    k = k.reshape(*lead, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(*lead, cfg.num_kv_heads, cfg.head_dim)
    q = rms_norm(q, layer["q_norm"], cfg.rms_norm_eps)
    k = rms_norm(k, layer["k_norm"], cfg.rms_norm_eps)
    return rope(q, positions, cfg), rope(k, positions, cfg), v


def _mlp(layer, x, cfg: ModelConfig):
    h = rms_norm(x, layer["mlp_norm"], cfg.rms_norm_eps)
    return (jax.nn.silu(h @ layer["gate"]) * (h @ layer["up"])) @ layer["down"]


def logits_from_hidden(params: Params, hidden):
    return jnp.dot(hidden, lm_head_matrix(params), preferred_element_type=jnp.float32)


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
            x = x + attn.reshape(n, s, cfg.q_size).astype(x.dtype) @ layer["o"]
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

def forward_chunk(params: Params, cfg: ModelConfig, tokens, kv_pages, page_table, prefix_len, write_pages,
                  *, block_size: int, attention_fn):
    """Run a chunk of ``C`` blocks per row against the paged prefix and write its K/V.

    tokens ``[R, C*B]``; the chunk of row ``r`` starts at absolute position ``prefix_len[r]``.
    kv_pages: list over layers of ``(k, v)``, each ``[Hkv, P, B, D]``. page_table ``[R, W]``.
    write_pages ``[R, C]``: the page each chunk block's K/V goes to (page 0 is the trash page used by
    padding). ``attention_fn`` has the signature of
    :func:`pallas_kernels.paged_block_attention.paged_block_attention_reference`.
    Returns (final hidden states ``[R, C*B, H]``, new kv_pages).
    """
    num_rows, chunk_len = tokens.shape
    num_blocks = chunk_len // block_size
    positions = prefix_len[:, None] + jnp.arange(chunk_len, dtype=prefix_len.dtype)[None, :]
    x = params["embed"][tokens]
    flat_pages = write_pages.reshape(-1)
    new_pages = []
    for layer, (k_pool, v_pool) in zip(params["layers"], kv_pages):
        with jax.named_scope("attention"):
            h = rms_norm(x, layer["attn_norm"], cfg.rms_norm_eps)
            q, k, v = _qkv(layer, h, positions, cfg)
            attn = attention_fn(q, k, v, k_pool, v_pool, page_table, prefix_len, block_size=block_size)
            x = x + attn.reshape(num_rows, chunk_len, cfg.q_size) @ layer["o"]
        with jax.named_scope("kv_write"):
            # [R, C*B, Hkv, D] -> [Hkv, R*C, B, D], scattered into the chunk's pages.
            def to_pages(t):
                t = t.reshape(num_rows * num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
                return t.transpose(2, 0, 1, 3).astype(k_pool.dtype)
            k_pool = k_pool.at[:, flat_pages].set(to_pages(k))
            v_pool = v_pool.at[:, flat_pages].set(to_pages(v))
            new_pages.append((k_pool, v_pool))
        with jax.named_scope("mlp"):
            x = x + _mlp(layer, x, cfg)
    hidden = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    return hidden, new_pages


def num_params(params: Params) -> int:
    return int(sum(math.prod(x.shape) for x in jax.tree.leaves(params)))
