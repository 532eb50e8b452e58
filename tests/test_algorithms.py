"""Decoding algorithms on hand-made logits (the scenarios of SGLang's unit tests, reference section 7)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dllm_jax.decode.algorithms import ALGORITHMS, JointThresholdInDel, apply_edit_operations, make_algorithm
from dllm_jax.decode.algorithms import greedy_candidates as _greedy_candidates

# Jitted as in the engine's step (one compile per algorithm and shape instead of one per primitive op and shape)
greedy_candidates = jax.jit(_greedy_candidates, static_argnums=1)


@functools.cache
def _jitted_step(algo):
    return jax.jit(type(algo).step, static_argnums=(0, 5))


def step(algo, ids, immutable, cand, state, mask):
    """``algo.step``, jitted (the algorithm and the mask id are static, as in the engine)."""
    return _jitted_step(algo)(algo, ids, immutable, cand, state, mask)

V, MASK = 16, 15


def favour(token, vocab=V, value=20.0, rows=1, block=4):
    logits = np.zeros((rows, block, vocab), np.float32)
    logits[..., token] = value
    return logits


def run_block(algo, ids, immutable, logits_fn, mask=MASK, max_runs=32):
    """Step the algorithm (one 'forward' per step) until it reports done; check immutables every step.
    Returns (final ids, number of forwards, per-step done flags)."""
    ids = np.array(ids, np.int32)
    immutable = np.array(immutable, bool)
    state = algo.init_state(ids.shape[0], ids.shape[1])
    done_all = np.zeros(ids.shape[0], bool)
    for run in range(1, max_runs + 1):
        cand = greedy_candidates(jnp.asarray(logits_fn(ids)), mask)
        new, done, state = step(algo, jnp.asarray(ids), jnp.asarray(immutable), cand, state, mask)
        new, done = np.asarray(new), np.asarray(done)
        assert (new[immutable] == ids[immutable]).all(), "an immutable position changed"
        # Done rows stop changing: the forward that produced these logits already saw their final tokens.
        assert (new[done] == ids[done]).all()
        ids = np.where(done_all[:, None], ids, new)
        done_all |= done
        if done_all.all():
            return ids, run
    raise AssertionError("did not finish")


def literal_prompt_block(prompt, block=4):
    ids = list(prompt) + [MASK] * (block - len(prompt))
    return [ids], [[True] * len(prompt) + [False] * (block - len(prompt))]


@pytest.mark.parametrize("name", ["LowConfidence", "JointThreshold", "EBSampling", "EntropyThreshold"])
@pytest.mark.parametrize("prompt", [[], [MASK, 2], [MASK, 2, MASK, 3]])
def test_literal_mask_prompts(name, prompt):
    """Section 7.2: token 7 has logit 20 everywhere; prompt positions (even literal masks) never change, and the
    block becomes prompt + [7] * rest, with one extra forward on the final tokens."""
    algo = make_algorithm(name)
    ids, imm = literal_prompt_block(prompt)
    final, forwards = run_block(algo, ids, imm, lambda ids: favour(7))
    assert final[0].tolist() == list(prompt) + [7] * (4 - len(prompt))
    assert forwards <= 32
    if len(prompt) == 4:
        assert forwards == 1  # nothing to decode: done on the first forward, nothing changed


def test_low_confidence_done_only_after_forward_on_final_tokens():
    algo = make_algorithm("LowConfidence", {"threshold": 0.5})
    # Row 0 has two masks that both pass the threshold; row 1 is complete.
    ids = np.array([[0, 0, 3, 4], [1, 2, 3, 4]])
    logits = favour(1, rows=2)
    cand = greedy_candidates(jnp.asarray(logits), 0)
    new, done, _ = step(algo, jnp.asarray(ids), jnp.zeros((2, 4), bool), cand, {}, 0)
    assert np.asarray(new).tolist() == [[1, 1, 3, 4], [1, 2, 3, 4]]
    assert np.asarray(done).tolist() == [False, True]
    # A second forward over the filled block reports done (without changing anything).
    new2, done2, _ = step(algo, new, jnp.zeros((2, 4), bool), cand, {}, 0)
    assert np.asarray(done2).tolist() == [True, True] and (np.asarray(new2) == np.asarray(new)).all()


def test_low_confidence_fallback_commits_the_best_sub_threshold_position():
    algo = make_algorithm("LowConfidence", {"threshold": 0.99})
    logits = np.zeros((1, 4, V), np.float32)
    logits[0, 1, 5] = 2.0  # p ~ 0.35
    logits[0, 2, 6] = 3.0  # p ~ 0.59: the higher of the two
    cand = greedy_candidates(jnp.asarray(logits), MASK)
    ids = np.array([[2, MASK, MASK, MASK]])
    imm = np.array([[True, False, False, False]])
    new, done, _ = step(algo, jnp.asarray(ids), jnp.asarray(imm), cand, {}, MASK)
    assert np.asarray(new).tolist() == [[2, MASK, 6, MASK]] and not bool(done[0])


def test_threshold_is_strict():
    logits = np.zeros((1, 2, 4), np.float32)
    logits[0, :, 1] = 1.0
    cand = greedy_candidates(jnp.asarray(logits), 3)
    conf = float(cand.confidence[0, 0])
    algo = make_algorithm("LowConfidence", {"threshold": conf})  # equal is not enough
    new, _, _ = step(algo, jnp.asarray([[3, 3]]), jnp.zeros((1, 2), bool), cand, {}, 3)
    assert np.asarray(new).tolist() == [[1, 3]]  # only the at-least-one fallback, not both
    algo = make_algorithm("LowConfidence", {"threshold": conf - 1e-6})
    new, _, _ = step(algo, jnp.asarray([[3, 3]]), jnp.zeros((1, 2), bool), cand, {}, 3)
    assert np.asarray(new).tolist() == [[1, 1]]


def test_mask_id_is_never_a_candidate():
    logits = favour(MASK)  # the model "wants" the mask id everywhere
    logits[..., 3] = 1.0
    cand = greedy_candidates(jnp.asarray(logits), MASK)
    assert (np.asarray(cand.tokens) == 3).all()
    for name in ("LowConfidence", "JointThreshold", "EBSampling", "EntropyThreshold"):
        final, _ = run_block(make_algorithm(name), *literal_prompt_block([]), lambda ids: logits)
        assert MASK not in final[0]


def test_joint_threshold_edits_then_reaches_fixed_point():
    algo = make_algorithm("JointThreshold", {"threshold": 0.5, "edit_threshold": 0.0})
    # The model prefers 7 at position 0 only once position 1 holds 8: the first commit of 9 gets edited to 7.
    def logits_fn(ids):
        out = np.zeros((1, 4, V), np.float32)
        out[0, :, 8] = 5.0
        out[0, 0, 9] = 6.0
        if ids[0, 1] == 8:
            out[0, 0, 7] = 10.0
        return out
    final, forwards = run_block(algo, [[MASK] * 4], [[False] * 4], logits_fn)
    assert final[0].tolist() == [7, 8, 8, 8]


def test_joint_threshold_post_edit_budget_stops_oscillation():
    algo = make_algorithm("JointThreshold", {"max_post_edit_steps": 3})
    # The preferred token at position 0 flips every step: edits never settle; the budget ends the block.
    def logits_fn(ids):
        out = favour(5)
        out[0, 0, 6 if ids[0, 0] == 5 else 5] = 30.0
        return out
    final, forwards = run_block(algo, [[MASK] * 4], [[False] * 4], logits_fn)
    assert forwards <= 4 + 3 + 2
    assert MASK not in final[0]


def test_joint_threshold_with_edit_threshold_above_one_never_edits():
    algo = make_algorithm("JointThreshold", {"edit_threshold": 2.0})
    def logits_fn(ids):
        out = favour(5, block=8)
        out[0, :, 6] = 21.0 if (ids != MASK).sum() > 3 else 0.0
        return out
    final, _ = run_block(algo, [[MASK] * 8], [[False] * 8], logits_fn)
    assert final[0].tolist()[:1] == [5]  # committed before the model changed its mind, never edited


def test_eb_sampling_entropy_budget():
    algo = make_algorithm("EBSampling", {"gamma": 0.5})
    logits = np.zeros((1, 4, V), np.float32)
    logits[0, 0, 3] = 30.0  # entropy ~ 0
    logits[0, 1, 4] = 3.0  # entropy ~ 1.2
    logits[0, 2, 5] = 30.0  # entropy ~ 0
    logits[0, 3, 6] = 2.0
    cand = greedy_candidates(jnp.asarray(logits), MASK)
    new, done, _ = step(algo, jnp.asarray([[MASK] * 4]), jnp.zeros((1, 4), bool), cand, {}, MASK)
    # The two near-zero-entropy positions fit the budget; the next one would exceed it only after being added,
    # and the reveal rule looks at entropy revealed *before* it, so it goes too; the fourth does not.
    assert np.asarray(new).tolist() == [[3, 4, 5, MASK]] and not bool(done[0])


def test_entropy_threshold_commits_lowest_and_below_threshold():
    algo = make_algorithm("EntropyThreshold", {"threshold": 0.5})
    logits = np.zeros((1, 4, V), np.float32)
    logits[0, 0, 3] = 30.0
    logits[0, 1, 4] = 1.0
    logits[0, 2, 5] = 2.0
    cand = greedy_candidates(jnp.asarray(logits), MASK)
    new, _, _ = step(algo, jnp.asarray([[MASK] * 4]), jnp.zeros((1, 4), bool), cand, {}, MASK)
    assert np.asarray(new).tolist() == [[3, MASK, MASK, MASK]]


def test_make_algorithm_errors():
    with pytest.raises(ValueError, match="LowConfidence"):
        make_algorithm("Nope")
    with pytest.raises(ValueError, match="threshold"):
        make_algorithm("LowConfidence", {"thresh": 0.9})
    with pytest.raises(ValueError, match="max_post_edit_steps"):
        make_algorithm("JointThreshold", {"max_post_edit_steps": True})
    with pytest.raises(ValueError, match="threshold"):
        make_algorithm("LowConfidence", {"threshold": "high"})
    assert set(ALGORITHMS) >= {"LowConfidence", "JointThreshold", "JointThresholdInDel", "EBSampling",
                               "EntropyThreshold"}
    assert make_algorithm("LowConfidence", {"block_size": 32}).config.threshold == 0.95  # YAML block_size ignored


# ----------------------------------------------------------------------------------------------
# JointThresholdInDel (reference section 2.4 and its unit tests)
# ----------------------------------------------------------------------------------------------
D, S = 13, 14


class _Cfg:
    delete_token_id = 156930
    split_token_id = 156931


def indel(**kw):
    return make_algorithm("JointThresholdInDel", {"delete_token_id": D, "split_token_id": S, **kw})


def test_indel_config():
    algo = indel(max_post_edit_steps=3)
    assert algo.max_regular_update_steps(6) == 9 and algo.max_steps(6) == 11
    with pytest.raises(ValueError, match="delete_token_id"):
        make_algorithm("JointThresholdInDel")
    with pytest.raises(ValueError, match="max_post_edit_steps"):
        indel(max_post_edit_steps=True)
    from_model = make_algorithm("JointThresholdInDel", model_config=_Cfg())
    assert (from_model.config.delete_token_id, from_model.config.split_token_id) == (156930, 156931)


def test_indel_apply_edit_operations_example():
    M = MASK
    old = jnp.asarray([[D, S, 3, 4, 5, 6, M, M]])
    selected = jnp.asarray([[D, S, 3, D, S, 6, M, M]])
    immutable = jnp.asarray([[True, True] + [False] * 6])
    ids, orig = apply_edit_operations(old, selected, immutable, jnp.asarray([[False] * 6 + [True, True]]),
                                      mask_id=M, delete_id=D, split_id=S)
    assert np.asarray(ids).tolist() == [[D, S, 3, M, 5, 6, M, M]]
    # The inserted mask is not an original one; the original masks keep their flag.
    assert np.asarray(orig).tolist() == [[False, False, False, False, False, False, True, True]]
    # A split without a delete pushes the last position out of the block.
    ids, orig = apply_edit_operations(old, jnp.asarray([[D, S, S, 4, 5, 6, M, M]]), immutable,
                                      jnp.asarray([[False] * 6 + [True, True]]), mask_id=M, delete_id=D, split_id=S)
    assert np.asarray(ids).tolist() == [[D, S, M, 3, 4, 5, 6, M]]
    assert np.asarray(orig).tolist() == [[False] * 7 + [True]]


def test_indel_resolves_original_masks_and_cleans_up():
    algo = indel(threshold=0.5, max_post_edit_steps=2)
    # The model wants DELETE at position 2 once: the block shrinks by one, a mask is appended (introduced), and
    # decoding must still terminate without emitting DELETE / SPLIT / MASK.
    calls = {"n": 0}

    def logits_fn(ids):
        calls["n"] += 1
        out = favour(7, block=6)
        if calls["n"] == 2:
            out[0, 2, D] = 40.0
        return out
    final, forwards = run_block(algo, [[2, 3, MASK, MASK, MASK, MASK]], [[True, True] + [False] * 4], logits_fn)
    assert final[0].tolist()[:2] == [2, 3]
    assert not set(final[0].tolist()) & {D, S, MASK}
    assert forwards <= algo.max_steps(6)


def test_indel_quota_one_plus_introduced():
    algo = indel(threshold=0.99)
    logits = np.zeros((1, 6, V), np.float32)
    for pos, tok in enumerate([3, 4, 5, 6, 8, 9]):
        logits[0, pos, tok] = 1.0 + pos * 0.1  # all below the threshold
    state = algo.init_state(1, 6)
    ids = jnp.asarray([[2, MASK, MASK, MASK, MASK, MASK]])
    imm = jnp.asarray([[True] + [False] * 5])
    state["num_update_steps"] = jnp.asarray([1])
    state["is_orig_mask"] = jnp.asarray([[False, True, True, False, False, True]])  # 2 masks were introduced
    new, done, _ = step(algo, ids, imm, greedy_candidates(jnp.asarray(logits), MASK), state, MASK)
    changed = (np.asarray(new) != np.asarray(ids)).sum()
    assert changed == 3 and not bool(done[0])  # 1 + 2 introduced, the most confident ones


def test_indel_rows_finish_independently_and_prompt_kept():
    algo = indel()
    ids = [[MASK, 2, MASK, MASK], [4, 4, 4, MASK]]
    imm = [[True, True, False, False], [True, True, True, False]]
    final, _ = run_block(algo, ids, imm, lambda ids: favour(7, rows=2))
    assert final.tolist() == [[MASK, 2, 7, 7], [4, 4, 4, 7]]


def test_indel_split_inserts_mask_before_old_token():
    algo = indel(threshold=0.5, max_post_edit_steps=1)
    calls = {"n": 0}

    def logits_fn(ids):
        calls["n"] += 1
        out = favour(7, block=4)
        if calls["n"] == 2:
            out[0, 1, S] = 40.0  # split position 1 once
        return out
    final, _ = run_block(algo, [[MASK] * 4], [[False] * 4], logits_fn)
    assert not set(final[0].tolist()) & {D, S, MASK}
