"""The shipped model: a standard HF directory that our loader and transformers both load, and that answers."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from dllm_jax.assets import DEFAULT_MODEL_PATH
from dllm_jax.model.loader import load_model
from dllm_jax.model.qwen3 import block_causal_mask, forward_full

pytestmark = pytest.mark.skipif(not os.path.isfile(os.path.join(DEFAULT_MODEL_PATH, "model.safetensors")),
                                reason="shipped model not exported yet")


@pytest.fixture(scope="module")
def model():
    return load_model(DEFAULT_MODEL_PATH)


def test_directory_is_complete_and_small():
    files = set(os.listdir(DEFAULT_MODEL_PATH))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= files
    size = sum(os.path.getsize(os.path.join(DEFAULT_MODEL_PATH, f)) for f in files)
    assert size <= 20 * 2**20
    with open(os.path.join(DEFAULT_MODEL_PATH, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(DEFAULT_MODEL_PATH, "generation_config.json")) as f:
        gen = json.load(f)
    assert cfg["model_type"] == "qwen3" and cfg["block_size"] == 32
    assert gen["eos_token_id"][0] == cfg["eos_token_id"][0]


def test_our_loader(model):
    cfg, tok = model.config, model.tokenizer
    assert cfg.block_size == 32
    assert cfg.mask_token_id == tok.mask_token_id == tok.convert_tokens_to_ids("<|mask|>")
    assert cfg.eos_token_ids[0] == tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.chat_template and "<|im_start|>" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)


def test_transformers_loads_it_as_qwen3_with_equal_logits(model):
    import torch
    import transformers

    hf = transformers.Qwen3ForCausalLM.from_pretrained(DEFAULT_MODEL_PATH, attn_implementation="eager").float().eval()
    from dllm_jax.train import tasks
    from dllm_jax.train.tokenizer import chat_prompt

    ex = tasks.heldout_set(3)[2]
    ids = model.tokenizer.encode(chat_prompt(ex.prompt) + ex.answer, add_special_tokens=False)
    ids = ids[:40] + [model.config.mask_token_id] * 8 + ids[48:70]
    s, b = len(ids), 8
    visible = block_causal_mask(s, b)
    additive = torch.where(torch.from_numpy(visible), 0.0, torch.finfo(torch.float32).min)[None, None]
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids]), attention_mask=additive).logits.numpy()
    ours = forward_full(model.params, model.config, jnp.asarray([ids]), jnp.arange(s)[None], jnp.asarray(visible)[None])
    assert np.max(np.abs(np.asarray(ours) - ref)) <= 1e-4


def test_naive_decoder_answers_held_out_prompts(model):
    from dllm_jax.evaluate import prompt_ids
    from dllm_jax.train import tasks
    from dllm_jax.train.naive_decode import naive_generate

    examples = [ex for ex in tasks.heldout_set(12) if ex.task in ("count", "times", "repeat")][:3]
    outs = naive_generate(model.params, model.config, prompt_ids(model.tokenizer, examples), block_size=32,
                          threshold=0.9, max_new_tokens=128)
    for ex, (ids, forwards) in zip(examples, outs):
        assert tasks.is_correct(ex, model.tokenizer.decode(ids, skip_special_tokens=True)), ex.prompt
        assert ids[-1] in model.config.eos_token_ids
        assert len(ids) / forwards >= 2.0
