"""The flags of ``dllm-jax serve`` / ``python -m serve`` and what they build: the server settings, the warm-up
variants, and (``uvicorn --factory serve:create_app``) the engine and settings described by
``$DLLM_JAX_SERVE_ARGS``. Below both :mod:`serve.app` (which reads the environment variable) and :mod:`serve.cli`
(the command, which runs the app). Imports neither FastAPI nor uvicorn."""

from __future__ import annotations

import argparse
import os
import shlex

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
    g.add_argument("--served-model-name", default=None, metavar="NAME[,ALIAS...]",
                   help="the model's name in OpenAI answers, then aliases a request's 'model' may also use (another "
                        "model is 404 model_not_found; default: the model directory's name)")
    g.add_argument("--allowed-hosts", default=None, metavar="HOST[,HOST...]",
                   help="host names a client may use beyond localhost and IP addresses ('name' any port, "
                        "'name:port', '*' any); other Host headers get 421 (DNS rebinding). Default: none, or any "
                        "Host when bound to 0.0.0.0 / :: with an API key")
    g.add_argument("--body-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="a request body must arrive within this; else 408 and the connection is closed (default 30)")
    g.add_argument("--max-queued-requests", type=int, default=256,
                   help="requests that may wait beyond --max-running-requests; more get 503 + Retry-After")
    g.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="longer prompts get 400 (default: what fits the context length)")
    g.add_argument("--max-request-bytes", type=int, default=8 << 20, help="larger request bodies get 413")
    g.add_argument("--incremental-streaming-output", action="store_true",
                   help="/generate streams only the new text and ids of each block (default: cumulative, as SGLang)")
    g.add_argument("--log-level", choices=LOG_LEVELS, default="info")
    g.add_argument("--no-access-log", action="store_true", help="do not log every HTTP request")
    g.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM / SIGINT, new requests get 503 at once and running ones may finish for this long; "
                        "then every open stream ends with an error event and every waiting request with a 503 "
                        "(default 30; 0: at once; a second signal: at once)")
    g.add_argument("--warmup-all", action="store_true",
                   help="compile every shape bucket before /health reports ok (default: the buckets a short chat "
                        "needs, then ready, the rest on a background thread; a request whose bucket is not compiled "
                        "yet runs in a larger compiled one or waits for its own)")
    g.add_argument("--warmup-variants", default=None, metavar="LIST",
                   help="also compile these step variants while starting, so that no first such request waits on "
                        "a compile: a comma list of sampling, logprobs, penalties, grammar, or all (default: none)")
    add_dp_arguments(p)


ROUTER_POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")


def add_dp_arguments(p: argparse.ArgumentParser) -> None:
    """``--dp N``: N replicas behind SGLang's router (:mod:`serve.dp`)."""
    g = p.add_argument_group("data parallel (replicas behind SGLang's router, `pip install 'dllm-jax[router]'`)")
    g.add_argument("--dp", type=int, default=None, metavar="N",
                   help="start N worker processes (each on its own GPUs, split by CUDA_VISIBLE_DEVICES, or its own "
                        "CPU cores) on ports --worker-port-start.., and SGLang's router in front on --router-port")
    g.add_argument("--router-policy", choices=ROUTER_POLICIES, default="cache_aware",
                   help="the router's policy (default cache_aware: a prompt goes to the worker holding its prefix)")
    g.add_argument("--router-port", type=int, default=None, help="the router's port (default: --port)")
    g.add_argument("--worker-port-start", type=int, default=None, metavar="PORT",
                   help="worker i listens on 127.0.0.1:PORT+i (default: the router's port + 1)")
    g.add_argument("--router-args", default="", metavar="'FLAGS'",
                   help="more flags for sglang-router, as one string (e.g. '--health-check-interval-secs 1'); they "
                        "come last, so they override the launcher's defaults")
    g.add_argument("--worker-restarts", type=int, default=3, metavar="N",
                   help="restart a worker that exits on its own up to N times (the router takes it back once "
                        "healthy; default 3)")
    g.add_argument("--worker-restart-delay", type=float, default=1.0, metavar="SECONDS",
                   help="wait this long before restarting a worker that exited (default 1)")
    g.add_argument("--worker-cpus", choices=("split", "shared"), default="split",
                   help="on CPU: give each worker its own share of this process's cores (split, default) or let "
                        "them all use every core (shared)")


def settings_from_args(args: argparse.Namespace):
    from serve.settings import ServerSettings

    return ServerSettings(
        served_model_name=args.served_model_name, api_key=args.api_key or os.environ.get(ENV_API_KEY) or None,
        max_queued_requests=args.max_queued_requests, max_prompt_tokens=args.max_prompt_tokens,
        max_request_bytes=args.max_request_bytes, incremental_streaming_output=args.incremental_streaming_output,
        profile_dir=getattr(args, "profile_dir", None), host=args.host, allowed_hosts=args.allowed_hosts,
        body_timeout_s=args.body_timeout)


def build_parser() -> argparse.ArgumentParser:
    from dllm_jax.cli import add_distributed_arguments, add_engine_arguments

    p = argparse.ArgumentParser(prog="python -m serve", description="dllm-jax HTTP server (SGLang- and "
                                                                    "OpenAI-style endpoints)")
    add_arguments(p)
    add_engine_arguments(p)
    add_distributed_arguments(p)
    return p


WARMUP_VARIANTS = ("sampling", "logprobs", "penalties", "grammar")


def warmup_variants(value: str | None) -> dict:
    """``--warmup-variants``: the keyword arguments of ``Engine.warmup``."""
    names = [v.strip() for v in (value or "").split(",") if v.strip()]
    if names == ["all"]:
        names = list(WARMUP_VARIANTS)
    for name in names:
        if name not in WARMUP_VARIANTS:
            raise ValueError(f"warmup_variants: unknown variant {name!r} (sampling, logprobs, penalties, grammar "
                             f"or all)")
    return {name: True for name in names}


def engine_and_settings_from_env():
    """(engine factory, settings) from ``$DLLM_JAX_SERVE_ARGS`` (for ``uvicorn --factory serve:create_app``)."""
    from dllm_jax.cli import build_engine

    args = build_parser().parse_args(shlex.split(os.environ.get(ENV_ARGS, "")))
    return (lambda: build_engine(args)), settings_from_args(args)
