"""Model families: everything one kind of checkpoint brings to the engine, named in one place.

A :class:`ModelFamily` says which Hugging Face ``architectures`` / ``model_type`` values it claims and provides:

* **config parsing**: its fields of :class:`~dllm_jax.config.ModelConfig` from a ``config.json`` dict
  (``parse_fields``; :meth:`ModelFamily.parse` gives the whole config);
* **its parameter table** (a :class:`~dllm_jax.model.table.ParamTable`: shapes, sharding axes, dtypes, checkpoint
  names). This registry is the only place a table is bound to a family: :func:`param_table` (a config's) and
  :func:`layout_table` (a checkpoint layout's) look it up here, and :mod:`dllm_jax.model.params` (shapes, dtypes,
  the initialiser), the loader, the sharding plan and the checkpoint name maps derive from what they return;
* **its device functions**, pure and traced inside the jitted step (:mod:`dllm_jax.decode.step`):
  ``forward_chunk`` (prefill: encode complete blocks, write their K/V), ``forward_chunk_kv`` (the part of a denoise
  forward that writes K/V: all a commit forward runs), ``forward_chunk_rest`` (the rest of a denoise forward: the
  hidden states) and ``logits_from_hidden`` (the head);
* **its KV layout per layer** (``kv_layout(cfg)``: one :class:`~dllm_jax.model.kv_layout.LayerKV` per layer),
  from which the page pool and the bytes of one page derive (:func:`dllm_jax.decode.step.init_kv_pages`,
  ``kv_bytes_per_page``);
* **its default algorithm** and the per-row algorithm state a block starts with (``init_state``);
* **its chat template** for tokenizers that ship none (:func:`default_chat_template`), and its default block size.

The lookup (:func:`family_of`) is plain Python on hashable static data (a config's ``architecture``): the step
does it at trace time, so routing through a family adds no jit argument and changes no compiled program.

Registered: SDAR / Qwen3 dense, SDAR-MoE (Qwen3-MoE) and LLaDA2. The three run one decoder
(:mod:`dllm_jax.model.qwen3`) and one parameter table (:mod:`dllm_jax.model.decoder_params`); they differ in the
checkpoint names (``checkpoint_layout``),
the config fields they parse, the default block size and the chat template. DiffusionGemma
(:mod:`dllm_jax.model.gemma`, its own table :mod:`dllm_jax.model.gemma_params` and heterogeneous KV layout)
decodes with Gemma4Renoise (:mod:`dllm_jax.decode.renoise`), served by its own runner and scheduler
(:mod:`dllm_jax.engine.families`: its ``serving`` kind, "canvas").
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from dllm_jax import hf_config
from dllm_jax.config import ConfigError, ModelConfig
from dllm_jax.model import gemma, qwen3
from dllm_jax.model.decoder_params import DECODER
from dllm_jax.model.gemma_params import GEMMA
from dllm_jax.model.kv_layout import LayerKV, uniform_kv_layout
from dllm_jax.model.table import ParamTable
from dllm_jax.model.templates import GEMMA_CHAT_TEMPLATE, LLADA2_CHAT_TEMPLATE


def algorithm_state(cfg: ModelConfig, algorithm, num_rows: int, block_size: int):
    """The per-row state a block starts with: the algorithm's own (a family with per-row model state, e.g.
    self-conditioning, adds its leaves here)."""
    return algorithm.init_state(num_rows, block_size)


def _qwen3_fields(hf: dict, num_layers: int, head_dim: int, source: str) -> dict:
    return hf_config._qwen3_fields(hf, num_layers, source)


def _llada2_fields(hf: dict, num_layers: int, head_dim: int, source: str) -> dict:
    return hf_config._llada2_fields(hf, num_layers, head_dim, source)


@dataclasses.dataclass(frozen=True, eq=False)  # identity equality and hash: a family is a registered singleton
class ModelFamily:
    name: str
    architectures: tuple[str, ...]  # HF ``architectures[0]`` values it claims
    model_types: tuple[str, ...]  # HF ``model_type`` values it claims (a config without ``architectures``)
    # config.json -> this family's ModelConfig fields: (hf dict, num_layers, head_dim, source) -> fields
    parse_fields: Callable[[dict, int, int, str], dict]
    param_table: ParamTable
    checkpoint_layout: str  # the table's checkpoint-name column (ModelConfig.family)
    # Device functions, signatures of dllm_jax.model.qwen3's: prefill, the K/V half of a denoise / commit
    # forward, its other half, the head. None for a family that is not served by mask blocks (its ``serving``
    # kind has its own device functions: DiffusionGemma's are model/gemma.py's encoder and decoder).
    forward_chunk: Callable | None = None
    forward_chunk_kv: Callable | None = None
    forward_chunk_rest: Callable | None = None
    logits_from_hidden: Callable | None = None
    kv_layout: Callable[[ModelConfig], tuple[LayerKV, ...]] = uniform_kv_layout
    default_algorithm: str = "LowConfidence"  # dllm_jax.decode.algorithms.ALGORITHMS name
    init_state: Callable = algorithm_state  # (cfg, algorithm, num_rows, block_size) -> per-row state
    chat_template: str | None = None  # used when the tokenizer ships none (None: prompts stay raw)
    default_block_size: int = hf_config.DEFAULT_SDAR_BLOCK_SIZE
    uses_mask_token: bool = True  # False: the canvas starts from noise (no mask id needed)
    # How the engine serves it (dllm_jax/engine/families.py): "mask" (blocks of mask tokens, the block radix
    # index) or "canvas" (noise canvases, per-row state on the device, the window-aware index)
    serving: str = "mask"

    def parse(self, hf: dict, source: str = "config.json") -> ModelConfig:
        """The config of a ``config.json`` dict this family claims (validated, errors naming the field)."""
        if family_of(hf, source=source) is not self:
            raise ConfigError(f"{source}: {_describe(hf)} belongs to another family than {self.name}")
        return ModelConfig.from_hf_dict(hf, source=source)

    def make_algorithm(self, name: str | None = None, config: dict | None = None, *, model_config=None):
        """An algorithm by name (None: the family's default), as :func:`dllm_jax.decode.algorithms.make_algorithm`."""
        from dllm_jax.decode.algorithms import make_algorithm

        name = name or self.default_algorithm
        if name == "Gemma4Renoise" and self.default_algorithm != name:
            raise ValueError(f"algorithm: Gemma4Renoise decodes uniform-noise models (DiffusionGemma); {self.name} "
                             f"is mask-based (its algorithms: LowConfidence, JointThreshold, ...)")
        return make_algorithm(name, config, model_config=model_config)

    def __repr__(self) -> str:
        return f"ModelFamily({self.name!r})"


_DEVICE_FUNCTIONS = dict(forward_chunk=qwen3.forward_chunk, forward_chunk_kv=qwen3.forward_chunk_kv,
                         forward_chunk_rest=qwen3.forward_chunk_rest, logits_from_hidden=qwen3.logits_from_hidden)

SDAR = ModelFamily(
    name="sdar", architectures=("Qwen3ForCausalLM", "SDARForCausalLM"), model_types=("qwen3", "sdar"),
    parse_fields=_qwen3_fields, param_table=DECODER, checkpoint_layout="qwen3", **_DEVICE_FUNCTIONS)
SDAR_MOE = ModelFamily(
    name="sdar_moe", architectures=("Qwen3MoeForCausalLM", "SDARMoeForCausalLM"), model_types=("qwen3_moe", "sdar_moe"),
    parse_fields=_qwen3_fields, param_table=DECODER, checkpoint_layout="qwen3", **_DEVICE_FUNCTIONS)
LLADA2 = ModelFamily(
    name="llada2", architectures=hf_config.LLADA2_ARCHITECTURES, model_types=hf_config.LLADA2_MODEL_TYPES,
    parse_fields=_llada2_fields, param_table=DECODER, checkpoint_layout="llada2", chat_template=LLADA2_CHAT_TEMPLATE,
    default_block_size=hf_config.DEFAULT_LLADA2_BLOCK_SIZE, **_DEVICE_FUNCTIONS)



DIFFUSION_GEMMA = ModelFamily(
    name="diffusion_gemma", architectures=hf_config.DIFFUSION_GEMMA_ARCHITECTURES,
    model_types=hf_config.DIFFUSION_GEMMA_MODEL_TYPES, parse_fields=lambda *a: {}, param_table=GEMMA,
    checkpoint_layout="diffusion_gemma", kv_layout=gemma.kv_layout, default_algorithm="Gemma4Renoise",
    default_block_size=256, uses_mask_token=False, serving="canvas", chat_template=GEMMA_CHAT_TEMPLATE)

_FAMILIES: list[ModelFamily] = []
_BY_ARCHITECTURE: dict[str, ModelFamily] = {}
_BY_MODEL_TYPE: dict[str, ModelFamily] = {}


def register_family(family: ModelFamily) -> ModelFamily:
    """Add a family; an architecture or model_type another family already claims is a ValueError."""
    for value, index, what in [(a, _BY_ARCHITECTURE, "architecture") for a in family.architectures] + \
                               [(t, _BY_MODEL_TYPE, "model_type") for t in family.model_types]:
        if value in index and index[value] is not family:
            raise ValueError(f"model family {family.name}: {what} '{value}' is already claimed by {index[value].name}")
    if family not in _FAMILIES:
        _FAMILIES.append(family)
    _BY_ARCHITECTURE.update(dict.fromkeys(family.architectures, family))
    _BY_MODEL_TYPE.update(dict.fromkeys(family.model_types, family))
    return family


def unregister_family(family: ModelFamily) -> None:
    """Remove a family registered with :func:`register_family` (tests)."""
    _FAMILIES.remove(family)
    for index in (_BY_ARCHITECTURE, _BY_MODEL_TYPE):
        for key in [k for k, f in index.items() if f is family]:
            del index[key]


def families() -> tuple[ModelFamily, ...]:
    return tuple(_FAMILIES)


for _family in (SDAR, SDAR_MOE, LLADA2, DIFFUSION_GEMMA):
    register_family(_family)


def family_of(model: ModelConfig | dict, *, source: str = "config.json") -> ModelFamily:
    """The family of a :class:`ModelConfig` (by its architecture) or of a ``config.json`` dict (by
    ``architectures[0]``, else ``model_type``). None claims it: a :class:`~dllm_jax.config.ConfigError` (a
    ValueError) naming the architecture and the registered ones."""
    if isinstance(model, ModelConfig):
        family = _BY_ARCHITECTURE.get(model.architecture)
        if family is None:
            raise ConfigError(f"{_unclaimed(f'architecture {model.architecture!r}')} (model_type "
                              f"{model.model_type!r})")
        return family
    archs = model.get("architectures") or []
    if archs:
        family = _BY_ARCHITECTURE.get(archs[0])
    else:
        family = _BY_MODEL_TYPE.get(model.get("model_type"))
    if family is None:
        raise ConfigError(f"{source}: {_unclaimed(_describe(model))}")
    return family


def param_table(cfg: ModelConfig | None = None) -> ParamTable:
    """The parameter table of ``cfg``'s family (SDAR / Qwen3, SDAR-MoE and LLaDA2 share the decoder's; None:
    SDAR's). A config no family claims: a :class:`~dllm_jax.config.ConfigError`, as :func:`family_of`."""
    return SDAR.param_table if cfg is None else family_of(cfg).param_table


def layout_table(layout: str) -> ParamTable:
    """The parameter table of the family whose checkpoint layout is ``layout`` (``ModelConfig.family``: ``"qwen3"``,
    ``"llada2"``, ``"diffusion_gemma"``); a KeyError when none is."""
    for family in _FAMILIES:
        if family.checkpoint_layout == layout:
            return family.param_table
    raise KeyError(layout)


def default_chat_template(cfg: ModelConfig) -> str | None:
    """The template to use when the tokenizer has none (None: keep none; the caller formats raw prompts): the
    model family's (:attr:`ModelFamily.chat_template`)."""
    return family_of(cfg).chat_template


def _describe(hf: dict) -> str:
    archs = hf.get("architectures") or []
    return f"architecture {archs[0]!r}" if archs else f"model_type {hf.get('model_type')!r}"


def _unclaimed(what: str) -> str:
    return (f"no model family claims {what}; supported architectures: "
            f"{', '.join(a for f in _FAMILIES for a in f.architectures)}")
