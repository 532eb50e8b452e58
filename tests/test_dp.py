"""``dllm-jax serve --dp 2``: two workers behind SGLang's real router (``sglang-router``), on this CPU.

One launcher for the module (``python -m serve --dp 2``, policy cache_aware, restarts on): 100 mixed requests
(chat, completions, ``/generate``, streamed and not, n > 1) all answered with the shipped model's right answers and
spread over both workers; repeated prompts land on the worker that holds their prefix (``cached_tokens`` > 0);
a worker killed mid-run (SIGKILL): its in-flight streams end in an error (the router cuts them; its non-streamed
requests are retried on the other worker), every request after the router noticed is answered by the other, and
the launcher's restart is taken back by the router; a worker stopped with SIGTERM mid-run: its streams end with an
error event and ``[DONE]``; a client's disconnect aborts its request on the worker; ``--api-key`` guards the
router and the workers; SIGTERM to the launcher stops every process. The workers decode one token per forward
(threshold 1.0), so that long requests are still running when a worker is killed.

Slow (two workers compile, a worker restarts): ``pytest -m slow tests/test_dp.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

from conftest import TEST_XLA_FLAGS
from serve.dp import free_port_base

pytestmark = pytest.mark.slow  # (sglang-router comes with the test extra: these never skip)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONTEXT = 512
SHAPE_BUCKETS = {"rows": [8], "pages": [CONTEXT // 32], "prefill_rows": [1], "prefill_blocks": [2]}
ROUTER_ARGS = ("--health-check-interval-secs 1 --health-failure-threshold 1 --health-success-threshold 1 "
               "--retry-initial-backoff-ms 200")
API_KEY = "dp-test-key"  # the launcher gives it to the router and the workers; the router sends it on
AUTH = {"Authorization": f"Bearer {API_KEY}"}
LONG = 256  # tokens: seconds at one token per forward
RESTART_DELAY = 30  # seconds: the launcher restarts a dead worker after this (the window the other one serves alone)


def _answer(kind: str, steps: int, start) -> str:
    if kind == "up":
        items = [f"{i} {start + i - 1}" for i in range(1, steps + 1)]
    elif kind == "down":
        items = [f"{i} {start - i + 1}" for i in range(1, steps + 1)]
    else:
        items = [f"{i} {start}" for i in range(1, steps + 1)]
    return "Answer: " + " | ".join(items)


def prompts() -> list[tuple[str, str]]:
    """(prompt, answer) pairs the shipped model answers right (checked, greedy, thresholds 0.95 and 1.0)."""
    out = []
    for i in range(12):
        out.append((f"Count up {10 + i % 8} steps from {20 + 9 * i}.", _answer("up", 10 + i % 8, 20 + 9 * i)))
        n = 10 + (i * 3) % 9
        out.append((f"Count down {n} steps from {150 - 7 * i}.", _answer("down", n, 150 - 7 * i)))
    for i, words in enumerate(["red owl", "green tea", "cold rain", "dark moon", "gold ring"]):
        times = 8 + [0, 2, 3, 0, 1][i]
        out.append((f"Repeat {times} times: {words}", _answer("rep", times, words)))
    return out


def chat_text(prompt: str) -> str:
    return f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"


class Launcher:
    def __init__(self, log_path):
        self.port = free_port_base(2)
        self.base = f"http://127.0.0.1:{self.port}"
        self.workers = [f"http://127.0.0.1:{self.port + 1}", f"http://127.0.0.1:{self.port + 2}"]
        self.log_path = str(log_path)
        env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=TEST_XLA_FLAGS, TOKENIZERS_PARALLELISM="false",
                   PYTHONPATH=REPO)
        args = [sys.executable, "-m", "serve", "--dp", "2", "--port", str(self.port), "--router-policy", "cache_aware",
                "--router-args", ROUTER_ARGS, "--worker-restarts", "2", "--worker-restart-delay", str(RESTART_DELAY),
                "--max-running-requests", "8",
                "--context-length", str(CONTEXT), "--max-prefill-tokens", "64", "--shape-buckets",
                json.dumps(SHAPE_BUCKETS), "--no-access-log", "--shutdown-timeout", "0",
                "--algorithm-config", json.dumps({"threshold": 1.0}), "--api-key", API_KEY]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(args, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)

    def output(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def wait_for(self, pattern: str, timeout: float, after: int = 0) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.compile(pattern).search(self.output(), after)
            if m:
                return m
            assert self.proc.poll() is None, f"the launcher exited {self.proc.returncode}:\n{self.output()[-5000:]}"
            time.sleep(0.2)
        raise AssertionError(f"no {pattern!r} within {timeout} s:\n{self.output()[-5000:]}")

    def worker_pid(self, i: int) -> int:
        return int(re.findall(rf"started worker {i} \(pid (\d+)\)", self.output())[-1])


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    launcher = Launcher(tmp_path_factory.mktemp("dp") / "launcher.log")
    try:
        launcher.wait_for(r"ready on http://127\.0\.0\.1:\d+ \(SGLang's router", 900)
        yield launcher
    finally:
        pids = [int(p) for p in re.findall(r"started worker \d \(pid (\d+)\)", launcher.output())]
        if launcher.proc.poll() is None:
            launcher.proc.send_signal(signal.SIGTERM)
        try:
            status = launcher.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            launcher.proc.kill()
            raise
        out = launcher.output()
        assert status == 0, out[-5000:]
        assert "dllm-jax: shut down" in out
        time.sleep(0.5)
        for pid in pids:  # every worker the launcher started (restarts included) is gone
            assert not os.path.exists(f"/proc/{pid}") or _zombie(pid), f"worker pid {pid} still runs"


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


def _requests_total(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10, headers=AUTH).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("dllm_requests_total"))


# ----------------------------------------------------------------------------------------------
# Clients
# ----------------------------------------------------------------------------------------------
async def _stream(client: httpx.AsyncClient, path: str, body: dict, started: asyncio.Event | None = None) -> dict:
    """A streamed request: its JSON events, whether ``[DONE]`` came, and the transport error that cut it."""
    out = {"events": [], "done": False, "cut": None, "status": None}
    try:
        async with client.stream("POST", path, json={**body, "stream": True}) as r:
            out["status"] = r.status_code
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    out["done"] = True
                elif line.startswith("data: "):
                    out["events"].append(json.loads(line[6:]))
                    if started is not None:
                        started.set()
    except (httpx.RemoteProtocolError, httpx.ReadError) as e:
        out["cut"] = f"{type(e).__name__}: {e}"
    return out


def _texts(kind: str, body: dict, result) -> list[str]:
    """The answer texts of a finished request (one per choice)."""
    if isinstance(result, dict) and "events" in result:  # streamed
        events = [e for e in result["events"] if "error" not in e]
        assert result["done"] and len(events) == len(result["events"]), result
        if kind == "generate":
            last = {}
            for e in events:
                last[e.get("index", 0)] = e["text"]
            return [last[i] for i in sorted(last)]
        texts: dict[int, str] = {}
        for e in events:
            for c in e["choices"]:
                piece = c["delta"].get("content") if kind == "chat" else c["text"]
                texts[c["index"]] = texts.get(c["index"], "") + (piece or "")
        return [texts[i] for i in sorted(texts)]
    if kind == "generate":
        return [r["text"] for r in result] if isinstance(result, list) else [result["text"]]
    return [c["message"]["content"] if kind == "chat" else c["text"] for c in result["choices"]]


def _mixed(i: int, prompt: str) -> tuple[str, str, dict, bool, int]:
    """Request i of the mix: (kind, path, body, streamed, choices)."""
    kind = ("chat", "completion", "generate")[i % 3]
    stream = (i // 3) % 2 == 1
    n = 2 if i % 5 == 0 else 1
    if kind == "chat":
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 128, "n": n}
        return kind, "/v1/chat/completions", body, stream, n
    if kind == "completion":
        body = {"model": "sdar-tiny", "prompt": chat_text(prompt), "max_tokens": 128, "n": n}
        return kind, "/v1/completions", body, stream, n
    body = {"text": chat_text(prompt), "sampling_params": {"max_new_tokens": 128, "n": n}}
    return kind, "/generate", body, stream, n


def test_mixed_requests_through_the_router(service):
    """100 requests, 8 at a time: every answer (every choice of n = 2) is the model's right answer, and both
    workers served some of them."""
    pairs = prompts()
    before = [_requests_total(w) for w in service.workers]

    async def run():
        sem = asyncio.Semaphore(8)
        async with httpx.AsyncClient(base_url=service.base, timeout=300, headers=AUTH) as client:
            async def one(i):
                prompt, answer = pairs[i % len(pairs)]
                kind, path, body, stream, n = _mixed(i, prompt)
                async with sem:
                    if stream:
                        result = await _stream(client, path, body)
                        assert result["status"] == 200, result
                    else:
                        r = await client.post(path, json=body)
                        assert r.status_code == 200, (path, r.text)
                        result = r.json()
                texts = _texts(kind, body, result)
                assert texts == [answer] * n, (i, kind, stream, prompt, texts)
                return kind, stream, n

            return await asyncio.gather(*(one(i) for i in range(100)))

    done = asyncio.run(run())
    assert len(done) == 100 and {(k, s) for k, s, _ in done} == {(k, s) for k in ("chat", "completion", "generate")
                                                                  for s in (False, True)}
    served = [_requests_total(w) - b for w, b in zip(service.workers, before)]
    assert all(s > 0 for s in served) and sum(served) >= 120, served  # 100 requests, 20 of them n = 2
    # --api-key guards the router and the workers (the router sent the key on with every request above)
    for base in (service.base, *service.workers):
        assert httpx.post(base + "/generate", json={"text": "red"}, timeout=30).status_code == 401


def test_cache_aware_sends_repeats_to_their_prefix(service):
    """Four longer prompts (a two-turn chat, over a block of 32), each sent four times: every repeat finds its prompt
    cached, so it went to the worker that answered it first."""
    pairs = prompts()
    with httpx.Client(base_url=service.base, timeout=120, headers=AUTH) as client:
        for k in range(4):
            (p1, a1), (p2, _) = pairs[k], pairs[k + 10]
            messages = [{"role": "user", "content": p1}, {"role": "assistant", "content": a1},
                        {"role": "user", "content": p2}]
            answers, cached = set(), []
            for _ in range(4):
                r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 96})
                assert r.status_code == 200, r.text
                answers.add(r.json()["choices"][0]["message"]["content"])
                cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
            assert r.json()["usage"]["prompt_tokens"] > 32 and len(answers) == 1  # over a block
            assert all(c > 0 for c in cached[1:]), cached


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10, headers=AUTH).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")
               or line.startswith(name + "{"))


def test_client_disconnect_passes_through_the_router(service):
    """A client that goes away from the router mid-request aborts it on the worker (the router drops its own
    connection to the worker): a stream closed after its first event, and a non-streamed request whose client
    times out. Each worker counts the engine requests it aborted so (``dllm_client_disconnects_total``)."""
    name = "dllm_client_disconnects_total"
    before = sum(_metric(w, name) for w in service.workers)
    path, body = _long(0)
    with httpx.Client(base_url=service.base, timeout=120, headers=AUTH) as client:
        with client.stream("POST", path, json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break  # close the connection after the first event
    with pytest.raises(httpx.TimeoutException):
        httpx.post(service.base + path, json=_long(1)[1], timeout=1.0, headers=AUTH)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and sum(_metric(w, name) for w in service.workers) < before + 2:
        time.sleep(0.2)
    assert sum(_metric(w, name) for w in service.workers) == before + 2


# distinct first letters: cache_aware finds no shared prefix and sends each to the least loaded worker
WORDS = "apple bird cat dog egg fish gold hat ice king lake moon night oak pen queen".split()


def _long(i: int) -> tuple[str, dict]:
    word = WORDS[i]
    return "/v1/chat/completions", {"messages": [{"role": "user", "content": f"{word} {word} {word}"}],
                                    "max_tokens": LONG, "ignore_eos": True}


def _fresh(i: int) -> str:
    """A long prompt no worker has seen (~150 one-token words)."""
    import random

    from dllm_jax.train.tasks import WORDS as VOCAB

    rng = random.Random(i)
    return " ".join(rng.choice(VOCAB) for _ in range(150))


async def _in_flight_then(action, service, streams: int = 12, plain: int = 4):
    """``streams`` long streams and ``plain`` long non-streamed requests; once every stream has its first event,
    ``action()``; then their outcomes."""
    async with httpx.AsyncClient(base_url=service.base, timeout=300, headers=AUTH) as client:
        started = [asyncio.Event() for _ in range(streams)]
        tasks = [asyncio.ensure_future(_stream(client, *_long(i), started[i])) for i in range(streams)]
        posts = [asyncio.ensure_future(client.post(_long(streams + i)[0], json=_long(streams + i)[1]))
                 for i in range(plain)]
        try:
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
            assert not any(t.done() for t in tasks), "a long stream finished before the kill"
            action()
            results = await asyncio.wait_for(asyncio.gather(*tasks), 180)
            responses = await asyncio.wait_for(asyncio.gather(*posts, return_exceptions=True), 180)
        finally:
            for t in tasks + posts:
                t.cancel()
    return results, responses


def _wait_router_sees(service, worker: str, healthy: bool, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        workers = httpx.get(service.base + "/workers", timeout=10, headers=AUTH).json()["workers"]
        states = {w["url"]: w["is_healthy"] for w in workers}
        if states.get(worker) is healthy:
            return
        time.sleep(0.2)
    raise AssertionError(f"the router never saw {worker} {'healthy' if healthy else 'unhealthy'}: {states}")


def _finished(result: dict) -> bool:
    last = result["events"][-1]
    return result["done"] and result["cut"] is None and "error" not in last and \
        last["choices"][0]["finish_reason"] == "length"


def test_killed_worker(service):
    """SIGKILL worker 0 while 16 long requests run: its streams end in an error (the router cuts the connection:
    a transport error at the client), the other worker's finish; the non-streamed ones are all answered (the
    router retries them on the other worker). Once the router marked it unhealthy, every request is answered by
    worker 1. Then the launcher's restart of worker 0 is taken back: new prompts reach it."""
    pid = service.worker_pid(0)
    after = len(service.output())
    results, responses = asyncio.run(_in_flight_then(lambda: os.kill(pid, signal.SIGKILL), service))
    cut = [r for r in results if not _finished(r)]
    assert cut and len(cut) < len(results), [(r["done"], r["cut"]) for r in results]
    for r in cut:  # an error, never a silent truncation that looks complete
        assert r["cut"] is not None or any("error" in e for e in r["events"]), r
    for r in responses:
        assert not isinstance(r, Exception) and r.status_code == 200, r
        assert r.json()["usage"]["completion_tokens"] == LONG
    _wait_router_sees(service, service.workers[0], healthy=False)
    before = _requests_total(service.workers[1])
    pairs = prompts()

    async def later():
        async with httpx.AsyncClient(base_url=service.base, timeout=120, headers=AUTH) as client:
            bodies = [{"messages": [{"role": "user", "content": prompt}]} for prompt, _ in pairs[:20]]
            return await asyncio.gather(*(client.post("/v1/chat/completions", json=b) for b in bodies))

    for r, (_, answer) in zip(asyncio.run(later()), pairs):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == answer
    assert _requests_total(service.workers[1]) - before == 20  # all of them by the other worker
    # the launcher restarts worker 0 on its port; the router's health check takes it back
    service.wait_for(r"restarted worker 0 \(pid \d+\)", 60, after)
    _wait_router_sees(service, service.workers[0], healthy=True, timeout=600)
    before = _requests_total(service.workers[0])

    async def fresh(round_):  # 8 at a time: cache_aware sends a prompt it has no prefix of to the least loaded
        async with httpx.AsyncClient(base_url=service.base, timeout=120, headers=AUTH) as client:
            bodies = [{"messages": [{"role": "user", "content": _fresh(8 * round_ + i)}], "max_tokens": 64}
                      for i in range(8)]
            return await asyncio.gather(*(client.post("/v1/chat/completions", json=b) for b in bodies))

    for round_ in range(5):
        assert all(r.status_code == 200 for r in asyncio.run(fresh(round_)))
        if _requests_total(service.workers[0]) > before:
            break
    assert _requests_total(service.workers[0]) > before, "the restarted worker got no request"


def test_stopped_worker_ends_its_streams_with_an_error_event(service):
    """SIGTERM worker 1 (``--shutdown-timeout 0``) while long streams run: the worker ends each of its streams
    with an error event and ``[DONE]``, which the router passes on; the other worker's finish."""
    pid = service.worker_pid(1)
    results, responses = asyncio.run(_in_flight_then(lambda: os.kill(pid, signal.SIGTERM), service, plain=0))
    ended = [r for r in results if not _finished(r)]
    assert ended and len(ended) < len(results), [(r["done"], r["cut"]) for r in results]
    for r in ended:
        assert r["done"] and r["cut"] is None, r
        error = r["events"][-1]["error"]
        assert "server shutting down" in error["message"], error

