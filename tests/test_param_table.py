"""The parameter table (dllm_jax.model.params) is the single description of a parameter: every leaf the model
has is one row, and the shapes, dtypes, initial values, sharding axes and checkpoint names both ways all derive
from it. The published fixtures (dllm_jax.testing.published) describe the checkpoints independently, so they
check the table's names from outside."""

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dllm_jax import sharding
from dllm_jax.config import ModelConfig
from dllm_jax.model.checkpoint_names import (convert, expected_hf_shape, hf_name_for, hf_tensor_parts,
                                             params_to_hf)
from dllm_jax.model.params import (DECODER, DIMS, FAMILIES, MOE, PARAM_AXES, abstract_params, get_leaf, has_leaf,
                                   init_params, key_path, param_dtypes, param_shapes, param_table)
from dllm_jax.testing import published
from test_llada2 import BAILING, SOFTMAX_TIED

DENSE = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
             head_dim=8)
CONFIGS = {
    "sdar": ModelConfig(**DENSE),
    "sdar_tied_qkv_bias": ModelConfig(**dict(DENSE, tie_word_embeddings=True, attention_bias=True)),
    "sdar_moe": ModelConfig(**dict(DENSE, num_layers=3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                   moe_layers=(0, 2), norm_topk_prob=True)),
    "llada2": ModelConfig.from_hf_dict(BAILING),  # biases, o bias, shared experts, expert bias, fp32 router
    "llada2_tied": ModelConfig.from_hf_dict(SOFTMAX_TIED),  # no q/k norm, tied head, two dense layers
}


def _leaves(tree):
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, tuple))
    return {key_path(p): x for p, x in flat}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_leaf_is_one_row_and_everything_derives_from_it(name):
    cfg = CONFIGS[name]
    table = param_table(cfg)
    params = init_params(cfg, jax.random.key(0), dtype=jnp.bfloat16)
    leaves = _leaves(params)
    rows = dict(table.paths(cfg))
    assert set(leaves) == set(rows)  # every leaf has its row, every present row its leaf
    assert len({leaf.axes_key for leaf in table.leaves}) == len(table.leaves)  # one row per leaf name
    shapes, dtypes = _leaves(param_shapes(cfg)), _leaves(param_dtypes(cfg, jnp.bfloat16))
    abstract = _leaves(abstract_params(cfg, jnp.bfloat16))
    traced = _leaves(jax.eval_shape(lambda: init_params(cfg, jax.random.key(0), dtype=jnp.bfloat16)))
    for path, x in leaves.items():
        leaf = rows[path]
        assert table.leaf(path) is leaf
        assert x.shape == shapes[path] == leaf.shape_for(cfg) == abstract[path].shape == traced[path].shape
        assert x.dtype == jnp.dtype(dtypes[path]) == abstract[path].dtype == traced[path].dtype
        assert len(leaf.axes) == x.ndim == len(leaf.shape) and all(a in sharding.RULES for a in leaf.axes)
        assert sharding.PARAM_AXES[leaf.axes_key] == leaf.axes
        if leaf.init == "ones":
            assert bool(jnp.all(x == 1))
        elif leaf.init == "zeros":
            assert bool(jnp.all(x == 0))
    # The dtype rule: routing inputs stay float32 in a bf16 model (the expert bias always; an fp32 router's weights).
    f32 = {p[-1] for p, x in leaves.items() if x.dtype == jnp.float32}
    assert f32 == ({"expert_bias"} if cfg.moe_expert_bias else set()) | ({"router"} if cfg.router_fp32 else set())


def test_sharding_axes_are_the_tables():
    assert sharding.PARAM_AXES is PARAM_AXES
    assert set(PARAM_AXES) == {leaf.axes_key for leaf in DECODER.leaves}
    assert all(all(d in DIMS for d in leaf.shape) for leaf in DECODER.leaves)
    assert {leaf.key for leaf in DECODER.leaves if leaf.where == MOE} >= {"router", "gate_up", "down"}


def _part_value(cfg, params, p):
    """What ``p`` fills: its leaf, one expert's row of it, one segment's rows of a fused leaf."""
    from dllm_jax.model.fused import segment_of

    a = get_leaf(params, p.path) if p.expert is None else get_leaf(params, p.path)[p.expert]
    if p.segment is None:
        return a
    leaf = param_table(cfg).leaf(p.path)
    return segment_of(cfg, leaf, a, p.segment, leaf.row_axis - (p.expert is not None))


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_checkpoint_names_round_trip(name, tp):
    """Our pytree -> the family's checkpoint tensors -> our pytree, bit for bit, every leaf (every expert row, every
    fused leaf's segment) filled exactly once; the expected shape of every tensor is its shape; the name a leaf
    reports is written. With the fused leaves laid out for two TP shards too."""
    from dllm_jax.model.placement import missing_pieces

    cfg = CONFIGS[name].replace(tp_shards=tp)
    params = jax.tree.map(np.asarray, init_params(cfg, jax.random.key(1)))
    shapes = param_shapes(cfg)
    hf = params_to_hf(params, cfg)
    filled: dict[tuple, list] = {}
    for hf_name, a in hf.items():
        parts = hf_tensor_parts(cfg, hf_name)
        assert parts and all(has_leaf(shapes, p.path) for p in parts), hf_name
        assert expected_hf_shape(cfg, shapes, parts) == a.shape, hf_name
        for p in parts:
            np.testing.assert_array_equal(convert(p.convert, a), _part_value(cfg, params, p))
            assert (p.expert, p.segment) not in filled.get(p.path, []), (hf_name, p)
            filled.setdefault(p.path, []).append((p.expert, p.segment))
            assert hf_name_for(cfg, p.path, p.expert, p.segment) == hf_name
    for path, x in _leaves(params).items():
        assert missing_pieces(cfg, shapes, path, filled[path]) == [], path


PUBLISHED_DIMS = dict(vocab_size=448, **published.TINY_DIMS)
PUBLISHED_CONFIGS = {
    "sdar": published.sdar_config(**PUBLISHED_DIMS),
    "sdar_untied": published.sdar_config(**dict(PUBLISHED_DIMS, tie_word_embeddings=False)),
    "sdar_moe": published.sdar_moe_config(**published.TINY_MOE_DIMS, mlp_only_layers=[1], **PUBLISHED_DIMS),
    "llada2": published.llada2_config(**PUBLISHED_DIMS, **published.TINY_LLADA2_DIMS),
}


@pytest.mark.parametrize("layout", list(PUBLISHED_CONFIGS))
def test_published_names_resolve_to_the_table(layout):
    """Every tensor of a published checkpoint (names and shapes as the fixtures write them, independently of the
    table) lands in a leaf with the expected shape, and every leaf is filled."""
    config = PUBLISHED_CONFIGS[layout]
    cfg = ModelConfig.from_hf_dict(config)
    shapes = param_shapes(cfg)
    filled: dict[tuple, set] = {}
    for hf_name, shape, _ in published.tensor_specs(config):
        parts = [p for p in hf_tensor_parts(cfg, hf_name) or () if has_leaf(shapes, p.path)]
        assert parts, hf_name
        assert expected_hf_shape(cfg, shapes, parts) == tuple(shape), hf_name
        for p in parts:
            filled.setdefault(p.path, set()).add((p.expert, p.segment))
    from dllm_jax.model.placement import missing_pieces

    for path, shape in _leaves(shapes).items():
        assert missing_pieces(cfg, shapes, path, filled.get(path, set())) == [], path


def test_each_family_names_every_leaf_it_can_hold():
    for family in FAMILIES:
        unnamed = {leaf.axes_key for leaf in DECODER.leaves if not leaf.hf_names(family)}
        assert unnamed == ({"o_bias"} if family == "qwen3" else set()), family  # Qwen3 has no output bias


def test_production_code_never_imports_the_test_fixtures():
    root = pathlib.Path(__file__).resolve().parents[1] / "dllm_jax"
    offenders = [str(p.relative_to(root)) for p in root.rglob("*.py")
                 if "testing" not in p.relative_to(root).parts
                 and re.search(r"dllm_jax\.testing|from dllm_jax import testing", p.read_text())]
    assert offenders == []


def test_model_modules_stay_small():
    root = pathlib.Path(__file__).resolve().parents[1] / "dllm_jax"
    paths = [*(root / "model").glob("*.py"), *(root / "testing").glob("*.py"), root / "sharding.py", root / "plan.py"]
    long = {str(p.relative_to(root)): n for p in paths if (n := len(p.read_text().splitlines())) > 500}
    assert long == {}
