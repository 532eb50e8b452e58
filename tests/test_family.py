"""The model-family interface (dllm_jax.model.family): a model's family is found from its config (or config.json),
and what the family names is what the engine uses: its parameter table, its KV layout (the page pool and the bytes
of a page), its device functions (traced by the jitted step) and its chat template."""

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dllm_jax import config as config_module
from dllm_jax import plan
from dllm_jax.config import ModelConfig
from dllm_jax.decode.algorithms import make_algorithm
from dllm_jax.decode.step import DenoiseBatch, StepSpec, denoise, init_kv_pages, kv_bytes_per_page, prefill
from dllm_jax.model import family as fam
from dllm_jax.model import qwen3
from dllm_jax.model.family import LLADA2, SDAR, SDAR_MOE, LayerKV, ModelFamily, default_chat_template, family_of
from dllm_jax.model.params import DECODER, init_params, param_table
from dllm_jax.model.templates import LLADA2_CHAT_TEMPLATE
from dllm_jax.testing import published

EXPECTED = {"sdar": SDAR, "sdar_moe": SDAR_MOE, "llada2": LLADA2}


def _published_config(layout: str) -> dict:
    """The config.json :func:`dllm_jax.testing.published.write_published` writes for ``layout`` (tiny dims)."""
    dims = dict(published.TINY_DIMS, vocab_size=512)
    if layout == "sdar":
        return published.sdar_config(**dims)
    if layout == "sdar_moe":
        return published.sdar_moe_config(**published.TINY_MOE_DIMS, **dims)
    return published.llada2_config(eos_token_id=1, pad_token_id=1, **published.TINY_LLADA2_DIMS, **dims)


@pytest.mark.parametrize("layout", published.LAYOUTS)
def test_every_published_layout_resolves_to_its_family(layout):
    hf = _published_config(layout)
    family = EXPECTED[layout]
    cfg = ModelConfig.from_hf_dict(hf)
    assert family_of(hf) is family_of(cfg) is family
    assert family.parse(hf) == cfg
    # a config.json naming only its model_type resolves by it
    assert family_of({k: v for k, v in hf.items() if k != "architectures"}) is family
    assert family.param_table is param_table(cfg) is DECODER
    assert family.checkpoint_layout == cfg.family
    assert family.default_block_size == cfg.default_block_size
    assert family.chat_template == default_chat_template(cfg) == (LLADA2_CHAT_TEMPLATE if layout == "llada2" else None)
    assert family.make_algorithm(model_config=cfg).name == "LowConfidence"


@pytest.mark.parametrize("preset,expected", [("sdar-1.7b", SDAR), ("sdar-8b", SDAR), ("sdar-30b-a3b", SDAR_MOE),
                                             ("llada2-mini", LLADA2)])
def test_plan_presets_resolve(preset, expected):
    assert family_of(plan.PRESETS[preset]) is family_of(plan.load_config(preset)[1]) is expected


def test_families_claim_exactly_what_the_config_parser_supports():
    claimed = [a for f in fam.families() for a in f.architectures]
    assert sorted(claimed) == sorted(config_module.SUPPORTED_ARCHITECTURES)  # each claimed once
    types = [t for f in fam.families() for t in f.model_types]
    assert sorted(types) == sorted(config_module.SUPPORTED_MODEL_TYPES)
    with pytest.raises(ValueError, match="architecture 'Qwen3ForCausalLM' is already claimed by sdar"):
        fam.register_family(dataclasses.replace(SDAR, name="copy"))


def test_an_unknown_architecture_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match="no model family claims architecture 'Gemma4ForCausalLM'.*SDARForCausalLM"):
        family_of({"architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4"})
    with pytest.raises(ValueError, match="model_type 'gemma4'"):
        family_of({"model_type": "gemma4"})
    cfg = ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=1, num_kv_heads=1,
                      head_dim=8, architecture="DiffusionGemmaForCausalLM", model_type="diffusion_gemma")
    with pytest.raises(ValueError, match="'DiffusionGemmaForCausalLM'"):
        family_of(cfg)
    with pytest.raises(ValueError, match="'DiffusionGemmaForCausalLM'"):
        param_table(cfg)


@pytest.mark.parametrize("layout", published.LAYOUTS)
def test_the_kv_layout_is_the_pool_init_kv_pages_builds(layout):
    cfg = ModelConfig.from_hf_dict(_published_config(layout))
    kv = family_of(cfg).kv_layout(cfg)
    assert len(kv) == cfg.num_layers and all(layer == LayerKV(cfg.num_kv_heads, cfg.head_dim) for layer in kv)
    for dtype in (jnp.float32, jnp.bfloat16):
        pool = init_kv_pages(cfg, 5, 4, dtype)
        assert [(k.shape, v.shape, k.dtype, v.dtype) for k, v in pool] == \
            [((lk.kv_heads, 5, 4, lk.head_dim),) * 2 + (jnp.dtype(dtype),) * 2 for lk in kv]
        pool_bytes = sum(k.nbytes + v.nbytes for k, v in pool)
        assert kv_bytes_per_page(cfg, 4, dtype) * 5 == pool_bytes
        # what the engine sized its pool with before the family interface
        assert kv_bytes_per_page(cfg, 4, dtype) == \
            2 * cfg.num_layers * cfg.num_kv_heads * 4 * cfg.head_dim * jnp.dtype(dtype).itemsize


# ----------------------------------------------------------------------------------------------
# A registered fake family: what it names is what the engine uses
# ----------------------------------------------------------------------------------------------

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
            head_dim=8, mask_token_id=95, block_size=4)


@contextlib.contextmanager
def _registered(family: ModelFamily):
    fam.register_family(family)
    try:
        yield family
    finally:
        fam.unregister_family(family)


def _counting(calls: dict, name: str, fn):
    def wrapped(*args, **kwargs):
        calls[name] = calls.get(name, 0) + 1
        return fn(*args, **kwargs)
    return wrapped


def test_a_family_with_per_layer_kv_gets_its_own_pool():
    def kv_layout(cfg):  # e.g. sliding layers, then a full layer with other heads (DiffusionGemma's shape)
        return (LayerKV(2, 8, window=8), LayerKV(1, 16, dtype=jnp.bfloat16))

    fake = dataclasses.replace(SDAR, name="fake_kv", architectures=("FakeKVForLM",), model_types=("fake_kv",),
                               kv_layout=kv_layout)
    cfg = ModelConfig(**dict(TINY, architecture="FakeKVForLM", model_type="fake_kv"))
    with _registered(fake):
        pool = init_kv_pages(cfg, 3, 4, jnp.float32)
        assert [(k.shape, k.dtype) for k, _ in pool] == [((2, 3, 4, 8), jnp.float32), ((1, 3, 4, 16), jnp.bfloat16)]
        assert kv_bytes_per_page(cfg, 4, jnp.float32) == 2 * (2 * 4 * 8 * 4 + 1 * 4 * 16 * 2)
    with pytest.raises(ValueError, match="FakeKVForLM"):
        init_kv_pages(cfg, 3, 4)  # unregistered: no family claims it


def _batch(rows, block, mask_id, rng):
    tokens = rng.integers(0, mask_id, (rows, block)).astype(np.int32)
    tokens[:, 1:] = mask_id
    immutable = np.zeros((rows, block), bool)
    immutable[:, 0] = True
    zeros = np.zeros(rows, np.int32)
    return DenoiseBatch(tokens=jnp.asarray(tokens), immutable=jnp.asarray(immutable),
                        page_table=jnp.asarray(np.array([[1, 0], [2, 0]], np.int32)),
                        prefix_len=jnp.full(rows, block, jnp.int32), write_page=jnp.asarray([3, 4], jnp.int32),
                        steps_taken=jnp.asarray(zeros), temperature=jnp.zeros(rows, jnp.float32),
                        top_k=jnp.asarray(zeros), top_p=jnp.ones(rows, jnp.float32),
                        seed=jnp.zeros(rows, jnp.uint32), rng_step=jnp.asarray(zeros))


def test_the_step_traces_the_family_device_functions():
    calls: dict[str, int] = {}
    fns = {name: _counting(calls, name, getattr(qwen3, name))
           for name in ("forward_chunk", "forward_chunk_kv", "forward_chunk_rest", "logits_from_hidden")}
    fake = dataclasses.replace(SDAR, name="fake", architectures=("FakeDiffusionForLM",), model_types=("fake",), **fns)
    fake_cfg = ModelConfig(**dict(TINY, architecture="FakeDiffusionForLM", model_type="fake"))
    real_cfg = ModelConfig(**dict(TINY, architecture="SDARForCausalLM", model_type="sdar"))
    block, mask_id = TINY["block_size"], TINY["mask_token_id"]
    algo = make_algorithm("EntropyThreshold", {})  # needs entropy: the step materialises logits
    rng = np.random.default_rng(0)
    prompt = jnp.asarray(rng.integers(0, mask_id, (2, block)), jnp.int32)
    batch = _batch(2, block, mask_id, rng)
    state = algo.init_state(2, block)
    with _registered(fake):
        params = init_params(fake_cfg, jax.random.key(0))  # the table comes from the family too
        results, texts = {}, {}
        for name, cfg in (("fake", fake_cfg), ("real", real_cfg)):
            spec = StepSpec(model=cfg, block_size=block, mask_id=mask_id, algorithm=algo)
            pool = init_kv_pages(cfg, 6, block)
            pool = prefill(params, pool, prompt, jnp.zeros((2, 2), jnp.int32), jnp.zeros(2, jnp.int32),
                           jnp.asarray([[1], [2]], jnp.int32), spec=dataclasses.replace(spec, algorithm=None))
            texts[name] = denoise.lower(params, pool, batch, state, spec=spec).as_text()
            results[name] = jax.tree.map(np.asarray, denoise(params, pool, batch, state, spec=spec))
            if name == "fake":  # prefill, the K/V half, the rest and the head were the fake family's
                assert set(calls) == set(fns) and all(n >= 1 for n in calls.values()), calls
                traced = dict(calls)
    # the real family's step called none of the fake's wrappers; both trace the same program and compute the same
    assert calls == traced
    assert texts["fake"] == texts["real"]
    jax.tree.map(np.testing.assert_array_equal, results["fake"], results["real"])
