"""Multi-host protocol on one machine: a leader engine broadcasts every device call's inputs through a channel;
a follower runner (its own parameters and KV pool, as on another host) replays them and ends with the same KV."""

import queue
import threading

import jax
import numpy as np

from conftest import ENGINE_KW
from dllm_jax.engine.runner import ModelRunner


class QueueChannel:
    """Same interface as dllm_jax.distributed.BroadcastChannel, over an in-process queue."""

    def __init__(self):
        self.q = queue.Queue()

    def send(self, header, arrays):
        self.q.put((np.array(header), {k: np.array(v) for k, v in arrays.items()}))

    def recv(self, template_fn):
        header, arrays = self.q.get()
        if int(header[0]) != 0:
            template = template_fn(header)  # the follower must be able to shape every array from the header
            assert {k: (v.shape, v.dtype) for k, v in template.items()} == \
                {k: (v.shape, v.dtype) for k, v in arrays.items()}
        return header, arrays


def start_follower(leader, channel: QueueChannel, max_rows: int):
    """A follower runner on the leader's model and buckets, replaying in a thread; returns (runner, thread,
    result: ``result["calls"]`` = the calls it ran once it stopped)."""
    r = leader.runner
    follower = ModelRunner(r.params, r.cfg, block_size=r.block_size, mask_id=leader.mask_token_id,
                           algorithm=r.algorithm, num_pages=leader.num_kv_pages, max_rows=max_rows,
                           max_pages_per_row=r.max_pages_per_row, max_prefill_blocks=r.max_prefill_blocks,
                           loop=False, channel=channel, fold_commit=r.greedy_spec.fold_commit,
                           shape_buckets=ENGINE_KW["shape_buckets"], chain_blocks=r.chain)
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("calls", follower.follow()))
    thread.start()
    return follower, thread, result


def test_follower_replays_leader_calls(tiny_model, make_engine):
    channel = QueueChannel()
    leader = make_engine(tiny_model, channel=channel, **ENGINE_KW)
    r = leader.runner
    follower, thread, result = start_follower(leader, channel, leader.max_running_requests)
    leader.generate(input_ids=[[5, 6, 7, 8, 9, 10], [3, 4], list(range(2, 20))],
                    sampling_params={"max_new_tokens": 9, "ignore_eos": True, "temperature": 0.7, "seed": 1})
    calls = r.device_calls
    leader.shutdown()  # sends the stop message
    thread.join(timeout=60)
    assert result["calls"] == calls > 0
    for (lk, lv), (fk, fv) in zip(r.kv_pages, follower.kv_pages):
        assert np.array_equal(np.asarray(lk), np.asarray(fk)) and np.array_equal(np.asarray(lv), np.asarray(fv))


def test_single_process_has_no_channel(tiny_model, make_engine):
    engine = make_engine(tiny_model)
    assert jax.process_count() == 1 and engine.runner.channel is None and engine.is_leader
