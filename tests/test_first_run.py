"""What a new user sees: backends that cannot run here are refused at once by the CLI and the server (exit 2, one
line naming the field; the Engine's ValueError is tests/test_engine.py's), the server starts with lines of ours
and nothing else, and ``--version`` answers. (CI's .ci/run runs the README's demo in a venv without extras and
checks its output too.)"""

from __future__ import annotations

import os

import pytest

from dllm_jax.assets import DEFAULT_MODEL_PATH

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHOICES = "auto, xla, pallas_interpret"


def _env() -> dict:
    return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="", PYTHONPATH=REPO, TOKENIZERS_PARALLELISM="false")


@pytest.mark.parametrize("command, flag", [("generate", "--attention-backend"), ("serve", "--confidence-backend")])
def test_cli_and_server_refuse_pallas_in_one_line(capsys, command, flag):
    from dllm_jax import cli

    extra = ["Count up 11 steps from 71."] if command == "generate" else ["--port", "1"]
    assert cli.main([command, flag, "pallas", *extra]) == 2  # the console script exits with main's value
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    field = flag[2:].replace("-", "_")
    assert len(lines) == 1 and lines[0].startswith(f"dllm-jax {command}: error: {field}: 'pallas' needs a GPU"), lines
    assert lines[0].endswith(CHOICES) and not out.out


def test_version(capsys):
    from dllm_jax import __version__, cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.strip() == f"dllm-jax {__version__}"


def test_server_start_says_only_what_we_say():
    """At the default log level: our loading line, the KV pool, and the ready line with the address; nothing from
    JAX, uvicorn or transformers (no 'Unable to initialize backend', no 'PyTorch was not found')."""
    from serve.launch import ServerProcess

    buckets = '{"rows": [8], "pages": [8], "prefill_rows": [1], "prefill_blocks": [2]}'
    with ServerProcess(["--model-path", DEFAULT_MODEL_PATH, "--max-running-requests", "4", "--context-length",
                        "256", "--num-kv-pages", "40", "--shape-buckets", buckets, "--no-warmup"],
                       env=_env(), cwd=REPO) as server:
        port = server.port
    out = server.output()
    lines = [line for line in out.splitlines() if line.strip()]
    assert lines[0].startswith(f"dllm-jax: loading {DEFAULT_MODEL_PATH} on cpu"), out
    ready = f"dllm-jax: ready on http://127.0.0.1:{port} (sdar-tiny, block 32"
    assert sum(line.startswith(ready) for line in lines) == 1, out
    assert all(line.startswith("dllm-jax: ") for line in lines), out
