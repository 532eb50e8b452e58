"""``dllm-jax serve`` / ``python -m serve``: the HTTP server.

``dllm-jax serve`` comes from :func:`register` (the ``dllm_jax.commands`` entry point in pyproject.toml: ``serve``
depends on ``dllm_jax``, never the reverse): :func:`add_arguments` plus the shared engine flags
(``dllm_jax.cli.add_engine_arguments``), then :func:`main`. ``python -m serve`` builds the same parser here.
``uvicorn --factory serve:create_app`` reads the same flags from the ``DLLM_JAX_SERVE_ARGS`` environment variable.

Several processes (one engine over several hosts, see :mod:`dllm_jax.distributed`): run the same command on every
host with ``--coordinator-address``, ``--num-processes`` and ``--process-id`` (or ``$JAX_COORDINATOR_ADDRESS``,
``$JAX_NUM_PROCESSES``, ``$JAX_PROCESS_ID``). Process 0 binds HTTP and schedules; the others bind no port and
replay its device calls until it shuts down. If the group fails (a process dies or stops answering), the leader
fails its requests with the error, stops serving and exits with status 1, so that a supervisor restarts the group.

This module imports neither FastAPI nor uvicorn at import time (``dllm-jax generate`` imports it to build its
parser), but it raises ImportError when they are missing, so ``dllm-jax`` simply has no ``serve`` command then.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import shlex
import sys

for _module in ("fastapi", "uvicorn", "prometheus_client"):
    if importlib.util.find_spec(_module) is None:
        raise ImportError(f"dllm-jax serve needs the {_module!r} package (pip install 'dllm-jax')")

ENV_ARGS = "DLLM_JAX_SERVE_ARGS"
ENV_API_KEY = "DLLM_JAX_API_KEY"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default: loopback only; use 0.0.0.0 to serve other machines)")
    g.add_argument("--port", type=int, default=30000)
    g.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on every endpoint but /health "
                        f"(default: ${ENV_API_KEY} if set)")
    g.add_argument("--served-model-name", default=None, help="the model's name in OpenAI answers "
                                                             "(default: the model directory's name)")
    g.add_argument("--max-queued-requests", type=int, default=256,
                   help="requests that may wait beyond --max-running-requests; more get 503 + Retry-After")
    g.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="longer prompts get 400 (default: what fits the context length)")
    g.add_argument("--max-request-bytes", type=int, default=8 << 20, help="larger request bodies get 413")
    g.add_argument("--incremental-streaming-output", action="store_true",
                   help="/generate streams only the new text and ids of each block (default: cumulative, as SGLang)")
    g.add_argument("--log-level", choices=LOG_LEVELS, default="info")
    g.add_argument("--no-access-log", action="store_true", help="do not log every HTTP request")


def register(subparsers) -> None:
    """Add ``serve`` to the ``dllm-jax`` command (entry point ``dllm_jax.commands``)."""
    from dllm_jax.cli import add_distributed_arguments, add_engine_arguments

    s = subparsers.add_parser("serve", help="HTTP server (SGLang- and OpenAI-style endpoints)")
    add_arguments(s)
    add_engine_arguments(s)
    add_distributed_arguments(s)
    s.set_defaults(fn=main)


def settings_from_args(args: argparse.Namespace):
    from serve.settings import ServerSettings

    return ServerSettings(
        served_model_name=args.served_model_name, api_key=args.api_key or os.environ.get(ENV_API_KEY) or None,
        max_queued_requests=args.max_queued_requests, max_prompt_tokens=args.max_prompt_tokens,
        max_request_bytes=args.max_request_bytes, incremental_streaming_output=args.incremental_streaming_output,
        profile_dir=getattr(args, "profile_dir", None))


def build_parser() -> argparse.ArgumentParser:
    from dllm_jax.cli import add_distributed_arguments, add_engine_arguments

    p = argparse.ArgumentParser(prog="python -m serve", description="dllm-jax HTTP server (SGLang- and "
                                                                    "OpenAI-style endpoints)")
    add_arguments(p)
    add_engine_arguments(p)
    add_distributed_arguments(p)
    return p


def main(args: argparse.Namespace) -> int:
    """Build the engine (errors in the flags or the model fail here, before binding), then serve until stopped."""
    import uvicorn

    from dllm_jax import distributed
    from dllm_jax.cli import build_engine, configure_logging, init_distributed
    from serve.app import create_app

    configure_logging(args.log_level)
    log = logging.getLogger("dllm_jax.serve")
    settings = settings_from_args(args)
    multi_process = init_distributed(args)  # before anything else touches JAX
    if args.warmup is None:
        args.warmup = True  # a server compiles its buckets before it answers, so no request waits on a compile
    engine = build_engine(args)
    if not engine.is_leader:
        return distributed.run_follower(engine)  # no HTTP: replay the leader's device calls
    if args.host not in ("127.0.0.1", "localhost", "::1") and not settings.api_key:
        log.warning("binding %s without an API key: anyone who can reach this address can use the server", args.host)
    app = create_app(engine, settings)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=_uvicorn_level(args.log_level),
                            access_log=not args.no_access_log, timeout_graceful_shutdown=5)
    _serve(config, engine)
    if engine.failure is not None:
        log.error("stopped serving: the process group failed (restart every process)")
        distributed.hard_exit(1)  # JAX's exit handler would wait for the lost process at its shutdown barrier
    if multi_process:
        log.info("shut down; the followers stop with it")
    return 0


def _uvicorn_level(level: str) -> str:
    """uvicorn's own start/stop lines repeat what the ready line says: shown from ``--log-level debug`` only."""
    return level if level == "debug" else ("warning" if level == "info" else level)


def _serve(config, engine) -> None:
    """uvicorn's server, plus one "ready" line once the socket is bound and the app has started."""
    import uvicorn

    class ReadyServer(uvicorn.Server):
        async def on_tick(self, counter: int) -> bool:
            if engine.failure is not None:  # a multi-process group failed: stop serving (main exits 1)
                return True
            return await super().on_tick(counter)

        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            if self.started:
                host = f"[{config.host}]" if ":" in config.host else config.host
                info = engine.get_model_info()
                pages = info["num_kv_pages"] - 1  # page 0 is the trash page of padding rows
                logging.getLogger("dllm_jax.serve").info(
                    "ready on http://%s:%d (%s, block %d, %s; %d KV pages = %d tokens)", host, config.port,
                    os.path.basename(info["model_path"]), info["block_size"], info["algorithm"], pages,
                    pages * info["block_size"])

    try:
        ReadyServer(config).run()
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled, after a clean shutdown
        pass


def run(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return main(args) or 0
    except ValueError as err:
        print(f"dllm-jax serve: error: {err}", file=sys.stderr)
        return 2


def engine_and_settings_from_env():
    """(engine factory, settings) from ``$DLLM_JAX_SERVE_ARGS`` (for ``uvicorn --factory serve:create_app``)."""
    from dllm_jax.cli import build_engine

    args = build_parser().parse_args(shlex.split(os.environ.get(ENV_ARGS, "")))
    return (lambda: build_engine(args)), settings_from_args(args)
