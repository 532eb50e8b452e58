"""The synthetic corpus and the tokenizer trained on it."""

import json

import numpy as np
import pytest

from dllm_jax.train import data, tasks
from dllm_jax.train import tokenizer as tok_lib


@pytest.fixture(scope="module")
def tokenizer():
    return tok_lib.train_tokenizer()


def test_training_data_is_deterministic():
    a = tasks.training_examples(0, 7, 24)
    assert a == tasks.training_examples(0, 7, 24)
    assert a != tasks.training_examples(0, 8, 24)
    assert a != tasks.training_examples(1, 7, 24)
    assert {ex.task for ex in tasks.training_examples(0, 0, 64)} == set(tasks.TASKS)


def test_heldout_set_is_fixed_balanced_and_never_trained_on():
    held = tasks.heldout_set(60)
    assert held == tasks.heldout_set(60) and held[:12] == tasks.heldout_set(12)
    assert len(tasks.heldout_set(300)) == 300
    assert [ex.task for ex in held[:6]] == list(tasks.TASKS)
    assert len({ex.prompt for ex in held}) == 60
    prompts = tasks.heldout_prompts()
    assert len(prompts) == tasks.HELDOUT_POOL
    trained = [ex.prompt for step in range(20) for ex in tasks.training_examples(0, step, 32)]
    assert not prompts & set(trained)
    # the held-out stream is a different seed: its first examples are not the training ones
    assert not {ex.prompt for ex in held} & {ex.prompt for ex in tasks.training_examples(0, 0, 200)}


def test_answers_are_determined_by_the_prompt():
    rng = np.random.default_rng(3)
    for _ in range(20):
        for gen, words, step in ((tasks.gen_count, 4, 1), (tasks.gen_countdown, 4, -1), (tasks.gen_evens, 5, 2)):
            ex = gen(rng)
            steps, start = int(ex.prompt.split()[words - 2]), int(ex.prompt.rstrip(".").split()[-1])
            assert tasks.MIN_STEPS <= steps <= tasks.MAX_STEPS and len(ex.prompt.split()) == words + 2
            items = [start + step * i for i in range(steps)]
            assert ex.answer == "Answer: " + " | ".join(f"{i} {x}" for i, x in enumerate(items, 1))
            assert 0 <= min(items) and max(items) <= tasks.MAX_NUMBER
        ex = tasks.gen_times(rng)
        words = ex.prompt.rstrip(".").split()
        k, lo, hi = int(words[3]), int(words[5]), int(words[7])
        assert ex.answer == "Answer: " + " | ".join(f"{k} x {j} = {k * j}" for j in range(lo, hi + 1))
        assert max(k * j for j in range(lo, hi + 1)) <= tasks.MAX_NUMBER
        ex = tasks.gen_repeat(rng)
        times, phrase = ex.prompt[len("Repeat "):].split(" times: ")
        assert ex.answer == "Answer: " + " | ".join(f"{i} {phrase}" for i in range(1, int(times) + 1))
        assert len(set(phrase.split())) == len(phrase.split())
        ex = tasks.gen_backwards(rng)
        times, phrase = ex.prompt[len("Repeat backwards "):].split(" times: ")
        back = " ".join(phrase.split()[::-1])
        assert ex.answer == "Answer: " + " | ".join(f"{i} {back}" for i in range(1, int(times) + 1))


def test_is_correct_is_exact_match_after_strip():
    ex = tasks.Example("copy", "Copy the list: a b", "Answer: a b")
    assert tasks.is_correct(ex, " Answer: a b\n")
    assert not tasks.is_correct(ex, "Answer: a  b")
    assert not tasks.is_correct(ex, "Answer: a b c")


def test_tokenizer_special_tokens_and_round_trip(tokenizer, tmp_path):
    from transformers import AutoTokenizer

    tok_lib.save_tokenizer(tokenizer, tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert 300 <= len(tok) <= 4000
    ids = tok_lib.special_ids(tok)
    assert ids == {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "<|mask|>": 3}
    assert tok.mask_token == "<|mask|>" and tok.mask_token_id == 3
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    for ex in tasks.heldout_set(12):
        for text in (ex.prompt, ex.answer, "Unseen text, with Punctuation! 12345 ~ é"):
            assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    text = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<|mask|><|mask|>"
    enc = tok.encode(text, add_special_tokens=False)
    assert enc.count(3) == 2 and enc[0] == 1
    assert tok.decode(enc, skip_special_tokens=True) == "user\nhi\nassistant\n"
    tok_lib.check_tokenizer(tok)  # every item is one token


def test_chat_template(tokenizer):
    msgs = [{"role": "user", "content": "Count from 3 to 40."}]
    assert tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        tok_lib.chat_prompt("Count from 3 to 40.")
    no_gen = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    assert no_gen == "<|im_start|>user\nCount from 3 to 40.<|im_end|>\n"
    two = msgs + [{"role": "assistant", "content": "Answer: 3"}]
    assert tokenizer.apply_chat_template(two, tokenize=False).endswith("<|im_start|>assistant\nAnswer: 3<|im_end|>\n")


def test_encoded_rows_span_several_blocks_and_fit(tokenizer):
    enc = data.Encoder(tokenizer)
    examples = tasks.training_examples(0, 0, 300)
    batch = enc.batch(examples)
    answer_len = batch.answer_end - batch.prompt_len
    assert answer_len.min() >= 30 and answer_len.max() <= 101
    assert batch.answer_end.max() <= data.DEFAULT_SEQ_LEN == 128
    for i in range(8):
        row = batch.tokens[i]
        assert row[batch.answer_end[i] - 1] == enc.end_id
        assert np.all(row[batch.answer_end[i]:] == enc.pad_id)
        assert tokenizer.decode(row[batch.prompt_len[i]: batch.answer_end[i] - 1]) == examples[i].answer
        assert tokenizer.decode(row[: batch.prompt_len[i]]) == tok_lib.chat_prompt(examples[i].prompt)
