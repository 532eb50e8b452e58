"""A byte-level BPE tokenizer trained on the synthetic corpus, saved as a standard HF tokenizer.

Special tokens (ids 0-3): ``<|endoftext|>`` (padding after the answer's end, also an EOS),
``<|im_start|>`` / ``<|im_end|>`` (chat roles; ``<|im_end|>`` ends an answer) and ``<|mask|>`` (the
diffusion mask token). The chat template is Qwen's ChatML with ``add_generation_prompt``.
"""

from __future__ import annotations

import os

from dllm_jax.train import tasks

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
MASK = "<|mask|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, MASK)

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def chat_prompt(user_message: str) -> str:
    """What ``apply_chat_template([{"role": "user", ...}], add_generation_prompt=True)`` renders."""
    return f"{IM_START}user\n{user_message}{IM_END}\n{IM_START}assistant\n"


def train_tokenizer(vocab_size: int = 2048, seed: int = 7):
    """Train the BPE on :func:`tasks.tokenizer_corpus` and wrap it as a ``PreTrainedTokenizerFast``.

    ``vocab_size`` is an upper bound: byte-level pre-tokenization never merges across spaces, so
    training stops once every word of the corpus is one token (a little under 800 tokens).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=1, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    corpus = tasks.tokenizer_corpus(seed)
    corpus += [chat_prompt(t) for t in corpus[:50]]  # role names and newlines
    tok.train_from_iterator(corpus, trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=IM_END, pad_token=ENDOFTEXT, mask_token=MASK,
        additional_special_tokens=[IM_START], chat_template=CHAT_TEMPLATE,
        model_max_length=4096, clean_up_tokenization_spaces=False,
    )
    check_tokenizer(hf)
    return hf


def check_tokenizer(tokenizer) -> None:
    """Every word and number item must be one token with its leading space (the tasks rely on it)."""
    bad = [w for w in list(tasks.WORDS) + [str(n) for n in range(tasks.MAX_NUMBER + 1)]
           if len(tokenizer.encode(" " + w, add_special_tokens=False)) != 1]
    if bad:
        raise RuntimeError(f"tokenizer splits items into several tokens: {bad[:10]}")
    for s in SPECIAL_TOKENS:
        ids = tokenizer.convert_tokens_to_ids(s)
        if tokenizer.encode(s, add_special_tokens=False) != [ids]:
            raise RuntimeError(f"special token {s} is not a single token")


def special_ids(tokenizer) -> dict[str, int]:
    return {s: int(tokenizer.convert_tokens_to_ids(s)) for s in SPECIAL_TOKENS}


def save_tokenizer(tokenizer, out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    tokenizer.save_pretrained(out_dir)
