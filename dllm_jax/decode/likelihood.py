"""Sequence likelihoods of block-diffusion (mask-based) models: what an RL policy ratio or a multiple-choice
evaluation needs, where next-token log-probabilities do not exist.

A completion ``c`` after a prompt ``p`` lies in the blocks of ``B`` positions the model decodes (aligned to multiples
of ``B``; the prompt's last block holds its first completion tokens). Two estimators, both over rows of the
whole-sequence forward (:func:`dllm_jax.model.qwen3.forward_full`) under the block-causal mask, the mask id
excluded from every distribution (as decoding excludes it):

* ``"chain"``: each block decoded left to right one token at a time -- token ``j`` conditioned on the clean
  earlier blocks, its block's earlier tokens and masks from ``j`` to the block's end. One row per completion
  token; the sum is the exact log-likelihood of that unmasking order.
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
    seq = np.asarray(list(prompt) + list(completion), np.int32)
    if estimator == "chain":
        rows, _, at = chain_rows(cfg, prompt, completion)
        return _batched(params, cfg, rows, seq, max_rows)[np.arange(len(rows)), at].astype(np.float64)
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
