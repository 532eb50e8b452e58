"""A request's host-side state: its tokens, its KV pages and its current block."""

from __future__ import annotations

import dataclasses
import enum
import time
from typing import Any, Callable

import numpy as np

from dllm_jax.engine.sampling import SamplingParams


class Phase(enum.Enum):
    WAITING = "waiting"  # queued (new, or retracted and waiting to be re-admitted)
    PREFILL = "prefill"  # admitted; complete blocks of real tokens still to encode
    DECODE = "decode"  # admitted; its next block has positions to generate
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Request:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    on_event: Callable[["Request", dict], None] | None = None  # called with each committed chunk / the finish
    # Also call on_event after every denoise step that leaves the block unfinished, with {"provisional": True}.
    provisional: bool = False
    # A streamed request: each committed block goes out as it is done (the scheduler never chains its blocks).
    stream: bool = False
    arrival_time: float = dataclasses.field(default_factory=time.perf_counter)
    # Structured output: the request's grammar state (dllm_jax/engine/grammar.py RowGrammar), or None.
    grammar: Any = None
    # Images in the prompt (DiffusionGemma; dllm_jax/engine/images.py): the prepared images, their spans of image
    # tokens in prompt_ids (first position, count, image), and the prompt's prefix-cache keys (image tokens keyed
    # by their image's digest). Empty / None: a text prompt, keyed by its ids.
    images: tuple = ()
    image_spans: tuple = ()
    prompt_keys: list | None = None

    phase: Phase = Phase.WAITING
    output_ids: list[int] = dataclasses.field(default_factory=list)

    # KV: pages[i] holds block i of the real tokens; the request owns (holds a reference on) only own_pages,
    # the rest belong to the radix index and are kept alive by the lock on `node`.
    pages: list[int] = dataclasses.field(default_factory=list)
    own_pages: set[int] = dataclasses.field(default_factory=set)
    node: Any = None

    # The block being denoised (None between blocks).
    block_tokens: np.ndarray | None = None
    block_immutable: np.ndarray | None = None
    block_page: int | None = None
    block_offset: int | None = None  # absolute position of the block's first token (None: prefix_len(B))
    block_steps: int = 0
    algo_state: dict[str, np.ndarray] | None = None
    # Log probabilities (params.return_logprob): per position of the block, the figures of the forward that
    # wrote it (block_*), and per committed output token SGLang's [logprob, token_id, None] triple (output_*).
    block_logprob: np.ndarray | None = None  # [B] f32
    block_top_logprob: np.ndarray | None = None  # [B, k] f32
    block_top_ids: np.ndarray | None = None  # [B, k] int32
    output_token_logprobs: list = dataclasses.field(default_factory=list)
    output_top_logprobs: list = dataclasses.field(default_factory=list)
    # Commit-forward folding: the last page in `pages` holds KV computed before its block was final; these are
    # the block's final tokens, re-encoded by a refresh row in the next denoise call (then it may be cached).
    stale_tokens: np.ndarray | None = None

    cached_tokens: int | None = None  # the prefix matched at the first admission; never changes afterwards
    forward_passes: int = 0  # forwards that served this request (prefill chunks and denoise steps)
    retractions: int = 0
    weight_version: str | None = None  # of the weights loaded when its last block was decoded (engine/weights.py)
    finish_reason: dict | None = None
    first_block_time: float | None = None
    finish_time: float | None = None
    emitted_tokens: int = 0
    emitted_text: str = ""
    final_text: str | None = None  # the answer's text when a stop string cut it (output.find_stop_string)

    @property
    def real_ids(self) -> list[int]:
        """Prompt plus committed outputs: the tokens whose KV may be cached."""
        return self.prompt_ids + self.output_ids

    @property
    def cache_keys(self) -> list:
        """The prefix cache's keys of :attr:`real_ids` (the ids themselves, but for image tokens)."""
        return self.real_ids if self.prompt_keys is None else self.prompt_keys + self.output_ids

    @property
    def real_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def prefix_len(self, block_size: int) -> int:
        return len(self.pages) * block_size

    @property
    def finished(self) -> bool:
        return self.phase is Phase.FINISHED
