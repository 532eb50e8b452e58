"""Checkpoint tensor names <-> our pytree, both ways, derived from the parameter table's names.

A checkpoint tensor maps to one or more *parts* (:class:`Part`): a leaf of our pytree (``path``), optionally one
expert row of a stacked ``[E, ...]`` leaf, optionally one segment of a fused leaf (``q_proj`` in ``qkv``: its rows,
placed in the leaf's shard blocks, :mod:`dllm_jax.model.fused`), and the conversion from the checkpoint's array.
Matrices are stored as the checkpoints store them (``[out, in]``, :mod:`dllm_jax.model.params`), so a tensor is used
as it is (``ID``) or, fused in the checkpoint, split by rows: a part is always a copy of the checkpoint's bytes,
never a transpose. A checkpoint tensor that is a whole fused leaf in its layout (LLaDA2's ``query_key_value`` on one
shard) is one part, one copy.
Besides the names, a family's layout has a few rules of its own (:data:`LAYOUTS`): which names only a sparse (MoE)
layer may hold, and which it refuses outright.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import numpy as np

from dllm_jax.config import ModelConfig
from dllm_jax.model import gemma_params
from dllm_jax.model.family import layout_table, param_table
from dllm_jax.model.fused import fused_groups, segment_rows, split_fused
from dllm_jax.model.table import DENSE, LAYER, MOE, TOP, Leaf, Params, get_leaf


@dataclasses.dataclass(frozen=True)
class Part:
    path: tuple  # ("embed",), ("layers", i, "qkv"), ("layers", i, "moe", "gate_up")
    expert: int | None  # None: the whole leaf; e: row e of a stacked [E, ...] leaf
    convert: tuple  # a conversion spec (see convert): hashable, so one jitted function serves every tensor
    segment: int | None = None  # None: the whole leaf; j: segment j of a fused leaf (its rows, in shard blocks)


class Unsupported(Exception):
    """A tensor this config cannot hold; the message completes "tensor 'NAME' ..."."""


# Conversion specs, applied on the device (jnp) or to numpy arrays alike:
#   ("id",)               as stored
#   ("rows", lo, hi)      rows lo:hi of a fused tensor (LLaDA2 query_key_value)
#   ("mid", lo, hi)       a[:, lo:hi] of a fused 3D expert tensor (gate_up_proj [E, 2M, H])
#   ("T",), ("T3",)       [in, out] -> [out, in] (stacked: [E, in, out] -> [E, out, in]): only for the matrices of
#                         a converted directory of format version 1, which stored them [in, out]
ID, T, T3 = ("id",), ("T",), ("T3",)
# Specs that act row by row along axis 0, so a large tensor can be converted in chunks of rows.
CHUNKABLE = ("id", "T", "T3", "mid")
# Specs whose result is a slice of the stored array: a tensor in the leaf's dtype is copied, never computed on.
COPIES = ("id", "rows", "mid")


def convert(spec: tuple, a):
    kind = spec[0]
    if kind == "id":
        return a
    if kind == "T":
        return a.T
    if kind == "T3":
        return a.transpose(0, 2, 1)
    if kind == "rows":
        return a[spec[1]:spec[2]]
    if kind == "mid":
        return a[:, spec[1]:spec[2]]
    raise AssertionError(spec)


@dataclasses.dataclass(frozen=True)
class Layout:
    """A family's naming rules beyond the table's names (names relative to ``model.layers.{i}.``)."""

    sparse_prefixes: tuple[str, ...]  # names only a sparse layer may hold (in a dense one: an error)
    sparse_hint: str  # what to check when a dense layer holds them
    dense_hint: bool = False  # name first_k_dense_replace when a sparse layer holds a dense MLP weight
    refuse_mlp_bias: bool = False  # an ``mlp.*.bias`` tensor is refused (LLaDA2 has none; we support none)


LAYOUTS = {
    "qwen3": Layout(sparse_prefixes=("mlp.gate.weight", "mlp.experts."),
                    sparse_hint="check num_experts, mlp_only_layers, decoder_sparse_step"),
    "llada2": Layout(sparse_prefixes=("mlp.gate.", "mlp.experts.", "mlp.shared_experts."),
                     sparse_hint="check num_experts, first_k_dense_replace", dense_hint=True, refuse_mlp_bias=True),
}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_PREFIX = "model.layers.{i}."


@dataclasses.dataclass(frozen=True)
class _Index:
    """A family's names, for lookup: exact names (fused leaves in table order) and per-expert patterns."""

    top: dict[str, list[tuple[Leaf, int | None]]]  # (row, segment or None)
    layer: dict[str, list[tuple[Leaf, int | None]]]  # LAYER, DENSE and MOE leaves, by name relative to the layer
    experts: list[tuple[re.Pattern, Leaf, int | None]]


@functools.lru_cache(maxsize=None)
def _index(family: str) -> _Index:
    top: dict[str, list[Leaf]] = {}
    layer: dict[str, list[Leaf]] = {}
    experts = []
    for leaf in layout_table(family).leaves:
        named = [(j, seg.names.get(family, ())) for j, seg in enumerate(leaf.segments)] or [(None, leaf.hf_names(family))]
        for j, names in named:
            for name in names:
                if "{e}" in name:
                    experts.append((re.compile("^" + re.escape(name).replace(r"\{e\}", r"(\d+)") + "$"), leaf, j))
                else:
                    (top if leaf.where == TOP else layer).setdefault(name, []).append((leaf, j))
    return _Index(top, layer, experts)


def _path(leaf: Leaf, layer: int | None) -> tuple:
    if leaf.where == TOP:
        return (leaf.key,)
    return ("layers", layer, "moe", leaf.key) if leaf.where == MOE else ("layers", layer, leaf.key)


def _parts(cfg: ModelConfig, entries: list[tuple[Leaf, int | None]], layer: int | None) -> list[Part]:
    """The parts of one (non per-expert) checkpoint tensor that fills ``entries`` (several: a fused tensor, split
    along its out axis: the rows of a matrix or bias, axis 1 of a stacked ``[E, out, in]`` expert tensor). A tensor
    that is every segment of one fused leaf, in order, on one shard block is the leaf itself: one part, as stored."""
    leaf0, seg0 = entries[0]
    if len(entries) == 1:
        return [Part(_path(leaf0, layer), None, ID, seg0)]
    whole = all(leaf is leaf0 for leaf, _ in entries) and [j for _, j in entries] == list(range(len(leaf0.segments)))
    if whole and fused_groups(cfg, leaf0) == 1:
        return [Part(_path(leaf0, layer), None, ID)]
    parts, lo = [], 0
    for leaf, j in entries:
        rows = segment_rows(cfg, leaf, j) if j is not None else leaf.shape_for(cfg)[leaf.row_axis]
        kind = "mid" if leaf.row_axis == 1 else "rows"  # [E, out, in] tensors concatenated along out
        parts.append(Part(_path(leaf, layer), None, (kind, lo, lo + rows), j))
        lo += rows
    return parts


def hf_tensor_parts(cfg: ModelConfig, name: str) -> list[Part] | None:
    """Where checkpoint tensor ``name`` goes in our pytree (None: not a model weight, e.g. rotary buffers).

    Parts of leaves ``cfg``'s model does not have (biases it does not use, a tied head) are included: the caller
    skips them. Raises :class:`Unsupported` for a tensor that contradicts config.json (e.g. expert weights in a
    dense layer).
    """
    if cfg.family == gemma_params.LAYOUT:
        return _gemma_parts(cfg, name)
    index = _index(cfg.family)
    if name in index.top:
        return _parts(cfg, index.top[name], None)
    m = _LAYER_RE.match(name)
    if not m:
        return None
    i, suffix = int(m.group(1)), m.group(2)
    if i >= cfg.num_layers:
        raise Unsupported(f"is for layer {i} but the config has {cfg.num_layers} layers")
    layout = LAYOUTS[cfg.family]
    if layout.refuse_mlp_bias and suffix.startswith("mlp.") and suffix.endswith(".bias"):
        raise Unsupported("is an MLP bias; MLP biases are not supported (LLaDA2 checkpoints have none)")
    sparse = cfg.is_moe_layer(i)
    leaves = index.layer.get(suffix)
    if leaves and leaves[0][0].where in (LAYER, DENSE):
        if leaves[0][0].where == DENSE and sparse:
            hint = f" (first_k_dense_replace={min(cfg.moe_layers)})" if layout.dense_hint else ""
            raise Unsupported(f"is a dense MLP weight but config.json makes layer {i} a sparse (MoE) layer{hint}")
        return _parts(cfg, leaves, i)
    if not sparse and suffix.startswith(layout.sparse_prefixes):
        raise Unsupported(f"is an expert/router weight but config.json makes layer {i} a dense layer "
                          f"({layout.sparse_hint})")
    if leaves:
        return _parts(cfg, leaves, i)
    for pattern, leaf, j in index.experts:
        m = pattern.match(suffix)
        if m:
            return [Part(_path(leaf, i), int(m.group(1)), ID, j)]
    return None


_GEMMA_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")


def _gemma_parts(cfg: ModelConfig, name: str) -> list[Part] | None:
    """DiffusionGemma's names: the decoder's (``model.decoder.``) fill the shared leaves of a tied checkpoint (the
    encoder's copies, when a checkpoint stores them twice, are skipped: transformers ties the encoder to the
    decoder), each stack its own leaves of an untied one; vision tensors are skipped (text-only serving)."""
    table = gemma_params.GEMMA
    tied = cfg.tie_word_embeddings
    if name == "lm_head.weight":
        return [] if tied else [Part(("lm_head",), None, ID)]
    if name.startswith(gemma_params.VISION_PREFIXES):
        return None
    for prefix, decoder in ((gemma_params.DECODER_PREFIX, True), (gemma_params.ENCODER_PREFIX, False)):
        if not name.startswith(prefix):
            continue
        rel = name[len(prefix):]
        m = _GEMMA_LAYER_RE.match(rel)
        if m is None:  # a stack's top-level tensor
            key = {"embed_tokens.weight": "embed", "norm.weight": "final_norm"}.get(rel)
            if key is None:
                full = [leaf for leaf in table.leaves if leaf.where == TOP and name in leaf.hf_names(gemma_params.LAYOUT)
                        and leaf.key.startswith("sc_")]
                return [Part((full[0].key,), None, ID)] if full and decoder else None
            if tied and not decoder:
                return []
            return [Part(("dec_" + key if decoder and not tied else key,), None, ID)]
        i, suffix = int(m.group(1)), m.group(2)
        if i >= cfg.num_layers:
            raise Unsupported(f"is for layer {i} but the config has {cfg.num_layers} layers")
        stack = "dec_layers" if decoder and not tied else "layers"
        if suffix == "layer_scalar":
            return [Part((stack, i, "dec_layer_scalar" if decoder and tied else "layer_scalar"), None, ID)]
        if tied and not decoder:
            return []
        if suffix == "experts.gate_up_proj":
            width = cfg.moe_intermediate_size
            return [Part((stack, i, "experts_gate"), None, ("mid", 0, width)),
                    Part((stack, i, "experts_up"), None, ("mid", width, 2 * width))]
        rows = [leaf for leaf in table.leaves if leaf.where != TOP and suffix in leaf.hf_names(gemma_params.LAYOUT)]
        if not rows:
            return None
        if suffix == "self_attn.v_proj.weight" and not cfg.is_sliding_layer(i):
            raise Unsupported(f"is a v projection but config.json makes layer {i} a full-attention layer (full "
                              f"layers take their values from k_proj; check text_config.layer_types)")
        return [Part((stack, i, rows[0].key), None, ID)]
    return None


def expected_hf_shape(cfg: ModelConfig, shapes: Params, parts: list[Part]) -> tuple:
    """The shape the checkpoint tensor must have for ``parts`` (from config.json), for the mismatch message."""
    out = [stored_shape(part.convert, part_shape(cfg, shapes, part)) for part in parts]
    if len(out) == 1:
        return out[0]
    axis = 1 if parts[0].convert[0] == "mid" else 0  # fused: concatenated along the checkpoint's out axis
    return out[0][:axis] + (sum(s[axis] for s in out),) + out[0][axis + 1:]


def part_shape(cfg: ModelConfig, shapes: Params, part: Part) -> tuple:
    """The shape ``part`` fills: its leaf's, or its segment's rows of it; without the expert axis for one expert."""
    shape = tuple(get_leaf(shapes, part.path))
    if part.segment is not None:
        leaf = param_table(cfg).leaf(part.path, cfg)
        ax = leaf.row_axis
        shape = shape[:ax] + (segment_rows(cfg, leaf, part.segment),) + shape[ax + 1:]
    return shape[1:] if part.expert is not None else shape


def stored_shape(spec: tuple, leaf_shape: tuple) -> tuple:
    """The shape of the array that ``spec`` turns into a leaf (a part's, for fused tensors) of ``leaf_shape``."""
    if spec[0] == "T":
        return tuple(reversed(leaf_shape))
    if spec[0] == "T3":
        return (leaf_shape[0], leaf_shape[2], leaf_shape[1])
    return tuple(leaf_shape)


def unconvert(spec: tuple, a):
    """The inverse of :func:`convert` for one part: a leaf back in the stored array's layout (a fused tensor's
    part; :func:`params_to_hf` and ``read_weight`` concatenate the parts)."""
    if spec[0] == "T":
        return a.T
    if spec[0] == "T3":
        return a.transpose(0, 2, 1)
    return a


def hf_name_for(cfg: ModelConfig, path: tuple, expert: int | None = None, segment: int | None = None) -> str:
    """The checkpoint tensor name that fills our leaf ``path`` (row ``expert`` of a stacked leaf, segment
    ``segment`` of a fused one): for messages."""
    leaf = param_table(cfg).leaf(path, cfg)
    names = leaf.segments[segment].names.get(cfg.family, ()) if segment is not None else leaf.hf_names(cfg.family)
    if not names:
        return ".".join(str(p) for p in path) + f" (no {cfg.family} checkpoint name)"
    name = names[0].replace("{e}", "*" if expert is None else str(expert))
    if leaf.where == TOP:
        return name
    if cfg.family == gemma_params.LAYOUT:
        decoder = path[0] == "dec_layers" or cfg.tie_word_embeddings and path[2] != "layer_scalar"
        prefix = gemma_params.DECODER_PREFIX if decoder else gemma_params.ENCODER_PREFIX
        return f"{prefix}layers.{path[1]}.{name}"
    return _PREFIX.format(i=path[1]) + name


def params_to_hf(params: Params, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Our pytree -> checkpoint state dict (numpy, ``[out, in]`` matrices, as stored) in the layout of ``cfg``'s
    family.

    MoE experts are written one tensor per expert (what transformers' ``save_pretrained`` writes); fused leaves are
    written as their checkpoint tensors (``q_proj``, ...; LLaDA2's ``query_key_value`` as one).
    """
    family = cfg.family
    unfused = split_fused(cfg, jax.tree.map(np.asarray, params))
    groups: dict[str, list[np.ndarray]] = {}  # name -> its parts, in table order (several: a fused tensor)
    for path, leaf in param_table(cfg).paths(cfg):  # table order: a fused tensor's parts in order
        named = [(path[:-1] + (seg.key,), seg.names.get(family, ())) for seg in leaf.segments] or \
            [(path, leaf.hf_names(family))]
        for upath, names in named:
            if not names:
                continue
            name = names[0] if leaf.where == TOP else _PREFIX.format(i=path[1]) + names[0]
            a = get_leaf(unfused, upath)
            if "{e}" in name:
                for e in range(a.shape[0]):
                    groups.setdefault(name.replace("{e}", str(e)), []).append(a[e])
            else:
                groups.setdefault(name, []).append(a)
    # A fused tensor concatenates its parts along the checkpoint's out axis (after the expert axis, if stacked).
    return {name: np.ascontiguousarray(parts[0] if len(parts) == 1 else np.concatenate(parts, axis=parts[0].ndim - 2))
            for name, parts in groups.items()}
