"""The block-diffusion training objective (SDAR / BD3-LM), with the two-copy "noisy + clean" layout.

Each row of ``S`` tokens is cut into blocks of ``B`` positions (``B`` drawn per row). Every block
gets a noise rate ``t ~ U(eps, 1)``; each of its answer positions becomes the mask token with
probability ``t``. The model sees ``[noisy copy ; clean copy]`` (``2S`` tokens, both copies at
positions ``0..S-1``) under the mask of :func:`two_copy_mask`:

* noisy block ``k`` sees itself (bidirectionally) and the clean blocks ``< k``;
* clean block ``k`` sees the clean blocks ``<= k`` (the block-causal mask the engine serves with);
* clean positions never see noisy ones.

So one forward scores every block as if it were the block being denoised with all earlier blocks
committed, exactly what the engine runs. The loss is the masked-diffusion ELBO: cross-entropy on
masked positions weighted by ``1/t``, normalized by the number of answer positions.

Scored ("answer") positions: from the end of the prompt to the end of the block holding the
answer's ``<|im_end|>`` (its trailing ``<|endoftext|>`` padding included, as the engine must fill it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dllm_jax.config import ModelConfig
from dllm_jax.model import qwen3
from dllm_jax.model.qwen3 import logits_from_hidden

BLOCK_SIZES = (4, 8, 16, 32)
MIN_NOISE = 0.05


def two_copy_mask(seq_len: int, block_size):
    """``[2S, 2S]`` bool (True = query may see key) for the layout ``[noisy ; clean]``.

    ``block_size`` may be a traced scalar (one compiled step serves every block size).
    """
    pos = jnp.arange(seq_len)
    blk = pos // block_size
    bq, bk = blk[:, None], blk[None, :]
    noisy_noisy = bq == bk
    noisy_clean = bk < bq
    clean_clean = bk <= bq
    clean_noisy = jnp.zeros_like(noisy_noisy)
    top = jnp.concatenate([noisy_noisy, noisy_clean], axis=1)
    bottom = jnp.concatenate([clean_noisy, clean_clean], axis=1)
    return jnp.concatenate([top, bottom], axis=0)


def _attend(q, k, mask, scale):
    """q ``[N,H,T,D]``, k/v ``[N,H,S,D]``, mask broadcastable to ``[N,H,T,S]`` -> scores (masked)."""
    s = jnp.einsum("nhtd,nhsd->nhts", q, k, preferred_element_type=jnp.float32) * scale
    return jnp.where(mask, s, -jnp.inf)


def two_copy_forward(params, cfg: ModelConfig, noisy, clean, block_size: int):
    """Final hidden states of the noisy copy, ``[N, S, H]``.

    Mathematically :func:`qwen3.forward_full` on ``[noisy ; clean]`` under :func:`two_copy_mask`
    (a test checks it), but without materializing the ``2S x 2S`` scores, which are mostly masked:
    the clean copy runs block-causal attention over itself (``S x S``) and the noisy copy attends to
    the clean blocks before its own (``S x S``) plus its own block (``S x B``), with one softmax over
    both. On a 2-core CPU this is about twice as fast. ``block_size`` is static.
    """
    n, s = noisy.shape
    b = block_size
    nb = s // b
    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    group = hq // hkv
    scale = d ** -0.5
    positions = jnp.broadcast_to(jnp.arange(s)[None], (n, s))
    blk = jnp.arange(s) // b
    before = blk[None, :] < blk[:, None]     # [S, S]: key block strictly before query block
    upto = blk[None, :] <= blk[:, None]      # block-causal

    def heads(t, h):  # [N, S, h, D] -> [N, Hq, S, D] (kv heads repeated for GQA)
        t = jnp.swapaxes(t, 1, 2)
        return jnp.repeat(t, hq // h, axis=1) if h != hq else t

    xs = params["embed"][jnp.concatenate([noisy, clean], axis=0)]  # [2N, S, H]: both copies share weights
    pos2 = jnp.concatenate([positions, positions], axis=0)
    for layer in params["layers"]:
        h = qwen3.rms_norm(xs, layer["attn_norm"], cfg.rms_norm_eps)
        q, k, v = qwen3._qkv(layer, h, pos2, cfg)
        q, k, v = heads(q, hq), heads(k, hkv), heads(v, hkv)
        qn, qc = q[:n], q[n:]
        kn, kc = k[:n], k[n:]
        vn, vc = v[:n], v[n:]
        # clean copy: block-causal over itself
        pc = jax.nn.softmax(_attend(qc, kc, upto, scale), axis=-1)
        oc = jnp.einsum("nhts,nhsd->nhtd", pc, vc)
        # noisy copy: earlier clean blocks + its own block, one softmax over both
        s_clean = _attend(qn, kc, before, scale)                                  # [N,Hq,S,S]
        qb = qn.reshape(n, hq, nb, b, d)
        kb, vb = kn.reshape(n, hq, nb, b, d), vn.reshape(n, hq, nb, b, d)
        s_self = jnp.einsum("nhctd,nhcsd->nhcts", qb, kb, preferred_element_type=jnp.float32) * scale
        s_self = s_self.reshape(n, hq, s, b)                                      # [N,Hq,S,B]
        p = jax.nn.softmax(jnp.concatenate([s_clean, s_self], axis=-1), axis=-1)
        p_clean, p_self = p[..., :s], p[..., s:].reshape(n, hq, nb, b, b)
        on = jnp.einsum("nhts,nhsd->nhtd", p_clean, vc) + \
            jnp.einsum("nhcts,nhcsd->nhctd", p_self, vb).reshape(n, hq, s, d)
        attn = jnp.swapaxes(jnp.concatenate([on, oc], axis=0), 1, 2).reshape(2 * n, s, hq * d)
        xs = xs + qwen3._out_proj(layer, attn.astype(xs.dtype))
        xs = xs + qwen3._mlp(layer, xs, cfg)
    return qwen3.rms_norm(xs[:n], params["final_norm"], cfg.rms_norm_eps)


def answer_positions(seq_len: int, prompt_len, answer_end, block_size):
    """``[N, S]`` bool: positions scored for each row (prompt end .. end of the answer's last block)."""
    pos = jnp.arange(seq_len)[None, :]
    b = block_size[:, None]
    last = ((answer_end[:, None] + b - 1) // b) * b
    return (pos >= prompt_len[:, None]) & (pos < last)


def add_noise(key, tokens, prompt_len, answer_end, block_size, mask_id, min_noise=MIN_NOISE):
    """Returns (noisy tokens, masked [N,S] bool, t [N,S] per-position noise rate, scored [N,S] bool)."""
    n, s = tokens.shape
    k_rate, k_mask = jax.random.split(key)
    scored = answer_positions(s, prompt_len, answer_end, block_size)
    blk = jnp.arange(s)[None, :] // block_size[:, None]  # [N, S]
    rates = min_noise + (1.0 - min_noise) * jax.random.uniform(k_rate, (n, s))  # one rate per block index
    t = jnp.take_along_axis(rates, blk, axis=1)
    masked = scored & (jax.random.uniform(k_mask, (n, s)) < t)
    noisy = jnp.where(masked, mask_id, tokens)
    return noisy, masked, t, scored


def loss_fn(params, cfg: ModelConfig, key, tokens, prompt_len, answer_end, block_size: int,
            end_weight: float = 1.0):
    """Block-diffusion loss for a batch whose rows all use ``block_size`` (static).

    ``end_weight`` multiplies the loss of the positions from the answer's ``<|im_end|>`` on (where to
    stop): one position per answer, otherwise too rare a signal for a small model to learn to compare
    the last item with the prompt's bound instead of guessing the length.

    Returns (loss, metrics dict).
    """
    n, s = tokens.shape
    bs = jnp.full((n,), block_size, jnp.int32)
    noisy, masked, t, scored = add_noise(key, tokens, prompt_len, answer_end, bs, cfg.mask_token_id)
    hidden = two_copy_forward(params, cfg, noisy, tokens, block_size)
    logits = logits_from_hidden(params, hidden)  # [N, S, V] float32
    logz = jax.nn.logsumexp(logits, axis=-1)
    target = jnp.take_along_axis(logits, tokens[..., None], axis=-1)[..., 0]
    ce = logz - target
    m = masked.astype(jnp.float32)
    num_scored = jnp.maximum(scored.sum(), 1)
    at_end = jnp.arange(s)[None, :] >= answer_end[:, None] - 1
    weight = jnp.where(at_end, end_weight, 1.0)
    loss = jnp.sum(ce * m * weight / t) / num_scored
    num_masked = jnp.maximum(m.sum(), 1.0)
    correct = (jnp.argmax(logits, axis=-1) == tokens).astype(jnp.float32)
    metrics = {
        "loss": loss,
        "masked_ce": jnp.sum(ce * m) / num_masked,
        "masked_acc": jnp.sum(correct * m) / num_masked,
    }
    return loss, metrics
