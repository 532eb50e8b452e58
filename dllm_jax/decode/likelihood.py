"""Sequence likelihoods of block-diffusion (mask-based) models: what an RL policy ratio or a multiple-choice
evaluation needs, where next-token log-probabilities do not exist.

A completion ``c`` after a prompt ``p`` lies in the blocks of ``B`` positions the model decodes (aligned to multiples
of ``B``; the prompt's last block holds its first completion tokens). Two estimators, both over rows of the
whole-sequence forward (:func:`dllm_jax.model.qwen3.forward_full`) under the block-causal mask, the mask id
excluded from every distribution (as decoding excludes it):

* ``"chain"``: each block decoded left to right one token at a time -- token ``j`` conditioned on the clean
  earlier blocks, its block's earlier tokens and masks from ``j`` to the block's end. One row per completion
  token; the sum is the exact log-likelihood of that unmasking order. :func:`chain_scores` also returns each
  position's top-k alternatives from the same forward (what OpenAI's ``echo`` + ``logprobs`` reports for a prompt).
* ``"elbo"``: the block-diffusion ELBO by Monte Carlo (as LLaDA / SDAR evaluate): per sample and block, a mask
  ratio ``t ~ U(0, 1]``, each completion token of the block masked with probability ``t`` (at least one), earlier
  blocks clean; a masked token contributes ``log p(x_j) / t``. Per-token figures are the average of their
  contributions over ``num_samples`` samples (seeded); their sum is the ELBO estimate (a lower bound in expectation).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.config import ModelConfig
from dllm_jax.model.qwen3 import block_causal_mask, forward_full
from pallas_kernels import next_pow2

ESTIMATORS = ("chain", "elbo")
# rows x S x S per chain call (the attention scores per head): a long prompt is scored in fewer rows per call
# (a power of two) rather than in one [256, S, S] block (1 GiB per head at S = 1024)
ATTENTION_BUDGET = 1 << 24


@functools.partial(jax.jit, static_argnums=1)
def _position_logprobs(params, cfg: ModelConfig, tokens, targets):
    """``[n, S]``: log p(targets[r, s] at position s) for each row ``tokens[r]`` (block-causal, mask id excluded)."""
    from dllm_jax.model.qwen3 import logits_from_hidden

    n, s = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (n, s))
    mask = jnp.asarray(block_causal_mask(s, cfg.block_size))[None].repeat(n, 0)
    hidden = forward_full(params, cfg, tokens, positions, mask, return_hidden=True)
    logits = logits_from_hidden(params, hidden).astype(jnp.float32)
    logits = logits.at[..., cfg.mask_token_id].set(-jnp.inf)
    return jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), targets[..., None], axis=-1)[..., 0]


@functools.partial(jax.jit, static_argnums=(1, 5))
def _chain_logprobs(params, cfg: ModelConfig, tokens, targets, at, top_k: int):
    """Per row ``r`` of ``tokens [n, S]``, at its position ``at[r]``: (log p(targets[r]) ``[n]``, the ``top_k`` most
    likely tokens' log-probabilities ``[n, k]`` and ids ``[n, k]``, most likely first), all from one forward
    (block-causal, mask id excluded). The LM head runs only at the scored position of each row."""
    from dllm_jax.model.qwen3 import logits_from_hidden

    n, s = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (n, s))
    mask = jnp.asarray(block_causal_mask(s, cfg.block_size))[None].repeat(n, 0)
    hidden = forward_full(params, cfg, tokens, positions, mask, return_hidden=True)
    hidden = jnp.take_along_axis(hidden, at[:, None, None], axis=1)[:, 0]  # [n, H]
    logits = logits_from_hidden(params, hidden).astype(jnp.float32)
    logits = logits.at[..., cfg.mask_token_id].set(-jnp.inf)
    logp = jax.nn.log_softmax(logits, axis=-1)
    target = jnp.take_along_axis(logp, targets[:, None], axis=-1)[:, 0]
    if not top_k:
        return target, jnp.zeros((n, 0), jnp.float32), jnp.zeros((n, 0), jnp.int32)
    top_lp, top_ids = jax.lax.top_k(logp, top_k)
    return target, top_lp, top_ids.astype(jnp.int32)


def chain_scores(params, cfg: ModelConfig, prompt: list[int], completion: list[int], *, top_k: int = 0,
                 max_rows: int = 256) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The chain estimator with the alternatives: per completion token, (its log-probability ``[m]`` float64, the
    ``top_k`` most likely tokens' log-probabilities ``[m, k]`` float64 and ids ``[m, k]`` int, most likely first;
    the mask id is never among them), from the same forward. Rows are padded as :func:`score`'s (a power-of-two
    count, whole blocks), so only those shapes and ``top_k`` compile."""
    k = int(top_k)
    if k < 0 or k >= cfg.vocab_size:
        raise ValueError(f"top_k: must be in [0, {cfg.vocab_size - 1}], got {top_k!r}")
    m = len(completion)
    if not m:
        return np.zeros(0), np.zeros((0, k)), np.zeros((0, k), np.int64)
    B = cfg.block_size
    rows, targets, at = chain_rows(cfg, prompt, completion)
    longest = -(-len(rows[-1]) // B) * B  # rows grow with j
    fit = ATTENTION_BUDGET // (longest * longest)
    per_call = min(max_rows, 1 << max(0, fit.bit_length() - 1))  # a power of two
    lps, tlps, tids = [], [], []
    for i in range(0, m, per_call):
        part = rows[i:i + per_call]
        length = -(-max(len(r) for r in part) // B) * B
        n = next_pow2(len(part))
        tokens = np.full((n, length), cfg.mask_token_id, np.int32)
        for j, r in enumerate(part):
            tokens[j, :len(r)] = r
        tg = np.zeros(n, np.int32)
        tg[:len(part)] = targets[i:i + per_call]
        where = np.zeros(n, np.int32)
        where[:len(part)] = at[i:i + per_call]
        lp, tlp, tid = _chain_logprobs(params, cfg, jnp.asarray(tokens), jnp.asarray(tg), jnp.asarray(where), k)
        lps.append(np.asarray(lp)[:len(part)])
        tlps.append(np.asarray(tlp)[:len(part)])
        tids.append(np.asarray(tid)[:len(part)])
    return (np.concatenate(lps).astype(np.float64), np.concatenate(tlps).astype(np.float64),
            np.concatenate(tids).astype(np.int64))


def _run(params, cfg: ModelConfig, rows: list[np.ndarray], seq: np.ndarray) -> np.ndarray:
    """``[len(rows), S]`` log-probabilities of ``seq``'s tokens under each row (rows padded to a power-of-two count
    and whole blocks; padding: mask tokens in later blocks, which no real position sees)."""
    B = cfg.block_size
    length = -(-max(len(r) for r in rows) // B) * B
    n = next_pow2(len(rows))
    tokens = np.full((n, length), cfg.mask_token_id, np.int32)
    for i, r in enumerate(rows):
        tokens[i, :len(r)] = r
    targets = np.zeros((n, length), np.int32)
    targets[:, :min(length, len(seq))] = seq[:length]
    return np.asarray(_position_logprobs(params, cfg, jnp.asarray(tokens), jnp.asarray(targets)))[:len(rows)]


def _batched(params, cfg, rows, seq, max_rows):
    return np.concatenate([_run(params, cfg, rows[i:i + max_rows], seq) for i in range(0, len(rows), max_rows)])


def chain_rows(cfg: ModelConfig, prompt: list[int], completion: list[int]):
    """(rows, targets, positions) of the chain estimator: one row per completion token."""
    B, mask = cfg.block_size, cfg.mask_token_id
    seq = list(prompt) + list(completion)
    rows, targets, at = [], [], []
    for j in range(len(prompt), len(seq)):
        end = (j // B + 1) * B
        row = np.asarray(seq[:min(end, len(seq))] + [mask] * max(0, end - len(seq)), np.int32)
        row[j:end] = mask
        rows.append(row)
        targets.append(seq[j])
        at.append(j)
    return rows, targets, at


def score(params, cfg: ModelConfig, prompt: list[int], completion: list[int], *, estimator: str = "chain",
          num_samples: int = 8, seed: int = 0, max_rows: int = 256) -> np.ndarray:
    """Per completion token log-probability estimates ``[len(completion)]`` (float64 numpy); see the module doc."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator: must be one of {', '.join(ESTIMATORS)}, got {estimator!r}")
    if not completion:
        return np.zeros(0)
    if estimator == "chain":
        return chain_scores(params, cfg, prompt, completion, max_rows=max_rows)[0]
    return _elbo(params, cfg, prompt, completion, num_samples, seed, max_rows)


def _elbo(params, cfg: ModelConfig, prompt, completion, num_samples: int, seed: int, max_rows: int) -> np.ndarray:
    B, mask = cfg.block_size, cfg.mask_token_id
    rng = np.random.default_rng(seed)
    seq = np.asarray(list(prompt) + list(completion), np.int32)
    start = len(prompt)
    rows, masks, weights = [], [], []  # one row per (sample, block); the positions it masked; 1 / t
    for _ in range(num_samples):
        for b in range(start // B, (len(seq) - 1) // B + 1):
            lo, hi = max(start, b * B), min(len(seq), (b + 1) * B)
            t = 1.0 - rng.random()  # (0, 1]
            masked = rng.random(hi - lo) < t
            if not masked.any():
                masked[rng.integers(hi - lo)] = True
            row = np.full((b + 1) * B, mask, np.int32)
            row[:hi] = seq[:hi]
            row[lo:hi][masked] = mask
            rows.append(row)
            masks.append(np.flatnonzero(masked) + lo)
            weights.append(1.0 / t)
    logps = _batched(params, cfg, rows, seq, max_rows)
    total = np.zeros(len(completion))
    for r, (positions, w) in enumerate(zip(masks, weights)):
        total[positions - start] += w * logps[r, positions]
    return total / num_samples
