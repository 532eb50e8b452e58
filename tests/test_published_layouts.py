"""Checkpoint directories in the layouts SDAR / SDAR-MoE / LLaDA2 are published in (issue 17), written by
:func:`dllm_jax.testing.published.write_published` at test size: the published config keys (remote-code ``auto_map``,
``attn_implementation: "flex_attention"``, ``fuse_cross_entropy``, ...), bf16 weights in sharded safetensors with
an index, SDAR's tokenizer as vocab.json / merges.txt / tokenizer_config.json / added_tokens.json only, a
``generation_config.json`` with an EOS list and sampling defaults, and ``.py`` files that raise on import.

The engine loads each without running or asking about remote code, finds the mask and EOS ids, formats chats with
the checkpoint's template, and decides as the float64 reference on the same directory (tests/oracle.py: transformers
for SDAR, the NumPy forward of test_llada2 for LLaDA2)."""

import builtins
import os
import sys

import numpy as np
import pytest

from conftest import assert_pages_back
from dllm_jax.model.generation import generation_defaults
from dllm_jax.model.tokenizer import load_tokenizer
from dllm_jax.testing import published
from dllm_jax.testing.tokenizer_files import LLADA2_MASK_TOKEN, write_fast_tokenizer
from oracle import Oracle

# One fixed bucket set for every engine here (chat prompts of ~40-60 tokens, answers of 12).
KW = dict(max_running_requests=4, context_length=128, num_kv_pages=4 * 32 + 1,
          shape_buckets=dict(rows=(8,), pages=(32,), prefill_rows=(1,), prefill_blocks=(16,)))
GREEDY = {"max_new_tokens": 12, "temperature": 0}
TRAP_MODULES = ("modeling_sdar", "configuration_sdar", "tokenization_qwen2", "tokenization_qwen2_fast",
                "modeling_llada2_moe", "configuration_llada2_moe", "tokenization_bailing", "modeling_sdar_moe",
                "configuration_sdar_moe")
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hello world"},
        {"role": "assistant", "content": "yes"}, {"role": "user", "content": "count one two three"}]


@pytest.fixture(autouse=True)
def _no_prompt(monkeypatch):
    """Anything that asks (transformers' "Do you wish to run the custom code? [y/N]") fails the test instead of
    blocking it."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"loading asked the user something: {args}")

    monkeypatch.setattr(builtins, "input", refuse)


def _no_remote_code(path):
    assert not os.path.exists(os.path.join(path, "REMOTE_CODE_IMPORTED")), "the directory's own code was imported"
    assert not set(TRAP_MODULES) & set(sys.modules)


def _engine(path, **kw):
    from dllm_jax import Engine

    return Engine(path, **dict(KW, **kw))


@pytest.fixture(scope="module")
def sdar(tmp_path_factory):
    pub = published.write_published(str(tmp_path_factory.mktemp("sdar") / "SDAR-tiny-Chat"), "sdar", std=0.5,
                                  embed_std=0.5, max_shard_bytes=150_000)
    engine = _engine(pub.path)
    yield pub, engine
    engine.shutdown()
    assert_pages_back(engine)


def test_sdar_directory_is_the_published_layout(sdar):
    pub, _ = sdar
    files = set(os.listdir(pub.path))
    assert {"vocab.json", "merges.txt", "tokenizer_config.json", "added_tokens.json", "chat_template.jinja",
            "generation_config.json", "model.safetensors.index.json", "modeling_sdar.py"} <= files
    assert "tokenizer.json" not in files and len(pub.shards) >= 2
    for key in ("auto_map", "fuse_cross_entropy", "micro_forward", "use_deepep", "mask_token_id", "block_size"):
        assert key in pub.config
    assert pub.config["attn_implementation"] == "flex_attention" and pub.config["model_type"] == "sdar"
    # The traps work: importing one really raises (run on a copy, so the directory stays clean).
    import runpy
    import shutil

    copy = os.path.join(os.path.dirname(pub.path), "trap_copy")
    os.makedirs(copy, exist_ok=True)
    shutil.copy(os.path.join(pub.path, "modeling_sdar.py"), copy)
    with pytest.raises(RuntimeError, match="remote code"):
        runpy.run_path(os.path.join(copy, "modeling_sdar.py"))


def test_sdar_loads_without_remote_code_and_decodes_like_transformers(sdar):
    pub, engine = sdar
    _no_remote_code(pub.path)
    assert type(engine.tokenizer).__name__ == "Qwen2Tokenizer"
    assert engine.mask_token_id == pub.mask_token_id == pub.token_ids["<|MASK|>"]
    assert engine.eos_token_ids == pub.eos_token_ids == (pub.token_ids["<|im_end|>"], pub.token_ids["<|endoftext|>"])
    assert engine.block_size == 4
    # The checkpoint's template: a system message and a multi-turn conversation.
    text = engine.apply_chat_template(CHAT)
    assert text == ("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nhello world<|im_end|>\n"
                    "<|im_start|>assistant\nyes<|im_end|>\n<|im_start|>user\ncount one two three<|im_end|>\n"
                    "<|im_start|>assistant\n")
    prompts = [engine.tokenize(text), engine.tokenize(engine.apply_chat_template("tell me a story")),
               engine.tokenize("hello world, one two three")]
    assert prompts[0].count(pub.token_ids["<|im_start|>"]) == 5  # special tokens encode as single ids
    outs = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=GREEDY)]
    Oracle(pub.path).verify_all(prompts, outs, 12, stop_ids=engine.eos_token_ids)
    assert all(pub.mask_token_id not in o for o in outs)
    _no_remote_code(pub.path)


def test_generation_config_gives_the_defaults_of_unset_sampling_params(sdar, tmp_path):
    pub, engine = sdar
    gen = pub.generation_config
    assert engine.get_model_info()["default_sampling_params"] == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    unset = engine.make_request([1, 2, 3], {"max_new_tokens": 4}).params
    assert (unset.temperature, unset.top_p, unset.top_k) == (gen["temperature"], gen["top_p"], gen["top_k"])
    null = engine.make_request([1, 2, 3], {"temperature": None, "top_k": None}).params  # null = default
    assert (null.temperature, null.top_k) == (0.6, 20)
    given = engine.make_request([1, 2, 3], {"temperature": 0, "top_p": 1.0}).params
    assert (given.temperature, given.top_p, given.top_k) == (0.0, 1.0, 20)
    assert engine.make_request([1, 2, 3], None).params.temperature == 0.6
    # do_sample: false means greedy; no file means no defaults.
    (tmp_path / "generation_config.json").write_text('{"do_sample": false, "temperature": 0.7, "top_k": 5}')
    assert generation_defaults(str(tmp_path)) == {"temperature": 0.0}
    assert generation_defaults(str(tmp_path / "missing")) == {}
    # sampling_defaults="none": SamplingParams' own defaults (greedy).
    plain = _engine(pub.path, sampling_defaults="none")
    try:
        assert plain.make_request([1, 2, 3], {}).params.temperature == 0.0
    finally:
        plain.shutdown()
    with pytest.raises(ValueError, match="sampling_defaults"):
        _engine(pub.path, sampling_defaults="openai")


def test_tokenizer_class_is_chosen_without_auto_tokenizer(sdar, tmp_path, monkeypatch):
    """AutoTokenizer would follow the tokenizer config's auto_map into the directory's code; it is never asked."""
    import transformers

    pub, _ = sdar

    def refuse(*args, **kwargs):
        raise AssertionError("AutoTokenizer was asked to resolve the tokenizer")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)
    tok = load_tokenizer(pub.path)
    assert type(tok).__name__ == "Qwen2Tokenizer" and tok.convert_tokens_to_ids("<|MASK|>") == pub.mask_token_id
    fast = write_fast_tokenizer(str(tmp_path))  # LLaDA2's: tokenizer.json, a remote BailingTokenizer class
    tok = load_tokenizer(str(tmp_path))
    assert tok.mask_token_id == fast[LLADA2_MASK_TOKEN]
    _no_remote_code(pub.path)


def test_converted_published_directory_keeps_its_tokenizer(sdar, tmp_path):
    from dllm_jax.model.loader import convert_checkpoint, load_model

    pub, engine = sdar
    out = tmp_path / "converted"
    convert_checkpoint(pub.path, str(out), dtype="bfloat16")
    assert not any(f.endswith(".py") for f in os.listdir(out))  # remote code is never carried over
    m = load_model(str(out), dtype="bfloat16")
    assert m.config.mask_token_id == engine.mask_token_id and m.config.eos_token_ids == engine.eos_token_ids
    assert m.tokenizer.encode("hello world") == engine.tokenizer.encode("hello world")


def test_llada2_published_layout_decides_as_the_numpy_reference(tmp_path):
    from test_llada2 import _np_forward

    from dllm_jax.model.templates import render_llada2_chat

    pub = published.write_published(str(tmp_path / "LLaDA2-tiny"), "llada2", std=0.5, embed_std=0.5,
                                  max_shard_bytes=150_000, keep_tensors=True)
    engine = _engine(pub.path, block_size=4)
    try:
        _no_remote_code(pub.path)
        assert "mask_token_id" not in pub.config  # it comes from the tokenizer
        assert engine.mask_token_id == pub.token_ids[LLADA2_MASK_TOKEN]
        assert engine.eos_token_ids == pub.eos_token_ids
        assert engine.apply_chat_template(CHAT) == render_llada2_chat(CHAT)
        prompts = [[5, 6, 7, 8, 9, 10], [3, 4], engine.tokenize("hello world, one two")]
        outs = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=dict(GREEDY,
                                                                                               ignore_eos=True))]
        oracle = Oracle(logits_fn=lambda tokens, block: _np_forward(pub.tensors, pub.config, np.asarray(tokens), block),
                        block_size=4, mask_id=engine.mask_token_id)
        oracle.verify_all(prompts, outs, 12)
    finally:
        engine.shutdown()
    _no_remote_code(pub.path)


@pytest.mark.slow
def test_sdar_moe_published_layout_decodes_like_transformers(tmp_path):
    pub = published.write_published(str(tmp_path / "SDAR-MoE-tiny"), "sdar_moe", std=0.5, embed_std=0.5,
                                  max_shard_bytes=150_000)
    engine = _engine(pub.path)
    try:
        _no_remote_code(pub.path)
        assert engine.config.is_moe and engine.mask_token_id == pub.mask_token_id
        prompts = [engine.tokenize(engine.apply_chat_template(CHAT)), [5, 6, 7, 8, 9, 10]]
        outs = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=GREEDY)]
        Oracle(pub.path).verify_all(prompts, outs, 12, stop_ids=engine.eos_token_ids)
    finally:
        engine.shutdown()
    _no_remote_code(pub.path)


def test_tokenizer_fixtures_have_the_vocabulary_they_promise(tmp_path):
    """``bpe_vocab`` tokens of BPE, then the added ones (issue 49: ``write_gemma_tokenizer(bpe_vocab=995)`` gave 543
    tokens where its docstring promised 1,000, the word corpus having merges for about 540); the default sizes keep
    their tokens."""
    import json

    from transformers import PreTrainedTokenizerFast

    from dllm_jax.testing.tokenizer_files import (GEMMA_ADDED_TOKENS, train_bpe, write_gemma_tokenizer,
                                                  write_qwen2_tokenizer)

    for bpe_vocab in (256, 400, 543, 544, 995, 4000):
        out = tmp_path / f"gemma{bpe_vocab}"
        out.mkdir()
        ids = write_gemma_tokenizer(str(out), bpe_vocab=bpe_vocab)
        tok = PreTrainedTokenizerFast.from_pretrained(str(out))
        assert len(tok) == bpe_vocab + len(GEMMA_ADDED_TOKENS), (bpe_vocab, len(tok))
        assert sorted(ids.values()) == list(range(bpe_vocab, bpe_vocab + len(GEMMA_ADDED_TOKENS)))
        assert tok.decode(tok.encode("hello world 42", add_special_tokens=False)) == "hello world 42"
    out = tmp_path / "qwen"
    out.mkdir()
    ids = write_qwen2_tokenizer(str(out), bpe_vocab=995)
    assert len(json.loads((out / "vocab.json").read_text())) == 995 and min(ids.values()) == 995
    for bad in (100, 255, 1 << 17):
        with pytest.raises(ValueError, match="bpe_vocab"):
            train_bpe(bad)
