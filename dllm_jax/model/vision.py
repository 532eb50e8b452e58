"""DiffusionGemma's vision tower (Gemma 4's) and its projector, as a pure function over their parameter pytree.

transformers 5.24 (``Gemma4VisionModel``, ``DiffusionGemmaMultimodalEmbedder``, ``DiffusionGemmaEncoderModel``)
is the reference; every rule below is its:

* **Patches in**: the image processor resizes an image (aspect kept) to at most ``max_patches`` patches of
  ``patch x patch`` pixels in ``[0, 1]``, flattens each patch (``3 * patch**2`` values) and pads the list to
  ``max_patches`` with zero patches at position ``(-1, -1)``: so every image has the same shape, one compile.
* **Patch embedding**: ``(2 * (p - 0.5)) @ input_proj`` plus the x and y rows of a learned 2-D position table
  (zero for padding patches).
* **Encoder layers**: bidirectional attention over the real patches (padding keys masked), q / k RMSNorm with
  scale, v RMSNorm without, scaling 1.0, 2-D RoPE (the head dim split in halves: the first rotated by the x
  coordinate, the second by y; theta ``rope_theta``); a gated-GELU MLP; four norms per layer. With
  ``use_clipped_linears`` every linear clamps its input and output to stored bounds.
* **Pooling**: padding states zeroed, then each ``k x k`` block of patches (``k = pooling_kernel_size``) averaged
  (in float32) into one soft token, times ``sqrt(hidden)``; ``standardize`` subtracts / scales by stored vectors.
  An image of ``n`` real patches gives ``n / k**2`` soft tokens, the first ones of its output (the others are
  padding).
* **Projector** (``embed_vision``): RMSNorm without scale, then a linear to the text hidden size. These rows
  replace the embeddings at the image-token positions of the prompt (not scaled by ``sqrt(H)``).

The encoder then attends over the prompt as usual; with ``use_bidirectional_attention: "vision"`` the tokens of one
image (a run of image tokens) also see each other both ways, on every layer, whatever the window.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.config import ConfigError


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """The vision tower's shape (``vision_config``) and the prompt's image tokens (the top-level config)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    patch_size: int
    pooling_kernel_size: int
    position_embedding_size: int
    rope_theta: float
    rms_norm_eps: float
    clipped_linears: bool
    standardize: bool
    image_token_id: int
    boi_token_id: int
    eoi_token_id: int
    bidirectional: bool  # text_config.use_bidirectional_attention == "vision"

    @classmethod
    def from_hf_dict(cls, hf: dict, source: str = "config.json") -> "VisionConfig | None":
        """None when the config has no ``vision_config`` (a text-only checkpoint)."""
        v = hf.get("vision_config")
        if not isinstance(v, dict):
            return None
        if v.get("model_type", "gemma4_vision") != "gemma4_vision":
            raise ConfigError(f"{source}: vision_config.model_type {v.get('model_type')!r} is not supported "
                              f"(only 'gemma4_vision')")
        rope = v.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ConfigError(f"{source}: vision_config.rope_parameters.rope_type must be 'axial'")
        act = v.get("hidden_activation", "gelu_pytorch_tanh")
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ConfigError(f"{source}: vision_config.hidden_activation {act!r} is not supported")
        hidden, heads = int(v.get("hidden_size", 768)), int(v.get("num_attention_heads", 12))
        text = hf.get("text_config") or {}
        return cls(hidden_size=hidden, intermediate_size=int(v.get("intermediate_size", 3072)),
                   num_layers=int(v.get("num_hidden_layers", 16)), num_heads=heads,
                   num_kv_heads=int(v.get("num_key_value_heads", heads)),
                   head_dim=int(v.get("head_dim") or hidden // heads), patch_size=int(v.get("patch_size", 16)),
                   pooling_kernel_size=int(v.get("pooling_kernel_size", 3)),
                   position_embedding_size=int(v.get("position_embedding_size", 10 * 1024)),
                   rope_theta=float(rope.get("rope_theta", 100.0)), rms_norm_eps=float(v.get("rms_norm_eps", 1e-6)),
                   clipped_linears=bool(v.get("use_clipped_linears", False)),
                   standardize=bool(v.get("standardize", False)),
                   image_token_id=int(hf.get("image_token_id", 258_880)),
                   boi_token_id=int(hf.get("boi_token_id", 255_999)),
                   eoi_token_id=int(hf.get("eoi_token_id", 258_882)),
                   bidirectional=text.get("use_bidirectional_attention") == "vision")

    @classmethod
    def from_model_dir(cls, model_dir: str) -> "VisionConfig | None":
        path = os.path.join(model_dir, "config.json")
        with open(path) as f:
            return cls.from_hf_dict(json.load(f), source=path)


# ----------------------------------------------------------------------------------------------
# The forward
# ----------------------------------------------------------------------------------------------

def _rms_norm(x, weight, eps):
    xf = x.astype(jnp.float32)
    out = xf * jnp.power(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps, -0.5)
    if weight is not None:
        out = out * weight.astype(jnp.float32)
    return out.astype(x.dtype)


def _linear(x, w, clip=None):
    """``x @ w.T`` (``w`` stored ``[out, in]``), clamped in and out by ``clip`` = (in_min, in_max, out_min,
    out_max) when the tower has clipped linears."""
    if clip is not None:
        x = jnp.clip(x, clip[0].astype(x.dtype), clip[1].astype(x.dtype))
    y = jnp.einsum("...i,oi->...o", x, w.astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)
    if clip is not None:
        y = jnp.clip(y, clip[2].astype(y.dtype), clip[3].astype(y.dtype))
    return y


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1) * sin


def _rope_2d(x, positions, theta):
    """x ``[N, P, heads, D]``; positions ``[N, P, 2]`` (x, y). The first half of the head dim turns with x, the
    second with y, each half rotate-half RoPE over ``D / 4`` frequencies (cos / sin cast to x's dtype)."""
    d = x.shape[-1]
    spatial = d // 2
    inv = 1.0 / (np.float32(theta) ** (np.arange(0, spatial, 2, dtype=np.float32) / np.float32(spatial)))
    angles = positions[..., None].astype(jnp.float32) * jnp.asarray(inv)  # [N, P, 2, D/4]
    out = []
    for axis in range(2):
        a = jnp.concatenate([angles[:, :, axis], angles[:, :, axis]], axis=-1)[:, :, None, :]
        part = x[..., axis * spatial:(axis + 1) * spatial]
        out.append(_rotate(part, jnp.cos(a).astype(x.dtype), jnp.sin(a).astype(x.dtype)))
    return jnp.concatenate(out, axis=-1)


def _attention(layer, h, positions, real, vcfg: VisionConfig):
    n, p, _ = h.shape
    d = vcfg.head_dim
    clip = layer.get
    q = _linear(h, layer["q"], clip("q_clip")).reshape(n, p, vcfg.num_heads, d)
    k = _linear(h, layer["k"], clip("k_clip")).reshape(n, p, vcfg.num_kv_heads, d)
    v = _linear(h, layer["v"], clip("v_clip")).reshape(n, p, vcfg.num_kv_heads, d)
    q = _rope_2d(_rms_norm(q, layer["q_norm"], vcfg.rms_norm_eps), positions, vcfg.rope_theta)
    k = _rope_2d(_rms_norm(k, layer["k_norm"], vcfg.rms_norm_eps), positions, vcfg.rope_theta)
    v = _rms_norm(v, None, vcfg.rms_norm_eps)
    groups = vcfg.num_heads // vcfg.num_kv_heads
    qg = q.reshape(n, p, vcfg.num_kv_heads, groups, d)
    scores = jnp.einsum("npkgd,nskd->nkgps", qg, k, preferred_element_type=jnp.float32)
    scores = jnp.where(real[:, None, None, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(h.dtype)
    out = jnp.einsum("nkgps,nskd->npkgd", probs, v, preferred_element_type=jnp.float32).astype(h.dtype)
    return _linear(out.reshape(n, p, vcfg.num_heads * d), layer["o"], clip("o_clip"))


def image_features(vparams, pixel_values, positions, vcfg: VisionConfig):
    """Soft tokens of a batch of images in the text model's space: pixel_values ``[N, P, 3 * patch**2]`` in
    ``[0, 1]``, positions ``[N, P, 2]`` int32 (padding ``-1``) -> ``[N, P / k**2, text hidden]`` (an image's
    real soft tokens first, the rest padding), in ``vparams``' dtype."""
    dtype = vparams["patch_proj"].dtype
    eps = vcfg.rms_norm_eps
    pad = jnp.all(positions == -1, axis=-1)  # [N, P]
    x = (2.0 * (pixel_values.astype(jnp.float32) - 0.5)).astype(dtype)
    h = _linear(x, vparams["patch_proj"])
    clamped = jnp.maximum(positions, 0)
    table = vparams["pos_table"].astype(dtype)
    pos_emb = table[0][clamped[..., 0]] + table[1][clamped[..., 1]]
    h = h + jnp.where(pad[..., None], jnp.zeros((), dtype), pos_emb)
    for layer in vparams["layers"]:
        a = _attention(layer, _rms_norm(h, layer["attn_norm"], eps), positions, ~pad, vcfg)
        h = h + _rms_norm(a, layer["post_attn_norm"], eps)
        m = _rms_norm(h, layer["pre_ff_norm"], eps)
        m = _linear(jax.nn.gelu(_linear(m, layer["gate"], layer.get("gate_clip")), approximate=True)
                    * _linear(m, layer["up"], layer.get("up_clip")), layer["down"], layer.get("down_clip"))
        h = h + _rms_norm(m, layer["post_ff_norm"], eps)
    h = jnp.where(pad[..., None], jnp.zeros((), dtype), h)
    k = vcfg.pooling_kernel_size
    num_patches = h.shape[1]
    out_len = num_patches // (k * k)
    if out_len != num_patches:  # average each k x k block of patches (padding: position (0, 0), state zero)
        max_x = jnp.max(clamped[..., 0], axis=-1, keepdims=True) + 1
        kernel = clamped // k
        kernel = kernel[..., 0] + (max_x // k) * kernel[..., 1]  # [N, P]
        weights = jax.nn.one_hot(kernel, out_len, dtype=jnp.float32) / (k * k)  # [N, P, L]
        h = jnp.einsum("npl,nph->nlh", weights, h.astype(jnp.float32)).astype(dtype)
    h = h.astype(jnp.float32) * np.float32(vcfg.hidden_size ** 0.5)
    if vcfg.standardize:
        h = (h - vparams["std_bias"].astype(jnp.float32)) * vparams["std_scale"].astype(jnp.float32)
    h = h.astype(dtype)
    return _linear(_rms_norm(h, None, eps), vparams["proj"])


image_features_jit = jax.jit(image_features, static_argnames="vcfg")


# ----------------------------------------------------------------------------------------------
# Host planning: one tower call per encode, and where each soft token goes
# ----------------------------------------------------------------------------------------------

def tower_batch(images) -> tuple[np.ndarray, np.ndarray, dict]:
    """The distinct images of an encode stacked for one tower call (``pixel_values``, ``positions``; the count
    padded to a power of two with copies of the first: a compile per bucket) and each image's batch slot (by
    ``id``). ``images``: objects with ``pixel_values`` / ``positions`` (:class:`dllm_jax.engine.images.PreparedImage`)."""
    distinct = list({id(img): img for img in images}.values())
    batch = 1 << max(0, len(distinct) - 1).bit_length()
    padded = distinct + [distinct[0]] * (batch - len(distinct))
    return (np.stack([img.pixel_values for img in padded]), np.stack([img.positions for img in padded]),
            {id(img): i for i, img in enumerate(distinct)})


def placement(rows: int, chunk: int, per_image: int, row_images, slots: dict, bidirectional: bool):
    """``encode_chunk``'s image index and groups ``[rows, chunk]`` int32 (-1: text): row ``r``'s entries
    ``(image, offset in the chunk, first soft token, count)`` take rows ``slot * per_image + first ...`` of the
    flattened tower output; each entry is its own group when the config asks for bidirectional vision attention."""
    index = np.full((rows, chunk), -1, np.int32)
    group = np.full((rows, chunk), -1, np.int32)
    for r, entries in enumerate(row_images):
        for g, (img, offset, first, count) in enumerate(entries or ()):
            index[r, offset:offset + count] = slots[id(img)] * per_image + first + np.arange(count)
            if bidirectional:
                group[r, offset:offset + count] = g
    return index, group
