"""One engine over two OS processes for real: 2 CPU devices each, joined by ``jax.distributed`` (a local
coordinator, gloo collectives), TP = 4 across both. The leader answers batches (mixed lengths, prefix reuse, FDFO
and sync) with exactly the tokens a single-process TP = 1 engine gives; the follower exits cleanly when the leader
shuts down; when the follower dies, the leader fails its request with a clear error at once and refuses new
ones. The processes run tests/multiprocess_worker.py (2 CPU devices each; the test process has 4)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import ENGINE_KW, TEST_XLA_FLAGS

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)
WORKER = os.path.join(TESTS, "multiprocess_worker.py")
TP4 = dict(ENGINE_KW, tensor_parallel_size=4)
# B = 4: mixed lengths (a partial block, several blocks, a prompt holding the mask id); the second batch shares
# whole blocks with the first (prefix reuse: cached_tokens > 0 there)
BATCHES = [[[5, 6, 7, 8, 9, 10], [3, 4], list(range(2, 20)), [63, 2, 63, 3]],
           [[5, 6, 7, 8, 9, 10, 11, 12, 40], list(range(2, 20)) + [7, 7, 9]]]
PARAMS = {"max_new_tokens": 10, "ignore_eos": True}
SCHEDULES = ("fdfo", "sync")
COLLECTIVE_TIMEOUT = 20  # seconds; a killed peer fails a collective at once, a stuck one after this
# the FDFO run then updates these tensors in place (q rows of the fused q|k|v leaf, up rows of gate|up, a norm)
# (layer 1's gate and up together: that fused leaf is built whole on the host; layer 0's q alone: written in place)
UPDATE = {"scale": {"model.layers.0.self_attn.q_proj.weight": 1.5, "model.layers.1.mlp.up_proj.weight": -1.0,
                    "model.layers.1.mlp.gate_proj.weight": 0.75, "model.norm.weight": 0.5}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env() -> dict:
    """Two CPU devices per process (the test process itself has four)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count=2 {TEST_XLA_FLAGS}")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    return env


def start_pair(tmp_path, spec: dict, cmd=None) -> list[subprocess.Popen]:
    """Process 0 and 1 of a group; ``cmd(process_id, spec_path)`` gives each one's command line."""
    spec = dict(spec, coordinator=f"127.0.0.1:{free_port()}")
    procs = []
    for pid in (0, 1):
        path = tmp_path / f"spec{pid}.json"
        path.write_text(json.dumps(dict(spec, process_id=pid, out=str(tmp_path / f"out{pid}.json"))))
        argv = cmd(pid, str(path)) if cmd else [sys.executable, WORKER, str(path)]
        log = open(tmp_path / f"log{pid}.txt", "w")
        procs.append(subprocess.Popen(argv, cwd=REPO, env=process_env(), stdout=log, stderr=subprocess.STDOUT))
    return procs


def wait_all(procs, tmp_path, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    try:
        return [p.wait(timeout=max(0.1, deadline - time.monotonic())) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"the processes did not finish within {timeout} s\n{logs(tmp_path)}")


def logs(tmp_path) -> str:
    return "\n".join(f"--- process {pid} ---\n" + _tail(tmp_path / f"log{pid}.txt") for pid in (0, 1))


def _tail(path, chars=4000) -> str:
    return path.read_text()[-chars:] if path.exists() else "(no log)"


def result(tmp_path, pid: int) -> dict:
    return json.loads((tmp_path / f"out{pid}.json").read_text())


def test_two_processes_generate_like_one_and_fail_fast(tiny_model, make_engine, tmp_path):
    """One pair of processes: an FDFO and a sync engine answer like TP = 1 (the follower replays every call and
    returns from ``follow()`` at each shutdown; the FDFO engine's weights are then updated from tensors and back
    from the directory, and it answers like a TP = 1 engine updated the same way); then a third engine's follower is SIGKILLed mid-request (it kills
    itself on receiving its 6th call, so the moment is deterministic): the leader's stream ends with a clear
    abort within seconds, and new requests are refused."""
    runs = [{"schedule": s, "batches": BATCHES, "params": PARAMS} for s in SCHEDULES]
    runs[0]["update"] = UPDATE  # weight updates reach the follower's shards (dllm_jax/engine/weight_sync.py)
    die = {"prompt": [5, 6, 7, 8, 9], "params": {"max_new_tokens": 48, "ignore_eos": True}, "die_at_call": 6}
    procs = start_pair(tmp_path, {"model": tiny_model, "engine": TP4, "runs": runs, "die": die,
                                  "collective_timeout": COLLECTIVE_TIMEOUT})
    expected = []  # meanwhile, the single-process TP = 1 reference
    for schedule in SCHEDULES:
        engine = make_engine(tiny_model, schedule=schedule, **ENGINE_KW)
        expected.append([[o["output_ids"] for o in engine.generate(input_ids=b, sampling_params=PARAMS)]
                         for b in BATCHES])
    updated = _updated_reference(make_engine(tiny_model, **ENGINE_KW), tiny_model)
    assert wait_all(procs, tmp_path, 150) == [0, -9], logs(tmp_path)
    leader, follower = result(tmp_path, 0), result(tmp_path, 1)
    for i, schedule in enumerate(SCHEDULES):
        run = leader["runs"][i]
        assert run["outputs"] == expected[i], schedule
        assert all(c > 0 for c in run["cached"][1]), f"{schedule}: no prefix reuse in the second batch"
        assert follower["runs"][i]["calls"] == run["calls"] > 0  # it replayed every call, then stopped
    # both updates, on every process, then a release and resume of weights and pool (each process its own shards)
    answers = leader["runs"][0]["updated"]
    read = answers.pop("read")
    assert answers.pop("sharded") > 0  # leaves spread over both processes: the reads gathered them
    assert answers == {"v1": updated, "v2": expected[0], "resumed": expected[0]}
    from safetensors.numpy import load_file

    original = load_file(os.path.join(tiny_model, "model.safetensors"))
    for name, rows in read.items():  # get_weights_by_name of leaves sharded over both processes (after v2)
        np.testing.assert_array_equal(np.asarray(rows, np.float32), original[name][:3].astype(np.float32), name)
    assert updated != expected[0]

    reason = leader["finish_reason"]
    assert reason["type"] == "abort" and reason["message"].startswith("multi-process engine failed"), reason
    assert "restarted" in reason["message"] and leader["failure"] == reason["message"]
    assert 0 < leader["tokens"] < 48  # blocks committed before the death reached the client
    latency = leader["failed_at"] - follower["died_at"]
    assert latency < 5, f"the leader took {latency:.1f} s to fail the request"
    assert leader["refused"] == leader["failure"]


def _updated_reference(engine, model: str) -> list:
    """The single-process answers after the worker's update from tensors."""
    from safetensors.numpy import load_file

    original = load_file(os.path.join(model, "model.safetensors"))
    engine.update_weights_from_tensor({n: original[n] * f for n, f in UPDATE["scale"].items()})
    return [[o["output_ids"] for o in engine.generate(input_ids=b, sampling_params=PARAMS)] for b in BATCHES]


# ----------------------------------------------------------------------------------------------
# The server over two processes (`python -m serve` = `dllm-jax serve`)
# ----------------------------------------------------------------------------------------------
def start_servers(tmp_path, model: str, port: int, collective_timeout: int = COLLECTIVE_TIMEOUT):
    """Process 0 configured by flags, process 1 by the environment variables (both ways are supported)."""
    coordinator = f"127.0.0.1:{free_port()}"
    engine = ["--model-path", model, "--tp", "4", "--max-running-requests", str(ENGINE_KW["max_running_requests"]),
              "--context-length", str(ENGINE_KW["context_length"]), "--num-kv-pages", str(ENGINE_KW["num_kv_pages"]),
              "--shape-buckets", json.dumps(ENGINE_KW["shape_buckets"]), "--collective-timeout",
              str(collective_timeout), "--port", str(port), "--no-access-log"]
    procs = []
    for pid in (0, 1):
        env = process_env()
        argv = [sys.executable, "-m", "serve", *engine]
        if pid == 0:
            argv += ["--coordinator-address", coordinator, "--num-processes", "2", "--process-id", "0"]
        else:
            env.update(JAX_COORDINATOR_ADDRESS=coordinator, JAX_NUM_PROCESSES="2", JAX_PROCESS_ID="1")
        log = open(tmp_path / f"log{pid}.txt", "w")
        procs.append(subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs


def wait_healthy(base: str, procs, tmp_path, timeout: float = 180) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            pytest.fail(f"a server process exited early\n{logs(tmp_path)}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    for p in procs:
        p.kill()
    pytest.fail(f"the server did not come up\n{logs(tmp_path)}")


@pytest.mark.slow
def test_server_over_two_processes(tiny_model, make_engine, tmp_path):
    """HTTP on the leader only; answers equal the single-process TP = 1 engine's; on SIGINT the leader shuts down
    and the follower, which bound no port, exits cleanly with it."""
    import httpx

    port = free_port()
    procs = start_servers(tmp_path, tiny_model, port)
    base = f"http://127.0.0.1:{port}"
    engine = make_engine(tiny_model, **ENGINE_KW)
    expected = [[o["output_ids"] for o in engine.generate(input_ids=b, sampling_params=PARAMS)] for b in BATCHES]
    wait_healthy(base, procs, tmp_path)
    for batch, want in zip(BATCHES, expected):
        r = httpx.post(base + "/generate", json={"input_ids": batch, "sampling_params": PARAMS}, timeout=60)
        assert r.status_code == 200, r.text
        assert [o["output_ids"] for o in r.json()] == want
    assert all(o["meta_info"]["cached_tokens"] > 0 for o in r.json())  # the second batch reused the first's blocks
    info = httpx.get(base + "/get_model_info", timeout=10).json()
    assert info["tensor_parallel_size"] == 4
    procs[0].send_signal(signal.SIGINT)
    assert wait_all(procs, tmp_path, 60) == [0, 0], logs(tmp_path)
    follower_log = (tmp_path / "log1.txt").read_text()
    assert "following the leader" in follower_log and "ready on" not in follower_log
    assert "Traceback" not in logs(tmp_path)


@pytest.mark.slow
def test_server_exits_when_a_follower_dies(tiny_model, tmp_path):
    """The follower is SIGKILLed while the server is idle: the leader's keepalive notices within its interval (a
    quarter of the collective timeout), fails, stops serving and exits with status 1 and the reason."""
    import httpx

    port = free_port()
    procs = start_servers(tmp_path, tiny_model, port)
    base = f"http://127.0.0.1:{port}"
    wait_healthy(base, procs, tmp_path)
    r = httpx.post(base + "/generate", json={"input_ids": BATCHES[0][0], "sampling_params": PARAMS}, timeout=60)
    assert r.status_code == 200, r.text
    killed = time.monotonic()
    procs[1].kill()
    rc = wait_all(procs[:1], tmp_path, 60)
    elapsed = time.monotonic() - killed
    print(f"follower killed while idle: the leader exited after {elapsed:.2f} s")
    assert rc == [1], logs(tmp_path)
    assert elapsed < COLLECTIVE_TIMEOUT / 4 + 10, f"the leader took {elapsed:.1f} s to stop"
    text = (tmp_path / "log0.txt").read_text()
    assert "multi-process engine failed" in text and "must be restarted" in text, text[-3000:]
    procs[1].wait()


@pytest.mark.slow
def test_two_processes_serve_diffusion_gemma(tmp_path):
    """DiffusionGemma over two processes, TP = 4 (a tied published-layout checkpoint, vocabulary split over all
    four devices): both schedules answer seeded requests in the near-argmax regime with the tokens of one device,
    the follower replays every call (encodes and denoise loops) and stops at each shutdown."""
    pytest.importorskip("torch")
    from test_renoise_tp import EXACT, PROMPTS, VOCAB

    from dllm_jax import Engine
    from dllm_jax.testing.diffusion_gemma import FULL, SLIDING, write_tiny_diffusion_gemma
    from dllm_jax.testing.tokenizer_files import write_gemma_tokenizer

    model = str(tmp_path / "dg")
    os.makedirs(model)
    ids = write_gemma_tokenizer(model, bpe_vocab=VOCAB - 5)
    write_tiny_diffusion_gemma(model, canvas_length=4, tie=True, vocab_size=VOCAB, sliding_window=6,
                               num_hidden_layers=2, layer_types=[SLIDING, FULL],
                               eos_token_id=[ids["<eos>"], ids["<end_of_turn>"]])
    kw = dict(max_running_requests=2, max_prefill_tokens=16, context_length=64, warmup=False, algorithm_config=EXACT)
    batches = [PROMPTS, [PROMPTS[1] + [50, 51]]]  # the second shares the first's pages (prefix reuse)
    params = {"max_new_tokens": 8, "seed": 100, "ignore_eos": True}  # one seed: every request draws alike
    runs = [{"schedule": s, "batches": batches, "params": params} for s in SCHEDULES]
    procs = start_pair(tmp_path, {"model": model, "engine": dict(kw, tensor_parallel_size=4), "runs": runs,
                                  "collective_timeout": COLLECTIVE_TIMEOUT})
    expected = []
    for schedule in SCHEDULES:
        engine = Engine(model, schedule=schedule, **kw)
        expected.append([[o["output_ids"] for o in engine.generate(input_ids=b, sampling_params=params)]
                         for b in batches])
        engine.scheduler.check_pages()
        engine.shutdown()
    assert wait_all(procs, tmp_path, 240) == [0, 0], logs(tmp_path)
    leader, follower = result(tmp_path, 0), result(tmp_path, 1)
    for i, schedule in enumerate(SCHEDULES):
        run = leader["runs"][i]
        assert run["outputs"] == expected[i], schedule
        assert run["cached"][1][0] > 0, f"{schedule}: no prefix reuse in the second batch"
        assert follower["runs"][i]["calls"] == run["calls"] > 0
