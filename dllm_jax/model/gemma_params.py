"""DiffusionGemma's parameter table: the Gemma 4 text encoder / decoder pair, one row per leaf.

The pytree (:mod:`dllm_jax.model.gemma` runs it):

* ``embed`` ``[V, H]``, ``final_norm``, ``layers`` (a list of dicts): the encoder's, and the decoder's too when the
  checkpoint ties them (the published one does: ``tie_word_embeddings``, transformers' ``_tied_weights_keys``);
* ``sc_pre_norm`` / ``sc_gate`` / ``sc_up`` / ``sc_down``: the decoder's self-conditioning block;
* untied checkpoints only: ``dec_embed``, ``dec_final_norm``, ``dec_layers`` (the decoder's own stack) and
  ``lm_head`` ``[V, H]``; tied ones keep each decoder layer's ``layer_scalar`` buffer (transformers ties weights,
  not buffers) as ``dec_layer_scalar`` beside the encoder's.

A layer holds its attention (sliding layers a ``v`` projection; full layers none, with their own head dim and KV
heads: the ``G*`` shape symbols), a dense gated-GELU MLP and a mixture of experts (router with its scale vectors;
experts stacked ``[E, out, in]``, gate and up split by rows from the checkpoint's fused ``gate_up_proj``; every
matrix ``[out, in]`` as the checkpoint stores it, see :mod:`dllm_jax.model.decoder_params`), its norms and
``layer_scalar``. Checkpoint names are relative to a stack's ``layers.{i}.`` (``model.encoder.language_model.`` or
``model.decoder.``); top-level names are absolute. :mod:`dllm_jax.model.checkpoint_names` maps them.
"""

from __future__ import annotations

import functools
from typing import Iterator

from dllm_jax.config import ModelConfig
from dllm_jax.model.table import LAYER, TOP, Leaf, ParamTable, Params, axes_key, row

LAYOUT = "diffusion_gemma"
SLIDING_LAYER, FULL_LAYER = "sliding_layer", "full_layer"  # leaves only sliding / only full layers have
ENCODER_PREFIX = "model.encoder.language_model."
DECODER_PREFIX = "model.decoder."
VISION_PREFIXES = ("model.encoder.vision_tower.", "model.encoder.embed_vision.")


def _untied(c: ModelConfig) -> bool:
    return not c.tie_word_embeddings


def _g(key, where, shape, axes, init, name, **kw) -> Leaf:
    return row(key, where, shape, axes, init, {LAYOUT: name}, **kw)


_H = ("hidden",)


def _norm(key, where, name, **kw) -> Leaf:
    """A norm weight (or scale vector) over the hidden size, initialised to ones."""
    return _g(key, where, "H", _H, "ones", name, **kw)


def _mlp(prefix, where, names) -> tuple[Leaf, ...]:
    """A gated MLP's ``{prefix}gate`` / ``{prefix}up`` ``[I, H]`` and ``{prefix}down`` ``[H, I]``, named
    ``{names}gate_proj.weight`` / ``up_proj`` / ``down_proj``."""
    return (_g(prefix + "gate", where, "I H", ("mlp", "hidden"), "normal", names + "gate_proj.weight", matrix=True),
            _g(prefix + "up", where, "I H", ("mlp", "hidden"), "normal", names + "up_proj.weight", matrix=True),
            _g(prefix + "down", where, "H I", ("hidden", "mlp"), "normal", names + "down_proj.weight", matrix=True))


def _by_kind(key, sliding, full, axes, init, name, *, full_axes=None, **kw) -> tuple[Leaf, Leaf]:
    """A leaf of both layer kinds, one checkpoint name: shape ``sliding`` in sliding layers, ``full`` (the ``G*``
    symbols) in full ones; ``full_axes`` where the full layers' logical axes differ."""
    return (_g(key, SLIDING_LAYER, sliding, axes, init, name, **kw),
            _g(key, FULL_LAYER, full, axes if full_axes is None else full_axes, init, name, **kw))


GEMMA_LEAVES: tuple[Leaf, ...] = (
    # The encoder's embedding and final norm, then the decoder's own (untied checkpoints only, same names).
    *(row for prefix, present in (("", None), ("dec_", _untied)) for row in (
        _g(prefix + "embed", TOP, "V H", ("vocab", "hidden"), "normal", DECODER_PREFIX + "embed_tokens.weight",
           present=present),
        _norm(prefix + "final_norm", TOP, DECODER_PREFIX + "norm.weight", present=present))),
    _g("lm_head", TOP, "V H", ("vocab", "hidden"), "normal", "lm_head.weight", matrix=True, present=_untied),
    # The decoder's self-conditioning block.
    _norm("sc_pre_norm", TOP, DECODER_PREFIX + "self_conditioning.pre_norm.weight"),
    *_mlp("sc_", TOP, DECODER_PREFIX + "self_conditioning."),
    # Attention: sliding layers (head_dim, num_kv_heads, a v projection) and full layers (G* dims, none).
    _norm("attn_norm", LAYER, "input_layernorm.weight"),
    #         key   sliding  full     logical axes              init
    *_by_kind("q",  "Q H",   "GQ H",  ("q_heads", "hidden"),    "normal", "self_attn.q_proj.weight", matrix=True),
    *_by_kind("k",  "KV H",  "GKV H", ("kv_heads", "hidden"),   "normal", "self_attn.k_proj.weight", matrix=True,
              full_axes=("global_kv_heads", "hidden")),
    _g("v", SLIDING_LAYER, "KV H", ("kv_heads", "hidden"), "normal", "self_attn.v_proj.weight", matrix=True),
    *_by_kind("o",  "H Q",   "H GQ",  ("hidden", "q_heads"),    "normal", "self_attn.o_proj.weight", matrix=True),
    *(row for p in ("q", "k") for row in _by_kind(f"{p}_norm", "D", "GD", ("head_dim",), "ones",
                                                   f"self_attn.{p}_norm.weight")),
    _norm("post_attn_norm", LAYER, "post_attention_layernorm.weight"),
    # Feed-forward: a dense gated-GELU MLP and a mixture of experts, summed.
    _norm("pre_ff_norm", LAYER, "pre_feedforward_layernorm.weight"),
    *_mlp("", LAYER, "mlp."),
    _norm("post_ff_norm_1", LAYER, "post_feedforward_layernorm_1.weight"),
    _g("router", LAYER, "E H", ("router", "hidden"), "normal", "router.proj.weight", matrix=True),
    _norm("router_scale", LAYER, "router.scale"),
    _g("expert_scale", LAYER, "E", ("router",), "ones", "router.per_expert_scale"),
    _norm("pre_ff_norm_2", LAYER, "pre_feedforward_layernorm_2.weight"),
    # experts stacked [E, out, in]; gate and up are one fused checkpoint tensor, split by rows in this order
    *(_g(f"experts_{p}", LAYER, "E M H", ("experts", "expert_mlp", "hidden"), "normal", "experts.gate_up_proj",
         matrix=True) for p in ("gate", "up")),
    _g("experts_down", LAYER, "E H M", ("experts", "hidden", "expert_mlp"), "normal", "experts.down_proj",
       matrix=True),
    _norm("post_ff_norm_2", LAYER, "post_feedforward_layernorm_2.weight"),
    _norm("post_ff_norm", LAYER, "post_feedforward_layernorm.weight"),
    _g("layer_scalar", LAYER, "1", (None,), "ones", "layer_scalar"),
    _g("dec_layer_scalar", LAYER, "1", (None,), "ones", "layer_scalar",
       present=lambda c: c.tie_word_embeddings),  # tied: the decoder's own buffer
)


class GemmaTable(ParamTable):
    """The table with DiffusionGemma's structure: leaves by layer kind, and a second stack when untied."""

    def leaf(self, path: tuple, cfg: ModelConfig | None = None) -> Leaf:
        """The row of ``path``; a leaf whose row depends on the layer's kind (``q``, ``k``, ...) needs ``cfg``."""
        rows = self._rows_by_key[axes_key(path)]
        if len(rows) == 1:
            return rows[0]
        if cfg is None:
            raise LookupError(f"{path}: the row of a layer-kind leaf depends on the config")
        kind = SLIDING_LAYER if cfg.is_sliding_layer(path[1]) else FULL_LAYER
        return next(r for r in rows if r.where == kind)

    @functools.cached_property
    def _rows_by_key(self) -> dict[str, list[Leaf]]:
        out: dict[str, list[Leaf]] = {}
        for leaf in self.leaves:
            out.setdefault(leaf.axes_key, []).append(leaf)
        return out

    def layer_leaves(self, cfg: ModelConfig, i: int, *, decoder_stack: bool = False) -> Iterator[Leaf]:
        kind = SLIDING_LAYER if cfg.is_sliding_layer(i) else FULL_LAYER
        for leaf in self.leaves:
            if leaf.where in (LAYER, kind) and leaf.exists(cfg):
                if decoder_stack and leaf.key == "dec_layer_scalar":
                    continue
                yield leaf

    def empty(self, cfg: ModelConfig) -> Params:
        out: Params = {"layers": [{} for _ in range(cfg.num_layers)]}
        if not cfg.tie_word_embeddings:
            out["dec_layers"] = [{} for _ in range(cfg.num_layers)]
        return out

    def stacks(self, cfg: ModelConfig) -> tuple[str, ...]:
        return ("layers",) if cfg.tie_word_embeddings else ("layers", "dec_layers")

    def paths(self, cfg: ModelConfig) -> Iterator[tuple[tuple, Leaf]]:
        for leaf in self.leaves:
            if leaf.where == TOP and leaf.exists(cfg):
                yield (leaf.key,), leaf
        for stack in self.stacks(cfg):
            for i in range(cfg.num_layers):
                for leaf in self.layer_leaves(cfg, i, decoder_stack=stack == "dec_layers"):
                    yield (stack, i, leaf.key), leaf


GEMMA = GemmaTable(GEMMA_LEAVES)  # DiffusionGemma's family carries it (dllm_jax.model.family)
