"""Text in and out of the engine: tokenization, chat template, stop strings (also across block boundaries) and
streamed text that adds up to the final text and never repeats itself."""

import pytest

from dllm_jax.engine.sampling import SamplingParams

from conftest import ENGINE_KW, SHIPPED_KW


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    import jax

    from dllm_jax.config import ModelConfig
    from dllm_jax.model.converted import save_hf
    from dllm_jax.model.params import init_params
    from dllm_jax.train import tokenizer as tok_lib

    tok = tok_lib.train_tokenizer()
    ids = tok_lib.special_ids(tok)
    cfg = ModelConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, max_position_embeddings=512, mask_token_id=ids[tok_lib.MASK],
                      block_size=4, eos_token_ids=(ids[tok_lib.IM_END],), tie_word_embeddings=True)
    path = tmp_path_factory.mktemp("chat") / "model"
    save_hf(init_params(cfg, jax.random.PRNGKey(5), std=0.5), cfg, str(path))
    tok.save_pretrained(str(path))
    return str(path)


RUN = {"max_new_tokens": 24, "ignore_eos": True}


def test_prompt_text_and_chat_template(chat_model, make_engine):
    engine = make_engine(chat_model, **ENGINE_KW)
    text = engine.apply_chat_template("Copy the list: a b c")
    assert "Copy the list: a b c" in text and text != "Copy the list: a b c"
    by_text = engine.generate(prompt=text, sampling_params=RUN)
    by_ids = engine.generate(input_ids=engine.tokenize(text), sampling_params=RUN)
    assert by_text["output_ids"] == by_ids["output_ids"] and by_text["text"] == by_ids["text"]
    assert by_text["meta_info"]["prompt_tokens"] == len(engine.tokenize(text))


def test_detokenizing_equals_the_tokenizers_decode(chat_model, make_engine):
    """The engine decodes through the fast tokenizer's own method (skipping transformers' per-id input walk):
    the same text as ``tokenizer.decode`` for any ids, special tokens kept or skipped."""
    import random

    engine = make_engine(chat_model, **ENGINE_KW)
    tok = engine.tokenizer
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(0, 40))]
        for skip in (True, False):
            assert engine.output.decode(ids, skip) == tok.decode(ids, skip_special_tokens=skip)


def test_stop_string_across_a_block_boundary(make_engine):
    # the shipped model at B = 4 (it was trained on 4 too): its text does not repeat itself, a random one may
    engine = make_engine(None, block_size=4, **dict(SHIPPED_KW, context_length=128,
                                                    shape_buckets=dict(SHIPPED_KW["shape_buckets"], pages=(32,))))
    prompt = engine.apply_chat_template("Count up 15 steps from 40.")
    full = engine.generate(prompt=prompt, sampling_params=RUN)
    ids = full["output_ids"]
    tok = engine.tokenizer
    # A stop string made of the end of block 2's text and the start of block 3's (blocks of 4 tokens here).
    split = 8 - (len(engine.tokenize(prompt)) % 4)
    left, right = tok.decode(ids[:split]), tok.decode(ids[:split + 2])
    stop = right[max(0, len(left) - 2):]
    assert stop and stop in right and stop not in left[:-2]
    want_text = full["text"][:full["text"].find(stop)]
    out = engine.generate(prompt=prompt, sampling_params={**RUN, "stop": [stop]})
    assert out["text"] == want_text
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["output_ids"] == ids[:len(out["output_ids"])] and len(out["output_ids"]) < len(ids)
    chunks = list(engine.generate(prompt=prompt, sampling_params={**RUN, "stop": [stop]}, stream=True))
    assert "".join(c["text"] for c in chunks) == want_text
    assert sum((c["output_ids"] for c in chunks), []) == out["output_ids"]


def test_streamed_text_equals_final_text(chat_model, make_engine):
    engine = make_engine(chat_model, **dict(ENGINE_KW, context_length=128,
                                             shape_buckets=dict(ENGINE_KW["shape_buckets"], pages=(32,))))
    prompt = engine.apply_chat_template("Reverse the list: 4 8 15 16 23 42")
    final = engine.generate(prompt=prompt, sampling_params=RUN)
    chunks = list(engine.generate(prompt=prompt, sampling_params=RUN, stream=True))
    assert "".join(c["text"] for c in chunks) == final["text"]
    assert chunks[-1]["meta_info"]["completion_tokens"] == len(final["output_ids"])


def test_stop_strings_need_a_tokenizer(tiny_model, make_engine):
    engine = make_engine(tiny_model, **ENGINE_KW)
    with pytest.raises(ValueError, match="stop"):
        engine.generate(input_ids=[2, 3], sampling_params={"stop": "x"})
    with pytest.raises(ValueError, match="sampling_params.stop"):
        SamplingParams.from_dict({"stop": ["", "a"]})
