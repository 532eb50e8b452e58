"""Differentiable sequence likelihoods of a block-diffusion policy and the GRPO / PPO loss over them
(``python -m dllm_jax.train.rl``).

The trainer's log-likelihood must be the engine's (:meth:`dllm_jax.Engine.score`), so that the ratio of the new policy
to the old one (scored by the engine at rollout time) is exactly 1 before the first update. Both estimators of
:mod:`dllm_jax.decode.likelihood` are sums over *rows*: a row is the sequence's clean blocks before block ``b`` and
one noised copy of block ``b``; a completion token's estimate is a weighted sum of its log-probabilities in the rows
that mask it (mask id excluded from the distribution, as decoding excludes it):

* ``chain``: the rows of :func:`dllm_jax.decode.likelihood.chain_rows` (imported, not rebuilt): one per completion
  token, weight 1 at that token;
* ``elbo``: the rows of the engine's ELBO (per sample and block a mask ratio ``t``, the same seeded draws as
  ``Engine.score(estimator="elbo", num_samples, seed)``), weight ``1 / (t * num_samples)`` at every masked token.

Under the block-causal mask the hidden states of the clean prefix are the same in every row of a sequence, so
:func:`row_logprobs` computes them once per sequence (the clean copy, block-causal) and runs only each row's own
block (``B`` query positions attending to the clean blocks before it and to itself): the logits of
``forward_full(row)`` at that block, exactly, for about ``B`` tokens of work per row instead of the row's length
(the same idea as :func:`dllm_jax.train.objective.two_copy_forward`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.config import ModelConfig
from dllm_jax.decode.likelihood import ESTIMATORS, chain_rows
from dllm_jax.model import qwen3


DUAL_CLIP = 3.0        # a negative advantage's surrogate is bounded below by DUAL_CLIP * A (dual-clip PPO)
MAX_LOG_RATIO = 20.0   # log-ratios are clamped before exp (no inf * 0)


# ----------------------------------------------------------------------------------------------
# Rows (host side, numpy)
# ----------------------------------------------------------------------------------------------

def row_specs(cfg: ModelConfig, prompt: list[int], completion: list[int], estimator: str = "chain", *,
              num_samples: int = 8, seed: int = 0):
    """The estimator's rows as (block index ``[n]``, the row's block tokens ``[n, B]``, weights ``[n, B]``): the
    estimate of the completion token at position ``p`` is ``sum_r weights[r, p - b_r * B] * log p_r(seq[p])``."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator: must be one of {', '.join(ESTIMATORS)}, got {estimator!r}")
    B = cfg.block_size
    if not completion:
        return np.zeros(0, np.int32), np.zeros((0, B), np.int32), np.zeros((0, B), np.float32)
    seq = np.asarray(list(prompt) + list(completion), np.int32)
    blocks, toks, weights = [], [], []
    if estimator == "chain":
        rows, _, at = chain_rows(cfg, prompt, completion)
        for row, j in zip(rows, at):
            b = j // B
            assert len(row) == (b + 1) * B and np.array_equal(row[:b * B], seq[:b * B])
            w = np.zeros(B, np.float32)
            w[j - b * B] = 1.0
            blocks.append(b), toks.append(row[b * B:]), weights.append(w)
    else:  # the draws of dllm_jax.decode.likelihood._elbo, in its order (a test checks the two agree)
        mask = cfg.mask_token_id
        rng = np.random.default_rng(seed)
        start = len(prompt)
        for _ in range(num_samples):
            for b in range(start // B, (len(seq) - 1) // B + 1):
                lo, hi = max(start, b * B), min(len(seq), (b + 1) * B)
                t = 1.0 - rng.random()
                masked = rng.random(hi - lo) < t
                if not masked.any():
                    masked[rng.integers(hi - lo)] = True
                blk = np.full(B, mask, np.int32)
                blk[:hi - b * B] = seq[b * B:hi]
                blk[lo - b * B:hi - b * B][masked] = mask
                w = np.zeros(B, np.float32)
                w[lo - b * B:hi - b * B][masked] = 1.0 / (t * num_samples)
                blocks.append(b), toks.append(blk), weights.append(w)
    return np.asarray(blocks, np.int32), np.stack(toks).astype(np.int32), np.stack(weights)


@dataclasses.dataclass
class Chunk:
    """Sequences packed for one device call, fixed shapes ``C`` sequences x ``S`` positions, ``R`` rows."""
    clean: np.ndarray     # [C, S] int32: prompt + completion, mask-id padded
    q_seq: np.ndarray     # [R] int32: the row's sequence in the chunk
    q_block: np.ndarray   # [R] int32: the row's block index
    q_tokens: np.ndarray  # [R, B] int32: the row's own (noised) block
    q_weight: np.ndarray  # [R, B] float32 (0 on padding rows)
    scored: np.ndarray    # [C, S] float32: 1 at completion positions
    adv: np.ndarray       # [C] float32: the sequence's advantage (0 on padding sequences)
    old_lp: np.ndarray    # [C, S] float32: per-token estimate under the rollout policy (Engine.score)
    ref_lp: np.ndarray    # [C, S] float32: per-token estimate under the reference policy (KL), else 0
    index: list           # the batch index of each real sequence of the chunk

    def arrays(self):
        return (self.clean, self.q_seq, self.q_block, self.q_tokens, self.q_weight, self.scored, self.adv,
                self.old_lp, self.ref_lp)


def pack(cfg: ModelConfig, prompts, completions, *, seq_len: int, rows_per_chunk: int, seqs_per_chunk: int,
         adv=None, old_lp=None, ref_lp=None, estimator: str = "chain", num_samples: int = 8, seed: int = 0):
    """Pack sequences into :class:`Chunk` s (greedy, in order). ``old_lp`` / ``ref_lp``: per sequence the
    per-completion-token estimates (lists), or None (zeros)."""
    B = cfg.block_size
    if seq_len % B:
        raise ValueError(f"seq_len {seq_len} must be a multiple of the block size {B}")
    chunks, cur = [], []

    def flush():
        if not cur:
            return
        C, R = seqs_per_chunk, rows_per_chunk
        ch = Chunk(np.full((C, seq_len), cfg.mask_token_id, np.int32), np.zeros(R, np.int32), np.zeros(R, np.int32),
                   np.full((R, B), cfg.mask_token_id, np.int32), np.zeros((R, B), np.float32),
                   np.zeros((C, seq_len), np.float32), np.zeros(C, np.float32), np.zeros((C, seq_len), np.float32),
                   np.zeros((C, seq_len), np.float32), [])
        r = 0
        for c, (i, specs) in enumerate(cur):
            p, comp = prompts[i], completions[i]
            n = len(p) + len(comp)
            ch.clean[c, :n] = list(p) + list(comp)
            ch.scored[c, len(p):n] = 1.0
            ch.adv[c] = 0.0 if adv is None else adv[i]
            if old_lp is not None:
                ch.old_lp[c, len(p):n] = old_lp[i]
            if ref_lp is not None:
                ch.ref_lp[c, len(p):n] = ref_lp[i]
            blocks, toks, weights = specs
            k = len(blocks)
            ch.q_seq[r:r + k], ch.q_block[r:r + k] = c, blocks
            ch.q_tokens[r:r + k], ch.q_weight[r:r + k] = toks, weights
            r += k
            ch.index.append(i)
        chunks.append(ch)
        cur.clear()

    used = 0
    for i, (p, comp) in enumerate(zip(prompts, completions)):
        if len(p) + len(comp) > seq_len:
            raise ValueError(f"sequence {i}: {len(p) + len(comp)} tokens exceed seq_len {seq_len}")
        specs = row_specs(cfg, p, comp, estimator, num_samples=num_samples, seed=seed)
        k = len(specs[0])
        if k > rows_per_chunk:
            raise ValueError(f"sequence {i}: {k} rows exceed rows_per_chunk {rows_per_chunk}")
        if cur and (used + k > rows_per_chunk or len(cur) == seqs_per_chunk):
            flush()
            used = 0
        cur.append((i, specs))
        used += k
    flush()
    return chunks


# ----------------------------------------------------------------------------------------------
# The forward (device side, differentiable)
# ----------------------------------------------------------------------------------------------

def row_logprobs(params, cfg: ModelConfig, clean, q_seq, q_block, q_tokens, q_off=None):
    """Log p(clean token at position ``q_block * B + t``) under the row ``clean[q_seq][:q_block * B] + q_tokens`` and
    the block-causal mask (mask id excluded): what :func:`dllm_jax.model.qwen3.forward_full` gives on that row, with
    the clean prefix computed once per sequence. ``[R, B]`` for every offset ``t``; with ``q_off [R]`` (one scored
    position per row, the chain estimator) ``[R]`` at ``t = q_off`` only, the last layer run for that position alone."""
    C, S = clean.shape
    R, B = q_tokens.shape
    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    g = hq // hkv
    scale = d ** -0.5
    pos_c = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (C, S))
    pos_r = q_block[:, None] * B + jnp.arange(B, dtype=jnp.int32)[None]          # [R, B]
    blk = jnp.arange(S) // B
    causal = blk[None, :] <= blk[:, None]                                        # [S, S] block-causal
    before = jnp.arange(S)[None, :] < (q_block * B)[:, None]                     # [R, S] clean blocks before
    xc = params["embed"][clean]                                                  # [C, S, H]
    xr = params["embed"][q_tokens]                                               # [R, B, H]
    layers = params["layers"]
    for li, layer in enumerate(layers):
        last = li == len(layers) - 1
        hc = qwen3.rms_norm(xc, layer["attn_norm"], cfg.rms_norm_eps)
        hr = qwen3.rms_norm(xr, layer["attn_norm"], cfg.rms_norm_eps)
        qc, kc, vc = qwen3._qkv(layer, hc, pos_c, cfg)                           # [C, S, h, D]
        qr, kr, vr = qwen3._qkv(layer, hr, pos_r, cfg)                           # [R, B, h, D]
        if not last:  # the clean copy's own output feeds only later layers' keys
            qcg = qc.reshape(C, S, hkv, g, d)
            s = jnp.einsum("ntkgd,nskd->nkgts", qcg, kc, preferred_element_type=jnp.float32) * scale
            p = jax.nn.softmax(jnp.where(causal[None, None, None], s, -jnp.inf), axis=-1)
            oc = jnp.einsum("nkgts,nskd->ntkgd", p, vc, preferred_element_type=jnp.float32)
            xc = xc + qwen3._out_proj(layer, oc.reshape(C, S, hq * d).astype(xc.dtype))
            xc = xc + qwen3._mlp(layer, xc, cfg)
        if last and q_off is not None:  # only the scored position's query is needed from here on
            qr = jnp.take_along_axis(qr, q_off[:, None, None, None], axis=1)      # [R, 1, hq, D]
            xr = jnp.take_along_axis(xr, q_off[:, None, None], axis=1)            # [R, 1, H]
        t = qr.shape[1]
        # rows: the clean blocks before theirs (their sequence's keys) and their own block, one softmax
        kcr, vcr = kc[q_seq], vc[q_seq]                                          # [R, S, hkv, D]
        qrg = qr.reshape(R, t, hkv, g, d)
        s_c = jnp.einsum("rtkgd,rskd->rkgts", qrg, kcr, preferred_element_type=jnp.float32) * scale
        s_c = jnp.where(before[:, None, None, None, :], s_c, -jnp.inf)
        s_s = jnp.einsum("rtkgd,rskd->rkgts", qrg, kr, preferred_element_type=jnp.float32) * scale
        p = jax.nn.softmax(jnp.concatenate([s_c, s_s], axis=-1), axis=-1)
        orow = (jnp.einsum("rkgts,rskd->rtkgd", p[..., :S], vcr, preferred_element_type=jnp.float32)
                + jnp.einsum("rkgts,rskd->rtkgd", p[..., S:], vr, preferred_element_type=jnp.float32))
        xr = xr + qwen3._out_proj(layer, orow.reshape(R, t, hq * d).astype(xr.dtype))
        xr = xr + qwen3._mlp(layer, xr, cfg)
    hidden = qwen3.rms_norm(xr, params["final_norm"], cfg.rms_norm_eps)
    logits = qwen3.logits_from_hidden(params, hidden).astype(jnp.float32)
    logits = logits.at[..., cfg.mask_token_id].set(-jnp.inf)
    targets = jnp.take_along_axis(clean[q_seq], pos_r, axis=1)                   # [R, B]
    if q_off is not None:
        targets = jnp.take_along_axis(targets, q_off[:, None], axis=1)           # [R, 1]
    lp = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), targets[..., None], axis=-1)[..., 0]
    return lp if q_off is None else lp[:, 0]


def token_logprobs(params, cfg: ModelConfig, clean, q_seq, q_block, q_tokens, q_weight, one_per_row: bool = False):
    """``[C, S]`` per-position estimates: each row's weighted log-probabilities added at their positions.
    ``one_per_row``: every row weighs one position only (chain), so only that one is computed."""
    C, S = clean.shape
    B = q_tokens.shape[1]
    if one_per_row:
        q_off = jnp.argmax(q_weight, axis=1).astype(jnp.int32)
        w = jnp.take_along_axis(q_weight, q_off[:, None], axis=1)[:, 0]
        lp = row_logprobs(params, cfg, clean, q_seq, q_block, q_tokens, q_off)
        contrib = jnp.where(w > 0, w * lp, 0.0)                                  # padding rows: 0 (never -inf * 0)
        flat = q_seq * S + q_block * B + q_off
        return jnp.zeros(C * S, jnp.float32).at[flat].add(contrib).reshape(C, S)
    lp = row_logprobs(params, cfg, clean, q_seq, q_block, q_tokens)
    contrib = jnp.where(q_weight > 0, q_weight * lp, 0.0)
    flat = q_seq[:, None] * S + q_block[:, None] * B + jnp.arange(B)[None]
    return jnp.zeros(C * S, jnp.float32).at[flat.reshape(-1)].add(contrib.reshape(-1)).reshape(C, S)


@functools.partial(jax.jit, static_argnums=(1, 7))
def chunk_logprobs(params, cfg: ModelConfig, clean, q_seq, q_block, q_tokens, q_weight, one_per_row: bool = False):
    return token_logprobs(params, cfg, clean, q_seq, q_block, q_tokens, q_weight, one_per_row)


def policy_loss(params, cfg: ModelConfig, clean, q_seq, q_block, q_tokens, q_weight, scored, adv, old_lp, ref_lp, *,
                denom, clip_eps: float, kl_coef: float, one_per_row: bool = False):
    """This chunk's share of the GRPO loss ``-(1/denom) sum_seq sum_token surrogate + kl_coef * KL``.

    ``clip_eps > 0``: the PPO surrogate ``min(r A, clip(r, 1 - eps, 1 + eps) A)`` with the per-token ratio
    ``r = exp(logp - old_logp)`` (its gradient at ``r = 1`` is ``A * grad logp``), bounded below by ``DUAL_CLIP * A``
    for negative advantages (dual-clip PPO: a token whose ratio ran far up gets no gradient instead of an unbounded
    one; the ELBO's ``1 / t`` weights make such ratios possible after one update); ``clip_eps == 0``: plain
    ``A * logp``. ``kl_coef > 0`` adds the k3 estimate ``exp(ref - logp) - (ref - logp) - 1`` per token."""
    lp = token_logprobs(params, cfg, clean, q_seq, q_block, q_tokens, q_weight, one_per_row)
    a = adv[:, None]
    log_ratio = jnp.where(scored > 0, lp - old_lp, 0.0)
    if clip_eps > 0:
        ratio = jnp.exp(jnp.clip(log_ratio, -MAX_LOG_RATIO, MAX_LOG_RATIO))
        surr = jnp.minimum(ratio * a, jnp.clip(ratio, 1 - clip_eps, 1 + clip_eps) * a)
        surr = jnp.where(a < 0, jnp.maximum(surr, DUAL_CLIP * a), surr)
        clipped = jnp.sum(scored * (jnp.abs(ratio - 1) > clip_eps))
    else:
        surr = lp * a
        clipped = jnp.zeros(())
    pg = -jnp.sum(surr * scored) / denom
    diff = jnp.clip(jnp.where(scored > 0, ref_lp - lp, 0.0), -MAX_LOG_RATIO, MAX_LOG_RATIO)
    kl = jnp.sum((jnp.exp(diff) - diff - 1) * scored) / denom
    loss = pg + kl_coef * kl
    return loss, {"loss": loss, "pg": pg, "kl": kl, "clipped": clipped, "tokens": jnp.sum(scored),
                  "max_abs_log_ratio": jnp.max(jnp.abs(log_ratio))}


@functools.partial(jax.jit, static_argnames=("cfg", "clip_eps", "kl_coef", "one_per_row"))
def chunk_grads(params, clean, q_seq, q_block, q_tokens, q_weight, scored, adv, old_lp, ref_lp, denom, *,
                cfg: ModelConfig, clip_eps: float, kl_coef: float, one_per_row: bool = False):
    """(gradient of this chunk's share of the loss, metrics)."""
    fn = functools.partial(policy_loss, cfg=cfg, denom=denom, clip_eps=clip_eps, kl_coef=kl_coef,
                           one_per_row=one_per_row)
    (_, metrics), grads = jax.value_and_grad(
        lambda p: fn(p, clean=clean, q_seq=q_seq, q_block=q_block, q_tokens=q_tokens, q_weight=q_weight,
                     scored=scored, adv=adv, old_lp=old_lp, ref_lp=ref_lp), has_aux=True)(params)
    return grads, metrics


def sequence_logprobs(params, cfg: ModelConfig, prompts, completions, *, seq_len: int, rows_per_chunk: int,
                      seqs_per_chunk: int, estimator: str = "chain", num_samples: int = 8, seed: int = 0):
    """Per sequence the per-completion-token estimates (float64 numpy), as ``Engine.score`` returns them."""
    out = [None] * len(prompts)
    for ch in pack(cfg, prompts, completions, seq_len=seq_len, rows_per_chunk=rows_per_chunk,
                   seqs_per_chunk=seqs_per_chunk, estimator=estimator, num_samples=num_samples, seed=seed):
        lp = np.asarray(chunk_logprobs(params, cfg, *(jnp.asarray(a) for a in ch.arrays()[:5]), estimator == "chain"),
                        np.float64)
        for c, i in enumerate(ch.index):
            p = len(prompts[i])
            out[i] = lp[c, p:p + len(completions[i])]
    return out


def group_advantages(rewards: np.ndarray, eps: float = 1e-6) -> tuple[np.ndarray, np.ndarray]:
    """GRPO: ``rewards [P, G]`` -> (advantages ``(r - mean) / (std + eps)`` per group ``[P, G]``, kept ``[P]``:
    the groups whose rewards differ; a zero-variance group carries no signal and gets advantage 0)."""
    r = np.asarray(rewards, np.float64)
    std = r.std(axis=1, keepdims=True)
    keep = std[:, 0] > 0
    adv = np.where(keep[:, None], (r - r.mean(axis=1, keepdims=True)) / (std + eps), 0.0)
    return adv, keep
