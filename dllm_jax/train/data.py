"""Turn task examples into fixed-length token arrays for training and evaluation.

A training row is ``chat_prompt(prompt) + answer + <|im_end|>`` followed by ``<|endoftext|>`` up to
the row length ``seq_len``: SDAR pads an answer's final block with end-of-text, and the model must
learn to fill that padding confidently. The objective scores positions up to the end of the block
holding ``<|im_end|>`` only (for the block size drawn for the row).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from dllm_jax.train import tasks
from dllm_jax.train.tokenizer import ENDOFTEXT, IM_END, MASK, chat_prompt, special_ids

DEFAULT_SEQ_LEN = 128


@dataclasses.dataclass
class Batch:
    tokens: np.ndarray      # [N, S] int32
    prompt_len: np.ndarray  # [N] int32: positions < prompt_len are the prompt (never noised)
    answer_end: np.ndarray  # [N] int32: one past the <|im_end|> that ends the answer


class Encoder:
    """Tokenizes examples with the project's tokenizer (fast backend, batched)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        ids = special_ids(tokenizer)
        self.pad_id = ids[ENDOFTEXT]
        self.end_id = ids[IM_END]
        self.mask_id = ids[MASK]
        self._fast = tokenizer.backend_tokenizer

    def _encode(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._fast.encode_batch(texts, add_special_tokens=False)]

    def prompt_ids(self, examples: list[tasks.Example]) -> list[list[int]]:
        return self._encode([chat_prompt(ex.prompt) for ex in examples])

    def answer_ids(self, examples: list[tasks.Example]) -> list[list[int]]:
        """The expected completion: answer tokens then ``<|im_end|>``."""
        return [ids + [self.end_id] for ids in self._encode([ex.answer for ex in examples])]

    def batch(self, examples: list[tasks.Example], seq_len: int = DEFAULT_SEQ_LEN) -> Batch:
        prompts, answers = self.prompt_ids(examples), self.answer_ids(examples)
        n = len(examples)
        tokens = np.full((n, seq_len), self.pad_id, np.int32)
        prompt_len = np.zeros(n, np.int32)
        answer_end = np.zeros(n, np.int32)
        for i, (p, a) in enumerate(zip(prompts, answers)):
            row = p + a
            if len(row) > seq_len:
                raise ValueError(f"example of {len(row)} tokens does not fit seq_len={seq_len}: {examples[i].prompt!r}")
            tokens[i, : len(row)] = row
            prompt_len[i] = len(p)
            answer_end[i] = len(row)
        return Batch(tokens, prompt_len, answer_end)


def training_batch(encoder: Encoder, seed: int, step: int, batch_size: int, seq_len: int = DEFAULT_SEQ_LEN) -> Batch:
    return encoder.batch(tasks.training_examples(seed, step, batch_size), seq_len)
