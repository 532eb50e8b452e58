"""`dllm-jax serve` / `python -m serve` argument handling, the server's rules as plain functions (Host check, profile
root, error fields, the body text check), and the app in-process (starlette TestClient) on the tiny random model:
no uvicorn process here (tests/test_serve.py and tests/test_serve_hardening.py have those)."""

import os

import pytest


def test_serve_subcommand_is_registered_and_parses(capsys):
    from dllm_jax import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--host", "--port", "--api-key", "--max-queued-requests", "--max-prompt-tokens", "--model-path",
                 "--max-running-requests", "--log-level"):
        assert flag in out


def test_defaults_bind_loopback():
    from serve.cli import build_parser, settings_from_args

    args = build_parser().parse_args([])
    assert args.host == "127.0.0.1" and args.port == 30000 and args.model_path is None
    settings = settings_from_args(args)
    assert settings.api_key is None and settings.max_queued_requests > 0


def test_api_key_from_environment(monkeypatch):
    from serve.cli import build_parser, settings_from_args

    monkeypatch.setenv("DLLM_JAX_API_KEY", "from-env")
    assert settings_from_args(build_parser().parse_args([])).api_key == "from-env"
    assert settings_from_args(build_parser().parse_args(["--api-key", "flag"])).api_key == "flag"


def test_bad_model_path_fails_before_binding(tmp_path, capsys):
    from dllm_jax import cli
    from serve.cli import run

    missing = str(tmp_path / "nope")
    assert run(["--model-path", missing, "--port", "1"]) == 2
    assert "model directory not found" in capsys.readouterr().err
    assert cli.main(["serve", "--model-path", missing, "--port", "1"]) == 2


def test_bad_settings_are_rejected():
    from serve.app import ServerSettings

    with pytest.raises(ValueError, match="max_queued_requests"):
        ServerSettings(max_queued_requests=-1)
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        ServerSettings(max_prompt_tokens=0)


def test_server_flags_reach_the_settings(tmp_path, monkeypatch):
    from serve.cli import build_parser, settings_from_args
    from serve.settings import ServerSettings

    s = settings_from_args(build_parser().parse_args([
        "--served-model-name", "main, alias", "--allowed-hosts", "A.example,b.example:8443", "--body-timeout", "5",
        "--profile-dir", str(tmp_path / "p")]))
    assert s.served_model_names == ["main", "alias"] and s.allowed_hosts == ["a.example", "b.example:8443"]
    assert s.body_timeout_s == 5 and s.profile_root == str(tmp_path / "p") and s.host == "127.0.0.1"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert ServerSettings().profile_root == str(tmp_path / "cache" / "dllm-jax" / "profiles")
    with pytest.raises(ValueError, match="body_timeout_s"):
        ServerSettings(body_timeout_s=0)
    with pytest.raises(ValueError, match="served_model_name"):
        ServerSettings(served_model_name=" , ")


def test_host_rules():
    """DNS rebinding: only names of this server pass (a rebinding page's Host is its own name); a wildcard bind
    with an API key accepts any Host, unless --allowed-hosts says otherwise."""
    from serve.limits import host_allowed, origin_allowed
    from serve.settings import ServerSettings

    loop = ServerSettings(host="127.0.0.1", allowed_hosts="good.example,pinned.example:8443")
    for host in ("localhost", "localhost:30000", "127.0.0.1:1", "127.0.0.2", "[::1]:30000", "good.example",
                 "Good.Example.:99", "pinned.example:8443", "10.0.0.5:30000", "[fe80::1]"):
        assert host_allowed(host, loop), host
    for host in ("evil.example", "pinned.example", "pinned.example:80", "good.example.evil", "", "localhost.evil"):
        assert not host_allowed(host, loop), host
    # bound to a wildcard without a key: addresses pass, a name must be allowed
    wild = ServerSettings(host="0.0.0.0")
    assert not wild.any_host
    assert host_allowed("10.0.0.5:30000", wild) and not host_allowed("myserver.lan", wild)
    assert ServerSettings(host="0.0.0.0", api_key="k").any_host and ServerSettings(host="::", api_key="k").any_host
    assert not ServerSettings(host="0.0.0.0", api_key="k", allowed_hosts="myserver.lan").any_host
    assert ServerSettings(allowed_hosts="*").any_host and not ServerSettings(host="127.0.0.1", api_key="k").any_host
    # a bound name passes (any port)
    assert host_allowed("myserver.lan:1", ServerSettings(host="myserver.lan"))
    # Origin: this server's own page (the request's Host), or a host of ours; not any address
    assert origin_allowed("http://localhost:8080", None, loop) and origin_allowed("https://good.example", None, loop)
    assert origin_allowed("http://10.0.0.5:30000", "10.0.0.5:30000", loop)
    for origin in ("null", "http://evil.example", "file://", "http://user@evil.example", "http://10.0.0.6:30000"):
        assert not origin_allowed(origin, "10.0.0.5:30000", loop), origin


def test_profile_paths_stay_under_the_root(tmp_path):
    from serve.errors import ApiError
    from serve.routes.admin import profile_path

    root = str(tmp_path / "root")
    os.makedirs(root)
    os.symlink(tmp_path, os.path.join(root, "out"))
    assert profile_path(root, None) == root and profile_path(root, "a/b") == os.path.join(root, "a", "b")
    assert profile_path(root, os.path.join(root, "x")) == os.path.join(root, "x")
    for bad in ("..", "../root-sibling", "/etc", "out/x", "a/../../x"):
        with pytest.raises(ApiError) as e:
            profile_path(root, bad)
        assert e.value.status == 403 and e.value.param == "output_dir"


def test_error_params_name_the_clients_field():
    from serve.errors import ApiError, bad_request, error_body
    from serve.schemas import OPENAI_FIELD_NAMES

    e = bad_request("sampling_params.logit_bias.5000: token id 5000 is outside the vocabulary", OPENAI_FIELD_NAMES)
    assert (e.param, e.message) == ("logit_bias.5000", "logit_bias.5000: token id 5000 is outside the vocabulary")
    e = bad_request("sampling_params.max_new_tokens: too large", OPENAI_FIELD_NAMES)
    assert e.param == "max_tokens" and e.message == "max_tokens: too large"
    assert bad_request("sampling_params.stop[1]: bad", OPENAI_FIELD_NAMES).param == "stop[1]"
    assert bad_request("sampling_params.top_k: bad").param == "sampling_params.top_k"  # /generate: as sent
    # the framework's stock refusals name the part of the request
    assert ApiError(404, "Not Found").param == "path" and ApiError(405, "Method Not Allowed").param == "method"
    assert ApiError(400, "There was an error parsing the body").param == "body"
    assert ApiError(503, "server busy: retry").param is None
    # a message quoting unencodable text still encodes
    assert error_body(400, "text: 'a\ud800'", "text")["error"]["message"] == "text: 'a\\ud800'"


def test_body_text_check_names_the_field():
    from pydantic import ValidationError

    from serve.schemas import ChatCompletionRequest, GenerateRequest

    for body, param in (({"text": "a\ud800"}, "text"), ({"text": ["a", "b\udfff"]}, "text[1]"),
                        ({"text": "a", "rid": "r\x00"}, "rid"),
                        ({"text": "a", "sampling_params": {"stop": ["x", "\x00"]}}, "sampling_params.stop[1]"),
                        ({"text": "a", "\ud800": 1}, "\\ud800")):
        with pytest.raises(ValidationError) as e:
            GenerateRequest.model_validate(body)
        assert e.value.errors()[0]["ctx"]["param"] == param, e.value
    GenerateRequest.model_validate({"text": ["a\x00b"]})  # a NUL in prompt text is the tokenizer's business
    ChatCompletionRequest.model_validate({"messages": [{"role": "user",
                                                        "content": [{"type": "text", "text": "\x00"}]}]})
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x", "name": "\x00"}]})
    deep = {"text": "a", "sampling_params": {"logit_bias": {}}}
    node = deep
    for _ in range(5000):  # iterative: no recursion limit
        node["x"] = {}
        node = node["x"]
    with pytest.raises(ValidationError) as e:
        GenerateRequest.model_validate(deep)
    assert e.value.errors()[0]["type"] == "extra_forbidden"


def test_import_dllm_jax_does_not_need_fastapi():
    import subprocess
    import sys

    code = ("import sys; import dllm_jax, dllm_jax.cli; "
            "assert 'fastapi' not in sys.modules and 'uvicorn' not in sys.modules, sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, env={"JAX_PLATFORMS": "cpu", "PATH": ""})


def _sse(text: str) -> list:
    import json

    out = []
    for line in text.splitlines():
        if line.startswith("data: "):
            out.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
    return out


def test_in_process_app_incremental_streaming(tiny_model):
    """``create_app`` over an engine built by the caller; ``--incremental-streaming-output`` sends only the new part
    of each block, and the parts add up to the non-streaming answer. A tokenizer-less model answers text with 400."""
    import json

    from fastapi.testclient import TestClient

    import dllm_jax
    from serve import ServerSettings, create_app

    from conftest import ENGINE_KW

    engine = dllm_jax.Engine(tiny_model, **ENGINE_KW)  # the engine tests' shapes: compiled programs are cache hits
    app = create_app(engine, ServerSettings(incremental_streaming_output=True, max_queued_requests=2),
                     own_engine=False)
    body = {"input_ids": [5, 6, 7, 8, 9], "sampling_params": {"max_new_tokens": 20, "ignore_eos": True}}
    with TestClient(app, base_url="http://localhost") as client:  # (TestClient's own "testserver" is no local Host)
        whole = client.post("/generate", json=body).json()
        events = _sse(client.post("/generate", json={**body, "stream": True}).text)
        assert events[-1] == "[DONE]"
        parts = [e["output_ids"] for e in events[:-1]]
        assert sum(parts, []) == whole["output_ids"] and len(whole["output_ids"]) == 20
        assert len(parts) >= 2 and all(parts)  # prompt tail block, then whole blocks of 4
        r = client.post("/generate", json={"text": "hello"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "text"
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        load = client.get("/internal/load").json()
        assert load["server_capacity"] == ENGINE_KW["max_running_requests"] + 2 and load["server_inflight"] == 0
        # a body must be declared JSON: `curl -d` without -H 'Content-Type: application/json' (form-encoded) is
        # refused, as any HTML form or "simple" cross-site request would be
        form = {"Content-Type": "application/x-www-form-urlencoded"}
        r = client.post("/generate", content=json.dumps(body), headers=form)
        assert r.status_code == 415 and r.json()["error"]["param"] == "content-type"
        r = client.post("/generate", content=json.dumps(body), headers={"Content-Type": "application/json"})
        assert r.status_code == 200 and r.json()["output_ids"] == whole["output_ids"]
        assert client.get("/health", headers={"Host": "testserver"}).status_code == 421
    # the app did not own the engine: it is still usable, and every page came back
    assert engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 3})["meta_info"][
        "completion_tokens"] == 3
    engine.shutdown()
    assert engine.allocator.num_free + engine.radix.total == engine.allocator.capacity
