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
        r = client.post("/generate", json={**body, "image_data": "data:image/png;base64,AAAA"})  # no vision tower
        assert r.status_code == 400 and r.json()["error"]["param"] == "image_data"
        assert "reads text only" in r.json()["error"]["message"]
        with pytest.raises(ValueError, match="image_data: this model reads text only"):  # and from Python
            engine.make_request([5, 6, 7], image_data=b"\x89PNG")
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


# ----------------------------------------------------------------------------------------------
# Issue 49: bodies parsed off the event loop within limits; origins; error fields; malformed tensors; the schema
# ----------------------------------------------------------------------------------------------
def _refused(body: bytes):
    from fastapi.exceptions import RequestValidationError

    from serve.body import parse_json
    from serve.errors import ApiError, error_from_validation

    try:
        parse_json(body)
    except ApiError as e:
        return e
    except RequestValidationError as e:
        return error_from_validation(e)
    return None


def test_body_limits_name_the_limit():
    """Keys (in all, and per object), items per array, values in all and nesting are bounded while the body is
    parsed: a 413 (400 for nesting) naming the object or array and the limit, before any model validation."""
    import json

    from serve import body as b

    ok = {"text": [f"prompt {i}" for i in range(10_000)], "sampling_params": {"logit_bias": {str(i): 1 for i in
                                                                                           range(300)}},
          "input_ids": [[5] * 4096] * 64, "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]}
    assert b.parse_json(json.dumps(ok).encode()) == ok
    cases = [
        ({"text": "hi", "sampling_params": {str(i): 1 for i in range(b.MAX_OBJECT_KEYS + 1)}}, 413,
         "sampling_params", "keys in one object"),
        ({"text": "hi", "messages": [{"x": [1] * (b.MAX_ARRAY_ITEMS + 1)}]}, 413, "messages[0].x",
         "items in one array"),
        ({"a": [{str(j): 0 for j in range(1000)} for _ in range(101)]}, 413, "body", "keys in a request body"),
        ({f"{i:x}": 1 for i in range(700_000)}, 413, "body", "700,000 keys in all"),  # counted before it is parsed
        ({"a": [[[1] * 1000] * 1000] * 5}, 413, "body", "values in a request body"),
    ]
    for body, status, param, words in cases:
        e = _refused(json.dumps(body).encode())
        assert e is not None and (e.status, e.param) == (status, param), (param, e and (e.status, e.param, e.message))
        assert words in e.message and e.message.startswith(param + ":"), e.message
        assert e.code == "body_too_complex"
    for depth in (b.MAX_DEPTH + 1, 100_000):  # (the second beyond the parser's own recursion limit)
        e = _refused(b"[" * depth + b"]" * depth)
        assert (e.status, e.param) == (400, "body") and f"deeper than {b.MAX_DEPTH}" in e.message
    assert b.parse_json(b"[" * b.MAX_DEPTH + b"]" * b.MAX_DEPTH) is not None
    # a prompt full of colons is not taken for keys (they are counted only outside strings)
    assert b.parse_json(json.dumps({"text": ":" * 200_000}).encode())["text"] == ":" * 200_000
    e = _refused(b'{"text": }')
    assert (e.status, e.param) == (400, "body") and e.message.startswith("body: malformed JSON at position 9")
    e = _refused(b"\xff\xfe\xfd")
    assert (e.status, e.param) == (400, "body")


def test_state_changing_endpoints_are_own_origin_only():
    """Every POST endpoint but generation and the read-only ones is state-changing (so none is forgotten); those
    take only this server's own origin (the request's Host) or no Origin, whatever the settings."""
    from serve.limits import STATE_CHANGING, same_origin
    from serve.routes import admin, openai, rl, sglang

    posts = {r.path for m in (admin, openai, rl, sglang) for r in m.router.routes if "POST" in r.methods}
    assert posts - STATE_CHANGING == {"/generate", "/v1/completions", "/v1/chat/completions", "/score",
                                      "/get_weights_by_name"}
    assert STATE_CHANGING <= posts
    for origin, host in (("http://127.0.0.1:30000", "127.0.0.1:30000"), ("http://localhost", "localhost:80"),
                         ("https://gpu.example", "gpu.example:443"), ("http://[::1]:8", "[::1]:8"),
                         ("HTTP://GPU.example:9", "gpu.example:9")):
        assert same_origin(origin, host), (origin, host)
    for origin, host in (("http://localhost:9999", "localhost:30000"), ("http://127.0.0.1:30000", "localhost:30000"),
                         ("null", "localhost:30000"), ("https://gpu.example", "gpu.example:80"),
                         ("http://user@localhost:30000", "localhost:30000"), ("file://", "localhost"),
                         ("http://localhost:30000/x", "localhost:30000"), ("http://localhost:30000", None)):
        assert not same_origin(origin, host), (origin, host)


def test_error_codes_are_strings_or_null_and_params_the_clients_fields():
    from serve import features
    from serve.errors import ApiError, bad_request, error_body, qualify
    from serve.schemas import CHAT_FIELD_NAMES, OPENAI_FIELD_NAMES

    assert error_body(400, "x: bad", "x")["error"]["code"] is None
    assert ApiError(401, "authorization: no").code == "invalid_api_key"
    assert ApiError(503, "busy").response().body.count(b'"code":null') == 1
    for status in (400, 403, 404, 405, 408, 413, 415, 421, 500, 503):
        code = ApiError(status, "x: y").code
        assert code is None or isinstance(code, str), (status, code)
    # a model's own refusal names the bare engine parameter: put under sampling_params, then renamed
    names = features.engine_sampling_fields()
    msg = qualify("top_logprobs_num: not supported with Gemma4Renoise", "sampling_params", names)
    assert bad_request(msg, CHAT_FIELD_NAMES).param == "top_logprobs"
    assert bad_request(msg, OPENAI_FIELD_NAMES).param == "logprobs"
    msg = qualify("min_new_tokens: not supported", "sampling_params[1]", names)
    assert bad_request(msg).param == "sampling_params[1].min_new_tokens"
    assert qualify("rid: taken", "sampling_params", names) == "rid: taken"  # not a sampling parameter
    assert bad_request("prompt[1]: empty", {"prompt": "text"}).param == "text[1]"


def test_malformed_safetensors_blobs_are_value_errors():
    """Every malformed blob is a ValueError naming the field (the route's 400), never an OverflowError or a
    wrapped-around size; none quotes the blob's first bytes."""
    from serve_fuzz import bad_tensor_blobs

    from dllm_jax.model.weight_update import decode_tensors

    for what, blob in bad_tensor_blobs():
        with pytest.raises(ValueError) as e:
            decode_tensors(blob, "serialized_named_tensors")
        message = str(e.value)
        assert message.startswith("serialized_named_tensors: "), (what, message)
        assert "SECRET" not in message and str(int.from_bytes(b"SECRET!!", "little")) not in message, (what, message)


def test_safetensors_file_errors_quote_nothing_of_the_file(tmp_path):
    """A checkpoint file that is another file (a link to it): the error names the file and the problem, never its
    first bytes read as a header length, nor its header's keys."""
    import json

    from dllm_jax.model.errors import CheckpointError
    from dllm_jax.model.safetensors_io import SafetensorsFile

    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"SECRET!!" + b"x" * 100)
    header = json.dumps({"password-hunter2": {"dtype": "F32", "shape": [1], "data_offsets": [0, 8]}}).encode()
    keys = tmp_path / "keys.safetensors"
    keys.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 4)
    for path, words in ((secret, "not a safetensors file"), (keys, "header entry 0: data_offsets")):
        link = tmp_path / f"model-{path.stem}.safetensors"
        link.symlink_to(path)
        with pytest.raises(CheckpointError) as e:
            SafetensorsFile(str(link))
        message = str(e.value)
        assert words in message and "SECRET" not in message and "hunter2" not in message, message
        assert str(int.from_bytes(b"SECRET!!", "little")) not in message, message


def test_openapi_document_is_the_servers(tmp_path):
    """400 (not FastAPI's 422) with this server's error body, the gate's statuses, text/plain for /metrics, event
    streams, unique operation ids; the bearer scheme only with a key. Built without an engine."""
    from serve import ServerSettings, create_app

    never = lambda: (_ for _ in ()).throw(AssertionError("not started"))  # noqa: E731
    doc = create_app(engine_factory=never, settings=ServerSettings()).openapi()
    text = json_dumps(doc)
    assert "422" not in text and "HTTPValidationError" not in text
    ids = [op["operationId"] for ops in doc["paths"].values() for op in ops.values()]
    assert len(ids) == len(set(ids)), ids
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            assert {"400", "403", "413", "421", "500", "503"} <= set(op["responses"]), (path, method)
            assert ("415" in op["responses"]) == (method == "post"), (path, method)
            assert "security" not in op
    assert doc["components"]["schemas"]["Error"]["properties"]["error"]["properties"]["code"]["type"] == \
        ["string", "null"]
    assert list(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
        assert "text/event-stream" in doc["paths"][path]["post"]["responses"]["200"]["content"]
    assert {"get_flush_cache", "post_flush_cache", "get_v1_models_model_id"} <= set(ids)
    keyed = create_app(engine_factory=never, settings=ServerSettings(api_key="k")).openapi()
    assert keyed["paths"]["/generate"]["post"]["security"] == [{"bearer": []}]
    assert keyed["paths"]["/health"]["get"]["security"] == []
    assert "401" in keyed["paths"]["/generate"]["post"]["responses"]


def json_dumps(obj) -> str:
    import json

    return json.dumps(obj)
