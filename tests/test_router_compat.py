"""A worker SGLang's router can use, in-process (TestClient over the shipped model; no router needed): the bodies
``sglang-router`` 0.3.2 forwards, byte for byte as recorded against a recording server, answered with the model's
right answers; every router field of :mod:`serve.schemas.router_fields` accepted (ignored ones whatever their
value, neutral-only ones at their neutral value, else a 400 naming them); ``sampling_seed`` is the seed;
``model: "unknown"`` is no model; the registration and load endpoints in the router's format; ``/health_generate``;
a ``rid`` on ``/v1`` reaches ``/abort_request``; each ignored field logged once; the ``--dp`` launcher's pieces
(worker flags, device split, router command). The real router in front of real
workers: tests/test_dp.py (slow)."""

from __future__ import annotations

import json
import logging

import pytest

from conftest import SHIPPED_KW

COUNT = "Count up 11 steps from 71."
COUNT_ANSWER = "Answer: 1 71 | 2 72 | 3 73 | 4 74 | 5 75 | 6 76 | 7 77 | 8 78 | 9 79 | 10 80 | 11 81"
CHAT_TEXT = f"<|im_start|>user\n{COUNT}<|im_end|>\n<|im_start|>assistant\n"

# What sglang-router 0.3.2 sent a recording worker for plain client requests (its defaults filled in): the client
# sent {"text", "sampling_params"}; {"messages", "max_tokens"}; {"model", "prompt", "max_tokens", "stream",
# "stream_options"}.
ROUTER_GENERATE = {"text": CHAT_TEXT, "model": None, "sampling_params": {"max_new_tokens": 64},
                   "return_text_in_logprobs": False, "stream": False, "log_metrics": True,
                   "return_hidden_states": False, "background": False, "no_logs": False, "return_bytes": False,
                   "return_entropy": False}
ROUTER_CHAT = {"messages": [{"role": "user", "content": COUNT}], "model": "unknown", "logprobs": False,
               "max_completion_tokens": 64, "stream": False, "no_stop_trim": False, "ignore_eos": False,
               "continue_final_message": False, "skip_special_tokens": True, "separate_reasoning": True,
               "stream_reasoning": True, "return_hidden_states": False}
ROUTER_COMPLETION = {"model": "sdar-tiny", "prompt": CHAT_TEXT, "max_tokens": 64, "stream": True,
                     "stream_options": {"include_usage": True}, "echo": False, "no_stop_trim": False,
                     "ignore_eos": False, "skip_special_tokens": True, "return_hidden_states": False}


@pytest.fixture(scope="module")
def client():
    from fastapi.testclient import TestClient

    import dllm_jax
    from serve import ServerSettings, create_app

    engine = dllm_jax.Engine(None, warmup=False, **SHIPPED_KW)
    app = create_app(engine, ServerSettings(served_model_name="sdar-tiny"))
    with TestClient(app, base_url="http://localhost") as c:
        yield c


def _events(text: str) -> list:
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:])
            for line in text.splitlines() if line.startswith("data: ")]


def test_the_routers_own_bodies_are_answered(client):
    r = client.post("/generate", json=ROUTER_GENERATE)
    assert r.status_code == 200, r.text
    assert r.json()["text"] == COUNT_ANSWER
    events = _events(client.post("/generate", json={**ROUTER_GENERATE, "stream": True}).text)
    assert events[-1] == "[DONE]" and events[-2]["text"] == COUNT_ANSWER
    r = client.post("/v1/chat/completions", json=ROUTER_CHAT)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == COUNT_ANSWER and r.json()["model"] == "sdar-tiny"
    events = _events(client.post("/v1/completions", json=ROUTER_COMPLETION).text)
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] > 0  # include_usage honoured
    assert "".join(c["text"] for e in events[:-2] for c in e["choices"]) == COUNT_ANSWER


def _value(name: str, neutral: tuple):
    """A value for a router field: its first neutral value (null where there is none)."""
    return neutral[0] if neutral else None


def _not_neutral(neutral: tuple):
    if not neutral:
        return "x"
    ok = neutral[0]
    return True if ok is False else {"a": 1} if ok == {} else 0.5


@pytest.mark.parametrize("kind,path,base", [
    ("generate", "/generate", {"text": CHAT_TEXT, "sampling_params": {"max_new_tokens": 64}}),
    ("chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": COUNT}], "max_tokens": 64}),
    ("completion", "/v1/completions", {"prompt": CHAT_TEXT, "max_tokens": 64}),
    ("sampling", "/generate", {"text": CHAT_TEXT, "sampling_params": {"max_new_tokens": 64}}),
])
def test_every_router_field_is_accepted(client, kind, path, base):
    """All at once at values the router may send (an ignored field: any value; a neutral-only one: its neutral
    value), the answer unchanged; then each neutral-only field at another value alone: 400 naming it."""
    from serve.schemas.router_fields import IGNORED, NEUTRAL

    def body(fields: dict) -> dict:
        if kind == "sampling":
            return {**base, "sampling_params": {**base["sampling_params"], **fields}}
        return {**base, **fields}

    every = {name: {"routing": "x", "priority": 3}.get(name, 7 if "port" in name or "rank" in name else "x")
             for name in IGNORED[kind]}
    every.update({name: _value(name, neutral) for name, neutral in NEUTRAL[kind].items()})
    r = client.post(path, json=body(every))
    assert r.status_code == 200, r.text
    out = r.json()
    text = out.get("text") or out.get("choices", [{}])[0].get("text") or out["choices"][0]["message"]["content"]
    assert text == COUNT_ANSWER
    prefix = "sampling_params." if kind == "sampling" else ""
    for name, neutral in NEUTRAL[kind].items():
        r = client.post(path, json=body({name: _not_neutral(neutral)}))
        assert r.status_code == 400, (name, r.text)
        assert r.json()["error"]["param"] == prefix + name, r.json()
        assert "not supported by this server" in r.json()["error"]["message"]


def test_sampling_seed_is_the_seed(client):
    params = {"max_new_tokens": 24, "temperature": 1.5, "ignore_eos": True}
    by_seed = client.post("/generate", json={"text": "red", "sampling_params": {**params, "seed": 11}}).json()
    by_router = client.post("/generate", json={"text": "red", "sampling_params": {**params, "sampling_seed": 11}})
    assert by_router.json()["output_ids"] == by_seed["output_ids"]
    chat = {"messages": [{"role": "user", "content": "red"}], "max_tokens": 24, "temperature": 1.5,
            "ignore_eos": True}
    a = client.post("/v1/chat/completions", json={**chat, "seed": 5}).json()["choices"][0]["message"]["content"]
    b = client.post("/v1/chat/completions", json={**chat, "sampling_seed": 5}).json()
    assert b["choices"][0]["message"]["content"] == a
    r = client.post("/generate", json={"text": "red", "sampling_params": {"seed": 1, "sampling_seed": 2}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.sampling_seed"


def test_model_unknown_is_no_model(client):
    for model in ("unknown", "sdar-tiny", None):
        assert client.post("/generate", json={**ROUTER_GENERATE, "model": model}).status_code == 200
        assert client.post("/v1/chat/completions", json={**ROUTER_CHAT, "model": model}).status_code == 200
    for path, body in (("/generate", ROUTER_GENERATE), ("/v1/chat/completions", ROUTER_CHAT)):
        r = client.post(path, json={**body, "model": "other"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_registration_and_load_endpoints(client):
    """What the router reads when it registers a worker (its ServerInfo / ModelInfo field types), the load its
    power-of-two monitor sums (``num_tokens`` of each entry), and the real-generation health check."""
    for path in ("/server_info", "/get_server_info"):
        info = client.get(path).json()
        assert info["model_path"].endswith("sdar-tiny") and info["served_model_name"] == "sdar-tiny"
        assert info["tp_size"] == 1 and info["dp_size"] == 1 and isinstance(info["max_total_tokens"], int)
        assert info["max_running_requests"] == SHIPPED_KW["max_running_requests"] and isinstance(info["version"], str)
    assert client.get("/model_info").json() == client.get("/get_model_info").json()
    assert client.get("/model_info").json()["is_generation"] is True
    load = client.get("/get_load").json()
    assert isinstance(load, list) and len(load) == 1
    assert load[0]["num_tokens"] == 0 and load[0]["num_reqs"] == 0 and load[0]["dp_rank"] == 0
    r = client.get("/health_generate")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_rid_on_openai_reaches_abort_request(client):
    """A ``rid`` (SGLang's extension, which the router forwards) names the engine requests of a ``/v1`` request:
    ``/abort_request`` ends the stream (error event, ``[DONE]``); several choices of one id are ``rid-j``; a list
    of the wrong length is a 400."""
    body = {"messages": [{"role": "user", "content": "red"}], "max_tokens": 200, "ignore_eos": True,
            "stream": True, "rid": "abc"}
    seen = []
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            seen.append(line[6:])
            if len(seen) == 1:
                assert client.post("/abort_request", json={"rid": "abc"}).json() == {"aborted": ["abc"]}
    assert seen[-1] == "[DONE]" and "error" in json.loads(seen[-2]), seen[-3:]
    r = client.post("/v1/chat/completions", json={**body, "stream": False, "n": 2, "rid": ["a"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "rid"
    r = client.post("/v1/completions", json={"prompt": "red", "max_tokens": 4, "n": 2, "rid": "two"})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2


def test_ignored_fields_are_logged_once(client, caplog):
    from serve.schemas import router_fields

    router_fields._logged.discard("bootstrap_room")
    body = {**ROUTER_GENERATE, "bootstrap_room": 5}
    with caplog.at_level(logging.INFO, logger="dllm_jax.serve"):
        for _ in range(3):
            assert client.post("/generate", json=body).status_code == 200
    lines = [r.getMessage() for r in caplog.records if "'bootstrap_room'" in r.getMessage()]
    assert len(lines) == 1 and "accepted and ignored" in lines[0]


# ----------------------------------------------------------------------------------------------
# The --dp launcher's pieces (serve/dp.py), without starting anything
# ----------------------------------------------------------------------------------------------
def test_workers_get_the_users_flags_and_not_the_launchers():
    from serve.args import build_parser
    from serve.dp import worker_argv

    p = build_parser()
    argv = ["--dp", "2", "--router-policy", "round_robin", "--router-args", "--health-check-interval-secs 1",
            "--port", "31000", "--host", "0.0.0.0", "--api-key", "k", "--no-warmup", "--disable-prefix-cache",
            "--max-running-requests", "8", "--tp", "2", "--served-model-name=-odd,name",
            "--shape-buckets", '{"rows": [8]}', "--shutdown-timeout", "0", "--log-level", "warning"]
    args = p.parse_args(argv)
    flags = worker_argv(args, p)
    assert not any(f.startswith(("--dp", "--router", "--port", "--host", "--api-key", "--worker")) for f in flags)
    again = p.parse_args(flags)
    for dest in ("warmup", "enable_prefix_cache", "max_running_requests", "tensor_parallel_size",
                 "served_model_name", "shape_buckets", "shutdown_timeout", "log_level"):
        assert getattr(again, dest) == getattr(args, dest), dest
    assert worker_argv(p.parse_args([]), p) == []  # defaults are not repeated


def test_devices_are_split_between_workers():
    from serve.dp import device_groups

    assert device_groups(2, ["0", "1", "2", "3"], [0, 1], "split", None) == [{"gpus": ["0", "1"]},
                                                                              {"gpus": ["2", "3"]}]
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        device_groups(2, ["0", "1", "2", "3"], [0, 1], "split", 4)
    with pytest.raises(ValueError, match="GPU"):
        device_groups(3, ["0", "1"], [0, 1], "split", None)
    assert device_groups(2, [], [0, 1, 2, 3], "split", None) == [{"cpus": [0, 1]}, {"cpus": [2, 3]}]
    assert device_groups(2, [], [0, 1], "shared", None) == [{"cpus": [0, 1]}, {"cpus": [0, 1]}]
    assert device_groups(3, [], [0, 1], "split", None) == [{"cpus": [0, 1]}] * 3  # fewer cores than workers


def test_router_command_and_checks():
    from serve.args import build_parser
    from serve.dp import Replicas, check, router_command

    p = build_parser()
    args = p.parse_args(["--dp", "2", "--router-policy", "power_of_two", "--port", "31000", "--api-key", "k",
                         "--router-args", "--health-check-interval-secs 7"])
    args.router_port = 31000
    cmd = router_command(args, ["http://127.0.0.1:31001", "http://127.0.0.1:31002"])
    assert cmd[1:3] == ["-m", "sglang_router.launch_router"]
    assert cmd[cmd.index("--policy") + 1] == "power_of_two" and cmd[cmd.index("--api-key") + 1] == "k"
    assert cmd[cmd.index("--worker-urls") + 1:cmd.index("--worker-urls") + 3] == ["http://127.0.0.1:31001",
                                                                                  "http://127.0.0.1:31002"]
    assert cmd[-2:] == ["--health-check-interval-secs", "7"]  # the user's flags last: they win
    for bad, match in ((["--dp", "0"], "dp"), (["--dp", "2", "--num-processes", "2"], "multi-process"),
                       (["--dp", "2", "--worker-restarts", "-1"], "worker_restarts")):
        with pytest.raises(ValueError, match=match):
            check(p.parse_args(bad))
    with pytest.raises(ValueError, match="router_port"):
        Replicas(p.parse_args(["--dp", "2", "--port", "31000", "--worker-port-start", "30999"]))
