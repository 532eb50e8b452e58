"""``dllm-jax serve`` / ``python -m serve``: the HTTP server.

``dllm-jax serve`` comes from :func:`register` (the ``dllm_jax.commands`` entry point in pyproject.toml: ``serve``
depends on ``dllm_jax``, never the reverse): :func:`serve.args.add_arguments` plus the shared engine flags
(``dllm_jax.cli.add_engine_arguments``), then :func:`main`. ``python -m serve`` builds the same parser
(:func:`serve.args.build_parser`). ``uvicorn --factory serve:create_app`` reads the same flags from the
``DLLM_JAX_SERVE_ARGS`` environment variable (:func:`serve.args.engine_and_settings_from_env`).

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
import contextlib
import importlib.util
import logging
import os
import signal
import sys
import threading

from serve.args import (ENV_API_KEY, ENV_ARGS, LOG_LEVELS, WARMUP_VARIANTS, add_arguments,  # noqa: F401 (re-exported)
                        build_parser, engine_and_settings_from_env, settings_from_args, warmup_variants)

for _module in ("fastapi", "uvicorn", "prometheus_client"):
    if importlib.util.find_spec(_module) is None:
        raise ImportError(f"dllm-jax serve needs the {_module!r} package (pip install 'dllm-jax')")


def register(subparsers) -> None:
    """Add ``serve`` to the ``dllm-jax`` command (entry point ``dllm_jax.commands``)."""
    from dllm_jax.cli import add_distributed_arguments, add_engine_arguments

    s = subparsers.add_parser("serve", help="HTTP server (SGLang- and OpenAI-style endpoints)")
    add_arguments(s)
    add_engine_arguments(s)
    add_distributed_arguments(s)
    s.set_defaults(fn=main)


def main(args: argparse.Namespace) -> int:
    """Build the engine (errors in the flags or the model fail here, before binding), bind, warm the engine up
    while ``/health`` answers 503 ``starting``, then serve until SIGTERM / SIGINT (a graceful shutdown, exit 0).

    Several processes: the leader compiles before it binds, in step with the followers (they replay its warm-up
    calls, and must not wait on a leader that serves nothing yet)."""
    if getattr(args, "dp", None) is not None:  # replicas behind SGLang's router: this process only launches them
        from serve.dp import main as launch_replicas

        return launch_replicas(args)
    import uvicorn

    from dllm_jax import distributed
    from dllm_jax.cli import build_engine, configure_logging, init_distributed
    from serve.app import create_app

    configure_logging(args.log_level)
    log = logging.getLogger("dllm_jax.serve")
    settings = settings_from_args(args)
    variants = warmup_variants(args.warmup_variants)
    if args.shutdown_timeout < 0:
        raise ValueError(f"shutdown_timeout: must be >= 0, got {args.shutdown_timeout:g}")
    # a server compiles its buckets before it admits requests, so no request waits on a compile
    warm = args.warmup is not False or bool(variants)
    multi_process = init_distributed(args)  # before anything else touches JAX
    args.warmup = False
    try:
        with _stop_quietly_while_loading():
            engine = build_engine(args)
            if engine.is_leader and multi_process and warm:
                engine.warmup(**variants)
    except KeyboardInterrupt:
        log.info("interrupted while loading")
        return 0
    if _stopped_by is not None:  # a signal whose KeyboardInterrupt was swallowed (e.g. by a gc callback)
        log.info("interrupted while loading")
        return 0
    if not engine.is_leader:
        return distributed.run_follower(engine)  # no HTTP: replay the leader's device calls
    if args.host not in ("127.0.0.1", "localhost", "::1") and not settings.api_key:
        log.warning("binding %s without an API key: anyone who can reach this address can use the server", args.host)
    if multi_process:
        app = create_app(engine, settings)
    else:
        def warm_up():
            if warm:  # staged: ready once a short chat's buckets are compiled, the rest in the background
                engine.warmup(**variants, background=not args.warmup_all)
            return engine

        app = create_app(settings=settings, engine_factory=warm_up)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=_uvicorn_level(args.log_level),
                            access_log=not args.no_access_log, timeout_graceful_shutdown=FINAL_WRITE_S)
    _serve(config, app, engine, args.shutdown_timeout)
    if engine.failure is not None:
        log.error("stopped serving: the process group failed (restart every process)")
        distributed.hard_exit(1)  # JAX's exit handler would wait for the lost process at its shutdown barrier
    if app.state.startup_error is not None:
        return 1
    if app.state.abandoned_start:  # the warm-up thread still compiles: exit without waiting for it
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    if multi_process:
        log.info("shut down; the followers stop with it")
    return 0


FINAL_WRITE_S = 5  # after the drain: how long uvicorn waits for responses still being written


def _uvicorn_level(level: str) -> str:
    """uvicorn's own start/stop lines repeat what the ready line says: shown from ``--log-level debug`` only."""
    return level if level == "debug" else ("warning" if level == "info" else level)


def _serve(config, app, engine, shutdown_timeout: float) -> None:
    """uvicorn's server, plus one "ready" line once the engine is warm, and our own signal handling: the first
    SIGTERM / SIGINT drains (:func:`serve.app.drain`) before uvicorn closes the connections, a second one ends the
    running requests at once, a third one leaves without waiting for responses. A signal is not re-raised after
    the shutdown (uvicorn's default), so the process exits 0."""
    import asyncio

    import uvicorn

    from serve.app import drain

    log = logging.getLogger("dllm_jax.serve")

    class Server(uvicorn.Server):
        stop_signal: str | None = None
        hurry = False
        announced = False
        drainer = None

        def handle_exit(self, sig, frame) -> None:  # a signal handler: flags only, read by on_tick
            if self.stop_signal is None:
                self.stop_signal = signal.Signals(sig).name
            elif not self.should_exit:
                self.hurry = True
            else:
                self.force_exit = True

        async def on_tick(self, counter: int) -> bool:
            if engine.failure is not None:  # a multi-process group failed: stop serving (main exits 1)
                return True
            if app.state.startup_error is not None:  # the warm-up failed (logged)
                return True
            server = app.state.server
            if not self.announced and server is not None and server.ready:
                self.announced = True
                self.announce()
            if self.stop_signal is not None and self.drainer is None:
                log.info("%s: shutting down (new requests get 503)", self.stop_signal)
                self.drainer = asyncio.ensure_future(drain(app, shutdown_timeout, lambda: self.hurry))
                self.drainer.add_done_callback(self.drained)
            return await super().on_tick(counter)

        def drained(self, task) -> None:
            if not task.cancelled() and task.exception() is not None:
                log.error("shutdown: draining failed", exc_info=task.exception())
            self.should_exit = True

        def announce(self) -> None:
            host = f"[{config.host}]" if ":" in config.host else config.host
            info = engine.get_model_info()
            pages = info["num_kv_pages"] - 1  # page 0 is the trash page of padding rows
            log.info("ready on http://%s:%d (%s, block %d, %s; %d KV pages = %d tokens)", host, config.port,
                     os.path.basename(info["model_path"]), info["block_size"], info["algorithm"], pages,
                     pages * info["block_size"])

    Server(config).run()


_stopped_by: int | None = None  # the SIGTERM / SIGINT that arrived before the server ran


@contextlib.contextmanager
def _stop_quietly_while_loading():
    """SIGTERM and SIGINT before the server runs (JAX importing, the model loading): a KeyboardInterrupt, which
    ends the process quietly with status 0 (:func:`run`, :func:`main`), as a signal while serving does. The
    signal is also recorded, since Python drops an exception raised inside a gc callback or ``__del__``."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(sig, frame):
        global _stopped_by
        _stopped_by = sig
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run(argv: list[str] | None = None) -> int:
    """``python -m serve``."""
    try:
        with _stop_quietly_while_loading():  # main() serves with its own signal handling meanwhile
            return main(build_parser().parse_args(argv)) or 0
    except ValueError as err:
        print(f"dllm-jax serve: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # stopped while loading (or after serving, while the engine shut down)
        return 0
