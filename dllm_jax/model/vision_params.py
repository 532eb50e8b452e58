"""The vision tower's parameter table, apart from the text model's (:mod:`dllm_jax.model.gemma_params`): its
checkpoint names in the published layout (``model.encoder.vision_tower.*``, ``model.encoder.embed_vision.*``),
its pytree (:mod:`dllm_jax.model.vision` runs it) and its loader.

The tower is small next to the text model (about 0.4 B parameters in the published checkpoint) and runs once per
image at prompt-encode time, so its leaves are loaded whole and replicated; they are not sharded, not in the text
model's pytree and not touched by weight updates of the text model.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from dllm_jax.model.errors import CheckpointError
from dllm_jax.model.safetensors_io import SafetensorsFile, safetensor_files
from dllm_jax.model.vision import VisionConfig

TOWER = "model.encoder.vision_tower."
PROJECTOR = "model.encoder.embed_vision."

# leaf -> (checkpoint name, shape rule over the VisionConfig); per layer names are under encoder.layers.{i}.
_TOP = {
    "patch_proj": (TOWER + "patch_embedder.input_proj.weight", lambda v: (v.hidden_size, 3 * v.patch_size ** 2)),
    "pos_table": (TOWER + "patch_embedder.position_embedding_table",
                  lambda v: (2, v.position_embedding_size, v.hidden_size)),
    "proj": (PROJECTOR + "embedding_projection.weight", None),  # [text hidden, vision hidden]: checked on use
}
_STANDARDIZE = {"std_bias": TOWER + "std_bias", "std_scale": TOWER + "std_scale"}
_LINEARS = {  # leaf -> (name, [out, in] rule)
    "q": ("self_attn.q_proj", lambda v: (v.num_heads * v.head_dim, v.hidden_size)),
    "k": ("self_attn.k_proj", lambda v: (v.num_kv_heads * v.head_dim, v.hidden_size)),
    "v": ("self_attn.v_proj", lambda v: (v.num_kv_heads * v.head_dim, v.hidden_size)),
    "o": ("self_attn.o_proj", lambda v: (v.hidden_size, v.num_heads * v.head_dim)),
    "gate": ("mlp.gate_proj", lambda v: (v.intermediate_size, v.hidden_size)),
    "up": ("mlp.up_proj", lambda v: (v.intermediate_size, v.hidden_size)),
    "down": ("mlp.down_proj", lambda v: (v.hidden_size, v.intermediate_size)),
}
_NORMS = {"q_norm": ("self_attn.q_norm.weight", "D"), "k_norm": ("self_attn.k_norm.weight", "D"),
          "attn_norm": ("input_layernorm.weight", "H"), "post_attn_norm": ("post_attention_layernorm.weight", "H"),
          "pre_ff_norm": ("pre_feedforward_layernorm.weight", "H"),
          "post_ff_norm": ("post_feedforward_layernorm.weight", "H")}
_CLIP_BOUNDS = ("input_min", "input_max", "output_min", "output_max")


def _layer_prefix(i: int) -> str:
    return f"{TOWER}encoder.layers.{i}."


def vision_tensor_names(vcfg: VisionConfig) -> dict[tuple, str]:
    """pytree path -> checkpoint name of every tensor the tower needs (a clip leaf: its four bound names,
    joined by ``|``)."""
    out = {(key,): name for key, (name, _) in _TOP.items()}
    if vcfg.standardize:
        out.update({(key,): name for key, name in _STANDARDIZE.items()})
    for i in range(vcfg.num_layers):
        p = _layer_prefix(i)
        for key, (name, _) in _LINEARS.items():
            out[("layers", i, key)] = f"{p}{name}.linear.weight"
            if vcfg.clipped_linears:
                out[("layers", i, key + "_clip")] = "|".join(f"{p}{name}.{b}" for b in _CLIP_BOUNDS)
        for key, (name, _) in _NORMS.items():
            out[("layers", i, key)] = p + name
    return out


def _expected(vcfg: VisionConfig, path: tuple, text_hidden: int):
    key = path[-1]
    if key in _TOP:
        rule = _TOP[key][1]
        return (text_hidden, vcfg.hidden_size) if rule is None else rule(vcfg)
    if key in _STANDARDIZE:
        return (vcfg.hidden_size,)
    if key in _LINEARS:
        return _LINEARS[key][1](vcfg)
    if key.endswith("_clip"):
        return (4,)
    return (vcfg.head_dim,) if _NORMS[key][1] == "D" else (vcfg.hidden_size,)


def has_vision_tower(model_dir: str) -> bool:
    """Whether the directory's safetensors carry the tower (a converted directory, text-only, does not)."""
    try:
        files = safetensor_files(model_dir)
    except CheckpointError:
        return False
    for path in files:
        with SafetensorsFile(path) as st:
            if any(name.startswith(TOWER) for name in st.tensors):
                return True
    return False


def load_vision_params(model_dir: str, vcfg: VisionConfig, text_hidden: int, dtype) -> dict:
    """The tower's pytree from the checkpoint's safetensors, in ``dtype`` (norm weights, clip bounds and the
    standardize vectors float32). A missing or misshapen tensor is a :class:`CheckpointError` naming it."""
    names = vision_tensor_names(vcfg)
    wanted = {n for joined in names.values() for n in joined.split("|")}
    arrays: dict[str, np.ndarray] = {}
    for path in safetensor_files(model_dir):
        with SafetensorsFile(path) as st:
            for name in wanted & set(st.tensors):
                arrays[name] = np.array(st.view(name), dtype=np.float32)
    out: dict = {"layers": [{} for _ in range(vcfg.num_layers)]}
    for path, joined in names.items():
        parts = joined.split("|")
        missing = [n for n in parts if n not in arrays]
        if missing:
            raise CheckpointError(f"{model_dir}: the vision tower's tensor '{missing[0]}' is missing")
        if len(parts) > 1:  # clip bounds: four scalars
            value = np.asarray([arrays[n].reshape(()) for n in parts], np.float32)
        else:
            value = arrays[parts[0]]
        want = _expected(vcfg, path, text_hidden)
        if tuple(value.shape) != tuple(want):
            raise CheckpointError(f"{model_dir}: tensor '{parts[0]}' has shape {tuple(value.shape)}, expected "
                                  f"{tuple(want)} from config.json")
        keep32 = path[-1].endswith(("_norm", "_clip")) or path[-1] in _STANDARDIZE
        leaf = jnp.asarray(value, jnp.float32 if keep32 else dtype)
        if path[0] == "layers":
            out["layers"][path[1]][path[2]] = leaf
        else:
            out[path[0]] = leaf
    return out
