"""The server's life against real ``python -m serve`` processes and real signals: the port opens before the engine
is warm (``/health`` 503 ``starting``, requests 503 with ``Retry-After``, then 200), warm-up progress is logged as
lines when stderr is not a terminal, and a graceful shutdown on SIGINT and on SIGTERM: new requests get 503 at
once, running ones may finish within ``--shutdown-timeout`` (a second signal cuts that short), the rest end with an
abort frame (``/generate``) or an error event (OpenAI) and ``[DONE]``, or a 503 JSON error when not streamed; the
process exits 0 with no traceback. Also: the metric names pass ``promtool check metrics`` (and its rules, written
out here for machines without it).

Two servers (each start is most of this module's time on a CPU). Requests are slowed down on purpose: LowConfidence
with threshold 1.0 commits one token per forward, so a long request outlasts the shutdown timeout.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import time

import httpx
import pytest

from conftest import TEST_XLA_FLAGS
from dllm_jax.assets import DEFAULT_MODEL_PATH

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONTEXT = 512
SHAPE_BUCKETS = {"rows": [8], "pages": [CONTEXT // 32], "prefill_rows": [1], "prefill_blocks": [2]}
SHIPPED = all(os.path.isfile(os.path.join(DEFAULT_MODEL_PATH, f)) for f in ("config.json", "model.safetensors"))
LONG = 448  # tokens: ~7 s at one token per forward, four requests running
SHORT = 24  # tokens: well within the shutdown timeout
TIMINGS: dict[str, float] = {}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    if SHIPPED:
        return DEFAULT_MODEL_PATH
    from test_serve import build_chat_model

    return build_chat_model(str(tmp_path_factory.mktemp("lifecycle_model") / "model"))


@pytest.fixture(scope="module", autouse=True)
def print_timings():
    yield
    if TIMINGS:
        print("\nlifecycle timings: " + ", ".join(f"{k} {v:.2f} s" for k, v in TIMINGS.items()))


def server_process(model_dir: str, log_path, *extra: str):
    from serve.launch import ServerProcess

    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_DEFAULT_MATMUL_PRECISION="highest", XLA_FLAGS=TEST_XLA_FLAGS,
               TOKENIZERS_PARALLELISM="false", PYTHONPATH=REPO)
    args = ["--model-path", model_dir, "--max-running-requests", "4", "--context-length", str(CONTEXT),
            "--max-prefill-tokens", "64", "--shape-buckets", json.dumps(SHAPE_BUCKETS), "--no-access-log",
            "--algorithm-config", json.dumps({"threshold": 1.0}), *extra]
    return ServerProcess(args, env=env, cwd=REPO, log_path=str(log_path))


# ----------------------------------------------------------------------------------------------
# Clients
# ----------------------------------------------------------------------------------------------
async def read_stream(client: httpx.AsyncClient, path: str, body: dict) -> dict:
    """One SSE request: its status, its JSON events, whether it ended with ``[DONE]``."""
    out = {"path": path, "status": None, "events": [], "done": False}
    async with client.stream("POST", path, json={**body, "stream": True}) as r:
        out["status"] = r.status_code
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                out["done"] = True
            elif line.startswith("data: "):
                assert not out["done"], f"an event after [DONE]: {line}"
                out["events"].append(json.loads(line[6:]))
    return out


async def post(client: httpx.AsyncClient, path: str, body: dict) -> dict:
    r = await client.post(path, json=body)
    return {"path": path, "status": r.status_code, "json": r.json(), "retry_after": r.headers.get("retry-after")}


def generate(i: int, tokens: int) -> dict:
    return {"text": f"Count up {tokens} steps from {i}.", "sampling_params": {"max_new_tokens": tokens,
                                                                             "ignore_eos": True}}


def chat(i: int, tokens: int) -> dict:
    return {"messages": [{"role": "user", "content": f"List {tokens} colours, number {i}."}], "max_tokens": tokens,
            "ignore_eos": True}


def stream_outcome(s: dict) -> str:
    """``completed`` or ``aborted`` (checking that the stream says so properly), for one stream."""
    assert s["status"] == 200 and s["done"] and s["events"], s
    last = s["events"][-1]
    if s["path"] == "/generate":
        reason = last["meta_info"]["finish_reason"]
        if reason["type"] == "abort":
            assert reason["message"] == "server shutting down", last
            return "aborted"
        assert reason["type"] == "length" and last["meta_info"]["completion_tokens"] > 0, last
        return "completed"
    if "error" in last:
        assert last["error"]["type"] == "server_busy" and "server shutting down" in last["error"]["message"], last
        return "aborted"
    assert last["choices"][0]["finish_reason"] == "length", last
    return "completed"


def post_outcome(p: dict) -> str:
    if p["status"] == 200:
        return "completed"
    assert p["status"] == 503 and p["json"]["error"]["type"] == "server_busy", p
    assert "server shutting down" in p["json"]["error"]["message"] and p["retry_after"], p
    return "aborted"


async def submitted(client: httpx.AsyncClient) -> int:
    return (await client.get("/internal/load")).json()["requests"]  # submitted to the engine since start


async def wait_submitted(client: httpx.AsyncClient, n: int, timeout: float = 60) -> None:
    """Until the engine has been given ``n`` requests since start (finished ones included)."""
    deadline = time.perf_counter() + timeout
    while await submitted(client) < n:
        assert time.perf_counter() < deadline, "the requests were not admitted"
        await asyncio.sleep(0.02)


async def drive_shutdown(server, sig: int, short: int, long: int, after_signal=None) -> tuple[list, list, float]:
    """Open ``short`` then ``long`` streams on /generate and /v1/chat/completions (alternating), with one short and
    three long non-streamed requests, the short ones admitted first (so that they run first); once all are in
    flight send ``sig``, run ``after_signal(client)`` while the server drains, and collect everything. Returns
    (streams, non-streamed answers, seconds from the signal to the exit)."""
    async with httpx.AsyncClient(base_url=server.base, timeout=60) as client:
        before = await submitted(client)

        def open_stream(i: int, tokens: int):
            path, body = ("/generate", generate(i, tokens)) if i % 2 == 0 else ("/v1/chat/completions",
                                                                               chat(i, tokens))
            return asyncio.ensure_future(read_stream(client, path, body))

        tasks = [open_stream(i, SHORT) for i in range(short)]
        posts = [asyncio.ensure_future(post(client, "/generate", generate(100, SHORT)))]
        await wait_submitted(client, before + short + 1)
        tasks += [open_stream(short + i, LONG) for i in range(long)]
        posts += [asyncio.ensure_future(post(client, "/v1/chat/completions", chat(101, LONG))),
                  asyncio.ensure_future(post(client, "/generate", generate(102, LONG))),
                  asyncio.ensure_future(post(client, "/v1/completions", {"prompt": "One two", "max_tokens": LONG,
                                                                         "ignore_eos": True}))]
        await wait_submitted(client, before + len(tasks) + len(posts))
        sent = time.perf_counter()
        server.proc.send_signal(sig)
        if after_signal is not None:
            await after_signal(client)
        streams = await asyncio.gather(*tasks)
        answers = await asyncio.gather(*posts)
        await asyncio.get_running_loop().run_in_executor(None, server.proc.wait, 60)
        return streams, answers, time.perf_counter() - sent


def assert_clean_exit(server, log_text: str) -> None:
    assert server.proc.returncode == 0, log_text
    for bad in ("Traceback", "CancelledError", "ERROR", "Exception"):
        assert bad not in log_text, log_text


# ----------------------------------------------------------------------------------------------
# Start: port first, 503 "starting" while warming up; then SIGINT with requests finishing and cut
# ----------------------------------------------------------------------------------------------
def test_start_warm_up_then_sigint_drains(model_dir, tmp_path):
    """The port opens before the warm-up ends: ``/health`` is 503 ``starting`` (then 200), a request 503 JSON with
    Retry-After; the warm-up logs progress lines (stderr is a file here) before the ready line. Then SIGINT with
    ``--shutdown-timeout 2.5``: the short requests finish normally, the long ones end with an abort / error event
    and [DONE] (503 JSON when not streamed), new requests meanwhile get 503 and /health ``shutting_down``; exit 0,
    no traceback."""
    log_path = tmp_path / "server.log"
    # no compilation cache: the warm-up really compiles (a few seconds), whatever ran before
    server = server_process(model_dir, log_path, "--warmup-variants", "sampling", "--compilation-cache", "off",
                            "--shutdown-timeout", "2.5", "--warmup-all").start()  # every bucket before ready
    try:
        port_s = server.wait_port()
        r = httpx.get(server.base + "/health")
        assert r.status_code == 503 and r.json() == {"status": "starting"} and r.headers["retry-after"], r.text
        r = httpx.post(server.base + "/generate", json=generate(0, 8))
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_busy" and r.headers["retry-after"], r.text
        ready_s = server.wait_healthy()
        assert httpx.get(server.base + "/health").json() == {"status": "ok"}
        TIMINGS["port open"], TIMINGS["ready"] = port_s, ready_s

        deadline = time.perf_counter() + 5  # the ready line follows within a tick of the server's loop
        while "dllm-jax: ready on" not in server.output() and time.perf_counter() < deadline:
            time.sleep(0.05)
        lines = server.output().splitlines()
        progress = [i for i, line in enumerate(lines) if re.fullmatch(r"dllm-jax: compiled \d+/3 shape buckets", line)]
        done = [i for i, line in enumerate(lines) if line.startswith("dllm-jax: compiled 3 shape buckets in ")]
        ready = [i for i, line in enumerate(lines) if line.startswith("dllm-jax: ready on http://127.0.0.1:")]
        assert progress and len(done) == 1 and len(ready) == 1, lines
        assert max(progress) < done[0] < ready[0], lines

        async def while_draining(client):
            await asyncio.sleep(0.3)
            r = await client.get("/health")
            assert r.status_code == 503 and r.json() == {"status": "shutting_down"}, r.text
            for path, body in (("/generate", generate(200, 8)), ("/v1/chat/completions", chat(201, 8))):
                r = await client.post(path, json=body)
                assert r.status_code == 503 and r.headers["retry-after"], r.text
                assert "shutting down" in r.json()["error"]["message"], r.text

        streams, posts, exit_s = asyncio.run(drive_shutdown(server, signal.SIGINT, short=4, long=6,
                                                            after_signal=while_draining))
    finally:
        server.stop()
    TIMINGS["SIGINT -> exit (timeout 2.5 s)"] = exit_s
    outcomes = [stream_outcome(s) for s in streams]
    assert outcomes == ["completed"] * 4 + ["aborted"] * 6, outcomes
    assert [post_outcome(p) for p in posts] == ["completed", "aborted", "aborted", "aborted"], posts
    assert 2.5 < exit_s < 10, exit_s
    text = server.output()
    assert_clean_exit(server, text)
    assert "SIGINT: shutting down" in text and "ended 9 unfinished request(s)" in text, text


# ----------------------------------------------------------------------------------------------
# SIGTERM, then a second one; the metric names
# ----------------------------------------------------------------------------------------------
def test_sigterm_then_a_second_ends_every_request_at_once(model_dir, tmp_path):
    """``--shutdown-timeout 60``: on SIGTERM the server drains (``/health`` says ``shutting_down``); a second
    SIGTERM ends every open stream at once with its abort / error event and [DONE] and every waiting request with a
    503 JSON error (as ``--shutdown-timeout 0`` would); exit 0 with no traceback, long before the timeout. The live
    /metrics text passes the naming rules."""
    server = server_process(model_dir, tmp_path / "server.log", "--shutdown-timeout", "60")

    async def second_signal(client):
        await asyncio.sleep(0.3)
        r = await client.get("/health")
        assert r.status_code == 503 and r.json() == {"status": "shutting_down"}, r.text
        server.proc.send_signal(signal.SIGTERM)

    with server:
        r = httpx.post(server.base + "/generate", json=generate(0, SHORT), timeout=60)  # fills the histograms
        assert r.status_code == 200, r.text
        check_metric_names(httpx.get(server.base + "/metrics").text)
        streams, posts, exit_s = asyncio.run(drive_shutdown(server, signal.SIGTERM, short=0, long=8,
                                                            after_signal=second_signal))
    TIMINGS["SIGTERM + SIGTERM 0.3 s later -> exit"] = exit_s
    assert [stream_outcome(s) for s in streams] == ["aborted"] * 8
    assert [post_outcome(p) for p in posts][1:] == ["aborted"] * 3, posts  # the short one may finish first
    assert exit_s < 8, exit_s
    text = server.output()
    assert_clean_exit(server, text)
    assert "SIGTERM: shutting down" in text and "ended " in text, text


def check_metric_names(text: str) -> None:
    """Prometheus' naming rules (what ``promtool check metrics`` checks, which runs too when it is installed):
    counters end in ``_total``, other types never do (nor in ``_count`` / ``_sum`` / ``_bucket``), names are
    snake_case without colons (those are for recording rules), units are base units, every metric has HELP."""
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    helps = set(re.findall(r"^# HELP (\S+) ", text, re.M))
    assert types and "dllm_kv_pages_capacity" in types and "dllm_tokens_per_forward" in types, text
    for name, kind in types.items():
        assert re.fullmatch(r"[a-z_][a-z0-9_]*", name), name
        assert name in helps, f"{name}: no HELP"
        if kind == "counter":
            assert name.endswith("_total"), f"{name}: a counter without _total"
        else:
            reserved = ("_total", "_count", "_sum", "_bucket")
            assert not name.endswith(reserved), f"{name}: a {kind} with a counter's or a histogram's suffix"
        assert not re.search(r"_(milliseconds|ms|microseconds|minutes|hours|kilobytes|megabytes|percent)(_|$)",
                             name), f"{name}: not a base unit"
    if shutil.which("promtool"):
        out = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
        assert out.returncode == 0 and not out.stdout.strip() and not out.stderr.strip(), out.stdout + out.stderr


def test_metric_names_pass_the_lint():
    """Every metric this server exports (fed with numbers: labelled counters and histograms show up), rendered
    as /metrics renders it; and one tokens-per-forward definition: completion tokens over the requests' forwards."""
    from serve.metrics import ServerMetrics

    load = {"kv_pages_total": 100, "kv_pages_used": 10, "generation_tokens": 90, "prefill_forwards": 3,
            "denoise_forwards": 7, "prompt_tokens": 40, "cached_tokens": 8}
    metrics = ServerMetrics(lambda: load, lambda: 2)
    metrics.http_responses.labels("/generate", "200").inc()
    metrics.rejected.labels("invalid").inc()
    metrics.client_aborts.inc()
    for tokens, forwards in ((30, 10), (60, 20)):
        metrics.observe_finish({"finish_reason": {"type": "length"}, "completion_tokens": tokens,
                                "forward_passes": forwards, "e2e_latency": 0.5, "time_to_first_block": 0.1})
    text = metrics.render().decode()
    check_metric_names(text)
    assert "dllm_kv_pages_total" not in text
    values = dict(re.findall(r"^(dllm_\w+) (\S+)$", text, re.M))
    assert float(values["dllm_kv_pages_capacity"]) == 100
    assert float(values["dllm_tokens_per_forward"]) == 90 / 30 == (float(values["dllm_request_completion_tokens_total"])
                                                                   / float(values["dllm_request_forward_passes_total"]))


def test_lifecycle_flags(capsys):
    """``--warmup-variants`` (a comma list, or all) and ``--shutdown-timeout``; bad values fail before loading."""
    from serve.cli import build_parser, run, warmup_variants

    assert warmup_variants(None) == {}
    assert warmup_variants("all") == {"sampling": True, "logprobs": True, "penalties": True, "grammar": True}
    assert warmup_variants("logprobs, penalties") == {"logprobs": True, "penalties": True}
    args = build_parser().parse_args(["--warmup-variants", "sampling", "--shutdown-timeout", "0"])
    assert args.warmup_variants == "sampling" and args.shutdown_timeout == 0
    assert build_parser().parse_args([]).shutdown_timeout == 30
    assert run(["--warmup-variants", "sampling,top_k", "--port", "1"]) == 2
    assert "warmup_variants: unknown variant 'top_k'" in capsys.readouterr().err
    assert run(["--shutdown-timeout", "-1", "--port", "1"]) == 2
    assert "shutdown_timeout: must be >= 0" in capsys.readouterr().err
