"""Weight updates on a multi-process engine (dllm_jax/engine/weight_sync.py), on one machine: a leader engine
and a follower runner with its own copy of the parameters (as on another host) joined by an in-process channel.
After each update, from tensors and from a directory, every follower leaf equals the leader's, and the K/V both
write afterwards is the same. The real two-process run: tests/test_multiprocess.py."""

from __future__ import annotations

import os
import shutil
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ENGINE_KW
from dllm_jax.engine.runner import ModelRunner
from dllm_jax.model.params import key_path, path_name
from test_distributed import QueueChannel

PARAMS = {"max_new_tokens": 12, "ignore_eos": True}
PROMPTS = [[5, 6, 7, 8, 9, 10], list(range(2, 20))]


def _flat(params) -> dict:
    return {path_name(key_path(p)): np.asarray(v) for p, v in jax.tree_util.tree_flatten_with_path(params)[0]}


@pytest.fixture
def pair(tiny_model, make_engine):
    """(leader, follower runner, its thread's result)."""
    channel = QueueChannel()
    leader = make_engine(tiny_model, channel=channel, **ENGINE_KW)
    r = leader.runner
    follower = ModelRunner(jax.tree.map(jnp.copy, r.params), r.cfg, block_size=r.block_size,
                           mask_id=leader.mask_token_id, algorithm=r.algorithm, num_pages=leader.num_kv_pages,
                           max_rows=leader.max_running_requests, max_pages_per_row=r.max_pages_per_row,
                           max_prefill_blocks=r.max_prefill_blocks, loop=False, channel=channel,
                           fold_commit=r.greedy_spec.fold_commit, shape_buckets=ENGINE_KW["shape_buckets"],
                           chain_blocks=r.chain)
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("calls", follower.follow()), daemon=True)
    thread.start()
    yield leader, follower, result
    leader.shutdown()
    thread.join(timeout=60)
    assert "calls" in result, "the follower did not stop"


def _caught_up(leader, follower, timeout=60.0):
    """Wait until the follower has replayed every call the leader made (it runs behind, on its own thread)."""
    import time

    deadline = time.monotonic() + timeout
    while follower.device_calls < leader.runner.device_calls:
        assert time.monotonic() < deadline, "the follower fell behind"
        time.sleep(0.01)


def _same_params(leader, follower):
    _caught_up(leader, follower)
    a, b = _flat(leader.runner.params), _flat(follower.params)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def _same_kv(leader, follower):
    _caught_up(leader, follower)
    for (lk, lv), (fk, fv) in zip(leader.runner.kv_pages, follower.kv_pages):
        assert np.array_equal(np.asarray(lk), np.asarray(fk)) and np.array_equal(np.asarray(lv), np.asarray(fv))


def test_updates_reach_every_process(pair, tiny_model, tmp_path):
    leader, follower, _ = pair
    base = [o["output_ids"] for o in leader.generate(input_ids=PROMPTS, sampling_params=PARAMS)]
    original = _flat(leader.runner.params)

    # from tensors: checkpoint names (two segments of the fused q|k|v and gate|up leaves) and one of our paths
    q = leader.get_weights_by_name("model.layers.0.self_attn.q_proj.weight", truncate_size=None)
    up = leader.get_weights_by_name("model.layers.1.mlp.up_proj.weight", truncate_size=None)
    norm = original["final_norm"]
    out = leader.update_weights_from_tensor({"model.layers.0.self_attn.q_proj.weight": q * 1.5,
                                             "model.layers.1.mlp.up_proj.weight": jnp.asarray(up * -1.0),
                                             "final_norm": norm * 0.5}, weight_version="v1")
    assert out["success"] and out["weight_version"] == "v1"
    assert not np.array_equal(_flat(leader.runner.params)["final_norm"], norm)
    changed = leader.generate(input_ids=PROMPTS, sampling_params=PARAMS)  # (replayed after the update)
    _same_params(leader, follower)
    assert [o["meta_info"]["weight_version"] for o in changed] == ["v1", "v1"]
    assert [o["output_ids"] for o in changed] != base
    _same_kv(leader, follower)

    # from a directory: back to the original weights
    hf_dir = str(tmp_path / "original")
    shutil.copytree(tiny_model, hf_dir)
    out = leader.update_weights_from_disk(hf_dir, weight_version="v2")
    assert out["success"] and out["weight_version"] == "v2"
    assert [o["output_ids"] for o in leader.generate(input_ids=PROMPTS, sampling_params=PARAMS)] == base
    _same_params(leader, follower)
    for k, v in _flat(follower.params).items():
        np.testing.assert_array_equal(v, original[k], err_msg=k)
    _same_kv(leader, follower)


def test_a_refused_update_sends_nothing(pair):
    leader, follower, _ = pair
    before = _flat(follower.params)
    with pytest.raises(ValueError, match="final_norm"):
        leader.update_weights_from_tensor({"final_norm": np.zeros((3,), np.float32)})
    with pytest.raises(ValueError):
        leader.update_weights_from_disk(os.path.dirname(__file__))  # no checkpoint there
    leader.generate(input_ids=PROMPTS[:1], sampling_params=PARAMS)  # the follower still replays in step
    for k, v in _flat(follower.params).items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)
    _same_kv(leader, follower)


def _wait_for(condition, timeout=60.0):
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the follower did not apply the message"
        time.sleep(0.01)


def test_release_and_resume_reach_every_process(pair):
    """Each process frees its own weights and pool and restores them: the same weights, an empty pool, the same
    answers and K/V afterwards on both."""
    leader, follower, _ = pair
    base = [o["output_ids"] for o in leader.generate(input_ids=PROMPTS, sampling_params=PARAMS)]
    original = _flat(leader.runner.params)
    _same_kv(leader, follower)
    leader.release_memory_occupation(["weights", "kv_cache"])
    _wait_for(lambda: set(follower.released) == {"weights", "kv_cache"})
    for tree in (leader.runner.params, follower.params, leader.runner.kv_pages, follower.kv_pages):
        assert all(a.is_deleted() for a in jax.tree.leaves(tree))
    leader.resume_memory_occupation()
    _wait_for(lambda: not follower.released)
    for k, v in _flat(follower.params).items():
        np.testing.assert_array_equal(v, original[k], err_msg=k)
    _same_params(leader, follower)
    assert not any(np.asarray(a).any() for a in jax.tree.leaves(follower.kv_pages))  # empty, as the leader's
    assert [o["output_ids"] for o in leader.generate(input_ids=PROMPTS, sampling_params=PARAMS)] == base
    _same_kv(leader, follower)


def test_a_read_keeps_every_process_in_step(pair):
    """get_weights_by_name is sent to the followers too (a leaf sharded over processes is gathered by all of
    them); a bad name is refused before anything is sent, and the pair keeps decoding in step."""
    leader, follower, _ = pair
    q = leader.get_weights_by_name("model.layers.0.self_attn.q_proj.weight", truncate_size=None)
    assert q.shape == (leader.config.q_size, leader.config.hidden_size)
    with pytest.raises(ValueError, match="name"):
        leader.get_weights_by_name("model.layers.0.nope.weight")
    leader.generate(input_ids=PROMPTS, sampling_params=PARAMS)
    _same_kv(leader, follower)
