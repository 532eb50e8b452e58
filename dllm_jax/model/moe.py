"""Sparse mixture-of-experts MLP: routing, then a grouped matmul over tokens sorted by expert.

Routing (:func:`route`) covers the Qwen3-MoE and BailingMoE-v2 / LLaDA2 variants:

1. scores = softmax or sigmoid of the router logits (float32);
2. choice scores = scores (+ ``expert_bias``: the bias decides WHICH experts, never how much they weigh);
3. group limit: experts form ``n_group`` groups; a group's score is the sum of its two best choice scores when
   an expert bias is used (DeepSeek-V3 / Bailing-v2 convention), else its best score (DeepSeek-V2); only the
   ``topk_group`` best groups stay eligible;
4. top-k over the eligible choice scores;
5. weights = the UNBIASED scores of the chosen experts, renormalised to sum one if ``norm_topk_prob``, times
   ``routed_scaling_factor``.

The experts (:func:`moe_mlp`) run without a Python loop over experts: the ``N * k`` (token, expert) pairs are
sorted by expert and ``jax.lax.ragged_dot`` multiplies each contiguous group by its expert's weights. There is
no capacity limit and nothing is dropped, so a token's output depends only on that token (not on what else is in
the batch), and every shape is static (``N * k`` rows) under ``jit``. Shared experts, if any, run as one dense
SwiGLU and are added unscaled.

Expert weights are stacked ``[E, out, in]`` (each expert's matrix as the checkpoint stores it; gate|up fused into one
``gate_up`` leaf, :mod:`dllm_jax.model.fused`) so a later ``expert``
mesh axis can shard their leading axis; like every matrix here they are contracted on their last axis.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dllm_jax.config import ModelConfig
from dllm_jax.model.compute_layout import InOut
from dllm_jax.model.fused_layout import fused_axis_groups


def contract(x, w):
    """``x [..., in] . w [out, in] -> [..., out]`` accumulated in float32 (float32 out): ``x @ w.T`` without the
    transpose. A matrix is stored ``[out, in]`` as checkpoints store it; XLA (cuBLAS, XLA:CPU's dot kernels) takes
    the transposed operand as it is, and on XLA:CPU this order measured as fast as or faster than ``x @ w`` over an
    ``[in, out]`` matrix at the 1.7B shape (bf16 8 rows: 2048 -> 6144 in 5-8 ms vs 14 ms; bench/RESULTS.md), though
    slower for small matrices at a few dozen rows (the shipped model's call: 3.5 vs 3.1 ms; issue 50).

    The rows are flattened to one axis first: with a 3D ``x`` inside a device loop, XLA:CPU lays the loop's weights
    out ``[in, out]`` and copies every matrix so at each call (all the weights again, and slower), which a 2D dot
    does not make it do. ``w`` may also be an :class:`~dllm_jax.model.compute_layout.InOut` copy (small models on
    XLA:CPU), contracted on its first axis."""
    lead = x.shape[:-1]
    if isinstance(w, InOut):  # an [in, out] compute copy (dllm_jax.model.compute_layout): its first axis
        out = jax.lax.dot_general(x.reshape(-1, x.shape[-1]), w.t, (((1,), (0,)), ((), ())),
                                  preferred_element_type=jnp.float32)
    else:
        out = jax.lax.dot_general(x.reshape(-1, x.shape[-1]), w, (((1,), (1,)), ((), ())),
                                  preferred_element_type=jnp.float32)
    return out.reshape(*lead, w.shape[0])


def linear(x, w):
    """``x @ w.T`` for a stored ``[out, in]`` matrix, accumulated in float32 and returned in ``x``'s dtype. For
    float32 this is the plain product; for bfloat16 it is what GPUs do anyway, and on XLA:CPU it is ~10x faster than
    a bf16-output dot (measured on a 1.7B-shaped layer: 1.5 ms vs 14 ms for 8 tokens)."""
    return contract(x, w).astype(x.dtype)


def split_gate_up(y, cfg: ModelConfig, axis: str = "gate_up"):
    """The gate and up halves of a fused gate|up product ``y [..., 2I]`` (shard-major rows,
    :mod:`dllm_jax.model.fused`: ``[..., g, 2, I/g]``), each ``[..., I]``."""
    lead = y.shape[:-1]
    g = fused_axis_groups(cfg, axis, y.shape[-1])
    y = y.reshape(*lead, g, 2, -1)
    return y[..., 0, :].reshape(*lead, -1), y[..., 1, :].reshape(*lead, -1)


def swiglu(x, gate_up, down, cfg: ModelConfig):
    """Dense SwiGLU MLP ``down(silu(gate x) * (up x))`` over the fused ``gate_up`` leaf: one matmul for both
    (products accumulated in float32)."""
    gate, up = split_gate_up(linear(x, gate_up), cfg)
    return linear(jax.nn.silu(gate) * up, down)


def router_logits(moe, x, cfg: ModelConfig):
    """``[N, E]`` float32 router logits; computed in float32 when the checkpoint asks for an fp32 router."""
    if cfg.router_fp32:
        return contract(x.astype(jnp.float32), moe["router"].astype(jnp.float32))
    router = moe["router"].astype(x.dtype)
    return jax.lax.dot_general(x, router, (((x.ndim - 1,), (1,)), ((), ()))).astype(jnp.float32)


def route(logits, cfg: ModelConfig, expert_bias=None):
    """Choose ``k`` experts per token. logits ``[N, E]`` float32 -> (expert ids ``[N, k]`` int32,
    weights ``[N, k]`` float32). See the module docstring for the exact rule."""
    num_tokens, num_experts = logits.shape
    k = cfg.num_experts_per_tok
    if cfg.moe_score_func == "sigmoid":
        scores = jax.nn.sigmoid(logits)
    else:
        scores = jax.nn.softmax(logits, axis=-1)
    choice = scores if expert_bias is None else scores + expert_bias.astype(jnp.float32)
    if cfg.moe_n_group > 1 and cfg.moe_topk_group < cfg.moe_n_group:
        grouped = choice.reshape(num_tokens, cfg.moe_n_group, num_experts // cfg.moe_n_group)
        if expert_bias is not None:
            group_score = jax.lax.top_k(grouped, 2)[0].sum(axis=-1)
        else:
            group_score = grouped.max(axis=-1)
        _, best_groups = jax.lax.top_k(group_score, cfg.moe_topk_group)  # [N, topk_group]
        keep = jnp.zeros((num_tokens, cfg.moe_n_group), bool).at[
            jnp.arange(num_tokens)[:, None], best_groups].set(True)
        keep = jnp.repeat(keep, num_experts // cfg.moe_n_group, axis=1)
        choice = jnp.where(keep, choice, -jnp.inf)
    _, expert_ids = jax.lax.top_k(choice, k)
    weights = jnp.take_along_axis(scores, expert_ids, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    weights = weights * cfg.routed_scaling_factor
    return expert_ids.astype(jnp.int32), weights


# rows [N, in] grouped along axis 0 against stacked experts [E, out, in]: contract in with in, group by axis 0.
_RAGGED_OUT_IN = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((1,), (2,)), ((), ())),
                                                   lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])


def grouped_experts(moe, x, expert_ids, activation=jax.nn.silu, cfg: ModelConfig | None = None):
    """Every (token, chosen expert) pair's gated-MLP output ``down(act(x @ gate) * (x @ up))``, ``[N, k, H]``, via
    a grouped matmul (``activation``: SiLU for SwiGLU experts; DiffusionGemma's are tanh-GELU).

    x ``[N, H]``, expert_ids ``[N, k]``. Rows are sorted by expert (stable), ``ragged_dot`` runs each expert
    on its contiguous run of rows, and the inverse permutation puts the results back in (token, slot) order.
    ``moe`` holds ``gate_up`` (fused, one grouped matmul for both; ``cfg`` gives its layout) and ``down``, or
    (DiffusionGemma's unfused experts) ``gate``, ``up`` and ``down``.
    """
    num_tokens, k = expert_ids.shape
    num_experts = moe["down"].shape[0]
    flat_ids = expert_ids.reshape(-1)
    order = jnp.argsort(flat_ids, stable=True)
    group_sizes = jnp.zeros((num_experts,), jnp.int32).at[flat_ids].add(1)
    rows = x[order // k]  # [N*k, H], grouped by expert
    def rdot(a, w):  # a [rows, in] . w [E, out, in]: accumulated in float32, in x's dtype (as the dense products)
        return jax.lax.ragged_dot_general(a, w.astype(x.dtype), group_sizes, _RAGGED_OUT_IN,
                                          preferred_element_type=jnp.float32).astype(x.dtype)

    if "gate_up" in moe:
        gate, up = split_gate_up(rdot(rows, moe["gate_up"]), cfg, "expert_gate_up")
    else:
        gate, up = rdot(rows, moe["gate"]), rdot(rows, moe["up"])
    out = rdot(activation(gate) * up, moe["down"])
    inverse = jnp.argsort(order)  # a gather back to (token, slot) order: no scatter-add, fixed summation order
    return out[inverse].reshape(num_tokens, k, -1)


def moe_mlp(moe, x, cfg: ModelConfig):
    """Sparse MLP over the (already normalised) hidden states ``x [..., H]``."""
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    expert_ids, weights = route(router_logits(moe, flat, cfg), cfg, moe.get("expert_bias"))
    per_expert = grouped_experts(moe, flat, expert_ids, cfg=cfg)  # [N, k, H]
    out = jnp.einsum("nkh,nk->nh", per_expert.astype(jnp.float32), weights).astype(x.dtype)
    if "shared_gate_up" in moe:
        out = out + swiglu(flat, moe["shared_gate_up"], moe["shared_down"], cfg)
    return out.reshape(*lead, -1)
