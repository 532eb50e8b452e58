"""The block-diffusion objective, the training loop (one-step smoke test) and the naive decoder."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dllm_jax.config import ModelConfig
from dllm_jax.model.params import init_params
from dllm_jax.model.qwen3 import block_causal_mask, forward_full
from dllm_jax.train import objective

MASK = 3
# Jitted once per shape (eagerly every jnp op would compile on its own: hundreds of small compiles).
_two_copy_forward = jax.jit(objective.two_copy_forward, static_argnums=(1, 4))
_forward_full = jax.jit(forward_full, static_argnums=1, static_argnames="return_hidden")
_loss_fn = jax.jit(objective.loss_fn, static_argnums=(1, 6), static_argnames="end_weight")
TINY = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=8, tie_word_embeddings=True, mask_token_id=MASK, block_size=4)


def test_two_copy_mask_layout():
    s, b = 12, 4
    m = np.asarray(objective.two_copy_mask(s, b))
    blk = np.arange(s) // b
    for q in range(s):
        # noisy query: its own noisy block, and the clean blocks strictly before it
        assert np.array_equal(m[q, :s], blk == blk[q])
        assert np.array_equal(m[q, s:], blk < blk[q])
        # clean query: block-causal over the clean copy, never the noisy copy
        assert not m[s + q, :s].any()
        assert np.array_equal(m[s + q, s:], blk <= blk[q])
    assert np.array_equal(m[s:, s:], block_causal_mask(s, b))


@pytest.mark.parametrize("b", [4, 8])
def test_two_copy_forward_equals_forward_full_under_the_mask(b):
    params = init_params(TINY, jax.random.key(0), std=0.2)
    rng = np.random.default_rng(0)
    s = 24
    clean = jnp.asarray(rng.integers(4, 64, (2, s)), jnp.int32)
    noisy = jnp.where(jnp.asarray(rng.random((2, s)) < 0.5), MASK, clean)
    ours = _two_copy_forward(params, TINY, noisy, clean, b)
    pos = jnp.broadcast_to(jnp.concatenate([jnp.arange(s), jnp.arange(s)])[None], (2, 2 * s))
    mask = jnp.broadcast_to(objective.two_copy_mask(s, b)[None], (2, 2 * s, 2 * s))
    ref = _forward_full(params, TINY, jnp.concatenate([noisy, clean], 1), pos, mask, return_hidden=True)[:, :s]
    np.testing.assert_allclose(np.asarray(ours), np.asarray(ref), atol=2e-5)


def test_noise_touches_only_answer_positions_up_to_the_answer_block_end():
    n, s, b = 64, 32, 8
    tokens = jnp.full((n, s), 7, jnp.int32)
    prompt_len = jnp.full((n,), 5, jnp.int32)
    answer_end = jnp.full((n,), 19, jnp.int32)  # answer block ends at 24
    noisy, masked, t, scored = objective.add_noise(jax.random.key(1), tokens, prompt_len, answer_end,
                                                   jnp.full((n,), b, jnp.int32), MASK)
    noisy, masked, t, scored = map(np.asarray, (noisy, masked, t, scored))
    assert np.array_equal(scored[0], (np.arange(s) >= 5) & (np.arange(s) < 24))
    assert not masked[:, :5].any() and not masked[:, 24:].any()
    assert masked[:, 5:24].any()
    assert np.array_equal(noisy == MASK, masked)
    # one noise rate per block
    for blk in range(s // b):
        assert np.allclose(t[:, blk * b: (blk + 1) * b], t[:, blk * b: blk * b + 1])
    assert t.min() >= objective.MIN_NOISE


def test_loss_is_on_masked_positions_only():
    params = init_params(TINY, jax.random.key(0), std=0.2)
    rng = np.random.default_rng(1)
    n, s, b = 4, 24, 4
    tokens = jnp.asarray(rng.integers(4, 64, (n, s)), jnp.int32)
    prompt_len = jnp.full((n,), 6, jnp.int32)
    answer_end = jnp.full((n,), 14, jnp.int32)  # scored: 6..15
    key = jax.random.key(5)
    loss, metrics = _loss_fn(params, TINY, key, tokens, prompt_len, answer_end, b)
    # by hand: the weighted CE of the masked positions, over the number of scored positions
    bs = jnp.full((n,), b, jnp.int32)
    noisy, masked, t, scored = objective.add_noise(key, tokens, prompt_len, answer_end, bs, MASK)
    hidden = _two_copy_forward(params, TINY, noisy, tokens, b)
    logp = jax.nn.log_softmax(hidden @ params["embed"].T, axis=-1)
    ce = -jnp.take_along_axis(logp, tokens[..., None], -1)[..., 0]
    expected = jnp.sum(jnp.where(masked, ce / t, 0)) / scored.sum()
    np.testing.assert_allclose(float(loss), float(expected), rtol=1e-5)
    # tokens past the answer's last block are neither scored nor seen by a scored position
    changed = tokens.at[:, 16:].set(9)
    loss2, _ = _loss_fn(params, TINY, key, changed, prompt_len, answer_end, b)
    np.testing.assert_allclose(float(loss2), float(loss), rtol=1e-6)
    # a masked position's own target matters; changing the prompt (context) matters too
    loss3, _ = _loss_fn(params, TINY, key, tokens.at[:, 0].set(9), prompt_len, answer_end, b)
    assert abs(float(loss3) - float(loss)) > 1e-7
    # end_weight scales exactly the positions from <|im_end|> (answer_end - 1) on
    w = 7.0
    loss4, _ = _loss_fn(params, TINY, key, tokens, prompt_len, answer_end, b, end_weight=w)
    at_end = jnp.arange(s)[None, :] >= 13
    expected4 = jnp.sum(jnp.where(masked, ce / t * jnp.where(at_end, w, 1.0), 0)) / scored.sum()
    np.testing.assert_allclose(float(loss4), float(expected4), rtol=1e-5)
    assert bool(jnp.any(masked & at_end)) and float(loss4) > float(loss)


def test_one_training_step_checkpoint_resume_and_export(tmp_path):
    from dllm_jax.model.loader import load_model
    from dllm_jax.train.train import TrainConfig, train

    tc = TrainConfig(out=str(tmp_path / "run"), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                     head_dim=16, intermediate_size=32, batch_size=2, seq_len=160, block_sizes=(8,),
                     block_size_probs=(1.0,), steps=1, warmup_steps=1, log_every=1, ckpt_every=1)
    out = train(tc, progress=False)
    assert out["steps"] == 1 and np.isfinite(out["final"]["loss"])
    run = tmp_path / "run"
    assert (run / "loss_curve.png").is_file()
    assert [json.loads(l)["step"] for l in open(run / "train_log.jsonl")] == [1]
    out2 = train(TrainConfig(**{**tc.__dict__, "steps": 2}), resume=True, progress=False)
    assert out2["steps"] == 2
    assert [json.loads(l)["step"] for l in open(run / "train_log.jsonl")] == [1, 2]
    loaded = load_model(out2["hf_dir"])
    assert loaded.config.mask_token_id == 3 and loaded.config.block_size == 32
    assert loaded.config.eos_token_ids == (2, 0)
    for a, b in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(out2["params"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for fn in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert os.path.isfile(os.path.join(out2["hf_dir"], fn))


def test_naive_decoder_semantics_with_a_scripted_model(monkeypatch):
    """Drive the decoder with fake logits to check commit order, threshold, EOS and forward counting."""
    from dllm_jax.train import naive_decode

    vocab, b = 16, 4
    eos = 2
    target = [5, 6, 7, 8, 9, 10, eos, 11]  # after the prompt; EOS at output index 6
    conf_by_offset = [0.99, 0.5, 0.95, 0.3, 0.97, 0.96, 0.99, 0.25]

    def fake_forward(params, cfg, tokens, positions, attn, return_hidden=False):
        n, length = tokens.shape
        prompt = 3
        logits = np.full((n, length, vocab), -20.0, np.float32)
        for p in range(length):
            j = p - prompt
            if 0 <= j < len(target):
                c = conf_by_offset[j]
                logits[:, p, target[j]] = np.log(c)
                logits[:, p, 12:16] = np.log((1 - c) / 4)  # the rest spread: the target stays the argmax
                logits[:, p, MASK] = 50.0  # the mask id must never be picked
        return jnp.asarray(logits)

    monkeypatch.setattr(naive_decode, "forward_full", fake_forward)
    cfg = TINY.replace(vocab_size=vocab, eos_token_ids=(eos,))
    [(out, fwd)] = naive_decode.naive_generate(None, cfg, [[1, 4, 4]], block_size=b, threshold=0.9, max_new_tokens=32)
    assert out == target[:7]
    # block 0 (positions 0-3): one mask (offset 0, conf .99): 1 commit step + 1 final forward = 2
    # block 1 (offsets 1-4): .5 .95 .3 .97 -> commit {2,4}; then {1} (best, .5); then {3}; then final = 4
    # block 2 (offsets 5-8): .96 .99 .25 1/15 -> {5,6}; then {7} (best); then {8}; then final = 4
    assert fwd == 2 + 4 + 4
