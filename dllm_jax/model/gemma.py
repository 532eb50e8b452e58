"""DiffusionGemma: the Gemma 4 text encoder and decoder as pure functions over the parameter pytree.

transformers' ``transformers.models.diffusion_gemma`` (5.24) is the reference; every rule below is its:

* **Encoder** (:func:`encode_chunk`): a causal Gemma 4 text model. It runs prompt chunks and finished canvases and
  writes their K/V into the paged pool, each token at ``page_table[r, pos // S]``, slot ``pos % S`` (``S``: the
  page size; chunks start anywhere, canvases are not aligned to pages). A sliding layer's query at ``q`` sees keys
  ``k`` with ``q - window < k <= q``; a full layer's, ``k <= q``.
* **Decoder** (:func:`decode_canvas`): the same layer stack (tied weights, or its own), bidirectional over the
  canvas, reading the prefix K/V and writing none. A sliding layer sees the last ``window - 1`` prefix tokens
  (what transformers' sliding cache layer keeps) and the whole canvas; a full layer, the whole prefix and canvas.
  The canvas embedding passes the self-conditioning block: ``post_norm(embed + mlp(pre_norm(soft)))`` with
  ``soft`` the previous step's soft embedding (zero on the first step).
* **Layers**: q / k RMSNorm (with scale), v RMSNorm without scale, attention scaling 1.0; full layers have their
  own head dim and KV heads, and no v projection: their values are the k projection's output (before the k norm
  and RoPE) through the v norm, so the pool keeps only that raw projection for them and derives K and V from it
  on read (half a full layer's KV bytes). RoPE per layer kind (default on sliding layers; "proportional" on full
  ones: the first ``partial * D / 2`` frequency pairs rotate, over the whole head dim). The feed-forward part sums
  a dense gated-GELU MLP and a mixture of experts (router: unscaled RMSNorm, ``* scale * H^-0.5``, softmax in
  float32, top-k renormalised, ``* per_expert_scale``), each with its norms, then a post-norm and
  ``layer_scalar``. Embeddings are scaled by ``sqrt(H)`` (in the model dtype); logits are soft-capped in float32.

The pool of one layer is a tuple: ``(k, v)`` for a sliding layer, ``(raw,)`` for a full one, each
``[kv_heads, pages, S, head_dim]`` in the layer's own dims (:func:`kv_layout`). Sliding and full layers read
through their own page tables (``page_tables["sliding"]`` / ``["full"]``, ``[R, W]`` each, by page of position):
a sliding layer never reads a page wholly older than its window, so its table may point such pages at the trash
page and the pool need not keep them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.config import ModelConfig
from dllm_jax.model.kv_layout import LayerKV
from dllm_jax.model.moe import contract, grouped_experts, linear
from dllm_jax.model.qwen3 import embed_tokens, kv_to_storage, kv_values
from dllm_jax.model.table import Params

SLIDING_KIND, FULL_KIND = "sliding", "full"  # page-table keys


def gelu_tanh(x):
    return jax.nn.gelu(x, approximate=True)


def rms_norm(x, weight=None, eps: float = 1e-6):
    """Gemma's RMSNorm: normalise in float32, times the weight in float32 (none: unscaled), back to x's dtype."""
    xf = x.astype(jnp.float32)
    out = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if weight is not None:
        out = out * weight.astype(jnp.float32)
    return out.astype(x.dtype)


def inv_freq(spec: tuple, head_dim: int) -> np.ndarray:
    """``[head_dim / 2]`` float32 inverse frequencies of a RoPE spec ``(rope_type, theta, partial, factor)``:
    ``default``: ``theta ** -(2i / D)``; ``proportional``: the first ``int(partial * D // 2)`` of those, the rest
    zero (those dims never rotate), divided by ``factor``."""
    rope_type, theta, partial, factor = spec
    if rope_type == "default":
        return (1.0 / (np.float32(theta) ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim))))\
            .astype(np.float32)
    angles = int(partial * head_dim // 2)
    rotated = 1.0 / (np.float32(theta) ** (np.arange(0, 2 * angles, 2, dtype=np.float32) / np.float32(head_dim)))
    out = np.concatenate([rotated, np.zeros(head_dim // 2 - angles, np.float32)]).astype(np.float32)
    return (out / np.float32(factor)).astype(np.float32)


def rope(x, positions, freqs: np.ndarray):
    """Rotate-half RoPE over the whole head dim. x ``[..., T, heads, D]``, positions ``[..., T]``; cos / sin are
    computed in float32 and cast to x's dtype (as transformers)."""
    angles = positions[..., None].astype(jnp.float32) * jnp.asarray(freqs)
    emb = jnp.concatenate([angles, angles], axis=-1)[..., None, :]
    cos, sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


@dataclasses.dataclass(frozen=True)
class LayerGeometry:
    sliding: bool
    head_dim: int
    kv_heads: int
    freqs: np.ndarray = dataclasses.field(compare=False, repr=False)


def geometry(cfg: ModelConfig, i: int) -> LayerGeometry:
    sliding = cfg.is_sliding_layer(i)
    head_dim = cfg.layer_head_dim(i)
    return LayerGeometry(sliding, head_dim, cfg.layer_kv_heads(i),
                         inv_freq(cfg.rope_sliding if sliding else cfg.rope_full, head_dim))


def kv_layout(cfg: ModelConfig):
    """What each layer keeps in the pool (:class:`~dllm_jax.model.kv_layout.LayerKV`): a sliding layer K and V of
    its window, a full layer the raw k projection alone."""
    out = []
    for i in range(cfg.num_layers):
        g = geometry(cfg, i)
        out.append(LayerKV(g.kv_heads, g.head_dim, window=cfg.sliding_window if g.sliding else None,
                           tensors=2 if g.sliding else 1))
    return tuple(out)


# ----------------------------------------------------------------------------------------------
# Layer pieces
# ----------------------------------------------------------------------------------------------

def _keys_values(layer, raw, v_raw, positions, g: LayerGeometry, cfg: ModelConfig):
    """K (k norm, RoPE) and V (v norm) from the raw k / v projections ``[..., T, Hkv, D]``."""
    k = rope(rms_norm(raw, layer["k_norm"], cfg.rms_norm_eps), positions, g.freqs)
    return k, rms_norm(v_raw, None, cfg.rms_norm_eps)


def _project(layer, h, positions, g: LayerGeometry, cfg: ModelConfig):
    """q ``[R, T, Hq, D]`` (normed, rotated), the K / V of these tokens, and what the pool stores for them."""
    lead = h.shape[:-1]
    q = linear(h, layer["q"]).reshape(*lead, cfg.num_heads, g.head_dim)
    q = rope(rms_norm(q, layer["q_norm"], cfg.rms_norm_eps), positions, g.freqs)
    raw = linear(h, layer["k"]).reshape(*lead, g.kv_heads, g.head_dim)
    v_raw = linear(h, layer["v"]).reshape(*lead, g.kv_heads, g.head_dim) if g.sliding else raw
    k, v = _keys_values(layer, raw, v_raw, positions, g, cfg)
    stored = (k, v) if g.sliding else (raw,)
    return q, k, v, stored


def _attend(q, k, v, visible):
    """Scaled-by-one GQA attention: q ``[R, T, Hq, D]``, k / v ``[R, S, Hkv, D]``, visible ``[R, T, S]`` bool.
    Scores and softmax in float32, probabilities cast to q's dtype (as transformers' eager / SDPA path)."""
    num_rows, t, num_heads, d = q.shape
    kv_heads = k.shape[2]
    qg = q.reshape(num_rows, t, kv_heads, num_heads // kv_heads, d)
    scores = jnp.einsum("rtkgd,rskd->rkgts", qg, k, preferred_element_type=jnp.float32)
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(jnp.isnan(probs), 0.0, probs).astype(q.dtype)
    out = jnp.einsum("rkgts,rskd->rtkgd", probs, v, preferred_element_type=jnp.float32).astype(q.dtype)
    return out.reshape(num_rows, t, num_heads * d)


def _feed_forward(layer, x, cfg: ModelConfig, layer_scalar):
    """The layer's second half on the post-attention residual ``x``: dense MLP + experts, norms, layer scalar."""
    eps = cfg.rms_norm_eps
    h = rms_norm(x, layer["pre_ff_norm"], eps)
    dense = linear(gelu_tanh(linear(h, layer["gate"])) * linear(h, layer["up"]), layer["down"])
    dense = rms_norm(dense, layer["post_ff_norm_1"], eps)

    flat = x.reshape(-1, x.shape[-1])
    # (the scalar multiplies at float32 and rounds once, as a torch tensor times a Python float)
    routed = rms_norm(flat, None, eps) * layer["router_scale"].astype(x.dtype)
    routed = (routed.astype(jnp.float32) * cfg.hidden_size ** -0.5).astype(x.dtype)
    probs = jax.nn.softmax(linear(routed, layer["router"]).astype(jnp.float32), axis=-1)
    weights, expert_ids = jax.lax.top_k(probs, cfg.num_experts_per_tok)
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    weights = weights * layer["expert_scale"].astype(jnp.float32)[expert_ids]
    experts = {"gate": layer["experts_gate"], "up": layer["experts_up"], "down": layer["experts_down"]}
    per_expert = grouped_experts(experts, rms_norm(flat, layer["pre_ff_norm_2"], eps), expert_ids.astype(jnp.int32),
                                 activation=gelu_tanh)
    sparse = jnp.einsum("nkh,nk->nh", per_expert.astype(jnp.float32), weights).astype(x.dtype).reshape(x.shape)
    sparse = rms_norm(sparse, layer["post_ff_norm_2"], eps)

    x = x + rms_norm(dense + sparse, layer["post_ff_norm"], eps)
    return x * layer_scalar.astype(x.dtype)


def _embed(table, tokens, cfg: ModelConfig):
    return embed_tokens(table, tokens) * jnp.asarray(cfg.hidden_size ** 0.5, table.dtype)


# ----------------------------------------------------------------------------------------------
# Paged pool
# ----------------------------------------------------------------------------------------------

def _write(pool, values, pages, slots):
    """Scatter ``values [R, T, Hkv, D]`` into ``pool [Hkv, P, S, D]`` at (page, slot) ``[R, T]`` each."""
    return pool.at[:, pages, slots].set(kv_to_storage(values.transpose(2, 0, 1, 3), pool.dtype))


def _gather(pool, table):
    """A row's pages in position order: ``[R, W*S, Hkv, D]`` values."""
    pages = kv_values(pool)[:, table]  # [Hkv, R, W, S, D]
    hkv, num_rows, width, size, d = pages.shape
    return pages.reshape(hkv, num_rows, width * size, d).transpose(1, 2, 0, 3)


def _prefix_kv(layer, pool, table, g: LayerGeometry, cfg: ModelConfig, dtype):
    """The prefix K / V a layer reads, ``[R, W*S, Hkv, D]`` each. A full layer derives them from the raw k with
    the k norm of ``layer``, which must be the ENCODER's layer (it wrote them; an untied decoder has its own)."""
    if g.sliding:
        return _gather(pool[0], table).astype(dtype), _gather(pool[1], table).astype(dtype)
    raw = _gather(pool[0], table).astype(dtype)
    positions = jnp.broadcast_to(jnp.arange(raw.shape[1], dtype=jnp.int32), raw.shape[:2])
    return _keys_values(layer, raw, raw, positions, g, cfg)


def _table(page_tables, g: LayerGeometry):
    return page_tables[SLIDING_KIND if g.sliding else FULL_KIND]


# ----------------------------------------------------------------------------------------------
# Encoder and decoder
# ----------------------------------------------------------------------------------------------

def encode_chunk(params: Params, cfg: ModelConfig, tokens, prefix_len, num_tokens, kv_pages, page_tables, *,
                 return_hidden: bool = False, images=None):
    """Encode a chunk per row and write its K/V: tokens ``[R, T]`` at positions ``prefix_len[r] + t``, the first
    ``num_tokens[r]`` of them real (the others write to the trash page). Returns the new pool (and the final hidden
    states ``[R, T, H]`` with ``return_hidden``).

    ``images`` (prompts with images): ``(features [F, H], index [R, T], group [R, T])``: a position whose index is
    ``>= 0`` takes that row of the image features (:func:`dllm_jax.model.vision.image_features`, projected) as its
    embedding; positions of one group ``>= 0`` (the tokens of one image, whole in the chunk, when the config asks
    for bidirectional attention over vision tokens) also see each other both ways, on every layer."""
    num_rows, chunk = tokens.shape
    t = jnp.arange(chunk, dtype=jnp.int32)
    positions = prefix_len[:, None].astype(jnp.int32) + t[None, :]
    real = t[None, :] < num_tokens[:, None]
    x = _embed(params["embed"], tokens, cfg)
    causal = t[None, :, None] >= t[None, None, :]  # [1, T, T] query t sees chunk key t' <= t
    together = None
    if images is not None:
        features, index, group = images
        x = jnp.where((index >= 0)[..., None], features.astype(x.dtype)[jnp.maximum(index, 0)], x)
        together = (group[:, :, None] == group[:, None, :]) & (group[:, :, None] >= 0)  # [R, T, T]
    window = cfg.sliding_window or 0
    new_pages = []
    for i, (layer, pool) in enumerate(zip(params["layers"], kv_pages)):
        g = geometry(cfg, i)
        table = _table(page_tables, g)
        size = pool[0].shape[2]
        pages = jnp.where(real, jnp.take_along_axis(table, positions // size, axis=1), 0)
        slots = positions % size
        h = rms_norm(x, layer["attn_norm"], cfg.rms_norm_eps)
        q, k, v, stored = _project(layer, h, positions, g, cfg)
        pk, pv = _prefix_kv(layer, pool, table, g, cfg, x.dtype)
        key_pos = jnp.arange(pk.shape[1], dtype=jnp.int32)[None, None, :]
        prefix_visible = jnp.broadcast_to(key_pos < prefix_len[:, None, None], (num_rows, chunk, pk.shape[1]))
        own_visible = jnp.broadcast_to(causal, (num_rows, chunk, chunk))
        if g.sliding:
            prefix_visible &= positions[:, :, None] - key_pos < window
            own_visible &= (t[None, :, None] - t[None, None, :]) < window
        if together is not None:  # (causal, windowed) OR the same image: transformers' blockwise overlay
            own_visible |= together
        attn = _attend(q, jnp.concatenate([pk, k], 1), jnp.concatenate([pv, v], 1),
                       jnp.concatenate([prefix_visible, own_visible], -1))
        x = x + rms_norm(linear(attn, layer["o"]), layer["post_attn_norm"], cfg.rms_norm_eps)
        x = _feed_forward(layer, x, cfg, layer["layer_scalar"])
        new_pages.append(tuple(_write(p, s, pages, slots) for p, s in zip(pool, stored)))
    if return_hidden:
        return new_pages, rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    return new_pages


def decoder_weights(params: Params, cfg: ModelConfig):
    """(embedding, final norm, layers) the decoder runs: the shared ones of a tied checkpoint (each layer with the
    decoder's own ``layer_scalar``), or its own."""
    if cfg.tie_word_embeddings:
        layers = [{**layer, "layer_scalar": layer["dec_layer_scalar"]} for layer in params["layers"]]
        return params["embed"], params["final_norm"], layers
    return params["dec_embed"], params["dec_final_norm"], params["dec_layers"]


def soft_embedding(params: Params, cfg: ModelConfig, logits):
    """The self-conditioning input from processed logits ``[..., V]``: ``softmax(logits) @ E * sqrt(H)`` (the
    probabilities cast to the embedding's dtype first, as transformers)."""
    embed = decoder_weights(params, cfg)[0]
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(embed.dtype)
    soft = jnp.dot(probs, embed, preferred_element_type=jnp.float32).astype(probs.dtype)  # probs [.., V] @ [V, H]
    return soft * jnp.asarray(cfg.hidden_size ** 0.5, embed.dtype)


def decode_canvas(params: Params, cfg: ModelConfig, canvas, prefix_len, kv_pages, page_tables, self_conditioning=None):
    """The decoder over canvas rows: canvas ``[R, C]`` at positions ``prefix_len[r] + c``, reading the prefix
    K/V (no write), with the self-conditioning input ``[R, C, H]`` (None: the first step's zeros). Returns the
    final hidden states ``[R, C, H]`` (:func:`logits` turns them into logits)."""
    embed, final_norm, layers = decoder_weights(params, cfg)
    num_rows, length = canvas.shape
    positions = prefix_len[:, None].astype(jnp.int32) + jnp.arange(length, dtype=jnp.int32)[None, :]
    x = _embed(embed, canvas, cfg)
    soft = jnp.zeros_like(x) if self_conditioning is None else self_conditioning.astype(x.dtype)
    h = rms_norm(soft, params["sc_pre_norm"], cfg.rms_norm_eps)
    x = rms_norm(x + linear(gelu_tanh(linear(h, params["sc_gate"])) * linear(h, params["sc_up"]), params["sc_down"]),
                 None, cfg.rms_norm_eps)
    window = cfg.sliding_window or 0
    own_visible = jnp.ones((num_rows, length, length), bool)
    for i, (layer, pool) in enumerate(zip(layers, kv_pages)):
        g = geometry(cfg, i)
        h = rms_norm(x, layer["attn_norm"], cfg.rms_norm_eps)
        q, k, v, _ = _project(layer, h, positions, g, cfg)
        pk, pv = _prefix_kv(params["layers"][i], pool, _table(page_tables, g), g, cfg, x.dtype)
        key_pos = jnp.arange(pk.shape[1], dtype=jnp.int32)[None, :]
        prefix_visible = key_pos < prefix_len[:, None]
        if g.sliding:  # the last window - 1 prefix tokens (transformers' sliding cache layer)
            prefix_visible &= key_pos >= prefix_len[:, None] - (window - 1)
        prefix_visible = jnp.broadcast_to(prefix_visible[:, None, :], (num_rows, length, pk.shape[1]))
        attn = _attend(q, jnp.concatenate([pk, k], 1), jnp.concatenate([pv, v], 1),
                       jnp.concatenate([prefix_visible, own_visible], -1))
        x = x + rms_norm(linear(attn, layer["o"]), layer["post_attn_norm"], cfg.rms_norm_eps)
        x = _feed_forward(layer, x, cfg, layer["layer_scalar"])
    return rms_norm(x, final_norm, cfg.rms_norm_eps)


def logits(params: Params, cfg: ModelConfig, hidden):
    """Soft-capped float32 logits ``[..., V]`` (the ``[V, H]`` head, or the tied decoder embedding, as stored)."""
    out = contract(hidden, params["lm_head"] if "lm_head" in params else decoder_weights(params, cfg)[0])
    cap = cfg.final_logit_softcapping
    return out if cap is None else cap * jnp.tanh(out / cap)


# Jitted entry points (the config static: one compile per config and shape).
encode_chunk_jit = jax.jit(encode_chunk, static_argnums=1, static_argnames="return_hidden")
decode_canvas_jit = jax.jit(decode_canvas, static_argnums=1)
logits_jit = jax.jit(logits, static_argnums=1)
soft_embedding_jit = jax.jit(soft_embedding, static_argnums=1)


def init_kv_pages(cfg: ModelConfig, num_pages: dict, page_size: int, dtype=jnp.float32):
    """An empty pool: per layer a tuple of ``[Hkv, pages, S, D]`` arrays (``num_pages`` by kind: the sliding
    layers' pool may be smaller than the full layers')."""
    from dllm_jax.model.qwen3 import kv_storage_dtype

    store = kv_storage_dtype(dtype)
    pools = []
    for i in range(cfg.num_layers):
        g = geometry(cfg, i)
        shape = (g.kv_heads, num_pages[SLIDING_KIND if g.sliding else FULL_KIND], page_size, g.head_dim)
        pools.append(tuple(jnp.zeros(shape, store) for _ in range(2 if g.sliding else 1)))
    return pools

