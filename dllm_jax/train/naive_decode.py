"""A deliberately naive reference decoder: greedy LowConfidence by re-running the whole sequence.

No KV cache, no paging, no scheduler: every denoising step runs :func:`qwen3.forward_full` over the
whole (padded) sequence under the block-causal mask and reads the logits of the current block. It
implements the engine's decode semantics literally, so the engine can be tested against it:

* blocks are aligned to absolute positions ``k*B``; the first block decoded is the one holding the
  prompt's tail (its prompt positions are immutable, even if they hold the mask id);
* per step, over the masked positions: argmax token and its probability with the mask id's logit
  excluded; commit every position with ``p > threshold`` (strict), at least the most confident one
  (ties: lowest index);
* a block is done only when a forward has run on its final tokens: the step whose *input* has no
  mask left reports done (so a block with ``m`` masks costs between 2 and ``m + 1`` forwards);
* after a block, its tokens are appended to the output; generation stops at the first EOS id
  (tokens after it are dropped) or at ``max_new_tokens`` (the excess of the block is dropped).

``forward_passes`` counts denoising forwards only (this decoder has no separate prefill).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.config import ModelConfig
from dllm_jax.model.qwen3 import block_causal_mask, forward_full

LENGTH_BUCKET = 64


@functools.partial(jax.jit, static_argnames=("cfg", "block_size"))
def low_confidence_step(params, cfg: ModelConfig, tokens, block_start, prompt_len, threshold, *, block_size: int):
    """One greedy LowConfidence step for every row. tokens ``[N, L]``; block_start/prompt_len ``[N]``.

    Returns (the block's new tokens ``[N, B]``, done ``[N]``: the input block had no mask left).
    """
    n, length = tokens.shape
    mask_id = cfg.mask_token_id
    positions = jnp.broadcast_to(jnp.arange(length)[None], (n, length))
    attn = jnp.broadcast_to(jnp.asarray(block_causal_mask(length, block_size))[None], (n, length, length))
    logits = forward_full(params, cfg, tokens, positions, attn)  # [N, L, V]
    idx = block_start[:, None] + jnp.arange(block_size)[None, :]  # [N, B] absolute positions
    blk_logits = jnp.take_along_axis(logits, idx[:, :, None], axis=1)
    blk_tokens = jnp.take_along_axis(tokens, idx, axis=1)
    masked = (blk_tokens == mask_id) & (idx >= prompt_len[:, None])
    done = ~jnp.any(masked, axis=-1)
    blk_logits = blk_logits.at[..., mask_id].set(-jnp.inf)  # the mask id is never a candidate
    probs = jax.nn.softmax(blk_logits, axis=-1)
    x = jnp.argmax(blk_logits, axis=-1)
    conf = jnp.where(masked, jnp.max(probs, axis=-1), -jnp.inf)
    commit = conf > threshold
    best = jax.nn.one_hot(jnp.argmax(conf, axis=-1), block_size, dtype=bool)
    commit = jnp.where(jnp.any(commit, axis=-1, keepdims=True), commit, best)
    return jnp.where(commit & masked, x, blk_tokens), done


def naive_generate(params, cfg: ModelConfig, prompts: list[list[int]], *, block_size: int | None = None,
                   threshold: float = 0.9, max_new_tokens: int = 256, eos_ids=None, batch_size: int = 16):
    """Greedy LowConfidence for each prompt. Returns ``[(output_ids, forward_passes), ...]``.

    ``output_ids`` ends with the EOS token when generation stopped at one.
    """
    block = int(block_size or cfg.block_size)
    eos = set(int(e) for e in (cfg.eos_token_ids if eos_ids is None else eos_ids))
    results = []
    for lo in range(0, len(prompts), batch_size):
        results += _generate_batch(params, cfg, prompts[lo: lo + batch_size], block, float(threshold),
                                   int(max_new_tokens), eos)
    return results


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _generate_batch(params, cfg, prompts, block, threshold, max_new_tokens, eos):
    n = len(prompts)
    mask_id = cfg.mask_token_id
    prompt_len = np.array([len(p) for p in prompts], np.int32)
    if np.any(prompt_len == 0):
        raise ValueError("empty prompt")
    total = _round_up(int(prompt_len.max()) + max_new_tokens + block, LENGTH_BUCKET)
    tokens = np.full((n, total), mask_id, np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    block_start = (prompt_len // block) * block
    outputs = [[] for _ in range(n)]
    forwards = np.zeros(n, np.int64)
    active = np.ones(n, bool)
    thr = jnp.float32(threshold)
    while active.any():
        length = min(total, _round_up(int((block_start[active] + block).max()), LENGTH_BUCKET))
        # finished rows keep a valid (in-range) block start and are ignored
        starts = np.where(active, block_start, 0).astype(np.int32)
        new_blk, done = low_confidence_step(params, cfg, jnp.asarray(tokens[:, :length]), jnp.asarray(starts),
                                            jnp.asarray(prompt_len), thr, block_size=block)
        new_blk, done = np.asarray(new_blk), np.asarray(done)
        for r in np.flatnonzero(active):
            s = block_start[r]
            forwards[r] += 1
            tokens[r, s: s + block] = new_blk[r]
            if not done[r]:
                continue
            outputs[r] += tokens[r, max(s, prompt_len[r]): s + block].tolist()
            stop = next((j for j, t in enumerate(outputs[r]) if t in eos), None)
            if stop is not None and stop < max_new_tokens:
                outputs[r] = outputs[r][: stop + 1]
                active[r] = False
            elif len(outputs[r]) >= max_new_tokens:
                outputs[r] = outputs[r][:max_new_tokens]
                active[r] = False
            else:
                block_start[r] = s + block
    return [(outputs[i], int(forwards[i])) for i in range(n)]
