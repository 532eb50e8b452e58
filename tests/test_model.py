"""The JAX SDAR / Qwen3 model against transformers' Qwen3ForCausalLM, and the paged path against the full one."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from dllm_jax.config import ConfigError, ModelConfig
from dllm_jax.model.loader import CheckpointError, convert_checkpoint, load_model
from dllm_jax.model import qwen3
from dllm_jax.model.qwen3 import block_causal_mask, forward_chunk
from pallas_kernels.paged_block_attention import paged_block_attention_reference

# jitted, as everything that runs it in the engine or the trainer is (op by op, each primitive compiled on its own)
forward_full = jax.jit(qwen3.forward_full, static_argnums=1, static_argnames="return_hidden")

MASK_ID = 95


def _hf_model(tmp_path, *, tie, layers=3, heads=4, kv_heads=2, name="hf", rope_scaling=None):
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=16, max_position_embeddings=512,
        rope_theta=10000.0, tie_word_embeddings=tie, rms_norm_eps=1e-6, attn_implementation="eager",
        rope_scaling=rope_scaling,
    )
    model = transformers.Qwen3ForCausalLM(cfg).float().eval()
    with torch.no_grad():  # non-trivial norms so that a missed norm fails the test
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
    path = tmp_path / name
    model.save_pretrained(path)
    with open(path / "config.json") as f:
        d = json.load(f)
    d["mask_token_id"] = MASK_ID
    with open(path / "config.json", "w") as f:
        json.dump(d, f)
    return model, path


def _additive_mask(seq_len, block):
    visible = block_causal_mask(seq_len, block)
    return torch.where(torch.from_numpy(visible), 0.0, torch.finfo(torch.float32).min)[None, None]


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("block,seq_len", [(4, 11), (32, 45)])
def test_logits_match_transformers(tmp_path, tie, block, seq_len):
    hf, path = _hf_model(tmp_path, tie=tie)
    loaded = load_model(path, block_size=block)
    assert loaded.config.tie_word_embeddings == tie
    assert loaded.config.mask_token_id == MASK_ID and loaded.config.block_size == block
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 101, size=(2, seq_len))
    with torch.no_grad():
        ref = hf(input_ids=torch.from_numpy(tokens), attention_mask=_additive_mask(seq_len, block)).logits.numpy()
    positions = np.broadcast_to(np.arange(seq_len), tokens.shape)
    mask = np.broadcast_to(block_causal_mask(seq_len, block), (2, seq_len, seq_len))
    ours = forward_full(loaded.params, loaded.config, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(mask))
    assert np.max(np.abs(np.asarray(ours) - ref)) <= 1e-4


def test_linear_rope_scaling_matches_transformers(tmp_path):
    hf, path = _hf_model(tmp_path, tie=True, rope_scaling={"rope_type": "linear", "factor": 2.0})
    loaded = load_model(path, block_size=4)
    assert loaded.config.rope_scaling_factor == 2.0
    tokens = np.random.default_rng(2).integers(0, 101, size=(1, 13))
    with torch.no_grad():
        ref = hf(input_ids=torch.from_numpy(tokens), attention_mask=_additive_mask(13, 4)).logits.numpy()
    ours = forward_full(loaded.params, loaded.config, jnp.asarray(tokens), jnp.arange(13)[None],
                        jnp.asarray(block_causal_mask(13, 4))[None])
    assert np.max(np.abs(np.asarray(ours) - ref)) <= 1e-4


def test_unsupported_rope_scaling_is_a_clear_error(tmp_path):
    _, path = _hf_model(tmp_path, tie=True)
    with open(path / "config.json") as f:
        d = json.load(f)
    d.pop("rope_parameters", None)
    d["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    with open(path / "config.json", "w") as f:
        json.dump(d, f)
    with pytest.raises(ConfigError, match="yarn"):
        load_model(path)


@pytest.mark.parametrize("block", [4, 32])
def test_incremental_paged_path_equals_full_forward(tmp_path, block):
    """KV for complete blocks first (one chunk), then one block at a time: same logits as the full forward."""
    _, path = _hf_model(tmp_path, tie=False)
    m = load_model(path, block_size=block)
    cfg, params = m.config, m.params
    num_blocks = 4
    seq_len = num_blocks * block
    tokens = np.random.default_rng(3).integers(0, 101, size=(1, seq_len))
    full = forward_full(params, cfg, jnp.asarray(tokens), jnp.arange(seq_len)[None],
                        jnp.asarray(block_causal_mask(seq_len, block))[None], return_hidden=True)
    num_pages = 8
    pages = [(jnp.zeros((cfg.num_kv_heads, num_pages, block, cfg.head_dim)),) * 2 for _ in range(cfg.num_layers)]
    # Pages out of order on purpose: the page table, not the position, says where a block lives.
    page_ids = np.array([5, 2, 7, 3])
    table = jnp.asarray(np.concatenate([page_ids, [0, 0]])[None], jnp.int32)
    chunk = jax.jit(lambda *a: forward_chunk(params, cfg, *a, block_size=block,
                                             attention_fn=paged_block_attention_reference))
    # Prefill the first two blocks in one chunk.
    hidden, pages = chunk(jnp.asarray(tokens[:, : 2 * block]), pages, table, jnp.zeros((1,), jnp.int32),
                          jnp.asarray(page_ids[None, :2]))
    np.testing.assert_allclose(np.asarray(hidden), np.asarray(full[:, : 2 * block]), atol=1e-4)
    for b in range(2, num_blocks):
        sl = slice(b * block, (b + 1) * block)
        hidden, pages = chunk(jnp.asarray(tokens[:, sl]), pages, table, jnp.asarray([b * block], jnp.int32),
                              jnp.asarray(page_ids[None, b:b + 1]))
        np.testing.assert_allclose(np.asarray(hidden), np.asarray(full[:, sl]), atol=1e-4)


def test_orbax_round_trip_is_bit_identical(tmp_path):
    _, path = _hf_model(tmp_path, tie=False)
    out = tmp_path / "orbax"
    convert_checkpoint(str(path), str(out))
    a = load_model(path)
    b = load_model(out)
    assert a.config == b.config.replace() or a.config.replace(architecture=b.config.architecture) == b.config
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
        assert x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y))
    assert jax.tree.structure(a.params) == jax.tree.structure(b.params)


def test_bfloat16_load(tmp_path):
    _, path = _hf_model(tmp_path, tie=True)
    m = load_model(path, dtype="bfloat16")
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(m.params))


# --- error paths: each names the file or tensor at fault ---------------------------------------

def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        load_model(tmp_path / "nope")


def test_missing_config(tmp_path):
    (tmp_path / "m").mkdir()
    with pytest.raises(ConfigError, match="config.json"):
        load_model(tmp_path / "m")


def test_unknown_architecture(tmp_path):
    _, path = _hf_model(tmp_path, tie=True)
    with open(path / "config.json") as f:
        d = json.load(f)
    d["architectures"] = ["LlamaForCausalLM"]
    with open(path / "config.json", "w") as f:
        json.dump(d, f)
    with pytest.raises(ConfigError, match="LlamaForCausalLM"):
        load_model(path)


def test_missing_mask_token(tmp_path):
    _, path = _hf_model(tmp_path, tie=True)
    with open(path / "config.json") as f:
        d = json.load(f)
    d.pop("mask_token_id")
    with open(path / "config.json", "w") as f:
        json.dump(d, f)
    with pytest.raises(ConfigError, match="mask"):
        load_model(path)
    assert load_model(path, mask_token_id=7).config.mask_token_id == 7


def test_corrupt_safetensors(tmp_path):
    _, path = _hf_model(tmp_path, tie=True)
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(path)


def test_wrong_shape_names_tensor(tmp_path):
    _, path = _hf_model(tmp_path, tie=True)
    with open(path / "config.json") as f:
        d = json.load(f)
    d["intermediate_size"] = 128
    with open(path / "config.json", "w") as f:
        json.dump(d, f)
    with pytest.raises(CheckpointError, match=r"mlp\.(gate|up|down)_proj"):
        load_model(path)


def test_missing_tensor_names_tensor(tmp_path):
    _, path = _hf_model(tmp_path, tie=True)
    from safetensors.numpy import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    tensors.pop("model.layers.1.self_attn.k_norm.weight")
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.k_norm\.weight"):
        load_model(path)


def test_sharded_checkpoint(tmp_path):
    hf, path = _hf_model(tmp_path, tie=False, name="sharded")
    hf.save_pretrained(path, max_shard_size="50KB")
    assert (path / "model.safetensors.index.json").exists()
    with open(path / "config.json") as f:
        d = json.load(f)
    d["mask_token_id"] = MASK_ID
    with open(path / "config.json", "w") as f:
        json.dump(d, f)
    single = tmp_path / "single"
    hf.save_pretrained(single)
    a, b = load_model(path), load_model(single, mask_token_id=MASK_ID)
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
        assert np.array_equal(np.asarray(x), np.asarray(y))


def test_missing_shard(tmp_path):
    hf, path = _hf_model(tmp_path, tie=False, name="sharded")
    for f in path.glob("*.safetensors"):
        f.unlink()
    hf.save_pretrained(path, max_shard_size="50KB")
    shards = sorted(path.glob("model-*.safetensors"))
    shards[-1].unlink()
    with pytest.raises(CheckpointError, match=shards[-1].name):
        load_model(path, mask_token_id=MASK_ID)
