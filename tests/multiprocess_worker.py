"""One process of a two-process engine (tests/test_multiprocess.py starts two of these, 2 CPU devices each).

    python tests/multiprocess_worker.py SPEC.json

The spec (JSON): ``process_id``, ``coordinator`` (host:port), ``model``, ``engine`` (Engine keyword arguments,
``tensor_parallel_size`` included), ``collective_timeout``, ``out`` (where this process writes its JSON result),
``runs`` and optionally ``die``:

* for each entry of ``runs`` (``schedule``, ``batches`` of prompts, ``params``) the leader builds an engine,
  answers every batch and shuts it down; the follower builds the same engine and follows it until the stop
  message. With ``update`` (``{"scale": {checkpoint name: factor}}``) the leader then updates those tensors
  (the checkpoint's, scaled) from tensors, answers the batches again, updates back from the model's directory
  and answers them once more; the follower applies both updates as it follows.
* then, with ``die``: the leader runs a new engine's loop in a thread (as the server does) and streams one long
  request (``prompt``, ``params``); the follower SIGKILLs itself when it receives call number ``die_at_call``
  (after writing the time). The leader records when and how its request failed, and whether a new request is
  refused, then exits at once (:func:`dllm_jax.distributed.hard_exit`).
* without ``die`` both exit through the normal interpreter exit (JAX's shutdown barrier meets the other's).
"""

import json
import os
import signal
import sys
import time


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    from dllm_jax import Engine, distributed

    distributed.initialize(spec["coordinator"], 2, spec["process_id"],
                           collective_timeout_s=spec.get("collective_timeout"))
    leader = spec["process_id"] == 0
    out = {"runs": []}
    for run in spec["runs"]:
        engine = Engine(spec["model"], schedule=run["schedule"], **spec["engine"])
        if leader:
            results = [engine.generate(input_ids=batch, sampling_params=run["params"]) for batch in run["batches"]]
            out["runs"].append({"outputs": [[r["output_ids"] for r in res] for res in results],
                                "cached": [[r["meta_info"]["cached_tokens"] for r in res] for res in results]})
            if "update" in run:
                out["runs"][-1]["updated"] = _update_and_answer(engine, spec["model"], run)
            out["runs"][-1]["calls"] = engine.runner.device_calls
        else:
            out["runs"].append({"calls": engine.follow()})
        engine.shutdown()
    _write(spec["out"], out)
    if "die" not in spec:
        return
    die = spec["die"]
    engine = Engine(spec["model"], **spec["engine"])
    if leader:
        engine.start()
        chunks = list(engine.generate(input_ids=die["prompt"], sampling_params=die["params"], stream=True))
        out["failed_at"] = time.time()
        out["finish_reason"] = chunks[-1]["meta_info"]["finish_reason"]
        out["tokens"] = sum(len(c["output_ids"]) for c in chunks)
        try:
            engine.generate(input_ids=die["prompt"], sampling_params={"max_new_tokens": 4})
            out["refused"] = None
        except RuntimeError as e:
            out["refused"] = str(e)
        out["failure"] = engine.failure
        engine.shutdown()
        _write(spec["out"], out)
        distributed.hard_exit(0)  # JAX's exit handler would wait for the lost process at its shutdown barrier
    channel = engine.runner.channel
    recv, calls = channel.recv, [0]

    def dying_recv(template_fn):
        header, arrays = recv(template_fn)
        calls[0] += 1
        if calls[0] == die["die_at_call"]:
            _write(spec["out"], dict(out, died_at=time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        return header, arrays

    channel.recv = dying_recv
    engine.follow()


def _update_and_answer(engine, model: str, run: dict) -> dict:
    """Update from tensors (checkpoint tensors scaled), answer; update back from the directory, answer; release and
    resume the memory, answer."""
    from safetensors.numpy import load_file

    original = load_file(os.path.join(model, "model.safetensors"))
    named = {name: original[name] * factor for name, factor in run["update"]["scale"].items()}
    answers = {}
    for version, update in (("v1", lambda: engine.update_weights_from_tensor(named, weight_version="v1")),
                            ("v2", lambda: engine.update_weights_from_disk(model, weight_version="v2"))):
        assert update()["success"]
        results = [engine.generate(input_ids=batch, sampling_params=run["params"]) for batch in run["batches"]]
        answers[version] = [[r["output_ids"] for r in res] for res in results]
        assert all(r["meta_info"]["weight_version"] == version for res in results for r in res)
    # a read of sharded leaves (the q rows of the fused q|k|v leaf, a norm): every process joins the gather
    import jax

    answers["sharded"] = sum(not a.is_fully_addressable for a in jax.tree.leaves(engine.runner.params))
    answers["read"] = {name: engine.get_weights_by_name(name, truncate_size=3).tolist()
                       for name in ("model.layers.0.self_attn.q_proj.weight", "model.norm.weight")}
    # colocated training: every process frees its shards of the weights and the pool, then restores them
    engine.release_memory_occupation(["weights", "kv_cache"])
    engine.resume_memory_occupation(["weights", "kv_cache"])
    answers["resumed"] = [[r["output_ids"] for r in engine.generate(input_ids=batch, sampling_params=run["params"])]
                          for batch in run["batches"]]
    return answers


def _write(path: str, obj) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main(sys.argv[1])
