"""`dllm-jax serve` / `python -m serve` argument handling, and the app in-process (starlette TestClient) on the tiny
random model: no uvicorn process here (tests/test_serve.py has those)."""

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
    with TestClient(app) as client:
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
        # `curl -d` sends JSON as application/x-www-form-urlencoded: read as JSON all the same (as SGLang)
        form = {"Content-Type": "application/x-www-form-urlencoded"}
        r = client.post("/generate", content=json.dumps(body), headers=form)
        assert r.status_code == 200 and r.json()["output_ids"] == whole["output_ids"]
        r = client.post("/generate", content=b"text=hello", headers=form)
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("body: malformed JSON")
    # the app did not own the engine: it is still usable, and every page came back
    assert engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 3})["meta_info"][
        "completion_tokens"] == 3
    engine.shutdown()
    assert engine.allocator.num_free + engine.radix.total == engine.allocator.capacity
