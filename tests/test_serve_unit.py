"""``dllm-jax serve`` / ``python -m serve`` argument handling and the app factory, without starting a server."""

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
